"""Every variant x form x option equals the float64 NumPy reference (rel. err <= 1e-10),
outputs and final state.

The main cross product is variant x form x single option.  Each option case uses its own
sequence length, so lengths shorter than a chunk, multiples of the chunk and ragged tails are
all covered without multiplying the number of compilations.  Combinations of options are
spread over the variant x form grid instead of being crossed with it.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import falcon
from tests.helpers import (ALL_VARIANTS, FORMS, as_jnp, assert_close, assert_state_close, jcall,
                           make_initial_state, make_inputs, make_segment_ids, to_lib_state)
from tests.reference import reference_falcon

TOL = 1e-10
B, H, DK, DV = 2, 2, 6, 5
CHUNK = 8


def run_case(rng, variant, form, *, T=20, B=B, H=H, dk=DK, dv=DV, chunk_size=CHUNK, segments=False,
             initial_state=False, window=4, beta_per_head=False, impl="auto", **opts):
    """Draw inputs, run the library (jitted) and the reference, compare outputs and final states."""
    step = opts.get("step", "normalized")
    if initial_state:
        B = max(B, 3)  # rows: key + full tail, fresh, key + partial tail
    q, k, v, beta, lam = make_inputs(rng, variant="1" if beta_per_head else variant, B=B, T=T, H=H,
                                     dk=dk, dv=dv, step=step)
    seg = make_segment_ids(rng, B, T) if segments else None
    init = make_initial_state(rng, variant=variant, window=window, B=B, H=H, dk=dk, dv=dv) \
        if initial_state else None
    ref_out, ref_state = reference_falcon(q, k, v, beta, lam, variant=variant, window=window,
                                          segment_ids=seg, initial_state=init, **opts)
    out, state = jcall(falcon, *as_jnp(q, k, v, beta, lam), variant=variant, window=window, form=form,
                       chunk_size=chunk_size, impl=impl, return_final_state=True,
                       segment_ids=None if seg is None else jnp.asarray(seg),
                       initial_state=None if init is None else to_lib_state(init), **opts)
    assert out.dtype == jnp.float64
    assert_close(out, ref_out, TOL, f"{variant}/{form} output")
    assert_state_close(state, ref_state, TOL, f"{variant}/{form} final state")
    return out, ref_out


# option -> (kwargs, T).  chunk 8: T = 7 < chunk, 24 = 3 chunks exactly, the rest ragged.
OPTION_CASES = {
    "default": ({}, 20),
    "same_step": ({"alignment": "same_step"}, 13),
    "rbw": ({"timing": "rbw"}, 24),
    "direct": ({"step": "direct"}, 7),
    "scale_coupled": ({"scale_coupled": True}, 17),
    "segments": ({"segments": True}, 37),
    "initial_state": ({"initial_state": True}, 11),
}


# Marked slow (the full set runs them), where a default case runs the same code:
# * "direct" and "scale_coupled" change only the gates (rules.falcon_gates, one function for every form): their
#   chunk-form cases stay, and test_option_combinations runs both in every form;
# * the parallel form is the chunk form's block() over the whole sequence (write_stream, block, final_state): for
#   every variant but 3 (whose chunk form is the compact one) its same_step, rbw and initial_state cases run the
#   chunk form's code; its default and segments cases stay.
GATES_ONLY = ("direct", "scale_coupled")
CHUNK_FORMS_BLOCK = ("same_step", "rbw", "initial_state")


def _single_option_cases():
    for variant in ALL_VARIANTS:
        for case in OPTION_CASES:
            for form in FORMS:
                slow = ((form != "chunk" and case in GATES_ONLY)
                        or (form == "parallel" and variant != "3" and case in CHUNK_FORMS_BLOCK))
                yield pytest.param(variant, case, form, id=f"{variant}-{case}-{form}",
                                   marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("variant,case,form", list(_single_option_cases()))
def test_single_option(rng, variant, case, form):
    opts, T = OPTION_CASES[case]
    out, ref = run_case(rng, variant, form, T=T, **opts)
    assert np.max(np.abs(ref)) > 0.1  # the comparison is not vacuous


COMBO_CASES = [
    dict(segments=True, initial_state=True, timing="rbw"),
    dict(alignment="same_step", segments=True, initial_state=True, scale_coupled=True),
    dict(step="direct", scale_coupled=True, timing="rbw", scale=0.37, initial_state=True),
    dict(alignment="same_step", step="direct", segments=True, eps=1e-3, eps_gamma=1e-3, timing="rbw"),
]
COMBO_GRID = [(v, f, (i + j) % len(COMBO_CASES)) for i, v in enumerate(ALL_VARIANTS) for j, f in enumerate(FORMS)]


@pytest.mark.parametrize("variant,form,combo", COMBO_GRID)
def test_option_combinations(rng, variant, form, combo):
    """Each (variant, form) gets one combination; every combination meets every variant and form."""
    run_case(rng, variant, form, T=19, **COMBO_CASES[combo])


@pytest.mark.parametrize("variant,form", [(v, "chunk") for v in ALL_VARIANTS] + [("1", "parallel"),
                                                                               ("3", "parallel")])
def test_single_step_sequence(rng, variant, form):
    """T = 1 (a one-token call continuing a state: the decode-by-call case).  The recurrent form is
    one scan step and is covered by test_continuation's step loops."""
    out, ref = run_case(rng, variant, form, T=1, initial_state=True)
    assert np.max(np.abs(ref)) > 0.01


