"""Parallel form: the whole sequence as one block, O(T²) (masked attention / WY solve)."""

from __future__ import annotations

from falcon_jax.forms.block import block
from falcon_jax.forms.stream import final_state, write_stream
from falcon_jax.rules import Rule
from falcon_jax.state import FalconState


def parallel(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState):
    """Same arguments and result as :func:`falcon_jax.forms.recurrent.recurrent`."""
    stream = write_stream(rule, k, v, inputs, resets, state)
    run = stream.run[:, None, :]  # same for every head
    o, S = block(q, stream.x_ext, stream.y_ext, stream.w, stream.log_gamma, run, state.S,
                 regression=rule.regression, timing=rule.timing,
                 decay_before_residual=rule.decay_before_residual)
    return o, final_state(stream, S, k, rule)
