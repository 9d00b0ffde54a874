"""Self-checks of the NumPy reference (tests/reference.py): identities of the rules (docs/rules.md),
hand-computed examples, and internal consistency (segments, continuation)."""
import numpy as np
import pytest

from tests.helpers import (assert_close, assert_state_close, make_initial_state, make_inputs,
                           make_segment_ids)
from tests.reference import (reference_decayed_linear_attention, reference_deltanet, reference_falcon,
                             reference_gated_deltanet)

TOL = 1e-12

OPTION_SETS = [
    {},
    {"alignment": "same_step"},
    {"timing": "rbw", "scale_coupled": True},
    {"step": "direct"},
    {"segments": True, "initial_state": True},
]


def _run(variant, rng_seed, opts, *, window, B=3, T=13, H=2, dk=4, dv=3):
    rng = np.random.default_rng(rng_seed)
    opts = dict(opts)
    step = opts.get("step", "normalized")
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=dk, dv=dv, step=step)
    seg = make_segment_ids(rng, B, T) if opts.pop("segments", False) else None
    init = make_initial_state(rng, variant=variant, window=window, B=B, H=H, dk=dk, dv=dv) \
        if opts.pop("initial_state", False) else None
    return reference_falcon(q, k, v, beta, lam, variant=variant, window=window, segment_ids=seg,
                            initial_state=init, **opts)


@pytest.mark.parametrize("opts", OPTION_SETS, ids=str)
@pytest.mark.parametrize("pair", [("3", "1"), ("3A", "1A")])
def test_window_one_reduces_to_single_pair(pair, opts):
    windowed, single = pair
    out_w, st_w = _run(windowed, 0, opts, window=1)
    out_s, st_s = _run(single, 0, opts, window=1)
    assert np.max(np.abs(out_s)) > 0.1
    assert_close(out_w, out_s, TOL)
    assert_state_close(st_w, st_s, TOL)


@pytest.mark.parametrize("opts", OPTION_SETS, ids=str)
@pytest.mark.parametrize("pair", [("2", "1"), ("2A", "1A")])
def test_tied_column_gains_reduce_to_scalar(pair, opts):
    per_col, scalar = pair
    dv = 3
    out_s, st_s = _run(scalar, 1, opts, window=4, dv=dv)
    # the same draw, the scalar variant's beta repeated over the dv columns
    rng = np.random.default_rng(1)
    step = opts.get("step", "normalized")
    q, k, v, beta, lam = make_inputs(rng, variant=scalar, B=3, T=13, H=2, dk=4, dv=dv, step=step)
    o = dict(opts)
    seg = make_segment_ids(rng, 3, 13) if o.pop("segments", False) else None
    init = make_initial_state(rng, variant=scalar, window=4, B=3, H=2, dk=4, dv=dv) \
        if o.pop("initial_state", False) else None
    beta_cols = np.repeat(beta[..., None], dv, axis=-1)
    out_c, st_c = reference_falcon(q, k, v, beta_cols, lam, variant=per_col, segment_ids=seg,
                                   initial_state=init, **o)
    out_b, _ = reference_falcon(q, k, v, beta, lam, variant=per_col, segment_ids=seg,
                                initial_state=init, **o)  # [B,T,H] beta broadcasts
    assert np.max(np.abs(out_s)) > 0.1
    assert_close(out_c, out_s, TOL)
    assert_close(out_b, out_s, TOL)
    assert_state_close(st_c, st_s, TOL)


@pytest.mark.parametrize("pair", [("2", "1"), ("2A", "1A")])
def test_per_column_equals_scalar_rule_column_by_column(pair):
    """Falcon-2 columns are independent Falcon-1 problems sharing x (and E), each with its own gain."""
    per_col, scalar = pair
    rng = np.random.default_rng(2)
    B, T, H, dk, dv = 2, 11, 2, 4, 3
    q, k, v, beta, lam = make_inputs(rng, variant=per_col, B=B, T=T, H=H, dk=dk, dv=dv)
    seg = make_segment_ids(rng, B, T)
    out, st = reference_falcon(q, k, v, beta, lam, variant=per_col, segment_ids=seg)
    for c in range(dv):
        oc, sc = reference_falcon(q, k, v[..., c:c + 1], beta[..., c], lam, variant=scalar, segment_ids=seg)
        assert_close(out[..., c:c + 1], oc, TOL)
        assert_close(st["S"][..., c:c + 1], sc["S"], TOL)
    # distinct gains really matter
    o1, _ = reference_falcon(q, k, v, beta[..., 0], lam, variant=per_col, segment_ids=seg)
    assert np.max(np.abs(o1 - out)) > 1e-3


