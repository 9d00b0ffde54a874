"""``windowed_delta_rule`` (Falcon-3): every step writes its window's ``W`` pairs, all residuals on the same
(undecayed) previous state (:mod:`.reference`)::

    S_t = (e^{a_t} I − Σ_i w_{t,i} x_{t+i} x_{t+i}ᵀ) S_{t-1} + Σ_i w_{t,i} x_{t+i} y_{t+i}ᵀ,     o_t = S_tᵀ q_t

a rank-W delta transition.  The kernels run it as the decayed delta rule's chunk form over *virtual writes*:
step t becomes ``Wp = next_pow2(W)`` rows ``(t, i)`` with pair ``(x_{t+i}, y_{t+i})`` and weight ``w_{t,i}``
(rows ``i ≥ W`` zero), all sharing step t's write decay ``g_t`` and residual decay ``g_{t-1}``; the triangular
system couples a row only to rows of *earlier steps* (``group = Wp``), so the rows of one step see the same
state.  A window's pairs recur in W steps' rows (the C+W−1 overlap, materialised).  ``chunk_size`` counts rows:
``chunk_size / Wp`` steps per chunk.  ``implementation="xla"`` runs the compact chunk form (:mod:`.compact`) on
chunks of as many steps, each solved on its C + W − 1 distinct pairs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels.common import (check_config, check_operands, check_pieces, empty_result, flatten_pad,
                                       floor_log_decay, next_pow2)
from falcon_jax.kernels.decayed_delta_rule.api import unsupported_reason as delta_rule_reason
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.op import Static, kernel_op
from falcon_jax.kernels.decayed_delta_rule.tuned import tuned_config
from falcon_jax.kernels.windowed_delta_rule.compact import windowed_delta_rule_compact

MAX_SLOTS = 16  # virtual writes per step: one step's rows must fit a 16-row block of the triangular inverse


def unsupported_reason(name: str, window: int, q, y, chunk_size: int, interpret: bool | None = None) -> str | None:
    """Why implementation ``name`` declines a windowed call (None: it serves it): the decayed delta rule's
    reasons, and the ``next_pow2(window)`` virtual writes of a step must fit a 16-row block."""
    if name == "xla":
        return None
    slots = next_pow2(window)
    if slots > MAX_SLOTS:
        return (f"window={window}: the kernel puts next_pow2(window) = {slots} virtual writes per step into its "
                f"16-row blocks (at most {MAX_SLOTS})")
    # (a chunk of at least 16 rows, a power of two, holds a whole number of steps of at most 16 rows)
    return delta_rule_reason(name, q, y, chunk_size, interpret)


def windowed_delta_rule(q, x, y, w, log_gamma, run, initial_state, *, chunk_size: int = 64,
                        implementation="auto", config: KernelConfig | None = None, pieces: int | None = None,
                        interpret: bool | None = None):
    """Windowed decayed delta rule (Falcon-3).

    Args:
      q: ``[B, H, T, dk]``; x: ``[B, H, T+W-1, dk]``, y: ``[B, H, T+W-1, dv]`` (window entry i of step t is
        index t+i: the W−1 older pairs in front); w: ``[B, H, T, W]`` write weights; log_gamma, run:
        ``[B, H, T]`` (as ``decayed_delta_rule``: a log_gamma below −30 counts as −30); initial_state
        ``[B, H, dk, dv]``.
      implementation, config, pieces, interpret: as ``decayed_delta_rule``.
    Returns:
      ``(o [B, H, T, dv] in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    if getattr(w, "ndim", None) != 4 or w.shape[-1] < 1:
        raise ValueError(f"windowed_delta_rule: `w` must be [B, H, T, W] write weights (one per window slot, W >= 1); "
                         f"got {tuple(getattr(w, 'shape', ())) or type(w).__name__}.")
    W = w.shape[-1]
    B, T, H, dk, dv = check_operands("windowed_delta_rule", q, x, y, {"log_gamma": log_gamma}, run, initial_state,
                                     chunk_size=chunk_size, extra=W - 1)
    check_pieces("windowed_delta_rule", pieces)
    check_config("windowed_delta_rule", config, KernelConfig)
    if not jnp.issubdtype(w.dtype, jnp.floating) or tuple(w.shape) != (B, H, T, W):
        raise ValueError(f"windowed_delta_rule: `w` must be floating-point [B, H, T, W] = {[B, H, T, W]} (the "
                         f"leading dims of `q`); got {tuple(w.shape)} {w.dtype}.")
    chunk_size = int(chunk_size)  # a NumPy int would reach the kernels' block shapes
    if B * H == 0:
        return empty_result(B, T, H, dk, dv, y.dtype)
    log_gamma = floor_log_decay(log_gamma)
    name = impl.select("windowed_delta_rule", implementation,
                       lambda n: unsupported_reason(n, W, q, y, chunk_size, interpret))
    if name == "xla":
        steps = max(1, chunk_size // next_pow2(W))
        o, final = windowed_delta_rule_compact(q, x, y, w, log_gamma, run, initial_state, chunk_size=steps)
        return o.astype(y.dtype), final
    interpret = impl.interpret_mode(name, interpret)
    B, H, T, dk = q.shape
    dv = y.shape[-1]
    Wp = next_pow2(W)
    steps = chunk_size // Wp  # steps per chunk
    n_chunks = next_pow2(-(-T // steps))
    Ls = n_chunks * steps  # padded steps
    dtype = q.dtype
    config = config or tuned_config(dtype)
    config = dataclasses.replace(config, block_v=config.block_v_for(B * H, dv, dtype, dk),
                                 grad_block_v=min(config.grad_block_v, dv))
    P = 1 if name == "mosaic_tpu" else config.pieces(B * H, dv // config.block_v, n_chunks, pieces)
    f32 = jnp.float32

    pad = flatten_pad  # [B,H,len,...] -> [BH, n, ...]
    # padding: zero pairs, weights and log decays (identity steps), run continued
    x_e, y_e = pad(x.astype(dtype), Ls + W - 1), pad(y.astype(dtype), Ls + W - 1)

    def virtual(a):  # [BH, Ls+W-1, d] -> [BH, Ls*Wp, d]: row (t, i) = pair t+i, rows i ≥ W zero
        slots = [a[:, i:i + Ls] for i in range(W)] + [jnp.zeros_like(a[:, :Ls])] * (Wp - W)
        return jnp.stack(slots, axis=2).reshape(B * H, Ls * Wp, a.shape[-1])

    q_p = pad(q.astype(dtype), Ls)  # each step reads at its last row (after all its writes)
    q_v = jnp.concatenate([jnp.zeros((B * H, Ls, Wp - 1, dk), dtype), q_p[:, :, None]], axis=2)
    w_v = jnp.pad(pad(w.astype(f32), Ls), [(0, 0), (0, 0), (0, Wp - W)]).reshape(B * H, Ls * Wp)
    st = Static(chunk=chunk_size, config=config, pieces=P, interpret=interpret, implementation=name, group=Wp)
    o, final = kernel_op(q_v.reshape(B * H, Ls * Wp, dk), virtual(x_e), virtual(y_e), w_v,
                         pad(log_gamma.astype(f32), Ls), pad(run.astype(jnp.int32), Ls, "edge"),
                         initial_state.astype(f32).reshape(B * H, dk, dv), st)
    o = o.reshape(B * H, Ls, Wp, dv)[:, :T, Wp - 1]
    return o.reshape(B, H, T, dv), final.reshape(B, H, dk, dv)
