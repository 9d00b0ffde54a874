"""The per-column ops: Falcon-2 (``decayed_delta_rule_per_column``) and Falcon-2A
(``decayed_attention_per_column``), with a hand-written backward (``jax.custom_vjp``).

Value column c has its own write weight and decay (:mod:`.reference`)::

    Falcon-2:   s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} x_t (y_{t,c} − (S'_{t-1}ᵀ x_t)_c)
    Falcon-2A:  s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t               o_t = S_tᵀ q_t

Falcon-2A on a GPU (:mod:`.triton_attention`), on the weighted values ``η ⊙ y`` (formed in XLA): a state walk per
(batch·head, piece, value block) stores every chunk's start state, then one program per chunk and value block
forms its output; the backward recomputes the states, walks the state gradients in reverse, forms du, dg and
each value block's share of dA per chunk and value block, and dq, dx per chunk from the summed shares.  A
piece's walk is affine in its start state with a per-column slope, so when batch·heads leave the GPU idle the
sequence is cut into pieces (exact, as ``decayed_attention``).

Falcon-2 (:mod:`.triton`), and both rules on a TPU (:mod:`.mosaic_tpu`: grid steps over the chunks, the state in
VMEM): one program per (batch·head, value block) walks the chunks and solves each column's own
unit-lower-triangular system (they share the Gram ``X Xᵀ``) inside the walk; the backward is one reverse walk
per (batch·head, value block) after a forward walk that stores the chunk start states.  No pieces (a piece map
would be a ``dk × dk`` matrix per column).  No Mosaic GPU kernel: ``"mosaic_gpu"`` declines and ``"auto"`` takes
Triton on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels.common import (check_config, check_operands, check_pieces, chunk_local, empty_result,
                                       floor_log_decay, kernel_operands, layout_kw, next_pow2, pieces_for,
                                       reverse_chunk_cumsum, swap_time_heads)
from falcon_jax.kernels.per_column import mosaic_tpu, triton, triton_attention
from falcon_jax.kernels.per_column.config import KernelConfig, tuned_config
from falcon_jax.kernels.per_column.reference import decayed_attention_per_column_reference, decayed_delta_rule_reference

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}
LOG2_E = 1.4426950408889634  # log₂ e


def unsupported_reason(name: str, q, y, chunk_size: int, interpret: bool | None = None) -> str | None:
    """Why implementation ``name`` declines a per-column call (None: it serves it)."""
    return impl.kernel_reason(name, q, y, chunk_size, interpret,
                              no_mosaic_gpu="no Mosaic GPU kernel for per-column gates; 'triton' serves the GPU")


@dataclasses.dataclass(frozen=True)
class _Static:
    chunk: int
    config: KernelConfig
    interpret: bool
    residual: bool
    implementation: str

    def kw(self):
        kw = dict(chunk=self.chunk, block_v=self.config.block_v, interpret=self.interpret,
                  num_warps=self.config.num_warps)
        # the TPU kernels serve both rules; on a GPU this op serves Falcon-2 only (Falcon-2A: _attention_op)
        return dict(kw, residual=self.residual) if self.implementation == "mosaic_tpu" else kw


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _column_op(q, x, y, eta, log_gamma, run, s0, st: _Static):
    out, _ = _column_forward(q, x, y, eta, log_gamma, run, s0, st)
    return out


def _column_forward(q, x, y, eta, log_gamma, run, s0, st: _Static):
    g, rl = chunk_local(log_gamma, run, st.chunk)
    gp = g - log_gamma
    o, s_end = _KERNELS[st.implementation].forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=True, write_h=False,
                                                        **st.kw())
    return (o, s_end), (q, x, y, eta, g, gp, rl, s0)


def _column_backward(st: _Static, res, cts):
    q, x, y, eta, g, gp, rl, s0 = res
    do, ds_final = cts
    kernels = _KERNELS[st.implementation]
    h, _ = kernels.forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=False, write_h=True, **st.kw())
    dq, dx, dy, deta, dg, dgp, ds0 = kernels.backward_pass(
        q, x, y, eta, g, gp, rl, do.astype(y.dtype), h, ds_final.astype(jnp.float32), **st.kw())
    # g = chunk-local inclusive cumsum, gp = g − log γ (unused without the residual)
    chunk = st.chunk
    dlog = reverse_chunk_cumsum(dg + dgp, chunk) - dgp if st.residual else reverse_chunk_cumsum(dg, chunk)
    return (jnp.sum(dq, axis=1).astype(q.dtype), jnp.sum(dx, axis=1).astype(x.dtype), dy, deta, dlog, None, ds0)


_column_op.defvjp(_column_forward, _column_backward)


@dataclasses.dataclass(frozen=True)
class _AttentionStatic:
    chunk: int
    config: KernelConfig
    pieces: int
    interpret: bool
    heads: int | None  # the tokens [B, L, H, d] read in place (g too), or [B·H, L, d]

    def walk_kw(self):
        cfg = self.config
        return dict(chunk=self.chunk, pieces=self.pieces, block_v=cfg.walk_block_v, interpret=self.interpret,
                    num_warps=cfg.walk_warps, num_stages=cfg.walk_stages, **layout_kw(self.heads))

    def chunk_kw(self, block_v, num_warps, **kw):
        return dict(chunk=self.chunk, block_v=block_v, interpret=self.interpret, num_warps=num_warps,
                    **layout_kw(self.heads), **kw)


def _piece_decay(g, rl, st: _AttentionStatic):
    """[B·H, P, dv]: each column's total decay over each piece (0 if a segment starts inside it)."""
    g_last = g[:, st.chunk - 1::st.chunk]  # [B·H, n, dv] or, in place, [B, n, H, dv]
    if st.heads is not None:
        B, n, H, dv = g_last.shape
        g_last = jnp.swapaxes(g_last, 1, 2).reshape(B * H, n, dv)
    BH, n, dv = g_last.shape
    cont = rl.reshape(BH, n, st.chunk)[:, :, -1] == 0
    log_a = jnp.where(cont[..., None], g_last, -jnp.inf).reshape(BH, st.pieces, -1, dv).sum(2)
    return jnp.exp2(log_a)


