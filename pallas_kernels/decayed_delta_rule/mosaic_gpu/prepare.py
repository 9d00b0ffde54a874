"""The backward's per-chunk preparation of the state-gradient walk as a Pallas Mosaic GPU kernel (Hopper).

One chunk per CTA, no loop carried between chunks, so it maps onto one warpgroup with TMA loads and wgmma
products.  Per chunk (``C = 64`` rows; ``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within a segment; with
``key_shift`` row ``s``'s write feature is the key of row ``s − 1``, zero at the sequence's first row)::

    X    = E₁ K_n + E₀ K_{n−1}           (key_shift) two wgmmas with 0/1 register operands: key s − 1 in row s
    Vloc = (Q Xᵀ ⊙ D)ᵀ dO              wgmma: Xᵀ-side scores from SMEM, masked in registers, then · dO
    V    = Tᵀ Vloc                       wgmma: T transposed from SMEM, Vloc staged to SMEM in bf16
    q_term = Qᵀ (c ⊙ dO)   (optional)    c_t = e^{g_t} where the chunk's first segment runs, else 0

Every product is a 16-bit wgmma with fp32 accumulation.  The fp32 scores meet dO as two 16-bit parts,
``hi + lo`` (the Triton pass multiplies them in TF32); Vloc is rounded to the inputs' dtype before it meets T
(as there).  fp32 inputs are not served (wgmma would round them to TF32): :func:`unsupported_reason` says why,
and the op keeps the Triton pass.  Its values are checked on a Hopper GPU (``tests/test_gpu_kernels.py``); CI
cross-lowers it for CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import mosaic_mma, mosaic_smem, plgpu, token_dims
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu.common import CHUNK, F32, _load, _token_rows


def unsupported_reason(q, do, chunk: int, *, v_dtype, q_term_dtype=None) -> str | None:
    """Why :func:`prepare_v` cannot take this call (None: it can)."""
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
    return None


def _copy_keys(x_ref, heads, b, h, n, start, bar, *, x_s, kp_s=None, kc_s=None):
    """TMA chunk ``n``'s keys (rows from ``start`` = n·C) into ``x_s``, or with the keys read one row back
    (``kp_s``, ``kc_s`` given) chunks ``n − 1`` (chunk 0 again for n = 0) and ``n`` for :func:`_shift_keys`: TMA
    tiles start on multiples of 8 rows, so the keys one row back are not one copy.  (Only the previous chunk's last
    rows would do, but a bf16 wgmma's K is a multiple of 64 here.)  Arrives on ``bar`` once per copy: one, or two
    with the shift."""
    if kp_s is None:
        plgpu.copy_gmem_to_smem(_token_rows(x_ref, heads, b, h, start), x_s, bar)
        return
    plgpu.copy_gmem_to_smem(_token_rows(x_ref, heads, b, h, jnp.maximum(n - 1, 0) * CHUNK), kp_s, bar)
    plgpu.copy_gmem_to_smem(_token_rows(x_ref, heads, b, h, start), kc_s, bar)


def _shift_keys(x_s, kp_s, kc_s, n):
    """``x_s`` ← the write features of chunk ``n`` with the keys read one row back, from :func:`_copy_keys`' two
    tiles: row s ← key s − 1, row s − 1 of this chunk or (s = 0, n > 0) the previous chunk's last row; the
    sequence's first write feature stays zero.  Two 0/1 products, exact: one unit product per entry."""
    sq, dtype = (CHUNK, CHUNK), x_s.dtype
    rows = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=plgpu.Layout.WGMMA)
    within = jnp.where(cols == rows - 1, 1.0, 0.0).astype(dtype)
    carried = jnp.where((rows == 0) & (cols == CHUNK - 1) & (n > 0), 1.0, 0.0).astype(dtype)
    x_s[...] = (mosaic_mma(within, kc_s, x_s.shape) + mosaic_mma(carried, kp_s, x_s.shape)).astype(dtype)
    plgpu.commit_smem()


