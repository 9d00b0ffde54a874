"""The write stream: pairs, windows and gates for a whole sequence at once.

Used by the parallel and chunk forms.  The recurrent form computes the same
quantities one step at a time from its carried state (``recurrent.step``),
through the same ``Rule.gates``.

Layout is head-major: ``[B, H, T, ...]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from falcon_jax.rules import Rule
from falcon_jax.state import FalconState


@dataclasses.dataclass
class WriteStream:
    """``x_ext``/``y_ext`` are the pairs with the ``W-1`` tail pairs of the
    initial state in front (index ``t + W - 1`` is position ``t``).

    x_ext  [B, H, W-1+T, dk]    y_ext  [B, H, W-1+T, dv]
    w      [B, H, T, W, G]      log_gamma [B, H, T, G]
    run    [B, T] int           number of segment starts up to and including t
    valid_ext [B, W-1+T] bool   the pair is real (not a sentinel / empty tail slot)

    With ``time_axis=1`` (the model's ``[B, T, H, ...]`` layout) the token arrays have time and
    heads swapped: x_ext ``[B, W-1+T, H, dk]``, w ``[B, T, H, W, G]``, log_gamma ``[B, T, H, G]``.
    """

    x_ext: jax.Array
    y_ext: jax.Array
    w: jax.Array | None  # None from write_pairs (no gates)
    log_gamma: jax.Array | None
    run: jax.Array
    valid_ext: jax.Array


def segment_starts(segment_ids, B: int, T: int) -> jax.Array:
    """``[B, T]`` bool: position t > 0 starts a new segment (the state resets before it)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((B, 1), bool), change], axis=1)


def segment_runs(segment_ids) -> jax.Array:
    """``[B, T]`` int32: the number of segment starts before or at each position (0 up to the first change of
    id in every row).  Two positions share a count exactly when no change of id lies between them: ids that come
    back after a change (``[0, 1, 0]``) are a new segment, as for the rules, which reset at every change.
    Softmax attention's masks compare these (the short convolutions compare adjacent ids over each tap)."""
    B, T = segment_ids.shape
    return jnp.cumsum(segment_starts(segment_ids, B, T), axis=1, dtype=jnp.int32)


def per_position(a, time_axis: int = 2):
    """A ``[B, T, ...]`` array shaped to broadcast against token arrays: ``[B, 1, T, ...]`` for
    ``[B, H, T, ...]`` (``time_axis=2``), ``[B, T, 1, ...]`` for ``[B, T, H, ...]`` (``time_axis=1``)."""
    return a[:, :, None] if time_axis == 1 else a[:, None]


def write_pairs(rule: Rule, k, v, resets, state: FalconState, time_axis: int = 2) -> WriteStream:
    """The write pairs of a sequence, without their gates (``w`` and ``log_gamma`` are None): what
    :func:`final_state` reads.  Arguments as :func:`write_stream`'s."""
    B, T = k.shape[0], k.shape[time_axis]
    W = rule.window
    if rule.alignment == "shifted":
        last_key = state.last_key[:, None] if time_axis == 1 else state.last_key[:, :, None]
        x = jnp.concatenate([last_key, jax.lax.slice_in_dim(k, 0, T - 1, axis=time_axis)], axis=time_axis)
        first = jnp.zeros((B, T), bool).at[:, 0].set(True)
        valid = ~resets & (~first | state.has_key[:, None])
    else:
        x = k
        valid = jnp.ones((B, T), bool)
    x = jnp.where(per_position(valid, time_axis)[..., None], x, 0.0)
    # The barrier keeps XLA from constant-folding this cumsum when there are no segment ids (all-false
    # resets): folding a reduce-window over T = 131072 took seconds of compile time on the H200.
    run = jnp.cumsum(jax.lax.optimization_barrier(resets).astype(jnp.int32), axis=1)

    tail_x, tail_y = ((jnp.swapaxes(a, 1, 2) if time_axis == 1 else a) for a in (state.tail_x, state.tail_y))
    x_ext = jnp.concatenate([tail_x, x], axis=time_axis)
    y_ext = jnp.concatenate([tail_y, v], axis=time_axis)
    valid_ext = jnp.concatenate([state.tail_valid, valid], axis=1)
    return WriteStream(x_ext=x_ext, y_ext=y_ext, w=None, log_gamma=None, run=run, valid_ext=valid_ext)


