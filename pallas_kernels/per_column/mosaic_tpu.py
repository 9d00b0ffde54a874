"""TPU kernels (Pallas, Mosaic TPU lowering) for the decayed delta rule with per-column gates (Falcon-2) and its
inner-product twin without the residual (Falcon-2A).

Same passes, signatures, inputs, outputs and math as Falcon-2's GPU kernels, :mod:`.triton` (so ``api.py`` drives
either), with ``residual=False`` for Falcon-2A (on a GPU Falcon-2A has its own passes, :mod:`.triton_attention`):
``q, x [BH, L, dk]``, ``y [BH, L, dv]``, per-column gates ``eta, g, gp [BH, L, dv]`` (write weight, chunk-local
inclusive and exclusive log-decay cumsums), run index ``rl [BH, L]``, fp32 state ``[BH, dk, dv]``.  Value column
c of a chunk is the scalar-gate chunk form with its own gates (masks cut between segments)::

    A_c[s, j] = [j < s] η_{s,c} (x_s·x_j) e^{gp_{s,c} − g_{j,c}}
    (I + A_c) P[:, c] = η_c ⊙ (Y[:, c] − c⁻_c ⊙ (X S_0)[:, c])
    o[t, c] = c_{t,c} (Q S_0)[t, c] + Σ_{s≤t} (q_t·x_s) e^{g_{t,c} − g_{s,c}} P[s, c]
    S_C[:, c] = a_c S_0[:, c] + Xᵀ (w_c ⊙ P[:, c])

``residual=False`` (Falcon-2A): ``A_c ≡ 0``, no ``S_0`` term in the residual, ``P = η ⊙ Y``.

Layout, in the TPU idiom of :mod:`..decayed_delta_rule.mosaic_tpu`: the grid is (batch·head, value block, chunk) with the chunk axis
``"arbitrary"`` and the ``[dk, block_v]`` fp32 state (the backward: its gradient dS) carried across grid steps
in a VMEM scratch buffer; each grid step sees one chunk's ``[C, dk]`` rows of q and x, ``[C, block_v]`` tiles of
y and the gates, and the run index as a ``[C, 1]`` column and a ``[1, C]`` row block, so no vector transposes are
needed.  The solves are the "rows" form of the GPU kernel (no 16-row blocks: 16-column slices are
lane-misaligned on TPU): loops over the chunk's rows on full ``[C, block_v]`` and ``[C, C]`` tiles, a row or
column picked by a masked select and reduction, a row written by a masked select.  Only differences
``g_a − g_b`` with ``a ≥ b`` are exponentiated (masked entries become −∞ before ``exp``).  Dots are fp32
(HIGHEST precision, ``..decayed_delta_rule.mosaic_tpu._mm``) wherever an operand is fp32; the Gram and ``Q Xᵀ`` in the inputs'
dtype.

Kernels:
  * ``forward_pass`` (``falcon_delta_col_fwd_tpu`` / ``falcon_attn_col_fwd_tpu``): per chunk ``X S_0``,
    ``Q S_0``, the Gram, then one row loop: row s of P by forward substitution from the rows before it and
    row s of the intra-chunk read in the same step; the state update by a dot.  Writes o, optionally the chunk
    start states h, and the end state.
  * ``backward_pass`` (``falcon_delta_col_bwd_tpu`` / ``falcon_attn_col_bwd_tpu``): the chunks in reverse, dS
    in VMEM; per chunk P again from the stored start state h (forward substitution, which also keeps
    ``Σ_{j<s} (x_s·x_j) e^{gp_s − g_j} P_j`` for dη), then a row loop for the transposed read
    ``(QXᵀ ⊙ D_c)ᵀ dO`` that also gives column s of ``d(QXᵀ)`` and accumulates the read ``ō`` (for the decay
    gradient), then the backward substitution ``(I + A_c)ᵀ dR = dP`` that also gives column s of ``d(XXᵀ)``
    from the same exponential tile (three ``[C, block_v]`` exponential tiles per row in all; Falcon-2A one).
    The decay gradients are elementwise, as in the GPU's blocked backward:
    ``Σ_j dA[r, j] A[r, j] = −dR_r (R_r − P_r)``, ``Σ_r dA[r, j] A[r, j] = −P_j (dP_j − dR_j)`` and the read's
    ``dO_t ō_t`` and ``−P_s ((QXᵀ ⊙ D)ᵀ dO)_s``.  Returns every gradient the GPU backward returns, dq and dx as
    one share per value block (``[BH, nv, L, dk]``, summed by the caller).

Mosaic's block rule: a value block must be a multiple of 128 columns or all of dv.  :func:`value_block` gives
the width ``api.py`` asks for on ``"mosaic_tpu"``, in interpret mode too (which itself has no such rule: the
kernels here take any divisor of dv), so the interpret-mode tests run the widths a TPU would.

No TPU is lent to this project: these kernels are tested in TPU interpret mode on CPU
(``interpret=pltpu.InterpretParams()``, which fills unwritten output memory with NaN) against the float64 token
scan, and lowered through the Mosaic TPU lowering rules on CPU (``lowering_platforms=("tpu",)``); they have
never been compiled for or run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from falcon_jax.kernels.common import interpret_tpu
from falcon_jax.kernels.decayed_delta_rule.mosaic_tpu import NT, TN, _mm

F32 = jnp.float32
LANES = 128


def value_block(block_v: int, dv: int) -> int:
    """The value block a compiled TPU kernel can take for ``block_v`` requested of ``dv`` columns: ``block_v``
    if it is a multiple of 128 dividing dv (or all of dv), else 128 where 128 divides dv, else dv."""
    if block_v >= dv:
        return dv
    if block_v % LANES == 0 and dv % block_v == 0:
        return block_v
    return LANES if dv % LANES == 0 else dv


def _row(a, rows, s):
    """Row ``s`` (dynamic) of a 2-D tile as a ``[1, n]`` row; ``rows``: the tile's row iota."""
    return jnp.sum(jnp.where(rows == s, a, 0.0), axis=0, keepdims=True)


