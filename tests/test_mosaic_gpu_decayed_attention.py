"""The Mosaic GPU (Hopper wgmma + TMA) forward of decayed attention, without a GPU.

* Cross-lowering: ``jit(...).trace(...).lower(lowering_platforms=("cuda",))`` on CPU runs the
  whole Pallas → Mosaic GPU lowering (layout inference, wgmma/TMA shape and swizzle checks,
  SMEM allocation; sm_90 is assumed without a device), at the benchmark shapes and small odd
  ones, forward and forward+backward (the backward is the Triton one).  Compiling to SASS and
  running needs the H200: ``benchmarks/gpu_check_mosaic.py``.
* Numerics: jax's Mosaic GPU interpreter (threads, barriers, TMA and wgmma simulated on CPU)
  against the fp64 reference — skipped: on jax 0.10.2 the interpreted kernel blocks (the
  interpreter lacks ``plgpu.load``/``run_state``/layouts, which the kernel swaps for plain
  reads there, and then waits forever; not isolated yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_attention import decayed_attention
from falcon_jax.kernels.decayed_attention import mosaic_gpu
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference
from tests.helpers import mosaic_lowering_available


needs_lowering = pytest.mark.skipif(not mosaic_lowering_available(),
                                    reason="this jax cannot lower Mosaic GPU kernels for CUDA on CPU")


def _specs(B, H, T, dk, dv, dtype):
    S = jax.ShapeDtypeStruct
    return (S((B, H, T, dk), dtype), S((B, H, T, dk), dtype), S((B, H, T, dv), dtype), S((B, H, T), jnp.float32),
            S((B, H, T), jnp.int32), S((B, H, dk, dv), jnp.float32))


def _lower(fn, specs):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
@pytest.mark.parametrize("B,H,T,dk,dv,pieces", [
    (8, 16, 2048, 128, 128, None),  # benchmark shapes; None: the op's own piece split
    (1, 16, 32768, 128, 128, None),
    (2, 3, 333, 64, 64, None),  # odd T, dk = dv = 64 (one compute warpgroup per CTA)
    (1, 2, 1000, 128, 256, 4),  # two CTAs of two value blocks per (head, piece)
])
def test_forward_lowers_for_cuda(B, H, T, dk, dv, pieces):
    def fwd(q, x, y, log_decay, run, s0):
        return decayed_attention(q, x, y, log_decay, run, s0, implementation="mosaic_gpu", interpret=False,
                                 pieces=pieces)

    text = _lower(fwd, _specs(B, H, T, dk, dv, jnp.bfloat16))
    # the output pass, plus the piece-ends pass when the sequence is split
    assert text.count("mosaic_gpu") >= 1


@needs_lowering
def test_forward_and_backward_lower_for_cuda():
    """The custom VJP: Mosaic GPU forward, Triton backward from the same residuals."""
    def loss(q, x, y, log_decay, run, s0):
        o, s = decayed_attention(q, x, y, log_decay, run, s0, implementation="mosaic_gpu", interpret=False, pieces=2)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    specs = _specs(1, 2, 700, 128, 128, jnp.bfloat16)
    text = _lower(lambda *a: jax.grad(loss, argnums=(0, 1, 2, 3, 5))(*a), specs)
    assert "mosaic_gpu" in text
    for name in ("dstate", "chunk_grads"):
        assert f"falcon_decayed_attention_{name}" in text, name


def test_unsupported_inputs_raise():
    z = lambda *s, dt=jnp.float32: jnp.zeros(s, dt)  # noqa: E731
    args = (z(1, 1, 64, 64), z(1, 1, 64, 64), z(1, 1, 64, 64), z(1, 1, 64), z(1, 1, 64, dt=jnp.int32), z(1, 1, 64, 64))
    with pytest.raises(NotImplementedError, match="bf16 or fp16"):
        decayed_attention(*args, implementation="mosaic_gpu", interpret=False)
    bf = [a.astype(jnp.bfloat16) if i < 3 else a for i, a in enumerate(args)]
    with pytest.raises(NotImplementedError, match="chunk_size"):
        decayed_attention(*bf, chunk_size=32, implementation="mosaic_gpu", interpret=False)
    assert mosaic_gpu.unsupported_reason(128, 96, 64, jnp.bfloat16) is not None
    assert mosaic_gpu.unsupported_reason(128, 128, 64, jnp.bfloat16) is None


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="runs the kernel on a Hopper GPU; jax 0.10.2's CPU interpreter of Mosaic GPU "
                           "kernels hangs on it (cause not isolated), so CPU only cross-lowers it (above)")
@pytest.mark.parametrize("T,dv,pieces,segments", [(150, 128, 1, True), (200, 64, 2, False)])
def test_kernel_matches_reference_on_gpu(T, dv, pieces, segments):
    """The real lowering against the float64 reference (bf16 tiles: 2e-2)."""
    rng = np.random.default_rng(T + dv)
    dk = 64
    q = rng.normal(size=(1, 1, T, dk)) / np.sqrt(dk)
    x = rng.normal(size=(1, 1, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(1, 1, T, dv))
    log_decay = -rng.uniform(0.0, 0.3, size=(1, 1, T))
    if segments:
        starts = rng.uniform(size=(1, 1, T)) < 0.03
        starts[..., 0] = False
        run = np.cumsum(starts, axis=-1)
    else:
        run = np.zeros((1, 1, T), np.int64)
    s0 = rng.normal(size=(1, 1, dk, dv)) * 0.3
    bf = [jnp.asarray(a, jnp.bfloat16) for a in (q, x, y)]
    o, final = decayed_attention(*bf, jnp.asarray(log_decay, jnp.float32), jnp.asarray(run, jnp.int32),
                                 jnp.asarray(s0, jnp.float32), implementation="mosaic_gpu", interpret=False,
                                 pieces=pieces)
    ref = decayed_attention_reference(*(jnp.asarray(a, jnp.float64) for a in bf), jnp.asarray(log_decay),
                                      jnp.asarray(run), jnp.asarray(s0))
    for got, want in zip((o, final), ref):
        got, want = np.asarray(got, np.float64), np.asarray(want)
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 2e-2  # bf16 output, bf16 tiles of S
