"""Public entry: ``decayed_delta_rule(..., implementation=...)`` with a hand-written backward.

    p_t = η_t (y_t − S_{t-1}ᵀ x_t),   S_t = [same segment] · e^{a_t} S_{t-1} + x_t p_tᵀ,   o_t = S_tᵀ q_t

(``reference.py``; the residual is measured on the *undecayed* previous state, as
Falcon-1 does.)  Implementations: ``"pallas_gpu"`` (Triton lowering),
``"pallas_tpu"`` (Mosaic TPU lowering) — on a machine without that accelerator
each runs in its interpret mode —, ``"xla"`` (the plain-JAX reference, a scan)
and ``"auto"`` (the kernel of the machine's accelerator, else the reference).  A
request the kernels cannot serve raises ``NotImplementedError`` with the reason,
so callers can fall back.

Forward: per chunk ``T = (I + A)⁻¹`` (parallel over chunks), then a walk over
chunks carrying the fp32 state and writing the outputs.  When batch·heads
leave the GPU idle, the sequence is cut into pieces: each piece's walk is an
affine map of its initial state, ``S_end = M S_start + E`` with a ``dk × dk``
matrix M (not a scalar: the delta rule's state transition is
``a·I − Xᵀ diag(w) T diag(η c_p) X`` per chunk); one walk over the augmented
state ``[I | 0]`` with values ``[0 | Y]`` gives every piece's ``[M | E]`` at
once, a short scan over pieces (XLA) their true initial states, then the
output walk runs from those (exact).

Backward (``jax.custom_vjp``, no differentiation through ``pallas_call``):
``T`` and the chunk start states recomputed, a reverse walk for the state
gradients (pieces likewise, with ``Mᵀ``), then every chunk's dq, dx, dy, dη
and log-decay gradients.

On the GPU the walks are split as fla and jax-linear-attention split them (``KernelConfig``'s "auto"
choices, measured on the H200): per chunk in parallel ``V = Tᵀ(QXᵀ ⊙ D)ᵀ dO``, ``B = Tᵀ(w ⊙ X)``, so the
reverse walk carries only the state (``dR = V + B dS``, three dots per chunk); the recompute walk stores
``P`` and the reverse walk ``dR``, so the per-chunk gradients (one program per chunk) need neither T nor the
scores for them; and, when batch·heads·value blocks leave fewer than 128
programs, the forward likewise (``W = T(η c⁻ ⊙ X)``, ``U = T(η ⊙ Y)``, ``P = U − W S``, a state-only walk,
then the outputs from the stored chunk states in parallel).  The TPU runs the fused walks and one program
per chunk.

Per-column gates (Falcon-2: ``η``, ``log γ`` of shape ``[B, H, T, dv]``) go through
``pallas_gpu_columns.py`` (GPU) or ``pallas_tpu_columns.py`` (TPU; same passes and math):
one program per (batch·head, value block) walks the chunks (on the TPU: grid steps over
the chunks, the state in VMEM) and solves each column's own unit-lower-triangular system
(they share the Gram X Xᵀ) by column-batched forward substitution inside the walk; the
backward is one reverse walk per (batch·head, value block) after a forward walk that
stores the chunk start states.  No pieces (a piece map would be a ``dk × dk`` matrix per
column).

``decayed_attention_per_column`` (Falcon-2A) is the inner-product rule with the same
per-column gates, ``S_t = e^{a_t} ⊙ S_{t-1} + x_t (η_t ⊙ y_t)ᵀ``: the per-column kernel
with ``residual=False`` (no system to solve, ``P = η ⊙ Y``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels.common import (GRAD_LOOPS, check_layout, chunk_local, chunk_state_dtype, flatten_pad,
                                   interpret_default, kernel_operands, large_shared_memory, next_pow2, pieces_for,
                                   resolve_implementation,
                                   reverse_chunk_cumsum, shift_time, swap_time_heads, token_dims,
                                   unsupported_dims_reason)
from falcon_jax.kernels.common import layout_kw as _layout_kw
from falcon_jax.kernels.decayed_delta_rule import (mosaic_gpu, mosaic_gpu_walks, pallas_gpu, pallas_gpu_columns,
                                               pallas_tpu, pallas_tpu_columns)
from falcon_jax.kernels.decayed_delta_rule.xla import chunk_grads as xla_chunk_grads
from falcon_jax.kernels.decayed_delta_rule.xla import outputs as xla_outputs
from falcon_jax.kernels.decayed_delta_rule.reference import (decayed_attention_per_column_reference,
                                                         decayed_delta_rule_reference)

IMPLEMENTATIONS = ("auto", "pallas_gpu", "pallas_tpu", "xla")
# an output-writing walk of at most this many programs leaves the GPU's SMs room (two per SM of the H200's 132):
# it pipelines 3 stages rather than 2 (KernelConfig.walk_stages) and reads its scores from their own kernel
# (KernelConfig.fwd_scores_for)
FEW_OUTPUT_PROGRAMS = 264
# the split reverse walk takes (c ⊙ Q)ᵀ dO from dstate_prepare from this many programs on (KernelConfig.dstate_q)
MANY_WALK_PROGRAMS = 256
# KernelConfig(walks="mosaic"): the Mosaic GPU fused walks' chunks in flight (the register form, 64 columns; H200
# bf16 H16 d128, next93: 3 stages the fastest Mosaic walk at 8x2048 and 2x8192)
MOSAIC_WALK_STAGES = 3
_BACKENDS = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}


def unsupported_reason(q, y, chunk_size: int, interpret: bool = False) -> str | None:
    """Every Triton dot dimension (dk, dv, the chunk, and the 16-row blocks of the triangular
    inverse) must be a power of two ≥ 16."""
    return unsupported_dims_reason(q.shape[-1], y.shape[-1], chunk_size, q.dtype, interpret)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters and pass choices of the kernels (block_v, tri_warps, target_programs, chunk_grads and
    walk_operands from the sixth and seventh H200 runs, docs/kernels.md)."""

    # value columns per program of the walks; None: 32, or 16 when 32 gives fewer than 128 programs (H200 bf16
    # whole op at 1x32768x16x128, 16 vs 32: forward 1.186 vs 1.273 ms (the fused walk, 128 programs, against
    # the split one), fwd+bwd 3.799 vs 3.859; at 8x2048 and 2x8192 16 lost: 0.580 vs 0.394, 0.623 vs 0.450
    # forward, next46); 64 when that still gives at least 256 programs and the output walk reads its scores from
    # the scores kernel (fwd_scores_for at that count: 256-264 under "auto"; H200 bf16 whole op at 8x2048x16x128,
    # 64 columns with the scores kernel vs 32 forming them: fwd 0.368 vs 0.392 ms, fwd+bwd 1.315 vs 1.334, next55;
    # with the walk forming its scores 64 lost everywhere, next45)
    block_v: int | None = None
    tri_warps: int = 1  # the triangular inverse's 16-row substitution is serial: one warp (H200: 0.66 vs 0.90 ms fwd)
    # the GPU triangular inverse's elimination inside its 16-row diagonal blocks (``pallas_gpu._unit_lower_inverses``):
    # "columns" (right-looking, no layout conversion between steps) or "rows" (the form until the twenty-second
    # session)
    tri_elimination: str = "columns"
    fwd_warps: int = 4
    # the forward walks' (and the backward's recompute walk's) software-pipelining stages (Triton num_stages);
    # None: 3, or for an output-writing walk 2 with many programs and 4 with few and narrow tiles (``walk_stages``)
    fwd_stages: int | None = None
    state_warps: int = 4
    # GPU, split state-gradient walk: warps of dstate_prepare, one program per chunk forming V (None: state_warps).
    # Not yet timed on its own (h200_run.sh next60): at 8x2048x16x128 it took 153 us in next56, 2.4x the ≈ 63 us
    # its reads and writes need at the H200's bandwidth; state_warps=8 moved the walk as well and lost (next55)
    prepare_warps: int | None = None
    # the state-gradient (reverse) walks' stages; None: 3 (``walk_stages``)
    state_stages: int | None = None
    grad_warps: int = 4
    # the chunk gradients' software-pipelining stages (Triton num_stages): 2 with grad_loops="fori" (next43); 3
    # once the value half lost its state dots (H200 bf16 whole op fwd+bwd, 3 vs 2 stages: 1.403 vs 1.464 ms at
    # 8x2048x16x128, 1.440 vs 1.496 at 2x8192, 3.340 vs 3.463 at 1x32768; next50)
    grad_stages: int = 3
    grad_block_k: int = 32  # key columns per step of the chunk gradients' key half (two-program and stored kernels)
    # value columns per step of the stored chunk gradients' value half (None: 128 for 16-bit inputs since the
    # twenty-fourth run, capped at dv — H200 bf16 whole op fwd+bwd, 128 vs 64 columns: 1.064 vs 1.104 ms at
    # 8x2048x16x128, 1.279 vs 1.336 at 2x8192, next102; 64 for fp32, not timed at 128 — and 64 since the fifteenth
    # run before that, when the value half lost its state dots; H200 bf16 whole op fwd+bwd, 64 vs 32 columns at 3
    # stages: 1.372 vs 1.391 ms at 8x2048x16x128, 1.426 vs 1.443 at 2x8192, 3.321 vs 3.359 at 1x32768, next51; at
    # 2 stages 1.425 / 1.464 / 3.401 vs 1.464 / 1.496 / 3.463, next50.  Before that, with two state dots per block,
    # 64 lost: next45)
    grad_block_v: int | None = None
    # the stored chunk gradients' loops over value / key column blocks: "fori" (lax.fori_loop: an scf.for whose
    # loads Triton's pipeliner issues a block ahead with grad_stages >= 2) or "unrolled" (Python, static slices:
    # nothing to pipeline; the default until the fourteenth run).  H200 bf16 whole op fwd+bwd, fori with 2 stages
    # vs unrolled with 1: 1.634 vs 1.977 ms (8x2048x16x128), 1.738 vs 2.070 (2x8192), 4.279 vs 4.938 (1x32768);
    # the chunk-gradient kernel 637 vs 963 us at 8x2048; fori with 1 stage 1.721 / 1.831 / 4.440, 3 stages
    # 1.794 / 1.895 / 4.574 (next43).  GPU only.
    grad_loops: str = "fori"
    # chunk_grads="pallas_stored": the dtype the state-gradient walk stores dR in for bf16/fp16 inputs: "input"
    # (H200 bf16 fwd+bwd 2.16 / 2.45 / 5.97 ms at 8x2048 / 2x8192 / 1x32768 x16x128; dy = η dR is rounded twice,
    # 1.5x the fp32-dR error at d64) or "fp32" (2.55 / 2.80 / 6.59 ms, +8% peak memory; dy rounded once).
    # Writing dy from the walk instead (rounded once) cost 0.29 ms at 8x2048 (next18/next19).
    stored_dr: str = "input"
    # the dtype the GPU's triangular inverse T = (I + A)⁻¹ is stored in for bf16/fp16 inputs (solved in fp32
    # either way): "input" (rounded once; its dots are the inputs' MMA on halved loads, as fla keeps its inverse
    # in the keys' dtype; H200 bf16 8x2048x16x128: W, U 0.118 vs 0.234 ms, V, B 0.195 vs 0.291, fused forward
    # walk 0.346 vs 0.398; whole op fwd+bwd 2.033 vs 2.137 ms, next22; d128 gradient error 1.2-1.6x the XLA
    # form's vs 1.0-1.4x) or "fp32" (its dots in TF32).  fp32 inputs and the TPU keep fp32.
    tri_dtype: str = "input"
    # GPU, split state-gradient walk: the dtype V = Tᵀ(QXᵀ⊙D)ᵀdO is stored in for bf16/fp16 inputs: "input"
    # (halves the [BH, T, dv] buffer the reverse walk reads, 268 -> 134 MB at 1x32768x16x128; H200 bf16 Falcon-1
    # fwd+bwd vs fp32 V: 1.307 vs 1.334 ms at 8x2048x16x128, 1.347 vs 1.364 at 2x8192, 3.167 vs 3.208 at 1x32768
    # (next55; next58 with save_tri 1-2% likewise); bf16 gradients at d128 1.22-1.76x the XLA form's error,
    # next59, against 1.17-1.73x with fp32 V, next56), "fp32", or "auto" (the default since the sixteenth run):
    # "input" for one row per step (Falcon-1), "fp32" for windowed steps (Falcon-3: dR = V + B dS cancels more
    # with a window's repeated keys; CPU, T 80, chunk 16, W 4, its bf16 k-gradient error went to 6.8x the XLA
    # form's with bf16 V, 2.5-2.8x with fp32)
    stored_v: str = "auto"
    # keep the forward's triangular inverse T ([BH, T, C], tri_dtype) for the backward instead of solving it
    # again.  Under one jit XLA already runs the two identical inverse calls once (the H200 fwd+bwd profile has one
    # falcon_delta_tri_inverse), so it gains nothing there: H200 bf16 fwd+bwd 1.315 / 1.380 / 3.235 ms vs 1.329 /
    # 1.362 / 3.247 at 8x2048 / 2x8192 / 1x32768 (next58); it saves the solve when forward and backward are
    # compiled apart (T's buffer kept from one to the other).
    save_tri: bool = False
    # cut the sequence into pieces only below this many programs: the piece maps walk a dk + dv wide augmented
    # state in fp32, which cost more than they gained at 128 and 64 programs on the H200 (seventh run)
    target_programs: int = 64
    # GPU, the pieces' maps ``[M | E]``: "split" (W, U per chunk as the split forward forms them, then the
    # state-only walk of each piece over ``[I | 0]`` with values ``[0 | U]``, two dots per chunk, the walks'
    # operand dtype — the peers' maps), "fused" (the fused forward walk over the augmented state, T applied in
    # every step, fp32 operands: the only maps until the twenty-first session) or "auto" ("split" on the GPU)
    piece_maps: str = "auto"
    # the backward's per-chunk gradients: "pallas" (one program per chunk), "xla" (batched matmuls, xla.py),
    # "pallas_split" (GPU: two programs per chunk, value then key columns, no [C, dk] fp32 accumulators),
    # "pallas_stored" (GPU: one program per chunk reading P and dR as the recompute and state-gradient walks
    # stored them, instead of forming them again from T and the scores) or "auto": "pallas_stored" on the GPU
    # (H200, 8x2048x16x128 bf16: 0.86 ms vs "pallas_split" 1.51, XLA 2.75; op fwd+bwd 2.16 vs 2.72, next20),
    # "pallas" on the TPU; "pallas_stored_split" (GPU: "pallas_stored" as two programs per chunk, the value sums
    # through memory: 510 + 653 us vs 977 fused at 8x2048, op fwd+bwd 2.235 vs 2.038 ms; next33)
    chunk_grads: str = "auto"
    # the forward's outputs: "pallas" (inside the walk), "xla" (the walk stores chunk states; slower on the H200),
    # "split" (GPU: W, U per chunk, a state-only walk, then an output kernel — the peers' split) or "auto":
    # "split" on the GPU when the fused walk would run fewer than 128 programs (H200, 1x32768x16x128: 1.89 vs
    # 2.59 ms; 8x2048: 0.69 vs 0.53), else "pallas"
    outputs: str = "auto"
    # the backward's state-gradient walk: "pallas" (recomputes the scores and applies Tᵀ in the walk), "split"
    # (GPU: V = Tᵀ(QXᵀ⊙D)ᵀdO and B = Tᵀ(w⊙X) per chunk in parallel, a walk of three dots per chunk) or "auto":
    # "split" on the GPU (H200: 0.29 + 0.31 vs 0.84 ms at 8x2048, 0.55 + 1.74 vs 3.95 at 1x32768), else "pallas"
    state_grads: str = "auto"
    # value columns per program of the split walks; None: the widest power of two ≤ 64 that still gives 128
    # programs, at least 16 (H200: 64 at 8x2048x16, 32 at 2x8192x16, 16 at 1x32768x16 were the fastest)
    split_block_v: int | None = None
    # the walks' dots with the fp32 state, P, dS or dR (and the XLA chunk gradients' dots with computed fp32
    # operands): "input" (both operands rounded to the bf16/fp16 inputs' dtype: bf16 MMA, as the peers do; H200
    # forward 0.90 vs 1.29 ms, output error 1.45x) or "fp32" (TF32 for bf16 inputs).  fp32 inputs are unaffected
    # either way; the TPU kernels ignore it (fp32 operands).
    walk_operands: str = "input"
    # per-column gates (Falcon-2, 2A): the kernels' solves, reads and row-mixing gradients "blocked" (16-row
    # blocks: serial inside the diagonal blocks, dots between them, the decay gradients elementwise; H200, bf16,
    # 8x2048x16x128, Falcon-2 fwd 8.07 vs 18.06 ms, fwd+bwd 41.0 vs 82.2; Falcon-2A 5.49 / 21.7 vs 9.48 / 27.1)
    # or "rows" (serial loops over the chunk's rows, the default until the eleventh run).  GPU only: the TPU kernel
    # (pallas_tpu_columns) is the row form either way
    column_solve: str = "blocked"
    # in place ([B, T, H, d] tokens, GPU, power-of-two H): the gates' transpose to the kernels' [B·H, T] and their
    # cotangents' back, "pallas" (a transpose kernel both ways) or "xla" (jnp.swapaxes, the default until the
    # twelfth run: XLA folded it into the gates' producer and its backward — Falcon-1's ‖x‖² reduction and the
    # β / λ gradient chain — one 271 µs fusion each way at 1x32768x16x128 on the H200).  H200 bf16 whole op,
    # pallas vs xla: 1x32768 fwd 1.751 vs 2.026 ms, fwd+bwd 5.685 vs 5.972; 8x2048 0.533 / 2.038 vs 0.524 / 2.035;
    # 2x8192 0.714 / 2.353 vs 0.713 / 2.338 (next33)
    gate_transpose: str = "pallas"
    # GPU, the split reverse walk's dR = V + B dS: B = Tᵀ(w ⊙ X) stored per chunk by dstate_prepare and read by
    # the walk ("stored", [BH, T, dk] in the walk operands' dtype), or formed in the walk as Tᵀ(w ⊙ X dS) from the
    # chunk's T ("from_t", the default since the sixteenth run: a [C, C] tile read per step instead of [C, dk],
    # one more dot in the chain, no B buffer).  H200 bf16 whole op fwd+bwd, from_t vs stored (next54): 1.328 vs
    # 1.370 ms at 8x2048x16x128, 1.362 vs 1.419 at 2x8192, 3.213 vs 3.299 at 1x32768; peak memory the same.
    dstate_b: str = "from_t"
    # GPU, the split reverse walk's (c ⊙ Q)ᵀ dO term of dS: formed by every value-block program each step ("walk":
    # q [C, dk] and dO loaded, one more dot) or once per chunk by dstate_prepare, written into dh's buffer and
    # read back by the walk just before it writes that chunk's dh there ("prepare": the walk loads a [dk, block_v]
    # tile instead of q and dO, no extra memory; one piece only, else "walk"), or "auto" (the default since the
    # seventeenth run): "prepare" when the walk runs at least 256 programs.  H200 bf16 whole op fwd+bwd, prepare vs
    # walk (next61): 1.231 vs 1.297 ms at 8x2048x16x128 (256 programs of 64 columns: the walk 298 -> 182 us,
    # prepare 142 -> 192), but 1.437 vs 1.340 at 2x8192 and 3.401 vs 3.151 at 1x32768 (128 programs: the walk
    # 1,006 -> 1,157 us at 1x32768); with the keys in place, 1.304 vs 1.364 ms at 8x2048 (next63).  Since the
    # twenty-fourth run "auto" is "walk" wherever the Mosaic GPU reverse walk runs: it forms the q-term from the
    # multicast Q tile off its dS chain at no cost (H200 bf16 8x2048, next99: the walk 142.4 us either way, prepare
    # 118.3 -> 84.1 us, whole op fwd+bwd 1.120 vs 1.145 ms, same peak memory: dh takes the q-term's buffer)
    dstate_q: str = "auto"
    # GPU, the split reverse walk's V = Tᵀ(QXᵀ⊙D)ᵀdO: from dstate_prepare ("prepare") or formed by the Mosaic GPU
    # reverse walk itself ("walk": the masked scores from its multicast Q and X tiles and dOᵀ(QXᵀ⊙D) added to
    # (w ⊙ X dS)ᵀ before its one product with T, so no prepare pass runs; only where the Mosaic walk runs and forms
    # the q-term too, else "prepare"), or "auto": "prepare".  The walk's step is latency-bound and the three more
    # products (scores, two parts against dO) cost it more than the pass they save (H200 bf16 8x2048, next100: the
    # walk alone 0.368 vs 0.254 ms, the whole op fwd+bwd 1.169 vs 1.097 ms, same peak memory)
    dstate_v: str = "auto"
    # GPU, the forward walk that writes the outputs: its masked scores QXᵀ ⊙ D formed by every value-block program
    # of a head ("walk") or once per chunk by a parallel 4-warp kernel and read by the walk ("kernel"), or "auto":
    # "kernel" when the output walk runs at most 264 programs (two per SM of the H200's 132), else "walk".  H200
    # bf16 forward, kernel vs walk (next54): 0.418 vs 0.446 ms at 2x8192x16x128 (128 programs), 1.094 vs 1.187 at
    # 1x32768 (128), but 0.555 vs 0.392 at 8x2048 (512: reading the stored scores in every program of a head
    # costs more than the dots when the SMs are full).  next51 stored them from the one-warp triangular inverse
    # instead: the inverse doubled (174 -> 349 us at 1x32768).
    fwd_scores: str = "auto"
    # ``decayed_delta_rule(shifted_keys=True)`` (Falcon-1's call): the GPU passes read the keys one row back in
    # place where every pass of the call can (``keys_read_in_place``), so no shifted copy of k is made (its
    # [B, T, H, dk] buffer was live at the forward+backward's peak), or False: the op shifts k in XLA first.
    # H200 bf16 Falcon-1 fwd+bwd peak memory at 1x32768x16x128 (temp + outputs): 1,359 vs 1,493 MB (jla
    # gated_deltanet 1,149); fwd 0.369 / 0.410 / 1.082 ms vs 0.374 / 0.428 / 1.098 at 8x2048 / 2x8192 / 1x32768,
    # fwd+bwd 1.304 / 1.397 / 3.232 vs 1.299 / 1.395 / 3.257 (next63)
    keys_in_place: bool = True
    # GPU, the split reverse walk's per-chunk preparation (``dstate_prepare``: V and the q-term): the Triton
    # kernel ("triton"), the Pallas Mosaic GPU kernel of ``mosaic_gpu.py`` ("mosaic": wgmma + TMA, Hopper; bf16/fp16,
    # C = 64, d = 64 or 128, V stored in the inputs' dtype, B formed in the walk; the Triton kernel where it does not
    # serve the call), or "auto" (the default since the nineteenth run): "mosaic" on a Hopper GPU under jax >= 0.11
    # (``mosaic_gpu.on_hopper``; checked on 0.11.2, only cross-lowered on 0.10).  H200 bf16,
    # H16 d128, the pass alone 0.52-0.60x the Triton one's time (8x2048: 0.126 vs 0.226 ms with the q-term,
    # next76); whole op fwd+bwd in one lease 1.209 vs 1.305 ms at 8x2048, 1.338 vs 1.404 at 2x8192, 3.122 vs 3.263
    # at 1x32768 (next77), 1.340 vs 1.405 at 2x8192 with the scores' hi + lo parts (next78)
    prepare: str = "auto"
    # GPU, chunk_grads="pallas_stored": the Triton kernel ("triton") or the Pallas Mosaic GPU one of
    # ``mosaic_gpu.py`` ("mosaic": one warpgroup per chunk, wgmma + TMA; bf16/fp16, C = 64, d = 64 or 128, P, dR and
    # the chunk states in the inputs' dtype, group 1; the Triton kernel where it does not serve the call), or "auto":
    # "mosaic" on a Hopper GPU under jax >= 0.11 (as ``prepare``).  Default "triton": on the H200 (bf16, H16, d128,
    # next81) the Mosaic pass has the Triton pass's errors but takes 1.27-1.29x its time, and the whole op fwd+bwd
    # 1.367 vs 1.209 ms at 8x2048, 1.494 vs 1.324 at 2x8192, 3.421 vs 3.108 at 1x32768 (one CTA per SM at
    # ~211 KB of SMEM: see ``mosaic_gpu.chunk_grad_stored_pass``)
    chunk_grads_kernel: str = "triton"
    # GPU, the walks of one piece — the forward's output walk, the backward's recompute walk (fused) and its split
    # reverse walk: the Triton kernels ("triton") or the Pallas Mosaic GPU ones of ``mosaic_gpu_walks.py``
    # ("mosaic": a head's value blocks of 64 columns as one thread-block cluster sharing the chunk's tiles by TMA
    # multicast, the state carried transposed so that every product takes its left operand from registers;
    # bf16/fp16, C = 64, d 64 or 128, the walks' operands in the inputs' dtype, the reverse walk with the q-term from
    # prepare and dR stored in the inputs' dtype; keys read one row back are shifted by a copy in XLA first; the
    # Triton kernel where it does not serve the call), or "auto" (the default): "mosaic" on a Hopper GPU under
    # jax >= 0.11 (as ``prepare``) for a walk the Triton kernel would run at 64 value columns (``block_v_for``,
    # ``split_block_v_for``), "triton" otherwise.  On the H200 (bf16, H16, d128) the fused walks alone (next93):
    # 8x2048 0.142 vs 0.171 ms output walk, 0.137 vs 0.157 recompute; 2x8192 (Triton at 32 columns) 0.216 vs 0.214,
    # 0.200 vs 0.181; 1x32768 (16 columns) 0.768 vs 0.729, 0.688 vs 0.574, where a walk step's latency bounds
    # either kernel.  The whole op, fwd / fwd+bwd: "mosaic" everywhere (next94, fused walks only) 8x2048
    # 0.330 / 1.191 vs 0.352 / 1.203 ms, 2x8192 0.408 / 1.353 vs 0.408 / 1.337, 1x32768 1.190 / 3.312 vs
    # 1.070 / 3.098 (there the keys' shifted copy is an 81 us fusion of its own; at 8x2048 XLA fuses it with
    # ||x||^2); "auto" with the reverse walk too (next96) 8x2048 0.329 / 1.141 vs 0.362 / 1.221 (reverse walk
    # 141 vs 182 us), the other shapes the Triton walks; +71 MB compiled peak at 8x2048 (the shifted keys)
    walks: str = "auto"
    # per-column gates: value columns per program (several [C, block_v] fp32 tiles live).  TPU: Mosaic's blocks need
    # a multiple of 128 columns or all of dv, so a narrower width becomes 128 (or dv) there
    # (pallas_tpu_columns.value_block; in interpret mode too, so the tests run the widths a TPU would)
    column_block_v: int = 32
    column_warps: int = 4

    def __post_init__(self):
        for name, allowed in (("chunk_grads", ("auto", "pallas", "xla", "pallas_split", "pallas_stored",
                                               "pallas_stored_split")),
                              ("outputs", ("auto", "pallas", "xla", "split")),
                              ("piece_maps", ("auto", "fused", "split")),
                              ("state_grads", ("auto", "pallas", "split")),
                              ("column_solve", ("rows", "blocked")),
                              ("tri_elimination", ("columns", "rows")),
                              ("gate_transpose", ("xla", "pallas")),
                              ("dstate_b", ("stored", "from_t")),
                              ("dstate_q", ("auto", "walk", "prepare")),
                              ("dstate_v", ("auto", "walk", "prepare")),
                              ("fwd_scores", ("auto", "walk", "kernel")),
                              *((name, ("auto", "triton", "mosaic")) for name in ("prepare", "chunk_grads_kernel",
                                                                                  "walks")),
                              ("grad_loops", GRAD_LOOPS),
                              ("stored_v", ("auto", "fp32", "input")),
                              *((name, ("fp32", "input")) for name in ("stored_dr", "tri_dtype",
                                                                       "walk_operands"))):
            if getattr(self, name) not in allowed:
                choices = " or ".join(repr(a) for a in allowed)
                raise ValueError(f"KernelConfig: {name} must be {choices}, got {getattr(self, name)!r}.")
        for name in ("save_tri", "keys_in_place"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelConfig: {name} must be True or False, got {getattr(self, name)!r}.")
        if self.grad_block_k < 16 or self.grad_block_k & (self.grad_block_k - 1):
            raise ValueError(f"KernelConfig: grad_block_k must be a power of two >= 16, got {self.grad_block_k!r}.")
        if self.prepare_warps not in (None, 1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig: prepare_warps must be None (state_warps) or 1, 2, 4, 8 or 16, got "
                             f"{self.prepare_warps!r}.")
        for name in ("block_v", "split_block_v", "grad_block_v"):
            width = getattr(self, name)
            if width is not None and (not isinstance(width, int) or width < 16 or width & (width - 1)):
                raise ValueError(f"KernelConfig: {name} must be None (auto) or a power of two >= 16, got {width!r}.")

    def walk_operand_dtype(self, dtype):
        """The dtype the walks round their state-sized operands to for inputs of ``dtype`` (None: fp32)."""
        return None if self.walk_operands == "fp32" or jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)

    def tri_kw(self, backend: str, dtype) -> dict:
        """Keyword arguments of ``backend``'s ``tri_inverse_pass`` for inputs of ``dtype``: the number of warps
        and, on the GPU, the dtype T is stored in (``tri_dtype``)."""
        kw = dict(num_warps=self.tri_warps)
        if backend == "pallas_gpu":
            keep = self.tri_dtype == "fp32" or jnp.dtype(dtype) == jnp.float32
            kw["t_dtype"] = jnp.float32 if keep else jnp.dtype(dtype)
            kw["elimination"] = self.tri_elimination
        return kw

    def chunk_grads_for(self, backend: str) -> str:
        """``chunk_grads`` with "auto" resolved for ``backend`` ("pallas_gpu" or "pallas_tpu")."""
        if self.chunk_grads != "auto":
            return self.chunk_grads
        return "pallas_stored" if backend == "pallas_gpu" else "pallas"

    def piece_maps_for(self, backend: str) -> str:
        """``piece_maps`` with "auto" resolved for ``backend`` (the split maps are a GPU pass)."""
        if self.piece_maps != "auto":
            return self.piece_maps
        return "split" if backend == "pallas_gpu" else "fused"

    def state_grads_for(self, backend: str) -> str:
        """``state_grads`` with "auto" resolved for ``backend``."""
        if self.state_grads != "auto":
            return self.state_grads
        return "split" if backend == "pallas_gpu" else "pallas"

    def outputs_for(self, backend: str, bh: int, dv: int) -> str:
        """``outputs`` with "auto" resolved for ``backend`` and ``bh`` batch·heads of ``dv`` value columns."""
        if self.outputs != "auto":
            return self.outputs
        fused_programs = bh * max(dv // self.block_v_for(bh, dv), 1)
        return "split" if backend == "pallas_gpu" and fused_programs < 128 else "pallas"

    def fwd_scores_for(self, backend: str, output_programs: int) -> str:
        """``fwd_scores`` with "auto" resolved for an output walk of ``output_programs`` programs on ``backend``
        (the TPU walks always form their scores: "walk")."""
        if backend != "pallas_gpu":
            return "walk"
        if self.fwd_scores != "auto":
            return self.fwd_scores
        return "kernel" if output_programs <= FEW_OUTPUT_PROGRAMS else "walk"

    def dstate_q_for(self, walk_programs: int, mosaic_walk: bool = False) -> str:
        """``dstate_q`` with "auto" resolved for a split reverse walk of ``walk_programs`` programs (``mosaic_walk``:
        the Mosaic GPU reverse walk will run it)."""
        if self.dstate_q != "auto":
            return self.dstate_q
        if mosaic_walk:
            return "walk"
        return "prepare" if walk_programs >= MANY_WALK_PROGRAMS else "walk"

    def dstate_v_for(self, mosaic_walk: bool, q_term_in_walk: bool) -> str:
        """``dstate_v`` resolved: "walk" where it asks for it and the Mosaic GPU reverse walk runs (``mosaic_walk``)
        and forms the q-term itself (``q_term_in_walk``); else "prepare"."""
        if mosaic_walk and q_term_in_walk and self.dstate_v == "walk":
            return "walk"
        return "prepare"

    def stored_v_for(self, group: int) -> str:
        """``stored_v`` with "auto" resolved for steps of ``group`` rows (1: Falcon-1; the window: Falcon-3)."""
        if self.stored_v != "auto":
            return self.stored_v
        return "input" if group == 1 else "fp32"

    @staticmethod
    def walk_stages(stages: int | None, output_programs: int = 0, narrow_tiles: bool = False) -> int:
        """A walk's pipelining stages: ``stages`` if set, else 3, but 2 for a walk that writes the outputs with
        ``output_programs`` > 264 programs (two per SM of the H200's 132; 0: a walk that writes no outputs), and
        4 for one with fewer whose tiles are narrow (``narrow_tiles``: 16-bit inputs, dk ≤ 128, ≤ 16 value
        columns, a GPU with ~228 KB of shared memory per SM — four stages of its tiles fit there; H200 bf16
        forward at 1x32768x16x128, 16 columns, next109/next110: 1.031-1.042 ms at 4 stages vs 1.056-1.066 at 3,
        the same at 2x8192's 32 columns, forward+backward unchanged — the recompute walk, which writes no
        outputs, keeps 3).
        H200 bf16 whole op (next45, next46): the fused
        forward at 8x2048x16x128 (512 programs) 0.394 ms at 2 stages vs 0.460 at 3, at 2x8192 (128) 0.524 vs
        0.449; the split forward at 1x32768 1.587 vs 1.272; forward+backward with every walk at 3 vs at 2:
        1.595 vs 1.665, 1.640 vs 1.775, 3.861 vs 4.357 (the backward's walks write no outputs: the recompute
        walk at 512 programs gains from the third stage too)."""
        if stages is not None:
            return stages
        if output_programs > FEW_OUTPUT_PROGRAMS:
            return 2
        return 4 if output_programs and narrow_tiles else 3

    def block_v_for(self, bh: int, dv: int, dtype=None, dk: int | None = None) -> int:
        """Value columns per program of the walks for ``bh`` batch·heads of ``dv`` columns (see ``block_v``); 64
        only for 16-bit ``dtype`` inputs with ``dk`` ≤ 128 (fp32 q, k, v at dk 128: the output walk's 64-column
        tiles ask for 264 KB of shared memory, over the H200's 227 KB; next56)."""
        if self.block_v is not None:
            return min(self.block_v, dv)
        narrow_tiles = dtype is not None and jnp.dtype(dtype).itemsize <= 2 and dk is not None and dk <= 128
        wide_programs = bh * (dv // 64)
        if (narrow_tiles and dv >= 64 and wide_programs >= 256
                and self.fwd_scores_for("pallas_gpu", wide_programs) == "kernel"):
            return 64
        width = min(32, dv)
        return 16 if width > 16 and bh * (dv // width) < 128 else width

    def resolved(self, bh: int, dv: int, dtype=None, dk: int | None = None) -> "KernelConfig":
        """This config with ``block_v`` and ``grad_block_v`` set for ``bh`` batch·heads of ``dv`` value columns
        (inputs of ``dtype``, ``dk`` key columns)."""
        sixteen_bit = dtype is not None and jnp.dtype(dtype).itemsize == 2
        return dataclasses.replace(self, block_v=self.block_v_for(bh, dv, dtype, dk),
                                   grad_block_v=min(self.grad_block_v or (128 if sixteen_bit else 64), dv))

    def split_block_v_for(self, bh: int, dv: int) -> int:
        """Value columns per program of the split walks for ``bh`` batch·heads (see ``split_block_v``)."""
        if self.split_block_v is not None:
            return min(self.split_block_v, dv)
        width = min(64, dv)
        while width > 16 and bh * (dv // width) < 128:
            width //= 2
        return width


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12, 13, 14))
def _kernel_op(q, x, y, eta, log_gamma, run, s0, chunk, config, pieces, interpret, backend, group, heads,
               key_shift):
    out, _ = _forward(q, x, y, eta, log_gamma, run, s0, chunk, config, pieces, interpret, backend, group, heads,
                      key_shift)
    return out


def keys_read_in_place(config: "KernelConfig", backend: str, bh: int, dv: int, pieces: int) -> bool:
    """Whether the passes a call runs read the keys one row back in place (``shifted_keys=True``): the GPU's
    output walk, split state-gradient walk and stored chunk gradients (the defaults), one piece.  Elsewhere
    the op shifts the keys in XLA (a copy).  ``config`` resolved for the call."""
    return (config.keys_in_place and backend == "pallas_gpu" and pieces == 1
            and config.outputs_for(backend, bh, dv) == "pallas"
            and config.state_grads_for(backend) == "split"
            and config.chunk_grads_for(backend) in ("pallas_stored", "pallas_stored_split"))


def _first_row(a, heads):
    """Row 0 of a token operand as ``[BH, d]``: ``[BH, L, d]``, or ``[B, L, H, d]`` with ``heads``."""
    row = a[:, 0]
    return row.reshape(-1, row.shape[-1]) if heads is not None else row


def _state_after_first_row(s0, x0, y0, eta0, lg0, keep):
    """``[BH, dk, dv]``: the state after row 0, ``e^{log γ₀} S + η₀ x₀ (y₀ − Sᵀ x₀)ᵀ`` with ``S = s0``, or
    ``S = 0`` where row 0 starts a segment (``keep`` False).  x0 ``[BH, dk]``, y0 ``[BH, dv]``, gates ``[BH]``."""
    prev = jnp.where(keep[:, None, None], s0, 0.0)
    resid = y0 - jnp.einsum("bk,bkd->bd", x0, prev, precision=jax.lax.Precision.HIGHEST)
    return jnp.exp(lg0)[:, None, None] * prev + (eta0[:, None] * x0)[:, :, None] * resid[:, None, :]


def _fold_first_row(s0, x0, y, eta, log_gamma, run, heads):
    """Row 0's step (write feature ``x0`` ``[BH, dk]``: ``first_key``) done in XLA: returns the kernel operands
    ``(s0, eta, log_gamma, run)`` with s0 the state after row 0 and row 0 an identity step for the kernels
    (log γ = 0 and run index 0, so they neither decay nor reset there; their row-0 feature is zero — the masked
    row −1, or the shifted copy's zero row — so they write nothing there whatever η₀ is, and η₀ stays: the
    in-place chunk gradients form row 0's dy as ``η₀ dR₀``), and the residuals :func:`_first_row_grads` needs.
    Gates ``[BH, L]``; y a token operand (:func:`_first_row`)."""
    eta0, lg0, run0 = eta[:, 0], log_gamma[:, 0], run[:, 0]
    keep = run0 == 0
    y0 = _first_row(y, heads).astype(jnp.float32)
    folded = _state_after_first_row(s0, x0, y0, eta0, lg0, keep)
    operands = (folded, eta, log_gamma.at[:, 0].set(0.0), run - run0[:, None])
    return operands, (s0, x0, y0, eta0, lg0, keep)


def _first_row_grads(residuals, ds_folded):
    """The backward of :func:`_fold_first_row`: gradients w.r.t. s0, x0, y's row 0, η₀ and log γ₀."""
    *primals, keep = residuals
    _, vjp = jax.vjp(lambda *a: _state_after_first_row(*a, keep), *primals)
    return vjp(ds_folded)


def _keys_one_row_later(k, first_key, axis):
    """Write features from keys: ``x[t] = k[t − 1]`` along ``axis``, ``x[0] = first_key`` ``[B, H, dk]`` (None:
    zero)."""
    if first_key is None:
        return shift_time(k, 1, axis=axis)
    row0 = jnp.expand_dims(first_key.astype(k.dtype), axis)  # [B, H, dk] -> [B, H, 1, dk] or [B, 1, H, dk]
    return jnp.concatenate([row0, jax.lax.slice_in_dim(k, 0, k.shape[axis] - 1, axis=axis)], axis=axis)


def _gates(log_gamma, run, chunk, group=1):
    """Per-row chunk-local g, gp = g − log γ and run index.  ``group > 1``: ``log_gamma`` and ``run`` are per
    *step* ``[BH, L / group]`` and every step has ``group`` rows (its virtual writes), which all share the step's
    g (write decay) and gp (residual decay)."""
    if group == 1:
        g, rl = chunk_local(log_gamma, run, chunk)
        return g, g - log_gamma, rl
    g, rl = chunk_local(log_gamma, run, chunk // group)
    rows = functools.partial(jnp.repeat, repeats=group, axis=1)
    return rows(g), rows(g - log_gamma), rows(rl)


def _log_gamma_grad(dg, dgp, chunk, group):
    """Gradient w.r.t. log γ from those w.r.t. the rows' g and gp (g = chunk-local inclusive cumsum, gp = g − log γ)."""
    if group > 1:
        BH, L = dg.shape
        dg, dgp = (a.reshape(BH, L // group, group).sum(-1) for a in (dg, dgp))
    return reverse_chunk_cumsum(dg + dgp, chunk // group) - dgp


def _piece_maps(kernels, config, backend, q, x, y, eta, g, gp, rl, tinv, pieces, kw):
    """``[M | E]`` of every piece (``KernelConfig.piece_maps``).  Returns (M [BH, P, dk, dk], E [BH, P, dk, dv],
    fp32; the split forward's ``(W, U)`` when the split maps formed them, else None)."""
    BH, L, dk = token_dims(q, kw.get("heads"))
    dv = y.shape[-1]
    if config.piece_maps_for(backend) == "split":
        if backend != "pallas_gpu":
            raise NotImplementedError(f"{backend}: KernelConfig(piece_maps='split') is a GPU pass; leave it at "
                                      "its default for this backend")
        wu = kernels.prepare_wu(x, y, eta, g, gp, rl, tinv, chunk=kw["chunk"], interpret=kw["interpret"],
                                num_warps=kw["num_warps"], heads=kw.get("heads"),
                                w_dtype=kw["walk_operands"] or jnp.float32)
        # as wide as the split state walk's programs, over dk + dv columns (block_v divides both)
        block_v = min(config.split_block_v_for(BH * pieces, dv), dk)
        M, E = kernels.piece_maps(x, *wu, g, rl, chunk=kw["chunk"], pieces=pieces, block_v=block_v,
                                  interpret=kw["interpret"], num_warps=kw["num_warps"],
                                  num_stages=kw["num_stages"], heads=kw.get("heads"),
                                  walk_operands=kw["walk_operands"])
        return M, E, wu
    y_aug = jnp.concatenate([jnp.zeros((*y.shape[:-1], dk), y.dtype), y], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (BH, pieces, dk, dk))
    s_aug = jnp.concatenate([eye, jnp.zeros((BH, pieces, dk, dv), jnp.float32)], axis=-1)
    # block_v divides dk + dv (both powers of two); the maps' walk keeps fp32 state operands (M is a transition);
    # its dots with T follow tri_dtype, the same T the walks that use the maps apply
    kw = dict(kw, block_v=min(kw["block_v"], dk), walk_operands=None)
    (ends,) = kernels.forward_pass(q, x, y_aug, eta, g, gp, rl, tinv, s_aug, write_o=False, write_h=False, **kw)
    return ends[..., :dk], ends[..., dk:], None


def _piece_starts(M, E, s0):
    """True initial state of each piece: S(p+1) = M_p S(p) + E_p, S(0) = s0. Returns ([BH,P,dk,dv], final)."""

    def step(S, inp):
        m, e = inp
        return jnp.einsum("bij,bjd->bid", m, S, precision=jax.lax.Precision.HIGHEST) + e, S

    final, starts = jax.lax.scan(step, s0, (jnp.moveaxis(M, 1, 0), jnp.moveaxis(E, 1, 0)))
    return jnp.moveaxis(starts, 0, 1), final


def _check_split(config, backend):
    gpu_only = ("split", "pallas_split", "pallas_stored", "pallas_stored_split")
    for name in ("outputs", "state_grads", "chunk_grads"):
        if getattr(config, name) in gpu_only and backend != "pallas_gpu":
            raise NotImplementedError(f"{backend}: KernelConfig({name}={getattr(config, name)!r}) is a GPU kernel; "
                                      "leave it at its default for this backend")


def _forward(q, x, y, eta, log_gamma, run, s0, chunk, config, pieces, interpret, backend, group, heads, key_shift):
    _check_split(config, backend)
    keys = {"key_shift": True} if key_shift else {}  # x holds the keys, read one row back (keys_read_in_place)
    fold = None
    if key_shift:  # s0 is (s0, first_key [BH, dk]): row 0's step is folded into s0 here, so that the backward
        # forms its gradient w.r.t. y's row 0 through the chunk gradients' dy (an XLA sum would copy all of dy)
        (s0, eta, log_gamma, run), fold = _fold_first_row(*s0, y, eta, log_gamma, run, heads)
    kernels = _BACKENDS[backend]
    BH, dv = token_dims(q, heads)[0], y.shape[-1]
    g, gp, rl = _gates(log_gamma, run, chunk, group)
    tinv = kernels.tri_inverse_pass(x, eta, g, gp, rl, chunk=chunk, interpret=interpret, group=group,
                                    **config.tri_kw(backend, q.dtype), **_layout_kw(heads), **keys)
    kw = dict(chunk=chunk, pieces=pieces, block_v=config.block_v, interpret=interpret, num_warps=config.fwd_warps,
              num_stages=config.walk_stages(config.fwd_stages),
              walk_operands=config.walk_operand_dtype(q.dtype), **_layout_kw(heads))
    M = wu = None
    if pieces > 1:
        M, E, wu = _piece_maps(kernels, config, backend, q, x, y, eta, g, gp, rl, tinv, pieces, kw)
        starts, _ = _piece_starts(M, E, s0)
    else:
        starts = s0[:, None]
    outputs = config.outputs_for(backend, BH, dv)
    if outputs == "split":
        o, _, s_end = kernels.split_forward(q, x, y, eta, g, gp, rl, tinv, starts, wu=wu,
                                            **dict(kw, block_v=config.split_block_v_for(BH * pieces, dv)))
    elif outputs == "xla":  # the walk carries the state only; outputs from the chunk states in parallel
        h, s_end = kernels.forward_pass(q, x, y, eta, g, gp, rl, tinv, starts, write_o=False, write_h=True, **kw)
        o = xla_outputs(q, x, y, eta, g, gp, rl, tinv, h, chunk=chunk, heads=heads)
    else:
        output_programs = BH * pieces * (dv // config.block_v)
        narrow = (jnp.dtype(q.dtype).itemsize == 2 and token_dims(q, heads)[2] <= 128 and config.block_v <= 16
                  and large_shared_memory())
        stages = config.walk_stages(config.fwd_stages, output_programs=output_programs, narrow_tiles=narrow)
        walk = _walk(config, backend, interpret, pieces)
        # the Mosaic walk reads the scores (a Triton walk handed the call back reads them too)
        if config.fwd_scores_for(backend, output_programs) == "kernel" or walk is not kernels.forward_pass:
            kw["scores"] = kernels.masked_scores_pass(q, x, g, rl, chunk=chunk, interpret=interpret, heads=heads,
                                                      dtype=kw["walk_operands"] or jnp.float32, **keys)
        o, s_end = walk(q, x, y, eta, g, gp, rl, tinv, starts, write_o=True, write_h=False,
                        **dict(kw, num_stages=stages), **keys)
    # the pieces' transitions M ([BH, P, dk, dk] fp32) are kept for the backward's reverse scan over pieces
    return (o, s_end[:, -1]), (q, x, y, eta, g, gp, rl, starts, tinv if config.save_tri else None, fold, M)


def _fwd_rule(q, x, y, eta, log_gamma, run, s0, chunk, config, pieces, interpret, backend, group, heads,
              key_shift):
    return _forward(q, x, y, eta, log_gamma, run, s0, chunk, config, pieces, interpret, backend, group, heads,
                    key_shift)


def _mosaic_or_triton(choice: str, backend: str, interpret: bool, mosaic_pass, triton_pass):
    """A backward pass with a Mosaic GPU kernel: ``triton_pass``, or (``choice`` "mosaic", or "auto" on a Hopper GPU;
    the GPU backend, not interpreted) ``mosaic_pass``, which hands a call it does not serve (NotImplementedError)
    back to ``triton_pass``."""
    if backend != "pallas_gpu" or interpret or choice == "triton":
        return triton_pass
    if choice == "auto" and not mosaic_gpu.on_hopper():
        return triton_pass

    def either(*args, **kw):
        try:
            return mosaic_pass(*args, **kw)
        except NotImplementedError:
            return triton_pass(*args, **kw)

    return either


def _walks_choice(config: KernelConfig, block_v: int) -> str:
    """``KernelConfig.walks`` for a walk the Triton kernel would run at ``block_v`` columns: "auto" takes the
    Mosaic walk (on a Hopper GPU, :func:`_mosaic_or_triton`) only at 64 columns, where it measured faster."""
    if config.walks == "auto" and block_v != mosaic_gpu_walks.REGISTER_FORM_BLOCK_V:
        return "triton"
    return config.walks


def _mosaic_walk_or_triton(config: KernelConfig, backend: str, interpret: bool, block_v: int, mosaic_walk,
                           triton_walk, **mosaic_kw):
    """A walk with a Mosaic GPU kernel (``KernelConfig.walks``, :func:`_walks_choice`, :func:`_mosaic_or_triton`);
    the Mosaic walk is called with the Triton walk's arguments less its launch parameters, plus ``mosaic_kw``."""
    return _mosaic_or_triton(_walks_choice(config, block_v), backend, interpret,
                             _with_triton_arguments(mosaic_walk, **mosaic_kw), triton_walk)


def _with_triton_arguments(mosaic_walk, **mosaic_kw):
    """``mosaic_walk`` called with a Triton walk's arguments: less its launch parameters, at the register form's
    64 columns, plus ``mosaic_kw``."""
    def mosaic(*args, num_warps=None, num_stages=None, interpret=False, block_v=None, **kw):
        del num_warps, num_stages, interpret, block_v  # the Triton walk's launch parameters
        return mosaic_walk(*args, block_v=mosaic_gpu_walks.REGISTER_FORM_BLOCK_V, **mosaic_kw, **kw)

    return mosaic


def _walk(config: KernelConfig, backend: str, interpret: bool, pieces: int):
    """The fused walk of one piece (``config`` resolved, its ``block_v`` set): ``forward_pass``'s call."""
    kernels = _BACKENDS[backend]
    if pieces != 1:
        return kernels.forward_pass
    return _mosaic_walk_or_triton(config, backend, interpret, config.block_v, mosaic_gpu_walks.forward_walk,
                                  kernels.forward_pass, stages=MOSAIC_WALK_STAGES, form="registers")


def _reverse_walk(config: KernelConfig, backend: str, interpret: bool, block_v: int, v_in_walk: bool = False):
    """The split reverse walk of one piece writing dh and dR (``block_v`` the Triton walk's width):
    ``state_grad_split_pass``'s call.  ``v_in_walk``: the Mosaic walk forms V (no ``prepare_vb`` ran, so no
    Triton walk can take the call; :func:`_takes_mosaic_reverse_walk` said the Mosaic one will)."""
    if v_in_walk:
        return _with_triton_arguments(mosaic_gpu_walks.reverse_walk)
    kernels = _BACKENDS[backend]
    return _mosaic_walk_or_triton(config, backend, interpret, block_v, mosaic_gpu_walks.reverse_walk,
                                  kernels.state_grad_split_pass)


def _takes_mosaic_reverse_walk(config: KernelConfig, backend: str, interpret: bool, block_v: int, q, x, do, tinv, *,
                               chunk: int, v_dtype, write_dr, b_from_t: bool, walk_operands) -> bool:
    """Whether :func:`_reverse_walk` will run the Mosaic GPU reverse walk for this one-piece call (decided before
    ``prepare_vb``, which forms the q-term only for a walk that does not)."""
    choice = _walks_choice(config, block_v)
    if backend != "pallas_gpu" or interpret or choice == "triton" or (choice == "auto" and not mosaic_gpu.on_hopper()):
        return False
    v = jax.ShapeDtypeStruct(do.shape, v_dtype)
    return mosaic_gpu_walks.reverse_walk_unsupported_reason(
        x, v, chunk, block_v=mosaic_gpu_walks.REGISTER_FORM_BLOCK_V, pieces=1, write_dh=True, vb=(v, None, None),
        write_dr=write_dr, b_from_t=b_from_t, walk_operands=walk_operands, t_dtype=tinv.dtype, q_dtype=q.dtype,
        do_dtype=do.dtype) is None


def _prepare(config: KernelConfig, backend: str, interpret: bool):
    """The split reverse walk's ``prepare_vb`` (``KernelConfig.prepare``, :func:`_mosaic_or_triton`)."""
    kernels = _BACKENDS[backend]
    return _mosaic_or_triton(config.prepare, backend, interpret, mosaic_gpu.prepare_vb, kernels.prepare_vb)


def _stored_dr_dtype(config: KernelConfig, walk_kw: dict):
    """The dtype the reverse walk stores dR in for the stored chunk gradients (``KernelConfig.stored_dr``)."""
    return jnp.float32 if config.stored_dr == "fp32" else walk_kw["walk_operands"] or jnp.float32


def _bwd_rule(chunk, config, pieces, interpret, backend, group, heads, key_shift, res, cts):
    kernels = _BACKENDS[backend]
    keys = {"key_shift": True} if key_shift else {}
    q, x, y, eta, g, gp, rl, starts, saved_tinv, fold, M = res
    split_state_grads = config.state_grads_for(backend) == "split"
    do, ds_final = cts
    BH, L, dk = token_dims(q, heads)
    dv = y.shape[-1]
    kw = dict(chunk=chunk, pieces=pieces, block_v=config.block_v, interpret=interpret,
              walk_operands=config.walk_operand_dtype(q.dtype), **_layout_kw(heads))
    fwd_kw = dict(kw, num_warps=config.fwd_warps, num_stages=config.walk_stages(config.fwd_stages))
    state_kw = dict(kw, num_warps=config.state_warps, num_stages=config.walk_stages(config.state_stages))
    do = do.astype(y.dtype)
    ds_final = ds_final.astype(jnp.float32)
    chunk_grads = config.chunk_grads_for(backend)
    # the walks below store P and dR for the chunk gradients
    stored = chunk_grads in ("pallas_stored", "pallas_stored_split")
    # 1) T and the state at every chunk start, recomputed from each piece's true initial state (the fused walk:
    #    on the H200 it beat W, U + the state-only walk, 0.22 vs 0.24 + 0.16 ms at 8x2048x16x128)
    if saved_tinv is None:
        tinv = kernels.tri_inverse_pass(x, eta, g, gp, rl, chunk=chunk, interpret=interpret, group=group,
                                        **config.tri_kw(backend, q.dtype), **_layout_kw(heads), **keys)
    else:  # KernelConfig(save_tri=True): the forward's
        tinv = saved_tinv
    if stored:
        p, h, _ = _walk(config, backend, interpret, pieces)(q, x, y, eta, g, gp, rl, tinv, starts, write_o=False,
                                                            write_h=True, write_p=True, **fwd_kw, **keys)
    else:
        h, _ = kernels.forward_pass(q, x, y, eta, g, gp, rl, tinv, starts, write_o=False, write_h=True, **fwd_kw)
    # 2) gradients w.r.t. every chunk's end state, by a reverse walk (pieces: reverse scan over pieces,
    #    dS_end(p-1) = M_pᵀ dS_end(p) + local_p)
    if split_state_grads:  # V, B once for both walks below
        state_grad_pass = kernels.state_grad_split_pass
        lo = state_kw["walk_operands"] or jnp.float32
        b_from_t = config.dstate_b == "from_t"
        # the walk's (c ⊙ Q)ᵀ dO per chunk from prepare, in dh's buffer (KernelConfig.dstate_q; one piece only)
        state_kw["block_v"] = config.split_block_v_for(BH * pieces, dv)
        walk_programs = BH * pieces * (dv // state_kw["block_v"])
        v_dtype = lo if config.stored_v_for(group) == "input" else jnp.float32
        mosaic_walk = pieces == 1 and stored and _takes_mosaic_reverse_walk(
            config, backend, interpret, state_kw["block_v"], q, x, do, tinv, chunk=chunk, v_dtype=v_dtype,
            write_dr=_stored_dr_dtype(config, state_kw), b_from_t=b_from_t, walk_operands=state_kw["walk_operands"])
        q_term = config.dstate_q_for(walk_programs, mosaic_walk) == "prepare" and pieces == 1
        v_in_walk = config.dstate_v_for(mosaic_walk, not q_term) == "walk"
        if v_in_walk:  # the Mosaic reverse walk forms V and the q-term: no prepare pass
            state_kw["vb"] = (None, None, None)
        else:
            state_kw["vb"] = _prepare(config, backend, interpret)(
                q, x, eta, g, gp, rl, tinv, do, chunk=chunk, interpret=interpret,
                num_warps=config.prepare_warps or config.state_warps, heads=heads, b_dtype=lo,
                v_dtype=v_dtype, with_b=not b_from_t,
                q_term_dtype=chunk_state_dtype(q.dtype) if q_term else None,
                walk_operands=state_kw["walk_operands"], **keys)
        state_kw["b_from_t"] = b_from_t
    else:
        state_grad_pass = kernels.state_grad_pass
    if pieces > 1:
        zeros = jnp.zeros((BH, pieces, dk, dv), jnp.float32)
        (local,) = state_grad_pass(q, x, eta, g, gp, rl, tinv, do, zeros, write_dh=False, **state_kw)
        ends_rev, _ = _piece_starts(jnp.swapaxes(M, -1, -2)[:, ::-1], local[:, ::-1], ds_final)
        ds_ends = ends_rev[:, ::-1]
    else:
        ds_ends = ds_final[:, None]
    if stored:
        dr_dtype = _stored_dr_dtype(config, state_kw)
        if split_state_grads and pieces == 1:
            state_grad_pass = _reverse_walk(config, backend, interpret, state_kw["block_v"], v_in_walk)
        dr, dh, ds_start = state_grad_pass(q, x, eta, g, gp, rl, tinv, do, ds_ends, write_dh=True, write_dr=dr_dtype,
                                           **state_kw, **keys)
    else:
        dh, ds_start = state_grad_pass(q, x, eta, g, gp, rl, tinv, do, ds_ends, write_dh=True, **state_kw)
    ds0 = ds_start[:, 0]
    if key_shift:  # through row 0's folded step (keys_read_in_place implies the stored chunk gradients)
        _, x0, *_ = fold  # the residuals of _fold_first_row: (s0, x0, y0, η₀, log γ₀, keep)
        # y's row 0 reaches the loss through the fold alone: ∂/∂y₀ = η₀ dS₀ᵀ x₀.  The walk left dR's row 0 at
        # zero (its feature is zero), so it takes x₀ᵀ dS₀ there, and the chunk gradients' dy = η ⊙ dR gives that
        # row (an in-place update of the one row of a buffer only they read; the row touches nothing else
        # there, all its products being with the zero feature)
        row0 = jnp.einsum("bk,bkd->bd", x0, ds0, precision=jax.lax.Precision.HIGHEST)  # [BH, dv]
        dr = dr.at[:, 0].set(row0.reshape(dr[:, 0].shape).astype(dr.dtype))  # dR is like y (either layout)
        ds0, dx0, _, deta0, dlg0 = _first_row_grads(fold, ds0)
        ds0 = (ds0, dx0)
    # 3) per-chunk gradients
    if stored:
        stored_pass = (_mosaic_or_triton(config.chunk_grads_kernel, backend, interpret,
                                         mosaic_gpu.chunk_grad_stored_pass, kernels.chunk_grad_stored_pass)
                       if chunk_grads == "pallas_stored" else kernels.chunk_grad_stored_split_pass)
        dq, dx, dy, deta, dg, dgp = stored_pass(
            q, x, y, eta, g, gp, rl, do, h, dh, p, dr, chunk=chunk, block_v=config.grad_block_v,
            interpret=interpret, num_warps=config.grad_warps, num_stages=config.grad_stages, group=group,
            walk_operands=config.walk_operand_dtype(q.dtype), block_k=config.grad_block_k, loops=config.grad_loops,
            **_layout_kw(heads), **keys)
    elif chunk_grads == "xla":
        dq, dx, dy, deta, dg, dgp = xla_chunk_grads(q, x, y, eta, g, gp, rl, tinv, do, h, dh, chunk=chunk,
                                                    group=group, heads=heads,
                                                    operands=config.walk_operand_dtype(q.dtype))
    elif chunk_grads == "pallas_split":
        dq, dx, dy, deta, dg, dgp = kernels.chunk_grad_split_pass(
            q, x, y, eta, g, gp, rl, tinv, do, h, dh, chunk=chunk, block_v=config.block_v, interpret=interpret,
            num_warps=config.grad_warps, num_stages=config.grad_stages, group=group,
            walk_operands=config.walk_operand_dtype(q.dtype), block_k=config.grad_block_k, **_layout_kw(heads))
    else:
        dq, dx, dy, deta, dg, dgp = kernels.chunk_grad_pass(
            q, x, y, eta, g, gp, rl, tinv, do, h, dh, chunk=chunk, block_v=config.block_v, interpret=interpret,
            num_warps=config.grad_warps, num_stages=config.grad_stages, group=group, **_layout_kw(heads))
    dlog_gamma = _log_gamma_grad(dg, dgp, chunk, group)
    if key_shift:  # the kernels' dx is by write-feature row: x[t] = k[t − 1]
        dx = shift_time(dx, -1, axis=1)
        # the kernels saw log γ₀ = 0 and a zero feature: row 0's gates reach the output through the fold alone
        deta, dlog_gamma = deta.at[:, 0].set(deta0), dlog_gamma.at[:, 0].set(dlg0)
    return dq, dx, dy, deta, dlog_gamma, None, ds0


_kernel_op.defvjp(_fwd_rule, _bwd_rule)


_COLUMN_BACKENDS = {"pallas_gpu": pallas_gpu_columns, "pallas_tpu": pallas_tpu_columns}  # per-column kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _column_op(q, x, y, eta, log_gamma, run, s0, chunk, config, interpret, residual, implementation):
    out, _ = _column_forward(q, x, y, eta, log_gamma, run, s0, chunk, config, interpret, residual, implementation)
    return out


def _column_kw(chunk, config, interpret, residual):
    return dict(chunk=chunk, block_v=config.column_block_v, interpret=interpret, num_warps=config.column_warps,
                residual=residual, blocked=config.column_solve == "blocked")


def _column_forward(q, x, y, eta, log_gamma, run, s0, chunk, config, interpret, residual, implementation):
    g, gp, rl = _gates(log_gamma, run, chunk)
    o, s_end = _COLUMN_BACKENDS[implementation].forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=True,
                                                             write_h=False,
                                                             **_column_kw(chunk, config, interpret, residual))
    return (o, s_end), (q, x, y, eta, g, gp, rl, s0)


def _column_bwd(chunk, config, interpret, residual, implementation, res, cts):
    q, x, y, eta, g, gp, rl, s0 = res
    do, ds_final = cts
    kw = _column_kw(chunk, config, interpret, residual)
    kernels = _COLUMN_BACKENDS[implementation]
    h, _ = kernels.forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=False, write_h=True, **kw)
    dq, dx, dy, deta, dg, dgp, ds0 = kernels.backward_pass(
        q, x, y, eta, g, gp, rl, do.astype(y.dtype), h, ds_final.astype(jnp.float32), **kw)
    # g = chunk-local inclusive cumsum, gp = g − log γ (unused without the residual)
    dlog = reverse_chunk_cumsum(dg + dgp, chunk) - dgp if residual else reverse_chunk_cumsum(dg, chunk)
    return (jnp.sum(dq, axis=1).astype(q.dtype), jnp.sum(dx, axis=1).astype(x.dtype), dy, deta, dlog, None, ds0)


_column_op.defvjp(lambda *a: _column_forward(*a), _column_bwd)


def decayed_delta_rule(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                       implementation: str = "auto", config: KernelConfig | None = None,
                       pieces: int | None = None, interpret: bool | None = None, layout: str = "BHTD",
                       shifted_keys: bool = False, first_key=None):
    """Chunked decayed delta rule (residual on the undecayed state).

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      eta: ``[B, H, T]`` write weight, or ``[B, H, T, dv]`` one per value column (cast to fp32).
      log_gamma: ``[B, H, T]`` log decay ≤ 0, or ``[B, H, T, dv]`` per value column (cast to fp32).
      run: ``[B, H, T]`` int, number of segment starts up to t (non-decreasing; 0 = continues
        ``initial_state``); the state resets to zero before a step whose run index changes.
      initial_state: ``[B, H, dk, dv]``.
      layout: ``"BHTD"`` (the shapes above) or ``"BTHD"``: q, x ``[B, T, H, dk]``, y ``[B, T, H, dv]``,
        eta, log_gamma and run ``[B, T, H]`` (or ``[B, T, H, dv]``), o ``[B, T, H, dv]``. The GPU Triton
        kernels (scalar gates) read and write it in place; the other paths transpose.
      shifted_keys: x holds the keys k and row t's write feature is ``k[t − 1]``; row 0's is ``first_key``:
        Falcon's prefix-aligned pair ``(k_{t−1}, v_t)`` without a shifted copy of k.  The GPU's default passes
        read k one row back in place (:func:`keys_read_in_place`) and row 0's step is done in XLA, folded into
        the initial state; the other paths shift k in XLA.  x's gradient is k's.
      first_key: ``[B, H, dk]``, row 0's write feature under ``shifted_keys`` (a key carried from an earlier
        segment; its gradient is returned like any input's); None: zero.
    Returns:
      ``(o [B, H, T, dv] (or [B, T, H, dv]) in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    check_layout(layout)
    implementation = resolve_implementation(implementation, IMPLEMENTATIONS)
    per_column = eta.ndim == 4 or log_gamma.ndim == 4
    if first_key is not None:
        if not shifted_keys:
            raise ValueError("decayed_delta_rule: first_key is row 0's write feature under shifted_keys=True; pass "
                             "shifted_keys=True, or put the feature into x's row 0 yourself.")
        want = initial_state.shape[:3]
        if first_key.shape != want:
            raise ValueError(f"decayed_delta_rule: first_key must be [B, H, dk] = {list(want)} (initial_state's "
                             f"leading dims), got {list(first_key.shape)}.")
    in_place = layout == "BTHD"
    if in_place and (implementation != "pallas_gpu" or per_column):  # only these read BTHD in place
        o, final = decayed_delta_rule(*(swap_time_heads(a) for a in (q, x, y, eta, log_gamma, run)), initial_state,
                                      chunk_size=chunk_size, implementation=implementation, config=config,
                                      pieces=pieces, interpret=interpret, shifted_keys=shifted_keys,
                                      first_key=first_key)
        return swap_time_heads(o), final
    time_axis = 1 if in_place else 2
    if shifted_keys and (implementation == "xla" or per_column):  # x[t] = k[t − 1], x[0] = first_key
        x, shifted_keys = _keys_one_row_later(x, first_key, time_axis), False
    if implementation == "xla":
        o, final = decayed_delta_rule_reference(q, x, y, eta, log_gamma, run, initial_state)
        return o.astype(y.dtype), final
    if per_column:
        return _per_column(q, x, y, eta, log_gamma, run, initial_state, chunk_size, implementation, config,
                           interpret, residual=True)
    interpret = interpret_default(implementation, interpret)
    reason = unsupported_reason(q, y, chunk_size, interpret)
    if reason is not None:
        raise NotImplementedError(f"{implementation} decayed_delta_rule: {reason}")
    if in_place:
        B, T, H, dk = q.shape
    else:
        B, H, T, dk = q.shape
    dv = y.shape[-1]
    dtype = q.dtype
    chunk = chunk_size
    n_chunks = next_pow2(-(-T // chunk))  # power-of-two chunk count keeps every block a power of two
    L = n_chunks * chunk
    config = config or KernelConfig()
    config = config.resolved(B * H, dv, dtype, dk)
    if implementation == "pallas_tpu":
        P = 1  # TPU: batch·heads across cores, chunks sequential on each
    else:
        P = pieces or pieces_for(B * H, dv // config.block_v, n_chunks, config.target_programs)

    # padding: zero pairs, zero write weight and zero log decay (identity steps), run continued.  In place the
    # tokens stay [B, L, H, d] (padded in time only); the gates are [B·H, L] either way.
    tokens, gates = kernel_operands(in_place, L, gate_kernel=config.gate_transpose == "pallas",
                                    interpret=bool(interpret))
    key_shift = shifted_keys and keys_read_in_place(config, implementation, B * H, dv, P)
    if shifted_keys and not key_shift:
        x = shift_time(x, 1, axis=time_axis)
    f32 = jnp.float32
    heads = H if in_place else None
    y_k, eta_k, lg_k, run_k = (tokens(y.astype(dtype)), gates(eta.astype(f32)), gates(log_gamma.astype(f32)),
                               gates(run.astype(jnp.int32), mode="edge"))
    s0 = initial_state.astype(f32).reshape(B * H, dk, dv)
    x0 = None if first_key is None else first_key.astype(f32).reshape(B * H, dk)
    if key_shift:  # the op folds row 0's step itself (_forward), so that the kernels form its dy row
        s0 = (s0, jnp.zeros((B * H, dk), f32) if x0 is None else x0)
    elif shifted_keys and x0 is not None:  # the shifted copy's row 0 is zero: row 0's step folded here
        (s0, eta_k, lg_k, run_k), _ = _fold_first_row(s0, x0, y_k, eta_k, lg_k, run_k, heads)
    o, final = _kernel_op(tokens(q.astype(dtype)), tokens(x.astype(dtype)), y_k, eta_k, lg_k, run_k, s0, chunk,
                          config, P, bool(interpret), implementation, 1, heads, key_shift)
    o = o[:, :T] if in_place else o[:, :T].reshape(B, H, T, dv)
    return o, final.reshape(B, H, dk, dv)


def _per_column(q, x, y, eta, log_gamma, run, initial_state, chunk_size, implementation, config, interpret,
                residual):
    """The per-column kernel of ``implementation`` (``pallas_gpu_columns`` or ``pallas_tpu_columns``;
    ``residual``: decayed delta rule, Falcon-2; else the inner-product rule, Falcon-2A).  Gates ``[B, H, T]`` are
    broadcast over the value columns."""
    name = "decayed_delta_rule" if residual else "decayed_attention_per_column"
    interpret = interpret_default(implementation, interpret)
    reason = unsupported_reason(q, y, chunk_size, interpret)
    if reason is not None:
        raise NotImplementedError(f"{implementation} {name}: {reason}")
    B, H, T, dk = q.shape
    dv = y.shape[-1]
    dtype, f32 = q.dtype, jnp.float32
    L = next_pow2(-(-T // chunk_size)) * chunk_size
    config = config or KernelConfig()
    block_v = min(config.column_block_v, dv)
    if implementation == "pallas_tpu":  # Mosaic: a multiple of 128 columns or all of dv (interpret mode alike)
        block_v = pallas_tpu_columns.value_block(block_v, dv)
    config = dataclasses.replace(config, column_block_v=block_v)
    eta, log_gamma = (a if a.ndim == 4 else jnp.broadcast_to(a[..., None], (*a.shape, dv)) for a in (eta, log_gamma))

    flat = functools.partial(flatten_pad, length=L)  # zero pairs, write weight, log decay; run continued

    o, final = _column_op(flat(q.astype(dtype)), flat(x.astype(dtype)), flat(y.astype(dtype)),
                          flat(eta.astype(f32)), flat(log_gamma.astype(f32)), flat(run.astype(jnp.int32), mode="edge"),
                          initial_state.astype(f32).reshape(B * H, dk, dv), chunk_size, config, bool(interpret),
                          residual, implementation)
    return o[:, :T].reshape(B, H, T, dv), final.reshape(B, H, dk, dv)


def decayed_attention_per_column(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                                 implementation: str = "auto", config: KernelConfig | None = None,
                                 interpret: bool | None = None):
    """Decayed linear attention with per-column gates (Falcon-2A's recurrence), value column c::

        s'_{t-1,c} = [r_t = r_{t-1}] · s_{t-1,c}
        s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t,      o_t = S_tᵀ q_t

    (``reference.decayed_attention_per_column_reference``).  The per-column kernel of
    :func:`decayed_delta_rule` without the residual (``P = η ⊙ Y``, no triangular system), with the
    backward of that kernel minus its solve terms.  ``"pallas_gpu"`` (``pallas_gpu_columns``) or
    ``"pallas_tpu"`` (``pallas_tpu_columns``), each in its interpret mode off its accelerator, or ``"xla"``.

    Args: as :func:`decayed_delta_rule` (eta, log_gamma ``[B, H, T, dv]`` or ``[B, H, T]``).
    Returns: ``(o [B, H, T, dv] in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    implementation = resolve_implementation(implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        o, final = decayed_attention_per_column_reference(q, x, y, eta, log_gamma, run, initial_state)
        return o.astype(y.dtype), final
    return _per_column(q, x, y, eta, log_gamma, run, initial_state, chunk_size, implementation, config, interpret,
                       residual=False)


def windowed_unsupported_reason(window: int, q, y, chunk_size: int, interpret: bool = False) -> str | None:
    """The windowed op runs ``next_pow2(window)`` virtual writes per step inside 16-row blocks."""
    slots = next_pow2(window)
    if slots > 16:
        return (f"window={window}: the kernel puts next_pow2(window) = {slots} virtual writes per step into its "
                "16-row blocks (at most 16)")
    reason = unsupported_reason(q, y, chunk_size, interpret)
    if reason is None and chunk_size < slots:
        reason = f"chunk_size={chunk_size} is below next_pow2(window) = {slots} rows (one step)"
    return reason


def windowed_delta_rule(q, x, y, w, log_gamma, run, initial_state, *, chunk_size: int = 64,
                        implementation: str = "auto", config: KernelConfig | None = None,
                        pieces: int | None = None, interpret: bool | None = None):
    """Windowed decayed delta rule (Falcon-3): every step writes its window's ``W`` pairs, all residuals on the
    same (undecayed) previous state — ``reference.windowed_delta_rule_reference``.

    Step t's update ``S_t = (e^{a_t} I − Σ_i w_{t,i} x_{t+i} x_{t+i}ᵀ) S_{t-1} + Σ_i w_{t,i} x_{t+i} y_{t+i}ᵀ``
    is a rank-W delta transition.  The kernels run it as the Falcon-1 chunk form over *virtual writes*:
    step t becomes ``Wp = next_pow2(W)`` rows ``(t, i)`` with pair ``(x_{t+i}, y_{t+i})`` and weight
    ``w_{t,i}`` (rows ``i ≥ W`` zero), all sharing step t's write decay ``g_t`` and residual decay
    ``g_{t-1}``; the triangular system couples a row only to rows of *earlier steps* (``group = Wp``), so
    the rows of one step see the same state.  A window's pairs recur in W steps' rows (the C+W−1 overlap,
    materialised).  ``chunk_size`` counts rows: ``chunk_size / Wp`` steps per chunk.

    Args:
      q: ``[B, H, T, dk]``; x: ``[B, H, T+W-1, dk]``, y: ``[B, H, T+W-1, dv]`` (window entry i of step t is
        index t+i: the W−1 older pairs in front); w: ``[B, H, T, W]`` write weights; log_gamma, run:
        ``[B, H, T]`` (as :func:`decayed_delta_rule`); initial_state ``[B, H, dk, dv]``.
    Returns:
      ``(o [B, H, T, dv] in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    from falcon_jax.kernels.decayed_delta_rule.reference import windowed_delta_rule_reference

    implementation = resolve_implementation(implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        o, final = windowed_delta_rule_reference(q, x, y, w, log_gamma, run, initial_state)
        return o.astype(y.dtype), final
    interpret = interpret_default(implementation, interpret)
    B, H, T, dk = q.shape
    W = w.shape[-1]
    dv = y.shape[-1]
    reason = windowed_unsupported_reason(W, q, y, chunk_size, interpret)
    if reason is not None:
        raise NotImplementedError(f"{implementation} windowed_delta_rule: {reason}")
    Wp = next_pow2(W)
    steps = chunk_size // Wp  # steps per chunk
    n_chunks = next_pow2(-(-T // steps))
    Ls = n_chunks * steps  # padded steps
    dtype = q.dtype
    config = config or KernelConfig()
    config = config.resolved(B * H, dv, dtype, dk)
    if implementation == "pallas_tpu":
        P = 1
    else:
        P = pieces or pieces_for(B * H, dv // config.block_v, n_chunks, config.target_programs)
    f32 = jnp.float32

    pad = flatten_pad  # [B,H,len,...] -> [BH, n, ...]
    # padding: zero pairs, weights and log decays (identity steps), run continued
    x_e, y_e = pad(x.astype(dtype), Ls + W - 1), pad(y.astype(dtype), Ls + W - 1)

    def virtual(a):  # [BH, Ls+W-1, d] -> [BH, Ls*Wp, d]: row (t, i) = pair t+i, rows i ≥ W zero
        slots = [a[:, i:i + Ls] for i in range(W)] + [jnp.zeros_like(a[:, :Ls])] * (Wp - W)
        return jnp.stack(slots, axis=2).reshape(B * H, Ls * Wp, a.shape[-1])

    q_p = pad(q.astype(dtype), Ls)  # each step reads at its last row (after all its writes)
    q_v = jnp.concatenate([jnp.zeros((B * H, Ls, Wp - 1, dk), dtype), q_p[:, :, None]], axis=2)
    w_v = jnp.pad(pad(w.astype(f32), Ls), [(0, 0), (0, 0), (0, Wp - W)]).reshape(B * H, Ls * Wp)
    o, final = _kernel_op(q_v.reshape(B * H, Ls * Wp, dk), virtual(x_e), virtual(y_e), w_v,
                          pad(log_gamma.astype(f32), Ls), pad(run.astype(jnp.int32), Ls, "edge"),
                          initial_state.astype(f32).reshape(B * H, dk, dv), chunk_size, config, P,
                          bool(interpret), implementation, Wp, None, False)
    o = o.reshape(B * H, Ls, Wp, dv)[:, :T, Wp - 1]
    return o.reshape(B, H, T, dv), final.reshape(B, H, dk, dv)
