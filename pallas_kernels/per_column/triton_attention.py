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
pair depends on the column, so ``o`` is not one product of ``[C, C]`` scores with the values.  The chunk is cut
into 16-row sub-blocks ``i`` (rows ``16i … 16i+15``, last row ``b_i``); for t in sub-block i and s in an earlier
sub-block j the decay factors through the sub-blocks' last rows,

    e^{g_t − g_s} = E_i[t] · V_ij · F_j[s],
    E_i = e^{g_t − g_{b_{i−1}}},   V_ij = e^{g_{b_{i−1}} − g_{b_j}},   F_j = e^{g_{b_j} − g_s},

each factor an exponential of a difference with the later row first (≤ 1: nothing overflows, nothing is divided
by a small decay), so that sub-block pair's share is ``E_i ⊙ V_ij ⊙ (A_ij (F_j ⊙ U_j))``, one ``[16, 16]`` by
``[16, block_v]`` product.  Inside a sub-block the decays ``e^{g_t − g_s}`` are formed exactly, one
``[16, 16, block_v]`` tile of exponentials (:func:`_diagonal`), masked to ``s ≤ t`` before ``exp``.

Passes (``api.py`` runs them):

* :func:`state_pass` — grid (batch·head, piece, value block): walks the chunks with the fp32 state in registers,
  ``S ← a ⊙ S + Xᵀ (w ⊙ U)``, optionally storing every chunk's start state h; returns each piece's end state.
  A piece's walk is affine in its start state with a per-column slope (the product of its chunks' ``a``), so
  pieces walked from zero and a short scan over pieces give the exact start states.
* :func:`output_pass` — grid (batch·head, chunk): ``o`` of one chunk from its start state h, value blocks of
  ``block_v`` columns in turn.
* :func:`state_grad_pass` — the reverse walk: ``dS ← a ⊙ dS + Qᵀ (c ⊙ dO)``, storing every chunk's end-state
  gradient dh.
* :func:`chunk_grad_pass` — grid (batch·head, chunk): from h and dh, every gradient of the chunk: per value
  block ``o`` again and ``dU = (the transposed intra-chunk read) + w ⊙ X dh``, written, and the gradient of g,
  ``dO ⊙ o − u ⊙ dU`` (+ ``⟨S_C, dS_C⟩`` per column at the chunk's last row); summed over the value blocks,
  ``dA[t, s] = Σ_c dO[t, c] e^{g_{t,c} − g_{s,c}} u[s, c]`` per sub-block pair (the same factorization) and the
  state terms ``(c ⊙ dO) hᵀ``, ``(w ⊙ U) dhᵀ``; then ``dq = (dA ⊙ M) X + …`` and ``dx = (dA ⊙ M)ᵀ Q + …``
  per sub-block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import (call, chunk_specs, dot, precision_for, token_dims, triton_params, walk_layout,
                                       walk_outputs)

F32 = jnp.float32
SUB = 16  # rows of a sub-block (Triton's smallest dot tile)


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


def _diagonal(A, g, left, right, *, sums):
    """One sub-block's own pairs, exactly: ``D[t, s, c] = e^{g_{t,c} − g_{s,c}}`` on ``s ≤ t`` (masked before
    ``exp``), ``A [16, 16]`` the masked scores.  ``sums``: which of

    * ``"read"``: ``Σ_s A[t, s] D[t, s, c] right[s, c]`` (the read of ``right`` = U),
    * ``"back"``: ``Σ_t A[t, s] D[t, s, c] left[t, c]`` (the transposed read of ``left`` = dO),
    * ``"pairs"``: ``Σ_c left[t, c] D[t, s, c] right[s, c]`` (``[16, 16]``, before the mask M)

    to return, in that order."""
    shape = (SUB, SUB, g.shape[1])
    t = lax.broadcasted_iota(jnp.int32, shape, 0)
    s = lax.broadcasted_iota(jnp.int32, shape, 1)
    D = jnp.exp2(jnp.where(t >= s, g[:, None, :] - g[None, :, :], -jnp.inf))
    out = []
    if "read" in sums or "back" in sums:
        AD = A[:, :, None] * D
        if "read" in sums:
            out.append(jnp.sum(AD * right[None, :, :], axis=1))
        if "back" in sums:
            out.append(jnp.sum(AD * left[:, None, :], axis=0))
    if "pairs" in sums:
        out.append(jnp.sum(D * left[:, None, :] * right[None, :, :], axis=2))
    return out


class _Chunk:
    """One chunk's sub-blocks: row slices, run indices, the query tiles ``Q_i``, the masks ``M_ij`` and scores
    ``A_ij = Q_i X_jᵀ ⊙ M_ij`` (j ≤ i; fp32)."""

    def __init__(self, q_ref, x_ref, rl_ref, chunk, precision):
        self.nb = chunk // SUB
        self.rows = [pl.ds(i * SUB, SUB) for i in range(self.nb)]
        self.rl = [rl_ref[r] for r in self.rows]
        self.rl_last = rl_ref[chunk - 1]
        causal = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0) >= lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
        self.q = [q_ref[r, :] for r in self.rows]
        x = [x_ref[r, :] for r in self.rows]
        self.mask, self.A = {}, {}
        for i in range(self.nb):
            for j in range(i + 1):
                same = self.rl[i][:, None] == self.rl[j][None, :]
                self.mask[i, j] = (same & causal) if i == j else same
                self.A[i, j] = jnp.where(self.mask[i, j], dot(self.q[i], x[j].T, precision), 0.0)


