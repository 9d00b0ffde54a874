"""Launch parameters of the per-column kernels, and their tuned values."""

from __future__ import annotations

import dataclasses

from falcon_jax.kernels.common import check_launch_parameters

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Falcon-2 (``decayed_delta_rule_per_column``) and the TPU kernels: ``block_v``, value columns per program
    (several ``[C, block_v]`` fp32 tiles live; on a TPU, Mosaic's blocks need a multiple of 128 columns or all
    of dv, so a narrower width becomes that there), and ``num_warps``, Triton warps per program.

    Falcon-2A on a GPU (``decayed_attention_per_column``, :mod:`.triton_attention`): ``walk_block_v`` value
    columns per program of the state walks, with ``walk_warps`` warps and ``walk_stages`` pipelining stages;
    ``pieces_below``: cut the sequence into pieces while fewer walk programs (batch·heads × value blocks × pieces)
    would run; ``out_block_v``: the value columns of one program of the output pass (grid batch·head × chunk ×
    value block), with ``out_warps`` warps; ``grad_block_v``: the value columns of one program of the column
    gradient pass (grid batch·head × chunk × value block; several ``[C, width]`` fp32 tiles live beside the
    ``[C, C]`` scores and the block's share of dA), with ``grad_warps`` warps, and the width of the row gradient
    pass's state terms; ``row_grad_warps``: warps of the row gradient pass (grid batch·head × chunk: dq, dx)."""

    block_v: int = 32
    num_warps: int = 4
    walk_block_v: int = 64
    walk_warps: int = 4
    walk_stages: int = 3
    pieces_below: int = 128
    out_block_v: int = 64
    out_warps: int = 4
    grad_block_v: int = 32
    grad_warps: int = 8
    row_grad_warps: int = 4

    def __post_init__(self):
        check_launch_parameters(self, widths=("block_v", "walk_block_v", "out_block_v", "grad_block_v"),
                                warps=("num_warps", "walk_warps", "out_warps", "grad_warps",
                                       "row_grad_warps"),
                                counts=("walk_stages", "pieces_below"))


# Falcon-2 measured on one H200 (bf16, H16, d128, 8x2048): 32 columns and 4 warps.  Falcon-2A's fields: the
# walks as decayed_attention's (64 columns, 4 warps, 3 stages, pieces below 128 programs), the row gradient pass
# 4 warps as decayed_attention's chunk gradients; the output pass 64 columns, 4 warps and the column gradients 32
# columns, 8 warps measured best on one H100 (8x2048, 2x8192; docs/kernels.md: output 16, 32, 64, 128 columns with
# 4 or 8 warps, column gradients 16 columns or 4 warps).  The same elsewhere.
TUNED: dict[str, KernelConfig] = {"default": KernelConfig()}


def tuned_config() -> KernelConfig:
    return TUNED["default"]
