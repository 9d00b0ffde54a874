"""The GPU kernels on their real lowering, against float64 references computed on the host CPU.

Marked ``gpu`` and skipped without a GPU; on a GPU machine ``python -m pytest -m gpu tests/test_gpu_kernels.py
tests/test_gpu_sharding.py`` is the correctness check of the Triton and Mosaic GPU kernels.  (The rest of the
suite runs the kernels in Pallas's interpret mode on a CPU: that checks their programs, not the GPU compiler's
lowering of them.)  A class per kernel op, with the rules it serves; each case is one sizeable program —
sequences long enough to be cut into pieces, odd lengths (padded chunks), packed segments and a continued state —
with every kernel output poisoned first (NaN where a kernel fails to write):

* forward values, fp32, T = 7777, d = 128: outputs and final state against the float64 recurrence
  (``tests/reference.py``), rel. error <= 1e-4;
* fp32 gradients at d = 64 w.r.t. q, k, v, β, λ and the continued state, against the float64 XLA chunk form on
  the host, rel. error <= 1e-4;
* bf16 gradients at d = 128 within ``BF16_ERROR_MULTIPLE`` times the XLA chunk form's error (on the same GPU) on
  the same bf16 inputs (both against float64 on those inputs; Falcon-3 within ``BF16_ERROR_MULTIPLE_WINDOWED``);
* extreme gates (β·‖x‖² near 2, γ at its clamp on a tenth of the steps) and T = 65536 (finite);
* Gated DeltaNet (the residual on the decayed state) and DeltaNet through the decayed delta rule: values against
  the float64 recurrences of ``falcon_jax.reference``, fp32 gradients (log γ = −30 and 0 among them for Gated
  DeltaNet), bf16 gradients as above, and ``impl="auto"`` serving both from the kernels;
* the Mosaic GPU passes (a Hopper GPU): ``implementation="mosaic_gpu"`` against ``"triton"`` on the same inputs,
  for Falcon-1's call and Gated DeltaNet's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import FalconState, deltanet, falcon, gated_deltanet, init_state
from falcon_jax.kernels.common import on_hopper, poisoned_outputs
from falcon_jax.reference import reference_deltanet, reference_gated_deltanet
from tests.helpers import (assert_close, assert_state_close, make_initial_state, make_inputs, make_segment_ids,
                           rel_err, to_lib_state)
from tests.reference import reference_falcon

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs a GPU: checks the kernels' real GPU lowering "
                                 "(run `python -m pytest -m gpu tests/test_gpu_*.py` on a GPU machine)")]

HOST = jax.devices("cpu")[0]
KERNELS = ("mosaic_gpu", "triton")  # falcon(impl=...): the GPU kernels, never the XLA fallback
TOL = 1e-4
# bf16 gradients: the kernels round the walks' operands to bf16 (as the peers do); the XLA chunk form computes in
# fp32 from the same bf16 inputs, its dots at default precision (TF32 on a GPU).  On the H200 the kernels' errors
# were 1.2-2.0x the XLA form's (Falcon-1, d = 128, T = 2048)
BF16_ERROR_MULTIPLE = 2.5
# DeltaNet (γ = 1): the backward stores each chunk's state in bf16 (``chunk_state_dtype``, as fla stores h), and
# with no decay a chunk state's rounding is never damped by later chunks.  On the H200 its errors were
# 1.4-3.5x the XLA form's (relative 0.0055-0.0069, within bf16's 2^-7; β's the largest), Gated DeltaNet's
# under 2.5x
BF16_ERROR_MULTIPLE_UNDECAYED = 4.0
# Falcon-3 (W = 4 bf16 products per step in the windowed kernel): on an H100, over four seeds, q, k, v and λ's errors
# were 1.6-3.6x the XLA form's; β's 3.4-6.2x (relative 0.007-0.011; the XLA form's β error is small, 0.0015-0.0023).
# The same at 18987e6, before the gates took the window's Gram: the kernel's β gradient, not the Gram, sets the ratio
BF16_ERROR_MULTIPLE_WINDOWED = {"beta": 8.0, "*": 4.0}
F32 = jnp.float32
GRAD_NAMES = ("q", "k", "v", "beta", "lam", "S0", "last_key", "tail_x", "tail_y")
# (B, T, H, d) per check.  values: 4 heads walk 122 chunks in pieces, and 7777 rows pad to 128 chunks
SHAPES = {"values": (1, 7777, 4, 128), "fp32 grads": (1, 2000, 4, 64), "bf16 grads": (1, 2000, 4, 128),
          "long": (1, 65536, 2, 128), "extreme": (1, 4096, 4, 128), "mosaic": (2, 1000, 4, 128)}


def pytest_generate_tests(metafunc):
    """Each class's rules parametrize its checks: ``rule`` over ``RULES``, ``bf16_rule`` over ``BF16_RULES``, ..."""
    for arg, attr in (("rule", "RULES"), ("bf16_rule", "BF16_RULES"), ("long_rule", "LONG_RULES"),
                      ("extreme_rule", "EXTREME_RULES")):
        if arg in metafunc.fixturenames:
            metafunc.parametrize(arg, list(getattr(metafunc.cls, attr)))


