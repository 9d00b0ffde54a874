"""Public entry: ``decayed_attention(..., implementation=...)`` with a hand-written backward.

    S_t = [same segment] · e^{a_t} S_{t-1} + x_t y_tᵀ,   o_t = S_tᵀ q_t       (reference.py)

Implementations: ``"pallas_gpu"`` (Triton lowering), ``"mosaic_gpu"`` (Hopper forward with
wgmma + TMA, backward = the Triton one; bf16/fp16 only), ``"pallas_tpu"``
(Mosaic TPU lowering) — on a machine without that accelerator each runs in
its interpret mode —, ``"xla"`` (the plain-JAX reference, O(T²)) and
``"auto"`` (the kernel of the machine's accelerator, else the reference).  A request the GPU kernel cannot
serve raises ``NotImplementedError`` with the reason, so callers can fall back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import chunk_local as _prepare
from falcon_jax.kernels.common import next_pow2 as _next_pow2
from falcon_jax.kernels.common import pieces_for as _pieces
from falcon_jax.kernels.common import (GRAD_LOOPS, check_layout, interpret_default, kernel_operands as _kernel_operands,
                                   layout_kw as _layout_kw, resolve_implementation, reverse_chunk_cumsum,
                                   swap_time_heads, token_dims, unsupported_dims_reason)
from falcon_jax.kernels.decayed_attention import mosaic_gpu, pallas_gpu, pallas_tpu
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference

IMPLEMENTATIONS = ("auto", "pallas_gpu", "mosaic_gpu", "pallas_tpu", "xla")
_BACKENDS = {"pallas_gpu": pallas_gpu, "mosaic_gpu": mosaic_gpu, "pallas_tpu": pallas_tpu}


def unsupported_reason(q, y, chunk_size: int, interpret: bool = False) -> str | None:
    return unsupported_dims_reason(q.shape[-1], y.shape[-1], chunk_size, q.dtype, interpret)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the GPU kernels (tuned on the H200: benchmarks/bench_inner_product.py --tune)."""

    block_v: int = 64  # value columns per program of the state walks
    fwd_warps: int = 4
    fwd_stages: int = 3
    state_warps: int = 4
    grad_warps: int = 4
    grad_stages: int = 1
    # cut the sequence into pieces until this many programs run; 128 measured fastest on the H200
    # (kernel only, bf16: 8x2048x16x128 fwd+bwd 1.010 ms vs 1.316 at 264; 1x32768x16x128 2.361 vs 2.574)
    target_programs: int = 128
    mosaic_target_ctas: int = 132  # mosaic_gpu: one CTA per SM (≈210 KiB of SMEM each), one wave
    # the chunk gradients' loop over value blocks: "unrolled" (Python, static slices) or "fori" (lax.fori_loop,
    # which Triton's pipeliner prefetches with grad_stages >= 2).  The default is the code next39 timed (whole op
    # bf16 fwd+bwd 0.935 / 1.127 / 2.127 ms at 8x2048 / 2x8192 / 1x32768 x16x128; its Triton IR is identical to
    # today's).  With dy computed before the value sums (70bd2c8 to 8b465ab) the whole op measured 1.204 / 1.405 /
    # 2.657 unrolled and 1.122 / 1.309 / 2.487 fori with 2 stages (next48); the fori loop with the sums first
    # again (the code now) is not yet timed (h200_run.sh next49).  GPU Triton kernel only.
    grad_loops: str = "unrolled"

    def __post_init__(self):
        if self.grad_loops not in GRAD_LOOPS:
            raise ValueError(f"KernelConfig: grad_loops must be one of {GRAD_LOOPS}, got {self.grad_loops!r}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _kernel_op(q, x, y, log_decay, run, s0, chunk, config, pieces, interpret, backend, heads):
    out, _ = _forward(q, x, y, log_decay, run, s0, chunk, config, pieces, interpret, backend, heads)
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


def _forward(q, x, y, log_decay, run, s0, chunk, config, pieces, interpret, backend, heads):
    kernels = _BACKENDS[backend]
    g, rl = _prepare(log_decay, run, chunk)
    kw = dict(chunk=chunk, pieces=pieces, block_v=config.block_v, interpret=interpret,
              num_warps=config.fwd_warps, num_stages=config.fwd_stages, **_layout_kw(heads))
    BH, _, dk = token_dims(q, heads)
    dv = y.shape[-1]
    if pieces > 1:
        zeros = jnp.zeros((BH, pieces, dk, dv), jnp.float32)
        (ends,) = kernels.forward_pass(q, x, y, g, rl, zeros, write_o=False, write_h=False, **kw)
        starts, _ = _piece_starts(ends, _piece_decay(g, rl, chunk, pieces), s0)
    else:
        starts = s0[:, None]
    o, s_end = kernels.forward_pass(q, x, y, g, rl, starts, write_o=True, write_h=False, **kw)
    return (o, s_end[:, -1]), (q, x, y, g, rl, starts)


def _fwd_rule(q, x, y, log_decay, run, s0, chunk, config, pieces, interpret, backend, heads):
    return _forward(q, x, y, log_decay, run, s0, chunk, config, pieces, interpret, backend, heads)


def _bwd_rule(chunk, config, pieces, interpret, backend, heads, res, cts):
    kernels = _BACKENDS[backend]
    q, x, y, g, rl, starts = res
    do, ds_final = cts
    BH, L, dk = token_dims(q, heads)
    dv = y.shape[-1]
    kw = dict(chunk=chunk, pieces=pieces, block_v=config.block_v, interpret=interpret, **_layout_kw(heads))
    fwd_kw = dict(kw, num_warps=config.fwd_warps, num_stages=config.fwd_stages)
    state_kw = dict(kw, num_warps=config.state_warps, num_stages=config.fwd_stages)
    do = do.astype(y.dtype)
    ds_final = ds_final.astype(jnp.float32)
    # 1) states at every chunk start, recomputed from each piece's true initial state
    h, _ = kernels.forward_pass(q, x, y, g, rl, starts, write_o=False, write_h=True, **fwd_kw)
    # 2) gradients w.r.t. every chunk's end state, by a reverse pass (pieces: reverse scan over pieces)
    if pieces > 1:
        zeros = jnp.zeros((BH, pieces, dk, dv), jnp.float32)
        (local,) = kernels.state_grad_pass(q, g, rl, do, zeros, write_dh=False, **state_kw)
        a = _piece_decay(g, rl, chunk, pieces)
        # dS_end(p-1) = a_p dS_end(p) + local_p, walked from the last piece
        ends_rev, _ = _piece_starts(local[:, ::-1], a[:, ::-1], ds_final)
        ds_ends = ends_rev[:, ::-1]
    else:
        ds_ends = ds_final[:, None]
    dh, ds_start = kernels.state_grad_pass(q, g, rl, do, ds_ends, write_dh=True, **state_kw)
    # 3) per-chunk gradients
    dq, dx, dy, dg = kernels.chunk_grad_pass(q, x, y, g, rl, do, h, dh, chunk=chunk, block_v=config.block_v,
                                                interpret=interpret, num_warps=config.grad_warps,
                                                num_stages=config.grad_stages, loops=config.grad_loops,
                                                **_layout_kw(heads))
    # g is the chunk-local cumsum of log_decay: its gradient is the reverse cumsum within each chunk
    dlog = reverse_chunk_cumsum(dg, chunk)
    return dq, dx, dy, dlog, None, ds_start[:, 0]


_kernel_op.defvjp(_fwd_rule, _bwd_rule)


def decayed_attention(q, x, y, log_decay, run, initial_state, *, chunk_size: int = 64,
                      implementation: str = "auto", config: KernelConfig | None = None,
                      pieces: int | None = None, interpret: bool | None = None, layout: str = "BHTD"):
    """Chunked decayed attention.

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      log_decay: ``[B, H, T]`` (cast to fp32).
      run: ``[B, H, T]`` int, number of segment starts up to t (non-decreasing; 0 = continues
        ``initial_state``).
      initial_state: ``[B, H, dk, dv]``.
      layout: ``"BHTD"`` (the shapes above) or ``"BTHD"``: q, x ``[B, T, H, dk]``, y ``[B, T, H, dv]``,
        log_decay and run ``[B, T, H]``, o ``[B, T, H, dv]`` — the usual layout of a model's projections.
        The GPU Triton kernels read and write it in place (no transposed copies of the tokens or their
        gradients); the other implementations transpose.
    Returns:
      ``(o [B, H, T, dv] (or [B, T, H, dv]) in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    check_layout(layout)
    implementation = resolve_implementation(implementation, IMPLEMENTATIONS)
    in_place = layout == "BTHD"
    if in_place and implementation != "pallas_gpu":  # only the Triton kernels read BTHD in place
        o, final = decayed_attention(*(swap_time_heads(a) for a in (q, x, y, log_decay, run)), initial_state,
                                     chunk_size=chunk_size, implementation=implementation, config=config,
                                     pieces=pieces, interpret=interpret)
        return swap_time_heads(o), final
    if implementation == "xla":
        o, final = decayed_attention_reference(q, x, y, log_decay, run, initial_state)
        return o.astype(y.dtype), final
    interpret = interpret_default(implementation, interpret)
    reason = unsupported_reason(q, y, chunk_size, interpret)
    if reason is None and implementation == "mosaic_gpu":
        reason = mosaic_gpu.unsupported_reason(q.shape[-1], y.shape[-1], chunk_size, q.dtype)
    if reason is not None:
        raise NotImplementedError(f"{implementation} decayed_attention: {reason}")
    if in_place:
        B, T, H, dk = q.shape
    else:
        B, H, T, dk = q.shape
    dv = y.shape[-1]
    dtype = q.dtype
    chunk = chunk_size
    n_chunks = _next_pow2(-(-T // chunk))  # power-of-two chunk count keeps every block a power of two
    L = n_chunks * chunk
    config = config or KernelConfig()
    config = dataclasses.replace(config, block_v=min(config.block_v, dv))
    if implementation == "pallas_tpu":
        P = 1  # TPU: batch·heads across cores, chunks sequential on each
    elif implementation == "mosaic_gpu":  # the backward (Triton) runs with the same pieces
        P = pieces or _pieces(B * H, mosaic_gpu.ctas_per_head_piece(dv), n_chunks, config.mosaic_target_ctas)
    else:
        P = pieces or _pieces(B * H, dv // config.block_v, n_chunks, config.target_programs)

    # padding: zero pairs, zero log decay (identity steps), run continued.  In place the tokens stay
    # [B, L, H, d] (padded in time only); the gates are [B·H, L] either way (they are small).
    tokens, gates = _kernel_operands(in_place, L)
    o, final = _kernel_op(tokens(q.astype(dtype)), tokens(x.astype(dtype)), tokens(y.astype(dtype)),
                          gates(log_decay.astype(jnp.float32)), gates(run.astype(jnp.int32), mode="edge"),
                          initial_state.astype(jnp.float32).reshape(B * H, dk, dv), chunk, config, P,
                          bool(interpret), implementation, H if in_place else None)
    o = o[:, :T] if in_place else o[:, :T].reshape(B, H, T, dv)
    return o, final.reshape(B, H, dk, dv)
