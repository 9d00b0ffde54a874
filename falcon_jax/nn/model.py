"""The language model: :class:`FalconLM`, its loss, decoding and parameter counts.

    h_0 = E[tokens]                               E [V, D], tied with the output
    h_l = DecoderBlock_l(h_{l-1})                  l = 1..L, mixer per layer from the config
    logits = RMSNorm(h_L) Eᵀ                       [B, T, V], fp32 (fp64 under fp64 compute)

Decoding (O(1) memory for the recurrent layers)::

    cache = model.init_cache(B, max_len)           # per layer: FalconState + conv state, or a KV cache
    logits, cache = model(prompt, cache=cache)     # prefill (chunk form)
    logits, cache = model(next_tok[:, None], cache=cache)   # one step (falcon_step / length-1 rule)
    tokens = model.generate(prompt, 32, greedy=True)        # jit-compiled lax.scan loop
    tokens = model.generate(prompts, 32, lengths=lengths, greedy=True)   # rows of different lengths
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from falcon_jax.nn.blocks import DecoderBlock
from falcon_jax.nn.cache import KVCache, LMCache
from falcon_jax.nn.config import LMConfig, expected_param_count
from falcon_jax.nn.layers import RMSNorm, make_param, normal_init
from falcon_jax.sharding import constrain_batch
from falcon_jax.validation import check_segment_ids, concrete_int_range, is_concrete


class FalconLM(nnx.Module):
    """Decoder-only LM over a stack of :class:`~falcon_jax.nn.blocks.DecoderBlock` (pre-norm
    RMSNorm, SwiGLU, no bias, no dropout) with tied input/output embeddings.

    Parameters: ``embedding [V, D]`` (logical axes ``("vocab", "embed")``), ``layers[i]``
    (mixer, two norms, MLP), ``final_norm.scale [D]``.
    """

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LMConfig):
            raise TypeError(f"FalconLM: config must be an LMConfig (e.g. LMConfig.preset('falcon-1A-tiny')); "
                            f"got {type(config).__name__}.")
        self.config = config
        dt, pdt = config.compute_dtype, config.storage_dtype
        self.dtype = dt
        self.embedding = make_param(rngs, normal_init(config.init_std), (config.vocab_size, config.d_model),
                                    ("vocab", "embed"), pdt)
        self.layers = nnx.List([DecoderBlock(config, spec, rngs=rngs) for spec in config.layer_specs()])
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)

    @property
    def logits_dtype(self):
        return jnp.promote_types(self.dtype, jnp.float32)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens ``[B, T]`` int -> ``[B, T, D]`` in the compute dtype.  An id outside ``[0, vocab_size)``
        (only possible for traced tokens: concrete ones are checked) embeds as NaN, so the logits and the
        loss show it, instead of a negative id wrapping around to the end of the vocabulary."""
        tokens = jnp.where(tokens < 0, self.config.vocab_size, tokens)
        return jnp.take(self.embedding[...], tokens, axis=0, mode="fill").astype(self.dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """``[B, T, D]`` -> logits ``[B, T, V]`` in fp32 (the tied embedding, fp32 accumulation)."""
        return jnp.einsum("btd,vd->btv", h, self.embedding[...].astype(self.dtype),
                          preferred_element_type=self.logits_dtype)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None, cache: LMCache | None = None):
        """tokens ``[B, T]`` -> logits ``[B, T, V]``; with ``cache``: ``(logits, new_cache)``.

        ``segment_ids [B, T]`` packs several sequences in a row: no mixer passes information
        across a change of id.  With a cache, the tokens continue the cached sequence (its last
        segment); a one-token decode step always continues it.
        """
        if getattr(tokens, "ndim", None) != 2 or tokens.shape[1] < 1:
            raise ValueError(f"FalconLM: tokens must be [batch, time] ints with time >= 1; got "
                             f"{tuple(tokens.shape) if hasattr(tokens, 'shape') else type(tokens).__name__}.")
        check_token_ids("FalconLM", tokens, self.config.vocab_size)
        check_segment_ids(segment_ids, *tokens.shape)
        if cache is not None:
            self._check_cache(cache, tokens.shape[0])
        # constrain_batch: rows stay on their devices under a sharded step (no-op otherwise)
        x = constrain_batch(self.embed(tokens))
        new_layers = []
        for i, layer in enumerate(self.layers):
            if cache is None and self.config.remat:  # recomputed in the backward pass, not stored
                x = nnx.remat(lambda layer, x: layer(x, segment_ids=segment_ids))(layer, x)
            elif cache is None:
                x = layer(x, segment_ids=segment_ids)
            else:
                x, c = layer(x, segment_ids=segment_ids, cache=cache.layers[i])
                new_layers.append(c)
            x = constrain_batch(x)
        logits = constrain_batch(self.unembed(self.final_norm(x)), split_last=True)
        if cache is None:
            return logits
        return logits, LMCache(layers=tuple(new_layers), length=cache.length + tokens.shape[1])

    def _check_cache(self, cache, batch: int) -> None:
        """``cache`` must be the layout of ``self.init_cache(batch, max_len)`` (shapes only: traced caches too)."""
        fix = "make it with this model's init_cache(batch, max_len), or take it from this model's previous call"
        if not isinstance(cache, LMCache):
            raise TypeError(f"FalconLM: `cache` must be an LMCache ({fix}); got {type(cache).__name__}.")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"FalconLM: `cache` holds {len(cache.layers)} layer caches but this model has "
                             f"{len(self.layers)} layers: it belongs to another model; {fix}.")
        for i, (layer, got) in enumerate(zip(self.layers, cache.layers)):
            max_len = got.max_len if isinstance(got, KVCache) else 1
            want = jax.eval_shape(lambda layer=layer, max_len=max_len: layer.init_cache(batch, max_len))
            got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
            want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
            if got_tree != want_tree:
                raise ValueError(f"FalconLM: `cache.layers[{i}]` is a {type(got).__name__} of another layout than "
                                 f"layer {i}'s {type(want).__name__}: the "
                                 f"cache belongs to another model; {fix}.")
            for (path, g), (_, w) in zip(got_leaves, want_leaves):
                if tuple(getattr(g, "shape", ())) != tuple(w.shape):
                    raise ValueError(f"FalconLM: `cache.layers[{i}]{jax.tree_util.keystr(path)}` has shape "
                                     f"{tuple(getattr(g, 'shape', ()))} but layer {i} with batch {batch} needs "
                                     f"{tuple(w.shape)}: the cache was made for another batch size or model; "
                                     f"{fix}.")

    # ------------------------------------------------------------------ decoding
    def init_cache(self, batch: int, max_len: int) -> LMCache:
        """A fresh cache for ``batch`` sequences of at most ``max_len`` tokens (prompt + generated).
        Only softmax layers use ``max_len`` (a preallocated KV cache); recurrent layers keep a
        fixed-size state."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"init_cache: {name} must be an int >= 1; got {value!r}.")
        return LMCache(layers=tuple(layer.init_cache(batch, max_len) for layer in self.layers),
                       length=jnp.zeros((), jnp.int32))

    def prefill(self, tokens: jax.Array, max_len: int) -> tuple[jax.Array, LMCache]:
        """Run the prompt ``[B, P]`` through a fresh cache; returns ``(logits [B, P, V], cache)``."""
        return self(tokens, cache=self.init_cache(tokens.shape[0], max_len))

    def decode_step(self, token: jax.Array, cache: LMCache) -> tuple[jax.Array, LMCache]:
        """One token ``[B]`` -> ``(logits [B, V], cache)``."""
        if getattr(token, "ndim", None) != 1:
            raise ValueError(f"FalconLM.decode_step: token must be [batch] ints, one token per row (several tokens "
                             f"[batch, time] go through model(tokens, cache=cache)); got "
                             f"{tuple(token.shape) if hasattr(token, 'shape') else type(token).__name__}.")
        logits, cache = self(token[:, None], cache=cache)
        return logits[:, 0], cache

    def generate(self, tokens: jax.Array, max_new_tokens: int, *, lengths=None, pad_id: int = 0,
                 temperature: float = 1.0, greedy: bool = False, rng: jax.Array | None = None) -> jax.Array:
        """Autoregressive generation: prefill ``tokens [B, P]``, then ``max_new_tokens`` decode
        steps in one jit-compiled ``lax.scan``.  Returns ``[B, P + max_new_tokens]`` int32
        (the prompt followed by the generated tokens).

        Prompts of different lengths: pass them right-padded in ``tokens`` with ``lengths [B]`` (row b's
        prompt is ``tokens[b, :lengths[b]]``, 1 <= lengths[b] <= P).  Each row then continues exactly as
        it would alone (the same tokens under ``greedy``; logits equal up to rounding): the rows run
        left-aligned to the end, the padding in a segment of its own that no layer passes on.  The result
        keeps the right-padded layout: row b is its prompt, its ``max_new_tokens`` new tokens, then
        ``pad_id`` up to ``P + max_new_tokens``.

        ``greedy=True`` takes the argmax; otherwise samples ``softmax(logits / temperature)``
        (``temperature`` finite and > 0) with ``rng`` (a ``jax.random.key``).  Token ids must be ints in ``[0, vocab_size)``:
        concrete prompts are checked, but under a caller's ``jax.jit`` the ids cannot be read, and an id outside
        the range gives NaN logits; a row whose logits are NaN generates -1 at every step (not a token id).
        """
        if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0; got {max_new_tokens!r}.")
        max_new_tokens = int(max_new_tokens)  # a jit-static argument: one compile for 2 and np.int64(2)
        if not hasattr(tokens, "dtype"):
            tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise ValueError(f"generate: tokens must be a [batch, prompt_len >= 1] prompt; got shape "
                             f"{tuple(tokens.shape)}.")
        B, P = tokens.shape
        V = self.config.vocab_size
        check_token_ids("generate", tokens, V)
        tokens = jnp.asarray(tokens, jnp.int32)
        if isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < V:
            raise ValueError(f"generate: pad_id must be a token id in [0, vocab_size={V}); got {pad_id!r}.")
        if lengths is not None:
            lengths = _check_lengths(lengths, B, P)
            tokens = jnp.where(jnp.arange(P)[None] < lengths[:, None], tokens, pad_id)
        if not isinstance(greedy, (bool, np.bool_)):  # the string 'false' would decode greedily
            raise TypeError(f"generate: greedy must be True or False; got {greedy!r}.")
        if max_new_tokens == 0:
            return tokens
        if not greedy:
            if rng is None:
                raise ValueError("generate: pass rng=jax.random.key(seed) to sample, or greedy=True.")
            if not (isinstance(rng, jax.Array) and ((jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ())
                                                    or (rng.dtype == jnp.uint32 and rng.shape == (2,)))):
                got = type(rng).__name__ + (f" of dtype {rng.dtype}" if hasattr(rng, "dtype") else "") + (
                    f" and shape {tuple(rng.shape)}" if hasattr(rng, "shape") else "")
                raise TypeError(f"generate: rng must be one JAX random key (jax.random.key(seed)); got {got}.")
            if isinstance(temperature, bool) or np.ndim(temperature) != 0 \
                    or not (np.issubdtype(np.asarray(temperature).dtype, np.integer)
                            or np.issubdtype(np.asarray(temperature).dtype, np.floating)):
                raise TypeError(f"generate: temperature must be one real number > 0; got {temperature!r}.")
            # Sampling runs in fp32: a temperature that is inf there samples uniformly (the model ignored), one
            # below fp32's smallest normal number divides by zero or a denormal.
            f32 = np.finfo(np.float32)
            if not float(f32.tiny) <= float(temperature) <= float(f32.max):
                raise ValueError(f"generate: temperature must be finite and > 0 in float32 (from {float(f32.tiny):.3g} "
                                 f"to {float(f32.max):.3g}) when sampling; got {temperature!r} (use greedy=True for "
                                 "argmax decoding).")
        else:
            rng = jax.random.key(0)  # unused
        graphdef, state = nnx.split(self)
        return _generate(graphdef, state, tokens, lengths, rng, jnp.asarray(temperature, jnp.float32),
                         max_new_tokens=max_new_tokens, greedy=bool(greedy), pad_id=int(pad_id))


def check_token_ids(owner: str, tokens, vocab_size: int, *, what: str = "token", fix: str = "") -> None:
    """``tokens`` must be an integer array; concrete ids must lie in ``[0, vocab_size)`` (TypeError /
    ValueError naming the values found; ``what`` names the ids, ``fix`` ends the message).  Traced ids cannot
    be read: :meth:`FalconLM.embed` and :func:`cross_entropy` make an out-of-range one NaN."""
    dtype = getattr(tokens, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{owner}: tokens must be integer token ids (int32); got "
                        f"{'dtype ' + str(dtype) if dtype is not None else type(tokens).__name__}"
                        + (" (ids stored as floats: cast them with .astype(jnp.int32))"
                           if dtype is not None and jnp.issubdtype(dtype, jnp.floating) else "") + ".")
    found = concrete_int_range(tokens)
    if found is None:  # traced or empty
        return
    lo, hi = found
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{owner}: {what} ids must be in [0, vocab_size={vocab_size}); got ids from {lo} to "
                         f"{hi}.{fix}")


def _check_lengths(lengths, B: int, P: int) -> jax.Array:
    """``lengths [B]`` ints with ``1 <= lengths[b] <= P`` (concrete: checked; traced: clipped into range)."""
    if not hasattr(lengths, "dtype"):
        lengths = np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer) or tuple(lengths.shape) != (B,):
        raise TypeError(f"generate: lengths must be {B} ints (one prompt length per row, shape [B]); got "
                        f"shape {tuple(lengths.shape)} dtype {lengths.dtype}.")
    if is_concrete(lengths):
        with jax.ensure_compile_time_eval():
            lo, hi = (int(x) for x in np.asarray(jnp.stack([jnp.min(lengths), jnp.max(lengths)])))
        if lo < 1 or hi > P:
            raise ValueError(f"generate: lengths must be in [1, {P}] (the prompt's width P = {P}); got "
                             f"lengths from {lo} to {hi}.")
    return jnp.clip(jnp.asarray(lengths, jnp.int32), 1, P)


def _sample(logits, key, temperature, greedy):
    """One token per row of ``logits [B, V]``; -1 for a row with a NaN logit (argmax and categorical would give a
    valid-looking id, 0)."""
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        # the largest logit subtracted first: a small temperature then sends the others to -inf, never the
        # largest to inf (inf - inf would be NaN)
        logits32 = logits.astype(jnp.float32)
        scaled = (logits32 - jnp.max(logits32, axis=-1, keepdims=True)) / temperature
        tok = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.isnan(logits).any(axis=-1), -1, tok)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "pad_id"))
def _generate(graphdef, state, tokens, lengths, rng, temperature, *, max_new_tokens, greedy, pad_id):
    model = nnx.merge(graphdef, state)
    B, P = tokens.shape
    keys = jax.random.split(rng, max_new_tokens)
    if lengths is None:
        prompt, segment_ids = tokens, None
    else:  # right-align the rows: padding first, in segment 0; the prompt in segment 1 starts fresh
        src = jnp.arange(P)[None] - (P - lengths)[:, None]
        real = src >= 0
        prompt = jnp.where(real, jnp.take_along_axis(tokens, jnp.maximum(src, 0), axis=1), pad_id)
        segment_ids = real.astype(jnp.int32)
    logits, cache = model(prompt, segment_ids=segment_ids, cache=model.init_cache(B, P + max_new_tokens))
    first = _sample(logits[:, -1], keys[0], temperature, greedy)

    def body(carry, key):
        tok, cache = carry
        logits, cache = model(tok[:, None], cache=cache)
        nxt = _sample(logits[:, 0], key, temperature, greedy)
        return (nxt, cache), nxt

    _, rest = jax.lax.scan(body, (first, cache), keys[1:])
    new = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)  # [B, N]
    if lengths is None:
        return jnp.concatenate([tokens, new], axis=1)
    # right-padded result: row b = prompt (lengths[b]), its N new tokens, pad_id
    j = jnp.arange(P + max_new_tokens)[None]
    in_prompt = j < lengths[:, None]
    in_new = ~in_prompt & (j < lengths[:, None] + max_new_tokens)
    both = jnp.concatenate([tokens, new], axis=1)
    idx = jnp.where(in_prompt, j, jnp.where(in_new, j - lengths[:, None] + P, 0))
    return jnp.where(in_prompt | in_new, jnp.take_along_axis(both, idx, axis=1), pad_id)


# ---------------------------------------------------------------------- loss
def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy (nats) of ``logits [..., V]`` against ``targets [...]`` over
    the positions where ``mask`` (same shape as targets) is true; computed in fp32 or wider.

    ``mask`` selects positions (any nonzero value counts as true); it does not weight them.  Target ids must lie
    in ``[0, V)`` (positions to leave out go in ``mask``): concrete ones are checked; a traced one outside makes
    the loss NaN where the mask keeps it (a negative id would otherwise index from the end)."""
    return _cross_entropy("cross_entropy", logits, targets, mask, "mask")


