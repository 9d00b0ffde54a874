"""The per-column ops' definitions in plain JAX (``lax.scan`` over tokens); the kernels must equal them.

Per (batch, head) and value column c, with write weight ``η_{t,c}``, log decay ``a_{t,c}`` and run index ``r_t``
(the state resets where it changes; ``s'_{t-1,c} = [r_t = r_{t-1}] · s_{t-1,c}``)::

    Falcon-2:   p_{t,c} = η_{t,c} (y_{t,c} − (S'_{t-1}ᵀ x_t)_c),   s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + x_t p_{t,c}
    Falcon-2A:  s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t
    o_t = S_tᵀ q_t

The regression rule is :func:`falcon_jax.kernels.decayed_delta_rule.reference.decayed_delta_rule_reference`,
which takes per-column gates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.kernels.decayed_delta_rule.reference import decayed_delta_rule_reference

__all__ = ["decayed_attention_per_column_reference", "decayed_delta_rule_reference"]


def decayed_attention_per_column_reference(q, x, y, eta, log_gamma, run, initial_state):
    """The inner-product rule with per-column gates (Falcon-2A): as :func:`decayed_delta_rule_reference`
    without the residual, ``s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t``, ``o_t = S_tᵀ q_t``."""
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    q, x, y, eta, log_gamma = (a.astype(f32) for a in (q, x, y, eta, log_gamma))
    prev_run = jnp.concatenate([jnp.zeros_like(run[..., :1]), run[..., :-1]], axis=-1)
    keep = (run == prev_run).astype(f32)
    dv = y.shape[-1]
    eta, log_gamma = (a if a.ndim == y.ndim else jnp.broadcast_to(a[..., None], (*a.shape, dv))
                      for a in (eta, log_gamma))

    def step(S, inp):
        q_t, x_t, y_t, eta_t, a_t, keep_t = inp
        S = jnp.exp(a_t)[..., None, :] * (keep_t[..., None, None] * S) + x_t[..., :, None] * (eta_t * y_t)[..., None, :]
        return S, jnp.einsum("...k,...kd->...d", q_t, S)

    seq = [jnp.moveaxis(a, 2, 0) for a in (q, x, y, eta, log_gamma, keep)]
    final, o = jax.lax.scan(step, initial_state.astype(f32), seq)
    return jnp.moveaxis(o, 0, 2), final
