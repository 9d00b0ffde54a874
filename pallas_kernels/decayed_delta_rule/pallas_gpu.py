"""GPU kernels (Pallas, Triton lowering) for the decayed delta rule (Falcon-1's recurrence).

Layout: batch·heads flattened, ``q, x [BH, L, dk]``, ``y [BH, L, dv]``,
``eta [BH, L]`` (write weight), ``g [BH, L]`` the *chunk-local* inclusive cumsum
of the log decay, ``gp = g − log γ`` (the same sum, exclusive), ``rl [BH, L]`` the
chunk-local run index (0 = same segment as the chunk's initial state).
``tinv [BH, L, C]``: row ``cC + s`` holds row ``s`` of chunk c's ``T = (I + A)⁻¹`` (fp32, or the bf16/fp16
inputs' dtype, ``KernelConfig.tri_dtype``; every dot with it goes through ``_tdot``).

Per chunk (local index s, j; masks M⁻ strict lower, M⁺ lower incl., both cut
between segments; ``c_p = [rl = 0] e^{gp}``, ``c = [rl = 0] e^{g}``,
``w = [rl = rl_last] e^{g_last − g}``, ``a = [rl_last = 0] e^{g_last}``)::

    A[s, j] = M⁻ · η_s (x_s·x_j) e^{gp_s − g_j}          strictly lower
    P = (I + A)⁻¹ R,   R = η ⊙ (Y − c_p ⊙ X S_0)          (P = η ⊙ residuals)
    o = c ⊙ Q S_0 + (Q Xᵀ ⊙ M⁺ e^{g_t − g_s}) P
    S_C = a S_0 + Xᵀ (w ⊙ P)

Only differences ``g_t − g_s`` with ``t ≥ s`` are exponentiated (masked entries
become −inf before ``exp``), so nothing overflows at any decay.

Kernels:
  * ``tri_inverse_pass`` — one program per chunk: ``T = (I + A)⁻¹`` by blocked
    forward substitution over 16-row blocks (the diagonal blocks by right-looking
    elimination, all in one loop; the blocks below them by matmuls).  No powers of A are formed, so β near 2 (A's
    entries near 2, alternating-sign inverse) stays exact to fp32 rounding.
  * ``forward_pass`` — one program per (batch·head, piece, value block) walks its
    chunks with ``S_0`` in registers (fp32), writing o, optionally each chunk's
    start state h, and the end state.
  * ``state_grad_pass`` — the reverse walk: ``dP = (QXᵀ⊙D)ᵀ dO + w ⊙ X dS``,
    ``dR = Tᵀ dP``, ``dS ← a dS + (c⊙Q)ᵀ dO − (η c_p ⊙ X)ᵀ dR``.
  * ``chunk_grad_pass`` — one program per chunk: dq, dx, dy, dη and the gradients
    w.r.t. g and gp from h, dh and T.

The peers' split (the GPU defaults where the H200 measured them faster, ``api.KernelConfig``):
  * ``split_forward`` = ``prepare_wu`` (``W = T(η c⁻ ⊙ X)``, ``U = T(η ⊙ Y)`` per chunk) +
    ``state_walk`` (``P = U − W S``, ``S ← a S + (w ⊙ X)ᵀ P``, stores h) + ``split_outputs``
    (every chunk's outputs from h in parallel).
  * ``state_grad_split_pass`` = ``prepare_vb`` (``V = Tᵀ(QXᵀ ⊙ D)ᵀ dO``, ``B = Tᵀ(w ⊙ X)``) + a
    reverse walk with ``dR = V + B dS``.
  * ``chunk_grad_split_pass`` — ``chunk_grad_pass`` as two programs per chunk (value columns, then
    key columns), so that neither holds ``[C, dk]`` fp32 accumulators.
  * ``chunk_grad_stored_pass`` (the GPU default since the ninth H200 run) — the walks already form ``P``
    (recompute walk, ``forward_pass(write_p=True)``) and ``dR`` (reverse walk, ``write_dr=dtype``); stored,
    they spare the chunk gradients T, the scores' transpose product and both T products, leaving one program
    per chunk: the value sums from P and dR, then the key columns (whose ``dR hᵀ`` and ``P dhᵀ`` also give the
    gates' terms through the chunk state, so no value block takes a dot with it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import (call, chunk_specs, column_block, column_loop, dot, pltriton, precision_for,
                                   row_block, token_dims, triton_params, walk_layout, walk_outputs)

BLOCK = 16  # rows of a diagonal block of the triangular inverse (Triton's smallest dot tile)
F32 = jnp.float32


def _masks(g_row, g_col, rl_row, rl_col, strict, group=1):
    """``exp(g_row[t] − g_col[s])`` on ``s < t`` (strict=True) or ``s ≤ t`` (False) or every (t, s)
    (None: a block of rows wholly after the columns' block), within one segment; else 0.

    ``group`` (a power of two ≤ 16): rows come in groups of ``group`` (the virtual writes of one step of a
    windowed rule); strict=True then means *an earlier group* (``s // group < t // group``).
    Leading batch axes are allowed (``xla.py`` calls it on ``[BH, n, C]`` rows); the kernels pass vectors."""
    n_r, n_c = g_row.shape[-1], g_col.shape[-1]
    rows = lax.broadcasted_iota(jnp.int32, (n_r, n_c), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n_r, n_c), 1)
    mask = rl_row[..., :, None] == rl_col[..., None, :]
    if strict and group > 1:
        shift = jnp.int32(group.bit_length() - 1)
        mask &= lax.shift_right_logical(rows, shift) > lax.shift_right_logical(cols, shift)
    elif strict is not None:
        mask &= (rows > cols) if strict else (rows >= cols)
    return jnp.exp(jnp.where(mask, g_row[..., :, None] - g_col[..., None, :], -jnp.inf))


def _gates(eta, g, gp, rl, g_last, rl_last):
    cont = jnp.where(rl == 0, jnp.exp(g), 0.0)  # decay of S_0 to row t (read)
    cont_p = jnp.where(rl == 0, jnp.exp(gp), 0.0)  # decay of S_0 to row t's residual
    w_last = jnp.where(rl == rl_last, jnp.exp(g_last - g), 0.0)  # decay of row s's write to the chunk end
    a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)
    return cont, cont_p, w_last, a_last


def _unit_lower_inverses(blocks, elimination="columns"):
    """``(I + a)⁻¹`` of each strictly lower ``[16, 16]`` block ``a`` in ``blocks``, by forward elimination — all
    blocks in the same loop: their chains are independent, so one 15-step loop over the list (rather than 15
    steps per block, one block after another) lets the warp overlap their latencies.

    ``elimination="columns"`` (right-looking): step j takes row j of t, final once steps < j ran, and subtracts
    ``a[:, j] ⊗ t[j, :]`` from the rows below.  Column j of a does not depend on t, so a step's chain is one
    reduction over rows and a multiply-add, and each vector is broadcast along the axis it was reduced over: no
    layout conversion between steps.  ``"rows"`` (the kernel's form until the twenty-second session): step r
    sets row r to ``e_r − a_r t``; a_r (reduced over rows) must be broadcast along columns, which Triton
    lowers through shared memory every step."""
    n = blocks[0].shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def row_step(r, a, t):
        a_r = jnp.sum(jnp.where(rows == r, a, 0.0), axis=0)  # row r of a (zero from column r on)
        new = jnp.sum(a_r[:, None] * t, axis=0)  # a_r @ t: rows < r of t are final
        return jnp.where(rows == r, t - new[None, :], t)  # row r: e_r − a_r t

    def column_step(j, a, t):
        a_j = jnp.sum(jnp.where(cols == j, a, 0.0), axis=1)  # column j of a (zero on rows ≤ j)
        t_j = jnp.sum(jnp.where(rows == j, t, 0.0), axis=0)  # row j of t, final
        return t - a_j[:, None] * t_j[None, :]

    if elimination not in ("columns", "rows"):
        raise ValueError(f"elimination must be 'columns' or 'rows', got {elimination!r}")
    step, first, stop = (column_step, 0, n - 1) if elimination == "columns" else (row_step, 1, n)

    def body(r, ts):
        return tuple(step(r, a, t) for a, t in zip(blocks, ts))

    eye = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
    return list(lax.fori_loop(jnp.int32(first), jnp.int32(stop), body, tuple(eye for _ in blocks)))


class _KeysOneRowBack:
    """The write features ``x`` of a block of rows, read in place from the keys ``k`` one row back:
    ``x[t] = k[t − 1]``, and the sequence's first row zero (the op folds row 0's step, with ``first_key``, into the
    initial state), so no shifted copy of k is made (``shifted_keys=True`` in the op).

    Indexed like the x ref it stands for — ``[...]``, ``[rows, :]``, ``[:, cols]`` — with ``rows`` a static or
    ``pl.ds`` slice counted from ``base``, the sequence row of this block's first row (a chunk program's
    ``c · C``; 0 for a walk over the whole sequence).  ``k_ref`` holds the whole sequence, ``k[0]`` at row
    ``pad``.  A window is one load one row earlier; one that may start at the sequence's first row is a masked
    load (row −1 reads zero, never touching memory), which Triton feeds to the dots as it does a plain load.
    ``pad``: 0 on the GPU; 1 in interpret mode, whose windows are dynamic slices that clamp a start of −1 to 0
    — there k has a NaN row in front (:func:`_key_operand`), so a window the mask failed to cover shows."""

    def __init__(self, k_ref, base, rows, pad):
        self.k_ref, self.base, self.rows, self.pad = k_ref, base, rows, pad

    def __getitem__(self, idx):
        rows, cols = (slice(None), slice(None)) if idx is Ellipsis else idx
        if isinstance(rows, slice):
            if rows != slice(None):
                raise ValueError(f"_KeysOneRowBack: row slices are pl.ds windows or ':', got {rows!r}")
            start, n = 0, self.rows
        else:
            start, n = rows.start, rows.size
        first = self.base + start  # the window's first x row
        window = self.k_ref.at[pl.ds(first - 1 + self.pad, n), cols]
        if (isinstance(start, int) and start > 0) or (isinstance(first, int) and first > 0):
            return window[...]  # never the sequence's first row
        width = self.k_ref.shape[-1] if isinstance(cols, slice) else cols.size
        keep = lax.broadcasted_iota(jnp.int32, (n, width), 0) + first > 0
        return pltriton.load(window, mask=keep, other=jnp.zeros((), window.dtype))


def _keys(x_ref, key_shift, key_pad, base=0, rows=None):
    """``x_ref`` itself, or with ``key_shift`` the keys it holds read one row back (:class:`_KeysOneRowBack`)."""
    return _KeysOneRowBack(x_ref, base, rows, key_pad) if key_shift else x_ref


def _chunk_keys(x_ref, key_shift, key_pad, chunk):
    """:func:`_keys` in a program of a (batch·head, chunk) grid: the chunk's ``[C, dk]`` rows."""
    return _keys(x_ref, key_shift, key_pad, pl.program_id(1) * chunk, chunk)


def _tri_kernel(x_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, *, chunk, precision, group, key_shift=False,
                key_pad=0, elimination="columns"):
    x_ref = _chunk_keys(x_ref, key_shift, key_pad, chunk)
    nb = chunk // BLOCK
    blk = [pl.ds(i * BLOCK, BLOCK) for i in range(nb)]
    eta = [eta_ref[b] for b in blk]
    g = [g_ref[b] for b in blk]
    gp = [gp_ref[b] for b in blk]
    rl = [rl_ref[b] for b in blk]
    p32 = lax.Precision.HIGHEST if precision is not None else None

    # x's blocks are read where used, not held: held, a [64, 128] bf16 tile is 128 registers of the one warp
    def a_block(i, k):  # A_ik (k < i: every entry; k = i: strictly lower)
        return (eta[i][:, None] * dot(x_ref[blk[i], :], x_ref[blk[k], :].T, precision)
                * _masks(gp[i], g[k], rl[i], rl[k], strict=True if k == i else None, group=group))

    T = {(i, i): t for i, t in enumerate(_unit_lower_inverses([a_block(i, i) for i in range(nb)], elimination))}
    for i in range(nb):
        A = [a_block(i, k) for k in range(i)]
        for k in range(i):  # block forward substitution: T_ik = −T_ii Σ_{k≤m<i} A_im T_mk
            acc = dot(A[k], T[k, k], p32)
            for m in range(k + 1, i):
                acc += dot(A[m], T[m, k], p32)
            T[i, k] = -dot(T[i, i], acc, p32)
        for k in range(nb):
            t_ref[blk[i], blk[k]] = (T[i, k] if k <= i else jnp.zeros((BLOCK, BLOCK), F32)).astype(t_ref.dtype)


def _masked_scores(q, x, g, rl, precision):
    """One chunk's masked scores ``QXᵀ ⊙ D`` (``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within a segment), fp32."""
    return dot(q, x.T, precision) * _masks(g, g, rl, rl, strict=False)


def _scores_kernel(q_ref, x_ref, g_ref, rl_ref, s_ref, *, precision, key_shift=False, key_pad=0):
    """One chunk's masked scores (:func:`_masked_scores`), stored for the output walk."""
    x_ref = _chunk_keys(x_ref, key_shift, key_pad, q_ref.shape[0])
    s_ref[...] = _masked_scores(q_ref[...], x_ref[...], g_ref[...], rl_ref[...], precision).astype(s_ref.dtype)


def _sdot(a, b, p32, lo):
    """A walk's dot with an fp32 state-sized operand (S, P, dS, dR): at ``p32`` (TF32 for bf16 inputs), or,
    with ``lo`` a dtype (``KernelConfig(walk_operands="input")``), both operands rounded to it first — the
    bf16 MMA the peers use; S and dS themselves stay fp32."""
    if lo is None:  # b may be a state stored in the inputs' dtype (the chunk gradients' h, dh)
        return dot(a.astype(F32), b.astype(F32), p32)
    return dot(a.astype(lo), b.astype(lo), None)


def _tdot(t, b, p32):
    """``t @ b`` for a tile ``t`` of the triangular inverse T (or its transpose): stored in fp32, at ``p32``;
    stored in the inputs' dtype (``KernelConfig(tri_dtype="input")``, as the peers keep their inverse), ``b`` is
    rounded to it and the dot is the inputs' MMA."""
    if t.dtype == F32:
        return dot(t, b.astype(F32), p32)
    return dot(t, b.astype(t.dtype), None)


def _chunk_rows(refs, c, chunk):
    """Rows of chunk ``c``: (rows slice, eta, g, gp, rl, g at the last row, rl at the last row)."""
    eta_ref, g_ref, gp_ref, rl_ref = refs
    start = pl.multiple_of(c * chunk, chunk)
    rows = pl.ds(start, chunk)
    return rows, eta_ref[rows], g_ref[rows], gp_ref[rows], rl_ref[rows], g_ref[start + chunk - 1], \
        rl_ref[start + chunk - 1]


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


def _reverse_walk(q_ref, x_ref, gate_refs, do_ref, ds_end_ref, out_refs, *, chunk, n_chunks, write_dh, precision, lo,
                  residual_grad, write_dr=False, q_term_ref=None):
    """The reverse walk both state-gradient kernels share: per chunk (last first) store the end-state gradient dS
    (``write_dh``), get ``dR = residual_grad(rows, q, x, do, g, rl, w, dS)`` (stored with ``write_dr``), then
    ``dS ← a dS + (c ⊙ Q)ᵀ dO − (η c⁻ ⊙ X)ᵀ dR``.  ``q_term_ref``: every chunk's ``(c ⊙ Q)ᵀ dO`` as
    :func:`prepare_vb` formed it, in the buffer dh is written to (read before it is overwritten); the walk then
    loads neither q nor dO (``residual_grad`` must not need them)."""
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
        else:
            q = do = None
        dR = residual_grad(rows, q, x, do, g, rl, w_last, dS)
        if write_dr:
            dr_ref[rows, :] = dR.astype(dr_ref.dtype)
        return a_last * dS + q_term - _sdot(x.T, (eta * cont_p)[:, None] * dR, p32, lo)

    ds_start_ref[...] = lax.fori_loop(0, n_chunks, body, ds_end_ref[...].astype(F32))


def _state_grad_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, do_ref, ds_end_ref, *out_refs,
                       chunk, n_chunks, write_dh, precision, lo=None, write_dr=False):
    """The fused reverse walk: ``dP = (QXᵀ⊙D)ᵀ dO + w ⊙ X dS``, ``dR = Tᵀ dP`` inside the walk."""
    p32 = lax.Precision.HIGHEST if precision is not None else None

    def residual_grad(rows, q, x, do, g, rl, w_last, dS):
        scores = _masked_scores(q, x, g, rl, precision)
        dP = _sdot(scores.T, do, p32, lo) + w_last[:, None] * _sdot(x, dS, p32, lo)
        return _tdot(t_ref[rows, :].T, dP, p32)

    _reverse_walk(q_ref, x_ref, (eta_ref, g_ref, gp_ref, rl_ref), do_ref, ds_end_ref, out_refs, chunk=chunk,
                  n_chunks=n_chunks, write_dh=write_dh, precision=precision, lo=lo, residual_grad=residual_grad,
                  write_dr=write_dr)


