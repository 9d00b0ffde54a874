"""falcon_jax.testing: its documented example runs, and each check fails when what it checks is wrong."""
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import falcon_jax.testing as ft
from falcon_jax import falcon


def test_the_module_example_runs():
    result = doctest.testmod(ft, raise_on_error=False, verbose=False)
    assert result.attempted >= 6 and result.failed == 0, result


@pytest.fixture
def inputs():
    return ft.random_inputs(jax.random.key(5), batch=2, time=10, heads=2, dk=4, dv=3, variant="2")


def test_matches_reference_passes_and_fails(inputs, monkeypatch):
    q, k, v, beta, lam = inputs
    err = ft.assert_matches_reference(q, k, v, beta, lam, variant="2", form="chunk", chunk_size=4)
    assert 0 < err < ft.default_tolerance(jnp.float32)

    def off_by_a_little(*a, **kw):  # an implementation that is wrong by 1e-3 of the output's scale
        out, state = falcon(*a, **kw)
        return out + 1e-3 * jnp.max(jnp.abs(out)), state

    monkeypatch.setattr(ft, "falcon", off_by_a_little)
    with pytest.raises(AssertionError, match=r"vs the float64 reference: output.*max \|got - want\| / max \|want\|"):
        ft.assert_matches_reference(q, k, v, beta, lam, variant="2", form="chunk", chunk_size=4)


def test_forms_agree_fails_on_a_wrong_state(inputs, monkeypatch):
    q, k, v, beta, lam = inputs
    errors = ft.assert_forms_agree(q, k, v, beta, lam, variant="2A", forms=("recurrent", "chunk"), chunk_size=4)
    assert set(errors) == {"chunk"}

    def chunk_state_off(*a, form, **kw):
        out, state = falcon(*a, form=form, **kw)
        return out, (state.replace(S=state.S * 1.01) if form == "chunk" else state)

    monkeypatch.setattr(ft, "falcon", chunk_state_off)
    with pytest.raises(AssertionError, match=r"form 'chunk' vs 'recurrent': final state.S"):
        ft.assert_forms_agree(q, k, v, beta, lam, variant="2A", forms=("recurrent", "chunk"), chunk_size=4)


def test_domain_checks_run_before_the_compiled_call(inputs):
    q, k, v, beta, lam = inputs
    with pytest.raises(ValueError, match="`lam` must be >= 0"):
        ft.assert_matches_reference(q, k, v, beta, -lam, variant="2")


def test_state_and_cache_layouts():
    state = jax.eval_shape(lambda: falcon(*ft.random_inputs(jax.random.key(0), batch=1, time=5, heads=2, dk=4,
                                                            dv=3), variant="3", window=3, return_final_state=True))[1]
    ft.assert_state_layout(state, batch=1, heads=2, dk=4, dv=3, variant="3", window=3, dtype=jnp.float32)
    with pytest.raises(AssertionError):
        ft.assert_state_layout(state, batch=1, heads=2, dk=4, dv=3, variant="3", window=4)  # tail 3, not 2
    with pytest.raises(AssertionError):
        ft.assert_state_layout(state, batch=1, heads=2, dk=4, dv=3, variant="3", window=3, dtype=jnp.float64)

    from falcon_jax.nn import FalconLM, LMConfig
    model = FalconLM(LMConfig.preset("falcon-1A-tiny"), rngs=nnx.Rngs(0))
    cache = model.init_cache(2, 8)
    ft.assert_cache_layout(cache, model, 2, 8)
    grown = jax.tree.map(lambda a: np.concatenate([a, a], axis=0) if a.ndim else a, cache)
    with pytest.raises(AssertionError):
        ft.assert_cache_layout(grown, model, 2, 8)


@pytest.mark.parametrize("check", ["reference", "forms"])
def test_an_output_in_a_lower_dtype_fails(inputs, monkeypatch, check):
    # rounded to bf16 the output is within bf16's tolerance, far outside fp32's: the dtype must be checked
    q, k, v, beta, lam = inputs

    def bf16_output(*a, **kw):
        out, state = falcon(*a, **kw)
        return out.astype(jnp.bfloat16), state

    monkeypatch.setattr(ft, "falcon", bf16_output)
    with pytest.raises(AssertionError, match=r"output dtype bfloat16 is not the dtype of q, k, v \(float32\)"):
        if check == "reference":
            ft.assert_matches_reference(q, k, v, beta, lam, variant="2", chunk_size=4)
        else:
            ft.assert_forms_agree(q, k, v, beta, lam, variant="2", forms=("recurrent", "chunk"), chunk_size=4)


