"""The Mosaic GPU passes of ``decayed_delta_rule`` (Hopper: wgmma + TMA) on a CPU: what they refuse, that they
cross-lower for CUDA with the Triton passes' output shapes and dtypes and the aliasing they promise, and which
passes the op runs under ``implementation="mosaic_gpu"``.

They have no interpreter here, so their values are checked on a Hopper GPU only; the Triton passes they stand in
for are checked against float64 in interpret mode (``test_decayed_delta_rule.py``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels import common
from falcon_jax.kernels.decayed_delta_rule import KernelConfig, decayed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.mosaic_gpu import prepare, walks
from falcon_jax.kernels.decayed_delta_rule.triton import forward, state_grads
from tests.kernels.helpers import S, lowered_text, mosaic_lowering_available, on_backend, pallas_calls

pytestmark = pytest.mark.skipif(not mosaic_lowering_available(),
                                reason="this jax cannot lower Pallas Mosaic GPU kernels for CUDA on a CPU")
BF, F32 = jnp.bfloat16, jnp.float32
C = 64


def tokens(B, L, H, d, dtype=BF, in_place=True):
    return S((B, L, H, d) if in_place else (B * H, L, d), dtype)


def pass_args(B, L, H, dk, dv, dtype=BF, t_dtype=None, in_place=True):
    """q, x, y (or dO), η, g, g⁻, rl, T, the ``[B·H, 1, dk, dv]`` state and the scores, as the op passes them."""
    rows = S((B * H, L), F32)
    return dict(q=tokens(B, L, H, dk, dtype, in_place), x=tokens(B, L, H, dk, dtype, in_place),
                y=tokens(B, L, H, dv, dtype, in_place), eta=rows, g=rows, gp=rows, rl=S((B * H, L), jnp.int32),
                tinv=S((B * H, L, C), t_dtype or dtype), s0=S((B * H, 1, dk, dv), F32),
                scores=S((B * H, L, C), dtype))


def shapes(fn, *specs):
    return [(a.shape, a.dtype) for a in jax.tree.leaves(jax.eval_shape(fn, *specs))]


def mosaic_lines(text):
    return [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]


# ---- prepare_v: V = Tᵀ (QXᵀ ⊙ D)ᵀ dO per chunk, and the reverse walk's q-term --------------------------------

def prepare_call(a, heads=2, **kw):
    kw = dict(dict(chunk=C, heads=heads, v_dtype=a["q"].dtype, q_term_dtype=a["q"].dtype, key_shift=True,
                   walk_operands=a["q"].dtype), **kw)
    return lambda: prepare.prepare_v(a["q"], a["x"], a["eta"], a["g"], a["gp"], a["rl"], a["tinv"], a["y"], **kw)


@pytest.mark.parametrize("args,kw,match", [
    ({}, dict(interpret=True), "runs on a Hopper GPU only (no CPU interpreter)"),
    ({}, dict(chunk=32), "chunk_size=32: the Mosaic GPU prepare pass takes chunk_size=64"),
    (dict(dtype=F32), {}, "dtype float32: bf16 or fp16 only"),
    (dict(dk=32), {}, "dk=32: the Mosaic GPU prepare pass takes 64 or 128"),
    (dict(dv=256), {}, "dv=256: the Mosaic GPU prepare pass takes 64 or 128"),
    ({}, dict(v_dtype=F32), "V stored in float32"),
    ({}, dict(q_term_dtype=F32), "q-term stored in float32"),
    (dict(t_dtype=F32), {}, "T stored in float32"),
    ({}, dict(walk_operands=None), "the walk's operands in fp32"),
])
def test_prepare_refuses_calls_it_does_not_serve(args, kw, match):
    a = pass_args(**dict(dict(B=1, L=128, H=2, dk=64, dv=64), **args))
    with pytest.raises(NotImplementedError, match=re.escape(f"mosaic_gpu prepare_v: {match}")):
        jax.eval_shape(prepare_call(a, **kw))


@pytest.mark.parametrize("B,L,H,d,key_shift,q_term,in_place", [
    (2, 256, 4, 128, True, True, True),  # Falcon-1's call: keys one row back, read in place, the q-term
    (1, 64, 2, 64, False, False, True),  # one chunk, d = 64
    (3, 320, 1, 128, True, True, False),  # head-major, an odd number of chunks
])
def test_prepare_lowers_with_the_triton_pass_shapes(B, L, H, d, key_shift, q_term, in_place):
    a = pass_args(B, L, H, d, d, in_place=in_place)
    kw = dict(heads=H if in_place else None, key_shift=key_shift, q_term_dtype=BF if q_term else None)
    specs = [a[n] for n in ("q", "x", "eta", "g", "gp", "rl", "tinv", "y")]

    def mosaic(*s):
        return prepare.prepare_v(*s, chunk=C, v_dtype=BF, walk_operands=BF, **kw)

    def triton(*s):
        return state_grads.prepare_v(*s, chunk=C, v_dtype=BF, walk_operands=BF, interpret=False, **kw)

    want = [(a["y"].shape, BF)] + [((B * H, L // C, d, d), BF)] * q_term
    assert shapes(mosaic, *specs) == shapes(triton, *specs) == want
    (line,) = mosaic_lines(lowered_text(mosaic, specs))
    assert line.count("output_operand_alias<") == 0


# ---- the cluster walks --------------------------------------------------------------------------------------

WALK = dict(chunk=C, heads=2, walk_operands=BF, write_o=True, write_p=False, write_h=False)


def forward_call(a, **kw):
    kw = dict(WALK, **kw)
    scores = a["scores"] if kw["write_o"] else None
    return lambda: walks.forward_walk(a["q"], a["x"], a["y"], a["eta"], a["g"], a["gp"], a["rl"], a["tinv"], a["s0"],
                                      scores=scores, **kw)


@pytest.mark.parametrize("args,kw,match", [
    ({}, dict(chunk=32), "chunk_size=32: the Mosaic GPU walks take chunk_size=64"),
    (dict(dtype=F32), dict(walk_operands=F32), "dtype float32: bf16 or fp16 only"),
    ({}, dict(walk_operands=None), "the walk's operands in fp32"),
    ({}, dict(walk_operands=F32), "the walk's operands in fp32"),
    (dict(t_dtype=F32), {}, "T stored in float32"),
    (dict(dk=32), {}, "dk=32: the Mosaic GPU walks take 64 or 128"),
    (dict(dk=256), {}, "dk=256"),
    ({}, dict(block_v=32), "block_v=32: the Mosaic GPU walks take 64 value columns"),
    (dict(dv=576), {}, "at most 8 CTAs"),
    ({}, dict(pieces=2), "pieces=2: the Mosaic GPU walks walk whole sequences"),
])
def test_forward_walk_refuses_calls_it_does_not_serve(args, kw, match):
    a = pass_args(**dict(dict(B=1, L=128, H=2, dk=64, dv=64), **args))
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        jax.eval_shape(forward_call(a, **kw))


def test_forward_walk_reads_its_scores_in_the_inputs_dtype():
    a = pass_args(1, 128, 2, 64, 64)
    a["scores"] = S(a["scores"].shape, F32)
    with pytest.raises(NotImplementedError, match="the scores stored in float32"):
        jax.eval_shape(forward_call(a))
    with pytest.raises(NotImplementedError, match="write_o reads the masked scores"):
        jax.eval_shape(lambda: walks.forward_walk(*(a[n] for n in ("q", "x", "y", "eta", "g", "gp", "rl", "tinv",
                                                                   "s0")), scores=None, **WALK))


@pytest.mark.parametrize("walk", ["output", "recompute"])
@pytest.mark.parametrize("B,L,H,d,in_place,key_shift", [(2, 256, 4, 128, True, True), (3, 320, 1, 64, False, False)])
def test_forward_walk_lowers_with_the_triton_walks_outputs(walk, B, L, H, d, in_place, key_shift):
    """The forward's output walk (o, end state) and the backward's recompute walk (P, chunk states, end state):
    the Triton walk's shapes and dtypes, lowered for CUDA in either layout, keys read one row back or not."""
    a = pass_args(B, L, H, d, 2 * d, in_place=in_place)
    out = walk == "output"
    kw = dict(WALK, heads=H if in_place else None, block_v=64, write_o=out, write_p=not out, write_h=not out,
              key_shift=key_shift)
    names = ("q", "x", "y", "eta", "g", "gp", "rl", "tinv", "s0", "scores")

    def mosaic(*s):
        return walks.forward_walk(*s[:9], scores=s[9] if out else None, **kw)

    def triton(*s):
        return forward.forward_pass(*s[:9], scores=s[9] if out else None, pieces=1, interpret=False, **kw)

    specs = [a[n] for n in names]
    want = shapes(triton, *specs)
    assert shapes(mosaic, *specs) == want
    assert want[-1] == ((B * H, 1, d, 2 * d), F32) and (out or want[-2] == ((B * H, L // C, d, 2 * d), BF))
    assert len(mosaic_lines(lowered_text(mosaic, specs))) == 1


def reverse_call(a, prepared="v", **kw):
    v = {"v": (a["y"], None), "v-and-q-term": (a["y"], a["s0"]), "fp32-v": (S(a["y"].shape, F32), None),
         None: None}[prepared]
    kw = dict(dict(chunk=C, heads=2, prepared=v, write_dr=a["q"].dtype, walk_operands=a["q"].dtype,
                   key_shift=True), **kw)
    return lambda: walks.reverse_walk(a["q"], a["x"], a["eta"], a["g"], a["gp"], a["rl"], a["tinv"], a["y"], a["s0"],
                                      **kw)


@pytest.mark.parametrize("prepared,args,kw,match", [
    ("v", {}, dict(block_v=32), "block_v=32"),
    ("v", {}, dict(pieces=2), "pieces=2"),
    (None, {}, {}, "it needs prepare_v's V without a q-term"),
    ("v-and-q-term", {}, {}, "it needs prepare_v's V without a q-term"),
    ("v", {}, dict(write_dh=False), "it needs prepare_v's V without a q-term"),
    ("fp32-v", {}, {}, "V stored in fp32"),
    ("v", {}, dict(write_dr=F32), "dR stored in fp32 or not at all"),
    ("v", {}, dict(write_dr=None), "dR stored in fp32 or not at all"),
    ("v", dict(t_dtype=F32), {}, "T stored in float32"),
])
def test_reverse_walk_refuses_calls_it_does_not_serve(prepared, args, kw, match):
    a = pass_args(**dict(dict(B=1, L=128, H=2, dk=64, dv=64), **args))
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        jax.eval_shape(reverse_call(a, prepared, **kw))


def test_reverse_walk_forms_the_q_term_from_queries_in_the_keys_dtype():
    a = pass_args(1, 128, 2, 64, 64)
    a["q"] = S(a["q"].shape, F32)
    with pytest.raises(NotImplementedError, match="forming the q-term in the walk from queries or dO"):
        jax.eval_shape(reverse_call(a, write_dr=BF, walk_operands=BF))


@pytest.mark.parametrize("B,L,H,d,in_place", [(2, 256, 4, 128, True), (3, 320, 1, 64, False)])
def test_reverse_walk_lowers_with_the_triton_walks_outputs_and_writes_dr_over_v(B, L, H, d, in_place):
    """dR, dh and the start state's gradient in the Triton walk's shapes and dtypes; dR is written over V (the
    one operand the Mosaic call aliases)."""
    a = pass_args(B, L, H, d, 2 * d, in_place=in_place)
    names = ("q", "x", "eta", "g", "gp", "rl", "tinv", "y", "s0")
    kw = dict(chunk=C, heads=H if in_place else None, pieces=1, block_v=64, write_dh=True, write_dr=BF,
              walk_operands=BF, key_shift=True)

    def mosaic(*s, v):
        return walks.reverse_walk(*s, prepared=(v, None), **kw)

    def triton(*s, v):
        return state_grads.state_grad_walk(*s, prepared=(v, None), interpret=False, **kw)

    def with_v(fn):
        return lambda *s: fn(*s[:-1], v=s[-1])

    specs = [a[n] for n in names] + [a["y"]]
    assert shapes(with_v(mosaic), *specs) == shapes(with_v(triton), *specs) == [
        (a["y"].shape, BF), ((B * H, L // C, d, 2 * d), BF), ((B * H, 1, d, 2 * d), F32)]
    (line,) = mosaic_lines(lowered_text(with_v(mosaic), specs))
    assert line.count("output_operand_alias<") == 1


def test_walk_gates_are_the_triton_walks_gates():
    """The gate rows the walks read, formed in XLA: η, η c⁻, w, c per token and a per state row, against their
    float64 definitions with segment starts inside chunks."""
    rng = np.random.default_rng(0)
    BH, n, dk = 3, 2, 8
    L = n * C
    lg = -rng.uniform(0.0, 0.3, size=(BH, n, C))
    g = np.cumsum(lg, axis=-1)
    gp = g - lg
    run = np.cumsum(rng.random((BH, n, C)) < 0.05, axis=-1)
    rl = run - run[..., :1]
    eta = rng.uniform(0.1, 2.0, size=(BH, L))
    flat = lambda a: jnp.asarray(np.reshape(a, (BH, L)), F32)  # noqa: E731
    eta_r, ec, w, c, a = walks.walk_gates(flat(eta), flat(g), flat(gp), jnp.asarray(rl.reshape(BH, L)), C, dk)
    first, last_run = rl == 0, rl == rl[..., -1:]
    want = {"eta c-": eta.reshape(BH, n, C) * np.where(first, np.exp(gp), 0.0),
            "w": np.where(last_run, np.exp(g[..., -1:] - g), 0.0), "c": np.where(first, np.exp(g), 0.0)}
    np.testing.assert_allclose(np.asarray(eta_r), eta.reshape(BH, L), rtol=1e-6)
    for (name, expect), got in zip(want.items(), (ec, w, c)):
        np.testing.assert_allclose(np.asarray(got).reshape(BH, n, C), expect, rtol=1e-5, atol=1e-7, err_msg=name)
    want_a = np.where(rl[..., -1] == 0, np.exp(g[..., -1]), 0.0)
    np.testing.assert_allclose(np.asarray(a).reshape(BH, n, dk), np.repeat(want_a[..., None], dk, -1), rtol=1e-5,
                               atol=1e-7)
    assert np.any(want["w"] == 0.0) and np.any(want["c"] == 0.0)  # segment starts inside chunks


# ---- which passes the op runs -------------------------------------------------------------------------------

WIDE = KernelConfig(fill_programs=1, pieces_below=1, block_v=64, split_block_v=64)  # the Mosaic walks' width


def op_kernels(monkeypatch, dtype=BF, config=WIDE, implementation="mosaic_gpu", pieces=None, B=1, T=256, H=2,
               D=128, lower=False):
    """The kernels Falcon-1's call of the op (keys one row back, ``[B, T, H, D]`` in place) runs forward and
    backward on a Hopper GPU, by name; with ``lower`` also its text lowered for CUDA."""
    on_backend(monkeypatch, "gpu")
    monkeypatch.setattr(common, "on_hopper", lambda: True)
    run = jnp.zeros((B, T, H), jnp.int32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation=implementation, layout="BTHD",
                                  shifted_keys=True, config=config, pieces=pieces)
        return jnp.sum(o.astype(F32)) + jnp.sum(s)

    specs = [S((B, T, H, D), dtype)] * 3 + [S((B, T, H), F32)] * 2 + [S((B, H, D, D), F32)]
    fn = jax.value_and_grad(loss, argnums=tuple(range(6)))
    names = [n.removeprefix("falcon_delta_") for n in pallas_calls(fn, *(jnp.zeros(s.shape, s.dtype) for s in specs))
             if not n.startswith("gate_transpose")]
    return (names, lowered_text(fn, specs)) if lower else names


def test_op_runs_the_mosaic_passes_where_they_serve(monkeypatch):
    """bf16 with 64-column walks in one piece: the forward's output walk, the backward's recompute walk, V's
    preparation and the reverse walk are the Mosaic GPU kernels (the reverse walk forms the q-term itself: prepare
    writes V alone); the triangular inverse, the masked scores and the chunk gradients stay Triton.  The whole
    forward + backward lowers for CUDA."""
    names, text = op_kernels(monkeypatch, lower=True)
    assert names == ["tri_inverse", "masked_scores", "walk_mgpu", "tri_inverse", "walk_mgpu", "dstate_prepare_mgpu",
                     "dstate_walk_mgpu", "chunk_grads"]
    assert [line.count("output_operand_alias<") for line in mosaic_lines(text)] == [0, 0, 0, 1]


@pytest.mark.parametrize("case,kw,want", [
    ("fp32", dict(dtype=F32), ["tri_inverse", "masked_scores", "fwd", "tri_inverse", "fwd", "dstate_prepare",
                               "dstate_walk", "chunk_grads"]),
    ("32-column walks", dict(config=KernelConfig(fill_programs=1, pieces_below=1, block_v=32, split_block_v=32)),
     ["tri_inverse", "masked_scores", "fwd", "tri_inverse", "fwd", "dstate_prepare_mgpu", "dstate_walk",
      "chunk_grads"]),
    ("fp32 walk operands", dict(config=KernelConfig(fill_programs=1, pieces_below=1, block_v=64, split_block_v=64,
                                                    walk_operands="fp32")),
     ["tri_inverse", "masked_scores", "fwd", "tri_inverse", "fwd", "dstate_prepare", "dstate_walk", "chunk_grads"]),
    ("pieces", dict(pieces=2), ["tri_inverse", "prepare_wu", "piece_maps", "masked_scores", "fwd", "tri_inverse",
                                "fwd", "dstate_prepare_mgpu", "dstate_walk", "dstate_walk", "chunk_grads"]),
    ("triton", dict(implementation="triton"), ["tri_inverse", "masked_scores", "fwd", "tri_inverse", "fwd",
                                               "dstate_prepare", "dstate_walk", "chunk_grads"]),
])
def test_op_hands_what_the_mosaic_passes_refuse_to_triton(monkeypatch, case, kw, want):
    """fp32 inputs and fp32 walk operands (wgmma would round to TF32 / the products would differ): every pass
    Triton; 32-column walks: the Triton walks, the Mosaic preparation; pieces: the Triton walks per piece;
    ``"triton"``: no Mosaic pass at all."""
    assert op_kernels(monkeypatch, **kw) == want, case
