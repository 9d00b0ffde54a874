"""Decoding: prefill + step-by-step decode equals the full forward for every mixer; the
recurrent caches do not grow; generate() is a jit-compiled loop consistent with the model."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from falcon_jax import FalconState
from falcon_jax.nn import FalconLM, KVCache, LMCache, LMConfig, RecurrentCache, cache_nbytes, cache_shapes
from falcon_jax.nn import model as model_mod

# decode == forward for every Falcon variant and every baseline, several rules stacked in one
# model per test (one compile per group; each layer's cache is checked to matter, below)
GROUPS = {
    "regression": ("falcon-1", "falcon-2", "falcon-3"),
    "inner_product": ("falcon-1A", "falcon-2A", "falcon-3A"),
    "decayed_linear": ("retnet", "mamba2"),
    "delta": ("deltanet", "gated_deltanet"),
    "softmax": ("transformer",),
}
T, P = 11, 6  # sequence length, prompt length (the prefill spans two chunks of 4)


def lm(mixer, **over):
    # fp64 and a large init so that the mixers dominate the logits (a wrong cache shows up)
    fields = dict(vocab_size=50, d_model=32, n_layers=1, n_heads=4, mixer=mixer, chunk_size=4, window=3,
                  init_std=0.3, dtype="float64", param_dtype="float64")
    fields.update(over)
    return FalconLM(LMConfig(**fields), rngs=nnx.Rngs(0))


class Runner:
    """Jitted forward / cached call of one model (one compile per input shape)."""

    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)
        self.model = model
        self.forward = jax.jit(lambda s, t, seg: nnx.merge(self.graphdef, s)(t, segment_ids=seg))
        self.cached = jax.jit(lambda s, t, c, seg: nnx.merge(self.graphdef, s)(t, cache=c, segment_ids=seg))

    def full(self, tokens, seg=None):
        return self.forward(self.state, tokens, seg)

    def step(self, tokens, cache, seg=None):
        return self.cached(self.state, tokens, cache, seg)


def prefill_then_decode(run: Runner, tokens, prompt_len, *, seg=None, max_len=None, forget_layer=None):
    """Prefill ``tokens[:, :prompt_len]`` then decode the rest one token at a time; returns the
    logits of every position and the final cache.  ``forget_layer=i``: a control that resets
    layer i's cache before the last step, as a broken cache would."""
    B, L = tokens.shape
    cache = run.model.init_cache(B, max_len or L)
    shapes = cache_shapes(cache)
    logits, cache = run.step(tokens[:, :prompt_len], cache, None if seg is None else seg[:, :prompt_len])
    out = [logits]
    for t in range(prompt_len, L):
        if forget_layer is not None and t == L - 1:
            layers = list(cache.layers)
            layers[forget_layer] = run.model.init_cache(B, max_len or L).layers[forget_layer]
            cache = LMCache(layers=tuple(layers), length=cache.length)
        logits, cache = run.step(tokens[:, t:t + 1], cache)
        out.append(logits)
        assert cache_shapes(cache) == shapes  # no cache grows while decoding
    return jnp.concatenate(out, axis=1), cache


@pytest.mark.parametrize("group", GROUPS)
def test_prefill_and_decode_equal_forward(group, rng):
    """Row 0 packs two documents (ids 0 | 1, boundary inside the prompt), row 1 is one document:
    prefill (chunk form, two chunks) + token-by-token decode (falcon_step / length-1 rule calls)
    equals the full forward, so the rules' states, the conv states and the KV cache all carry
    across calls and respect the boundary."""
    mixers = GROUPS[group]
    run = Runner(lm(mixers[0], n_layers=len(mixers), layer_mixers=mixers))
    tokens = jnp.asarray(rng.integers(0, 50, (2, T)), jnp.int32)
    seg = jnp.asarray([[0] * 3 + [1] * (T - 3), [0] * T], jnp.int32)
    full = run.full(tokens, seg)
    dec, cache = prefill_then_decode(run, tokens, P, seg=seg, max_len=T + 3)  # a roomier KV cache
    chex.assert_equal_shape([full, dec])
    np.testing.assert_allclose(np.asarray(dec), np.asarray(full), rtol=1e-9, atol=1e-9)
    assert int(cache.length) == T
    # control: each layer's cache matters — dropping it before the last step changes the logits
    for i in range(len(mixers)):
        bad, _ = prefill_then_decode(run, tokens, P, seg=seg, max_len=T + 3, forget_layer=i)
        assert float(jnp.min(jnp.max(jnp.abs(bad[:, -1] - full[:, -1]), axis=-1))) > 1e-3, mixers[i]


