"""The public entry points: ``falcon`` (a whole sequence) and ``falcon_step`` (one token)."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from falcon_jax import validation as val
from falcon_jax.kernels import implementation
from falcon_jax.forms.chunk import chunk
from falcon_jax.forms.chunk_pallas import (KERNEL_CONFIGS, chunk_pallas, compact_served, kernel_op_name,
                                           time_major_served)
from falcon_jax.forms.chunk_pallas import supports as pallas_unsupported
from falcon_jax.forms.parallel import parallel
from falcon_jax.forms.recurrent import recurrent
from falcon_jax.forms.recurrent import step as recurrent_step
from falcon_jax.forms.stream import segment_starts
from falcon_jax.rules import Rule, falcon_rule
from falcon_jax import context_parallel
from falcon_jax.sharding import current, per_shard
from falcon_jax.state import FalconState, empty_state, tail_length_for


def compute_dtype(*arrays) -> jnp.dtype:
    """fp64 if any input is fp64 (needs x64), else fp32: states and decays never run in bf16."""
    return jnp.result_type(jnp.float32, *[a.dtype for a in arrays])


def cast_state(state: FalconState, dtype) -> FalconState:
    """The state's floating fields in the compute dtype (flags stay bool)."""
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, state)


def _heads_first(a):
    return jnp.moveaxis(a, 2, 1)


_warned: set[str] = set()


def select_kernel(impl, rule: Rule, inputs: dict, dk: int, dv: int, dtype, chunk_size: int) -> str:
    """The implementation of the chunk form: ``impl``'s first candidate that serves the call
    (:mod:`falcon_jax.kernels.implementation`; "xla" is the XLA chunk form).  Under ``"auto"`` on an accelerator,
    falling back to XLA because the kernels declined warns once per reason."""
    reasons = []

    def decline(name):
        reason = None if name == "xla" else pallas_unsupported(rule, inputs, name, dv, dk, dtype, chunk_size)
        if reason is not None:
            reasons.append(reason)
        return reason

    name = implementation.select("falcon", impl, decline, argname="impl")
    if name == "xla" and impl == "auto" and jax.default_backend() in ("gpu", "tpu") and reasons:
        reason = reasons[-1]
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"falcon: {reason}; using the XLA chunk form.", stacklevel=4)
    return name


def run_rule(rule: Rule, q, k, v, inputs: dict, *, form: str, chunk_size: int, scale,
             initial_state: FalconState | None, segment_ids, impl, kernel_config, return_final_state: bool):
    """Shared driver of ``falcon`` and the baselines (arguments already validated).

    q,k [B,T,H,dk]; v [B,T,H,dv]; inputs {name: [B,T,H] or [B,T,H,dv]}.
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    chunk_size = int(chunk_size)  # a NumPy int (validated) would reach the kernels' block shapes
    cdt = compute_dtype(q, k, v, *inputs.values())
    out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    tail = rule.window - 1
    if initial_state is None:
        if rule.window > T:
            return _window_capped(rule, q, k, v, inputs, form=form, chunk_size=chunk_size, scale=scale,
                                  segment_ids=segment_ids, impl=impl, kernel_config=kernel_config,
                                  return_final_state=return_final_state)
        state = empty_state(B, H, dk, dv, tail, cdt)
    else:
        val.check_state(initial_state, B, H, dk, dv, tail)
        state = cast_state(initial_state, cdt)
    if B == 0 or H == 0:  # nothing to compute (and the kernels' grids and shards cannot be empty)
        out = jnp.zeros((B, T, H, dv), out_dtype)
        return (out, state.replace(has_key=jnp.ones((B,), bool))) if return_final_state else out
    kernel = select_kernel(impl, rule, inputs, dk, dv, out_dtype, chunk_size) if form == "chunk" else "xla"
    if kernel_config is not None:
        val.check_kernel_config(kernel_config, KERNEL_CONFIGS[kernel_op_name(rule, inputs)])
    q, k, v = (a.astype(cdt) for a in (q, k, v))
    inputs = {name: a.astype(cdt) for name, a in inputs.items()}

    def forward_for(width: int):
        """The rule's forward on values ``width`` wide (context parallelism runs wider values than ``dv``): the
        call's kernel where it serves that width, else the XLA chunk form."""
        name = kernel
        if name != "xla" and width != dv:
            reason = pallas_unsupported(rule, inputs, name, width, dk, out_dtype, chunk_size)
            if any(a.ndim == 4 for a in inputs.values()):  # the widened groups are dk + 1 columns, not one
                reason = f"{rule.name}: the per-column kernels take one gate per value column"
            if reason is not None:
                name = "xla"
                if reason not in _warned:
                    _warned.add(reason)
                    warnings.warn(f"falcon: context parallelism runs values {width} wide: {reason}; that pass uses "
                                  f"the XLA chunk form.", stacklevel=4)
        return functools.partial(_forward, rule, form=form, chunk_size=chunk_size, kernel=name,
                                 kernel_config=kernel_config if name == kernel else None, kernel_dtype=out_dtype)

    plan = context_parallel.plan(current(), rule, B, T, H)
    if plan is not None:
        o, final = context_parallel.run(plan, rule, forward_for, q, k, v, inputs, segment_ids, state)
    else:
        resets = segment_starts(segment_ids, B, T)
        o, final = forward_for(dv)(q, k, v, inputs, resets, state, sharded=True)
    out = (o * scale).astype(out_dtype)
    return (out, final) if return_final_state else out