def _cross_entropy(owner: str, logits, targets, mask, mask_name: str):
    if not hasattr(targets, "dtype") or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"{owner}: `targets` must be integer token ids; got "
                        f"{'dtype ' + str(targets.dtype) if hasattr(targets, 'dtype') else type(targets).__name__}.")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{owner}: `targets` must be `logits` [..., V] without its last axis, "
                         f"{tuple(logits.shape[:-1])}; got {tuple(targets.shape)}.")
    if mask is not None and tuple(getattr(mask, "shape", ())) != tuple(targets.shape):
        raise ValueError(f"{owner}: `{mask_name}` must have the shape of `targets` {tuple(targets.shape)}; got "
                         f"{tuple(getattr(mask, 'shape', ()))}.")
    if not hasattr(logits, "dtype") or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(f"{owner}: `logits` must be floating point; got "
                        f"{'dtype ' + str(logits.dtype) if hasattr(logits, 'dtype') else type(logits).__name__}.")
    V = logits.shape[-1]
    check_token_ids(owner, targets, V, what="target",
                    fix=f" Every target must be a token id; leave positions out with `{mask_name}`.")
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # "fill": an id outside [0, V) reads NaN (negative ids are moved past the end first, not wrapped)
    idx = jnp.where(targets < 0, V, targets)[..., None]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), idx, axis=-1, mode="fill")[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(bool)  # a mask, not weights: 5 or -1 count as true, as in lm_loss
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask, dtype=nll.dtype), 1.0)


