"""TPU kernels (Pallas, Mosaic TPU lowering) for the decayed delta rule.

Same passes, signatures and math as the Triton ones (so ``op.py`` drives
either), in the TPU idiom of the decayed-attention TPU op: the walks' grid is
(batch·head, chunk) with the chunk axis ``"arbitrary"`` and the state carried
across grid steps in a VMEM scratch buffer; per-position gates come as column
``[C, 1]`` and row ``[1, C]`` blocks, so no vector transposes are needed (a
column sum is a ``Mᵀ·1`` matmul).  The triangular inverse is forward
substitution row by row over the whole chunk on full ``[C, C]`` tiles (masked
selects and reductions; no 16-column slices, which are lane-misaligned on TPU).
No sequence split on TPU (``pieces`` must be 1).

No TPU is lent to this project: these kernels are tested in TPU interpret
mode on CPU only (``interpret=pltpu.InterpretParams()``, which also fills
unwritten output memory with NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from falcon_jax.kernels.common import interpret_tpu

F32 = jnp.float32
NN = (((1,), (0,)), ((), ()))  # a @ b
NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _mm(a, b, dims=NN, precise=True):
    precision = lax.Precision.HIGHEST if precise and (a.dtype == F32 or b.dtype == F32) else None
    return lax.dot_general(a, b, dims, preferred_element_type=F32, precision=precision)


def _layout(eta, g, gp, rl, chunk):
    """Each gate as a column block [BH, n, C, 1] and a row block [BH, n, 1, C]."""
    BH, L = g.shape
    n = L // chunk
    out = []
    for a in (eta, g, gp, rl):
        a = a.reshape(BH, n, chunk)
        out += [a[..., :, None], a[..., None, :]]
    return out


def _gate_specs(chunk, index):
    col = pl.BlockSpec((None, None, chunk, 1), index)
    row = pl.BlockSpec((None, None, 1, chunk), index)
    return [col, row] * 4


def _earlier(rows, cols, group):
    """``cols`` in an earlier group than ``rows`` (groups of ``group`` rows, a power of two: the virtual writes
    of one step of a windowed rule); ``cols < rows`` for group 1."""
    if group == 1:
        return rows > cols
    shift = jnp.int32(group.bit_length() - 1)
    return lax.shift_right_logical(rows, shift) > lax.shift_right_logical(cols, shift)


class _Gates:
    """Gates of one chunk from its 8 refs (column and row of eta, g, gp, rl)."""

    def __init__(self, refs, chunk, group=1):
        ec, er, gc, gr, pc, pr, rc, rr = (r[...] for r in refs)
        self.eta_c, self.eta_r, self.g_c, self.g_r, self.gp_c, self.gp_r = ec, er, gc, gr, pc, pr
        self.rl_c, self.rl_r = rc, rr
        g_last, rl_last = gr[:, chunk - 1:chunk], rr[:, chunk - 1:chunk]  # [1,1]
        rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        same = rc == rr
        self.rows, self.cols, self.same = rows, cols, same
        self.decay = jnp.exp(jnp.where((rows >= cols) & same, gc - gr, -jnp.inf))  # e^{g_t − g_s}, s ≤ t
        self.earlier = _earlier(rows, cols, group)  # j in an earlier group than s (group 1: j < s)
        self.gamma = jnp.exp(jnp.where(self.earlier & same, pc - gr, -jnp.inf))  # e^{gp_s − g_j}
        self.cont = jnp.where(rc == 0, jnp.exp(gc), 0.0)
        self.cont_p = jnp.where(rc == 0, jnp.exp(pc), 0.0)
        self.w_last = jnp.where(rc == rl_last, jnp.exp(g_last - gc), 0.0)
        self.a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)  # [1,1]


def _tri_kernel(x_ref, *refs, chunk, group):
    *gate_refs, t_ref = refs
    gt = _Gates(gate_refs, chunk, group)
    x = x_ref[...]
    gram = _mm(x, x, NT)
    # Aᵀ[m, s] = A[s, m] = η_s (x_s·x_m) e^{gp_s − g_m} (m < s): the Gram is symmetric, the rest by masks
    gamma_t = jnp.exp(jnp.where(_earlier(gt.cols, gt.rows, group) & gt.same, gt.gp_r - gt.g_c, -jnp.inf))
    a_t = gt.eta_r * gram * gamma_t
    rows, cols = gt.rows, gt.cols

    def body(r, t):
        a_col = jnp.sum(jnp.where(cols == r, a_t, 0.0), axis=1, keepdims=True)  # [C,1]: A[r, m] over m
        new = jnp.sum(a_col * t, axis=0, keepdims=True)  # [1,C]: A[r, :] @ t (rows < r of t are final)
        return jnp.where(rows == r, t - new, t)

    t_ref[...] = lax.fori_loop(jnp.int32(1), jnp.int32(chunk), body,  # int32 index (also under x64)
                               jnp.where(rows == cols, 1.0, 0.0).astype(F32))


def tri_inverse_pass(x, eta, g, gp, rl, *, chunk, interpret, num_warps=None, num_stages=None, group=1):
    """See :func:`.triton.triangular_inverse.tri_inverse_pass`."""
    del num_warps, num_stages
    BH, L, dk = x.shape
    n = L // chunk
    at = lambda b, c: (b, c, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_tri_kernel, chunk=chunk, group=group), grid=(BH, n),
        in_specs=[pl.BlockSpec((None, chunk, dk), at), *_gate_specs(chunk, lambda b, c: (b, c, 0, 0))],
        out_specs=pl.BlockSpec((None, chunk, chunk), at),
        out_shape=jax.ShapeDtypeStruct((BH, L, chunk), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_tpu(interpret), name="falcon_delta_tri_inverse_tpu",
    )(x, *_layout(eta, g, gp, rl, chunk))


def _forward_kernel(q_ref, x_ref, y_ref, *refs, chunk, write_o, write_h):
    refs = list(refs)
    gate_refs, (t_ref, s0_ref) = refs[:8], refs[8:10]
    refs = refs[10:]
    o_ref = refs.pop(0) if write_o else None
    h_ref = refs.pop(0) if write_h else None
    s_end_ref, state = refs
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        state[...] = s0_ref[...].astype(F32)

    S = state[...]
    if write_h:
        h_ref[...] = S
    gt = _Gates(gate_refs, chunk)
    x, y = x_ref[...], y_ref[...]
    xf = x.astype(F32)
    P = _mm(t_ref[...], gt.eta_c * (y.astype(F32) - gt.cont_p * _mm(xf, S)))
    if write_o:
        q = q_ref[...]
        scores = _mm(q, x, NT) * gt.decay
        o_ref[...] = (_mm(scores, P) + gt.cont * _mm(q.astype(F32), S)).astype(o_ref.dtype)
    S = gt.a_last * S + _mm(xf * gt.w_last, P, TN)
    state[...] = S

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        s_end_ref[...] = S


def forward_pass(q, x, y, eta, g, gp, rl, tinv, s0, *, chunk, pieces, block_v, write_o, write_h, interpret,
                 num_warps=None, num_stages=None, walk_operands=None):
    """See :func:`.triton.forward.forward_pass` (``pieces`` must be 1; block_v is the whole dv; the walk's operands
    stay fp32: ``walk_operands`` is a GPU choice)."""
    del block_v, num_warps, num_stages, walk_operands
    if pieces != 1:
        raise NotImplementedError("mosaic_tpu decayed_delta_rule: no sequence split (pieces must be 1)")
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    at = lambda b, c: (b, c, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, chunk, dk), at), pl.BlockSpec((None, chunk, dk), at),
                pl.BlockSpec((None, chunk, dv), at), *_gate_specs(chunk, lambda b, c: (b, c, 0, 0)),
                pl.BlockSpec((None, chunk, chunk), at),
                pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, 0, 0, 0))]
    out_shape, out_specs = [], []
    if write_o:
        out_shape.append(jax.ShapeDtypeStruct((BH, L, dv), y.dtype))
        out_specs.append(pl.BlockSpec((None, chunk, dv), at))
    if write_h:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), F32))
        out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, c, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((BH, 1, dk, dv), F32))
    out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, 0, 0, 0)))
    return pl.pallas_call(
        functools.partial(_forward_kernel, chunk=chunk, write_o=write_o, write_h=write_h), grid=(BH, n),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_tpu(interpret), name="falcon_delta_fwd_tpu",
    )(q, x, y, *_layout(eta, g, gp, rl, chunk), tinv, s0)


def _state_grad_kernel(q_ref, x_ref, *refs, chunk, write_dh):
    refs = list(refs)
    gate_refs, (t_ref, do_ref, ds_end_ref) = refs[:8], refs[8:11]
    refs = refs[11:]
    dh_ref = refs.pop(0) if write_dh else None
    ds_start_ref, dstate = refs
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dstate[...] = ds_end_ref[...].astype(F32)

    dS = dstate[...]
    if write_dh:
        dh_ref[...] = dS
    gt = _Gates(gate_refs, chunk)
    q, x = q_ref[...], x_ref[...]
    xf = x.astype(F32)
    do = do_ref[...].astype(F32)
    scores = _mm(q, x, NT) * gt.decay
    dP = _mm(scores, do, TN) + gt.w_last * _mm(xf, dS)
    dR = _mm(t_ref[...], dP, TN)
    dS = (gt.a_last * dS + _mm(q.astype(F32) * gt.cont, do, TN) - _mm(xf * (gt.eta_c * gt.cont_p), dR, TN))
    dstate[...] = dS

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        ds_start_ref[...] = dS


def state_grad_pass(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret,
                    num_warps=None, num_stages=None, walk_operands=None):
    """See :func:`.triton.state_grads.state_grad_walk` (reverse walk: grid step i visits chunk n-1-i)."""
    del block_v, num_warps, num_stages, walk_operands
    if pieces != 1:
        raise NotImplementedError("mosaic_tpu decayed_delta_rule: no sequence split (pieces must be 1)")
    BH, L, dk = q.shape
    dv = do.shape[-1]
    n = L // chunk
    rev = lambda b, i: (b, n - 1 - i, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, chunk, dk), rev), pl.BlockSpec((None, chunk, dk), rev),
                *_gate_specs(chunk, lambda b, i: (b, n - 1 - i, 0, 0)), pl.BlockSpec((None, chunk, chunk), rev),
                pl.BlockSpec((None, chunk, dv), rev), pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, 0, 0, 0))]
    out_shape, out_specs = [], []
    if write_dh:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), F32))
        out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, n - 1 - i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((BH, 1, dk, dv), F32))
    out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, 0, 0, 0)))
    return pl.pallas_call(
        functools.partial(_state_grad_kernel, chunk=chunk, write_dh=write_dh), grid=(BH, n),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_tpu(interpret), name="falcon_delta_dstate_tpu",
    )(q, x, *_layout(eta, g, gp, rl, chunk), tinv, do, ds_end)


def _chunk_grad_kernel(q_ref, x_ref, y_ref, *refs, chunk, group):
    """One chunk's gradients from T, h and dh; the per-position gradients are ``[C, 1]`` columns."""
    gate_refs = refs[:8]
    t_ref, do_ref, h_ref, dh_ref, dq_ref, dx_ref, dy_ref, deta_ref, dg_ref, dgp_ref = refs[8:]
    gt = _Gates(gate_refs, chunk, group)
    q, x = q_ref[...], x_ref[...]
    qf, xf = q.astype(F32), x.astype(F32)
    y, do = y_ref[...].astype(F32), do_ref[...].astype(F32)
    h, dh, tinv = h_ref[...], dh_ref[...], t_ref[...]
    eta, cont, cont_p, w_last = gt.eta_c, gt.cont, gt.cont_p, gt.w_last
    ones = jnp.ones((chunk, 1), F32)

    def col_sum(m):  # Σ_t m[t, s] as a column [C, 1]
        return _mm(m, ones, TN)

    scores = _mm(q, x, NT) * gt.decay
    gram = _mm(x, x, NT)
    xh = _mm(xf, h)
    target = y - cont_p * xh
    P = _mm(tinv, eta * target)
    xdh = _mm(xf, dh)
    dP = _mm(scores, do, TN) + w_last * xdh
    dR = _mm(tinv, dP, TN)
    d_a = -_mm(dR, P, NT)
    d_op = _mm(do, P, NT)
    do_h = _mm(do, h, NT)
    dr_h = _mm(dR, h, NT)
    p_dh = _mm(P, dh, NT)
    d_scores = d_op * gt.decay
    d_k = d_a * eta * gt.gamma
    a_grad = d_k * gram
    dq = cont * do_h + _mm(d_scores, xf)
    dx = (_mm(d_scores, qf, TN) + w_last * p_dh - (eta * cont_p) * dr_h + _mm(d_k, xf) + _mm(d_k, xf, TN))
    d_decay = d_op * scores
    wl_term = w_last * jnp.sum(xdh * P, axis=1, keepdims=True)
    end = jnp.sum(wl_term) + jnp.sum(gt.a_last * jnp.sum(h * dh))
    last = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) == chunk - 1
    dg_ref[...] = (jnp.sum(d_decay, axis=1, keepdims=True) - col_sum(d_decay)
                   + cont * jnp.sum(do_h * qf, axis=1, keepdims=True) - col_sum(a_grad) - wl_term
                   + jnp.where(last, end, 0.0))
    deta_ref[...] = (jnp.sum(dR * target, axis=1, keepdims=True)
                     + jnp.sum(d_a * gram * gt.gamma, axis=1, keepdims=True))
    dgp_ref[...] = -eta * cont_p * jnp.sum(dR * xh, axis=1, keepdims=True) + jnp.sum(a_grad, axis=1, keepdims=True)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dy_ref[...] = (eta * dR).astype(dy_ref.dtype)


