"""Forward kernel of decayed attention for Hopper (Pallas Mosaic GPU: wgmma + TMA).

Same layout and contract as :func:`pallas_gpu.forward_pass` (``q, x [BH, L, dk]``,
``y [BH, L, dv]``, chunk-local ``g, rl [BH, L]``, per-piece initial states
``[BH, P, dk, dv]`` fp32); only the forward walk is replaced — the backward
(and the forward with ``write_h``, which the backward calls) stay the Triton
kernels of :mod:`pallas_gpu`, so the residuals are unchanged.

Schedule: one CTA per (batch·head, piece, group of ``W`` value blocks of 64
columns), ``W + 1`` warpgroups, warp-specialised:

* the memory warpgroup streams each chunk's ``q, x`` tiles (shared by all
  value blocks), the ``W`` ``y`` tiles and the gate vectors ``g, rl`` with TMA
  into a ``stages``-deep ring of shared-memory slots; a slot is refilled once
  every compute warpgroup has released it (``free`` barrier, ``W`` arrivals);
* compute warpgroup ``w`` owns value block ``w`` and keeps its state
  ``S [dk, 64]`` (fp32) in registers.  Per chunk (``C = 64`` rows)::

      A   = q xᵀ                       wgmma, both operands from SMEM (x transposed)
      P   = A ⊙ D,  D[t,s] = e^{g_t−g_s} [s ≤ t, rl_t = rl_s]   (registers, → bf16)
      o   = e^{g}[rl=0] ⊙ (q S) + P y  wgmma q·S (S staged to SMEM as bf16), then P (registers) · y
      S  ← e^{g_C}[rl_C=0] S + xᵀ (w ⊙ y),  w_s = e^{g_C−g_s} [rl_s = rl_C]
                                       wgmma, xᵀ from SMEM (transposed), w ⊙ y written over the y slot

  and ``o`` goes out through a double-buffered SMEM tile with a TMA store.

Every matmul is bf16/fp16 × bf16/fp16 with fp32 accumulation; fp32 inputs are
not served (wgmma would round them to TF32): the op raises
``NotImplementedError`` so that callers fall back to ``pallas_gpu``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import mosaic_mma, mosaic_smem
from falcon_jax.kernels.decayed_attention import pallas_gpu as _triton

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

CHUNK = 64
BLOCK_V = 64  # value columns per compute warpgroup (one wgmma N tile)
MAX_WARPGROUPS = 2  # compute warpgroups per CTA (value blocks sharing the q, x tiles)
SMEM_BUDGET = 225 * 1024  # of the 227 KiB a Hopper CTA may take
F32 = jnp.float32


def unsupported_reason(dk: int, dv: int, chunk: int, dtype) -> str | None:
    if plgpu is None:
        return "this jax has no Pallas Mosaic GPU"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the Mosaic GPU kernel takes chunk_size={CHUNK}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name}: the Mosaic GPU kernel takes bf16 or fp16 (wgmma would round fp32 to TF32)"
    if dk not in (64, 128):
        return f"dk={dk}: the Mosaic GPU kernel takes dk = 64 or 128"
    if dv % BLOCK_V:
        return f"dv={dv}: the Mosaic GPU kernel needs a multiple of {BLOCK_V}"
    return None


def warpgroups(dv: int) -> int:
    """Compute warpgroups per CTA: value blocks that share one CTA's q, x tiles."""
    nv = dv // BLOCK_V
    return MAX_WARPGROUPS if nv % MAX_WARPGROUPS == 0 else 1


def ctas_per_head_piece(dv: int) -> int:
    return dv // BLOCK_V // warpgroups(dv)


def _stages(dk, W, itemsize, write_o):
    per_stage = ((2 if write_o else 1) * CHUNK * dk + W * CHUNK * BLOCK_V) * itemsize + 2 * CHUNK * 4
    # per warpgroup: the fp32 state staging tile, aliased with (S in bf16, two output tiles)
    fixed = W * max(dk * BLOCK_V * 4, (dk * BLOCK_V + 2 * CHUNK * BLOCK_V) * itemsize) + 1024
    for stages in (4, 3, 2):
        if stages * per_stage + fixed <= SMEM_BUDGET:
            return stages
    raise ValueError(f"Mosaic GPU decayed attention needs {2 * per_stage + fixed} bytes of SMEM")


def _interpret_params(interpret):
    """``interpret=True``: jax's Mosaic GPU interpreter (threads, barriers, TMA and wgmma simulated on
    CPU; a private API, so a jax without it raises NotImplementedError)."""
    if not interpret:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:  # pragma: no cover
        raise NotImplementedError("mosaic_gpu decayed_attention: this jax has no Mosaic GPU interpret mode") from e
    return InterpretGPUParams()