# ---------------------------------------------------------------------------
# Hand-computed 2-step example.  B = H = 1, dk = 2, dv = 1, eps = 0.
# Initial state: S = [1, 1]^T, last_key = [0, 2] (has_key), tail (W=2) = ([2, 0], 1).
# k = [[1, 0], [0, 1]], v = [5, 2], beta = [1, 1], lam = [0, 0.5], q = [[1, 1], [1, -1]].
# Pairs (shifted): t=0: x=[0,2], y=5; t=1: x=[1,0], y=2.
# Falcon-1:  t=0 E=4, eta=1/4, gamma=1, r=5-2=3        -> S=[1, 2.5],  o0 = 3.5
#            t=1 E=1, eta=2/3, alpha=1/3, r=2-1=1      -> S=2/3*[1,2.5]+2/3*[1,0]=[4/3, 5/3], o1=-1/3
# Falcon-1A: t=0 S=[1,1]+1/4*[0,10]=[1,3.5], o0=4.5; t=1 S=2/3*[1,3.5]+2/3*[2,0]=[2,7/3], o1=-1/3
# Falcon-3A (W=2): t=0 pairs {([2,0],1),([0,2],5)}: E=4, eta=1/4, mean xy=[1,5] -> S=[1.25,2.25], o0=3.5
#            t=1 pairs {([0,2],5),([1,0],2)}: E=2.5, eta=1/3, alpha=1/6, mean xy=[1,5]
#            -> S=5/6*[1.25,2.25]+1/3*[1,5]=[11/8, 85/24], o1=-13/6
# Falcon-3 (W=2): t=0 Gram=diag(4,4), E=4/2=2, eta=1/2, r=(1-2, 5-2)=(-1,3), mean x r=[-1,3]
#            -> S=[0.5, 2.5], o0=3
#            t=1 Gram=diag(4,1), E=2, eta=1/2.5=0.4, alpha=0.2, r=(5-5, 2-0.5)=(0,1.5), mean x r=[0.75,0]
#            -> S=0.8*[0.5,2.5]+0.4*[0.75,0]=[0.7, 2], o1=-1.3
# rbw (Falcon-1): o0 = S_init^T q0 = 2, o1 = [1, 2.5].q1 = -1.5
# ---------------------------------------------------------------------------

def _hand_inputs():
    q = np.array([[1.0, 1.0], [1.0, -1.0]]).reshape(1, 2, 1, 2)
    k = np.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = np.array([5.0, 2.0]).reshape(1, 2, 1, 1)
    beta = np.ones((1, 2, 1))
    lam = np.array([0.0, 0.5]).reshape(1, 2, 1)
    init = {"S": np.array([1.0, 1.0]).reshape(1, 1, 2, 1),
            "last_key": np.array([0.0, 2.0]).reshape(1, 1, 2),
            "has_key": np.array([True]),
            "tail_x": np.array([2.0, 0.0]).reshape(1, 1, 1, 2),
            "tail_y": np.array([1.0]).reshape(1, 1, 1, 1),
            "tail_valid": np.array([[True]])}
    return q, k, v, beta, lam, init


