"""SwiGLU MLP, the pre-norm decoder block and the mixer factory.

    x <- x + mixer(RMSNorm(x))
    x <- x + W_down( SiLU(W_gate RMSNorm(x)) ⊙ W_up RMSNorm(x) )

The mixer and the MLP run under the named scopes ``mixer`` and ``mlp`` (the mixer's sequence-mixing
op under ``mixer/core``), so a profile or the compiled HLO's ``op_name`` metadata attributes device
time to them (``benchmarks.run --suite lm`` reports the mixers' share of the train step this way).

No bias, no dropout.  Residual-branch output projections (mixer ``o_proj`` and
``W_down``) start at std ``init_std / √(2·n_layers)`` (GPT-2's scaled init).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from falcon_jax.nn.attention import FalconAttention
from falcon_jax.nn.baselines import (DeltaNetMixer, GatedDeltaNetMixer, Mamba2Mixer, RetNetMixer,
                                     SoftmaxAttention)
from falcon_jax.nn.config import LMConfig, MixerSpec
from falcon_jax.nn.layers import RMSNorm, dense


class SwiGLU(nnx.Module):
    """``y = W_down(SiLU(W_gate x) ⊙ W_up x)``: x ``[..., D]`` -> ``[..., D]``, hidden F.
    Kernels: ``gate_proj``/``up_proj [D, F]`` (``("embed", "mlp")``), ``down_proj [F, D]``
    (``("mlp", "embed")``)."""

    def __init__(self, d_model: int, hidden: int, *, init_std: float = 0.02, out_std: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = dense(d_model, hidden, ("embed", "mlp"), std=init_std, **kw)
        self.up_proj = dense(d_model, hidden, ("embed", "mlp"), std=init_std, **kw)
        self.down_proj = dense(hidden, d_model, ("mlp", "embed"), std=init_std if out_std is None else out_std, **kw)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def make_mixer(cfg: LMConfig, spec: MixerSpec, *, rngs: nnx.Rngs):
    """The token mixer of one layer, built from the config and the layer's parsed mixer name."""
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    common = dict(head_dim=cfg.dk, v_head_dim=cfg.dv, init_std=cfg.init_std, out_std=out_std, dtype=dt,
                  param_dtype=pdt, rngs=rngs)
    if spec.kind == "transformer":
        return SoftmaxAttention(cfg.d_model, cfg.n_heads, rope_theta=cfg.rope_theta, attn_impl=cfg.attn_impl,
                                **common)
    rec = dict(common, conv_size=cfg.conv_size, norm_eps=cfg.norm_eps, form=cfg.form, chunk_size=cfg.chunk_size,
               impl=cfg.impl)
    if spec.kind == "falcon":
        opts = cfg.falcon_options(spec)
        return FalconAttention(cfg.d_model, cfg.n_heads, variant=spec.variant, window=cfg.window,
                               qk_norm=opts["qk_norm"], gain=opts["gain"], lam=opts["lam"], lam_max=cfg.lam_max,
                               lam_init=cfg.lam_init, per_column_gains=opts["per_column_gains"],
                               alignment=cfg.alignment, timing=cfg.timing, eps=cfg.eps, eps_gamma=cfg.eps_gamma,
                               **rec)
    cls = {"linear_attention": RetNetMixer, "mamba2": Mamba2Mixer, "deltanet": DeltaNetMixer,
           "gated_deltanet": GatedDeltaNetMixer}[spec.kind]
    return cls(cfg.d_model, cfg.n_heads, **rec)


class DecoderBlock(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm1(x))``, then ``+ mlp(norm2(x))``.
    x ``[B, T, D]`` -> ``[B, T, D]`` (or ``(x, cache)`` with a cache)."""

    def __init__(self, cfg: LMConfig, spec: MixerSpec, *, rngs: nnx.Rngs):
        dt, pdt = cfg.compute_dtype, cfg.storage_dtype
        self.kind = spec.kind
        self.norm1 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.mixer = make_mixer(cfg, spec, rngs=rngs)
        self.norm2 = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=dt, param_dtype=pdt, rngs=rngs)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn, init_std=cfg.init_std,
                          out_std=cfg.init_std / math.sqrt(2 * cfg.n_layers), dtype=dt, param_dtype=pdt, rngs=rngs)

    def init_cache(self, batch: int, max_len: int | None):
        return self.mixer.init_cache(batch, max_len)

    def __call__(self, x, *, segment_ids=None, cache=None):
        with jax.named_scope("mixer"):
            out = self.mixer(self.norm1(x), segment_ids=segment_ids, cache=cache)
        y, new_cache = out if cache is not None else (out, None)
        x = x + y
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.norm2(x))
        return x if cache is None else (x, new_cache)
