"""Falcon-3's window statistic: the window Gram and its top eigenvalue (``rules.window_gram``,
``forms.stream.window_grams``, ``rules.top_eigenvector_jacobi``, ``rules.window_lambda_max``) against float64
numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import rules
from falcon_jax.forms.stream import window_grams, write_stream
from falcon_jax.state import empty_state


def _windows(rng, kind, n, batch=400, d=16):
    """``[batch, n, d]`` window keys of one kind: the Grams a sliding window meets, easy and hard."""
    if kind == "random":
        return rng.normal(size=(batch, n, d)) * rng.uniform(0.1, 10, size=(batch, 1, 1))
    if kind == "partial":  # a window cut by a segment start: zero rows, repeated zero eigenvalues
        x = rng.normal(size=(batch, n, d))
        x[:, : rng.integers(1, n) if n > 1 else 0] = 0
        return x
    if kind == "parallel":  # nearly parallel keys: one dominant eigenvalue, the rest ~1e-12 of it
        return np.repeat(rng.normal(size=(batch, 1, d)), n, axis=1) + 1e-6 * rng.normal(size=(batch, n, d))
    if kind == "close":  # two nearly equal top eigenvalues (orthogonal keys of close norms)
        q, _ = np.linalg.qr(rng.normal(size=(batch, d, n)))
        scale = np.ones(n)
        scale[0] = 1 + 1e-7
        return np.swapaxes(q, 1, 2) * scale[:, None]
    if kind == "zero":  # an empty window
        return np.zeros((batch, n, d))
    raise ValueError(kind)


KINDS = ("random", "partial", "parallel", "close", "zero")
top_eigenvector = jax.jit(rules.top_eigenvector_jacobi, static_argnums=1)  # one compile per shape and dtype


# float64 at n = 8 compiles 8 sweeps of an 8 × 8 Jacobi in fp64 (~30 s on CI): slow; fp32 n = 8 always runs
@pytest.mark.parametrize("n,dtype,tol", [
    pytest.param(n, dtype, tol, marks=[pytest.mark.slow] if (n, dtype) == (8, np.float64) else [])
    for dtype, tol in [(np.float64, 1e-12), (np.float32, 2e-6)] for n in [1, 2, 3, 4, 5, 8]])
def test_jacobi_top_eigenvalue_matches_eigvalsh(rng, n, dtype, tol):
    for kind in KINDS:
        x = _windows(rng, kind, n)
        gram = np.einsum("bik,bjk->bij", x, x)
        ref = np.linalg.eigvalsh(gram)[:, -1]
        v = np.asarray(top_eigenvector(jnp.asarray(gram.astype(dtype))), np.float64)
        assert v.shape == (x.shape[0], n)
        np.testing.assert_allclose(np.linalg.norm(v, axis=-1), 1.0, atol=10 * np.finfo(dtype).eps, err_msg=kind)
        rayleigh = np.einsum("bi,bij,bj->b", v, gram, v)
        scale = np.maximum(ref, np.finfo(np.float64).tiny)
        assert np.max(np.abs(rayleigh - ref) / scale) <= tol, kind


@pytest.mark.parametrize("n", [3, 4, pytest.param(8, marks=pytest.mark.slow)])  # n = 8 compiles for 3-12 s
def test_jacobi_needs_its_sweeps(rng, n):
    """The sweep count matters: a single sweep leaves general Grams' top eigenvalue off (so the test above
    would see too few sweeps)."""
    x = _windows(rng, "random", n)
    gram = np.einsum("bik,bjk->bij", x, x)
    ref = np.linalg.eigvalsh(gram)[:, -1]
    v = np.asarray(top_eigenvector(jnp.asarray(gram), 1))
    assert np.max(np.abs(np.einsum("bi,bij,bj->b", v, gram, v) - ref) / ref) > 1e-6


@pytest.mark.parametrize("n", [1, 3, 4, 7])
def test_window_gram_is_exact_fp32(rng, n):
    x = rng.normal(size=(3, 7, n, 128)).astype(np.float32)
    gram = np.asarray(rules.window_gram(jnp.asarray(x)))
    assert gram.dtype == np.float32 and gram.shape == (3, 7, n, n)
    ref = np.einsum("...ik,...jk->...ij", x.astype(np.float64), x.astype(np.float64))
    np.testing.assert_allclose(gram, ref, rtol=2e-6, atol=1e-5)
    np.testing.assert_array_equal(gram, np.swapaxes(gram, -1, -2))  # x_i·x_j and x_j·x_i: the same products
    bf16 = rules.window_gram(jnp.asarray(x, jnp.bfloat16))
    assert bf16.dtype == jnp.float32  # bf16 keys: the Gram is still accumulated in fp32


@pytest.mark.parametrize("n", [4, 9])
def test_lambda_max_value_and_gradient(rng, n, monkeypatch):
    """``window_lambda_max`` on either eigenvector route (Jacobi up to JACOBI_MAX_WINDOW, eigh above): the value is
    the top eigenvalue and the gradient w.r.t. the window keys is ``2 v vᵀ X`` (simple top eigenvalue)."""
    x = _windows(rng, "random", n, batch=50)
    ref = np.linalg.eigvalsh(np.einsum("bik,bjk->bij", x, x))
    vecs = np.linalg.eigh(np.einsum("bik,bjk->bij", x, x))[1][..., -1]

    jacobi_calls = []

    def counted_jacobi(*args):
        jacobi_calls.append(args)
        return top_eigenvector_jacobi(*args)

    top_eigenvector_jacobi = rules.top_eigenvector_jacobi
    monkeypatch.setattr(rules, "top_eigenvector_jacobi", counted_jacobi)
    # eigh, then Jacobi where the library would take it (a 9 × 9 Jacobi only costs compile time: n = 9 uses eigh)
    for threshold in (0, 16) if n <= rules.JACOBI_MAX_WINDOW else (0,):
        monkeypatch.setattr(rules, "JACOBI_MAX_WINDOW", threshold)
        jacobi_calls.clear()

        def energy(x):  # a new function per threshold: jax.jit caches traces by function, across jit wrappers
            return rules.window_lambda_max(x)

        value = np.asarray(jax.jit(energy)(jnp.asarray(x)))
        assert bool(jacobi_calls) == (threshold >= n)  # the route under test is the one traced
        np.testing.assert_allclose(value, ref[:, -1], rtol=1e-12)
        grad = np.asarray(jax.grad(lambda x: jnp.sum(energy(x)))(jnp.asarray(x)))
        np.testing.assert_allclose(grad, 2 * vecs[..., :, None] * np.einsum("bj,bjk->bk", vecs, x)[:, None, :],
                                   rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("n", [1, 3, 4])  # the Jacobi route's n = 8 is checked above, on the eigenvector alone
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 4e-6)])
def test_window_lambda_max_matches_eigvalsh(rng, n, dtype, tol):
    """λmax on every kind of window (cut by a segment, empty, nearly parallel, nearly equal top
    eigenvalues) against float64 eigvalsh; the gradient is finite everywhere and zero for an empty window."""
    energy = jax.jit(rules.window_lambda_max)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(rules.window_lambda_max(x))))
    for kind in KINDS:
        x = _windows(rng, kind, n, batch=100)
        ref = np.linalg.eigvalsh(np.einsum("bik,bjk->bij", x, x))[:, -1]
        value = np.asarray(energy(jnp.asarray(x.astype(dtype))), np.float64)
        scale = np.maximum(ref, np.finfo(np.float64).tiny)
        assert np.max(np.abs(value - ref) / scale) <= tol, kind
        g = np.asarray(grad(jnp.asarray(x.astype(dtype))))
        assert np.all(np.isfinite(g)), kind
        if kind == "zero":
            assert not np.any(g), kind


def test_window_lambda_max_of_bf16_keys_is_fp32(rng):
    x = rng.normal(size=(5, 4, 64))
    value = rules.window_lambda_max(jnp.asarray(x, jnp.bfloat16))
    assert value.dtype == jnp.float32
    x16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)  # the rounded keys, exactly
    ref = np.linalg.eigvalsh(np.einsum("bik,bjk->bij", x16, x16))[:, -1]
    np.testing.assert_allclose(np.asarray(value), ref, rtol=4e-6)


def test_jacobi_rejects_a_non_square_gram():
    with pytest.raises(ValueError, match="square"):
        rules.top_eigenvector_jacobi(jnp.zeros((2, 3, 4)))


@pytest.mark.parametrize("W", [1, 2, 4, 5])
@pytest.mark.parametrize("time_axis", [1, 2])
def test_window_grams_of_the_stream_equal_each_windows_gram(rng, W, time_axis):
    """The lagged products give every window's Gram: ``gram[t, i, j] = x_ext[t+i]·x_ext[t+j]`` against float64
    products of the stacked windows, in either token layout (odd T, keys of mixed scale)."""
    B, H, T, d = 2, 3, 13, 16
    x = rng.normal(size=(B, T + W - 1, H, d)) * rng.uniform(0.1, 10, size=(B, T + W - 1, H, 1))
    windows = np.stack([x[:, i:i + T] for i in range(W)], axis=3)  # [B, T, H, W, d]
    ref = np.einsum("bthik,bthjk->bthij", windows, windows)
    x_in = x if time_axis == 1 else np.swapaxes(x, 1, 2)
    gram = np.asarray(window_grams(jnp.asarray(x_in, jnp.float32), W, T, time_axis), np.float64)
    if time_axis == 2:
        gram = np.swapaxes(gram, 1, 2)
    assert gram.shape == (B, T, H, W, W)
    np.testing.assert_allclose(gram, ref, rtol=2e-6, atol=1e-4)


@pytest.mark.parametrize("variant", ["3", "3A"])
def test_gates_of_a_sequence_stack_no_window_of_keys(variant):
    """The write stream's gates and their gradient never hold a ``[..., W, dk]`` array (every step's window of keys,
    W × the keys' memory): its Gram comes from lagged products.  The values and gradients are checked against the
    recurrence in tests/test_forms.py and tests/test_gradients.py; this guards the cost."""
    B, H, T, dk, dv, W = 2, 3, 16, 8, 4, 4
    rule = rules.falcon_rule(variant, window=W)
    state = empty_state(B, H, dk, dv, W - 1, jnp.float32)
    v = jnp.ones((B, H, T, dv))
    inputs = {"beta": jnp.ones((B, H, T)), "lam": jnp.full((B, H, T), 0.01)}

    def gates(k):
        stream = write_stream(rule, k, v, inputs, jnp.zeros((B, T), bool), state)
        return jnp.sum(stream.w) + jnp.sum(stream.log_gamma)

    jaxpr = jax.make_jaxpr(jax.grad(gates))(jnp.ones((B, H, T, dk)))
    shapes = set()

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.update(tuple(getattr(o.aval, "shape", ())) for o in eqn.outvars)
            for value in eqn.params.values():  # the bodies of scans, loops, custom derivatives, pjit
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        collect(sub)

    collect(jaxpr.jaxpr)
    stacked = [s for s in shapes if len(s) >= 2 and s[-2:] == (W, dk)]
    assert not stacked, f"a window of keys was stacked: {stacked}"
