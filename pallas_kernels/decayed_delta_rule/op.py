"""The kernel op of ``decayed_delta_rule``: which passes run, in which order, forward and backward
(``jax.custom_vjp``; nothing is differentiated through a ``pallas_call``).

Operands are the kernels' (padded, flattened) arrays: tokens ``[BH, L, d]`` or, with ``heads=H``, the model's
``[B, L, H, d]`` read in place; gates ``[BH, L]``; the initial state ``[BH, dk, dv]`` fp32.  With ``group > 1``
every step has ``group`` rows (Falcon-3's virtual writes, :mod:`..windowed_delta_rule`).  With
``decay_before_residual`` (Gated DeltaNet's residual on the decayed state) every pass is the same with the residual
decay ``g⁻`` replaced by ``g`` (:func:`_gates`), and the log-decay gradient sums accordingly (:func:`_log_gamma_grad`).

Forward: per chunk ``T = (I + A)⁻¹`` (parallel over chunks), then a walk over the chunks carrying the fp32
state and writing the outputs — fused, or split (``W``, ``U`` per chunk, a state-only walk, then the outputs in
parallel) when few programs would walk.  When batch·heads leave the GPU idle the sequence is cut into pieces:
each piece's walk is an affine map of its initial state, ``S_end = M S_start + E`` (M a ``dk × dk`` matrix: the
delta rule's transition is ``a I − Xᵀ diag(w) T diag(η c⁻) X`` per chunk); one state walk over ``[I | 0]`` with
values ``[0 | U]`` gives every piece's ``[M | E]``, a short scan over pieces (XLA) their true initial states, and
the walk runs from those (exact).

Backward (GPU): ``T`` and the chunk start states recomputed (the recompute walk also stores ``P``), a reverse walk
for the state gradients (storing ``dR``; pieces likewise, with ``Mᵀ``), then every chunk's dq, dx, dy, dη and
log-decay gradients from the stored ``P`` and ``dR``.  The TPU backward walks with T inside its fused walks and
forms the chunk gradients from T.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import chunk_local, chunk_state_dtype, reverse_chunk_cumsum, shift_time, token_dims
from falcon_jax.kernels.decayed_delta_rule import mosaic_tpu
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu import prepare as mosaic_prepare
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu import walks as mosaic_walks
from falcon_jax.kernels.decayed_delta_rule.shifted_keys import first_row_grads, fold_first_row
from falcon_jax.kernels.decayed_delta_rule.triton import chunk_grads, forward, state_grads
from falcon_jax.kernels.decayed_delta_rule.triton.triangular_inverse import tri_inverse_pass

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
    """The op's static arguments: chunk rows, the config (its ``block_v`` and ``grad_block_v`` resolved for the
    call), pieces, interpret mode, the implementation ("mosaic_gpu", "triton" or "mosaic_tpu"), rows per step
    (``group``), heads (tokens read in place), whether x holds the keys read one row back (``key_shift``) and
    whether the residual is read from the decayed state (``decay_before_residual``: every pass gets ``gp = g``,
    :func:`_gates`)."""

    chunk: int
    config: KernelConfig
    pieces: int
    interpret: bool
    implementation: str
    group: int = 1
    heads: int | None = None
    key_shift: bool = False
    decay_before_residual: bool = False

    @property
    def tpu(self) -> bool:
        return self.implementation == "mosaic_tpu"


def _mosaic_or_triton(st: Static, mosaic_pass, triton_pass):
    """``triton_pass``, or under ``"mosaic_gpu"`` ``mosaic_pass`` called with the same arguments, handing a call it
    does not serve (NotImplementedError) back to ``triton_pass``."""
    if st.implementation != "mosaic_gpu":
        return triton_pass

    def either(*args, **kw):
        try:
            return mosaic_pass(*args, **kw)
        except NotImplementedError:
            return triton_pass(*args, **kw)

    return either


def _fused_walk(st: Static):
    """The fused walk of the forward and of the backward's recompute (``forward_pass``'s call): the Mosaic GPU
    cluster walk where it serves (one piece, 64-column blocks), else Triton; the TPU's on a TPU."""
    if st.tpu:
        return mosaic_tpu.forward_pass
    if st.pieces != 1:
        return forward.forward_pass
    return _mosaic_or_triton(st, functools.partial(mosaic_walks.forward_walk, stages=st.config.mosaic_walk_stages),
                             forward.forward_pass)