def _forward(rule: Rule, q, k, v, inputs: dict, resets, state: FalconState, *, form: str, chunk_size: int,
             kernel: str, kernel_config, kernel_dtype, sharded: bool = False):
    """The rule on one sequence from ``state``: ``(o [B, T, H, dv] unscaled, final state)``.

    q, k, v, inputs in the compute dtype (``[B, T, H, ...]``), resets ``[B, T]``.  ``kernel``: "xla" or the Pallas
    implementation of the chunk form; ``sharded``: under :func:`~falcon_jax.sharding.kernel_sharding` the kernels
    run once per device shard of rows and heads."""
    B, T, H, _ = q.shape

    def kernels(time_major: bool):
        """The Pallas chunk form; under kernel_sharding(mesh) each device runs it on its own rows and heads."""
        fn = functools.partial(chunk_pallas, rule, chunk_size=chunk_size, implementation=kernel,
                               kernel_config=kernel_config, kernel_dtype=kernel_dtype, time_major=time_major)
        return per_shard(fn, batch=B, heads=H, head_dim=2 if time_major else 1) if sharded else fn

    if kernel != "xla" and time_major_served(rule, inputs):
        # the kernels read and write the model's [B, T, H, ...] layout in place: no transposed copies
        return kernels(time_major=True)(q, k, v, inputs, resets, state)
    qh, kh, vh = (_heads_first(a) for a in (q, k, v))
    inputs_h = {name: _heads_first(a) for name, a in inputs.items()}
    if form == "recurrent":
        o, final = recurrent(rule, qh, kh, vh, inputs_h, resets, state)
    elif form == "parallel":
        o, final = parallel(rule, qh, kh, vh, inputs_h, resets, state)
    elif kernel != "xla":
        o, final = kernels(time_major=False)(qh, kh, vh, inputs_h, resets, state)
    elif compact_served(rule, inputs):  # Falcon-3 in XLA: each chunk on its C + W − 1 distinct pairs
        o, final = chunk_pallas(rule, qh, kh, vh, inputs_h, resets, state, chunk_size=chunk_size,
                                implementation="xla")
    else:
        o, final = chunk(rule, qh, kh, vh, inputs_h, resets, state, chunk_size=chunk_size)
    return jnp.moveaxis(o, 1, 2), final


def _window_capped(rule: Rule, q, k, v, inputs: dict, *, return_final_state: bool, **kw):
    """A window longer than the sequence, from an empty state: position t sees at most t + 1 pairs, so the
    rule with window T gives the same outputs (the chunk and parallel forms unroll the window: their
    compile time would grow with W for nothing).  The final state keeps the layout of window W: its tail is
    the capped rule's T − 1 pairs after W − T empty slots."""
    T = q.shape[1]
    capped = dataclasses.replace(rule, window=T)
    out, state = run_rule(capped, q, k, v, inputs, initial_state=None, return_final_state=True, **kw)
    if not return_final_state:
        return out
    missing = rule.window - T

    def pad(a, axis):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (missing, 0)
        return jnp.pad(a, widths)

    return out, state.replace(tail_x=pad(state.tail_x, 2), tail_y=pad(state.tail_y, 2),
                              tail_valid=pad(state.tail_valid, 1))


