"""Small building blocks shared by the mixers and the model.

Every parameter carries *logical* axis names (``nnx.with_partitioning``, metadata
``out_sharding``) from this vocabulary; :mod:`falcon_jax.nn.sharding` maps them to mesh axes:

============  ==========================================================
``vocab``     the vocabulary axis of the (tied) embedding
``embed``     the model width D (input side of projections)
``heads``     the flattened heads·head_dim axis of q/k/v/gate/out projections,
              per-head gate projections and per-head vectors
``mlp``       the SwiGLU hidden axis F
``norm``      RMSNorm weights (replicated by default)
``conv``      the tap axis of the short convolutions (replicated)
============  ==========================================================

Params are created with ``eager_sharding=False``: a model can be built without a mesh
and placed on one later (:func:`falcon_jax.nn.sharding.shard_model`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from falcon_jax import context_parallel


def normal_init(std: float):
    return nnx.initializers.normal(stddev=std)


def partitioned(init, axes: tuple):
    """``init`` with the logical axis names ``axes`` attached (no eager placement)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def make_param(rngs: nnx.Rngs, init, shape: tuple, axes: tuple, param_dtype) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` initialised by ``init(key, shape, dtype)`` with logical ``axes``."""
    return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=axes, eager_sharding=False)


def dense(d_in: int, d_out: int, axes: tuple, *, std: float, rngs: nnx.Rngs, dtype, param_dtype) -> nnx.Linear:
    """A bias-free ``nnx.Linear`` ``[d_in] -> [d_out]``, kernel ~ N(0, std²), kernel axes ``axes``."""
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=partitioned(normal_init(std), axes), rngs=rngs)


def check_real(owner: str, field: str, value, low: float, high: float | None = None, *, low_ok: bool = True,
               meaning: str = "") -> float:
    """``value`` as a float if it is a finite real number in ``[low, high)`` (``(low, …)`` when not ``low_ok``),
    else a ValueError naming ``owner.field`` (a negative norm epsilon or a RoPE base of 0 gives NaN outputs)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= low if low_ok else value > low) and (high is None or value < high))
    if not ok:
        where = f"in [{low}, {high})" if high is not None else f"{'>=' if low_ok else '>'} {low}"
        raise ValueError(f"{owner}: {field}={value!r} must be a finite number {where}{meaning}.")
    return float(value)


def check_size(owner: str, field: str, value) -> int:
    """``value`` as an int if it is a Python or NumPy int >= 1 (not a bool), else a ValueError naming
    ``owner.field``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{owner}: {field}={value!r} must be an int >= 1.")
    return int(value)


# Rows whose largest |x| reaches 2^_SCALE_FROM are divided by a power of two that brings it below 2^_SCALE_TO
# before squaring: a float32 square overflows from |x| ≈ 1.8e19 (the plain formula gives 0 for the whole row), and
# the sum of n squares below 2^32 stays finite for any n < 2^96.  Rows below 2^_SCALE_FROM keep the factor 1: their
# results are the plain formula's, bit for bit; above it the power of two divides exactly, and only eps's share
# (negligible there) is rounded differently.
_SCALE_FROM = 32
_SCALE_TO = 16


def _row_scale(xf: jax.Array) -> jax.Array:
    """A power of two ``s`` per row of ``xf`` (over the last axis, kept as size 1) such that ``max|xf · s| < 2^16``
    where ``max|xf| >= 2^32``, and ``s = 1`` elsewhere; ``s`` is a normal number of ``xf.dtype`` (float32 or
    float64), built from its exponent bits, so multiplying by it is exact."""
    fi = jnp.finfo(xf.dtype)
    itype = jnp.int32 if fi.bits == 32 else jnp.int64
    m = jax.lax.stop_gradient(jnp.max(jnp.abs(xf), axis=-1, keepdims=True))
    _, e = jnp.frexp(m)  # m = f · 2^e, f in [0.5, 1): m < 2^e
    shift = jnp.where(e > _SCALE_FROM, e - _SCALE_TO, 0).astype(itype)  # at most maxexp - 16: s stays normal
    biased = (fi.maxexp - 1) - shift  # the biased exponent of 2^-shift
    return jax.lax.bitcast_convert_type(biased << fi.nmant, xf.dtype)


def _normalize(x: jax.Array, eps: float, reduce) -> jax.Array:
    """``x · rsqrt(reduce(x²) + eps)`` for ``reduce`` a mean or sum over the last axis, in fp32 (or wider), returned
    in ``x.dtype``; as ``(s·x) · rsqrt(reduce((s·x)²) + eps·s²)`` with ``s`` from :func:`_row_scale`, so that a
    finite row of large magnitude does not overflow (s = 1 for |x| < 2^32)."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    s = _row_scale(xf)
    xs = xf * s
    y = xs * jax.lax.rsqrt(reduce(xs * xs, axis=-1, keepdims=True) + eps * s * s)
    return y.astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x², -1) + eps)`` computed in fp32 (or wider), returned in ``x.dtype``; rows whose squares
    overflow fp32 are scaled by a power of two first (:func:`_normalize`)."""
    return _normalize(x, eps, jnp.mean)


def l2_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(sum(x², -1) + eps)`` in fp32 (or wider), returned in ``x.dtype``; rows whose squares overflow
    fp32 are scaled by a power of two first (:func:`_normalize`)."""
    return _normalize(x, eps, jnp.sum)


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x²) + eps) · scale`` over the last axis; ``scale [dim]`` starts at 1."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.eps = check_real("RMSNorm", "eps", eps, 0.0, low_ok=False,
                              meaning=" (0 would divide an all-zero row by zero: NaN)")
        self.dim = dim
        self.dtype = dtype
        self.scale = make_param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if getattr(x, "ndim", 0) < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: x must be [..., dim={self.dim}]; got shape {tuple(getattr(x, 'shape', ()))}.")
        return rms_normalize(x, self.eps).astype(self.dtype) * self.scale[...].astype(self.dtype)


class ShortConv(nnx.Module):
    """Causal depthwise convolution of width K over time, per channel::

        y_t[c] = Σ_{i<K} w[i, c] · x_{t-K+1+i}[c] · [seg(t-K+1+i) = seg(t)]

    x ``[B, T, C]`` -> y ``[B, T, C]``.  ``state [B, K-1, C]`` holds the last K-1 inputs of the
    previous call (zeros for a fresh sequence), so a long input cut in pieces gives the same
    output.  Positions of another packed segment (``segment_ids [B, T]``; a segment is a stretch of equal ids, so an
    id that comes back after a change starts a new one) never contribute; the state counts as part of the first
    segment of ``x``.
    Init: ``w ~ U(±1/√K)`` (the usual fan-in bound of a depthwise conv).
    """

    def __init__(self, channels: int, width: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.channels = check_size("ShortConv", "channels", channels)
        self.width = check_size("ShortConv", "width", width)
        self.dtype = dtype
        bound = 1.0 / math.sqrt(width)
        init = nnx.initializers.uniform(scale=2 * bound)
        self.kernel = make_param(rngs, lambda k, s, d: init(k, s, d) - jnp.asarray(bound, d), (width, channels),
                                 ("conv", "heads"), param_dtype)

    def init_state(self, batch: int, dtype) -> jax.Array:
        return jnp.zeros((batch, self.width - 1, self.channels), dtype)

    def __call__(self, x: jax.Array, state: jax.Array | None = None, segment_ids: jax.Array | None = None):
        """Returns ``(y [B, T, C], new_state [B, K-1, C])``."""
        if getattr(x, "ndim", None) != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"ShortConv: x must be [B, T, channels={self.channels}]; got shape "
                             f"{tuple(getattr(x, 'shape', ()))}.")
        B, T, C = x.shape
        K = self.width
        if state is not None and tuple(getattr(state, "shape", ())) != (B, K - 1, C):
            # a state of another length would shift every output (T - 1 or T + 3 outputs came back)
            raise ValueError(f"ShortConv: state must be [B, width - 1, channels] = {(B, K - 1, C)} (the last "
                             f"width - 1 inputs of the previous call, or init_state(B, dtype)); got shape "
                             f"{tuple(getattr(state, 'shape', ()))}.")
        w = self.kernel[...].astype(x.dtype)
        y = None
        if state is None:
            # a sequence split over devices (context parallelism): each device its slice, the K-1 inputs before it
            # from the previous device; before position 0 the (zero) state, whose taps add nothing
            y = context_parallel.halo_map(
                lambda ext, seg_ext, w: _taps(ext, w, None if seg_ext is None else _unbroken(seg_ext, K)),
                (x, segment_ids), (w,), halo=K - 1)
            state = self.init_state(B, x.dtype)
        ext = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
        if segment_ids is not None:
            # the state's positions count as the first segment's: they carry the first id, so a tap reaching back
            # before position 0 is kept where no id changes between position 0 and t
            seg_ext = jnp.concatenate([jnp.repeat(segment_ids[:, :1], K - 1, axis=1), segment_ids], axis=1)
        if y is None:
            y = _taps(ext, w, None if segment_ids is None else _unbroken(seg_ext, K))
        new_state = ext[:, T:]  # the last K-1 inputs
        if segment_ids is not None:  # only the last segment's inputs carry over: the last output's taps 1..K-1
            last = _unbroken(seg_ext[:, -K:], K)
            keep = jnp.stack([last(i, 1)[:, 0] for i in range(1, K)], axis=1)
            new_state = jnp.where(keep[..., None], new_state, 0)
        return y, new_state


def _unbroken(seg_ext, K: int):
    """``same(i, L)`` for :func:`_taps` from the ids ``seg_ext [B, K-1+L]`` of the extended input: tap i of output t
    (extended positions t+i .. t+K-1) is kept where no id changes between them.  Adjacent ids are compared, not the
    tap's id with t's: an id that comes back after a change is another segment (as for the rules)."""
    L = seg_ext.shape[1] - K + 1
    step = seg_ext[:, 1:] == seg_ext[:, :-1]  # [B, K-2+L]: no change from extended position m to m+1
    kept = [jnp.ones((seg_ext.shape[0], L), bool)]  # tap K-1 is position t itself
    for i in range(K - 2, -1, -1):
        kept.insert(0, kept[0] & step[:, i:i + L])
    return lambda i, _: kept[i]


def _taps(ext, w, same=None):
    """``y[:, t] = Σ_i w[i] · ext[:, t + i] · same(i, L)[:, t]`` for the ``L = len(ext) − K + 1`` outputs of the
    extended input ``ext [B, K-1+L, C]``; ``same(i, L)``: ``[B, L]`` bool, tap i stays in position t's segment."""
    K = w.shape[0]
    L = ext.shape[1] - K + 1
    y = jnp.zeros(ext.shape[:1] + (L,) + ext.shape[2:], ext.dtype)
    for i in range(K):  # K is 4: an unrolled sum of shifted slices beats a conv call here
        tap = ext[:, i:i + L] * w[i]
        if same is not None:
            tap = jnp.where(same(i, L)[..., None], tap, 0)
        y = y + tap
    return y
