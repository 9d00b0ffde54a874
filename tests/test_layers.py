"""Mixers and blocks of falcon_jax.nn: shapes, dtypes, the layer equation of docs/layers.md, gate
parameterization, packed sequences, gradients and configuration errors."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from falcon_jax import falcon
from falcon_jax.nn import (DeltaNetMixer, FalconAttention, FalconLM, GatedDeltaNetMixer, KVCache, LMConfig,
                           Mamba2Mixer, RetNetMixer, RMSNorm, ShortConv, SoftmaxAttention, SwiGLU, lm_loss, make_mixer,
                           parse_mixer)
from falcon_jax.nn.layers import l2_normalize, rms_normalize

D, H, DK = 32, 4, 8
ALL_MIXERS = ("falcon-1", "falcon-2", "falcon-3", "falcon-1A", "falcon-2A", "falcon-3A", "transformer", "retnet",
              "mamba2", "deltanet", "gated_deltanet")


def build(mixer, *, dtype="float32", seed=0, **over):
    cfg = LMConfig(vocab_size=64, d_model=D, n_layers=1, n_heads=H, mixer=mixer, chunk_size=4, dtype=dtype,
                   init_std=over.pop("init_std", 0.2), **over)
    return make_mixer(cfg, parse_mixer(mixer), rngs=nnx.Rngs(seed))


class Jitted:
    """``mixer(h, segment_ids=seg)`` under one ``jax.jit`` (compiled once per input shape)."""

    def __init__(self, module):
        self.graphdef, self.state = nnx.split(module)
        self.fn = jax.jit(lambda s, h, seg: nnx.merge(self.graphdef, s)(h, segment_ids=seg))

    def __call__(self, h, segment_ids=None):
        return self.fn(self.state, h, segment_ids)


def run(mixer_module, h, **kw):
    return Jitted(mixer_module)(h, **kw)


# ------------------------------------------------------------------ shapes and dtypes
@pytest.mark.parametrize("mixer", ["falcon-2", "transformer", "mamba2"])
def test_mixer_shape_and_dtype_float32_under_x64(mixer, rng):
    # conftest turns on x64: parameters and outputs must still be float32
    m = build(mixer, form="parallel")
    for _, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.Param)):
        assert leaf.dtype == jnp.float32
    h = jnp.asarray(rng.standard_normal((2, 9, D)), jnp.float32)
    y = run(m, h)
    chex.assert_shape(y, (2, 9, D))
    chex.assert_type(y, jnp.float32)
    chex.assert_tree_all_finite(y)


@pytest.mark.parametrize("mixer", ["falcon-1A", "transformer"])
def test_mixer_bf16_forward_is_finite(mixer, rng):
    m = build(mixer, dtype="bfloat16", init_std=0.02)
    h = jnp.asarray(rng.standard_normal((2, 16, D)), jnp.bfloat16)
    y = run(m, h)
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_shape(y, (2, 16, D))
    chex.assert_tree_all_finite(y)
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0


# ------------------------------------------------------------ the layer equation (docs/layers.md)
def _np(a):
    return np.asarray(a, np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _conv(x, w):
    """causal depthwise conv, x [B,T,C], w [K,C]: y_t = sum_i w[i] x_{t-K+1+i}"""
    K = w.shape[0]
    xp = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2])), x], axis=1)
    return sum(w[i] * xp[:, i:i + x.shape[1]] for i in range(K))


def reference_falcon_attention(m: FalconAttention, h):
    """An independent NumPy transcription of docs/layers.md from the module's parameters; the rule
    itself through falcon(form="recurrent") (the core is tested elsewhere)."""
    B, T, _ = h.shape
    Hh, dk, dv = m.n_heads, m.dk, m.dv
    W = {name: _np(getattr(m, name).kernel[...]) for name in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj",
                                                             "gain_proj")}
    q, k, v = h @ W["q_proj"], h @ W["k_proj"], h @ W["v_proj"]
    if m.conv_size:
        q = _silu(_conv(q, _np(m.conv_q.kernel[...])))
        k = _silu(_conv(k, _np(m.conv_k.kernel[...])))
        v = _silu(_conv(v, _np(m.conv_v.kernel[...])))
    q, k, v = q.reshape(B, T, Hh, dk), k.reshape(B, T, Hh, dk), v.reshape(B, T, Hh, dv)
    if m.qk_norm == "rms":
        q = q / np.sqrt(np.mean(q * q, -1, keepdims=True) + m.norm_eps)
        k = k / np.sqrt(np.mean(k * k, -1, keepdims=True) + m.norm_eps)
    else:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + m.norm_eps)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + m.norm_eps)
    g = 2 * _sigmoid(h @ W["gain_proj"])
    if m.gain == "ctx_eta":
        g = g / dk
    g = g.reshape(B, T, Hh, dv) if m.per_column_gains else g.reshape(B, T, Hh)
    if m.lam == "ctx":
        lam = m.lam_max * _sigmoid(h @ _np(m.lam_proj.kernel[...]) + _np(m.lam_bias[...]))
    elif m.lam == "const":
        lam = np.broadcast_to(np.log1p(np.exp(_np(m.lam_const[...]))), (B, T, Hh))
    else:
        lam = np.zeros((B, T, Hh))
    opts = m.options
    rule = jax.jit(lambda *a: falcon(*a, variant=opts["variant"], window=opts["window"],
                                     alignment=opts["alignment"], timing=opts["timing"],
                                     step="normalized" if m.gain == "ctx_beta" else "direct",
                                     scale_coupled=m.lam == "ctx", eps=opts["eps"], eps_gamma=opts["eps_gamma"],
                                     form="recurrent"))
    o = np.asarray(rule(*(jnp.asarray(a) for a in (q, k, v, g, lam))))
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + m.norm_eps) * _np(m.o_norm_scale[...])
    return (o.reshape(B, T, Hh * dv) * _silu(h @ W["g_proj"])) @ W["o_proj"]


# every variant, both norms, both gains, the three ridges, per-column gains on and off, and the
# window / alignment / timing / conv switches; the forms vary too (each equals the recurrence)
LAYER_CASES = [
    dict(variant="1A", qk_norm="rms", gain="ctx_eta", lam="ctx"),  # the paper's .3 setting
    dict(variant="1", qk_norm="l2", gain="ctx_beta", lam="ctx", form="parallel"),  # .1
    dict(variant="2", qk_norm="l2", gain="ctx_eta", lam="const", form="parallel"),  # per-column gains
    dict(variant="2A", qk_norm="rms", gain="ctx_beta", lam="none", per_column_gains=False, form="parallel"),
    dict(variant="3", qk_norm="rms", gain="ctx_beta", lam="ctx", window=3, timing="rbw", form="recurrent"),
    dict(variant="3A", qk_norm="rms", gain="ctx_eta", lam="const", window=2, alignment="same_step", conv_size=0,
         form="parallel"),
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_falcon_attention_matches_spec_equation(case, rng):
    case = dict(case)
    m = FalconAttention(D, H, head_dim=DK, v_head_dim=6, chunk_size=4, init_std=0.3, dtype=jnp.float64,
                        param_dtype=jnp.float64, rngs=nnx.Rngs(1), **case)
    h = rng.standard_normal((2, 10, D))
    y = run(m, jnp.asarray(h))
    ref = reference_falcon_attention(m, h)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-9, atol=1e-10)


def test_falcon_attention_forwards_its_options():
    """The options reach ``falcon``: the layer passes ``m.options`` (the test above checks that
    the output is the rule run with them), and ``m.options`` is what was asked for."""
    m = FalconAttention(D, H, variant="3a", window=5, alignment="same_step", timing="rbw", gain="ctx_beta",
                        lam="const", eps=1e-5, eps_gamma=1e-3, form="parallel", chunk_size=8, impl="xla",
                        rngs=nnx.Rngs(0))
    assert m.options == dict(variant="3A", window=5, alignment="same_step", timing="rbw", step="normalized",
                             scale_coupled=False, eps=1e-5, eps_gamma=1e-3)
    assert (m.form, m.chunk_size, m.impl) == ("parallel", 8, "xla")
    m = FalconAttention(D, H, variant="1", gain="ctx_eta", lam="ctx", rngs=nnx.Rngs(0))
    assert (m.options["step"], m.options["scale_coupled"], m.options["window"]) == ("direct", True, 4)
    assert m.init_cache(2).state.tail_x.shape == (2, H, 0, D // H)
    assert FalconAttention(D, H, variant="3", window=5, rngs=nnx.Rngs(0)).init_cache(2).state.tail_x.shape == (
        2, H, 4, D // H)


def test_falcon_gates_at_init(rng):
    """With the gate projections zeroed: β = 2σ(0) = 1, η = 1/dk (for RMS and ℓ2 keys alike), and
    λ̄ starts at lam_init (log-spaced over heads), the const ridge at λ̄₀·E[‖k‖²]."""
    h = jnp.asarray(rng.standard_normal((1, 3, D)), jnp.float32)

    def gates(**kw):
        m = FalconAttention(D, H, head_dim=DK, lam_init=(1e-3, 1e-1), rngs=nnx.Rngs(0), **kw)
        m.gain_proj.kernel[...] = jnp.zeros_like(m.gain_proj.kernel[...])
        if kw.get("lam", "ctx") == "ctx":
            m.lam_proj.kernel[...] = jnp.zeros_like(m.lam_proj.kernel[...])
        return m._gates(h)

    lam0 = np.exp(np.linspace(np.log(1e-3), np.log(1e-1), H))
    g = gates(gain="ctx_beta")
    np.testing.assert_allclose(g["beta"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(g["lam"][0, 0], lam0, rtol=1e-5)
    np.testing.assert_allclose(gates(gain="ctx_eta")["beta"], 1.0 / DK, rtol=1e-6)
    np.testing.assert_allclose(gates(gain="ctx_eta", qk_norm="l2")["beta"], 1.0 / DK, rtol=1e-6)
    np.testing.assert_allclose(gates(lam="const", qk_norm="l2")["lam"][0, 0], lam0, rtol=1e-5)
    np.testing.assert_allclose(gates(lam="const")["lam"][0, 0], lam0 * DK, rtol=1e-5)
    np.testing.assert_array_equal(gates(lam="none")["lam"], 0.0)
    chex.assert_shape(gates(variant="2A")["beta"], (1, 3, H, DK))  # per-column: dv gains per head


# ------------------------------------------------------------------ packed sequences
def test_short_conv_does_not_leak_across_segments(rng):
    conv = ShortConv(6, 4, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, 9, 6)))
    seg = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    y, state = nnx.jit(lambda c, x, s: c(x, segment_ids=s))(conv, x, seg)
    w = np.asarray(conv.kernel[...])
    for lo, hi in ((0, 3), (3, 5), (5, 9)):
        np.testing.assert_allclose(np.asarray(y[:, lo:hi]), _conv(np.asarray(x[:, lo:hi]), w), rtol=1e-12)
    # the carried state holds the last K-1 inputs, all of the last segment here
    np.testing.assert_allclose(np.asarray(state), np.asarray(x[:, -3:]))
    _, state2 = conv(x[:, :7], segment_ids=seg[:, :7])  # last segment only 2 long: older slot zeroed
    np.testing.assert_allclose(np.asarray(state2[:, 0]), 0.0)
    np.testing.assert_allclose(np.asarray(state2[:, 1:]), np.asarray(x[:, 5:7]))


def test_rope_checks_its_arguments(rng):
    """The public rope: theta=0 gave NaN, positions of another length a broadcasting error from inside JAX."""
    from falcon_jax.nn.baselines import rope
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 8)), jnp.float32)
    with pytest.raises(ValueError, match=r"^rope: theta=0\.0 must be a finite number > 0"):
        rope(x, jnp.arange(5), 0.0)
    with pytest.raises(ValueError, match=r"^rope: positions must be \[T\] or \[B, T\] = \(5,\) or \(2, 5\); got "
                                         r"shape \(4,\)"):
        rope(x, jnp.arange(4), 1e4)
    np.testing.assert_allclose(rope(x, jnp.arange(5), 1e4), rope(x, jnp.tile(jnp.arange(5), (2, 1)), 1e4))


def test_short_conv_and_rmsnorm_refuse_inputs_of_another_shape(rng):
    """A state of another length shifted every output (T - 1 or T + 3 outputs came back); x with other channels
    or a zero width failed inside JAX (a concatenate error, a ZeroDivisionError)."""
    conv = ShortConv(8, 4, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    for state in (jnp.zeros((2, 2, 8)), jnp.zeros((2, 6, 8)), jnp.zeros((1, 3, 8))):
        with pytest.raises(ValueError, match=r"^ShortConv: state must be \[B, width - 1, channels\] = \(2, 3, 8\)"):
            conv(x, state)
    with pytest.raises(ValueError, match=r"^ShortConv: x must be \[B, T, channels=8\]; got shape \(2, 5, 6\)"):
        conv(x[..., :6])
    with pytest.raises(ValueError, match=r"^ShortConv: width=0 must be an int >= 1"):
        ShortConv(8, 0, rngs=nnx.Rngs(0))
    y, new_state = conv(x, conv.init_state(2, jnp.float32))  # the right state is accepted
    assert y.shape == (2, 5, 8) and new_state.shape == (2, 3, 8)
    with pytest.raises(ValueError, match=r"^RMSNorm: x must be \[\.\.\., dim=8\]; got shape \(2, 5, 6\)"):
        RMSNorm(8, rngs=nnx.Rngs(0))(x[..., :6])


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_mixer_packed_segments_equal_separate_sequences(mixer, rng):
    # the recurrent form compiles fastest; the forms' own segment handling is tested in the core
    f = Jitted(build(mixer, dtype="float64", form="recurrent"))
    ab = rng.standard_normal((2, 6, D))  # two sequences, run side by side ...
    packed = jnp.asarray(ab.reshape(1, 12, D))  # ... and packed in one row
    y = f(packed, jnp.asarray([[3] * 6 + [8] * 6], jnp.int32))
    separate = f(jnp.asarray(ab), jnp.zeros((2, 6), jnp.int32))
    np.testing.assert_allclose(np.asarray(y).reshape(2, 6, D), np.asarray(separate), rtol=1e-9, atol=1e-11)
    # one id for the whole row: the second sequence now sees the first (the check can fail)
    y_leak = f(packed, jnp.zeros((1, 12), jnp.int32))
    assert float(jnp.max(jnp.abs(y_leak[:, 6:] - y[:, 6:]))) > 1e-4


def test_short_conv_segment_id_reused_after_a_change_is_a_new_segment(rng):
    """Ids [0, 0, 1, 0, 0]: the second stretch of 0s is a segment of its own (the rules reset at every change of
    id), with and without a carried state: neither the taps nor the carried state join the two stretches of 0s."""
    conv = ShortConv(6, 4, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, 5, 6)))
    state = jnp.asarray(rng.standard_normal((1, 3, 6)))
    reused, numbered = jnp.asarray([[0, 0, 1, 0, 0]]), jnp.asarray([[0, 0, 1, 2, 2]])
    w = np.asarray(conv.kernel[...])
    for s in (None, state):
        y, new_state = conv(x, s, reused)
        y_num, new_state_num = conv(x, s, numbered)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_num))
        np.testing.assert_array_equal(np.asarray(new_state), np.asarray(new_state_num))
        np.testing.assert_allclose(np.asarray(y[:, 3:]), _conv(np.asarray(x[:, 3:]), w), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(new_state[:, 0]), 0.0)  # position 2 is another segment


@pytest.mark.parametrize("mixer", ["falcon-1A", "transformer"])
def test_mixer_segment_id_reused_after_a_change_is_a_new_segment(mixer, rng):
    """Ids [3, 3, 3, 8, 8, 3, 3, 3]: every mixer (the short convolutions and softmax attention too, not only the
    rule) treats the last stretch of 3s as a new segment, the same as ids [0, 0, 0, 1, 1, 2, 2, 2]; so does a call
    with a cache (the cached softmax path)."""
    m = build(mixer, dtype="float64", form="recurrent")
    f = Jitted(m)
    h = jnp.asarray(rng.standard_normal((1, 8, D)))
    reused = jnp.asarray([[3, 3, 3, 8, 8, 3, 3, 3]], jnp.int32)
    numbered = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2]], jnp.int32)
    y = f(h, reused)
    np.testing.assert_allclose(np.asarray(y), np.asarray(f(h, numbered)), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(np.asarray(y[:, 5:]), np.asarray(f(h[:, 5:], None)), rtol=1e-9, atol=1e-12)
    y_cached, _ = m(h, segment_ids=reused, cache=m.init_cache(1, 8))
    np.testing.assert_allclose(np.asarray(y_cached), np.asarray(y), rtol=1e-9, atol=1e-12)


def test_softmax_attention_flash_kernel_equals_the_masked_layer_on_packed_rows(rng):
    """``attn_impl="triton"`` (the Pallas flash attention, interpreted here) in fp32 against the XLA masked layer
    in float64 with the same parameters: outputs and the gradients w.r.t. the input and every parameter, odd T
    with a one-token segment at each end of a row."""
    B, T = 2, 29
    seg = np.zeros((B, T), np.int32)
    seg[0, 1:] += 1
    seg[0, 11:] += 1
    seg[0, T - 1:] += 1
    seg[1, 17:] = 4
    seg = jnp.asarray(seg)
    h = rng.standard_normal((B, T, D))
    ct = jnp.asarray(rng.standard_normal((B, T, D)))

    def value_and_grads(impl, dtype):
        graphdef, state = nnx.split(build("transformer", dtype=dtype, attn_impl=impl))

        def loss(state, h):
            y = nnx.merge(graphdef, state)(h, segment_ids=seg)
            return jnp.sum(y * ct.astype(y.dtype)), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, jnp.asarray(h, dtype))
        return y, grads

    got, got_grads = value_and_grads("triton", "float32")
    want, want_grads = value_and_grads("xla", "float64")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    leaves = jax.tree_util.tree_leaves_with_path(got_grads)
    for (path, g), w in zip(leaves, jax.tree_util.tree_leaves(want_grads), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0, path
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * float(jnp.max(jnp.abs(w))), err_msg=jax.tree_util.keystr(path))


def test_softmax_attention_auto_choice_and_errors(rng, monkeypatch):
    """``attn_impl="auto"`` on a GPU: cuDNN without segment ids (bf16), the Pallas flash attention with them
    (its kernels traced), XLA with a one-time warning naming the reason where the kernel declines (fp64); off a
    GPU, XLA.  A bad ``attn_impl`` names the choices; ``"triton"`` declining raises with its reason."""
    import warnings

    from falcon_jax.nn import baselines
    from tests.kernels.helpers import on_backend, pallas_calls

    h = jnp.asarray(rng.standard_normal((2, 21, D)), jnp.bfloat16)
    seg = jnp.asarray(np.repeat([[0, 1, 2]], 7, axis=1).repeat(2, 0), jnp.int32)
    x = jnp.zeros((2, 21, H, DK), jnp.bfloat16)
    m = build("transformer", dtype="bfloat16")
    assert m._implementation(x, x, x, packed=True) == "xla"  # a CPU
    graphdef, state = nnx.split(m)
    on_backend(monkeypatch, "gpu")
    assert m._implementation(x, x, x, packed=False) == "cudnn"
    assert m._implementation(x, x, x, packed=True) == "triton"
    assert build("transformer", dtype="float32")._implementation(x, x, x, packed=False) == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pallas_calls(lambda h: nnx.merge(graphdef, state)(h, segment_ids=seg), h) == ["mha_forward"]
    m64 = build("transformer", dtype="float64")
    g64, s64 = nnx.split(m64)
    monkeypatch.setattr(baselines, "_warned_fallback", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert pallas_calls(lambda h: nnx.merge(g64, s64)(h, segment_ids=seg), h.astype(jnp.float64)) == []
    messages = [str(w.message) for w in caught if "declined" in str(w.message)]
    assert len(messages) == 1 and "float64" in messages[0] and "T x T mask" in messages[0], messages
    with pytest.raises(NotImplementedError, match=r"attn_impl='triton' declined: dtypes q float64"):
        nnx.merge(*nnx.split(build("transformer", dtype="float64", attn_impl="triton")))(h.astype(jnp.float64),
                                                                                          segment_ids=seg)
    with pytest.raises(ValueError, match=r"attn_impl='flash'.*'auto', 'triton'.*'cudnn' or 'xla'"):
        SoftmaxAttention(D, H, attn_impl="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"LMConfig.attn_impl='pallas'.*'auto', 'triton', 'cudnn', 'xla'"):
        LMConfig(attn_impl="pallas")


SHARDED_ATTENTION = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from falcon_jax.nn import SoftmaxAttention
from falcon_jax.sharding import kernel_sharding
from falcon_jax.testing import pallas_call_operand_shapes

mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "tensor"))
B, T, D, H = 4, 21, 32, 4
graphdef, state = nnx.split(SoftmaxAttention(D, H, attn_impl="triton", init_std=0.3, rngs=nnx.Rngs(0)))
rng = np.random.default_rng(0)
h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
out = {}
for packed in (True, False):
    ids = seg if packed else None
    def loss(state, h):
        y = nnx.merge(graphdef, state)(h, segment_ids=ids)
        return jnp.sum(y * jnp.cos(y))
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    l0, g0 = f(state, h)
    hs = jax.device_put(h, NamedSharding(mesh, P("data")))
    with kernel_sharding(mesh, batch_axes="data", head_axis="tensor"):
        f_sh = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        l1, g1 = f_sh(state, hs)
        shapes = [operands[0] for operands in pallas_call_operand_shapes(f_sh, state, hs)]
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
              for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))
    out[str(packed)] = {"loss": [float(l0), float(l1)], "grad_err": err,
                        "operands": sorted({tuple(s) for s in shapes})}
print("RESULT" + json.dumps(out))
"""


