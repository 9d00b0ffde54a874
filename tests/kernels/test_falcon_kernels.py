"""``falcon(impl=...)`` and the baselines through the kernel ops, against the XLA chunk form (itself checked
against the float64 reference in ``test_forms.py``) or the float64 recurrence: every rule's mapping onto its op
(Falcon-1 onto the decayed delta rule with the keys one row back, DeltaNet and Gated DeltaNet onto it with
same-step pairs and Gated DeltaNet's residual on the decayed state, 1A / 3A and linear attention onto decayed
attention with the window's corrections, 3 onto the windowed op, 2 / 2A onto the per-column ops), continuing from
a state, with segments, gradients w.r.t. every input; ``kernel_config`` reaching the op; bf16 error bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import falcon_jax.kernels.decayed_attention as attention_op
import falcon_jax.kernels.decayed_delta_rule as delta_rule_op
import falcon_jax.kernels.per_column as per_column_op
import falcon_jax.kernels.windowed_delta_rule as windowed_op
from falcon_jax import decayed_linear_attention, deltanet, falcon, gated_deltanet, init_state
from falcon_jax.kernels.common import poisoned_outputs
from falcon_jax.reference import reference_deltanet, reference_gated_deltanet
from tests.helpers import rel_err
from tests.kernels.helpers import FP32_TOL

IN_PLACE = delta_rule_op.KernelConfig(fill_programs=1, pieces_below=1)  # one piece, the fused forward


def falcon_inputs(rng, B=1, T=45, H=2, dk=16, dv=16, per_column=False, segments=False, clamp=False):
    """``(q, k, v, β, λ)`` fp32 and the options ``segment_ids`` (starts inside chunks) and, with ``clamp``, λ = 1e6
    on a third of the steps (γ at its clamp).  λ < 0.5 keeps γ = 1 − ηλ away from 0 elsewhere: near it the
    gradients w.r.t. β and λ go through 1/γ, and two fp32 computations differ by far more than 1e-4 there."""
    q = rng.normal(size=(B, T, H, dk))
    k = rng.normal(size=(B, T, H, dk)) / 4
    v = rng.normal(size=(B, T, H, dv))
    beta = rng.uniform(0.05, 1.95, size=(B, T, H, dv) if per_column else (B, T, H))
    lam = rng.uniform(0, 0.5, size=(B, T, H))
    if clamp:
        lam = np.where(rng.uniform(size=lam.shape) < 0.3, 1e6, lam)
    options = {"segment_ids": jnp.asarray(np.sort(rng.integers(0, 3, size=(B, T)), axis=1))} if segments else {}
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, beta, lam)], options


def assert_kernel_matches_xla_chunk_form(rng, inputs, kw, impl="triton", grads=True, tol=FP32_TOL,
                                         same=("last_key", "has_key")):
    """``falcon(**kw, impl=impl)`` (outputs poisoned) against ``impl="xla"``, continuing from the state after the
    first 9 steps: outputs and S (rel. ``tol``), the state fields ``same`` exactly and, with ``grads``, the
    gradients w.r.t. q, k, v, β, λ and the carried S (rel. 1e-4).  Jitted (interpret-mode kernels run eagerly
    dispatch op by op)."""
    q, k, v, beta, lam = inputs
    _, state = falcon(*(a[:, :9] for a in inputs), **{**kw, "segment_ids": None, "return_final_state": True})
    run = jax.jit(lambda *a, impl: falcon(*a[:5], impl=impl, initial_state=state.replace(S=a[5]),
                                          return_final_state=True, **kw), static_argnames="impl")
    with poisoned_outputs():
        got, got_state = run(*inputs, state.S, impl=impl)
    want, want_state = run(*inputs, state.S, impl="xla")
    assert rel_err(got, want) < tol and rel_err(got_state.S, want_state.S) < tol
    for name in same:
        np.testing.assert_array_equal(getattr(got_state, name), getattr(want_state, name), err_msg=name)
    if not grads:
        return
    ct = jnp.asarray(rng.normal(size=got.shape), jnp.float32)
    ct_s = jnp.asarray(rng.normal(size=state.S.shape), jnp.float32)

    def grads_of(impl):
        def loss(*a):
            out, final = run(*a, impl=impl)
            return jnp.sum(out * ct) + jnp.sum(final.S * ct_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs, state.S)

    with poisoned_outputs():
        got_grads = grads_of(impl)
    for name, g, w in zip(("q", "k", "v", "beta", "lam", "S"), got_grads, grads_of("xla")):
        assert float(jnp.max(jnp.abs(w))) > 0, name
        assert rel_err(g, w) < 1e-4, name


@pytest.mark.parametrize("options,config", [
    # at these shapes: pieces, the split forward, a shifted copy (the op's test_shifted_keys_match_float64 runs them;
    # the mapping onto the op is the next case's)
    pytest.param({"timing": "rbw", "segments": True}, None, marks=pytest.mark.slow),
    ({"timing": "rbw", "segments": True}, IN_PLACE),  # the keys read one row back in place
    pytest.param({"alignment": "same_step", "clamp": True}, None, marks=pytest.mark.slow),
    pytest.param({"scale_coupled": True, "segments": True}, IN_PLACE, marks=pytest.mark.slow),
])
def test_falcon1(rng, options, config):
    """Falcon-1 through the decayed delta rule: the prefix-aligned keys one row back (step 0's with the carried
    key, folded into the initial state), or the same-step pair."""
    options = dict(options)
    inputs, extra = falcon_inputs(rng, segments=options.pop("segments", False), clamp=options.pop("clamp", False))
    kw = dict(variant="1", chunk_size=16, kernel_config=config, **options, **extra)
    assert_kernel_matches_xla_chunk_form(rng, inputs, kw)


@pytest.mark.parametrize("config", [IN_PLACE, pytest.param(None, marks=pytest.mark.slow)])
def test_falcon1_carried_key_and_state_gradients(rng, config):
    """The gradients w.r.t. the carried state S and the carried key (step 0's write feature, folded into the
    op's initial state) equal the XLA chunk form's, with the keys read in place or shifted."""
    inputs, _ = falcon_inputs(rng, T=40)
    kw = dict(variant="1", chunk_size=16, return_final_state=True)
    _, state = falcon(*(a[:, :7] for a in inputs), **kw)
    rest = [a[:, 7:] for a in inputs]
    ct = jnp.asarray(rng.normal(size=rest[2].shape), jnp.float32)
    ct_s = jnp.asarray(rng.normal(size=state.S.shape), jnp.float32)

    def grads(impl):
        def loss(S, last_key):
            out, final = falcon(*rest, impl=impl, kernel_config=config if impl != "xla" else None,
                                initial_state=state.replace(S=S, last_key=last_key), **kw)
            return jnp.sum(out * ct) + jnp.sum(final.S * ct_s)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(state.S, state.last_key)

    with poisoned_outputs():
        got = grads("triton")
    for name, g, w in zip(("S", "last_key"), got, grads("xla")):
        assert float(jnp.max(jnp.abs(w))) > 0, name  # the carried key reaches the loss
        assert rel_err(g, w) < 1e-4, name


@pytest.mark.parametrize("variant,options", [
    # 1A's mapping is 3A's without the window's corrections
    pytest.param("1A", {"timing": "rbw", "alignment": "same_step"}, marks=pytest.mark.slow), ("3A", {"segments": True}),
    pytest.param("1A", {"segments": True, "timing": "rbw"}, marks=pytest.mark.slow),
    pytest.param("3A", {"timing": "rbw", "alignment": "same_step", "clamp": True}, marks=pytest.mark.slow),
    pytest.param("3A", {"window": 2, "timing": "rbw", "segments": True}, marks=pytest.mark.slow),
])
def test_falcon_inner_product_rules(rng, variant, options):
    """Falcon-1A and 3A through decayed attention (3A: each pair at its last writer with the summed coefficient,
    plus the banded correction of the earlier writes), the window tail included."""
    options = dict(options)
    inputs, extra = falcon_inputs(rng, segments=options.pop("segments", False), clamp=options.pop("clamp", False))
    kw = dict(variant=variant, chunk_size=16, **options, **extra)
    assert_kernel_matches_xla_chunk_form(rng, inputs, kw, same=("last_key", "tail_x", "tail_y", "tail_valid"))


@pytest.mark.parametrize("window,options,grads", [
    (4, {"timing": "rbw", "segments": True}, True),
    pytest.param(2, {"alignment": "same_step", "clamp": True}, False, marks=pytest.mark.slow),  # W = 4's mapping
    pytest.param(3, {"scale_coupled": True, "segments": True}, True, marks=pytest.mark.slow),
])
def test_falcon3(rng, window, options, grads):
    """Falcon-3 through the windowed op, continuing from a state whose window tail feeds the first windows."""
    options = dict(options)
    inputs, extra = falcon_inputs(rng, H=1, T=33, segments=options.pop("segments", False),
                                  clamp=options.pop("clamp", False))
    kw = dict(variant="3", window=window, chunk_size=16, **options, **extra)
    assert_kernel_matches_xla_chunk_form(rng, inputs, kw, grads=grads,
                                         same=("tail_x", "tail_y", "tail_valid", "last_key"))


@pytest.mark.parametrize("variant,impl", [
    ("2", "triton"), ("2A", "triton"),  # the TPU's per-column kernels: test_per_column.py
    pytest.param("2", "mosaic_tpu", marks=pytest.mark.slow), pytest.param("2A", "mosaic_tpu", marks=pytest.mark.slow)])
def test_falcon2_per_column_gains(rng, variant, impl):
    """Falcon-2 and 2A with a gain per value column through the per-column ops, Triton and TPU."""
    inputs, extra = falcon_inputs(rng, H=1, T=41, per_column=True, segments=True)
    kw = dict(variant=variant, chunk_size=16, **extra)
    assert_kernel_matches_xla_chunk_form(rng, inputs, kw, impl=impl, same=("last_key",) if variant == "2A" else ())


def test_baselines_through_the_kernels(rng):
    """DeltaNet (the decayed delta rule, same-step pairs, no decay) and decayed linear attention."""
    (q, k, v, beta, lam), _ = falcon_inputs(rng, T=40)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_decay = -lam / 2
    for baseline, gates in ((deltanet, (beta,)), (decayed_linear_attention, (log_decay, beta))):
        run = jax.jit(lambda *a, impl: baseline(*a, impl=impl, chunk_size=16), static_argnames="impl")
        with poisoned_outputs():
            got = run(q, k, v, *gates, impl="triton")
        assert rel_err(got, run(q, k, v, *gates, impl="xla")) < FP32_TOL, baseline.__name__


DELTA_BASELINES = {"gated_deltanet": (gated_deltanet, reference_gated_deltanet),
                   "deltanet": (deltanet, reference_deltanet)}


@pytest.mark.parametrize("name,impl,config,extreme", [
    # one mapping for every config and lowering: the op's decay_before_residual tests run pieces, the split forward
    # and the TPU kernels, test_baselines_through_the_kernels DeltaNet through the kernels
    pytest.param("gated_deltanet", "triton", None, False, marks=pytest.mark.slow),  # pieces, the split forward
    ("gated_deltanet", "triton", IN_PLACE, True),  # the fused walk on [B, T, H, d] in place; log γ −30 and 0
    pytest.param("gated_deltanet", "mosaic_tpu", None, False, marks=pytest.mark.slow),
    pytest.param("deltanet", "triton", IN_PLACE, False, marks=pytest.mark.slow),
])
def test_delta_rule_baselines_through_the_kernels(rng, name, impl, config, extreme):
    """Gated DeltaNet (the residual on the decayed state) and DeltaNet through the decayed delta rule at an odd
    length, with segments inside chunks, a continued state and a read scale: outputs and final state against
    the float64 recurrence (``falcon_jax.reference``), and the gradients w.r.t. q, k, v, β, log γ and the state
    against the XLA chunk form in float64.  ``extreme``: log γ = −30 (γ ≈ 1e-13) on a third of the steps and
    0 on a third."""
    fn, reference = DELTA_BASELINES[name]
    B, T, H, d = 2, 45, 2, 16
    q = rng.normal(size=(B, T, H, d))
    k = rng.normal(size=(B, T, H, d))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # β‖k‖² = β < 2: contractive
    v = rng.normal(size=(B, T, H, d))
    beta = rng.uniform(0.1, 1.9, size=(B, T, H))
    u = rng.uniform(size=(B, T, H))
    log_decay = (np.where(u < 1 / 3, -30.0, np.where(u < 2 / 3, 0.0, -rng.uniform(0, 1, size=u.shape))) if extreme
                 else -rng.uniform(0, 1, size=u.shape))
    s0 = rng.normal(size=(B, H, d, d)) / 4
    seg = np.sort(rng.integers(0, 3, size=(B, T)), axis=1)
    gates, gate_names = ((beta, log_decay), ("beta", "log_decay")) if name == "gated_deltanet" else ((beta,), ("beta",))
    kw = dict(chunk_size=16, scale=0.7, segment_ids=jnp.asarray(seg), return_final_state=True)

    def run(*args, impl, kernel_config=None):
        *xs, S = args
        state = init_state(B, H, d, d, variant="1", dtype=S.dtype).replace(S=S)
        out, final = fn(*xs, initial_state=state, impl=impl, kernel_config=kernel_config, **kw)
        return out, final.S

    floats = (q, k, v, *gates, s0)
    want, want_s = reference(q, k, v, *gates, scale=0.7, segment_ids=seg, initial_state=s0)
    kernel = jax.jit(lambda *a: run(*a, impl=impl, kernel_config=config))
    with poisoned_outputs():
        got, got_s = kernel(*(jnp.asarray(a, jnp.float32) for a in floats))
    assert rel_err(got, want) < FP32_TOL and rel_err(got_s, want_s["S"]) < FP32_TOL, name
    ct, ct_s = rng.normal(size=want.shape), rng.normal(size=s0.shape)

    def grads(impl, dtype, config=None):
        def loss(*a):
            out, S = run(*a, impl=impl, kernel_config=config)
            return jnp.sum(out * ct.astype(dtype)) + jnp.sum(S * ct_s.astype(dtype))
        return jax.jit(jax.grad(loss, argnums=tuple(range(len(floats)))))(*(jnp.asarray(a, dtype) for a in floats))

    with poisoned_outputs():
        got_grads = grads(impl, jnp.float32, config)
    for gname, g, w in zip(("q", "k", "v", *gate_names, "S"), got_grads, grads("xla", jnp.float64), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0, gname
        assert rel_err(g, w) < 1e-4, (name, gname, rel_err(g, w))


@pytest.mark.parametrize("variant,per_column,module,name", [
    ("1", False, delta_rule_op, "decayed_delta_rule"), ("3", False, windowed_op, "windowed_delta_rule"),
    ("1A", False, attention_op, "decayed_attention"), ("3A", False, attention_op, "decayed_attention"),
    ("2", True, per_column_op, "decayed_delta_rule_per_column"),
    ("2A", True, per_column_op, "decayed_attention_per_column")])
def test_kernel_config_and_implementation_reach_the_op(monkeypatch, variant, per_column, module, name):
    """``falcon(impl=..., kernel_config=...)`` hands both to the op that serves the rule; None leaves the op its
    tuned values."""
    real, seen = getattr(module, name), []
    config_type = (delta_rule_op if module is windowed_op else module).KernelConfig

    def spy(*args, config=None, implementation=None, **kw):
        seen.append((config, implementation))
        return real(*args, config=config, implementation=implementation, **kw)

    monkeypatch.setattr(module, name, spy)
    dv = 16
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((1, 32, 2, 16), (1, 32, 2, 16), (1, 32, 2, dv),
                                                           (1, 32, 2, dv) if per_column else (1, 32, 2), (1, 32, 2))]
    config = config_type(block_v=16)
    for impl, cfg in (("triton", config), ("mosaic_tpu", None)):
        jax.eval_shape(lambda *a: falcon(*a, variant=variant, chunk_size=16, impl=impl, kernel_config=cfg), *specs)
    assert seen == [(config, "triton"), (None, "mosaic_tpu")]


# test_bf16_tokens_continue_a_state_and_keep_its_dtype holds the same bound for Falcon-1 and 3A (decayed attention)
# from a state, in the default set
@pytest.mark.slow
def test_bf16_outputs_within_twice_the_xla_forms_error(rng):
    """bf16 q, k, v: the kernels (bf16 products, fp32 states, solves and accumulation) against the float64
    recurrence, within twice the error of the XLA chunk form (fp32 compute on the same bf16 values)."""
    inputs, _ = falcon_inputs(rng, T=64)
    for variant in ("1", "1A"):
        exact = falcon(*(a.astype(jnp.float64) for a in inputs), variant=variant, form="recurrent")
        bf = [a.astype(jnp.bfloat16) for a in inputs[:3]] + inputs[3:]
        run = jax.jit(lambda *a, impl: falcon(*a, variant=variant, impl=impl, chunk_size=16), static_argnames="impl")
        with poisoned_outputs():
            err_kernel = rel_err(run(*bf, impl="triton"), exact)
        err_xla = rel_err(run(*bf, impl="xla"), exact)
        assert err_kernel <= 2 * err_xla + 1e-3, (variant, err_kernel, err_xla)


@pytest.mark.parametrize("variant,multiple,T", [("1", 3, 80),
                                               pytest.param("1A", 3, 80, marks=pytest.mark.slow),  # 3A's op
                                               ("3A", 2, 200), pytest.param("3", 3, 80, marks=pytest.mark.slow)])
def test_bf16_gradients_within_a_multiple_of_the_xla_forms_error(rng, variant, multiple, T):
    """bf16 q, k, v, backward: the kernels store their per-chunk states and state gradients in bf16 and run their
    products on bf16 operands; the XLA chunk form computes in fp32 from the same bf16 values.  Against float64
    on those values the kernels' gradient error stays within ``multiple`` times the XLA form's.  Falcon-3A's
    bound is tighter: its write stream's slices feed the kernel, the gates and the banded correction, and their
    cotangents must sum in fp32 before rounding to bf16 (summed in bf16, its k error here was 2.8x the XLA form's,
    1.8x summed in fp32)."""
    inputs, _ = falcon_inputs(rng, T=T)
    ct = jnp.asarray(rng.normal(size=inputs[2].shape))
    bf = [a.astype(jnp.bfloat16) for a in inputs[:3]]

    def grads(impl, xs, dtype):
        def loss(q, k, v):
            out = falcon(q, k, v, *(a.astype(dtype) for a in inputs[3:]), variant=variant, impl=impl, chunk_size=16)
            return jnp.sum(out.astype(dtype) * ct.astype(dtype))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)

    exact = grads("xla", [a.astype(jnp.float64) for a in bf], jnp.float64)
    with poisoned_outputs():
        got = grads("triton", bf, jnp.float32)
    xla = grads("xla", bf, jnp.float32)
    for name, g, x, e in zip("qkv", got, xla, exact):
        assert np.all(np.isfinite(np.asarray(g, np.float64))), name
        assert rel_err(g, e) <= multiple * rel_err(x, e) + 1e-3, (name, rel_err(g, e), rel_err(x, e))


@pytest.mark.parametrize("variant,kw", [
    pytest.param("1A", {}, marks=pytest.mark.slow),  # decayed attention: 3A's op, 3A's case adds a window tail
    ("3A", {"timing": "rbw"}), ("1", {"timing": "rbw"}), ("3", {}),
    pytest.param("2A", {"per_column": True}, marks=pytest.mark.slow)])
def test_bf16_tokens_continue_a_state_and_keep_its_dtype(rng, variant, kw):
    """bf16 q, k, v through the kernels continuing from an fp32 state (a carried key and, for 3 / 3A, a full
    window tail; segments): the final state keeps every field in the state's dtype, its key and tail equal the XLA
    chunk form's, and outputs and S stay within twice the XLA chunk form's error against the float64 recurrence on
    the same values (S within 1e-2: the kernels' products are on bf16 operands)."""
    kw = dict(kw)
    per_column = kw.pop("per_column", False)
    H = 1 if variant.startswith("3") else 2
    inputs, extra = falcon_inputs(rng, T=37, H=H, per_column=per_column, segments=True)
    bf = [a.astype(jnp.bfloat16) for a in inputs[:3]] + inputs[3:]
    kw = dict(variant=variant, chunk_size=16, **kw)
    # the state after 9 bf16 steps: what a model carries from one call to the next (bf16-representable values)
    _, state = falcon(*(a[:, :9] for a in bf), **kw, return_final_state=True)
    assert all(a.dtype == jnp.float32 for a in (state.S, state.last_key, state.tail_x, state.tail_y))
    run = jax.jit(lambda *a, impl: falcon(*a, impl=impl, initial_state=state, return_final_state=True,
                                          **extra, **kw), static_argnames="impl")
    with poisoned_outputs():
        got, got_state = run(*bf, impl="triton")
    xla, xla_state = run(*bf, impl="xla")
    state64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a, state)
    exact, exact_state = falcon(*(a.astype(jnp.float64) for a in bf), form="recurrent", initial_state=state64,
                                return_final_state=True, **extra, **kw)
    assert got.dtype == jnp.bfloat16
    for name in ("S", "last_key", "tail_x", "tail_y"):
        assert getattr(got_state, name).dtype == jnp.float32, name
    for name in ("last_key", "tail_x", "tail_y", "tail_valid"):
        np.testing.assert_array_equal(getattr(got_state, name), getattr(xla_state, name), err_msg=name)
    assert rel_err(got, exact) <= 2 * rel_err(xla, exact) + 1e-3
    # the kernels' products run on bf16 operands (the XLA form's in fp32): S within a few bf16 roundings
    assert rel_err(got_state.S, exact_state.S) < 1e-2

