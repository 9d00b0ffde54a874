"""GPU kernels (Pallas, Triton lowering) for the decayed delta rule with per-column gates (Falcon-2); Falcon-2A
has its own (:mod:`.triton_attention`).

Layout: ``q, x [BH, L, dk]``, ``y [BH, L, dv]``; gates ``eta, g, gp [BH, L, dv]`` (one write weight and one
chunk-local log-decay cumsum per value column, ``gp = g − log γ``), ``rl [BH, L]`` the chunk-local run index.

Value columns are independent given the Gram ``X Xᵀ``: column c of a chunk is the scalar-gate chunk form with
its own gates (masks M⁻ strict lower, M⁺ lower incl., both cut between segments)::

    A_c[s, j] = M⁻ · η_{s,c} (x_s·x_j) e^{gp_{s,c} − g_{j,c}}
    (I + A_c) P[:, c] = η_c ⊙ (Y[:, c] − c⁻_c ⊙ (X S_0)[:, c])
    o[t, c] = c_{t,c} (Q S_0)[t, c] + Σ_{s≤t} M⁺ (q_t·x_s) e^{g_{t,c} − g_{s,c}} P[s, c]
    S_C[:, c] = a_c S_0[:, c] + Xᵀ (w_c ⊙ P[:, c])

A per-column ``(I + A_c)⁻¹`` would be a ``[C, C]`` matrix per column; instead the chunk is solved in 16-row
blocks: a *column-batched forward substitution* inside each diagonal block (:func:`_solve_forward`, rows in
turn, one ``[16, block_v]`` tile of masked exponentials per row), dots between blocks with the decays
renormalized at the earlier block's last row (:func:`_block_solve`).  The decayed read has a different decay per
column, so it is formed in the same blocks.  Only differences ``g_a − g_b`` with ``a ≥ b`` are exponentiated.

* :func:`forward_pass` — one program per (batch·head, value block) walks the chunks with S_0 in registers
  (fp32), writing o, optionally each chunk's start state h, and the end state.  No pieces: a piece's walk is
  affine in its start state with a ``dk × dk`` matrix *per column*, too large to form.
* :func:`backward_pass` — one program per (batch·head, value block) walks the chunks in reverse with the
  end-state gradient dS in registers and, per chunk, recomputes P from h, forms ``dP = (QXᵀ ⊙ D_c)ᵀ dO + w ⊙
  X dS``, solves ``(I + A_c)ᵀ dR = dP`` by backward substitution and writes every gradient of its columns (dy,
  dη, dg, dgp) and its block's share of dq and dx (summed over value blocks in XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import call, dot, precision_for, triton_params

F32 = jnp.float32


def _row(a, r):
    """Row ``r`` of a 2-D tile (dynamic r), as a vector."""
    rows = lax.broadcasted_iota(jnp.int32, a.shape, 0)
    return jnp.sum(jnp.where(rows == r, a, 0.0), axis=0)


def _col(a, r):
    """Column ``r`` of a 2-D tile (dynamic r), as a vector."""
    cols = lax.broadcasted_iota(jnp.int32, a.shape, 1)
    return jnp.sum(jnp.where(cols == r, a, 0.0), axis=1)


def _at(v, r):
    """Element ``r`` of a vector (dynamic r)."""
    idx = lax.broadcasted_iota(jnp.int32, v.shape, 0)
    return jnp.sum(jnp.where(idx == r, v, 0.0))


def _set_row(a, r, row):
    rows = lax.broadcasted_iota(jnp.int32, a.shape, 0)
    return jnp.where(rows == r, row[None, :], a)


def _decay(mask, g_row, g):
    """``exp(g_row[c] − g[j, c])`` where ``mask[j]``, else 0: a ``[C, block_v]`` tile."""
    return jnp.exp(jnp.where(mask[:, None], g_row[None, :] - g, -jnp.inf))


def _decay_from(mask, g, g_col):
    """``exp(g[t, c] − g_col[c])`` where ``mask[t]``, else 0."""
    return jnp.exp(jnp.where(mask[:, None], g - g_col[None, :], -jnp.inf))


def _gates(g, gp, rl, g_last, rl_last):
    """[C, block_v] gates of a chunk (see ``decayed_delta_rule.triton.common._gates``), per column; a_last [block_v]."""
    first = (rl == 0)[:, None]
    cont = jnp.where(first, jnp.exp(g), 0.0)
    cont_p = jnp.where(first, jnp.exp(gp), 0.0)
    w_last = jnp.where((rl == rl_last)[:, None], jnp.exp(g_last[None, :] - g), 0.0)
    a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)
    return cont, cont_p, w_last, a_last


def _solve_forward(gram, R, eta, g, gp, rl, qx=None, sums=False):
    """Column-batched forward substitution ``(I + A_c) P[:, c] = R[:, c]``; with ``qx`` also the intra-chunk
    read ``Σ_{j≤t} qx[t, j] e^{g_t − g_j} P[j]`` (rows formed as their P rows are final).  Returns (P, read or
    None), and with ``sums`` also
    ``Σ_{j<s} gram[s, j] e^{gp_s − g_j} P[j]`` per row (``(A_c P)_s / η_s``, for dη)."""
    C = R.shape[0]
    idx = lax.broadcasted_iota(jnp.int32, (C,), 0)
    zeros = jnp.zeros(R.shape, F32)

    def body(s, carry):
        P, O, SG = carry
        g_s, rl_s = _row(g, s), _at(rl, s)
        same = rl == rl_s
        coef = _row(gram, s)[:, None] * _decay((idx < s) & same, _row(gp, s), g)
        sg = jnp.sum(coef * P, axis=0)
        P = _set_row(P, s, _row(R, s) - _row(eta, s) * sg)
        if sums:
            SG = _set_row(SG, s, sg)
        if qx is not None:
            read = _row(qx, s)[:, None] * _decay((idx <= s) & same, g_s, g)
            O = _set_row(O, s, jnp.sum(read * P, axis=0))
        return P, O, SG

    P, O, SG = lax.fori_loop(0, C, body, (zeros, zeros, zeros))
    return (P, O, SG) if sums else (P, O)


BLOCK = 16  # rows of a diagonal block of the blocked solve (Triton's smallest dot tile)


def _same(rl_a, rl_b):
    """1 where rows of two blocks are in the same segment, else 0: ``[len(rl_a), len(rl_b)]`` fp32."""
    return (rl_a[:, None] == rl_b[None, :]).astype(F32)


def _block_solve(blocks, precision, p32, with_read, sums=False):
    """The chunk's solve (and intra-chunk read) over 16-row ``blocks`` — dicts with x, q, R, eta, g, gp, rl
    and ``g_r`` (g at the block's last row) — in order: serial inside a diagonal block (:func:`_solve_forward`),
    dots between blocks with the decays renormalized at the earlier block's last row r (``e^{g⁻_i − g_r}``,
    ``e^{g_i − g_r}`` and ``e^{g_r − g_k}``, all ≤ 1)::

        R_i −= η_i ⊙ e^{g⁻_i − g_r} ⊙ ((X_i X_kᵀ ⊙ same) (e^{g_r − g_k} ⊙ P_k))
        o_i += e^{g_i − g_r} ⊙ ((Q_i X_kᵀ ⊙ same) (e^{g_r − g_k} ⊙ P_k))

    Adds P (and ``read``, and with ``sums`` ``sg`` as :func:`_solve_forward`) to every block dict."""
    for i, blk in enumerate(blocks):
        x, eta, g, gp, rl = blk["x"], blk["eta"], blk["g"], blk["gp"], blk["rl"]
        R = blk["R"]
        read = jnp.zeros(R.shape, F32)
        sg = jnp.zeros(R.shape, F32)
        for k in range(i):
            earlier = blocks[k]
            same = _same(rl, earlier["rl"])
            z_k = jnp.exp(earlier["g_r"][None, :] - earlier["g"]) * earlier["P"]
            sg = sg + jnp.exp(gp - earlier["g_r"][None, :]) * dot(dot(x, earlier["x"].T, precision) * same, z_k, p32)
            if with_read:
                read = read + jnp.exp(g - earlier["g_r"][None, :]) * dot(
                    dot(blk["q"], earlier["x"].T, precision) * same, z_k, p32)
        gram = dot(x, x.T, precision)
        qx = dot(blk["q"], x.T, precision) if with_read else None
        solved = _solve_forward(gram, R - eta * sg, eta, g, gp, rl, qx=qx, sums=sums)
        blk["P"] = solved[0]
        if with_read:
            blk["read"] = solved[1] + read
        if sums:
            blk["sg"] = sg + solved[2]


def _chunk_blocks(refs, start, chunk, names):
    """The 16-row blocks of the chunk starting at ``start``: per block a dict of the named refs' rows (vectors
    for ``rl``, fp32), the block's rows slice and ``g_r``, g at its last row."""
    blocks = []
    for i in range(chunk // BLOCK):
        rows = pl.ds(start + i * BLOCK, BLOCK)
        blk = {name: refs[name][rows, :] for name in names if name != "rl"}
        blk["rl"] = refs["rl"][rows].astype(F32)
        blk["rows"] = rows
        blk["g_r"] = refs["g"][start + (i + 1) * BLOCK - 1, :]
        blocks.append(blk)
    return blocks


def _forward_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, s0_ref, *out_refs, chunk,
                            n_chunks, write_o, write_h, precision):
    """:func:`_forward_kernel` with the chunk cut into 16-row blocks (``KernelConfig(column_solve="blocked")``,
    :func:`_block_solve`): the substitution and the read stay serial only inside a diagonal block."""
    refs = list(out_refs)
    o_ref = refs.pop(0) if write_o else None
    h_ref = refs.pop(0) if write_h else None
    (s_end_ref,) = refs
    p32 = lax.Precision.HIGHEST if precision is not None else None
    named = dict(q=q_ref, x=x_ref, y=y_ref, eta=eta_ref, g=g_ref, gp=gp_ref, rl=rl_ref)

    def body(c, S):
        start = pl.multiple_of(c * chunk, chunk)
        g_last, rl_last = g_ref[start + chunk - 1, :], rl_ref[start + chunk - 1].astype(F32)
        a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)
        if write_h:
            h_ref[c, :, :] = S
        blocks = _chunk_blocks(named, start, chunk, ("q", "x", "y", "eta", "g", "gp", "rl") if write_o
                               else ("x", "y", "eta", "g", "gp", "rl"))
        for blk in blocks:
            blk["cont"], cont_p, blk["w_last"], _ = _gates(blk["g"], blk["gp"], blk["rl"], g_last, rl_last)
            y = blk["y"].astype(F32) - cont_p * dot(blk["x"].astype(F32), S, p32)
            blk["R"] = blk["eta"] * y
        _block_solve(blocks, precision, p32, with_read=write_o)
        S_new = a_last[None, :] * S
        for blk in blocks:
            if write_o:
                o = blk["read"] + blk["cont"] * dot(blk["q"].astype(F32), S, p32)
                o_ref[blk["rows"], :] = o.astype(o_ref.dtype)
            S_new = S_new + dot(blk["x"].astype(F32).T, blk["w_last"] * blk["P"], p32)
        return S_new

    s_end_ref[...] = lax.fori_loop(0, n_chunks, body, s0_ref[...].astype(F32))


