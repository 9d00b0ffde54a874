"""Decayed delta rule with the residual on the undecayed state: the chunk kernel behind Falcon-1 (and, over
virtual writes, the windowed form behind Falcon-3)."""

from pallas_kernels.decayed_delta_rule.api import decayed_delta_rule, windowed_delta_rule

__all__ = ["decayed_delta_rule", "windowed_delta_rule"]
