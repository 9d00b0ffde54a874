"""Input generators and comparison helpers shared by the tests (no library logic here)."""
from __future__ import annotations

import numpy as np

from tests.reference import PER_COLUMN, effective_window

STATE_FIELDS = ("S", "last_key", "has_key", "tail_x", "tail_y", "tail_valid")
FLOAT_STATE_FIELDS = ("S", "last_key", "tail_x", "tail_y")
ALL_VARIANTS = ("1", "2", "3", "1A", "2A", "3A")
FORMS = ("recurrent", "parallel", "chunk")


def make_inputs(rng, *, variant="1", B=2, T=20, H=2, dk=6, dv=5, step="normalized",
                beta_range=None, lam_range=(0.0, 1.0)):
    """Random (q, k, v, beta, lam) as float64 NumPy arrays.

    Keys and queries are scaled so that their norm is about 1; beta is uniform in
    (0, 2) for the normalized step and in (0, 1) for the direct step (there beta is
    eta itself, and eta * ||x||^2 < 2 keeps the delta rule contractive); lam is
    uniform in (0, 1).
    """
    q = rng.standard_normal((B, T, H, dk)) / np.sqrt(dk)
    k = rng.standard_normal((B, T, H, dk)) / np.sqrt(dk)
    v = rng.standard_normal((B, T, H, dv))
    if beta_range is None:
        beta_range = (0.0, 2.0) if step == "normalized" else (0.0, 1.0)
    bshape = (B, T, H, dv) if variant in PER_COLUMN else (B, T, H)
    beta = rng.uniform(*beta_range, size=bshape)
    lam = rng.uniform(*lam_range, size=(B, T, H))
    return q, k, v, beta, lam


def make_segment_ids(rng, B, T, max_segments=4):
    """Random packed-sequence ids [B, T]: non-decreasing ints, a different layout per row.

    Row 0 always has a segment of length 1 when T >= 3 (a lone sentinel), to hit
    that edge.
    """
    seg = np.zeros((B, T), dtype=np.int32)
    for b in range(B):
        n_cuts = int(rng.integers(1, max_segments)) if T > 1 else 0
        cuts = set(rng.choice(np.arange(1, T), size=min(n_cuts, T - 1), replace=False).tolist()) if T > 1 else set()
        if b == 0 and T >= 3:
            cuts |= {T // 2, T // 2 + 1}
        ids = np.zeros(T, dtype=np.int32)
        for c in sorted(cuts):
            ids[c:] += 1
        seg[b] = ids + 3 * b  # ids need not start at zero
    return seg


def make_initial_state(rng, *, variant, window, B, H, dk, dv):
    """A random continuation state as a dict of NumPy arrays.

    Row 0 has a key and a full tail, row 1 (if any) is fresh (no key, empty tail),
    further rows have a key and a partially valid tail (valid entries are always a
    suffix: the newest pairs, as produced by a real previous call).
    """
    L = effective_window(variant, window) - 1
    has_key = np.array([b != 1 for b in range(B)])
    n_valid = [L if b == 0 else (0 if b == 1 else min(1, L)) for b in range(B)]
    tail_valid = np.zeros((B, L), dtype=bool)
    for b, n in enumerate(n_valid):
        if n:
            tail_valid[b, L - n:] = True
    return {
        "S": 0.5 * rng.standard_normal((B, H, dk, dv)),
        "last_key": rng.standard_normal((B, H, dk)) / np.sqrt(dk),
        "has_key": has_key,
        "tail_x": rng.standard_normal((B, H, L, dk)) / np.sqrt(dk),
        "tail_y": rng.standard_normal((B, H, L, dv)),
        "tail_valid": tail_valid,
    }


def to_lib_state(d):
    """dict of arrays -> falcon_jax.FalconState (fp arrays keep their dtype)."""
    import jax.numpy as jnp
    from falcon_jax import FalconState

    return FalconState(**{name: jnp.asarray(d[name]) for name in STATE_FIELDS})


def state_to_dict(state):
    if isinstance(state, dict):
        return {name: np.asarray(state[name]) for name in state}
    return {name: np.asarray(getattr(state, name)) for name in STATE_FIELDS}


def rel_err(a, b):
    """max|a - b| / max|b| (absolute error when b is identically zero)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    num = float(np.max(np.abs(a - b))) if a.size else 0.0
    den = float(np.max(np.abs(b))) if b.size else 0.0
    return num / den if den > 0 else num


def assert_close(a, b, tol, what="output"):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != expected {b.shape}"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.1e}"


def assert_state_close(got, want, tol, what="state"):
    """Compare two Falcon states (FalconState or dict).  Tail entries are compared
    only where the expected tail is valid (invalid slots are don't-care)."""
    g = state_to_dict(got)
    w = state_to_dict(want)
    for name in ("S", "last_key"):
        assert_close(g[name], w[name], tol, f"{what}.{name}")
    np.testing.assert_array_equal(np.asarray(g["has_key"], bool), np.asarray(w["has_key"], bool),
                                  err_msg=f"{what}.has_key")
    assert g["tail_valid"].shape == w["tail_valid"].shape, \
        f"{what}.tail_valid shape {g['tail_valid'].shape} != {w['tail_valid'].shape}"
    np.testing.assert_array_equal(np.asarray(g["tail_valid"], bool), np.asarray(w["tail_valid"], bool),
                                  err_msg=f"{what}.tail_valid")
    mask = np.asarray(w["tail_valid"], bool)[:, None, :, None]
    for name in ("tail_x", "tail_y"):
        assert g[name].shape == w[name].shape, f"{what}.{name} shape {g[name].shape} != {w[name].shape}"
        assert_close(np.where(mask, g[name], 0.0), np.where(mask, w[name], 0.0), tol, f"{what}.{name}")


def as_jnp(*arrays, dtype=None):
    import jax.numpy as jnp

    return tuple(None if a is None else jnp.asarray(a, dtype=dtype) for a in arrays)


# ----------------------------------------------------------------------------
# Jitted library calls.  The library functions are plain Python (not jitted);
# calling them eagerly compiles every primitive for every new shape, which is
# far slower than compiling one jitted program per test.  Static (Python)
# options are bound with functools.partial; arrays, segment_ids and the
# initial state are traced arguments.  Cached per (function, options).
# ----------------------------------------------------------------------------
import functools  # noqa: E402

_TRACED = ("initial_state", "segment_ids")


@functools.lru_cache(maxsize=None)
def _jitted(fn, frozen):
    import jax

    return jax.jit(functools.partial(fn, **dict(frozen)))


def jcall(fn, *args, **kwargs):
    """fn(*args, **kwargs) through a cached jax.jit (array args and _TRACED kwargs traced)."""
    traced = {name: kwargs.pop(name) for name in _TRACED if name in kwargs}
    return _jitted(fn, tuple(sorted(kwargs.items())))(*args, **traced)


# ----------------------------------------------------------------------------
# Scripts on simulated CPU devices (the device count is fixed before jax starts: a subprocess).
# ----------------------------------------------------------------------------
def run_on_simulated_devices(script: str, devices: int, *args: str, timeout: int = 600) -> dict:
    """Run ``python -c script *args`` with jax on ``devices`` simulated CPU devices; the script
    prints ``"RESULT" + json.dumps(...)``, which is returned parsed.  Fails with its stderr."""
    import json
    import os
    import subprocess
    import sys

    from falcon_jax.train.launch import simulated_cpu_env

    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=simulated_cpu_env(dict(os.environ), devices), timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])

