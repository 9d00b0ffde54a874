"""The forward walks of ``decayed_delta_rule`` (Triton): the fused walk and the split forward.

Per chunk (``P = η ⊙ residuals``; masks and gates as in :mod:`.common`)::

    P = T (η ⊙ (Y − c⁻ ⊙ X S))           o = c ⊙ Q S + (Q Xᵀ ⊙ D) P           S ← a S + Xᵀ (w ⊙ P)

* :func:`forward_pass` — the fused walk: one program per (batch·head, piece, value block) walks its chunks with
  the fp32 state in registers, writing o (its masked scores formed in the walk, or read from
  :func:`masked_scores_pass`), and for the backward each chunk's start state h and P.
* :func:`split_forward` — the split the peers use when few programs would walk: ``W = T(η c⁻ ⊙ X)`` and
  ``U = T(η ⊙ Y)`` per chunk in parallel (:func:`prepare_wu`), a walk carrying only the state
  (``P = U − W S``, :func:`state_walk`), then every chunk's outputs from the stored start states in parallel
  (:func:`split_outputs`).  :func:`piece_maps` runs the same state walk over ``[I | 0]`` to give each piece of a
  sequence its affine map ``S_end = M S_start + E``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import (call, chunk_specs, precision_for, row_block, token_dims, walk_layout,
                                       walk_outputs)
from falcon_jax.kernels.decayed_delta_rule.triton.common import (F32, _chunk_keys, _chunk_rows, _gates, _key_operand,
                                                                 _key_spec, _keys, _masked_scores, _one_piece,
                                                                 _params, _sdot, _tdot)


def _scores_kernel(q_ref, x_ref, g_ref, rl_ref, s_ref, *, precision, key_shift=False, key_pad=0):
    """One chunk's masked scores (:func:`_masked_scores`), stored for the output walk."""
    x_ref = _chunk_keys(x_ref, key_shift, key_pad, q_ref.shape[0])
    s_ref[...] = _masked_scores(q_ref[...], x_ref[...], g_ref[...], rl_ref[...], precision).astype(s_ref.dtype)


def masked_scores_pass(q, x, g, rl, *, chunk, interpret, num_warps=4, heads=None, dtype=F32, key_shift=False):
    """Every chunk's masked scores ``QXᵀ ⊙ D`` ``[BH, L, C]`` in ``dtype``, one program per chunk, for
    ``forward_pass(scores=...)``."""
    BH, L, dk = token_dims(q, heads)
    sp = chunk_specs(q, dk, chunk, heads)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    (scores,) = call(functools.partial(_scores_kernel, precision=precision_for(q.dtype), **key_kw),
                     grid=(BH, L // chunk), in_specs=[sp.k, _key_spec(sp, x, key_shift, heads), sp.row, sp.row],
                     out_specs=[sp.square],
                     out_shape=[jax.ShapeDtypeStruct((BH, L, chunk), dtype)],
                     args=(q, keys, g, rl),
                     compiler_params=_params(interpret, num_warps, 1), interpret=interpret,
                     name="falcon_delta_masked_scores")
    return scores


def _forward_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, s0_ref, *out_refs, chunk,
                    n_chunks, write_o, write_h, precision, lo=None, write_p=False, read_scores=False, key_shift=False,
                    key_pad=0):
    x_ref = _keys(x_ref, key_shift, key_pad)  # one piece: the walk's rows are the sequence's
    refs = list(out_refs)
    sc_ref = refs.pop(0) if read_scores else None  # an input: every chunk's masked scores (masked_scores_pass)
    o_ref = refs.pop(0) if write_o else None
    p_ref = refs.pop(0) if write_p else None
    h_ref = refs.pop(0) if write_h else None
    (s_end_ref,) = refs
    p32 = lax.Precision.HIGHEST if precision is not None else None

    def body(c, S):
        rows, eta, g, gp, rl, g_last, rl_last = _chunk_rows((eta_ref, g_ref, gp_ref, rl_ref), c, chunk)
        cont, cont_p, w_last, a_last = _gates(eta, g, gp, rl, g_last, rl_last)
        x = x_ref[rows, :]
        if write_h:
            h_ref[c, :, :] = S.astype(h_ref.dtype)
        resid = eta[:, None] * (y_ref[rows, :].astype(F32) - cont_p[:, None] * _sdot(x, S, p32, lo))
        P = _tdot(t_ref[rows, :], resid, p32)  # η ⊙ residuals of the chunk
        if write_p:
            p_ref[rows, :] = P.astype(p_ref.dtype)
        if write_o:
            q = q_ref[rows, :]
            if read_scores:
                scores = sc_ref[rows, :]
            else:
                scores = _masked_scores(q, x, g, rl, precision)
            o = _sdot(scores, P, p32, lo) + cont[:, None] * _sdot(q, S, p32, lo)
            o_ref[rows, :] = o.astype(o_ref.dtype)
        return a_last * S + _sdot(x.T, w_last[:, None] * P, p32, lo)  # the row scale on the narrow P

    s_end_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))