class _Columns:
    """One value block of a chunk, per sub-block: g, u (fp32), the decay factors ``E_i`` (i ≥ 1), ``F_j``
    (j < last), the inter-chunk read's ``c_i`` and, with ``walk``, the state update's ``w_i`` and ``a``; ``g_b[i]``:
    g at sub-block i's last row."""

    def __init__(self, ch: _Chunk, g_ref, u_ref, cols, walk: bool):
        nb = ch.nb
        self.g = [g_ref[r, cols] for r in ch.rows]
        self.u = [u_ref[r, cols].astype(F32) for r in ch.rows]
        self.g_b = [g_ref[(i + 1) * SUB - 1, cols] for i in range(nb)]
        g_last = self.g_b[-1]
        self.E = [None] + [jnp.exp2(self.g[i] - self.g_b[i - 1][None, :]) for i in range(1, nb)]
        self.F = [jnp.exp2(self.g_b[j][None, :] - self.g[j]) for j in range(nb - 1)] + [None]
        self.cont = [jnp.where((ch.rl[i] == 0)[:, None], jnp.exp2(self.g[i]), 0.0) for i in range(nb)]
        if walk:  # the backward's state terms
            gates = [_walk_gates(self.g[i], ch.rl[i], g_last, ch.rl_last) for i in range(nb)]
            self.w = [w for w, _ in gates]
            self.a = gates[0][1]

    def V(self, i, j):
        """``e^{g_{b_{i−1}} − g_{b_j}}`` (``[1, block_v]``) for ``j < i − 1``; None for ``j = i − 1`` (1)."""
        return None if j == i - 1 else jnp.exp2(self.g_b[i - 1] - self.g_b[j])[None, :]


def _scaled(term, factor):
    return term if factor is None else term * factor