@pytest.mark.parametrize("field", ["last_key", "has_key"])
def test_a_state_field_missing_its_batch_axis_fails(monkeypatch, field):
    # identical rows: a field without its batch axis broadcasts against the masks and matches every row
    q, k, v, beta, lam = (jnp.concatenate([a, a]) for a in ft.random_inputs(jax.random.key(6), batch=1, time=6,
                                                                             heads=2, dk=4, dv=3))

    def first_row_only(*a, **kw):
        out, state = falcon(*a, **kw)
        return out, state.replace(**{field: getattr(state, field)[0]})

    monkeypatch.setattr(ft, "falcon", first_row_only)
    with pytest.raises(AssertionError, match=rf"final state.{field}: shape .*, expected \(2,"):
        ft.assert_matches_reference(q, k, v, beta, lam, variant="1", chunk_size=4)


def test_a_form_compared_with_itself_is_refused(inputs):
    q, k, v, beta, lam = inputs
    with pytest.raises(ValueError, match="`forms` must list at least two different forms"):
        ft.assert_forms_agree(q, k, v, beta, lam, variant="2", forms=("chunk", "chunk"))


@pytest.mark.parametrize("tol", [float("inf"), float("nan"), -1e-3, "1e-3", True])
def test_a_tolerance_that_passes_or_fails_everything_is_refused(inputs, tol):
    q, k, v, beta, lam = inputs
    with pytest.raises(ValueError, match="`tol` must be a finite number >= 0"):
        ft.assert_matches_reference(q, k, v, beta, lam, variant="2", tol=tol)
    with pytest.raises(ValueError, match="`tol` must be a finite number >= 0"):
        ft.assert_forms_agree(q, k, v, beta, lam, variant="2", tol=tol)


@pytest.mark.parametrize("check", ["reference", "forms"])
def test_bad_q_is_named_before_it_is_unpacked(inputs, check):
    q, k, v, beta, lam = inputs
    fn = ft.assert_matches_reference if check == "reference" else ft.assert_forms_agree
    with pytest.raises(ValueError, match=r"`q` must have rank 4 \[batch, time, heads, dim\]; got shape \(10, 2, 4\)"):
        fn(q[0], k, v, beta, lam, variant="2")
    with pytest.raises(TypeError, match="`q` must be an array; got list"):
        fn(np.asarray(q).tolist(), k, v, beta, lam, variant="2")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"variant": "2B"}, ValueError, r"`variant` must be one of '1', '2', '3', '1A', '2A', '3A'; got '2B'"),
    ({"variant": 2}, ValueError, r"`variant` must be one of .*; got 2\."),
    ({"dtype": jnp.int32}, TypeError, r"random_inputs: `dtype` must be a floating dtype"),
    ({"time": 0}, ValueError, r"random_inputs: `time` must be an int >= 1; got 0"),
    ({"dk": 4.0}, ValueError, r"random_inputs: `dk` must be an int >= 1; got 4.0"),
    ({"key": 0}, TypeError, r"random_inputs: `key` must be a PRNG key, e.g. jax.random.key\(0\); got 0"),
])
def test_random_inputs_names_a_bad_argument(kwargs, error, message):
    kwargs = {"key": jax.random.key(0)} | kwargs
    with pytest.raises(error, match=message):
        ft.random_inputs(kwargs.pop("key"), **kwargs)


@pytest.mark.parametrize("sizes", [{"batch": None}, {"dk": {3, 4}}])
def test_state_layout_refuses_a_size_chex_reads_as_any(sizes):
    state = jax.eval_shape(lambda: falcon(*ft.random_inputs(jax.random.key(0), batch=1, time=5, heads=2, dk=4,
                                                            dv=3), variant="1", return_final_state=True))[1]
    layout = {"batch": 1, "heads": 2, "dk": 4, "dv": 3} | sizes
    with pytest.raises(ValueError, match=rf"assert_state_layout: `{next(iter(sizes))}` must be an int"):
        ft.assert_state_layout(state, variant="1", **layout)


def test_a_state_field_in_another_dtype_fails(inputs, monkeypatch):
    # the values agree (a wider S, a flag stored as 1.0): only the dtypes tell
    q, k, v, beta, lam = inputs

    def chunk_state_retyped(*a, form, **kw):
        out, state = falcon(*a, form=form, **kw)
        return out, (state.replace(S=state.S.astype(jnp.float64)) if form == "chunk" else state)

    monkeypatch.setattr(ft, "falcon", chunk_state_retyped)
    with pytest.raises(AssertionError, match=r"final state.S: dtype float64, expected float32"):
        ft.assert_forms_agree(q, k, v, beta, lam, variant="2", forms=("recurrent", "chunk"), chunk_size=4)

    def float_flags(*a, **kw):
        out, state = falcon(*a, **kw)
        return out, state.replace(has_key=state.has_key.astype(jnp.float32))

    monkeypatch.setattr(ft, "falcon", float_flags)
    with pytest.raises(AssertionError, match=r"final state.has_key: dtype float32, expected bool"):
        ft.assert_matches_reference(q, k, v, beta, lam, variant="2", chunk_size=4)