def _piece_starts(ends_from_zero, a, s0):
    """Each piece's true start state, ``S(p+1) = a_p ⊙ S(p) + E_p`` (a_p per column), ``S(0) = s0``.
    Returns ([BH, P, dk, dv], the state after the last piece)."""

    def step(S, inp):
        a_p, e_p = inp
        return a_p[:, None, :] * S + e_p, S

    final, starts = jax.lax.scan(step, s0, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(ends_from_zero, 1, 0)))
    return jnp.moveaxis(starts, 0, 1), final


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention_op(q, x, u, log_gamma, run, s0, st: _AttentionStatic):
    """Falcon-2A's kernels on the weighted values ``u = η ⊙ y``."""
    out, _ = _attention_forward(q, x, u, log_gamma, run, s0, st)
    return out


def _attention_forward(q, x, u, log_gamma, run, s0, st: _AttentionStatic):
    # g in base 2 (the kernels' decays are exp2), in log_gamma's layout
    g, rl = chunk_local(log_gamma * LOG2_E, run, st.chunk)
    BH, dk, dv = s0.shape
    if st.pieces > 1:
        zeros = jnp.zeros((BH, st.pieces, dk, dv), jnp.float32)
        (ends,) = triton_attention.state_pass(x, u, g, rl, zeros, write_h=False, **st.walk_kw())
        starts, _ = _piece_starts(ends, _piece_decay(g, rl, st), s0)
    else:
        starts = s0[:, None]
    h, s_end = triton_attention.state_pass(x, u, g, rl, starts, write_h=True, **st.walk_kw())
    o = triton_attention.output_pass(q, x, u, g, rl, h, **st.chunk_kw(st.config.out_block_v, st.config.out_warps))
    return (o, s_end[:, -1]), (q, x, u, g, rl, starts)


