"""Argument checks shared by the public functions.

Every failure names the argument and says how to fix it.  Shapes, dtypes and Python options are
checked always (they are static, so the checks run unchanged under ``jax.jit``).  The *values* of
the gates are checked against the rules' domain only when they are concrete (NumPy arrays, or JAX
arrays outside a trace); traced values cannot be inspected, so :func:`clamp` moves them into the
domain instead.  The checks of ``variant`` and ``window`` (which fix a state's layout) live in
:mod:`falcon_jax.state` and are re-exported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from falcon_jax.kernels.common import LOG_DECAY_FLOOR
from falcon_jax.rules import PER_COLUMN_VARIANTS
from falcon_jax.state import FalconState, check_variant, check_window  # noqa: F401 - re-exported

FORMS = ("recurrent", "parallel", "chunk")
ALIGNMENTS = ("shifted", "same_step")
TIMINGS = ("raw", "rbw")
STEPS = ("normalized", "direct")
IMPLS = ("auto", "mosaic_gpu", "triton", "mosaic_tpu", "xla")  # falcon_jax.kernels.implementation


def _choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(repr(c) for c in choices)}; got {value!r}.")


def check_chunk_size(chunk_size) -> None:
    """The chunk length of the chunk form, checked with every form: a typo is caught before a switch to it."""
    ok = (not isinstance(chunk_size, bool) and isinstance(chunk_size, (int, np.integer))
          and chunk_size >= 1 and (chunk_size & (chunk_size - 1)) == 0)
    if not ok:
        raise ValueError(f"`chunk_size` must be a positive power of two (e.g. 64), whatever the form; got "
                         f"{chunk_size!r}.")


def check_options(*, form, alignment, timing, step, impl, eps, eps_gamma, scale) -> None:
    _choice("form", form, FORMS)
    _choice("alignment", alignment, ALIGNMENTS)
    _choice("timing", timing, TIMINGS)
    _choice("step", step, STEPS)
    if isinstance(impl, str) or not isinstance(impl, (list, tuple)):
        _choice("impl", impl, IMPLS)
    elif not impl or any(not isinstance(i, str) or i not in IMPLS[1:] for i in impl):
        raise ValueError(f"`impl` as a sequence lists implementations to try in order, each one of "
                         f"{', '.join(repr(c) for c in IMPLS[1:])}; got {impl!r}.")
    if not _real(eps) or not 0 <= eps < np.inf:
        raise ValueError(f"`eps` must be a finite float >= 0; got {eps!r}.")
    if not _real(eps_gamma) or not 0 < eps_gamma < 1:
        raise ValueError(f"`eps_gamma` must be a float in (0, 1); got {eps_gamma!r}.")
    if not _real(scale):
        raise TypeError(f"`scale` must be a Python or NumPy real number; got {type(scale).__name__}.")
    if not np.isfinite(scale):
        raise ValueError(f"`scale` must be finite; got {scale!r}.")


def _real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def check_flag(name: str, value) -> None:
    """A yes/no option must be a bool: any other value (a string such as "false" is truthy) is an error."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False; got {value!r}.")


def _floating(name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array; got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`{name}` must be a floating-point array (bf16, fp16, fp32 or fp64); got dtype {x.dtype}.")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Returns ``(B, T, H, dk, dv)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _floating(name, x)
        if x.ndim != 4:
            raise ValueError(f"`{name}` must have rank 4 [batch, time, heads, dim]; got shape {tuple(x.shape)}.")
    _one_dtype(("q", "k", "v"), (q, k, v))
    if q.shape != k.shape:
        raise ValueError(f"`q` and `k` must have the same shape [B, T, H, dk]; got {tuple(q.shape)} and {tuple(k.shape)}.")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"`v` must match `q` in [batch, time, heads]; got v {tuple(v.shape)} and q {tuple(q.shape)}.")
    B, T, H, dk = q.shape
    if T < 1:
        raise ValueError("`q`, `k`, `v` must have at least one time step (T >= 1).")
    _head_dims(("q", "k", "v"), dk, v.shape[3])
    return B, T, H, dk, v.shape[3]


