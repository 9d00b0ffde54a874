"""Decayed attention with scalar gates: the chunk kernel behind Falcon-1A, Falcon-3A and decayed linear
attention."""

from falcon_jax.kernels.decayed_attention.api import decayed_attention
from falcon_jax.kernels.decayed_attention.config import KernelConfig

__all__ = ["KernelConfig", "decayed_attention"]
