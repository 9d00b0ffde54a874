"""The decayed-attention Pallas kernels (GPU Triton and TPU Mosaic lowerings) in interpret mode on CPU.

Ground truth: the op's O(T²) definition (``reference.py``) in float64; the
kernels accumulate in fp32, so bounds are fp32-sized.  Every kernel call here
runs with poisoned (NaN) outputs, so an element a kernel does not write fails
the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import decayed_linear_attention, falcon
from falcon_jax.kernels.decayed_attention import decayed_attention
from falcon_jax.kernels.decayed_attention.api import KernelConfig
from falcon_jax.kernels.decayed_attention.pallas_gpu import poisoned_outputs
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference
from tests.helpers import assert_pallas_matches_xla_chunk_form, bf16_gradient_errors, time_major

FP32_TOL = 2e-5


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def op_inputs(rng, B=1, H=2, T=37, dk=16, dv=32, segments=False, decay_range=(0.0, 0.3)):
    q = rng.normal(size=(B, H, T, dk))
    x = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(B, H, T, dv))
    log_decay = -rng.uniform(*decay_range, size=(B, H, T))
    if segments:
        starts = rng.uniform(size=(B, 1, T)) < 0.08
        starts[..., 0] = False
        run = np.broadcast_to(np.cumsum(starts, axis=-1), (B, H, T))
    else:
        run = np.zeros((B, H, T), np.int64)
    s0 = rng.normal(size=(B, H, dk, dv))
    return q, x, y, log_decay, jnp.asarray(run, jnp.int32), s0


def kernel(q, x, y, log_decay, run, s0, implementation="pallas_gpu", **kw):
    """GPU kernels under poisoned outputs; TPU interpret mode fills unwritten memory with NaN itself."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    if implementation == "pallas_tpu":
        kw.pop("pieces", None)
    with poisoned_outputs():
        return decayed_attention(f32(q), f32(x), f32(y), f32(log_decay), run, f32(s0), chunk_size=16,
                                 implementation=implementation, **kw)


IMPLEMENTATIONS = ["pallas_gpu", "pallas_tpu"]


@pytest.mark.parametrize("T,pieces,segments,implementation", [
    (1, 1, False, "pallas_gpu"), (16, 1, True, "pallas_gpu"), (37, 1, True, "pallas_gpu"),
    (100, 2, False, "pallas_gpu"), (100, 4, True, "pallas_gpu"),
    (1, 1, False, "pallas_tpu"), (37, 1, True, "pallas_tpu"), (100, 1, False, "pallas_tpu"),
])
def test_forward_matches_reference(T, pieces, segments, implementation):
    rng = np.random.default_rng(T * 10 + pieces + 100 * segments)
    q, x, y, log_decay, run, s0 = op_inputs(rng, T=T, segments=segments)
    o, final = kernel(q, x, y, log_decay, run, s0, pieces=pieces, implementation=implementation)
    o_ref, final_ref = decayed_attention_reference(*(jnp.asarray(a) for a in (q, x, y, log_decay)), run, jnp.asarray(s0))
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("pieces,segments,block_v,implementation,extra", [
    (1, False, 32, "pallas_gpu", {}), (2, True, 32, "pallas_gpu", {}), (4, True, 16, "pallas_gpu", {}),
    (2, True, 16, "pallas_gpu", {"grad_loops": "fori", "grad_stages": 2}), (1, True, 32, "pallas_tpu", {})])
def test_gradients_match_reference(pieces, segments, block_v, implementation, extra):
    """Gradients w.r.t. q, x, y, log decay and S0 vs float64; value blocks of 16 or 32 (dv = 32), the chunk
    gradients' value loop unrolled or a ``lax.fori_loop`` (``grad_loops="fori"``, two blocks)."""
    rng = np.random.default_rng(7 + pieces)
    q, x, y, log_decay, run, s0 = op_inputs(rng, T=70, segments=segments)
    ct_o = jnp.asarray(rng.normal(size=y.shape))
    ct_s = jnp.asarray(rng.normal(size=s0.shape))

    def loss(fn):
        def f(q, x, y, log_decay, s0):
            o, s = fn(q, x, y, log_decay, run, s0)
            return jnp.sum(o * ct_o.astype(o.dtype)) + jnp.sum(s * ct_s.astype(s.dtype))
        return f

    got = jax.grad(loss(lambda *a: kernel(*a, pieces=pieces, config=KernelConfig(block_v=block_v, **extra),
                                          implementation=implementation)),
                   argnums=(0, 1, 2, 3, 4))(*(jnp.asarray(a, jnp.float32) for a in (q, x, y, log_decay, s0)))
    want = jax.grad(loss(decayed_attention_reference), argnums=(0, 1, 2, 3, 4))(
        *(jnp.asarray(a) for a in (q, x, y, log_decay, s0)))
    for name, g, w in zip(["q", "x", "y", "log_decay", "initial_state"], got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, w) < 5e-5, name


