"""``windowed_delta_rule`` (Falcon-3) against its definition in float64: every step writes its window's W pairs,
all residuals on the same previous state,

    S_t = e^{a_t} S'_{t-1} + Σ_{i<W} w_{t,i} x_{t+i} (y_{t+i} − S'_{t-1}ᵀ x_{t+i})ᵀ,   o_t = S_tᵀ q_t

run by the decayed delta rule's passes over ``next_pow2(W)`` virtual rows per step.  One class of checks per
lowering (``IMPLEMENTATION``, ``INTERPRET = False``); the ``Test...Interpret`` subclasses run in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_delta_rule import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.reference import decayed_delta_rule_reference
from falcon_jax.kernels.windowed_delta_rule import windowed_delta_rule
from falcon_jax.kernels.windowed_delta_rule.compact import windowed_delta_rule_compact
from falcon_jax.kernels.windowed_delta_rule.reference import windowed_delta_rule_reference
from tests.kernels.helpers import (S, check_op, clamped_decays, custom_call_lines, lowered_text, nearly_parallel,
                                   on_backend, run_index)

NAMES = ("q", "x", "y", "w", "log_gamma", "initial_state")


def window_inputs(rng, W, T=37, H=1, dk=16, dv=16, segments=True, beta=None, x=None):
    """``(q, x, y, w, log γ, s0)`` and the run index: pairs ``[B, H, T+W-1, d]`` (the W−1 older pairs in front),
    weights with ``λmax(Σ_i w_{t,i} x_{t+i} x_{t+i}ᵀ) = β_t`` (the rank-W write's top eigenvalue, stable for β < 2;
    ``beta`` None: uniform in (0.1, 1.9)), unequal per slot unless β is given."""
    q = rng.normal(size=(1, H, T, dk))
    x = rng.normal(size=(1, H, T + W - 1, dk)) / np.sqrt(dk) if x is None else x
    y = rng.normal(size=(1, H, T + W - 1, dv))
    x_win = np.stack([x[:, :, i:i + T] for i in range(W)], axis=3)
    lam_max = np.linalg.eigvalsh(np.einsum("bhtik,bhtjk->bhtij", x_win, x_win))[..., -1]
    w = np.broadcast_to(((rng.uniform(0.1, 1.9, size=(1, H, T)) if beta is None else beta) / lam_max)[..., None],
                        (1, H, T, W)).copy()
    if beta is None:
        w *= rng.uniform(0.5, 1.0, size=w.shape)  # still stable
    log_gamma = -rng.uniform(0.0, 0.3, size=(1, H, T))
    s0 = rng.normal(size=(1, H, dk, dv)) / 4
    return (q, x, y, w, log_gamma, s0), run_index(rng, 1, H, T, segments)


def reference(run):
    return lambda q, x, y, w, log_gamma, s0: windowed_delta_rule_reference(q, x, y, w, log_gamma, run, s0)


class WindowedDeltaRuleChecks:
    IMPLEMENTATION: str
    INTERPRET: bool = False

    def op(self, run, chunk=16, **kw):
        return lambda q, x, y, w, log_gamma, s0: windowed_delta_rule(
            q, x, y, w, log_gamma, run, s0, chunk_size=chunk, implementation=self.IMPLEMENTATION,
            interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("W,T,chunk", [(3, 29, 16), (4, 1, 16), pytest.param(2, 37, 16, marks=pytest.mark.slow),
                                           pytest.param(4, 45, 32, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, W, T, chunk):
        """Odd T, segment starts inside chunks, non-zero initial state; W = 3 pads each step to 4 rows."""
        args, run = window_inputs(rng, W, T=T)
        check_op(rng, self.op(run, chunk=chunk), reference(run), args, NAMES, grads=False)

    def test_gradients_match_float64(self, rng):
        """Gradients w.r.t. q, the window pairs (each recurs in W steps' rows), the per-slot weights, log γ and
        S0; segments inside chunks; dv = 32."""
        args, run = window_inputs(rng, 3, T=29, dv=32)
        check_op(rng, self.op(run), reference(run), args, NAMES)

    def test_extreme_gates(self, rng):
        """The rank-W write's top eigenvalue β = 1.999 with nearly parallel keys (the transition's eigenvalue
        along them ≈ −0.999) and γ = 1e-6 on a third of the steps, 1 elsewhere: within 1e-4."""
        W, T = 4, 40
        x = nearly_parallel(rng.normal(size=(1, 1, T + W - 1, 16)) / 4)
        (q, x, y, w, _, s0), run = window_inputs(rng, W, T=T, segments=False, beta=1.999, x=x)
        args = (q, x, y, w, clamped_decays(rng, w.shape[:3]), s0)
        check_op(rng, self.op(run, chunk=32), reference(run), args, NAMES, tol=1e-4, grads=False)

    def test_log_decay_below_the_floor(self, rng):
        """One step of log γ = −1e30 and one of −inf (hard resets) among small ones count as −30: finite, and
        the chunk's later small decays are not lost to rounding in its cumulative sums."""
        (q, x, y, w, log_gamma, s0), run = window_inputs(rng, 3, T=29, segments=False)
        log_gamma[:, :, 5], log_gamma[:, :, 14] = -1e30, -np.inf
        check_op(rng, self.op(run), reference(run), (q, x, y, w, log_gamma, s0), NAMES, grads=False)


