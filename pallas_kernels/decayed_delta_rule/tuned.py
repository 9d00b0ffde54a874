"""Tuned launch parameters of ``decayed_delta_rule``: one :class:`KernelConfig` per device kind and dtype.

The values were measured on one NVIDIA H200 (jax 0.11.2; bf16 and fp32 q/k/v, H = 16, d = 128, at 8×2048,
2×8192 and 1×32768 tokens; each choice timed as the whole op, forward and forward+backward).  Other GPUs take
the ``"gpu"`` row; the ``"sm90"`` and ``"sm100"`` rows add what needs ~228 KB of shared memory per SM (the
4-stage output walk).  The TPU kernels read only ``pieces_below`` (they never cut a sequence) and the precision
fields.  Add a row for your device kind after timing it with ``python -m benchmarks.run --suite bench``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import default_gpu_major
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig

_SIXTEEN_BIT = KernelConfig()  # the dataclass defaults are the H200's bf16 values
_FP32 = dataclasses.replace(_SIXTEEN_BIT, grad_block_v=64, wide_walk_programs=None)

TUNED: dict[str, dict[str, KernelConfig]] = {
    "gpu": {"16-bit": _SIXTEEN_BIT, "fp32": _FP32},
    "sm90": {"16-bit": dataclasses.replace(_SIXTEEN_BIT, narrow_output_walk_stages=4), "fp32": _FP32},
    "sm100": {"16-bit": dataclasses.replace(_SIXTEEN_BIT, narrow_output_walk_stages=4), "fp32": _FP32},
    "tpu": {"16-bit": _SIXTEEN_BIT, "fp32": _FP32},
}


def device_key(device=None) -> str:
    """The :data:`TUNED` row of ``device`` (default: the first device): ``"sm90"`` / ``"sm100"`` for GPUs of that
    compute capability, ``"gpu"`` for other GPUs, ``"tpu"``; a CPU (interpret mode) takes the ``"gpu"`` row."""
    device = device or jax.devices()[0]
    if device.platform == "tpu":
        return "tpu"
    major = default_gpu_major() if device is jax.devices()[0] else None
    return {9: "sm90", 10: "sm100"}.get(major, "gpu")


def tuned_config(dtype, device=None) -> KernelConfig:
    """The tuned :class:`KernelConfig` for q, k, v of ``dtype`` on ``device``; change a field with
    ``dataclasses.replace(tuned_config(jnp.bfloat16), block_v=32)``."""
    width = "16-bit" if jnp.dtype(dtype).itemsize == 2 else "fp32"
    return TUNED[device_key(device)][width]