def falcon(q, k, v, beta, lam, *, variant, window=4, form="chunk", chunk_size=64, alignment="shifted",
           timing="raw", step="normalized", scale_coupled=False, eps=1e-6, eps_gamma=1e-6, scale=1.0,
           initial_state=None, return_final_state=False, segment_ids=None, impl="auto", kernel_config=None):
    """Falcon fast-weight attention, one of six rules, in one of three equivalent forms.

    Per head, with the prefix-aligned write pair ``x_t = k_{t-1}, y_t = v_t``
    (``alignment="shifted"``; ``x_0 = 0`` is a sentinel: no write, no decay)::

        η_t = β_t / (E_t + λ_t + ε)            (step="normalized"; "direct": η_t = β_t)
        γ_t = 1 − min(η_t λ_t, 1 − ε_γ)
        Falcon-1:  S_t = γ_t S_{t-1} + η_t x_t (y_t − S_{t-1}ᵀ x_t)ᵀ          E_t = ‖x_t‖²
        Falcon-2:  the same per value column c with η_{t,c}, γ_{t,c}
        Falcon-3:  S_t = γ_t S_{t-1} + η_t/B_t Σ_{j∈I_t} x_j (y_j − S_{t-1}ᵀ x_j)ᵀ   E_t = λmax(X_tᵀX_t)/B_t
        Falcon-1A: S_t = γ_t S_{t-1} + η_t x_t y_tᵀ                         E_t = ‖x_t‖²
        Falcon-2A: the same per value column
        Falcon-3A: S_t = γ_t S_{t-1} + η_t/B_t Σ_{j∈I_t} x_j y_jᵀ             E_t = mean_{j∈I_t} ‖x_j‖²
        o_t = scale · S_tᵀ q_t   (timing="raw";  "rbw" reads S_{t-1})

    ``I_t`` is the last ``window`` pairs (3/3A only), ``B_t = |I_t|``.

    Args:
      q, k: ``[B, T, H, dk]``.  v: ``[B, T, H, dv]``.  The three of one floating dtype, the output's (the gates
        may have another, e.g. fp32 gates with bf16 q, k, v).
      beta: gains ``[B, T, H]``; ``[B, T, H, dv]`` for the per-column variants "2"/"2A"
        (a ``[B, T, H]`` gain is shared by all columns), or a scalar (the same gain everywhere).
        Domain: β ∈ [0, 2] with ``step="normalized"``; with ``step="direct"`` it is η itself, η ≥ 0.
      lam: ridge ``[B, T, H]`` or a scalar, λ ≥ 0; with ``scale_coupled=True`` it is λ̄ ≥ 0 and
        λ_t = λ̄_t·sg(E_t).
        Concrete ``beta``/``lam`` outside the domain (or not finite) raise ``ValueError``; traced ones
        (under ``jit``/``grad``) are clamped into it, with zero gradient where the clamp acts.  Inside
        the domain γ ∈ [ε_γ, 1] and no finite input makes the state overflow (docs/rules.md).
      variant: "1", "2", "3", "1A", "2A" or "3A".
      window: sliding-window size B ≥ 1 for "3"/"3A" (ignored by the others).  Without an
        ``initial_state``, a window longer than T is run as window T (identical outputs, the compile
        time of window T) and the final state keeps window W's layout.
      form: "recurrent" (lax.scan), "parallel" (O(T²)) or "chunk" (SSD-style, O(T·C)).
      chunk_size: chunk length C of the chunk form, a power of two (checked with every form); any T works (a C
        longer than T runs as one chunk of the next power of two >= T).  Falcon-3 (kernels and XLA alike)
        counts C in rows, ``next_pow2(window)`` per step: C / next_pow2(window) steps per chunk.
      alignment: "shifted" (prefix-aligned pair, the Falcon default) or "same_step" (x_t = k_t).
      timing: "raw" (read after write) or "rbw" (read before write).
      initial_state: a :class:`FalconState` to continue from (fed to the first segment).  A concrete state
        holding NaN or inf raises ``ValueError`` naming the field; a traced one is not read (docs/rules.md).
      return_final_state: also return the state after the last position.
      segment_ids: ``[B, T]`` ints for packed sequences; the state resets where the id changes.
      impl: implementation of the chunk form (:mod:`falcon_jax.kernels.implementation`): "auto" (the kernels
        of this machine's accelerator where they serve the call, else XLA, warning once per reason), "xla" (the
        XLA chunk form), "mosaic_gpu", "triton" or "mosaic_tpu" (those Pallas kernels, or an error saying why
        not; off their accelerator they run in interpret mode), or a sequence of these tried in order.
      kernel_config: launch parameters of the kernel op that serves the rule (a ``KernelConfig`` of
        ``falcon_jax.kernels.decayed_attention`` for 1A/3A, ``decayed_delta_rule`` for 1/3, ``per_column`` for
        per-column 2/2A); None: the op's tuned values.

    Returns:
      ``out [B, T, H, dv]`` in the dtype of q, k, v, or ``(out, FalconState)``.
      Internally everything runs in fp32 (fp64 for fp64 inputs).
    """
    val.check_variant(variant)
    variant = variant.upper()
    val.check_window(window)
    val.check_options(form=form, alignment=alignment, timing=timing, step=step, impl=impl, eps=eps,
                      eps_gamma=eps_gamma, scale=scale)
    val.check_flag("scale_coupled", scale_coupled)
    val.check_flag("return_final_state", return_final_state)
    val.check_chunk_size(chunk_size)
    B, T, H, dk, dv = val.check_qkv(q, k, v)
    beta, lam = (val.gate_array(name, x, (B, T, H), q) for name, x in (("beta", beta), ("lam", lam)))
    val.check_beta_for_variant(beta, variant, B, T, H, dv)
    val.check_gate("lam", lam, B, T, H)
    beta, lam = val.falcon_gates_in_domain(beta, lam, step=step)
    val.check_segment_ids(segment_ids, B, T)
    rule = falcon_rule(variant, window=int(window), alignment=alignment, timing=timing, step=step,
                       scale_coupled=bool(scale_coupled), eps=float(eps), eps_gamma=float(eps_gamma))
    return run_rule(rule, q, k, v, {"beta": beta, "lam": lam}, form=form, chunk_size=chunk_size,
                    scale=scale, initial_state=initial_state, segment_ids=segment_ids, impl=impl,
                    kernel_config=kernel_config, return_final_state=return_final_state)


