"""``decayed_attention``: chunked decayed linear attention with scalar gates, with a hand-written backward.

    S_t = [same segment] · e^{a_t} S_{t-1} + x_t y_tᵀ,   o_t = S_tᵀ q_t       (:mod:`.reference`)

Forward: one walk over the chunks per (batch·head, piece, value block) carrying the fp32 state
(:mod:`.triton`, :mod:`.mosaic_tpu`).  When batch·heads leave the GPU idle the sequence is cut into pieces: a
first walk gives each piece's end state from zero, a short scan over pieces (XLA) their true initial states (a
piece's map is a scalar decay and an offset), and the output walk runs from those (exact).  Backward
(``jax.custom_vjp``): the chunk start states recomputed, a reverse walk for the state gradients (pieces
likewise), then one program per chunk for dq, dx, dy and the log-decay gradient.  No Mosaic GPU kernel:
``"mosaic_gpu"`` declines and ``"auto"`` takes Triton on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels.common import (check_config, check_operands, check_pieces, chunk_local, empty_result,
                                       floor_log_decay, kernel_operands, next_pow2, pieces_for, reverse_chunk_cumsum,
                                       swap_time_heads, token_dims)
from falcon_jax.kernels.decayed_attention import mosaic_tpu, triton
from falcon_jax.kernels.decayed_attention.config import KernelConfig, tuned_config
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}


def unsupported_reason(name: str, q, y, chunk_size: int, interpret: bool | None = None) -> str | None:
    """Why implementation ``name`` declines a call (None: it serves it): every Triton dot dimension (dk, dv, the
    chunk) must be a power of two ≥ 16."""
    return impl.kernel_reason(name, q, y, chunk_size, interpret,
                              no_mosaic_gpu="no Mosaic GPU kernel for decayed_attention; 'triton' serves the GPU")


@dataclasses.dataclass(frozen=True)
class _Static:
    chunk: int
    config: KernelConfig
    pieces: int
    interpret: bool
    implementation: str
    heads: int | None

    def walk_kw(self):
        return dict(chunk=self.chunk, pieces=self.pieces, block_v=self.config.block_v, interpret=self.interpret,
                    **({} if self.heads is None else {"heads": self.heads}))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kernel_op(q, x, y, log_decay, run, s0, st: _Static):
    out, _ = _forward(q, x, y, log_decay, run, s0, st)
    return out


def _piece_decay(g, rl, chunk, pieces):
    """[BH, P]: total decay over each piece (0 if a segment starts inside it)."""
    BH, L = g.shape
    g_last = g.reshape(BH, L // chunk, chunk)[..., -1]
    cont = rl.reshape(BH, L // chunk, chunk)[..., -1] == 0
    log_a = jnp.where(cont, g_last, -jnp.inf).reshape(BH, pieces, -1).sum(-1)
    return jnp.exp(log_a)


def _piece_starts(ends_from_zero, a, s0):
    """True initial state of each piece: S(p+1) = a_p S(p) + E_p, S(0) = s0. Returns ([BH,P,dk,dv], final)."""

    def step(S, inp):
        a_p, e_p = inp
        return a_p[:, None, None] * S + e_p, S

    final, starts = jax.lax.scan(step, s0, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(ends_from_zero, 1, 0)))
    return jnp.moveaxis(starts, 0, 1), final


def _forward(q, x, y, log_decay, run, s0, st: _Static):
    kernels = _KERNELS[st.implementation]
    g, rl = chunk_local(log_decay, run, st.chunk)
    kw = dict(st.walk_kw(), num_warps=st.config.fwd_warps, num_stages=st.config.fwd_stages)
    BH, _, dk = token_dims(q, st.heads)
    dv = y.shape[-1]
    if st.pieces > 1:
        zeros = jnp.zeros((BH, st.pieces, dk, dv), jnp.float32)
        (ends,) = kernels.forward_pass(q, x, y, g, rl, zeros, write_o=False, write_h=False, **kw)
        starts, _ = _piece_starts(ends, _piece_decay(g, rl, st.chunk, st.pieces), s0)
    else:
        starts = s0[:, None]
    o, s_end = kernels.forward_pass(q, x, y, g, rl, starts, write_o=True, write_h=False, **kw)
    return (o, s_end[:, -1]), (q, x, y, g, rl, starts)


def _backward(st: _Static, res, cts):
    kernels = _KERNELS[st.implementation]
    q, x, y, g, rl, starts = res
    do, ds_final = cts
    BH, _, dk = token_dims(q, st.heads)
    dv = y.shape[-1]
    cfg = st.config
    fwd_kw = dict(st.walk_kw(), num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    state_kw = dict(st.walk_kw(), num_warps=cfg.state_warps, num_stages=cfg.fwd_stages)
    do = do.astype(y.dtype)
    ds_final = ds_final.astype(jnp.float32)
    # 1) states at every chunk start, recomputed from each piece's true initial state
    h, _ = kernels.forward_pass(q, x, y, g, rl, starts, write_o=False, write_h=True, **fwd_kw)
    # 2) gradients w.r.t. every chunk's end state, by a reverse walk (pieces: a reverse scan over pieces)
    if st.pieces > 1:
        zeros = jnp.zeros((BH, st.pieces, dk, dv), jnp.float32)
        (local,) = kernels.state_grad_pass(q, g, rl, do, zeros, write_dh=False, **state_kw)
        a = _piece_decay(g, rl, st.chunk, st.pieces)
        # dS_end(p-1) = a_p dS_end(p) + local_p, walked from the last piece
        ends_rev, _ = _piece_starts(local[:, ::-1], a[:, ::-1], ds_final)
        ds_ends = ends_rev[:, ::-1]
    else:
        ds_ends = ds_final[:, None]
    dh, ds_start = kernels.state_grad_pass(q, g, rl, do, ds_ends, write_dh=True, **state_kw)
    # 3) per-chunk gradients
    dq, dx, dy, dg = kernels.chunk_grad_pass(q, x, y, g, rl, do, h, dh, chunk=st.chunk, block_v=cfg.block_v,
                                             interpret=st.interpret, num_warps=cfg.grad_warps,
                                             num_stages=cfg.grad_stages,
                                             **({} if st.heads is None else {"heads": st.heads}))
    # g is the chunk-local cumsum of log_decay: its gradient is the reverse cumsum within each chunk
    return dq, dx, dy, reverse_chunk_cumsum(dg, st.chunk), None, ds_start[:, 0]


_kernel_op.defvjp(_forward, _backward)


def decayed_attention(q, x, y, log_decay, run, initial_state, *, chunk_size: int = 64, implementation="auto",
                      config: KernelConfig | None = None, pieces: int | None = None, interpret: bool | None = None,
                      layout: str = "BHTD"):
    """Chunked decayed attention.

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      log_decay: ``[B, H, T]`` (cast to fp32); below −30 it counts as −30
        (:func:`~falcon_jax.kernels.common.floor_log_decay`).
      run: ``[B, H, T]`` int, number of segment starts up to t (non-decreasing; 0 = continues
        ``initial_state``).
      initial_state: ``[B, H, dk, dv]``.
      implementation: ``"auto"``, ``"triton"``, ``"mosaic_tpu"``, ``"xla"`` or a sequence of them
        (:mod:`falcon_jax.kernels.implementation`; ``"mosaic_gpu"`` declines).
      config: :class:`KernelConfig` (None: tuned).  pieces: cut the sequence into this many pieces (GPU; None: by
        the program count), a power of two; more pieces than chunks run as one piece per chunk.  interpret: Pallas
        interpret mode (None: off the kernel's accelerator).
      layout: ``"BHTD"`` (the shapes above) or ``"BTHD"``: q, x ``[B, T, H, dk]``, y ``[B, T, H, dv]``,
        log_decay and run ``[B, T, H]``, o ``[B, T, H, dv]`` — the usual layout of a model's projections.  The
        Triton kernels read and write it in place (no transposed copies of the tokens or their gradients); the
        other implementations transpose.
    Returns:
      ``(o [B, H, T, dv] (or [B, T, H, dv]) in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    B, T, H, dk, dv = check_operands("decayed_attention", q, x, y, {"log_decay": log_decay}, run, initial_state,
                                     chunk_size=chunk_size, layout=layout)
    check_pieces("decayed_attention", pieces)
    check_config("decayed_attention", config, KernelConfig)
    chunk_size = int(chunk_size)  # a NumPy int would reach the kernels' block shapes
    if B * H == 0:
        return empty_result(B, T, H, dk, dv, y.dtype, layout)
    log_decay = floor_log_decay(log_decay)
    name = impl.select("decayed_attention", implementation, lambda n: unsupported_reason(n, q, y, chunk_size,
                                                                                         interpret))
    in_place = layout == "BTHD"
    if in_place and name != "triton":  # only the Triton kernels read BTHD in place
        o, final = decayed_attention(*(swap_time_heads(a) for a in (q, x, y, log_decay, run)), initial_state,
                                     chunk_size=chunk_size, implementation=name, config=config, pieces=pieces,
                                     interpret=interpret)
        return swap_time_heads(o), final
    if name == "xla":
        o, final = decayed_attention_reference(q, x, y, log_decay, run, initial_state)
        return o.astype(y.dtype), final
    interpret = impl.interpret_mode(name, interpret)
    B, T, H, dk = q.shape if in_place else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    dv = y.shape[-1]
    dtype = q.dtype
    n_chunks = next_pow2(-(-T // chunk_size))  # power-of-two chunk count keeps every block a power of two
    L = n_chunks * chunk_size
    config = config or tuned_config()
    config = dataclasses.replace(config, block_v=min(config.block_v, dv))
    if name == "mosaic_tpu":
        P = 1  # TPU: batch·heads across cores, chunks sequential on each
    else:
        P = pieces_for(B * H, dv // config.block_v, n_chunks, config.pieces_below, pieces)
    # padding: zero pairs, zero log decay (identity steps), run continued.  In place the tokens stay
    # [B, L, H, d] (padded in time only); the gates are [B·H, L] either way (they are small).
    tokens, gates = kernel_operands(in_place, L)
    st = _Static(chunk_size, config, P, interpret, name, H if in_place else None)
    o, final = _kernel_op(tokens(q.astype(dtype)), tokens(x.astype(dtype)), tokens(y.astype(dtype)),
                          gates(log_decay.astype(jnp.float32)), gates(run.astype(jnp.int32), mode="edge"),
                          initial_state.astype(jnp.float32).reshape(B * H, dk, dv), st)
    o = o[:, :T] if in_place else o[:, :T].reshape(B, H, T, dv)
    return o, final.reshape(B, H, dk, dv)
