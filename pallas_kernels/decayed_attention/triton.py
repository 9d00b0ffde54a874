"""GPU kernels (Pallas, Triton lowering) for decayed attention with scalar gates.

Layout: batch·heads flattened, ``q, x [BH, L, dk]``, ``y [BH, L, dv]`` — or, with ``heads=H``,
the model's own ``[B, L, H, d]`` read in place (``common.row_block``) —,
``g [BH, L]`` the *chunk-local* inclusive cumsum of the log decay, ``rl [BH, L]``
the chunk-local run index (0 = same segment as the chunk's initial state).

Schedule (forward): one program per (batch·head, piece of the sequence,
block of value columns) walks its chunks in order with the state in
registers: per chunk ``o = (q xᵀ ⊙ D) y + e^{g} q S`` and
``S ← e^{g_last} S + (x ⊙ e^{g_last − g})ᵀ y``.  When batch·heads alone
would leave the GPU idle, the sequence is cut into pieces: a first pass
gives each piece's end state from zero, a short scan over pieces (XLA) their
true initial states, and the output pass runs from those (exact).

Backward: states recomputed per chunk (same kernel, writing them), a reverse
pass for the state gradients (pieces likewise), then one program per chunk
for dq, dx, dy and the gradient of the log-decay cumsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import call as _call
from falcon_jax.kernels.common import chunk_specs as _chunk_specs
from falcon_jax.kernels.common import column_block
from falcon_jax.kernels.common import dot as _dot
from falcon_jax.kernels.common import precision_for as _precision
from falcon_jax.kernels.common import token_dims as _token_dims
from falcon_jax.kernels.common import triton_params as _params
from falcon_jax.kernels.common import walk_layout as _walk_layout
from falcon_jax.kernels.common import walk_outputs as _walk_outputs


def _chunk_masks(g, rl, chunk):
    """Decay mask ``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within one segment."""
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    mask = (rows >= cols) & (rl[:, None] == rl[None, :])
    return jnp.exp(jnp.where(mask, g[:, None] - g[None, :], -jnp.inf))


def _chunk_rows(g_ref, rl_ref, c, chunk):
    """Rows of chunk ``c`` and its gates: (rows, g, rl, g at the last row, rl at the last row)."""
    start = pl.multiple_of(c * chunk, chunk)
    rows = pl.ds(start, chunk)
    return rows, g_ref[rows], rl_ref[rows], g_ref[start + chunk - 1], rl_ref[start + chunk - 1]


def _forward_kernel(q_ref, x_ref, y_ref, g_ref, rl_ref, s0_ref, *out_refs, chunk, n_chunks, write_o,
                    write_h, precision):
    refs = list(out_refs)
    o_ref = refs.pop(0) if write_o else None
    h_ref = refs.pop(0) if write_h else None
    (s_end_ref,) = refs

    def body(c, S):
        rows, g, rl, g_last, rl_last = _chunk_rows(g_ref, rl_ref, c, chunk)
        x = x_ref[rows, :]
        y = y_ref[rows, :]
        if write_h:
            h_ref[c, :, :] = S.astype(h_ref.dtype)
        if write_o:
            q = q_ref[rows, :]
            scores = _dot(q, x.T, precision) * _chunk_masks(g, rl, chunk)
            inter = _dot(q, S.astype(q.dtype), precision)
            o = _dot(scores.astype(y.dtype), y, precision) + jnp.where(rl == 0, jnp.exp(g), 0.0)[:, None] * inter
            o_ref[rows, :] = o.astype(o_ref.dtype)
        w_last = jnp.where(rl == rl_last, jnp.exp(g_last - g), 0.0)
        # the row scale on the value block ([C, block_v]), not on the [C, dk] keys every program of a head reloads
        write = _dot(x.T, (y * w_last[:, None]).astype(y.dtype), precision)
        return jnp.where(rl_last == 0, jnp.exp(g_last), 0.0) * S + write

    s_end_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(jnp.float32))


def _state_grad_kernel(q_ref, g_ref, rl_ref, do_ref, ds_end_ref, *out_refs, chunk, n_chunks, write_dh,
                       precision):
    """Reverse pass: ``dS_start(c) = e^{g_last}[no reset] dS_end(c) + (q ⊙ e^{g}[cont])ᵀ do``."""
    refs = list(out_refs)
    dh_ref = refs.pop(0) if write_dh else None
    (ds_start_ref,) = refs

    def body(i, dS):
        c = n_chunks - 1 - i
        rows, g, rl, g_last, rl_last = _chunk_rows(g_ref, rl_ref, c, chunk)
        if write_dh:
            dh_ref[c, :, :] = dS.astype(dh_ref.dtype)
        q = q_ref[rows, :]
        do = do_ref[rows, :]
        do_c = (do * jnp.where(rl == 0, jnp.exp(g), 0.0)[:, None]).astype(do.dtype)  # scale the narrow block
        return jnp.where(rl_last == 0, jnp.exp(g_last), 0.0) * dS + _dot(q.astype(do.dtype).T, do_c, precision)

    ds_start_ref[...] = lax.fori_loop(0, n_chunks, body, ds_end_ref[...].astype(jnp.float32))


def _chunk_grad_kernel(q_ref, x_ref, y_ref, g_ref, rl_ref, do_ref, h_ref, dh_ref, dq_ref, dx_ref, dy_ref,
                       dg_ref, *, chunk, block_v, precision):
    """Gradients inside one chunk from its start state ``h`` and end-state gradient ``dh``.

    ``dg`` is the gradient w.r.t. the chunk-local cumsum ``g``:
    ``q·dq − x·dx`` plus ``⟨S_end, dh⟩`` at the chunk's last position.
    Value columns are visited in blocks of ``block_v`` so that only one block
    of ``y, do, h, dh`` is live at a time (shared memory); the loop is unrolled (static slices).
    """
    q, x = q_ref[...], x_ref[...]
    g, rl = g_ref[...], rl_ref[...]
    dk = q.shape[-1]
    dv = y_ref.shape[-1]
    g_last = g_ref[chunk - 1]
    rl_last = rl_ref[chunk - 1]
    decay = _chunk_masks(g, rl, chunk)
    scores = (_dot(q, x.T, precision) * decay).astype(q.dtype)  # [C, C]
    cont = jnp.where(rl == 0, jnp.exp(g), 0.0)
    w_last = jnp.where(rl == rl_last, jnp.exp(g_last - g), 0.0)
    a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)

    def value_block(j, sums):
        dscores, dq_state, y_dh, end_term = sums
        cols = column_block(j, block_v)
        y, do = y_ref[:, cols], do_ref[:, cols]
        h, dh = h_ref[:, cols], dh_ref[:, cols]
        # the sums before dy: with dy first Triton scheduled the block differently and the whole op's
        # forward+backward ran ~25% slower on the H200
        sums = (dscores + _dot(do, y.T, precision), dq_state + _dot(do, h.T.astype(do.dtype), precision),
                y_dh + _dot(y, dh.T.astype(y.dtype), precision),
                end_term + a_last * jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32)))
        dy = _dot(scores.T, do, precision) + w_last[:, None] * _dot(x, dh.astype(x.dtype), precision)
        dy_ref[:, cols] = dy.astype(dy_ref.dtype)
        return sums

    zeros = (jnp.zeros((chunk, chunk), jnp.float32), jnp.zeros((chunk, dk), jnp.float32),
             jnp.zeros((chunk, dk), jnp.float32), jnp.zeros((), jnp.float32))
    sums = zeros
    for j in range(dv // block_v):  # unrolled: static slices (a fori_loop measured slower here on the H200)
        sums = value_block(j, sums)
    dscores, dq_state, y_dh, end_term = sums
    dscores = (dscores * decay).astype(q.dtype)
    dq = _dot(dscores, x, precision) + cont[:, None] * dq_state
    dx = _dot(dscores.T, q, precision) + w_last[:, None] * y_dh
    xf, qf = x.astype(jnp.float32), q.astype(jnp.float32)
    end_term += jnp.sum(w_last * jnp.sum(xf * y_dh, axis=1))
    last = lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1
    dg_ref[...] = jnp.sum(qf * dq, axis=1) - jnp.sum(xf * dx, axis=1) + jnp.where(last, end_term, 0.0)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dx_ref[...] = dx.astype(dx_ref.dtype)


def forward_pass(q, x, y, g, rl, s0, *, chunk, pieces, block_v, write_o, write_h, interpret, num_warps=4,
                 num_stages=2, heads=None):
    """Run the chunk walk for every (batch·head, piece, value block).

    q, x [BH, L, dk]; y [BH, L, dv] (or [B, L, H, d] with ``heads=H``); g, rl [BH, L]; s0 [BH, P, dk, dv]
    initial state of each piece.
    Returns (o like y if write_o, h [BH, n_chunks, dk, dv] if write_h, s_end [BH, P, dk, dv]).
    """
    grid, n, specs, shapes = _walk_layout(q, y, chunk, pieces, block_v, heads)
    in_specs = [specs.rows_k, specs.rows_k, specs.rows_v, specs.gate, specs.gate, specs.piece_state]
    out_specs, out_shape = _walk_outputs(specs, shapes, write_h, first=[(specs.rows_v, y)] if write_o else ())
    kernel = functools.partial(_forward_kernel, chunk=chunk, n_chunks=n, write_o=write_o, write_h=write_h,
                               precision=_precision(q.dtype))
    return _call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                 args=(q, x, y, g, rl, s0), compiler_params=None if interpret else _params(num_warps, num_stages),
                 interpret=interpret, name="falcon_decayed_attention_fwd")


def state_grad_pass(q, g, rl, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret, num_warps=4,
                    num_stages=2, heads=None):
    """Reverse chunk walk. ds_end [BH, P, dk, dv] gradient at each piece's end.

    Returns (dh [BH, n_chunks, dk, dv] gradient w.r.t. each chunk's end state if write_dh,
    ds_start [BH, P, dk, dv]).
    """
    grid, n, specs, shapes = _walk_layout(q, do, chunk, pieces, block_v, heads)
    in_specs = [specs.rows_k, specs.gate, specs.gate, specs.rows_v, specs.piece_state]
    out_specs, out_shape = _walk_outputs(specs, shapes, write_dh)
    kernel = functools.partial(_state_grad_kernel, chunk=chunk, n_chunks=n, write_dh=write_dh,
                               precision=_precision(q.dtype))
    return _call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                 args=(q, g, rl, do, ds_end), compiler_params=None if interpret else _params(num_warps, num_stages),
                 interpret=interpret, name="falcon_decayed_attention_dstate")


def chunk_grad_pass(q, x, y, g, rl, do, h, dh, *, chunk, block_v, interpret, num_warps=4, num_stages=1,
                    heads=None):
    """Per-chunk gradients. h, dh [BH, n_chunks, dk, dv].

    Returns dq, dx, dy (in the layout of q, x, y: [BH, L, d], or [B, L, H, d] with ``heads=H``) and
    dg [BH, L] f32."""
    BH, L, _ = _token_dims(q, heads)
    sp = _chunk_specs(q, y.shape[-1], chunk, heads)
    kernel = functools.partial(_chunk_grad_kernel, chunk=chunk, block_v=block_v, precision=_precision(q.dtype))
    return _call(kernel, grid=(BH, L // chunk), in_specs=[sp.k, sp.k, sp.v, sp.row, sp.row, sp.v, sp.state, sp.state],
                 out_specs=[sp.k, sp.k, sp.v, sp.row],
                 out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                            jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct((BH, L), jnp.float32)],
                 args=(q, x, y, g, rl, do, h, dh),
                 compiler_params=None if interpret else _params(num_warps, num_stages), interpret=interpret,
                 name="falcon_decayed_attention_chunk_grads")
