"""``KernelConfig``: the launch parameters and precision of ``decayed_delta_rule``'s kernels, and the rules that
turn them into one call's choices.

A walk carries each (batch·head, value block)'s state through the chunks one after another, so how many
*programs* a walk runs (batch·heads × value blocks × pieces of the sequence) decides most choices: the widths of
the value blocks, whether the forward is fused or split, how deep the walks pipeline, and whether the sequence
is cut into pieces.  The thresholds are fields, so a tuned table (:mod:`.tuned`) can hold them per device kind.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from falcon_jax.kernels.common import check_launch_parameters, pieces_for

PRECISIONS = ("input", "fp32")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (Triton warps, pipelining stages, value-block widths, program-count thresholds) and
    precision options.  The defaults are the tuned bf16 values of an H200 (:func:`.tuned.tuned_config` gives
    the row for a device and dtype); ``None`` widths are chosen per call by the rules below."""

    # value columns per program: the fused walks, the split walks, the chunk gradients' value and key halves
    block_v: int | None = None
    split_block_v: int | None = None
    grad_block_v: int = 128
    grad_block_k: int = 32
    # Triton warps and software-pipelining stages per pass (tri: the triangular inverse, one warp: its 16-row
    # substitution is serial; fwd: the forward walks; state / prepare: the reverse walk and its preparation;
    # grad: the chunk gradients).  fwd_stages None: by the output walk's program count (output_walk_stages).
    tri_warps: int = 1
    fwd_warps: int = 4
    fwd_stages: int | None = None
    state_warps: int = 4
    state_stages: int = 3
    prepare_warps: int = 4
    grad_warps: int = 4
    grad_stages: int = 3
    # program-count rules (batch·heads × value blocks × pieces)
    fill_programs: int = 128  # programs that fill the GPU (about one per SM): the split forward and narrower
    # walks below it
    few_output_programs: int = 264  # up to this many: the scores from their own kernel, 3+ stages; above: 2
    narrow_output_walk_stages: int = 3  # stages of a few-program output walk over ≤ 16 columns of 16-bit tiles
    wide_walk_programs: int | None = 256  # 64-column fused walks from this many programs (16-bit, dk ≤ 128)
    q_term_in_prepare_from: int = 256  # the Triton reverse walk reads (c ⊙ Q)ᵀ dO from the prepare pass from here
    pieces_below: int = 64  # cut the sequence into pieces while fewer programs would walk
    mosaic_walk_stages: int = 3  # chunks in flight in the Mosaic GPU walks
    # precision of bf16 / fp16 inputs ("input": rounded to the inputs' dtype, the peers' choice; "fp32": kept):
    # the walks' operands with the fp32 state, the stored triangular inverse, the stored residual gradient dR
    walk_operands: str = "input"
    tri_dtype: str = "input"
    stored_dr: str = "input"

    def __post_init__(self):
        for name in ("walk_operands", "tri_dtype", "stored_dr"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"KernelConfig: {name} must be 'input' or 'fp32', got {getattr(self, name)!r}.")
        check_launch_parameters(self, widths=("block_v", "split_block_v", "grad_block_v", "grad_block_k"),
                                warps=("tri_warps", "fwd_warps", "state_warps", "prepare_warps", "grad_warps"),
                                counts=("fwd_stages", "state_stages", "grad_stages", "narrow_output_walk_stages",
                                        "mosaic_walk_stages"),
                                thresholds=("fill_programs", "few_output_programs", "wide_walk_programs",
                                            "q_term_in_prepare_from", "pieces_below"),
                                optional=("block_v", "split_block_v", "fwd_stages", "wide_walk_programs"))

    # ---- one call's choices ----------------------------------------------------------------------------------

    def walk_dtype(self, dtype):
        """The dtype the walks round their state-sized operands to for inputs of ``dtype`` (None: fp32)."""
        return None if self.walk_operands == "fp32" or jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)

    def tri_store_dtype(self, dtype):
        """The dtype the GPU's triangular inverse is stored in (solved in fp32 either way)."""
        keep = self.tri_dtype == "fp32" or jnp.dtype(dtype) == jnp.float32
        return jnp.float32 if keep else jnp.dtype(dtype)

    def stored_dr_dtype(self, dtype):
        """The dtype the reverse walk stores dR in for the chunk gradients."""
        return jnp.float32 if self.stored_dr == "fp32" else self.walk_dtype(dtype) or jnp.float32

    @staticmethod
    def stored_v_dtype(walk_dtype, group: int):
        """The dtype V is stored in: the walks' for one row per step (Falcon-1), fp32 for windowed steps
        (Falcon-3: ``dR = V + Tᵀ(w ⊙ X dS)`` cancels more with a window's repeated keys)."""
        return (walk_dtype or jnp.float32) if group == 1 else jnp.float32

    def block_v_for(self, bh: int, dv: int, dtype, dk: int) -> int:
        """Value columns per program of the fused walks for ``bh`` batch·heads: 64 for 16-bit tiles (dk ≤ 128)
        when that gives between ``wide_walk_programs`` and ``few_output_programs`` programs (the output walk then
        reads its scores from their own kernel); else 32, or 16 when 32 gives fewer than ``fill_programs``."""
        if self.block_v is not None:
            return min(self.block_v, dv)
        wide_programs = bh * (dv // 64)
        if (self.wide_walk_programs is not None and jnp.dtype(dtype).itemsize <= 2 and dk <= 128 and dv >= 64
                and self.wide_walk_programs <= wide_programs <= self.few_output_programs):
            return 64
        width = min(32, dv)
        return 16 if width > 16 and bh * (dv // width) < self.fill_programs else width

    def split_block_v_for(self, programs_per_column_block: int, dv: int) -> int:
        """Value columns per program of the split walks: the widest power of two ≤ 64 (at least 16) that still
        gives ``fill_programs`` programs (``programs_per_column_block``: batch·heads × pieces)."""
        if self.split_block_v is not None:
            return min(self.split_block_v, dv)
        width = min(64, dv)
        while width > 16 and programs_per_column_block * (dv // width) < self.fill_programs:
            width //= 2
        return width

    def split_forward(self, bh: int, dv: int, block_v: int) -> bool:
        """The GPU forward split (W, U, a state-only walk, outputs) rather than fused, for ``bh`` batch·heads."""
        return bh * max(dv // block_v, 1) < self.fill_programs

    def scores_kernel(self, output_programs: int) -> bool:
        """An output walk of this many programs reads its masked scores from their own kernel (few programs), or
        forms them itself (many: the SMs are full, and reading them in every program of a head costs more)."""
        return output_programs <= self.few_output_programs

    def output_walk_stages(self, output_programs: int, narrow_tiles: bool) -> int:
        """Pipelining stages of a walk that writes the outputs: ``fwd_stages`` if set; 2 above
        ``few_output_programs`` (many programs share an SM), ``narrow_output_walk_stages`` for a few-program walk
        over ``narrow_tiles`` (16-bit, dk ≤ 128, ≤ 16 value columns), else 3."""
        if self.fwd_stages is not None:
            return self.fwd_stages
        if output_programs > self.few_output_programs:
            return 2
        return self.narrow_output_walk_stages if narrow_tiles else 3

    def walk_stages(self) -> int:
        """Stages of a forward walk that writes no outputs (the piece maps, the backward's recompute walk)."""
        return 3 if self.fwd_stages is None else self.fwd_stages

    def pieces(self, bh: int, value_blocks: int, n_chunks: int, requested: int | None = None) -> int:
        """Pieces of the sequence the GPU walks run in parallel (a power of two; 1 when enough programs walk), or
        ``requested`` (at most one per chunk)."""
        return pieces_for(bh, value_blocks, n_chunks, self.pieces_below, requested)