def _chunk_grad_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, do_ref, h_ref, dh_ref,
                       dq_ref, dx_ref, dy_ref, deta_ref, dg_ref, dgp_ref, *, chunk, block_v, precision, group):
    """Gradients inside one chunk from its start state ``h``, end-state gradient ``dh`` and ``T``.

    Value columns are visited in blocks of ``block_v`` (only one block of
    ``y, do, h, dh`` and the derived ``[C, block_v]`` tiles is live at a time).
    """
    p32 = lax.Precision.HIGHEST if precision is not None else None
    q, x = q_ref[...], x_ref[...]
    qf, xf = q.astype(F32), x.astype(F32)
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    cont, cont_p, w_last, a_last = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    tinv = t_ref[...]
    dk = q.shape[-1]
    dv = y_ref.shape[-1]
    decay = _masks(g, g, rl, rl, strict=False)
    scores = dot(q, x.T, precision) * decay
    gram = dot(x, x.T, precision)
    gamma = _masks(gp, g, rl, rl, strict=True, group=group)
    sums = _value_sums_init(chunk)
    do_h = jnp.zeros((chunk, dk), F32)
    dr_h = jnp.zeros((chunk, dk), F32)
    p_dh = jnp.zeros((chunk, dk), F32)
    h_dh = jnp.zeros((), F32)
    for j in range(dv // block_v):  # static: a few blocks
        cols = pl.ds(j * block_v, block_v)
        y, do = y_ref[:, cols].astype(F32), do_ref[:, cols].astype(F32)
        h, dh = h_ref[:, cols].astype(F32), dh_ref[:, cols].astype(F32)
        P, dR, terms = _value_block_grads(xf, y, do, h, dh, tinv, scores, eta, cont_p, w_last, precision, None)
        sums = tuple(acc + t for acc, t in zip(sums, terms))
        do_h += dot(do, h.T, p32)
        dr_h += dot(dR, h.T, p32)
        p_dh += dot(P, dh.T, p32)
        h_dh += jnp.sum(h * dh)
        dy_ref[:, cols] = (eta[:, None] * dR).astype(dy_ref.dtype)
    d_op = sums[1]
    d_k, deta, dgp, dg = _gate_grads(*sums, scores, gram, gamma, eta)
    r_eta, r_gp, r_g = _state_row_grads(jnp.sum(xf * dr_h, axis=1), jnp.sum(xf * p_dh, axis=1), h_dh, eta, cont_p,
                                        w_last, a_last, chunk)
    d_scores = d_op * decay
    dq = cont[:, None] * do_h + dot(d_scores, xf, p32)
    dx = (dot(d_scores.T, qf, p32) + w_last[:, None] * p_dh - (eta * cont_p)[:, None] * dr_h
          + dot(d_k + d_k.T, xf, p32))
    deta_ref[...] = deta + r_eta
    dgp_ref[...] = dgp + r_gp
    dg_ref[...] = dg + r_g + cont * jnp.sum(do_h * qf, axis=1)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dx_ref[...] = dx.astype(dx_ref.dtype)


def _value_sums_init(chunk):
    """Zeros for the value-column sums of one chunk: −dR Pᵀ, dO Pᵀ ``[C, C]`` and ``Σ_v dR ⊙ Y`` ``[C]``."""
    return jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk,), F32)