def rule_inputs(rng, rule, B, T, H, D):
    """float64 (q, k, v, β, λ) with long memories (β ~ U(0.1, 1.9), λ ~ U(0, 0.05)), segment ids and a continued
    state (a key and, for the windowed rules, a full tail)."""
    xs = make_inputs(rng, variant=rule["variant"], B=B, T=T, H=H, dk=D, dv=D, beta_range=(0.1, 1.9),
                     lam_range=(0.0, 0.05))
    state = make_initial_state(rng, variant=rule["variant"], window=rule.get("window", 4), B=B, H=H, dk=D, dv=D)
    return xs, make_segment_ids(rng, B, T), state


def as_f32(state: dict) -> FalconState:
    return to_lib_state({n: a.astype(np.float32) if a.dtype.kind == "f" else a for n, a in state.items()})


def gradient_fn(rule, impl):
    """jit(grad) of ``Σ o·ct_o + Σ S_final·ct_s`` w.r.t. q, k, v, β, λ and the state's S, last key and tail."""
    def loss(q, k, v, beta, lam, S, last_key, tail_x, tail_y, flags, seg, ct_o, ct_s):
        state = FalconState(S=S, last_key=last_key, has_key=flags[0], tail_x=tail_x, tail_y=tail_y,
                            tail_valid=flags[1])
        out, final = falcon(q, k, v, beta, lam, initial_state=state, segment_ids=seg, return_final_state=True,
                            impl=impl, **rule)
        return jnp.sum(out * ct_o) + jnp.sum(final.S * ct_s)
    return jax.jit(jax.grad(loss, argnums=tuple(range(9))))


class KernelOpChecks:
    """Values and fp32 gradients of every rule in ``RULES`` (name -> falcon options) on the GPU kernels."""

    RULES: dict = {}

    def test_forward_values(self, rule, rng):
        kw = self.RULES[rule]
        B, T, H, D = SHAPES["values"]
        xs, seg, state = rule_inputs(rng, kw, B, T, H, D)
        want, want_state = reference_falcon(*xs, segment_ids=seg, initial_state=state, **kw)
        run = jax.jit(lambda *a, s, seg: falcon(*a, initial_state=s, segment_ids=seg, return_final_state=True,
                                                impl=KERNELS, **kw))
        with poisoned_outputs():
            got, got_state = run(*(jnp.asarray(a, F32) for a in xs), s=as_f32(state), seg=jnp.asarray(seg))
        assert_close(got, want, TOL, f"Falcon-{rule} output")
        assert_state_close(got_state, want_state, TOL, f"Falcon-{rule} final state")

    def test_fp32_gradients(self, rule, rng):
        kw = self.RULES[rule]
        B, T, H, D = SHAPES["fp32 grads"]
        xs, seg, state = rule_inputs(rng, kw, B, T, H, D)
        floats = [*xs, state["S"], state["last_key"], state["tail_x"], state["tail_y"]]
        flags = (state["has_key"], state["tail_valid"])
        ct_o, ct_s = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, H, D, D))
        want = gradient_fn(kw, "xla")(*jax.device_put([*floats, flags, seg, ct_o, ct_s], HOST))  # float64, host
        with poisoned_outputs():
            got = gradient_fn(kw, KERNELS)(*(jnp.asarray(a, F32) for a in floats), flags, seg,
                                           jnp.asarray(ct_o, F32), jnp.asarray(ct_s, F32))
        errors = {name: rel_err(g, w) for name, g, w in zip(GRAD_NAMES, got, want)}
        assert all(np.isfinite(np.asarray(g)).all() for g in got), errors
        assert max(errors.values()) <= TOL, errors


