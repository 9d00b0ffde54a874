"""``decayed_attention`` (Falcon-1A, 3A, decayed linear attention) against its definition in float64.

    S_t = [same segment] · e^{a_t} S_{t-1} + x_t y_tᵀ,   o_t = S_tᵀ q_t

One class of checks per lowering with that lowering's settings (``IMPLEMENTATION``, ``INTERPRET = False``); the
``Test...Interpret`` subclasses run them in Pallas's interpret mode on a CPU.  A class for a real accelerator
subclasses the lowering's class as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_attention import KernelConfig, decayed_attention
from falcon_jax.kernels.decayed_attention.config import tuned_config
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference
from tests.kernels.helpers import (S, check_op, clamped_decays, custom_call_lines, lowered_text, on_backend,
                                   pallas_calls, run_index, time_major)

NAMES = ("q", "x", "y", "log_decay", "initial_state")


def attention_inputs(rng, B=1, H=2, T=37, dk=16, dv=32, segments=True, decay_range=(0.0, 0.3)):
    """``(q, x, y, log decay, s0)`` float64 and the run index."""
    q = rng.normal(size=(B, H, T, dk))
    x = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(B, H, T, dv))
    log_decay = -rng.uniform(*decay_range, size=(B, H, T))
    s0 = rng.normal(size=(B, H, dk, dv))
    return (q, x, y, log_decay, s0), run_index(rng, B, H, T, segments)


def reference(run):
    return lambda q, x, y, log_decay, s0: decayed_attention_reference(q, x, y, log_decay, run, s0)


class DecayedAttentionChecks:
    """The checks every lowering of the op must pass; subclasses set the lowering."""

    IMPLEMENTATION: str
    INTERPRET: bool = False

    def op(self, run, layout="BHTD", **kw):
        def call(q, x, y, log_decay, s0):
            if layout == "BTHD":  # the kernels get [B, T, H, d]; the test compares in [B, H, T, d]
                q, x, y, log_decay = (time_major(a) for a in (q, x, y, log_decay))
                o, s = decayed_attention(q, x, y, log_decay, time_major(run), s0, chunk_size=16, layout="BTHD",
                                         implementation=self.IMPLEMENTATION, interpret=self.INTERPRET, **kw)
                return time_major(o), s
            return decayed_attention(q, x, y, log_decay, run, s0, chunk_size=16, implementation=self.IMPLEMENTATION,
                                     interpret=self.INTERPRET, **kw)
        return call

    @pytest.mark.parametrize("T,segments", [(1, False), (37, True), pytest.param(100, False, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, T, segments):
        """T = 1, a padded last chunk with segment starts inside chunks, several chunks; non-zero initial
        state."""
        args, run = attention_inputs(rng, T=T, segments=segments)
        check_op(rng, self.op(run), reference(run), args, NAMES, grads=False)

    def test_gradients_match_float64(self, rng):
        """Every input's gradient, segment starts inside chunks, dv = 32 in two value blocks of 16."""
        args, run = attention_inputs(rng, T=45)
        check_op(rng, self.op(run, config=KernelConfig(block_v=16)), reference(run), args, NAMES)

    def test_model_layout_matches_float64(self, rng):
        """``layout="BTHD"``: ``[B, T, H, d]`` tokens (H = 3: rows strided over the heads), values and
        gradients."""
        args, run = attention_inputs(rng, B=2, H=3, T=37)
        check_op(rng, self.op(run, layout="BTHD"), reference(run), args, NAMES)

    def test_decays_at_the_clamp_and_one(self, rng):
        """γ = 1e-6 (log γ ≈ −13.8) on a third of the steps and γ = 1 elsewhere: only differences of cumulative
        log decays with the later one first are exponentiated."""
        (q, x, y, _, s0), run = attention_inputs(rng, T=64, segments=False)
        log_decay = clamped_decays(rng, q.shape[:3])
        check_op(rng, self.op(run), reference(run), (q, x, y, log_decay, s0), NAMES, grads=False)

    def test_log_decay_below_the_floor(self, rng):
        """One step of log decay −1e30 and one of −inf (hard resets) among small ones: they count as −30, so the
        chunk's later small decays are not lost to rounding in its cumulative sums and −inf − (−inf) gives no
        NaN."""
        (q, x, y, log_decay, s0), run = attention_inputs(rng, T=37, segments=False)
        log_decay[:, :, 5], log_decay[:, :, 20] = -1e30, -np.inf
        floored = lambda q, x, y, log_decay, s0: reference(run)(q, x, y, jnp.maximum(log_decay, -30.0), s0)
        check_op(rng, self.op(run), floored, (q, x, y, log_decay, s0), NAMES, grads=False)


