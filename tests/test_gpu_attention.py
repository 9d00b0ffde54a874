"""The softmax layers' Pallas flash attention (``falcon_jax.kernels.flash_attention``) on its real GPU lowering.

Marked ``gpu`` and skipped without a GPU; on a GPU machine ``python -m pytest -m gpu tests/test_gpu_attention.py``.
(The CPU suite runs the kernel in Pallas's interpret mode and cross-lowers it: that checks its program, not the GPU
compiler's lowering of it.)  Packed rows with one-token segments at 0 and at T − 1, T off the block size:

* outputs and the gradients of q, k, v in bf16 (d = 64, 128) and fp32 (d = 64), each against float64 on the same
  inputs (on the host CPU), within ``ERROR_MULTIPLE`` times the error of the XLA masked attention
  (``jax.nn.dot_product_attention(mask=..., implementation="xla")``) on the same GPU and inputs;
* memory: the compiled forward+backward at 1 × 32768 holds no T × T array (temporaries a small multiple of q);
* the layer: ``SoftmaxAttention(attn_impl="auto")`` in bf16 compiles to the Triton kernels with segment ids and
  to cuDNN without, and its packed output equals ``attn_impl="xla"``'s within bf16 error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from falcon_jax.kernels.flash_attention import flash_attention
from falcon_jax.nn import SoftmaxAttention
from tests.helpers import rel_err

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs a GPU: checks the flash attention's real GPU lowering "
                                 "(run `python -m pytest -m gpu tests/test_gpu_attention.py` on a GPU machine)")]

HOST = jax.devices("cpu")[0]
# both attentions compute from the same rounded inputs; the kernel's score and output products round p to the
# input dtype (bf16) or run in TF32 (fp32), as XLA's GPU dots do at default precision
ERROR_MULTIPLE = 2.5


def packed_ids(rng, B, T):
    ids = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = [1, T - 1] if b == 0 else []
        cuts += sorted(rng.choice(np.arange(2, T - 1), size=5, replace=False).tolist())
        for c in cuts:
            ids[b, c:] += 1
    return jnp.asarray(ids)


def reference(q, k, v, segment_ids, scale):
    """Causal softmax attention within segments, from the equation (the dtype of q)."""
    T = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    allowed = jnp.tril(jnp.ones((T, T), bool))[None, None] & (segment_ids[:, None, :, None] ==
                                                              segment_ids[:, None, None, :])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1), v)


def xla_masked(q, k, v, segment_ids):
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def value_and_grads(fn, q, k, v, ct):
    def loss(q, k, v):
        o = fn(q, k, v)
        return jnp.sum(o.astype(ct.dtype) * ct), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [o, *grads]


@pytest.mark.parametrize("dtype,d", [("bfloat16", 64), ("bfloat16", 128), ("float32", 64)])
def test_values_and_gradients_within_the_xla_masked_attention_error(rng, dtype, d):
    B, T, H = 2, 2000, 4
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, d)), dtype) for _ in range(3))
    ct = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32)
    seg = packed_ids(rng, B, T)
    got = value_and_grads(lambda q, k, v: flash_attention(q, k, v, seg), q, k, v, ct)
    xla = value_and_grads(lambda q, k, v: xla_masked(q, k, v, seg), q, k, v, ct)
    host = jax.device_put([a.astype(jnp.float64) for a in (q, k, v)] + [seg, ct.astype(jnp.float64)], HOST)
    exact = value_and_grads(lambda q, k, v: reference(q, k, v, host[3], d ** -0.5), *host[:3], host[4])
    for name, g, x, w in zip(("o", "dq", "dk", "dv"), got, xla, exact, strict=True):
        g, x, w = (np.asarray(a, np.float64) for a in (g, x, w))
        assert np.all(np.isfinite(g)), name
        err, xla_err = rel_err(g, w), rel_err(x, w)
        assert err <= ERROR_MULTIPLE * xla_err, f"{name}: flash {err:.2e} vs XLA {xla_err:.2e} ({dtype}, d={d})"


def test_forward_and_backward_hold_no_t_by_t_array(rng):
    """1 × 32768, 4 heads of 64, bf16, packed: a T × T bool mask alone would be 1 GiB, the scores 16 GiB; the
    compiled forward+backward's temporaries stay within 32 times q (512 MiB), and it runs to finite gradients."""
    B, T, H, d = 1, 32768, 4, 64
    seg = packed_ids(rng, B, T)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, seg).astype(jnp.float32) ** 2)

    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.bfloat16) for _ in range(3))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 32 * q.nbytes, f"temporaries {temp / 2**20:.0f} MiB for q of {q.nbytes / 2**20:.0f} MiB"
    grads = compiled(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_layer_auto_compiles_to_the_flash_attention_when_packed_and_to_cudnn_when_not(rng):
    D, H, T = 256, 4, 2048
    graphdef, state = nnx.split(SoftmaxAttention(D, H, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    xla_graphdef, _ = nnx.split(SoftmaxAttention(D, H, dtype=jnp.bfloat16, attn_impl="xla", rngs=nnx.Rngs(0)))
    h = jnp.asarray(rng.standard_normal((2, T, D)), jnp.bfloat16)
    seg = packed_ids(rng, 2, T)
    run = jax.jit(lambda s, h, seg: nnx.merge(graphdef, s)(h, segment_ids=seg))
    packed_hlo = run.lower(state, h, seg).compile().as_text()
    assert "__gpu$xla.gpu.triton" in packed_hlo and "__cudnn$" not in packed_hlo
    single_hlo = jax.jit(lambda s, h: nnx.merge(graphdef, s)(h)).lower(state, h).compile().as_text()
    assert "__cudnn$" in single_hlo and "__gpu$xla.gpu.triton" not in single_hlo
    got = run(state, h, seg)
    want = jax.jit(lambda s, h, seg: nnx.merge(xla_graphdef, s)(h, segment_ids=seg))(state, h, seg)
    assert rel_err(np.asarray(got, np.float64), np.asarray(want, np.float64)) < 2e-2
