"""The decayed delta rule with the residual on the undecayed state: the chunk kernel behind Falcon-1 and DeltaNet
(and, over virtual writes, Falcon-3's windowed form)."""

from falcon_jax.kernels.decayed_delta_rule.api import decayed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.tuned import tuned_config

__all__ = ["KernelConfig", "decayed_delta_rule", "tuned_config"]
