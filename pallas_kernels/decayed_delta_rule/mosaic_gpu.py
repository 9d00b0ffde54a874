"""Hopper kernels of ``decayed_delta_rule`` in Pallas Mosaic GPU (wgmma + TMA).

Two backward passes, each one chunk per CTA with no loop carried from chunk to chunk, so each maps onto one
warpgroup with TMA loads and wgmma products: the ``dstate_prepare`` pass (:func:`prepare_vb`, the op's default
on a Hopper GPU under jax >= 0.11) and the stored chunk gradients (:func:`chunk_grad_stored_pass`, opt-in:
``KernelConfig(chunk_grads_kernel="mosaic")``; on the H200 it is 1.27-1.29x the Triton pass's time, see its
docstring).  The rest of the op stays the Triton kernels of :mod:`pallas_gpu`.

The prepare pass, per chunk (``C = 64`` rows; ``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within a segment; with
``key_shift`` row ``s``'s write feature is the key of row ``s − 1``, zero at the sequence's first row)::

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

Both are tested on the H200 only (``benchmarks/gpu_check_mosaic_prepare.py``,
``benchmarks/gpu_check_mosaic_chunk_grads.py``: against the Triton pass and a float64 reference): jax 0.10.2's
CPU interpreter of Mosaic GPU has no transposed wgmma operands, so CI only cross-lowers the kernels for CUDA
(their results' shapes, the outputs written over inputs), checks what they refuse and which pass the op takes
(``tests/test_mosaic_gpu_decayed_delta.py``).
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

from falcon_jax.kernels.common import default_gpu_major, mosaic_gpu_call, mosaic_mma, mosaic_smem, token_dims

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
    return default_gpu_major() == 9


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


def _token_rows(ref, heads, b, h, start, cols=None):
    """A chunk's ``C`` token rows from ``start`` (optionally a column block ``cols``): ``[b, rows, h]`` in place
    (``heads`` set), ``[b·H + h, rows]`` head-major (``heads`` None: one head per grid row)."""
    span = pl.ds(pl.multiple_of(start, CHUNK), CHUNK)
    idx = (b, span, h) if heads is not None else (b + h, span)
    return ref.at[idx] if cols is None else ref.at[(*idx, cols)]


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
    return v, None, (outs[1] if with_q else None)


def chunk_grads_unsupported_reason(q, y, chunk: int, *, h_dtype, p_dtype, dr_dtype, group: int = 1,
                                   walk_operands=None) -> str | None:
    """Why :func:`chunk_grad_stored_pass` cannot take this call (None: it can)."""
    if plgpu is None:
        return "this jax has no Pallas Mosaic GPU"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the Mosaic GPU chunk gradients take chunk_size={CHUNK}"
    if group != 1:
        return f"group={group} (the windowed rule's virtual writes): the Triton chunk gradients only"
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype.name}: bf16 or fp16 only (wgmma would round fp32 to TF32)"
    for name, d in (("dk", q.shape[-1]), ("dv", y.shape[-1])):
        if d not in (64, 128):
            return f"{name}={d}: the Mosaic GPU chunk gradients take 64 or 128"
    for name, dt in (("the chunk states", h_dtype), ("P", p_dtype), ("dR", dr_dtype)):
        if jnp.dtype(dt) != dtype:
            return (f"{name} stored in {jnp.dtype(dt).name}: the Mosaic GPU chunk gradients read the inputs' dtype "
                    f"(KernelConfig(stored_dr='input', walk_operands='input'))")
    if walk_operands is None or jnp.dtype(walk_operands) != dtype:
        return "the walk's operands in fp32 (KernelConfig(walk_operands='fp32')): the products would differ"
    return None


def chunk_grad_stored_pass(q, x, y, eta, g, gp, rl, do, h, dh, p, dr, *, chunk, interpret=False, group=1, heads=None,
                           walk_operands=None, key_shift=False, **triton_kw):
    """Drop-in for :func:`pallas_gpu.chunk_grad_stored_pass`: the chunk gradients from the ``P`` (recompute walk)
    and ``dR`` (reverse walk) the walks stored, one warpgroup per chunk.  Returns ``(dq, dx, dy, dη, dg, dg⁻)``.

    q, x ``[B·H, L, dk]`` or, with ``heads=H``, ``[B, L, H, dk]`` (x: the keys, read one row back with
    ``key_shift``); y, do, p, dr likewise with dv; eta, g, gp, rl ``[B·H, L]``; h, dh ``[B·H, L/C, dk, dv]`` (each
    chunk's start state and end-state gradient).  dy is written over dR and, where they share shape and dtype, dx
    over P (as the Triton pass does).  Per chunk (rows t, columns s; ``D`` the decay mask, ``Γ`` its strict
    version from ``g⁻``; ``c``, ``c⁻``, ``w`` the start/end-state gates of ``pallas_gpu._gates``)::

        dA = −dR Pᵀ ⊙ Γ,  dK = η ⊙ dA,  dS = dO Pᵀ ⊙ D     (and their transposes, as products Pᵀ-first)
        dq = c ⊙ dO hᵀ + dS X
        dx = dSᵀ Q + (dK + dKᵀ) X + w ⊙ P dhᵀ − (η c⁻) ⊙ dR hᵀ
        dy = η ⊙ dR

    and the gate rows; every column sum of a ``[C, C]`` tile is the row sum of its transpose, formed by its own
    product (one more 64×64×d wgmma each; a column reduction across warps is avoided).  The state's row terms
    (``Σ_v dR ⊙ X h`` …) are row sums against ``X h``, ``X dh``, ``Q h``.  The chunk's last row of dg gets
    ``Σ_t w ⊙ Σ_v P ⊙ X dh + a ⟨h, dh⟩``, which the kernel leaves as a per-row term summed here in XLA.

    Every product is a 16-bit wgmma with fp32 accumulation, the inputs' dtype as the Triton pass rounds them
    (``walk_operands`` = the inputs' dtype).  Refuses (NotImplementedError) what
    :func:`chunk_grads_unsupported_reason` names, and interpret mode.

    On the H200 (bf16, H16, d128, keys one row back in place; ``benchmarks/gpu_check_mosaic_chunk_grads.py``,
    next81) its errors against float64 equal the Triton pass's in all eight value cases, but it takes 1.27-1.29x
    the Triton pass's time alone (0.68 vs 0.54 ms at 8x2048 and 2x8192, 1.31 vs 1.01 at 1x32768, both with
    the copies of P and dR their aliases need outside the op).  About 211 KB of SMEM per CTA (the chunk's six
    [C, d] tiles, two [dk, dv] states, the keys' two previous-chunk tiles) leaves one CTA per SM, so a chunk's
    loads, ~20 serial wgmma waits and stores do not overlap another chunk's; issuing the products in groups with
    one wait each was slower still (1.37x, next80: more accumulators live at once).  Hence opt-in."""
    del triton_kw  # block sizes, warps, stages, loops of the Triton pass
    if interpret:
        raise NotImplementedError("mosaic_gpu chunk_grad_stored_pass: runs on a Hopper GPU only (no CPU interpreter)")
    reason = chunk_grads_unsupported_reason(q, y, chunk, h_dtype=h.dtype, p_dtype=p.dtype, dr_dtype=dr.dtype,
                                            group=group, walk_operands=walk_operands)
    if reason is None and (dh.dtype != h.dtype or dr.shape != y.shape):
        reason = f"dh in {jnp.dtype(dh.dtype).name} or dR shaped {dr.shape}: stored as the chunk states / like y"
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu chunk_grad_stored_pass: {reason}")
    BH, L, dk = token_dims(q, heads)
    dv = y.shape[-1]
    H = heads or 1
    B = BH // H
    C = CHUNK
    n_chunks = L // C
    dtype = q.dtype
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    key_blocks = dk // C  # dq, dx in [C, C] column blocks (the accumulators stay [C, C])
    dx_over_p = p.shape == x.shape and p.dtype == x.dtype

    vec = plgpu.SMEM((C,), F32)
    tile_k, tile_v = mosaic_smem((C, dk), dtype), mosaic_smem((C, dv), dtype)
    # each gate vector twice, one buffer per register layout it is read in (see prepare_vb)
    gate_order = ("eta", "g", "gp", "rl")
    gate_names = [f"{gate}_{layout}" for gate in gate_order for layout in ("r", "c")]
    scratch = dict(q_s=tile_k, x_s=tile_k, y_s=tile_v, do_s=tile_v, p_s=tile_v, dr_s=tile_v,
                   h_s=mosaic_smem((dk, dv), dtype), dh_s=mosaic_smem((dk, dv), dtype),
                   dq_st=mosaic_smem((C, C), dtype), dx_st=mosaic_smem((C, C), dtype),
                   **{name: vec for name in gate_names}, **{f"{o}_st": vec for o in ("deta", "dg", "dgp", "end")},
                   bar_v=plgpu.Barrier(num_arrivals=4 + len(gate_names)),
                   bar_k=plgpu.Barrier(num_arrivals=5 if key_shift else 4))
    if key_shift:
        scratch.update(kp_s=tile_k, kc_s=tile_k)
    vec_out = jax.ShapeDtypeStruct((BH, L), F32)
    out_shape = [jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(q.shape, dtype),
                 jax.ShapeDtypeStruct(x.shape, x.dtype), vec_out, vec_out, vec_out, vec_out]

    def chunk_body(q_ref, x_ref, y_ref, do_ref, p_ref, dr_ref, h_ref, dh_ref, eta_ref, g_ref, gp_ref, rl_ref,
                   dy_ref, dq_ref, dx_ref, deta_ref, dg_ref, dgp_ref, end_ref, *, q_s, x_s, y_s, do_s, p_s, dr_s, h_s,
                   dh_s, dq_st, dx_st, bar_v, bar_k, deta_st, dg_st, dgp_st, end_st, kp_s=None, kc_s=None, **gates):
        b, n, h_ = grid_ids()
        bh = b * H + h_
        start = n * C
        chunk_rows = pl.ds(pl.multiple_of(start, C), C)  # of the [B·H, L] rows
        # the value operands first (dy and the value sums need no more), then the keys and states
        for src, dst in ((dr_ref, dr_s), (p_ref, p_s), (do_ref, do_s), (y_ref, y_s)):
            plgpu.copy_gmem_to_smem(_token_rows(src, heads, b, h_, start), dst, bar_v)
        for gate, src in zip(gate_order, (eta_ref, g_ref, gp_ref, rl_ref)):
            for layout in ("r", "c"):
                plgpu.copy_gmem_to_smem(src.at[bh, chunk_rows], gates[f"{gate}_{layout}"], bar_v)
        plgpu.copy_gmem_to_smem(_token_rows(q_ref, heads, b, h_, start), q_s, bar_k)
        _copy_keys(x_ref, heads, b, h_, n, start, bar_k, x_s=x_s, kp_s=kp_s, kc_s=kc_s)
        plgpu.copy_gmem_to_smem(h_ref.at[bh, n], h_s, bar_k)
        plgpu.copy_gmem_to_smem(dh_ref.at[bh, n], dh_s, bar_k)

        sq = (C, C)
        row_ids = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
        col_ids = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
        plgpu.barrier_wait(bar_v)
        eta_r, g_r, gp_r, rl_r = (_load(gates[f"{gate}_r"], ROWS) for gate in gate_order)
        eta_c, g_c, gp_c, rl_c = (_load(gates[f"{gate}_c"], COLS) for gate in gate_order)

        def rows_bc(v, shape=sq):
            return lax.broadcast_in_dim(v, shape, [0])

        def cols_bc(v):
            return lax.broadcast_in_dim(v, sq, [1])

        def last_of(v_cols):  # the chunk's last entry of a column vector, on every row
            return jnp.sum(jnp.where(col_ids == C - 1, cols_bc(v_cols), 0.0), axis=1)

        g_last, rl_last = last_of(g_c), last_of(rl_c)
        first_seg = rl_r == 0.0
        cont = jnp.where(first_seg, jnp.exp(g_r), 0.0)
        cont_p = jnp.where(first_seg, jnp.exp(gp_r), 0.0)
        w_last = jnp.where(rl_r == rl_last, jnp.exp(g_last - g_r), 0.0)
        a_last = jnp.where(rl_last == 0.0, jnp.exp(g_last), 0.0)

        # the [C, C] masks are formed where they are used, one at a time (each is 32 fp32 registers a thread)
        def masked_exp(transposed, strict, row_gate):
            """[t, s]: e^{row_gate_t − g_s} on s ≤ t (s < t if strict) within a segment; transposed ([s, t],
            rows s): the same entries, from the column vectors.  A select, not a multiply: a masked entry is exactly
            zero and its exponent is never exponentiated."""
            t_ids, s_ids = (col_ids, row_ids) if transposed else (row_ids, col_ids)
            keep = ((s_ids < t_ids) if strict else (s_ids <= t_ids)) & (rows_bc(rl_r) == cols_bc(rl_c))
            if transposed:
                expo = cols_bc(dict(g=g_c, gp=gp_c)[row_gate]) - rows_bc(g_r)
            else:
                expo = rows_bc(dict(g=g_r, gp=gp_r)[row_gate]) - cols_bc(g_c)
            return jnp.where(keep, jnp.exp(jnp.where(keep, expo, 0.0)), 0.0)

        # dy = η ⊙ dR (over dR: this chunk's dR rows are in SMEM now) and Σ_v dR ⊙ Y
        dr_v = _load(dr_s, WGMMA).astype(F32)
        d_ey = jnp.sum(dr_v * _load(y_s, WGMMA).astype(F32), axis=1)
        y_s[...] = (rows_bc(eta_r, (C, dv)) * dr_v).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_s, _token_rows(dy_ref, heads, b, h_, start))
        plgpu.barrier_wait(bar_k)
        if key_shift:
            _shift_keys(x_s, kp_s, kc_s, n)
        gram = mosaic_mma(x_s, x_s.T, sq)  # symmetric: its own transpose
        # [t, s]: dA ⊙ Γ, dK = η ⊙ dA ⊙ Γ, the decay gradient and dS
        da_gamma = -mosaic_mma(dr_s, p_s.T, sq) * masked_exp(False, True, "gp")
        d_k = da_gamma * rows_bc(eta_r)
        deta = d_ey + jnp.sum(da_gamma * gram, axis=1)
        dgp = jnp.sum(d_k * gram, axis=1)
        d_op = mosaic_mma(do_s, p_s.T, sq)
        decay = masked_exp(False, False, "g")
        dg = jnp.sum(d_op * mosaic_mma(q_s, x_s.T, sq) * decay, axis=1)
        d_s = (d_op * decay).astype(dtype)
        # [s, t]: the same from Pᵀ-first products; their row sums are the column sums above
        d_k_t = -mosaic_mma(p_s, dr_s.T, sq) * masked_exp(True, True, "gp") * cols_bc(eta_c)
        dg = dg - jnp.sum(d_k_t * gram, axis=1)
        d_sym = (d_k + d_k_t).astype(dtype)
        d_op_t = mosaic_mma(p_s, do_s.T, sq)
        decay_t = masked_exp(True, False, "g")
        dg = dg - jnp.sum(d_op_t * mosaic_mma(x_s, q_s.T, sq) * decay_t, axis=1)
        d_s_t = (d_op_t * decay_t).astype(dtype)

        # the state's row terms: Σ_v dR ⊙ X h, Σ_v P ⊙ X dh, Σ_v dO ⊙ Q h, and ⟨h, dh⟩ by row halves
        wide = (C, dv)
        d_xh = jnp.sum(_load(dr_s, WGMMA).astype(F32) * mosaic_mma(x_s, h_s, wide), axis=1)
        d_wl = jnp.sum(_load(p_s, WGMMA).astype(F32) * mosaic_mma(x_s, dh_s, wide), axis=1)
        q_do_h = jnp.sum(_load(do_s, WGMMA).astype(F32) * mosaic_mma(q_s, h_s, wide), axis=1)
        h_dh = None
        for j in range(key_blocks):
            rows = pl.ds(j * C, C)
            part = jnp.sum(_load(h_s.at[rows], WGMMA).astype(F32) * _load(dh_s.at[rows], WGMMA).astype(F32), axis=1)
            h_dh = part if h_dh is None else h_dh + part
        wl = w_last * d_wl
        deta_st[...] = deta - cont_p * d_xh
        dgp_st[...] = dgp - eta_r * cont_p * d_xh
        dg_st[...] = dg - wl + cont * q_do_h
        end_st[...] = wl + a_last * h_dh  # summed over the chunk into its last row's dg (the caller)
        plgpu.commit_smem()
        for ref, src in ((deta_ref, deta_st), (dg_ref, dg_st), (dgp_ref, dgp_st), (end_ref, end_st)):
            plgpu.copy_smem_to_gmem(src, ref.at[bh, chunk_rows])

        for j in range(key_blocks):  # dq, dx by [C, C] column blocks (key dims j·C ...)
            cols = pl.ds(j * C, C)
            h_j, dh_j = h_s.at[cols], dh_s.at[cols]  # [C key dims, dv]
            x_j, q_j = x_s.at[:, cols], q_s.at[:, cols]
            dq = rows_bc(cont) * mosaic_mma(do_s, h_j.T, sq) + mosaic_mma(d_s, x_j, sq)
            dx = (mosaic_mma(d_s_t, q_j, sq) + mosaic_mma(d_sym, x_j, sq)
                  + rows_bc(w_last) * mosaic_mma(p_s, dh_j.T, sq)
                  - rows_bc(eta_r * cont_p) * mosaic_mma(dr_s, h_j.T, sq))
            if j:  # the previous block's stores have read the staging tiles
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dq_st[...] = dq.astype(dtype)
            dx_st[...] = dx.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_st, _token_rows(dq_ref, heads, b, h_, start, cols))
            plgpu.copy_smem_to_gmem(dx_st, _token_rows(dx_ref, heads, b, h_, start, cols))
        plgpu.wait_smem_to_gmem(0)

    call, grid_ids = mosaic_gpu_call(chunk_body, out_shape=out_shape, grid=(B, n_chunks, H), grid_names=("b", "n", "h"),
                                     scratch=scratch, aliases={5: 0, **({4: 2} if dx_over_p else {})},
                                     name="falcon_delta_chunk_grads_mgpu")
    dy, dq, dx, deta, dg, dgp, end = call(q, x, y, do, p, dr, h, dh, eta, g, gp, rl.astype(F32))
    # the chunk's last row of dg: Σ_t w_t Σ_v (P ⊙ X dh)_t + a ⟨h, dh⟩
    dg = dg.reshape(BH, n_chunks, C).at[:, :, -1].add(end.reshape(BH, n_chunks, C).sum(-1)).reshape(BH, L)
    return dq, dx, dy, deta, dg, dgp