def _tri_inverse(st: Static, x, eta, g, gp, rl, dtype):
    if st.tpu:
        return mosaic_tpu.tri_inverse_pass(x, eta, g, gp, rl, chunk=st.chunk, interpret=st.interpret, group=st.group)
    return tri_inverse_pass(x, eta, g, gp, rl, chunk=st.chunk, interpret=st.interpret, group=st.group,
                            num_warps=st.config.tri_warps, t_dtype=st.config.tri_store_dtype(dtype), heads=st.heads,
                            key_shift=st.key_shift)


def _gates(log_gamma, run, chunk, group=1, decay_before_residual=False):
    """Per-row chunk-local g, gp and run index: ``gp = g − log γ``, the decay from the chunk's start to the
    residual of the row, read from the undecayed state; with ``decay_before_residual`` (the residual read from
    the decayed state, Gated DeltaNet) the row's own decay is in it, ``gp = g``, and every pass runs unchanged.
    ``group > 1``: ``log_gamma`` and ``run`` are per *step* ``[BH, L / group]`` and every step has ``group``
    rows, which all share the step's g (write decay) and gp (residual decay)."""
    steps = chunk // group
    g, rl = chunk_local(log_gamma, run, steps)
    gp = g if decay_before_residual else g - log_gamma
    if group == 1:
        return g, gp, rl
    rows = functools.partial(jnp.repeat, repeats=group, axis=1)
    return rows(g), rows(gp), rows(rl)


