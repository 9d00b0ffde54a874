"""Causal softmax attention within packed segments, fused: JAX's Pallas GPU flash attention.

    o_t = Σ_{s ≤ t, seg(s) = seg(t)} softmax_s(scale · q_t·k_s) v_s
    q, k [B, T, H, dk],  v [B, T, H, dv],  segment_ids [B, T] (None: one sequence per row)  ->  o [B, T, H, dv]

:func:`flash_attention` runs ``jax.experimental.pallas.ops.gpu.attention.mha`` (Pallas's Triton lowering, with
its own Triton backward) with ``causal=True`` and the ids as its ``segment_ids``.  Neither the scores nor a
``T × T`` mask are ever stored: its memory is O(T) per row and head (q, k, v, o and the log-sum-exp of each
query, kept for the backward).  Its work is that of causal attention: the kernel skips the key blocks after a
query block, not those of other segments.  Around the kernel:

* T is padded at the end to a multiple of the block (``block``, cut to the next power of two ≥ 16 of a shorter
  T): a padded key comes after every real query, so causally no real query sees it, and a padded query's
  output is dropped, so its cotangent, and its share of the gradients of k and v, is zero.
* dk and dv are padded with zeros to one power of two ≥ 16 (the kernel takes one head dimension, its matrix
  products tiles of at least 16): zero columns of q and k leave every score unchanged, zero columns of v give
  output columns that are dropped.  ``scale`` defaults to ``1/√dk`` of the unpadded dk.
* The kernel's index arithmetic mixes int32 and Python ints, which ``jax_enable_x64`` turns into a type
  error, so its forward and backward are traced with x64 off (a ``custom_vjp`` around the kernel's own).

:func:`flash_attention_reason` says why the kernel declines a call (None when it serves it).  Off a GPU the
kernel runs in Pallas's interpret mode (``interpret=None``), which is how the tests run it on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from falcon_jax.kernels.common import next_pow2
from falcon_jax.kernels.implementation import accelerator_reason, interpret_mode

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 128  # tests/test_gpu_attention.py checks head dimensions 64 and 128 on a GPU


def _padded_head_dim(dk: int, dv: int) -> int:
    return max(16, next_pow2(max(dk, dv)))


def flash_attention_reason(q, k, v, interpret: bool | None = None) -> str | None:
    """Why :func:`flash_attention` declines these q, k, v (anything with ``.shape`` and ``.dtype``), or None:
    dtypes other than bf16/fp16/fp32 (q, k and v alike), head dimensions past ``MAX_HEAD_DIM`` once padded,
    or ``interpret=False`` off a GPU."""
    dtypes = {jnp.dtype(a.dtype) for a in (q, k, v)}
    if len(dtypes) > 1 or dtypes.pop() not in DTYPES:
        return (f"dtypes q {jnp.dtype(q.dtype)}, k {jnp.dtype(k.dtype)}, v {jnp.dtype(v.dtype)}: the kernel takes "
                f"bf16, fp16 or fp32, the same for q, k and v")
    d = _padded_head_dim(q.shape[-1], v.shape[-1])
    if d > MAX_HEAD_DIM:
        return (f"head dimensions dk={q.shape[-1]}, dv={v.shape[-1]} pad to {d} > {MAX_HEAD_DIM}, past the "
                f"head dimensions this kernel's tiles are checked for")
    return accelerator_reason("triton", interpret)


def _check(q, k, v, segment_ids, scale, block: int, backward_block: int) -> None:
    for name, a in (("q", q), ("k", k), ("v", v), ("segment_ids", segment_ids)):
        if a is not None and not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"flash_attention: `{name}` must be an array; got {type(a).__name__}.")
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"flash_attention: q, k must be [B, T, H, dk] and v [B, T, H, dv] with the same B, T, H; "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}.")
    if segment_ids is not None:
        if tuple(segment_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"flash_attention: segment_ids must be [B, T] = {tuple(q.shape[:2])}; got "
                             f"{tuple(segment_ids.shape)}.")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"flash_attention: segment_ids must be integers (packed-document ids); got "
                            f"{segment_ids.dtype}.")
    for name, b in (("block", block), ("backward_block", backward_block)):
        if not (isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 16 and b & (b - 1) == 0):
            raise ValueError(f"flash_attention: {name}={b!r} must be a power of two >= 16 (e.g. 128 or 32).")
    if scale is not None:
        # the kernel takes the scale as a constant: a traced one cannot reach it, a NaN or inf gives NaN outputs
        if isinstance(scale, jax.core.Tracer) or isinstance(scale, bool):
            raise TypeError(f"flash_attention: `scale` must be a concrete finite number (the kernel takes it as a "
                            f"constant), or None for 1/sqrt(dk); got {scale!r}.")
        try:
            value = None if isinstance(scale, (str, bytes)) else float(scale)
        except (TypeError, ValueError):
            value = None
        if value is None or not np.isfinite(value):
            raise ValueError(f"flash_attention: `scale` must be a finite number, or None for 1/sqrt(dk); got "
                             f"{scale!r}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _mha(q, k, v, segment_ids, options):
    from jax.experimental.pallas.ops.gpu import attention

    with jax.enable_x64(False):
        return attention.mha(q, k, v, segment_ids, **dict(options))


def _mha_fwd(q, k, v, segment_ids, options):
    from jax.experimental.pallas.ops.gpu import attention

    with jax.enable_x64(False):
        o, vjp = jax.vjp(lambda q, k, v: attention.mha(q, k, v, segment_ids, **dict(options)), q, k, v)
    return o, vjp  # the vjp is a pytree of the kernel's residuals: q, k, v, ids, o, log-sum-exp


def _mha_bwd(options, vjp, do):
    with jax.enable_x64(False):
        dq, dk, dv = vjp(do)
    return dq, dk, dv, None


_mha.defvjp(_mha_fwd, _mha_bwd)


def flash_attention(q, k, v, segment_ids=None, *, scale: float | None = None, interpret: bool | None = None,
                    block: int = 128, backward_block: int = 32):
    """Causal softmax attention of ``q, k [B, T, H, dk]``, ``v [B, T, H, dv]`` within the segments of
    ``segment_ids [B, T]`` (equal ids attend to each other; None: one sequence per row) -> ``o [B, T, H, dv]``
    in q's dtype (see the module docstring for the equation and the padding).

    ``scale``: the score scale (default ``1/√dk``).  ``block``: the forward kernel's query and key block,
    ``backward_block`` the backward's (powers of two ≥ 16; the block is cut to the next power of two ≥ 16 of a
    shorter T).  ``interpret``: None runs Pallas's interpret mode off a GPU.  Raises ``NotImplementedError``
    with :func:`flash_attention_reason`'s reason when the kernel declines the call."""
    _check(q, k, v, segment_ids, scale, block, backward_block)
    reason = flash_attention_reason(q, k, v, interpret)
    if reason is not None:
        raise NotImplementedError(f"flash_attention declined: {reason}.")
    from jax.experimental.pallas.ops.gpu import attention

    B, T, H, dk = q.shape
    dv = v.shape[-1]
    d = _padded_head_dim(dk, dv)
    block = min(int(block), max(16, next_pow2(T)))
    backward_block = min(int(backward_block), block)
    length = -(-T // block) * block

    def pad(a):
        if a.shape[1] == length and a.shape[-1] == d:
            return a
        return jnp.pad(a, ((0, 0), (0, length - T), (0, 0), (0, d - a.shape[-1])))

    ids = None
    if segment_ids is not None:
        ids = jnp.asarray(segment_ids).astype(jnp.int32)
        if length != T:  # padded queries continue the last segment; their outputs are dropped
            ids = jnp.pad(ids, ((0, 0), (0, length - T)), mode="edge")
    sizes = attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=backward_block,
                                 block_kv_dkv=backward_block, block_q_dq=backward_block, block_kv_dq=backward_block)
    options = (("sm_scale", float(dk ** -0.5 if scale is None else scale)), ("causal", True),
               ("block_sizes", sizes), ("interpret", interpret_mode("triton", interpret)))
    o = _mha(pad(q), pad(k), pad(v), ids, options)
    return o[:, :T, :, :dv]