def _value_block_grads(x, y, do, h, dh, tinv, scores, eta, cont_p, w_last, precision, lo):
    """One block of value columns of the chunk gradients: ``P = T(η ⊙ (Y − c⁻ ⊙ X h))``,
    ``dR = Tᵀ((QXᵀ⊙D)ᵀ dO + w ⊙ X dh)`` and the block's terms of the sums in :func:`_value_sums_init`.
    y, do fp32; x, h, dh in the inputs' dtype or fp32 (see :func:`_in_dot`)."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    target = y - cont_p[:, None] * _in_dot(x, h, precision, p32)
    P = _tdot(tinv, eta[:, None] * target, p32)
    dP = _sdot(scores.T, do, p32, lo) + w_last[:, None] * _in_dot(x, dh, precision, p32)
    dR = _tdot(tinv.T, dP, p32)
    return P, dR, _value_block_terms(do, P, dR, y, p32, lo)


def _store_value_sums(refs, sums):
    """Write the value half's sums (:func:`_value_sums_init`) for the key half's program."""
    for ref, value in zip(refs, sums):
        ref[...] = value


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


def _in_dot(a, b, precision, p32):
    """``a @ b`` for an input-dtype ``a`` and a stored state ``b``: on the inputs' dtype when b is stored in it
    (exact), else in fp32 at ``p32``."""
    if a.dtype == b.dtype:
        return dot(a, b, precision)
    return dot(a.astype(F32), b.astype(F32), p32)


def _chunk_grad_values_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, do_ref, h_ref, dh_ref,
                              dy_ref, p_ref, dr_ref, da_ref, dop_ref, dey_ref, *, chunk, block_v, precision, lo=None):
    """First half of the split chunk gradients: everything summed over the value columns, which are visited in
    blocks of ``block_v`` — ``dy``, ``P`` and ``dR`` (stored for the second half), ``dA = −dR Pᵀ`` and
    ``dO Pᵀ`` (``[C, C]``), and the row sum ``Σ_v dR ⊙ Y``.  Four ``[C, C]``
    fp32 tiles live (scores, T and the two sums), none ``[C, dk]``."""
    q, x = q_ref[...], x_ref[...]
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    cont, cont_p, w_last, a_last = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    del cont, a_last
    tinv = t_ref[...]
    scores = _masked_scores(q, x, g, rl, precision)
    sums = _value_sums_init(chunk)
    for j in range(y_ref.shape[-1] // block_v):  # static: a few blocks
        cols = pl.ds(j * block_v, block_v)
        y, do = y_ref[:, cols].astype(F32), do_ref[:, cols].astype(F32)
        P, dR, terms = _value_block_grads(x, y, do, h_ref[:, cols], dh_ref[:, cols], tinv, scores, eta, cont_p,
                                          w_last, precision, lo)
        sums = tuple(acc + t for acc, t in zip(sums, terms))
        dy_ref[:, cols] = (eta[:, None] * dR).astype(dy_ref.dtype)
        p_ref[:, cols] = P.astype(p_ref.dtype)
        dr_ref[:, cols] = dR.astype(dr_ref.dtype)
    _store_value_sums((da_ref, dop_ref, dey_ref), sums)


def _stored_value_sums(y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, p_ref, dr_ref, dy_ref, *, chunk, block_v,
                       precision, lo, loops="unrolled"):
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

    return column_loop(y_ref.shape[-1] // block_v, value_block, _value_sums_init(chunk), loops), rows


def _row_gates(eta_ref, g_ref, gp_ref, rl_ref, chunk):
    """One chunk's gate rows: (eta, g, gp, rl, cont, cont_p, w_last, a_last) (see :func:`_gates`)."""
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    return (eta, g, gp, rl, *_gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1]))


