"""Chunk form through the Pallas kernels (``impl="pallas"``).

Serves the rules whose chunk computation is decayed attention with scalar
gates: Falcon-1A (and 2A with one gain per head) and decayed linear
attention.  Everything else raises ``NotImplementedError`` with the reason;
``impl="auto"`` then falls back to the XLA chunk form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.forms.stream import final_state, write_stream
from falcon_jax.rules import Rule
from falcon_jax.state import FalconState


def supports(rule: Rule, inputs: dict, dv: int, dk: int | None = None, dtype=None,
             interpret: bool = False, chunk_size: int = 64) -> str | None:
    """None if the kernels serve this call, else the reason."""
    if dk is not None and dtype is not None:
        from pallas_kernels.decayed_attention.api import unsupported_reason

        probe = jnp.zeros((0, dk), dtype)
        reason = unsupported_reason(probe, jnp.zeros((0, dv), dtype), chunk_size, interpret)
        if reason is not None:
            return f"{rule.name}: {reason}"
    if rule.regression:
        return f"{rule.name}: no Pallas kernel for regression rules yet"
    if rule.window != 1:
        return f"{rule.name}: no Pallas kernel for the sliding window yet"
    beta = inputs.get("beta")
    if beta is not None and beta.ndim == 4:
        return f"{rule.name}: no Pallas kernel for per-column gains yet"
    return None


def chunk_pallas(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState, *, chunk_size: int,
                 kernel_dtype=None):
    """Same arguments and result as :func:`falcon_jax.forms.chunk.chunk`.

    ``kernel_dtype``: dtype of q, x, y inside the kernel (the caller's input dtype, e.g. bf16);
    gates, decays and states stay fp32.
    """
    from pallas_kernels.decayed_attention import decayed_attention

    reason = supports(rule, inputs, v.shape[-1])
    if reason is not None:
        raise NotImplementedError(reason)
    B, H, T, _ = q.shape
    kd = kernel_dtype or q.dtype
    stream = write_stream(rule, k, v, inputs, resets, state)
    x = stream.x_ext  # W = 1: no tail in front
    y = stream.w[..., 0, :] * v  # [B,H,T,1] * [B,H,T,dv]: the write weight folded into the value
    log_gamma = stream.log_gamma[..., 0]
    run = jnp.broadcast_to(stream.run[:, None, :], (B, H, T))
    if rule.timing == "rbw":
        # read S_{t-1}: the raw read of position t-1 with query q_t; 0 where a segment starts
        q_read = jnp.concatenate([q[:, :, 1:], jnp.zeros_like(q[:, :, :1])], axis=2)
    else:
        q_read = q
    # the kernel of this machine's accelerator; on CPU the GPU kernel in interpret mode
    implementation = "pallas_tpu" if jax.default_backend() == "tpu" else "pallas_gpu"
    o, S = decayed_attention(q_read.astype(kd), x.astype(kd), y.astype(kd), log_gamma, run, state.S,
                             chunk_size=chunk_size, implementation=implementation)
    o = o.astype(q.dtype)
    if rule.timing == "rbw":
        first = jnp.einsum("bhk,bhkd->bhd", q[:, :, 0], state.S)
        o = jnp.concatenate([first[:, :, None], o[:, :, :-1]], axis=2)
        o = jnp.where(resets[:, None, :, None], 0.0, o)
    return o, final_state(stream, S.astype(state.S.dtype), k, rule)
