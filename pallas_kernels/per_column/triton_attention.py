"""GPU kernels (Pallas, Triton lowering) for decayed attention with per-column gates (Falcon-2A).

Layout: ``q, x [BH, L, dk]`` (or, with ``heads=H``, the model's ``[B, L, H, dk]`` read in place, as every
token-like array here: ``common.row_block``), the weighted values ``u = η ⊙ y [BH, L, dv]`` (in the inputs'
dtype; the op folds the write weight in, as Falcon-1A's callers do); ``g [BH, L, dv]`` fp32, each column's
chunk-local inclusive cumsum of the log decay **in base 2**, ``log₂ γ`` (every decay is an ``exp2``, one
special-function instruction, where ``exp`` costs a range reduction more); ``rl [BH, L]`` the chunk-local run
index.  Below, ``e^{g}`` stands for ``2^{g}``; the gradient ``dg`` the passes return is w.r.t. the natural-log
cumsum.  Value column c of a chunk is decayed linear attention with its own decays::

    o[t, c]   = c_{t,c} (Q S_0)[t, c] + Σ_{s≤t} A[t, s] e^{g_{t,c} − g_{s,c}} u[s, c],   A = Q Xᵀ ⊙ M
    S_C[:, c] = a_c S_0[:, c] + Σ_s w_{s,c} x_s u[s, c]

(``M[t, s] = [s ≤ t, same segment]``; c, w, a as in docs/kernels.md "Notation", per column.)  The decay of a
pair depends on the column, so ``o`` is not one product of ``[C, C]`` scores with the values.  The pairs s < t
of a chunk are split by a binary tree: at level k (k = 0 … log₂C − 1) the rows fall into groups of
``2m = 2^{k+1}``, each cut into halves, and the level's pairs are t in the second half and s in the first half
of one group (every pair s < t at exactly one level).  With the group's pivot p, the last row of its first half
(s ≤ p < t),

    e^{g_t − g_s} = e^{g_t − g_p} · e^{g_p − g_s},

each factor an exponential of a later row's g minus an earlier row's (≤ 1: nothing overflows, nothing is
divided by a small decay).  One ``[C, block_v]`` tile of exponentials per level, every row against its group's
pivot, gives ``src`` (``e^{g_p − g_s}`` on first-half rows, else 0) and ``dst`` (``e^{g_t − g_p}`` on second-half
rows, else 0), and the level's share of each sum is one full-chunk product (``A_k = A ⊙ P_k``, ``P_k`` the level's
pairs):

    o  += dst ⊙ (A_k (src ⊙ U))                 the read
    dU += src ⊙ (A_kᵀ (dst ⊙ dO))               its transpose
    dA += P_k ⊙ ((dst ⊙ dO)(src ⊙ U)ᵀ)          dA[t, s] = Σ_c dO[t, c] e^{g_{t,c} − g_{s,c}} u[s, c]

The pairs t = s (decay 1) add ``A[t, t] u_t``, ``A[t, t] dO_t`` and ``Σ_c dO[t, c] u[t, c]``.  Per chunk that is
log₂ C exponentials per value element and log₂ C products of ``[C, C]`` by ``[C, block_v]`` (three per level in
the backward: o again, dU, dA) where Falcon-1A has one (two); no tile has a third axis.

Passes (``api.py`` runs them):

* :func:`state_pass` — grid (batch·head, piece, value block): walks the chunks with the fp32 state in registers,
  ``S ← a ⊙ S + Xᵀ (w ⊙ U)``, optionally storing every chunk's start state h; returns each piece's end state.
  A piece's walk is affine in its start state with a per-column slope (the product of its chunks' ``a``), so
  pieces walked from zero and a short scan over pieces give the exact start states.
* :func:`output_pass` — grid (batch·head, chunk, value block): ``o = c ⊙ Q h`` plus the levels' reads and the
  pairs t = s.
* :func:`state_grad_pass` — the reverse walk: ``dS ← a ⊙ dS + Qᵀ (c ⊙ dO)``, storing every chunk's end-state
  gradient dh.
* :func:`column_grad_pass` — grid (batch·head, chunk, value block of ``block_v``): from h and dh, for its
  columns, o again, ``dU = w ⊙ X dh`` plus the levels' transposed reads, written, the gradient of g,
  ``dO ⊙ o − u ⊙ dU`` (+ ``⟨S_C, dS_C⟩`` per column at the chunk's last row), and the columns' share of dA
  (the pairs t = s on its diagonal) into ``dA_part [BH, n_chunks, dv / block_v, C, C]`` fp32.
* XLA sums ``dA_part`` over the value blocks (fp32).
* :func:`row_grad_pass` — grid (batch·head, chunk): as Falcon-1A's pass, ``dq = (dA ⊙ M) X + (c ⊙ dO) hᵀ``
  and ``dx = (dA ⊙ M)ᵀ Q + (w ⊙ U) dhᵀ``, full-chunk products.

:func:`chunk_grad_pass` runs the last three.  The column pass unrolls its levels (each level's masks and pivots
static); the output pass loops over them, where unrolling measured slower (docs/kernels.md).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import (call, chunk_specs, dot, precision_for, row_block, token_dims, triton_params,
                                       walk_layout, walk_outputs)

F32 = jnp.float32


def _mm(a, b, dtype, precision):
    """``a @ b`` with fp32 accumulation, the operands in the inputs' dtype (fp32 inputs: true fp32 products)."""
    return dot(a.astype(dtype), b.astype(dtype), precision)


