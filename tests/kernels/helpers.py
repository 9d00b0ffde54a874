"""What the kernel tests share: inputs, float64 comparisons, the passes a call runs, cross-lowering.

Every kernel call in these tests runs jitted (interpret-mode kernels run eagerly dispatch op by op, ten times
slower) and, where it goes through ``common.call``, under ``poisoned_outputs()`` so that an element a kernel
does not write shows as NaN.  TPU interpret mode fills unwritten memory with NaN itself.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from falcon_jax.kernels.common import poisoned_outputs
from tests.helpers import rel_err

FP32_TOL = 2e-5  # outputs and states of fp32 kernels against float64
GRAD_TOL = 5e-5  # their gradients
S = jax.ShapeDtypeStruct


def f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def f64(*arrays):
    return tuple(jnp.asarray(a, jnp.float64) for a in arrays)


def time_major(a):
    """``[B, H, T, ...]`` <-> ``[B, T, H, ...]`` (the ops' ``layout="BTHD"``)."""
    return jnp.swapaxes(jnp.asarray(a), 1, 2)


def run_index(rng, B, H, T, segments: bool):
    """``[B, H, T]`` int32 run index: 0 throughout, or segment starts inside chunks (one at T // 2, shared by
    the heads)."""
    if not segments:
        return jnp.zeros((B, H, T), jnp.int32)
    starts = rng.uniform(size=(B, 1, T)) < 0.08
    starts[..., 0] = False
    starts[..., T // 2] = T > 2
    return jnp.asarray(np.broadcast_to(np.cumsum(starts, axis=-1), (B, H, T)), jnp.int32)


def delta_inputs(rng, B=1, H=2, T=53, dk=16, dv=32, segments=True, eta_range=(0.1, 1.9), decay_range=(0.0, 0.3)):
    """``(q, x, y, η, log γ, run, s0)`` for the decayed delta rule, float64: keys of norm about 1 and
    ``η‖x‖² ∈ eta_range`` (the delta rule is stable for ``η‖x‖² < 2``)."""
    q = rng.normal(size=(B, H, T, dk))
    x = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(B, H, T, dv))
    eta = rng.uniform(*eta_range, size=(B, H, T)) / np.sum(x * x, axis=-1)
    log_gamma = -rng.uniform(*decay_range, size=(B, H, T))
    s0 = rng.normal(size=(B, H, dk, dv)) / 4
    return q, x, y, eta, log_gamma, run_index(rng, B, H, T, segments), s0


def nearly_parallel(x):
    """Keys all close to the first one: the triangular inverse alternates in sign with entries near 2 when
    ``η‖x‖² ≈ 2`` (no power series of A would survive)."""
    return x[..., :1, :] + 0.05 * x


def clamped_decays(rng, shape):
    """log γ at the clamp (γ = 1e-6) on a third of the entries, 0 (γ = 1) elsewhere."""
    return np.where(rng.uniform(size=shape) < 0.33, np.log(1e-6), 0.0)


def assert_matches(got, want, tol=FP32_TOL, what="output"):
    got = np.asarray(got, np.float64)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    err = rel_err(got, want)
    assert err < tol, f"{what}: rel err {err:.2e} >= {tol:.0e}"


def value_and_grads(fn, args, cotangents, poison=True):
    """``((o, final), gradients w.r.t. every one of args)`` of ``Σ o · ct_o + Σ final · ct_s``,
    ``fn(*args) -> (o, final)``, jitted, the kernels' outputs poisoned."""
    ct_o, ct_s = cotangents

    def loss(*a):
        o, s = fn(*a)
        return jnp.sum(o * ct_o.astype(o.dtype)) + jnp.sum(s * ct_s.astype(s.dtype)), (o, s)

    with poisoned_outputs() if poison else contextlib.nullcontext():
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


def check_op(rng, op, reference, args, names, tol=FP32_TOL, grad_tol=GRAD_TOL, grads=True, unreached=()):
    """``op`` on the fp32 values of ``args`` against ``reference`` on their float64 values, each
    ``f(*args) -> (o, final state)``: outputs and final state within ``tol`` and, with ``grads``, the gradient
    w.r.t. each of ``args`` (named ``names``) within ``grad_tol`` under random cotangents — every one of them
    reaching the loss except those named in ``unreached``, whose gradients must be exactly zero.  Returns the
    op's ``(o, final)``."""
    want_out = jax.eval_shape(reference, *f64(*args))
    cts = tuple(jnp.asarray(rng.normal(size=a.shape)) for a in want_out)
    if not grads:
        with poisoned_outputs():
            got = jax.jit(op)(*f32(*args))
        want = jax.jit(reference)(*f64(*args))
    else:
        want, want_grads = value_and_grads(reference, f64(*args), cts, poison=False)
        got, got_grads = value_and_grads(op, f32(*args), cts)
        for name, g, w in zip(names, got_grads, want_grads, strict=True):
            if name in unreached:
                assert float(jnp.max(jnp.abs(g))) == 0.0 == float(jnp.max(jnp.abs(w))), name
                continue
            assert float(jnp.max(jnp.abs(w))) > 0, f"{name} does not reach the loss"
            assert_matches(g, w, grad_tol, f"d{name}")
    assert_matches(got[0], want[0], tol, "o")
    assert_matches(got[1], want[1], tol, "final state")
    return got


# ---- which passes a call runs -----------------------------------------------------------------------------

KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")  # mpmd_map: Pallas Mosaic GPU kernels (plgpu.kernel)


def _pallas_eqns(jaxpr, out):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_PRIMITIVES:
            out.append(eqn)
        for param in eqn.params.values():
            for v in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(v, jex.ClosedJaxpr):
                    _pallas_eqns(v.jaxpr, out)
                elif isinstance(v, jex.Jaxpr):
                    _pallas_eqns(v, out)
    return out


def pallas_calls(fn, *args, param=None) -> list:
    """The names of the Pallas kernels ``fn(*args)`` traces, in order, with repeats (interpret mode included: the
    kernels are traced whatever runs them); with ``param``, ``(name, that parameter of the call)`` pairs."""
    eqns = _pallas_eqns(jax.make_jaxpr(fn)(*args).jaxpr, [])
    return [str(e.params["name"]) if param is None else (str(e.params["name"]), e.params[param]) for e in eqns]


def pallas_call_avals(fn, args, name):
    """``(operands, outputs)`` of every traced call of kernel ``name`` in ``fn(*args)``, each a list of
    ``(shape, dtype)``."""
    def avals(variables):
        return [(v.aval.shape, v.aval.dtype) for v in variables]
    return [(avals(eqn.invars), avals(eqn.outvars))
            for eqn in _pallas_eqns(jax.make_jaxpr(fn)(*args).jaxpr, []) if str(eqn.params["name"]) == name]


# ---- cross-lowering on a CPU ------------------------------------------------------------------------------

def on_backend(monkeypatch, platform: str):
    """Make ``jax.default_backend()`` answer ``platform`` (what ``"auto"`` and ``interpret=False`` ask), so that
    a kernel implementation can be selected and cross-lowered for an accelerator this machine lacks."""
    monkeypatch.setattr(jax, "default_backend", lambda: platform)


def lowered_text(fn, specs, platform="cuda") -> str:
    """StableHLO text of ``jit(fn)`` on ``specs`` (ShapeDtypeStructs) lowered for ``platform`` without a
    device: every kernel goes through that accelerator's Pallas lowering rules."""
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,)).as_text()


def custom_call_lines(text: str, name: str) -> list[str]:
    """The lowered custom calls of the Triton kernel ``name``."""
    return [line for line in text.splitlines() if f'name = "{name}"' in line]


def operand_aliases(custom_call_line: str) -> set[tuple[int, int]]:
    """``{(output index, operand index)}``: the outputs a lowered custom call writes over its operands."""
    return {(int(o), int(i)) for o, i in re.findall(r"output_tuple_indices = \[(\d+)\],\s*operand_index = (\d+)",
                                                    custom_call_line)}


def mosaic_lowering_available() -> bool:
    """This jax lowers a Pallas Mosaic GPU kernel for CUDA without a GPU (cross-lowering on a CPU)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        def copy(x_ref, o_ref):
            o_ref[...] = x_ref[...]

        kernel = plgpu.kernel(copy, out_type=S((128,), jnp.float32))
        lowered_text(kernel, [S((128,), jnp.float32)])
        return True
    except Exception:  # noqa: BLE001  (no Mosaic GPU, or no CUDA lowering in this jaxlib)
        return False