def window_grams(x_ext, W: int, T: int, time_axis: int = 2) -> jax.Array:
    """The Gram of every position's window from the ext pairs ``x_ext`` ``[B, H, W-1+T, dk]``: ``[B, H, T, W, W]``
    with ``gram[t, i, j] = x_ext[t+i] · x_ext[t+j]``, in at least fp32 (``time_axis=1``: ``[B, W-1+T, H, dk]`` →
    ``[B, T, H, W, W]``).

    The windows overlap, so the Gram's entries are the W lagged products ``x_s · x_{s+m}`` (m < W) of the
    sequence, read at ``s = t + min(i, j)``, ``m = |i − j|``: W reductions over dk per position and no stacked copy
    of the windows' keys (``[B, T, H, W, dk]``); the gradient is W shifted scalings of the keys.  A product and a
    sum, not a dot, as :func:`falcon_jax.rules.window_gram` (exact fp32 on every backend)."""
    x = x_ext.astype(jnp.promote_types(x_ext.dtype, jnp.float32))
    length = x.shape[time_axis]
    lagged = [jnp.sum(jax.lax.slice_in_dim(x, 0, length - m, axis=time_axis)
                      * jax.lax.slice_in_dim(x, m, length, axis=time_axis), axis=-1) for m in range(W)]

    def entry(i, j):
        first = min(i, j)
        return jax.lax.slice_in_dim(lagged[abs(i - j)], first, first + T, axis=time_axis)

    return jnp.stack([jnp.stack([entry(i, j) for j in range(W)], axis=-1) for i in range(W)], axis=-2)


def write_stream(rule: Rule, k, v, inputs: dict, resets, state: FalconState, time_axis: int = 2) -> WriteStream:
    """k [B,H,T,dk], v [B,H,T,dv], inputs {name: [B,H,T] or [B,H,T,dv]}, resets [B,T].

    ``time_axis=1``: k, v, inputs in ``[B, T, H, ...]`` instead (the state keeps its own layout)."""
    B, T = k.shape[0], k.shape[time_axis]
    W = rule.window
    pairs = write_pairs(rule, k, v, resets, state, time_axis)
    x_ext, valid_ext, run = pairs.x_ext, pairs.valid_ext, pairs.run
    valid = valid_ext[:, W - 1:]
    run_ext = jnp.concatenate([jnp.zeros((B, W - 1), run.dtype), run], axis=1)
    # window entry i of position t is ext index t + i (oldest first, current last)
    gram = window_grams(x_ext, W, T, time_axis)
    in_win = jnp.stack([valid_ext[:, i:i + T] & (run_ext[:, i:i + T] == run) for i in range(W)], axis=2)
    w, log_gamma = rule.gates(gram, per_position(in_win, time_axis), per_position(valid, time_axis), inputs)
    return dataclasses.replace(pairs, w=w, log_gamma=log_gamma)


def final_state(stream: WriteStream, S_final, k, rule: Rule, time_axis: int = 2) -> FalconState:
    """The state after the last position: ``S``, the last key, and the window tail (always in the
    state's ``[B, H, ...]`` layout)."""
    tail = rule.window - 1
    total = stream.x_ext.shape[time_axis]
    run_last = stream.run[:, -1:]
    # tail slots come from the last W-1 ext entries; they stay valid only inside the last segment
    ext_run = jnp.concatenate([jnp.zeros((run_last.shape[0], tail), stream.run.dtype), stream.run], axis=1)
    keep = stream.valid_ext[:, total - tail:] & (ext_run[:, total - tail:] == run_last)

    def tail_of(a):
        a = jax.lax.slice_in_dim(a, total - tail, total, axis=time_axis)
        return jnp.swapaxes(a, 1, 2) if time_axis == 1 else a

    return FalconState(
        S=S_final,
        last_key=jax.lax.index_in_dim(k, k.shape[time_axis] - 1, axis=time_axis, keepdims=False),
        has_key=jnp.ones((k.shape[0],), bool),
        tail_x=tail_of(stream.x_ext),
        tail_y=tail_of(stream.y_ext),
        tail_valid=keep,
    )
