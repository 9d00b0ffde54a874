"""Exact output and end state of one block of steps, given the block's initial state.

This is the parallel form (one block = the whole sequence, O(T²)) and the
intra-chunk part of the chunk form (one block = one chunk, O(C²)).

Notation inside a block of ``C`` steps (local index t, s); ``g_t`` is the
inclusive local cumulative log decay, so the decay from step s to t is
``exp(g_t − g_s)`` — only differences of chunk-local log sums are ever
exponentiated (no global decay products, no division by small γ; this is
the App. C.6 renormalization written as a ratio).

Inner product (1A, 2A, 3A, linear attention) — a masked attention over the
``C + W − 1`` pairs of the block (the window's ``W − 1`` overlap in front)::

    o_t = e^{g_t}·qᵀS_0 + Σ_j (q_t·x_j) K_{tj} y_j,   K_{tj} = Σ_i D_{t,j−i} w_{j−i,i}

``K`` is the banded window operator (Alg. 4); for ``W = 1`` it is the
decay mask ``D ⊙ η`` of decayed linear attention.

Regression (1, 2, 3, DeltaNet, Gated DeltaNet) — the writes are unknown
until the residuals are known; with ``p_{s,i} = w_{s,i}(y_{s,i} − Ŝ_sᵀx_{s,i})``
they satisfy a unit lower-triangular system over the ``N = C·W``
(time × rank) unknowns (WY / TriSolve form, Fig. 4–5, Alg. 1, Alg. 3)::

    p_n + w_n Σ_{m: s(m) < s(n)} e^{ĝ_{s(n)} − g_{s(m)}} (x_n·x_m) p_m = w_n (y_n − e^{ĝ_{s(n)}} S_0ᵀ x_n)

with ``ĝ_s = g_{s−1}`` (residual on the undecayed state: Falcon) or ``g_s``
(decayed: Gated DeltaNet).  Per-column rules solve one system per column,
all sharing the Gram ``x_n·x_m``.  Segment starts inside the block cut every
pair of steps in different segments (``run``).
"""

from __future__ import annotations

import jax.numpy as jnp

from falcon_jax.kernels.common import unit_lower_inverse


def _band(decay, w):
    """``K[..., t, s+i, g] = Σ_i decay[..., t, s, g] · w[..., s, i, g]``.

    decay [..., R, C, G] (R rows), w [..., C, W, G] -> [..., R, C+W-1, G].
    """
    W = w.shape[-2]
    out = 0.0
    for i in range(W):
        term = decay * w[..., None, :, i, :]
        pad = [(0, 0)] * (term.ndim - 2) + [(i, W - 1 - i), (0, 0)]
        out = out + jnp.pad(term, pad)
    return out


def unit_lower_solve(A, rhs, block_size: int = 64):
    """Solve ``(I + A) X = rhs`` for strictly lower-triangular ``A [..., N, N]``, rhs ``[..., N, M]``.

    Blocked forward substitution: diagonal blocks by their inverses
    (:func:`unit_lower_inverse`, matmuls only), the rest by matmuls, as a
    kernel does.
    """
    N = A.shape[-1]

    def solve(a, b):
        return unit_lower_inverse(a) @ b

    if N <= block_size:
        return solve(A, rhs)
    parts = []
    for start in range(0, N, block_size):
        stop = min(start + block_size, N)
        b = rhs[..., start:stop, :]
        if parts:
            b = b - A[..., start:stop, :start] @ jnp.concatenate(parts, axis=-2)
        parts.append(solve(A[..., start:stop, start:stop], b))
    return jnp.concatenate(parts, axis=-2)