def _col(a, cols, s):
    """Column ``s`` (dynamic) of a 2-D tile as an ``[n, 1]`` column; ``cols``: the tile's column iota."""
    return jnp.sum(jnp.where(cols == s, a, 0.0), axis=1, keepdims=True)


def _decay(mask, a, b):
    """``exp(a − b)`` where ``mask``, else 0 (the exponent masked to −∞ first: nothing overflows)."""
    return jnp.exp(jnp.where(mask, a - b, -jnp.inf))


class _Chunk:
    """One chunk's per-column gates (``[C, block_v]``), run index column ``[C, 1]`` and row ``[1, C]``, the
    iotas the row loops select with and the gates of ``.triton._gates`` in this layout."""

    def __init__(self, eta_ref, g_ref, gp_ref, rlc_ref, rlr_ref, chunk):
        self.eta, self.g = eta_ref[...], g_ref[...]
        self.gp = None if gp_ref is None else gp_ref[...]
        self.rl_c, self.rl_r = rlc_ref[...], rlr_ref[...]  # fp32 (small run counts: exact)
        bv = self.g.shape[1]
        self.rows = lax.broadcasted_iota(jnp.int32, (chunk, bv), 0)  # row iota of a [C, block_v] tile
        self.rows_cc = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        self.cols_cc = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        self.idx = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
        self.lanes = lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        g_last = _row(self.g, self.rows, chunk - 1)  # [1, bv]
        rl_last = _col(self.rl_r, self.lanes, chunk - 1)  # [1, 1]
        first = self.rl_c == 0
        self.cont = jnp.where(first, jnp.exp(self.g), 0.0)
        self.cont_p = None if self.gp is None else jnp.where(first, jnp.exp(self.gp), 0.0)
        self.w_last = jnp.where(self.rl_c == rl_last, jnp.exp(g_last - self.g), 0.0)
        self.a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)  # [1, bv]

    def same(self, s):
        """``[C, 1]``: rows in the same segment as row ``s``."""
        return self.rl_c == _col(self.rl_r, self.lanes, s)


def _substitute(ch, gram, R, qxt=None):
    """Column-batched forward substitution ``(I + A_c) P[:, c] = R[:, c]`` row by row; with ``qxt`` (``X Qᵀ``)
    also the intra-chunk read ``ō[s] = Σ_{j≤s} (q_s·x_j) e^{g_s − g_j} P[j]``, row s formed once P's rows up to
    s are final.  Returns (P, ō or None, sg) with ``sg[s] = Σ_{j<s} (x_s·x_j) e^{gp_s − g_j} P[j]`` (for dη).
    ``gram=None``: no system (``P = R``), only the read."""
    C = R.shape[0]
    zeros = jnp.zeros(R.shape, F32)

    def body(s, carry):
        P, O, SG = carry
        same = ch.same(s)
        if gram is not None:
            coef = _col(gram, ch.cols_cc, s)  # x_j·x_s over j (the Gram is symmetric)
            tile = coef * _decay((ch.idx < s) & same, _row(ch.gp, ch.rows, s), ch.g)  # [C(j), bv]
            sg = jnp.sum(tile * P, axis=0, keepdims=True)
            P = jnp.where(ch.rows == s, _row(R, ch.rows, s) - _row(ch.eta, ch.rows, s) * sg, P)
            SG = jnp.where(ch.rows == s, sg, SG)
        if qxt is not None:
            read = _col(qxt, ch.cols_cc, s) * _decay((ch.idx <= s) & same, _row(ch.g, ch.rows, s), ch.g)
            O = jnp.where(ch.rows == s, jnp.sum(read * P, axis=0, keepdims=True), O)
        return P, O, SG

    P, O, SG = lax.fori_loop(jnp.int32(0), jnp.int32(C), body, (zeros if gram is not None else R, zeros, zeros))
    return P, (O if qxt is not None else None), SG