def lm_loss(model: FalconLM, tokens: jax.Array, *, segment_ids=None, loss_mask=None) -> jax.Array:
    """Next-token loss of ``tokens [B, T]`` (``T >= 2``): position t predicts t+1; pairs that cross a
    segment boundary and pairs whose *target* has ``loss_mask`` (``[B, T]``) false are left out.  The ids
    are checked as :func:`cross_entropy`'s targets (the last column is only a target)."""
    if getattr(tokens, "ndim", None) != 2 or tokens.shape[1] < 2:
        raise ValueError(f"lm_loss: `tokens` must be [B, T] with T >= 2 (position t predicts t + 1); got "
                         f"{'shape ' + str(tuple(tokens.shape)) if hasattr(tokens, 'shape') else type(tokens).__name__}.")
    if loss_mask is not None and tuple(getattr(loss_mask, "shape", ())) != tuple(tokens.shape):
        raise ValueError(f"lm_loss: `loss_mask` must have the shape of `tokens` {tuple(tokens.shape)}; got "
                         f"{tuple(getattr(loss_mask, 'shape', ()))}.")
    check_token_ids("lm_loss", tokens, model.config.vocab_size, what="target",
                    fix=" Every target must be a token id; leave positions out with `loss_mask`.")
    check_segment_ids(segment_ids, *tokens.shape)  # all of them: the last column only decides the last pair
    logits = model(tokens[:, :-1], segment_ids=None if segment_ids is None else segment_ids[:, :-1])
    mask = jnp.ones(tokens[:, 1:].shape, bool)
    if segment_ids is not None:
        mask &= segment_ids[:, 1:] == segment_ids[:, :-1]
    if loss_mask is not None:
        mask &= loss_mask[:, 1:].astype(bool)
    return _cross_entropy("lm_loss", logits, tokens[:, 1:], mask, "loss_mask")