def forward_pass(q, x, y, eta, g, gp, rl, tinv, s0, *, chunk, pieces, block_v, write_o, write_h, interpret,
                 num_warps=4, num_stages=2, heads=None, walk_operands=None, write_p=False, scores=None,
                 key_shift=False):
    """Chunk walk for every (batch·head, piece, value block).

    ``walk_operands``: None, or a dtype the state-sized operands of the walk's dots are rounded to (see ``_sdot``).

    s0 [BH, P, dk, dv]: initial state of each piece.  Returns (o like y if write_o,
    P = η ⊙ residuals shaped like y in ``walk_operands`` or fp32 if write_p,
    h [BH, n_chunks, dk, dv] if write_h, s_end [BH, P, dk, dv]).  ``heads=H``: q, x, y (and o) are
    ``[B, L, H, d]``, read in place.  ``scores``: every chunk's masked scores ``[BH, L, C]``
    (:func:`masked_scores_pass`), read instead of each program forming ``QXᵀ`` itself (write_o only).
    """
    _one_piece(key_shift, pieces, "forward_pass")
    keys, key_kw = _key_operand(x, key_shift, interpret)
    grid, n, specs, shapes = walk_layout(q, y, chunk, pieces, block_v, heads=heads)
    Lp = n * chunk
    t_spec = pl.BlockSpec((None, Lp, chunk), lambda b, p, v: (b, p, 0))
    in_specs = [specs.rows_k, specs.rows_k, specs.rows_v, specs.gate, specs.gate, specs.gate, specs.gate, t_spec,
                specs.piece_state] + [t_spec] * (scores is not None)
    first = [(specs.rows_v, y)] if write_o else []
    if write_p:  # in y's layout, so that the chunk gradients can write dx over it (_dx_over_p)
        first.append((specs.rows_v, jax.ShapeDtypeStruct(y.shape, walk_operands or F32)))
    out_specs, out_shape = walk_outputs(specs, shapes, write_h, first=first)
    kernel = functools.partial(_forward_kernel, chunk=chunk, n_chunks=n, write_o=write_o, write_h=write_h,
                               precision=precision_for(q.dtype), lo=walk_operands, write_p=write_p,
                               read_scores=scores is not None, **key_kw)
    args = (q, keys, y, eta, g, gp, rl, tinv, s0)
    args += (scores,) if scores is not None else ()
    return call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                args=args, compiler_params=_params(interpret, num_warps, num_stages),
                interpret=interpret, name="falcon_delta_fwd")


def _prepare_kernel(x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, w_ref, u_ref, *, chunk, precision):
    """One chunk's ``W = T (η c⁻ ⊙ X)`` and ``U = T (η ⊙ Y)``, so that ``P = U − W S_0`` (the split forward).
    (Forming T here instead of reading it was slower on the H200: 0.48 vs 0.13 + 0.24 ms at 8x2048x16x128.)"""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    _, cont_p, _, _ = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    tinv = t_ref[...]
    w_ref[...] = _tdot(tinv, (eta * cont_p)[:, None] * x_ref[...].astype(F32), p32).astype(w_ref.dtype)
    u_ref[...] = _tdot(tinv, eta[:, None] * y_ref[...].astype(F32), p32).astype(u_ref.dtype)