@pytest.mark.parametrize("T,pieces,segments,implementation", [
    (37, 1, True, "pallas_gpu"), (100, 4, True, "pallas_gpu"), (64, 2, False, "pallas_gpu"),
    (37, 1, True, "pallas_tpu"), (37, 1, True, "xla")])
def test_time_major_layout_matches_reference(T, pieces, segments, implementation):
    """``layout="BTHD"``: the Triton kernels read [B, T, H, d] in place (other implementations transpose);
    values, final state and gradients equal the float64 reference, every output element written."""
    rng = np.random.default_rng(3 * T + pieces)
    q, x, y, log_decay, run, s0 = op_inputs(rng, B=2, H=3, T=T, segments=segments)
    ct_o = jnp.asarray(rng.normal(size=y.shape))
    kw = dict(pieces=pieces, layout="BTHD") if implementation != "pallas_tpu" else dict(layout="BTHD")

    def loss_tm(q, x, y, log_decay, s0):  # the op in BTHD, the cotangent transposed to match
        if implementation == "xla":
            o, s = decayed_attention(q, x, y, log_decay, time_major(run), s0, implementation="xla", layout="BTHD")
        else:
            o, s = kernel(q, x, y, log_decay, time_major(run), s0, implementation=implementation, **kw)
        assert o.shape == (2, T, 3, y.shape[-1])
        return jnp.sum(o * time_major(ct_o).astype(o.dtype)) + jnp.sum(s), (o, s)

    def loss_ref(q, x, y, log_decay, s0):
        o, s = decayed_attention_reference(q, x, y, log_decay, run, s0)
        return jnp.sum(o * ct_o) + jnp.sum(s), (o, s)

    args32 = [jnp.asarray(time_major(a), jnp.float32) for a in (q, x, y, log_decay)] + [jnp.asarray(s0, jnp.float32)]
    (_, (o, s)), got = jax.value_and_grad(loss_tm, argnums=(0, 1, 2, 3, 4), has_aux=True)(*args32)
    (_, (o_ref, s_ref)), want = jax.value_and_grad(loss_ref, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        *(jnp.asarray(a) for a in (q, x, y, log_decay, s0)))
    assert rel_err(o, time_major(o_ref)) < FP32_TOL
    assert rel_err(s, s_ref) < FP32_TOL
    for name, g, w in zip(["q", "x", "y", "log_decay"], got[:4], want[:4]):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, time_major(w)) < 5e-5, name
    assert rel_err(got[4], want[4]) < 5e-5


def test_layout_is_validated():
    rng = np.random.default_rng(0)
    q, x, y, log_decay, run, s0 = op_inputs(rng, T=16)
    with pytest.raises(ValueError, match="layout"):
        decayed_attention(*(jnp.asarray(a, jnp.float32) for a in (q, x, y, log_decay)), run, jnp.asarray(s0),
                          layout="TBHD")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_extreme_decays_stay_finite_and_exact(implementation):
    """γ at the clamp (log γ = log 1e-6 ≈ −13.8) and γ = 1 in one sequence."""
    rng = np.random.default_rng(3)
    q, x, y, _, run, s0 = op_inputs(rng, T=64)
    log_decay = np.where(rng.uniform(size=(1, 2, 64)) < 0.5, np.log1p(-(1 - 1e-6)), 0.0)
    o, final = kernel(q, x, y, log_decay, run, s0, implementation=implementation)
    o_ref, final_ref = decayed_attention_reference(*(jnp.asarray(a) for a in (q, x, y, log_decay)), run, jnp.asarray(s0))
    assert np.all(np.isfinite(np.asarray(o)))
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(final, final_ref) < FP32_TOL


