"""The Mosaic GPU cluster walks of ``decayed_delta_rule`` (``mosaic_gpu_walks.forward_walk``), without a GPU.

Their values are checked on the H200 only (``benchmarks/gpu_check_mosaic_walks.py``: o, P, h and the end state
against a float64 walk of the same rounded inputs, next to the Triton walk, which the interpret-mode tests
cover).  Here: what they refuse, and that both forms of the step cross-lower for CUDA with the Triton walk's
output shapes and dtypes, for every output set, both token layouts, d 64 and 128 and each value-block width.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule, mosaic_gpu_walks, pallas_gpu
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig
from tests.helpers import mosaic_lowering_available

needs_lowering = pytest.mark.skipif(not mosaic_lowering_available(),
                                    reason="this jax cannot lower Mosaic GPU kernels for CUDA on CPU")
BF = jnp.bfloat16
S = jax.ShapeDtypeStruct
C = 64


def _walk_args(B, L, H, dk, dv, dtype=BF, t_dtype=None, in_place=True):
    """Zero q, x, y, η, g, g⁻, rl, T, s0, scores (``[B, L, H, d]`` tokens, or head-major)."""
    shape = (lambda d: (B, L, H, d)) if in_place else (lambda d: (B * H, L, d))
    q, x = jnp.zeros(shape(dk), dtype), jnp.zeros(shape(dk), dtype)
    y = jnp.zeros(shape(dv), dtype)
    rows = jnp.zeros((B * H, L), jnp.float32)
    tinv = jnp.zeros((B * H, L, C), t_dtype or dtype)
    s0 = jnp.zeros((B * H, 1, dk, dv), jnp.float32)
    return q, x, y, rows, rows, rows, jnp.zeros((B * H, L), jnp.int32), tinv, s0, tinv


WALK_KW = dict(chunk=C, heads=2, block_v=32, walk_operands=BF, write_o=True, write_p=False, write_h=False)


def _call(args, **change):
    kw = dict(WALK_KW, **change)
    *pos, scores = args
    return mosaic_gpu_walks.forward_walk(*pos, scores=scores, **kw)


@pytest.mark.parametrize("change,match", [
    (dict(chunk=32), "chunk_size=32"),
    (dict(walk_operands=None), "walk's operands in fp32"),
    (dict(walk_operands=jnp.float32), "walk's operands in fp32"),
    (dict(pieces=2), "pieces=2"),
    (dict(block_v=8), "block_v=8"),
    (dict(block_v=128), "block_v=128"),
    (dict(form="registers"), "form='registers' with block_v=32"),
])
def test_walk_refuses_calls_it_does_not_serve(change, match):
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        _call(_walk_args(1, 128, 2, 64, 64), **change)


@pytest.mark.parametrize("dk,dv,dtype,t_dtype,block_v,match", [
    (64, 64, jnp.float32, None, 32, "bf16 or fp16 only"),
    (32, 64, BF, None, 32, "dk=32"),
    (256, 64, BF, None, 32, "dk=256"),
    (64, 64, BF, jnp.float32, 32, "T stored in float32"),
    (64, 48, BF, None, 32, "block_v must divide dv"),
    (64, 256, BF, None, 16, "at most 8 CTAs"),  # 16 blocks of 16 columns: past the portable cluster
])
def test_walk_refuses_dtypes_and_widths(dk, dv, dtype, t_dtype, block_v, match):
    args = _walk_args(1, 128, 2, dk, dv, dtype=dtype, t_dtype=t_dtype)
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        _call(args, block_v=block_v, walk_operands=dtype)


def test_walk_needs_the_scores_for_outputs_and_a_known_form():
    *pos, _ = _walk_args(1, 128, 2, 64, 64)
    with pytest.raises(NotImplementedError, match="write_o reads the masked scores"):
        mosaic_gpu_walks.forward_walk(*pos, scores=None, **WALK_KW)
    with pytest.raises(ValueError, match="form must be 'smem' or 'registers'"):
        _call(_walk_args(1, 128, 2, 64, 64), form="shared")


def test_walk_gates_match_the_triton_walks_gates():
    """The gate rows formed in XLA are ``pallas_gpu._gates`` of the chunk-local g, g⁻ and run index, laid out
    per token (η, η c⁻, w, c) and per state row (a, repeated over dk)."""
    rng = np.random.default_rng()
    BH, n, dk = 3, 2, 8
    L = n * C
    lg = -rng.uniform(0.0, 0.3, size=(BH, n, C))
    g = np.cumsum(lg, axis=-1)
    gp = g - lg
    run = np.cumsum(rng.random((BH, n, C)) < 0.05, axis=-1)
    rl = run - run[..., :1]
    eta = rng.uniform(0.1, 2.0, size=(BH, L))
    f32 = lambda a: jnp.asarray(np.reshape(a, (BH, L)), jnp.float32)  # noqa: E731
    eta_r, ec, w, c, a = mosaic_gpu_walks.walk_gates(f32(eta), f32(g), f32(gp), jnp.asarray(rl.reshape(BH, L)),
                                                     C, dk)
    # the definitions, in float64
    first = rl == 0
    last_run = rl == rl[..., -1:]
    want_c = np.where(first, np.exp(g), 0.0)
    want_ec = eta.reshape(BH, n, C) * np.where(first, np.exp(gp), 0.0)
    want_w = np.where(last_run, np.exp(g[..., -1:] - g), 0.0)
    want_a = np.where(rl[..., -1] == 0, np.exp(g[..., -1]), 0.0)
    np.testing.assert_allclose(np.asarray(eta_r), eta.reshape(BH, L), rtol=1e-6)
    for got, want in ((ec, want_ec), (w, want_w), (c, want_c)):
        np.testing.assert_allclose(np.asarray(got).reshape(BH, n, C), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(a).reshape(BH, n, dk), np.repeat(want_a[..., None], dk, -1),
                               rtol=1e-5, atol=1e-7)
    assert np.any(want_w == 0.0) and np.any(want_c == 0.0)  # the draw has segment starts inside chunks


def _result_types(text):
    """``[(shape, dtype), ...]`` of the lowered Mosaic GPU custom call's results."""
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    results = line.rsplit("->", 1)[1]
    return [(tuple(int(n) for n in m.group(1).split("x")), m.group(2))
            for m in re.finditer(r"tensor<([\dx]+)x(bf16|f16|f32)>", results)]


