"""Chunk form through the Pallas kernels (``falcon(impl=...)`` any of ``"mosaic_gpu"``, ``"triton"``,
``"mosaic_tpu"``; :mod:`falcon_jax.kernels.implementation`).

Falcon-1, DeltaNet and Gated DeltaNet go through the regression op ``falcon_jax.kernels.decayed_delta_rule``::

    p_t = η_t (y_t − S_{t-1}ᵀ x_t),   S_t = e^{a_t} S_{t-1} + x_t p_tᵀ,   o_t = S_tᵀ q_t

Gated DeltaNet (``rule.decay_before_residual``) reads the residual from the decayed state,
``p_t = η_t (y_t − e^{a_t} S_{t-1}ᵀ x_t)``: the op's ``decay_before_residual=True``.

(Falcon-2 with per-column gains: ``η``, ``a`` one value per value column, ``⊙`` in place of the scalar
products: ``falcon_jax.kernels.per_column.decayed_delta_rule_per_column``.)

Falcon-3 (window W > 1) goes through the windowed op ``falcon_jax.kernels.windowed_delta_rule``::

    S_t = e^{a_t} S_{t-1} + Σ_{i<W} w_{t,i} x_{t,i} (y_{t,i} − S_{t-1}ᵀ x_{t,i})ᵀ

with the write stream's window pairs (``x_ext``/``y_ext`` including the state's
tail) and per-slot weights ``w_{t,i}`` (λmax gates computed in XLA).  Its
``chunk_size`` counts kernel rows: ``chunk_size / next_pow2(W)`` steps per chunk.

with the write stream's ``x_t``, ``y_t = v_t``, ``η_t`` and ``a_t = log γ_t``
(segment resets inside the op).  Read-before-write reads step t−1's state with
query q_t (the op is called with the queries shifted one step left).

The inner-product rules with scalar gates — Falcon-1A, Falcon-3A (and
2A with one gain per head) and decayed linear attention — through one kernel
op, ``falcon_jax.kernels.decayed_attention``::

    S_p = e^{a_p} S_{p-1} + x_p y'_pᵀ,   o_p = S_pᵀ q_p      (per position p)

Falcon-1A maps onto it with ``y' = η v``.  Falcon-3A writes each pair
``(x_j, y_j)`` at the W steps of the windows that contain it.  The pair is
handed to the kernel at its *last* writer ``s = j``-th step (window slot 0),
with the writes summed into one coefficient decayed forward to that step::

    c_j = Σ_i w_{s_i, i} · exp(Σ_{r=s_i+1}^{s_0} a_r)      (s_i = the step writing j through slot i)

Every factor is a decay ≤ 1: nothing is divided by a small γ.  A read at step
t that comes before a pair's last writer misses that pair's earlier writes; a
banded correction (at most W−1 pairs per step, plain XLA) adds them, and the
same correction adds the last W−1 pairs' partial writes to the final state.
Read-before-write reads step t−1's state with query q_t (the kernel is called
with the queries shifted one step left; step 0 reads the initial state in XLA).

Falcon-2A with per-column gains goes through the per-column op without the
residual, ``falcon_jax.kernels.per_column.decayed_attention_per_column``
(``s_{t,c} = e^{a_{t,c}} s_{t-1,c} + η_{t,c} y_{t,c} x_t``), mapped exactly like
Falcon-2 (the same write stream, query shift and step-0 read), GPU or TPU, and in
the model's ``[B, T, H, ...]`` layout (its GPU kernels read it in place).

Everything else declines with the reason (:func:`supports`); ``impl="auto"`` then falls back to the
XLA chunk form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from falcon_jax.forms.stream import final_state, per_position, write_stream
from falcon_jax.kernels import decayed_attention as attention_op
from falcon_jax.kernels import decayed_delta_rule as delta_rule_op
from falcon_jax.kernels import per_column as per_column_op
from falcon_jax.kernels import windowed_delta_rule as windowed_op
from falcon_jax.kernels.common import shift_time
from falcon_jax.kernels.decayed_attention.api import unsupported_reason as attention_reason
from falcon_jax.kernels.decayed_delta_rule.api import unsupported_reason as delta_rule_reason
from falcon_jax.kernels.per_column.api import unsupported_reason as per_column_reason
from falcon_jax.kernels.windowed_delta_rule.api import unsupported_reason as windowed_reason
from falcon_jax.rules import Rule
from falcon_jax.state import FalconState


def _per_column(inputs: dict) -> bool:
    return any(a is not None and getattr(a, "ndim", 0) == 4 for a in inputs.values())


def kernel_op_name(rule: Rule, inputs: dict) -> str:
    """The kernel op that serves this rule: "decayed_attention", "decayed_delta_rule", "windowed_delta_rule" or
    "per_column" (its :class:`KernelConfig` is the one ``falcon(kernel_config=...)`` takes)."""
    if _per_column(inputs):
        return "per_column"
    if rule.regression:
        return "windowed_delta_rule" if rule.window > 1 else "decayed_delta_rule"
    return "decayed_attention"


KERNEL_CONFIGS = {"decayed_attention": attention_op.KernelConfig, "decayed_delta_rule": delta_rule_op.KernelConfig,
                  "windowed_delta_rule": delta_rule_op.KernelConfig, "per_column": per_column_op.KernelConfig}


def supports(rule: Rule, inputs: dict, implementation: str, dv: int, dk: int, dtype, chunk_size: int = 64,
             interpret: bool | None = None) -> str | None:
    """None if kernel ``implementation`` serves this call, else the reason."""
    q, y = jax.ShapeDtypeStruct((0, dk), dtype), jax.ShapeDtypeStruct((0, dv), dtype)
    op = kernel_op_name(rule, inputs)
    if rule.regression and rule.decay_before_residual and op != "decayed_delta_rule":
        return (f"{rule.name}: the residual on the decayed state has a Pallas kernel for scalar gates and window 1 "
                f"only (decayed_delta_rule), not {op}")
    if op == "per_column" and rule.window > 1:
        return f"{rule.name}: no Pallas kernel for per-column gains of windowed rules yet"
    if op == "per_column":
        reason = per_column_reason(implementation, q, y, chunk_size, interpret)
    elif op == "windowed_delta_rule":
        reason = windowed_reason(implementation, rule.window, q, y, chunk_size, interpret)
    elif op == "decayed_delta_rule":
        reason = delta_rule_reason(implementation, q, y, chunk_size, interpret)
    else:
        reason = attention_reason(implementation, q, y, chunk_size, interpret)
    return None if reason is None else f"{rule.name}: {reason}"


def compact_served(rule: Rule, inputs: dict) -> bool:
    """Whether the XLA chunk form runs this rule as the windowed op's compact form (``implementation="xla"``:
    each chunk solved on its C + W − 1 distinct pairs) rather than :mod:`falcon_jax.forms.chunk`'s system on
    C·W lifted rows: the windowed regression rule (Falcon-3) with scalar gates."""
    return rule.regression and rule.window > 1 and not _per_column(inputs) and not rule.decay_before_residual


def time_major_served(rule: Rule, inputs: dict) -> bool:
    """Whether :func:`chunk_pallas` takes this call in the model's ``[B, T, H, ...]`` layout (the GPU kernels
    read it in place): every rule with scalar gates except the windowed regression rule (Falcon-3's virtual rows
    are built head-major), and Falcon-2A with per-column gates; not Falcon-2 with per-column gates."""
    if _per_column(inputs):
        return not rule.regression
    return not (rule.regression and rule.window > 1)


def _time_slice(a, start, stop, axis):
    return jax.lax.slice_in_dim(a, start, stop, axis=axis)


def _at_time(a, t, axis):
    return jax.lax.index_in_dim(a, t, axis=axis, keepdims=False)


def _shift_queries(q, axis):
    """``out[t] = q[t + 1]`` (zero at the end): step t's state read with the query of step t+1."""
    return shift_time(q, -1, axis)


