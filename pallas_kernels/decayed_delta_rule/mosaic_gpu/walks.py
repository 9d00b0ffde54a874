"""The chunk walks of ``decayed_delta_rule`` as Pallas Mosaic GPU kernels on thread-block clusters (Hopper).

Why clusters.  A walk carries one head's ``[dk, dv]`` state through every chunk in turn, so the only parallelism
inside a head is over value columns: the Triton walks give each of a head's value blocks its own program, and
each of those programs reads the chunk's whole ``[C, dk]`` keys, queries and ``[C, C]`` inverse and scores every
step.  Here a head's value blocks of 64 columns are the CTAs of one cluster: the tiles every block needs are
loaded once per cluster by TMA multicast (each CTA loads a share, every CTA receives the whole tile), and only the
block's own ``[C, 64]`` values, gates and outputs are its own.

One CTA = one warpgroup computing + one issuing the loads (``plgpu.emit_pipeline_warp_specialized``, ``stages``
chunks in flight; a slot is refilled only when every CTA of the cluster has consumed it).  The walk carries the
state transposed, ``Sᵀ`` ``[64, dk]`` in fp32 registers, so that every product takes its left operand from
registers (a wgmma's left operand has 64 rows) and no step stores to SMEM before a product.  Per chunk (the gates
``c``, ``c⁻``, ``w``, ``a`` of ``..triton.common._gates``, formed here in XLA)::

    Rᵀ = (η ⊙ Y)ᵀ − Sᵀ (η c⁻ ⊙ X)ᵀ      wgmma Sᵀ · Xᵀ     (S rounded to the inputs' dtype, as the Triton walk)
    Pᵀ = Rᵀ Tᵀ                         wgmma Rᵀ · Tᵀ       (R rounded likewise; T stored in the inputs' dtype)
    oᵀ = Pᵀ (QXᵀ ⊙ D)ᵀ + Sᵀ (c ⊙ Q)ᵀ    wgmma              (write_o; the scores from masked_scores_pass)
    Sᵀ ← a Sᵀ + (w ⊙ P)ᵀ X             wgmma

Every product is a 16-bit wgmma with fp32 accumulation, rounding the same operands the Triton walk rounds with
``walk_operands`` = the inputs' dtype.

Keys read one row back in place (``key_shift``, Falcon-1's call) would need a TMA copy starting one row before a
chunk, which the tiled copies a wgmma operand needs cannot do (a copy of 8-row tiles starts on a tile); with
``key_shift`` the walks shift a copy of the keys in XLA first (one more read and write of ``[B, L, H, dk]``).

The reverse walk of the backward (:func:`reverse_walk`) is the same kind of kernel, walking the chunks last
first; it forms the walk's ``(c ⊙ Q)ᵀ dO`` term itself (one more product off the chain through dS) and writes dR
over V as the Triton walk does, through a ref (``jax.new_ref``) that ``pl.kernel`` aliases in and out of the
call.  Values are checked on a Hopper GPU (``tests/test_gpu_kernels.py``); CI cross-lowers both walks for CUDA
and checks what they refuse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import chunk_state_dtype, plgpu, shift_time, token_dims
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu.common import CHUNK, F32, _load
from falcon_jax.kernels.decayed_delta_rule.triton.common import _gates

CLUSTER = "cluster"
MAX_CLUSTER = 8  # the portable thread-block cluster size
SMEM_BYTES = 232448  # a Hopper CTA's shared memory
BLOCK_V = 64  # value columns per CTA: a wgmma's left operand (the state, from registers) has 64 rows


def walk_unsupported_reason(x, y, chunk: int, *, block_v: int = BLOCK_V, pieces: int = 1, walk_operands=None,
                            t_dtype=None, scores_dtype=None) -> str | None:
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
    if block_v != BLOCK_V:
        return f"block_v={block_v}: the Mosaic GPU walks take {BLOCK_V} value columns"
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
                 write_p=False, write_h=False, block_v=BLOCK_V, stages=3, walk_operands=None, p_dtype=None,
                 key_shift=False, pieces=1, **triton_kw):
    """Drop-in for :func:`..triton.forward.forward_pass` (one piece): walks every batch·head's chunks with one
    cluster of ``dv / 64`` CTAs.

    q, x ``[B·H, L, dk]`` or, with ``heads=H``, ``[B, L, H, dk]`` (read in place); y likewise with dv; eta, g,
    gp, rl ``[B·H, L]`` (chunk-local g, gp, run index); tinv ``[B·H, L, C]`` in the inputs' dtype; s0
    ``[B·H, 1, dk, dv]`` fp32; ``scores`` ``[B·H, L, C]`` (the masked scores, ``masked_scores_pass``, in the
    inputs' dtype) with ``write_o``.  Returns, as ``forward_pass`` does, ``(o like y if write_o, P like y in
    p_dtype (default walk_operands) if write_p, h [B·H, L/C, dk, dv] in the chunk-state dtype if write_h,
    s_end [B·H, 1, dk, dv] fp32)``.  Refuses (NotImplementedError) what :func:`walk_unsupported_reason` names."""
    del triton_kw  # warps, stages and interpret of the Triton walk
    if write_o and scores is None:
        raise NotImplementedError("mosaic_gpu forward_walk: write_o reads the masked scores (pass scores=)")
    reason = walk_unsupported_reason(x, y, chunk, block_v=block_v, pieces=pieces, walk_operands=walk_operands,
                                     t_dtype=tinv.dtype, scores_dtype=None if scores is None else scores.dtype)
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu forward_walk: {reason}")
    if key_shift:  # row t's write feature is x[t − 1], zero at t = 0 (time is axis 1 in either layout)
        x = shift_time(x, 1, axis=1)
    BH, B, H, dk, dv, n_blocks, n = _walk_dims(x, y, heads, block_v)
    C, N = CHUNK, block_v
    dtype = x.dtype
    p_dtype = jnp.dtype(p_dtype or walk_operands)
    h_dtype = chunk_state_dtype(dtype)
    COLS = plgpu.Layout.WGMMA.reduce(0)
    tile = _tile(dtype, N)
    gate_rows = walk_gates(eta, g, gp, rl, C, dk)
    if not write_o:
        gate_rows = gate_rows[:3] + gate_rows[4:]  # c is read by the outputs only

    # as many chunks in flight as fit the SMEM (at most ``stages``): each holds its input tiles and output slots
    item = jnp.dtype(dtype).itemsize
    per_step = (C * dk * item + C * C * item) * (2 if write_o else 1) + C * N * item + (len(gate_rows) - 1) * C * 4
    per_step += dk * 4 + C * N * item * write_o + C * N * p_dtype.itemsize * write_p + dk * N * item * write_h
    fixed = N * dk * 4 + 4096  # the state's scratch, barriers, slack
    depth = max(1, min(stages, (SMEM_BYTES - fixed) // per_step))

    def shared(shape, index_map):  # the same tile for every block of the head: one multicast load per cluster
        return plgpu.BlockSpec(shape, index_map, transforms=tile, collective_axes=(CLUSTER,))

    def body(*refs):
        q_ref, x_ref, y_ref, t_ref, s0_ref, sc_ref, *rest = refs
        gate_refs, rest = rest[:len(gate_rows)], rest[len(gate_rows):]
        outs, (st_s, bar) = rest[:-2], rest[-2:]
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
        cols_bc = functools.partial(_cols_bc, rows=N)

        def step(_, *slots):
            """One chunk on ``Sᵀ`` ``[N, dk]``: every product's left operand from registers (WGMMA layout)."""
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

        def compute(pipeline):  # s0 and s_end as Sᵀ [B·H, dv, dk] (transposed in XLA)
            _carry_state(pipeline, s0_ref.at[bh, cols], s_end_ref.at[bh, cols], st_s, bar)

        pipeline = plgpu.emit_pipeline_warp_specialized(
            step, grid=(n,), memory_registers=40, in_specs=in_specs, out_specs=out_specs,
            max_concurrent_steps=min(depth, n), wg_axis="wg", num_compute_wgs=1, compute_context=compute)
        pipeline(*in_refs, *out_refs)

    out_type = []
    if write_o:
        out_type.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
    if write_p:
        out_type.append(jax.ShapeDtypeStruct(y.shape, p_dtype))
    if write_h:
        out_type.append(jax.ShapeDtypeStruct((BH, n * dk, dv), h_dtype))
    out_type.append(jax.ShapeDtypeStruct((BH, dv, dk), F32))
    scratch = [plgpu.SMEM((N, dk), F32, transforms=_tile(F32, 32)), plgpu.Barrier(num_arrivals=1)]
    kernel = plgpu.kernel(body, out_type=tuple(out_type), scratch_types=scratch, grid=(B, H), grid_names=("b", "h"),
                          cluster=(n_blocks,), cluster_names=(CLUSTER,), num_threads=2, thread_name="wg",
                          compiler_params=plgpu.CompilerParams(approx_math=True),
                          kernel_name="falcon_delta_walk_mgpu")
    sc = scores if scores is not None else tinv  # a placeholder operand when the outputs are not written
    s0 = jnp.swapaxes(s0.astype(F32)[:, 0], 1, 2)
    outs = list(kernel(q, x, y, tinv, s0, sc, *gate_rows))
    outs[-1] = jnp.swapaxes(outs[-1], 1, 2)[:, None]
    if write_h:  # [B·H, n·dk, dv] -> [B·H, n, dk, dv]
        outs[-2] = outs[-2].reshape(BH, n, dk, dv)
    return tuple(outs)


