"""Chunk form (SSD-style): exact blocks of ``chunk_size`` steps, the state passed between them.

Each chunk is solved by :func:`falcon_jax.forms.block.block` from the state
at its start; a ``lax.scan`` over chunks carries that state.  Any ``T``:
the sequence is padded to a multiple of the chunk with *identity* steps
(zero write weight and zero log decay), so padding changes neither the
outputs nor the final state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.forms.block import block
from falcon_jax.forms.stream import final_state, write_stream
from falcon_jax.rules import Rule
from falcon_jax.state import FalconState


def chunk(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState, *, chunk_size: int):
    """Same arguments and result as :func:`falcon_jax.forms.recurrent.recurrent`."""
    B, H, T, dk = q.shape
    # one chunk of the next power of two >= T covers the sequence: a longer one only adds identity steps,
    # and its C x C intra-chunk products would grow with chunk_size, not T
    W, C = rule.window, min(chunk_size, 1 << (T - 1).bit_length())
    stream = write_stream(rule, k, v, inputs, resets, state)
    n = -(-T // C)
    pad = n * C - T

    def pad_time(a, axis, mode="constant"):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        return jnp.pad(a, widths, mode=mode)

    q_p = pad_time(q, 2)
    w = pad_time(stream.w, 2)
    log_gamma = pad_time(stream.log_gamma, 2)
    run = pad_time(stream.run, 1, mode="edge")
    x_ext = pad_time(stream.x_ext, 2)
    y_ext = pad_time(stream.y_ext, 2)

    # chunk c covers positions [cC, cC+C) and ext pairs [cC, cC+C+W-1) (its window overlap in front)
    idx = jnp.arange(n)[:, None] * C + jnp.arange(C + W - 1)[None, :]
    xs = dict(
        q=q_p.reshape(B, H, n, C, dk),
        x=x_ext[:, :, idx],
        y=y_ext[:, :, idx],
        w=w.reshape(B, H, n, C, *w.shape[3:]),
        log_gamma=log_gamma.reshape(B, H, n, C, -1),
    )
    xs = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, 2, 0), xs)
    run = run.reshape(B, n, C)
    before = jnp.concatenate([jnp.zeros((B, 1), run.dtype), run[:, :-1, -1]], axis=1)
    xs["run"] = jnp.moveaxis(run - before[:, :, None], 1, 0)[:, :, None, :]  # [n,B,1,C]

    def body(S0, c):
        o, S_end = block(c["q"], c["x"], c["y"], c["w"], c["log_gamma"], c["run"], S0,
                         regression=rule.regression, timing=rule.timing,
                         decay_before_residual=rule.decay_before_residual)
        return S_end, o

    S_final, o = jax.lax.scan(body, state.S, xs)
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, -1)[:, :, :T]
    return o, final_state(stream, S_final, k, rule)
