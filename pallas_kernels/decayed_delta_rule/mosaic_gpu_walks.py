"""The chunk walks of ``decayed_delta_rule`` as Pallas Mosaic GPU kernels on thread-block clusters (Hopper).

Why clusters.  A walk carries one head's ``[dk, dv]`` state through every chunk in turn, so the only parallelism
inside a head is over value columns: the Triton walks (``pallas_gpu.forward_pass``) give each of a head's value
blocks its own program, and each of those programs reads the chunk's whole ``[C, dk]`` keys, queries, ``[C, C]``
inverse and scores every step.  With 16 batch·heads at 1×32768 (8 blocks of 16 columns, 128 programs) that is
≈ 3.5 GB per walk through L2, which bounds the long walks (docs/kernels.md, thirteenth run).  Here a head's value
blocks are the CTAs of one cluster: the tiles every block needs are loaded once per cluster by TMA multicast
(each CTA loads a share, every CTA receives the whole tile), and only the block's own ``[C, block_v]`` values,
gates and outputs are its own.

One CTA = one warpgroup computing + one issuing the loads (``plgpu.emit_pipeline_warp_specialized``, ``stages``
chunks in flight; a slot is refilled only when every CTA of the cluster has consumed it).  Per chunk, with the
state ``S`` ``[dk, block_v]`` in fp32 registers (rows ``t`` of the chunk; ``c``, ``c⁻``, ``w``, ``a`` the gates of
``pallas_gpu._gates``, formed here in XLA)::

    R = η ⊙ Y − (η c⁻) ⊙ X S           wgmma X · S       (S rounded to the inputs' dtype, as the Triton walk)
    P = T R                            wgmma T · R            (R rounded likewise; T stored in the inputs' dtype)
    o = (QXᵀ ⊙ D) P + c ⊙ Q S          wgmma scores · P, Q · S   (write_o; the scores from masked_scores_pass)
    S ← a S + Xᵀ (w ⊙ P)              wgmma Xᵀ · (w ⊙ P)

Every product is a 16-bit wgmma with fp32 accumulation, rounding the same operands the Triton walk rounds with
``walk_operands`` = the inputs' dtype.  All the SMEM tiles of a wgmma share one swizzle, so every tile here is
tiled ``(8, block_v)`` with a ``2·block_v``-byte swizzle (the narrow ``[·, block_v]`` operands set it).

Keys read one row back in place (``key_shift``, Falcon-1's call) would need a TMA copy starting one row before a
chunk, which the tiled copies a wgmma operand needs cannot do (a copy of 8-row tiles starts on a tile); with
``key_shift`` the walk shifts a copy of the keys in XLA first (one more read and write of ``[B, L, H, dk]``).

The split reverse walk of the backward (``reverse_walk``) is the same kind of kernel, walking the chunks last
first; it writes dR (and dh) over V (and the q-term) as the Triton walk does, through refs (``jax.new_ref``) that
``pl.kernel`` aliases in and out of the Mosaic GPU call (``plgpu.kernel`` takes no aliases).  It can form the
q-term itself (the op's default since the twenty-fourth run: one more product off the chain through dS) and V too
(opt-in, ``KernelConfig(dstate_v="walk")``: slower on the H200).

Checked on the GPU only (``benchmarks/gpu_check_mosaic_walks.py``); CI cross-lowers it for CUDA and checks what
it refuses (``tests/test_mosaic_gpu_walks.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

from falcon_jax.kernels.common import chunk_state_dtype, shift_time, token_dims
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu import CHUNK, _load
from falcon_jax.kernels.decayed_delta_rule.pallas_gpu import _gates

F32 = jnp.float32
CLUSTER = "cluster"
MAX_CLUSTER = 8  # the portable thread-block cluster size
SMEM_BYTES = 232448  # a Hopper CTA's shared memory
BLOCK_WIDTHS = (16, 32, 64)  # value columns per CTA: the tiles' swizzle is 2·width bytes (32, 64, 128)
REGISTER_FORM_BLOCK_V = 64  # the register form's value columns: a wgmma's left operand has 64 rows


def walk_unsupported_reason(x, y, chunk: int, *, block_v: int, pieces: int = 1, walk_operands=None, t_dtype=None,
                            scores_dtype=None) -> str | None:
    """Why :func:`forward_walk` cannot take this call (None: it can)."""
    if plgpu is None:
        return "this jax has no Pallas Mosaic GPU"
    if chunk != CHUNK:
        return f"chunk_size={chunk}: the Mosaic GPU walks take chunk_size={CHUNK}"
    dtype = jnp.dtype(x.dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype.name}: bf16 or fp16 only (wgmma would round fp32 to TF32)"
    if walk_operands is None or jnp.dtype(walk_operands) != dtype:
        return "the walk's operands in fp32 (KernelConfig(walk_operands='fp32')): the products would differ"
    for name, dt in (("T", t_dtype), ("the scores", scores_dtype)):
        if dt is not None and jnp.dtype(dt) != dtype:
            return f"{name} stored in {jnp.dtype(dt).name}: the wgmma takes it in the inputs' dtype"
    dk, dv = x.shape[-1], y.shape[-1]
    if dk not in (64, 128):
        return f"dk={dk}: the Mosaic GPU walks take 64 or 128"
    if block_v not in BLOCK_WIDTHS:
        return f"block_v={block_v}: the Mosaic GPU walks take {' or '.join(map(str, BLOCK_WIDTHS))} value columns"
    if dv % block_v or dv // block_v > MAX_CLUSTER:
        return (f"dv={dv} in blocks of {block_v}: a head's blocks form one cluster, at most {MAX_CLUSTER} CTAs "
                f"(block_v must divide dv, dv / block_v <= {MAX_CLUSTER})")
    if pieces != 1:
        return f"pieces={pieces}: the Mosaic GPU walks walk whole sequences"
    return None


def _tile(dtype, width):
    """Transforms of an SMEM tile that a wgmma with ``width``-column narrow operands reads: ``(8, width)`` tiles,
    swizzled by ``width`` elements' bytes (one swizzle for both operands of a wgmma)."""
    swizzle = width * jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(swizzle))


