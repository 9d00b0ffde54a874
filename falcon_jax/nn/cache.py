"""Decode caches (pytrees) for the mixers and the language model.

* :class:`RecurrentCache` — a Falcon or recurrent-baseline layer: the rule's
  :class:`~falcon_jax.FalconState` (``S [B,H,dk,dv]``, last key, window tail) plus the short
  convolutions' last ``K-1`` inputs.  Its size is fixed by the model, not by the number of
  tokens seen: O(1) memory in the sequence length.
* :class:`KVCache` — a softmax-attention layer: keys and values preallocated to ``max_len``
  and the number of positions filled.  It is the only cache whose size depends on
  ``max_len``.
* :class:`LMCache` — one cache per layer and the number of tokens consumed.

The positions are one scalar for the whole batch: prompts of different lengths run right-aligned, the
padding in front in a packed segment of its own that no layer passes on
(``FalconLM.generate(..., lengths=...)``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from falcon_jax.state import FalconState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentCache:
    """``state``: FalconState of the layer's rule;  ``conv``: ``{"q","k","v": [B, K-1, C]}``
    (empty when the layer has no short convolution)."""

    state: FalconState
    conv: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """``k [B, L, H, dk]``, ``v [B, L, H, dv]`` with ``L = max_len``, in the layer's compute dtype;
    ``length`` int32 ``[]``: positions ``[0, length)`` are filled; ``seg_start`` int32 ``[B]``: where
    the packed segment that decoding continues begins (earlier keys are never attended to).  Writing past
    ``max_len`` is an error (``ValueError`` when ``length`` is concrete, NaN outputs under ``jit``)."""

    k: jax.Array
    v: jax.Array
    length: jax.Array
    seg_start: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMCache:
    """``layers``: one cache per layer;  ``length`` int32 ``[]``: tokens consumed so far."""

    layers: tuple
    length: jax.Array


def cache_nbytes(cache) -> int:
    """Total bytes of the arrays in a cache pytree."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(cache))


def cache_shapes(cache):
    """The pytree of ``(shape, dtype)`` of a cache (for checking that decoding does not grow it)."""
    return jax.tree_util.tree_map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), cache)
