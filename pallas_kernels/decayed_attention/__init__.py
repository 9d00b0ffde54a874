"""Decayed attention with scalar gates: the chunk kernel behind Falcon-1A and decayed linear attention."""

from falcon_jax.kernels.decayed_attention.api import decayed_attention

__all__ = ["decayed_attention"]