def _lowered(fn, args):
    return jax.jit(fn).trace(*(S(a.shape, a.dtype) for a in args)).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
@pytest.mark.parametrize("form,block_v", [("smem", 16), ("smem", 32), ("smem", 64), ("registers", 64)])
@pytest.mark.parametrize("B,L,H,dk,dv,in_place", [
    (2, 256, 4, 128, 128, True),  # Falcon-1's call: [B, T, H, d] read in place
    (1, 64, 2, 64, 64, True),  # one chunk, d64
    (3, 320, 1, 128, 128, False),  # head-major, odd number of chunks
])
@pytest.mark.parametrize("walk", ["output", "recompute"])
@pytest.mark.parametrize("key_shift", [False, True])
def test_walk_lowers_with_the_triton_walks_outputs(form, block_v, B, L, H, dk, dv, in_place, walk, key_shift):
    """Both walks the op runs (the forward's o + end state; the backward's P + chunk states + end state), each
    form and width: the lowered kernel's results are the Triton walk's, in shape and dtype (the end state of
    the register form comes back transposed in XLA)."""
    args = _walk_args(B, L, H, dk, dv, in_place=in_place)
    outputs = walk == "output"
    kw = dict(WALK_KW, heads=H if in_place else None, block_v=block_v, write_o=outputs, write_p=not outputs,
              write_h=not outputs, key_shift=key_shift)

    def mosaic(*a):
        *pos, scores = a
        return mosaic_gpu_walks.forward_walk(*pos, scores=scores if outputs else None, form=form, **kw)

    def triton(*a):
        *pos, scores = a
        return pallas_gpu.forward_pass(*pos, scores=scores if outputs else None, pieces=1, interpret=False, **kw)

    text = _lowered(mosaic, args)
    assert "falcon_delta_walk_mgpu" in text
    got = jax.eval_shape(mosaic, *args)
    want = jax.eval_shape(triton, *args)
    assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
    n = L // C
    y_shape = args[2].shape
    kernel_results = [(y_shape, "bf16")] if outputs else [(y_shape, "bf16"), ((B * H, n * dk, dv), "bf16")]
    s_end = (B * H, dv, dk) if form == "registers" else (B * H, 1, dk, dv)
    assert _result_types(text) == kernel_results + [(s_end, "f32")]


