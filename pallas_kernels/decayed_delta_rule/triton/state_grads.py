"""The state-gradient walk of ``decayed_delta_rule``'s backward (Triton), split as the peers split it.

Per chunk, in parallel (:func:`prepare_v`): ``V = Tᵀ (Q Xᵀ ⊙ D)ᵀ dO`` and, optionally, the walk's
``(c ⊙ Q)ᵀ dO`` term; then a reverse walk (:func:`state_grad_walk`) carrying only the fp32 state gradient::

    dh_c = dS                    dR = V + Tᵀ (w ⊙ X dS)                dS ← a dS + (c ⊙ Q)ᵀ dO − (η c⁻ ⊙ X)ᵀ dR

storing dh (every chunk's end-state gradient) and dR (the residuals' gradient) for the chunk gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import call, chunk_specs, dot, precision_for, token_dims, walk_layout, walk_outputs
from falcon_jax.kernels.decayed_delta_rule.triton.common import (F32, _chunk_keys, _chunk_rows, _gates, _key_operand,
                                                                 _key_spec, _keys, _masked_scores, _one_piece,
                                                                 _params, _sdot, _tdot)


def _reverse_walk(q_ref, x_ref, gate_refs, do_ref, ds_end_ref, out_refs, *, chunk, n_chunks, write_dh, precision, lo,
                  residual_grad, write_dr=False, q_term_ref=None):
    """The reverse walk: per chunk (last first) store the end-state gradient dS (``write_dh``), get
    ``dR = residual_grad(rows, x, w, dS)`` (stored with ``write_dr``), then
    ``dS ← a dS + (c ⊙ Q)ᵀ dO − (η c⁻ ⊙ X)ᵀ dR``.  ``q_term_ref``: every chunk's ``(c ⊙ Q)ᵀ dO`` as
    :func:`prepare_v` formed it, in the buffer dh is written to (read before it is overwritten); the walk then
    loads neither q nor dO."""
    refs = list(out_refs)
    dr_ref = refs.pop(0) if write_dr else None
    dh_ref = refs.pop(0) if write_dh else None
    (ds_start_ref,) = refs
    p32 = lax.Precision.HIGHEST if precision is not None else None

    def body(i, dS):
        c = n_chunks - 1 - i
        rows, eta, g, gp, rl, g_last, rl_last = _chunk_rows(gate_refs, c, chunk)
        cont, cont_p, w_last, a_last = _gates(eta, g, gp, rl, g_last, rl_last)
        if q_term_ref is not None:
            q_term = q_term_ref[c, :, :].astype(F32)  # before dh (the same buffer) is written
        if write_dh:
            dh_ref[c, :, :] = dS.astype(dh_ref.dtype)
        x = x_ref[rows, :]
        if q_term_ref is None:
            q, do = q_ref[rows, :], do_ref[rows, :].astype(F32)
            # the row scales go on the narrow dO and dR blocks ([C, block_v]), not on the keys ([C, dk], in every
            # program of a head, every step)
            q_term = _sdot(q.T, cont[:, None] * do, p32, lo)
        dR = residual_grad(rows, x, w_last, dS)
        if write_dr:
            dr_ref[rows, :] = dR.astype(dr_ref.dtype)
        return a_last * dS + q_term - _sdot(x.T, (eta * cont_p)[:, None] * dR, p32, lo)

    ds_start_ref[...] = lax.fori_loop(0, n_chunks, body, ds_end_ref[...].astype(F32))


def _prepare_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, do_ref, v_ref, *q_term_refs, chunk,
                    precision, lo=None, key_shift=False, key_pad=0):
    """One chunk's ``V = Tᵀ (Q Xᵀ ⊙ D)ᵀ dO`` (the reverse walk's ``dR = V + Tᵀ (w ⊙ X dS)``) and, with a
    ``q_term_ref``, the walk's ``(c ⊙ Q)ᵀ dO`` ``[dk, dv]`` (its operands rounded to ``lo`` as the walk would)."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    cont, _, _, _ = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    q, x = q_ref[...], _chunk_keys(x_ref, key_shift, key_pad, chunk)[...]
    do = do_ref[...].astype(F32)
    scores = _masked_scores(q, x, g, rl, precision)
    v_ref[...] = _tdot(t_ref[...].T, dot(scores.T, do, p32), p32).astype(v_ref.dtype)
    for q_term_ref in q_term_refs:
        q_term_ref[...] = _sdot(q.T, cont[:, None] * do, p32, lo).astype(q_term_ref.dtype)