class TritonWindowedDeltaRule(WindowedDeltaRuleChecks):
    IMPLEMENTATION = "triton"

    def test_pieces_match_float64(self, rng):
        """W = 4, the sequence in two pieces (the piece maps over virtual rows): values and gradients."""
        args, run = window_inputs(rng, 4, T=45, dv=32)
        check_op(rng, self.op(run, chunk=32, pieces=2, config=KernelConfig(block_v=16)), reference(run), args, NAMES)

    def test_one_live_slot_is_the_decayed_delta_rule(self, rng):
        """W = 2 with slot 0's weights zero: every step writes only its current pair, Falcon-1's recurrence (the
        group-strict system of 2-row steps and the per-step gates, against the plain definition)."""
        (q, x, y, w, log_gamma, s0), run = window_inputs(rng, 2, T=37)
        w[..., 0] = 0.0

        def plain(q, x, y, w, log_gamma, s0):
            return decayed_delta_rule_reference(q, x[:, :, 1:], y[:, :, 1:], w[..., 1], log_gamma, run, s0)

        check_op(rng, self.op(run), plain, (q, x, y, w, log_gamma, s0), NAMES, grads=False)


class TestTritonWindowedDeltaRuleInterpret(TritonWindowedDeltaRule):
    INTERPRET = True


class TestXLAWindowedDeltaRule(WindowedDeltaRuleChecks):
    """The compact chunk form (:mod:`.compact`): window residuals carried by W × W recurrences, one fresh read
    per step solved on the chunk's distinct pairs."""

    IMPLEMENTATION = "xla"

    @pytest.mark.parametrize("W,T,steps", [(1, 33, 8), pytest.param(2, 40, 16, marks=pytest.mark.slow),  # W = 5's
                                           (5, 70, 12), (4, 64, 64)])
    def test_compact_form_matches_float64(self, rng, W, T, steps):
        """Chunks of 8, 12 (padded to 16 for the triangular inverse), 16 and 64 steps; W = 1 (Falcon-1), 2, 5
        (a window wider than half the 8-step chunk reaches back into the previous chunk), segments: values and
        every gradient."""
        args, run = window_inputs(rng, W, T=T, dv=8)

        def op(q, x, y, w, log_gamma, s0):
            return windowed_delta_rule_compact(q, x, y, w, log_gamma, run, s0, chunk_size=steps)

        check_op(rng, op, reference(run), args, NAMES)


class MosaicTPUWindowedDeltaRule(WindowedDeltaRuleChecks):
    IMPLEMENTATION = "mosaic_tpu"


class TestMosaicTPUWindowedDeltaRuleInterpret(MosaicTPUWindowedDeltaRule):
    INTERPRET = True


@pytest.mark.parametrize("implementation,platform", [("triton", "gpu"), ("mosaic_tpu", "tpu")])
def test_lowers_for_the_accelerator(monkeypatch, implementation, platform):
    """Forward + backward, W = 4, bf16, d = 128, chunk 64 (16 steps): every pass lowers; on the GPU the reverse
    walk stores V in fp32 for a window's rows (``dR = V + Tᵀ(w ⊙ X dS)`` cancels more with repeated keys)."""
    on_backend(monkeypatch, platform)
    B, H, T, D, W = 1, 2, 256, 128, 4
    run = jnp.zeros((B, H, T), jnp.int32)

    def loss(q, x, y, w, log_gamma, s0):
        o, s = windowed_delta_rule(q, x, y, w, log_gamma, run, s0, implementation=implementation)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    xy = S((B, H, T + W - 1, D), jnp.bfloat16)
    text = lowered_text(jax.grad(loss, argnums=tuple(range(6))),
                        [S((B, H, T, D), jnp.bfloat16), xy, xy, S((B, H, T, W), jnp.float32),
                         S((B, H, T), jnp.float32), S((B, H, D, D), jnp.float32)],
                        platform="cuda" if platform == "gpu" else "tpu")
    if platform == "tpu":
        for name in ("tri_inverse_tpu", "fwd_tpu", "dstate_tpu", "chunk_grads_tpu"):
            assert f"falcon_delta_{name}" in text, name
        return
    for name in ("tri_inverse", "fwd", "dstate_prepare", "dstate_walk", "chunk_grads"):
        assert custom_call_lines(text, f"falcon_delta_{name}"), name
    (prepare,) = custom_call_lines(text, "falcon_delta_dstate_prepare")
    assert f"tensor<{B * H}x{T * W}x{D}xf32>" in prepare.rsplit("->", 1)[1]  # V of T steps' 4 rows, fp32