def chunk_grad_pass(q, x, y, eta, g, gp, rl, tinv, do, h, dh, *, chunk, block_v, interpret, num_warps=None,
                    num_stages=None, group=1):
    """Every chunk's dq, dx, dy and the gate gradients from T and the chunk states h, dh (the GPU's
    :func:`.triton.chunk_grads.chunk_grad_pass` reads the P and dR its walks stored instead)."""
    del block_v, num_warps, num_stages
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    at = lambda b, c: (b, c, 0)  # noqa: E731
    row_k, row_v = pl.BlockSpec((None, chunk, dk), at), pl.BlockSpec((None, chunk, dv), at)
    state = pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, c, 0, 0))
    col = pl.BlockSpec((None, None, chunk, 1), lambda b, c: (b, c, 0, 0))
    vec = jax.ShapeDtypeStruct((BH, n, chunk, 1), F32)
    dq, dx, dy, deta, dg, dgp = pl.pallas_call(
        functools.partial(_chunk_grad_kernel, chunk=chunk, group=group), grid=(BH, n),
        in_specs=[row_k, row_k, row_v, *_gate_specs(chunk, lambda b, c: (b, c, 0, 0)),
                  pl.BlockSpec((None, chunk, chunk), at), row_v, state, state],
        out_specs=[row_k, row_k, row_v, col, col, col],
        out_shape=[jax.ShapeDtypeStruct((BH, L, dk), q.dtype), jax.ShapeDtypeStruct((BH, L, dk), x.dtype),
                   jax.ShapeDtypeStruct((BH, L, dv), y.dtype), vec, vec, vec],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_tpu(interpret), name="falcon_delta_chunk_grads_tpu",
    )(q, x, y, *_layout(eta, g, gp, rl, chunk), tinv, do, h, dh)
    return dq, dx, dy, deta.reshape(BH, L), dg.reshape(BH, L), dgp.reshape(BH, L)
