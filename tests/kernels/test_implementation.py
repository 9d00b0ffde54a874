"""The one implementation vocabulary (``falcon_jax.kernels.implementation``) of every op and of ``falcon(impl=)``:
``"auto"`` per platform, names, sequences, the reasons a lowering declines, ``NoImplementation``, bad values, and
``falcon(kernel_config=)``'s type check.  Selection only: calls are traced (``jax.eval_shape``), not run."""

from __future__ import annotations

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import deltanet, falcon, gated_deltanet
from falcon_jax.kernels import common
from falcon_jax.kernels import decayed_attention as attention_op
from falcon_jax.kernels import decayed_delta_rule as delta_rule_op
from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels import per_column as per_column_op
from falcon_jax.kernels.decayed_attention import decayed_attention
from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule
from falcon_jax.kernels.implementation import NoImplementation
from falcon_jax.kernels.per_column import decayed_attention_per_column, decayed_delta_rule_per_column
from falcon_jax.kernels.windowed_delta_rule import windowed_delta_rule
from falcon_jax.rules import baseline_rule, falcon_rule
from tests.kernels.helpers import S, on_backend, pallas_calls

B, H, T = 1, 2, 8


@pytest.fixture(autouse=True)
def on_a_cpu(monkeypatch):
    """The tests answer for a CPU without a Hopper GPU unless they say otherwise (``on_backend``), whatever
    machine runs them."""
    on_backend(monkeypatch, "cpu")
    monkeypatch.setattr(common, "on_hopper", lambda: False)


def op_specs(dk=16, dv=16, dtype=jnp.float32, per_column=False):
    """ShapeDtypeStructs of ``(q, x, y, gate, log γ, run, s0)`` for the kernel ops (head-major)."""
    gate = S((B, H, T, dv) if per_column else (B, H, T), jnp.float32)
    return (S((B, H, T, dk), dtype), S((B, H, T, dk), dtype), S((B, H, T, dv), dtype), gate, gate,
            S((B, H, T), jnp.int32), S((B, H, dk, dv), jnp.float32))


def trace(op, specs, **kw):
    """``op`` traced on ``specs`` with ``kw`` (selection runs at trace time)."""
    return jax.eval_shape(lambda *a: op(*a, **kw), *specs)


def delta_rule(specs, **kw):
    return trace(decayed_delta_rule, specs, chunk_size=16, **kw)


def attention(specs, **kw):
    q, x, y, _, log_decay, run, s0 = specs
    return trace(decayed_attention, (q, x, y, log_decay, run, s0), chunk_size=16, **kw)


def windowed(window, chunk_size=16, **kw):
    q, x, y, _, log_gamma, run, s0 = op_specs()
    xy = lambda a: S((B, H, T + window - 1, a.shape[-1]), a.dtype)  # noqa: E731
    return trace(windowed_delta_rule, (q, xy(x), xy(y), S((B, H, T, window), jnp.float32), log_gamma, run, s0),
                 chunk_size=chunk_size, **kw)


def falcon_specs(dk=16, dv=16, dtype=jnp.float32, per_column=False):
    tok = lambda d: S((B, T, H, d), dtype)  # noqa: E731
    gate = S((B, T, H), jnp.float32)
    return tok(dk), tok(dk), tok(dv), S((B, T, H, dv), jnp.float32) if per_column else gate, gate


def falcon_call(variant="1", specs=None, **kw):
    return trace(falcon, specs or falcon_specs(), variant=variant, chunk_size=16, **kw)


# ---- the vocabulary ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("platform,want", [("gpu", ("mosaic_gpu", "triton", "xla")), ("tpu", ("mosaic_tpu", "xla")),
                                           ("cpu", ("xla",))])
def test_auto_is_the_platforms_ordered_fallback(monkeypatch, platform, want):
    on_backend(monkeypatch, platform)
    assert impl.platform_default() == want
    for auto in ("auto", None):
        assert impl.candidates(auto) == (want, False)


