"""Numerical robustness: extreme gates, zero keys, long sequences in fp32, bf16 accuracy,
and composition with jit / vmap / grad."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import falcon
from tests.helpers import (ALL_VARIANTS, FORMS, as_jnp, assert_close, jcall, make_initial_state, make_inputs,
                           make_segment_ids, rel_err, to_lib_state)
from tests.reference import reference_falcon

B, T, H, DK, DV = 2, 20, 2, 6, 5
CHUNK = 8


def _extreme_inputs(rng, variant, case):
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=DK, dv=DV)
    if case == "beta~0":
        beta = rng.uniform(0.0, 1e-8, size=beta.shape)
    elif case == "beta~2":
        beta = 2.0 - rng.uniform(0.0, 1e-7, size=beta.shape)
    elif case == "lam=1e6":
        # eta*lam ~ beta: alpha clamps at 1 - eps_gamma whenever beta > ~1 (decay ~1e-6 per step,
        # log-decay sums over a chunk of 8 reach ~ -110)
        lam = np.full(lam.shape, 1e6)
    elif case == "zero_keys":
        k = np.zeros_like(k)
    elif case == "some_zero_keys":
        k = np.where(rng.uniform(size=k.shape[:3] + (1,)) < 0.5, 0.0, k)
    elif case == "tiny_lam":
        lam = np.full(lam.shape, 1e-30)
    else:
        raise AssertionError(case)
    return q, k, v, beta, lam


EXTREME_CASES = ("beta~0", "beta~2", "lam=1e6", "zero_keys", "some_zero_keys", "tiny_lam")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_extreme_gates_finite_and_exact(rng, variant):
    """All forms stay finite and equal the reference (fp64, rel 1e-9) at extreme gates; the
    chunk form's gradients are finite; the fp32 chunk form stays finite and close."""
    seg = jnp.asarray(make_segment_ids(rng, B, T))
    opts = dict(variant=variant, window=3, chunk_size=CHUNK)

    def loss(q, k, v, beta, lam, w):
        return jnp.sum(w * falcon(q, k, v, beta, lam, form="chunk", segment_ids=seg, **opts))

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    for case in EXTREME_CASES:
        arrays = _extreme_inputs(rng, variant, case)
        ref, _ = reference_falcon(*arrays, segment_ids=np.asarray(seg), variant=variant, window=3)
        assert np.all(np.isfinite(ref))
        for form in FORMS:
            out = jcall(falcon, *as_jnp(*arrays), form=form, segment_ids=seg, **opts)
            assert_close(out, ref, 1e-9, f"{case}/{form}")
        out32 = jcall(falcon, *as_jnp(*arrays, dtype=jnp.float32), form="chunk", segment_ids=seg, **opts)
        assert out32.dtype == jnp.float32
        assert_close(out32, ref, 1e-4, f"{case}/chunk fp32")
        w = jnp.asarray(rng.standard_normal(ref.shape))
        grads = grad_fn(*as_jnp(*arrays), w)
        for name, g in zip(("q", "k", "v", "beta", "lam"), grads):
            assert np.all(np.isfinite(np.asarray(g))), f"{case}: d/d{name} not finite"


def test_zero_denominator_eps0(rng):
    """eps = 0, lam = 0 and zero keys make E + lam + eps = 0.  The paper (Eq. 3.4) sets eta := 0
    there; the rules do not say.  Acceptable: follow that convention, or reject eps = 0 with an
    error naming `eps`.  Not acceptable: silent NaN/inf (zero keys occur, e.g. in padding)."""
    q, k, v, beta, lam = make_inputs(rng, variant="1", B=B, T=T, H=H, dk=DK, dv=DV)
    k[:, 3:6] = 0.0
    k[1] = 0.0
    lam = np.zeros_like(lam)
    for variant in ("1", "1A"):
        ref, _ = reference_falcon(q, k, v, beta, lam, variant=variant, eps=0.0)
        assert np.all(np.isfinite(ref))
        try:
            out = jcall(falcon, *as_jnp(q, k, v, beta, lam), variant=variant, form="chunk", chunk_size=CHUNK,
                        eps=0.0)
        except ValueError as e:
            assert "eps" in str(e)
            continue
        assert_close(out, ref, 1e-10, f"{variant} eps=0 output")


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_long_sequence_fp32_chunk(rng, variant):
    """T = 16384 in fp32, chunk form (default chunk 64), one small head, packed segments and an
    initial state.  fp32 unit roundoff is 6e-8; the decayed recurrence is contractive, so errors
    do not grow with T (measured ~4e-6); the bound 1e-4 leaves 25x margin."""
    T_long = 16384
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=1, T=T_long, H=1, dk=8, dv=8)
    seg = np.zeros((1, T_long), np.int32)
    seg[0, 5000:] = 1
    seg[0, 12345:] = 2
    init = make_initial_state(rng, variant=variant, window=4, B=1, H=1, dk=8, dv=8)
    ref, ref_state = reference_falcon(q, k, v, beta, lam, variant=variant, segment_ids=seg, initial_state=init)
    init32 = to_lib_state({n: (a.astype(np.float32) if a.dtype == np.float64 else a) for n, a in init.items()})
    out, state = jcall(falcon, *as_jnp(q, k, v, beta, lam, dtype=jnp.float32), variant=variant, form="chunk",
                       segment_ids=jnp.asarray(seg), initial_state=init32, return_final_state=True)
    assert out.dtype == jnp.float32
    assert_close(out, ref, 1e-4, "fp32 T=16384 output")
    assert_close(state.S, ref_state["S"], 1e-4, "fp32 T=16384 final S")


