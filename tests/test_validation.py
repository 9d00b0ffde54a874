"""Bad arguments raise ValueError / TypeError whose message names the argument.

The accepted calls are traced with jax.eval_shape (validation happens at trace time), so
no program is compiled here."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import decayed_linear_attention, deltanet, falcon, falcon_step, gated_deltanet, init_state
from tests.helpers import as_jnp, make_initial_state, make_inputs, to_lib_state

B, T, H, DK, DV = 2, 8, 2, 4, 3
ERRORS = (ValueError, TypeError)


@pytest.fixture
def inputs(rng):
    return dict(zip(("q", "k", "v", "beta", "lam"), as_jnp(*make_inputs(rng, B=B, T=T, H=H, dk=DK, dv=DV))))


def call(inputs, variant="1", **kw):
    a = dict(inputs)
    for name in ("q", "k", "v", "beta", "lam"):
        if name in kw:
            a[name] = kw.pop(name)
    return falcon(a["q"], a["k"], a["v"], a["beta"], a["lam"], variant=variant, **kw)


def test_valid_call_does_not_raise(inputs):
    """The baseline for every case below: the unmodified inputs are accepted."""
    for form in ("recurrent", "parallel", "chunk"):
        out = jax.eval_shape(lambda: call(inputs, form=form, chunk_size=4))
        assert out.shape == (B, T, H, DV)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_wrong_rank(inputs, name):
    bad = inputs[name][0]  # rank 3
    with pytest.raises(ERRORS, match=rf"\b{name}\b"):
        call(inputs, **{name: bad})


@pytest.mark.parametrize("name,shape,pattern", [
    ("k", (B, T, H, DK + 1), r"\b[qk]\b"),   # dk mismatch between q and k
    ("k", (B, T + 1, H, DK), r"\b[qk]\b"),   # T mismatch between q and k
    ("v", (B, T - 1, H, DV), r"\bv\b"),      # v shorter than q
    ("v", (B, T, H + 1, DV), r"\bv\b"),      # v with other heads
    ("beta", (B, T, H + 1), r"\bbeta\b"),
    ("beta", (B, T), r"\bbeta\b"),
    ("lam", (B, T - 1, H), r"\blam\b"),
    ("lam", (B, T, H, DV), r"\blam\b"),
])
def test_mismatched_shapes(inputs, name, shape, pattern):
    with pytest.raises(ERRORS, match=pattern):
        call(inputs, **{name: jnp.ones(shape, jnp.float64)})


@pytest.mark.parametrize("arg,value", [
    ("variant", "4"), ("variant", "1B"), ("variant", 1),
    ("form", "fused"), ("form", None),
    ("alignment", "prefix"), ("timing", "raw_after"), ("step", "normalised"), ("impl", "cuda"),
])
def test_unknown_option(inputs, arg, value):
    kw = {"variant": "1", arg: value}
    variant = kw.pop("variant")
    with pytest.raises(ERRORS, match=arg):
        call(inputs, variant=variant, **kw)


@pytest.mark.parametrize("window", [0, -1, 2.5])
def test_bad_window(inputs, window):
    with pytest.raises(ERRORS, match="window"):
        call(inputs, variant="3", window=window)


@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("chunk_size", [0, 3, 48, -8, 2.5, 64.0, "64", None, True])
def test_chunk_size_not_power_of_two(inputs, form, chunk_size):
    """Checked with every form (the recurrent and parallel forms do not use it), so a typo does not
    wait for the switch to the chunk form; the baselines take the same argument."""
    pattern = (r"^`chunk_size` must be a positive power of two \(e\.g\. 64\), whatever the form; got "
               rf"{re.escape(repr(chunk_size))}\.")
    with pytest.raises(ValueError, match=pattern):
        jax.eval_shape(lambda: call(inputs, form=form, chunk_size=chunk_size))
    with pytest.raises(ValueError, match=pattern):
        jax.eval_shape(lambda: deltanet(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], form=form,
                                        chunk_size=chunk_size))


@pytest.mark.parametrize("variant", ["1", "3", "1A", "3A"])
def test_per_column_beta_for_scalar_variant(inputs, variant):
    with pytest.raises(ERRORS, match=r"\bbeta\b"):
        call(inputs, variant=variant, beta=jnp.ones((B, T, H, DV), jnp.float64))


@pytest.mark.parametrize("variant", ["2", "2A"])
def test_per_column_beta_wrong_columns(inputs, variant):
    with pytest.raises(ERRORS, match=r"\bbeta\b"):
        call(inputs, variant=variant, beta=jnp.ones((B, T, H, DV + 1), jnp.float64))


def test_segment_ids_shape(inputs):
    with pytest.raises(ERRORS, match="segment_ids"):
        call(inputs, segment_ids=jnp.zeros((B, T + 1), jnp.int32))


def test_segment_ids_not_an_array(inputs):
    with pytest.raises(TypeError, match=r"^`segment_ids` must be an integer array \[B, T\] = \[2, 8\] \(e\.g\. "
                                        r"jnp\.asarray\(ids, jnp\.int32\)\); got list"):
        call(inputs, segment_ids=[[0] * T] * B)


def test_segment_ids_of_64_bits_must_fit_int32(inputs):
    """64-bit ids are used as int32, where ids 2**32 apart are one segment: concrete ids outside the int32 range are
    refused; in-range int64 ids give the int32 result, and traced ids are not read."""
    ids = np.zeros((B, T), np.int64)
    ids[:, 5:] = 2**32  # two segments
    with jax.enable_x64(False):
        assert np.all(np.asarray(jnp.asarray(ids)) == 0)  # one segment once cast: what the check prevents
    fns = {"falcon": lambda s: call(inputs, segment_ids=s),
           "deltanet": lambda s: deltanet(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], segment_ids=s)}
    for name, fn in fns.items():
        for bad in (ids, ids.astype(np.uint64), jnp.asarray(ids), -ids):
            with pytest.raises(ValueError, match=r"^`segment_ids` of dtype u?int64 must hold values in the int32 "
                                                 r"range .* got values in \[-?\d+, \d+\]\. Renumber the segments"):
                fn(bad)
        renumbered = np.where(ids == 0, 0, 1)
        np.testing.assert_array_equal(np.asarray(fn(renumbered)), np.asarray(fn(renumbered.astype(np.int32))))
        assert not np.allclose(np.asarray(fn(renumbered)), np.asarray(fn(np.zeros((B, T), np.int32)))), name
        jax.eval_shape(fn, jax.ShapeDtypeStruct((B, T), jnp.int64))  # traced: not inspected


def test_heads_of_width_zero_are_refused(inputs):
    """A head dim of 0 leaves the state empty: unchecked, falcon, the baselines and falcon_step would return
    zeros whatever the inputs (dk = 0) or an empty output (dv = 0)."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with pytest.raises(ValueError, match=r"^`q` and `k` must have a head dim dk >= 1; got dk = 0"):
        call(inputs, q=q[..., :0], k=k[..., :0])
    with pytest.raises(ValueError, match=r"^`v` must have a head dim dv >= 1; got dv = 0"):
        call(inputs, v=v[..., :0])
    with pytest.raises(ValueError, match=r"^`q` and `k` must have a head dim dk >= 1"):
        deltanet(q[..., :0], k[..., :0], v, inputs["beta"])
    state = init_state(B, H, DK, DV, variant="1", dtype=jnp.float64)
    with pytest.raises(ValueError, match=r"^`q_t` and `k_t` must have a head dim dk >= 1; got dk = 0"):
        falcon_step(state, q[:, 0, :, :0], k[:, 0, :, :0], v[:, 0], inputs["beta"][:, 0], inputs["lam"][:, 0],
                    variant="1")


