"""Launch parameters of ``decayed_attention``'s kernels, and their tuned values per device kind."""

from __future__ import annotations

import dataclasses

from falcon_jax.kernels.common import check_launch_parameters


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Triton launch parameters: value columns per program of the walks (``block_v``), warps and pipelining
    stages per pass, and the program count below which a sequence is cut into pieces walked in parallel
    (``pieces_below``: batch·heads × value blocks × pieces).  The TPU kernels read only ``pieces_below`` (they
    never cut a sequence, so not even that)."""

    block_v: int = 64
    fwd_warps: int = 4
    fwd_stages: int = 3
    state_warps: int = 4
    grad_warps: int = 4
    grad_stages: int = 1
    pieces_below: int = 128

    def __post_init__(self):
        check_launch_parameters(self, widths=("block_v",), warps=("fwd_warps", "state_warps", "grad_warps"),
                                counts=("fwd_stages", "grad_stages"), thresholds=("pieces_below",))


# Measured on one H200 (jax 0.11.2, bf16 q/k/v, H16, d128 at 8x2048, 2x8192 and 1x32768; the whole op timed
# forward and forward+backward): 64 value columns, 4 warps, 3 forward stages, pieces until 128 programs
# (against 264: 1.010 vs 1.316 ms fwd+bwd at 8x2048, 2.361 vs 2.574 at 1x32768).  Other devices take it too.
TUNED: dict[str, KernelConfig] = {"default": KernelConfig()}


def tuned_config() -> KernelConfig:
    return TUNED["default"]
