"""Checks users can run on their own inputs: the forms agree, the library matches the float64 reference,
states and caches have the layout they should.  Built on ``chex``; every check raises ``AssertionError``
with what differed and by how much.

Example (runs as a doctest)::

    >>> import jax
    >>> from falcon_jax import testing
    >>> q, k, v, beta, lam = testing.random_inputs(jax.random.key(0), batch=2, time=12, heads=2, dk=4, dv=3)
    >>> errors = testing.assert_forms_agree(q, k, v, beta, lam, variant="3A", window=3, chunk_size=4)
    >>> sorted(errors)
    ['chunk', 'parallel']
    >>> err = testing.assert_matches_reference(q, k, v, beta, lam, variant="1", form="chunk", chunk_size=4)
    >>> out, state = jax.jit(lambda *a: falcon_jax.falcon(*a, variant="3A", window=3, return_final_state=True))(
    ...     q, k, v, beta, lam)
    >>> testing.assert_state_layout(state, batch=2, heads=2, dk=4, dv=3, variant="3A", window=3)

Closeness is normwise: ``max |got − want| <= tol · max |want|`` per array (an elementwise relative test
fails on entries near zero that carry no information); an all-zero ``want`` takes the absolute bound
``max |got| <= tol``.  The default ``tol`` follows the dtype of q, k, v
(:func:`default_tolerance`), which the output must have.  :func:`assert_matches_reference` runs
:func:`falcon_jax.reference.reference_falcon`, a Python loop over batch, heads and time in float64: use it on
short sequences (T of a few hundred).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

import falcon_jax  # noqa: F401 - the doctest's namespace
from falcon_jax import validation as val
from falcon_jax.falcon import falcon
from falcon_jax.reference import reference_falcon
from falcon_jax.rules import PER_COLUMN_VARIANTS
from falcon_jax.state import FalconState, check_variant, check_window, tail_length_for

FORMS = ("recurrent", "parallel", "chunk")
STATE_FIELDS = ("S", "last_key", "has_key", "tail_x", "tail_y", "tail_valid")
# options of ``falcon`` that choose how a rule is computed, not which rule: the reference ignores them
_HOW = ("form", "chunk_size", "impl", "kernel_config", "return_final_state")

__all__ = ["FORMS", "assert_cache_layout", "assert_forms_agree", "assert_matches_reference", "assert_state_layout",
           "default_tolerance", "random_inputs"]


def default_tolerance(dtype) -> float:
    """Normwise relative tolerance for outputs of ``dtype``: 1e-9 (fp64), 2e-4 (fp32), 5e-3 (fp16),
    3e-2 (bf16).  The states always run in fp32 or wider; the tolerance covers rounding of the outputs and
    the different summation orders of the forms on sequences of a few hundred steps."""
    dtype = jnp.dtype(dtype)
    return {jnp.dtype(jnp.float64): 1e-9, jnp.dtype(jnp.float32): 2e-4, jnp.dtype(jnp.float16): 5e-3,
            jnp.dtype(jnp.bfloat16): 3e-2}.get(dtype, 2e-4)


def _check_sizes(fn: str, **sizes) -> None:
    """Each ``name=(value, low)``: ``value`` an int (not a bool) >= ``low``, or a ValueError naming it."""
    for name, (value, low) in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{fn}: `{name}` must be an int >= {low}; got {value!r}.")


def random_inputs(key, *, batch=2, time=16, heads=2, dk=8, dv=8, variant="1", dtype=jnp.float32):
    """Seeded inputs inside the rules' domain: q, k ``[B, T, H, dk]`` with norms about 1, v ``[B, T, H, dv]``
    standard normal, β uniform in (0, 2) (``[B, T, H, dv]`` for "2"/"2A"), λ uniform in (0, 1).  ``variant``
    fixes β's shape; ``dtype`` is a floating dtype; ``batch``, ``heads`` >= 0 and ``time``, ``dk``, ``dv`` >= 1."""
    if not (hasattr(key, "shape") and hasattr(key, "dtype")):  # jax.random reports "invalid PRNG key data"
        raise TypeError(f"random_inputs: `key` must be a PRNG key, e.g. jax.random.key(0); got {key!r}.")
    check_variant(variant)  # an unknown name would give β the per-head shape without a word
    _check_sizes("random_inputs", batch=(batch, 0), time=(time, 1), heads=(heads, 0), dk=(dk, 1), dv=(dv, 1))
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:  # an integer cast would round q and k (norms about 1) to 0
        raise TypeError(f"random_inputs: `dtype` must be a floating dtype (e.g. jnp.float32); got {dtype!r}.")
    kq, kk, kv, kb, kl = jax.random.split(key, 5)
    q = jax.random.normal(kq, (batch, time, heads, dk)) / np.sqrt(dk)
    k = jax.random.normal(kk, (batch, time, heads, dk)) / np.sqrt(dk)
    v = jax.random.normal(kv, (batch, time, heads, dv))
    bshape = (batch, time, heads, dv) if variant.upper() in PER_COLUMN_VARIANTS else (batch, time, heads)
    beta = jax.random.uniform(kb, bshape, minval=0.05, maxval=1.95)
    lam = jax.random.uniform(kl, (batch, time, heads), minval=0.0, maxval=1.0)
    return tuple(a.astype(dtype) for a in (q, k, v, beta, lam))