def _key_grads(q_ref, x_ref, do_ref, h_ref, dh_ref, p_ref, dr_ref, sums, rows, out_refs, *, chunk, block_k, precision,
               group, lo, loops="unrolled"):
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
    q_do_h, d_xh, d_wl, h_dh = column_loop(q.shape[-1] // block_k, key_block, (row, row, row, jnp.zeros((), F32)),
                                           loops)
    r_eta, r_gp, r_g = _state_row_grads(d_xh, d_wl, h_dh, eta, cont_p, w_last, a_last, chunk)
    deta_ref[...] = deta + r_eta
    dgp_ref[...] = dgp + r_gp
    dg_ref[...] = dg + r_g + cont * q_do_h


def _chunk_grad_keys_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, h_ref, dh_ref, p_ref, dr_ref, da_ref,
                            dop_ref, dey_ref, *out_refs, chunk, block_k, precision, group, lo=None, loops="unrolled",
                            key_shift=False, key_pad=0):
    """Second half of the split chunk gradients (:func:`_key_grads`) from the first half's stored sums."""
    _key_grads(q_ref, _chunk_keys(x_ref, key_shift, key_pad, chunk), do_ref, h_ref, dh_ref, p_ref, dr_ref,
               (da_ref[...], dop_ref[...], dey_ref[...]),
               _row_gates(eta_ref, g_ref, gp_ref, rl_ref, chunk), out_refs, chunk=chunk, block_k=block_k,
               precision=precision, group=group, lo=lo, loops=loops)