def falcon_inputs(rng, B=2, T=45, H=2, dk=16, dv=32):
    q = rng.normal(size=(B, T, H, dk))
    k = rng.normal(size=(B, T, H, dk)) / 4
    v = rng.normal(size=(B, T, H, dv))
    beta = rng.uniform(0.05, 1.95, size=(B, T, H))
    lam = rng.uniform(0, 1, size=(B, T, H))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, beta, lam)]


@pytest.mark.parametrize("variant,options", [
    pytest.param("1A", {}, marks=pytest.mark.slow), ("1A", {"timing": "rbw", "alignment": "same_step"}),
    pytest.param("1A", {"scale_coupled": True}, marks=pytest.mark.slow), ("1A", {"segments": True, "timing": "rbw"}),
    ("3A", {"segments": True}), ("3A", {"timing": "rbw", "alignment": "same_step", "clamp": True}),
    pytest.param("3A", {"window": 2, "timing": "rbw", "segments": True}, marks=pytest.mark.slow),
])
def test_falcon_pallas_equals_xla_chunk_form(variant, options):
    """Falcon-1A and 3A (window pairs handed to the kernel with summed coefficients plus a banded
    correction) against the XLA chunk form, continuing from a non-trivial state; ``clamp`` puts
    λ = 1e6 on a third of the steps so γ sits at its clamp."""
    rng = np.random.default_rng(len(str(options)) + len(variant))
    q, k, v, beta, lam = falcon_inputs(rng)
    options = dict(options)
    if options.pop("segments", False):
        options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, 45)), axis=1))
    if options.pop("clamp", False):
        lam = jnp.where(jnp.asarray(rng.uniform(size=lam.shape) < 0.3), 1e6, lam).astype(jnp.float32)
    kw = dict(variant=variant, chunk_size=16, return_final_state=True, **options)
    # continue from a non-trivial state so the initial-state path is exercised; the window tail too
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, True, rng, tol=FP32_TOL,
                                         same=("last_key", "tail_x", "tail_y", "tail_valid"))


def test_linear_attention_baseline_through_kernel():
    rng = np.random.default_rng(11)
    q, k, v, beta, _ = falcon_inputs(rng)
    log_decay = jnp.asarray(-rng.uniform(0, 0.5, size=beta.shape), jnp.float32)
    with poisoned_outputs():
        got = decayed_linear_attention(q, k, v, log_decay, beta, impl="pallas", chunk_size=16)
    want = decayed_linear_attention(q, k, v, log_decay, beta, impl="xla", chunk_size=16)
    assert rel_err(got, want) < FP32_TOL


def test_bf16_error_within_twice_the_xla_forms():
    """bf16 inputs: the kernel (bf16 matmuls, fp32 accumulation and state) against the fp64
    recurrence, bounded by twice the error of the XLA chunk form (fp32 compute on the same
    bf16 inputs)."""
    rng = np.random.default_rng(5)
    q, k, v, beta, lam = falcon_inputs(rng, T=64)
    exact = falcon(*(a.astype(jnp.float64) for a in (q, k, v, beta, lam)), variant="1A", form="recurrent")
    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)] + [beta, lam]
    err_kernel = rel_err(falcon(*bf, variant="1A", impl="pallas", chunk_size=16), exact)
    err_xla = rel_err(falcon(*bf, variant="1A", impl="xla", chunk_size=16), exact)
    assert err_kernel <= 2 * err_xla + 1e-3, (err_kernel, err_xla)


def test_bf16_gradients_within_twice_the_xla_forms():
    """bf16 inputs, backward: the kernel stores its per-chunk states and their gradients in bf16 and
    runs its matmuls on bf16 operands (fp32 accumulation), the XLA chunk form computes in fp32 from
    the same bf16 inputs; the kernel's gradient error against fp64 stays within 3× the XLA form's
    (measured 2.7× on these inputs, the same with fp32-stored states: the dots round them anyway)."""
    rng = np.random.default_rng(6)
    q, k, v, beta, lam = falcon_inputs(rng, T=80)
    ct = rng.normal(size=v.shape)
    for name, g_kernel, err_kernel, err_xla in bf16_gradient_errors(q, k, v, beta, lam, ct, variant="1A",
                                                                    chunk_size=16):
        assert np.all(np.isfinite(np.asarray(g_kernel, np.float64))), name
        assert err_kernel <= 3 * err_xla + 1e-3, (name, err_kernel, err_xla)


