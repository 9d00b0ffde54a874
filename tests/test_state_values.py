"""A concrete state holding NaN or ±inf is refused, by every public entry point that takes one (falcon's and the
baselines' ``initial_state``, falcon_step's ``state``, a layer's ``cache.state``), with a ValueError naming the
field; a traced state is not read, and the check adds nothing to a jaxpr (docs/rules.md, "Packed sequences and
continuation")."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from falcon_jax import decayed_linear_attention, deltanet, falcon, falcon_step, gated_deltanet, init_state
from falcon_jax import validation
from falcon_jax.nn.attention import FalconAttention

B, T, H, DK, DV = 3, 8, 2, 4, 3
BAD_ROW = 1  # the row a test poisons; rows 0 and 2 stay finite


def _inputs(rng):
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, DK)) / np.sqrt(DK), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, DV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.2, 0.9, (B, T, H)), jnp.float32)  # in every rule's domain (β‖k‖² ≲ 2)
    lam = jnp.asarray(rng.uniform(0.0, 0.1, (B, T, H)), jnp.float32)
    log_decay = jnp.asarray(-rng.uniform(0.0, 0.5, (B, T, H)), jnp.float32)
    return q, k, v, beta, lam, log_decay


# name -> (the argument errors name, the variant whose state layout it takes, window, its call on (state, inputs))
ENTRY_POINTS = {
    "falcon": ("initial_state", "3", 3, lambda s, q, k, v, beta, lam, log_decay: falcon(
        q, k, v, beta, lam, variant="3", window=3, chunk_size=4, initial_state=s)),
    "falcon_step": ("state", "3", 3, lambda s, q, k, v, beta, lam, log_decay: falcon_step(
        s, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], variant="3", window=3)[0]),
    "decayed_linear_attention": ("initial_state", "1", 1, lambda s, q, k, v, beta, lam, log_decay:
                                 decayed_linear_attention(q, k, v, log_decay, beta, chunk_size=4, initial_state=s)),
    "deltanet": ("initial_state", "1", 1, lambda s, q, k, v, beta, lam, log_decay: deltanet(
        q, k, v, beta, chunk_size=4, initial_state=s)),
    "gated_deltanet": ("initial_state", "1", 1, lambda s, q, k, v, beta, lam, log_decay: gated_deltanet(
        q, k, v, beta, log_decay, chunk_size=4, initial_state=s)),
}
# the floating fields each entry point's state holds values in (the baselines' window tails are empty)
CASES = [(entry, field) for entry, (_, variant, _, _) in ENTRY_POINTS.items()
         for field in (("S", "last_key", "tail_x", "tail_y") if variant == "3" else ("S", "last_key"))]


def _state(rng, variant, window):
    """A random finite continuation state (every row has a key and a full window tail)."""
    fresh = init_state(B, H, DK, DV, variant=variant, window=window)
    random = {name: jnp.asarray(0.5 * rng.standard_normal(getattr(fresh, name).shape), jnp.float32)
              for name in ("S", "last_key", "tail_x", "tail_y")}
    return fresh.replace(has_key=jnp.ones((B,), bool), tail_valid=jnp.ones(fresh.tail_valid.shape, bool), **random)


def _poisoned(state, field, value):
    """``state`` with one entry of ``field`` in row BAD_ROW set to ``value`` (a copy: NumPy or JAX arrays)."""
    x = getattr(state, field)
    where = (BAD_ROW,) + (0,) * (x.ndim - 1)
    if isinstance(x, np.ndarray):
        x = x.copy()
        x[where] = value
        return state.replace(**{field: x})
    return state.replace(**{field: x.at[where].set(value)})


def _refusal(argname, field, kind):
    return rf"^`{re.escape(argname)}\.{field}` \(.+\) must be finite; it holds {kind} in batch rows \[{BAD_ROW}\]\."


@pytest.mark.parametrize("value,kind", [(np.nan, "NaN"), (np.inf, "inf"), (-np.inf, "inf")])
@pytest.mark.parametrize("entry,field", CASES)
def test_a_non_finite_state_is_refused_naming_the_field(rng, entry, field, value, kind):
    argname, variant, window, call = ENTRY_POINTS[entry]
    state = _poisoned(_state(rng, variant, window), field, value)
    with pytest.raises(ValueError, match=_refusal(argname, field, kind)) as refused:
        call(state, *_inputs(rng))
    assert "init_state" in str(refused.value)  # the fix: a fresh state for those rows


def test_numpy_states_are_checked_in_the_dtype_the_call_computes_with(rng):
    """A NumPy state is read in NumPy, cast as the call casts it: without x64 an fp64 value beyond the fp32 range
    is inf there (the call's outputs of that row were NaN while the check, reading fp64, passed it); with x64 it
    is finite.  A NaN in it is refused like a JAX array's."""
    argname, variant, window, call = ENTRY_POINTS["deltanet"]
    state = jax.tree.map(np.asarray, _state(rng, variant, window))
    inputs = _inputs(rng)
    huge = state.replace(S=np.asarray(state.S, np.float64).copy())
    huge.S[BAD_ROW] = 1e39
    with jax.enable_x64(False):  # the default: fp64 values become fp32
        with pytest.raises(ValueError, match=_refusal(argname, "S", "inf")):
            call(huge, *inputs)
    with jax.enable_x64(True):
        validation.check_state_finite(huge, argname=argname)
    with pytest.raises(ValueError, match=_refusal(argname, "S", "NaN")):
        call(_poisoned(state, "S", np.nan), *inputs)
    mixed = _poisoned(state.replace(S=jnp.asarray(state.S)), "last_key", -np.inf)  # one JAX field, one NumPy
    with pytest.raises(ValueError, match=_refusal(argname, "last_key", "inf")):
        call(mixed, *inputs)


# falcon's case (an un-jitted Falcon-3 chunk form, ~14 s) is marked slow: the check is one function for every entry
# point, falcon_step's case runs it on the same Falcon-3 state, and falcon's refusals are
# test_a_non_finite_state_is_refused_naming_the_field's falcon cases.
@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.slow) if e == "falcon" else e
                                   for e in ENTRY_POINTS])
