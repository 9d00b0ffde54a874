"""Bad inputs to the rules and to generation: clear errors for concrete values, the rules' domain for
traced ones, and edge cases that would otherwise fail silently or with an unrelated error.

The rules' domain (docs/rules.md): β ∈ [0, 2] (normalized step; η ≥ 0 with step="direct"), λ ≥ 0,
window ≥ 1; the baselines: β ≥ 0, log_decay ≤ 0."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from falcon_jax import decayed_linear_attention, deltanet, falcon, falcon_step, init_state, testing
from falcon_jax.nn import FalconLM, LMConfig

B, T, H, DK, DV = 2, 16, 2, 4, 3


@pytest.fixture
def qkv():
    q, k, v, _, _ = testing.random_inputs(jax.random.key(7), batch=B, time=T, heads=H, dk=DK, dv=DV)
    return q, k, v


def full(value, shape=(B, T, H)):
    return jnp.full(shape, value, jnp.float32)


# --------------------------------------------------------------------------- concrete: ValueError
@pytest.mark.parametrize("beta, lam, step, named", [
    (-1.0, 0.1, "normalized", r"`beta` must be in \[0, 2\] \(the normalized step size\); got values in \[-1, -1\]"),
    (2.5, 0.1, "normalized", r"`beta` must be in \[0, 2\]"),
    (100.0, 0.1, "normalized", r"`beta` must be in \[0, 2\].*2 \* jax.nn.sigmoid"),
    (np.nan, 0.1, "normalized", r"`beta` must be finite and in \[0, 2\].*NaN or inf"),
    (0.5, -0.5, "normalized", r"`lam` must be >= 0 \(the ridge λ; λ < 0 makes the decay γ > 1.*softplus"),
    (0.5, np.inf, "normalized", r"`lam` must be finite"),
    (-0.1, 0.1, "direct", r"`beta` must be >= 0 \(the step size η with step='direct'\)"),
])
def test_gates_outside_the_domain_raise_naming_the_range(qkv, beta, lam, step, named):
    q, k, v = qkv
    for b, l_ in ((full(beta), full(lam)), (np.full((B, T, H), beta), np.full((B, T, H), lam))):
        with pytest.raises(ValueError, match=named):  # checked while tracing: nothing is compiled
            jax.eval_shape(lambda: falcon(q, k, v, b, l_, variant="1", step=step))
    state = init_state(B, H, DK, DK, variant="1")
    with pytest.raises(ValueError, match=named.replace("`beta`", "`beta_t`").replace("`lam`", "`lam_t`")):
        falcon_step(state, q[:, 0], k[:, 0], k[:, 0], full(beta, (B, H)), full(lam, (B, H)), variant="1", step=step)


def test_baseline_gates_outside_the_domain_raise(qkv):
    q, k, v = qkv
    negative, positive = full(-0.5), full(0.1)  # made here: inside eval_shape they would be traced
    with pytest.raises(ValueError, match=r"`beta` must be >= 0 \(the write gain\)"):
        jax.eval_shape(lambda: deltanet(q, k, v, negative))
    with pytest.raises(ValueError, match=r"`log_decay` must be <= 0"):
        jax.eval_shape(lambda: decayed_linear_attention(q, k, v, positive))


@pytest.mark.parametrize("variant", ["1", "3A"])
def test_traced_gates_are_clamped_into_the_domain(variant):
    """Under jit the values cannot be read: β = 10 runs as β = 2, λ = −0.99 as λ = 0, β = −3 as β = 0
    (unclamped they overflow to inf, then NaN, on long sequences), and the edge β = 2 is the float64 reference's."""
    T_ = 96
    q, k, v, _, _ = testing.random_inputs(jax.random.key(1), batch=1, time=T_, heads=1, dk=4, dv=2)
    run = jax.jit(lambda b, l_: falcon(q, k, v, b, l_, variant=variant, form="recurrent"))
    shape = (1, T_, 1)
    for bad, edge in (((10.0, 0.0), (2.0, 0.0)), ((1.0, -0.99), (1.0, 0.0)), ((-3.0, 0.5), (0.0, 0.5))):
        out = run(full(bad[0], shape), full(bad[1], shape))
        assert bool(jnp.all(jnp.isfinite(out)))
        np.testing.assert_array_equal(out, run(full(edge[0], shape), full(edge[1], shape)))
    testing.assert_matches_reference(q[:, :24], k[:, :24], v[:, :24], 2.0, 0.0, variant=variant, form="recurrent")