def _read_before_write(o, q, S0, resets, axis):
    """Read-before-write outputs from the shifted reads ``o``: step 0 reads the initial state, a segment
    start reads the reset state (zero)."""
    first = jnp.einsum("bhk,bhkd->bhd", _at_time(q, 0, axis), S0.astype(q.dtype))
    T = o.shape[axis]
    o = jnp.concatenate([jnp.expand_dims(first, axis), _time_slice(o, 0, T - 1, axis)], axis=axis)
    return jnp.where(per_position(resets, axis)[..., None], 0.0, o)


def chunk_pallas(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState, *, chunk_size: int,
                 implementation: str, kernel_config=None, kernel_dtype=None, time_major: bool = False):
    """Same arguments and result as :func:`falcon_jax.forms.chunk.chunk`.

    ``implementation``: "mosaic_gpu", "triton" or "mosaic_tpu" (the caller checked :func:`supports`), or "xla"
    where :func:`compact_served`.
    ``kernel_config``: the op's ``KernelConfig`` (:func:`kernel_op_name`; None: tuned).  ``kernel_dtype``:
    dtype of q, x, y inside the kernel (the caller's input dtype, e.g. bf16); gates, decays, coefficients and
    states stay fp32.  ``time_major``: q, k, v, inputs and the output are ``[B, T, H, ...]`` instead of
    ``[B, H, T, ...]`` (only where :func:`time_major_served`), which the GPU kernels read and write in place.
    """
    if time_major and not time_major_served(rule, inputs):
        raise ValueError(f"{rule.name}: time_major=True is served only where time_major_served() says so")
    op_kw = dict(chunk_size=chunk_size, implementation=implementation, config=kernel_config)
    if rule.regression or _per_column(inputs):
        return _regression(rule, q, k, v, inputs, resets, state, op_kw=op_kw, kernel_dtype=kernel_dtype,
                           time_major=time_major)
    ax = 1 if time_major else 2  # the time axis of the token arrays
    T = q.shape[ax]
    W = rule.window
    kd = kernel_dtype or q.dtype
    stream = write_stream(rule, k, v, inputs, resets, state, time_axis=ax)
    w = stream.w[..., 0]  # [B,H,T,W] (time-major [B,T,H,W]): step s writes pair s+i (tail-ext index) with w[s, i]
    lg = stream.log_gamma[..., 0]  # [B,H,T] or [B,T,H]
    run = stream.run  # [B,T]
    # decay[m][t] = exp(Σ_{r=t-m+1}^{t} a_r): from step t-m to step t (m < W)
    decay = [jnp.ones_like(lg)]
    for m in range(1, W):
        decay.append(decay[-1] * jnp.exp(shift_time(lg, m - 1, axis=ax)))

    def writes_before(d):
        """Σ_{i≥d} w[t+d-i, i] · decay[i-d][t] over same-segment steps: the writes of pair t+d done by
        steps ≤ t, decayed to t.  [B,H,T] (or [B,T,H])"""
        total = jnp.zeros_like(lg)
        for i in range(d, W):
            same = (shift_time(run, i - d, axis=1) == run) & (jnp.arange(T) >= i - d)
            total = total + jnp.where(per_position(same, ax), shift_time(w[..., i], i - d, axis=ax), 0.0) * decay[i - d]
        return total

    x_pair = _time_slice(stream.x_ext, 0, T, ax)  # the pair whose last writer is step s
    y_pair = writes_before(0)[..., None] * _time_slice(stream.y_ext, 0, T, ax)
    # kernel position t is step t; read-before-write reads step t's state with the query of step t+1
    # (step t+1's read of S_t), and step 0's read of the initial state is added below
    q_step = q if rule.timing == "raw" else _shift_queries(q, ax)
    o, S = attention_op.decayed_attention(q_step.astype(kd), x_pair.astype(kd), y_pair.astype(kd), lg,
                                          jnp.broadcast_to(per_position(run, ax), lg.shape), state.S,
                                          layout="BTHD" if time_major else "BHTD", **op_kw)
    o = o.astype(q.dtype)  # reads at steps 0..T-1 (rbw: with the query of step t+1)
    # pairs t+d (d ≥ 1) not yet handed to the kernel at step t: add their writes so far
    for d in range(1, W):
        coef = writes_before(d)
        x_d, y_d = _time_slice(stream.x_ext, d, d + T, ax), _time_slice(stream.y_ext, d, d + T, ax)
        o = o + (jnp.einsum("...k,...k->...", q_step, x_d) * coef)[..., None] * y_d
        last = _at_time(coef, T - 1, ax)  # the final state gets pair T-1+d's writes up to step T-1
        S = S + jnp.einsum("bhk,bh,bhd->bhkd", _at_time(x_d, T - 1, ax), last, _at_time(y_d, T - 1, ax))
    if rule.timing == "rbw":
        o = _read_before_write(o, q, state.S, resets, ax)
    return o, final_state(stream, S.astype(state.S.dtype), k, rule, time_axis=ax)