def reverse_walk_unsupported_reason(x, do, chunk: int, *, pieces: int, write_dh: bool, prepared, write_dr,
                                    walk_operands, t_dtype, q_dtype, block_v: int = BLOCK_V) -> str | None:
    """Why :func:`reverse_walk` cannot take this call (None: it can)."""
    reason = walk_unsupported_reason(x, do, chunk, block_v=block_v, pieces=pieces, walk_operands=walk_operands,
                                     t_dtype=t_dtype)
    if reason is not None:
        return reason
    dtype = jnp.dtype(x.dtype)
    if prepared is None or prepared[1] is not None or not write_dh:
        return "the reverse walk forms the q-term itself and writes dh; it needs prepare_v's V without a q-term"
    if jnp.dtype(prepared[0].dtype) != dtype:
        return "V stored in fp32: the walk writes dR over it in the inputs' dtype"
    if jnp.dtype(q_dtype) != dtype or jnp.dtype(do.dtype) != dtype:
        return "forming the q-term in the walk from queries or dO in another dtype than the keys'"
    if write_dr is None or jnp.dtype(write_dr) != dtype:
        return "dR stored in fp32 or not at all (KernelConfig(stored_dr='fp32'))"
    return None


def reverse_walk(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces=1, block_v=BLOCK_V, write_dh=True,
                 prepared=None, write_dr=None, walk_operands=None, heads=None, key_shift=False, **triton_kw):
    """Drop-in for :func:`..triton.state_grads.state_grad_walk` (one piece, dh and dR written): every batch·head's
    chunks last first, with one cluster of ``dv / 64`` CTAs sharing the chunk's keys, queries and T by TMA
    multicast.  Per chunk, carrying ``dSᵀ`` ``[64, dk]`` in fp32 registers (every product's left operand from
    registers)::

        dh_c = dS
        dRᵀ = Vᵀ + (w ⊙ X dS)ᵀ T                           wgmma dSᵀ · Xᵀ, then · T
        dSᵀ ← a dSᵀ + (c ⊙ dO)ᵀ Q − (η c⁻ ⊙ dR)ᵀ X          wgmma

    ``prepared = (V, None)`` as ``prepare_v`` gives it (no q-term: the walk forms ``(c ⊙ Q)ᵀ dO`` as one more
    product issued with ``dSᵀ Xᵀ``); dR is written over V.  q, x ``[B·H, L, dk]`` or ``[B, L, H, dk]``
    (``heads``), do like the values; eta, g, gp, rl ``[B·H, L]``; tinv ``[B·H, L, C]``; ds_end
    ``[B·H, 1, dk, dv]`` fp32.  Returns ``(dR like do, dh [B·H, L/C, dk, dv], dS_start [B·H, 1, dk, dv] fp32)``.
    Refuses (NotImplementedError) what :func:`reverse_walk_unsupported_reason` names."""
    del triton_kw
    reason = reverse_walk_unsupported_reason(x, do, chunk, block_v=block_v, pieces=pieces, write_dh=write_dh,
                                             prepared=prepared, write_dr=write_dr, walk_operands=walk_operands,
                                             t_dtype=tinv.dtype, q_dtype=q.dtype)
    if reason is not None:
        raise NotImplementedError(f"mosaic_gpu reverse_walk: {reason}")
    if key_shift:  # as forward_walk
        x = shift_time(x, 1, axis=1)
    v, _ = prepared
    BH, B, H, dk, dv, n_blocks, n = _walk_dims(x, do, heads, block_v)
    C, N = CHUNK, block_v
    dtype = x.dtype
    h_dtype = chunk_state_dtype(dtype)
    COLS = plgpu.Layout.WGMMA.reduce(0)
    tile = _tile(dtype, N)
    _, ec_rows, w_rows, c_rows, a_rows = walk_gates(eta, g, gp, rl, C, dk)

    item = jnp.dtype(dtype).itemsize
    # per chunk in flight: keys, T, queries, V, dO, dR and dh slots, the gates
    per_step = 2 * C * dk * item + C * C * item + 3 * C * N * item + dk * N * item + 3 * C * 4 + dk * 4
    fixed = N * dk * 4 + 4096
    depth = max(1, min(3, (SMEM_BYTES - fixed) // per_step))

    def body(x_ref, t_ref, ec_ref, w_ref, a_ref, ds_end_ref, v_ref, q_ref, do_ref, c_ref, ds_start_ref, dh_ref):
        dr_ref = v_ref  # dR over V

        def scoped(st_s, bar):
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
                        plgpu.BlockSpec((dk,), lambda c: (back(c),)), own_rows,
                        shared((C, dk), lambda c: (back(c), 0)), own_rows, gate]
            in_refs = [tokens(x_ref), t_ref.at[bh], ec_ref.at[bh], w_ref.at[bh], a_ref.at[bh], tokens(v_ref),
                       tokens(q_ref), tokens(do_ref), c_ref.at[bh]]
            out_specs = [own_rows, own_state]
            out_refs = [tokens(dr_ref), dh_ref.at[bh]]
            cols_bc = functools.partial(_cols_bc, rows=N)

            def step(_, x_s, t_s, ec_s, w_s, a_s, v_s, q_s, do_s, c_s, dr_s, dh_s, dSt):
                st = dSt.astype(dtype)
                a_cols = cols_bc(_load(a_s, COLS))
                do_t = _load_transposed(do_s)  # dOᵀ [N, C]
                cdo = (cols_bc(_load(c_s, COLS)) * do_t).astype(dtype)  # (c ⊙ dO)ᵀ
                xds, q_term = _products((st, x_s.T, (N, C)), (cdo, q_s, (N, dk)))
                base = a_cols * dSt + q_term
                _store_transposed(dh_s, st)
                wx = cols_bc(_load(w_s, COLS)) * xds
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

        pl.run_scoped(scoped, plgpu.SMEM((N, dk), F32, transforms=_tile(F32, 32)), plgpu.Barrier(num_arrivals=1),
                      collective_axes="wg")

    mesh = plgpu.Mesh(grid=(B, H), grid_names=("b", "h"), cluster=(n_blocks,), cluster_names=(CLUSTER,),
                      num_threads=2, thread_name="wg", kernel_name="falcon_delta_dstate_walk_mgpu")
    out_type = (jax.ShapeDtypeStruct((BH, dv, dk), F32), jax.ShapeDtypeStruct((BH, n * dk, dv), h_dtype))
    kernel = pl.kernel(body, out_type=out_type, mesh=mesh, name=mesh.kernel_name,
                       compiler_params=plgpu.CompilerParams(approx_math=True))
    # dR is written over V: a ref passed to the kernel is aliased in and out of it
    v_ref = jax.new_ref(v)
    ds_start_t, dh = kernel(x, tinv, ec_rows, w_rows, a_rows, jnp.swapaxes(ds_end[:, 0].astype(F32), 1, 2), v_ref,
                            q, do, c_rows)
    return v_ref[...], dh.reshape(BH, n, dk, dv), jnp.swapaxes(ds_start_t, 1, 2)[:, None]
