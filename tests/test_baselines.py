"""Baselines (decayed linear attention, DeltaNet, Gated DeltaNet) in all forms equal their
float64 references, and the documented identities with Falcon hold."""
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import decayed_linear_attention, deltanet, falcon, gated_deltanet, init_state
from tests.helpers import FORMS, as_jnp, assert_close, jcall, make_inputs, make_segment_ids
from tests.reference import (reference_decayed_linear_attention, reference_deltanet, reference_falcon,
                             reference_gated_deltanet)

TOL = 1e-10
B, T, H, DK, DV = 2, 19, 2, 6, 5
CHUNK = 8


def _inputs(rng):
    q, k, v, beta, lam = make_inputs(rng, B=B, T=T, H=H, dk=DK, dv=DV, step="direct")
    log_decay = np.log(rng.uniform(0.5, 1.0, size=(B, T, H)))
    return q, k, v, beta, log_decay


def _lib_state(S0):
    return init_state(B, H, DK, DV, variant="1", dtype=jnp.float64).replace(S=jnp.asarray(S0))


BASELINES = {
    "linear_attention": (decayed_linear_attention, reference_decayed_linear_attention,
                         lambda beta, g: (g, beta)),
    "linear_attention_beta1": (decayed_linear_attention, reference_decayed_linear_attention,
                               lambda beta, g: (g,)),
    "deltanet": (deltanet, reference_deltanet, lambda beta, g: (beta,)),
    "gated_deltanet": (gated_deltanet, reference_gated_deltanet, lambda beta, g: (beta, g)),
}
GRID = [(name, form, extras) for name in BASELINES for form in FORMS for extras in (False, True)
        if not (name == "linear_attention_beta1" and extras)]


@pytest.mark.parametrize("name,form,extras", GRID)
def test_baseline_matches_reference(rng, name, form, extras):
    """extras: packed segments + an initial state + scale."""
    lib_fn, ref_fn, gate_args = BASELINES[name]
    q, k, v, beta, log_decay = _inputs(rng)
    gates = gate_args(beta, log_decay)
    kw, lib_kw = {}, {}
    if extras:
        seg = make_segment_ids(rng, B, T)
        S0 = rng.standard_normal((B, H, DK, DV))
        kw = dict(segment_ids=seg, initial_state=S0, scale=0.7)
        lib_kw = dict(segment_ids=jnp.asarray(seg), initial_state=_lib_state(S0), scale=0.7)
    ref_out, ref_state = ref_fn(q, k, v, *gates, **kw)
    out, state = jcall(lib_fn, *as_jnp(q, k, v, *gates), form=form, chunk_size=CHUNK, return_final_state=True,
                       **lib_kw)
    assert out.dtype == jnp.float64
    assert np.max(np.abs(ref_out)) > 0.1
    assert_close(out, ref_out, TOL, f"{name}/{form} output")
    assert_close(state.S, ref_state["S"], TOL, f"{name}/{form} final S")


@pytest.mark.parametrize("form", FORMS)
def test_deltanet_is_falcon1_same_step_direct_no_ridge(rng, form):
    q, k, v, beta, _ = _inputs(rng)
    seg = jnp.asarray(make_segment_ids(rng, B, T))
    dn = jcall(deltanet, *as_jnp(q, k, v, beta), form=form, chunk_size=CHUNK, segment_ids=seg)
    f1 = jcall(falcon, *as_jnp(q, k, v, beta, np.zeros_like(beta)), variant="1", alignment="same_step",
               step="direct", form=form, chunk_size=CHUNK, segment_ids=seg)
    assert np.max(np.abs(np.asarray(dn))) > 0.1
    assert_close(f1, dn, TOL, "falcon-1 vs deltanet")


def test_linear_attention_is_falcon1A_same_step_direct(rng):
    """Falcon-1A with same-step pairs and eta = beta has gamma = 1 - beta*lam and writes
    beta k v^T: decayed linear attention with log_decay = log(1 - beta*lam)."""
    q, k, v, beta, _ = _inputs(rng)
    lam = rng.uniform(0.0, 0.9, size=beta.shape)
    seg = jnp.asarray(make_segment_ids(rng, B, T))
    la = jcall(decayed_linear_attention, *as_jnp(q, k, v, np.log1p(-beta * lam), beta), form="chunk",
               chunk_size=CHUNK, segment_ids=seg)
    f1a = jcall(falcon, *as_jnp(q, k, v, beta, lam), variant="1A", alignment="same_step", step="direct",
                form="chunk", chunk_size=CHUNK, segment_ids=seg)
    assert_close(f1a, la, TOL, "falcon-1A vs linear attention")


def test_gated_deltanet_reads_decayed_state(rng):
    """GDN differs from Falcon-1 (same-step, direct) exactly by where the residual is read:
    with gamma = 1 - beta*lam the two must *differ* (guards against mixing them up), and the
    library GDN equals its reference while Falcon-1 equals the Falcon reference."""
    q, k, v, beta, _ = _inputs(rng)
    lam = rng.uniform(0.2, 0.9, size=beta.shape)
    g = np.log1p(-beta * lam)
    gdn = jcall(gated_deltanet, *as_jnp(q, k, v, beta, g), form="recurrent")
    f1 = jcall(falcon, *as_jnp(q, k, v, beta, lam), variant="1", alignment="same_step", step="direct",
               form="recurrent")
    ref_gdn, _ = reference_gated_deltanet(q, k, v, beta, g)
    ref_f1, _ = reference_falcon(q, k, v, beta, lam, variant="1", alignment="same_step", step="direct")
    assert_close(gdn, ref_gdn, TOL)
    assert_close(f1, ref_f1, TOL)
    assert np.max(np.abs(ref_gdn - ref_f1)) > 1e-3


@pytest.mark.parametrize("name", ["linear_attention", "gated_deltanet"])
@pytest.mark.parametrize("form", ["parallel", "chunk"])
def test_a_near_reset_decay_among_small_ones_stays_exact_in_fp32(rng, name, form):
    """One step with log_decay = -1e6 (a near reset, in the domain) among steps of -0.1.  The chunk and parallel
    forms take differences of cumulative sums of log decays; in fp32 the small decays after such a step were lost
    to rounding (outputs off by 0.14 against the float64 reference).  Log decays below -30 count as -30."""
    lib_fn, ref_fn, gate_args = BASELINES[name]
    q, k, v, beta, _ = _inputs(rng)
    log_decay = np.full((B, T, H), -0.1)
    log_decay[:, 3] = -1e6
    gates = gate_args(beta, log_decay)
    ref_out, _ = ref_fn(q, k, v, *gates)
    out = jcall(lib_fn, *(jnp.asarray(a, jnp.float32) for a in (q, k, v, *gates)), form=form, chunk_size=16)
    assert out.dtype == jnp.float32
    assert_close(out, ref_out, 2e-5, f"{name}/{form} output")