def _forward_kernel(*refs, chunk, write_o, write_h, residual):
    refs = list(refs)
    q_ref, x_ref, y_ref, eta_ref, g_ref = refs[:5]
    gp_ref = refs[5] if residual else None
    refs = refs[6 if residual else 5:]
    rlc_ref, rlr_ref, s0_ref = refs[:3]
    refs = refs[3:]
    o_ref = refs.pop(0) if write_o else None
    h_ref = refs.pop(0) if write_h else None
    s_end_ref, state = refs
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _():
        state[...] = s0_ref[...].astype(F32)

    S = state[...]
    if write_h:
        h_ref[...] = S
    ch = _Chunk(eta_ref, g_ref, gp_ref, rlc_ref, rlr_ref, chunk)
    x = x_ref[...]
    xf = x.astype(F32)
    y = y_ref[...].astype(F32)
    if residual:
        gram = _mm(x, x, NT)
        R = ch.eta * (y - ch.cont_p * _mm(xf, S))
    else:  # inner-product rule: P = η ⊙ Y
        gram, R = None, ch.eta * y
    if write_o:
        q = q_ref[...]
        P, o, _ = _substitute(ch, gram, R, qxt=_mm(x, q, NT))
        o_ref[...] = (o + ch.cont * _mm(q.astype(F32), S)).astype(o_ref.dtype)
    elif residual:
        P, _, _ = _substitute(ch, gram, R)
    else:
        P = R
    S = ch.a_last * S + _mm(xf, ch.w_last * P, TN)
    state[...] = S

    @pl.when(c == pl.num_programs(2) - 1)
    def _():
        s_end_ref[...] = S