def _one_dtype(names: tuple[str, str, str], arrays) -> None:
    """q, k and v in one dtype, the output's: mixed, they would be promoted silently (bf16 q and v with an fp32 k
    give an fp32 output).  The gates have no such rule: fp32 gates with bf16 q, k, v are the layers' own calls."""
    dtypes = [jnp.dtype(x.dtype) for x in arrays]
    if len(set(dtypes)) > 1:
        got = ", ".join(f"{n} {d}" for n, d in zip(names, dtypes))
        casts = ", ".join(f"{n}.astype({names[0]}.dtype)" for n, d in zip(names[1:], dtypes[1:]) if d != dtypes[0])
        raise TypeError(f"`{names[0]}`, `{names[1]}` and `{names[2]}` must have one dtype (the output's); got {got}. "
                        f"Cast them to one dtype, e.g. {casts}; the gates may keep theirs (they run in fp32 or wider).")


def _head_dims(names: tuple[str, str, str], dk: int, dv: int) -> None:
    """Heads of width 0 have an empty state: every output would be 0 (or empty) whatever the inputs."""
    q, k, v = names
    if dk < 1:
        raise ValueError(f"`{q}` and `{k}` must have a head dim dk >= 1; got dk = 0.")
    if dv < 1:
        raise ValueError(f"`{v}` must have a head dim dv >= 1; got dv = 0.")


def check_step_qkv(q_t, k_t, v_t) -> tuple[int, int, int, int]:
    """:func:`falcon_step`'s query, key and value, one token each (no time axis); returns ``(B, H, dk, dv)``."""
    for name, x, dims in (("q_t", q_t, "B, H, dk"), ("k_t", k_t, "B, H, dk"), ("v_t", v_t, "B, H, dv")):
        _floating(name, x)
        if x.ndim != 3:
            raise ValueError(f"`{name}` must be [{dims}] (rank 3, one token); got shape {tuple(x.shape)}. For step t "
                             f"of a sequence {name[0]} [B, T, H, ...] pass {name[0]}[:, t], without the time axis.")
    _one_dtype(("q_t", "k_t", "v_t"), (q_t, k_t, v_t))
    B, H, dk = q_t.shape
    if tuple(k_t.shape) != (B, H, dk):
        raise ValueError(f"`k_t` must be [B, H, dk] = {[B, H, dk]}, the shape of `q_t`; got {tuple(k_t.shape)}.")
    if tuple(v_t.shape[:2]) != (B, H):
        raise ValueError(f"`v_t` must be [B, H, dv] with the [B, H] = {[B, H]} of `q_t`; got {tuple(v_t.shape)}.")
    _head_dims(("q_t", "k_t", "v_t"), dk, v_t.shape[2])
    return B, H, dk, v_t.shape[2]


def check_hidden(owner: str, h, d_model: int, *, min_time: int = 0) -> tuple[int, int]:
    """A layer's input ``h [B, T, D]``: a floating-point array with ``D = d_model`` and ``T >= min_time``;
    returns ``(B, T)``.  Errors start with ``owner`` (the layer's class)."""
    if not hasattr(h, "shape") or not hasattr(h, "dtype"):
        raise TypeError(f"{owner}: `h` must be a floating-point array [B, T, D]; got {type(h).__name__}.")
    if not jnp.issubdtype(h.dtype, jnp.floating):
        raise TypeError(f"{owner}: `h` must be a floating-point array [B, T, D] of hidden states; got dtype "
                        f"{h.dtype} (token ids go to FalconLM, which embeds them).")
    if h.ndim != 3 or h.shape[2] != d_model:
        hint = " (one sequence: add its batch axis, h[None])" if h.ndim == 2 and h.shape[1] == d_model else ""
        raise ValueError(f"{owner}: `h` must be [B, T, D] with D = d_model = {d_model}; got shape "
                         f"{tuple(h.shape)}{hint}.")
    if h.shape[1] < min_time:
        raise ValueError(f"{owner}: `h` must have T >= {min_time} time steps; got shape {tuple(h.shape)}.")
    return h.shape[0], h.shape[1]


