"""Model configuration: mixer names, :class:`LMConfig`, presets and the parameter-count formula.

Mixer names (case-insensitive; every row of the paper's Tables 1–3 is a name)::

    "transformer"  (aliases "attention", "softmax")    softmax attention with RoPE
    "retnet"       (alias "linear_attention")          fixed per-head decay linear attention
    "mamba2"       (alias "mamba-2")                   data-dependent decay, Δ-scaled writes
    "deltanet"                                         DeltaNet (L2-normalised q, k)
    "gated_deltanet" (aliases "gated-deltanet", "gdn") Gated DeltaNet (L2-normalised q, k)
    "falcon-<V>"   V in 1, 2, 3, 1A, 2A, 3A            Falcon-V with the config's layer options
    "falcon-<V>.<c>"  c in 1, 2, 3                     the paper's layer settings (Table 1):
        .1 = QK-ℓ2, ctxβ-ctxλ;  .2 = QK-ℓ2, ctxη-ctxλ;  .3 = QK-RMSNorm, ctxη-ctxλ
                                                       (these override qk_norm/gain/lam)

A stack is pure (``mixer`` for every layer), hybrid (``attn_every=k``: every k-th layer,
counting from 1, is ``attn_mixer``), or fully explicit (``layer_mixers``, one name per layer).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from falcon_jax.rules import PER_COLUMN_VARIANTS, VARIANTS

_ALIASES = {
    "transformer": "transformer", "attention": "transformer", "softmax": "transformer",
    "retnet": "linear_attention", "linear_attention": "linear_attention",
    "mamba2": "mamba2", "mamba-2": "mamba2",
    "deltanet": "deltanet",
    "gated_deltanet": "gated_deltanet", "gated-deltanet": "gated_deltanet", "gdn": "gated_deltanet",
}
# the paper's Falcon layer settings, ".1"/".2"/".3" in Tables 1–3
FALCON_SETTINGS = {
    "1": dict(qk_norm="l2", gain="ctx_beta", lam="ctx"),
    "2": dict(qk_norm="l2", gain="ctx_eta", lam="ctx"),
    "3": dict(qk_norm="rms", gain="ctx_eta", lam="ctx"),
}
_FALCON_RE = re.compile(r"^falcon-?(1a|2a|3a|1|2|3)(?:\.(\d+))?$")
RECURRENT_KINDS = ("falcon", "linear_attention", "mamba2", "deltanet", "gated_deltanet")
MIXER_NAMES = tuple(_ALIASES) + tuple(f"falcon-{v}" for v in VARIANTS) + tuple(
    f"falcon-{v}.{c}" for v in VARIANTS for c in FALCON_SETTINGS)

QK_NORMS = ("rms", "l2")
GAINS = ("ctx_beta", "ctx_eta")
LAMS = ("ctx", "const", "none")


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """A parsed mixer name: ``kind`` (``"transformer"`` or one of ``RECURRENT_KINDS``),
    the Falcon ``variant`` (None otherwise) and the layer options a ``.c`` suffix fixes."""

    kind: str
    variant: str | None = None
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def recurrent(self) -> bool:
        return self.kind != "transformer"


def parse_mixer(name: Any, *, field: str = "mixer") -> MixerSpec:
    """Parse a mixer name (see the module docstring); ValueError naming ``field`` if unknown."""
    if isinstance(name, str):
        key = name.strip().lower()
        if key in _ALIASES:
            return MixerSpec(_ALIASES[key])
        m = _FALCON_RE.match(key)
        if m and (m.group(2) is None or m.group(2) in FALCON_SETTINGS):
            over = tuple(FALCON_SETTINGS[m.group(2)].items()) if m.group(2) else ()
            return MixerSpec("falcon", m.group(1).upper(), over)
    raise ValueError(
        f"LMConfig.{field}={name!r} is not a known mixer. Use one of: "
        f"{', '.join(sorted(set(_ALIASES)))}, 'falcon-<V>' with V in {', '.join(VARIANTS)}, "
        f"optionally with the paper's setting suffix '.1', '.2' or '.3' (e.g. 'falcon-1A.3').")


FLOAT_DTYPES = tuple(jnp.dtype(d) for d in ("float32", "bfloat16", "float16", "float64"))
_INT_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "v_head_dim", "mlp_hidden", "attn_every",
               "conv_size", "window", "chunk_size")


def _choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"LMConfig.{field}={value!r} is not valid; set it to one of "
                         f"{', '.join(repr(c) for c in choices)}.")


def _is_int(value) -> bool:
    """A Python or NumPy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _pos_int(field: str, value, *, zero_ok: bool = False) -> None:
    ok = _is_int(value) and (value >= 0 if zero_ok else value >= 1)
    if not ok:
        raise ValueError(f"LMConfig.{field}={value!r} must be an int >= {0 if zero_ok else 1}.")


