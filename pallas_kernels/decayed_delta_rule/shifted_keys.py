"""Falcon-1's write features from its keys, ``x[t] = k[t − 1]``, without a shifted copy of k.

The GPU passes read the keys one row back in place; row 0, whose feature is the key carried from an earlier
call (``first_key``), is done here in XLA and folded into the initial state, so the kernels see row 0 as an
identity step (log γ = 0, same segment, zero feature).  Its gradients come back through the same fold.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import shift_time


def _first_row(a, heads):
    """Row 0 of a token operand as ``[BH, d]``: ``[BH, L, d]``, or ``[B, L, H, d]`` with ``heads``."""
    row = a[:, 0]
    return row.reshape(-1, row.shape[-1]) if heads is not None else row


def _state_after_first_row(s0, x0, y0, eta0, lg0, keep, decay_before_residual=False):
    """``[BH, dk, dv]``: the state after row 0, ``e^{log γ₀} S + η₀ x₀ (y₀ − Ŝᵀ x₀)ᵀ`` with ``S = s0``, or
    ``S = 0`` where row 0 starts a segment (``keep`` False); ``Ŝ = S``, or ``e^{log γ₀} S`` with
    ``decay_before_residual``.  x0 ``[BH, dk]``, y0 ``[BH, dv]``, gates ``[BH]``."""
    prev = jnp.where(keep[:, None, None], s0, 0.0)
    decayed = jnp.exp(lg0)[:, None, None] * prev
    seen = decayed if decay_before_residual else prev
    resid = y0 - jnp.einsum("bk,bkd->bd", x0, seen, precision=jax.lax.Precision.HIGHEST)
    return decayed + (eta0[:, None] * x0)[:, :, None] * resid[:, None, :]


def fold_first_row(s0, x0, y, eta, log_gamma, run, heads, decay_before_residual=False):
    """Row 0's step (write feature ``x0`` ``[BH, dk]``: ``first_key``) done in XLA: returns the kernel operands
    ``(s0, eta, log_gamma, run)`` with s0 the state after row 0 and row 0 an identity step for the kernels
    (log γ = 0 and run index 0, so they neither decay nor reset there; their row-0 feature is zero — the masked
    row −1, or the shifted copy's zero row — so they write nothing there whatever η₀ is, and η₀ stays: the
    in-place chunk gradients form row 0's dy as ``η₀ dR₀``), and the residuals :func:`first_row_grads` needs.
    Gates ``[BH, L]``; y a token operand (:func:`_first_row`)."""
    eta0, lg0, run0 = eta[:, 0], log_gamma[:, 0], run[:, 0]
    keep = run0 == 0
    y0 = _first_row(y, heads).astype(jnp.float32)
    folded = _state_after_first_row(s0, x0, y0, eta0, lg0, keep, decay_before_residual)
    operands = (folded, eta, log_gamma.at[:, 0].set(0.0), run - run0[:, None])
    return operands, (s0, x0, y0, eta0, lg0, keep)


def first_row_grads(residuals, ds_folded, decay_before_residual=False):
    """The backward of :func:`fold_first_row` (called with the same ``decay_before_residual``): gradients
    w.r.t. s0, x0, y's row 0, η₀ and log γ₀."""
    *primals, keep = residuals
    _, vjp = jax.vjp(lambda *a: _state_after_first_row(*a, keep, decay_before_residual), *primals)
    return vjp(ds_folded)


def keys_one_row_later(k, first_key, axis):
    """Write features from keys: ``x[t] = k[t − 1]`` along ``axis``, ``x[0] = first_key`` ``[B, H, dk]`` (None:
    zero)."""
    if first_key is None:
        return shift_time(k, 1, axis=axis)
    row0 = jnp.expand_dims(first_key.astype(k.dtype), axis)  # [B, H, dk] -> [B, H, 1, dk] or [B, 1, H, dk]
    return jnp.concatenate([row0, jax.lax.slice_in_dim(k, 0, k.shape[axis] - 1, axis=axis)], axis=axis)