def _walk_gates(g, rl, g_last, rl_last):
    """``w [C, block_v]`` (a row's write decayed to the chunk's end) and ``a [block_v]`` (the state's decay over
    the chunk), per column."""
    w = jnp.where((rl == rl_last)[:, None], jnp.exp2(g_last[None, :] - g), 0.0)
    a = jnp.where(rl_last == 0, jnp.exp2(g_last), 0.0)
    return w, a


def _state_kernel(x_ref, u_ref, g_ref, rl_ref, s0_ref, *out_refs, chunk, n_chunks, write_h, precision):
    h_ref = out_refs[0] if write_h else None
    s_end_ref = out_refs[-1]
    dtype = x_ref.dtype

    def body(c, S):
        start = pl.multiple_of(c * chunk, chunk)
        rows = pl.ds(start, chunk)
        if write_h:
            h_ref[c, :, :] = S.astype(h_ref.dtype)
        w, a = _walk_gates(g_ref[rows, :], rl_ref[rows], g_ref[start + chunk - 1, :], rl_ref[start + chunk - 1])
        return a[None, :] * S + _mm(x_ref[rows, :].T, w * u_ref[rows, :].astype(F32), dtype, precision)

    s_end_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))


def _state_grad_kernel(q_ref, g_ref, rl_ref, do_ref, ds_end_ref, *out_refs, chunk, n_chunks, write_dh, precision):
    """``dS_start = a ⊙ dS_end + Qᵀ (c ⊙ dO)``, last chunk first; dh: the gradient w.r.t. each chunk's end
    state."""
    dh_ref = out_refs[0] if write_dh else None
    ds_start_ref = out_refs[-1]
    dtype = q_ref.dtype

    def body(i, dS):
        c = n_chunks - 1 - i
        start = pl.multiple_of(c * chunk, chunk)
        rows = pl.ds(start, chunk)
        if write_dh:
            dh_ref[c, :, :] = dS.astype(dh_ref.dtype)
        g, rl = g_ref[rows, :], rl_ref[rows]
        rl_last = rl_ref[start + chunk - 1]
        cont = jnp.where((rl == 0)[:, None], jnp.exp2(g), 0.0)
        a = jnp.where(rl_last == 0, jnp.exp2(g_ref[start + chunk - 1, :]), 0.0)
        return a[None, :] * dS + _mm(q_ref[rows, :].T, cont * do_ref[rows, :].astype(F32), dtype, precision)

    ds_start_ref[...] = lax.fori_loop(0, n_chunks, body, ds_end_ref[...].astype(F32))


def _mask(rl, chunk):
    """``M[t, s] = [s ≤ t, same segment]`` ``[C, C]``."""
    t = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    s = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return (t >= s) & (rl[:, None] == rl[None, :])


def _scores(q, x, rl, chunk, precision):
    """``A = Q Xᵀ ⊙ M`` ``[C, C]`` fp32 and its diagonal ``[C]``."""
    A = jnp.where(_mask(rl, chunk), dot(q, x.T, precision), 0.0)
    eye = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0) == lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return A, jnp.sum(jnp.where(eye, A, 0.0), axis=1)


def _levels(chunk):
    return chunk.bit_length() - 1  # log₂ C


def _level(k, chunk):
    """Level k of the pair tree (rows in groups of ``2m = 2^{k+1}``, each cut into halves): ``pivot [C]``, each
    row's group's pivot row (the first half's last row); ``first [C, 1]``, the row is in its group's first half;
    ``pairs [C, C]``, t and s in different halves of one group (the highest bit of ``t xor s`` is k).  Of those
    only t > s (t in the second half) count: the others meet a zero (A is causal, ``dst`` zero on first
    halves)."""
    t = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    pivot = ((t >> (k + 1)) << (k + 1)) + (1 << k) - 1
    first = ((t >> k) & 1) == 0
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return pivot, first[:, None], ((rows ^ cols) >> k) == 1