def _attention_backward(st: _AttentionStatic, res, cts):
    q, x, u, g, rl, starts = res
    do, ds_final = cts
    BH, _, dk, dv = starts.shape
    do = do.astype(u.dtype)
    ds_final = ds_final.astype(jnp.float32)
    h, _ = triton_attention.state_pass(x, u, g, rl, starts, write_h=True, **st.walk_kw())
    if st.pieces > 1:  # dS at each piece's end: a reverse scan over pieces of the walks from zero
        zeros = jnp.zeros((BH, st.pieces, dk, dv), jnp.float32)
        (local,) = triton_attention.state_grad_pass(q, g, rl, do, zeros, write_dh=False, **st.walk_kw())
        a = _piece_decay(g, rl, st)
        ends_rev, _ = _piece_starts(local[:, ::-1], a[:, ::-1], ds_final)
        ds_ends = ends_rev[:, ::-1]
    else:
        ds_ends = ds_final[:, None]
    dh, ds_start = triton_attention.state_grad_pass(q, g, rl, do, ds_ends, write_dh=True, **st.walk_kw())
    cfg = st.config
    dq, dx, du, dg = triton_attention.chunk_grad_pass(
        q, x, u, g, rl, do, h, dh, **st.chunk_kw(cfg.grad_block_v, cfg.grad_warps, row_warps=cfg.row_grad_warps))
    # g is the chunk-local cumsum of log γ: its gradient is the reverse cumsum within each chunk (time: axis 1)
    return dq, dx, du, reverse_chunk_cumsum(dg, st.chunk), None, ds_start[:, 0]


_attention_op.defvjp(_attention_forward, _attention_backward)