def test_softmax_attention_flash_kernel_runs_per_shard_under_kernel_sharding():
    """On a data=2 x tensor=2 mesh of simulated CPU devices, ``attn_impl="triton"`` runs the flash attention on
    each device's rows and heads ([B/2, T', H/2, d] operands, never the whole batch), with the loss and the
    gradients of the unsharded call, with and without segment ids."""
    from tests.helpers import run_on_simulated_devices

    out = run_on_simulated_devices(SHARDED_ATTENTION, 4)
    for packed, got in out.items():
        one, sharded = got["loss"]
        assert abs(one - sharded) < 1e-5 * abs(one), (packed, got)
        assert got["grad_err"] < 1e-5, (packed, got)
        assert got["operands"] and all(s[0] == 2 and s[2] == 2 for s in got["operands"]), (packed, got)


@pytest.mark.parametrize("mixer", ["gated_deltanet", "deltanet"])
def test_delta_rule_baseline_layers_run_the_kernels(mixer, rng, monkeypatch):
    """The (Gated) DeltaNet layer with the default ``impl="auto"`` traces the decayed delta rule's kernels on a
    GPU (no fallback warning), and with ``impl="triton"`` (interpreted here) equals ``impl="xla"``."""
    import warnings

    from falcon_jax.kernels import common
    from tests.kernels.helpers import on_backend, pallas_calls

    h = jnp.asarray(rng.standard_normal((2, 21, 64)), jnp.float32)
    seg = jnp.asarray(np.sort(rng.integers(0, 2, (2, 21)), axis=1), jnp.int32)

    def layer(impl):
        cfg = LMConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, mixer=mixer, chunk_size=16, impl=impl)
        m = make_mixer(cfg, parse_mixer(mixer), rngs=nnx.Rngs(0))
        return nnx.split(m), lambda g, s, x, sid: nnx.merge(g, s)(x, segment_ids=sid)

    (graphdef, state), fn = layer("auto")
    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("error")
        on_backend(patch, "gpu")
        patch.setattr(common, "on_hopper", lambda: False)
        assert "falcon_delta_tri_inverse" in pallas_calls(lambda x: fn(graphdef, state, x, seg), h)
    got = jax.jit(fn, static_argnums=0)(*layer("triton")[0], h, seg)
    want = jax.jit(fn, static_argnums=0)(*layer("xla")[0], h, seg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ gradients
def test_gradient_reaches_every_mixer_parameter(rng):
    """One model stacking every kind of mixer parameter: per-column gains + ctx λ (falcon-2),
    const λ (falcon-3A), Mamba-2's Δ/A/D, GDN's β/Δ/A (a superset of DeltaNet's; RetNet has only
    the shared ones), softmax attention.  The parallel form keeps the compile short."""
    mixers = ("falcon-2", "falcon-3A", "mamba2", "gated_deltanet", "transformer")
    cfg = LMConfig(vocab_size=64, d_model=D, n_layers=len(mixers), n_heads=H, layer_mixers=mixers, lam="ctx",
                   form="parallel", init_std=0.2)
    model = FalconLM(cfg, rngs=nnx.Rngs(0))
    # layer 2 with the constant ridge instead
    model.layers[1].mixer = make_mixer(cfg.replace(lam="const"), parse_mixer("falcon-3A"), rngs=nnx.Rngs(1))
    tokens = jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.jit(jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p, rest), tokens)))(params)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    for name in ("lam_const", "lam_bias", "gain_proj", "A_log", "D_skip", "dt_bias", "beta_proj", "conv_q"):
        assert any(name in p for p in paths), name
    for path, g in flat:
        assert float(jnp.max(jnp.abs(g))) > 0, f"zero gradient for {jax.tree_util.keystr(path)}"