def prepare_v(q, x, eta, g, gp, rl, tinv, do, *, chunk, interpret, num_warps=4, heads=None, v_dtype=F32,
              q_term_dtype=None, walk_operands=None, key_shift=False):
    """Every chunk's ``V = Tᵀ (Q Xᵀ ⊙ D)ᵀ dO`` shaped like dO (in ``v_dtype``; dR is written over it) and, with a
    ``q_term_dtype``, the walk's ``(c ⊙ Q)ᵀ dO`` per chunk ``[BH, n_chunks, dk, dv]`` (its operands rounded to
    ``walk_operands`` as in the walk; dh is written over it), else None.  Returns ``(V, q_term)``."""
    BH, L, dk = token_dims(q, heads)
    dv = do.shape[-1]
    sp = chunk_specs(q, dv, chunk, heads)
    out_specs, out_shape = [sp.v], [jax.ShapeDtypeStruct(do.shape, v_dtype)]
    if q_term_dtype is not None:
        out_specs.append(sp.state)
        out_shape.append(jax.ShapeDtypeStruct((BH, L // chunk, dk, dv), q_term_dtype))
    keys, key_kw = _key_operand(x, key_shift, interpret)
    outs = call(functools.partial(_prepare_kernel, chunk=chunk, precision=precision_for(q.dtype), lo=walk_operands,
                                  **key_kw),
                grid=(BH, L // chunk), in_specs=[sp.k, _key_spec(sp, x, key_shift, heads), sp.row, sp.row, sp.row,
                                                 sp.row, sp.square, sp.v],
                out_specs=out_specs, out_shape=out_shape, args=(q, keys, eta, g, gp, rl, tinv, do),
                compiler_params=_params(interpret, num_warps, 1), interpret=interpret,
                name="falcon_delta_dstate_prepare")
    return outs[0], (outs[1] if q_term_dtype is not None else None)


def _walk_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, v_ref, t_ref, do_ref, ds_end_ref, *refs, chunk,
                 n_chunks, write_dh, precision, lo=None, write_dr=False, q_term=False, key_shift=False, key_pad=0):
    """The reverse walk with ``dR = V + Tᵀ (w ⊙ X dS)``: three dots per chunk and one with the chunk's T.
    ``q_term``: the first of ``refs`` holds every chunk's ``(c ⊙ Q)ᵀ dO`` (the buffer dh is written to), the
    rest are the outputs."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    q_term_ref, out_refs = (refs[0], refs[1:]) if q_term else (None, refs)

    def residual_grad(rows, x, w_last, dS):
        b_ds = _tdot(t_ref[rows, :].T, w_last[:, None] * _sdot(x, dS, p32, lo), p32)
        return v_ref[rows, :].astype(F32) + b_ds

    _reverse_walk(q_ref, _keys(x_ref, key_shift, key_pad), (eta_ref, g_ref, gp_ref, rl_ref), do_ref, ds_end_ref,
                  out_refs, chunk=chunk, n_chunks=n_chunks, write_dh=write_dh, precision=precision, lo=lo,
                  residual_grad=residual_grad, write_dr=write_dr, q_term_ref=q_term_ref)


def state_grad_walk(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret,
                    num_warps=4, num_stages=2, heads=None, walk_operands=None, prepared=None, write_dr=None,
                    key_shift=False):
    """The reverse walk over the chunks of every (batch·head, piece, value block).

    ``ds_end`` ``[BH, P, dk, dv]``: the gradient at each piece's end.  ``prepared``: :func:`prepare_v`'s
    ``(V, q_term)`` (formed here if None); a q-term makes the walk add it instead of forming ``(c ⊙ Q)ᵀ dO`` and
    write dh over it (one piece, ``write_dh`` only).  ``write_dr``: None, or the dtype dR is stored in, shaped like
    dO (the tokens' layout, so that the chunk gradients can write dy over it).
    Returns (dR if write_dr, dh [BH, n_chunks, dk, dv] if write_dh, ds_start [BH, P, dk, dv])."""
    if prepared is None:
        prepared = prepare_v(q, x, eta, g, gp, rl, tinv, do, chunk=chunk, interpret=interpret, num_warps=num_warps,
                             heads=heads, key_shift=key_shift)
    v, q_term = prepared
    _one_piece(key_shift, pieces, "state_grad_walk")
    grid, n_piece, specs, shapes = walk_layout(q, do, chunk, pieces, block_v, heads=heads)
    Lp = n_piece * chunk
    in_specs = [specs.rows_k, specs.rows_k, specs.gate, specs.gate, specs.gate, specs.gate, specs.rows_v,
                pl.BlockSpec((None, Lp, chunk), lambda i, p, j: (i, p, 0)), specs.rows_v, specs.piece_state]
    first = [(specs.rows_v, jax.ShapeDtypeStruct(do.shape, write_dr))] if write_dr is not None else ()
    out_specs, out_shape = walk_outputs(specs, shapes, write_dh, first=first)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    args = [q, keys, eta, g, gp, rl, v, tinv, do, ds_end]
    # dR is written over V (same shape and blocks; each chunk's dR rows are formed from its V rows, read by the
    # same program first), so the two never take memory side by side (XLA copies V first if something reads it
    # later)
    aliases = {6: 0} if write_dr is not None and jnp.dtype(write_dr) == v.dtype else {}
    if q_term is not None:
        if pieces != 1 or not write_dh or q_term.dtype != shapes.chunk_states.dtype:
            raise ValueError("state_grad_walk: a prepared q-term needs one piece, write_dh and dh's dtype "
                             f"{shapes.chunk_states.dtype} (got pieces={pieces}, write_dh={write_dh}, "
                             f"{q_term.dtype})")
        in_specs.append(specs.chunk_states)
        aliases[len(args)] = int(write_dr is not None)  # the q-term's buffer becomes dh
        args.append(q_term)
    kernel = functools.partial(_walk_kernel, chunk=chunk, n_chunks=n_piece, write_dh=write_dh,
                               precision=precision_for(q.dtype), lo=walk_operands, write_dr=write_dr is not None,
                               q_term=q_term is not None, **key_kw)
    return call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, args=tuple(args),
                aliases=aliases, compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_dstate_walk")