class TritonDecayedAttention(DecayedAttentionChecks):
    IMPLEMENTATION = "triton"

    @pytest.mark.parametrize("pieces", [4, pytest.param(2, marks=pytest.mark.slow)])
    def test_pieces_match_float64(self, rng, pieces):
        """The sequence cut into pieces walked in parallel (each piece's end state from zero, a scan over pieces
        for their initial states, the reverse scan for the state gradients): values and gradients, segment starts
        inside pieces."""
        args, run = attention_inputs(rng, T=100)
        check_op(rng, self.op(run, pieces=pieces), reference(run), args, NAMES)

    def test_pieces_follow_the_program_count(self, rng):
        """Pieces until batch·heads × value blocks × pieces reaches ``pieces_below``: the forward then walks twice
        (piece ends, then outputs); one piece walks once."""
        args, run = attention_inputs(rng, T=128)
        args = [jnp.asarray(a, jnp.float32) for a in args]
        few = pallas_calls(self.op(run, config=KernelConfig(block_v=32, pieces_below=128)), *args)
        enough = pallas_calls(self.op(run, config=KernelConfig(block_v=32, pieces_below=2)), *args)
        assert few == ["falcon_decayed_attention_fwd"] * 2 and enough == ["falcon_decayed_attention_fwd"]


class TestTritonDecayedAttentionInterpret(TritonDecayedAttention):
    INTERPRET = True


class MosaicTPUDecayedAttention(DecayedAttentionChecks):
    IMPLEMENTATION = "mosaic_tpu"


class TestMosaicTPUDecayedAttentionInterpret(MosaicTPUDecayedAttention):
    INTERPRET = True


# ---- the launch parameters ----------------------------------------------------------------------------------

def test_kernel_config_is_validated():
    assert tuned_config() == KernelConfig()
    for bad in ({"block_v": 48}, {"block_v": 8}, {"block_v": 32.0}, {"fwd_warps": 3}, {"state_warps": 0},
                {"grad_warps": 32}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"KernelConfig: {name} must be"):
            KernelConfig(**bad)


@pytest.mark.parametrize("bad", [{"fwd_stages": 0}, {"grad_stages": None}, {"fwd_stages": 1.5},
                                 {"pieces_below": None}, {"pieces_below": -1}])
def test_kernel_config_refuses_bad_stages_and_program_counts(bad):
    """Stages (ints >= 1) and ``pieces_below`` (an int >= 0) are checked where the config is made: before, a
    ``pieces_below=None`` reached a comparison deep inside the call (a bare TypeError) and bad stages a Triton
    launch."""
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"KernelConfig: {name} must be an int >= "):
        KernelConfig(**bad)
    KernelConfig(pieces_below=0)


# ---- cross-lowered for the accelerators -----------------------------------------------------------------------

@pytest.mark.parametrize("layout,dtype,pieces", [("BTHD", jnp.bfloat16, 2), ("BHTD", jnp.float32, 1)])
def test_triton_lowering_reads_the_model_layout_in_place(monkeypatch, layout, dtype, pieces):
    """Forward + backward through the Triton lowering rules (d = 128, chunk 64, H = 3): every pass lowers (the
    walk, its recompute in the backward, the reverse walk, the chunk gradients; with pieces a walk for the
    pieces' end states and a reverse one for their gradients), and in ``[B, T, H, d]`` no token array is
    transposed around the kernels."""
    on_backend(monkeypatch, "gpu")
    B, H, T, D = 2, 3, 512, 128
    tok = (B, T, H, D) if layout == "BTHD" else (B, H, T, D)
    gate = tok[:3]
    run = jnp.zeros(gate, jnp.int32)

    def loss(q, x, y, log_decay, s0):
        o, s = decayed_attention(q, x, y, log_decay, run, s0, implementation="triton", pieces=pieces, layout=layout)
        assert o.shape == tok and o.dtype == dtype
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = lowered_text(jax.grad(loss, argnums=tuple(range(5))), [S(tok, dtype)] * 3 + [
        S(gate, jnp.float32), S((B, H, D, D), jnp.float32)])
    counts = {name: len(custom_call_lines(text, f"falcon_decayed_attention_{name}"))
              for name in ("fwd", "dstate", "chunk_grads")}
    assert counts == {"fwd": 2 + (pieces > 1), "dstate": 1 + (pieces > 1), "chunk_grads": 1}
    transposed = [line for line in text.splitlines() if "stablehlo.transpose" in line and f"{B}x{T}x{H}x{D}" in line]
    assert layout == "BHTD" or not transposed, transposed[:2]


def test_mosaic_tpu_lowering(monkeypatch):
    """Forward + backward through the Mosaic TPU lowering rules (bf16, d = 128, chunk 64): Mosaic's block rules
    and every op's lowering rule; compiling for a TPU needs one."""
    B, H, T, D = 1, 2, 256, 128
    run = jnp.zeros((B, H, T), jnp.int32)

    def loss(q, x, y, log_decay, s0):
        o, s = decayed_attention(q, x, y, log_decay, run, s0, implementation="mosaic_tpu", interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    tok = S((B, H, T, D), jnp.bfloat16)
    on_backend(monkeypatch, "tpu")
    text = lowered_text(jax.grad(loss, argnums=tuple(range(5))),
                        [tok] * 3 + [S((B, H, T), jnp.float32), S((B, H, D, D), jnp.float32)], platform="tpu")
    for name in ("fwd_tpu", "dstate_tpu", "chunk_grads_tpu"):
        assert f"falcon_decayed_attention_{name}" in text, name
    assert "tpu_custom_call" in text