# ------------------------------------------------------------------ blocks
def test_rmsnorm_and_swiglu(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 8)) * 5)
    norm = RMSNorm(8, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.arange(1.0, 9.0)
    xn = np.asarray(x)
    expect = xn / np.sqrt(np.mean(xn ** 2, -1, keepdims=True) + 1e-6) * np.arange(1.0, 9.0)
    np.testing.assert_allclose(np.asarray(norm(x)), expect, rtol=1e-12)
    mlp = SwiGLU(8, 12, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    g, u, d = (np.asarray(p.kernel[...]) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    np.testing.assert_allclose(np.asarray(mlp(x)), (_silu(xn @ g) * (xn @ u)) @ d, rtol=1e-10)


def test_rmsnorm_of_rows_whose_squares_overflow_fp32(rng):
    """|x| from about 1.8e19 squares to inf in fp32: the norm must still scale every row to RMS 1, like a
    float64 NumPy reference, for rows of any finite magnitude (each row of its own scale), and for the ℓ2 norm."""
    norm = RMSNorm(8, rngs=nnx.Rngs(0))
    ones = np.asarray(norm(jnp.ones((2, 8), jnp.float32)))
    for big in (1e19, 1e20, 1e30, 3e38):  # eps (1e-6) is negligible here, not for the ones: 1 against 1 - 5e-7
        np.testing.assert_allclose(np.asarray(norm(jnp.full((2, 8), big, jnp.float32))), ones, rtol=1e-6)
    scales = 10.0 ** np.array([-3, 0, 4, 9, 10, 15, 19, 20, 25, 30, 35, 37])[:, None]  # one scale per row
    x = (rng.standard_normal((len(scales), 64)) * scales).astype(np.float32)
    assert np.isfinite(x).all()
    x64 = x.astype(np.float64)
    for fn, reduce in ((rms_normalize, np.mean), (l2_normalize, np.sum)):
        expect = x64 / np.sqrt(reduce(x64 ** 2, -1, keepdims=True) + 1e-6)
        got = np.asarray(jax.jit(fn, static_argnums=1)(jnp.asarray(x), 1e-6))
        np.testing.assert_allclose(got, expect, rtol=2e-6, atol=1e-7, err_msg=fn.__name__)
    # the gradient scales as 1/c for an input scaled by c (no inf · 0)
    v = jnp.asarray(rng.standard_normal(8), jnp.float32)
    w = jnp.asarray(rng.standard_normal(8), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(rms_normalize(x, 1e-6) * w))
    np.testing.assert_allclose(np.asarray(grad(v * 1e20)) * 1e20, np.asarray(grad(v)), rtol=1e-5, atol=1e-6)


def test_mixer_classes_by_name():
    expect = {"transformer": SoftmaxAttention, "softmax": SoftmaxAttention, "retnet": RetNetMixer,
              "linear_attention": RetNetMixer, "mamba2": Mamba2Mixer, "deltanet": DeltaNetMixer,
              "gated_deltanet": GatedDeltaNetMixer, "gdn": GatedDeltaNetMixer, "falcon-1A.3": FalconAttention}
    for name, cls in expect.items():
        assert type(build(name)) is cls, name
    m = build("falcon-1A.1")
    assert (m.variant, m.qk_norm, m.gain, m.lam) == ("1A", "l2", "ctx_beta", "ctx")
    m = build("Falcon-3A.2", qk_norm="rms")  # the suffix wins over the config fields
    assert (m.variant, m.qk_norm, m.gain, m.window) == ("3A", "l2", "ctx_eta", 4)
    assert type(build("falcon-2")).__name__ == "FalconAttention" and build("falcon-2").per_column_gains


# ------------------------------------------------------------------ errors
def test_layer_config_errors():
    with pytest.raises(ValueError, match=r"n_heads=5 does not divide d_model=32.*head_dim"):
        FalconAttention(32, 5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"per_column_gains=True.*variant '1A'.*'2' or '2A'"):
        FalconAttention(32, 4, variant="1A", per_column_gains=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"variant='4'"):
        FalconAttention(32, 4, variant="4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"per_column_gains='False' must be None, True or False"):
        FalconAttention(32, 4, variant="2A", per_column_gains="False", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"lam_init=0.01 must be a pair \(low, high\)"):
        FalconAttention(32, 4, lam_init=0.01, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"gain='eta'"):
        FalconAttention(32, 4, gain="eta", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"chunk_size=48.*power of two"):
        DeltaNetMixer(32, 4, chunk_size=48, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"head_dim=7 must be even"):
        SoftmaxAttention(28, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"v_head_dim=6 must equal head_dim=8 in softmax attention"):
        SoftmaxAttention(32, 4, v_head_dim=6, rngs=nnx.Rngs(0))  # refused when built, not inside the attention call
    # a bool is not a size (True would be window 1 or chunk 1, False no short convolution)
    for make, field, value in ((lambda **kw: FalconAttention(32, 4, variant="3", **kw, rngs=nnx.Rngs(0)), "window", True),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "chunk_size", True),
                               (lambda **kw: DeltaNetMixer(32, 4, **kw, rngs=nnx.Rngs(0)), "chunk_size", True),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "conv_size", False),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "window", np.True_)):
        with pytest.raises(ValueError, match=rf"^\w+: {field}={value!r} must be"):
            make(**{field: value})
    # real options: a negative norm epsilon or a RoPE base of 0 would give NaN outputs, not an error
    for make, field, value in ((lambda **kw: SoftmaxAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "rope_theta", 0.0),
                               (lambda **kw: SoftmaxAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "rope_theta", -1e4),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "norm_eps", -1.0),
                               (lambda **kw: DeltaNetMixer(32, 4, **kw, rngs=nnx.Rngs(0)), "norm_eps", float("nan")),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "eps", -1e-6),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "eps_gamma", 1.0),
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "eps_gamma", True),
                               (lambda **kw: RMSNorm(32, **kw, rngs=nnx.Rngs(0)), "eps", -1e-6),
                               # 0 divides an all-zero row by zero (a Falcon layer's output at position 0)
                               (lambda **kw: FalconAttention(32, 4, **kw, rngs=nnx.Rngs(0)), "norm_eps", 0.0),
                               (lambda **kw: RMSNorm(32, **kw, rngs=nnx.Rngs(0)), "eps", 0.0)):
        with pytest.raises(ValueError, match=rf"^\w+: {field}={value!r} must be a finite number"):
            make(**{field: value})
    # the smallest positive epsilon keeps the zero output at position 0 finite (it was NaN with 0)
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 32)), jnp.float32)
    out = FalconAttention(32, 4, norm_eps=1e-30, rngs=nnx.Rngs(0))(h)
    assert bool(jnp.isfinite(out).all())
    # checked when the layer is built, not at its first call with a message about falcon()'s `lam` or `beta`
    # (lam_max, init_std) or without the layer's name (alignment, timing, impl), or inside Flax / JAX (dtypes)
    for field, value, named in (("lam_max", float("inf"), "must be a finite number > 0"),
                                ("lam_max", "1", "must be a finite number > 0"),
                                ("init_std", float("nan"), "must be a finite number > 0"),
                                ("out_std", -0.1, "must be a finite number >= 0"),
                                ("alignment", "bogus", "must be one of 'shifted', 'same_step'"),
                                ("timing", "after", "must be one of 'raw', 'rbw'"),
                                ("impl", "cuda", "must be one of 'auto'"),
                                ("dtype", jnp.int32, "must be one of float32, bfloat16"),
                                ("param_dtype", jnp.int8, "must be one of float32, bfloat16")):
        with pytest.raises(ValueError, match=rf"^FalconAttention: {field}=.* {named}"):
            FalconAttention(32, 4, **{field: value}, rngs=nnx.Rngs(0))
    FalconAttention(32, 4, out_std=0.0, rngs=nnx.Rngs(0))  # a zero-initialised output projection is fine
    # a per-column FalconAttention does accept its gains (the check is not over-eager)
    FalconAttention(32, 4, variant="2A", per_column_gains=True, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cls", [FalconAttention, SoftmaxAttention, RetNetMixer])
def test_layer_sizes_must_be_positive_ints(cls, rng):
    """d_model, n_heads, head_dim and v_head_dim of a layer built directly (LMConfig checks its own).  Before,
    n_heads=0 with a head_dim built a layer whose every output was 0; head_dim=0 or a float failed inside a
    projection or an attention call, and n_heads=0 without a head_dim with a ZeroDivisionError."""
    for kw, field in ((dict(n_heads=0, head_dim=8), "n_heads=0"), (dict(n_heads=0), "n_heads=0"),
                      (dict(d_model=0, head_dim=8), "d_model=0"), (dict(head_dim=0), "head_dim=0"),
                      (dict(head_dim=-2), "head_dim=-2"), (dict(head_dim=8.0), "head_dim=8.0"),
                      (dict(v_head_dim=0), "v_head_dim=0"), (dict(n_heads=True), "n_heads=True")):
        args = dict(d_model=D, n_heads=H) | kw
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: {field} must be an int >= 1"):
            cls(args.pop("d_model"), args.pop("n_heads"), rngs=nnx.Rngs(0), **args)
    dv = 8 if cls is SoftmaxAttention else 6
    m = cls(D, H, head_dim=np.int64(8), v_head_dim=dv, rngs=nnx.Rngs(0))  # NumPy ints are ints
    assert (m.dk, m.dv) == (8, dv)
    assert m(jnp.asarray(rng.standard_normal((1, 3, D)), jnp.float32)).shape == (1, 3, D)


@pytest.mark.parametrize("mixer", ["falcon-3A", "deltanet", "transformer"])
def test_layer_inputs_are_named(mixer, rng):
    """A mixer's own call checks h, segment_ids and cache (FalconLM checks its own before).  Without these
    checks: silent for integer h, for float segment ids on the decode step, for [B, 1] segment ids broadcast over a
    softmax layer's rows; elsewhere an unpacking, dot_general, jnp.pad or concatenation error from inside the
    layer."""
    m = build(mixer, window=3)
    owner = type(m).__name__
    B, T = 2, 5
    h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    cache = m.init_cache(B, 8)
    seg = jnp.zeros((B, T), jnp.int32)
    cases = [
        (TypeError, rf"^{owner}: `h` must be a floating-point array \[B, T, D\].*got dtype int32", dict(h=h.astype(jnp.int32))),
        (ValueError, rf"^{owner}: `h` must be \[B, T, D\] with D = d_model = 32; got shape \(5, 32\) \(one sequence: "
                     r"add its batch axis, h\[None\]\)", dict(h=h[0])),
        (ValueError, rf"^{owner}: `h` must be \[B, T, D\] with D = d_model = 32; got shape \(2, 5, 33\)",
         dict(h=jnp.ones((B, T, D + 1)))),
        (ValueError, r"^`segment_ids` must have shape \[B, T\] = \[2, 5\]; got \(2, 1\)", dict(segment_ids=seg[:, :1])),
        (ValueError, r"^`segment_ids` must have shape \[B, T\] = \[2, 1\]; got \(2, 5\)",
         dict(h=h[:, :1], segment_ids=seg, cache=cache)),
        (TypeError, r"^`segment_ids` must be an integer array; got dtype float32",
         dict(h=h[:, :1], segment_ids=jnp.zeros((B, 1), jnp.float32), cache=cache)),  # the decode step
        (TypeError, r"^`segment_ids` must be an integer array \[B, T\] = \[2, 5\].*got list",
         dict(segment_ids=[[0] * T] * B)),
        (ValueError, r"^`segment_ids` of dtype int64 must hold values in the int32 range .* got values in "
                     r"\[0, 4294967296\]", dict(segment_ids=np.asarray([[0, 0, 0, 2**32, 2**32]] * B))),
        (TypeError, rf"^{owner}: `cache` must be a {type(cache).__name__} \(make it with this layer's init_cache",
         dict(cache={"state": None})),
        (ValueError, r"`cache\.(state\.S|k)` has shape \(3, .* needs? \[B, .*\] = \[2, ", dict(cache=m.init_cache(B + 1, 8))),
    ]
    if mixer != "transformer":
        cases.append((ValueError, rf"^{owner}: `h` must have T >= 1 time steps; got shape \(2, 0, 32\)",
                      dict(h=h[:, :0])))
        short = type(cache)(state=cache.state, conv={n: c[:, :1] for n, c in cache.conv.items()})
        cases.append((ValueError, rf"^{owner}: `cache.conv\['q'\]` has shape \(2, 1, 32\) but this layer with "
                                  r"batch 2 needs \[B, conv_size-1, H\*d\] = \[2, 3, 32\]", dict(cache=short)))
    for error, pattern, kw in cases:
        kw.setdefault("h", h)
        with pytest.raises(error, match=pattern):
            m(kw.pop("h"), **kw)
    # the checks do not refuse the layer's own inputs and caches
    assert m(h, segment_ids=seg).shape == (B, T, D)
    y, _ = m(h[:, :1], segment_ids=seg[:, :1], cache=cache)
    assert y.shape == (B, 1, D)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_kv_cache_of_another_dtype_is_named(dtype, rng):
    """A KVCache holds keys and values in the layer's compute dtype and int32 positions, as init_cache makes them.
    Without the check an integer cache truncates the keys and values written into it (wrong outputs, no error), a
    narrower float cache rounds them, a wider one keeps its dtype in every later cache for nothing (attention casts
    the keys back to the layer's dtype), and a length of another dtype fails inside dynamic_update_slice."""
    m = build("transformer", dtype=dtype)
    B, T = 2, 3
    h = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    cache = m.init_cache(B, 8)
    fields = dict(k=cache.k, v=cache.v, length=cache.length, seg_start=cache.seg_start)
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    fix = r": make it with this layer's init_cache\(batch, max_len\), or take it from this layer's previous call\."
    for name, bad in (("k", "int32"), ("v", "int32"), ("k", other), ("v", other), ("v", "float16"),
                      ("length", "int64"), ("length", "float32"), ("seg_start", "float32"), ("seg_start", "int64")):
        want = f"{dtype}, the layer's compute dtype" if name in ("k", "v") else "int32, as init_cache makes it"
        pattern = rf"^SoftmaxAttention: `cache\.{name}` must have dtype {want}; got {bad}{fix}"
        wrong = KVCache(**{**fields, name: fields[name].astype(bad)})
        with pytest.raises(TypeError, match=pattern):
            m(h, cache=wrong)
        with pytest.raises(TypeError, match=pattern):  # traced caches are checked too
            jax.eval_shape(lambda c: m(h, cache=c), wrong)
    # the layer's own cache is accepted and comes back in its dtypes
    y, new = m(h, cache=cache)
    assert y.dtype == jnp.dtype(dtype)
    assert jax.tree_util.tree_map(lambda a: a.dtype, new) == jax.tree_util.tree_map(lambda a: a.dtype, cache)