def _run(q, k, v, beta, lam, *, variant, **options):
    """``falcon(..., return_final_state=True)`` compiled as one program (eager execution compiles every
    primitive on its own, several times slower on a first call).  The gates are checked against the rules'
    domain first, while they are concrete: inside the program they would only be clamped."""
    B, T, H, _ = q.shape
    beta, lam = (val.gate_array(n, x, (B, T, H), q) for n, x in (("beta", beta), ("lam", lam)))
    val.falcon_gates_in_domain(beta, lam, step=options.get("step", "normalized"))
    dynamic = {n: options.pop(n) for n in ("initial_state", "segment_ids") if options.get(n) is not None}
    if isinstance(options.get("impl"), list):
        options["impl"] = tuple(options["impl"])

    @jax.jit
    def run(q, k, v, beta, lam, dynamic):
        return falcon(q, k, v, beta, lam, variant=variant, return_final_state=True, **dynamic, **options)

    return run(q, k, v, beta, lam, dynamic)


def _tolerance(tol, dtype) -> float:
    """``tol`` as a float, or the default for ``dtype`` when None.  An infinite tolerance passes anything, a NaN
    or negative one fails everything with a confusing ``atol``: both are refused."""
    if tol is None:
        return default_tolerance(dtype)
    try:
        value = None if isinstance(tol, (str, bytes, bool, np.bool_)) else float(tol)
    except (TypeError, ValueError):
        value = None
    if value is None or not np.isfinite(value) or value < 0:
        raise ValueError(f"`tol` must be a finite number >= 0 (a normwise relative tolerance, e.g. 1e-4), or None "
                         f"for default_tolerance(dtype); got {tol!r}.")
    return value


def _check_output_dtype(out, q, what: str) -> None:
    """``falcon`` returns its output in the dtype of ``q``, ``k``, ``v``: an output in another dtype is a bug (a
    lower one loses precision), and the tolerance follows the inputs' dtype, not the output's."""
    if jnp.dtype(out.dtype) != jnp.dtype(q.dtype):
        raise AssertionError(f"{what}: output dtype {jnp.dtype(out.dtype)} is not the dtype of q, k, v "
                             f"({jnp.dtype(q.dtype)}).")