def prepare_wu(x, y, eta, g, gp, rl, tinv, *, chunk, interpret, num_warps=4, heads=None, w_dtype=F32):
    """Every chunk's ``W = T (η c⁻ ⊙ X)`` ``[BH, L, dk]`` (in ``w_dtype``) and ``U = T (η ⊙ Y)`` ``[BH, L, dv]``
    (fp32: it enters ``P = U − W S`` by a subtraction, rounding it would add to P's error)."""
    BH, L, dk = token_dims(x, heads)
    dv = y.shape[-1]
    sp = chunk_specs(x, dv, chunk, heads)
    kernel = functools.partial(_prepare_kernel, chunk=chunk, precision=precision_for(x.dtype))
    return call(kernel, grid=(BH, L // chunk), in_specs=[sp.k, sp.v, sp.row, sp.row, sp.row, sp.row, sp.square],
                out_specs=[sp.flat_k, sp.flat_v],
                out_shape=[jax.ShapeDtypeStruct((BH, L, dk), w_dtype), jax.ShapeDtypeStruct((BH, L, dv), F32)],
                args=(x, y, eta, g, gp, rl, tinv), compiler_params=_params(interpret, num_warps, 1),
                interpret=interpret, name="falcon_delta_prepare_wu")


def _state_walk_kernel(x_ref, w_ref, u_ref, g_ref, rl_ref, s0_ref, *out_refs, chunk, n_chunks, precision, lo=None,
                       write_h=True, values_from=0):
    """The split forward's walk: only the state, two dots per chunk (``P = U − W S``, ``S ← a S + (w ⊙ X)ᵀ P``);
    stores every chunk's start state for the output pass if ``write_h``.  Value blocks before ``values_from``
    take ``U = 0`` (the piece maps' ``[I | 0]`` columns: their u block is a placeholder)."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    h_ref, s_end_ref = out_refs if write_h else (None, *out_refs)
    # 1 for value columns, 0 for the map columns (a transition carries no values)
    u_scale = (pl.program_id(2) >= values_from).astype(F32) if values_from else None

    def body(c, S):
        start = pl.multiple_of(c * chunk, chunk)
        rows = pl.ds(start, chunk)
        g, rl, g_last, rl_last = g_ref[rows], rl_ref[rows], g_ref[start + chunk - 1], rl_ref[start + chunk - 1]
        w_last = jnp.where(rl == rl_last, jnp.exp(g_last - g), 0.0)
        a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)
        if write_h:
            h_ref[c, :, :] = S.astype(h_ref.dtype)
        u = u_ref[rows, :].astype(F32)
        P = (u if u_scale is None else u_scale * u) - _sdot(w_ref[rows, :], S, p32, lo)
        return a_last * S + _sdot(x_ref[rows, :].T, w_last[:, None] * P, p32, lo)  # the row scale on the narrow P

    s_end_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))


def state_walk(x, w, u, g, rl, s0, *, chunk, pieces, block_v, interpret, num_warps=4, num_stages=2, heads=None,
               walk_operands=None):
    """The split forward's walk over the chunks of every (batch·head, piece, value block): the state only.
    Returns (h [BH, n_chunks, dk, dv], each chunk's start state in the chunk-state dtype; s_end [BH, P, dk, dv])."""
    grid, n_piece, specs, shapes = walk_layout(x, u, chunk, pieces, block_v, heads=heads)
    dk = w.shape[-1]
    Lp = n_piece * chunk
    w_rows = pl.BlockSpec((None, Lp, dk), lambda b, p, v: (b, p, 0))
    u_rows = pl.BlockSpec((None, Lp, block_v), lambda b, p, v: (b, p, v))
    state_specs, state_shapes = walk_outputs(specs, shapes, True)
    return call(functools.partial(_state_walk_kernel, chunk=chunk, n_chunks=n_piece, precision=precision_for(x.dtype),
                                  lo=walk_operands),
                grid=grid, in_specs=[specs.rows_k, w_rows, u_rows, specs.gate, specs.gate, specs.piece_state],
                out_specs=state_specs, out_shape=state_shapes, args=(x, w, u, g, rl, s0),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_state_walk")


def piece_maps(x, w, u, g, rl, *, chunk, pieces, block_v, interpret, num_warps=4, num_stages=2, heads=None,
               walk_operands=None):
    """Every piece's affine map ``S_end = M S_start + E`` from the split forward's ``W, U`` (:func:`prepare_wu`):
    the state walk of each piece over the augmented state ``[I | 0]`` with values ``[0 | U]`` (``dk + dv``
    columns, ``block_v`` per program, the map columns' U never read), its end state ``[M | E]``.  The walk's dots
    round their operands to ``walk_operands`` as the state walks do; M and E stay fp32.
    Returns (M [BH, P, dk, dk], E [BH, P, dk, dv]), fp32."""
    BH, L, dk = token_dims(x, heads)
    dv = u.shape[-1]
    if dk % block_v or dv % block_v:
        raise ValueError(f"piece_maps: block_v={block_v} must divide dk={dk} and dv={dv}")
    aug = jax.ShapeDtypeStruct((*u.shape[:-1], dk + dv), u.dtype)
    grid, n_piece, specs, shapes = walk_layout(x, aug, chunk, pieces, block_v, heads=heads)
    Lp = n_piece * chunk
    nk = dk // block_v
    w_rows = pl.BlockSpec((None, Lp, dk), lambda b, p, v: (b, p, 0))
    # the map columns (v < nk) read value block 0 as a placeholder, scaled to zero in the kernel
    u_rows = pl.BlockSpec((None, Lp, block_v), lambda b, p, v: (b, p, jnp.maximum(v - nk, 0)))
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=F32), (BH, pieces, dk, dk))
    s_aug = jnp.concatenate([eye, jnp.zeros((BH, pieces, dk, dv), F32)], axis=-1)
    state_specs, state_shapes = walk_outputs(specs, shapes, False)
    (ends,) = call(functools.partial(_state_walk_kernel, chunk=chunk, n_chunks=n_piece,
                                     precision=precision_for(x.dtype), lo=walk_operands, write_h=False,
                                     values_from=nk),
                   grid=grid, in_specs=[specs.rows_k, w_rows, u_rows, specs.gate, specs.gate, specs.piece_state],
                   out_specs=state_specs, out_shape=state_shapes, args=(x, w, u, g, rl, s_aug),
                   compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                   name="falcon_delta_piece_maps")
    return ends[..., :dk], ends[..., dk:]


def _output_kernel(q_ref, x_ref, w_ref, u_ref, g_ref, rl_ref, h_ref, o_ref, *, precision, lo=None):
    """One chunk's outputs from its start state h: ``o = c ⊙ Q h + (Q Xᵀ ⊙ D)(U − W h)``."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    q, x, g, rl = q_ref[...], x_ref[...], g_ref[...], rl_ref[...]
    h = h_ref[...].astype(F32)  # stored in the inputs' dtype for bf16 inputs
    cont = jnp.where(rl == 0, jnp.exp(g), 0.0)
    P = u_ref[...].astype(F32) - _sdot(w_ref[...], h, p32, lo)
    scores = _masked_scores(q, x, g, rl, precision)
    o = _sdot(scores, P, p32, lo) + cont[:, None] * _sdot(q, h, p32, lo)
    o_ref[...] = o.astype(o_ref.dtype)


def split_outputs(q, x, w, u, g, rl, h, *, like, chunk, block_v, interpret, num_warps=4, heads=None,
                  walk_operands=None):
    """Every chunk's outputs from its start state (parallel over batch·head, chunk and value block):
    ``o = c ⊙ Q h + (Q Xᵀ ⊙ D)(U − W h)``; o is shaped and typed like ``like`` (y)."""
    BH, L, dk = token_dims(q, heads)
    dv = u.shape[-1]
    n = L // chunk
    row_kv = row_block(heads, chunk, dk, lambda b, c, v: (b, c, 0))
    out_v = row_block(heads, chunk, block_v, lambda b, c, v: (b, c, v))
    row = pl.BlockSpec((None, chunk), lambda b, c, v: (b, c))
    (o,) = call(functools.partial(_output_kernel, precision=precision_for(q.dtype), lo=walk_operands),
                grid=(BH, n, dv // block_v),
                in_specs=[row_kv, row_kv, pl.BlockSpec((None, chunk, dk), lambda b, c, v: (b, c, 0)),
                          pl.BlockSpec((None, chunk, block_v), lambda b, c, v: (b, c, v)), row, row,
                          pl.BlockSpec((None, None, dk, block_v), lambda b, c, v: (b, c, 0, v))],
                out_specs=[out_v], out_shape=[jax.ShapeDtypeStruct(like.shape, like.dtype)],
                args=(q, x, w, u, g, rl, h), compiler_params=_params(interpret, num_warps, 1), interpret=interpret,
                name="falcon_delta_outputs")
    return o


def split_forward(q, x, y, eta, g, gp, rl, tinv, s0, *, chunk, pieces, block_v, interpret, num_warps=4,
                  num_stages=2, heads=None, walk_operands=None, output_block_v=None, wu=None):
    """The forward split as the peers split it: ``W, U`` per chunk (parallel, :func:`prepare_wu`; ``wu``: as it
    returned them, already formed), a walk that
    carries only the state (two dots per chunk over ``block_v`` value columns, storing the chunk start states,
    :func:`state_walk`), then the outputs of every chunk (parallel, :func:`split_outputs`, ``output_block_v``
    value columns per program, default all of them up to 128).  ``W`` is stored in ``walk_operands`` (the dtype
    the walks round it to for their dots anyway) or fp32.
    Returns (o like y, h [BH, n_chunks, dk, dv] in the chunk-state dtype, s_end [BH, P, dk, dv]); s0 as
    :func:`forward_pass`."""
    w, u = wu or prepare_wu(x, y, eta, g, gp, rl, tinv, chunk=chunk, interpret=interpret, num_warps=num_warps,
                            heads=heads, w_dtype=walk_operands or F32)
    h, s_end = state_walk(x, w, u, g, rl, s0, chunk=chunk, pieces=pieces, block_v=block_v, interpret=interpret,
                          num_warps=num_warps, num_stages=num_stages, heads=heads, walk_operands=walk_operands)
    o = split_outputs(q, x, w, u, g, rl, h, like=y, chunk=chunk, block_v=output_block_v or min(u.shape[-1], 128),
                      interpret=interpret, num_warps=num_warps, heads=heads, walk_operands=walk_operands)
    return o, h, s_end