def _real(field: str, value, low: float, high: float | None = None, *, low_ok: bool = True,
          meaning: str = "") -> None:
    """A finite real number in ``[low, high)`` (``(low, ...)`` when not ``low_ok``; no upper bound when ``high`` is None)."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= low if low_ok else value > low) and (high is None or value < high))
    if not ok:
        where = f"in [{low}, {high})" if high is not None else f"{'>=' if low_ok else '>'} {low}"
        raise ValueError(f"LMConfig.{field}={value!r} must be a finite number {where}{meaning}.")


def is_pair_of_reals(value) -> bool:
    """``value`` is a list or tuple of two finite real numbers (not bools)."""
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value))


def swiglu_hidden(d_model: int, multiple_of: int = 64) -> int:
    """Default SwiGLU width: 8/3·d rounded up to a multiple of 64 (= 2048 at d = 768), which
    keeps the MLP at the parameter count of GPT-2's 4·d GELU MLP (3·d·8d/3 = 2·d·4d)."""
    return multiple_of * math.ceil(int(8 * d_model / 3) / multiple_of)


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Everything that defines a :class:`falcon_jax.nn.FalconLM`.

    Shapes: ``d_model = D``; ``n_heads = H``; ``head_dim = dk`` (default ``D // H``);
    ``v_head_dim = dv`` (default ``dk``); ``mlp_hidden = F`` (default :func:`swiglu_hidden`).

    Falcon layer options (docs/layers.md): ``window`` (B for 3/3A), ``qk_norm`` ("rms" | "l2"),
    ``gain`` ("ctx_beta": β = 2σ(W_β h), normalized step | "ctx_eta": η = 2σ(W_η h)/dk,
    direct step), ``lam`` ("ctx": scale-coupled λ̄ = lam_max·σ(W_λ h + b) | "const": learned
    per-head λ = softplus(p) | "none"), ``lam_init`` (low, high): the initial λ̄ of the heads,
    log-spaced, ``per_column_gains`` (None = True exactly for variants 2/2A), ``alignment``,
    ``timing``, ``eps``, ``eps_gamma``.  Recurrent mixers share ``conv_size`` (0 = no short
    convolution), ``form``, ``chunk_size``, ``impl``.  Softmax layers use ``rope_theta`` and
    ``attn_impl`` ("auto": on a GPU cuDNN without ``segment_ids`` in bf16/fp16, the Pallas flash attention
    with them, else XLA; "triton", "cudnn", "xla" force one: :class:`~falcon_jax.nn.SoftmaxAttention`).
    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype (both explicit so that
    ``jax_enable_x64`` does not change them).  ``remat``: each layer's activations are recomputed in the
    backward pass instead of stored (``nnx.remat`` per layer; the same gradients): the step holds one
    layer's activations and every layer's input, at the cost of a second forward pass.
    """

    vocab_size: int = 50304
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    head_dim: int | None = None
    v_head_dim: int | None = None
    mlp_hidden: int | None = None
    mixer: str = "falcon-1A.3"
    layer_mixers: tuple[str, ...] | None = None
    attn_every: int = 0
    attn_mixer: str = "transformer"
    # Falcon layer
    window: int = 4
    qk_norm: str = "rms"
    gain: str = "ctx_eta"
    lam: str = "ctx"
    lam_max: float = 1.0
    lam_init: tuple[float, float] = (1e-3, 1e-1)
    per_column_gains: bool | None = None
    alignment: str = "shifted"
    timing: str = "raw"
    eps: float = 1e-6
    eps_gamma: float = 1e-6
    # all recurrent mixers
    conv_size: int = 4
    form: str = "chunk"
    chunk_size: int = 64
    impl: str = "auto"
    # softmax attention
    rope_theta: float = 10000.0
    attn_impl: str = "auto"
    # numerics / init
    init_std: float = 0.02
    norm_eps: float = 1e-6
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    remat: bool = False

    def __post_init__(self):
        if not isinstance(self.remat, bool):
            raise ValueError(f"LMConfig.remat must be True or False; got {self.remat!r}.")
        for f in ("vocab_size", "d_model", "n_layers", "n_heads"):
            _pos_int(f, getattr(self, f))
        for f in ("head_dim", "v_head_dim", "mlp_hidden"):
            if getattr(self, f) is not None:
                _pos_int(f, getattr(self, f))
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"LMConfig.n_heads={self.n_heads} does not divide d_model={self.d_model}: pick n_heads "
                f"dividing d_model (e.g. {max(h for h in range(1, self.n_heads + 1) if self.d_model % h == 0)}) "
                f"or set head_dim explicitly.")
        if self.per_column_gains is not None and not isinstance(self.per_column_gains, bool):
            # a string is truthy: 'False' would choose per-column gains
            raise ValueError(f"LMConfig.per_column_gains={self.per_column_gains!r} must be None, True or False "
                             f"(None: per-column gains exactly for falcon-2 / falcon-2A).")
        _pos_int("attn_every", self.attn_every, zero_ok=True)
        _pos_int("conv_size", self.conv_size, zero_ok=True)
        if self.conv_size == 1:  # the recurrent mixers refuse a width-1 convolution when the model is built
            raise ValueError("LMConfig.conv_size=1 must be 0 (no short convolution) or an int >= 2 (the paper uses 4).")
        _pos_int("window", self.window)
        if not (_is_int(self.chunk_size) and self.chunk_size >= 1 and self.chunk_size & (self.chunk_size - 1) == 0):
            raise ValueError(f"LMConfig.chunk_size={self.chunk_size!r} must be a power of two (e.g. 64).")
        for f in _INT_FIELDS:  # NumPy ints as Python ints (config.json, static arguments)
            if _is_int(getattr(self, f)):
                object.__setattr__(self, f, int(getattr(self, f)))
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        _choice("gain", self.gain, GAINS)
        _choice("lam", self.lam, LAMS)
        _choice("alignment", self.alignment, ("shifted", "same_step"))
        _choice("timing", self.timing, ("raw", "rbw"))
        _choice("form", self.form, ("recurrent", "parallel", "chunk"))
        _choice("impl", self.impl, ("auto", "mosaic_gpu", "triton", "mosaic_tpu", "xla"))
        _choice("attn_impl", self.attn_impl, ("auto", "triton", "cudnn", "xla"))
        if self.layer_mixers is not None and self.attn_every:
            raise ValueError(f"LMConfig.attn_every={self.attn_every} has no effect with layer_mixers, which names "
                             f"every layer's mixer: put {self.attn_mixer!r} into layer_mixers where you want it and "
                             f"leave attn_every at 0.")
        if self.attn_every > self.n_layers and self.layer_mixers is None:
            raise ValueError(f"LMConfig.attn_every={self.attn_every} > n_layers={self.n_layers} would make no layer "
                             f"{self.attn_mixer!r}: set attn_every to at most {self.n_layers} (0 for none).")
        if not self.lam_max > 0:
            raise ValueError(f"LMConfig.lam_max={self.lam_max!r} must be > 0.")
        _real("lam_max", self.lam_max, 0.0, low_ok=False)
        _real("eps", self.eps, 0.0, meaning=" (added to the step's denominator)")
        _real("eps_gamma", self.eps_gamma, 0.0, 1.0, low_ok=False, meaning=" (the smallest decay γ)")
        _real("norm_eps", self.norm_eps, 0.0, low_ok=False,
              meaning=" (the RMSNorm epsilon; 0 would divide an all-zero row, e.g. a Falcon layer's output at "
                      "position 0, by zero: NaN)")
        _real("init_std", self.init_std, 0.0, low_ok=False, meaning=" (the initial weights' standard deviation)")
        _real("rope_theta", self.rope_theta, 0.0, low_ok=False, meaning=" (the RoPE base)")
        if not is_pair_of_reals(self.lam_init):
            raise ValueError(f"LMConfig.lam_init={self.lam_init!r} must be a pair (low, high) of numbers, e.g. "
                             f"(1e-3, 1e-1): the initial λ̄ of the heads, log-spaced from low to high.")
        lo, hi = self.lam_init
        if not 0 < lo <= hi < self.lam_max:
            raise ValueError(f"LMConfig.lam_init={self.lam_init!r} must satisfy 0 < low <= high < lam_max "
                             f"= {self.lam_max}.")
        for f in ("dtype", "param_dtype"):
            try:
                dt = jnp.dtype(getattr(self, f))
            except TypeError as e:
                raise ValueError(f"LMConfig.{f}={getattr(self, f)!r} is not a dtype name.") from e
            if dt not in FLOAT_DTYPES:  # 8-bit floats have no implicit promotion: the first norm would fail
                raise ValueError(f"LMConfig.{f}={getattr(self, f)!r} must be one of "
                                 f"{', '.join(repr(str(d)) for d in FLOAT_DTYPES)}.")
        if self.layer_mixers is not None:
            if not isinstance(self.layer_mixers, (list, tuple)) or len(self.layer_mixers) != self.n_layers:
                raise ValueError(f"LMConfig.layer_mixers must be a sequence of n_layers={self.n_layers} "
                                 f"mixer names; got {self.layer_mixers!r}.")
            object.__setattr__(self, "layer_mixers", tuple(self.layer_mixers))
        object.__setattr__(self, "lam_init", tuple(self.lam_init))
        specs = self.layer_specs()  # raises for unknown names
        for spec in specs:
            if spec.kind == "falcon":
                self._check_falcon(spec)
                self._check_setting_suffix(spec)

    # ------------------------------------------------------------------ derived
    @property
    def dk(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def dv(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.dk

    @property
    def ffn(self) -> int:
        return self.mlp_hidden if self.mlp_hidden is not None else swiglu_hidden(self.d_model)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def storage_dtype(self):
        return jnp.dtype(self.param_dtype)

    def layer_specs(self) -> tuple[MixerSpec, ...]:
        """The parsed mixer of every layer."""
        if self.layer_mixers is not None:
            return tuple(parse_mixer(n, field=f"layer_mixers[{i}]") for i, n in enumerate(self.layer_mixers))
        base = parse_mixer(self.mixer)
        attn = parse_mixer(self.attn_mixer, field="attn_mixer") if self.attn_every else None
        return tuple(attn if self.attn_every and (i + 1) % self.attn_every == 0 else base
                     for i in range(self.n_layers))

    def falcon_options(self, spec: MixerSpec) -> dict:
        """The Falcon layer options of ``spec`` (the ``.c`` suffix overrides the config fields)."""
        opts = dict(qk_norm=self.qk_norm, gain=self.gain, lam=self.lam)
        opts.update(dict(spec.overrides))
        per_col = self.per_column_gains
        opts["per_column_gains"] = spec.variant in PER_COLUMN_VARIANTS if per_col is None else per_col
        return opts

    def _check_falcon(self, spec: MixerSpec) -> None:
        if self.per_column_gains and spec.variant not in PER_COLUMN_VARIANTS:
            raise ValueError(
                f"LMConfig.per_column_gains=True but the mixer falcon-{spec.variant} has one gain per head; "
                f"use a per-column variant ('falcon-2' or 'falcon-2A') or set per_column_gains=None.")

    def _check_setting_suffix(self, spec: MixerSpec) -> None:
        """A ``.c`` suffix sets qk_norm, gain and lam; a field set to another value than both its default and the
        suffix's would be overridden without a word."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for field, value in spec.overrides:
            mine = getattr(self, field)
            if mine != value and mine != defaults[field]:
                raise ValueError(
                    f"LMConfig.{field}={mine!r} conflicts with the mixer falcon-{spec.variant} and its setting suffix, "
                    f"which sets {field}={value!r}: drop the suffix (e.g. 'falcon-{spec.variant}') to choose {field} "
                    f"yourself, or leave {field} unset.")

    def replace(self, **changes) -> "LMConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """The named presets (any mixer name also works with the ``-tiny``/``-130m`` suffix)."""
        return PAPER_PRESETS + tuple(f"{m}-tiny" for m in TINY_MIXERS)

    @classmethod
    def preset(cls, name: str, **overrides) -> "LMConfig":
        """A named configuration, ``"<mixer>-<size>"``, e.g. ``"transformer-124m"``,
        ``"falcon-1A.3-130m"``, ``"gated_deltanet-130m"``, ``"falcon-1A-tiny"``.

        Sizes: ``tiny`` (D=64, 2 layers, 4 heads of 16, F=128, vocab 256, chunk 16; for CPU
        tests) and ``124m``/``130m`` (GPT-2 small width and depth: D=768, 12 layers, 12 heads of
        64, F=2048, vocab 50304; the two names are the same shape, the paper quotes 124M for
        the Transformer and ~130M for the recurrent models).  ``overrides`` replace fields.
        """
        if not isinstance(name, str) or "-" not in name:
            raise ValueError(f"LMConfig.preset: unknown preset {name!r}; use '<mixer>-<size>' with size "
                             f"in {sorted(SIZES)}, e.g. {', '.join(PAPER_PRESETS[:3])}.")
        mixer, size = name.rsplit("-", 1)
        if size.lower() not in SIZES:
            raise ValueError(f"LMConfig.preset: unknown size {size!r} in {name!r}; use one of {sorted(SIZES)}.")
        parse_mixer(mixer)
        fields = dict(SIZES[size.lower()], mixer=mixer)
        fields.update(overrides)
        return cls(**fields)


SIZES = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, mlp_hidden=128, chunk_size=16),
    "124m": dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, chunk_size=64),
    "130m": dict(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, chunk_size=64),
}
PAPER_PRESETS = (
    "transformer-124m", "retnet-130m", "mamba2-130m", "deltanet-130m", "gated_deltanet-130m",
    "falcon-1A.1-130m", "falcon-1A.2-130m", "falcon-1A.3-130m", "falcon-3A.3-130m", "falcon-1.3-130m",
)
TINY_MIXERS = ("transformer", "retnet", "mamba2", "deltanet", "gated_deltanet") + tuple(
    f"falcon-{v}" for v in VARIANTS)


def expected_param_count(cfg: LMConfig) -> dict[str, int]:
    """Parameter count from the config alone (the documented formula; tests compare it with
    the count of the built model).  With ``D, H, dk, dv, F, V, K = conv_size``:

    * embedding (tied with the output): ``V·D``;  final norm: ``D``
    * every layer: two RMSNorm weights ``2·D`` + SwiGLU ``3·D·F`` + its mixer:
      - transformer: ``D·H·(2·dk + dv) + H·dv·D``
      - recurrent mixers share q,k,v,gate,out projections ``D·H·(2·dk + 2·dv) + H·dv·D``,
        the output norm weight ``dv`` and the short convolutions ``K·H·(2·dk + dv)``, plus
        - falcon: gain ``D·H·g`` (g = dv with per-column gains, else 1); λ: ctx ``D·H + H``,
          const ``H``, none ``0``
        - deltanet: β ``D·H``;  gated_deltanet: β ``D·H``, Δ ``D·H``, A_log ``H``, dt_bias ``H``
        - mamba2: Δ ``D·H``, A_log ``H``, dt_bias ``H``, skip D ``H``;  retnet: nothing
    """
    D, H, dk, dv, F, V, K = cfg.d_model, cfg.n_heads, cfg.dk, cfg.dv, cfg.ffn, cfg.vocab_size, cfg.conv_size
    mixers = 0
    for spec in cfg.layer_specs():
        if spec.kind == "transformer":
            mixers += D * H * (2 * dk + dv) + H * dv * D
            continue
        n = D * H * (2 * dk + 2 * dv) + H * dv * D + dv + K * H * (2 * dk + dv)
        if spec.kind == "falcon":
            opts = cfg.falcon_options(spec)
            n += D * H * (dv if opts["per_column_gains"] else 1)
            n += {"ctx": D * H + H, "const": H, "none": 0}[opts["lam"]]
        elif spec.kind == "deltanet":
            n += D * H
        elif spec.kind == "gated_deltanet":
            n += 2 * D * H + 2 * H
        elif spec.kind == "mamba2":
            n += D * H + 3 * H
        mixers += n
    counts = {"embedding": V * D, "mixers": mixers, "mlp": cfg.n_layers * 3 * D * F,
              "norms": cfg.n_layers * 2 * D + D}
    counts["total"] = sum(counts.values())
    return counts