def _products(*pairs):
    """``[a @ b for a, b, shape in pairs]`` (fp32) issued together, one wait for all (see ``common.mosaic_mma``)."""
    def scoped(*accs):
        for acc, (a, b, _) in zip(accs, pairs):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    out = pl.run_scoped(scoped, *(plgpu.ACC(shape, F32) for _, _, shape in pairs))
    return lax.optimization_barrier(out)


def _cols_bc(v, rows):
    """A ``[cols]`` vector broadcast over ``rows`` rows: ``[rows, cols]``."""
    return lax.broadcast_in_dim(v, (rows, v.shape[0]), [1])


def _store_transposed(ref, value):
    """A ``[rows, cols]`` value (WGMMA layout) into a ``[cols, rows]`` SMEM tile."""
    ref.T[...] = plgpu.layout_cast(value.astype(ref.dtype), plgpu.Layout.WGMMA_TRANSPOSED)


def _load_transposed(ref):
    """A ``[cols, rows]`` SMEM tile as a ``[rows, cols]`` fp32 value in the WGMMA layout."""
    value = _load(ref.T, plgpu.Layout.WGMMA_TRANSPOSED)
    return plgpu.layout_cast(value, plgpu.Layout.WGMMA).astype(F32)


def _carry_state(pipeline, state_in, state_out, st_s, bar):
    """A walk's ``compute_context``: the fp32 state from ``state_in`` (GMEM) through SMEM into the pipeline's carry,
    and the carry at the end out to ``state_out``."""
    plgpu.copy_gmem_to_smem(state_in, st_s, bar)
    plgpu.barrier_wait(bar)
    end = pipeline(_load(st_s, plgpu.Layout.WGMMA))
    st_s[...] = end
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(st_s, state_out)
    plgpu.wait_smem_to_gmem(0)


def _walk_dims(x, v, heads, block_v):
    """``(BH, B, H, dk, dv, n_blocks, n)`` of a walk over ``x`` (keys) and ``v`` (values) in ``block_v``-column
    blocks of ``CHUNK``-row chunks."""
    BH, L, dk = token_dims(x, heads)
    dv = v.shape[-1]
    H = heads or 1
    return BH, BH // H, H, dk, dv, dv // block_v, L // CHUNK


def walk_gates(eta, g, gp, rl, chunk, dk):
    """The row gates the walks read, from the chunk-local ``g``, ``gp``, run index ``rl`` ``[BH, L]``: ``η``,
    ``η c⁻`` (the residual's S-term), ``w`` (a write's decay to the chunk end), ``c`` (S_0's decay to a read),
    each ``[BH, L]``, and ``a`` (the state's decay over the chunk) repeated over the ``dk`` state rows,
    ``[BH, L/C · dk]``."""
    BH, L = eta.shape
    n = L // chunk
    eta3, g3, gp3, rl3 = (v.reshape(BH, n, chunk) for v in (eta, g, gp, rl))
    cont, cont_p, w, a = _gates(eta3, g3, gp3, rl3, g3[..., -1:], rl3[..., -1:])
    rows = [v.reshape(BH, L).astype(F32) for v in (eta3, eta3 * cont_p, w, cont)]
    return (*rows, jnp.broadcast_to(a, (BH, n, dk)).reshape(BH, n * dk).astype(F32))