def test_names_and_sequences_are_taken_as_given():
    assert impl.candidates("triton") == (("triton",), True)
    assert impl.candidates(["mosaic_tpu", "xla"]) == (("mosaic_tpu", "xla"), True)
    assert impl.candidates(("xla", "triton")) == (("xla", "triton"), True)


@pytest.mark.parametrize("bad", ["pallas", "gpu", "mosaic", "TRITON", "", (), ["triton", "cuda"],
                                 ["auto"], 3, {"triton"}])
def test_bad_implementations_are_value_errors_naming_the_argument(bad):
    with pytest.raises(ValueError, match="`implementation` must be 'auto', one of"):
        impl.candidates(bad)
    with pytest.raises(ValueError, match="`impl` must be"):
        impl.candidates(bad, argname="impl")
    with pytest.raises(ValueError, match="`implementation`"):
        delta_rule(op_specs(), implementation=bad)


@pytest.mark.parametrize("bad", ["pallas", "tpu", "cuda", ["triton", "auto"], [], ("xla", 3)])
def test_falcon_refuses_unknown_impl_naming_it(bad):
    with pytest.raises(ValueError, match="`impl`"):
        falcon_call(impl=bad)


@pytest.mark.parametrize("platform,name,want", [
    ("cpu", "triton", True), ("cpu", "mosaic_tpu", True), ("gpu", "triton", False), ("gpu", "mosaic_tpu", True),
    ("tpu", "mosaic_tpu", False), ("tpu", "triton", True), ("gpu", "mosaic_gpu", False)])
def test_a_kernel_off_its_accelerator_is_interpreted(monkeypatch, platform, name, want):
    on_backend(monkeypatch, platform)
    assert impl.interpret_mode(name, None) is want
    assert impl.interpret_mode(name, True) is True and impl.interpret_mode(name, False) is False


def test_select_takes_the_first_that_serves_and_asks_no_further():
    asked = []

    def decline(name):
        asked.append(name)
        return None if name == "mosaic_tpu" else f"{name} cannot"

    assert impl.select("op", ("triton", "mosaic_tpu", "xla"), decline) == "mosaic_tpu"
    assert asked == ["triton", "mosaic_tpu"]


def test_one_name_declined_is_a_not_implemented_error_with_its_reason():
    with pytest.raises(NotImplementedError, match=r"^op: impl='triton' declined: no\.$") as info:
        impl.select("op", "triton", lambda name: "no.", argname="impl")
    assert not isinstance(info.value, NoImplementation)


def test_every_name_declined_is_no_implementation_with_every_reason():
    with pytest.raises(NoImplementation) as info:
        impl.select("op", ["mosaic_gpu", "triton", "xla"], lambda name: f"{name} says no")
    err = info.value
    assert isinstance(err, NotImplementedError) and isinstance(err, ExceptionGroup)
    assert "no implementation of ('mosaic_gpu', 'triton', 'xla')" in str(err)
    assert [str(e) for e in err.exceptions] == [f"op: implementation={n!r} declined: {n} says no"
                                                for n in ("mosaic_gpu", "triton", "xla")]


# ---- why each lowering declines, through the ops ----------------------------------------------------------

def reasons(call):
    """The messages of the NotImplementedError (or every one of a NoImplementation) ``call()`` raises."""
    with pytest.raises(NotImplementedError) as info:
        call()
    err = info.value
    return [str(e) for e in err.exceptions] if isinstance(err, NoImplementation) else [str(err)]


def test_kernel_ops_decline_off_their_accelerator_with_each_reason():
    """On this CPU: the Mosaic GPU passes have no interpreter and need a Hopper GPU; interpret=False needs the
    kernel's own accelerator."""
    assert reasons(lambda: delta_rule(op_specs(), implementation=("mosaic_gpu", "triton", "mosaic_tpu"),
                                      interpret=False)) == [
        "decayed_delta_rule: implementation='mosaic_gpu' declined: needs a Hopper GPU (sm_90) and jax >= 0.11; "
        "'triton' serves other GPUs",
        "decayed_delta_rule: implementation='triton' declined: interpret=False off a GPU",
        "decayed_delta_rule: implementation='mosaic_tpu' declined: interpret=False off a TPU"]
    assert reasons(lambda: delta_rule(op_specs(), implementation="mosaic_gpu", interpret=True)) == [
        "decayed_delta_rule: implementation='mosaic_gpu' declined: its Mosaic GPU passes run on the GPU only (no "
        "interpret mode); use 'triton'"]


