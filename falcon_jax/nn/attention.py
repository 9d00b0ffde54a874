"""The Falcon token mixer (docs/layers.md) and the skeleton it shares with the recurrent baselines.

Every recurrent mixer in this package computes, from its input ``h [B, T, D]``::

    q = SiLU(conv_q(W_q h)),  k = SiLU(conv_k(W_k h)),  v = SiLU(conv_v(W_v h))   [B,T,H,d]
        (the short causal depthwise conv + SiLU only when conv_size > 0)
    q, k <- per-head weightless normalisation (rule-specific)
    o    = rule(q, k, v, gates(h))                                              [B,T,H,dv]
    y    = W_o( RMSNorm_head(o) · w_norm  ⊙  SiLU(W_g h) )                        [B,T,D]

with bias-free projections.  Only the normalisation, the gates and the rule differ
(:class:`FalconAttention` here, the baselines in :mod:`falcon_jax.nn.baselines`).

Calling convention of every mixer (also :class:`~falcon_jax.nn.baselines.SoftmaxAttention`)::

    y = mixer(h, segment_ids=None)                  # training / scoring
    y, cache = mixer(h, cache=cache)                # continue from a cache: a prefill when
                                                    # T > 1 (chunk form), a decode step when T = 1
    cache = mixer.init_cache(batch, max_len)        # a fresh cache
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from falcon_jax import validation as val
from falcon_jax.falcon import falcon, falcon_step
from falcon_jax.nn.cache import RecurrentCache
from falcon_jax.nn.config import FLOAT_DTYPES, is_pair_of_reals
from falcon_jax.nn.layers import ShortConv, check_real, check_size, dense, l2_normalize, make_param, rms_normalize
from falcon_jax.rules import PER_COLUMN_VARIANTS, VARIANTS
from falcon_jax.state import empty_state


def _err(owner: str, field: str, value, fix: str) -> ValueError:
    return ValueError(f"{owner}: {field}={value!r} {fix}")


def check_float_dtype(owner: str, field: str, dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype if it is bf16, fp16, fp32 or fp64, else a ValueError naming ``owner.field``."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in FLOAT_DTYPES:
        raise _err(owner, field, dtype, f"must be one of {', '.join(str(d) for d in FLOAT_DTYPES)}.")
    return dt


def check_form(owner: str, form, chunk_size) -> None:
    """A recurrent mixer's ``form`` and ``chunk_size`` (a power of two, not a bool)."""
    if form not in ("recurrent", "parallel", "chunk"):
        raise _err(owner, "form", form, "must be 'recurrent', 'parallel' or 'chunk'.")
    if isinstance(chunk_size, bool) or not (isinstance(chunk_size, int) and chunk_size >= 1
                                            and chunk_size & (chunk_size - 1) == 0):
        raise _err(owner, "chunk_size", chunk_size, "must be a power of two (e.g. 64).")


def resolve_head_dims(owner: str, d_model: int, n_heads: int, head_dim, v_head_dim) -> tuple[int, int]:
    """``(dk, dv)``: ``head_dim`` defaults to ``d_model // n_heads`` (which must divide).  Every size is an
    int >= 1: with ``n_heads=0`` a layer would output 0 whatever its input."""
    d_model, n_heads = check_size(owner, "d_model", d_model), check_size(owner, "n_heads", n_heads)
    head_dim = None if head_dim is None else check_size(owner, "head_dim", head_dim)
    v_head_dim = None if v_head_dim is None else check_size(owner, "v_head_dim", v_head_dim)
    if head_dim is None:
        if d_model % n_heads:
            raise _err(owner, "n_heads", n_heads, f"does not divide d_model={d_model}: pick n_heads dividing "
                       "d_model or set head_dim explicitly.")
        head_dim = d_model // n_heads
    return head_dim, head_dim if v_head_dim is None else v_head_dim


def _float_dtype(dtype):
    """The dtype the rules' states run in for this compute dtype (fp32, or fp64 under fp64)."""
    return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