def _per_column(op, q, x, y, eta, log_gamma, run, initial_state, *, chunk_size, implementation, config, interpret,
                residual, layout, pieces=None):
    B, T, H, dk, dv = check_operands(op, q, x, y, {"eta": eta, "log_gamma": log_gamma}, run, initial_state,
                                     chunk_size=chunk_size, layout=layout, per_column=True)
    check_config(op, config, KernelConfig)
    chunk_size = int(chunk_size)  # a NumPy int would reach the kernels' block shapes
    if B * H == 0:
        return empty_result(B, T, H, dk, dv, y.dtype, layout)
    log_gamma = floor_log_decay(log_gamma)
    name = impl.select(op, implementation, lambda n: unsupported_reason(n, q, y, chunk_size, interpret))
    attention_kernels = name == "triton" and not residual
    in_place = layout == "BTHD"
    if in_place and not attention_kernels:  # only Falcon-2A's GPU kernels read [B, T, H, d] in place
        o, final = _per_column(op, *(swap_time_heads(a) for a in (q, x, y, eta, log_gamma, run)), initial_state,
                               chunk_size=chunk_size, implementation=name, config=config, interpret=interpret,
                               residual=residual, layout="BHTD", pieces=pieces)
        return swap_time_heads(o), final
    if name == "xla":
        reference = decayed_delta_rule_reference if residual else decayed_attention_per_column_reference
        o, final = reference(q, x, y, eta, log_gamma, run, initial_state)
        return o.astype(y.dtype), final
    interpret = impl.interpret_mode(name, interpret)
    B, T, H, dk = q.shape if in_place else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    dv = y.shape[-1]
    dtype, f32 = q.dtype, jnp.float32
    n_chunks = next_pow2(-(-T // chunk_size))
    L = n_chunks * chunk_size
    config = config or tuned_config()
    eta, log_gamma = (a if a.ndim == 4 else jnp.broadcast_to(a[..., None], (*a.shape, dv)) for a in (eta, log_gamma))
    # padding: zero pairs, write weight and log decay (identity steps), run continued; the run index [B·H, L]
    tokens, gates = kernel_operands(in_place, L)
    q, x, log_gamma = tokens(q.astype(dtype)), tokens(x.astype(dtype)), tokens(log_gamma.astype(f32))
    run, s0 = gates(run.astype(jnp.int32), mode="edge"), initial_state.astype(f32).reshape(B * H, dk, dv)
    if attention_kernels:
        config = dataclasses.replace(config, **{f: min(getattr(config, f), dv)
                                                for f in ("walk_block_v", "out_block_v", "grad_block_v")})
        P = pieces_for(B * H, dv // config.walk_block_v, n_chunks, config.pieces_below, pieces)
        # the write weight folded into the values in XLA, as decayed_attention's callers do (η's and y's
        # gradients by autodiff of the product)
        u = tokens((eta.astype(f32) * y.astype(f32)).astype(dtype))
        st = _AttentionStatic(chunk_size, config, P, interpret, H if in_place else None)
        o, final = _attention_op(q, x, u, log_gamma, run, s0, st)
        o = o[:, :T] if in_place else o[:, :T].reshape(B, H, T, dv)
        return o, final.reshape(B, H, dk, dv)
    block_v = min(config.block_v, dv)
    if name == "mosaic_tpu":  # Mosaic: a multiple of 128 columns or all of dv (interpret mode alike)
        block_v = mosaic_tpu.value_block(block_v, dv)
    st = _Static(chunk_size, dataclasses.replace(config, block_v=block_v), interpret, residual, name)
    o, final = _column_op(q, x, tokens(y.astype(dtype)), tokens(eta.astype(f32)), log_gamma, run, s0, st)
    return o[:, :T].reshape(B, H, T, dv), final.reshape(B, H, dk, dv)


def decayed_delta_rule_per_column(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                                  implementation="auto", config: KernelConfig | None = None,
                                  interpret: bool | None = None, layout: str = "BHTD"):
    """The decayed delta rule with per-column gates (Falcon-2's recurrence).

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      eta, log_gamma: ``[B, H, T, dv]`` write weight and log decay ≤ 0 per value column (``[B, H, T]``: the same
        in every column); cast to fp32, a log decay below −30 counting as −30.
      run: ``[B, H, T]`` int, number of segment starts up to t (0 = continues ``initial_state``).
      initial_state: ``[B, H, dk, dv]``.
      implementation: ``"auto"``, ``"triton"``, ``"mosaic_tpu"``, ``"xla"`` or a sequence
        (:mod:`falcon_jax.kernels.implementation`; ``"mosaic_gpu"`` declines).
      config: :class:`KernelConfig` (None: tuned).  interpret: Pallas interpret mode (None: off the accelerator).
      layout: ``"BHTD"`` (the shapes above) or ``"BTHD"``: q, x, y, eta, log_gamma, run and o with time before
        heads (``[B, T, H, ...]``), the model's layout; Falcon-2A's GPU kernels read and write it in place, the
        other kernels transpose.
    Returns:
      ``(o [B, H, T, dv] (or [B, T, H, dv]) in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    return _per_column("decayed_delta_rule_per_column", q, x, y, eta, log_gamma, run, initial_state,
                       chunk_size=chunk_size, implementation=implementation, config=config, interpret=interpret,
                       residual=True, layout=layout)


def decayed_attention_per_column(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                                 implementation="auto", config: KernelConfig | None = None,
                                 interpret: bool | None = None, layout: str = "BHTD", pieces: int | None = None):
    """Decayed linear attention with per-column gates (Falcon-2A's recurrence),
    ``s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t``, ``o_t = S_tᵀ q_t``.  Arguments and returns as
    :func:`decayed_delta_rule_per_column`; ``pieces``: on a GPU, cut the sequence into this many pieces walked in
    parallel (None: by the program count, ``KernelConfig.pieces_below``)."""
    check_pieces("decayed_attention_per_column", pieces)
    return _per_column("decayed_attention_per_column", q, x, y, eta, log_gamma, run, initial_state,
                       chunk_size=chunk_size, implementation=implementation, config=config, interpret=interpret,
                       residual=False, layout=layout, pieces=pieces)
