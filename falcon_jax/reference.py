"""Independent float64 NumPy references of the rules (the ground truth of the tests and of
:func:`falcon_jax.testing.assert_matches_reference`).

Everything here is a plain sequential recurrence: Python loops over batch, head
and time, small NumPy linear algebra per step, no JAX.  It follows the rules'
definitions literally (shifted write stream with the boundary sentinel, the
six Falcon rules, the clamped positive decay, packed segments, continuation
state with the sliding-window tail).  It is slow (O(B·H·T) Python steps): meant
for short sequences.

Conventions (per batch b, head h, 0-indexed t):

* alignment="shifted": the write pair at t is (x_t, y_t) = (k_{t-1}, v_t).
  Position t is a *sentinel* (no pair: eta = alpha = 0, gamma = 1) when it is a
  segment start (t > 0 and segment_ids changes) or when t = 0 and no previous
  key is available (no initial state, or initial_state.has_key is False).
  alignment="same_step": (x_t, y_t) = (k_t, v_t), never a sentinel.
* At a segment start (t > 0) the state S, the previous key and the window are
  reset before step t.  The initial state always feeds position 0.
* Windowed variants (3, 3A) use the last W pairs up to and including t
  (sentinels excluded, never crossing a segment start, the incoming tail
  counting as earlier pairs).  The other variants use W = 1.
"""
from __future__ import annotations

import numpy as np

VARIANTS = ("1", "2", "3", "1A", "2A", "3A")
PER_COLUMN = ("2", "2A")
WINDOWED = ("3", "3A")
RESIDUAL = ("1", "2", "3")


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _field(state, name):
    if isinstance(state, dict):
        return state[name]
    return getattr(state, name)


def effective_window(variant, window):
    return int(window) if variant in WINDOWED else 1


def _segment_starts(segment_ids, B, T):
    """starts[b, t] is True iff t > 0 starts a new segment in row b."""
    starts = np.zeros((B, T), dtype=bool)
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        if seg.shape != (B, T):
            raise ValueError(f"segment_ids must have shape {(B, T)}, got {seg.shape}")
        starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return starts