def _chunk_grad_stored_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, h_ref, dh_ref, p_ref, dr_ref,
                              dy_ref, *out_refs, chunk, block_v, block_k, precision, group, lo=None, loops="unrolled",
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
                                    lo=lo, loops=loops)
    _key_grads(q_ref, _chunk_keys(x_ref, key_shift, key_pad, chunk), do_ref, h_ref, dh_ref, p_ref, dr_ref, sums, rows,
               out_refs, chunk=chunk, block_k=block_k, precision=precision, group=group, lo=lo, loops=loops)
    if dy_last:
        if barrier:
            pltriton.debug_barrier()
        dy_ref[...] = (eta_ref[...][:, None] * dr_ref[...].astype(F32)).astype(dy_ref.dtype)


def _chunk_grad_stored_values_kernel(y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, p_ref, dr_ref, dy_ref, *sum_refs,
                                     chunk, block_v, precision, lo=None, loops="unrolled"):
    """The value half of :func:`_chunk_grad_stored_kernel` as its own program: dy and the value sums, stored
    (two ``[C, C]`` fp32 tiles and a row per chunk) for :func:`_chunk_grad_keys_kernel`."""
    sums, _ = _stored_value_sums(y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, p_ref, dr_ref, dy_ref, chunk=chunk,
                                 block_v=block_v, precision=precision, lo=lo, loops=loops)
    _store_value_sums(sum_refs, sums)


def _prepare_kernel(x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, w_ref, u_ref, *, chunk, precision):
    """One chunk's ``W = T (η c⁻ ⊙ X)`` and ``U = T (η ⊙ Y)``, so that ``P = U − W S_0`` (the split forward).
    (Forming T here instead of reading it was slower on the H200: 0.48 vs 0.13 + 0.24 ms at 8x2048x16x128.)"""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    _, cont_p, _, _ = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    tinv = t_ref[...]
    w_ref[...] = _tdot(tinv, (eta * cont_p)[:, None] * x_ref[...].astype(F32), p32).astype(w_ref.dtype)
    u_ref[...] = _tdot(tinv, eta[:, None] * y_ref[...].astype(F32), p32).astype(u_ref.dtype)


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


def _state_grad_prepare_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, do_ref, v_ref, *out_refs, chunk,
                               precision, with_b=True, lo=None, key_shift=False, key_pad=0):
    """One chunk's ``V = Tᵀ (Q Xᵀ ⊙ D)ᵀ dO``, (``with_b``) ``B = Tᵀ (w ⊙ X)``, so that the reverse walk's
    ``dR = V + B dS`` (the split state-gradient walk), and (a last output, if any) the walk's ``(c ⊙ Q)ᵀ dO``
    ``[dk, dv]`` (its operands rounded to ``lo`` as the walk would)."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    refs = list(out_refs)
    b_ref = refs.pop(0) if with_b else None
    eta, g, gp, rl = eta_ref[...], g_ref[...], gp_ref[...], rl_ref[...]
    cont, _, w_last, _ = _gates(eta, g, gp, rl, g_ref[chunk - 1], rl_ref[chunk - 1])
    q, x = q_ref[...], _chunk_keys(x_ref, key_shift, key_pad, chunk)[...]
    do = do_ref[...].astype(F32)
    tinv_t = t_ref[...].T
    scores = _masked_scores(q, x, g, rl, precision)
    v_ref[...] = _tdot(tinv_t, dot(scores.T, do, p32), p32).astype(v_ref.dtype)
    if b_ref is not None:
        b_ref[...] = _tdot(tinv_t, w_last[:, None] * x.astype(F32), p32).astype(b_ref.dtype)
    for q_term_ref in refs:
        q_term_ref[...] = _sdot(q.T, cont[:, None] * do, p32, lo).astype(q_term_ref.dtype)


def _state_grad_split_kernel(q_ref, x_ref, eta_ref, g_ref, gp_ref, rl_ref, v_ref, b_ref, do_ref, ds_end_ref, *refs,
                             chunk, n_chunks, write_dh, precision, lo=None, write_dr=False, b_from_t=False,
                             q_term=False, key_shift=False, key_pad=0):
    """The split reverse walk: ``dR = V + B dS`` — three dots per chunk (the fused walk's six include
    recomputing the scores and applying Tᵀ).  ``b_from_t``: ``b_ref`` holds the chunk's T instead of B, and
    ``B dS = Tᵀ (w ⊙ X dS)`` is formed here (one more dot in the chain; a ``[C, C]`` tile read instead of
    ``[C, dk]``, and no B buffer).  ``q_term``: the first of ``refs`` holds every chunk's ``(c ⊙ Q)ᵀ dO`` (the
    buffer dh is written to), the rest are the outputs."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    q_term_ref, out_refs = (refs[0], refs[1:]) if q_term else (None, refs)

    def residual_grad(rows, q, x, do, g, rl, w_last, dS):
        if b_from_t:
            b_ds = _tdot(b_ref[rows, :].T, w_last[:, None] * _sdot(x, dS, p32, lo), p32)
        else:
            b_ds = _sdot(b_ref[rows, :], dS, p32, lo)
        return v_ref[rows, :].astype(F32) + b_ds

    _reverse_walk(q_ref, _keys(x_ref, key_shift, key_pad), (eta_ref, g_ref, gp_ref, rl_ref), do_ref, ds_end_ref,
                  out_refs, chunk=chunk, n_chunks=n_chunks, write_dh=write_dh, precision=precision, lo=lo,
                  residual_grad=residual_grad, write_dr=write_dr, q_term_ref=q_term_ref)


def _params(interpret, num_warps, num_stages):
    return None if interpret else triton_params(num_warps, num_stages)


def _key_spec(sp, x, key_shift, heads):
    """x's block in a (batch·head, chunk) grid: the chunk's rows (``sp.k``), or with ``key_shift`` (x holds the
    keys, read one row back in place: :class:`_KeysOneRowBack`) the batch·head's whole sequence."""
    if not key_shift:
        return sp.k
    _, L, dk = token_dims(x, heads)
    return row_block(heads, L, dk, lambda b, c: (b, 0, 0))


def _key_operand(x, key_shift, interpret):
    """``(the array a pass's kernel reads x from, the kernel's keywords)``: x and none; with ``key_shift``
    (:class:`_KeysOneRowBack`) the keywords, and in interpret mode x with a NaN row in front, the view's ``pad``
    (time is axis 1 in either layout)."""
    if not key_shift:
        return x, {}
    pad = int(bool(interpret))
    if pad:
        x = jnp.concatenate([jnp.full_like(x[:, :1], jnp.nan), x], axis=1)
    return x, {"key_shift": True, "key_pad": pad}


def _one_piece(key_shift, pieces, name):
    if key_shift and pieces != 1:
        raise ValueError(f"{name}: key_shift (keys read one row back in place) walks one piece, got pieces={pieces}")