def forward_walk(q, x, y, eta, g, gp, rl, tinv, s0, *, chunk, heads=None, scores=None, write_o=True,
                 write_p=False, write_h=False, block_v=16, stages=3, walk_operands=None, p_dtype=None,
                 key_shift=False, pieces=1, form="smem", **triton_kw):
    """Drop-in for :func:`pallas_gpu.forward_pass` (one piece): walks every batch·head's chunks with one cluster
    of ``dv / block_v`` CTAs.

    q, x ``[B·H, L, dk]`` or, with ``heads=H``, ``[B, L, H, dk]`` (read in place); y likewise with dv; eta, g,
    gp, rl ``[B·H, L]`` (chunk-local g, gp, run index); tinv ``[B·H, L, C]`` in the inputs' dtype; s0
    ``[B·H, 1, dk, dv]`` fp32; ``scores`` ``[B·H, L, C]`` (the masked scores, ``masked_scores_pass``, in the
    inputs' dtype) with ``write_o``.  Returns, as ``forward_pass`` does, ``(o like y if write_o, P like y in
    p_dtype (default walk_operands) if write_p, h [B·H, L/C, dk, dv] in the chunk-state dtype if write_h,
    s_end [B·H, 1, dk, dv] fp32)``.  Refuses (NotImplementedError) what :func:`walk_unsupported_reason` names.

    ``form``: ``"smem"`` (the state and each product's narrow operand go through SMEM as wgmma's B operand) or
    ``"registers"`` (value-major: the walk carries ``Sᵀ`` ``[block_v, dk]`` and every product takes its left
    operand from registers, ``Sᵀ Xᵀ``, ``Rᵀ Tᵀ``, ``(w ⊙ P)ᵀ X``, so no step stores to SMEM before a
    product; block_v = 64, the smallest M of a wgmma)."""
    del triton_kw  # warps, stages and interpret of the Triton walk
    if write_o and scores is None:
        raise NotImplementedError("mosaic_gpu forward_walk: write_o reads the masked scores (pass scores=)")
    reason = walk_unsupported_reason(x, y, chunk, block_v=block_v, pieces=pieces, walk_operands=walk_operands,
                                     t_dtype=tinv.dtype, scores_dtype=None if scores is None else scores.dtype)
    if reason is None and form == "registers" and block_v != REGISTER_FORM_BLOCK_V:
        reason = (f"form='registers' with block_v={block_v}: a wgmma's left operand has 64 rows "
                  f"(block_v={REGISTER_FORM_BLOCK_V})")
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu forward_walk: {reason}")
    if form not in ("smem", "registers"):
        raise ValueError(f"forward_walk: form must be 'smem' or 'registers', got {form!r}")
    value_major = form == "registers"
    if key_shift:  # row t's write feature is x[t − 1], zero at t = 0 (time is axis 1 in either layout)
        x = shift_time(x, 1, axis=1)
    BH, B, H, dk, dv, n_blocks, n = _walk_dims(x, y, heads, block_v)
    C, N = CHUNK, block_v
    dtype = x.dtype
    p_dtype = jnp.dtype(p_dtype or walk_operands)
    h_dtype = chunk_state_dtype(dtype)
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    tile = _tile(dtype, N)
    gate_rows = walk_gates(eta, g, gp, rl, C, dk)
    if not write_o:
        gate_rows = gate_rows[:3] + gate_rows[4:]  # c is read by the outputs only

    # as many chunks in flight as fit the SMEM (at most ``stages``): each holds its input tiles and output slots
    item = jnp.dtype(dtype).itemsize
    per_step = (C * dk * item + C * C * item) * (2 if write_o else 1) + C * N * item + (len(gate_rows) - 1) * C * 4
    per_step += dk * 4 + C * N * item * write_o + C * N * p_dtype.itemsize * write_p + dk * N * item * write_h
    fixed = N * dk * 4 + (0 if value_major else dk * N * item + 3 * C * N * item) + 4096  # scratch, barriers, slack
    depth = max(1, min(stages, (SMEM_BYTES - fixed) // per_step))

    def shared(shape, index_map):  # the same tile for every block of the head: one multicast load per cluster
        return plgpu.BlockSpec(shape, index_map, transforms=tile, collective_axes=(CLUSTER,))

    def body(*refs):
        q_ref, x_ref, y_ref, t_ref, s0_ref, sc_ref, *rest = refs
        gate_refs, rest = rest[:len(gate_rows)], rest[len(gate_rows):]
        n_scratch = 2 if value_major else 6
        outs, scratch_refs = rest[:-n_scratch], rest[-n_scratch:]
        s_b, r_b, wp_b, p_b = (None,) * 4 if value_major else scratch_refs[:4]
        st_s, bar = scratch_refs[-2:]
        b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index(CLUSTER)
        bh = b * H + h
        cols = pl.ds(j * N, N)

        def tokens(ref):  # one head's [L, d] rows
            return ref.at[b, :, h, :] if heads is not None else ref.at[bh]

        def own(index_map):
            return plgpu.BlockSpec((C, N), index_map, transforms=tile)

        in_specs = [shared((C, dk), lambda c: (c, 0)), shared((C, C), lambda c: (c, 0))]
        in_refs = [tokens(x_ref), t_ref.at[bh]]
        if write_o:
            in_specs += [shared((C, dk), lambda c: (c, 0)), shared((C, C), lambda c: (c, 0))]
            in_refs += [tokens(q_ref), sc_ref.at[bh]]
        in_specs.append(own(lambda c: (c, j)))
        in_refs.append(tokens(y_ref))
        in_specs += [plgpu.BlockSpec((C,), lambda c: (c,))] * (len(gate_rows) - 1)
        in_specs.append(plgpu.BlockSpec((dk,), lambda c: (c,)))
        in_refs += [ref.at[bh] for ref in gate_refs]
        out_specs, out_refs = [], []
        outs = list(outs)
        if write_o:
            out_specs.append(own(lambda c: (c, j)))
            out_refs.append(tokens(outs.pop(0)))
        if write_p:
            out_specs.append(own(lambda c: (c, j)))
            out_refs.append(tokens(outs.pop(0)))
        if write_h:
            out_specs.append(plgpu.BlockSpec((dk, N), lambda c: (c, j), transforms=tile))
            out_refs.append(outs.pop(0).at[bh])
        (s_end_ref,) = outs

        def rows_bc(v, rows=C):
            return lax.broadcast_in_dim(v, (rows, N), [0])

        def step(_, *slots):
            *slots, S = slots
            x_s, t_s, *slots = slots
            if write_o:
                q_s, sc_s, *slots = slots
            y_s, *slots = slots
            eta_s, ec_s, w_s, *slots = slots
            if write_o:
                c_s, *slots = slots
            a_s, *slots = slots
            o_s = slots.pop(0) if write_o else None
            p_s = slots.pop(0) if write_p else None
            h_s = slots.pop(0) if write_h else None
            state = h_s if write_h else s_b  # the chunk's start state, also the products' operand
            state[...] = S.astype(state.dtype)
            plgpu.commit_smem()
            if write_o:
                xs, qs = _products((x_s, state, (C, N)), (q_s, state, (C, N)))
            else:
                (xs,) = _products((x_s, state, (C, N)))
            resid = (rows_bc(_load(eta_s, ROWS)) * _load(y_s, WGMMA).astype(F32)
                     - rows_bc(_load(ec_s, ROWS)) * xs)
            r_b[...] = resid.astype(dtype)
            plgpu.commit_smem()
            (p,) = _products((t_s, r_b, (C, N)))
            if write_p:
                p_s[...] = p.astype(p_s.dtype)
            wp_b[...] = (rows_bc(_load(w_s, ROWS)) * p).astype(dtype)
            if write_o:
                p_b[...] = p.astype(dtype)
            plgpu.commit_smem()
            if write_o:
                upd, o = _products((x_s.T, wp_b, (dk, N)), (sc_s, p_b, (C, N)))
                o_s[...] = (o + rows_bc(_load(c_s, ROWS)) * qs).astype(o_s.dtype)
            else:
                (upd,) = _products((x_s.T, wp_b, (dk, N)))
            return rows_bc(_load(a_s, ROWS), dk) * S + upd

        cols_bc = functools.partial(_cols_bc, rows=N)

        def step_value_major(_, *slots):
            """The step on ``Sᵀ`` ``[N, dk]``: every product's left operand from registers (WGMMA layout)."""
            *slots, St = slots
            x_s, t_s, *slots = slots
            if write_o:
                q_s, sc_s, *slots = slots
            y_s, eta_s, ec_s, w_s, *slots = slots
            if write_o:
                c_s, *slots = slots
            a_s, *slots = slots
            o_s = slots.pop(0) if write_o else None
            p_s = slots.pop(0) if write_p else None
            h_s = slots.pop(0) if write_h else None
            st = St.astype(dtype)
            if write_o:
                xs, qs = _products((st, x_s.T, (N, C)), (st, q_s.T, (N, C)))
            else:
                (xs,) = _products((st, x_s.T, (N, C)))
            if write_h:
                _store_transposed(h_s, st)
            y_t = _load_transposed(y_s)
            resid = cols_bc(_load(eta_s, COLS)) * y_t - cols_bc(_load(ec_s, COLS)) * xs
            (p,) = _products((resid.astype(dtype), t_s.T, (N, C)))
            if write_p:
                _store_transposed(p_s, p)
            wp = (cols_bc(_load(w_s, COLS)) * p).astype(dtype)
            if write_o:
                upd, o = _products((wp, x_s, (N, dk)), (p.astype(dtype), sc_s.T, (N, C)))
                _store_transposed(o_s, o + cols_bc(_load(c_s, COLS)) * qs)
            else:
                (upd,) = _products((wp, x_s, (N, dk)))
            return cols_bc(_load(a_s, COLS)) * St + upd

        # s0 and s_end: [B·H, 1, dk, dv], or as Sᵀ [B·H, dv, dk] (transposed in XLA) for the register form
        state_at = (lambda ref: ref.at[bh, cols]) if value_major else (lambda ref: ref.at[bh, 0, :, cols])

        def compute(pipeline):
            _carry_state(pipeline, state_at(s0_ref), state_at(s_end_ref), st_s, bar)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step_value_major if value_major else step, grid=(n,), memory_registers=40, in_specs=in_specs,
            out_specs=out_specs,
            max_concurrent_steps=min(depth, n), wg_axis="wg", num_compute_wgs=1, compute_context=compute)
        pipeline(*in_refs, *out_refs)

    out_type = []
    if write_o:
        out_type.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
    if write_p:
        out_type.append(jax.ShapeDtypeStruct(y.shape, p_dtype))
    if write_h:
        out_type.append(jax.ShapeDtypeStruct((BH, n * dk, dv), h_dtype))
    out_type.append(jax.ShapeDtypeStruct((BH, dv, dk) if value_major else (BH, 1, dk, dv), F32))
    narrow = plgpu.SMEM((C, N), dtype, transforms=tile)
    # the fp32 state in and out: tiled as wide as a 128-byte swizzle allows (an untiled [dk, 32] fp32 load found no
    # bank-conflict-free transfer plan)
    state_tile = _tile(F32, min(N, 32))
    if value_major:  # only the fp32 state in and out
        scratch = [plgpu.SMEM((N, dk), F32, transforms=_tile(F32, 32))]
    else:
        scratch = [plgpu.SMEM((dk, N), dtype, transforms=tile), narrow, narrow, narrow,
                   plgpu.SMEM((dk, N), F32, transforms=state_tile)]
    scratch.append(plgpu.Barrier(num_arrivals=1))
    kernel = plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H), grid_names=("b", "h"),
                          cluster=(n_blocks,), cluster_names=(CLUSTER,), num_threads=2, thread_name="wg",
                          compiler_params=plgpu.CompilerParams(approx_math=True),
                          kernel_name="falcon_delta_walk_mgpu")
    sc = scores if scores is not None else tinv  # a placeholder operand when the outputs are not written
    s0 = s0.astype(F32)
    if value_major:
        s0 = jnp.swapaxes(s0[:, 0], 1, 2)
    outs = list(kernel(q, x, y, tinv, s0, sc, *gate_rows))
    if value_major:
        outs[-1] = jnp.swapaxes(outs[-1], 1, 2)[:, None]
    if write_h:  # [B·H, n·dk, dv] -> [B·H, n, dk, dv]
        outs[-2] = outs[-2].reshape(BH, n, dk, dv)
    return tuple(outs)


