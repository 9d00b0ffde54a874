"""Helpers the Triton passes of ``decayed_delta_rule`` share: the chunk's masks and gates, the dots with the
fp32 state and the triangular inverse, and the keys read one row back in place.

Notation (per chunk; local rows s, j; masks cut between segments): ``g`` the chunk-local inclusive cumsum of
the log decay, ``gp = g − log γ`` (exclusive), ``rl`` the chunk-local run index (0 = the segment of the chunk's
initial state); ``c = [rl = 0] e^{g}`` (the initial state's decay to a read), ``c⁻ = [rl = 0] e^{gp}`` (to a
residual), ``w = [rl = rl_last] e^{g_last − g}`` (a write's decay to the chunk end), ``a = [rl_last = 0] e^{g_last}``
(the state's decay over the chunk).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import dot, pltriton, row_block, token_dims, triton_params

BLOCK = 16  # rows of a diagonal block of the triangular inverse (Triton's smallest dot tile)
F32 = jnp.float32


def _masks(g_row, g_col, rl_row, rl_col, strict, group=1):
    """``exp(g_row[t] − g_col[s])`` on ``s < t`` (strict=True) or ``s ≤ t`` (False) or every (t, s)
    (None: a block of rows wholly after the columns' block), within one segment; else 0.

    ``group`` (a power of two ≤ 16): rows come in groups of ``group`` (the virtual writes of one step of a
    windowed rule); strict=True then means *an earlier group* (``s // group < t // group``).
    Leading batch axes are allowed; the kernels pass vectors."""
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


def _in_dot(a, b, precision, p32):
    """``a @ b`` for an input-dtype ``a`` and a stored state ``b``: on the inputs' dtype when b is stored in it
    (exact), else in fp32 at ``p32``."""
    if a.dtype == b.dtype:
        return dot(a, b, precision)
    return dot(a.astype(F32), b.astype(F32), p32)


def _chunk_rows(refs, c, chunk):
    """Rows of chunk ``c``: (rows slice, eta, g, gp, rl, g at the last row, rl at the last row)."""
    eta_ref, g_ref, gp_ref, rl_ref = refs
    start = pl.multiple_of(c * chunk, chunk)
    rows = pl.ds(start, chunk)
    return rows, eta_ref[rows], g_ref[rows], gp_ref[rows], rl_ref[rows], g_ref[start + chunk - 1], \
        rl_ref[start + chunk - 1]


def _masked_scores(q, x, g, rl, precision):
    """One chunk's masked scores ``QXᵀ ⊙ D`` (``D[t, s] = e^{g_t − g_s}`` on ``s ≤ t`` within a segment), fp32."""
    return dot(q, x.T, precision) * _masks(g, g, rl, rl, strict=False)


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

