"""Launch parameters of the per-column kernels, and their tuned values."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """``block_v``: value columns per program (several ``[C, block_v]`` fp32 tiles live; on a TPU, Mosaic's blocks
    need a multiple of 128 columns or all of dv, so a narrower width becomes that there); ``num_warps``: Triton
    warps per program."""

    block_v: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if not isinstance(self.block_v, int) or self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"KernelConfig: block_v must be a power of two >= 16, got {self.block_v!r}.")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}.")


# Measured on one H200 (bf16, H16, d128, 8x2048): 32 columns and 4 warps; the same elsewhere until timed.
TUNED: dict[str, KernelConfig] = {"default": KernelConfig()}


def tuned_config() -> KernelConfig:
    return TUNED["default"]