def reverse_walk_unsupported_reason(x, do, chunk: int, *, block_v: int, pieces: int, write_dh: bool, vb, write_dr,
                                    b_from_t: bool, walk_operands, t_dtype, q_dtype=None,
                                    do_dtype=None) -> str | None:
    """Why :func:`reverse_walk` cannot take this call (None: it can)."""
    reason = walk_unsupported_reason(x, do, chunk, block_v=block_v, pieces=pieces, walk_operands=walk_operands,
                                     t_dtype=t_dtype)
    if reason is not None:
        return reason
    if block_v != REGISTER_FORM_BLOCK_V:
        return f"block_v={block_v}: the Mosaic GPU reverse walk takes {REGISTER_FORM_BLOCK_V} value columns"
    dtype = jnp.dtype(x.dtype)
    if vb is None or not b_from_t or not write_dh:
        return ("the reverse walk without prepare_vb's (V, B, q-term), B formed from T or dh written "
                "(KernelConfig(dstate_b='from_t'))")
    v, _, q_term = vb
    if v is None and q_term is not None:
        return "V formed in the walk with the q-term from prepare_vb: the walk forms both or neither"
    if (v is not None and jnp.dtype(v.dtype) != dtype) or (q_term is not None and jnp.dtype(q_term.dtype) != dtype):
        return "V or the q-term stored in fp32: the walk writes dR and dh over them in the inputs' dtype"
    if q_term is None and (q_dtype is None or jnp.dtype(q_dtype) != dtype or jnp.dtype(do_dtype) != dtype):
        return "forming the q-term in the walk from queries or dO in another dtype than the keys'"
    if write_dr is None or jnp.dtype(write_dr) != dtype:
        return "dR stored in fp32 or not at all (KernelConfig(stored_dr='input'))"
    return None