class Bf16GradientChecks:
    """bf16 q, k, v (fp32 gates) at d = 128: the kernels' gradient errors against float64 on the same rounded
    inputs (on the host), within ``BF16_MULTIPLE`` times the XLA chunk form's on the same GPU (a class's own bound,
    else ``BF16_ERROR_MULTIPLE``; a dict gives a bound per gradient, ``"*"`` the others')."""

    BF16_RULES: tuple = ()
    BF16_MULTIPLE = BF16_ERROR_MULTIPLE

    def test_bf16_gradients(self, bf16_rule, rng):
        kw = self.RULES[bf16_rule]
        B, T, H, D = SHAPES["bf16 grads"]
        q, k, v, beta, lam = make_inputs(rng, variant=kw["variant"], B=B, T=T, H=H, dk=D, dv=D,
                                         beta_range=(0.1, 1.9), lam_range=(0.0, 0.05))
        tokens = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
        gates = [jnp.asarray(a, F32) for a in (beta, lam)]
        ct = rng.standard_normal((B, T, H, D))

        def grads(impl, args, ct):
            def loss(*a):
                return jnp.sum(falcon(*a, impl=impl, **kw).astype(ct.dtype) * ct)
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)

        exact = grads("xla", jax.device_put([jnp.asarray(a, jnp.float64) for a in tokens + gates], HOST),
                      jax.device_put(jnp.asarray(ct), HOST))
        xla = grads("xla", tokens + gates, jnp.asarray(ct, F32))  # on the GPU, as the library runs it there
        with poisoned_outputs():
            got = grads(KERNELS, tokens + gates, jnp.asarray(ct, F32))
        errors = {name: (rel_err(g, e), rel_err(x, e)) for name, g, x, e in zip("q k v beta lam".split(), got, xla,
                                                                                  exact)}
        bound = self.BF16_MULTIPLE if isinstance(self.BF16_MULTIPLE, dict) else {"*": self.BF16_MULTIPLE}
        assert all(kernel <= bound.get(name, bound["*"]) * xla_err for name, (kernel, xla_err) in errors.items()), \
            errors


class LongSequenceChecks:
    """T = 65536 in bf16 (B = 1, H = 2): the forward and every gradient finite, the gradients not all zero."""

    LONG_RULES: tuple = ()

    def test_long_sequence_is_finite(self, long_rule, rng):
        kw = self.RULES[long_rule]
        B, T, H, D = SHAPES["long"]
        xs = make_inputs(rng, variant=kw["variant"], B=B, T=T, H=H, dk=D, dv=D, beta_range=(0.1, 1.9),
                         lam_range=(0.0, 0.05))
        args = [jnp.asarray(a, jnp.bfloat16) for a in xs[:3]] + [jnp.asarray(a, F32) for a in xs[3:]]
        fn = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(falcon(*a, impl=KERNELS, **kw).astype(F32)),
                                        argnums=(0, 1, 2, 3, 4)))
        with poisoned_outputs():
            value, grads = fn(*args)
        assert np.isfinite(float(value))
        for name, g in zip("q k v beta lam".split(), grads):
            g = np.asarray(g, np.float32)
            assert np.isfinite(g).all() and np.abs(g).max() > 0, name


class ExtremeGateChecks:
    """β = 1.99 everywhere (β·‖x‖² near 2: the delta rule's step at the edge of contraction) and λ = 10⁶ on a
    tenth of the steps (γ at its clamp ε_γ), fp32, against the float64 recurrence."""

    EXTREME_RULES: tuple = ()

    def test_extreme_gates(self, extreme_rule, rng):
        kw = self.RULES[extreme_rule]
        B, T, H, D = SHAPES["extreme"]
        q, k, v, _, lam = make_inputs(rng, variant=kw["variant"], B=B, T=T, H=H, dk=D, dv=D, lam_range=(0.0, 0.05))
        beta = np.full((B, T, H), 1.99)
        lam = np.where(rng.uniform(size=lam.shape) < 0.1, 1e6, lam)
        want, want_state = reference_falcon(q, k, v, beta, lam, **kw)
        with poisoned_outputs():
            got, got_state = jax.jit(lambda *a: falcon(*a, return_final_state=True, impl=KERNELS, **kw))(
                *(jnp.asarray(a, F32) for a in (q, k, v, beta, lam)))
        assert_close(got, want, TOL, f"Falcon-{extreme_rule} output")
        assert_close(got_state.S, want_state["S"], TOL, f"Falcon-{extreme_rule} final S")


