"""The chunk gradients of ``decayed_delta_rule``'s backward (Triton): one program per chunk.

The walks store what the chunk gradients need: the recompute walk each chunk's start state h and
``P = η ⊙ residuals``, the reverse walk each chunk's end-state gradient dh and ``dR``.  From them, per chunk:

* the value half (loop over blocks of value columns): ``dy = η ⊙ dR`` and the sums ``−dR Pᵀ``, ``dO Pᵀ``
  (``[C, C]``) and ``Σ_v dR ⊙ Y``;
* the key half (loop over blocks of key columns): dq, dx and, from the sums, the gradients w.r.t. η and the
  chunk-local decay sums g and g⁻ (the products ``dR hᵀ`` and ``P dhᵀ`` it needs for dx also give the terms
  through the chunk state, so the value half takes no dot with the state).

dy is written over the stored dR and dx over the stored P where shapes and dtypes agree: the backward's peak
memory holds no separate gradient buffers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from falcon_jax.kernels.common import call, chunk_specs, column_block, dot, pltriton, precision_for, token_dims
from falcon_jax.kernels.decayed_delta_rule.triton.common import (F32, _chunk_keys, _gates, _in_dot, _key_operand,
                                                                 _key_spec, _masks, _params, _sdot)


def _value_sums_init(chunk):
    """Zeros for the value-column sums of one chunk: −dR Pᵀ, dO Pᵀ ``[C, C]`` and ``Σ_v dR ⊙ Y`` ``[C]``."""
    return jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk,), F32)


def _value_block_terms(do, P, dR, y, p32, lo):
    """One value block's terms of the sums in :func:`_value_sums_init` (all fp32)."""
    return -_sdot(dR, P.T, p32, lo), _sdot(do, P.T, p32, lo), jnp.sum(dR * y, axis=1)


def _gate_grads(d_a, d_op, d_ey, scores, gram, gamma, eta):
    """From one chunk's value sums: the Gram's gradient ``d_k`` (zero off A's support), and the parts of dη and
    of the gradients w.r.t. ``g⁻`` and ``g`` that do not go through the chunk's start or end state
    (:func:`_state_row_grads` adds those; the callers add ``c ⊙ ⟨dO hᵀ, q⟩`` to dg)."""
    d_k = d_a * eta[:, None] * gamma
    a_grad = d_k * gram  # dA ⊙ A
    d_decay = d_op * scores
    deta = d_ey + jnp.sum(d_a * gram * gamma, axis=1)
    dg = jnp.sum(d_decay, axis=1) - jnp.sum(d_decay, axis=0) - jnp.sum(a_grad, axis=0)
    return d_k, deta, jnp.sum(a_grad, axis=1), dg


def _state_row_grads(d_xh, d_wl, h_dh, eta, cont_p, w_last, a_last, chunk):
    """The terms of dη, dg⁻ and dg through the chunk's start state h (``c⁻ ⊙ X h`` in the targets, ``a h`` in
    the end state) and its end state's gradient dh (``w ⊙ P`` in the end state), from the row sums
    ``d_xh = Σ_v dR ⊙ X h``, ``d_wl = Σ_v P ⊙ X dh`` and ``h_dh = ⟨h, dh⟩``.  The key half forms them as
    ``Σ_k X ⊙ dR hᵀ`` and ``Σ_k X ⊙ P dhᵀ`` from the products it needs anyway, so the value half has no dot
    with the state.  Returns the terms of (dη, dg⁻, dg)."""
    wl_term = w_last * d_wl
    last = lax.broadcasted_iota(jnp.int32, (chunk,), 0) == chunk - 1
    end = jnp.sum(wl_term) + a_last * h_dh
    return -cont_p * d_xh, -(eta * cont_p) * d_xh, jnp.where(last, end, 0.0) - wl_term