def test_recurrent_cache_is_constant_size():
    """A recurrent layer's cache is the same for any context length; a softmax layer's KV cache
    is preallocated (decoding never grows either: checked in every decode above)."""
    model = lm("falcon-3A", n_layers=2, attn_every=2, dtype="float32", param_dtype="float32")
    small, big = model.init_cache(2, 16), model.init_cache(2, 100_000)
    layer = small.layers[0]
    assert isinstance(layer, RecurrentCache) and isinstance(layer.state, FalconState)
    assert cache_shapes(layer) == cache_shapes(big.layers[0])
    chex.assert_shape(layer.state.S, (2, 4, 8, 8))
    chex.assert_type(layer.state.S, jnp.float32)
    chex.assert_shape(layer.state.tail_x, (2, 4, 2, 8))  # window 3: the last 2 write pairs
    assert set(layer.conv) == {"q", "k", "v"}
    chex.assert_shape(layer.conv["q"], (2, 3, 32))  # the last K-1 = 3 inputs
    assert isinstance(small.layers[1], KVCache)
    chex.assert_shape(small.layers[1].k, (2, 16, 4, 8))
    chex.assert_shape(big.layers[1].v, (2, 100_000, 4, 8))
    assert cache_nbytes(big) > cache_nbytes(small)


# ------------------------------------------------------------------ generate
def test_generate_greedy_is_the_models_argmax(rng):
    model = lm("falcon-1A", n_layers=2, attn_every=2)
    prompt = jnp.asarray(rng.integers(0, 50, (3, 5)), jnp.int32)
    out = model.generate(prompt, 7, greedy=True)
    chex.assert_shape(out, (3, 12))
    chex.assert_type(out, jnp.int32)
    np.testing.assert_array_equal(np.asarray(out[:, :5]), np.asarray(prompt))
    # teacher-forced re-scoring of the generated text: every new token is the argmax
    logits = Runner(model).full(out)
    np.testing.assert_array_equal(np.asarray(out[:, 5:]), np.asarray(jnp.argmax(logits[:, 4:-1], -1)))


def test_generate_sampling_is_seeded_and_compiled_once(rng):
    model = lm("falcon-1A", dtype="float32", param_dtype="float32")
    prompt = jnp.asarray(rng.integers(0, 50, (2, 4)), jnp.int32)
    a = model.generate(prompt, 6, temperature=1.5, rng=jax.random.key(1))
    size = model_mod._generate._cache_size()
    b = model.generate(prompt, 6, temperature=1.5, rng=jax.random.key(1))
    c = model.generate(prompt, 6, temperature=1.5, rng=jax.random.key(2))
    assert model_mod._generate._cache_size() == size  # same shapes: no recompilation
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert int(a.min()) >= 0 and int(a.max()) < 50


def test_generate_traced_out_of_range_prompt_emits_minus_one(rng):
    """Prompt ids are checked when concrete; under a caller's jax.jit they cannot be read, and an id outside
    [0, vocab_size) embeds as NaN: that row's logits are NaN and every token it generates is -1 (argmax of NaN
    logits would be token 0). The other rows are unchanged."""
    model = lm("falcon-1A", n_layers=2, attn_every=2, dtype="float32", param_dtype="float32")
    prompt = jnp.asarray(rng.integers(0, 50, (2, 5)), jnp.int32)
    bad = prompt.at[1, 2].set(50)
    with pytest.raises(ValueError, match=r"^generate: token ids must be in \[0, vocab_size=50\)"):
        model.generate(bad, 4, greedy=True)
    for kw in (dict(greedy=True), dict(rng=jax.random.key(3))):
        want = model.generate(prompt, 4, **kw)
        got = jax.jit(lambda t: model.generate(t, 4, **kw))(bad)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1, :5]), np.asarray(bad[1]))
        np.testing.assert_array_equal(np.asarray(got[1, 5:]), -1)
        assert int(want.min()) >= 0  # valid prompts never emit -1