def _backward_kernel(q_ref, x_ref, y_ref, eta_ref, g_ref, gp_ref, rl_ref, do_ref, h_ref, ds_end_ref,
                             dq_ref, dx_ref, dy_ref, deta_ref, dg_ref, dgp_ref, ds_start_ref, *, chunk, n_chunks,
                             precision):
    """:func:`_backward_kernel` in 16-row blocks (``KernelConfig(column_solve="blocked")``): P and the intra-chunk
    read by :func:`_block_solve`; the transposed read ``dP = (QXᵀ ⊙ D)ᵀ dO + w ⊙ X dS``, the transposed solve
    ``(I + A_c)ᵀ dR = dP`` and the row-mixing gradients ``d(QXᵀ)``, ``d(XXᵀ)`` serial inside diagonal blocks and
    dots between blocks (decays renormalized at the earlier block's last row); the decay gradients without a
    pairwise loop, per column: ``Σ_j dA[r, j] A[r, j] = −dR_r (R_r − P_r)``,
    ``Σ_r dA[r, j] A[r, j] = −P_j (dP_j − dR_j)``, and the read's ``dO_t ō_t`` and ``−P_s (QXᵀ ⊙ D)ᵀ dO)_s``."""
    p32 = lax.Precision.HIGHEST if precision is not None else None
    named = dict(q=q_ref, x=x_ref, y=y_ref, eta=eta_ref, g=g_ref, gp=gp_ref, rl=rl_ref, do=do_ref)
    idx = lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)

    def body(i_rev, dS):
        c = n_chunks - 1 - i_rev
        start = pl.multiple_of(c * chunk, chunk)
        g_last, rl_last = g_ref[start + chunk - 1, :], rl_ref[start + chunk - 1].astype(F32)
        a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)
        h = h_ref[c, :, :]
        blocks = _chunk_blocks(named, start, chunk, ("q", "x", "y", "eta", "g", "gp", "rl", "do"))
        for blk in blocks:
            blk["cont"], cont_p, blk["w_last"], _ = _gates(blk["g"], blk["gp"], blk["rl"], g_last, rl_last)
            blk["xf"], blk["qf"], blk["do"] = blk["x"].astype(F32), blk["q"].astype(F32), blk["do"].astype(F32)
            blk["xh"] = dot(blk["xf"], h, p32)
            blk["target"] = blk["y"].astype(F32) - cont_p * blk["xh"]
            blk["edr_scale"] = blk["eta"] * cont_p
            blk["R"] = blk["eta"] * blk["target"]
            blk["xds"] = dot(blk["xf"], dS, p32)
        _block_solve(blocks, precision, p32, with_read=True, sums=True)
        nb = len(blocks)
        # the transposed read dPr[s] = Σ_{t≥s} qx[t, s] e^{g_t − g_s} dO[t], last block first
        for k in range(nb - 1, -1, -1):
            blk = blocks[k]
            g, rl, do = blk["g"], blk["rl"], blk["do"]
            qx = dot(blk["q"], blk["x"].T, precision)

            def grad_p(s, dPr, qx=qx, g=g, rl=rl, do=do):
                read = _col(qx, s)[:, None] * _decay_from((idx >= s) & (rl == _at(rl, s)), g, _row(g, s))
                return _set_row(dPr, s, jnp.sum(read * do, axis=0))

            dPr = lax.fori_loop(0, BLOCK, grad_p, jnp.zeros(do.shape, F32))
            acc = jnp.zeros(do.shape, F32)
            for i in range(k + 1, nb):
                later = blocks[i]
                qx_ik = dot(later["q"], blk["x"].T, precision) * _same(later["rl"], rl)
                acc = acc + dot(qx_ik.T, jnp.exp(later["g"] - blk["g_r"][None, :]) * later["do"], p32)
            blk["dPr"] = dPr + jnp.exp(blk["g_r"][None, :] - g) * acc
            blk["dP"] = blk["dPr"] + blk["w_last"] * blk["xds"]
        # the transposed solve (I + A_c)ᵀ dR = dP, last block first
        for k in range(nb - 1, -1, -1):
            blk = blocks[k]
            eta, g, gp, rl = blk["eta"], blk["g"], blk["gp"], blk["rl"]
            rhs = jnp.zeros(eta.shape, F32)
            for i in range(k + 1, nb):
                later = blocks[i]
                gram_ik = dot(later["x"], blk["x"].T, precision) * _same(later["rl"], rl)
                u = later["eta"] * jnp.exp(later["gp"] - blk["g_r"][None, :]) * later["dR"]
                rhs = rhs + dot(gram_ik.T, u, p32)
            rhs = blk["dP"] - jnp.exp(blk["g_r"][None, :] - g) * rhs
            gram = dot(blk["x"], blk["x"].T, precision)

            def solve_back(j, dR, gram=gram, eta=eta, g=g, gp=gp, rl=rl, rhs=rhs):
                s = BLOCK - 1 - j
                coef = eta * _col(gram, s)[:, None] * _decay_from((idx > s) & (rl == _at(rl, s)), gp, _row(g, s))
                return _set_row(dR, s, _row(rhs, s) - jnp.sum(coef * dR, axis=0))

            blk["dR"] = lax.fori_loop(0, BLOCK, solve_back, jnp.zeros(eta.shape, F32))
        # row-mixing gradients: d(QXᵀ)[t, s] = Σ_c e^{g_t − g_s} P[s] dO[t] (s ≤ t) and
        # d(XXᵀ)[r, j] = −Σ_c η_r dR_r e^{gp_r − g_j} P[j] (j < r), as [16, 16] blocks (a ≥ b)
        d_qx, d_gram = {}, {}
        for a in range(nb):
            blk = blocks[a]
            g, gp, rl, P, do = blk["g"], blk["gp"], blk["rl"], blk["P"], blk["do"]
            edr = blk["eta"] * blk["dR"]

            def cross(r, carry, g=g, gp=gp, rl=rl, P=P, do=do, edr=edr):
                dqx, dgram = carry
                same = rl == _at(rl, r)
                f = _decay((idx <= r) & same, _row(g, r), g) * P * _row(do, r)[None, :]
                dqx = _set_row(dqx, r, jnp.sum(f, axis=1))
                gp_p = _decay((idx < r) & same, _row(gp, r), g) * P
                dgram = _set_row(dgram, r, -jnp.sum(gp_p * _row(edr, r)[None, :], axis=1))
                return dqx, dgram

            zc = jnp.zeros((BLOCK, BLOCK), F32)
            d_qx[a, a], d_gram[a, a] = lax.fori_loop(0, BLOCK, cross, (zc, zc))
            for b in range(a):
                earlier = blocks[b]
                same = _same(rl, earlier["rl"])
                z_b = jnp.exp(earlier["g_r"][None, :] - earlier["g"]) * earlier["P"]
                d_qx[a, b] = dot(jnp.exp(g - earlier["g_r"][None, :]) * do, z_b.T, p32) * same
                d_gram[a, b] = -dot(jnp.exp(gp - earlier["g_r"][None, :]) * edr, z_b.T, p32) * same
        # per block: every gradient of its rows; the state gradient
        ds = a_last[None, :] * dS
        h_ds = jnp.sum(h * dS, axis=0)
        for a in range(nb):
            blk = blocks[a]
            P, dR, dP, do = blk["P"], blk["dR"], blk["dP"], blk["do"]
            cdo = blk["cont"] * do
            wp = blk["w_last"] * P
            dq = dot(cdo, h.T, p32)
            dx = dot(wp, dS.T, p32)
            for b in range(a + 1):
                dq = dq + dot(d_qx[a, b], blocks[b]["xf"], p32)
            for t in range(a, nb):
                dx = dx + dot(d_qx[t, a].T, blocks[t]["qf"], p32)
            dg = (do * blk["read"] - P * blk["dPr"] + cdo * dot(blk["qf"], h, p32) - wp * blk["xds"])
            ds = ds + dot(blk["qf"].T, cdo, p32)
            edr = blk["edr_scale"] * dR
            dx = dx - dot(edr, h.T, p32)
            for b in range(a + 1):
                dx = dx + dot(d_gram[a, b], blocks[b]["xf"], p32)
            for t in range(a, nb):
                dx = dx + dot(d_gram[t, a].T, blocks[t]["xf"], p32)
            dg = dg + P * (dP - dR)
            dgp_ref[blk["rows"], :] = -dR * (blk["R"] - P) - edr * blk["xh"]
            deta_ref[blk["rows"], :] = dR * (blk["target"] - blk["sg"])
            ds = ds - dot(blk["xf"].T, edr, p32)
            if a == nb - 1:  # the chunk end: Σ_s w_s P_s (X dS)_s + a ⟨h, dS⟩ at the last row
                end = a_last * h_ds
                for other in blocks:
                    end = end + jnp.sum(other["w_last"] * other["P"] * other["xds"], axis=0)
                dg = dg + jnp.where((idx == BLOCK - 1)[:, None], end[None, :], 0.0)
            dq_ref[blk["rows"], :] = dq.astype(dq_ref.dtype)
            dx_ref[blk["rows"], :] = dx.astype(dx_ref.dtype)
            dy_ref[blk["rows"], :] = (blk["eta"] * dR).astype(dy_ref.dtype)
            dg_ref[blk["rows"], :] = dg
        return ds

    ds_start_ref[...] = lax.fori_loop(0, n_chunks, body, ds_end_ref[...].astype(F32))