def _stored_value_sums(y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, p_ref, dr_ref, dy_ref, *, chunk, block_v,
                       precision, lo):
    """The value half's sums (:func:`_value_sums_init`) from the ``P`` (recompute walk) and ``dR``
    (state-gradient walk) the walks stored, writing ``dy = η ⊙ dR`` (unless ``dy_ref`` is None: the caller
    writes it): no T, no scores, no chunk state — per value
    block the two ``[C, C]`` sums and a row sum (the state's row terms come from the key half, see
    :func:`_key_grads`).  Returns (sums, the chunk's gate rows :func:`_row_gates`, which the key half reuses)."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    rows = _row_gates(eta_ref, g_ref, gp_ref, rl_ref, chunk)
    eta = rows[0]

    def value_block(j, sums):
        cols = column_block(j, block_v)
        dR = dr_ref[:, cols].astype(F32)
        terms = _value_block_terms(do_ref[:, cols].astype(F32), p_ref[:, cols].astype(F32), dR,
                                   y_ref[:, cols].astype(F32), p32, lo)
        if dy_ref is not None:
            dy_ref[:, cols] = (eta[:, None] * dR).astype(dy_ref.dtype)
        return tuple(acc + t for acc, t in zip(sums, terms))

    return lax.fori_loop(0, y_ref.shape[-1] // block_v, value_block, _value_sums_init(chunk)), rows


def _row_gates(eta_ref, g_ref, gp_ref, rl_ref, chunk):
    """One chunk's gate rows: (eta, g, gp, rl, cont, cont_p, w_last, a_last) (see :func:`_gates`)."""
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    return (eta, g, gp, rl, *_gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1]))


def _key_grads(q_ref, x_ref, do_ref, h_ref, dh_ref, p_ref, dr_ref, sums, rows, out_refs, *, chunk, block_k, precision,
               group, lo):
    """The key half's body: dq, dx by blocks of ``block_k`` key columns (two ``[C, C]`` tiles live: the score and
    Gram gradients), and dη, dg, dgp, from the value half's ``sums`` (:func:`_value_sums_init`) and the chunk's
    gate ``rows`` (:func:`_row_gates`).  Each key block's ``dR hᵀ`` and ``P dhᵀ`` (needed for dx) also give the
    state's row sums of :func:`_state_row_grads`: ``Σ_v dR ⊙ X h = Σ_k X ⊙ dR hᵀ`` and
    ``Σ_v P ⊙ X dh = Σ_k X ⊙ P dhᵀ`` — no dot with the state in the value half."""
    dq_ref, dx_ref, deta_ref, dg_ref, dgp_ref = out_refs
    p32 = lax.Precision.HIGHEST if precision is not None else None
    q, x = q_ref[...], x_ref[...]
    eta, g, gp, rl, cont, cont_p, w_last, a_last = rows
    d_op = sums[1]
    decay = _masks(g, g, rl, rl, strict=False)
    gamma = _masks(gp, g, rl, rl, strict=True, group=group)
    d_k, deta, dgp, dg = _gate_grads(*sums, dot(q, x.T, precision) * decay, dot(x, x.T, precision), gamma, eta)
    d_scores = d_op * decay
    d_sym = d_k + d_k.T
    do, P, dR = do_ref[...], p_ref[...], dr_ref[...]

    def key_block(j, row_sums):
        q_do_h, d_xh, d_wl, h_dh = row_sums
        cols = column_block(j, block_k)
        h_j, dh_j = h_ref[cols, :], dh_ref[cols, :]  # [block_k, dv]
        q_j, x_j = q_ref[:, cols].astype(F32), x_ref[:, cols].astype(F32)
        do_h = _in_dot(do, h_j.T, precision, p32)
        dr_h = _sdot(dR, h_j.T, p32, lo)
        p_dh = _sdot(P, dh_j.T, p32, lo)
        dq = cont[:, None] * do_h + _sdot(d_scores, x_j, p32, lo)
        dx = (_sdot(d_scores.T, q_j, p32, lo) + w_last[:, None] * p_dh - (eta * cont_p)[:, None] * dr_h
              + _sdot(d_sym, x_j, p32, lo))
        dq_ref[:, cols] = dq.astype(dq_ref.dtype)
        dx_ref[:, cols] = dx.astype(dx_ref.dtype)
        return (q_do_h + jnp.sum(do_h * q_j, axis=1), d_xh + jnp.sum(dr_h * x_j, axis=1),
                d_wl + jnp.sum(p_dh * x_j, axis=1), h_dh + jnp.sum(h_j.astype(F32) * dh_j.astype(F32)))

    row = jnp.zeros((chunk,), F32)
    q_do_h, d_xh, d_wl, h_dh = lax.fori_loop(0, q.shape[-1] // block_k, key_block,
                                             (row, row, row, jnp.zeros((), F32)))
    r_eta, r_gp, r_g = _state_row_grads(d_xh, d_wl, h_dh, eta, cont_p, w_last, a_last, chunk)
    deta_ref[...] = deta + r_eta
    dgp_ref[...] = dgp + r_gp
    dg_ref[...] = dg + r_g + cont * q_do_h