def block(q, x_ext, y_ext, w, log_gamma, run, S0, *, regression: bool, timing: str,
          decay_before_residual: bool):
    """One block.

    q [..., C, dk]; x_ext [..., C+W-1, dk]; y_ext [..., C+W-1, dv];
    w [..., C, W, G]; log_gamma [..., C, G]; run [..., C] int (0 = same segment as S0,
    counts segment starts inside the block); S0 [..., dk, dv].
    Returns (o [..., C, dv] (unscaled), S_end [..., dk, dv]).
    """
    C, W, G = w.shape[-3:]
    dk, dv = x_ext.shape[-1], y_ext.shape[-1]
    dg = dv // G
    lead = q.shape[:-2]

    g = jnp.cumsum(log_gamma, axis=-2)  # [..., C, G]   g_t
    g_prev = g - log_gamma  # g_{t-1}
    cont = (run == 0)[..., None]  # [..., C, 1] still in S0's segment
    same = run[..., :, None] == run[..., None, :]  # [..., C, C]
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    def pair_decay(g_row, tri):  # [..., C(t), C(s), G] = exp(g_row[t] - g[s]) on the mask
        mask = (tri & same)[..., None]
        diff = g_row[..., :, None, :] - g[..., None, :, :]
        return jnp.exp(jnp.where(mask, diff, -jnp.inf))

    def init_decay(g_row):  # [..., C, G] decay of S0 up to row t (0 after a segment start)
        return jnp.where(cont, jnp.exp(g_row), 0.0)

    if timing == "raw":
        read, read0 = pair_decay(g, incl), init_decay(g)
    else:
        read, read0 = pair_decay(g_prev, strict), init_decay(g_prev)
    last_same = same[..., -1, :, None]  # [..., C, 1]
    end = jnp.exp(jnp.where(last_same, g[..., -1:, :] - g, -jnp.inf))  # [..., C(s), G]
    end0 = jnp.where(run[..., -1:] == 0, jnp.exp(g[..., -1, :]), 0.0)  # [..., G]

    S0g = S0.reshape(*lead, dk, G, dg)
    out = jnp.einsum("...tk,...kgd->...tgd", q, S0g) * read0[..., None]
    S_end = S0g * end0[..., None, :, None]

    if not regression:
        J = C + W - 1
        y_g = y_ext.reshape(*lead, J, G, dg)
        qx = jnp.einsum("...tk,...jk->...tj", q, x_ext)
        K_read = _band(read, w)  # [..., C, J, G]
        k_end = _band(end[..., None, :, :], w)[..., 0, :, :]  # [..., J, G]
        out = out + jnp.einsum("...tj,...tjg,...jgd->...tgd", qx, K_read, y_g)
        S_end = S_end + jnp.einsum("...jk,...jg,...jgd->...kgd", x_ext, k_end, y_g)
    else:
        N = C * W
        x_v = jnp.stack([x_ext[..., i:i + C, :] for i in range(W)], axis=-2).reshape(*lead, N, dk)
        y_v = jnp.stack([y_ext[..., i:i + C, :] for i in range(W)], axis=-2).reshape(*lead, N, G, dg)
        w_v = w.reshape(*lead, N, G)
        g_hat = g if decay_before_residual else g_prev

        def per_pair(a, axis):  # repeat the step axis W times: step s -> pairs (s, 0..W-1)
            return jnp.repeat(a, W, axis=axis)

        pred = per_pair(per_pair(pair_decay(g_hat, strict), -3), -2)  # [..., N, N, G]
        pred0 = per_pair(init_decay(g_hat), -2)  # [..., N, G]
        gram = jnp.einsum("...nk,...mk->...nm", x_v, x_v)
        A = jnp.moveaxis(w_v[..., :, None, :] * pred * gram[..., None], -1, -3)  # [..., G, N, N]
        rhs = w_v[..., None] * (y_v - jnp.einsum("...nk,...kgd->...ngd", x_v, S0g) * pred0[..., None])
        P = unit_lower_solve(A, jnp.moveaxis(rhs, -2, -3))
        P = jnp.moveaxis(P, -3, -2)  # [..., N, G, dg]
        qx = jnp.einsum("...tk,...nk->...tn", q, x_v)
        out = out + jnp.einsum("...tn,...tng,...ngd->...tgd", qx, per_pair(read, -2), P)
        S_end = S_end + jnp.einsum("...nk,...ng,...ngd->...kgd", x_v, per_pair(end, -2), P)

    return out.reshape(*lead, C, dv), S_end.reshape(*lead, dk, dv)
