"""Recurrent form: one step at a time (``lax.scan``), O(1) state.

``step`` is the definition every other form must equal, and the decode step
used for generation.  It takes the pairs, the window and the gates straight
from the carried :class:`FalconState`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.rules import Rule, window_gram
from falcon_jax.state import FalconState


def step(rule: Rule, state: FalconState, q_t, k_t, v_t, inputs_t: dict, reset_t=None):
    """One token for every batch row and head.

    q_t, k_t [B,H,dk]; v_t [B,H,dv]; inputs_t {name: [B,H] or [B,H,dv]};
    reset_t [B] bool (a segment starts here: S and the window are cleared first).
    Returns (o_t [B,H,dv] unscaled, new_state).
    """
    B, H, dk, dv = state.S.shape
    S, has_key, tail_valid = state.S, state.has_key, state.tail_valid
    if reset_t is not None:
        S = jnp.where(reset_t[:, None, None, None], 0.0, S)
        has_key = has_key & ~reset_t
        tail_valid = tail_valid & ~reset_t[:, None]
    if rule.alignment == "shifted":
        x, valid = state.last_key, has_key
    else:
        x, valid = k_t, jnp.ones((B,), bool)
    x = jnp.where(valid[:, None, None], x, 0.0)
    x_win = jnp.concatenate([state.tail_x, x[:, :, None, :]], axis=2)  # [B,H,W,dk]
    y_win = jnp.concatenate([state.tail_y, v_t[:, :, None, :]], axis=2)
    in_win = jnp.concatenate([tail_valid, valid[:, None]], axis=1)  # [B,W]
    w, log_gamma = rule.gates(window_gram(x_win), in_win[:, None], valid[:, None], inputs_t)  # [B,H,W,G], [B,H,G]
    G = w.shape[-1]
    gamma = jnp.exp(log_gamma)[:, :, None, :, None]  # over [B,H,dk,G,dv/G]
    S_g = S.reshape(B, H, dk, G, dv // G)
    targets = y_win.reshape(B, H, -1, G, dv // G)
    if rule.regression:
        seen = gamma * S_g if rule.decay_before_residual else S_g
        targets = targets - jnp.einsum("bhwk,bhkgd->bhwgd", x_win, seen)
    S_new = gamma * S_g + jnp.einsum("bhwk,bhwg,bhwgd->bhkgd", x_win, w, targets)
    read = S_new if rule.timing == "raw" else S_g
    o = jnp.einsum("bhk,bhkgd->bhgd", q_t, read).reshape(B, H, dv)
    tail = rule.window - 1
    new_state = FalconState(
        S=S_new.reshape(B, H, dk, dv),
        last_key=k_t,
        has_key=jnp.ones_like(has_key),
        tail_x=x_win[:, :, 1:] if tail else state.tail_x,
        tail_y=y_win[:, :, 1:] if tail else state.tail_y,
        tail_valid=in_win[:, 1:] if tail else state.tail_valid,
    )
    return o, new_state


def recurrent(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState):
    """q,k [B,H,T,dk]; v [B,H,T,dv]; inputs {name: [B,H,T(,dv)]}; resets [B,T].

    Returns (o [B,H,T,dv] unscaled, final state).
    """

    def time_major(a):
        return jnp.moveaxis(a, 2, 0)

    xs = (time_major(q), time_major(k), time_major(v),
          jax.tree_util.tree_map(time_major, inputs), jnp.moveaxis(resets, 1, 0))

    def body(carry, x):
        q_t, k_t, v_t, inputs_t, reset_t = x
        o_t, carry = step(rule, carry, q_t, k_t, v_t, inputs_t, reset_t)
        return carry, o_t

    final, o = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 2), final