def test_a_finite_state_runs_and_its_poisoned_copy_is_refused(rng, entry, monkeypatch):
    """The check reads a finite state without changing the call: the result equals the one with the check
    replaced by a no-op, and the jitted one (whose traced state is not checked) to rounding; one NaN in the same
    state is refused."""
    argname, variant, window, call = ENTRY_POINTS[entry]
    state, inputs = _state(rng, variant, window), _inputs(rng)
    out = call(state, *inputs)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, jax.jit(call)(state, *inputs), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=_refusal(argname, "S", "NaN")):
        call(_poisoned(state, "S", np.nan), *inputs)
    monkeypatch.setattr(validation, "check_state_finite", lambda state, *, argname: None)
    np.testing.assert_array_equal(call(state, *inputs), out)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_under_jit_the_state_is_not_read_and_the_jaxpr_is_unchanged(rng, entry, monkeypatch):
    """Eagerly the poisoned state is refused; as a traced argument of a jitted call it is not read (no error, and
    the NaN reaches its own row's outputs only).  The jaxprs with the check and with the check replaced by a no-op
    are identical, for a traced state and for a concrete state closed over by the traced function."""
    argname, variant, window, call = ENTRY_POINTS[entry]
    state, inputs = _state(rng, variant, window), _inputs(rng)
    poisoned = _poisoned(state, "S", np.nan)
    with pytest.raises(ValueError, match=_refusal(argname, "S", "NaN")):
        call(poisoned, *inputs)
    jitted = jax.jit(call)
    clean, out = np.asarray(jitted(state, *inputs)), np.asarray(jitted(poisoned, *inputs))
    assert np.isnan(out[BAD_ROW]).any()
    others = [r for r in range(B) if r != BAD_ROW]
    np.testing.assert_array_equal(out[others], clean[others])

    def jaxprs():
        return (str(jax.make_jaxpr(call)(state, *inputs)),
                str(jax.make_jaxpr(lambda *a: call(state, *a))(*inputs)))

    checked = jaxprs()
    monkeypatch.setattr(validation, "check_state_finite", lambda state, *, argname: None)
    assert jaxprs() == checked


def test_a_layer_cache_holding_nan_is_refused_as_cache_state(rng):
    """A layer names the cache it was given; under nnx.jit (as in generate) the cache is not read."""
    layer = FalconAttention(8, H, head_dim=DK, v_head_dim=DV, variant="3", window=3, chunk_size=4, rngs=nnx.Rngs(0))
    h = jnp.asarray(rng.standard_normal((B, 1, 8)), jnp.float32)
    cache = layer.init_cache(B)
    bad = dataclasses.replace(cache, state=_poisoned(cache.state, "tail_y", np.nan))
    with pytest.raises(ValueError, match=_refusal("cache.state", "tail_y", "NaN")):
        layer(h, cache=bad)
    y, _ = nnx.jit(lambda m, h, c: m(h, cache=c))(layer, h, bad)
    assert y.shape == (B, 1, 8)