@pytest.mark.parametrize("variant", ["1", "1A"])
def test_an_eps_gamma_below_the_dtypes_resolution_keeps_gradients_finite(qkv, variant):
    """fp32, ε_γ = 1e-30 and λ = 1e6 with β > 1 (ηλ past the clamp): 1 − ε_γ rounds to 1 in fp32, and a cap of 1
    would give γ = 0, log γ = −inf and NaN gradients of k, β and λ through the clamp (0 · inf) in every form.  The cap
    is taken below 1 in the compute dtype: outputs and gradients finite, the outputs those of the float64 reference."""
    q, k, v = qkv
    beta, lam = full(1.5), full(1e6)
    loss = jax.jit(jax.grad(lambda *a: jnp.sum(falcon(*a, variant=variant, form="recurrent", eps_gamma=1e-30) ** 2),
                            argnums=(0, 1, 2, 3, 4)))
    for name, g in zip(("q", "k", "v", "beta", "lam"), loss(q, k, v, beta, lam)):
        assert bool(jnp.all(jnp.isfinite(g))), name
    testing.assert_matches_reference(q, k, v, beta, lam, variant=variant, form="recurrent", eps_gamma=1e-30)


def test_scalar_gates_broadcast(qkv):
    q, k, v = qkv
    run = jax.jit(lambda b, l_: falcon(q, k, v, b, l_, variant="1A", form="recurrent"))
    np.testing.assert_array_equal(jax.jit(lambda: falcon(q, k, v, 0.5, 0.1, variant="1A", form="recurrent"))(),
                                  run(full(0.5), full(0.1)))


# Falcon-1 in the parallel form (un-jitted, ~9 s) is marked slow: the parallel form is the chunk form's block() over
# the whole sequence, which Falcon-1's chunk case runs on its chunks, and 3A's parallel case runs the parallel form.
@pytest.mark.parametrize("variant,form", [pytest.param(v, f, marks=pytest.mark.slow) if (v, f) == ("1", "parallel")
                                          else (v, f) for v in ("1", "3A") for f in ("recurrent", "parallel", "chunk")])