@pytest.mark.parametrize("variant,timing,expected_out,expected_S", [
    ("1", "raw", [3.5, -1 / 3], [4 / 3, 5 / 3]),
    ("1", "rbw", [2.0, -1.5], [4 / 3, 5 / 3]),
    ("1A", "raw", [4.5, -1 / 3], [2.0, 7 / 3]),
    ("3A", "raw", [3.5, -13 / 6], [11 / 8, 85 / 24]),
    ("3", "raw", [3.0, -1.3], [0.7, 2.0]),
])
def test_hand_computed_two_steps(variant, timing, expected_out, expected_S):
    q, k, v, beta, lam, init = _hand_inputs()
    if variant in ("1", "1A"):
        init = dict(init, tail_x=np.zeros((1, 1, 0, 2)), tail_y=np.zeros((1, 1, 0, 1)),
                    tail_valid=np.zeros((1, 0), bool))
    out, st = reference_falcon(q, k, v, beta, lam, variant=variant, window=2, timing=timing,
                               eps=0.0, initial_state=init)
    np.testing.assert_allclose(out.reshape(-1), expected_out, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(st["S"].reshape(-1), expected_S, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(st["last_key"].reshape(-1), [0.0, 1.0])
    if variant in ("3", "3A"):
        np.testing.assert_allclose(st["tail_x"].reshape(-1), [1.0, 0.0])
        np.testing.assert_allclose(st["tail_y"].reshape(-1), [2.0])
        assert st["tail_valid"].tolist() == [[True]]


def test_hand_computed_fresh_sentinel_and_clamp():
    """No initial state: t=0 is the sentinel (o0 = 0); lam huge clamps alpha at 1 - eps_gamma."""
    q, k, v, beta, lam, _ = _hand_inputs()
    lam = np.array([0.0, 1e9]).reshape(1, 2, 1)
    out, st = reference_falcon(q, k, v, beta, lam, variant="1", eps=0.0, eps_gamma=0.25)
    # t=1: x=[1,0], E=1, eta=1/(1+1e9), alpha=min(eta*1e9, 0.75)=0.75, r=2 -> S=[2*eta, 0]
    eta = 1.0 / (1.0 + 1e9)
    np.testing.assert_allclose(out.reshape(-1), [0.0, 2 * eta], rtol=1e-14)
    np.testing.assert_allclose(st["S"].reshape(-1), [2 * eta, 0.0], rtol=1e-14)


def test_direct_step_and_scale():
    rng = np.random.default_rng(3)
    q, k, v, beta, lam = make_inputs(rng, variant="1", B=1, T=5, H=1, dk=3, dv=2, step="direct")
    out1, _ = reference_falcon(q, k, v, beta, lam, variant="1", step="direct")
    out2, _ = reference_falcon(q, k, v, beta, lam, variant="1", step="direct", scale=2.5)
    assert_close(out2, 2.5 * out1, TOL)
    # one real step by hand: t=1, x=k0, y=v1, eta=beta1, gamma=1-beta1*lam1, S=eta x y^T
    S1 = beta[0, 1, 0] * np.outer(k[0, 0, 0], v[0, 1, 0])
    np.testing.assert_allclose(out1[0, 1, 0], S1.T @ q[0, 1, 0], rtol=1e-13)
    np.testing.assert_allclose(out1[0, 0, 0], 0.0)


@pytest.mark.parametrize("variant", ["1", "2", "3", "1A", "2A", "3A"])
@pytest.mark.parametrize("alignment", ["shifted", "same_step"])
def test_segments_equal_separate_runs(variant, alignment):
    rng = np.random.default_rng(4)
    B, T, H, dk, dv = 1, 17, 2, 4, 3
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=dk, dv=dv)
    bounds = [0, 5, 6, 12, 17]
    seg = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))[None]
    out, st = reference_falcon(q, k, v, beta, lam, variant=variant, window=3, alignment=alignment,
                               segment_ids=seg)
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, st_s = reference_falcon(q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e], lam[:, s:e],
                                   variant=variant, window=3, alignment=alignment)
        assert_close(out[:, s:e], o, TOL, f"segment {s}:{e}")
    assert_state_close(st, st_s, TOL)


@pytest.mark.parametrize("variant", ["1", "2", "3", "1A", "2A", "3A"])
@pytest.mark.parametrize("split", [1, 3, 9])
def test_continuation_is_exact(variant, split):
    rng = np.random.default_rng(5)
    B, T, H, dk, dv = 2, 10, 2, 4, 3
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=dk, dv=dv)
    seg = np.array([[0] * 6 + [1] * 4, [0] * 2 + [1] * 8])
    assert split not in (2, 6)  # no segment start at the split point
    kw = dict(variant=variant, window=4, timing="rbw", segment_ids=None)
    out, st = reference_falcon(q, k, v, beta, lam, **dict(kw, segment_ids=seg))
    a = slice(0, split)
    b = slice(split, T)
    o1, s1 = reference_falcon(q[:, a], k[:, a], v[:, a], beta[:, a], lam[:, a], **dict(kw, segment_ids=seg[:, a]))
    o2, s2 = reference_falcon(q[:, b], k[:, b], v[:, b], beta[:, b], lam[:, b], initial_state=s1,
                              **dict(kw, segment_ids=seg[:, b]))
    assert_close(np.concatenate([o1, o2], axis=1), out, TOL)
    assert_state_close(s2, st, TOL)