def _log_gamma_grad(dg, dgp, chunk, group, decay_before_residual=False):
    """Gradient w.r.t. log γ from the kernels' gradients w.r.t. the rows' g and gp (each taken as its own
    operand).  ``log γ_t`` is in ``g_s`` for every row s ≥ t of its chunk, and in ``gp_s = g_s − log γ_s`` for
    s > t only, so ``∂/∂log γ_t = Σ_{s ≥ t} (dg_s + dgp_s) − dgp_t``; with ``decay_before_residual`` (``gp = g``)
    it is in ``gp_s`` for s ≥ t as well and the ``− dgp_t`` goes: a reverse cumulative sum, no division by γ."""
    if group > 1:
        BH, L = dg.shape
        dg, dgp = (a.reshape(BH, L // group, group).sum(-1) for a in (dg, dgp))
    total = reverse_chunk_cumsum(dg + dgp, chunk // group)
    return total if decay_before_residual else total - dgp


def _piece_starts(M, E, s0):
    """True initial state of each piece: S(p+1) = M_p S(p) + E_p, S(0) = s0. Returns ([BH,P,dk,dv], final)."""

    def step(S, inp):
        m, e = inp
        return jnp.einsum("bij,bjd->bid", m, S, precision=jax.lax.Precision.HIGHEST) + e, S

    final, starts = jax.lax.scan(step, s0, (jnp.moveaxis(M, 1, 0), jnp.moveaxis(E, 1, 0)))
    return jnp.moveaxis(starts, 0, 1), final


def _walk_kw(st: Static, dtype, num_warps, num_stages, block_v):
    return dict(chunk=st.chunk, pieces=st.pieces, block_v=block_v, interpret=st.interpret, num_warps=num_warps,
                num_stages=num_stages, walk_operands=st.config.walk_dtype(dtype),
                **({} if st.heads is None else {"heads": st.heads}))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def kernel_op(q, x, y, eta, log_gamma, run, s0, st: Static):
    """``(o, final state [BH, dk, dv] fp32)``; with ``st.key_shift`` s0 is ``(s0, first_key [BH, dk])``."""
    out, _ = _forward(q, x, y, eta, log_gamma, run, s0, st)
    return out


def _forward(q, x, y, eta, log_gamma, run, s0, st: Static):
    cfg, keys = st.config, {"key_shift": True} if st.key_shift else {}
    fold = None
    if st.key_shift:  # s0 is (s0, first_key): row 0's step is folded into s0 here, so that the backward forms its
        # gradient w.r.t. y's row 0 through the chunk gradients' dy (an XLA sum would copy all of dy)
        (s0, eta, log_gamma, run), fold = fold_first_row(*s0, y, eta, log_gamma, run, st.heads,
                                                         st.decay_before_residual)
    BH, _, dk = token_dims(q, st.heads)
    dv = y.shape[-1]
    g, gp, rl = _gates(log_gamma, run, st.chunk, st.group, st.decay_before_residual)
    tinv = _tri_inverse(st, x, eta, g, gp, rl, q.dtype)
    kw = _walk_kw(st, q.dtype, cfg.fwd_warps, cfg.walk_stages(), cfg.block_v)
    M = wu = None
    if st.pieces > 1:  # the pieces' maps [M | E] from W, U (the split forward's), then their true initial states
        wu = forward.prepare_wu(x, y, eta, g, gp, rl, tinv, chunk=st.chunk, interpret=st.interpret,
                                num_warps=cfg.fwd_warps, heads=st.heads, w_dtype=kw["walk_operands"] or F32)
        # as wide as the split state walk's programs, over dk + dv columns (block_v divides both)
        map_block_v = min(cfg.split_block_v_for(BH * st.pieces, dv), dk)
        M, E = forward.piece_maps(x, *wu, g, rl, **dict(kw, block_v=map_block_v))
        starts, _ = _piece_starts(M, E, s0)
    else:
        starts = s0[:, None]
    if not st.tpu and cfg.split_forward(BH, dv, cfg.block_v):
        o, _, s_end = forward.split_forward(q, x, y, eta, g, gp, rl, tinv, starts, wu=wu,
                                            **dict(kw, block_v=cfg.split_block_v_for(BH * st.pieces, dv)))
    else:
        output_programs = BH * st.pieces * (dv // cfg.block_v)
        narrow = jnp.dtype(q.dtype).itemsize == 2 and dk <= 128 and cfg.block_v <= 16
        walk = _fused_walk(st)
        # the Mosaic walk reads the scores (a Triton walk it hands the call back to reads them too)
        mosaic_walk = st.implementation == "mosaic_gpu" and st.pieces == 1 and cfg.block_v == mosaic_walks.BLOCK_V
        if not st.tpu and (cfg.scores_kernel(output_programs) or mosaic_walk):
            kw["scores"] = forward.masked_scores_pass(q, x, g, rl, chunk=st.chunk, interpret=st.interpret,
                                                      heads=st.heads, dtype=kw["walk_operands"] or F32, **keys)
        kw["num_stages"] = cfg.output_walk_stages(output_programs, narrow)
        o, s_end = walk(q, x, y, eta, g, gp, rl, tinv, starts, write_o=True, write_h=False, **kw, **keys)
    # the pieces' transitions M ([BH, P, dk, dk] fp32) are kept for the backward's reverse scan over pieces
    return (o, s_end[:, -1]), (q, x, y, eta, g, gp, rl, starts, fold, M)


def _backward(st: Static, res, cts):
    q, x, y, eta, g, gp, rl, starts, fold, M = res
    do, ds_final = cts
    do = do.astype(y.dtype)
    ds_final = ds_final.astype(F32)
    grads = (_backward_tpu if st.tpu else _backward_gpu)(st, q, x, y, eta, g, gp, rl, starts, M, fold, do, ds_final)
    dq, dx, dy, deta, dg, dgp, ds0, fold_grads = grads
    dlog_gamma = _log_gamma_grad(dg, dgp, st.chunk, st.group, st.decay_before_residual)
    if st.key_shift:  # the kernels' dx is by write-feature row: x[t] = k[t − 1]
        ds0, dx0, _, deta0, dlg0 = fold_grads
        dx = shift_time(dx, -1, axis=1)
        # the kernels saw log γ₀ = 0 and a zero feature: row 0's gates reach the output through the fold alone
        deta, dlog_gamma = deta.at[:, 0].set(deta0), dlog_gamma.at[:, 0].set(dlg0)
        ds0 = (ds0, dx0)
    return dq, dx, dy, deta, dlog_gamma, None, ds0


def _backward_gpu(st: Static, q, x, y, eta, g, gp, rl, starts, M, fold, do, ds_final):
    cfg, keys = st.config, {"key_shift": True} if st.key_shift else {}
    BH, _, dk = token_dims(q, st.heads)
    dv = y.shape[-1]
    # 1) T and the state at every chunk start (and P) from each piece's true initial state
    tinv = _tri_inverse(st, x, eta, g, gp, rl, q.dtype)
    fwd_kw = _walk_kw(st, q.dtype, cfg.fwd_warps, cfg.walk_stages(), cfg.block_v)
    p, h, _ = _fused_walk(st)(q, x, y, eta, g, gp, rl, tinv, starts, write_o=False, write_h=True, write_p=True,
                              **fwd_kw, **keys)
    # 2) the state gradients by a reverse walk (pieces: each piece's from zero, then a reverse scan over pieces,
    #    dS_end(p-1) = M_pᵀ dS_end(p) + local_p); V (and maybe the walk's q-term) per chunk first
    state_kw = _walk_kw(st, q.dtype, cfg.state_warps, cfg.state_stages, cfg.split_block_v_for(BH * st.pieces, dv))
    lo = state_kw["walk_operands"]
    v_dtype = cfg.stored_v_dtype(lo, st.group)
    dr_dtype = cfg.stored_dr_dtype(q.dtype)
    mosaic_reverse = (st.implementation == "mosaic_gpu" and st.pieces == 1 and state_kw["block_v"] == mosaic_walks.BLOCK_V
                      and mosaic_walks.reverse_walk_unsupported_reason(
                          x, do, st.chunk, pieces=1, write_dh=True,
                          prepared=(jax.ShapeDtypeStruct(do.shape, v_dtype), None), write_dr=dr_dtype,
                          walk_operands=lo, t_dtype=tinv.dtype, q_dtype=q.dtype) is None)
    walk_programs = BH * st.pieces * (dv // state_kw["block_v"])
    q_term = not mosaic_reverse and st.pieces == 1 and walk_programs >= cfg.q_term_in_prepare_from
    prepare = _mosaic_or_triton(st, mosaic_prepare.prepare_v, state_grads.prepare_v)
    state_kw["prepared"] = prepare(q, x, eta, g, gp, rl, tinv, do, chunk=st.chunk, interpret=st.interpret,
                                   num_warps=cfg.prepare_warps, heads=st.heads, v_dtype=v_dtype,
                                   q_term_dtype=chunk_state_dtype(q.dtype) if q_term else None, walk_operands=lo,
                                   **keys)
    if st.pieces > 1:
        zeros = jnp.zeros((BH, st.pieces, dk, dv), F32)
        (local,) = state_grads.state_grad_walk(q, x, eta, g, gp, rl, tinv, do, zeros, write_dh=False, **state_kw)
        ends_rev, _ = _piece_starts(jnp.swapaxes(M, -1, -2)[:, ::-1], local[:, ::-1], ds_final)
        ds_ends = ends_rev[:, ::-1]
        reverse = state_grads.state_grad_walk
    else:
        ds_ends = ds_final[:, None]
        reverse = _mosaic_or_triton(st, mosaic_walks.reverse_walk, state_grads.state_grad_walk)
    dr, dh, ds_start = reverse(q, x, eta, g, gp, rl, tinv, do, ds_ends, write_dh=True, write_dr=dr_dtype,
                               **state_kw, **keys)
    ds0, fold_grads = ds_start[:, 0], None
    if st.key_shift:  # through row 0's folded step
        _, x0, *_ = fold  # the residuals of fold_first_row: (s0, x0, y0, η₀, log γ₀, keep)
        # y's row 0 reaches the loss through the fold alone: ∂/∂y₀ = η₀ dS₀ᵀ x₀.  The walk left dR's row 0 at
        # zero (its feature is zero), so it takes x₀ᵀ dS₀ there, and the chunk gradients' dy = η ⊙ dR gives that
        # row (an in-place update of the one row of a buffer only they read; the row touches nothing else there,
        # all its products being with the zero feature)
        row0 = jnp.einsum("bk,bkd->bd", x0, ds0, precision=jax.lax.Precision.HIGHEST)  # [BH, dv]
        dr = dr.at[:, 0].set(row0.reshape(dr[:, 0].shape).astype(dr.dtype))  # dR is like y (either layout)
        fold_grads = first_row_grads(fold, ds0, st.decay_before_residual)
    # 3) every chunk's gradients from the stored P and dR
    dq, dx, dy, deta, dg, dgp = chunk_grads.chunk_grad_pass(
        q, x, y, eta, g, gp, rl, do, h, dh, p, dr, chunk=st.chunk, block_v=cfg.grad_block_v, interpret=st.interpret,
        num_warps=cfg.grad_warps, num_stages=cfg.grad_stages, group=st.group, walk_operands=lo,
        block_k=cfg.grad_block_k, **({} if st.heads is None else {"heads": st.heads}), **keys)
    return dq, dx, dy, deta, dg, dgp, ds0, fold_grads


def _backward_tpu(st: Static, q, x, y, eta, g, gp, rl, starts, M, fold, do, ds_final):
    cfg = st.config
    tinv = _tri_inverse(st, x, eta, g, gp, rl, q.dtype)
    kw = dict(chunk=st.chunk, pieces=1, block_v=cfg.block_v, interpret=st.interpret)
    h, _ = mosaic_tpu.forward_pass(q, x, y, eta, g, gp, rl, tinv, starts, write_o=False, write_h=True, **kw)
    dh, ds_start = mosaic_tpu.state_grad_pass(q, x, eta, g, gp, rl, tinv, do, ds_final[:, None], write_dh=True, **kw)
    dq, dx, dy, deta, dg, dgp = mosaic_tpu.chunk_grad_pass(q, x, y, eta, g, gp, rl, tinv, do, h, dh, chunk=st.chunk,
                                                           block_v=cfg.block_v, interpret=st.interpret,
                                                           group=st.group)
    return dq, dx, dy, deta, dg, dgp, ds_start[:, 0], None


kernel_op.defvjp(_forward, _backward)