def test_generate_errors():
    model = lm("falcon-1A")
    prompt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="rng="):
        model.generate(prompt, 2)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=0.0, rng=jax.random.key(0))
    for bad in (-1, 2.0, True, np.int64(-1)):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
            model.generate(prompt, bad, greedy=True)
    assert model.generate(prompt, 0, greedy=True).shape == (1, 3)
    # a NumPy int (a length computed with NumPy) is an int, as init_cache takes it
    np.testing.assert_array_equal(np.asarray(model.generate(prompt, np.int64(2), greedy=True)),
                                  np.asarray(model.generate(prompt, 2, greedy=True)))


def test_init_cache_and_generate_reject_bad_sizes_and_keys():
    model = lm("falcon-1A", dtype="float32", param_dtype="float32")
    for bad in (-1, 0, 2.0, True):
        with pytest.raises(ValueError, match="init_cache: batch must be an int >= 1"):
            model.init_cache(bad, 8)
        with pytest.raises(ValueError, match="init_cache: max_len must be an int >= 1"):
            model.init_cache(2, bad)
    prompt = jnp.ones((1, 3), jnp.int32)
    # (a batch of keys failed inside jax.random.split)
    for bad in (0, np.zeros(2, np.uint32), jnp.zeros(3, jnp.uint32), jax.random.split(jax.random.key(0), 2)):
        with pytest.raises(TypeError, match="rng must be one JAX random key"):
            model.generate(prompt, 2, rng=bad)
    for good in (jax.random.key(1), jax.random.PRNGKey(1)):  # new-style and raw uint32[2] keys both sample
        assert model.generate(prompt, 2, rng=good).shape == (1, 5)


def test_generate_rejects_a_greedy_flag_or_temperature_that_is_not_one():
    """greedy='false' would decode greedily and temperature=inf sample uniformly, ignoring the model."""
    model = lm("falcon-1A", dtype="float32", param_dtype="float32")
    prompt, key = jnp.ones((1, 3), jnp.int32), jax.random.key(1)
    for bad in ("false", 0, None):
        with pytest.raises(TypeError, match="greedy must be True or False"):
            model.generate(prompt, 2, greedy=bad, rng=key)
    for bad in ("0.7", jnp.ones(2), True):
        with pytest.raises(TypeError, match="temperature must be one real number"):
            model.generate(prompt, 2, temperature=bad, rng=key)
    # 1e300 is inf in float32 (uniform sampling) and 1e-45 a denormal (the logits divided by ~0)
    for bad in (float("inf"), float("nan"), -1.0, 0, 1e300, 1e-45):
        with pytest.raises(ValueError, match="temperature must be finite and > 0 in float32"):
            model.generate(prompt, 2, temperature=bad, rng=key)
    for good in (0.5, 2, np.float32(0.7), jnp.asarray(1.5)):
        assert model.generate(prompt, 2, temperature=good, rng=key).shape == (1, 5)
    assert model.generate(prompt, 2, greedy=np.bool_(True)).shape == (1, 5)
    # the smallest temperature accepted samples the argmax: the largest logit is subtracted before dividing
    # (logits / tiny would make both 99 and 100 inf, and the first of them win)
    from falcon_jax.nn.model import _sample
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    logits = jnp.asarray([[99.0, 100.0, -5.0], [3.0, -1.0, 2.5]], jnp.float32)
    np.testing.assert_array_equal(_sample(logits, key, tiny, greedy=False), [1, 0])
