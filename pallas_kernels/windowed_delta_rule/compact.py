"""Falcon-3's chunk form on the chunk's ``P = C + W − 1`` distinct pairs (XLA), not on ``C·W`` virtual rows.

Notation for one chunk of ``C`` steps (local t, s), pairs ``p = 0 … P−1`` (window slot i of step t is pair
``t + i``), ``Ŝ_t`` the state step t's residuals are measured on (its start state, zeroed at a segment start)::

    r_{t,i} = y_{t+i} − x_{t+i}ᵀ Ŝ_t,    S_t = e^{a_t} Ŝ_t + Σ_i w_{t,i} x_{t+i} r_{t,i}ᵀ,    o_t = S_tᵀ q_t

**Only the newest slot needs the state.**  Pair ``t + i`` (``i < W−1``) was slot ``i+1`` of step ``t−1``, so its
residual follows from step ``t−1``'s residuals and the ``W × W`` Gram of the two windows::

    r_{t,i} = (1 − λ_t) y_{t+i} + λ_t r_{t−1,i+1} − κ_t Σ_j w_{t−1,j} (x_{t+i}·x_{t−1+j}) r_{t−1,j}

(``κ_t = [no segment start at t]``, ``λ_t = κ_t e^{a_{t−1}}``).  Every ``r_{t,i}`` is therefore a linear
combination of the *fresh reads* ``f_t = r_{t,W−1}`` (one per step), the values ``y_p`` and the state reads
``z_p = x_pᵀ S_{−1}`` (the chunk's start state): a coefficient row ``[C + 2P]`` per residual, built by the
recurrence above in one scan of C steps of ``W × W`` products.  The fresh reads solve a unit lower-triangular
``C × C`` system, Falcon-1's size::

    f_t + Σ_{s<t} D̂_{ts} Σ_i w_{s,i} (x_{t+W−1}·x_{s+i}) r_{s,i} = y_{t+W−1} − ê_t z_{t+W−1}

(``D̂_{ts} = e^{g_{t−1} − g_s}`` within a segment, ``ê_t = e^{g_{t−1}}`` before the first segment start, g the
chunk-local cumulative log decay).  Substituting back, the outputs and the chunk's end state are products of
``dv``-independent matrices with ``Y`` and ``Z = X S_{−1}``, the shape of Falcon-1's chunk form on P rows::

    o     = e ⊙ (Q S_{−1}) + O_y Y + O_z Z                  [C, P] matrices
    S_end = e_C S_{−1} + Xᵀ (A_y Y + A_z Z)                 [P, P] matrices

So the state walk and the value-wide products are Falcon-1's chunk form on P = C + W − 1 rows; what the window
adds is ``dv``-independent: the coefficient scan and the contractions over the ``C·W`` residuals, whose cost per
step grows with C² (docs/kernels.md counts it).  This module is the form in XLA, exact against
:func:`.reference.windowed_delta_rule_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import chunk_local, flatten_pad, next_pow2, unit_lower_inverse

_HI = jax.lax.Precision.HIGHEST


def _chunk_matrices(x, q, w, a, g, seg):
    """The ``dv``-independent matrices of one chunk (leading axes batched).

    x ``[..., P, dk]`` (the chunk's pairs), q ``[..., C, dk]``, w ``[..., C, W]``, a ``[..., C]`` log decays and g
    their chunk-local cumulative sum, seg ``[..., C]`` chunk-local segment index (0: the segment of the start
    state).
    Returns ``(O [..., C, 2P], A [..., P, 2P], e [..., C])``: columns ``[:P]`` act on Y, ``[P:]`` on Z.
    """
    C, W = w.shape[-2], w.shape[-1]
    P = x.shape[-2]
    f32 = jnp.promote_types(x.dtype, jnp.float32)
    G = jnp.einsum("...pk,...rk->...pr", x, x, precision=_HI)  # [P, P]
    QX = jnp.einsum("...tk,...pk->...tp", q, x, precision=_HI)  # [C, P]
    g_hat = g - a  # log decay S_{-1} -> Ŝ_t (within the first segment)
    t = jnp.arange(C)
    same = seg[..., :, None] == seg[..., None, :]

    def decay(log_to, strict):  # [t, s]: e^{log_to[t] − g[s]} within a segment, s ≤ t (s < t if strict)
        mask = same & ((t[:, None] > t[None, :]) if strict else (t[:, None] >= t[None, :]))
        return jnp.where(mask, jnp.exp(jnp.where(mask, log_to[..., :, None] - g[..., None, :], 0.0)), 0.0)

    D, D_hat = decay(g, False), decay(g_hat, True)  # step s's writes in S_t, in Ŝ_t
    first = seg == 0
    e = jnp.where(first, jnp.exp(g), 0.0)
    e_hat = jnp.where(first, jnp.exp(g_hat), 0.0)
    keep = jnp.concatenate([first[..., :1], seg[..., 1:] == seg[..., :-1]], axis=-1).astype(f32)

    # coefficient rows over the basis [f (C) | y (P) | z (P)] of every residual r_{t,i}: a scan over t
    nb = C + 2 * P
    basis = jnp.eye(nb, dtype=f32)
    i = jnp.arange(W)
    batch = w.shape[:-2]
    lam = keep * jnp.exp(jnp.concatenate([jnp.zeros_like(a[..., :1]), a[..., :-1]], axis=-1))
    # rows t+i (i < W-1) and columns t-1+j of the Gram, per step: [..., C, W-1, W]
    rows = t[:, None, None] + i[None, :-1, None]
    cols = jnp.maximum(t[:, None, None] - 1 + i[None, None, :], 0)
    G_win = G[..., rows, cols]
    r0 = basis[C + i[:-1]] - keep[..., :1, None] * basis[C + P + i[:-1]]  # slots < W-1 of step 0: y − z
    coef0 = jnp.concatenate([jnp.broadcast_to(r0, (*batch, W - 1, nb)), jnp.broadcast_to(basis[0], (*batch, 1, nb))],
                            axis=-2)

    def step(prev, inp):  # prev [..., W, nb] -> step t's rows
        t_, lam_t, keep_t, w_prev, G_t = inp
        mixed = jnp.einsum("...ij,...j,...jb->...ib", G_t, w_prev, prev, precision=_HI)
        older = ((1.0 - lam_t)[..., None, None] * basis[C + t_ + i[:-1]]
                 + lam_t[..., None, None] * prev[..., 1:, :] - keep_t[..., None, None] * mixed)
        new = jnp.concatenate([older, jnp.broadcast_to(basis[t_], (*batch, 1, nb))], axis=-2)
        return new, new

    steps = (t[1:], jnp.moveaxis(lam[..., 1:], -1, 0), jnp.moveaxis(keep[..., 1:], -1, 0),
             jnp.moveaxis(w[..., :-1, :], -2, 0), jnp.moveaxis(G_win[..., 1:, :, :], -3, 0))
    _, later = jax.lax.scan(step, coef0, steps)
    coef = jnp.concatenate([coef0[..., None, :, :], jnp.moveaxis(later, 0, -3)], axis=-3)  # [..., C, W, nb]
    coef = coef.reshape(*batch, C * W, nb)

    pair = t[:, None] + i[None, :]  # [C, W]: pair of slot i of step t
    ww = w.reshape(*batch, C * W)
    # the fresh reads' system: K [C, C·W] = D̂_{ts} w_{s,i} (x_{t+W-1}·x_{s+i})
    K = (D_hat[..., :, :, None] * G[..., (t + W - 1)[:, None, None], pair[None]]).reshape(*batch, C, C * W)
    K = K * ww[..., None, :]
    Kc = jnp.einsum("...tn,...nb->...tb", K, coef, precision=_HI)  # [C, nb]
    rhs = basis[C + W - 1 + t, C:] - e_hat[..., :, None] * basis[C + P + W - 1 + t, C:] - Kc[..., C:]  # [C, 2P]
    fresh = unit_lower_inverse(Kc[..., :C], precision=_HI) @ rhs
    resid = coef[..., :C] @ fresh + coef[..., C:]  # [C·W, 2P]: every r_{t,i} over [y | z]
    J = (D[..., :, :, None] * QX[..., :, pair]).reshape(*batch, C, C * W) * ww[..., None, :]  # o's reads
    O = jnp.einsum("...tn,...nb->...tb", J, resid, precision=_HI)
    last = D[..., -1, :, None] * w  # [C, W]: weight of r_{s,i} in S_end
    scatter = (pair.reshape(-1)[None, :] == jnp.arange(P)[:, None]).astype(f32)  # [P, C·W]
    A = jnp.einsum("pn,...n,...nb->...pb", scatter, last.reshape(*batch, C * W), resid, precision=_HI)
    return O, A, e


def windowed_delta_rule_compact(q, x, y, w, log_gamma, run, initial_state, *, chunk_size: int = 64):
    """:func:`.reference.windowed_delta_rule_reference` (same arguments and result) by the compact chunk form.

    q ``[B, H, T, dk]``; x ``[B, H, T+W-1, dk]``, y ``[B, H, T+W-1, dv]``; w ``[B, H, T, W]``; log_gamma, run
    ``[B, H, T]``; initial_state ``[B, H, dk, dv]``.  Returns ``(o [B, H, T, dv], final_state [B, H, dk, dv])`` in
    fp32 (fp64 for fp64 inputs).
    """
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    B, H, T, dk = q.shape
    W = w.shape[-1]
    C = min(chunk_size, next_pow2(T))
    n = -(-T // C)
    BH, L, P = B * H, n * C, C + W - 1
    # identity steps at the end: no writes, no decay, the last segment continued
    q, w, a = (flatten_pad(v.astype(f32), L) for v in (q, w, log_gamma))
    x, y = (flatten_pad(v.astype(f32), L + W - 1) for v in (x, y))
    g, seg = chunk_local(a, flatten_pad(run, L, "edge"), C)
    idx = jnp.arange(n)[:, None] * C + jnp.arange(P)[None, :]
    xc, yc = x[:, idx], y[:, idx]  # [BH, n, P, d]
    q = q.reshape(BH, n, C, dk)
    O, A, e = _chunk_matrices(xc, q, w.reshape(BH, n, C, W), *(v.reshape(BH, n, C) for v in (a, g, seg)))
    Oy, Oz, Ay, Az = O[..., :P], O[..., P:], A[..., :P], A[..., P:]
    writes_y = jnp.einsum("...pr,...rd->...pd", Ay, yc, precision=_HI)  # [BH, n, P, dv]: state-free part
    out_y = jnp.einsum("...tp,...pd->...td", Oy, yc, precision=_HI)

    def walk(S, c):  # one chunk: S [BH, dk, dv]
        xs, qs, Az_c, Oz_c, wy, oy, e_c = c
        Z = jnp.einsum("bpk,bkd->bpd", xs, S, precision=_HI)
        o = (e_c[..., None] * jnp.einsum("btk,bkd->btd", qs, S, precision=_HI) + oy
             + jnp.einsum("btp,bpd->btd", Oz_c, Z, precision=_HI))
        S = e_c[..., -1, None, None] * S + jnp.einsum(
            "bpk,bpd->bkd", xs, wy + jnp.einsum("bpr,brd->bpd", Az_c, Z, precision=_HI), precision=_HI)
        return S, o

    chunks = (xc, q, Az, Oz, writes_y, out_y, e)
    s0 = initial_state.astype(f32).reshape(BH, dk, -1)
    final, o = jax.lax.scan(walk, s0, tuple(jnp.moveaxis(c, 1, 0) for c in chunks))
    o = jnp.moveaxis(o, 0, 1).reshape(B, H, L, -1)[:, :, :T]
    return o, final.reshape(initial_state.shape)