def tri_inverse_pass(x, eta, g, gp, rl, *, chunk, interpret, num_warps=4, num_stages=1, group=1, heads=None,
                     t_dtype=F32, key_shift=False, elimination="columns"):
    """``T = (I + A)⁻¹`` of every chunk: ``[BH, L, C]`` in ``t_dtype`` (row cC+s = row s of chunk c's T; solved
    in fp32, rounded once when stored).

    ``group > 1``: A couples only rows of earlier groups (the windowed rule's virtual writes).
    ``heads=H``: x is ``[B, L, H, dk]``, read in place (``common.row_block``).  ``key_shift``: x holds the keys,
    and row t's write feature is ``x[t − 1]`` (zero at t = 0), read in place (:class:`_KeysOneRowBack`; the
    other passes take the same flag).  ``elimination``: see :func:`_unit_lower_inverses`."""
    BH, L, dk = token_dims(x, heads)
    sp = chunk_specs(x, dk, chunk, heads)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    kernel = functools.partial(_tri_kernel, chunk=chunk, precision=precision_for(x.dtype), group=group,
                               elimination=elimination, **key_kw)
    (tinv,) = call(kernel, grid=(BH, L // chunk), in_specs=[_key_spec(sp, x, key_shift, heads), sp.row, sp.row,
                                                             sp.row, sp.row],
                   out_specs=[sp.square],
                   out_shape=[jax.ShapeDtypeStruct((BH, L, chunk), t_dtype)],
                   args=(keys, eta, g, gp, rl),
                   compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                   name="falcon_delta_tri_inverse")
    return tinv


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


def _reverse_walk_outputs(q, do, specs, shapes, *, chunk, pieces, block_v, write_dh, write_dr, heads):
    """``write_dr``: None or the dtype dR is stored in, shaped like dO (the tokens' layout, so that the chunk
    gradients can write dy over it)."""
    first = [(specs.rows_v, jax.ShapeDtypeStruct(do.shape, write_dr))] if write_dr is not None else ()
    return walk_outputs(specs, shapes, write_dh, first=first)


def state_grad_pass(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret,
                    num_warps=4, num_stages=2, heads=None, walk_operands=None, write_dr=None):
    """Reverse chunk walk. ds_end [BH, P, dk, dv] gradient at each piece's end.

    Returns (dR shaped like do, the residuals' gradient, if write_dr (None, or the dtype to store it in),
    dh [BH, n_chunks, dk, dv] gradient w.r.t. each chunk's end state if write_dh, ds_start [BH, P, dk, dv]).
    """
    grid, n, specs, shapes = walk_layout(q, do, chunk, pieces, block_v, heads=heads)
    Lp = n * chunk
    t_spec = pl.BlockSpec((None, Lp, chunk), lambda b, p, v: (b, p, 0))
    in_specs = [specs.rows_k, specs.rows_k, specs.gate, specs.gate, specs.gate, specs.gate, t_spec, specs.rows_v,
                specs.piece_state]
    out_specs, out_shape = _reverse_walk_outputs(q, do, specs, shapes, chunk=chunk, pieces=pieces, block_v=block_v,
                                                 write_dh=write_dh, write_dr=write_dr, heads=heads)
    kernel = functools.partial(_state_grad_kernel, chunk=chunk, n_chunks=n, write_dh=write_dh,
                               precision=precision_for(q.dtype), lo=walk_operands, write_dr=write_dr is not None)
    return call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                args=(q, x, eta, g, gp, rl, tinv, do, ds_end),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_dstate")


