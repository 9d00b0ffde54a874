"""``falcon_jax.kernels.flash_attention``: JAX's Pallas GPU flash attention with packed segments, in Pallas's
interpret mode on a CPU (x64 on, as in the whole suite), against a float64 masked softmax attention and against
the XLA masked attention the softmax layers run otherwise; the Triton lowering cross-lowered for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.flash_attention import MAX_HEAD_DIM, flash_attention, flash_attention_reason
from tests.helpers import make_segment_ids
from tests.kernels.helpers import FP32_TOL, GRAD_TOL, S, assert_matches, custom_call_lines, lowered_text, on_backend

KERNELS = ("mha_forward", "mha_preprocess_backward", "mha_backward")


def reference(q, k, v, segment_ids, scale):
    """o_t = Σ_{s ≤ t, seg(s) = seg(t)} softmax_s(scale q_t·k_s) v_s, from the equation (float64 in, float64 out)."""
    T = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    p = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def xla_masked(q, k, v, segment_ids):
    """The softmax layers' XLA path: ``jax.nn.dot_product_attention`` with a [B, 1, T, T] segment mask."""
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def packed_ids(rng, B, T):
    """Row 0: one-token segments at 0 and at T − 1 around random cuts; row 1: make_segment_ids' random layout
    (ids not from 0); row 2: one segment with a nonzero id."""
    seg = make_segment_ids(rng, B, T)
    ids = np.zeros(T, np.int32)
    for cut in (1, T // 3, T // 3 + 5, T - 1):
        ids[cut:] += 1
    seg[0] = ids
    seg[2] = 7
    return jnp.asarray(seg)


def loss_and_grads(fn, q, k, v, ct):
    def loss(q, k, v):
        o = fn(q, k, v)
        return jnp.sum(o * ct.astype(o.dtype)), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


@pytest.mark.parametrize("T,dk,dv", [(37, 16, 16), (133, 24, 8)])
def test_flash_attention_equals_masked_attention_values_and_gradients(rng, T, dk, dv):
    """Odd T (padded to one block of 64 / two of 128, backward blocks of 32), dk ≠ dv off powers of two (padded
    to 32): outputs and the gradients of q, k and v within the fp32 kernel tolerances of the float64 equation,
    and as close to the fp32 XLA masked attention (where dk = dv, which it needs)."""
    B, H = 3, 2
    q, k = (rng.standard_normal((B, T, H, dk)) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv))
    ct = jnp.asarray(rng.standard_normal((B, T, H, dv)))
    seg = packed_ids(rng, B, T)
    scale = dk ** -0.5
    f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v)]
    want, want_grads = loss_and_grads(lambda q, k, v: reference(q, k, v, seg, scale), *map(jnp.asarray, (q, k, v)),
                                      ct)
    got, got_grads = loss_and_grads(lambda q, k, v: flash_attention(q, k, v, seg), *f32, ct)
    assert got.dtype == jnp.float32
    assert_matches(got, want, FP32_TOL, "o")
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert_matches(g, w, GRAD_TOL, f"d{name}")
    if dk == dv:
        xla, xla_grads = loss_and_grads(lambda q, k, v: xla_masked(q, k, v, seg), *f32, ct)
        assert_matches(got, xla, FP32_TOL, "o against XLA")
        for name, g, w in zip("qkv", got_grads, xla_grads):
            assert_matches(g, w, GRAD_TOL, f"d{name} against XLA")
    # the segments matter: one id per row gives other outputs (the check can fail)
    leak = jax.jit(lambda q, k, v: flash_attention(q, k, v, jnp.zeros_like(seg)))(*f32)
    assert float(jnp.max(jnp.abs(leak[0] - got[0]))) > 1e-2


def test_flash_attention_without_segments_is_causal_attention(rng):
    B, T, H, d = 2, 50, 2, 16
    q, k, v = (rng.standard_normal((B, T, H, d)) for _ in range(3))
    want = reference(*map(jnp.asarray, (q, k, v)), None, 0.3)
    got = jax.jit(lambda q, k, v: flash_attention(q, k, v, scale=0.3))(*(jnp.asarray(a, jnp.float32)
                                                                           for a in (q, k, v)))
    assert_matches(got, want, FP32_TOL, "o")


def test_flash_attention_declines_and_rejects_with_the_reason():
    x = jnp.zeros((1, 8, 2, 16), jnp.float32)
    assert flash_attention_reason(x, x, x) is None
    wide = jnp.zeros((1, 8, 2, 2 * MAX_HEAD_DIM), jnp.float32)
    assert "pad to 256" in flash_attention_reason(wide, wide, wide)
    with pytest.raises(NotImplementedError, match="float64.*bf16, fp16 or fp32"):
        flash_attention(x.astype(jnp.float64), x, x)
    with pytest.raises(NotImplementedError, match="interpret=False off a GPU"):
        flash_attention(x, x, x, interpret=False)
    with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\]"):
        flash_attention(x, x, x, jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids must be integers"):
        flash_attention(x, x, x, jnp.zeros((1, 8), jnp.float32))
    with pytest.raises(ValueError, match="q, k must be"):
        flash_attention(x, x[:, :4], x)
    with pytest.raises(ValueError, match="backward_block=24 must be a power of two"):
        flash_attention(x, x, x, backward_block=24)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", np.ones(2)])
def test_flash_attention_refuses_a_scale_that_is_not_a_finite_number(scale):
    """A NaN or inf scale gave NaN outputs without an error; a string or an array reached ``float()`` inside."""
    x = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="`scale` must be a finite number"):
        flash_attention(x, x, x, scale=scale)


def test_flash_attention_argument_errors_name_the_argument(rng):
    """A traced scale (the kernel takes it as a constant) and a list of ids are refused naming them, not by a
    ConcretizationTypeError or an AttributeError from inside; NumPy ints are blocks like Python ints."""
    x = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="`scale` must be a concrete finite number"):
        jax.jit(lambda s: flash_attention(x, x, x, scale=s))(0.5)
    with pytest.raises(TypeError, match="`segment_ids` must be an array; got list"):
        flash_attention(x, x, x, [[0] * 8])
    q, k, v = (jnp.asarray(rng.normal(size=(1, 20, 2, 16)), jnp.float32) for _ in range(3))
    got = jax.jit(lambda q, k, v: flash_attention(q, k, v, block=np.int64(16), scale=np.float32(0.25)))(q, k, v)
    want = reference(*(a.astype(jnp.float64) for a in (q, k, v)), None, 0.25)
    assert_matches(got, want, FP32_TOL)


def test_flash_attention_lowers_for_cuda_forward_and_backward(monkeypatch):
    """bf16, T = 1000 (padded to 1024), d = 64, packed: the forward, the backward's preprocessing and the
    backward each lower through Pallas's Triton lowering (the GPU compile itself is tests/test_gpu_attention.py)."""
    on_backend(monkeypatch, "gpu")
    B, T, H, d = 2, 1000, 4, 64

    def loss(q, k, v, seg):
        return jnp.sum(flash_attention(q, k, v, seg).astype(jnp.float32) ** 2)

    tok = S((B, T, H, d), jnp.bfloat16)
    text = lowered_text(jax.grad(loss, argnums=(0, 1, 2)), [tok, tok, tok, S((B, T), jnp.int32)])
    for name in KERNELS:
        assert len(custom_call_lines(text, name)) == 1, name
