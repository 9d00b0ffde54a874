"""The windowed op's definition in plain JAX (a ``lax.scan`` over steps); the kernels must equal it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def windowed_delta_rule_reference(q, x, y, w, log_gamma, run, initial_state):
    """Windowed (Falcon-3) form: every step writes the ``W`` pairs of its window, all residuals measured on the
    same previous state::

        S'_{t-1} = [r_t = r_{t-1}] · S_{t-1}
        S_t = e^{a_t} S'_{t-1} + Σ_{i<W} w_{t,i} x_{t+i} (y_{t+i} − S'_{t-1}ᵀ x_{t+i})ᵀ
        o_t = S_tᵀ q_t

    q [B,H,T,dk]; x [B,H,T+W-1,dk], y [B,H,T+W-1,dv] (window entry i of step t is index t+i: the ``W-1``
    older pairs in front); w [B,H,T,W]; log_gamma, run [B,H,T]; initial_state [B,H,dk,dv].
    ``W = 1`` is :func:`decayed_delta_rule_reference`.
    """
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    q, x, y, w, log_gamma = (a.astype(f32) for a in (q, x, y, w, log_gamma))
    T, W = w.shape[2], w.shape[3]
    x_win = jnp.stack([x[:, :, i:i + T] for i in range(W)], axis=3)  # [B,H,T,W,dk]
    y_win = jnp.stack([y[:, :, i:i + T] for i in range(W)], axis=3)
    prev_run = jnp.concatenate([jnp.zeros_like(run[..., :1]), run[..., :-1]], axis=-1)
    keep = (run == prev_run).astype(f32)

    def step(S, inp):
        q_t, x_t, y_t, w_t, a_t, keep_t = inp
        S = keep_t[..., None, None] * S
        p = w_t[..., None] * (y_t - jnp.einsum("...ik,...kd->...id", x_t, S))
        S = jnp.exp(a_t)[..., None, None] * S + jnp.einsum("...ik,...id->...kd", x_t, p)
        return S, jnp.einsum("...k,...kd->...d", q_t, S)

    seq = [jnp.moveaxis(a, 2, 0) for a in (q, x_win, y_win, w, log_gamma, keep)]
    final, o = jax.lax.scan(step, initial_state.astype(f32), seq)
    return jnp.moveaxis(o, 0, 2), final