@pytest.mark.parametrize("what", ["heads", "dk", "dv", "batch", "tail", "no_tail"])
def test_mismatched_initial_state(rng, inputs, what):
    dims = dict(B=B, H=H, dk=DK, dv=DV)
    variant, window = "3", 4
    if what == "heads":
        dims["H"] = H + 1
    elif what == "dk":
        dims["dk"] = DK + 1
    elif what == "dv":
        dims["dv"] = DV + 1
    elif what == "batch":
        dims["B"] = B + 1
    elif what == "tail":
        window = 3  # the state of a window-3 call given to a window-4 call
    elif what == "no_tail":
        variant = "1"  # a state without tail given to variant 3
    state = to_lib_state(make_initial_state(rng, variant=variant, window=window, **dims))
    with pytest.raises(ERRORS, match="initial_state"):
        call(inputs, variant="3", window=4, initial_state=state)


def test_initial_state_accepted_when_matching(rng, inputs):
    state = to_lib_state(make_initial_state(rng, variant="3", window=4, B=B, H=H, dk=DK, dv=DV))
    out = jax.eval_shape(lambda: call(inputs, variant="3", window=4, initial_state=state))
    assert out.shape == (B, T, H, DV)


def test_falcon_step_validation(rng, inputs):
    state = init_state(B, H, DK, DV, variant="3", window=4, dtype=jnp.float64)
    q_t, k_t, v_t = (inputs[n][:, 0] for n in ("q", "k", "v"))
    beta_t, lam_t = inputs["beta"][:, 0], inputs["lam"][:, 0]
    o, _ = jax.eval_shape(lambda: falcon_step(state, q_t, k_t, v_t, beta_t, lam_t, variant="3", window=4))
    assert o.shape == (B, H, DV)
    with pytest.raises(ERRORS, match=r"\bstate\b"):
        falcon_step(state, q_t, k_t, v_t, beta_t, lam_t, variant="3", window=2)
    with pytest.raises(ERRORS, match="variant"):
        falcon_step(state, q_t, k_t, v_t, beta_t, lam_t, variant="7", window=4)
    with pytest.raises(ERRORS, match=r"\bbeta"):
        falcon_step(state, q_t, k_t, v_t, jnp.ones((B, H, DV)), lam_t, variant="3", window=4)
    with pytest.raises(ERRORS, match=r"`q_t`"):
        falcon_step(state, q_t[0], k_t, v_t, beta_t, lam_t, variant="3", window=4)