def prepare_v(q, x, eta, g, gp, rl, tinv, do, *, chunk, heads=None, v_dtype=None, q_term_dtype=None,
              key_shift=False, interpret=False, walk_operands=None, num_warps=None):
    """Drop-in for :func:`..triton.state_grads.prepare_v`: returns ``(V, q_term)``.

    q, x ``[B·H, L, dk]`` or, with ``heads=H``, ``[B, L, H, dk]`` (read in place); do likewise with dv;
    eta, g, gp, rl ``[B·H, L]``; tinv ``[B·H, L, C]``.  V is shaped like do; q_term ``[B·H, L/C, dk, dv]``
    (None without ``q_term_dtype``).  ``num_warps`` (Triton's) is ignored; fp32 ``walk_operands`` (None) raise
    NotImplementedError, as does anything :func:`unsupported_reason` names."""
    del eta, gp, num_warps
    if interpret:
        raise NotImplementedError("mosaic_gpu prepare_v: runs on a Hopper GPU only (no CPU interpreter)")
    reason = unsupported_reason(q, do, chunk, v_dtype=v_dtype if v_dtype is not None else q.dtype,
                                q_term_dtype=q_term_dtype)
    if reason is None and tinv.dtype != q.dtype:
        reason = f"T stored in {jnp.dtype(tinv.dtype).name}: the wgmma takes it in the inputs' dtype"
    if reason is None and (walk_operands is None or jnp.dtype(walk_operands) != jnp.dtype(q.dtype)):
        reason = "the walk's operands in fp32 (KernelConfig(walk_operands='fp32')): the q-term would differ"
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu prepare_v: {reason}")
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
        plgpu.copy_gmem_to_smem(_token_rows(q_ref, heads, b, h, start), q_s, bar)
        _copy_keys(x_ref, heads, b, h, n, start, bar, x_s=x_s, kp_s=kp_s, kc_s=kc_s)
        plgpu.copy_gmem_to_smem(_token_rows(do_ref, heads, b, h, start), do_s, bar)
        chunk_rows = pl.ds(pl.multiple_of(start, C), C)  # of the [B·H, L, ...] arrays
        plgpu.copy_gmem_to_smem(t_ref.at[bh, chunk_rows], t_s, bar)
        for src, dsts in ((g_ref, (g_r, g_c)), (r_ref, (r_r, r_c))):
            for dst in dsts:
                plgpu.copy_gmem_to_smem(src.at[bh, chunk_rows], dst, bar)
        plgpu.barrier_wait(bar)

        sq = (C, C)
        s_ids = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)  # key row s
        t_ids = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)  # query row t
        if key_shift:
            _shift_keys(x_s, kp_s, kc_s, n)
        g_s_rows, g_t_cols = _load(g_r, ROWS), _load(g_c, COLS)
        r_s_rows, r_t_cols = _load(r_r, ROWS), _load(r_c, COLS)
        keep = (s_ids <= t_ids) & (lax.broadcast_in_dim(r_s_rows, sq, [0]) == lax.broadcast_in_dim(r_t_cols, sq, [1]))
        expo = lax.broadcast_in_dim(g_t_cols, sq, [1]) - lax.broadcast_in_dim(g_s_rows, sq, [0])
        scores_t = mosaic_mma(x_s, q_s.T, sq)  # [s, t] = x_s · q_t
        # select, not multiply: the masked exponent is never exponentiated and a masked entry is exactly zero
        scores_t = jnp.where(keep, scores_t * jnp.exp(jnp.where(keep, expo, 0.0)), 0.0)
        # the fp32 scores as two 16-bit parts (hi + lo, ~16 mantissa bits): one 16-bit product rounded them to 8,
        # and the whole op's bf16 v-gradient error went to 2.1x the XLA form's (the Triton pass forms this
        # product in TF32).  The pass is memory-bound, so the second product costs little
        hi = scores_t.astype(dtype)
        lo = (scores_t - hi.astype(F32)).astype(dtype)
        v_local = mosaic_mma(hi, do_s, (C, dv)) + mosaic_mma(lo, do_s, (C, dv))
        v_s[...] = v_local.astype(dtype)
        plgpu.commit_smem()
        v = mosaic_mma(t_s.T, v_s, (C, dv))  # Tᵀ Vloc; the wait inside frees v_s for V itself
        v_s[...] = v.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_s, _token_rows(v_ref, heads, b, h, start))
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
    return v, (outs[1] if with_q else None)

