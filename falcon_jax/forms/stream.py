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
    """

    x_ext: jax.Array
    y_ext: jax.Array
    w: jax.Array
    log_gamma: jax.Array
    run: jax.Array
    valid_ext: jax.Array


def segment_starts(segment_ids, B: int, T: int) -> jax.Array:
    """``[B, T]`` bool: position t > 0 starts a new segment (the state resets before it)."""
    if segment_ids is None:
        return jnp.zeros((B, T), bool)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((B, 1), bool), change], axis=1)


def write_stream(rule: Rule, k, v, inputs: dict, resets, state: FalconState) -> WriteStream:
    """k [B,H,T,dk], v [B,H,T,dv], inputs {name: [B,H,T] or [B,H,T,dv]}, resets [B,T]."""
    B, H, T, _ = k.shape
    W = rule.window
    if rule.alignment == "shifted":
        x = jnp.concatenate([state.last_key[:, :, None, :], k[:, :, :-1, :]], axis=2)
        first = jnp.zeros((B, T), bool).at[:, 0].set(True)
        valid = ~resets & (~first | state.has_key[:, None])
    else:
        x = k
        valid = jnp.ones((B, T), bool)
    x = jnp.where(valid[:, None, :, None], x, 0.0)
    # The barrier keeps XLA from constant-folding this cumsum when there are no segment ids (all-false
    # resets): folding a reduce-window over T = 131072 took seconds of compile time on the H200.
    run = jnp.cumsum(jax.lax.optimization_barrier(resets).astype(jnp.int32), axis=1)

    x_ext = jnp.concatenate([state.tail_x, x], axis=2)
    y_ext = jnp.concatenate([state.tail_y, v], axis=2)
    valid_ext = jnp.concatenate([state.tail_valid, valid], axis=1)
    run_ext = jnp.concatenate([jnp.zeros((B, W - 1), run.dtype), run], axis=1)
    # window entry i of position t is ext index t + i (oldest first, current last)
    x_win = jnp.stack([x_ext[:, :, i:i + T] for i in range(W)], axis=3)  # [B,H,T,W,dk]
    in_win = jnp.stack([valid_ext[:, i:i + T] & (run_ext[:, i:i + T] == run) for i in range(W)], axis=2)
    w, log_gamma = rule.gates(x_win, in_win[:, None], valid[:, None], inputs)
    return WriteStream(x_ext=x_ext, y_ext=y_ext, w=w, log_gamma=log_gamma, run=run, valid_ext=valid_ext)


def final_state(stream: WriteStream, S_final, k, rule: Rule) -> FalconState:
    """The state after the last position: ``S``, the last key, and the window tail."""
    tail = rule.window - 1
    total = stream.x_ext.shape[2]
    run_last = stream.run[:, -1:]
    # tail slots come from the last W-1 ext entries; they stay valid only inside the last segment
    ext_run = jnp.concatenate([jnp.zeros((run_last.shape[0], tail), stream.run.dtype), stream.run], axis=1)
    keep = stream.valid_ext[:, total - tail:] & (ext_run[:, total - tail:] == run_last)
    return FalconState(
        S=S_final,
        last_key=k[:, :, -1, :],
        has_key=jnp.ones((k.shape[0],), bool),
        tail_x=stream.x_ext[:, :, total - tail:],
        tail_y=stream.y_ext[:, :, total - tail:],
        tail_valid=keep,
    )