def test_fresh_initial_state_equals_none():
    rng = np.random.default_rng(6)
    for variant in ("1", "3", "2A"):
        q, k, v, beta, lam = make_inputs(rng, variant=variant, B=2, T=7, H=1, dk=3, dv=2)
        L = 3 if variant == "3" else 0
        fresh = {"S": np.zeros((2, 1, 3, 2)), "last_key": np.ones((2, 1, 3)), "has_key": np.zeros(2, bool),
                 "tail_x": np.ones((2, 1, L, 3)), "tail_y": np.ones((2, 1, L, 2)),
                 "tail_valid": np.zeros((2, L), bool)}
        o1, s1 = reference_falcon(q, k, v, beta, lam, variant=variant)
        o2, s2 = reference_falcon(q, k, v, beta, lam, variant=variant, initial_state=fresh)
        assert_close(o2, o1, 0.0)
        assert_state_close(s2, s1, 0.0)


def test_baseline_identities():
    rng = np.random.default_rng(7)
    B, T, H, dk, dv = 2, 9, 2, 4, 3
    q, k, v, beta, lam = make_inputs(rng, variant="1", B=B, T=T, H=H, dk=dk, dv=dv, step="direct")
    seg = make_segment_ids(rng, B, T)
    S0 = rng.standard_normal((B, H, dk, dv))
    init = {"S": S0, "last_key": np.zeros((B, H, dk)), "has_key": np.ones(B, bool),
            "tail_x": np.zeros((B, H, 0, dk)), "tail_y": np.zeros((B, H, 0, dv)),
            "tail_valid": np.zeros((B, 0), bool)}
    # DeltaNet == Falcon-1 with same-step pairs, direct step, lam = 0
    od, sd = reference_deltanet(q, k, v, beta, segment_ids=seg, initial_state=S0)
    of, sf = reference_falcon(q, k, v, beta, np.zeros_like(lam), variant="1", alignment="same_step",
                              step="direct", segment_ids=seg, initial_state=init)
    assert_close(od, of, TOL)
    assert_close(sd["S"], sf["S"], TOL)
    # Gated DeltaNet with zero log-decay == DeltaNet
    og, sg = reference_gated_deltanet(q, k, v, beta, np.zeros_like(lam), segment_ids=seg,
                                      initial_state={"S": S0})
    assert_close(og, od, TOL)
    # decayed linear attention == Falcon-1A same_step direct with gamma = 1 - beta*lam
    ol, sl = reference_decayed_linear_attention(q, k, v, np.log1p(-beta * lam), beta, segment_ids=seg,
                                                initial_state=S0)
    o1a, s1a = reference_falcon(q, k, v, beta, lam, variant="1A", alignment="same_step", step="direct",
                                segment_ids=seg, initial_state=init)
    assert_close(ol, o1a, TOL)
    assert_close(sl["S"], s1a["S"], TOL)
    # beta defaults to one
    o_def, _ = reference_decayed_linear_attention(q, k, v, -lam)
    o_one, _ = reference_decayed_linear_attention(q, k, v, -lam, np.ones_like(lam))
    assert_close(o_def, o_one, 0.0)
    # GDN one step by hand from S0 (t=0 of row 1, no reset at t=0)
    g = np.exp(-lam[1, 0, 0])
    kt = k[1, 0, 0]
    S1 = g * (S0[1, 0] - beta[1, 0, 0] * np.outer(kt, kt @ S0[1, 0])) + beta[1, 0, 0] * np.outer(kt, v[1, 0, 0])
    og2, _ = reference_gated_deltanet(q, k, v, beta, -lam, initial_state=S0)
    np.testing.assert_allclose(og2[1, 0, 0], S1.T @ q[1, 0, 0], rtol=1e-13)