WINDOW_GRID = [(v, w, "chunk") for v in ("3", "3A") for w in (1, 2, 5, 12)] + [("3", 12, "parallel"),
                                                                              ("3A", 12, "parallel")]


@pytest.mark.parametrize("variant,window,form", WINDOW_GRID)
def test_window_sizes(rng, variant, window, form):
    """Window 12 is wider than the chunk (8): the overlap reaches back more than one chunk."""
    run_case(rng, variant, form, T=29, window=window, segments=True, initial_state=True)


@pytest.mark.parametrize("chunk_size", [1, 2, 32])
def test_chunk_sizes(rng, chunk_size):
    """Degenerate chunks (1, 2) and one chunk longer than the sequence (32 > 13)."""
    for variant in ("1", "3A"):
        run_case(rng, variant, "chunk", chunk_size=chunk_size, T=13, segments=True, initial_state=True,
                 window=3)


def _largest_value(jaxpr) -> int:
    """The most elements of any value a jaxpr (and the jaxprs inside it) makes."""
    most = 0
    for eqn in jaxpr.eqns:
        most = max([most] + [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")])
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    most = max(most, _largest_value(inner))
    return most


def test_a_chunk_longer_than_the_sequence_costs_one_sequence_chunk(rng):
    """chunk_size 2**16 on T = 13 runs as one chunk of 16: the same values as the reference, and no value
    of the program grows with chunk_size (a [.., 2**16, 2**16] block would need terabytes; Falcon-3's
    largest, in its compact form, is under 3,000 elements)."""
    q, k, v, beta, lam = make_inputs(rng, variant="3", B=1, T=13, H=1, dk=4, dv=3)
    fn = lambda *a: falcon(*a, variant="3", window=3, form="chunk", chunk_size=2**16, impl="xla")  # noqa: E731
    assert _largest_value(jax.make_jaxpr(fn)(*as_jnp(q, k, v, beta, lam)).jaxpr) < 3000
    for variant in ("1", "3A"):
        run_case(rng, variant, "chunk", chunk_size=2**16, T=13, segments=True, initial_state=True, window=3)


@pytest.mark.parametrize("variant", ["2", "2A"])
def test_per_column_variant_accepts_per_head_beta(rng, variant):
    """A [B,T,H] beta given to 2/2A broadcasts over the value columns."""
    run_case(rng, variant, "chunk", beta_per_head=True, segments=True)


@pytest.mark.parametrize("variant", ["3", "1A"])
def test_impl_xla(rng, variant):
    """``impl="xla"`` named: the XLA chunk form (the other tests take "auto", which is XLA on a CPU too)."""
    run_case(rng, variant, "chunk", impl="xla", segments=True)


def test_falcon3_xla_chunk_form_is_the_compact_form(rng, monkeypatch):
    """Falcon-3's XLA chunk form runs the windowed op's compact form (each chunk on its C + W − 1 distinct
    pairs), not :mod:`falcon_jax.forms.chunk`'s system on C·W lifted rows, which Falcon-3A keeps; both
    traced afresh (make_jaxpr), the values are :func:`test_impl_xla`'s."""
    falcon_module = importlib.import_module("falcon_jax.falcon")  # the package's ``falcon`` is the function
    calls = []
    for name in ("chunk", "chunk_pallas"):
        real = getattr(falcon_module, name)
        monkeypatch.setattr(falcon_module, name, lambda rule, *a, _n=name, _f=real, **kw:
                            calls.append((rule.name, _n)) or _f(rule, *a, **kw))
    for variant in ("3", "3A"):
        q, k, v, beta, lam = make_inputs(rng, variant=variant, B=1, T=19, H=1, dk=4, dv=3)
        jax.make_jaxpr(lambda *a: falcon(*a, variant=variant, form="chunk", impl="xla"))(
            *as_jnp(q, k, v, beta, lam))
    assert [n for _, n in calls] == ["chunk_pallas", "chunk"], calls


# Un-jitted, every op dispatched alone (~17 s).  In the default set test_faults.py's
# test_a_non_finite_key_reaches_its_own_row_only calls falcon un-jitted in every form, and test_numerics.py's
# test_long_sequence_fp32_chunk and test_bf16_chunk_accuracy call it with the default window and chunk against the
# reference's defaults, returning a plain array.
@pytest.mark.slow
def test_eager_call_defaults_and_plain_return(rng):
    """Un-jitted call with the defaults (form='chunk', chunk_size=64, window=4, shifted, raw,
    normalized): returns a plain array when return_final_state is False."""
    q, k, v, beta, lam = make_inputs(rng, variant="3", B=1, T=70, H=1, dk=4, dv=3)
    ref, _ = reference_falcon(q, k, v, beta, lam, variant="3")
    out = falcon(*as_jnp(q, k, v, beta, lam), variant="3")
    assert isinstance(out, jnp.ndarray) and out.shape == (1, 70, 1, 3)
    assert_close(out, ref, TOL)