@pytest.mark.parametrize("variant,arg,shape,expected", [
    ("3", "beta_t", (B, 1, H), r"\[B, H\] = \[2, 2\]"),             # a [B, T, H] slice kept its time axis
    ("3", "lam_t", (B, H, 1), r"\[B, H\] = \[2, 2\]"),
    ("2", "beta_t", (B, H, DV + 1), r"\[B, H\] = \[2, 2\] or \[B, H, dv\] = \[2, 2, 3\]"),
    ("2A", "beta_t", (B, 1, H, DV), r"\[B, H\] = \[2, 2\] or \[B, H, dv\] = \[2, 2, 3\]"),
    ("2", "lam_t", (B, H, DV), r"\[B, H\] = \[2, 2\]"),
    ("1", "beta_t", (B, H, DV), r"\[B, H\] = \[2, 2\] \(variant '1' takes one gain per head\)"),
])
def test_falcon_step_gate_shapes_name_the_step_arguments(inputs, variant, arg, shape, expected):
    """falcon_step's gate errors name `beta_t` / `lam_t` and show the shape passed and the [B, H] (or
    [B, H, dv]) shape expected, not the length-1 sequence view the checks once ran on."""
    state = init_state(B, H, DK, DV, variant=variant, dtype=jnp.float64)
    q_t, k_t, v_t = (inputs[n][:, 0] for n in ("q", "k", "v"))
    gates = {"beta_t": inputs["beta"][:, 0], "lam_t": inputs["lam"][:, 0]}
    gates[arg] = jnp.full(shape, 0.5, jnp.float64)
    with pytest.raises(ValueError) as err:
        falcon_step(state, q_t, k_t, v_t, gates["beta_t"], gates["lam_t"], variant=variant)
    msg = str(err.value)
    assert msg.startswith(f"`{arg}` "), msg
    assert f"got {shape}" in msg, msg
    assert re.search(expected, msg), msg
    other = "lam" if arg == "beta_t" else "beta"
    assert f"`{other}" not in msg and f"`{arg[:-2]}`" not in msg, msg


@pytest.mark.parametrize("arg,shape,error,expected", [
    ("q_t", (B, 1, H, DK), ValueError, r"^`q_t` must be \[B, H, dk\] \(rank 3, one token\); got shape \(2, 1, 2, 4\)\. "
                                       r"For step t of a sequence q \[B, T, H, \.\.\.\] pass q\[:, t\]"),
    ("k_t", (B, 1, H, DK), ValueError, r"^`k_t` must be \[B, H, dk\] \(rank 3, one token\); got shape \(2, 1, 2, 4\)\. "
                                       r"For step t of a sequence k .* pass k\[:, t\]"),
    ("v_t", (B, H), ValueError, r"^`v_t` must be \[B, H, dv\] \(rank 3, one token\); got shape \(2, 2\)"),
    ("k_t", (B, H, DK + 1), ValueError, r"^`k_t` must be \[B, H, dk\] = \[2, 2, 4\], the shape of `q_t`; got \(2, 2, 5\)"),
    ("k_t", (B, H + 1, DK), ValueError, r"^`k_t` must be \[B, H, dk\] = \[2, 2, 4\], the shape of `q_t`; got \(2, 3, 4\)"),
    ("v_t", (B + 1, H, DV), ValueError, r"^`v_t` must be \[B, H, dv\] with the \[B, H\] = \[2, 2\] of `q_t`; got \(3, 2, 3\)"),
    ("q_t", "int32", TypeError, r"^`q_t` must be a floating-point array .*got dtype int32"),
    ("v_t", "int32", TypeError, r"^`v_t` must be a floating-point array .*got dtype int32"),
])
def test_falcon_step_qkv_errors_name_the_step_arguments(inputs, arg, shape, error, expected):
    """falcon_step's q_t / k_t / v_t errors name them and give the step's shapes, without a time axis."""
    state = init_state(B, H, DK, DV, variant="1", dtype=jnp.float64)
    a = {n + "_t": inputs[n][:, 0] for n in ("q", "k", "v")}
    a[arg] = a[arg].astype(shape) if isinstance(shape, str) else jnp.ones(shape, jnp.float64)
    with pytest.raises(error, match=expected) as err:
        falcon_step(state, a["q_t"], a["k_t"], a["v_t"], inputs["beta"][:, 0], inputs["lam"][:, 0], variant="1")
    assert "[B, T, H" not in str(err.value).split(" For step")[0], str(err.value)