def falcon_step(state, q_t, k_t, v_t, beta_t, lam_t, *, variant, window=4, alignment="shifted",
                timing="raw", step="normalized", scale_coupled=False, eps=1e-6, eps_gamma=1e-6, scale=1.0):
    """One decoding step; equals the recurrent form token by token.

    Args:
      state: :class:`FalconState` (``init_state(...)`` or from ``falcon(..., return_final_state=True)``); finite
        when concrete, as ``falcon``'s ``initial_state``.
      q_t, k_t: ``[B, H, dk]``;  v_t: ``[B, H, dv]``;  beta_t: ``[B, H]`` (``[B, H, dv]`` for 2/2A) or a
      scalar;  lam_t: ``[B, H]`` or a scalar.  Their domain, checks and clamping, and the options, as in
      :func:`falcon`.

    Returns:
      ``(o_t [B, H, dv], new_state)``; ``new_state`` is in the compute dtype (fp32, or fp64 for fp64 inputs)
      whatever ``state``'s dtype, so a ``lax.scan`` carrying it starts from an fp32 state (``init_state``'s
      default), not a bf16 one.
    """
    val.check_variant(variant)
    variant = variant.upper()
    val.check_window(window)
    val.check_options(form="recurrent", alignment=alignment, timing=timing, step=step, impl="auto",
                      eps=eps, eps_gamma=eps_gamma, scale=scale)
    val.check_flag("scale_coupled", scale_coupled)
    B, H, dk, dv = val.check_step_qkv(q_t, k_t, v_t)
    beta_t, lam_t = (val.gate_array(name, x, (B, H), q_t) for name, x in (("beta_t", beta_t), ("lam_t", lam_t)))
    val.check_step_gates(beta_t, lam_t, variant, B, H, dv)
    beta_t, lam_t = val.falcon_gates_in_domain(beta_t, lam_t, step=step, names=("beta_t", "lam_t"))
    val.check_state(state, B, H, dk, dv, tail_length_for(variant, window), argname="state")
    rule = falcon_rule(variant, window=int(window), alignment=alignment, timing=timing, step=step,
                       scale_coupled=bool(scale_coupled), eps=float(eps), eps_gamma=float(eps_gamma))
    cdt = compute_dtype(q_t, k_t, v_t, beta_t, lam_t)
    state = cast_state(state, cdt)
    out_dtype = jnp.result_type(q_t.dtype, k_t.dtype, v_t.dtype)
    if B == 0 or H == 0:  # nothing to compute, as in falcon (the step's reshapes cannot infer an empty axis)
        return jnp.zeros((B, H, dv), out_dtype), state.replace(has_key=jnp.ones((B,), bool))
    o, new_state = recurrent_step(rule, state, q_t.astype(cdt), k_t.astype(cdt), v_t.astype(cdt),
                        {"beta": beta_t.astype(cdt), "lam": lam_t.astype(cdt)})
    return (o * scale).astype(out_dtype), new_state
