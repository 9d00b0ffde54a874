"""The op's definition in plain JAX (one block, O(T²)); the kernels must equal it.

Per (batch, head), with a scalar log decay ``a_t`` and run index ``r_t``
(number of segment starts up to t; the state resets where it changes)::

    S_t = [r_t = r_{t-1}] · e^{a_t} S_{t-1} + x_t y_tᵀ,     S_{-1} = S0 (r_{-1} = 0)
    o_t = S_tᵀ q_t

Falcon-1A is this op with ``x_t = k_{t-1}`` (0 at the sentinel),
``y_t = η_t v_t`` and ``a_t = log γ_t``.
"""

from __future__ import annotations

import jax.numpy as jnp


def decayed_attention_reference(q, x, y, log_decay, run, initial_state):
    """q, x [B,H,T,dk]; y [B,H,T,dv]; log_decay [B,H,T]; run [B,H,T] int; initial_state [B,H,dk,dv].

    Returns (o [B,H,T,dv] float32, final_state [B,H,dk,dv] float32).
    """
    f32 = jnp.promote_types(jnp.float32, q.dtype)
    q, x, y = (a.astype(f32) for a in (q, x, y))
    T = q.shape[2]
    g = jnp.cumsum(log_decay.astype(f32), axis=-1)
    mask = (jnp.tril(jnp.ones((T, T), bool)) & (run[..., :, None] == run[..., None, :]))
    decay = jnp.exp(jnp.where(mask, g[..., :, None] - g[..., None, :], -jnp.inf))
    scores = jnp.einsum("bhtk,bhsk->bhts", q, x) * decay
    cont = run == 0
    o = jnp.einsum("bhts,bhsd->bhtd", scores, y)
    o = o + jnp.where(cont, jnp.exp(g), 0.0)[..., None] * jnp.einsum("bhtk,bhkd->bhtd", q, initial_state.astype(f32))
    last = jnp.where(run == run[..., -1:], jnp.exp(g[..., -1:] - g), 0.0)
    final = jnp.where(cont[..., -1], jnp.exp(g[..., -1]), 0.0)[..., None, None] * initial_state.astype(f32)
    final = final + jnp.einsum("bhsk,bhs,bhsd->bhkd", x, last, y)
    return o, final