# ---------------------------------------------------------------------- parameter counts
def _group(path: str) -> str:
    if "embedding" in path:
        return "embedding"
    if ".mixer" in path or "'mixer'" in path:
        return "mixers"
    if ".mlp" in path or "'mlp'" in path:
        return "mlp"
    return "norms"


def param_counts(model: FalconLM) -> dict[str, int]:
    """Parameters of a built (or ``nnx.eval_shape``-abstract) model, counted from
    ``nnx.state(model, nnx.Param)``, grouped as embedding / mixers / mlp / norms / total."""
    counts = {"embedding": 0, "mixers": 0, "mlp": 0, "norms": 0}
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    for path, leaf in leaves:
        counts[_group(jax.tree_util.keystr(path))] += math.prod(leaf.shape)
    counts["total"] = sum(counts.values())
    return counts


def abstract_model(config: LMConfig) -> FalconLM:
    """The model with ``jax.ShapeDtypeStruct`` parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: FalconLM(config, rngs=nnx.Rngs(0)))


def summarize_params(config: LMConfig | str, *, print_fn=print) -> dict[str, int]:
    """Count (abstractly) and print the parameters of a config or preset name; returns the counts."""
    if isinstance(config, str):
        name, config = config, LMConfig.preset(config)
    else:
        name = config.mixer
    counts = param_counts(abstract_model(config))
    if print_fn is not None:
        formula = expected_param_count(config)
        parts = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in counts.items() if k != "total")
        print_fn(f"{name}: {counts['total'] / 1e6:.2f}M parameters ({parts})"
                 + ("" if formula == counts else f"  [formula says {formula['total']}]"))
    return counts