class RecurrentMixer(nnx.Module):
    """The shared skeleton (see the module docstring).  Subclasses define ``_normalize_qk``,
    ``_gates(h) -> dict`` and ``_rule(q, k, v, gates, **call)`` and set ``self.tail``
    (the rule's window tail length, 0 except for Falcon-3/3A).

    Parameters and logical axes: ``q_proj``/``k_proj`` ``[D, H·dk]``, ``v_proj``/``g_proj``
    ``[D, H·dv]`` (``("embed", "heads")``), ``o_proj [H·dv, D]`` (``("heads", "embed")``),
    ``o_norm.scale [dv]`` (``("norm",)``), ``conv_{q,k,v}.kernel [K, C]`` (``("conv", "heads")``).
    Init: projections ~ N(0, init_std²), ``o_proj`` ~ N(0, out_std²).
    """

    owner = "RecurrentMixer"

    def __init__(self, d_model: int, n_heads: int, *, head_dim=None, v_head_dim=None, conv_size: int = 4,
                 init_std: float = 0.02, out_std: float | None = None, norm_eps: float = 1e-6,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        dk, dv = resolve_head_dims(self.owner, d_model, n_heads, head_dim, v_head_dim)
        if isinstance(conv_size, bool) or not isinstance(conv_size, int) or conv_size < 0 or conv_size == 1:
            raise _err(self.owner, "conv_size", conv_size, "must be 0 (no short convolution) or an int >= 2 "
                       "(the paper uses 4).")
        self.d_model, self.n_heads, self.dk, self.dv = d_model, n_heads, dk, dv
        self.conv_size = conv_size
        self.norm_eps = check_real(self.owner, "norm_eps", norm_eps, 0.0, low_ok=False,
                                   meaning=" (the q/k and output norms' epsilon; 0 would divide an all-zero row, "
                                           "e.g. the output at position 0, by zero: NaN)")
        check_real(self.owner, "init_std", init_std, 0.0, low_ok=False, meaning=" (the projections' initial "
                   "standard deviation)")
        if out_std is not None:
            check_real(self.owner, "out_std", out_std, 0.0, meaning=" (the output projection's; 0: zero-initialised)")
        self.dtype, self.param_dtype = check_float_dtype(self.owner, "dtype", dtype), check_float_dtype(
            self.owner, "param_dtype", param_dtype)
        self.tail = 0
        out_std = init_std if out_std is None else out_std
        kw = dict(rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)
        self.q_proj = dense(d_model, n_heads * dk, ("embed", "heads"), std=init_std, **kw)
        self.k_proj = dense(d_model, n_heads * dk, ("embed", "heads"), std=init_std, **kw)
        self.v_proj = dense(d_model, n_heads * dv, ("embed", "heads"), std=init_std, **kw)
        self.g_proj = dense(d_model, n_heads * dv, ("embed", "heads"), std=init_std, **kw)
        self.o_proj = dense(n_heads * dv, d_model, ("heads", "embed"), std=out_std, **kw)
        self.o_norm_scale = make_param(rngs, nnx.initializers.ones, (dv,), ("norm",), self.param_dtype)
        if conv_size:
            self.conv_q = ShortConv(n_heads * dk, conv_size, **kw)
            self.conv_k = ShortConv(n_heads * dk, conv_size, **kw)
            self.conv_v = ShortConv(n_heads * dv, conv_size, **kw)

    # -------------------------------------------------------------- hooks
    def _normalize_qk(self, q, k):
        return q, k

    def _gates(self, h) -> dict:
        raise NotImplementedError

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        raise NotImplementedError

    def _post(self, o, v):
        """Hook applied to the rule's output ``o [B,T,H,dv]`` (Mamba-2 adds its skip term)."""
        return o

    # -------------------------------------------------------------- cache
    def init_cache(self, batch: int, max_len: int | None = None) -> RecurrentCache:
        """A fresh cache; ``max_len`` is ignored (the state does not grow with the sequence)."""
        del max_len
        state = empty_state(batch, self.n_heads, self.dk, self.dv, self.tail, _float_dtype(self.dtype))
        conv = {}
        if self.conv_size:
            conv = {"q": self.conv_q.init_state(batch, self.dtype), "k": self.conv_k.init_state(batch, self.dtype),
                    "v": self.conv_v.init_state(batch, self.dtype)}
        return RecurrentCache(state=state, conv=conv)

    def _check_cache(self, cache, batch: int) -> None:
        """``cache`` must have the layout of ``self.init_cache(batch)`` (shapes, checked on traced caches too) and,
        where its values are concrete, a finite state (:func:`falcon_jax.validation.check_state`)."""
        fix = "make it with this layer's init_cache(batch), or take it from this layer's previous call"
        if not isinstance(cache, RecurrentCache):
            raise TypeError(f"{self.owner}: `cache` must be a RecurrentCache ({fix}); got {type(cache).__name__}.")
        val.check_state(cache.state, batch, self.n_heads, self.dk, self.dv, self.tail, argname="cache.state")
        widths = {"q": self.n_heads * self.dk, "k": self.n_heads * self.dk, "v": self.n_heads * self.dv}
        want = {name: (batch, self.conv_size - 1, c) for name, c in widths.items()} if self.conv_size else {}
        if not isinstance(cache.conv, dict) or set(cache.conv) != set(want):
            got = sorted(cache.conv) if isinstance(cache.conv, dict) else type(cache.conv).__name__
            raise ValueError(f"{self.owner}: `cache.conv` must hold the short convolutions' states "
                             f"{sorted(want)} (conv_size={self.conv_size}); got {got}: {fix}.")
        for name, shape in want.items():
            x = cache.conv[name]
            if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"{self.owner}: `cache.conv[{name!r}]` must be a floating-point array; got "
                                f"{getattr(x, 'dtype', type(x).__name__)}: {fix}.")
            if tuple(x.shape) != shape:
                raise ValueError(f"{self.owner}: `cache.conv[{name!r}]` has shape {tuple(x.shape)} but this layer "
                                 f"with batch {batch} needs [B, conv_size-1, H*d] = {list(shape)}: {fix}.")

    # -------------------------------------------------------------- forward
    def __call__(self, h: jax.Array, *, segment_ids: jax.Array | None = None, cache: RecurrentCache | None = None):
        """h ``[B, T, D]`` -> y ``[B, T, D]`` (in ``dtype``), or ``(y, cache)`` when ``cache`` is given.

        ``segment_ids [B, T]`` (packed sequences): neither the rule's state nor the short
        convolution carries information across a change of id.  With a cache and ``T = 1`` the
        layer takes one recurrent step (the decode path).
        """
        B, T = val.check_hidden(self.owner, h, self.d_model, min_time=1)
        val.check_segment_ids(segment_ids, B, T)  # before the short convolutions use them
        if cache is not None:
            self._check_cache(cache, B)
        h = h.astype(self.dtype)
        H, dk, dv = self.n_heads, self.dk, self.dv
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        new_conv = {}
        if self.conv_size:
            conv_in = cache.conv if cache is not None else {"q": None, "k": None, "v": None}
            q, new_conv["q"] = self.conv_q(q, conv_in["q"], segment_ids)
            k, new_conv["k"] = self.conv_k(k, conv_in["k"], segment_ids)
            v, new_conv["v"] = self.conv_v(v, conv_in["v"], segment_ids)
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        q, k, v = q.reshape(B, T, H, dk), k.reshape(B, T, H, dk), v.reshape(B, T, H, dv)
        q, k = self._normalize_qk(q, k)
        gates = self._gates(h)
        step = cache is not None and T == 1
        with jax.named_scope("core"):  # the rule alone, for profiles (blocks.py)
            result = self._rule(q, k, v, gates, step=step, segment_ids=segment_ids,
                                initial_state=None if cache is None else cache.state)
        o, state = result if cache is not None else (result, None)
        o = self._post(o.astype(self.dtype), v)
        o = rms_normalize(o, self.norm_eps) * self.o_norm_scale[...].astype(self.dtype)
        y = self.o_proj(o.reshape(B, T, H * dv) * jax.nn.silu(self.g_proj(h)))
        if cache is None:
            return y
        return y, RecurrentCache(state=state, conv=new_conv)