def _backward_kernel(*refs, chunk, residual):
    refs = list(refs)
    q_ref, x_ref, y_ref, eta_ref, g_ref = refs[:5]
    gp_ref = refs[5] if residual else None
    refs = refs[6 if residual else 5:]
    rlc_ref, rlr_ref, do_ref, h_ref, ds_end_ref, dq_ref, dx_ref, dy_ref, deta_ref, dg_ref = refs[:10]
    refs = refs[10:]
    dgp_ref = refs.pop(0) if residual else None
    ds_start_ref, dstate = refs
    C = chunk
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _():
        dstate[...] = ds_end_ref[...].astype(F32)

    dS = dstate[...]
    ch = _Chunk(eta_ref, g_ref, gp_ref, rlc_ref, rlr_ref, chunk)
    eta, g = ch.eta, ch.g
    q, x = q_ref[...], x_ref[...]
    qf, xf = q.astype(F32), x.astype(F32)
    y, do = y_ref[...].astype(F32), do_ref[...].astype(F32)
    h = h_ref[...]
    qx = _mm(q, x, NT)  # [t, s] = q_t·x_s
    if residual:
        gram = _mm(x, x, NT)
        xh = _mm(xf, h)
        target = y - ch.cont_p * xh
        R = eta * target
        P, _, sg = _substitute(ch, gram, R)
    else:
        target = y
        R = P = eta * y
    xds = _mm(xf, dS)
    zeros = jnp.zeros(do.shape, F32)
    zc = jnp.zeros((C, C), F32)

    def read_t(s, carry):
        """dPr[s] = Σ_{t≥s} (q_t·x_s) e^{g_t − g_s} dO[t]; d(QXᵀ)[t, s] = Σ_c e^{g_t − g_s} P[s] dO[t];
        ō[t] += (q_t·x_s) e^{g_t − g_s} P[s] (t ≥ s), all from one exponential tile."""
        dPr, d_qx, obar = carry
        F = _decay((ch.idx >= s) & ch.same(s), g, _row(g, ch.rows, s))  # [C(t), bv]
        coef = _col(qx, ch.cols_cc, s)  # q_t·x_s over t
        f_do = F * do
        p_s = _row(P, ch.rows, s)
        dPr = jnp.where(ch.rows == s, jnp.sum(coef * f_do, axis=0, keepdims=True), dPr)
        d_qx = jnp.where(ch.cols_cc == s, jnp.sum(f_do * p_s, axis=1, keepdims=True), d_qx)
        return dPr, d_qx, obar + coef * F * p_s

    dPr, d_qx, obar = lax.fori_loop(jnp.int32(0), jnp.int32(C), read_t, (zeros, zc, zeros))
    wp = ch.w_last * P
    dP = dPr + ch.w_last * xds

    if residual:
        def solve_t(k, carry):
            """(I + A_c)ᵀ dR = dP: dR[s] = dP[s] − Σ_{t>s} A_c[t, s] dR[t], last row first; and
            d(XXᵀ)[t, s] = −Σ_c η_t dR_t e^{gp_t − g_s} P[s] (t > s) from the same tile."""
            dR, d_gram = carry
            s = C - 1 - k
            u = eta * _decay((ch.idx > s) & ch.same(s), ch.gp, _row(g, ch.rows, s)) * dR  # [C(t), bv]
            coef = _col(gram, ch.cols_cc, s)  # x_t·x_s over t
            dR = jnp.where(ch.rows == s, _row(dP, ch.rows, s) - jnp.sum(coef * u, axis=0, keepdims=True), dR)
            d_gram = jnp.where(ch.cols_cc == s, -jnp.sum(u * _row(P, ch.rows, s), axis=1, keepdims=True), d_gram)
            return dR, d_gram

        dR, d_gram = lax.fori_loop(jnp.int32(0), jnp.int32(C), solve_t, (zeros, zc))
    else:
        dR = dP
    cdo = ch.cont * do
    dq = _mm(cdo, h, NT) + _mm(d_qx, xf)
    dx = _mm(d_qx, qf, TN) + _mm(wp, dS, NT)
    ds = ch.a_last * dS + _mm(qf, cdo, TN)
    dg = do * obar - P * dPr + cdo * _mm(qf, h) - wp * xds
    if residual:
        edr = eta * ch.cont_p * dR
        dx = dx - _mm(edr, h, NT) + _mm(d_gram, xf) + _mm(d_gram, xf, TN)
        dg = dg + P * (dP - dR)
        dgp_ref[...] = -dR * (R - P) - edr * xh
        deta_ref[...] = dR * (target - sg)
        ds = ds - _mm(xf, edr, TN)
    else:
        deta_ref[...] = dR * target
    # the chunk end: g at the last row moves w (Σ_s w_s P_s (X dS)_s) and a (a ⟨h, dS⟩)
    end = jnp.sum(wp * xds, axis=0, keepdims=True) + ch.a_last * jnp.sum(h * dS, axis=0, keepdims=True)
    dg_ref[...] = dg + jnp.where(ch.rows == C - 1, end, 0.0)
    dq_ref[...] = dq
    dx_ref[...] = dx
    dy_ref[...] = (eta * dR).astype(dy_ref.dtype)
    dstate[...] = ds

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        ds_start_ref[...] = ds