class TestDecayedAttention(KernelOpChecks, Bf16GradientChecks, LongSequenceChecks):
    """``decayed_attention``: Falcon-1A and 3A (the window as coefficients plus a banded correction)."""

    RULES = {"1A": dict(variant="1A", timing="raw"), "3A": dict(variant="3A", window=4, timing="rbw")}
    BF16_RULES = ("1A", "3A")
    LONG_RULES = ("1A",)


class TestDecayedDeltaRule(KernelOpChecks, Bf16GradientChecks, LongSequenceChecks, ExtremeGateChecks):
    """``decayed_delta_rule``: Falcon-1 (the keys read one row back in place)."""

    RULES = {"1": dict(variant="1", timing="rbw")}
    BF16_RULES = LONG_RULES = EXTREME_RULES = ("1",)


class TestWindowedDeltaRule(KernelOpChecks, Bf16GradientChecks, ExtremeGateChecks):
    """``windowed_delta_rule``: Falcon-3 (W virtual writes per step, the λmax gate)."""

    RULES = {"3": dict(variant="3", window=4, timing="raw")}
    BF16_RULES = EXTREME_RULES = ("3",)
    BF16_MULTIPLE = BF16_ERROR_MULTIPLE_WINDOWED


class TestPerColumn(KernelOpChecks):
    """``per_column`` with the residual: Falcon-2 with per-column gains (β ``[B, T, H, dv]``)."""

    RULES = {"2": dict(variant="2", timing="raw")}