def prepare_vb(q, x, eta, g, gp, rl, tinv, do, *, chunk, interpret, num_warps=4, heads=None, b_dtype=F32,
               v_dtype=F32, with_b=True, q_term_dtype=None, walk_operands=None, key_shift=False):
    """Every chunk's ``V = Tᵀ (Q Xᵀ ⊙ D)ᵀ dO`` shaped like dO (in ``v_dtype``) and ``B = Tᵀ (w ⊙ X)``
    ``[BH, L, dk]`` (in ``b_dtype``; None without ``with_b``): the reverse walk's ``dR = V + B dS``; with a
    ``q_term_dtype``, also the walk's ``(c ⊙ Q)ᵀ dO`` per chunk ``[BH, n_chunks, dk, dv]`` (its operands rounded
    to ``walk_operands`` as in the walk), else None.  Returns ``(V, B, q_term)``."""
    BH, L, dk = token_dims(q, heads)
    dv = do.shape[-1]
    sp = chunk_specs(q, dv, chunk, heads)
    out_specs, out_shape = [sp.v], [jax.ShapeDtypeStruct(do.shape, v_dtype)]  # like dO: dR is written over it
    if with_b:
        out_specs.append(sp.flat_k)
        out_shape.append(jax.ShapeDtypeStruct((BH, L, dk), b_dtype))
    if q_term_dtype is not None:
        out_specs.append(sp.state)
        out_shape.append(jax.ShapeDtypeStruct((BH, L // chunk, dk, dv), q_term_dtype))
    keys, key_kw = _key_operand(x, key_shift, interpret)
    outs = list(call(functools.partial(_state_grad_prepare_kernel, chunk=chunk, precision=precision_for(q.dtype),
                                       with_b=with_b, lo=walk_operands, **key_kw),
                     grid=(BH, L // chunk), in_specs=[sp.k, _key_spec(sp, x, key_shift, heads), sp.row, sp.row, sp.row,
                                                      sp.row, sp.square, sp.v],
                     out_specs=out_specs, out_shape=out_shape,
                     args=(q, keys, eta, g, gp, rl, tinv, do),
                     compiler_params=_params(interpret, num_warps, 1), interpret=interpret,
                     name="falcon_delta_dstate_prepare"))
    v = outs.pop(0)
    b = outs.pop(0) if with_b else None
    return v, b, (outs[0] if outs else None)


def state_grad_split_pass(q, x, eta, g, gp, rl, tinv, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret,
                          num_warps=4, num_stages=2, heads=None, walk_operands=None, vb=None, write_dr=None,
                          b_from_t=False, key_shift=False):
    """:func:`state_grad_pass` split as the forward is by ``split_forward``: ``V`` and ``B`` per chunk in parallel
    (:func:`prepare_vb`, or given as ``vb``), then a reverse walk of three dots per chunk; ``b_from_t``: no B
    (``vb``'s is None), the walk forms ``B dS = Tᵀ (w ⊙ X dS)`` from T.  A ``vb`` with a q-term (its third
    entry, :func:`prepare_vb` with ``q_term_dtype`` = dh's dtype): the walk adds it instead of forming
    ``(c ⊙ Q)ᵀ dO`` and writes dh over it (one piece, ``write_dh`` only).
    Same arguments and returns as :func:`state_grad_pass`."""
    dk = token_dims(q, heads)[2]
    if vb is None:
        vb = prepare_vb(q, x, eta, g, gp, rl, tinv, do, chunk=chunk, interpret=interpret, num_warps=num_warps,
                        heads=heads, b_dtype=walk_operands or F32, with_b=not b_from_t, key_shift=key_shift)
    v, b, q_term = vb
    _one_piece(key_shift, pieces, "state_grad_split_pass")
    grid, n_piece, specs, shapes = walk_layout(q, do, chunk, pieces, block_v, heads=heads)
    Lp = n_piece * chunk
    in_specs = [specs.rows_k, specs.rows_k, specs.gate, specs.gate, specs.gate, specs.gate,
                specs.rows_v,
                pl.BlockSpec((None, Lp, chunk if b_from_t else dk), lambda i, p, j: (i, p, 0)), specs.rows_v,
                specs.piece_state]
    out_specs, out_shape = _reverse_walk_outputs(q, do, specs, shapes, chunk=chunk, pieces=pieces, block_v=block_v,
                                                 write_dh=write_dh, write_dr=write_dr, heads=heads)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    args = [q, keys, eta, g, gp, rl, v, tinv if b_from_t else b, do, ds_end]
    # dR is written over V (same shape and blocks; each chunk's dR rows are formed from its V rows, read by the
    # same program first), so the two never take memory side by side (XLA copies V first if something reads it
    # later)
    aliases = {6: 0} if write_dr is not None and jnp.dtype(write_dr) == v.dtype else {}
    if q_term is not None:
        if pieces != 1 or not write_dh or q_term.dtype != shapes.chunk_states.dtype:
            raise ValueError("state_grad_split_pass: a prepared q-term needs one piece, write_dh and dh's dtype "
                             f"{shapes.chunk_states.dtype} (got pieces={pieces}, write_dh={write_dh}, "
                             f"{q_term.dtype})")
        in_specs.append(specs.chunk_states)
        aliases[len(args)] = int(write_dr is not None)  # the q-term's buffer becomes dh
        args.append(q_term)
    kernel = functools.partial(_state_grad_split_kernel, chunk=chunk, n_chunks=n_piece, write_dh=write_dh,
                               precision=precision_for(q.dtype), lo=walk_operands, write_dr=write_dr is not None,
                               b_from_t=b_from_t, q_term=q_term is not None, **key_kw)
    return call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, args=tuple(args),
                aliases=aliases, compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_dstate_walk")


def chunk_grad_pass(q, x, y, eta, g, gp, rl, tinv, do, h, dh, *, chunk, block_v, interpret, num_warps=4,
                    num_stages=1, group=1, heads=None):
    """Per-chunk gradients. h, dh [BH, n_chunks, dk, dv].

    Returns dq, dx, dy (in the layout of q, x, y: [BH, L, d], or [B, L, H, d] with ``heads=H``), and
    fp32 [BH, L]: deta, dg (w.r.t. the chunk-local inclusive cumsum g) and dgp (w.r.t. the exclusive one).
    """
    BH, L, _ = token_dims(q, heads)
    sp = chunk_specs(q, y.shape[-1], chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    kernel = functools.partial(_chunk_grad_kernel, chunk=chunk, block_v=block_v, precision=precision_for(q.dtype),
                               group=group)
    return call(kernel, grid=(BH, L // chunk),
                in_specs=[sp.k, sp.k, sp.v, sp.row, sp.row, sp.row, sp.row, sp.square, sp.v, sp.state, sp.state],
                out_specs=[sp.k, sp.k, sp.v, sp.row, sp.row, sp.row],
                out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype),
                           jax.ShapeDtypeStruct(y.shape, y.dtype), vec, vec, vec],
                args=(q, x, y, eta, g, gp, rl, tinv, do, h, dh),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_chunk_grads")


def chunk_grad_values(q, x, y, eta, g, gp, rl, tinv, do, h, dh, *, chunk, block_v, interpret, num_warps=4,
                      num_stages=1, heads=None, walk_operands=None):
    """The value half of :func:`chunk_grad_split_pass`: returns ``dy`` (like y) and the sums the key half
    reads — ``P`` and ``dR`` (shaped like y, in ``walk_operands`` or fp32), ``−dR Pᵀ``, ``dO Pᵀ`` ``[BH, L, C]``
    fp32 and the fp32 row sum ``Σ_v dR ⊙ Y`` ``[BH, L]``."""
    BH, L, _ = token_dims(q, heads)
    dv = y.shape[-1]
    sp = chunk_specs(q, dv, chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    sq = jax.ShapeDtypeStruct((BH, L, chunk), F32)
    p = jax.ShapeDtypeStruct(y.shape, walk_operands or F32)  # like y (see _dx_over_p)
    dr = jax.ShapeDtypeStruct(y.shape, walk_operands or F32)
    values = functools.partial(_chunk_grad_values_kernel, chunk=chunk, block_v=block_v,
                               precision=precision_for(q.dtype), lo=walk_operands)
    dy, *sums = call(
        values, grid=(BH, L // chunk),
        in_specs=[sp.k, sp.k, sp.v, sp.row, sp.row, sp.row, sp.row, sp.square, sp.v, sp.state, sp.state],
        out_specs=[sp.v, sp.v, sp.v, sp.square, sp.square, sp.row],
        out_shape=[jax.ShapeDtypeStruct(y.shape, y.dtype), p, dr, sq, sq, vec],
        args=(q, x, y, eta, g, gp, rl, tinv, do, h, dh), compiler_params=_params(interpret, num_warps, num_stages),
        interpret=interpret, name="falcon_delta_chunk_grads_values")
    return dy, tuple(sums)


def chunk_grad_keys(q, x, eta, g, gp, rl, do, h, dh, sums, *, chunk, interpret, num_warps=4, num_stages=1, group=1,
                    heads=None, walk_operands=None, block_k=32, loops="unrolled", key_shift=False):
    """The key half of :func:`chunk_grad_split_pass` from the value half's ``sums``: dq, dx (like q, x) by
    blocks of ``block_k`` key columns, and fp32 dη, dg, dgp ``[BH, L]``."""
    BH, L, dk = token_dims(q, heads)
    sp = chunk_specs(q, do.shape[-1], chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    kernel = functools.partial(_chunk_grad_keys_kernel, chunk=chunk, block_k=min(block_k, dk),
                               precision=precision_for(q.dtype), group=group, lo=walk_operands, loops=loops, **key_kw)
    return call(
        kernel, grid=(BH, L // chunk),
        in_specs=[sp.k, _key_spec(sp, x, key_shift, heads), sp.row, sp.row, sp.row, sp.row, sp.v, sp.state, sp.state,
                  sp.v, sp.v,
                  sp.square, sp.square, sp.row],
        out_specs=[sp.k, sp.k, sp.row, sp.row, sp.row],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype), vec, vec, vec],
        args=(q, keys, eta, g, gp, rl, do, h, dh, *sums), aliases=_dx_over_p(sums[0], x, 9, 1),
        compiler_params=_params(interpret, num_warps, num_stages),
        interpret=interpret, name="falcon_delta_chunk_grads_keys")


def chunk_grad_split_pass(q, x, y, eta, g, gp, rl, tinv, do, h, dh, *, chunk, block_v, interpret, num_warps=4,
                          num_stages=1, group=1, heads=None, walk_operands=None, block_k=32):
    """:func:`chunk_grad_pass` as two programs per chunk, so that neither holds ``[C, dk]`` fp32 accumulators
    next to its ``[C, C]`` tiles: the value half (:func:`chunk_grad_values`: ``dy``, ``P``, ``dR``, ``−dR Pᵀ``,
    ``dO Pᵀ`` and row sums, over value blocks of ``block_v``), then the key half (:func:`chunk_grad_keys`: dq, dx
    over key blocks of ``block_k``; dη, dg, dgp).  ``P`` and ``dR`` pass between them in ``walk_operands`` (the
    dtype their dots round them to) or fp32.  Same arguments and returns as :func:`chunk_grad_pass`."""
    kw = dict(chunk=chunk, interpret=interpret, num_warps=num_warps, num_stages=num_stages, heads=heads,
              walk_operands=walk_operands)
    dy, sums = chunk_grad_values(q, x, y, eta, g, gp, rl, tinv, do, h, dh, block_v=block_v, **kw)
    dq, dx, deta, dg, dgp = chunk_grad_keys(q, x, eta, g, gp, rl, do, h, dh, sums, group=group, block_k=block_k, **kw)
    return dq, dx, dy, deta, dg, dgp


def _dx_over_p(p, x, p_index, dx_index):
    """``aliases`` that write a chunk-gradient kernel's dx over the stored ``P`` where they share shape and dtype
    (``dk = dv``; P is kept in the tokens' layout for this): one fewer ``[B, T, H, d]`` buffer at the
    backward's peak.  Safe without a barrier: a program reads only its chunk's P rows, and every dx it stores
    depends on all of them (``P dhᵀ`` of the full tile; the value sums), so each P load precedes the first
    dx store.  XLA copies P first if anything else still reads it."""
    return {p_index: dx_index} if p.shape == x.shape and p.dtype == x.dtype else {}


def chunk_grad_stored_pass(q, x, y, eta, g, gp, rl, do, h, dh, p, dr, *, chunk, block_v, interpret, num_warps=4,
                           num_stages=1, group=1, heads=None, walk_operands=None, block_k=32, loops="unrolled",
                           key_shift=False):
    """The chunk gradients from the ``P`` and ``dR`` (both like y) the walks stored
    (``forward_pass(write_p=True)``, ``state_grad_*pass(write_dr=dtype)``), one program per chunk: the value
    sums of :func:`chunk_grad_values` without T, the scores or the chunk state, then :func:`chunk_grad_keys`' key
    columns.  Same returns as :func:`chunk_grad_pass`.  ``loops``: the column-block loops unrolled or as
    ``lax.fori_loop`` (``common.column_loop``)."""
    BH, L, dk = token_dims(q, heads)
    sp = chunk_specs(q, y.shape[-1], chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    # dy over dR where they share shape and dtype (the tokens' layout; bf16 dR for bf16 inputs), dx over P: the
    # backward's peak then holds neither output apart from the buffers the walks stored
    dy_last = dr.shape == y.shape and dr.dtype == y.dtype
    aliases = {**_dx_over_p(p, x, 10, 2), **({11: 0} if dy_last else {})}
    kernel = functools.partial(_chunk_grad_stored_kernel, chunk=chunk, block_v=block_v, block_k=min(block_k, dk),
                               precision=precision_for(q.dtype), group=group, lo=walk_operands, loops=loops,
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
        name="falcon_delta_chunk_grads_stored")
    return dq, dx, dy, deta, dg, dgp


def chunk_grad_stored_split_pass(q, x, y, eta, g, gp, rl, do, h, dh, p, dr, *, chunk, block_v, interpret,
                                 num_warps=4, num_stages=1, group=1, heads=None, walk_operands=None, block_k=32,
                                 loops="unrolled", key_shift=False):
    """:func:`chunk_grad_stored_pass` as two programs per chunk: the value sums from the stored ``P``, ``dR``
    (``dy``; ``−dR Pᵀ``, ``dO Pᵀ`` ``[BH, L, C]`` and a row, fp32), then :func:`chunk_grad_keys`.  Fewer live
    tiles per program than the fused kernel, for one more round trip of the sums.  Same arguments and returns."""
    BH, L, _ = token_dims(q, heads)
    sp = chunk_specs(q, y.shape[-1], chunk, heads)
    vec = jax.ShapeDtypeStruct((BH, L), F32)
    sq = jax.ShapeDtypeStruct((BH, L, chunk), F32)
    values = functools.partial(_chunk_grad_stored_values_kernel, chunk=chunk, block_v=block_v,
                               precision=precision_for(q.dtype), lo=walk_operands, loops=loops)
    dy, *sums = call(
        values, grid=(BH, L // chunk),
        in_specs=[sp.v, sp.row, sp.row, sp.row, sp.row, sp.v, sp.v, sp.v],
        out_specs=[sp.v, sp.square, sp.square, sp.row],
        out_shape=[jax.ShapeDtypeStruct(y.shape, y.dtype), sq, sq, vec],
        args=(y, eta, g, gp, rl, do, p, dr), compiler_params=_params(interpret, num_warps, num_stages),
        interpret=interpret, name="falcon_delta_chunk_grads_stored_values")
    dq, dx, deta, dg, dgp = chunk_grad_keys(q, x, eta, g, gp, rl, do, h, dh, (p, dr, *sums), chunk=chunk,
                                            interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                                            group=group, heads=heads, walk_operands=walk_operands, block_k=block_k,
                                            loops=loops, key_shift=key_shift)
    return dq, dx, dy, deta, dg, dgp