# bf16: unit roundoff u = 2**-8 ~ 3.9e-3 (8 significand bits).  Rounding the inputs to bf16 perturbs
# the output by a few u (measured 1.0-1.7 u with an fp32 compute path), rounding the output adds
# at most u relative to the largest entry.  We allow 4u = 1.6e-2 against the fp64 reference on
# the original (unrounded) inputs: bf16 compute in the inner products would still pass, a wrong
# decay, clamp or window would not (those are O(1) errors).
BF16_BOUND = 4 * 2.0 ** -8


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_bf16_chunk_accuracy(rng, variant):
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=2, T=256, H=2, dk=16, dv=16)
    ref, _ = reference_falcon(q, k, v, beta, lam, variant=variant)
    out = jcall(falcon, *as_jnp(q, k, v, beta, lam, dtype=jnp.bfloat16), variant=variant, form="chunk")
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, BF16_BOUND, "bf16 chunk form")


@pytest.mark.parametrize("variant", ["2", "3A"])
def test_jit_vmap_grad_compose(rng, variant):
    """jit(vmap(falcon)) over an extra leading axis equals per-item results (and the reference);
    jit(grad(vmap)) equals per-item jit(grad)."""
    N, Tn = 2, 13
    arrays = [np.stack(x) for x in zip(*[make_inputs(rng, variant=variant, B=B, T=Tn, H=H, dk=DK, dv=DV)
                                          for _ in range(N)])]
    seg = np.stack([make_segment_ids(rng, B, Tn) for _ in range(N)])
    w = rng.standard_normal((N, B, Tn, H, DV))
    f = functools.partial(falcon, variant=variant, window=3, form="chunk", chunk_size=4)
    batched = jax.jit(jax.vmap(f))(*as_jnp(*arrays), segment_ids=jnp.asarray(seg))
    for n in range(N):
        ref, _ = reference_falcon(*(a[n] for a in arrays), variant=variant, window=3, segment_ids=seg[n])
        assert_close(batched[n], ref, 1e-10, f"vmap item {n}")

    def loss(q, k, v, beta, lam, seg, w):
        return jnp.sum(w * f(q, k, v, beta, lam, segment_ids=seg))

    g_batched = jax.jit(jax.grad(lambda *a: jnp.sum(jax.vmap(loss)(*a)), argnums=(0, 1, 3)))(
        *as_jnp(*arrays, seg, w))
    g_item = jax.jit(jax.grad(loss, argnums=(0, 1, 3)))
    for n in range(N):
        g_n = g_item(*as_jnp(*(a[n] for a in arrays), seg[n], w[n]))
        for gb, gn in zip(g_batched, g_n):
            assert np.max(np.abs(np.asarray(gn))) > 0
            assert rel_err(gb[n], gn) <= 1e-10


# C = 48 (padded to 64, six levels) marked slow: C = 5 runs the padding, C = 64 the six levels
@pytest.mark.parametrize("C", [1, 5, 16, pytest.param(48, marks=pytest.mark.slow), 64])
def test_unit_lower_inverse_matches_float64(rng, C):
    """The XLA forms' triangular inverse: ``(I + N)⁻¹`` for strictly lower N (a batch of 3, entries of size 1,
    so the inverse has entries far from 0 and 1; sizes not powers of two padded inside) equals numpy's in fp64."""
    from falcon_jax.kernels.common import unit_lower_inverse

    N = np.tril(rng.normal(size=(3, C, C)) / np.sqrt(C), -1)
    want = np.linalg.inv(np.eye(C) + N)
    got = np.asarray(unit_lower_inverse(jnp.asarray(N)))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", ["1", "3"])
def test_xla_chunk_gradient_makes_no_lapack_call(variant):
    """The XLA chunk form's gradient solves its triangular systems by matmuls: a batched LAPACK solve on the CPU
    waits on XLA's thread pool, and two of a gradient's solves running at once can hang a 2-core machine (jaxlib 0.10)."""
    z, g = jnp.zeros((1, 2, 40, 8)), jnp.full((1, 2, 40), 0.5)

    def loss(q):
        return falcon(q, z, z, g, g, variant=variant, window=3, form="chunk", chunk_size=16, impl="xla").sum()

    text = jax.jit(jax.grad(loss)).lower(z).as_text()
    assert "stablehlo.dot_general" in text
    assert "lapack" not in text
