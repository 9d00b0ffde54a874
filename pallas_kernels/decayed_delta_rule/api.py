"""``decayed_delta_rule``: the chunked decayed delta rule (Falcon-1's recurrence; DeltaNet with γ = 1; Gated
DeltaNet with ``decay_before_residual=True``).

    p_t = η_t (y_t − S_{t-1}ᵀ x_t),   S_t = [same segment] · e^{a_t} S_{t-1} + x_t p_tᵀ,   o_t = S_tᵀ q_t

(:mod:`.reference`; the residual is measured on the *undecayed* previous state, as Falcon-1 does, or with
``decay_before_residual=True`` on the decayed one, ``p_t = η_t (y_t − e^{a_t} S_{t-1}ᵀ x_t)``.)  The passes
and their order are in :mod:`.op`; the launch parameters in :mod:`.config` and :mod:`.tuned`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels.common import (check_config, check_flag, check_operands, check_pieces, empty_result,
                                       floor_log_decay, kernel_operands, next_pow2, shift_time, swap_time_heads)
from falcon_jax.kernels.decayed_delta_rule.config import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.op import Static, kernel_op
from falcon_jax.kernels.decayed_delta_rule.reference import decayed_delta_rule_reference
from falcon_jax.kernels.decayed_delta_rule.shifted_keys import fold_first_row, keys_one_row_later
from falcon_jax.kernels.decayed_delta_rule.tuned import tuned_config

OP_IMPLEMENTATIONS = ("mosaic_gpu", "triton", "mosaic_tpu", "xla")


def unsupported_reason(name: str, q, y, chunk_size: int, interpret: bool | None = None) -> str | None:
    """Why implementation ``name`` declines a call with these q, y and chunk (None: it serves it).  The kernels'
    dots need every dimension (dk, dv, the chunk, the triangular inverse's 16-row blocks) a power of two ≥ 16."""
    return impl.kernel_reason(name, q, y, chunk_size, interpret)


def keys_read_in_place(config: KernelConfig, implementation: str, bh: int, dv: int, pieces: int) -> bool:
    """Whether the passes a ``shifted_keys=True`` call runs read the keys one row back in place: the GPU's fused
    output walk, reverse walk and chunk gradients over one piece.  Elsewhere the op shifts the keys in XLA (a
    copy).  ``config`` resolved for the call."""
    return (implementation in ("mosaic_gpu", "triton") and pieces == 1
            and not config.split_forward(bh, dv, config.block_v))


def decayed_delta_rule(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                       implementation="auto", config: KernelConfig | None = None, pieces: int | None = None,
                       interpret: bool | None = None, layout: str = "BHTD", shifted_keys: bool = False,
                       first_key=None, decay_before_residual: bool = False):
    """Chunked decayed delta rule (residual on the undecayed state, or on the decayed one).

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      eta: ``[B, H, T]`` write weight, or ``[B, H, T, dv]`` one per value column (cast to fp32; per-column gates
        go to :func:`falcon_jax.kernels.per_column.decayed_delta_rule_per_column`).
      log_gamma: ``[B, H, T]`` log decay ≤ 0, or ``[B, H, T, dv]`` per value column (cast to fp32); below −30
        it counts as −30 (:func:`~falcon_jax.kernels.common.floor_log_decay`).
      run: ``[B, H, T]`` int, number of segment starts up to t (non-decreasing; 0 = continues
        ``initial_state``); the state resets to zero before a step whose run index changes.
      initial_state: ``[B, H, dk, dv]``.
      implementation: ``"auto"``, ``"mosaic_gpu"``, ``"triton"``, ``"mosaic_tpu"``, ``"xla"`` or a sequence of
        them (:mod:`falcon_jax.kernels.implementation`).
      config: launch parameters and precision (:class:`KernelConfig`); None: the tuned row for this device and
        dtype (:func:`.tuned.tuned_config`).  Scalar gates only (per-column gates refuse it).
      pieces: cut the sequence into this many pieces walked in parallel (GPU; None: by the program count), a
        power of two; more pieces than chunks run as one piece per chunk.  Scalar gates only.
      interpret: run the kernels in Pallas's interpret mode (None: off their accelerator).
      layout: ``"BHTD"`` (the shapes above) or ``"BTHD"``: q, x ``[B, T, H, dk]``, y ``[B, T, H, dv]``,
        eta, log_gamma and run ``[B, T, H]`` (or ``[B, T, H, dv]``), o ``[B, T, H, dv]``.  The GPU kernels read
        and write it in place; the other paths transpose.
      shifted_keys: x holds the keys k and row t's write feature is ``k[t − 1]``; row 0's is ``first_key``:
        Falcon's prefix-aligned pair ``(k_{t−1}, v_t)`` without a shifted copy of k where the GPU passes read k
        one row back in place (:func:`keys_read_in_place`); elsewhere k is shifted in XLA.  x's gradient is k's.
      first_key: ``[B, H, dk]``, row 0's write feature under ``shifted_keys`` (None: zero).
      decay_before_residual: measure the residual on the decayed state, ``p_t = η_t (y_t − e^{a_t} S_{t-1}ᵀ x_t)``
        (Gated DeltaNet: ``x = k``, ``η = β``).  Every lowering serves it (the passes read the residual's decay
        as an operand, here the row's own inclusive decay); scalar gates only.
    Returns:
      ``(o [B, H, T, dv] (or [B, T, H, dv]) in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    B, T, H, dk, dv = check_operands("decayed_delta_rule", q, x, y, {"eta": eta, "log_gamma": log_gamma}, run,
                                     initial_state, chunk_size=chunk_size, layout=layout, per_column=True)
    check_pieces("decayed_delta_rule", pieces)
    check_config("decayed_delta_rule", config, KernelConfig)
    check_flag("decayed_delta_rule", "shifted_keys", shifted_keys)
    check_flag("decayed_delta_rule", "decay_before_residual", decay_before_residual)
    if first_key is not None:
        if not shifted_keys:
            raise ValueError("decayed_delta_rule: first_key is row 0's write feature under shifted_keys=True; pass "
                             "shifted_keys=True, or put the feature into x's row 0 yourself.")
        if not hasattr(first_key, "dtype") or not jnp.issubdtype(first_key.dtype, jnp.floating):
            raise TypeError(f"decayed_delta_rule: first_key must be a floating-point array [B, H, dk]; got "
                            f"{getattr(first_key, 'dtype', type(first_key).__name__)}.")
        want = initial_state.shape[:3]
        if first_key.shape != want:
            raise ValueError(f"decayed_delta_rule: first_key must be [B, H, dk] = {list(want)} (initial_state's "
                             f"leading dims), got {list(first_key.shape)}.")
    chunk_size = int(chunk_size)  # a NumPy int would reach the kernels' block shapes
    if B * H == 0:
        return empty_result(B, T, H, dk, dv, y.dtype, layout)
    in_place = layout == "BTHD"
    if decay_before_residual and (eta.ndim == 4 or log_gamma.ndim == 4):
        raise NotImplementedError("decayed_delta_rule: decay_before_residual=True takes scalar gates (eta and "
                                  "log_gamma [B, H, T]); the per-column kernels measure the residual on the "
                                  "undecayed state only.")
    if eta.ndim == 4 or log_gamma.ndim == 4:  # per-column gates: their own kernels
        from falcon_jax.kernels.per_column import decayed_delta_rule_per_column

        if config is not None or pieces is not None:
            raise ValueError("decayed_delta_rule: per-column gates (eta or log_gamma [B, H, T, dv]) run the "
                             "per-column kernels, which take neither this op's `config` nor `pieces`; leave them "
                             "None, or call falcon_jax.kernels.per_column.decayed_delta_rule_per_column with its "
                             "own KernelConfig.")
        if in_place:
            q, x, y, eta, log_gamma, run = (swap_time_heads(a) for a in (q, x, y, eta, log_gamma, run))
        if shifted_keys:
            x = keys_one_row_later(x, first_key, 2)
        o, final = decayed_delta_rule_per_column(q, x, y, eta, log_gamma, run, initial_state, chunk_size=chunk_size,
                                                 implementation=implementation, interpret=interpret)
        return (swap_time_heads(o) if in_place else o), final
    log_gamma = floor_log_decay(log_gamma)  # the per-column op above floors its own
    name = impl.select("decayed_delta_rule", implementation, lambda n: unsupported_reason(n, q, y, chunk_size,
                                                                                          interpret))
    if name == "xla" or (in_place and name == "mosaic_tpu"):  # these take [B, H, T, d]
        if in_place:
            q, x, y, eta, log_gamma, run = (swap_time_heads(a) for a in (q, x, y, eta, log_gamma, run))
        if shifted_keys:
            x = keys_one_row_later(x, first_key, 2)
        if name == "xla":
            o, final = decayed_delta_rule_reference(q, x, y, eta, log_gamma, run, initial_state,
                                                    decay_before_residual=decay_before_residual)
            o = o.astype(y.dtype)
        else:
            o, final = _kernels(q, x, y, eta, log_gamma, run, initial_state, chunk_size, name, config, pieces,
                                interpret, in_place=False, shifted_keys=False, first_key=None,
                                decay_before_residual=decay_before_residual)
        return (swap_time_heads(o) if in_place else o), final
    return _kernels(q, x, y, eta, log_gamma, run, initial_state, chunk_size, name, config, pieces, interpret,
                    in_place=in_place, shifted_keys=shifted_keys, first_key=first_key,
                    decay_before_residual=decay_before_residual)


def _kernels(q, x, y, eta, log_gamma, run, initial_state, chunk_size, name, config, pieces, interpret, *, in_place,
             shifted_keys, first_key, decay_before_residual):
    """The kernel op for implementation ``name``: pad, flatten (or keep ``[B, T, H, d]`` in place on the GPU),
    resolve the config, and read the keys one row back in place or shift them."""
    interpret = impl.interpret_mode(name, interpret)
    B, T, H, dk = q.shape if in_place else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    dv = y.shape[-1]
    dtype = q.dtype
    n_chunks = next_pow2(-(-T // chunk_size))  # power-of-two chunk count keeps every block a power of two
    L = n_chunks * chunk_size
    config = config or tuned_config(dtype)
    config = dataclasses.replace(config, block_v=config.block_v_for(B * H, dv, dtype, dk),
                                 grad_block_v=min(config.grad_block_v, dv))
    P = 1 if name == "mosaic_tpu" else config.pieces(B * H, dv // config.block_v, n_chunks, pieces)
    # padding: zero pairs, zero write weight and zero log decay (identity steps), run continued.  In place the
    # tokens stay [B, L, H, d] (padded in time only); the gates are [B·H, L] either way.
    tokens, gates = kernel_operands(in_place, L, gate_kernel=True, interpret=interpret)
    key_shift = shifted_keys and keys_read_in_place(config, name, B * H, dv, P)
    if shifted_keys and not key_shift:
        x = shift_time(x, 1, axis=1 if in_place else 2)
    f32 = jnp.float32
    heads = H if in_place else None
    y_k, eta_k, lg_k, run_k = (tokens(y.astype(dtype)), gates(eta.astype(f32)), gates(log_gamma.astype(f32)),
                               gates(run.astype(jnp.int32), mode="edge"))
    s0 = initial_state.astype(f32).reshape(B * H, dk, dv)
    x0 = None if first_key is None else first_key.astype(f32).reshape(B * H, dk)
    if key_shift:  # the op folds row 0's step itself, so that the kernels form its dy row
        s0 = (s0, jnp.zeros((B * H, dk), f32) if x0 is None else x0)
    elif shifted_keys and x0 is not None:  # the shifted copy's row 0 is zero: row 0's step folded here
        (s0, eta_k, lg_k, run_k), _ = fold_first_row(s0, x0, y_k, eta_k, lg_k, run_k, heads,
                                                     decay_before_residual)
    st = Static(chunk=chunk_size, config=config, pieces=P, interpret=interpret, implementation=name, group=1,
                heads=heads, key_shift=key_shift, decay_before_residual=decay_before_residual)
    o, final = kernel_op(tokens(q.astype(dtype)), tokens(x.astype(dtype)), y_k, eta_k, lg_k, run_k, s0, st)
    o = o[:, :T] if in_place else o[:, :T].reshape(B, H, T, dv)
    return o, final.reshape(B, H, dk, dv)