def _chunk_grad_stored_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, h_ref, dh_ref, p_ref, dr_ref,
                              dy_ref, *out_refs, chunk, block_v, block_k, precision, group, lo=None,
                              key_shift=False, key_pad=0, dy_last=False, barrier=False):
    """The chunk gradients in one program per chunk from the P and dR the walks stored: dy and the value sums
    (:func:`_stored_value_sums`, which stay in registers), then the key columns (:func:`_key_grads`).
    ``dy_last``: dy is written at the end — the call writes dy over dR, so no thread may store dy before every
    thread has read the dR the rest of the kernel needs: every such load feeds a value used before the
    ``barrier`` (all the program's threads meet there; interpret mode runs one thread and needs none).  After it,
    each thread reads back the dR elements it turns into dy.  (Keeping the key half's dR tile for this instead
    doubled the kernel's spills, 156 → 312 bytes standalone.)"""
    sums, rows = _stored_value_sums(y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, p_ref, dr_ref,
                                    None if dy_last else dy_ref, chunk=chunk, block_v=block_v, precision=precision,
                                    lo=lo)
    _key_grads(q_ref, _chunk_keys(x_ref, key_shift, key_pad, chunk), do_ref, h_ref, dh_ref, p_ref, dr_ref, sums, rows,
               out_refs, chunk=chunk, block_k=block_k, precision=precision, group=group, lo=lo)
    if dy_last:
        if barrier:
            pltriton.debug_barrier()
        dy_ref[...] = (eta_ref[...][:, None] * dr_ref[...].astype(F32)).astype(dy_ref.dtype)


def _dx_over_p(p, x, p_index, dx_index):
    """``aliases`` that write a chunk-gradient kernel's dx over the stored ``P`` where they share shape and dtype
    (``dk = dv``; P is kept in the tokens' layout for this): one fewer ``[B, T, H, d]`` buffer at the
    backward's peak.  Safe without a barrier: a program reads only its chunk's P rows, and every dx it stores
    depends on all of them (``P dhᵀ`` of the full tile; the value sums), so each P load precedes the first
    dx store.  XLA copies P first if anything else still reads it."""
    return {p_index: dx_index} if p.shape == x.shape and p.dtype == x.dtype else {}


def chunk_grad_pass(q, x, y, eta, g, gp, rl, do, h, dh, p, dr, *, chunk, block_v, interpret, num_warps=4,
                    num_stages=1, group=1, heads=None, walk_operands=None, block_k=32, key_shift=False):
    """The chunk gradients from the ``P`` and ``dR`` (both like y) the walks stored
    (``forward_pass(write_p=True)``, ``state_grad_walk(write_dr=dtype)``) and the chunk states ``h``, ``dh``
    ``[BH, n_chunks, dk, dv]``: one program per chunk, ``block_v`` value and ``block_k`` key columns per step of
    its loops (``lax.fori_loop``, whose loads Triton's pipeliner issues a step ahead with ``num_stages`` ≥ 2).

    Returns dq, dx, dy (in the layout of q, x, y: ``[BH, L, d]``, or ``[B, L, H, d]`` with ``heads=H``) and fp32
    ``[BH, L]``: dη, dg (w.r.t. the chunk-local inclusive cumsum g) and dgp (w.r.t. the exclusive one)."""
    BH, L, dk = token_dims(q, heads)
    sp = chunk_specs(q, y.shape[-1], chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    # dy over dR where they share shape and dtype (the tokens' layout; bf16 dR for bf16 inputs), dx over P: the
    # backward's peak then holds neither output apart from the buffers the walks stored
    dy_last = dr.shape == y.shape and dr.dtype == y.dtype
    aliases = {**_dx_over_p(p, x, 10, 2), **({11: 0} if dy_last else {})}
    kernel = functools.partial(_chunk_grad_stored_kernel, chunk=chunk, block_v=block_v, block_k=min(block_k, dk),
                               precision=precision_for(q.dtype), group=group, lo=walk_operands,
                               dy_last=dy_last, barrier=not interpret, **key_kw)
    dy, dq, dx, deta, dg, dgp = call(
        kernel, grid=(BH, L // chunk),
        in_specs=[sp.k, _key_spec(sp, x, key_shift, heads), sp.v, sp.row, sp.row, sp.row, sp.row, sp.v, sp.state,
                  sp.state, sp.v, sp.v],
        out_specs=[sp.v, sp.k, sp.k, sp.row, sp.row, sp.row],
        out_shape=[jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(x.shape, x.dtype), vec, vec, vec],
        args=(q, keys, y, eta, g, gp, rl, do, h, dh, p, dr), aliases=aliases,
        compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
        name="falcon_delta_chunk_grads")
    return dq, dx, dy, deta, dg, dgp

