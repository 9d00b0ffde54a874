"""Baseline rules on the same-step pair ``(k_t, v_t)``, through the same forms as Falcon.

* decayed linear attention (RetNet / Mamba-2 style scalar decay)::

      S_t = γ_t S_{t-1} + β_t k_t v_tᵀ,   γ_t = exp(log_decay_t)

* DeltaNet::

      S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ

* Gated DeltaNet::

      S_t = γ_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
          = γ_t S_{t-1} + β_t k_t (v_t − γ_t S_{t-1}ᵀ k_t)ᵀ

  GDN decays *before* the residual: the prediction is read from the decayed
  state ``γ_t S_{t-1}``.  Falcon-1 reads it from the undecayed ``S_{t-1}``
  (``S_t = γ_t S_{t-1} + η_t x_t (y_t − S_{t-1}ᵀ x_t)ᵀ``, the gradient step on
  the ridge loss), and writes the prefix-aligned pair ``(k_{t-1}, v_t)``.

All read after write: ``o_t = scale · S_tᵀ q_t``.  Gates may be ``[B, T, H]`` arrays or scalars; their
domain is ``beta ≥ 0`` and ``log_decay ≤ 0`` (γ ≤ 1): concrete values outside it raise ``ValueError``,
traced ones are clamped into it.  A ``log_decay`` below −30 counts as −30 (γ = 9e-14, a reset within fp32
rounding), which keeps the chunk forms' cumulative sums exact.  DeltaNet also needs ``β‖k‖² ≤ 2``, which is
the caller's to keep (e.g. β = σ(z) with ℓ2-normalized keys).  Each takes the same
``form``, ``chunk_size``, ``initial_state``, ``return_final_state``,
``segment_ids``, ``impl`` and ``kernel_config`` arguments as :func:`falcon_jax.falcon` (a concrete
``initial_state`` holding NaN or inf is refused there too); a length-1 call with ``initial_state`` is a
decode step.
"""

from __future__ import annotations

from falcon_jax import validation as val
from falcon_jax.falcon import run_rule
from falcon_jax.rules import baseline_rule


def _run(name, q, k, v, inputs, *, form, chunk_size, scale, initial_state, return_final_state,
         segment_ids, impl, kernel_config):
    val.check_options(form=form, alignment="same_step", timing="raw", step="direct", impl=impl, eps=0.0,
                      eps_gamma=0.5, scale=scale)
    val.check_flag("return_final_state", return_final_state)
    val.check_chunk_size(chunk_size)
    B, T, H, _, _ = val.check_qkv(q, k, v)
    inputs = {arg: val.gate_array(arg, x, (B, T, H), q) for arg, x in inputs.items()}
    for arg, x in inputs.items():
        val.check_gate(arg, x, B, T, H)
    inputs = val.baseline_gates_in_domain(inputs)
    val.check_segment_ids(segment_ids, B, T)
    return run_rule(baseline_rule(name), q, k, v, inputs, form=form, chunk_size=chunk_size, scale=scale,
                    initial_state=initial_state, segment_ids=segment_ids, impl=impl,
                    kernel_config=kernel_config, return_final_state=return_final_state)


def decayed_linear_attention(q, k, v, log_decay, beta=None, *, form="chunk", chunk_size=64, scale=1.0,
                             initial_state=None, return_final_state=False, segment_ids=None, impl="auto",
                             kernel_config=None):
    """RetNet / Mamba-2 style: ``S_t = exp(log_decay_t) S_{t-1} + β_t k_t v_tᵀ``.

    q, k ``[B,T,H,dk]``; v ``[B,T,H,dv]``; log_decay ``[B,T,H]`` (≤ 0 for decay);
    beta ``[B,T,H]`` or None (= 1; Mamba-2's Δ_t).  Returns ``[B,T,H,dv]``.
    """
    inputs = {"log_decay": log_decay} if beta is None else {"log_decay": log_decay, "beta": beta}
    return _run("linear_attention", q, k, v, inputs, form=form, chunk_size=chunk_size, scale=scale,
                initial_state=initial_state, return_final_state=return_final_state,
                segment_ids=segment_ids, impl=impl, kernel_config=kernel_config)


def deltanet(q, k, v, beta, *, form="chunk", chunk_size=64, scale=1.0, initial_state=None,
             return_final_state=False, segment_ids=None, impl="auto", kernel_config=None):
    """DeltaNet: ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``; beta ``[B,T,H]``."""
    return _run("deltanet", q, k, v, {"beta": beta}, form=form, chunk_size=chunk_size, scale=scale,
                initial_state=initial_state, return_final_state=return_final_state,
                segment_ids=segment_ids, impl=impl, kernel_config=kernel_config)


def gated_deltanet(q, k, v, beta, log_decay, *, form="chunk", chunk_size=64, scale=1.0, initial_state=None,
                   return_final_state=False, segment_ids=None, impl="auto", kernel_config=None):
    """Gated DeltaNet: ``S_t = γ_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``, ``γ_t = exp(log_decay_t)``."""
    return _run("gated_deltanet", q, k, v, {"beta": beta, "log_decay": log_decay}, form=form,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_final_state=return_final_state, segment_ids=segment_ids, impl=impl, kernel_config=kernel_config)