def check_gate(name: str, x, B: int, T: int, H: int, *, dv: int | None = None, what: str = "") -> None:
    """``x`` must be ``[B, T, H]``, or also ``[B, T, H, dv]`` when ``dv`` is given."""
    _floating(name, x)
    allowed = [(B, T, H)] + ([(B, T, H, dv)] if dv is not None else [])
    if tuple(x.shape) not in allowed:
        shapes = " or ".join(str(list(s)) for s in allowed)
        raise ValueError(f"`{name}` must have shape {shapes}{what}; got {tuple(x.shape)}.")


def gate_array(name: str, x, shape: tuple, like) -> jax.Array:
    """A gate given as a scalar (Python or NumPy number, or a 0-d array) broadcast to ``shape`` in the
    floating dtype of ``like`` (at least fp32); any other value is returned as given (checked later)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a number or a floating-point array; got a bool.")
    if isinstance(x, (int, float, np.integer, np.floating)):
        return jnp.full(shape, x, jnp.promote_types(like.dtype, jnp.float32))
    if hasattr(x, "shape") and hasattr(x, "dtype") and x.ndim == 0:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating-point array or a Python number; got a 0-d array of "
                            f"dtype {x.dtype}.")
        return jnp.broadcast_to(jnp.asarray(x), shape)
    return x


def is_concrete(x) -> bool:
    """Whether ``x``'s values can be read here: not a tracer, and all on this process."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def concrete_int_range(x) -> tuple[int, int] | None:
    """``(min, max)`` of an integer array whose values can be read here, None when it is traced or empty.  NumPy
    input is read in NumPy: jnp would wrap int64 values to int32 first (2**40 -> 0)."""
    if not is_concrete(x) or x.size == 0:
        return None
    if isinstance(x, np.ndarray):
        return int(np.min(x)), int(np.max(x))
    with jax.ensure_compile_time_eval():  # computed now even when a trace (of other inputs) is under way
        lo, hi = np.asarray(jnp.stack([jnp.min(x), jnp.max(x)]))
    return int(lo), int(hi)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def check_range(name: str, x, low: float | None, high: float | None, meaning: str, fix: str) -> None:
    """Concrete ``x`` must be finite and in ``[low, high]`` (either bound may be None); ValueError naming
    the argument, the range, the values found and the fix.  Traced ``x`` is not inspected (see :func:`clamp`)."""
    if not is_concrete(x) or x.size == 0:
        return
    if isinstance(x, np.ndarray):
        lo, hi, finite = float(np.min(x)), float(np.max(x)), bool(np.all(np.isfinite(x)))
    else:
        with jax.ensure_compile_time_eval():  # computed now even when a trace (of other inputs) is under way
            a = jnp.asarray(x, jnp.promote_types(x.dtype, jnp.float32))
            stats = np.asarray(jnp.stack([jnp.min(a), jnp.max(a), jnp.all(jnp.isfinite(a))]))
        lo, hi, finite = float(stats[0]), float(stats[1]), bool(stats[2])
    if low is not None and high is not None:
        bounds = f"in [{_fmt(low)}, {_fmt(high)}]"
    else:
        bounds = f">= {_fmt(low)}" if low is not None else f"<= {_fmt(high)}"
    if not finite:
        raise ValueError(f"`{name}` must be finite and {bounds}{meaning}; it holds NaN or inf.")
    if (low is not None and lo < low) or (high is not None and hi > high):
        raise ValueError(f"`{name}` must be {bounds}{meaning}; got values in [{_fmt(lo)}, {_fmt(hi)}]. {fix}")


def clamp(x, low: float | None, high: float | None):
    """``x`` moved into ``[low, high]`` (for traced values, which :func:`check_range` cannot read).

    Written with ``where``, not ``clip``: inside the closed range, the boundaries included, the value and
    its gradient are unchanged (``clip`` halves the gradient at a boundary); outside, the gradient is 0."""
    if low is not None:
        x = jnp.where(x < low, jnp.asarray(low, x.dtype), x)
    if high is not None:
        x = jnp.where(x > high, jnp.asarray(high, x.dtype), x)
    return x