def test_a_non_finite_key_reaches_its_own_row_only(qkv, form, variant):
    """q, k, v are not checked (docs/rules.md): a NaN key makes its row's later outputs NaN (in the chunk and
    parallel forms possibly any output of the row: their masks and resets multiply by 0, and 0 · NaN = NaN),
    but the other rows keep exactly the values of the clean call."""
    q, k, v = qkv
    seg = jnp.asarray(np.repeat([[0, 1]], B, axis=0).repeat(T // 2, axis=1), jnp.int32)
    run = lambda k: np.asarray(falcon(q, k, v, full(0.7), full(0.1), variant=variant, form=form, chunk_size=4,  # noqa: E731
                                      segment_ids=seg))
    clean, poisoned = run(k), run(k.at[0, 2, 0, 1].set(jnp.nan))
    np.testing.assert_array_equal(poisoned[1:], clean[1:])
    assert np.isfinite(clean).all() and np.isnan(poisoned[0, 3:T // 2]).any()
    if form == "recurrent":
        assert np.isfinite(poisoned[0, :2]).all()  # the positions before the NaN key


def test_empty_batch_or_heads_give_empty_results():
    """B = 0 or H = 0 is accepted by falcon, init_state and falcon_step alike: empty outputs in the dtype of q, k, v
    and states of the rule's layout (the case init_state must not refuse and falcon_step must not reshape into a
    ZeroDivisionError).  The head dims dk, dv stay >= 1 (see test_validation)."""
    for b, h in ((0, 2), (2, 0)):
        q = jnp.zeros((b, 8, h, DK))
        v = jnp.zeros((b, 8, h, DV))
        init = init_state(b, h, DK, DV, variant="3")
        testing.assert_state_layout(init, batch=b, heads=h, dk=DK, dv=DV, variant="3", dtype=jnp.float32)
        for form in ("chunk", "parallel", "recurrent"):
            for initial_state in (None, init):
                out, state = falcon(q, q, v, full(1.0, (b, 8, h)), full(0.1, (b, 8, h)), variant="3", form=form,
                                    initial_state=initial_state, return_final_state=True)
                assert out.shape == (b, 8, h, DV) and out.dtype == q.dtype
                testing.assert_state_layout(state, batch=b, heads=h, dk=DK, dv=DV, variant="3")
        o, state = falcon_step(init, q[:, 0], q[:, 0], v[:, 0], full(1.0, (b, h)), full(0.1, (b, h)), variant="3")
        assert o.shape == (b, h, DV) and o.dtype == q.dtype
        testing.assert_state_layout(state, batch=b, heads=h, dk=DK, dv=DV, variant="3")
    for name, index in (("batch", 0), ("heads", 1)):
        sizes = [B, H, DK, DV]
        sizes[index] = -1
        with pytest.raises(ValueError, match=rf"^init_state: `{name}` must be an int >= 0; got -1"):
            init_state(*sizes, variant="1")
    for name, index in (("dk", 2), ("dv", 3)):
        sizes = [B, H, DK, DV]
        sizes[index] = 0
        with pytest.raises(ValueError, match=rf"^init_state: `{name}` must be an int >= 1; got 0"):
            init_state(*sizes, variant="1")


def test_state_fields_of_the_wrong_dtype_are_named(qkv):
    q, k, v = qkv
    state = init_state(B, H, DK, DV, variant="1")
    for field, bad, named in (("S", state.S.astype(jnp.int32), r"`initial_state.S` must be a floating-point"),
                              ("has_key", state.has_key.astype(jnp.int32), r"`initial_state.has_key` must be a bool")):
        with pytest.raises(TypeError, match=named):
            jax.eval_shape(lambda: falcon(q, k, v, full(1.0), full(0.1), variant="1",
                                          initial_state=state.replace(**{field: bad})))


def test_window_far_above_t_is_capped_at_t(qkv):
    """W = 1000 at T = 12 is the program of W = 12 (uncapped, at T = 16, still compiling after 10 minutes): the
    same outputs, the lowered chunk form the same size, a final state with W − 1 tail slots that continues
    exactly like the float64 reference with window 1000."""
    T = 12  # (a window of at most 8 takes the Jacobi eigensolver, slower to compile)
    q, k, v = (a[:, :T] for a in qkv)
    beta, lam = full(1.0, (B, T, H)), full(0.1, (B, T, H))

    def run(window, form="parallel", variant="3"):
        return jax.jit(lambda *a: falcon(*a, variant=variant, window=window, form=form, return_final_state=True))

    # first the program sizes (an uncapped window would unroll 1000 slots here, in seconds, not compile them)
    sizes = [len(run(w, "chunk", "3A").lower(q, k, v, beta, lam).as_text()) for w in (T, 1000)]
    assert sizes[1] < 1.1 * sizes[0], sizes  # the window's unrolled work does not grow beyond T
    out_w, state_w = run(1000)(q, k, v, beta, lam)
    out_t, state_t = run(T)(q, k, v, beta, lam)
    np.testing.assert_array_equal(out_w, out_t)
    testing.assert_state_layout(state_w, batch=B, heads=H, dk=DK, dv=DV, variant="3", window=1000)
    np.testing.assert_array_equal(state_w.tail_x[:, :, -(T - 1):], state_t.tail_x)
    assert not bool(jnp.any(state_w.tail_valid[:, :-(T - 1)]))
    # continue with one decode step of window 1000 (Falcon-3A: no eigensolver over 1000 slots)
    o_a, s_a = jax.jit(lambda *a: falcon(*a, variant="3A", window=1000, form="chunk", chunk_size=8,
                                         return_final_state=True))(q, k, v, beta, lam)
    o_b, _ = falcon_step(s_a, q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], variant="3A", window=1000)
    from falcon_jax.reference import reference_falcon
    cat = [np.concatenate([np.asarray(a), np.asarray(a[:, :1])], axis=1) for a in (q, k, v, beta, lam)]
    want, _ = reference_falcon(*cat, variant="3A", window=1000)
    np.testing.assert_allclose(np.asarray(o_a), want[:, :T], rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(o_b), want[:, T], rtol=0, atol=1e-5 * np.abs(want).max())


# --------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def hybrid():
    """Falcon-3A (window 3, short convolutions) then softmax attention with a KV cache; a larger init so that
    greedy decoding does not settle on one token."""
    cfg = LMConfig(mixer="falcon-3A", vocab_size=32, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                   chunk_size=4, window=3, layer_mixers=("falcon-3A", "transformer"), init_std=0.5)
    return FalconLM(cfg, rngs=nnx.Rngs(3))


def test_token_ids_and_dtypes_are_checked(hybrid):
    toks = np.array([[1, 2, 3]], np.int32)
    with pytest.raises(TypeError, match="tokens must be integer token ids.*cast them with .astype"):
        hybrid.generate(toks.astype(np.float32), 2, greedy=True)
    for bad, got in ((toks + 31, "from 32 to 34"), (toks - 2, "from -1 to 1")):
        with pytest.raises(ValueError, match=rf"token ids must be in \[0, vocab_size=32\); got ids {got}"):
            hybrid.generate(bad, 2, greedy=True)
        with pytest.raises(ValueError, match=r"FalconLM: token ids must be in \[0, vocab_size=32\)"):
            hybrid(jnp.asarray(bad))
    with jax.enable_x64(False):  # the default: int64 ids become int32 on the way in, 2**40 -> 0, 2**32 + 3 -> 3
        for wide in (np.array([[1, 2**40]]), np.array([[1, 2**32 + 3]], np.int64)):
            with pytest.raises(ValueError, match=rf"got ids from 1 to {wide.max()}"):
                hybrid(wide)
            with pytest.raises(ValueError, match=rf"got ids from 1 to {wide.max()}"):
                hybrid.generate(wide, 2, greedy=True)
    # traced ids cannot be read: an out-of-range one makes its row NaN instead of wrapping to another token
    logits = nnx.jit(lambda m, t: m(t))(hybrid, jnp.asarray([[1, 2, 3], [1, -1, 3], [1, 32, 3]], jnp.int32))
    assert bool(jnp.all(jnp.isfinite(logits[0]))) and bool(jnp.all(jnp.isnan(logits[1:, 1])))


def test_decoding_past_the_kv_cache_raises():
    model = FalconLM(LMConfig(mixer="transformer", vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                              mlp_hidden=32), rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, t, c: m(t, cache=c))
    _, cache = call(model, jnp.asarray([[1, 2, 3]], jnp.int32), model.init_cache(1, 4))
    logits, cache = call(model, jnp.asarray([[4]], jnp.int32), cache)  # fills the last position
    assert bool(jnp.all(jnp.isfinite(logits)))
    testing.assert_cache_layout(cache, model, 1, 4)
    with pytest.raises(ValueError, match=r"decoding past the KV cache: 4 positions filled \+ 1 new > max_len=4"):
        model(jnp.asarray([[5]], jnp.int32), cache=cache)
    logits, _ = call(model, jnp.asarray([[5]], jnp.int32), cache)
    assert bool(jnp.all(jnp.isnan(logits)))  # traced: loud, not a silently wrong distribution


def test_prompts_of_different_lengths_continue_as_alone(hybrid):
    rng = np.random.default_rng(11)
    P, N = 7, 6
    toks = rng.integers(0, 32, size=(3, P)).astype(np.int32)
    lengths = np.array([7, 2, 4])
    out = np.asarray(hybrid.generate(toks, N, lengths=lengths, pad_id=0, greedy=True))
    assert out.shape == (3, P + N)
    news = []
    for b in range(3):
        alone = np.asarray(hybrid.generate(toks[b:b + 1, :lengths[b]], N, greedy=True))[0]
        np.testing.assert_array_equal(out[b, :lengths[b] + N], alone, err_msg=f"row {b}")
        assert (out[b, lengths[b] + N:] == 0).all()  # pad_id after the row's tokens
        news.append(tuple(alone[lengths[b]:]))
    assert len(set(news)) == 3 and all(len(set(n)) > 1 for n in news)  # the comparison is not vacuous
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 7\]"):
        hybrid.generate(toks, N, lengths=np.array([7, 0, 4]), greedy=True)


def test_a_cache_of_another_model_or_batch_is_named(hybrid):
    """Without these checks: AttributeError / IndexError / a concatenation error deep in a layer, or (a longer
    stack's cache) accepted silently."""
    cfg = hybrid.config
    toks = jnp.asarray([[1, 2, 3]], jnp.int32)
    others = {
        "transformer-only": FalconLM(cfg.replace(layer_mixers=("transformer", "transformer")), rngs=nnx.Rngs(0)),
        "three layers": FalconLM(cfg.replace(n_layers=3, layer_mixers=("falcon-3A", "transformer", "transformer")),
                                 rngs=nnx.Rngs(0)),
        "window 4": FalconLM(cfg.replace(window=4), rngs=nnx.Rngs(0)),
    }
    for what, named in (("transformer-only", r"`cache.layers\[0\]` is a KVCache of another layout than layer 0's "
                                             r"RecurrentCache"),
                        ("three layers", r"`cache` holds 3 layer caches but this model has 2 layers"),
                        ("window 4", r"`cache.layers\[0\].state.tail_x` has shape \(1, 2, 3, 16\) but layer 0 with "
                                     r"batch 1 needs \(1, 2, 2, 16\)")):
        with pytest.raises(ValueError, match=rf"FalconLM: {named}.*init_cache\(batch, max_len\)"):
            hybrid(toks, cache=others[what].init_cache(1, 8))
    with pytest.raises(ValueError, match=r"`cache.layers\[0\].state.S` has shape \(2, 2, 16, 16\) but layer 0 with batch 1"):
        jax.eval_shape(lambda c: hybrid(toks, cache=c), hybrid.init_cache(2, 8))  # traced caches are checked too
    with pytest.raises(TypeError, match=r"`cache` must be an LMCache"):
        hybrid(toks, cache=hybrid.init_cache(1, 8).layers)
    with pytest.raises(ValueError, match=r"`segment_ids` must have shape \[B, T\] = \[1, 3\]; got \(1, 4\)"):
        hybrid(toks, segment_ids=jnp.zeros((1, 4), jnp.int32))
    logits, _ = hybrid(toks, cache=hybrid.init_cache(1, 8))  # its own cache is accepted
    np.testing.assert_allclose(logits, hybrid(toks), rtol=1e-5, atol=1e-5)


def test_lm_token_shapes_are_named(hybrid):
    """Without these checks: no tokens ([B, 0]) fail inside the first Falcon layer naming `q`, `k`, `v`; a [B, 1]
    token given to decode_step is reported as tokens of shape (B, 1, 1)."""
    with pytest.raises(ValueError, match=r"^FalconLM: tokens must be \[batch, time\] ints with time >= 1; got \(1, 0\)"):
        hybrid(jnp.zeros((1, 0), jnp.int32))
    cache = hybrid.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"^FalconLM.decode_step: token must be \[batch\] ints, one token per row "
                                         r"\(several tokens \[batch, time\] go through model\(tokens, cache=cache\)\); "
                                         r"got \(2, 1\)"):
        hybrid.decode_step(jnp.ones((2, 1), jnp.int32), cache)
    logits, _ = hybrid.decode_step(jnp.ones((2,), jnp.int32), cache)  # one token per row is accepted
    assert logits.shape == (2, 32)