def forward_pass(q, x, y, g, rl, s0, *, chunk, pieces, block_v=None, write_o, write_h, interpret=False,
                 num_warps=None, num_stages=None):
    """Drop-in for :func:`pallas_gpu.forward_pass` (``block_v``, ``num_warps``, ``num_stages`` are
    Triton launch parameters and ignored here). ``write_h`` (the backward's state recompute) runs
    the Triton kernel."""
    if write_h:
        return _triton.forward_pass(q, x, y, g, rl, s0, chunk=chunk, pieces=pieces, block_v=block_v or 64,
                                    write_o=write_o, write_h=write_h, interpret=interpret,
                                    num_warps=num_warps or 4, num_stages=num_stages or 2)
    BH, L, dk = q.shape
    dv = y.shape[-1]
    reason = unsupported_reason(dk, dv, chunk, q.dtype)
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu decayed_attention: {reason}")
    C = CHUNK
    W = warpgroups(dv)
    G = ctas_per_head_piece(dv)
    P = pieces
    ncs = L // C // P  # chunks per piece
    dtype = q.dtype
    stages = _stages(dk, W, jnp.dtype(dtype).itemsize, write_o)
    rl = rl.astype(F32)  # small integers, exact; one TMA/vector path for both gate vectors

    out_type = []
    if write_o:
        out_type.append(jax.ShapeDtypeStruct((BH, L, dv), dtype))
    out_type.append(jax.ShapeDtypeStruct((BH, P, dk, dv), F32))

    vec = plgpu.SMEM((stages, C), F32)
    scratch = dict(
        x_s=mosaic_smem((stages, C, dk), dtype),
        y_s=mosaic_smem((W, stages, C, BLOCK_V), dtype),
        g_s=vec,
        r_s=vec,
        # per compute warpgroup: fp32 state staging (start / end only) aliased with the loop's tiles
        per_wg=tuple(plgpu.RefUnion(plgpu.SMEM((dk, BLOCK_V), F32),
                                    [mosaic_smem((dk, BLOCK_V), dtype), mosaic_smem((2, C, BLOCK_V), dtype)])
                     for _ in range(W)),
        ready=plgpu.Barrier(num_arrivals=(4 if write_o else 3) + W, num_barriers=stages),
        free=plgpu.Barrier(num_arrivals=W, num_barriers=stages),
        state_bar=plgpu.Barrier(num_barriers=W),
        done=plgpu.Barrier(num_arrivals=W + 1),
    )
    if write_o:
        scratch["q_s"] = mosaic_smem((stages, C, dk), dtype)

    if interpret:  # the interpreter has no layouts
        rows_ids = functools.partial(lax.broadcasted_iota, jnp.int32, (C, C))
    else:
        rows_ids = functools.partial(plgpu.broadcasted_iota, jnp.int32, (C, C), layout=plgpu.Layout.WGMMA)
    ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma tile
    COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column

    mma = mosaic_mma

    def load(ref, layout, optimized=True):
        """SMEM → registers in ``layout`` (the interpreter has no ``plgpu.load``: a plain read there)."""
        if interpret:
            return ref[...]
        return plgpu.load(ref, (), layout=layout, optimized=optimized)

    def bcast_rows(v, n):
        return lax.broadcast_in_dim(v, (C, n), [0])

    def body(q_ref, x_ref, y_ref, g_ref, r_ref, s0_ref, *outs, x_s, y_s, g_s, r_s, per_wg, ready, free, state_bar,
             done, q_s=None):
        o_ref = outs[0] if write_o else None
        s_end_ref = outs[-1]
        bh, p, gv = lax.axis_index("bh"), lax.axis_index("p"), lax.axis_index("v")
        c0 = p * ncs
        wg = lax.axis_index("wg")

        def col0(w):
            return (gv * W + w) * BLOCK_V

        @pl.when(wg == W)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(n, slot):
                rows = pl.ds((c0 + n) * C, C)
                bar = ready.at[slot]
                if write_o:
                    plgpu.copy_gmem_to_smem(q_ref.at[bh, rows], q_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(x_ref.at[bh, rows], x_s.at[slot], bar)
                for w in range(W):
                    plgpu.copy_gmem_to_smem(y_ref.at[bh, rows, pl.ds(col0(w), BLOCK_V)], y_s.at[w, slot], bar)
                plgpu.copy_gmem_to_smem(g_ref.at[bh, rows], g_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(r_ref.at[bh, rows], r_s.at[slot], bar)

            for n in range(min(stages, ncs)):
                issue(n, n)

            if ncs > stages:
                @pl.loop(stages, ncs)
                def _refill(n):
                    slot = lax.rem(n, stages)
                    plgpu.barrier_wait(free.at[slot])  # release of chunk n − stages
                    issue(n, slot)

            for n in range(max(ncs - stages, 0), ncs):  # the last releases, so no phase is left pending
                plgpu.barrier_wait(free.at[n % stages])

        for w in range(W):
            @pl.when(wg == w)
            def _compute(w=w):
                plgpu.set_max_registers(232 if W == 2 else 240, action="increase")
                st_s, (slo_s, o_s) = per_wg[w]
                cols = pl.ds(col0(w), BLOCK_V)
                plgpu.copy_gmem_to_smem(s0_ref.at[bh, p, :, cols], st_s, state_bar.at[w])
                plgpu.barrier_wait(state_bar.at[w])
                S0 = load(st_s, plgpu.Layout.WGMMA, optimized=False)  # once per CTA
                plgpu.commit_smem()  # every thread has read st_s before anyone writes its aliases

                def step(n, S):
                    slot = lax.rem(n, stages)
                    plgpu.barrier_wait(ready.at[slot])
                    y_tile = y_s.at[w, slot]
                    g_row = load(g_s.at[slot], ROWS)
                    r_row = load(r_s.at[slot], ROWS)
                    g_last = g_s[slot, C - 1]
                    r_last = r_s[slot, C - 1]
                    if write_o:
                        g_col = load(g_s.at[slot], COLS)
                        r_col = load(r_s.at[slot], COLS)
                        # S in the input dtype for q·S (wgmma's right operand lives in SMEM)
                        slo_s[...] = S.astype(dtype)
                        plgpu.commit_smem()
                        scores = mma(q_s.at[slot], x_s.at[slot].T, (C, C))
                        keep = (rows_ids(0) >= rows_ids(1)) & (
                            lax.broadcast_in_dim(r_row, (C, C), [0]) == lax.broadcast_in_dim(r_col, (C, C), [1]))
                        expo = jnp.where(keep, lax.broadcast_in_dim(g_row, (C, C), [0])
                                         - lax.broadcast_in_dim(g_col, (C, C), [1]), -jnp.inf)
                        probs = (scores * jnp.exp(expo)).astype(dtype)
                        inter = mma(q_s.at[slot], slo_s, (C, BLOCK_V))
                        q_decay = jnp.where(r_row == 0.0, jnp.exp(g_row), 0.0)
                        o = mma(probs, y_tile, (C, BLOCK_V), init=inter * bcast_rows(q_decay, BLOCK_V))
                        half = lax.rem(n, 2)
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the tile sent two chunks ago is read
                        o_s.at[half][...] = o.astype(dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_s.at[half], o_ref.at[bh, pl.ds((c0 + n) * C, C), cols])
                    # state update: S ← a S + xᵀ (w ⊙ y), w ⊙ y written over this warpgroup's y tile
                    w_last = jnp.where(r_row == r_last, jnp.exp(g_last - g_row), 0.0)
                    y_val = load(y_tile, plgpu.Layout.WGMMA).astype(F32)
                    y_tile[...] = (y_val * bcast_rows(w_last, BLOCK_V)).astype(dtype)
                    plgpu.commit_smem()
                    a_last = jnp.where(r_last == 0.0, jnp.exp(g_last), 0.0)
                    S = mma(x_s.at[slot].T, y_tile, (dk, BLOCK_V), init=S * a_last)
                    plgpu.barrier_arrive(free.at[slot])
                    return S

                S = lax.fori_loop(0, ncs, step, S0)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # output tiles (aliases of st_s) are read
                st_s[...] = S
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(st_s, s_end_ref.at[bh, p, :, cols])
                plgpu.wait_smem_to_gmem(0)

        # no warpgroup leaves while another still issues copies or wgmmas
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

    kernel = plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch, grid=(BH, P, G),
                          grid_names=("bh", "p", "v"), num_threads=W + 1, thread_name="wg",
                          compiler_params=plgpu.CompilerParams(), interpret=_interpret_params(interpret),
                          kernel_name="falcon_decayed_attention_fwd_mgpu")
    return tuple(kernel(q, x, y, g, rl, s0))


state_grad_pass = _triton.state_grad_pass
chunk_grad_pass = _triton.chunk_grad_pass