BETA_MAX = 2.0  # the normalized step: η·E_t = β·E_t/(E_t + λ + ε) < 2 keeps the regression updates contractive


def falcon_gates_in_domain(beta, lam, *, step: str, names: tuple[str, str] = ("beta", "lam")):
    """Falcon's gates checked (concrete) and clamped (traced) into the rules' domain (docs/rules.md):

    * ``beta``: β ∈ [0, 2] with ``step="normalized"``; η ≥ 0 with ``step="direct"``.
    * ``lam``: λ ≥ 0 (λ̄ ≥ 0 when scale-coupled).

    ``names`` are the argument names the errors give (``("beta_t", "lam_t")`` for :func:`falcon_step`).

    Inside the domain the decay γ ∈ [ε_γ, 1] and the regression update ``I − η x xᵀ`` has eigenvalues in
    (−1, 1]: the state stays bounded for any finite q, k, v.  Outside, λ < 0 gives γ > 1 and β > 2 or
    β < 0 an expanding update, so a long sequence overflows to inf and then NaN."""
    beta_name, lam_name = names
    if step == "normalized":
        check_range(beta_name, beta, 0.0, BETA_MAX, " (the normalized step size)",
                    "Map a free parameter into the range with 2 * jax.nn.sigmoid(z).")
        beta = clamp(beta, 0.0, BETA_MAX)
    else:
        check_range(beta_name, beta, 0.0, None, " (the step size η with step='direct')",
                    "Map a free parameter into the range with jax.nn.softplus(z) or jax.nn.sigmoid(z).")
        beta = clamp(beta, 0.0, None)
    check_range(lam_name, lam, 0.0, None, " (the ridge λ; λ < 0 makes the decay γ > 1 and the state grow "
                "without bound)", "Map a free parameter into the range with jax.nn.softplus(z).")
    return beta, clamp(lam, 0.0, None)


def baseline_gates_in_domain(inputs: dict) -> dict:
    """The baselines' gates checked (concrete) and clamped (traced): ``beta`` ≥ 0 (a negative write gain
    expands the state), ``log_decay`` ≤ 0 (γ = exp(log_decay) ≤ 1), and ``log_decay`` below
    :data:`LOG_DECAY_FLOOR` raised to it, concrete or traced (its gradient there is 0).  DeltaNet's updates also need
    β‖k‖² ≤ 2 to stay contractive, which depends on the keys and is the caller's to keep (e.g. β = σ(z)
    with ℓ2-normalized keys)."""
    out = {}
    for name, x in inputs.items():
        if name == "beta":
            check_range("beta", x, 0.0, None, " (the write gain)",
                        "Map a free parameter into the range with jax.nn.sigmoid(z) or jax.nn.softplus(z).")
            x = clamp(x, 0.0, None)
        elif name == "log_decay":
            check_range("log_decay", x, None, 0.0, " (the log of the decay γ <= 1; log_decay > 0 makes the "
                        "state grow without bound)", "Use -jax.nn.softplus(z) or jnp.log(jax.nn.sigmoid(z)).")
            x = clamp(x, LOG_DECAY_FLOOR, 0.0)
        out[name] = x
    return out


def check_beta_for_variant(beta, variant: str, B: int, T: int, H: int, dv: int) -> None:
    _floating("beta", beta)
    if variant in PER_COLUMN_VARIANTS:
        check_gate("beta", beta, B, T, H, dv=dv, what=" (one gain per value column, or one per head)")
    elif beta.ndim == 4:
        raise ValueError(
            f"`beta` has per-column gains {tuple(beta.shape)} but variant {variant!r} takes one gain per "
            f"head, shape [B, T, H] = {[B, T, H]}; pass variant '2' or '2A' for per-column gains.")
    else:
        check_gate("beta", beta, B, T, H)