def _normwise_close(got, want, tol: float, what: str) -> float:
    """``max|got − want| <= tol · max|want|`` (chex's elementwise test with an absolute bound from the scale of
    ``want``; ``max|got| <= tol`` when ``want`` is all zero); returns the relative error."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    chex.assert_equal_shape([got, want], custom_message=what)
    if got.size == 0:
        return 0.0
    chex.assert_tree_all_finite(got, custom_message=f"{what} has NaN or inf")
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(got - want))) / (scale if scale > 0 else 1.0)
    chex.assert_trees_all_close(got, want, rtol=0.0, atol=tol * (scale if scale > 0 else 1.0),
                                custom_message=f"{what}: max |got - want| / max |want| = {err:.3e} > {tol:.1e}")
    return err


def _state_close(got: FalconState, want, tol: float, what: str) -> float:
    """Two states agree: every field in shape, the flags bool, the other fields in ``want``'s dtype when ``want`` is a
    FalconState (the reference's dict is float64), S and last_key within ``tol``, the flags exactly, the window tails
    where valid."""
    field = (lambda s, n: getattr(s, n)) if not isinstance(want, dict) else (lambda s, n: s[n])
    # the masks below broadcast: a field missing its batch axis would otherwise be compared against every row
    for name in STATE_FIELDS:
        got_shape, want_shape = np.shape(getattr(got, name)), np.shape(field(want, name))
        if got_shape != want_shape:
            raise AssertionError(f"{what}.{name}: shape {got_shape}, expected {want_shape}.")
        # the comparisons below cast to bool and float64; a flag stored as a float, or one form's state in another
        # dtype than the other's (a scan carry or a continuation would not take it), would pass them
        got_dtype = jnp.dtype(getattr(got, name).dtype)
        want_dtype = jnp.dtype(bool) if name in ("has_key", "tail_valid") else (
            None if isinstance(want, dict) else jnp.dtype(field(want, name).dtype))
        if want_dtype is not None and got_dtype != want_dtype:
            raise AssertionError(f"{what}.{name}: dtype {got_dtype}, expected {want_dtype}.")
    errs = [_normwise_close(got.S, field(want, "S"), tol, f"{what}.S")]
    has_key = np.asarray(field(want, "has_key"), bool)
    chex.assert_trees_all_equal(np.asarray(got.has_key, bool), has_key, custom_message=f"{what}.has_key")
    mask_k = has_key[:, None, None]  # last_key is meaningless where no key was seen
    errs.append(_normwise_close(np.where(mask_k, got.last_key, 0), np.where(mask_k, field(want, "last_key"), 0),
                                tol, f"{what}.last_key"))
    valid = np.asarray(field(want, "tail_valid"), bool)
    chex.assert_trees_all_equal(np.asarray(got.tail_valid, bool), valid, custom_message=f"{what}.tail_valid")
    mask = valid[:, None, :, None]
    for name in ("tail_x", "tail_y"):
        errs.append(_normwise_close(np.where(mask, getattr(got, name), 0), np.where(mask, field(want, name), 0),
                                    tol, f"{what}.{name}"))
    return max(errs)


def assert_forms_agree(q, k, v, beta, lam, *, variant, forms=FORMS, tol=None, **options) -> dict:
    """The forms of a rule agree on these inputs: ``falcon(..., form=f, return_final_state=True)`` for each
    ``f`` in ``forms``, compared with the first (by default the recurrent form, the rule's definition).

    Args:
      q, k, v, beta, lam, variant, options: as for :func:`falcon_jax.falcon` (``initial_state``,
        ``segment_ids``, ``window``, ``chunk_size``, ``impl``, ...; not ``form``).
      forms: at least two different forms of "recurrent", "parallel", "chunk".
      tol: normwise relative tolerance, a finite number >= 0 (default: :func:`default_tolerance` of the dtype
        of q, k, v, which every form's output must have).

    Returns ``{form: error}`` for every form after the first (the largest normwise error over the output and
    the state).  Raises ``AssertionError`` naming the form and the array that differ.
    """
    # a repeated form would be compared with itself and pass whatever it computes
    if (isinstance(forms, str) or len(forms) < 2 or len(set(forms)) != len(forms)
            or any(f not in FORMS for f in forms)):
        raise ValueError(f"`forms` must list at least two different forms of {FORMS}; got {forms!r}.")
    if "form" in options or "return_final_state" in options:
        raise ValueError("assert_forms_agree chooses `form` and `return_final_state` itself; pass `forms`.")
    val.check_qkv(q, k, v)  # shapes and dtypes read below, before falcon would check them
    tol = _tolerance(tol, q.dtype)
    results = {f: _run(q, k, v, beta, lam, variant=variant, form=f, **options) for f in forms}
    base_out, base_state = results[forms[0]]
    _check_output_dtype(base_out, q, f"form {forms[0]!r}")
    chex.assert_tree_all_finite(base_out, custom_message=f"form {forms[0]!r}: output")
    errors = {}
    for f in forms[1:]:
        out, state = results[f]
        chex.assert_trees_all_equal_shapes_and_dtypes(out, base_out, custom_message=f"form {f!r} vs {forms[0]!r}")
        errors[f] = max(_normwise_close(out, base_out, tol, f"form {f!r} vs {forms[0]!r}: output"),
                        _state_close(state, base_state, tol, f"form {f!r} vs {forms[0]!r}: final state"))
    return errors


def assert_matches_reference(q, k, v, beta, lam, *, variant, tol=None, **options) -> float:
    """:func:`falcon_jax.falcon` with ``options`` (any form, implementation, ``initial_state``,
    ``segment_ids``...) equals the float64 NumPy recurrence :func:`falcon_jax.reference.reference_falcon`
    on the same inputs: the output (which must have the dtype of q, k, v) and the final state, within ``tol``
    (default: :func:`default_tolerance` of the dtype of q, k, v; the inputs are given to the reference exactly,
    as float64).

    Returns the largest normwise relative error; raises ``AssertionError`` naming the array that differs.
    """
    val.check_qkv(q, k, v)  # shapes and dtypes read below, before falcon would check them
    tol = _tolerance(tol, q.dtype)
    run_options = {k_: v_ for k_, v_ in options.items() if k_ != "return_final_state"}
    out, state = _run(q, k, v, beta, lam, variant=variant, **run_options)
    _check_output_dtype(out, q, f"falcon variant {variant!r}")
    rule_options = {k_: v_ for k_, v_ in options.items() if k_ not in _HOW}
    B, T, H, _ = q.shape
    gates = [np.broadcast_to(np.asarray(x, np.float64), (B, T, H)) if np.ndim(x) == 0 else np.asarray(x, np.float64)
             for x in (beta, lam)]
    want_out, want_state = reference_falcon(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                            np.asarray(v, np.float64), *gates, variant=variant.upper(), **rule_options)
    return max(_normwise_close(out, want_out, tol, f"falcon variant {variant!r} vs the float64 reference: output"),
               _state_close(state, want_state, tol, f"falcon variant {variant!r} vs the float64 reference: final state"))


def assert_state_layout(state, *, batch: int, heads: int, dk: int, dv: int, variant: str, window: int = 4,
                        dtype=None) -> None:
    """``state`` is a :class:`~falcon_jax.FalconState` for these sizes and rule: ``S [B, H, dk, dv]``,
    ``last_key [B, H, dk]``, ``has_key [B]`` bool, ``tail_x [B, H, W-1, dk]``, ``tail_y [B, H, W-1, dv]``,
    ``tail_valid [B, W-1]`` bool (``W-1 = 0`` except for "3"/"3A"), floating fields of ``dtype`` (default:
    any floating dtype, all the same)."""
    if not isinstance(state, FalconState):
        raise AssertionError(f"expected a FalconState; got {type(state).__name__}.")
    check_variant(variant)
    check_window(window)
    # chex.assert_shape reads None (and a set) as "any size": the sizes would go unchecked
    _check_sizes("assert_state_layout", batch=(batch, 0), heads=(heads, 0), dk=(dk, 1), dv=(dv, 1))
    tail = tail_length_for(variant.upper(), window)
    chex.assert_shape([state.S, state.last_key, state.has_key, state.tail_x, state.tail_y, state.tail_valid],
                      [(batch, heads, dk, dv), (batch, heads, dk), (batch,), (batch, heads, tail, dk),
                       (batch, heads, tail, dv), (batch, tail)])
    chex.assert_type([state.has_key, state.tail_valid], bool)
    floats = [state.S, state.last_key, state.tail_x, state.tail_y]
    if dtype is None:
        chex.assert_type(floats, float)
        chex.assert_trees_all_equal_dtypes(*floats)
    else:
        chex.assert_type(floats, jnp.dtype(dtype))


def assert_cache_layout(cache, model, batch: int, max_len: int) -> None:
    """``cache`` has exactly the pytree structure, shapes and dtypes of ``model.init_cache(batch, max_len)``
    (a :class:`falcon_jax.nn.FalconLM` or a single mixer): e.g. after a prefill and any number of decode
    steps, a cache must not have grown or changed dtype."""
    expected = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    chex.assert_trees_all_equal_structs(cache, expected)
    chex.assert_trees_all_equal_shapes_and_dtypes(cache, expected)


def pallas_call_operand_shapes(fn, *args) -> list[list[tuple[int, ...]]]:
    """The operand shapes of every Pallas kernel call ``fn(*args)`` traces, in program order, inside
    ``shard_map``, ``custom_vjp`` and every other nested program — e.g. to check that under
    :func:`falcon_jax.kernel_sharding` each kernel sees one device's rows and heads, not the whole batch."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append([tuple(v.aval.shape) for v in eqn.invars])
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
