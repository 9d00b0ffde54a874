"""Flax NNX layers and language models built on the Falcon rules.

* mixers: :class:`FalconAttention` (docs/layers.md) and the baselines :class:`SoftmaxAttention`
  (RoPE Transformer), :class:`RetNetMixer`, :class:`Mamba2Mixer`, :class:`DeltaNetMixer`,
  :class:`GatedDeltaNetMixer`;
* blocks: :class:`RMSNorm`, :class:`SwiGLU`, :class:`DecoderBlock`;
* the model: :class:`LMConfig` (``LMConfig.preset(name)``), :class:`FalconLM`
  (``generate``, ``init_cache``), :func:`lm_loss`, :func:`param_counts`,
  :func:`expected_param_count`, :func:`summarize_params`;
* decode caches: :class:`RecurrentCache`, :class:`KVCache`, :class:`LMCache`;
* sharding: :func:`logical_to_mesh_rules`, :func:`shard_model`, :func:`create_sharded`.
"""

from falcon_jax.nn.attention import FalconAttention, RecurrentMixer
from falcon_jax.nn.baselines import (DeltaNetMixer, GatedDeltaNetMixer, Mamba2Mixer, RetNetMixer,
                                     SoftmaxAttention, rope)
from falcon_jax.nn.blocks import DecoderBlock, SwiGLU, make_mixer
from falcon_jax.nn.cache import KVCache, LMCache, RecurrentCache, cache_nbytes, cache_shapes
from falcon_jax.nn.config import MIXER_NAMES, LMConfig, MixerSpec, expected_param_count, parse_mixer
from falcon_jax.nn.layers import RMSNorm, ShortConv
from falcon_jax.nn.model import (FalconLM, abstract_model, cross_entropy, lm_loss, param_counts,
                                 summarize_params)
from falcon_jax.nn.sharding import (DEFAULT_RULES, batch_spec, create_sharded, logical_spec,
                                    logical_to_mesh_rules, shard_model, state_shardings)

__all__ = [
    "DEFAULT_RULES", "DecoderBlock", "DeltaNetMixer", "FalconAttention", "FalconLM", "GatedDeltaNetMixer",
    "KVCache", "LMCache", "LMConfig", "MIXER_NAMES", "Mamba2Mixer", "MixerSpec", "RMSNorm", "RecurrentCache",
    "RecurrentMixer", "RetNetMixer", "ShortConv", "SoftmaxAttention", "SwiGLU", "abstract_model", "batch_spec",
    "cache_nbytes", "cache_shapes", "create_sharded", "cross_entropy", "expected_param_count", "lm_loss",
    "logical_spec", "logical_to_mesh_rules", "make_mixer", "param_counts", "parse_mixer", "rope",
    "shard_model", "state_shardings", "summarize_params",
]