def check_step_gates(beta_t, lam_t, variant: str, B: int, H: int, dv: int) -> None:
    """:func:`falcon_step`'s gates: ``beta_t`` ``[B, H]`` (also ``[B, H, dv]`` for the per-column variants
    2/2A) and ``lam_t`` ``[B, H]``; errors name the step's arguments and give the shapes without a time axis."""
    def check(name, x, allowed, what=""):
        _floating(name, x)
        if tuple(x.shape) not in [shape for _, shape in allowed]:
            shapes = " or ".join(f"[{dims}] = {list(shape)}" for dims, shape in allowed)
            raise ValueError(f"`{name}` must have shape {shapes}{what}; got {tuple(x.shape)}. For step t of "
                             f"a gate over a sequence pass gate[:, t], without the time axis.")

    per_head = ("B, H", (B, H))
    _floating("beta_t", beta_t)
    if variant in PER_COLUMN_VARIANTS:
        check("beta_t", beta_t, [per_head, ("B, H, dv", (B, H, dv))],
              " (one gain per value column, or one per head)")
    elif tuple(beta_t.shape) == (B, H, dv):
        raise ValueError(
            f"`beta_t` must have shape [B, H] = {[B, H]} (variant {variant!r} takes one gain per head); got "
            f"{tuple(beta_t.shape)}, per-column gains: pass variant '2' or '2A' for per-column gains.")
    else:
        check("beta_t", beta_t, [per_head])
    check("lam_t", lam_t, [per_head])


def check_segment_ids(segment_ids, B: int, T: int) -> None:
    if segment_ids is None:
        return
    if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
        raise TypeError(f"`segment_ids` must be an integer array [B, T] = {[B, T]} (e.g. jnp.asarray(ids, "
                        f"jnp.int32)); got {type(segment_ids).__name__}.")
    if tuple(segment_ids.shape) != (B, T):
        raise ValueError(f"`segment_ids` must have shape [B, T] = {[B, T]}; got {tuple(segment_ids.shape)}.")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"`segment_ids` must be an integer array; got dtype {segment_ids.dtype}.")
    # 64-bit ids become int32 (without x64, and in the layers that compare ids as int32): ids that differ by a
    # multiple of 2**32 would merge into one segment.  Traced ids cannot be read here and are not checked.
    found = concrete_int_range(segment_ids) if np.dtype(segment_ids.dtype).itemsize == 8 else None
    if found is not None:
        lo, hi = found
        if lo < -2**31 or hi > 2**31 - 1:
            raise ValueError(f"`segment_ids` of dtype {segment_ids.dtype} must hold values in the int32 range "
                             f"[-2**31, 2**31 - 1] (they are used as int32, where ids 2**32 apart are one segment); "
                             f"got values in [{lo}, {hi}]. Renumber the segments of each row, e.g. "
                             f"np.unique(row, return_inverse=True)[1], and pass them as int32.")


def check_state(state, B: int, H: int, dk: int, dv: int, tail: int, *, argname: str = "initial_state") -> None:
    if not isinstance(state, FalconState):
        raise TypeError(f"`{argname}` must be a FalconState (from falcon(..., return_final_state=True) "
                        f"or falcon_jax.init_state); got {type(state).__name__}.")
    expected = {
        "S": ("B, H, dk, dv", (B, H, dk, dv)), "last_key": ("B, H, dk", (B, H, dk)), "has_key": ("B", (B,)),
        "tail_x": ("B, H, tail, dk", (B, H, tail, dk)), "tail_y": ("B, H, tail, dv", (B, H, tail, dv)),
        "tail_valid": ("B, tail", (B, tail)),
    }
    for field, (dims, shape) in expected.items():
        value = getattr(state, field)
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"`{argname}.{field}` must be an array; got {type(value).__name__}.")
        flag = field in ("has_key", "tail_valid")
        if flag and value.dtype != jnp.bool_:
            raise TypeError(f"`{argname}.{field}` must be a bool array; got dtype {value.dtype}.")
        if not flag and not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(f"`{argname}.{field}` must be a floating-point array (init_state makes fp32, fp64 "
                            f"under x64); got dtype {value.dtype}. Make states with falcon_jax.init_state or take "
                            f"them from falcon(..., return_final_state=True).")
        got = tuple(value.shape)
        if got != shape:
            hint = (" (the window tail length is window-1 for variants 3/3A and 0 otherwise: make the state "
                    "with the same variant and window)") if field.startswith("tail") else ""
            raise ValueError(f"`{argname}.{field}` has shape {got} but these inputs need [{dims}] = "
                             f"{list(shape)}{hint}.")
    check_state_finite(state, argname=argname)


