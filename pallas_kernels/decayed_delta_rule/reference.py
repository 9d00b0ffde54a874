"""The op's definition in plain JAX (a ``lax.scan`` over tokens); the kernels must equal it.

Per (batch, head), with write weight ``η_t``, log decay ``a_t = log γ_t`` and run
index ``r_t`` (number of segment starts up to t; the state resets where it changes)::

    S'_{t-1} = [r_t = r_{t-1}] · S_{t-1}          (S_{-1} = S0, r_{-1} = 0)
    p_t = η_t (y_t − S'_{t-1}ᵀ x_t)               residual on the undecayed state
    S_t = e^{a_t} S'_{t-1} + x_t p_tᵀ
    o_t = S_tᵀ q_t

Falcon-1 is this op with ``x_t = k_{t-1}`` (0 at the sentinel), ``y_t = v_t``,
``η_t`` its step size and ``a_t = log γ_t``; DeltaNet with ``x_t = k_t``, ``a = 0``.
``decay_before_residual=True`` measures the residual on the *decayed* state, as
Gated DeltaNet does (``x_t = k_t``, ``η_t = β_t``)::

    p_t = η_t (y_t − e^{a_t} S'_{t-1}ᵀ x_t)

Per-column gates (Falcon-2): ``η`` and ``a`` may be ``[B, H, T, dv]``, one value per
value column c: ``p_{t,c} = η_{t,c} (y_{t,c} − (S'_{t-1}ᵀ x_t)_c)``,
``s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + x_t p_{t,c}`` (column c of S).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decayed_delta_rule_reference(q, x, y, eta, log_gamma, run, initial_state, *, decay_before_residual=False):
    """q, x [B,H,T,dk]; y [B,H,T,dv]; eta, log_gamma [B,H,T] or [B,H,T,dv] (per column); run [B,H,T] int;
    initial_state [B,H,dk,dv]; decay_before_residual: the residual read from the decayed state (Gated DeltaNet).

    Returns (o [B,H,T,dv], final_state [B,H,dk,dv]) in fp32 (fp64 for fp64 inputs).
    """
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    q, x, y, eta, log_gamma = (a.astype(f32) for a in (q, x, y, eta, log_gamma))
    prev_run = jnp.concatenate([jnp.zeros_like(run[..., :1]), run[..., :-1]], axis=-1)
    keep = (run == prev_run).astype(f32)
    dv = y.shape[-1]
    # gates as [B,H,T,dv]: a scalar gate is the same in every column
    eta, log_gamma = (a if a.ndim == y.ndim else jnp.broadcast_to(a[..., None], (*a.shape, dv))
                      for a in (eta, log_gamma))

    def step(S, inp):
        q_t, x_t, y_t, eta_t, a_t, keep_t = inp
        S = keep_t[..., None, None] * S
        decayed = jnp.exp(a_t)[..., None, :] * S
        p = eta_t * (y_t - jnp.einsum("...k,...kd->...d", x_t, decayed if decay_before_residual else S))
        S = decayed + x_t[..., :, None] * p[..., None, :]
        return S, jnp.einsum("...k,...kd->...d", q_t, S)

    seq = [jnp.moveaxis(a, 2, 0) for a in (q, x, y, eta, log_gamma, keep)]
    final, o = jax.lax.scan(step, initial_state.astype(f32), seq)
    return jnp.moveaxis(o, 0, 2), final
