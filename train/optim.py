"""Optimizer: AdamW + warm-up/cosine schedule + global-norm clipping, with a weight-decay mask."""

from __future__ import annotations

import jax
import optax


def lr_schedule(cfg, total_steps: int) -> optax.Schedule:
    """Linear warm-up 0 -> ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio`` at
    ``total_steps``."""
    warm = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warm,
        decay_steps=max(total_steps, warm + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params, decay_embedding: bool = False):
    """A pytree of bools like ``params``: True = apply weight decay.

    Decay applies to matrices (ndim >= 2: projection and conv kernels).  Vectors are norm
    weights, biases and per-head gate parameters (``lam_bias``, ``dt_bias``, ``A_log``,
    ``D_skip``): decaying them would pull norms to 0 and gates towards a fixed point, so they
    are left alone.  The tied embedding is excluded unless ``decay_embedding``."""

    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if "embedding" in name:
            return bool(decay_embedding)
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg, total_steps: int, params) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``clip_by_global_norm(clip_norm)`` (the identity when ``clip_norm`` is 0) then AdamW (decoupled decay,
    masked).  The chain has both slots either way, so its state has one layout and a run resumes with clipping
    switched on or off (leaving the slot out made a checkpoint unreadable across that change)."""
    sched = lr_schedule(cfg, total_steps)
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm and cfg.clip_norm > 0 else optax.identity()
    adamw = optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask(params, cfg.decay_embedding))
    return optax.chain(clip, adamw), sched
