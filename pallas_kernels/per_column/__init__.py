"""Per-column gates: the decayed delta rule (Falcon-2) and decayed attention (Falcon-2A) with one write weight and
one decay per value column."""

from falcon_jax.kernels.per_column.api import decayed_attention_per_column, decayed_delta_rule_per_column
from falcon_jax.kernels.per_column.config import KernelConfig

__all__ = ["KernelConfig", "decayed_attention_per_column", "decayed_delta_rule_per_column"]