def test_falcon_step_state_errors_name_the_state_argument(inputs):
    state = init_state(B, H, DK, DV + 1, variant="1", dtype=jnp.float64)
    q_t, k_t, v_t = (inputs[n][:, 0] for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=r"^`state\.S` has shape \(2, 2, 4, 4\) but these inputs need "
                                         r"\[B, H, dk, dv\] = \[2, 2, 4, 3\]"):
        falcon_step(state, q_t, k_t, v_t, inputs["beta"][:, 0], inputs["lam"][:, 0], variant="1")
    with pytest.raises(TypeError, match=r"^`state` must be a FalconState"):
        falcon_step(None, q_t, k_t, v_t, inputs["beta"][:, 0], inputs["lam"][:, 0], variant="1")


def test_falcon_step_gate_range_names_the_step_arguments(inputs):
    state = init_state(B, H, DK, DV, variant="1", dtype=jnp.float64)
    q_t, k_t, v_t = (inputs[n][:, 0] for n in ("q", "k", "v"))
    beta_t, lam_t = inputs["beta"][:, 0], inputs["lam"][:, 0]
    with pytest.raises(ValueError, match=r"^`beta_t` must be in \[0, 2\]"):
        falcon_step(state, q_t, k_t, v_t, beta_t + 3.0, lam_t, variant="1")
    with pytest.raises(ValueError, match=r"^`lam_t` must be >= 0"):
        falcon_step(state, q_t, k_t, v_t, beta_t, lam_t - 1.0, variant="1")
    with pytest.raises(TypeError, match=r"^`beta_t` must be a floating-point array"):
        falcon_step(state, q_t, k_t, v_t, jnp.ones((B, H), jnp.int32), lam_t, variant="1")


@pytest.mark.parametrize("kw,pattern", [
    (dict(variant="9"), "variant"), (dict(window=0), "window"), (dict(heads=-1), "heads"), (dict(dk=0), "dk"),
    (dict(batch=2.0), "batch"), (dict(batch=True), "batch"),
    (dict(dtype=jnp.int32), "`dtype` must be a floating dtype"), (dict(dtype="bool"), "`dtype` must be a floating"),
])
def test_init_state_validation(kw, pattern):
    args = dict(batch=B, heads=H, dk=DK, dv=DV, variant="3", window=4)
    args.update(kw)
    with pytest.raises(ERRORS, match=pattern):
        init_state(args.pop("batch"), args.pop("heads"), args.pop("dk"), args.pop("dv"), **args)


@pytest.mark.parametrize("fn,extra", [
    (decayed_linear_attention, ("log_decay",)), (deltanet, ("beta",)), (gated_deltanet, ("beta", "log_decay")),
])
def test_baseline_validation(inputs, fn, extra):
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gates = [-inputs["lam"] if n == "log_decay" else inputs["beta"] for n in extra]
    assert jax.eval_shape(lambda: fn(q, k, v, *gates, form="recurrent")).shape == (B, T, H, DV)
    with pytest.raises(ERRORS, match="form"):
        fn(q, k, v, *gates, form="nope")
    with pytest.raises(ERRORS, match="chunk_size"):
        fn(q, k, v, *gates, form="chunk", chunk_size=48)
    with pytest.raises(ERRORS, match=r"\bq\b"):
        fn(q[0], k, v, *gates)
    bad = [jnp.ones((B, T, H + 1)) for _ in gates]
    with pytest.raises(ERRORS, match=extra[0]):
        fn(q, k, v, *bad)


