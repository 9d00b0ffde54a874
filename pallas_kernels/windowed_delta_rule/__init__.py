"""The windowed decayed delta rule: the chunk kernel behind Falcon-3 (the decayed delta rule's kernels over a
window's virtual writes)."""

from falcon_jax.kernels.windowed_delta_rule.api import windowed_delta_rule

__all__ = ["windowed_delta_rule"]
