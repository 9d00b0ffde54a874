"""``decayed_delta_rule`` (Falcon-1, DeltaNet, Gated DeltaNet) against its definition in float64.

    p_t = η_t (y_t − S'_{t-1}ᵀ x_t),   S_t = e^{a_t} S'_{t-1} + x_t p_tᵀ,   o_t = S_tᵀ q_t

and with ``decay_before_residual=True`` (Gated DeltaNet) ``p_t = η_t (y_t − e^{a_t} S'_{t-1}ᵀ x_t)``; that
definition is itself checked against the float64 NumPy recurrence of Gated DeltaNet
(``falcon_jax.reference.reference_gated_deltanet``).

One class of checks per lowering with that lowering's settings (``IMPLEMENTATION``, ``INTERPRET = False``); the
``Test...Interpret`` subclasses run them in Pallas's interpret mode on a CPU (small shapes: dk = 16, dv ≤ 32,
chunks of 16).  A class for a real accelerator subclasses the lowering's class as it is.  Which passes a call
runs is decided by the program-count rules of ``KernelConfig`` (``test_decayed_delta_rule_config.py``); at these
shapes the tuned values pick pieces and the split forward, so the Triton class forces each branch with
thresholds and checks from the traced kernels that it was taken.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_delta_rule import KernelConfig, decayed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.reference import decayed_delta_rule_reference
from falcon_jax.reference import reference_gated_deltanet
from tests.helpers import rel_err
from tests.kernels.helpers import (check_op, clamped_decays, delta_inputs, f32, f64, nearly_parallel,
                                   pallas_call_avals, pallas_calls, time_major, value_and_grads)

NAMES = ("q", "x", "y", "eta", "log_gamma", "initial_state")
SHIFTED_NAMES = ("q", "k", "y", "eta", "log_gamma", "initial_state", "first_key")

# the Triton passes' branches, forced by thresholds (these shapes have 2 batch·heads)
ONE_PIECE = dict(pieces_below=1)
FUSED = KernelConfig(fill_programs=1, **ONE_PIECE)  # fused walk, scores from their own kernel
SCORES_IN_WALK = KernelConfig(fill_programs=1, few_output_programs=0, **ONE_PIECE)  # the walk forms them
Q_TERM = KernelConfig(fill_programs=1, q_term_in_prepare_from=1, **ONE_PIECE)  # the reverse walk reads prepare's
SPLIT = KernelConfig(fill_programs=10**6, **ONE_PIECE)  # W, U, a state-only walk, the outputs


def keys_one_row_later(k, first_key=None):
    """``x[t] = k[t − 1]``, ``x[0] = first_key`` (None: 0) along the time axis of ``[B, H, T, d]``."""
    row0 = jnp.zeros_like(k[:, :, :1]) if first_key is None else first_key[:, :, None]
    return jnp.concatenate([row0, k[:, :, :-1]], axis=2)


def reference(run, shifted=False, decay_before_residual=False):
    def ref(q, x, y, eta, log_gamma, s0, first_key=None):
        if shifted:
            x = keys_one_row_later(x, first_key)
        return decayed_delta_rule_reference(q, x, y, eta, log_gamma, run, s0,
                                            decay_before_residual=decay_before_residual)
    return ref


def gdn_inputs(rng, **kw):
    """:func:`delta_inputs` with decays up to e^{-1} per step, so that reading the residual from the decayed or
    the undecayed state makes a difference of order one."""
    return delta_inputs(rng, decay_range=(0.0, 1.0), **kw)


def extreme_decays(rng, shape):
    """log γ = −30 (γ ≈ 1e-13) on a third of the steps, 0 (γ = 1) on a third, U(−1, 0) on the rest."""
    u = rng.uniform(size=shape)
    return np.where(u < 1 / 3, -30.0, np.where(u < 2 / 3, 0.0, -rng.uniform(0, 1, size=shape)))


def shifted_inputs(rng, first_key="random", **kw):
    """Inputs of a ``shifted_keys=True`` call: ``(q, k, y, η, log γ, s0[, first_key])``, the run index and the
    gradient names.  ``first_key``: "random", "none" (row 0 writes nothing) or "reset" (random, and row 0 starts
    a segment: the initial state cannot reach the loss)."""
    q, k, y, eta, log_gamma, run, s0 = delta_inputs(rng, **kw)
    args = (q, k, y, eta, log_gamma, s0)
    if first_key != "none":
        args += (rng.normal(size=k.shape[:2] + k.shape[3:]) / 4,)
    if first_key == "reset":
        run = run + 1
    return args, run, SHIFTED_NAMES[:len(args)]


class DeltaRuleChecks:
    """The checks every lowering of the op must pass; subclasses set the lowering."""

    IMPLEMENTATION: str
    INTERPRET: bool = False

    def op(self, run, layout="BHTD", chunk=16, shifted=False, **kw):
        """The op on ``[B, H, T, ...]`` arrays; with ``layout="BTHD"`` the kernels get ``[B, T, H, ...]``."""
        swap = time_major if layout == "BTHD" else (lambda a: a)

        def call(q, x, y, eta, log_gamma, s0, first_key=None):
            o, s = decayed_delta_rule(*(swap(a) for a in (q, x, y, eta, log_gamma, run)), s0, chunk_size=chunk,
                                      layout=layout, implementation=self.IMPLEMENTATION, interpret=self.INTERPRET,
                                      shifted_keys=shifted, first_key=first_key, **kw)
            return swap(o), s
        return call

    @pytest.mark.parametrize("T,chunk,segments", [(1, 16, False), (53, 16, True),
                                                  pytest.param(50, 32, True, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, T, chunk, segments):
        """T = 1; a padded last chunk with segment starts inside chunks; non-zero initial state."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=T, segments=segments)
        check_op(rng, self.op(run, chunk=chunk), reference(run), (q, x, y, eta, log_gamma, s0), NAMES, grads=False)

    def test_gradients_match_float64(self, rng):
        """Every input's gradient; segment starts inside chunks; dv = 32 in value blocks."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=53)
        check_op(rng, self.op(run), reference(run), (q, x, y, eta, log_gamma, s0), NAMES)

    @pytest.mark.parametrize("H", [4, pytest.param(3, marks=pytest.mark.slow)])
    def test_model_layout_matches_float64(self, rng, H):
        """``layout="BTHD"``: ``[B, T, H, d]`` tokens and ``[B, T, H]`` gates, values and gradients (H = 4: the
        gates through the transpose kernel; H = 3: transposed by XLA)."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, B=2, H=H, T=45)
        check_op(rng, self.op(run, layout="BTHD"), reference(run), (q, x, y, eta, log_gamma, s0), NAMES)

    def test_shifted_keys_match_float64(self, rng):
        """``shifted_keys=True``: x holds the keys and row t writes ``k[t − 1]``, row 0 ``first_key``; values
        and the gradients w.r.t. k (through the shift) and first_key."""
        args, run, names = shifted_inputs(rng)
        check_op(rng, self.op(run, shifted=True), reference(run, shifted=True), args, names)

    def test_extreme_gates(self, rng):
        """β = η‖x‖² = 1.999 with nearly parallel keys (the triangular inverse alternates in sign, entries near
        2) and γ = 1e-6 on a third of the steps, 1 elsewhere: finite and within 1e-4."""
        q, x, y, _, _, run, s0 = delta_inputs(rng, T=64, dv=16, segments=False)
        x = nearly_parallel(x)
        eta = 1.999 / np.sum(x * x, axis=-1)
        log_gamma = clamped_decays(rng, eta.shape)
        check_op(rng, self.op(run, chunk=32), reference(run), (q, x, y, eta, log_gamma, s0), NAMES, tol=1e-4,
                 grads=False)

    def test_tiny_decay_every_step(self, rng):
        """γ = 1e-6 on every step: chunk-local cumulative log decays reach −440 in a chunk of 32; only
        differences with the later row first are exponentiated, so nothing overflows."""
        q, x, y, eta, _, run, s0 = delta_inputs(rng, T=40, segments=False)
        log_gamma = np.full(eta.shape, np.log(1e-6))
        check_op(rng, self.op(run, chunk=32), reference(run), (q, x, y, eta, log_gamma, s0), NAMES, grads=False)

    def test_log_decay_below_the_floor(self, rng):
        """One step of log γ = −1e30 and one of −inf (hard resets) among small ones: they count as −30 (γ = 9e-14,
        a reset within fp32 rounding), so the chunk's later small decays are not lost to rounding in its
        cumulative sums and −inf − (−inf) gives no NaN.  The float64 reference is a scan: γ = 0 exactly there."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=37, segments=False)
        log_gamma[:, :, 5], log_gamma[:, :, 20] = -1e30, -np.inf
        check_op(rng, self.op(run), reference(run), (q, x, y, eta, log_gamma, s0), NAMES, grads=False)

    # ---- decay_before_residual=True: the residual on the decayed state (Gated DeltaNet) -------------------------

    def test_decayed_state_residual_matches_float64(self, rng):
        """Values and every gradient (log γ's included: the passes read ``g`` where the undecayed rule reads
        ``g⁻``, and log γ_t reaches the residuals of rows ≥ t) at an odd length with segment starts inside
        chunks, a nonzero initial state and dv = 32 in value blocks."""
        q, x, y, eta, log_gamma, run, s0 = gdn_inputs(rng, T=53)
        check_op(rng, self.op(run, decay_before_residual=True), reference(run, decay_before_residual=True),
                 (q, x, y, eta, log_gamma, s0), NAMES)

    def test_decayed_state_residual_extreme_gates(self, rng):
        """log γ = −30 (γ ≈ 1e-13: the chunk-local sums reach hundreds below zero), 0 and U(−1, 0), mixed, with
        segments: values and gradients, the log decay's too — it is a reverse cumulative sum of the kernels'
        gradients w.r.t. g, never a quotient by γ, so the tiny γ lose nothing to cancellation."""
        q, x, y, eta, _, run, s0 = gdn_inputs(rng, T=45)
        log_gamma = extreme_decays(rng, eta.shape)
        check_op(rng, self.op(run, decay_before_residual=True), reference(run, decay_before_residual=True),
                 (q, x, y, eta, log_gamma, s0), NAMES)

    def test_decayed_state_residual_continues_its_state(self, rng):
        """Two calls (the second from the first's final state, the split inside a chunk, segment starts in both)
        equal one call over the whole sequence in float64: values and gradients through the carried state."""
        q, x, y, eta, log_gamma, run, s0 = gdn_inputs(rng, T=45)

        def two_calls(q, x, y, eta, log_gamma, s0):
            first = self.op(run[:, :, :21], decay_before_residual=True)
            second = self.op(run[:, :, 21:] - run[:, :, 20:21], decay_before_residual=True)  # 0: continues
            o1, s1 = first(*(a[:, :, :21] for a in (q, x, y, eta, log_gamma)), s0)
            o2, s2 = second(*(a[:, :, 21:] for a in (q, x, y, eta, log_gamma)), s1)
            return jnp.concatenate([o1, o2], axis=2), s2

        check_op(rng, two_calls, reference(run, decay_before_residual=True), (q, x, y, eta, log_gamma, s0), NAMES)


class TritonDeltaRule(DeltaRuleChecks):
    IMPLEMENTATION = "triton"

    def kernels(self, op, *args):
        """The Triton kernels forward + backward of ``op`` run (traced), by name, without the prefix."""
        def loss(*a):
            o, s = op(*a)
            return jnp.sum(o) + jnp.sum(s)

        names = pallas_calls(jax.grad(loss, argnums=tuple(range(len(args)))), *f32(*args))
        return [n.removeprefix("falcon_delta_") for n in names]

    @pytest.mark.parametrize("pieces", [4, pytest.param(2, marks=pytest.mark.slow)])
    def test_pieces_match_float64(self, rng, pieces):
        """The sequence cut into pieces walked in parallel: each piece's map ``S_end = M S_start + E``, a scan
        over pieces for their initial states, the reverse scan with ``Mᵀ`` for the state gradients; values and
        gradients, segment starts inside pieces."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=100)
        args = (q, x, y, eta, log_gamma, s0)
        op = self.op(run, pieces=pieces, config=FUSED)
        assert self.kernels(op, *args).count("piece_maps") == 1
        check_op(rng, op, reference(run), args, NAMES)

    @pytest.mark.parametrize("config,forward,backward", [
        (FUSED, ["tri_inverse", "masked_scores", "fwd"], ["tri_inverse", "fwd", "dstate_prepare", "dstate_walk",
                                                          "chunk_grads"]),
        (SCORES_IN_WALK, ["tri_inverse", "fwd"], ["tri_inverse", "fwd", "dstate_prepare", "dstate_walk",
                                                  "chunk_grads"]),
        (SPLIT, ["tri_inverse", "prepare_wu", "state_walk", "outputs"],
         ["tri_inverse", "fwd", "dstate_prepare", "dstate_walk", "chunk_grads"]),
    ], ids=["fused", "scores-in-walk", "split"])
    def test_forward_branches_match_float64(self, rng, config, forward, backward):
        """The forward fused (one walk writing o, its masked scores from their own kernel or formed in the walk)
        or split (``W = T(η c⁻ ⊙ X)``, ``U = T(η ⊙ Y)`` per chunk, a walk carrying only the state, then every
        chunk's outputs), as the thresholds force; the backward is the same after either.  Values and every
        gradient."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=53)
        args = (q, x, y, eta, log_gamma, s0)
        op = self.op(run, config=config)
        assert self.kernels(op, *args) == forward + backward
        check_op(rng, op, reference(run), args, NAMES)

    @pytest.mark.parametrize("config,q_term", [(Q_TERM, True), pytest.param(FUSED, False, marks=pytest.mark.slow)])
    def test_reverse_walk_reads_prepares_q_term(self, rng, config, q_term):
        """From ``q_term_in_prepare_from`` walk programs on, ``prepare_v`` forms the reverse walk's
        ``(c ⊙ Q)ᵀ dO`` per chunk and the walk adds it (writing dh over it) instead of forming it: the same
        gradients, dk = dv = 32 (the chunk gradients write dx over P and dy over dR)."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=53, dk=32)
        args = (q, x, y, eta, log_gamma, s0)
        op = self.op(run, config=config)
        ((_, prepared),) = pallas_call_avals(jax.grad(lambda *a: jnp.sum(op(*a)[0])), f32(*args),
                                             "falcon_delta_dstate_prepare")
        # V like dO ([B·H, L, dv] head-major), and the q-term [B·H, chunks, dk, dv]
        assert prepared == [((2, 64, 32), jnp.float32)] + [((2, 4, 32, 32), jnp.float32)] * q_term
        check_op(rng, op, reference(run), args, NAMES)

    @pytest.mark.parametrize("layout,first_key,config,in_place", [
        ("BTHD", "reset", FUSED, True),
        ("BHTD", "none", Q_TERM, True),
        pytest.param("BTHD", "random", SPLIT, False, marks=pytest.mark.slow),
        pytest.param("BTHD", "random", KernelConfig(fill_programs=1, pieces_below=10**6), False,
                     marks=pytest.mark.slow),  # test_shifted_keys_match_float64 takes the copy (pieces) too
    ], ids=["in-place-reset", "in-place-no-first-key", "split-copy", "pieces-copy"])
    def test_keys_one_row_back(self, rng, layout, first_key, config, in_place):
        """``shifted_keys=True`` where every pass reads the keys one row back in place (one piece, the fused
        forward: a chunk's window one row earlier, row −1 masked, row 0's step folded into the initial state and
        its gradients back through the fold) and where the op shifts a copy (pieces, the split forward).  Both
        layouts; first_key random, absent, or with row 0 starting a segment (the initial state then cannot reach
        the loss)."""
        args, run, names = shifted_inputs(rng, first_key=first_key, B=2, T=53)
        op = self.op(run, layout=layout, shifted=True, config=config)
        if self.INTERPRET:  # keys read in place in interpret mode: a NaN row in front of the 64 rows, not a copy
            ((operands, _),) = pallas_call_avals(op, f32(*args), "falcon_delta_tri_inverse")
            assert operands[0][0][1] == 64 + in_place
        check_op(rng, op, reference(run, shifted=True), args, names,
                 unreached=("initial_state",) if first_key == "reset" else ())

    @pytest.mark.parametrize("config,layout,shifted,forward", [
        (FUSED, "BTHD", False, ["tri_inverse", "masked_scores", "fwd"]),
        (KernelConfig(fill_programs=1, pieces_below=1, few_output_programs=0), "BTHD", True, ["tri_inverse", "fwd"]),
        pytest.param(SPLIT, "BHTD", False, ["tri_inverse", "prepare_wu", "state_walk", "outputs"],
                     marks=pytest.mark.slow),
    ], ids=["fused-in-place", "shifted-keys-in-place", "split"])
    def test_decayed_state_residual_branches(self, rng, config, layout, shifted, forward):
        """``decay_before_residual=True`` through the forward branches the tuned values do not take at these
        shapes (:meth:`test_decayed_state_residual_matches_float64` runs pieces and the split forward): the fused
        walk on the model's ``[B, T, H, d]`` in place (Gated DeltaNet's call), and with the keys read one row
        back, whose row 0 is folded into the initial state in XLA (its residual on the decayed state too).
        Values and every gradient."""
        if shifted:
            args, run, names = shifted_inputs(rng, B=2, T=45, decay_range=(0.0, 1.0))
        else:
            q, x, y, eta, log_gamma, run, s0 = gdn_inputs(rng, T=53)
            args, names = (q, x, y, eta, log_gamma, s0), NAMES
        op = self.op(run, layout=layout, shifted=shifted, config=config, decay_before_residual=True)
        passes = [n for n in self.kernels(op, *args) if not n.startswith("gate_transpose")]  # [B, T, H] gates
        assert passes == forward + ["tri_inverse", "fwd", "dstate_prepare", "dstate_walk", "chunk_grads"]
        check_op(rng, op, reference(run, shifted=shifted, decay_before_residual=True), args, names)

    @pytest.mark.parametrize("config", [FUSED, pytest.param(KernelConfig(), marks=pytest.mark.slow)],
                             ids=["fused", "tuned"])
    def test_bf16_within_the_fp32_operand_error(self, rng, config):
        """bf16 q, x, y: the walks round their state-sized operands, T and dR to bf16 (``KernelConfig``'s
        "input" precision, the tuned one).  Outputs and gradients against float64 on the same bf16 values within
        twice the error of the fp32-operand path plus one bf16 unit (2⁻⁸ of the largest value), and the
        gradients within about four bf16 units."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=64)
        bf = tuple(jnp.asarray(a, jnp.bfloat16) for a in (q, x, y))
        gates = f32(eta, log_gamma, s0)
        cts = (jnp.asarray(rng.normal(size=y.shape)), jnp.zeros(s0.shape))

        def run_op(cfg, dtype):
            def fn(q_, x_, y_):
                o, s = decayed_delta_rule(q_, x_, y_, *gates[:2], run, gates[2], chunk_size=16,
                                          implementation=self.IMPLEMENTATION, interpret=self.INTERPRET, config=cfg)
                return o.astype(jnp.float32), s
            (o, _), grads = value_and_grads(fn, tuple(a.astype(dtype) for a in bf), cts)
            return [o, *grads]

        exact = run_op_reference(bf, eta, log_gamma, run, s0, cts)
        rounded = run_op(config, jnp.bfloat16)
        fp32_operands = run_op(dataclasses.replace(config, walk_operands="fp32", tri_dtype="fp32", stored_dr="fp32"),
                               jnp.bfloat16)
        for name, a, b, e in zip(["o", "dq", "dx", "dy"], rounded, fp32_operands, exact):
            err, err32 = rel_err(np.asarray(a, np.float32), e), rel_err(np.asarray(b, np.float32), e)
            assert np.all(np.isfinite(np.asarray(a, np.float32))), name
            assert err <= 2 * err32 + 2.0**-8, (name, err, err32)
            assert name == "o" or err < 1.5e-2, (name, err)

    def test_precision_options_leave_fp32_inputs_alone(self, rng):
        """``walk_operands``, ``tri_dtype`` and ``stored_dr`` "input" round only 16-bit inputs: fp32 runs are
        bit-identical to "fp32" ones, values and gradients."""
        q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=40)
        args = f32(q, x, y, eta, log_gamma, s0)
        cts = (jnp.asarray(rng.normal(size=y.shape)), jnp.asarray(rng.normal(size=s0.shape)))
        fp32 = dataclasses.replace(FUSED, walk_operands="fp32", tri_dtype="fp32", stored_dr="fp32")
        a = value_and_grads(self.op(run, config=FUSED), args, cts)
        b = value_and_grads(self.op(run, config=fp32), args, cts)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def run_op_reference(bf, eta, log_gamma, run, s0, cts):
    """``[o, dq, dx, dy]`` of the float64 definition on the bf16 values ``bf``."""
    def fn(q_, x_, y_):
        return decayed_delta_rule_reference(q_, x_, y_, jnp.asarray(eta), jnp.asarray(log_gamma), run,
                                            jnp.asarray(s0))
    (o, _), grads = value_and_grads(fn, tuple(a.astype(jnp.float64) for a in bf), cts, poison=False)
    return [o, *grads]


class TestTritonDeltaRuleInterpret(TritonDeltaRule):
    INTERPRET = True


class MosaicTPUDeltaRule(DeltaRuleChecks):
    IMPLEMENTATION = "mosaic_tpu"

    @pytest.mark.slow  # the TPU kernels take [B, H, T, d]: the op transposes in XLA
    @pytest.mark.parametrize("H", [4])
    def test_model_layout_matches_float64(self, rng, H):
        super().test_model_layout_matches_float64(rng, H)

    # T = 53 with segments: test_gradients_match_float64 checks these values (the forward alone runs in T = 1,
    # test_extreme_gates and test_tiny_decay_every_step)
    @pytest.mark.parametrize("T,chunk,segments", [(1, 16, False), pytest.param(53, 16, True, marks=pytest.mark.slow),
                                                  pytest.param(50, 32, True, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, T, chunk, segments):
        super().test_forward_matches_float64(rng, T, chunk, segments)

    @pytest.mark.slow  # the TPU kernels get the keys shifted by the op in XLA, the Triton class's copy path
    def test_shifted_keys_match_float64(self, rng):
        super().test_shifted_keys_match_float64(rng)

    # two calls of the op: the Triton class's case; the TPU kernels' initial and final states and their gradients
    # with the residual on the decayed state: test_decayed_state_residual_matches_float64
    @pytest.mark.slow
    def test_decayed_state_residual_continues_its_state(self, rng):
        super().test_decayed_state_residual_continues_its_state(rng)


class TestMosaicTPUDeltaRuleInterpret(MosaicTPUDeltaRule):
    INTERPRET = True


def test_decayed_state_reference_is_gated_deltanet(rng):
    """The op's definition with ``decay_before_residual=True`` is Gated DeltaNet's float64 NumPy recurrence
    (``S_t = γ_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`` with x = k, η = β; segment starts, an initial
    state), and reading the residual from the undecayed state instead changes the outputs by order one."""
    q, x, y, eta, log_gamma, run, s0 = gdn_inputs(rng, T=30)
    o, s = decayed_delta_rule_reference(*f64(q, x, y, eta, log_gamma), run, jnp.asarray(s0),
                                        decay_before_residual=True)
    swap = lambda a: np.swapaxes(np.asarray(a), 1, 2)  # noqa: E731  [B, H, T, ...] <-> [B, T, H, ...]
    want_o, want_state = reference_gated_deltanet(swap(q), swap(x), swap(y), swap(eta), swap(log_gamma),
                                                  segment_ids=np.asarray(run[:, 0]), initial_state=s0)
    assert rel_err(swap(o), want_o) < 1e-12 and rel_err(s, want_state["S"]) < 1e-12
    undecayed, _ = decayed_delta_rule_reference(*f64(q, x, y, eta, log_gamma), run, jnp.asarray(s0))
    assert rel_err(undecayed, o) > 0.05


# ---- arguments ----------------------------------------------------------------------------------------------

def test_first_key_needs_shifted_keys_and_its_shape(rng):
    q, k, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=8)
    args = (*f32(q, k, y, eta, log_gamma), run, *f32(s0))
    good = jnp.zeros(k.shape[:2] + k.shape[3:])
    with pytest.raises(ValueError, match="pass shifted_keys=True"):
        decayed_delta_rule(*args, implementation="xla", first_key=good)
    with pytest.raises(ValueError, match=r"first_key must be \[B, H, dk\] = \[1, 2, 16\]"):
        decayed_delta_rule(*args, implementation="xla", shifted_keys=True, first_key=good[..., :-1])
    with pytest.raises(ValueError, match="`layout` must be one of"):
        decayed_delta_rule(*args, implementation="xla", layout="TBHD")


@pytest.mark.parametrize("extra", [{"config": KernelConfig(block_v=16)}, {"pieces": 2}])
def test_per_column_gates_refuse_the_scalar_ops_launch_options(rng, extra):
    """Per-column gates go to the per-column kernels, which have their own KernelConfig and no pieces: this op's
    ``config`` or ``pieces`` with them is an error naming both, not silently dropped."""
    q, x, y, eta, log_gamma, run, s0 = delta_inputs(rng, T=8, dv=16)
    eta = np.broadcast_to(eta[..., None], y.shape)
    args = (*f32(q, x, y, eta, log_gamma), run, *f32(s0))
    with pytest.raises(ValueError, match="take neither this op's `config` nor `pieces`"):
        decayed_delta_rule(*args, implementation="xla", **extra)