@pytest.mark.parametrize("arg,value,error,pattern", [
    ("scale_coupled", "false", TypeError, r"`scale_coupled` must be True or False; got 'false'"),  # was truthy: on
    ("scale_coupled", 1, TypeError, r"`scale_coupled` must be True or False"),
    ("return_final_state", "no", TypeError, r"`return_final_state` must be True or False"),
    ("scale", float("nan"), ValueError, r"`scale` must be finite"),  # was an all-NaN output
    ("scale", "0.5", TypeError, r"`scale` must be a Python or NumPy real number; got str"),
    ("scale", True, TypeError, r"`scale` must be a Python or NumPy real number"),
    ("eps", float("inf"), ValueError, r"`eps` must be a finite float >= 0"),  # was η = 0: no update at all
])
def test_options_of_the_wrong_kind(inputs, arg, value, error, pattern):
    with pytest.raises(error, match=pattern):
        jax.eval_shape(lambda: call(inputs, **{arg: value}))


def test_flags_of_the_steps_and_baselines(inputs):
    state = init_state(B, H, DK, DV, variant="1", dtype=jnp.float64)
    q_t, k_t, v_t = (inputs[n][:, 0] for n in ("q", "k", "v"))
    with pytest.raises(TypeError, match="`scale_coupled` must be True or False"):
        falcon_step(state, q_t, k_t, v_t, inputs["beta"][:, 0], inputs["lam"][:, 0], variant="1", scale_coupled="yes")
    with pytest.raises(TypeError, match="`return_final_state` must be True or False"):
        deltanet(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], return_final_state="no")
    with pytest.raises(ValueError, match="`scale` must be finite"):
        deltanet(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], scale=float("inf"))
    for flag in (True, False, np.bool_(True)):  # NumPy bools are bools
        jax.eval_shape(lambda: call(inputs, scale_coupled=flag, return_final_state=flag, scale=np.float32(0.5)))


@pytest.mark.parametrize("dtypes,cast", [
    (("bfloat16", "float32", "bfloat16"), ("k",)),   # promoted, the output would be fp32 from bf16 q and v
    (("float32", "float32", "float64"), ("v",)),
    (("float16", "bfloat16", "bfloat16"), ("k", "v")),
])
def test_qkv_of_mixed_dtypes_are_refused(inputs, dtypes, cast):
    """q, k and v of different dtypes were promoted silently (the output took the widest); the gates keep their own
    dtype rule (fp32 gates with bf16 q, k, v are the layers' own calls)."""
    q, k, v = (inputs[n].astype(d) for n, d in zip(("q", "k", "v"), dtypes))
    for names, run in (
        (("q", "k", "v"), lambda: call(inputs, q=q, k=k, v=v)),
        (("q", "k", "v"), lambda: deltanet(q, k, v, inputs["beta"])),
        (("q_t", "k_t", "v_t"), lambda: falcon_step(init_state(B, H, DK, DV, variant="1", dtype=jnp.float64),
                                                    q[:, 0], k[:, 0], v[:, 0], inputs["beta"][:, 0],
                                                    inputs["lam"][:, 0], variant="1")),
    ):
        got = ", ".join(f"{n} {d}" for n, d in zip(names, dtypes))
        casts = ", ".join(f"{n}{names[0][1:]}.astype({names[0]}.dtype)" for n in cast)
        with pytest.raises(TypeError, match=rf"^`{names[0]}`, `{names[1]}` and `{names[2]}` must have one dtype "
                                            rf"\(the output's\); got {got}\. Cast them to one dtype, e\.g\. "
                                            rf"{re.escape(casts)};"):
            jax.eval_shape(run)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_qkv_of_one_dtype_with_fp32_gates_are_accepted(inputs, dtype):
    """The output is in q, k, v's dtype whatever the gates' (fp32 or fp64) and the state's dtype."""
    q, k, v = (inputs[n].astype(dtype) for n in ("q", "k", "v"))
    for gdt in ("float32", "float64"):
        beta, lam = inputs["beta"].astype(gdt), inputs["lam"].astype(gdt)
        assert jax.eval_shape(lambda: call(inputs, q=q, k=k, v=v, beta=beta, lam=lam)).dtype == dtype
        assert jax.eval_shape(lambda: deltanet(q, k, v, beta, form="recurrent")).dtype == dtype
        state = init_state(B, H, DK, DV, variant="1", dtype=jnp.float32)
        o, _ = jax.eval_shape(lambda: falcon_step(state, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0],
                                                  variant="1"))
        assert o.dtype == dtype
