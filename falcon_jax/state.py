"""The recurrent state a Falcon layer carries between calls and decode steps.

One ``FalconState`` holds everything needed to continue a sequence exactly
(docs/rules.md; the paper's App. C.7):

* ``S``          ``[B, H, dk, dv]`` the fast-weight matrix (fp32, fp64 under x64).
* ``last_key``   ``[B, H, dk]`` the last key seen; under the shifted alignment it
                 is the write feature ``x_0`` of the next call.
* ``has_key``    ``[B]`` bool; False for a fresh state, so the next position is
                 the boundary sentinel (no write, no decay).
* ``tail_x``     ``[B, H, W-1, dk]`` the last ``W-1`` write pairs, oldest first,
* ``tail_y``     ``[B, H, W-1, dv]`` for the sliding-window rules 3 and 3A
* ``tail_valid`` ``[B, W-1]`` bool  (``W-1 = 0`` for every other rule).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from falcon_jax.rules import VARIANTS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FalconState:
    S: jax.Array
    last_key: jax.Array
    has_key: jax.Array
    tail_x: jax.Array
    tail_y: jax.Array
    tail_valid: jax.Array

    @property
    def tail_length(self) -> int:
        """Number of earlier write pairs kept for the sliding window (``W-1``)."""
        return self.tail_x.shape[-2]

    def replace(self, **changes) -> "FalconState":
        return dataclasses.replace(self, **changes)


def check_variant(variant) -> None:
    """``variant`` names a Falcon rule (it fixes what a state holds)."""
    if not isinstance(variant, str) or variant.upper() not in VARIANTS:
        raise ValueError(f"`variant` must be one of {', '.join(repr(v) for v in VARIANTS)}; got {variant!r}.")


def check_window(window) -> None:
    """``window`` is a sliding-window length (it fixes the state's tail, ``W-1`` pairs)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"`window` must be an int >= 1 (the number of pairs in the sliding window); got {window!r}.")


def tail_length_for(variant: str, window: int) -> int:
    """``W-1`` for the sliding-window rules, 0 for the others."""
    return window - 1 if variant in ("3", "3A") else 0


def empty_state(batch: int, heads: int, dk: int, dv: int, tail: int, dtype) -> FalconState:
    return FalconState(
        S=jnp.zeros((batch, heads, dk, dv), dtype),
        last_key=jnp.zeros((batch, heads, dk), dtype),
        has_key=jnp.zeros((batch,), bool),
        tail_x=jnp.zeros((batch, heads, tail, dk), dtype),
        tail_y=jnp.zeros((batch, heads, tail, dv), dtype),
        tail_valid=jnp.zeros((batch, tail), bool),
    )


def init_state(batch: int, heads: int, dk: int, dv: int, *, variant: str, window: int = 4,
               dtype=jnp.float32) -> FalconState:
    """A fresh (all-zero) state for ``falcon(..., initial_state=...)`` or ``falcon_step``.

    Its first position is the boundary sentinel under the shifted alignment:
    there is no previous key, so nothing is written and nothing decays.
    ``batch`` and ``heads`` may be 0 (empty arrays, which falcon and falcon_step take); ``dk``, ``dv`` >= 1.
    """
    check_variant(variant)
    check_window(window)
    for name, value, low in (("batch", batch, 0), ("heads", heads, 0), ("dk", dk, 1), ("dv", dv, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"init_state: `{name}` must be an int >= {low}; got {value!r}.")
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:  # falcon and falcon_step take floating states only
        raise TypeError(f"init_state: `dtype` must be a floating dtype (jnp.float32, or jnp.float64 under x64); "
                        f"got {dtype!r}.")
    return empty_state(int(batch), int(heads), int(dk), int(dv), tail_length_for(variant, window), dtype)