def _run_blocks(rl, chunk):
    """The run index as fp32 ``[BH, n, C, 1]`` columns and ``[BH, n, 1, C]`` rows."""
    BH, L = rl.shape
    r = rl.astype(F32).reshape(BH, L // chunk, chunk)
    return r[..., :, None], r[..., None, :]


def _check(dv, block_v):
    if dv % block_v:
        raise ValueError(f"per_column mosaic_tpu: block_v={block_v} must divide dv={dv}")


def forward_pass(q, x, y, eta, g, gp, rl, s0, *, chunk, block_v, write_o, write_h, interpret, num_warps=None,
                 num_stages=None, residual=True):
    """See :func:`.triton.forward_pass` (the same inputs and outputs; ``num_warps`` and ``num_stages`` are GPU
    choices, ignored; the TPU kernel solves row by row, not in 16-row blocks).  Grid (batch·head, value block,
    chunk).  Returns (o [BH, L, dv] if write_o, h [BH, n_chunks, dk, dv] if write_h, s_end [BH, dk, dv])."""
    del num_warps, num_stages
    BH, L, dk = q.shape
    dv = y.shape[-1]
    _check(dv, block_v)
    n = L // chunk
    rows_k = pl.BlockSpec((None, chunk, dk), lambda b, v, c: (b, c, 0))
    rows_v = pl.BlockSpec((None, chunk, block_v), lambda b, v, c: (b, c, v))
    run_c = pl.BlockSpec((None, None, chunk, 1), lambda b, v, c: (b, c, 0, 0))
    run_r = pl.BlockSpec((None, None, 1, chunk), lambda b, v, c: (b, c, 0, 0))
    state = pl.BlockSpec((None, dk, block_v), lambda b, v, c: (b, 0, v))
    gates = (eta, g, gp) if residual else (eta, g)  # no residual: gp unused, not read
    in_specs = [rows_k, rows_k, rows_v] + [rows_v] * len(gates) + [run_c, run_r, state]
    out_shape, out_specs = [], []
    if write_o:
        out_shape.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        out_specs.append(rows_v)
    if write_h:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), F32))
        out_specs.append(pl.BlockSpec((None, None, dk, block_v), lambda b, v, c: (b, c, 0, v)))
    out_shape.append(jax.ShapeDtypeStruct((BH, dk, dv), F32))
    out_specs.append(state)
    return pl.pallas_call(
        functools.partial(_forward_kernel, chunk=chunk, write_o=write_o, write_h=write_h, residual=residual),
        grid=(BH, dv // block_v, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, block_v), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_tpu(interpret), name="falcon_delta_col_fwd_tpu" if residual else "falcon_attn_col_fwd_tpu",
    )(q, x, y, *(a.astype(F32) for a in gates), *_run_blocks(rl, chunk), s0.astype(F32))


def backward_pass(q, x, y, eta, g, gp, rl, do, h, ds_end, *, chunk, block_v, interpret, num_warps=None,
                  num_stages=None, residual=True):
    """See :func:`.triton.backward_pass`: the reverse walk (grid step i visits chunk n-1-i) with every
    gradient.  h [BH, n_chunks, dk, dv] chunk start states, ds_end [BH, dk, dv].

    Returns dq, dx [BH, nv, L, dk] fp32 (one share per value block: sum over axis 1), dy [BH, L, dv], fp32
    [BH, L, dv]: deta, dg (w.r.t. the chunk-local inclusive cumsum g), dgp (the exclusive one; None with
    ``residual=False``), and ds_start [BH, dk, dv].
    """
    del num_warps, num_stages
    BH, L, dk = q.shape
    dv = y.shape[-1]
    _check(dv, block_v)
    n = L // chunk
    nv = dv // block_v
    rows_k = pl.BlockSpec((None, chunk, dk), lambda b, v, i: (b, n - 1 - i, 0))
    rows_v = pl.BlockSpec((None, chunk, block_v), lambda b, v, i: (b, n - 1 - i, v))
    run_c = pl.BlockSpec((None, None, chunk, 1), lambda b, v, i: (b, n - 1 - i, 0, 0))
    run_r = pl.BlockSpec((None, None, 1, chunk), lambda b, v, i: (b, n - 1 - i, 0, 0))
    h_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, v, i: (b, n - 1 - i, 0, v))
    state = pl.BlockSpec((None, dk, block_v), lambda b, v, i: (b, 0, v))
    share = pl.BlockSpec((None, None, chunk, dk), lambda b, v, i: (b, v, n - 1 - i, 0))
    gates = (eta, g, gp) if residual else (eta, g)
    n_vec = 3 if residual else 2  # deta, dg (, dgp)
    vec = jax.ShapeDtypeStruct((BH, L, dv), F32)
    outs = pl.pallas_call(
        functools.partial(_backward_kernel, chunk=chunk, residual=residual), grid=(BH, nv, n),
        in_specs=[rows_k, rows_k, rows_v] + [rows_v] * len(gates) + [run_c, run_r, rows_v, h_spec, state],
        out_specs=[share, share, rows_v] + [rows_v] * n_vec + [state],
        out_shape=[jax.ShapeDtypeStruct((BH, nv, L, dk), F32), jax.ShapeDtypeStruct((BH, nv, L, dk), F32),
                   jax.ShapeDtypeStruct((BH, L, dv), y.dtype)] + [vec] * n_vec
        + [jax.ShapeDtypeStruct((BH, dk, dv), F32)],
        scratch_shapes=[pltpu.VMEM((dk, block_v), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_tpu(interpret), name="falcon_delta_col_bwd_tpu" if residual else "falcon_attn_col_bwd_tpu",
    )(q, x, y, *(a.astype(F32) for a in gates), *_run_blocks(rl, chunk), do, h.astype(F32), ds_end.astype(F32))
    return tuple(outs) if residual else (*outs[:5], None, outs[5])
