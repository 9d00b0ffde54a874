"""The triangular inverse ``T = (I + A)⁻¹`` of every chunk (Triton), the first pass of the forward and backward.

    A[s, j] = M⁻ · η_s (x_s·x_j) e^{gp_s − g_j}     strictly lower (``group > 1``: only rows of earlier groups)

One program per chunk, by blocked forward substitution over 16-row blocks: the diagonal blocks by right-looking
elimination (all in one loop), the blocks below them by matmuls.  No powers of A are formed, so β near 2 (A's
entries near 2, an inverse of alternating signs) stays exact to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import call, chunk_specs, dot, precision_for, token_dims
from falcon_jax.kernels.decayed_delta_rule.triton.common import (BLOCK, F32, _chunk_keys, _key_operand, _key_spec,
                                                                 _masks, _params)


def _unit_lower_inverses(blocks):
    """``(I + a)⁻¹`` of each strictly lower ``[16, 16]`` block ``a`` in ``blocks``, by right-looking forward
    elimination — all blocks in the same loop: their chains are independent, so one 15-step loop over the list
    (rather than 15 steps per block, one block after another) lets the warp overlap their latencies.

    Step j takes row j of t, final once steps < j ran, and subtracts ``a[:, j] ⊗ t[j, :]`` from the rows below.
    Column j of a does not depend on t, so a step's chain is one reduction over rows and a multiply-add, and each
    vector is broadcast along the axis it was reduced over: no layout conversion between steps."""
    n = blocks[0].shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def step(j, a, t):
        a_j = jnp.sum(jnp.where(cols == j, a, 0.0), axis=1)  # column j of a (zero on rows ≤ j)
        t_j = jnp.sum(jnp.where(rows == j, t, 0.0), axis=0)  # row j of t, final
        return t - a_j[:, None] * t_j[None, :]

    def body(j, ts):
        return tuple(step(j, a, t) for a, t in zip(blocks, ts))

    eye = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
    return list(lax.fori_loop(jnp.int32(0), jnp.int32(n - 1), body, tuple(eye for _ in blocks)))


def _tri_kernel(x_ref, eta_ref, g_ref, gp_ref, rl_ref, t_ref, *, chunk, precision, group, key_shift=False,
                key_pad=0):
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

    T = {(i, i): t for i, t in enumerate(_unit_lower_inverses([a_block(i, i) for i in range(nb)]))}
    for i in range(nb):
        A = [a_block(i, k) for k in range(i)]
        for k in range(i):  # block forward substitution: T_ik = −T_ii Σ_{k≤m<i} A_im T_mk
            acc = dot(A[k], T[k, k], p32)
            for m in range(k + 1, i):
                acc += dot(A[m], T[m, k], p32)
            T[i, k] = -dot(T[i, i], acc, p32)
        for k in range(nb):
            t_ref[blk[i], blk[k]] = (T[i, k] if k <= i else jnp.zeros((BLOCK, BLOCK), F32)).astype(t_ref.dtype)


def tri_inverse_pass(x, eta, g, gp, rl, *, chunk, interpret, num_warps=4, num_stages=1, group=1, heads=None,
                     t_dtype=F32, key_shift=False):
    """``T = (I + A)⁻¹`` of every chunk: ``[BH, L, C]`` in ``t_dtype`` (row cC+s = row s of chunk c's T; solved
    in fp32, rounded once when stored).

    ``group > 1``: A couples only rows of earlier groups (the windowed rule's virtual writes).
    ``heads=H``: x is ``[B, L, H, dk]``, read in place (``common.row_block``).  ``key_shift``: x holds the keys,
    and row t's write feature is ``x[t − 1]`` (zero at t = 0), read in place (:class:`_KeysOneRowBack`; the
    other passes take the same flag)."""
    BH, L, dk = token_dims(x, heads)
    sp = chunk_specs(x, dk, chunk, heads)
    keys, key_kw = _key_operand(x, key_shift, interpret)
    kernel = functools.partial(_tri_kernel, chunk=chunk, precision=precision_for(x.dtype), group=group, **key_kw)
    (tinv,) = call(kernel, grid=(BH, L // chunk), in_specs=[_key_spec(sp, x, key_shift, heads), sp.row, sp.row,
                                                             sp.row, sp.row],
                   out_specs=[sp.square],
                   out_shape=[jax.ShapeDtypeStruct((BH, L, chunk), t_dtype)],
                   args=(keys, eta, g, gp, rl),
                   compiler_params=_params(interpret, num_warps, num_stages), interpret=interpret,
                   name="falcon_delta_tri_inverse")
    return tinv