def _output_kernel(q_ref, x_ref, u_ref, g_ref, rl_ref, h_ref, o_ref, *, chunk, block_v, precision):
    dtype = q_ref.dtype
    ch = _Chunk(q_ref, x_ref, rl_ref, chunk, precision)
    for v in range(u_ref.shape[-1] // block_v):  # unrolled: static column slices
        cols = pl.ds(v * block_v, block_v)
        col = _Columns(ch, g_ref, u_ref, cols, walk=False)
        h = h_ref[:, cols]
        Ut = [_scaled(col.u[j], col.F[j]) for j in range(ch.nb - 1)]  # F_j ⊙ U_j
        for i in range(ch.nb):
            o = col.cont[i] * _mm(ch.q[i], h, dtype, precision)
            if i > 0:
                cross = sum(_scaled(_mm(ch.A[i, j], Ut[j], dtype, precision), col.V(i, j)) for j in range(i))
                o = o + col.E[i] * cross
            (diag,) = _diagonal(ch.A[i, i], col.g[i], None, col.u[i], sums=("read",))
            o_ref[ch.rows[i], cols] = (o + diag).astype(o_ref.dtype)


def _chunk_grad_kernel(q_ref, x_ref, u_ref, g_ref, rl_ref, do_ref, h_ref, dh_ref, dq_ref, dx_ref, du_ref, dg_ref, *,
                       chunk, block_v, precision):
    dtype = q_ref.dtype
    ch = _Chunk(q_ref, x_ref, rl_ref, chunk, precision)
    nb, dk = ch.nb, q_ref.shape[-1]
    dA = {key: jnp.zeros((SUB, SUB), F32) for key in ch.A}
    dq_state = [jnp.zeros((SUB, dk), F32) for _ in range(nb)]  # (c ⊙ dO) hᵀ
    dx_state = [jnp.zeros((SUB, dk), F32) for _ in range(nb)]  # (w ⊙ U) dhᵀ
    last_row = (lax.broadcasted_iota(jnp.int32, (SUB, 1), 0) == SUB - 1)
    for v in range(u_ref.shape[-1] // block_v):  # unrolled: static column slices
        cols = pl.ds(v * block_v, block_v)
        col = _Columns(ch, g_ref, u_ref, cols, walk=True)
        h, dh = h_ref[:, cols], dh_ref[:, cols]
        do = [do_ref[r, cols].astype(F32) for r in ch.rows]
        Ut = [_scaled(col.u[j], col.F[j]) for j in range(nb - 1)]  # F_j ⊙ U_j
        Et = [None] + [col.E[i] * do[i] for i in range(1, nb)]  # E_i ⊙ dO_i
        # ⟨S_C, dS_C⟩ per column: a ⟨h, dh⟩ + Σ_s u_s (w ⊙ X dh)_s
        end = col.a * jnp.sum(h.astype(F32) * dh.astype(F32), axis=0)
        o, dU = [], []
        for i in range(nb):
            # q and x tiles loaded again (from cache) rather than held across the value blocks: the
            # accumulators below already hold [C, dk] twice
            q_i, x_i = q_ref[ch.rows[i], :], x_ref[ch.rows[i], :]
            o_i = col.cont[i] * _mm(q_i, h, dtype, precision)
            if i > 0:
                o_i = o_i + col.E[i] * sum(_scaled(_mm(ch.A[i, j], Ut[j], dtype, precision), col.V(i, j))
                                           for j in range(i))
            du_state = col.w[i] * _mm(x_i, dh, dtype, precision)
            end = end + jnp.sum(col.u[i] * du_state, axis=0)
            du_i = du_state
            if i < nb - 1:
                du_i = du_i + col.F[i] * sum(_scaled(_mm(ch.A[t, i].T, Et[t], dtype, precision), col.V(t, i))
                                             for t in range(i + 1, nb))
            read, back, pairs = _diagonal(ch.A[i, i], col.g[i], do[i], col.u[i], sums=("read", "back", "pairs"))
            o.append(o_i + read)
            dU.append(du_i + back)
            dA[i, i] = dA[i, i] + pairs
            for j in range(i):
                dA[i, j] = dA[i, j] + _mm(_scaled(Et[i], col.V(i, j)), Ut[j].T, dtype, precision)
            dq_state[i] = dq_state[i] + _mm(col.cont[i] * do[i], h.T, dtype, precision)
            dx_state[i] = dx_state[i] + _mm(col.w[i] * col.u[i], dh.T, dtype, precision)
        for i in range(nb):
            rows = ch.rows[i]
            du_ref[rows, cols] = dU[i].astype(du_ref.dtype)
            dg = do[i] * o[i] - col.u[i] * dU[i]
            if i == nb - 1:
                dg = dg + jnp.where(last_row, end[None, :], 0.0)
            dg_ref[rows, cols] = dg
    for i in range(nb):
        dq, dx = dq_state[i], dx_state[i]
        for j in range(i + 1):
            dq = dq + _mm(jnp.where(ch.mask[i, j], dA[i, j], 0.0), x_ref[ch.rows[j], :], dtype, precision)
        for t in range(i, nb):
            dx = dx + _mm(jnp.where(ch.mask[t, i], dA[t, i], 0.0).T, q_ref[ch.rows[t], :], dtype, precision)
        dq_ref[ch.rows[i], :] = dq.astype(dq_ref.dtype)
        dx_ref[ch.rows[i], :] = dx.astype(dx_ref.dtype)


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


def output_pass(q, x, u, g, rl, h, *, chunk, block_v, interpret, num_warps=4, num_stages=1, heads=None):
    """o (like u) of every chunk from its start state h [BH, n_chunks, dk, dv]."""
    BH, L, _ = token_dims(q, heads)
    sp = chunk_specs(q, u.shape[-1], chunk, heads)
    kernel = functools.partial(_output_kernel, chunk=chunk, block_v=block_v, precision=precision_for(q.dtype))
    (o,) = call(kernel, grid=(BH, L // chunk), in_specs=[sp.k, sp.k, sp.v, sp.v, sp.row, sp.state],
                out_specs=[sp.v], out_shape=[jax.ShapeDtypeStruct(u.shape, u.dtype)], args=(q, x, u, g, rl, h),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_attn_col_out")
    return o


def chunk_grad_pass(q, x, u, g, rl, do, h, dh, *, chunk, block_v, interpret, num_warps=4, num_stages=1, heads=None):
    """Every gradient of every chunk from its start state h and end-state gradient dh ([BH, n_chunks, dk, dv]).

    Returns dq, dx, du (like q, x, u) and dg (like u, fp32; w.r.t. the chunk-local natural-log cumsum)."""
    BH, L, _ = token_dims(q, heads)
    sp = chunk_specs(q, u.shape[-1], chunk, heads)
    kernel = functools.partial(_chunk_grad_kernel, chunk=chunk, block_v=block_v, precision=precision_for(q.dtype))
    return call(kernel, grid=(BH, L // chunk),
                in_specs=[sp.k, sp.k, sp.v, sp.v, sp.row, sp.v, sp.state, sp.state],
                out_specs=[sp.k, sp.k, sp.v, sp.v],
                out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                           jax.ShapeDtypeStruct(u.shape, u.dtype), jax.ShapeDtypeStruct(u.shape, F32)],
                args=(q, x, u, g, rl, do, h, dh), compiler_params=_params(interpret, num_warps, num_stages),
                interpret=interpret, name="falcon_attn_col_grads")


__all__ = ["chunk_grad_pass", "output_pass", "state_grad_pass", "state_pass"]