def _level_factors(g_ref, cols, g, pivot, first):
    """``(src, dst)`` ``[C, block_v]``: ``e^{g_p − g_s}`` on first-half rows s and ``e^{g_t − g_p}`` on second-half
    rows t (zero elsewhere), p the row's pivot — one exponential per element, of a later row's g minus an earlier
    row's.  The pivot rows' g by one gathered load."""
    g_p = g_ref[pivot, cols]
    z = jnp.exp2(jnp.where(first, g_p - g, g - g_p))
    return jnp.where(first, z, 0.0), jnp.where(first, 0.0, z)


def _output_kernel(q_ref, x_ref, u_ref, g_ref, rl_ref, h_ref, o_ref, *, chunk, precision):
    dtype = q_ref.dtype
    q, rl = q_ref[...], rl_ref[...]
    A, A_diag = _scores(q, x_ref[...], rl, chunk, precision)
    A_lo = A.astype(dtype)  # the products' operand (fp32 inputs: unchanged)
    g, u = g_ref[...], u_ref[...].astype(F32)
    cont = jnp.where((rl == 0)[:, None], jnp.exp2(g), 0.0)
    o = cont * _mm(q, h_ref[...], dtype, precision) + A_diag[:, None] * u

    def level(k, o):
        pivot, first, pairs = _level(k, chunk)
        src, dst = _level_factors(g_ref, slice(None), g, pivot, first)
        return o + dst * _mm(jnp.where(pairs, A_lo, 0.0), src * u, dtype, precision)

    o_ref[...] = lax.fori_loop(0, _levels(chunk), level, o).astype(o_ref.dtype)


def _column_grad_kernel(q_ref, x_ref, u_ref, g_ref, rl_ref, do_ref, h_ref, dh_ref, du_ref, dg_ref, da_ref, *,
                        chunk, precision):
    """One chunk's ``block_v`` value columns: o again, du and dg (written) and the columns' share of dA,
    ``dA_v[t, s] = Σ_{c in the block} dO[t, c] e^{g_t,c − g_s,c} u[s, c]`` on the pairs s < t, with the pairs
    t = s, ``Σ_c dO[t, c] u[t, c]``, on its diagonal (``da_ref [C, C]`` fp32, unmasked: the segment mask is
    applied after the sum over the value blocks)."""
    dtype = q_ref.dtype
    q, x, rl = q_ref[...], x_ref[...], rl_ref[...]
    A, A_diag = _scores(q, x, rl, chunk, precision)
    A_lo = A.astype(dtype)
    last = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) == chunk - 1
    g, u, do = g_ref[...], u_ref[...].astype(F32), do_ref[...].astype(F32)
    h, dh = h_ref[...], dh_ref[...]
    w, a = _walk_gates(g, rl, g_ref[chunk - 1, :], rl_ref[chunk - 1])
    cont = jnp.where((rl == 0)[:, None], jnp.exp2(g), 0.0)
    du_state = w * _mm(x, dh, dtype, precision)
    o = cont * _mm(q, h, dtype, precision) + A_diag[:, None] * u
    du = du_state + A_diag[:, None] * do
    # ⟨S_C, dS_C⟩ per column: a ⟨h, dh⟩ + Σ_s u_s (w ⊙ X dh)_s
    end = a * jnp.sum(h.astype(F32) * dh.astype(F32), axis=0) + jnp.sum(u * du_state, axis=0)
    eye = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0) == lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    dA = jnp.where(eye, jnp.sum(do * u, axis=1)[:, None], 0.0)  # no level pairs t = s: the diagonal is free

    def level(k, carry):
        o, du, dA = carry
        pivot, first, pairs = _level(k, chunk)
        src, dst = _level_factors(g_ref, slice(None), g, pivot, first)
        su, dd = src * u, dst * do
        A_k = jnp.where(pairs, A_lo, 0.0)
        return (o + dst * _mm(A_k, su, dtype, precision), du + src * _mm(A_k.T, dd, dtype, precision),
                dA + jnp.where(pairs, _mm(dd, su.T, dtype, precision), 0.0))

    for k in range(_levels(chunk)):  # unrolled (module docstring)
        o, du, dA = level(k, (o, du, dA))
    du_ref[...] = du.astype(du_ref.dtype)
    dg_ref[...] = do * o - u * du + jnp.where(last, end[None, :], 0.0)
    da_ref[...] = dA


