"""The decayed delta rule: the chunk kernel behind Falcon-1 and DeltaNet (the residual on the undecayed state),
Gated DeltaNet (``decay_before_residual=True``: on the decayed state) and, over virtual writes, Falcon-3's windowed
form."""

from falcon_jax.kernels.decayed_delta_rule.api import decayed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.tuned import tuned_config

__all__ = ["KernelConfig", "decayed_delta_rule", "tuned_config"]