STATE_VALUE_FIELDS = {"S": "the fast-weight matrix", "last_key": "the last key, the next call's first write feature",
                      "tail_x": "the window's earlier write features", "tail_y": "the window's earlier values"}


def _rows(flags: np.ndarray, limit: int = 8) -> str:
    rows = np.flatnonzero(flags)
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    return f"[{shown}{', …' if rows.size > limit else ''}]"


def check_state_finite(state: FalconState, *, argname: str) -> None:
    """A concrete state's floating fields must be finite: a NaN or inf there reaches the outputs of its row
    (masks and resets that multiply by 0 keep it: 0 · NaN = NaN), so the call would return garbage without a
    word.  Such a state usually comes from an earlier call whose q, k or v were not finite (they are not
    checked).

    Only concrete fields are read (NumPy arrays, or JAX arrays outside a trace, computed eagerly even while a
    trace of other inputs is under way); a traced state is not inspected, so under ``jit`` / ``grad`` this costs
    nothing and adds nothing to the jaxpr.  ValueError naming ``argname.field``, the batch rows and the fix."""
    fields = [(name, getattr(state, name)) for name in STATE_VALUE_FIELDS]
    fields = [(name, x) for name, x in fields if x.size and is_concrete(x)]
    if not fields:
        return

    def bad_rows(xp, x):  # (NaN, inf) flags per batch row
        return xp.isnan(x).reshape(x.shape[0], -1).any(1), xp.isinf(x).reshape(x.shape[0], -1).any(1)

    # NumPy fields are read in NumPy, in the dtype the call computes with: without x64 a float64 array becomes
    # float32, where a finite 1e39 is inf
    with np.errstate(over="ignore"):  # the overflow to inf is what is looked for
        per_row = {name: bad_rows(np, x.astype(jax.dtypes.canonicalize_dtype(x.dtype))) for name, x in fields
                   if isinstance(x, np.ndarray)}
    on_device = [(name, x) for name, x in fields if not isinstance(x, np.ndarray)]
    if on_device:
        with jax.ensure_compile_time_eval():  # computed now even when a trace (of other inputs) is under way
            flags = jax.device_get([bad_rows(jnp, x) for _, x in on_device])
        per_row.update(zip((name for name, _ in on_device), flags))
    for name, _ in fields:
        nan_rows, inf_rows = per_row[name]
        if not (nan_rows.any() or inf_rows.any()):
            continue
        found = " and ".join(f"{kind} in batch rows {_rows(rows)}"
                             for kind, rows in (("NaN", nan_rows), ("inf", inf_rows)) if rows.any())
        raise ValueError(f"`{argname}.{name}` ({STATE_VALUE_FIELDS[name]}) must be finite; it holds {found}. A "
                         f"non-finite state makes the outputs of those rows NaN. Such a state usually comes from "
                         f"a call whose q, k or v held NaN or inf (they are not checked): give that call finite "
                         f"inputs, or restart those rows from a fresh state (falcon_jax.init_state, or a layer's "
                         f"init_cache).")


def check_kernel_config(config, expected: type) -> None:
    """``falcon(kernel_config=...)`` must be the ``KernelConfig`` of the kernel op that serves the rule."""
    if not isinstance(config, expected):
        raise TypeError(f"`kernel_config` must be a {expected.__module__}.{expected.__qualname__} for this rule (the "
                        f"launch parameters of the kernel op that serves it); got {type(config).__name__}.")