def _summed_products(shape, *pairs):
    """``Σ a @ b`` over ``pairs`` (fp32): every product into one accumulator, one wait."""
    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))


def reverse_walk(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces=1, block_v=REGISTER_FORM_BLOCK_V,
                 write_dh=True, vb=None, write_dr=None, b_from_t=False, walk_operands=None, heads=None,
                 key_shift=False, **triton_kw):
    """Drop-in for :func:`pallas_gpu.state_grad_split_pass` as Falcon-1's backward calls it (one piece, B formed
    from T, dh and dR written): the split reverse walk, every batch·head's chunks last first, with one cluster of
    ``dv / 64`` CTAs sharing the chunk's keys, T (and queries) by TMA multicast.  Per chunk, carrying ``dSᵀ``
    ``[64, dk]`` in fp32 registers (every product's left operand from registers or, for the scores, SMEM)::

        dh_c = dS
        dRᵀ = Vᵀ + (w ⊙ X dS)ᵀ T                           wgmma dSᵀ · Xᵀ, then · T
        dSᵀ ← a dSᵀ + (c ⊙ dO)ᵀ Q − (η c⁻ ⊙ dR)ᵀ X          wgmma

    ``vb = (V, None, q-term)`` as ``prepare_vb`` gives them — V ``Tᵀ (QXᵀ ⊙ D)ᵀ dO`` like do (dR written over it),
    the q-term ``((c ⊙ Q)ᵀ dO)`` ``[B·H, L/C, dk, dv]`` (dh written over it) — or with None in their place formed
    here, off the chain through dS: the q-term as one more product issued with ``dSᵀ Xᵀ`` (dh then takes a
    buffer of its own, the one the q-term would have taken); V (only with the q-term) as the masked scores
    ``QXᵀ ⊙ D`` (a product from the multicast Q and X tiles, masked in registers, staged to SMEM as two 16-bit
    parts ``hi + lo`` as ``mosaic_gpu.prepare_vb`` does) and ``dOᵀ (QXᵀ ⊙ D)``, added to ``(w ⊙ X dS)ᵀ`` before
    the one product with T: ``dRᵀ = (dOᵀ (QXᵀ ⊙ D) + (w ⊙ X dS)ᵀ) T`` (dR then takes V's buffer), so the walk
    needs no ``prepare_vb`` at all.

    q ``[B·H, L, dk]`` or ``[B, L, H, dk]`` (``heads``) and do like the values: read only to form what ``vb``
    leaves out; x like q; eta, g, gp, rl ``[B·H, L]``; tinv ``[B·H, L, C]``; ds_end ``[B·H, 1, dk, dv]`` fp32.
    Returns ``(dR like do, dh [B·H, L/C, dk, dv], dS_start [B·H, 1, dk, dv] fp32)``; given V and q-term buffers
    are written in place through ``jax.new_ref``.  Refuses (NotImplementedError) what
    :func:`reverse_walk_unsupported_reason` names."""
    del triton_kw
    reason = reverse_walk_unsupported_reason(x, do if vb is None or vb[0] is None else vb[0], chunk,
                                             block_v=block_v, pieces=pieces, write_dh=write_dh, vb=vb,
                                             write_dr=write_dr, b_from_t=b_from_t, walk_operands=walk_operands,
                                             t_dtype=tinv.dtype, q_dtype=q.dtype, do_dtype=do.dtype)
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu reverse_walk: {reason}")
    if key_shift:  # as forward_walk
        x = shift_time(x, 1, axis=1)
    v, _, q_term = vb
    with_q = q_term is None  # the walk forms the q-term
    with_v = v is None  # ... and V
    BH, B, H, dk, dv, n_blocks, n = _walk_dims(x, do, heads, block_v)
    C, N = CHUNK, block_v
    dtype = x.dtype
    h_dtype = chunk_state_dtype(dtype)
    WGMMA = plgpu.Layout.WGMMA
    ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)
    tile = _tile(dtype, N)
    _, ec_rows, w_rows, c_rows, a_rows = walk_gates(eta, g, gp, rl, C, dk)

    item = jnp.dtype(dtype).itemsize
    per_step = C * dk * item + C * C * item + 2 * C * N * item + 2 * dk * N * item + 2 * C * 4 + dk * 4
    if with_q:  # Q, dO and c in; no q-term in
        per_step += C * dk * item + C * N * item + C * 4 - dk * N * item
    fixed = N * dk * 4 + 4096
    if with_v:  # no V in; g and the run index in twice (one buffer per register layout); the scores' two parts
        per_step += 4 * C * 4 - C * N * item
        fixed += 2 * C * C * item
    depth = max(1, min(3, (SMEM_BYTES - fixed) // per_step))

    def body(*refs):
        x_ref, t_ref, ec_ref, w_ref, a_ref, ds_end_ref, *refs = refs
        v_ref = None if with_v else refs.pop(0)
        if with_q:
            q_ref, do_ref, c_ref, *refs = refs
        else:
            qt_ref, *refs = refs
        if with_v:
            g_ref, r_ref, *refs = refs
        ds_start_ref, *refs = refs
        dh_ref = refs.pop(0) if with_q else qt_ref  # dh over the q-term when it is given
        dr_ref = refs.pop(0) if with_v else v_ref  # dR over V likewise

        def scoped(st_s, bar, *score_parts):
            b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index(CLUSTER)
            bh = b * H + h
            cols = pl.ds(j * N, N)

            def tokens(ref):
                return ref.at[b, :, h, :] if heads is not None else ref.at[bh]

            def back(c):  # the pipeline's step c is chunk n - 1 - c
                return n - 1 - c

            shared = functools.partial(plgpu.BlockSpec, transforms=tile, collective_axes=(CLUSTER,))
            own_rows = plgpu.BlockSpec((C, N), lambda c: (back(c), j), transforms=tile)
            own_state = plgpu.BlockSpec((dk, N), lambda c: (back(c), j), transforms=tile)
            gate = plgpu.BlockSpec((C,), lambda c: (back(c),))
            in_specs = [shared((C, dk), lambda c: (back(c), 0)), shared((C, C), lambda c: (back(c), 0)), gate, gate,
                        plgpu.BlockSpec((dk,), lambda c: (back(c),))]
            in_refs = [tokens(x_ref), t_ref.at[bh], ec_ref.at[bh], w_ref.at[bh], a_ref.at[bh]]
            if not with_v:
                in_specs.append(own_rows)
                in_refs.append(tokens(v_ref))
            if with_q:
                in_specs += [shared((C, dk), lambda c: (back(c), 0)), own_rows, gate]
                in_refs += [tokens(q_ref), tokens(do_ref), c_ref.at[bh]]
            else:
                in_specs.append(own_state)
                in_refs.append(qt_ref.at[bh])
            if with_v:  # g and the run index, each read along rows and along columns of the scores
                in_specs += [gate] * 4
                in_refs += [g_ref.at[bh], g_ref.at[bh], r_ref.at[bh], r_ref.at[bh]]
            out_specs = [own_rows, own_state]
            out_refs = [tokens(dr_ref), dh_ref.at[bh]]
            cols_bc = functools.partial(_cols_bc, rows=N)
            sq = (C, C)

            def masked_scores(scores, g_t, g_s, r_t, r_s):
                """``QXᵀ ⊙ D`` from the ``[t, s]`` products: ``e^{g_t − g_s}`` on ``s ≤ t`` within a segment."""
                t_ids = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                s_ids = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA)
                keep = (s_ids <= t_ids) & (lax.broadcast_in_dim(r_t, sq, [0]) == lax.broadcast_in_dim(r_s, sq, [1]))
                expo = lax.broadcast_in_dim(g_t, sq, [0]) - lax.broadcast_in_dim(g_s, sq, [1])
                # select, not multiply: a masked exponent is never exponentiated, a masked entry exactly zero
                return jnp.where(keep, scores * jnp.exp(jnp.where(keep, expo, 0.0)), 0.0)

            def step(_, x_s, t_s, ec_s, w_s, a_s, *slots):
                *slots, dr_s, dh_s, dSt = slots
                v_s = None if with_v else slots.pop(0)
                st = dSt.astype(dtype)
                a_cols = cols_bc(_load(a_s, COLS))
                if with_q:
                    q_s, do_s, c_s, *slots = slots
                    do_t = _load_transposed(do_s)  # dOᵀ [N, C]
                    cdo = (cols_bc(_load(c_s, COLS)) * do_t).astype(dtype)  # (c ⊙ dO)ᵀ
                    xds, q_term = _products((st, x_s.T, (N, C)), (cdo, q_s, (N, dk)))
                    base = a_cols * dSt + q_term
                else:
                    (qt_s,) = slots
                    base = a_cols * dSt + _load_transposed(qt_s)  # before dh takes its place
                    (xds,) = _products((st, x_s.T, (N, C)))
                _store_transposed(dh_s, st)
                wx = cols_bc(_load(w_s, COLS)) * xds
                if with_v:
                    g_t_s, g_s_s, r_t_s, r_s_s = slots
                    (scores,) = _products((q_s, x_s.T, sq))
                    scores = masked_scores(scores, _load(g_t_s, ROWS), _load(g_s_s, COLS), _load(r_t_s, ROWS),
                                           _load(r_s_s, COLS))
                    hi_s, lo_s = score_parts
                    hi = scores.astype(dtype)
                    hi_s[...] = hi
                    lo_s[...] = (scores - hi.astype(F32)).astype(dtype)
                    plgpu.commit_smem()
                    do_b = do_t.astype(dtype)
                    (dr,) = _products(((_summed_products((N, C), (do_b, hi_s), (do_b, lo_s)) + wx).astype(dtype),
                                       t_s, (N, C)))
                else:
                    (bds,) = _products((wx.astype(dtype), t_s, (N, C)))
                    dr = _load_transposed(v_s) + bds
                _store_transposed(dr_s, dr)
                edr = (cols_bc(_load(ec_s, COLS)) * dr).astype(dtype)
                (upd,) = _products((edr, x_s, (N, dk)))
                return base - upd

            def compute(pipeline):
                _carry_state(pipeline, ds_end_ref.at[bh, cols], ds_start_ref.at[bh, cols], st_s, bar)

            pipeline = plgpu.emit_pipeline_warp_specialized(
                step, grid=(n,), memory_registers=40, in_specs=in_specs, out_specs=out_specs,
                max_concurrent_steps=min(depth, n), wg_axis="wg", num_compute_wgs=1, compute_context=compute)
            pipeline(*in_refs, *out_refs)

        scratch = [plgpu.SMEM((N, dk), F32, transforms=_tile(F32, 32)), plgpu.Barrier(num_arrivals=1)]
        if with_v:
            scratch += [plgpu.SMEM((C, C), dtype, transforms=tile)] * 2
        pl.run_scoped(scoped, *scratch, collective_axes="wg")

    mesh = plgpu.Mesh(grid=(B, H), grid_names=("b", "h"), cluster=(n_blocks,), cluster_names=(CLUSTER,),
                      num_threads=2, thread_name="wg", kernel_name="falcon_delta_dstate_walk_mgpu")
    out_type = [jax.ShapeDtypeStruct((BH, dv, dk), F32)]
    if with_q:
        out_type.append(jax.ShapeDtypeStruct((BH, n * dk, dv), h_dtype))
    if with_v:
        out_type.append(jax.ShapeDtypeStruct(do.shape, write_dr))
    kernel = pl.kernel(body, out_type=tuple(out_type), mesh=mesh, name=mesh.kernel_name,
                       compiler_params=plgpu.CompilerParams(approx_math=True))
    # dR (and dh) are written over V (and the q-term) when given: refs passed to the kernel are aliased in and
    # out of it
    ds_end_t = jnp.swapaxes(ds_end[:, 0].astype(F32), 1, 2)
    args = [x, tinv, ec_rows, w_rows, a_rows, ds_end_t]
    if not with_v:
        v_ref = jax.new_ref(v)
        args.append(v_ref)
    if with_q:
        args += [q, do, c_rows]
    else:
        qt_ref = jax.new_ref(q_term.reshape(BH, n * dk, dv))
        args.append(qt_ref)
    if with_v:
        args += [g.astype(F32), rl.astype(F32)]
    ds_start_t, *outs = kernel(*args)
    dh = outs.pop(0) if with_q else qt_ref[...]
    dr = outs.pop(0) if with_v else v_ref[...]
    return dr, dh.reshape(BH, n, dk, dv), jnp.swapaxes(ds_start_t, 1, 2)[:, None]