def test_walks_config_is_validated():
    for value in ("auto", "triton", "mosaic"):
        assert KernelConfig(walks=value).walks == value
    with pytest.raises(ValueError, match="walks must be 'auto' or 'triton' or 'mosaic'"):
        KernelConfig(walks="cluster")


def _lowered_falcon1(config, dtype, grads: bool, B=2, T=256, H=2, D=128):
    """StableHLO text of Falcon-1's kernel call in one piece (keys one row back, read in place from
    ``[B, T, H, D]``), its forward or forward + backward, cross-lowered for CUDA with ``config``."""
    gate = jnp.zeros((B, T, H), jnp.float32)
    run = jnp.zeros((B, T, H), jnp.int32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", layout="BTHD",
                                  interpret=False, config=config, shifted_keys=True, pieces=1)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    fn = jax.grad(loss, argnums=tuple(range(6))) if grads else loss
    tokens = S((B, T, H, D), dtype)
    return jax.jit(fn).trace(tokens, tokens, tokens, S(gate.shape, gate.dtype), S(gate.shape, gate.dtype),
                             S((B, H, D, D), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
@pytest.mark.parametrize("grads", [False, True])
def test_op_takes_the_configured_walks(grads):
    """``walks="mosaic"`` runs the Mosaic GPU walks in Falcon-1's call (the forward's output walk; under grad
    also the backward's recompute walk) for bf16 and hands fp32 back to the Triton walks; "triton" and, off a
    Hopper GPU, "auto" keep the Triton walks."""
    def walks(text):
        return (text.count('name = "falcon_delta_fwd"'), "falcon_delta_walk_mgpu" in text)

    fused = dict(outputs="pallas")  # this small call would take the split forward
    mosaic = walks(_lowered_falcon1(KernelConfig(walks="mosaic", **fused), BF, grads))
    triton = walks(_lowered_falcon1(KernelConfig(walks="triton", **fused), BF, grads))
    assert mosaic == (0, True) and triton[0] >= 1 + grads and not triton[1]
    assert walks(_lowered_falcon1(KernelConfig(walks="mosaic", **fused), jnp.float32, grads)) == (triton[0], False)
    # "auto" (the default) off a Hopper GPU, even at 64 columns
    assert walks(_lowered_falcon1(KernelConfig(block_v=64, **fused), BF, grads)) == triton


@pytest.mark.parametrize("in_place", [True, False])
def test_gpu_check_reference_matches_the_triton_walk(in_place):
    """The float64 walk that ``benchmarks/gpu_check_mosaic_walks.py`` holds the Mosaic walks to agrees with the
    Triton walk in interpret mode (to bf16 rounding), segment starts inside chunks and keys one row back
    included; and a wrong initial state shows."""
    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_walks import as_keys, make_case, reference

    B, L, H, d = 1, 192, 2, 32
    inputs = make_case(np.random.default_rng(), B, L, H, d, d, segments=True, first_row_zero=True, interpret=True)
    o_ref, p_ref, h_ref, s_ref = reference(*inputs)
    q, x, y, *rest = inputs
    if not in_place:
        q, x, y = (jnp.swapaxes(a, 1, 2).reshape(B * H, L, d) for a in (q, x, y))
    heads = H if in_place else None
    kw = dict(chunk=C, heads=heads, block_v=16, walk_operands=BF, pieces=1, interpret=True, key_shift=True)
    o, _ = pallas_gpu.forward_pass(q, as_keys(x), y, *rest[:-1], scores=rest[-1], write_o=True, write_h=False,
                                   **kw)
    p, h, s_end = pallas_gpu.forward_pass(q, as_keys(x), y, *rest[:-1], write_o=False, write_h=True,
                                          write_p=True, **kw)

    def tokens(a):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        return np.swapaxes(a, 1, 2).reshape(B * H, L, -1) if in_place else a

    errs = [rel_err(tokens(o), o_ref), rel_err(tokens(p), p_ref), rel_err(h, h_ref), rel_err(s_end[:, 0], s_ref)]
    assert max(errs) < 2e-2, errs
    o_wrong, _, h_wrong, _ = reference(*inputs[:8], 0 * inputs[8], inputs[9])
    assert rel_err(h[:, 0], h_wrong[:, 0]) > 0.5 and rel_err(tokens(o), o_wrong) > 1e-2


@needs_lowering
def test_auto_takes_the_mosaic_walks_on_hopper_for_64_columns(monkeypatch):
    """On a Hopper GPU "auto" takes the Mosaic walks where the Triton walks would take 64 value columns (where
    they measured faster on the H200) and keeps the Triton walks at 16 and 32."""
    from falcon_jax.kernels.decayed_delta_rule import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "on_hopper", lambda: True)
    for block_v, mosaic in ((64, True), (32, False), (16, False)):
        text = _lowered_falcon1(KernelConfig(outputs="pallas", block_v=block_v), BF, grads=True)
        assert ("falcon_delta_walk_mgpu" in text) is mosaic, block_v
        assert (text.count('name = "falcon_delta_fwd"') == 0) is mosaic, block_v


def test_gpu_check_reverse_reference_matches_the_triton_walk():
    """The float64 split reverse walk that ``gpu_check_mosaic_walks.py`` holds the Mosaic reverse walk to agrees
    with the Triton reverse walk in interpret mode (keys one row back in place, segment starts inside chunks, V and
    the q-term given, B from T); and a wrong q-term shows."""
    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_walks import as_keys, make_case, reverse_reference

    rng = np.random.default_rng()
    B, L, H, d = 1, 192, 2, 32
    q, x, y, eta, g, gp, rl, tinv, s0, _ = make_case(rng, B, L, H, d, d, segments=True, first_row_zero=True,
                                                     interpret=True)
    q_term = jnp.asarray(rng.normal(size=(B * H, L // C, d, d)) / np.sqrt(d), BF)
    dr, dh, ds = pallas_gpu.state_grad_split_pass(
        q, as_keys(x), eta, g, gp, rl, tinv, y, s0, chunk=C, pieces=1, block_v=16, write_dh=True, interpret=True,
        vb=(y, None, q_term), write_dr=BF, b_from_t=True, walk_operands=BF, heads=H, key_shift=True)
    want = reverse_reference(x, eta, g, gp, rl, tinv, y, q_term, s0)
    dr = np.swapaxes(np.asarray(dr.astype(jnp.float32)), 1, 2).reshape(B * H, L, d)
    errs = [rel_err(dr, want[0]), rel_err(dh, want[1]), rel_err(ds[:, 0], want[2])]
    assert max(errs) < 2e-2, errs
    wrong = reverse_reference(x, eta, g, gp, rl, tinv, y, 0 * q_term, s0)
    assert rel_err(ds[:, 0], wrong[2]) > 0.1


def test_gpu_check_reverse_reference_with_the_q_term_formed_in_the_walk():
    """With the q-term formed in the walk (``vb[2] = None``), the float64 q-term the GPU check builds
    (``q_term_reference``: ``(c ⊙ Q)ᵀ dO`` per chunk, c zero after a segment start) and its reverse walk agree with
    the Triton walk in interpret mode, which forms it from q and dO; and dropping c's segment cut shows."""
    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_walks import as_keys, make_case, q_term_reference, reverse_reference

    rng = np.random.default_rng()
    B, L, H, d = 1, 192, 2, 32
    q, x, y, eta, g, gp, rl, tinv, s0, _ = make_case(rng, B, L, H, d, d, segments=True, first_row_zero=True,
                                                     interpret=True)
    do = jnp.asarray(rng.normal(size=(B, L, H, d)), BF)
    dr, dh, ds = pallas_gpu.state_grad_split_pass(
        q, as_keys(x), eta, g, gp, rl, tinv, do, s0, chunk=C, pieces=1, block_v=16, write_dh=True, interpret=True,
        vb=(y, None, None), write_dr=BF, b_from_t=True, walk_operands=BF, heads=H, key_shift=True)
    want = reverse_reference(x, eta, g, gp, rl, tinv, y, q_term_reference(q, do, g, rl), s0)
    dr = np.swapaxes(np.asarray(dr.astype(jnp.float32)), 1, 2).reshape(B * H, L, d)
    errs = [rel_err(dr, want[0]), rel_err(dh, want[1]), rel_err(ds[:, 0], want[2])]
    assert max(errs) < 2e-2, errs
    uncut = reverse_reference(x, eta, g, gp, jnp.zeros_like(rl), tinv, y, q_term_reference(q, do, g, 0 * rl), s0)
    assert rel_err(dh, uncut[1]) > 3 * max(errs)


def test_gpu_check_v_reference_matches_the_triton_prepare():
    """The float64 ``V = Tᵀ (QXᵀ ⊙ D)ᵀ dO`` the GPU check holds the walk that forms V to (``v_reference``) agrees
    with Triton's ``prepare_vb`` in interpret mode (keys one row back in place, segment starts inside chunks); and
    a V without the segment cut shows."""
    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_walks import as_keys, make_case, v_reference

    rng = np.random.default_rng()
    B, L, H, d = 2, 128, 2, 32
    q, x, y, eta, g, gp, rl, tinv, s0, _ = make_case(rng, B, L, H, d, d, segments=True, first_row_zero=True,
                                                     interpret=True)
    do = jnp.asarray(rng.normal(size=(B, L, H, d)), BF)
    v, _, _ = pallas_gpu.prepare_vb(q, as_keys(x), eta, g, gp, rl, tinv, do, chunk=C, interpret=True, heads=H,
                                    v_dtype=jnp.float32, with_b=False, walk_operands=BF, key_shift=True)
    got = np.swapaxes(np.asarray(v), 1, 2).reshape(B * H, L, d)
    err = rel_err(got, v_reference(q, x, do, g, rl, tinv))
    assert err < 2e-2, err
    assert rel_err(got, v_reference(q, x, do, g, 0 * rl, tinv)) > 3 * err


@pytest.mark.parametrize("change,match", [
    (dict(block_v=32), "block_v=32"),
    (dict(b_from_t=False), "B formed from T"),
    (dict(vb=(None, None, jnp.zeros((2, 2, 64, 64), BF))), "the walk forms both or neither"),
    (dict(write_dh=False), "dh written"),
    (dict(write_dr=jnp.float32), "dR stored in fp32"),
    (dict(pieces=2), "pieces=2"),
])
def test_reverse_walk_refuses_calls_it_does_not_serve(change, match):
    B, L, H, d = 1, 128, 2, 64
    tokens = jnp.zeros((B, L, H, d), BF)
    rows = jnp.zeros((B * H, L), jnp.float32)
    vb = (tokens, None, jnp.zeros((B * H, L // C, d, d), BF))
    kw = dict(dict(chunk=C, vb=vb, write_dr=BF, b_from_t=True, walk_operands=BF, heads=H, key_shift=True), **change)
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        mosaic_gpu_walks.reverse_walk(tokens, tokens, rows, rows, rows, rows.astype(jnp.int32),
                                      jnp.zeros((B * H, L, C), BF), tokens, jnp.zeros((B * H, 1, d, d)), **kw)


def test_reverse_walk_refuses_fp32_queries_for_the_q_term_it_forms():
    B, L, H, d = 1, 128, 2, 64
    tokens = jnp.zeros((B, L, H, d), BF)
    rows = jnp.zeros((B * H, L), jnp.float32)
    with pytest.raises(NotImplementedError, match="forming the q-term in the walk"):
        mosaic_gpu_walks.reverse_walk(tokens.astype(jnp.float32), tokens, rows, rows, rows, rows.astype(jnp.int32),
                                      jnp.zeros((B * H, L, C), BF), tokens, jnp.zeros((B * H, 1, d, d)), chunk=C,
                                      vb=(tokens, None, None), write_dr=BF, b_from_t=True, walk_operands=BF, heads=H)


@needs_lowering
@pytest.mark.parametrize("B,L,H,d,in_place", [(2, 256, 4, 128, True), (3, 320, 1, 128, False), (1, 64, 2, 64, True)])
def test_reverse_walk_lowers_with_the_triton_walks_outputs(B, L, H, d, in_place):
    """The Mosaic reverse walk cross-lowers for CUDA, writes dR and dh over V and the q-term (two aliased
    operands of one Mosaic GPU call) or, forming the q-term itself, dR over V (one), and returns the Triton walk's
    shapes and dtypes."""
    tok = S((B, L, H, d) if in_place else (B * H, L, d), BF)
    rows = S((B * H, L), jnp.float32)
    args = (tok, tok, rows, rows, rows, S((B * H, L), jnp.int32), S((B * H, L, C), BF), tok,
            S((B * H, 1, d, d), jnp.float32), tok, S((B * H, L // C, d, d), BF))

    def call(fn, given_v=True, given_q_term=True, **extra):
        def run(q, x, eta, g, gp, rl, t, do, ds_end, v, q_term):
            return fn(q, x, eta, g, gp, rl, t, do, ds_end, chunk=C, pieces=1, block_v=64, write_dh=True,
                      vb=(v if given_v else None, None, q_term if given_q_term else None), write_dr=BF, b_from_t=True, walk_operands=BF,
                      heads=H if in_place else None, key_shift=True, **extra)
        return run

    # without the q-term the walk forms it (dh its own output), without V too (dR its own output)
    for given_v, given_q_term, aliases in ((True, True, 2), (True, False, 1), (False, False, 0)):
        mosaic = call(mosaic_gpu_walks.reverse_walk, given_v=given_v, given_q_term=given_q_term)
        text = jax.jit(mosaic).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        (line,) = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln]
        assert line.count("output_operand_alias<") == aliases
        got = jax.eval_shape(mosaic, *args)
        want = jax.eval_shape(call(pallas_gpu.state_grad_split_pass, given_q_term=given_q_term, interpret=False),
                              *args)
        assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]


@needs_lowering
def test_op_backward_takes_the_mosaic_reverse_walk():
    """Under ``walks="mosaic"`` Falcon-1's backward runs the split reverse walk as the Mosaic GPU kernel (one
    Mosaic call with two aliased operands, no Triton ``falcon_delta_dstate_walk``); fp32 and "triton" keep the
    Triton walk."""
    def reverse(config, dtype=BF):
        text = _lowered_falcon1(config, dtype, grads=True)
        mosaic = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln
                  and ln.count("output_operand_alias<") == 2]
        return len(mosaic), text.count('name = "falcon_delta_dstate_walk"')

    kw = dict(outputs="pallas", dstate_q="prepare", split_block_v=64)
    assert reverse(KernelConfig(walks="mosaic", **kw)) == (1, 0)
    assert reverse(KernelConfig(walks="triton", **kw)) == (0, 1)
    assert reverse(KernelConfig(walks="mosaic", **kw), jnp.float32) == (0, 1)


@needs_lowering
def test_op_backward_forms_v_and_the_q_term_in_the_mosaic_reverse_walk():
    """Under "auto" the Mosaic reverse walk forms the q-term itself and reads V from prepare (dR over V: one alias;
    prepare writes V alone), even at the 256 programs where the Triton walk reads prepare's q-term.  With
    ``dstate_v="walk"`` it forms V too: no prepare pass runs and the walk aliases nothing (dR and dh its own
    outputs).  The Triton walks ("triton") read V and the q-term from prepare."""
    def lowered(**kw):  # B4 T128 H64 d128: 256 reverse-walk programs of 64 columns
        text = _lowered_falcon1(KernelConfig(outputs="pallas", split_block_v=64, **kw), BF, grads=True, B=4, T=128,
                                H=64)
        aliased = [ln.count("output_operand_alias<") for ln in text.splitlines()
                   if "custom_call @mosaic_gpu" in ln and "output_operand_alias<" in ln]
        prepare = [ln for ln in text.splitlines() if 'name = "falcon_delta_dstate_prepare"' in ln]
        # prepare's outputs: V [B, T, H, dv] and, when it forms it, the q-term [B·H, L/C, dk, dv]
        results = [ln.rsplit("->", 1)[1] for ln in prepare]
        return aliased, [(r.count("tensor<4x128x64x128xbf16>"), r.count("tensor<256x2x128x128xbf16>"))
                         for r in results]

    assert lowered(walks="mosaic") == ([1], [(1, 0)])
    assert lowered(walks="mosaic", dstate_v="walk") == ([], [])
    assert lowered(walks="triton") == ([], [(1, 1)])