class TestPerColumnAttention(KernelOpChecks, Bf16GradientChecks, LongSequenceChecks):
    """``per_column`` without the residual: Falcon-2A with per-column gains (its own passes: state walks, cut into
    pieces when few heads walk, and per-chunk output and gradient passes over a binary tree of row groups)."""

    RULES = {"2A": dict(variant="2A", timing="rbw")}
    BF16_RULES = LONG_RULES = ("2A",)

    def test_extreme_decays(self, rng):
        """The op itself, fp32, d = 128, B·H = 4 over T = 1000 (8 pieces): log γ from −30 to −10 per step in a
        quarter of the columns, γ = 1 in another quarter, ordinary decays elsewhere, a few segment starts and an
        initial state — outputs, final state and the gradient w.r.t. every input against the float64
        reference on the host."""
        from falcon_jax.kernels.per_column import decayed_attention_per_column
        from falcon_jax.kernels.per_column.reference import decayed_attention_per_column_reference

        B, H, T, D = 2, 2, 1000, 128
        q, x = (rng.standard_normal((B, H, T, D)) / np.sqrt(D) for _ in range(2))
        y = rng.standard_normal((B, H, T, D))
        eta = rng.uniform(0.1, 1.9, (B, H, T, D))
        log_gamma = -rng.uniform(0.0, 0.1, (B, H, T, D))
        log_gamma[..., : D // 4] = -rng.uniform(10.0, 30.0, (B, H, T, D // 4))
        log_gamma[..., D // 4: D // 2] = 0.0
        run = np.broadcast_to(np.cumsum(rng.uniform(size=(B, 1, T)) < 0.005, axis=-1), (B, H, T)).astype(np.int32)
        s0 = rng.standard_normal((B, H, D, D)) / 4
        cts = (rng.standard_normal((B, H, T, D)), rng.standard_normal((B, H, D, D)))

        def run_op(op, floats, run, cts):
            def loss(q, x, y, eta, log_gamma, s0, run, ct_o, ct_s):
                o, final = op(q, x, y, eta, log_gamma, run, s0)
                return jnp.sum(o * ct_o) + jnp.sum(final * ct_s), (o, final)
            return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*floats, run, *cts)

        floats = (q, x, y, eta, log_gamma, s0)
        (_, want), want_grads = run_op(decayed_attention_per_column_reference,
                                       *jax.device_put(([jnp.asarray(a) for a in floats], jnp.asarray(run),
                                                        [jnp.asarray(c) for c in cts]), HOST))
        with poisoned_outputs():
            (_, got), got_grads = run_op(
                lambda *a: decayed_attention_per_column(*a, implementation="triton"),
                [jnp.asarray(a, F32) for a in floats], jnp.asarray(run), [jnp.asarray(c, F32) for c in cts])
        names = ("o", "final", "dq", "dx", "dy", "deta", "dlog_gamma", "ds0")
        errors = {name: rel_err(g, w) for name, g, w in zip(names, (*got, *got_grads), (*want, *want_grads))}
        assert all(np.isfinite(np.asarray(g)).all() for g in (*got, *got_grads)), errors
        assert max(errors.values()) <= TOL, errors


class TestDeltaRuleBaselines:
    """Gated DeltaNet (``decay_before_residual``: the residual on the decayed state) and DeltaNet through
    ``decayed_delta_rule`` (same-step pairs, the model's layout in place), with unit keys (β‖k‖² = β < 2), packed
    segments, a continued state and a read scale."""

    BASELINES = {"gated_deltanet": (gated_deltanet, reference_gated_deltanet, ("beta", "log_decay")),
                 "deltanet": (deltanet, reference_deltanet, ("beta",))}
    SCALE = 0.7

    def inputs(self, rng, name, B, T, H, D, extreme=False, edge_beta=False):
        """float64 (q, k, v, *gates), segment ids, S0.  log γ ~ −U(0.001, 0.1), or with ``extreme`` −30 (γ ≈
        1e-13) on a third of the steps, 0 on a third and −U(0, 1) on the rest; β ~ U(0.1, 1.9), or 1.99 with
        ``edge_beta`` (the step at the edge of contraction)."""
        q = rng.standard_normal((B, T, H, D)) / np.sqrt(D)
        k = rng.standard_normal((B, T, H, D))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((B, T, H, D))
        beta = np.full((B, T, H), 1.99) if edge_beta else rng.uniform(0.1, 1.9, (B, T, H))
        if extreme:
            u = rng.uniform(size=(B, T, H))
            log_decay = np.where(u < 1 / 3, -30.0, np.where(u < 2 / 3, 0.0, -rng.uniform(0, 1, u.shape)))
        else:
            log_decay = -rng.uniform(0.001, 0.1, (B, T, H))
        gates = (beta, log_decay) if name == "gated_deltanet" else (beta,)
        s0 = 0.3 * rng.standard_normal((B, H, D, D)) / np.sqrt(D)
        return (q, k, v, *gates), make_segment_ids(rng, B, T), s0

    def fn(self, name, impl):
        """``(out, final S)`` of the baseline from ``(*tokens and gates, S0)`` and segment ids."""
        baseline = self.BASELINES[name][0]

        def run(*args, seg):
            *xs, S = args
            state = init_state(S.shape[0], S.shape[1], S.shape[2], S.shape[3], variant="1", dtype=S.dtype)
            out, final = baseline(*xs, initial_state=state.replace(S=S), segment_ids=seg, scale=self.SCALE,
                                  impl=impl, return_final_state=True)
            return out, final.S
        return run

    @pytest.mark.parametrize("name,extreme", [("gated_deltanet", False), ("gated_deltanet", True),
                                              ("deltanet", False)])
    def test_forward_values(self, name, extreme, rng):
        """fp32 against the float64 recurrence; ``extreme``: log γ −30 and 0 among the steps and β = 1.99."""
        B, T, H, D = SHAPES["extreme" if extreme else "values"]
        xs, seg, s0 = self.inputs(rng, name, B, T, H, D, extreme=extreme, edge_beta=extreme)
        want, want_state = self.BASELINES[name][1](*xs, scale=self.SCALE, segment_ids=seg, initial_state=s0)
        with poisoned_outputs():
            got, got_s = jax.jit(self.fn(name, KERNELS))(*(jnp.asarray(a, F32) for a in (*xs, s0)),
                                                          seg=jnp.asarray(seg))
        assert_close(got, want, TOL, f"{name} output")
        assert_close(got_s, want_state["S"], TOL, f"{name} final S")

    @pytest.mark.parametrize("name,extreme", [("gated_deltanet", False), ("gated_deltanet", True),
                                              ("deltanet", False)])
    def test_fp32_gradients(self, name, extreme, rng):
        """Against the XLA chunk form in float64 on the host: the gradients w.r.t. q, k, v, the gates (log γ's
        through the kernels' reverse cumulative sums, γ ≈ 1e-13 among them with ``extreme``) and S0."""
        B, T, H, D = SHAPES["fp32 grads"]
        xs, seg, s0 = self.inputs(rng, name, B, T, H, D, extreme=extreme)
        floats = [*xs, s0]
        ct_o, ct_s = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, H, D, D))

        def grads(impl):
            run = self.fn(name, impl)

            def loss(*a):
                *args, seg, ct_o, ct_s = a
                out, S = run(*args, seg=seg)
                return jnp.sum(out * ct_o) + jnp.sum(S * ct_s)
            return jax.jit(jax.grad(loss, argnums=tuple(range(len(floats)))))

        want = grads("xla")(*jax.device_put([*floats, seg, ct_o, ct_s], HOST))  # float64, host
        with poisoned_outputs():
            got = grads(KERNELS)(*(jnp.asarray(a, F32) for a in floats), jnp.asarray(seg), jnp.asarray(ct_o, F32),
                                 jnp.asarray(ct_s, F32))
        names = ("q", "k", "v", *self.BASELINES[name][2], "S0")
        errors = {n: rel_err(g, w) for n, g, w in zip(names, got, want, strict=True)}
        assert all(np.isfinite(np.asarray(g)).all() for g in got), errors
        assert max(errors.values()) <= TOL, errors

    @pytest.mark.parametrize("name", ["gated_deltanet", "deltanet"])
    def test_bf16_gradients(self, name, rng):
        """bf16 q, k, v at d = 128: the kernels' gradient errors against float64 on the same rounded inputs
        within ``BF16_ERROR_MULTIPLE`` times the XLA chunk form's on this GPU (``BF16_ERROR_MULTIPLE_UNDECAYED``
        for DeltaNet)."""
        B, T, H, D = SHAPES["bf16 grads"]
        (q, k, v, *gates), _, _ = self.inputs(rng, name, B, T, H, D)
        tokens = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)]
        gates = [jnp.asarray(a, F32) for a in gates]
        ct = rng.standard_normal((B, T, H, D))
        baseline = self.BASELINES[name][0]

        def grads(impl, args, ct):
            def loss(*a):
                return jnp.sum(baseline(*a, impl=impl).astype(ct.dtype) * ct)
            return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)

        exact = grads("xla", jax.device_put([jnp.asarray(a, jnp.float64) for a in tokens + gates], HOST),
                      jax.device_put(jnp.asarray(ct), HOST))
        xla = grads("xla", tokens + gates, jnp.asarray(ct, F32))
        with poisoned_outputs():
            got = grads(KERNELS, tokens + gates, jnp.asarray(ct, F32))
        names = ("q", "k", "v", *self.BASELINES[name][2])
        errors = {n: (rel_err(g, e), rel_err(x, e)) for n, g, x, e in zip(names, got, xla, exact, strict=True)}
        multiple = BF16_ERROR_MULTIPLE_UNDECAYED if name == "deltanet" else BF16_ERROR_MULTIPLE
        assert all(kernel <= multiple * xla_err for kernel, xla_err in errors.values()), errors

    @pytest.mark.parametrize("name", ["gated_deltanet", "deltanet"])
    def test_auto_serves_them_from_the_kernels(self, name, rng):
        """``impl="auto"`` at the benchmark's 8×2048×16×128 bf16 lowers the decayed delta rule's kernels (the
        Mosaic GPU walks on a Hopper GPU) forward and backward, no XLA chunk form."""
        B, T, H, D = 8, 2048, 16, 128
        n_gates = len(self.BASELINES[name][2])
        specs = ([jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)] * 3
                 + [jax.ShapeDtypeStruct((B, T, H), F32)] * n_gates)
        baseline = self.BASELINES[name][0]
        text = jax.jit(jax.grad(lambda *a: jnp.sum(baseline(*a).astype(F32)), argnums=(0, 1, 2))).lower(
            *specs).as_text()
        for kernel in ("falcon_delta_tri_inverse", "falcon_delta_chunk_grads"):
            assert kernel in text, kernel
        if on_hopper():
            for kernel in TestMosaicGpuPasses.MOSAIC_KERNELS:
                assert kernel in text, kernel