def _params(interpret, num_warps, num_stages):
    return None if interpret else triton_params(num_warps, num_stages)


def _specs(q, y, block_v):
    BH, L, dk = q.shape
    dv = y.shape[-1]
    rows_k = pl.BlockSpec((None, L, dk), lambda b, v: (b, 0, 0))
    rows_v = pl.BlockSpec((None, L, block_v), lambda b, v: (b, 0, v))
    run = pl.BlockSpec((None, L), lambda b, v: (b, 0))
    state = pl.BlockSpec((None, dk, block_v), lambda b, v: (b, 0, v))
    return (BH, dv // block_v), rows_k, rows_v, run, state


def forward_pass(q, x, y, eta, g, gp, rl, s0, *, chunk, block_v, write_o, write_h, interpret, num_warps=4,
                 num_stages=2):
    """Chunk walk for every (batch·head, value block). s0 [BH, dk, dv].

    Returns (o [BH, L, dv] if write_o, h [BH, n_chunks, dk, dv] if write_h, s_end [BH, dk, dv]).
    """
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    grid, rows_k, rows_v, run, state = _specs(q, y, block_v)
    out_shape, out_specs = [], []
    if write_o:
        out_shape.append(jax.ShapeDtypeStruct(y.shape, y.dtype))
        out_specs.append(rows_v)
    if write_h:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), F32))
        out_specs.append(pl.BlockSpec((None, n, dk, block_v), lambda b, v: (b, 0, 0, v)))
    out_shape.append(jax.ShapeDtypeStruct((BH, dk, dv), F32))
    out_specs.append(state)
    kernel = functools.partial(_forward_kernel, chunk=chunk, n_chunks=n,
                               write_o=write_o, write_h=write_h, precision=precision_for(q.dtype))
    return call(kernel, grid=grid, in_specs=[rows_k, rows_k, rows_v, rows_v, rows_v, rows_v, run, state],
                out_specs=out_specs, out_shape=out_shape, args=(q, x, y, eta, g, gp, rl, s0),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_col_fwd")


def backward_pass(q, x, y, eta, g, gp, rl, do, h, ds_end, *, chunk, block_v, interpret, num_warps=4,
                  num_stages=1):
    """Reverse walk with every gradient. h [BH, n_chunks, dk, dv] chunk start states, ds_end [BH, dk, dv].

    Returns dq, dx [BH, nv, L, dk] fp32 (one share per value block: sum over axis 1), dy [BH, L, dv],
    fp32 [BH, L, dv]: deta, dg (w.r.t. the chunk-local inclusive cumsum g), dgp (the exclusive one), and
    ds_start [BH, dk, dv].
    """
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    nv = dv // block_v
    grid, rows_k, rows_v, run, state = _specs(q, y, block_v)
    share = pl.BlockSpec((None, None, L, dk), lambda b, v: (b, v, 0, 0))
    h_spec = pl.BlockSpec((None, n, dk, block_v), lambda b, v: (b, 0, 0, v))
    vec = jax.ShapeDtypeStruct((BH, L, dv), F32)
    kernel = functools.partial(_backward_kernel, chunk=chunk, n_chunks=n, precision=precision_for(q.dtype))
    return tuple(call(kernel, grid=grid,
                in_specs=[rows_k, rows_k, rows_v, rows_v, rows_v, rows_v, run, rows_v, h_spec, state],
                out_specs=[share, share, rows_v] + [rows_v] * 3 + [state],
                out_shape=[jax.ShapeDtypeStruct((BH, nv, L, dk), F32), jax.ShapeDtypeStruct((BH, nv, L, dk), F32),
                           jax.ShapeDtypeStruct((BH, L, dv), y.dtype)] + [vec] * 3
                + [jax.ShapeDtypeStruct((BH, dk, dv), F32)],
                args=(q, x, y, eta, g, gp, rl, do, h, ds_end),
                compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                name="falcon_delta_col_bwd"))

