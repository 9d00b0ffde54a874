"""Hopper kernels of ``decayed_delta_rule`` in Pallas Mosaic GPU (wgmma + TMA).

Only the backward's ``dstate_prepare`` pass is here (:func:`prepare_vb`): one chunk per CTA, no loop
carried from chunk to chunk, so it maps onto one warpgroup with TMA loads and wgmma products.
The rest of the op stays the Triton kernels of :mod:`pallas_gpu`.

Per chunk (``C = 64`` rows; ``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within a segment; with ``key_shift``
row ``s``'s write feature is the key of row ``s − 1``, zero at the sequence's first row)::

    X    = E₁ K_n + E₀ K_{n−1}           (key_shift) two wgmmas with 0/1 register operands: key s − 1 in row s
    Vloc = (Q Xᵀ ⊙ D)ᵀ dO              wgmma: Xᵀ-side scores from SMEM, masked in registers, then · dO
    V    = Tᵀ Vloc                       wgmma: T transposed from SMEM, Vloc staged to SMEM in bf16
    q_term = Qᵀ (c ⊙ dO)   (optional)    c_t = e^{g_t} where the chunk's first segment runs, else 0

the split reverse walk's ``dR = V + Tᵀ (w ⊙ X dS)`` and its ``(c ⊙ Q)ᵀ dO`` term of dS.

Every product is a 16-bit wgmma with fp32 accumulation.  The fp32 scores meet dO as two 16-bit parts,
``hi + lo`` (the Triton pass multiplies them in TF32); Vloc is rounded to the inputs' dtype before it meets T
(as there).
fp32 inputs are not served (wgmma would round them to TF32): :func:`unsupported_reason` says why, and
the op keeps the Triton pass.

Tested on the H200 only (``benchmarks/gpu_check_mosaic_prepare.py`` against the Triton pass and a
float64 reference): jax 0.10.2's CPU interpreter of Mosaic GPU has no transposed wgmma operands, so
CI only cross-lowers the kernel for CUDA (its results' shapes), checks what it refuses and which pass the op
takes (``tests/test_mosaic_gpu_decayed_delta.py``).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from pallas_kernels.common import mosaic_mma, mosaic_smem, token_dims

CHUNK = 64
F32 = jnp.float32


# the jax the kernel was checked and timed on (the H200's 0.11.2); older ones lower it (CI cross-lowers it on
# 0.10.2) but never ran it, so KernelConfig(prepare="auto") leaves them on the Triton pass
CHECKED_JAX = (0, 11)


def on_hopper() -> bool:
    """The default device is an sm_90 GPU (H100 / H200), and this jax has Pallas Mosaic GPU and is at least
    :data:`CHECKED_JAX`."""
    if plgpu is None or tuple(int(p) for p in jax.__version__.split(".")[:2]) < CHECKED_JAX:
        return False
    try:
        device = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return False
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def unsupported_reason(q, do, chunk: int, *, v_dtype, q_term_dtype=None, with_b: bool = False) -> str | None:
    """Why :func:`prepare_vb` cannot take this call (None: it can)."""
    if plgpu is None:
        return "this jax has no Pallas Mosaic GPU"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the Mosaic GPU prepare pass takes chunk_size={CHUNK}"
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(q.dtype).name}: bf16 or fp16 only (wgmma would round fp32 to TF32)"
    for name, d in (("dk", q.shape[-1]), ("dv", do.shape[-1])):
        if d not in (64, 128):
            return f"{name}={d}: the Mosaic GPU prepare pass takes 64 or 128"
    for name, dt in (("V", v_dtype), ("q-term", q_term_dtype)):
        if dt is not None and jnp.dtype(dt) != jnp.dtype(q.dtype):
            return f"{name} stored in {jnp.dtype(dt).name}: the Mosaic GPU prepare pass stores the inputs' dtype"
    if with_b:
        return "B = Tᵀ(w ⊙ X) (KernelConfig(dstate_b='stored')) is formed by the Triton pass only"
    return None


def _load(ref, layout):
    """SMEM → registers in ``layout``: the whole ref (jax 0.11's ``plgpu.load`` indexes it whole by default; an
    explicit empty index there fails its layout inference, while jax 0.10's requires the index)."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def prepare_vb(q, x, eta, g, gp, rl, tinv, do, *, chunk, heads=None, v_dtype=None, q_term_dtype=None,
               key_shift=False, interpret=False, with_b=True, walk_operands=None, num_warps=None, b_dtype=None):
    """Drop-in for :func:`pallas_gpu.prepare_vb` without B (``with_b=False``): returns ``(V, None, q_term)``.

    q, x ``[B·H, L, dk]`` or, with ``heads=H``, ``[B, L, H, dk]`` (read in place); do likewise with dv;
    eta, g, gp, rl ``[B·H, L]``; tinv ``[B·H, L, C]``.  V is shaped like do; q_term ``[B·H, L/C, dk, dv]``
    (None without ``q_term_dtype``).  ``num_warps`` and ``b_dtype`` (Triton's) are ignored; ``with_b`` and fp32
    ``walk_operands`` (None) raise NotImplementedError, as does anything :func:`unsupported_reason` names."""
    del eta, gp, num_warps, b_dtype
    if interpret:
        raise NotImplementedError("mosaic_gpu prepare_vb: runs on a Hopper GPU only (no CPU interpreter)")
    reason = unsupported_reason(q, do, chunk, v_dtype=v_dtype if v_dtype is not None else q.dtype,
                                q_term_dtype=q_term_dtype, with_b=with_b)
    if reason is None and tinv.dtype != q.dtype:
        reason = f"T stored in {jnp.dtype(tinv.dtype).name}: the wgmma takes it in the inputs' dtype"
    if reason is None and (walk_operands is None or jnp.dtype(walk_operands) != jnp.dtype(q.dtype)):
        reason = "the walk's operands in fp32 (KernelConfig(walk_operands='fp32')): the q-term would differ"
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu prepare_vb: {reason}")
    BH, L, dk = token_dims(q, heads)
    dv = do.shape[-1]
    H = heads or 1
    B = BH // H
    C = CHUNK
    n_chunks = L // C
    dtype = q.dtype
    with_q = q_term_dtype is not None
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)

    def rows_of(ref, b, h, start, rows=C):
        """``rows`` token rows from ``start``: ``[b, rows, h]`` in place, ``[b·H + h, rows]`` head-major."""
        span = pl.ds(pl.multiple_of(start, C), rows)
        return ref.at[b, span, h] if heads is not None else ref.at[b * H + h, span]

    vec = plgpu.SMEM((C,), F32)
    scratch = dict(q_s=mosaic_smem((C, dk), dtype), x_s=mosaic_smem((C, dk), dtype),
                   do_s=mosaic_smem((C, dv), dtype), t_s=mosaic_smem((C, C), dtype), v_s=mosaic_smem((C, dv), dtype),
                   # each gate vector twice, one buffer per register layout it is read in (rows, columns of the
                   # [C, C] tiles): one SMEM ref read in two layouts left jax 0.11.2's layout inference without a
                   # solution
                   g_r=vec, g_c=vec, r_r=vec, r_c=vec,
                   bar=plgpu.Barrier(num_arrivals=9 if key_shift else 8))
    if key_shift:  # the previous chunk's keys and this chunk's, shifted by products (below)
        scratch.update(kp_s=mosaic_smem((C, dk), dtype), kc_s=mosaic_smem((C, dk), dtype))
    out_type = [jax.ShapeDtypeStruct(do.shape, dtype)]
    halves = dk // C  # the q-term in [C, dv] row blocks (a wgmma accumulator of C rows)
    if with_q:
        if not (key_shift and dv == dk):  # else two key tiles, dead by then, stage its row blocks
            scratch["qt_s"] = mosaic_smem((dk, dv), dtype)
        out_type.append(jax.ShapeDtypeStruct((BH, n_chunks, dk, dv), dtype))

    def body(q_ref, x_ref, g_ref, r_ref, t_ref, do_ref, v_ref, *qt_out, q_s, x_s, do_s, t_s, v_s, g_r, g_c, r_r,
             r_c, bar, kp_s=None, kc_s=None, qt_s=None):
        b, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
        bh = b * H + h
        start = n * C
        plgpu.copy_gmem_to_smem(rows_of(q_ref, b, h, start), q_s, bar)
        if key_shift:
            # TMA tiles start on multiples of 8 rows, so the keys one row back are not one copy: chunks n − 1
            # (chunk 0 again for n = 0) and n come in, and 0/1 products pick key s − 1 for row s.  (Only the previous
            # chunk's last rows would do, but a bf16 wgmma's K is a multiple of 64 here.)
            plgpu.copy_gmem_to_smem(rows_of(x_ref, b, h, jnp.maximum(n - 1, 0) * C), kp_s, bar)
            plgpu.copy_gmem_to_smem(rows_of(x_ref, b, h, start), kc_s, bar)
        else:
            plgpu.copy_gmem_to_smem(rows_of(x_ref, b, h, start), x_s, bar)
        plgpu.copy_gmem_to_smem(rows_of(do_ref, b, h, start), do_s, bar)
        chunk_rows = pl.ds(pl.multiple_of(start, C), C)  # of the [B·H, L, ...] arrays
        plgpu.copy_gmem_to_smem(t_ref.at[bh, chunk_rows], t_s, bar)
        for src, dsts in ((g_ref, (g_r, g_c)), (r_ref, (r_r, r_c))):
            for dst in dsts:
                plgpu.copy_gmem_to_smem(src.at[bh, chunk_rows], dst, bar)
        plgpu.barrier_wait(bar)

        sq = (C, C)
        s_ids = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)  # key row s
        t_ids = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)  # query row t (or key r of a shift)
        if key_shift:
            # row s ← key s − 1: row s − 1 of this chunk, or (s = 0, n > 0) the previous chunk's last row; the
            # sequence's first write feature stays zero.  Exact: one unit product per entry.
            within = jnp.where(t_ids == s_ids - 1, 1.0, 0.0).astype(dtype)
            carried = jnp.where((s_ids == 0) & (t_ids == C - 1) & (n > 0), 1.0, 0.0).astype(dtype)
            x_s[...] = (mosaic_mma(within, kc_s, (C, dk)) + mosaic_mma(carried, kp_s, (C, dk))).astype(dtype)
            plgpu.commit_smem()
        g_s_rows, g_t_cols = _load(g_r, ROWS), _load(g_c, COLS)
        r_s_rows, r_t_cols = _load(r_r, ROWS), _load(r_c, COLS)
        keep = (s_ids <= t_ids) & (lax.broadcast_in_dim(r_s_rows, sq, [0]) == lax.broadcast_in_dim(r_t_cols, sq, [1]))
        expo = lax.broadcast_in_dim(g_t_cols, sq, [1]) - lax.broadcast_in_dim(g_s_rows, sq, [0])
        scores_t = mosaic_mma(x_s, q_s.T, sq)  # [s, t] = x_s · q_t
        # select, not multiply: the masked exponent is never exponentiated and a masked entry is exactly zero
        scores_t = jnp.where(keep, scores_t * jnp.exp(jnp.where(keep, expo, 0.0)), 0.0)
        # the fp32 scores as two 16-bit parts (hi + lo, ~16 mantissa bits): one 16-bit product rounded them to 8,
        # and the whole op's bf16 v-gradient error went to 2.1x the XLA form's (next77; the Triton pass forms
        # this product in TF32).  The pass is memory-bound, so the second product costs little
        hi = scores_t.astype(dtype)
        lo = (scores_t - hi.astype(F32)).astype(dtype)
        v_local = mosaic_mma(hi, do_s, (C, dv)) + mosaic_mma(lo, do_s, (C, dv))
        v_s[...] = v_local.astype(dtype)
        plgpu.commit_smem()
        v = mosaic_mma(t_s.T, v_s, (C, dv))  # Tᵀ Vloc; the wait inside frees v_s for V itself
        v_s[...] = v.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_s, rows_of(v_ref, b, h, start))
        if with_q:
            (qt_ref,) = qt_out
            cont = jnp.where(r_s_rows == 0.0, jnp.exp(g_s_rows), 0.0)
            # dO's rows scaled in place (its last reader, Vloc's product, has waited)
            do_rows = _load(do_s, WGMMA).astype(F32)
            do_s[...] = (lax.broadcast_in_dim(cont, (C, dv), [0]) * do_rows).astype(dtype)
            plgpu.commit_smem()
            for j in range(halves):
                rows = pl.ds(j * C, C)
                stage = qt_s.at[rows] if qt_s is not None else (kc_s, x_s)[j]  # x_s: dead after the scores
                stage[...] = mosaic_mma(q_s.at[:, rows].T, do_s, (C, dv)).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage, qt_ref.at[bh, n, rows])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, n_chunks, H),
                          grid_names=("b", "n", "h"), compiler_params=plgpu.CompilerParams(approx_math=True),
                          kernel_name="falcon_delta_dstate_prepare_mgpu")
    outs = kernel(q, x, g, rl.astype(F32), tinv, do)
    v = outs[0]
    return v, None, (outs[1] if with_q else None)
