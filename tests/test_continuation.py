"""Continuation: chained calls, packed segments and the decode step equal one whole call."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import falcon, falcon_step, init_state
from tests.helpers import (ALL_VARIANTS, as_jnp, assert_close, assert_state_close, jcall, make_initial_state,
                           make_inputs, to_lib_state)
from tests.reference import reference_falcon

TOL = 1e-10
B, T, H, DK, DV = 3, 20, 2, 6, 5
CHUNK = 8
WINDOW = 4
# segment starts per row; none of them falls on a split point below (a call always continues
# its initial state at position 0, so a boundary exactly at the split is not a continuation)
BOUNDARIES = [(5, 13), (3, 10, 17), ()]
# 1 and T-1; 2 and 7 inside a window (7: two positions after row 0's segment start, so the
# carried tail is partly valid); 8 and 16 on chunk boundaries; 11 inside a chunk
SPLITS_A = (1, 7, 16)
SPLITS_B = (2, 8, 19)


def _segment_ids():
    seg = np.zeros((B, T), np.int32)
    for b, cuts in enumerate(BOUNDARIES):
        for c in cuts:
            seg[b, c:] += 1
    return seg


def _call(arrays, sl, variant, form, seg, init, **opts):
    q, k, v, beta, lam = (a[:, sl] for a in arrays)
    return jcall(falcon, *as_jnp(q, k, v, beta, lam), variant=variant, window=WINDOW, form=form,
                 chunk_size=CHUNK, segment_ids=jnp.asarray(seg[:, sl]), initial_state=init,
                 return_final_state=True, **opts)


def _check_splits(rng, variant, form, splits, **opts):
    arrays = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=DK, dv=DV)
    seg = _segment_ids()
    for s in splits:
        assert np.all(seg[:, s] == seg[:, s - 1])
    init = to_lib_state(make_initial_state(rng, variant=variant, window=WINDOW, B=B, H=H, dk=DK, dv=DV))
    ref_out, ref_state = reference_falcon(*arrays, variant=variant, window=WINDOW, segment_ids=seg,
                                          initial_state=init, **opts)
    whole, whole_state = _call(arrays, slice(0, T), variant, form, seg, init, **opts)
    assert_close(whole, ref_out, TOL, "whole call vs reference")
    for s in splits:
        o1, st1 = _call(arrays, slice(0, s), variant, form, seg, init, **opts)
        o2, st2 = _call(arrays, slice(s, T), variant, form, seg, st1, **opts)
        chained = jnp.concatenate([o1, o2], axis=1)
        assert_close(chained, whole, TOL, f"split at {s}: chained vs whole")
        assert_close(chained, ref_out, TOL, f"split at {s}: chained vs reference")
        assert_state_close(st2, whole_state, TOL, f"split at {s}: final state")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_chunk_form_splits(rng, variant):
    _check_splits(rng, variant, "chunk", SPLITS_A if variant in ("1", "3", "2A") else SPLITS_B)


@pytest.mark.parametrize("variant,form", [("1", "parallel"), ("3", "parallel"), ("2A", "recurrent"),
                                          ("3A", "recurrent")])
def test_other_forms_splits(rng, variant, form):
    _check_splits(rng, variant, form, (7,) if form == "parallel" else (11,))


@pytest.mark.parametrize("variant", ["1", "2", "3A"])
def test_splits_with_options(rng, variant):
    _check_splits(rng, variant, "chunk", (4,), alignment="same_step", timing="rbw", scale_coupled=True)


@pytest.mark.parametrize("variant,form", [(v, "chunk") for v in ALL_VARIANTS] + [("3", "recurrent"),
                                                                               ("3", "parallel")])
def test_segments_equal_separate_runs(rng, variant, form):
    bounds = [0, 6, 7, 13, 20]  # includes a segment of length 1 (a lone sentinel)
    seg = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))[None].repeat(B, 0).astype(np.int32)
    seg[1] += 7  # ids only need to change at boundaries
    arrays = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=DK, dv=DV)
    kw = dict(variant=variant, window=WINDOW, form=form, chunk_size=CHUNK, return_final_state=True)
    packed, packed_state = jcall(falcon, *as_jnp(*arrays), segment_ids=jnp.asarray(seg), **kw)
    for s, e in zip(bounds[:-1], bounds[1:]):
        part, part_state = jcall(falcon, *as_jnp(*(a[:, s:e] for a in arrays)), **kw)
        assert_close(packed[:, s:e], part, TOL, f"segment [{s}, {e})")
    assert_state_close(packed_state, part_state, TOL, "final state vs last segment alone")


STEP_OPTIONS = [
    dict(alignment="same_step", timing="rbw", scale_coupled=True, scale=0.5),
    dict(step="direct", eps_gamma=1e-3),
]
STEP_GRID = [(v, {}) for v in ALL_VARIANTS] + [("1", STEP_OPTIONS[0]), ("3A", STEP_OPTIONS[0]),
                                                ("2", STEP_OPTIONS[1]), ("3", STEP_OPTIONS[1])]


@pytest.mark.parametrize("variant,opts", STEP_GRID,
                         ids=[f"{v}-" + ("+".join(sorted(o)) or "default") for v, o in STEP_GRID])
def test_step_loop_equals_recurrent_and_reference(rng, variant, opts):
    Ts = 9
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=Ts, H=H, dk=DK, dv=DV,
                                     step=opts.get("step", "normalized"))
    init = make_initial_state(rng, variant=variant, window=WINDOW, B=B, H=H, dk=DK, dv=DV)
    ref_out, ref_state = reference_falcon(q, k, v, beta, lam, variant=variant, window=WINDOW,
                                          initial_state=init, **opts)
    rec_out, rec_state = jcall(falcon, *as_jnp(q, k, v, beta, lam), variant=variant, window=WINDOW,
                               form="recurrent", initial_state=to_lib_state(init), return_final_state=True,
                               **opts)
    step_fn = jax.jit(functools.partial(falcon_step, variant=variant, window=WINDOW, **opts))
    state = to_lib_state(init)
    outs = []
    for t in range(Ts):
        o_t, state = step_fn(state, *as_jnp(q[:, t], k[:, t], v[:, t], beta[:, t], lam[:, t]))
        assert o_t.shape == (B, H, DV)
        outs.append(o_t)
    step_out = jnp.stack(outs, axis=1)
    assert_close(step_out, ref_out, TOL, "step loop vs reference")
    assert_close(step_out, rec_out, TOL, "step loop vs recurrent form")
    assert_state_close(state, ref_state, TOL, "step loop final state")
    assert_state_close(rec_state, ref_state, TOL, "recurrent final state")


# Falcon-3's case (its decode steps un-jitted, ~8 s) is marked slow: test_state_values.py runs falcon_step un-jitted
# on a Falcon-3 state, test_decode.py's regression group a Falcon-3 chunk-form prefill then decode steps, and 3A's case
# here init_state's window tail.
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "3" else v for v in ALL_VARIANTS])
def test_init_state_then_steps_after_prefix(rng, variant):
    """init_state is a fresh state (same as no initial state); a chunk-form prefix followed by
    decode steps equals one whole call."""
    Tt, prefix = 11, 8
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=Tt, H=H, dk=DK, dv=DV)
    st0 = init_state(B, H, DK, DV, variant=variant, window=WINDOW, dtype=jnp.float64)
    L = WINDOW - 1 if variant in ("3", "3A") else 0
    assert st0.S.shape == (B, H, DK, DV) and not np.any(np.asarray(st0.S))
    assert not np.any(np.asarray(st0.has_key))
    assert st0.tail_valid.shape == (B, L) and not np.any(np.asarray(st0.tail_valid))
    assert st0.tail_x.shape == (B, H, L, DK) and st0.tail_y.shape == (B, H, L, DV)
    assert st0.S.dtype == jnp.float64
    ref_out, ref_state = reference_falcon(q, k, v, beta, lam, variant=variant, window=WINDOW)
    o1, state = jcall(falcon, *as_jnp(*(a[:, :prefix] for a in (q, k, v, beta, lam))), variant=variant,
                      window=WINDOW, chunk_size=CHUNK, initial_state=st0, return_final_state=True)
    outs = [o1]
    # eager (un-jitted) decode steps for one variant, jitted for the others (compile time)
    step_fn = functools.partial(falcon_step, variant=variant, window=WINDOW)
    if variant != "3":
        step_fn = jax.jit(step_fn)
    for t in range(prefix, Tt):
        o_t, state = step_fn(state, *as_jnp(q[:, t], k[:, t], v[:, t], beta[:, t], lam[:, t]))
        outs.append(o_t[:, None])
    assert_close(jnp.concatenate(outs, axis=1), ref_out, TOL, "init_state prefix + steps vs reference")
    assert_state_close(state, ref_state, TOL)