def _regression(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState, *, op_kw: dict, kernel_dtype=None,
                time_major: bool = False):
    """Falcon-1 / DeltaNet / Gated DeltaNet (window 1) through the decayed delta rule; per-column
    gates (``G = dv``: Falcon-2, and Falcon-2A without the residual) through the per-column op; Falcon-3
    (window > 1) through the windowed op."""
    ax = 1 if time_major else 2
    kd = kernel_dtype or q.dtype
    stream = write_stream(rule, k, v, inputs, resets, state, time_axis=ax)
    eta = stream.w[..., 0, :]  # [B,H,T,G] (or [B,T,H,G]), G = 1 or dv
    lg = stream.log_gamma
    eta, lg = (a[..., 0] if a.shape[-1] == 1 else a for a in (eta, lg))  # [B,H,T] or [B,H,T,dv]
    run = jnp.broadcast_to(per_position(stream.run, ax), q.shape[:3])
    # raw: step t reads S_t; rbw: step t reads S_{t-1}, the op's position t-1 read with query q_t
    q_read = q if rule.timing == "raw" else _shift_queries(q, ax)
    if rule.window > 1:  # w [B,H,T,W,1]: step t writes ext pairs t..t+W-1 (its window, oldest first)
        o, S = windowed_op.windowed_delta_rule(q_read.astype(kd), stream.x_ext.astype(kd), stream.y_ext.astype(kd),
                                               stream.w[..., 0], lg, run, state.S, **op_kw)
    elif rule.regression and rule.alignment == "shifted" and eta.ndim == 3:
        # Falcon-1: the op reads the keys one row back (x_t = k_{t−1}) in place, so no shifted copy of k is
        # made; step 0's write feature is the carried key (zero without one or at a segment start)
        first_key = jax.lax.index_in_dim(stream.x_ext, 0, axis=ax, keepdims=False)
        o, S = delta_rule_op.decayed_delta_rule(q_read.astype(kd), k.astype(kd), v.astype(kd), eta, lg, run, state.S,
                                                shifted_keys=True, first_key=first_key,
                                                layout="BTHD" if time_major else "BHTD",
                                                decay_before_residual=rule.decay_before_residual, **op_kw)
    elif eta.ndim == 4:  # per-column gates ([B, H, T, dv], or [B, T, H, dv] time-major: Falcon-2A only)
        op = per_column_op.decayed_delta_rule_per_column if rule.regression else per_column_op.decayed_attention_per_column
        o, S = op(q_read.astype(kd), stream.x_ext.astype(kd), stream.y_ext.astype(kd), eta, lg, run, state.S,
                  layout="BTHD" if time_major else "BHTD", **op_kw)
    else:  # DeltaNet, Gated DeltaNet (the residual on the decayed state) and the same-step ablation of Falcon-1
        o, S = delta_rule_op.decayed_delta_rule(q_read.astype(kd), stream.x_ext.astype(kd), stream.y_ext.astype(kd),
                                                eta, lg, run, state.S, layout="BTHD" if time_major else "BHTD",
                                                decay_before_residual=rule.decay_before_residual, **op_kw)
    o = o.astype(q.dtype)
    if rule.timing == "rbw":
        o = _read_before_write(o, q, state.S, resets, ax)
    return o, final_state(stream, S.astype(state.S.dtype), k, rule, time_axis=ax)

