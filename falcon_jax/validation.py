"""Argument checks shared by the public functions.

Every failure names the argument and says how to fix it.  The checks read
only static facts (shapes, dtypes, Python options), so they run unchanged
under ``jax.jit``.  The checks of ``variant`` and ``window`` (which fix a state's layout)
live in :mod:`falcon_jax.state` and are re-exported here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from falcon_jax.rules import PER_COLUMN_VARIANTS
from falcon_jax.state import FalconState, check_variant, check_window  # noqa: F401 - re-exported

FORMS = ("recurrent", "parallel", "chunk")
ALIGNMENTS = ("shifted", "same_step")
TIMINGS = ("raw", "rbw")
STEPS = ("normalized", "direct")
IMPLS = ("auto", "mosaic_gpu", "triton", "mosaic_tpu", "xla")  # falcon_jax.kernels.implementation


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")


def check_chunk_size(chunk_size) -> None:
    ok = (not isinstance(chunk_size, bool) and isinstance(chunk_size, (int, np.integer))
          and chunk_size >= 1 and (chunk_size & (chunk_size - 1)) == 0)
    if not ok:
        raise ValueError(f"`chunk_size` must be a positive power of two (e.g. 64); got {chunk_size!r}.")


def check_options(*, form, alignment, timing, step, impl, eps, eps_gamma, scale) -> None:
    _choice("form", form, FORMS)
    _choice("alignment", alignment, ALIGNMENTS)
    _choice("timing", timing, TIMINGS)
    _choice("step", step, STEPS)
    if isinstance(impl, str) or not isinstance(impl, (list, tuple)):
        _choice("impl", impl, IMPLS)
    elif not impl or any(not isinstance(i, str) or i not in IMPLS[1:] for i in impl):
        raise ValueError(f"`impl` as a sequence lists implementations to try in order, each one of "
                         f"{', '.join(repr(c) for c in IMPLS[1:])}; got {impl!r}.")
    if not np.isscalar(eps) or not eps >= 0:
        raise ValueError(f"`eps` must be a float >= 0; got {eps!r}.")
    if not np.isscalar(eps_gamma) or not 0 < eps_gamma < 1:
        raise ValueError(f"`eps_gamma` must be a float in (0, 1); got {eps_gamma!r}.")
    if not np.isscalar(scale):
        raise TypeError(f"`scale` must be a Python or NumPy scalar; got {type(scale).__name__}.")


def _floating(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array; got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must be a floating-point array (bf16, fp16, fp32 or fp64); got dtype {x.dtype}.")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Returns ``(B, T, H, dk, dv)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _floating(name, x)
        if x.ndim != 4:
            raise ValueError(f"`{name}` must have rank 4 [batch, time, heads, dim]; got shape {tuple(x.shape)}.")
    if q.shape != k.shape:
        raise ValueError(f"`q` and `k` must have the same shape [B, T, H, dk]; got {tuple(q.shape)} and {tuple(k.shape)}.")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"`v` must match `q` in [batch, time, heads]; got v {tuple(v.shape)} and q {tuple(q.shape)}.")
    B, T, H, dk = q.shape
    if T < 1:
        raise ValueError("`q`, `k`, `v` must have at least one time step (T >= 1).")
    return B, T, H, dk, v.shape[3]


def check_gate(name: str, x, B: int, T: int, H: int, *, dv: int | None = None, what: str = "") -> None:
    """``x`` must be ``[B, T, H]``, or also ``[B, T, H, dv]`` when ``dv`` is given."""
    _floating(name, x)
    allowed = [(B, T, H)] + ([(B, T, H, dv)] if dv is not None else [])
    if tuple(x.shape) not in allowed:
        shapes = " or ".join(str(list(s)) for s in allowed)
        raise ValueError(f"`{name}` must have shape {shapes}{what}; got {tuple(x.shape)}.")


def check_beta_for_variant(beta, variant: str, B: int, T: int, H: int, dv: int) -> None:
    if variant in PER_COLUMN_VARIANTS:
        check_gate("beta", beta, B, T, H, dv=dv, what=" (one gain per value column, or one per head)")
    elif beta.ndim == 4:
        raise ValueError(
            f"`beta` has per-column gains {tuple(beta.shape)} but variant {variant!r} takes one gain per "
            f"head, shape [B, T, H] = {[B, T, H]}; pass variant '2' or '2A' for per-column gains.")
    else:
        check_gate("beta", beta, B, T, H)


def check_segment_ids(segment_ids, B: int, T: int) -> None:
    if segment_ids is None:
        return
    if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != (B, T):
        got = tuple(segment_ids.shape) if hasattr(segment_ids, "shape") else type(segment_ids).__name__
        raise ValueError(f"`segment_ids` must have shape [B, T] = {[B, T]}; got {got}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"`segment_ids` must be an integer array; got dtype {segment_ids.dtype}.")


def check_state(state, B: int, H: int, dk: int, dv: int, tail: int, *, argname: str = "initial_state") -> None:
    if not isinstance(state, FalconState):
        raise TypeError(f"`{argname}` must be a FalconState (from falcon(..., return_final_state=True) "
                        f"or falcon_jax.init_state); got {type(state).__name__}.")
    expected = {
        "S": (B, H, dk, dv), "last_key": (B, H, dk), "has_key": (B,),
        "tail_x": (B, H, tail, dk), "tail_y": (B, H, tail, dv), "tail_valid": (B, tail),
    }
    for field, shape in expected.items():
        got = tuple(getattr(state, field).shape)
        if got != shape:
            hint = (" (the window tail length is window-1 for variants 3/3A and 0 otherwise: make the state "
                    "with the same variant and window)") if field.startswith("tail") else ""
            raise ValueError(f"`{argname}.{field}` has shape {got} but these inputs need {shape}{hint}.")


def check_kernel_config(config, expected: type) -> None:
    """``falcon(kernel_config=...)`` must be the ``KernelConfig`` of the kernel op that serves the rule."""
    if not isinstance(config, expected):
        raise TypeError(f"`kernel_config` must be a {expected.__module__}.{expected.__qualname__} for this rule (the "
                        f"launch parameters of the kernel op that serves it); got {type(config).__name__}.")
