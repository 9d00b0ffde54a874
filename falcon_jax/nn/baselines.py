"""Baseline token mixers in the same calling convention as :class:`~falcon_jax.nn.FalconAttention`.

* :class:`SoftmaxAttention` — causal softmax attention with RoPE (LLaMA style, the paper's
  Transformer): ``y = W_o softmax(RoPE(q) RoPE(k)ᵀ/√dk + mask) v``.
* Recurrent baselines on the same-step pair ``(k_t, v_t)``, sharing the skeleton of
  :class:`~falcon_jax.nn.attention.RecurrentMixer` (projections, short conv + SiLU, gated
  per-head output RMSNorm, output projection); only normalisation, gates and rule differ:

  ==================  =====================  ==========================================================
  class               q, k normalisation     gates and rule
  ==================  =====================  ==========================================================
  RetNetMixer         none, read scale 1/√dk  fixed per-head decay γ_h = 1 − 2^(−5−h) (RetNet), no gain:
                                             ``S_t = γ_h S_{t-1} + k_t v_tᵀ``
  Mamba2Mixer         none                   Δ = softplus(W_Δ h + b_Δ), log γ = −exp(A_log)·Δ, β = Δ:
                                             ``S_t = γ_t S_{t-1} + Δ_t k_t v_tᵀ``, then ``o += D ⊙ v``
  DeltaNetMixer       ℓ2, read scale 1/√dk   β = σ(W_β h):  ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀk_t)ᵀ``
  GatedDeltaNetMixer  ℓ2, read scale 1/√dk   β = σ(W_β h), log γ = −exp(A_log)·softplus(W_Δ h + b_Δ):
                                             ``S_t = γ_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``
  ==================  =====================  ==========================================================

  Inits follow the papers: ``A_log = log U(1, 16)``, ``Δ`` at init log-uniform in
  [1e-3, 1e-1] through ``b_Δ = softplus⁻¹(Δ₀)``, Mamba-2's skip ``D = 1``.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from falcon_jax import validation as val
from falcon_jax.baselines import decayed_linear_attention, deltanet, gated_deltanet
from falcon_jax.forms.stream import segment_runs
from falcon_jax.kernels.flash_attention import flash_attention, flash_attention_reason
from falcon_jax.nn.attention import RecurrentMixer, _err, _float_dtype, check_form, resolve_head_dims
from falcon_jax.nn.cache import KVCache
from falcon_jax.nn.layers import check_real, dense, l2_normalize, make_param
from falcon_jax.sharding import current, shard_map_nonempty
from falcon_jax.validation import is_concrete


# ---------------------------------------------------------------------------- softmax attention
def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) of ``x [B, T, H, d]`` at ``positions [T]``
    (or ``[B, T]``); frequencies ``theta^(−2i/d)``, ``i < d/2``; computed in fp32 or wider."""
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"rope: x must be [B, T, H, d]; got shape {tuple(getattr(x, 'shape', ()))}.")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"SoftmaxAttention: head_dim={d} must be even for RoPE.")
    if tuple(positions.shape) not in ((x.shape[1],), (x.shape[0], x.shape[1])):
        raise ValueError(f"rope: positions must be [T] or [B, T] = ({x.shape[1]},) or {tuple(x.shape[:2])}; got "
                         f"shape {tuple(positions.shape)}.")
    check_real("rope", "theta", theta, 0.0, low_ok=False, meaning=" (the RoPE base; 0 gives NaN)")
    ft = jnp.promote_types(x.dtype, jnp.float32)
    inv = 1.0 / (theta ** (jnp.arange(0, d // 2, dtype=ft) * (2.0 / d)))
    ang = positions.astype(ft)[..., None] * inv  # [..., T, d/2]
    if ang.ndim == 2:
        ang = ang[None]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x.astype(ft)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


_warned_gather: set = set()


def _warn_if_sequence_sharded(T: int) -> None:
    """Softmax attention has no context-parallel form here (ring attention is not implemented): under a sequence
    axis XLA's partitioner gathers k and v over it, so these layers hold all T positions' keys and values."""
    ks = current()
    if ks is not None and ks.seq_axis and (T, ks.seq_shards) not in _warned_gather:
        _warned_gather.add((T, ks.seq_shards))
        warnings.warn(f"SoftmaxAttention under context parallelism ({ks.seq_shards} devices on {ks.seq_axis!r}): "
                      f"k and v are gathered over the sequence (every device holds all {T} positions' keys and "
                      f"values in these layers); ring attention is not implemented.", stacklevel=3)


ATTN_IMPLS = ("auto", "triton", "cudnn", "xla")
_warned_fallback: set = set()


def _per_shard_attention(batch: int, heads: int, packed: bool):
    """:func:`flash_attention` as ``fn(q, k, v, segment_ids)``; under :func:`falcon_jax.kernel_sharding` run once
    per device shard of rows and heads (a pallas_call under a sharded jit would otherwise see the whole batch
    gathered onto every device).  Under a sequence axis each shard holds all T positions (no ring attention)."""
    ks = current()
    if ks is None or not ks.shard_axes:
        return flash_attention
    if not ks.splits(batch, heads, "SoftmaxAttention", "the flash attention kernels"):
        return flash_attention
    b, h = ks.batch_entry, ks.head_axis
    tok = P(b, None, h)
    if packed:
        return shard_map_nonempty(flash_attention, ks.mesh, (tok, tok, tok, P(b)), tok, ks.shard_axes)
    run = shard_map_nonempty(lambda q, k, v: flash_attention(q, k, v), ks.mesh, (tok, tok, tok), tok,
                             ks.shard_axes)
    return lambda q, k, v, segment_ids: run(q, k, v)


class SoftmaxAttention(nnx.Module):
    """Causal multi-head softmax attention with RoPE, no bias (the paper's Transformer mixer)::

        q, k = RoPE(W_q h), RoPE(W_k h)      [B, T, H, dk];   v = W_v h   [B, T, H, dv]
        o_t  = Σ_{s ≤ t, seg(s)=seg(t)} softmax_s(q_t·k_s / √dk) v_s    (seg: a stretch of equal ids)
        y    = W_o o                         [B, T, D]

    ``attn_impl`` picks the attention (training and scoring calls; a call with a cache runs XLA):

    * ``"auto"``: on a GPU, without ``segment_ids`` cuDNN in bf16/fp16 and XLA in fp32; with
      ``segment_ids`` the fused Pallas flash attention (``"triton"``) in bf16/fp16/fp32, XLA where it declines
      (with a one-time warning naming the reason).  Off a GPU, XLA.
    * ``"triton"``: :func:`falcon_jax.kernels.flash_attention.flash_attention`, JAX's Pallas GPU flash
      attention with the segment ids in the kernel (memory O(T); Pallas's interpret mode off a GPU);
      ``NotImplementedError`` with the reason where it declines.
    * ``"cudnn"`` / ``"xla"``: ``jax.nn.dot_product_attention`` with that implementation; packed
      sequences as a ``[B, 1, T, T]`` mask (``jax.nn.dot_product_attention`` has no packed-segment argument).

    Under :func:`falcon_jax.kernel_sharding` the flash attention runs once per device shard of rows and
    heads.  Given ``segment_ids`` always take the segment path, even when every row is one sequence (under
    ``jit`` the ids are traced and cannot be inspected): pass ``segment_ids=None`` for cuDNN.  The decode
    cache is a :class:`KVCache`
    preallocated to ``max_len``; a call with a cache writes its T new keys/values at
    ``cache.length`` and attends causally to everything written so far in the current segment.
    Writing past ``max_len`` raises ``ValueError`` when the cache's length is concrete (eager decoding);
    under ``jit`` it cannot be read (and XLA would clamp the write index), so the outputs of a call that
    overflows are NaN instead of silently wrong.
    """

    owner = "SoftmaxAttention"

    def __init__(self, d_model: int, n_heads: int, *, head_dim=None, v_head_dim=None, rope_theta: float = 10000.0,
                 attn_impl: str = "auto", init_std: float = 0.02, out_std: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        dk, dv = resolve_head_dims(self.owner, d_model, n_heads, head_dim, v_head_dim)
        if dk % 2:
            raise _err(self.owner, "head_dim", dk, "must be even for RoPE.")
        if dv != dk:  # jax.nn.dot_product_attention (every path, the decode step too) takes one head dim
            raise _err(self.owner, "v_head_dim", dv, f"must equal head_dim={dk} in softmax attention; leave it None.")
        if attn_impl not in ATTN_IMPLS:
            raise _err(self.owner, "attn_impl", attn_impl, "must be 'auto', 'triton' (Pallas flash attention, "
                       "packed segments in the kernel), 'cudnn' or 'xla'.")
        self.d_model, self.n_heads, self.dk, self.dv = d_model, n_heads, dk, dv
        self.rope_theta = check_real(self.owner, "rope_theta", rope_theta, 0.0, low_ok=False,
                                     meaning=" (the RoPE base)")
        self.attn_impl = attn_impl
        self.dtype, self.param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
        out_std = init_std if out_std is None else out_std
        kw = dict(rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)
        self.q_proj = dense(d_model, n_heads * dk, ("embed", "heads"), std=init_std, **kw)
        self.k_proj = dense(d_model, n_heads * dk, ("embed", "heads"), std=init_std, **kw)
        self.v_proj = dense(d_model, n_heads * dv, ("embed", "heads"), std=init_std, **kw)
        self.o_proj = dense(n_heads * dv, d_model, ("heads", "embed"), std=out_std, **kw)

    def _implementation(self, q, k, v, packed: bool) -> str:
        """The attention of a call without a cache (see the class docstring)."""
        if self.attn_impl == "triton":
            reason = flash_attention_reason(q, k, v)
            if reason is not None:
                raise NotImplementedError(f"{self.owner}: attn_impl='triton' declined: {reason}; use "
                                          f"attn_impl='auto' or 'xla'.")
            return "triton"
        if self.attn_impl != "auto":
            return self.attn_impl
        if jax.default_backend() != "gpu":
            return "xla"
        if not packed:
            return "cudnn" if self.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else "xla"
        reason = flash_attention_reason(q, k, v, interpret=False)
        if reason is None:
            return "triton"
        if reason not in _warned_fallback:
            _warned_fallback.add(reason)
            warnings.warn(f"{self.owner}: attn_impl='auto' runs packed segments through XLA attention with a "
                          f"T x T mask (memory O(T^2)): the Pallas flash attention declined: {reason}.",
                          stacklevel=4)
        return "xla"

    def _attention(self, q, k, v, segment_ids):
        """Causal attention within segments, ``[B, T, H, d]`` in and out (no cache)."""
        impl = self._implementation(q, k, v, segment_ids is not None)
        if impl == "triton":
            return _per_shard_attention(q.shape[0], self.n_heads, segment_ids is not None)(q, k, v, segment_ids)
        mask = None
        if segment_ids is not None:
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B,1,T,T]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Zeros ``[B, max_len, H, d]`` in the compute dtype; ``length = 0``."""
        if max_len is None or max_len < 1:
            raise _err(self.owner, "max_len", max_len, "must be a positive int: softmax layers keep a "
                       "preallocated KV cache of max_len positions.")
        return KVCache(k=jnp.zeros((batch, max_len, self.n_heads, self.dk), self.dtype),
                       v=jnp.zeros((batch, max_len, self.n_heads, self.dv), self.dtype),
                       length=jnp.zeros((), jnp.int32), seg_start=jnp.zeros((batch,), jnp.int32))

    def _check_cache(self, cache, batch: int) -> None:
        """``cache`` must be a :class:`KVCache` of this layer's heads and ``batch`` rows (any ``max_len``), keys and
        values in the compute dtype (the new ones are written in the cache's dtype: an integer cache would truncate
        them, a narrower one round them), positions int32 (the write offsets' dtype)."""
        fix = "make it with this layer's init_cache(batch, max_len), or take it from this layer's previous call"
        if not isinstance(cache, KVCache):
            raise TypeError(f"{self.owner}: `cache` must be a KVCache ({fix}); got {type(cache).__name__}.")
        L = cache.k.shape[1] if getattr(cache.k, "ndim", 0) == 4 else "max_len"
        for name, dims, shape in (("k", "B, max_len, H, dk", (batch, L, self.n_heads, self.dk)),
                                  ("v", "B, max_len, H, dv", (batch, L, self.n_heads, self.dv)),
                                  ("seg_start", "B", (batch,)), ("length", "", ())):
            got = tuple(getattr(getattr(cache, name), "shape", ()))
            if got != shape:
                raise ValueError(f"{self.owner}: `cache.{name}` has shape {got} but this layer with batch {batch} "
                                 f"needs [{dims}] = {list(shape)}: {fix}.")
        for name, dtype, what in (("k", self.dtype, "the layer's compute dtype"),
                                  ("v", self.dtype, "the layer's compute dtype"),
                                  ("length", jnp.dtype(jnp.int32), "as init_cache makes it"),
                                  ("seg_start", jnp.dtype(jnp.int32), "as init_cache makes it")):
            got = getattr(getattr(cache, name), "dtype", None)
            if got != dtype:
                raise TypeError(f"{self.owner}: `cache.{name}` must have dtype {dtype}, {what}; got "
                                f"{got if got is not None else type(getattr(cache, name)).__name__}: {fix}.")

    def __call__(self, h: jax.Array, *, segment_ids: jax.Array | None = None, cache: KVCache | None = None):
        """h ``[B, T, D]`` -> y ``[B, T, D]``, or ``(y, cache)`` when a cache is given."""
        B, T = val.check_hidden(self.owner, h, self.d_model)
        val.check_segment_ids(segment_ids, B, T)
        if cache is not None:
            self._check_cache(cache, B)
        if segment_ids is not None:  # the masks compare ids for equality: equal ids split by a change must differ
            segment_ids = segment_runs(segment_ids)
        h = h.astype(self.dtype)
        H = self.n_heads
        q = self.q_proj(h).reshape(B, T, H, self.dk)
        k = self.k_proj(h).reshape(B, T, H, self.dk)
        v = self.v_proj(h).reshape(B, T, H, self.dv)
        start = jnp.zeros((), jnp.int32) if cache is None else cache.length
        pos = start + jnp.arange(T, dtype=jnp.int32)
        q, k = rope(q, pos, self.rope_theta), rope(k, pos, self.rope_theta)
        if cache is None:
            _warn_if_sequence_sharded(T)
            with jax.named_scope("core"):  # the attention alone, for profiles (blocks.py)
                o = self._attention(q, k, v, segment_ids)
            return self.o_proj(o.reshape(B, T, H * self.dv))
        if T > cache.max_len:  # a static check; a traced overflow would be clamped by XLA, silently
            raise ValueError(f"SoftmaxAttention: {T} new positions do not fit a KV cache of max_len="
                             f"{cache.max_len}; make the cache with max_len >= prompt + generated tokens.")
        if is_concrete(start):
            with jax.ensure_compile_time_eval():
                filled = int(start)
            if filled + T > cache.max_len:
                raise ValueError(f"SoftmaxAttention: decoding past the KV cache: {filled} positions filled + {T} "
                                 f"new > max_len={cache.max_len}; make the cache with init_cache(batch, max_len) "
                                 f"and max_len >= prompt + generated tokens.")
        # cached: write the T new positions at `start`, attend to keys j <= start + i of the query's
        # segment.  Earlier keys (from previous calls) count as the first segment of this call and
        # are visible from cache.seg_start on (the start of the segment the cache is in).
        zero = jnp.zeros((), jnp.int32)  # index dtypes must agree (int64 literals under x64)
        kc = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (zero, start, zero, zero))
        vc = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (zero, start, zero, zero))
        L = cache.max_len
        key_pos = jnp.arange(L, dtype=jnp.int32)
        old = (key_pos[None, :] < start) & (key_pos[None, :] >= cache.seg_start[:, None])  # [B, L]
        mask = (key_pos[None, :] <= pos[:, None])[None] & ((key_pos[None, :] >= start)[None] | old[:, None, :])
        seg_start = cache.seg_start
        if segment_ids is not None:
            seg = segment_ids.astype(jnp.int32)
            new_ids = jax.lax.dynamic_update_slice(jnp.full((B, L), -1, jnp.int32), seg, (zero, start))
            same_new = (new_ids[:, None, :] == seg[:, :, None]) | (key_pos < start)[None, None, :]
            same_old = (seg == seg[:, :1])[:, :, None] | (key_pos >= start)[None, None, :]
            mask = mask & same_new & same_old  # [B, T, L]
            change = jnp.concatenate([jnp.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
            last_change = jnp.max(jnp.where(change, jnp.arange(T, dtype=jnp.int32), -1), axis=1)
            seg_start = jnp.where(last_change >= 0, start + last_change, seg_start)
        with jax.named_scope("core"):
            o = jax.nn.dot_product_attention(q, kc.astype(self.dtype), vc.astype(self.dtype), mask=mask[:, None],
                                             implementation="xla")
        y = self.o_proj(o.reshape(B, T, H * self.dv))
        # a traced length past max_len: the write above was clamped and the keys are wrong; say so with NaN
        y = jnp.where(start + T > L, jnp.asarray(jnp.nan, y.dtype), y)
        return y, KVCache(k=kc, v=vc, length=start + T, seg_start=seg_start)


# ---------------------------------------------------------------------------- recurrent baselines
def _dt_bias_init(rng_key, H, dtype, low=1e-3, high=1e-1):
    """b_Δ with softplus(b_Δ) = Δ₀ log-uniform in [low, high] (the Mamba-2 init)."""
    u = jax.random.uniform(rng_key, (H,), jnp.float32)
    dt = jnp.exp(jnp.log(low) + u * (jnp.log(high) - jnp.log(low)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _a_log_init(rng_key, H, dtype):
    return jnp.log(jax.random.uniform(rng_key, (H,), jnp.float32, 1.0, 16.0)).astype(dtype)


class _RuleOptions:
    form: str
    chunk_size: int
    impl: str

    def _set_rule_options(self, form, chunk_size, impl):
        check_form(self.owner, form, chunk_size)
        self.form, self.chunk_size, self.impl = form, chunk_size, impl

    def _call_kwargs(self, step, initial_state, segment_ids):
        # a decode step is a length-1 call of the recurrent form from the carried state
        return dict(form="recurrent" if step else self.form, chunk_size=self.chunk_size, impl=self.impl,
                    initial_state=initial_state, return_final_state=initial_state is not None,
                    segment_ids=None if step else segment_ids)


class RetNetMixer(_RuleOptions, RecurrentMixer):
    """RetNet-style decayed linear attention (``"retnet"`` / ``"linear_attention"``): a fixed,
    non-learned decay per head ``γ_h = 1 − 2^(−5−h)``, unit write gain, keys unnormalised,
    read scale ``1/√dk``.  See the module table."""

    owner = "RetNetMixer"

    def __init__(self, d_model, n_heads, *, form="chunk", chunk_size=64, impl="auto", **kw):
        self._set_rule_options(form, chunk_size, impl)
        super().__init__(d_model, n_heads, **kw)

    def log_decay(self):
        h = np.arange(self.n_heads, dtype=np.float64)
        return np.log1p(-(2.0 ** (-5.0 - h)))

    def _gates(self, h):
        B, T, _ = h.shape
        gdt = _float_dtype(self.dtype)
        return {"log_decay": jnp.broadcast_to(jnp.asarray(self.log_decay(), gdt), (B, T, self.n_heads))}

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        return decayed_linear_attention(q, k, v, gates["log_decay"], scale=self.dk ** -0.5,
                                        **self._call_kwargs(step, initial_state, segment_ids))


class Mamba2Mixer(_RuleOptions, RecurrentMixer):
    """Mamba-2-style (SSD) mixer (``"mamba2"``): data-dependent scalar decay per head and a
    Δ-scaled write, plus the skip ``o += D ⊙ v``.  q, k play Mamba-2's C and B.  Extra
    parameters ``dt_proj [D, H]``, ``dt_bias [H]``, ``A_log [H]``, ``D_skip [H]``."""

    owner = "Mamba2Mixer"

    def __init__(self, d_model, n_heads, *, form="chunk", chunk_size=64, impl="auto", rngs: nnx.Rngs, **kw):
        self._set_rule_options(form, chunk_size, impl)
        super().__init__(d_model, n_heads, rngs=rngs, **kw)
        H, std = self.n_heads, kw.get("init_std", 0.02)
        pd = self.param_dtype
        self.dt_proj = dense(d_model, H, ("embed", "heads"), std=std, rngs=rngs, dtype=self.dtype, param_dtype=pd)
        self.dt_bias = make_param(rngs, lambda k, s, d: _dt_bias_init(k, s[0], d), (H,), ("heads",), pd)
        self.A_log = make_param(rngs, lambda k, s, d: _a_log_init(k, s[0], d), (H,), ("heads",), pd)
        self.D_skip = make_param(rngs, nnx.initializers.ones, (H,), ("heads",), pd)

    def _gates(self, h):
        gdt = _float_dtype(self.dtype)
        dt = jax.nn.softplus(self.dt_proj(h).astype(gdt) + self.dt_bias[...].astype(gdt))
        return {"log_decay": -jnp.exp(self.A_log[...].astype(gdt)) * dt, "beta": dt}

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        return decayed_linear_attention(q, k, v, gates["log_decay"], gates["beta"],
                                        **self._call_kwargs(step, initial_state, segment_ids))

    def _post(self, o, v):
        return o + self.D_skip[...].astype(o.dtype)[:, None] * v.astype(o.dtype)


class DeltaNetMixer(_RuleOptions, RecurrentMixer):
    """DeltaNet (``"deltanet"``): ℓ2-normalised q, k; ``β = σ(W_β h)``; no decay.  Extra
    parameter ``beta_proj [D, H]``."""

    owner = "DeltaNetMixer"

    def __init__(self, d_model, n_heads, *, form="chunk", chunk_size=64, impl="auto", rngs: nnx.Rngs, **kw):
        self._set_rule_options(form, chunk_size, impl)
        super().__init__(d_model, n_heads, rngs=rngs, **kw)
        self.beta_proj = dense(d_model, self.n_heads, ("embed", "heads"), std=kw.get("init_std", 0.02),
                               rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)

    def _normalize_qk(self, q, k):
        return l2_normalize(q, self.norm_eps), l2_normalize(k, self.norm_eps)

    def _gates(self, h):
        return {"beta": jax.nn.sigmoid(self.beta_proj(h).astype(_float_dtype(self.dtype)))}

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        return deltanet(q, k, v, gates["beta"], scale=self.dk ** -0.5,
                        **self._call_kwargs(step, initial_state, segment_ids))


class GatedDeltaNetMixer(DeltaNetMixer):
    """Gated DeltaNet (``"gated_deltanet"``): DeltaNet plus Mamba-2's decay
    ``log γ = −exp(A_log)·softplus(W_Δ h + b_Δ)``.  Extra parameters ``beta_proj [D, H]``,
    ``dt_proj [D, H]``, ``dt_bias [H]``, ``A_log [H]``."""

    owner = "GatedDeltaNetMixer"

    def __init__(self, d_model, n_heads, *, rngs: nnx.Rngs, **kw):
        super().__init__(d_model, n_heads, rngs=rngs, **kw)
        H, pd = self.n_heads, self.param_dtype
        self.dt_proj = dense(d_model, H, ("embed", "heads"), std=kw.get("init_std", 0.02), rngs=rngs,
                             dtype=self.dtype, param_dtype=pd)
        self.dt_bias = make_param(rngs, lambda k, s, d: _dt_bias_init(k, s[0], d), (H,), ("heads",), pd)
        self.A_log = make_param(rngs, lambda k, s, d: _a_log_init(k, s[0], d), (H,), ("heads",), pd)

    def _gates(self, h):
        gdt = _float_dtype(self.dtype)
        dt = jax.nn.softplus(self.dt_proj(h).astype(gdt) + self.dt_bias[...].astype(gdt))
        return {"beta": jax.nn.sigmoid(self.beta_proj(h).astype(gdt)),
                "log_decay": -jnp.exp(self.A_log[...].astype(gdt)) * dt}

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        return gated_deltanet(q, k, v, gates["beta"], gates["log_decay"], scale=self.dk ** -0.5,
                              **self._call_kwargs(step, initial_state, segment_ids))