@pytest.mark.skipif(ON_GPU and not on_hopper(), reason="the Mosaic GPU passes run on a Hopper GPU (sm_90)")
class TestMosaicGpuPasses:
    """``decayed_delta_rule`` with ``implementation="mosaic_gpu"`` — the Mosaic GPU forward walk (forward and the
    backward's recompute), prepare_v and reverse walk at 64 value columns — against ``"triton"`` (the Triton
    walks at 64 columns) on the same bf16 inputs: Falcon-1's call (the model's [B, T, H, d] in place, keys one row
    back, a first key) and Gated DeltaNet's (same-step keys, the residual on the decayed state), packed segments,
    a nonzero initial state, an odd length.  Each output and gradient's error
    against float64 on the same inputs is within 2x the Triton passes' plus half a bf16 unit."""

    MOSAIC_KERNELS = ("falcon_delta_walk_mgpu", "falcon_delta_dstate_prepare_mgpu", "falcon_delta_dstate_walk_mgpu")

    @pytest.mark.parametrize("call", ["falcon-1", "gated_deltanet"])
    def test_mosaic_passes_match_the_triton_passes(self, call, rng):
        """``call``: Falcon-1's (the keys one row back, a first key) or Gated DeltaNet's (same-step keys, the
        residual on the decayed state)."""
        from falcon_jax.kernels.decayed_delta_rule import KernelConfig, decayed_delta_rule

        B, T, H, D = SHAPES["mosaic"]
        bf = jnp.bfloat16
        q, keys = (jnp.asarray(rng.standard_normal((B, T, H, D)) / np.sqrt(D), bf) for _ in range(2))
        y = jnp.asarray(rng.standard_normal((B, T, H, D)), bf)
        eta = jnp.asarray(rng.uniform(0.1, 1.5, (B, T, H)), F32)
        log_gamma = jnp.asarray(-rng.uniform(0.001, 0.1, (B, T, H)), F32)
        run = jnp.asarray(np.cumsum(rng.uniform(size=(B, T, 1)) < 0.03, axis=1).repeat(H, axis=2), jnp.int32)
        s0 = jnp.asarray(0.3 * rng.standard_normal((B, H, D, D)) / np.sqrt(D), F32)
        first_key = jnp.asarray(rng.standard_normal((B, H, D)) / np.sqrt(D), F32)
        ct_o, ct_s = (jnp.asarray(rng.standard_normal(s), F32) for s in ((B, T, H, D), (B, H, D, D)))
        # 64-column walks in one piece, fused (no split forward however few programs walk)
        config = KernelConfig(block_v=64, split_block_v=64, fill_programs=1)

        gdn = call == "gated_deltanet"
        if gdn:
            log_gamma = jnp.asarray(-rng.uniform(0.0, 1.0, (B, T, H)), F32)  # the two residuals far apart

        def fn(implementation):
            def loss(q, x, y, eta, log_gamma, s0, first_key, run, ct_o, ct_s):
                keys = dict(decay_before_residual=True) if gdn else dict(shifted_keys=True, first_key=first_key)
                o, final = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation=implementation,
                                              config=config if implementation != "xla" else None, pieces=1,
                                              layout="BTHD", **keys)
                return jnp.sum(o.astype(ct_o.dtype) * ct_o) + jnp.sum(final * ct_s), (o, final)
            return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))

        args = (q, keys, y, eta, log_gamma, s0, first_key, run, ct_o, ct_s)
        (_, exact_out), exact_grads = fn("xla")(*jax.device_put(
            [a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args], HOST))
        errors = {}
        for implementation in ("mosaic_gpu", "triton"):
            lowered = fn(implementation).lower(*args).as_text()
            taken = {name for name in self.MOSAIC_KERNELS if name in lowered}
            assert taken == (set(self.MOSAIC_KERNELS) if implementation == "mosaic_gpu" else set()), taken
            with poisoned_outputs():
                (_, out), grads = fn(implementation)(*args)
            names = ("o", "final", "dq", "dk", "dy", "deta", "dlog_gamma", "ds0") + (() if gdn else ("dfirst_key",))
            errors[implementation] = {name: rel_err(g, e) for name, g, e in zip(
                names, (*out, *grads), (*exact_out, *exact_grads))}
        bound = {name: 2 * err + 2.0**-9 for name, err in errors["triton"].items()}
        assert all(errors["mosaic_gpu"][name] <= bound[name] for name in bound), errors