def reference_falcon(q, k, v, beta, lam, *, variant, window=4, alignment="shifted",
                     timing="raw", step="normalized", scale_coupled=False, eps=1e-6,
                     eps_gamma=1e-6, scale=1.0, segment_ids=None, initial_state=None):
    """Sequential float64 Falcon recurrence.  Returns (out [B,T,H,dv], final_state dict)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    if alignment not in ("shifted", "same_step"):
        raise ValueError(f"unknown alignment {alignment!r}")
    if timing not in ("raw", "rbw"):
        raise ValueError(f"unknown timing {timing!r}")
    if step not in ("normalized", "direct"):
        raise ValueError(f"unknown step {step!r}")
    q, k, v, beta, lam = map(_f64, (q, k, v, beta, lam))
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    assert k.shape == (B, T, H, dk) and v.shape == (B, T, H, dv)
    assert lam.shape == (B, T, H)
    per_col = variant in PER_COLUMN
    if per_col:
        if beta.ndim == 3:
            beta = np.broadcast_to(beta[..., None], (B, T, H, dv))
        assert beta.shape == (B, T, H, dv)
    else:
        assert beta.shape == (B, T, H)
    W = effective_window(variant, window)
    assert W >= 1
    L = W - 1  # tail length
    starts = _segment_starts(segment_ids, B, T)

    out = np.zeros((B, T, H, dv))
    S_fin = np.zeros((B, H, dk, dv))
    tail_x = np.zeros((B, H, L, dk))
    tail_y = np.zeros((B, H, L, dv))
    tail_valid = np.zeros((B, L), dtype=bool)

    for b in range(B):
        for h in range(H):
            # ---- carried state -------------------------------------------------
            if initial_state is not None:
                S = _f64(_field(initial_state, "S"))[b, h].copy()
                has_key = bool(np.asarray(_field(initial_state, "has_key"))[b])
                prev_key = _f64(_field(initial_state, "last_key"))[b, h].copy() if has_key else None
                if L > 0:
                    tx = _f64(_field(initial_state, "tail_x"))[b, h]
                    ty = _f64(_field(initial_state, "tail_y"))[b, h]
                    tv = np.asarray(_field(initial_state, "tail_valid"))[b]
                    tail = [(tx[i].copy(), ty[i].copy()) if bool(tv[i]) else None for i in range(L)]
                else:
                    tail = []
            else:
                S = np.zeros((dk, dv))
                prev_key = None
                tail = [None] * L

            for t in range(T):
                if starts[b, t]:
                    S = np.zeros((dk, dv))
                    prev_key = None
                    tail = [None] * L
                S_prev = S
                if alignment == "shifted":
                    x = prev_key
                else:
                    x = k[b, t, h]
                y = v[b, t, h]

                if x is None:  # sentinel: no write, no shrinkage
                    S_new = S_prev
                    pair = None
                else:
                    pair = (x, y)
                    pairs = [p for p in tail if p is not None] + [pair]
                    Bt = len(pairs)
                    X = np.stack([p[0] for p in pairs])  # [Bt, dk]
                    Y = np.stack([p[1] for p in pairs])  # [Bt, dv]
                    if variant == "3":
                        E = float(np.linalg.eigvalsh(X @ X.T).max()) / Bt
                    elif variant == "3A":
                        E = float(np.mean(np.sum(X * X, axis=1)))
                    else:
                        E = float(x @ x)
                    lam_eff = lam[b, t, h] * E if scale_coupled else lam[b, t, h]
                    bt = beta[b, t, h]  # scalar, or [dv] for the per-column variants
                    if step == "normalized":
                        den = E + lam_eff + eps
                        # paper Eq. (3.4) convention: eta := 0 when the denominator vanishes
                        # (only possible with eps = 0, lam = 0 and zero keys)
                        eta = bt / den if den > 0 else np.zeros_like(bt)
                    else:
                        eta = bt
                    alpha = np.minimum(eta * lam_eff, 1.0 - eps_gamma)
                    gamma = 1.0 - alpha
                    R = Y - X @ S_prev if variant in RESIDUAL else Y  # residuals use S_{t-1}
                    update = X.T @ R / Bt  # [dk, dv]
                    # gamma / eta are scalars or [dv] vectors: broadcasting over columns
                    S_new = gamma * S_prev + eta * update

                read = S_new if timing == "raw" else S_prev
                out[b, t, h] = scale * (read.T @ q[b, t, h])
                if L > 0:
                    tail = tail[1:] + [pair]
                prev_key = k[b, t, h]
                S = S_new

            S_fin[b, h] = S
            for i, p in enumerate(tail):
                if p is not None:
                    tail_x[b, h, i] = p[0]
                    tail_y[b, h, i] = p[1]
                    tail_valid[b, i] = True

    final = {
        "S": S_fin,
        "last_key": k[:, T - 1].copy(),
        "has_key": np.ones((B,), dtype=bool),
        "tail_x": tail_x,
        "tail_y": tail_y,
        "tail_valid": tail_valid,
    }
    return out, final


# ----------------------------------------------------------------------------
# Baselines: same-step pairs, no sentinel, resets at segment starts,
# o_t = scale * S_t^T q_t.
# ----------------------------------------------------------------------------

def _initial_S(initial_state, B, H, dk, dv):
    if initial_state is None:
        return np.zeros((B, H, dk, dv))
    if isinstance(initial_state, dict) or hasattr(initial_state, "S"):
        initial_state = _field(initial_state, "S")
    S0 = _f64(initial_state)
    assert S0.shape == (B, H, dk, dv)
    return S0


def _baseline(q, k, v, scale, segment_ids, initial_state, update):
    q, k, v = map(_f64, (q, k, v))
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    starts = _segment_starts(segment_ids, B, T)
    S0 = _initial_S(initial_state, B, H, dk, dv)
    out = np.zeros((B, T, H, dv))
    S_fin = np.zeros((B, H, dk, dv))
    for b in range(B):
        for h in range(H):
            S = S0[b, h].copy()
            for t in range(T):
                if starts[b, t]:
                    S = np.zeros((dk, dv))
                S = update(S, b, t, h)
                out[b, t, h] = scale * (S.T @ q[b, t, h])
            S_fin[b, h] = S
    return out, {"S": S_fin}


def reference_decayed_linear_attention(q, k, v, log_decay, beta=None, *, scale=1.0,
                                       segment_ids=None, initial_state=None):
    """S_t = exp(log_decay_t) S_{t-1} + beta_t k_t v_t^T (beta defaults to 1)."""
    k, v, g = _f64(k), _f64(v), _f64(log_decay)
    bet = np.ones(g.shape) if beta is None else _f64(beta)

    def update(S, b, t, h):
        kt, vt = k[b, t, h], v[b, t, h]
        return np.exp(g[b, t, h]) * S + bet[b, t, h] * np.outer(kt, vt)

    return _baseline(q, k, v, scale, segment_ids, initial_state, update)


def reference_deltanet(q, k, v, beta, *, scale=1.0, segment_ids=None, initial_state=None):
    """S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T."""
    k, v, bet = _f64(k), _f64(v), _f64(beta)

    def update(S, b, t, h):
        kt, vt = k[b, t, h], v[b, t, h]
        return S + bet[b, t, h] * np.outer(kt, vt - S.T @ kt)

    return _baseline(q, k, v, scale, segment_ids, initial_state, update)


def reference_gated_deltanet(q, k, v, beta, log_decay, *, scale=1.0, segment_ids=None,
                             initial_state=None):
    """S_t = gamma_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, gamma_t = exp(log_decay_t)."""
    k, v, bet, g = _f64(k), _f64(v), _f64(beta), _f64(log_decay)

    def update(S, b, t, h):
        kt, vt = k[b, t, h], v[b, t, h]
        dk = kt.shape[0]
        A = np.exp(g[b, t, h]) * (np.eye(dk) - bet[b, t, h] * np.outer(kt, kt))
        return A @ S + bet[b, t, h] * np.outer(kt, vt)

    return _baseline(q, k, v, scale, segment_ids, initial_state, update)