def _logit(p):
    return np.log(p) - np.log1p(-p)


def _inv_softplus(y):
    return y + np.log(-np.expm1(-y))


def lam_init_values(n_heads: int, low: float, high: float) -> np.ndarray:
    """Initial λ̄ of each head: log-spaced from ``low`` to ``high`` (one memory horizon per head,
    from ~1/low to ~1/high tokens for β ≈ 1)."""
    if n_heads == 1:
        return np.array([math.sqrt(low * high)])
    return np.exp(np.linspace(np.log(low), np.log(high), n_heads))


class FalconAttention(RecurrentMixer):
    """Falcon fast-weight attention as a token mixer (docs/layers.md: "Falcon-1A.3, QK-RMSNorm,
    ctxη-ctxλ" means ``variant="1A", qk_norm="rms", gain="ctx_eta", lam="ctx"``).

    On top of the shared skeleton (:class:`RecurrentMixer`)::

        q, k <- per head, weightless: RMSNorm (qk_norm="rms", ‖k‖² ≈ dk) or ℓ2 (qk_norm="l2", ‖k‖² ≈ 1)
        gain="ctx_beta":  β = 2σ(W_β h)              step="normalized": η = β/(E + λ + ε)
        gain="ctx_eta":   η = 2σ(W_η h) / dk         step="direct"; dk is the expected energy ‖k‖² of
                                                     an RMS-normed key (docs/layers.md).  It stays dk with ℓ2
                                                     keys (‖k‖² = 1): their steps and decays are dk
                                                     times smaller, which is what separates the
                                                     paper's .2 (ℓ2) from .3 (RMS) setting; with
                                                     1/E_exp instead the two would differ only by eps,
                                                     the output norm removing the common scale
        lam="ctx":    λ̄ = lam_max·σ(W_λ h + b), scale-coupled (λ = λ̄·sg(E));
                      b starts at logit(λ̄₀/lam_max), λ̄₀ log-spaced over heads in lam_init
        lam="const":  λ = softplus(p) per head, not scale-coupled; starts at λ̄₀·E_exp with
                      E_exp = dk ("rms") or 1 ("l2"), so that λ/‖k‖² starts at λ̄₀
        lam="none":   λ = 0 (no decay)
        o = falcon(q, k, v, β|η, λ; variant, window, alignment, timing, form, chunk_size, impl)

    ``W_β``/``W_η`` emit ``dv`` gains per head when ``per_column_gains`` (default: exactly
    for the per-column variants "2"/"2A"), else one.  With ``alignment="shifted"`` the
    write pair is ``(k_{t-1}, v_t)``.

    Shapes: h ``[B, T, D]`` -> ``[B, T, D]``; ``H = n_heads``, ``dk = head_dim``
    (default ``D/H``), ``dv = v_head_dim`` (default ``dk``).  Extra parameters:
    ``gain_proj [D, H·g]``, ``lam_proj [D, H]`` + ``lam_bias [H]`` (ctx) or ``lam_const [H]``.
    """

    owner = "FalconAttention"

    def __init__(self, d_model: int, n_heads: int, *, variant: str = "1A", head_dim=None, v_head_dim=None,
                 window: int = 4, qk_norm: str = "rms", gain: str = "ctx_eta", lam: str = "ctx",
                 lam_max: float = 1.0, lam_init: tuple[float, float] = (1e-3, 1e-1),
                 per_column_gains: bool | None = None, conv_size: int = 4, form: str = "chunk",
                 chunk_size: int = 64, alignment: str = "shifted", timing: str = "raw", impl: str = "auto",
                 eps: float = 1e-6, eps_gamma: float = 1e-6, init_std: float = 0.02, out_std: float | None = None,
                 norm_eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        o = self.owner
        check_real(o, "eps", eps, 0.0, meaning=" (added to the step's denominator)")
        check_real(o, "eps_gamma", eps_gamma, 0.0, 1.0, low_ok=False, meaning=" (the smallest decay γ)")
        check_real(o, "lam_max", lam_max, 0.0, low_ok=False, meaning=" (the largest λ of the context gate)")
        for field, value, choices in (("alignment", alignment, val.ALIGNMENTS), ("timing", timing, val.TIMINGS),
                                      ("impl", impl, val.IMPLS)):
            if not isinstance(value, str) or value not in choices:  # (a list of impls is falcon()'s, not a layer's)
                raise _err(o, field, value, f"must be one of {', '.join(repr(c) for c in choices)}.")
        if not isinstance(variant, str) or variant.upper() not in VARIANTS:
            raise _err(o, "variant", variant, f"is not a Falcon rule; use one of {', '.join(VARIANTS)}.")
        variant = variant.upper()
        if qk_norm not in ("rms", "l2"):
            raise _err(o, "qk_norm", qk_norm, "must be 'rms' or 'l2'.")
        if gain not in ("ctx_beta", "ctx_eta"):
            raise _err(o, "gain", gain, "must be 'ctx_beta' (β = 2σ, normalized step) or 'ctx_eta' (direct η).")
        if lam not in ("ctx", "const", "none"):
            raise _err(o, "lam", lam, "must be 'ctx', 'const' or 'none'.")
        if per_column_gains is not None and not isinstance(per_column_gains, (bool, np.bool_)):
            raise _err(o, "per_column_gains", per_column_gains, "must be None, True or False (None: per-column "
                       "gains exactly for variants '2' and '2A').")
        if per_column_gains is None:
            per_column_gains = variant in PER_COLUMN_VARIANTS
        if per_column_gains and variant not in PER_COLUMN_VARIANTS:
            raise _err(o, "per_column_gains", per_column_gains, f"but variant {variant!r} takes one gain per "
                       "head; use variant '2' or '2A' for per-column gains, or per_column_gains=None.")
        if isinstance(window, bool) or not (isinstance(window, int) and window >= 1):
            raise _err(o, "window", window, "must be an int >= 1.")
        check_form(o, form, chunk_size)
        if not is_pair_of_reals(lam_init):
            raise _err(o, "lam_init", lam_init, "must be a pair (low, high) of numbers, e.g. (1e-3, 1e-1).")
        lo, hi = lam_init
        if not 0 < lo <= hi < lam_max:
            raise _err(o, "lam_init", lam_init, f"must satisfy 0 < low <= high < lam_max = {lam_max}.")
        super().__init__(d_model, n_heads, head_dim=head_dim, v_head_dim=v_head_dim, conv_size=conv_size,
                         init_std=init_std, out_std=out_std, norm_eps=norm_eps, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
        H, dk, dv = self.n_heads, self.dk, self.dv
        self.variant, self.window, self.qk_norm, self.gain, self.lam = variant, window, qk_norm, gain, lam
        self.lam_max, self.per_column_gains = float(lam_max), bool(per_column_gains)
        self.form, self.chunk_size, self.impl = form, chunk_size, impl
        # a tuple, not a dict: module attributes must stay hashable (graphdefs are jit-static)
        self.rule_options = tuple(dict(variant=variant, window=window, alignment=alignment, timing=timing,
                                       step="normalized" if gain == "ctx_beta" else "direct",
                                       scale_coupled=lam == "ctx", eps=eps, eps_gamma=eps_gamma).items())
        self.tail = window - 1 if variant in ("3", "3A") else 0
        # the expected energy of a normalised key, ‖RMSNorm(k)‖² ≈ dk, ‖k/‖k‖‖² = 1 (const-λ init)
        self.expected_energy = float(dk) if qk_norm == "rms" else 1.0
        kw = dict(rngs=rngs, dtype=self.dtype, param_dtype=self.param_dtype)
        self.gain_proj = dense(d_model, H * (dv if self.per_column_gains else 1), ("embed", "heads"),
                               std=init_std, **kw)
        lam0 = lam_init_values(H, lo, hi)
        if lam == "ctx":
            self.lam_proj = dense(d_model, H, ("embed", "heads"), std=init_std, **kw)
            bias = _logit(lam0 / lam_max)
            self.lam_bias = make_param(rngs, lambda k, s, d: jnp.asarray(bias, d), (H,), ("heads",),
                                       self.param_dtype)
        elif lam == "const":
            p0 = _inv_softplus(lam0 * self.expected_energy)
            self.lam_const = make_param(rngs, lambda k, s, d: jnp.asarray(p0, d), (H,), ("heads",),
                                        self.param_dtype)

    @property
    def options(self) -> dict:
        """The keyword arguments this layer passes to ``falcon`` / ``falcon_step``."""
        return dict(self.rule_options)

    def _normalize_qk(self, q, k):
        norm = rms_normalize if self.qk_norm == "rms" else l2_normalize
        return norm(q, self.norm_eps), norm(k, self.norm_eps)

    def _gates(self, h) -> dict:
        B, T, _ = h.shape
        H = self.n_heads
        gdt = _float_dtype(self.dtype)  # gates in fp32 at least: they set step sizes and decays
        z = self.gain_proj(h).astype(gdt)
        g = 2.0 * jax.nn.sigmoid(z)
        if self.gain == "ctx_eta":
            g = g / self.dk
        g = g.reshape(B, T, H, self.dv) if self.per_column_gains else g.reshape(B, T, H)
        if self.lam == "ctx":
            lam = self.lam_max * jax.nn.sigmoid(self.lam_proj(h).astype(gdt) + self.lam_bias[...].astype(gdt))
        elif self.lam == "const":
            lam = jnp.broadcast_to(jax.nn.softplus(self.lam_const[...].astype(gdt)), (B, T, H))
        else:
            lam = jnp.zeros((B, T, H), gdt)
        return {"beta": g, "lam": lam}

    def _rule(self, q, k, v, gates, *, step, initial_state, segment_ids):
        if step:  # one decode step: the recurrent rule on the carried state
            o, state = falcon_step(initial_state, q[:, 0], k[:, 0], v[:, 0], gates["beta"][:, 0],
                                   gates["lam"][:, 0], **self.options)
            return o[:, None], state
        return falcon(q, k, v, gates["beta"], gates["lam"], form=self.form, chunk_size=self.chunk_size,
                      impl=self.impl, initial_state=initial_state, return_final_state=initial_state is not None,
                      segment_ids=segment_ids, **self.options)