@pytest.mark.parametrize("dims,match", [
    (dict(dk=24), "dk=24: the kernels need a power of two >= 16"),
    (dict(dk=8), "dk=8: the kernels need a power of two >= 16"),
    (dict(dv=48), "dv=48: the kernels need a power of two >= 16"),
])
@pytest.mark.parametrize("name", ["triton", "mosaic_tpu"])
def test_kernel_ops_decline_shapes_their_dots_cannot_take(dims, match, name):
    for op in (delta_rule, attention):
        (got,) = reasons(lambda: op(op_specs(**dims), implementation=name))
        assert got.endswith(f"implementation={name!r} declined: {match}"), got
    (got,) = reasons(lambda: trace(decayed_delta_rule_per_column, op_specs(per_column=True, **dims), chunk_size=16,
                                   implementation=name))
    assert got.endswith(match), got


def test_kernel_ops_decline_a_chunk_that_is_no_power_of_two_from_16():
    for chunk in (8, 24):
        (got,) = reasons(lambda: trace(decayed_delta_rule, op_specs(), chunk_size=chunk, implementation="triton"))
        assert got.endswith(f"chunk_size={chunk}: the kernels need a power of two >= 16"), got


def test_a_compiled_kernel_declines_other_dtypes(monkeypatch):
    """float64 runs interpreted (the tests' float64 checks), but a compiled Triton kernel takes bf16/fp16/fp32."""
    on_backend(monkeypatch, "gpu")
    (got,) = reasons(lambda: delta_rule(op_specs(dtype=jnp.float64), implementation="triton"))
    assert got.endswith("dtype float64: the kernels take bf16, fp16 or fp32"), got
    delta_rule(op_specs(dtype=jnp.float64), implementation="triton", interpret=True)  # interpreted: served


def test_ops_without_a_mosaic_gpu_kernel_decline_it(monkeypatch):
    monkeypatch.setattr(common, "on_hopper", lambda: True)
    (got,) = reasons(lambda: attention(op_specs(), implementation="mosaic_gpu"))
    assert got.endswith("no Mosaic GPU kernel for decayed_attention; 'triton' serves the GPU"), got
    for op in (decayed_delta_rule_per_column, decayed_attention_per_column):
        (got,) = reasons(lambda: trace(op, op_specs(per_column=True), chunk_size=16, implementation="mosaic_gpu"))
        assert got.endswith("no Mosaic GPU kernel for per-column gates; 'triton' serves the GPU"), got


def test_windowed_op_declines_windows_its_blocks_cannot_hold():
    for name in ("triton", "mosaic_tpu"):
        (got,) = reasons(lambda: windowed(17, implementation=name))
        assert got.endswith("window=17: the kernel puts next_pow2(window) = 32 virtual writes per step into its "
                            "16-row blocks (at most 16)"), got
    windowed(16, chunk_size=16, implementation="triton")  # 16 virtual writes, one step per chunk: served


def test_xla_serves_every_call_and_ends_a_sequence():
    specs = op_specs(dk=6, dv=5)  # no kernel takes these
    assert delta_rule(specs, implementation=("triton", "xla"))[0].shape == (B, H, T, 5)
    assert attention(specs, implementation=["mosaic_tpu", "xla"])[0].shape == (B, H, T, 5)
    assert windowed(32, implementation=("triton", "mosaic_tpu", "xla"))[0].shape == (B, H, T, 16)


# ---- falcon(impl=...) -------------------------------------------------------------------------------------

