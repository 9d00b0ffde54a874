"""Decayed delta rule with the residual on the undecayed state: the chunk kernel behind Falcon-1 (and, over
virtual writes, the windowed form behind Falcon-3); its per-column kernel without the residual serves the
inner-product rule with per-column gates (Falcon-2A, ``decayed_attention_per_column``)."""

from falcon_jax.kernels.decayed_delta_rule.api import decayed_attention_per_column, decayed_delta_rule, windowed_delta_rule

__all__ = ["decayed_attention_per_column", "decayed_delta_rule", "windowed_delta_rule"]