def _row_grad_kernel(q_ref, x_ref, u_ref, g_ref, rl_ref, do_ref, h_ref, dh_ref, da_ref, dq_ref, dx_ref, *, chunk,
                     block_v, precision):
    """One chunk's ``dq = (dA ⊙ M) X + Σ_v (c ⊙ dO_v) h_vᵀ`` and ``dx = (dA ⊙ M)ᵀ Q + Σ_v (w ⊙ U_v) dh_vᵀ`` from
    ``da_ref [C, C]``, dA summed over the value blocks (its diagonal the pairs t = s)."""
    dtype = q_ref.dtype
    q, x, rl = q_ref[...], x_ref[...], rl_ref[...]
    rl_last = rl_ref[chunk - 1]
    dA = jnp.where(_mask(rl, chunk), da_ref[...], 0.0)
    dq = _mm(dA, x, dtype, precision)
    dx = _mm(dA.T, q, dtype, precision)
    for v in range(u_ref.shape[-1] // block_v):  # the state terms, the gates formed again; unrolled: static slices
        cols = pl.ds(v * block_v, block_v)
        g = g_ref[:, cols]
        w, _ = _walk_gates(g, rl, g_ref[chunk - 1, cols], rl_last)
        cont = jnp.where((rl == 0)[:, None], jnp.exp2(g), 0.0)
        dq = dq + _mm(cont * do_ref[:, cols].astype(F32), h_ref[:, cols].T, dtype, precision)
        dx = dx + _mm(w * u_ref[:, cols].astype(F32), dh_ref[:, cols].T, dtype, precision)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dx_ref[...] = dx.astype(dx_ref.dtype)


def _params(interpret, num_warps, num_stages):
    return None if interpret else triton_params(num_warps, num_stages)


def state_pass(x, u, g, rl, s0, *, chunk, pieces, block_v, write_h, interpret, num_warps=4, num_stages=3,
               heads=None):
    """The state walk for every (batch·head, piece, value block).  s0 [BH, P, dk, dv]: each piece's start state.

    Returns (h [BH, n_chunks, dk, dv] (each chunk's start state, ``chunk_state_dtype``) if write_h,
    s_end [BH, P, dk, dv] fp32)."""
    grid, n, specs, shapes = walk_layout(x, u, chunk, pieces, block_v, heads)
    out_specs, out_shape = walk_outputs(specs, shapes, write_h)
    kernel = functools.partial(_state_kernel, chunk=chunk, n_chunks=n, write_h=write_h,
                               precision=precision_for(x.dtype))
    return call(kernel, grid=grid,
                in_specs=[specs.rows_k, specs.rows_v, specs.rows_v, specs.gate, specs.piece_state],
                out_specs=out_specs, out_shape=out_shape, args=(x, u, g, rl, s0),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_attn_col_state")


def state_grad_pass(q, g, rl, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret, num_warps=4,
                    num_stages=3, heads=None):
    """The reverse walk.  ds_end [BH, P, dk, dv]: the gradient at each piece's end.

    Returns (dh [BH, n_chunks, dk, dv] (w.r.t. each chunk's end state) if write_dh, ds_start [BH, P, dk, dv])."""
    grid, n, specs, shapes = walk_layout(q, do, chunk, pieces, block_v, heads)
    out_specs, out_shape = walk_outputs(specs, shapes, write_dh)
    kernel = functools.partial(_state_grad_kernel, chunk=chunk, n_chunks=n, write_dh=write_dh,
                               precision=precision_for(q.dtype))
    return call(kernel, grid=grid, in_specs=[specs.rows_k, specs.rows_v, specs.gate, specs.rows_v, specs.piece_state],
                out_specs=out_specs, out_shape=out_shape, args=(q, g, rl, do, ds_end),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_attn_col_dstate")


def _column_block_specs(heads, chunk, dk, block_v):
    """Block specs of a grid (batch·head, chunk, value block of ``block_v`` columns)."""
    return types.SimpleNamespace(k=row_block(heads, chunk, dk, lambda b, c, v: (b, c, 0)),
                                 v=row_block(heads, chunk, block_v, lambda b, c, v: (b, c, v)),
                                 row=pl.BlockSpec((None, chunk), lambda b, c, v: (b, c)),
                                 state=pl.BlockSpec((None, None, dk, block_v), lambda b, c, v: (b, c, 0, v)))


def output_pass(q, x, u, g, rl, h, *, chunk, block_v, interpret, num_warps=4, num_stages=1, heads=None):
    """o (like u) of every chunk from its start state h [BH, n_chunks, dk, dv]; grid (batch·head, chunk, value
    block of ``block_v`` columns)."""
    BH, L, dk = token_dims(q, heads)
    dv = u.shape[-1]
    sp = _column_block_specs(heads, chunk, dk, block_v)
    kernel = functools.partial(_output_kernel, chunk=chunk, precision=precision_for(q.dtype))
    (o,) = call(kernel, grid=(BH, L // chunk, dv // block_v), in_specs=[sp.k, sp.k, sp.v, sp.v, sp.row, sp.state],
                out_specs=[sp.v], out_shape=[jax.ShapeDtypeStruct(u.shape, u.dtype)], args=(q, x, u, g, rl, h),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_attn_col_out")
    return o


def column_grad_pass(q, x, u, g, rl, do, h, dh, *, chunk, block_v, interpret, num_warps=8, num_stages=1,
                     heads=None):
    """du, dg and each value block's share of dA for every (batch·head, chunk, value block of ``block_v``
    columns), from h and dh ([BH, n_chunks, dk, dv]).

    Returns du (like u), dg (like u, fp32; w.r.t. the chunk-local natural-log cumsum) and
    dA_part [BH, n_chunks, dv / block_v, C, C] fp32 (each block's pairs s < t, its pairs t = s on the diagonal;
    unmasked)."""
    BH, L, dk = token_dims(q, heads)
    n, n_blocks = L // chunk, u.shape[-1] // block_v
    sp = _column_block_specs(heads, chunk, dk, block_v)
    square = pl.BlockSpec((None, None, None, chunk, chunk), lambda b, c, v: (b, c, v, 0, 0))
    kernel = functools.partial(_column_grad_kernel, chunk=chunk, precision=precision_for(q.dtype))
    return call(kernel, grid=(BH, n, n_blocks),
                in_specs=[sp.k, sp.k, sp.v, sp.v, sp.row, sp.v, sp.state, sp.state],
                out_specs=[sp.v, sp.v, square],
                out_shape=[jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct(u.shape, F32),
                           jax.ShapeDtypeStruct((BH, n, n_blocks, chunk, chunk), F32)],
                args=(q, x, u, g, rl, do, h, dh), compiler_params=_params(interpret, num_warps, num_stages),
                interpret=interpret, name="falcon_attn_col_grads")


def row_grad_pass(q, x, u, g, rl, do, h, dh, dA, *, chunk, block_v, interpret, num_warps=4, num_stages=1,
                  heads=None):
    """dq, dx (like q, x) of every (batch·head, chunk) from dA [BH, n_chunks, C, C] fp32 (summed over the
    value blocks, unmasked), h and dh; the state terms ``block_v`` columns at a time."""
    BH, L, _ = token_dims(q, heads)
    sp = chunk_specs(q, u.shape[-1], chunk, heads)
    kernel = functools.partial(_row_grad_kernel, chunk=chunk, block_v=block_v, precision=precision_for(q.dtype))
    return call(kernel, grid=(BH, L // chunk),
                in_specs=[sp.k, sp.k, sp.v, sp.v, sp.row, sp.v, sp.state, sp.state, sp.square],
                out_specs=[sp.k, sp.k],
                out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)],
                args=(q, x, u, g, rl, do, h, dh, dA.reshape(BH, L, chunk)),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_attn_row_grads")


def chunk_grad_pass(q, x, u, g, rl, do, h, dh, *, chunk, block_v, interpret, num_warps=8, row_warps=4,
                    num_stages=1, heads=None):
    """Every gradient of every chunk from its start state h and end-state gradient dh ([BH, n_chunks, dk, dv]):
    :func:`column_grad_pass` (``num_warps``), its dA shares summed over the value blocks (XLA, fp32), then
    :func:`row_grad_pass` (``row_warps``).

    Returns dq, dx, du (like q, x, u) and dg (like u, fp32; w.r.t. the chunk-local natural-log cumsum)."""
    kw = dict(chunk=chunk, block_v=block_v, interpret=interpret, num_stages=num_stages, heads=heads)
    du, dg, dA_part = column_grad_pass(q, x, u, g, rl, do, h, dh, num_warps=num_warps, **kw)
    dq, dx = row_grad_pass(q, x, u, g, rl, do, h, dh, jnp.sum(dA_part, axis=2), num_warps=row_warps, **kw)
    return dq, dx, du, dg


__all__ = ["chunk_grad_pass", "column_grad_pass", "output_pass", "row_grad_pass", "state_grad_pass",
           "state_pass"]