def select(monkeypatch, platform, variant="1", dtype=jnp.bfloat16, dk=64, hopper=False, **rule_kw):
    from falcon_jax.falcon import select_kernel

    on_backend(monkeypatch, platform)
    monkeypatch.setattr(common, "on_hopper", lambda: hopper)
    rule = baseline_rule(variant) if variant in ("gated_deltanet", "deltanet") else falcon_rule(variant, **rule_kw)
    gates = {"beta": jnp.zeros((1, 8, 1)), "lam": jnp.zeros((1, 8, 1))}
    return select_kernel("auto", rule, gates, dk, 64, dtype, 64)


@pytest.mark.parametrize("platform,hopper,variant,want", [
    ("gpu", True, "1", "mosaic_gpu"),  # the decayed delta rule has Mosaic GPU passes
    ("gpu", True, "1A", "triton"),  # decayed attention has none
    ("gpu", False, "1", "triton"),
    ("gpu", False, "3", "triton"),
    ("tpu", False, "1", "mosaic_tpu"),
    ("tpu", False, "3A", "mosaic_tpu"),
    ("cpu", False, "1", "xla"),
    # the baselines through the decayed delta rule (Gated DeltaNet: its residual on the decayed state)
    ("gpu", True, "deltanet", "mosaic_gpu"),
    ("gpu", False, "deltanet", "triton"),
    ("gpu", True, "gated_deltanet", "mosaic_gpu"),
    ("gpu", False, "gated_deltanet", "triton"),
    ("tpu", False, "gated_deltanet", "mosaic_tpu"),
    ("cpu", False, "gated_deltanet", "xla"),
])
def test_falcon_auto_picks_per_platform(monkeypatch, platform, hopper, variant, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel serves it: no fallback warning
        assert select(monkeypatch, platform, variant, hopper=hopper) == want


def test_falcon_auto_falls_back_to_xla_on_a_gpu_with_one_warning_per_reason(monkeypatch):
    """Head dimensions the kernels cannot tile (dk = 24): on an accelerator "auto" takes the XLA chunk form and
    warns once, however many kernels declined and however often it is called; on a CPU, where "auto" is XLA
    anyway, it says nothing."""
    falcon_mod = importlib.import_module("falcon_jax.falcon")  # the package exports the function by that name
    monkeypatch.setattr(falcon_mod, "_warned", set())
    q, k, v, beta, lam = falcon_specs(dk=24)
    with pytest.warns(UserWarning) as record:
        on_backend(monkeypatch, "gpu")
        for _ in range(2):  # the public call: XLA's chunk form, no kernel traced
            assert pallas_calls(lambda *a: gated_deltanet(*a, chunk_size=16),
                                *(jnp.ones(s.shape, s.dtype) for s in (q, k, v, beta, lam))) == []
        assert select(monkeypatch, "gpu", "gated_deltanet", dk=24) == "xla"
    assert len(record) == 1
    assert "gated_deltanet: dk=24: the kernels need a power of two" in str(record[0].message)
    assert "using the XLA chunk form" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select(monkeypatch, "gpu", "gated_deltanet", dk=24) == "xla"  # said once
        assert select(monkeypatch, "cpu", "gated_deltanet", dk=24) == "xla"
    monkeypatch.setattr(falcon_mod, "_warned", set())
    with pytest.warns(UserWarning, match="falcon-1: dk=24: the kernels need a power of two"):
        assert select(monkeypatch, "gpu", "1", dk=24) == "xla"  # another rule, another reason: its own warning


def test_falcon_names_a_kernel_or_says_why_not():
    q, k, v, beta, lam = falcon_specs()
    log_decay = S(lam.shape, lam.dtype)
    odd = falcon_specs(dk=24)
    with pytest.raises(NotImplementedError, match="gated_deltanet: dk=24: the kernels need a power of two"):
        trace(gated_deltanet, (*odd[:4], log_decay), impl="triton", chunk_size=16)
    with pytest.raises(NotImplementedError,
                       match=r"^falcon: impl='triton' declined: falcon-1: chunk_size=8: the kernels need a power"):
        trace(falcon, (q, k, v, beta, lam), variant="1", chunk_size=8, impl="triton")
    long = [S((B, 40, H) + a.shape[3:], a.dtype) for a in (q, k, v, beta, lam)]  # a window of 32 fits T = 40
    with pytest.raises(NoImplementation) as info:
        falcon_call(variant="3", window=32, specs=long, impl=("triton", "mosaic_tpu"))
    assert [("window=32" in str(e)) for e in info.value.exceptions] == [True, True]
    # a sequence ending in "xla" serves what no kernel does, without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = trace(gated_deltanet, (*odd[:4], log_decay), impl=("triton", "xla"), chunk_size=16)
    assert out.shape == (B, T, H, 16)


def test_falcon_runs_named_kernels_interpreted_off_their_accelerator(monkeypatch):
    """On a CPU ``impl="triton"`` / ``"mosaic_tpu"`` run the Pallas kernels in interpret mode; on their own
    accelerator compiled; "xla" and, on a CPU, "auto" run none."""
    args = [jnp.zeros(s.shape, s.dtype) for s in falcon_specs()]

    def kernels(impl):
        return pallas_calls(lambda *a: falcon(*a, variant="1A", chunk_size=16, impl=impl), *args, param="interpret")

    for name, platform, suffix in (("triton", "gpu", ""), ("mosaic_tpu", "tpu", "_tpu")):
        ((kernel, interpreted),) = kernels(name)
        assert kernel == f"falcon_decayed_attention_fwd{suffix}" and interpreted
        on_backend(monkeypatch, platform)
        assert [interpreted for _, interpreted in kernels(name)] == [False], name
        on_backend(monkeypatch, "cpu")
    assert kernels("xla") == kernels("auto") == []


# ---- falcon(kernel_config=...) ----------------------------------------------------------------------------

@pytest.mark.parametrize("variant,per_column,config", [
    ("1", False, delta_rule_op.KernelConfig()), ("3", False, delta_rule_op.KernelConfig(block_v=16)),
    ("1A", False, attention_op.KernelConfig()), ("3A", False, attention_op.KernelConfig(block_v=16)),
    ("2", True, per_column_op.KernelConfig()), ("2A", True, per_column_op.KernelConfig()),
    ("2A", False, attention_op.KernelConfig()),  # one gain per head: decayed attention serves 2A
])
def test_kernel_config_of_the_op_serving_the_rule_is_taken(variant, per_column, config):
    falcon_call(variant, falcon_specs(per_column=per_column), impl="triton", kernel_config=config)


@pytest.mark.parametrize("variant,per_column,config,want", [
    ("1", False, attention_op.KernelConfig(), "decayed_delta_rule.config.KernelConfig"),
    ("3", False, per_column_op.KernelConfig(), "decayed_delta_rule.config.KernelConfig"),
    ("1A", False, delta_rule_op.KernelConfig(), "decayed_attention.config.KernelConfig"),
    ("2", True, delta_rule_op.KernelConfig(), "per_column.config.KernelConfig"),
    ("1", False, {"block_v": 32}, "decayed_delta_rule.config.KernelConfig"),
])
def test_kernel_config_of_another_op_is_a_type_error(variant, per_column, config, want):
    with pytest.raises(TypeError, match=rf"`kernel_config` must be a .*{want} for this rule"):
        falcon_call(variant, falcon_specs(per_column=per_column), impl="triton", kernel_config=config)
    with pytest.raises(TypeError, match="`kernel_config`"):  # whatever implementation runs
        falcon_call(variant, falcon_specs(per_column=per_column), impl="xla", kernel_config=config)


def test_baselines_take_the_kernel_config_of_their_op():
    q, k, v, beta, lam = falcon_specs()
    trace(deltanet, (q, k, v, beta), impl="triton", chunk_size=16, kernel_config=delta_rule_op.KernelConfig())
    with pytest.raises(TypeError, match="decayed_delta_rule.config.KernelConfig"):
        trace(deltanet, (q, k, v, beta), impl="triton", chunk_size=16, kernel_config=attention_op.KernelConfig())


def test_residual_on_the_decayed_state_is_served_by_the_scalar_gate_op_only():
    """The decayed delta rule takes ``decay_before_residual`` (Gated DeltaNet) with scalar gates on every lowering;
    the per-column and windowed ops measure the residual on the undecayed state, so a rule that would need them
    declines with the op's name, and the op refuses per-column gates."""
    import dataclasses

    from falcon_jax.forms.chunk_pallas import supports

    for name in ("triton", "mosaic_tpu", "xla"):
        assert delta_rule(op_specs(), implementation=name, decay_before_residual=True)[0].shape == (B, H, T, 16)
    with pytest.raises(NotImplementedError, match="decay_before_residual=True takes scalar gates"):
        delta_rule(op_specs(per_column=True), implementation="triton", decay_before_residual=True)
    windowed_gdn = dataclasses.replace(falcon_rule("3", window=4), decay_before_residual=True)
    got = supports(windowed_gdn, {}, "triton", 16, 16, jnp.float32, 16)
    assert got.endswith("has a Pallas kernel for scalar gates and window 1 only (decayed_delta_rule), not "
                        "windowed_delta_rule"), got
    assert supports(baseline_rule("gated_deltanet"), {}, "triton", 16, 16, jnp.float32, 16) is None


def _op_operands(T=32, d=16, W=None):
    """Well-formed [B, H, T, d] operands of the four kernel ops (seeded)."""
    q = jax.random.normal(jax.random.key(0), (1, 2, T, d))
    x = jnp.zeros((1, 2, T + (W - 1 if W else 0), d))
    gate = jnp.full((1, 2, T), -0.1)
    return q, x, gate, jnp.zeros((1, 2, T), jnp.int32), jnp.zeros((1, 2, d, d))


def _call_op(op, implementation, **bad):
    q, x, gate, run, s0 = _op_operands(W=4 if op == "windowed" else None)
    args = dict(q=q, x=x, y=x, gate=gate, run=run, initial_state=s0)
    chunk_size = bad.pop("chunk_size", 16)
    args.update(bad)
    a = args
    kw = dict(chunk_size=chunk_size, implementation=implementation)
    if op == "attention":
        return decayed_attention(a["q"], a["x"], a["y"], a["gate"], a["run"], a["initial_state"], **kw)
    if op == "windowed":
        w = a.get("w", jnp.full((1, 2, 32, 4), 0.1))
        return windowed_delta_rule(a["q"], a["x"], a["y"], w, a["gate"], a["run"], a["initial_state"], **kw)
    fn = {"delta_rule": decayed_delta_rule, "per_column": decayed_delta_rule_per_column,
          "attention_per_column": decayed_attention_per_column}[op]
    return fn(a["q"], a["x"], a["y"], jnp.abs(a["gate"]), a["gate"], a["run"], a["initial_state"], **kw)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("op", ["attention", "delta_rule", "windowed", "per_column", "attention_per_column"])
def test_kernel_ops_refuse_operands_of_the_wrong_shape_or_dtype(op, implementation):
    """Each op checks its operands' static shapes and dtypes before a lowering runs, naming the argument.

    The failure this guards against: operands that disagree in T, B or dk, gates in the other layout, a float
    run index or a mixed dtype computed without an error (the interpreted Triton kernels read past a short
    operand's end; XLA broadcast a y or a state whose B and H were swapped), and ``chunk_size=0`` ran on XLA."""
    q, x, gate, run, s0 = _op_operands(W=4 if op == "windowed" else None)
    cases = [
        (ValueError, "`x` must be", dict(x=x[:, :, :16])),
        (ValueError, "`y` must be", dict(y=jnp.concatenate([x, x]))),
        (ValueError, "`x` must be", dict(x=jnp.zeros((*x.shape[:3], 32)))),
        (ValueError, "`run` must be", dict(run=run[:, :, :16])),
        (TypeError, "`run` must be an integer array", dict(run=run.astype(jnp.float32))),
        (ValueError, r"`initial_state` must be \[B, H, dk, dv\] = \[1, 2, 16, 16\]", dict(initial_state=s0[:, :1])),
        (ValueError, "`initial_state` must be", dict(initial_state=jnp.swapaxes(s0, 0, 1))),
        (TypeError, "`q` must be a floating-point array", dict(q=q.astype(jnp.int32))),
        (TypeError, "must have one dtype", dict(q=q.astype(jnp.bfloat16))),
        (ValueError, "`q` must be", dict(q=q[0])),
        (ValueError, "`chunk_size` must be an int >= 1", dict(chunk_size=0)),
        (ValueError, "`chunk_size` must be an int >= 1", dict(chunk_size=16.0)),
    ]
    gate_name = {"attention": "log_decay", "windowed": "log_gamma"}.get(op, "eta")
    if op == "windowed":
        cases.append((ValueError, "`w` must be", dict(w=jnp.full((1, 2, 16, 4), 0.1))))
        cases.append((ValueError, "`w` must be", dict(w=jnp.full((1, 2, 32), 0.1))))
    cases.append((ValueError, f"`{gate_name}` must be", dict(gate=gate[:, :, :16])))
    cases.append((ValueError, f"`{gate_name}` must be", dict(gate=jnp.swapaxes(gate, 1, 2))))
    for error, match, bad in cases:
        with pytest.raises(error, match=match):
            _call_op(op, implementation, **bad)


@pytest.mark.parametrize("op", ["attention", "delta_rule", "windowed", "attention_per_column"])
def test_kernel_ops_take_pieces_as_a_power_of_two_and_at_most_one_per_chunk(op):
    """``pieces`` must be None or a power of two; more pieces than chunks run as one piece per chunk.

    The failure this guards against: ``decayed_delta_rule(..., pieces=3)`` cut 4 chunks unevenly and returned
    outputs off by 4 without an error; other counts (0, -1, 2.0, more pieces than chunks) ran as the automatic
    count or failed deep inside the piece scans."""
    q, x, gate, run, s0 = _op_operands(W=4 if op == "windowed" else None)
    x = 0.1 * jax.random.normal(jax.random.key(1), x.shape)

    def call(pieces, implementation="triton"):
        kw = dict(chunk_size=16, implementation=implementation, pieces=pieces)
        if op == "attention":
            return decayed_attention(q, x[..., :32, :], x[..., :32, :], gate, run, s0, **kw)
        if op == "windowed":
            return windowed_delta_rule(q, x, x, jnp.full((1, 2, 32, 4), 0.1), gate, run, s0, **kw)
        if op == "delta_rule":
            return decayed_delta_rule(q, x, x, jnp.full_like(gate, 0.5), gate, run, s0, **kw)
        return decayed_attention_per_column(q, x, x, jnp.full_like(gate, 0.5), gate, run, s0, **kw)

    for bad in (0, 3, -1, 2.0, True):
        with pytest.raises(ValueError, match="`pieces` must be a power of two >= 1"):
            call(bad)
    if op != "windowed":  # (its interpreted kernels take seconds; they share the delta rule's piece count)
        want, _ = call(None, implementation="xla")
        got, _ = call(64)  # 32 steps in chunks of 16 rows: fewer chunks than pieces
        assert jnp.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_kernel_ops_refuse_options_of_the_wrong_type():
    """Flags must be bools and ``config`` the op's own ``KernelConfig``, each error naming the option.

    The failure this guards against: ``shifted_keys="no"`` (a truthy string) shifted the keys and returned other
    outputs without an error, and another op's ``KernelConfig`` (or a dict) failed deep inside with an
    ``AttributeError`` or a comparison with None."""
    q, x, gate, run, s0 = _op_operands()
    eta = jnp.full_like(gate, 0.5)
    for name in ("shifted_keys", "decay_before_residual"):
        with pytest.raises(TypeError, match=f"`{name}` must be True or False; got 'no'"):
            decayed_delta_rule(q, x, x, eta, gate, run, s0, implementation="xla", **{name: "no"})
    with pytest.raises(TypeError, match="first_key must be a floating-point array"):
        decayed_delta_rule(q, x, x, eta, gate, run, s0, implementation="xla", shifted_keys=True,
                           first_key=jnp.zeros((1, 2, 16), jnp.int32))
    wrong = {"decayed_attention": delta_rule_op.KernelConfig(), "decayed_delta_rule": attention_op.KernelConfig(),
             "per_column": delta_rule_op.KernelConfig(), "windowed_delta_rule": {"block_v": 16}}
    calls = {
        "decayed_attention": lambda c: decayed_attention(q, x, x, gate, run, s0, implementation="triton", config=c),
        "decayed_delta_rule": lambda c: decayed_delta_rule(q, x, x, eta, gate, run, s0, implementation="triton",
                                                           config=c),
        "per_column": lambda c: decayed_attention_per_column(q, x, x, eta, gate, run, s0, implementation="triton",
                                                             config=c),
        "windowed_delta_rule": lambda c: windowed_delta_rule(
            q, jnp.zeros((1, 2, 35, 16)), jnp.zeros((1, 2, 35, 16)), jnp.full((1, 2, 32, 4), 0.1), gate, run, s0,
            implementation="triton", config=c),
    }
    for op, call in calls.items():
        with pytest.raises(TypeError, match=r"`config` must be a falcon_jax\.kernels\..*KernelConfig"):
            call(wrong[op])


@pytest.mark.parametrize("implementation", ["triton", "mosaic_tpu", "xla"])
@pytest.mark.parametrize("op", ["attention", "delta_rule", "windowed", "per_column", "attention_per_column"])
def test_kernel_ops_over_no_batch_rows_or_heads_return_empty_results(op, implementation):
    """B = 0 or H = 0: empty outputs and final state in the shapes a call returns, as ``falcon`` gives.

    The failure this guards against: the interpreted Triton kernels failed on their empty grid with a
    ``slice_sizes`` TypeError from JAX's HLO interpreter, the TPU ones with an out-of-bounds read inside an
    io_callback, and the windowed op's XLA form with a ZeroDivisionError."""
    q, x, gate, run, s0 = _op_operands(W=4 if op == "windowed" else None)
    for keep in (slice(0, 0), slice(None)), (slice(None), slice(0, 0)):
        empty = dict(q=q[keep], x=x[keep], y=x[keep], gate=gate[keep], run=run[keep], initial_state=s0[keep])
        if op == "windowed":
            empty["w"] = jnp.full((1, 2, 32, 4), 0.1)[keep]
        o, final = _call_op(op, implementation, **empty)
        B, H = q[keep].shape[:2]
        assert (o.shape, final.shape) == ((B, H, 32, 16), (B, H, 16, 16))


@pytest.mark.parametrize("implementation", ["triton", "mosaic_tpu"])
def test_a_numpy_int_chunk_size_reaches_the_kernels_as_an_int(implementation):
    """``chunk_size=np.int64(16)`` passes the ops' and ``falcon``'s checks, so it must reach the kernels' block
    shapes as a Python int (a NumPy int fails there: ``'numpy.int64' object has no attribute 'bit_length'``,
    ``... is not iterable``, a ConcretizationTypeError in TPU interpret mode).  Traced only (eval_shape): that
    failure is at trace time."""
    for op in ("attention", "delta_rule", "windowed", "per_column", "attention_per_column"):
        o, final = jax.eval_shape(lambda: _call_op(op, implementation, chunk_size=np.int64(16)))
        assert (o.shape, final.shape) == ((1, 2, 32, 16), (1, 2, 16, 16)), op
    q = jnp.zeros((1, 20, 2, 16))
    gate = jnp.full((1, 20, 2), 0.5)
    for variant in ("1", "1A", "3"):
        out = jax.eval_shape(lambda: falcon(q, q, q, gate, gate, variant=variant, window=3, impl=implementation,
                                            chunk_size=np.int64(16)))
        assert out.shape == (1, 20, 2, 16), variant