def test_rules_without_kernel_raise_or_fall_back():
    rng = np.random.default_rng(2)
    q, k, v, beta, lam = falcon_inputs(rng, T=20)
    with pytest.raises(NotImplementedError, match="impl='pallas'"):
        falcon(q, k, v, beta, lam, variant="3", window=32, impl="pallas")  # > 16 virtual writes per step
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon(q, k, v, beta, lam, variant="1A", impl="pallas", chunk_size=8)
    # on CPU "auto" is the XLA chunk form, exactly
    np.testing.assert_array_equal(falcon(q, k, v, beta, lam, variant="3", impl="auto"),
                                  falcon(q, k, v, beta, lam, variant="3", impl="xla"))


@pytest.mark.parametrize("layout,dtype,pieces", [("BTHD", jnp.bfloat16, 2), ("BTHD", jnp.float32, 1),
                                                 ("BHTD", jnp.bfloat16, 2)])
def test_triton_kernels_lower_in_both_layouts(layout, dtype, pieces):
    """Cross-lower forward + backward through the Triton lowering rules on CPU (no GPU needed), d = 128,
    chunk 64, H = 3 (the in-place [B, T, H, d] reads stride over the heads)."""
    B, H, T, D = 2, 3, 512, 128
    tok = (B, T, H, D) if layout == "BTHD" else (B, H, T, D)
    gate = (B, T, H) if layout == "BTHD" else (B, H, T)
    q = jnp.zeros(tok, dtype)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)
    run = jnp.zeros(gate, jnp.int32)

    def loss(q, x, y, log_decay, s0):
        o, s = decayed_attention(q, x, y, log_decay, run, s0, implementation="pallas_gpu", interpret=False,
                                 pieces=pieces, layout=layout)
        assert o.shape == tok
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(
        q, q, q, jnp.zeros(gate, jnp.float32), s0).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("fwd", "dstate", "chunk_grads"):
        assert f"falcon_decayed_attention_{name}" in text, name
    if layout == "BTHD":  # no transposes of the token arrays around the kernels
        assert "stablehlo.transpose" not in text or all(
            f"{B}x{T}x{H}x{D}" not in line for line in text.splitlines() if "stablehlo.transpose" in line)


@pytest.mark.parametrize("variant", ["1A", "3A"])
def test_falcon_kernel_path_in_both_layouts(variant, monkeypatch):
    """``falcon(impl="pallas")`` hands the kernels the [B, T, H, d] arrays in place by default; with
    ``PREFER_TIME_MAJOR`` off it transposes them to [B, H, T, d] first.  Both equal the XLA chunk form
    (outputs, state and its window tail, with segments and a continued state)."""
    from falcon_jax.forms import chunk_pallas

    rng = np.random.default_rng(21)
    q, k, v, beta, lam = falcon_inputs(rng)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, size=(2, 45)), axis=1))
    kw = dict(variant=variant, chunk_size=16, return_final_state=True, timing="rbw")
    _, state = falcon(q[:, :7], k[:, :7], v[:, :7], beta[:, :7], lam[:, :7], **kw)
    want, want_state = falcon(q, k, v, beta, lam, impl="xla", initial_state=state, segment_ids=seg, **kw)
    for prefer in (True, False):
        monkeypatch.setattr(chunk_pallas, "PREFER_TIME_MAJOR", prefer)
        with poisoned_outputs():
            got, got_state = falcon(q, k, v, beta, lam, impl="pallas", initial_state=state, segment_ids=seg, **kw)
        assert rel_err(got, want) < FP32_TOL, prefer
        assert rel_err(got_state.S, want_state.S) < FP32_TOL, prefer
        np.testing.assert_array_equal(got_state.tail_x, want_state.tail_x)
