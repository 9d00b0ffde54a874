"""The decayed-delta-rule Pallas kernels (Falcon-1's recurrence) in interpret mode on CPU.

Ground truth: the op's definition (``reference.py``, a token scan) in float64;
the kernels accumulate in fp32, so bounds are fp32-sized.  Every kernel call
here runs with poisoned (NaN) outputs, so an element a kernel does not write
fails the comparison.  Shapes are small (dk = 16, dv ≤ 32, chunk 16/32) because
interpret mode is slow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import deltanet, falcon, gated_deltanet
from falcon_jax.kernels.common import poisoned_outputs, transpose_gates
from falcon_jax.kernels.decayed_delta_rule import decayed_attention_per_column, decayed_delta_rule, windowed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.reference import (decayed_attention_per_column_reference,
                                                         decayed_delta_rule_reference, windowed_delta_rule_reference)
from tests.helpers import assert_pallas_matches_xla_chunk_form, bf16_gradient_errors, time_major

FP32_TOL = 1e-5


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


GRAD_NAMES = ("q", "x", "y", "eta", "log_gamma", "initial_state")


def assert_grads_match(rng, fn, ref_fn, args, run, tol, *, out_shape=None, poison=False, names=GRAD_NAMES):
    """Gradients of ``⟨o, ct_o⟩ + ⟨final, ct_s⟩`` (fresh random cotangents; ``o`` of ``out_shape``, default y's)
    w.r.t. ``args = (q, x, y, gate, log_gamma, s0)``: ``fn`` on their fp32 values against ``ref_fn`` (the float64
    scan) on ``args`` as given, each called as ``f(q, x, y, gate, log_gamma, run, s0)`` — every gradient finite
    and within ``tol`` relative error.  ``poison``: the kernels' backward traced under ``poisoned_outputs()``
    too (``kernel`` poisons only the forward it calls)."""
    ct_o = jnp.asarray(rng.normal(size=out_shape or args[2].shape))
    ct_s = jnp.asarray(rng.normal(size=args[5].shape))

    def loss(f):
        def total(*a):
            o, s = f(*a[:5], run, a[5])
            return jnp.sum(o * ct_o.astype(o.dtype)) + jnp.sum(s * ct_s.astype(s.dtype))
        return total

    argnums = tuple(range(6))
    with poisoned_outputs() if poison else contextlib.nullcontext():
        got = jax.grad(loss(fn), argnums=argnums)(*(jnp.asarray(a, jnp.float32) for a in args))
    want = jax.grad(loss(ref_fn), argnums=argnums)(*(jnp.asarray(a) for a in args))
    for name, g, w in zip(names, got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, w) < tol, name


def op_inputs(rng, B=1, H=2, T=50, dk=16, dv=16, segments=False, eta_range=(0.1, 1.9), decay_range=(0.0, 0.3)):
    """Keys of norm about 1, so ``η ∈ (0, 2)`` is the delta rule's stable range (β = η‖x‖²)."""
    q = rng.normal(size=(B, H, T, dk))
    x = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(B, H, T, dv))
    eta = rng.uniform(*eta_range, size=(B, H, T)) / np.sum(x * x, axis=-1)
    log_gamma = -rng.uniform(*decay_range, size=(B, H, T))
    if segments:
        starts = rng.uniform(size=(B, 1, T)) < 0.08
        starts[..., 0] = False
        starts[..., T // 2] = True  # at least one segment start inside a chunk
        run = np.broadcast_to(np.cumsum(starts, axis=-1), (B, H, T))
    else:
        run = np.zeros((B, H, T), np.int64)
    s0 = rng.normal(size=(B, H, dk, dv)) / 4
    return q, x, y, eta, log_gamma, jnp.asarray(run, jnp.int32), s0


def kernel(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", chunk_size=16, **kw):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    if implementation == "pallas_tpu":
        kw.pop("pieces", None)
    with poisoned_outputs():
        return decayed_delta_rule(f32(q), f32(x), f32(y), f32(eta), f32(log_gamma), run, f32(s0),
                                  chunk_size=chunk_size, implementation=implementation, **kw)


def reference(q, x, y, eta, log_gamma, run, s0):
    return decayed_delta_rule_reference(*(jnp.asarray(a) for a in (q, x, y, eta, log_gamma)), run, jnp.asarray(s0))


@pytest.mark.parametrize("T,chunk,pieces,segments,implementation,outputs", [
    (1, 16, 1, False, "pallas_gpu", "pallas"), (50, 16, 1, True, "pallas_gpu", "pallas"),
    (50, 32, 1, True, "pallas_gpu", "pallas"), (100, 16, 4, True, "pallas_gpu", "pallas"),
    (40, 16, 1, True, "pallas_tpu", "pallas"), (50, 32, 1, True, "pallas_gpu", "xla"),
    (100, 16, 4, True, "pallas_gpu", "xla"), (50, 32, 1, True, "pallas_gpu", "split"),
    (100, 16, 4, True, "pallas_gpu", "split"), (37, 16, 1, False, "pallas_gpu", "split"),
    (100, 16, 4, True, "pallas_gpu", "fused maps"), (100, 16, 4, True, "pallas_gpu", "split, fused maps"),
])
def test_forward_matches_reference(T, chunk, pieces, segments, implementation, outputs, rng):
    """Outputs and final state; ``outputs="xla"``: the walk carries the state only and the outputs come from
    the chunk start states in a parallel XLA pass; ``"split"``: W, U per chunk, a state-only walk and an
    output kernel.  Pieces take the split maps (the GPU's "auto"), or with "fused maps" the fused walk's."""
    H = 1 if implementation == "pallas_tpu" else 2  # TPU interpret mode is slow
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, H=H, T=T, segments=segments)
    maps = {"piece_maps": "fused"} if outputs.endswith("fused maps") else {}
    outputs = "split" if outputs.startswith("split") else "pallas" if outputs == "fused maps" else outputs
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=chunk, pieces=pieces,
                      implementation=implementation, config=KernelConfig(outputs=outputs, **maps))
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("T,chunk,pieces,segments,block_v,fwd_scores", [
    (50, 32, 1, True, 16, "kernel"), (150, 64, 1, True, 16, "kernel"), (100, 16, 4, True, 16, "kernel"),
    (37, 16, 1, False, 32, "kernel"), (50, 32, 1, True, 16, "walk"), (100, 16, 4, True, 16, "walk"),
    (70, 32, 1, True, 64, "kernel"),  # 64-column programs, as "auto" picks for many batch·heads
])
def test_forward_output_walk_scores(T, chunk, pieces, segments, block_v, fwd_scores, rng):
    """The fused output walk's masked scores ``QXᵀ ⊙ D``: stored by a parallel kernel and read by the walk
    (``fwd_scores="kernel"``, what "auto" picks for few programs) or formed in every program (``"walk"``);
    outputs and final state against float64, with segments inside chunks and pieces; outputs poisoned (a
    scores element left unwritten would reach o)."""
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=T, dv=max(32, block_v), segments=segments)
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=chunk, pieces=pieces,
                      config=KernelConfig(outputs="pallas", fwd_scores=fwd_scores, block_v=block_v))
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("chunk,pieces,block_v,implementation,chunk_grads,state_grads,extra", [
    (32, 1, 16, "pallas_gpu", "pallas", "pallas", {}), (16, 2, 32, "pallas_gpu", "pallas", "pallas", {}),
    (16, 2, 32, "pallas_gpu", "xla", "pallas", {}), (32, 1, 16, "pallas_gpu", "xla", "split", {}),
    (16, 2, 32, "pallas_gpu", "pallas", "split", {}), (16, 2, 32, "pallas_gpu", "pallas_split", "split", {}),
    (32, 1, 16, "pallas_gpu", "pallas_split", "pallas", {}), (16, 2, 32, "pallas_gpu", "pallas_stored", "split", {}),
    (32, 1, 16, "pallas_gpu", "pallas_stored", "pallas", {}),
    (16, 2, 32, "pallas_gpu", "pallas_stored", "split", {"save_tri": True, "stored_v": "input"}),
    (16, 2, 32, "pallas_gpu", "pallas_stored_split", "split", {}),
    (16, 4, 32, "pallas_gpu", "pallas_stored", "split", {"piece_maps": "fused"}),  # M saved by the fused maps
    (16, 4, 16, "pallas_gpu", "pallas_stored", "split", {"dk": 32}),  # two map blocks (dk / block_v) per piece
    (16, 2, 16, "pallas_gpu", "pallas_stored", "split",
     {"grad_loops": "unrolled", "grad_stages": 1, "grad_block_k": 16, "dk": 32}),
    (32, 1, 32, "pallas_gpu", "pallas_stored_split", "pallas", {"grad_block_v": 16, "grad_block_k": 16, "dk": 32}),
    (16, 2, 32, "pallas_gpu", "pallas_stored", "split", {"grad_block_v": 16, "grad_block_k": 16, "dk": 32}),
    # no segments: with a segment start in every chunk the rows that carry the chunk's start state and those that
    # reach its end state are disjoint, and the gates' terms through the state (from dR hᵀ, P dhᵀ) partly vanish
    (32, 1, 16, "pallas_gpu", "pallas_stored", "pallas", {"save_tri": True, "segments": False}),
    (16, 2, 32, "pallas_gpu", "pallas_stored_split", "split", {"grad_block_k": 16, "dk": 32, "segments": False}),
    # the split reverse walk reading a stored B = Tᵀ(w ⊙ X) (the default forms B dS from T), with pieces and
    # without segments
    (16, 2, 32, "pallas_gpu", "pallas_stored", "split", {"dstate_b": "stored"}),
    (32, 1, 16, "pallas_gpu", "pallas_stored", "split", {"dstate_b": "stored", "segments": False}),
    # the reverse walk adding (c ⊙ Q)ᵀ dO as dstate_prepare wrote it into dh's buffer: with the stored chunk
    # gradients (dh the walk's second output) and the formed ones (its first), with stored B and no segments; with
    # pieces the walk forms it itself
    (32, 1, 16, "pallas_gpu", "pallas_stored", "split", {"dstate_q": "prepare"}),
    (32, 1, 16, "pallas_gpu", "pallas", "split", {"dstate_q": "prepare"}),
    (32, 1, 32, "pallas_gpu", "pallas_stored", "split", {"dstate_q": "prepare", "dstate_b": "stored",
                                                         "segments": False}),
    (16, 2, 32, "pallas_gpu", "pallas_stored", "split", {"dstate_q": "prepare"}),
    # 64-column walks (what "auto" picks for many batch·heads), the output walk reading the scores kernel's
    (32, 1, 64, "pallas_gpu", "pallas_stored", "split", {"dv": 64, "fwd_scores": "kernel", "outputs": "pallas"}),
    pytest.param(16, 1, 32, "pallas_tpu", "pallas", "pallas", {}, marks=pytest.mark.slow),
    pytest.param(16, 1, 32, "pallas_tpu", "pallas", "pallas", {"save_tri": True}, marks=pytest.mark.slow),
])
def test_gradients_match_reference(chunk, pieces, block_v, implementation, chunk_grads, state_grads, extra, rng):
    """Gradients w.r.t. every input (q, x, y, η, log γ, S0), segments inside chunks, dv = 32 in value blocks;
    the per-chunk gradient pass as a kernel and as batched XLA matmuls; the state-gradient walk fused and
    split (``state_grads="split"``: V, B per chunk, a three-dot reverse walk), with and without pieces;
    ``chunk_grads="pallas_stored"`` (the GPU default): P and dR stored by either walk, with and without
    pieces, and as two programs per chunk (``"pallas_stored_split"``); the forward's T kept for the backward
    (``save_tri``, fp32 inputs: ``stored_v`` leaves V fp32); the stored kernels' column loops as
    ``lax.fori_loop`` (the default ``grad_loops="fori"``; two value and two key blocks: dk = 32, an
    ``extra["dk"]``, value blocks narrower than the walks' with ``grad_block_v``) and unrolled; without
    segments too; the split reverse walk forming B dS from T (the default ``dstate_b="from_t"``) and reading a
    stored B (``"stored"``).
    Outputs poisoned: every element written."""
    extra = dict(extra)
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=53, dk=extra.pop("dk", 16), dv=extra.pop("dv", 32),
                                                 segments=extra.pop("segments", True))
    config = KernelConfig(block_v=block_v, chunk_grads=chunk_grads, state_grads=state_grads, **extra)
    assert_grads_match(rng, lambda *a: kernel(*a, chunk_size=chunk, pieces=pieces, config=config,
                                              implementation=implementation),
                       decayed_delta_rule_reference, (q, x, y, eta, log_gamma, s0), run, 5e-5, poison=True)


@pytest.mark.parametrize("pieces,block_v,segments,dtype", [(4, 16, True, jnp.float32), (2, 32, False, jnp.float32),
                                                           (4, 16, False, jnp.bfloat16)])
def test_piece_maps_match_reference(pieces, block_v, segments, dtype, rng):
    """``pallas_gpu.piece_maps`` (the split maps): every piece's ``S_end = M S_start + E`` against float64
    token scans of that piece alone, ``M`` from ``S_start = I`` with zero values and ``E`` from ``S_start = 0``
    (a segment start inside the piece resets the carried state, M = 0: its run index counted from the token
    before); dk = dv = 32, two map and two value blocks at 16 columns; poisoned outputs.  bf16: the kernels' inputs and
    the walk's dots in bf16, bounded by the same scans of the bf16-rounded inputs."""
    from falcon_jax.kernels.decayed_delta_rule import pallas_gpu
    from falcon_jax.kernels.decayed_delta_rule.api import _gates

    T, chunk, dk, dv = 128, 16, 32, 32
    # slow decay, small steps: a piece's transition stays far from zero (M's entries up to ~1)
    q, x, y, eta, log_gamma, run, _ = op_inputs(rng, H=2, T=T, dk=dk, dv=dv, segments=segments,
                                                eta_range=(0.05, 0.3), decay_range=(0.0, 0.01))
    x, y = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float64)) for a in (x, y))  # what the kernels read
    BH = 2
    flat = lambda a: jnp.asarray(a).reshape(BH, T, *a.shape[3:])  # noqa: E731
    lg, rn = flat(np.asarray(log_gamma, np.float32)), flat(np.asarray(run))
    g, gp, rl = _gates(lg, rn, chunk)
    xk, yk, ek = flat(x).astype(dtype), flat(y).astype(dtype), flat(np.asarray(eta, np.float32))
    lo = jnp.bfloat16 if dtype == jnp.bfloat16 else None
    with poisoned_outputs():
        tinv = pallas_gpu.tri_inverse_pass(xk, ek, g, gp, rl, chunk=chunk, interpret=True)
        w, u = pallas_gpu.prepare_wu(xk, yk, ek, g, gp, rl, tinv, chunk=chunk, interpret=True, w_dtype=lo or jnp.float32)
        M, E = pallas_gpu.piece_maps(xk, w, u, g, rl, chunk=chunk, pieces=pieces, block_v=block_v, interpret=True,
                                     walk_operands=lo)
    assert M.shape == (BH, pieces, dk, dk) and E.shape == (BH, pieces, dk, dv)
    Lp = T // pieces
    run = np.asarray(run)
    for p in range(pieces):
        sl = slice(p * Lp, (p + 1) * Lp)
        before = run[..., p * Lp - 1:p * Lp] if p else np.zeros_like(run[..., :1])
        args = [jnp.asarray(a[:, :, sl], jnp.float64) for a in (q, x)]
        gates = [jnp.asarray(a[:, :, sl], jnp.float64) for a in (eta, log_gamma)]
        r = jnp.asarray(run[:, :, sl] - before, jnp.int32)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float64), (1, 2, dk, dk))
        _, m_ref = decayed_delta_rule_reference(*args, jnp.zeros((1, 2, Lp, dk), jnp.float64), *gates, r, eye)
        _, e_ref = decayed_delta_rule_reference(*args, jnp.asarray(y[:, :, sl]), *gates, r,
                                                jnp.zeros((1, 2, dk, dv), jnp.float64))
        tol = 1e-2 if dtype == jnp.bfloat16 else FP32_TOL
        # with segments a reset in the piece makes M exactly 0 there; without, M is a real transition
        assert segments or np.max(np.abs(np.asarray(m_ref))) > 0.5
        assert rel_err(M[:, p], m_ref.reshape(BH, dk, dk)) < tol, p
        assert rel_err(E[:, p], e_ref.reshape(BH, dk, dv)) < tol, p


def test_piece_maps_refuse_a_block_that_splits_the_keys(rng):
    from falcon_jax.kernels.decayed_delta_rule import pallas_gpu

    x = jnp.zeros((1, 64, 16), jnp.float32)
    u = jnp.zeros((1, 64, 64), jnp.float32)
    g = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="block_v=32 must divide dk=16"):
        pallas_gpu.piece_maps(x, x, u, g, g.astype(jnp.int32), chunk=16, pieces=2, block_v=32, interpret=True)


def keys_one_row_later(k, first_key=None):
    """``x[t] = k[t − 1]``, ``x[0] = first_key`` (None: 0) along the time axis of ``[B, H, T, d]``:
    ``shifted_keys``' write features."""
    row0 = jnp.zeros_like(k[:, :, :1]) if first_key is None else first_key[:, :, None]
    return jnp.concatenate([row0, k[:, :, :-1]], axis=2)


@pytest.mark.parametrize("chunk,pieces,block_v,layout,extra", [
    # the passes that read the keys one row back in place: the output walk (forming or reading its scores),
    # the recompute walk, the split reverse walk (forming or reading (c ⊙ Q)ᵀ dO, B from T or stored), the
    # stored chunk gradients (one program or two per chunk), in either layout
    (16, 1, 16, "BHTD", {}),
    (16, 1, 16, "BTHD", {"fwd_scores": "walk", "first_key": "none"}),
    (32, 1, 32, "BTHD", {"fwd_scores": "kernel", "dstate_q": "prepare", "first_key": "reset"}),
    (16, 1, 32, "BTHD", {"chunk_grads": "pallas_stored_split", "dstate_b": "stored", "segments": False}),
    (32, 1, 64, "BHTD", {"dv": 64, "fwd_scores": "kernel", "save_tri": True, "dk": 32}),
    # passes that take the shifted copy the op makes in XLA instead: pieces, the split forward, the fused
    # reverse walk, the formed chunk gradients, the XLA form
    (16, 2, 16, "BTHD", {}),
    (16, 1, 16, "BHTD", {"outputs": "split", "first_key": "reset"}),
    (16, 1, 16, "BHTD", {"state_grads": "pallas", "chunk_grads": "pallas", "first_key": "none"}),
    (16, 1, 16, "BTHD", {"keys_in_place": False}),
    (16, 1, 16, "xla", {}),
    (16, 1, 16, "xla", {"first_key": "reset"}),
])
def test_shifted_keys_match_reference(chunk, pieces, block_v, layout, extra, rng):
    """``shifted_keys=True``: the op takes the keys k and writes with ``x[t] = k[t − 1]`` and ``x[0] =
    first_key``, which the GPU passes read in place one row back — a chunk's window one row earlier, row −1
    masked and row 0's step folded into the initial state inside the op — and the others get as a copy.
    Values, final state and gradients w.r.t. every input (k's through the shift, first_key's) against the
    float64 reference on the shifted keys; T = 53 (a padded last chunk), segments inside chunks, outputs
    poisoned.  ``first_key``: random (default), none (zero row 0), or random with row 0 starting a segment
    (the step resets the initial state, then writes)."""
    extra = dict(extra)
    q, k, y, eta, log_gamma, run, s0 = op_inputs(rng, B=2, T=53, dk=extra.pop("dk", 16), dv=extra.pop("dv", 32),
                                                 segments=extra.pop("segments", True))
    first = extra.pop("first_key", "random")
    first_key = None if first == "none" else rng.normal(size=k.shape[:2] + k.shape[3:]) / 4
    if first == "reset":
        run = run + 1  # every run index ≠ 0: the state resets before row 0
    ct_o = jnp.asarray(rng.normal(size=y.shape))
    ct_s = jnp.asarray(rng.normal(size=s0.shape))
    config = KernelConfig(block_v=block_v, outputs=extra.pop("outputs", "pallas"), **extra)
    in_place = layout == "BTHD"
    lay = time_major if in_place else (lambda a: a)

    def loss_op(q, k, y, eta, log_gamma, s0, *first_key):
        kw = (dict(implementation="xla") if layout == "xla" else
              dict(implementation="pallas_gpu", interpret=True, chunk_size=chunk, pieces=pieces, config=config,
                   layout="BTHD" if in_place else "BHTD"))
        o, s = decayed_delta_rule(*(lay(a) for a in (q, k, y, eta, log_gamma, run)), s0, shifted_keys=True,
                                  first_key=first_key[0] if first_key else None, **kw)
        return jnp.sum(o * lay(ct_o).astype(o.dtype)) + jnp.sum(s * ct_s.astype(s.dtype)), (o, s)

    def loss_ref(q, k, y, eta, log_gamma, s0, *first_key):
        o, s = decayed_delta_rule_reference(q, keys_one_row_later(k, *first_key), y, eta, log_gamma, run, s0)
        return jnp.sum(o * ct_o) + jnp.sum(s * ct_s), (o, s)

    args = (q, k, y, eta, log_gamma, s0) + (() if first_key is None else (first_key,))
    argnums = tuple(range(len(args)))
    with poisoned_outputs():
        (_, (o, s)), got = jax.jit(jax.value_and_grad(loss_op, argnums=argnums, has_aux=True))(
            *(jnp.asarray(a, jnp.float32) for a in args))
    (_, (o_ref, s_ref)), want = jax.value_and_grad(loss_ref, argnums=argnums, has_aux=True)(
        *(jnp.asarray(a) for a in args))
    assert rel_err(o, lay(o_ref)) < FP32_TOL
    assert rel_err(s, s_ref) < FP32_TOL
    for name, g, w in zip(["q", "k", "y", "eta", "log_gamma", "initial_state", "first_key"], got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        if name == "initial_state" and first == "reset":  # reset before row 0: it cannot reach the loss
            assert float(jnp.max(jnp.abs(g))) == 0.0, name
            continue
        assert float(jnp.max(jnp.abs(w))) > 0, name  # every input reaches the loss
        assert rel_err(g, w) < 5e-5, name


def test_first_key_needs_shifted_keys_and_its_shape(rng):
    """``first_key`` without ``shifted_keys``, or not ``[B, H, dk]``, is refused with the fix named."""
    q, k, y, eta, log_gamma, run, s0 = (jnp.asarray(a, jnp.float32) for a in op_inputs(rng, B=1, T=8))
    good = jnp.zeros(k.shape[:2] + k.shape[3:])
    with pytest.raises(ValueError, match="shifted_keys=True"):
        decayed_delta_rule(q, k, y, eta, log_gamma, run, s0, implementation="xla", first_key=good)
    with pytest.raises(ValueError, match=r"first_key must be \[B, H, dk\]"):
        decayed_delta_rule(q, k, y, eta, log_gamma, run, s0, implementation="xla", shifted_keys=True,
                           first_key=good[..., :-1])


def test_keys_read_in_place_only_where_every_pass_can():
    """``keys_read_in_place``: the GPU defaults with one piece and the fused output walk; not with pieces, the split
    forward, the fused reverse walk, the formed chunk gradients, on the TPU or with ``keys_in_place=False``."""
    from falcon_jax.kernels.decayed_delta_rule.api import keys_read_in_place

    fused = KernelConfig(outputs="pallas").resolved(4, 32)
    assert keys_read_in_place(fused, "pallas_gpu", 4, 32, 1)
    assert keys_read_in_place(KernelConfig().resolved(128, 128), "pallas_gpu", 128, 128, 1)
    assert not keys_read_in_place(KernelConfig().resolved(4, 32), "pallas_gpu", 4, 32, 1)  # split forward
    assert not keys_read_in_place(fused, "pallas_gpu", 4, 32, 2)
    assert not keys_read_in_place(fused, "pallas_tpu", 4, 32, 1)
    assert not keys_read_in_place(dataclasses.replace(fused, keys_in_place=False), "pallas_gpu", 4, 32, 1)
    for name, value in (("state_grads", "pallas"), ("chunk_grads", "pallas"), ("chunk_grads", "xla")):
        assert not keys_read_in_place(dataclasses.replace(fused, **{name: value}), "pallas_gpu", 4, 32, 1), name


PASSES = {"pallas": KernelConfig(chunk_grads="pallas"), "xla": KernelConfig(chunk_grads="xla", outputs="xla"),
          "split": KernelConfig(outputs="split"),
          "all-split": KernelConfig(outputs="split", state_grads="split", chunk_grads="pallas_split"),
          "stored": KernelConfig(outputs="split", state_grads="split", chunk_grads="pallas_stored"),
          "default": KernelConfig(), "gate-xla": KernelConfig(gate_transpose="xla")}


@pytest.mark.parametrize("T,pieces,per_column,implementation,chunk_grads,H", [
    (53, 1, False, "pallas_gpu", "pallas", 3), (100, 4, False, "pallas_gpu", "pallas", 3),
    (41, 1, True, "pallas_gpu", "pallas", 3), (41, 1, False, "xla", "pallas", 3),
    pytest.param(53, 2, False, "pallas_gpu", "xla", 3, marks=pytest.mark.slow),
    (53, 2, False, "pallas_gpu", "split", 3), (53, 2, False, "pallas_gpu", "all-split", 3),
    (53, 1, False, "pallas_gpu", "stored", 3), (53, 1, False, "pallas_gpu", "default", 4),
    (53, 1, False, "pallas_gpu", "gate-xla", 4)])
def test_time_major_layout_matches_reference(T, pieces, per_column, implementation, chunk_grads, H, rng):
    """``layout="BTHD"``: the scalar-gate Triton kernels read [B, T, H, d] in place (per-column gates and
    other implementations transpose); values, state and gradients equal the float64 reference.
    ``"xla"``: also the outputs and the per-chunk gradients as batched XLA passes; ``"split"``: the split
    forward (outputs="split") with the default chunk gradients; ``"all-split"``: the split walks and the
    two-program chunk gradients; ``"stored"``: the one-program chunk gradients from the P and dR the walks
    stored.  The gates reach the kernels through the transpose kernel (``gate_transpose="pallas"``, the
    default) where H is a power of two (H = 4: ``"default"``), else, and with ``"gate-xla"``, by XLA."""
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, B=2, H=H, T=T, dv=32, segments=True)
    if per_column:
        eta = eta[..., None] * rng.uniform(0.5, 1.0, size=y.shape)
        log_gamma = log_gamma[..., None] * rng.uniform(0.5, 1.5, size=y.shape)
    ct_o = jnp.asarray(rng.normal(size=y.shape))
    reference_op = decayed_delta_rule_reference

    def loss_tm(*a):
        if implementation == "xla":
            o, s = decayed_delta_rule(*a[:5], time_major(run), a[5], implementation="xla", layout="BTHD")
        else:
            o, s = kernel(*a[:5], time_major(run), a[5], pieces=pieces, layout="BTHD",
                          config=PASSES[chunk_grads])
        assert o.shape == (2, T, H, 32)
        return jnp.sum(o * time_major(ct_o).astype(o.dtype)) + jnp.sum(s), (o, s)

    def loss_ref(*a):
        o, s = reference_op(*a[:5], run, a[5])
        return jnp.sum(o * ct_o) + jnp.sum(s), (o, s)

    argnums = tuple(range(6))
    # jitted: run eagerly, the interpret-mode kernels dispatch op by op
    (_, (o, s)), got = jax.jit(jax.value_and_grad(loss_tm, argnums=argnums, has_aux=True))(
        *(jnp.asarray(time_major(a), jnp.float32) for a in (q, x, y, eta, log_gamma)), jnp.asarray(s0, jnp.float32))
    (_, (o_ref, s_ref)), want = jax.value_and_grad(loss_ref, argnums=argnums, has_aux=True)(
        *(jnp.asarray(a) for a in (q, x, y, eta, log_gamma, s0)))
    assert rel_err(o, time_major(o_ref)) < FP32_TOL
    assert rel_err(s, s_ref) < FP32_TOL
    for name, g, w in zip(["q", "x", "y", "eta", "log_gamma"], got[:5], want[:5]):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, time_major(w)) < 5e-5, name
    assert rel_err(got[5], want[5]) < 5e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_gate_transpose_kernel(dtype, rng):
    """``transpose_gates``: [B, L, H] -> [B, H, L] by the Pallas kernel (interpret mode, outputs poisoned
    first: every element written), equal to ``swapaxes`` exactly, with L = 96 (blocks of 32 rows),
    L = 2048 (256) and 64 heads (blocks of 128 rows); its gradient is the transposed cotangent (the kernel
    with the blocks swapped, poisoned too)."""
    for B, L, H in ((2, 96, 4), (1, 2048, 8), (1, 512, 64)):
        a = jnp.asarray(rng.normal(size=(B, L, H)) * 100, dtype)
        with poisoned_outputs():
            got = transpose_gates(a, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.swapaxes(a, 1, 2)))
        if dtype == jnp.float32:  # the cotangent comes back through the kernel, blocks swapped
            ct = jnp.asarray(rng.normal(size=(B, H, L)), jnp.float32)
            with poisoned_outputs():
                grad = jax.grad(lambda a: jnp.sum(transpose_gates(a, interpret=True) * ct))(a)
            np.testing.assert_array_equal(np.asarray(grad), np.asarray(jnp.swapaxes(ct, 1, 2)))


def test_gate_transpose_kernel_lowers_for_triton():
    """Cross-lowered for Triton (bf16 tokens, d = 128, H = 4): with ``gate_transpose="pallas"`` the gates
    reach the kernels through the transpose kernel, their cotangents come back through it, and no [B, T, H]
    gate nor [B, H, T] cotangent is transposed by XLA."""
    B, T, H, D = 1, 256, 4, 128
    q = jnp.zeros((B, T, H, D), jnp.bfloat16)
    gate = jnp.zeros((B, T, H), jnp.float32)
    run = jnp.zeros((B, T, H), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(eta, log_gamma):
        o, s = decayed_delta_rule(q, q, q, eta, log_gamma, run, s0, implementation="pallas_gpu", interpret=False,
                                  layout="BTHD", config=KernelConfig(gate_transpose="pallas"))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(gate, gate).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "gate_transpose" in text
    assert "gate_transpose_back" in text  # the cotangents go back through the kernel too
    swapped = [line for line in text.splitlines() if "stablehlo.transpose" in line
               and any(f"tensor<{B}x{a}x{b}xf32>" in line.split("->")[0] for a, b in ((T, H), (H, T)))]
    assert not swapped, swapped[:2]


@pytest.mark.parametrize("dtype,pieces,walk_operands,chunk_grads,tri_dtype", [
    (jnp.bfloat16, 2, "fp32", "pallas", "fp32"), (jnp.float32, 1, "fp32", "pallas", "fp32"),
    (jnp.bfloat16, 2, "input", "pallas", "input"), (jnp.bfloat16, 2, "input", "auto", "fp32"),
    (jnp.bfloat16, 2, "input", "auto", "input"), (jnp.bfloat16, 2, "input", "pallas_split", "input"),
    (jnp.float32, 1, "input", "auto", "input")])
def test_kernels_lower_for_triton_in_place(dtype, pieces, walk_operands, chunk_grads, tri_dtype):
    """Cross-lower forward + backward with ``layout="BTHD"`` through the Triton rules (d = 128, chunk 64,
    H = 3): the kernels read the model's layout, and with the Pallas chunk gradients no [B, T, H, d] array
    is transposed around them; also with the walks' dots on bf16 operands and the default (here, with few
    programs: the split forward, the split state-gradient walk storing dR, the recompute walk storing P and
    the chunk gradients reading them), in bf16 and fp32, with the triangular inverse stored in fp32 or bf16."""
    B, T, H, D = 2, 512, 3, 128
    q = jnp.zeros((B, T, H, D), dtype)
    gate = jnp.zeros((B, T, H), jnp.float32)
    run = jnp.zeros((B, T, H), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", interpret=False,
                                  pieces=pieces, layout="BTHD",
                                  config=KernelConfig(walk_operands=walk_operands, chunk_grads=chunk_grads,
                                                      tri_dtype=tri_dtype))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
        lowering_platforms=("cuda",)).as_text()
    split = ("chunk_grads_values", "chunk_grads_keys")
    chunk_kernels = {"pallas": ("chunk_grads",), "pallas_split": split,
                     "auto": ("chunk_grads_stored", "prepare_wu", "state_walk", "outputs", "dstate_prepare",
                              "dstate_walk")}
    kernels = ("tri_inverse", "fwd", "dstate") + chunk_kernels[chunk_grads]
    for name in kernels:
        assert f"falcon_delta_{name}" in text, name
    assert all(f"{B}x{T}x{H}x{D}" not in line for line in text.splitlines() if "stablehlo.transpose" in line)


@pytest.mark.parametrize("elimination", ["columns", "rows"])
@pytest.mark.parametrize("group,extreme", [(1, False), (1, True), (2, False)])
def test_triangular_inverse_matches_float64(elimination, group, extreme, rng):
    """``pallas_gpu.tri_inverse_pass`` at chunk 64 (four 16-row diagonal blocks and the blocks below them) against
    float64 inverses of ``I + A``, ``A[s, j] = η_s (x_s·x_j) e^{g⁻_s − g_j}`` on earlier rows (earlier groups
    of ``group`` rows) of the same segment; both eliminations of the diagonal blocks; segment starts inside
    chunks; poisoned outputs.  ``extreme``: nearly parallel keys with
    η‖x‖² = 1.999 and a third of the decays at the clamp (T's entries reach ~1e5)."""
    from benchmarks.gpu_check_tri_inverse import reference as reference_inverses
    from falcon_jax.kernels.decayed_delta_rule import pallas_gpu
    from falcon_jax.kernels.decayed_delta_rule.api import _gates

    BH, T, C, d = 2, 192, 64, 32
    x = rng.normal(size=(BH, T, d))
    if extreme:
        x = x[:, :1] + 0.05 * x
    eta = (1.999 if extreme else rng.uniform(0.1, 1.9, size=(BH, T))) / np.sum(x * x, axis=-1)
    steps = T // group
    log_gamma = (np.where(rng.uniform(size=(BH, steps)) < 0.33, np.log(1e-6), 0.0) if extreme
                 else -rng.uniform(0.0, 0.2, size=(BH, steps)))
    run = np.cumsum(rng.uniform(size=(BH, steps)) < 0.05, axis=1)
    g, gp, rl = _gates(jnp.asarray(log_gamma, jnp.float32), jnp.asarray(run, jnp.int32), C, group)
    with poisoned_outputs():
        tinv = pallas_gpu.tri_inverse_pass(jnp.asarray(x, jnp.float32), jnp.asarray(eta, jnp.float32), g, gp, rl,
                                           chunk=C, interpret=True, group=group, elimination=elimination)
    want = reference_inverses(x, eta, g, gp, rl, chunk=C, group=group)
    assert not extreme or np.max(np.abs(want)) > 1e3  # the case is as hard as it says
    assert rel_err(tinv, want) < 1e-5


def test_extreme_gates_stay_finite_and_exact(rng):
    """β = η‖x‖² = 1.999 (the write's eigenvalue along x is −0.999) with nearly parallel keys (the
    triangular inverse alternates in sign with entries near 2: no power series would survive);
    γ at the clamp (log γ = log 1e-6) on a third of the steps and γ = 1 elsewhere."""
    q, x, y, _, _, run, s0 = op_inputs(rng, T=64, dv=16)
    x = x[..., :1, :] + 0.05 * x  # nearly parallel keys
    eta = 1.999 / np.sum(x * x, axis=-1)
    log_gamma = np.where(rng.uniform(size=eta.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
    assert rel_err(o, o_ref) < 1e-4 and rel_err(final, final_ref) < 1e-4


def test_tiny_decay_every_step(rng):
    """γ = 1e-6 on every step: chunk-local cumulative log decays reach −440 inside one chunk of 32; only
    differences g_t − g_s with t ≥ s are exponentiated, so nothing overflows."""
    q, x, y, eta, _, run, s0 = op_inputs(rng, T=40)
    log_gamma = np.full(eta.shape, np.log(1e-6))
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(final, final_ref) < FP32_TOL


def falcon_inputs(rng, B=2, T=45, H=2, dk=16, dv=16):
    q = rng.normal(size=(B, T, H, dk))
    k = rng.normal(size=(B, T, H, dk)) / 4
    v = rng.normal(size=(B, T, H, dv))
    beta = rng.uniform(0.05, 1.95, size=(B, T, H))
    lam = rng.uniform(0, 1, size=(B, T, H))
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, beta, lam)]


@pytest.mark.parametrize("options,check_grads", [
    ({}, False), ({"timing": "rbw", "segments": True}, True),
    pytest.param({}, True, marks=pytest.mark.slow),
    pytest.param({"timing": "rbw", "alignment": "same_step", "clamp": True}, True, marks=pytest.mark.slow),
    pytest.param({"alignment": "same_step", "scale_coupled": True, "segments": True}, True,
                 marks=pytest.mark.slow),
    # the passes that read the keys one row back in place (one piece, the fused output walk), step 0's pair with
    # the carried key folded into the initial state
    ({"timing": "rbw", "segments": True, "keys_in_place": True}, True),
])
def test_falcon1_pallas_equals_xla_chunk_form(options, check_grads, rng, monkeypatch):
    """Falcon-1 against the XLA chunk form, continuing from a non-trivial state (outputs, state and,
    with ``check_grads``, gradients); ``clamp`` puts λ = 1e6 on a third of the steps so γ sits at
    its clamp."""
    from falcon_jax.forms import chunk_pallas

    q, k, v, beta, lam = falcon_inputs(rng, B=1)  # interpret mode costs per grid step: keep batch·heads small
    options = dict(options)
    if options.pop("keys_in_place", False):
        monkeypatch.setattr(chunk_pallas, "KERNEL_CONFIG", KernelConfig(outputs="pallas", target_programs=1))
    if options.pop("segments", False):
        options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, size=(1, 45)), axis=1))
    if options.pop("clamp", False):
        lam = jnp.where(jnp.asarray(rng.uniform(size=lam.shape) < 0.3), 1e6, lam).astype(jnp.float32)
    kw = dict(variant="1", chunk_size=16, return_final_state=True, **options)
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, check_grads, rng, tol=FP32_TOL)


@pytest.mark.parametrize("in_place", [True, False])
def test_falcon1_state_gradients_through_the_folded_first_step(in_place, rng, monkeypatch):
    """Falcon-1 continuing from a state: the gradients w.r.t. the carried state S and the carried key (step 0's
    write feature, ``first_key``, which the op folds into its initial state) equal the XLA chunk form's, with the
    keys read in place (one piece, the fused output walk) and through the op's shifted copy (the small-shape
    default)."""
    from falcon_jax.forms import chunk_pallas

    if in_place:
        monkeypatch.setattr(chunk_pallas, "KERNEL_CONFIG", KernelConfig(outputs="pallas", target_programs=1))
    q, k, v, beta, lam = falcon_inputs(rng, B=1, T=40)
    kw = dict(variant="1", chunk_size=16, return_final_state=True)
    _, state = falcon(q[:, :7], k[:, :7], v[:, :7], beta[:, :7], lam[:, :7], **kw)
    ct = jnp.asarray(rng.normal(size=v[:, 7:].shape), jnp.float32)
    ct_s = jnp.asarray(rng.normal(size=state.S.shape), jnp.float32)

    def grads(impl):
        def loss(S, last_key):
            out, final = falcon(q[:, 7:], k[:, 7:], v[:, 7:], beta[:, 7:], lam[:, 7:], impl=impl,
                                initial_state=state.replace(S=S, last_key=last_key), **kw)
            return jnp.sum(out * ct) + jnp.sum(final.S * ct_s)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(state.S, state.last_key)

    with poisoned_outputs():
        got = grads("pallas")
    want = grads("xla")
    for name, g, w in zip(("S", "last_key"), got, want):
        assert float(jnp.max(jnp.abs(w))) > 0, name  # the carried key does reach the loss
        assert rel_err(g, w) < 1e-4, name


@pytest.mark.parametrize("window", [1, 3])
def test_falcon_hands_the_kernel_config_to_the_op(window, monkeypatch, rng):
    """``chunk_pallas.KERNEL_CONFIG`` reaches the regression op from ``falcon(impl="pallas")`` (the benchmarks time
    opt-in choices through the whole op with it); None leaves the op's defaults; the outputs do not change."""
    import falcon_jax.kernels.decayed_delta_rule as ops
    from falcon_jax.forms import chunk_pallas

    op_name = "decayed_delta_rule" if window == 1 else "windowed_delta_rule"
    real, seen = getattr(ops, op_name), []

    def spy(*args, config=None, **kw):
        seen.append(config)
        return real(*args, config=config, **kw)

    monkeypatch.setattr(ops, op_name, spy)
    q, k, v, beta, lam = falcon_inputs(rng, T=24)
    kw = dict(variant="1" if window == 1 else "3", impl="pallas", chunk_size=16,
              **({"window": window} if window > 1 else {}))
    default = falcon(q, k, v, beta, lam, **kw)
    config = KernelConfig(tri_dtype="input", chunk_grads="pallas_split")
    monkeypatch.setattr(chunk_pallas, "KERNEL_CONFIG", config)
    chosen = falcon(q, k, v, beta, lam, **kw)
    assert seen == [None, config]
    assert rel_err(chosen, default) < FP32_TOL  # fp32 inputs: tri_dtype leaves T in fp32


def test_deltanet_baseline_through_kernel(rng):
    q, k, v, beta, _ = falcon_inputs(rng, T=40)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    with poisoned_outputs():
        got = deltanet(q, k, v, beta, impl="pallas", chunk_size=16)
    want = deltanet(q, k, v, beta, impl="xla", chunk_size=16)
    assert rel_err(got, want) < FP32_TOL


def test_bf16_error_within_twice_the_xla_forms(rng):
    """bf16 inputs: the kernel (bf16 input matmuls; fp32 states, solves and accumulation) against the
    fp64 recurrence, bounded by twice the error of the XLA chunk form (fp32 compute on the same bf16
    inputs)."""
    q, k, v, beta, lam = falcon_inputs(rng, T=64)
    exact = falcon(*(a.astype(jnp.float64) for a in (q, k, v, beta, lam)), variant="1", form="recurrent")
    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)] + [beta, lam]
    err_kernel = rel_err(falcon(*bf, variant="1", impl="pallas", chunk_size=16), exact)
    err_xla = rel_err(falcon(*bf, variant="1", impl="xla", chunk_size=16), exact)
    assert err_kernel <= 2 * err_xla + 1e-3, (err_kernel, err_xla)


FP32_WALK_PALLAS_PASSES = KernelConfig(walk_operands="fp32", tri_dtype="fp32", chunk_grads="pallas", outputs="pallas",
                                       state_grads="pallas")


@pytest.mark.parametrize("config", [
    KernelConfig(walk_operands="fp32", outputs="xla", state_grads="pallas", chunk_grads="xla"),
    KernelConfig(walk_operands="input", outputs="pallas", state_grads="pallas", chunk_grads="pallas"),
    # opt-in combinations of choices tested on their own above: slow (CI time)
    pytest.param(KernelConfig(walk_operands="input", outputs="xla", state_grads="pallas", chunk_grads="xla"),
                 marks=pytest.mark.slow),
    KernelConfig(), KernelConfig(outputs="pallas"),
    pytest.param(KernelConfig(outputs="split", state_grads="split", chunk_grads="xla"), marks=pytest.mark.slow),
    KernelConfig(split_block_v=16), pytest.param(KernelConfig(tri_dtype="fp32"), marks=pytest.mark.slow),
    pytest.param(KernelConfig(chunk_grads="pallas_split"), marks=pytest.mark.slow),
    KernelConfig(stored_v="input", save_tri=True)],
    ids=["xla-passes", "bf16-walk-operands", "both", "default", "fused-forward", "split-walks", "narrow-split-walks",
         "fp32-inverse", "bf16-inverse-two-program-chunk-grads", "bf16-v-saved-inverse"])
def test_pass_choices_in_bf16_match_the_kernels_error(config, rng):
    """bf16 q, x, y with the pass choices — the outputs and chunk gradients as XLA passes (reading
    the chunk states the walk stores in bf16), the walks' state-sized dot operands rounded to bf16, the
    default (bf16 walk operands, split state-gradient walk, chunk gradients from the walks' P and dR, here the
    split forward: few programs, and T stored in bf16), the fused forward, the split walks with XLA chunk
    gradients, 16-column split walks, T in fp32, T in bf16 through the fused passes ("bf16-walk-operands": T
    is in bf16 by default) and the two-program chunk gradients (every kernel that reads T), V stored in bf16
    with the forward's T kept for the backward —:
    outputs and gradients against the float64 reference, within twice the error of the
    fp32-operand all-Pallas path on the same inputs plus one bf16 unit (2⁻⁸ of the largest value:
    rounding S and P to bf16 for a dot costs about that; measured 1–3.7× that path's error), with
    pieces, so the piece maps run too."""
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=64, dv=32, segments=True)
    ct = jnp.asarray(rng.normal(size=y.shape))

    def out_and_grads(fn, dtype):
        def loss(q_, x_, y_):
            o, _ = fn(q_, x_, y_)
            return jnp.sum(o.astype(ct.dtype) * ct), o
        (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            *(jnp.asarray(a).astype(jnp.bfloat16).astype(dtype) for a in (q, x, y)))
        return [o, *g]

    gates = [jnp.asarray(a, jnp.float32) for a in (eta, log_gamma)]
    exact = out_and_grads(lambda *a: reference(*a, eta, log_gamma, run, s0), jnp.float64)

    def op(cfg):
        return lambda *a: decayed_delta_rule(*a, *gates, run, jnp.asarray(s0, jnp.float32), chunk_size=16,
                                             implementation="pallas_gpu", config=cfg, pieces=2)

    with poisoned_outputs():
        split = out_and_grads(op(config), jnp.bfloat16)
        fused = out_and_grads(op(FP32_WALK_PALLAS_PASSES), jnp.bfloat16)
    for name, a, b, e in zip(["o", "q", "x", "y"], split, fused, exact):
        assert np.all(np.isfinite(np.asarray(a, np.float64))), name
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 2.0**-8, (name, rel_err(a, e), rel_err(b, e))


@pytest.mark.parametrize("dtype,pieces,heads", [(jnp.bfloat16, 1, True), (jnp.bfloat16, 2, False),
                                               (jnp.float32, 1, False)])
def test_split_walks_lower_for_triton(dtype, pieces, heads):
    """``outputs="split"`` and ``state_grads="split"``: their kernels (W/U, the state-only walk, the outputs; V/B
    and the three-dot reverse walk) cross-lower through the Triton rules at d = 128, chunk 64, forward and
    backward, in place ([B, T, H, d]) and head-major, with pieces."""
    B, T, H, D = 1, 512, 2, 128
    shape = (B, T, H, D) if heads else (B, H, T, D)
    q = jnp.zeros(shape, dtype)
    gate = jnp.zeros(shape[:3], jnp.float32)
    run = jnp.zeros(shape[:3], jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", interpret=False,
                                  pieces=pieces, layout="BTHD" if heads else "BHTD",
                                  config=KernelConfig(outputs="split", state_grads="split"))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
        lowering_platforms=("cuda",)).as_text()
    for name in ("tri_inverse", "prepare_wu", "state_walk", "outputs", "dstate_prepare", "dstate_walk"):
        assert f"falcon_delta_{name}" in text, name


@pytest.mark.parametrize("name,value", [("outputs", "split"), ("state_grads", "split"),
                                        ("chunk_grads", "pallas_split"), ("chunk_grads", "pallas_stored"),
                                        ("chunk_grads", "pallas_stored_split")])
def test_split_passes_are_gpu_only(name, value, rng):
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=20)
    with pytest.raises(NotImplementedError, match=f"{name}='{value}'"):
        kernel(q, x, y, eta, log_gamma, run, s0, implementation="pallas_tpu", config=KernelConfig(**{name: value}))


def test_kernel_config_auto_choices_per_backend_and_shape():
    """The defaults pick the split passes on the GPU (faster on the H200) and keep the TPU's fused kernels; the
    walks' value blocks 32 columns wide, 16 when 32 gives fewer than 128 programs, 64 when 64 still gives 256
    (16-bit inputs, dk <= 128; the output walk then reads the scores kernel's scores); the split forward only when the
    fused walk would still run fewer than 128; the split walks' width the widest ≤ 64 that still gives 128
    programs; the chunk gradients' value step 64 columns unless set; the output walk's scores from their own
    kernel for few programs; the reverse walk's B dS from T."""
    cfg = KernelConfig()
    assert cfg.chunk_grads_for("pallas_gpu") == "pallas_stored" and cfg.chunk_grads_for("pallas_tpu") == "pallas"
    assert cfg.state_grads_for("pallas_gpu") == "split" and cfg.state_grads_for("pallas_tpu") == "pallas"
    assert KernelConfig(chunk_grads="xla").chunk_grads_for("pallas_gpu") == "xla"
    assert KernelConfig(state_grads="pallas").state_grads_for("pallas_gpu") == "pallas"
    # 128 value columns in blocks of 32 (16 for under 128 programs): 4 (8) programs per batch·head
    assert cfg.outputs_for("pallas_gpu", 16, 128) == "pallas"  # 1x32768x16x128: 16 columns, 128 programs
    assert cfg.outputs_for("pallas_gpu", 32, 128) == "pallas"  # 2x8192x16x128: 32 columns, 128
    assert cfg.outputs_for("pallas_gpu", 8, 128) == "split"  # 16 columns, 64
    assert KernelConfig(block_v=32).outputs_for("pallas_gpu", 16, 128) == "split"  # 64
    bf16 = jnp.bfloat16
    assert [cfg.block_v_for(bh, 128, bf16, 128) for bh in (128, 127, 32, 16, 8)] == [64, 32, 32, 16, 16]
    assert KernelConfig(fwd_scores="walk").block_v_for(128, 128, bf16, 128) == 32  # 64 only with the scores kernel
    # 256 batch·heads: 512 64-column programs, too many for "auto" to read stored scores, so 32 columns (as measured
    # at 512 programs); asked for, the scores kernel takes 64 there too
    assert cfg.block_v_for(256, 128, bf16, 128) == 32
    assert KernelConfig(fwd_scores="kernel").block_v_for(256, 128, bf16, 128) == 64
    # 64 only for 16-bit inputs with dk <= 128: wider tiles overflow the H200's shared memory
    assert [cfg.block_v_for(128, 128, dt, dk) for dt, dk in ((jnp.float32, 128), (bf16, 256), (None, None))] == [32] * 3
    assert cfg.resolved(128, 128, bf16, 128).block_v == 64 and cfg.resolved(128, 128, jnp.float32, 128).block_v == 32
    assert cfg.block_v_for(4, 16) == 16 and KernelConfig(block_v=64).block_v_for(2, 32) == 32
    assert cfg.resolved(16, 128).block_v == 16 and cfg.resolved(16, 128).grad_block_v == 64
    assert KernelConfig(grad_block_v=64).resolved(1, 16).grad_block_v == 16
    # the stored chunk gradients' value half: all of dv up to 128 for 16-bit inputs (next102), 64 for fp32
    assert [cfg.resolved(16, dv, jnp.bfloat16).grad_block_v for dv in (64, 128, 256)] == [64, 128, 128]
    assert cfg.resolved(16, 128, jnp.float32).grad_block_v == 64
    assert cfg.outputs_for("pallas_tpu", 16, 128) == "pallas"
    assert KernelConfig(outputs="xla").outputs_for("pallas_gpu", 16, 128) == "xla"
    assert [cfg.split_block_v_for(bh, 128) for bh in (128, 32, 16, 1)] == [64, 32, 16, 16]
    assert cfg.split_block_v_for(128, 32) == 32 and KernelConfig(split_block_v=128).split_block_v_for(4, 64) == 64
    # the output walk's scores from their own kernel up to 264 programs (2x8192, 1x32768: 128), formed in the walk
    # above (8x2048: 512); the TPU always forms them in the walk
    assert [cfg.fwd_scores_for("pallas_gpu", n) for n in (128, 264, 265, 512)] == ["kernel", "kernel", "walk", "walk"]
    assert cfg.fwd_scores_for("pallas_tpu", 16) == "walk"
    assert KernelConfig(fwd_scores="walk").fwd_scores_for("pallas_gpu", 16) == "walk"
    assert KernelConfig(fwd_scores="kernel").fwd_scores_for("pallas_gpu", 512) == "kernel"
    assert cfg.dstate_b == "from_t"
    # the reverse walk's (c ⊙ Q)ᵀ dO from dstate_prepare from 256 walk programs on (8x2048x16x128: 128 batch·heads
    # x 2 blocks of 64 columns), formed in the walk below (2x8192, 1x32768: 128)
    assert [cfg.dstate_q_for(n) for n in (128, 255, 256, 512)] == ["walk", "walk", "prepare", "prepare"]
    assert cfg.split_block_v_for(128, 128) == 64 and cfg.split_block_v_for(16, 128) == 16
    assert KernelConfig(dstate_q="walk").dstate_q_for(512) == "walk"
    assert KernelConfig(dstate_q="prepare").dstate_q_for(1) == "prepare"
    # the Mosaic reverse walk forms it itself at any count (next99: free there, prepare 118 -> 84 us at 8x2048)
    assert [cfg.dstate_q_for(n, mosaic_walk=True) for n in (128, 256, 512)] == ["walk"] * 3
    assert KernelConfig(dstate_q="prepare").dstate_q_for(256, mosaic_walk=True) == "prepare"
    # V from prepare unless asked for in the Mosaic walk (next100: slower there), and only with the q-term there too
    assert cfg.dstate_v_for(True, True) == "prepare"
    assert [KernelConfig(dstate_v="walk").dstate_v_for(*a) for a in ((True, True), (True, False), (False, True))] == [
        "walk", "prepare", "prepare"]
    # V in bf16 for Falcon-1's one row per step, fp32 for a window's rows (Falcon-3)
    assert (cfg.stored_v_for(1), cfg.stored_v_for(4)) == ("input", "fp32")
    assert KernelConfig(stored_v="input").stored_v_for(4) == "input"


def test_walk_stages_follow_program_count():
    """The walks' pipelining stages: an explicit count is kept; None gives 3, except 2 for an output-writing
    walk of more than 264 programs and 4 for one of fewer with narrow tiles."""
    assert [KernelConfig.walk_stages(None, output_programs=n) for n in (1, 128, 264, 265, 512)] == [3, 3, 3, 2, 2]
    assert [KernelConfig.walk_stages(None, output_programs=n, narrow_tiles=True) for n in (1, 128, 264, 265)] == [
        4, 4, 4, 2]
    assert KernelConfig.walk_stages(None) == 3  # a walk that writes no outputs, however many programs
    assert KernelConfig.walk_stages(None, narrow_tiles=True) == 3
    assert KernelConfig.walk_stages(1) == 1 and KernelConfig.walk_stages(4, output_programs=4096) == 4


@pytest.mark.parametrize("platform,capability,large", [("gpu", "9.0", True), ("gpu", "10.0", True),
                                                       ("gpu", "8.0", False), ("gpu", "12.0", False),
                                                       ("cpu", None, False)])
def test_large_shared_memory_names_the_gpus_with_228_kb(platform, capability, large):
    """``common.large_shared_memory``: True for a GPU of compute capability 9.x or 10.x only (the 4-stage output
    walk of ``walk_stages`` would not fit an A100's or a consumer GPU's shared memory)."""
    from falcon_jax.kernels import common

    device = SimpleNamespace(platform=platform, compute_capability=capability)
    with mock.patch.object(common.jax, "devices", lambda: [device]):
        assert common.large_shared_memory() is large


@pytest.mark.parametrize("kwargs,match", [
    ({"chunk_grads": "triton"}, "chunk_grads must be 'auto' or 'pallas' or 'xla' or 'pallas_split'"),
    ({"outputs": "XLA"}, "outputs must be"),
    ({"walk_operands": "bf16"}, "walk_operands must be 'fp32' or 'input'"),
    ({"split_block_v": 24}, "split_block_v must be None"), ({"grad_block_v": 8}, "grad_block_v must be None"),
    ({"block_v": 48}, "block_v must be None"),
    ({"grad_block_k": 8}, "grad_block_k must be a power of two"),
    ({"stored_dr": "bf16"}, "stored_dr must be 'fp32' or 'input'"),
    ({"tri_dtype": jnp.bfloat16}, "tri_dtype must be 'fp32' or 'input'"),
    ({"column_solve": "block"}, "column_solve must be 'rows' or 'blocked'"),
    ({"tri_elimination": "row"}, "tri_elimination must be 'columns' or 'rows'"),
    ({"stored_v": "bf16"}, "stored_v must be 'auto' or 'fp32' or 'input'"),
    ({"save_tri": "yes"}, "save_tri must be True or False"), ({"dstate_b": "t"}, "dstate_b must be"),
    ({"fwd_scores": "inverse"}, "fwd_scores must be"), ({"prepare_warps": 3}, "prepare_warps must be None"),
    ({"dstate_q": "kernel"}, "dstate_q must be 'auto' or 'walk' or 'prepare'"),
])
def test_kernel_config_refuses_unknown_pass_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_kernel_resources_captures_every_triton_kernel():
    """``benchmarks/kernel_resources.py`` (registers / spills on any machine) sees every Triton kernel of the
    op's value and gradient, cross-lowered for CUDA, each with its own warps and stages, and puts the
    lowering hooks back afterwards (compiling the TTIR needs a standalone Triton: not part of this test).
    With ``grad_loops="fori"`` (Falcon-1's default) the stored chunk gradients' column loops reach Triton as
    ``scf.for`` loops (what its pipeliner needs); ``"unrolled"`` (Falcon-1A's default) leaves none."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.triton import lowering

    from benchmarks.kernel_resources import lower_kernels

    before = (lowering.lower_jaxpr_to_triton_module, mlir.custom_call)
    modules = lower_kernels("1x256x4x64", "tri_warps=2,grad_warps=8,grad_stages=3")
    assert (lowering.lower_jaxpr_to_triton_module, mlir.custom_call) == before
    by_name = {}
    for m in modules:
        assert m["ttir"].lstrip().startswith("module") and "tt.func" in m["ttir"], m.get("name")
        by_name.setdefault(m["name"], []).append(m)
    assert {"falcon_delta_tri_inverse", "falcon_delta_fwd", "falcon_delta_dstate_walk",
            "falcon_delta_chunk_grads_stored", "gate_transpose", "gate_transpose_back"} <= set(by_name)
    assert {m["num_warps"] for m in by_name["falcon_delta_tri_inverse"]} == {2}
    # 4 batch·heads x 2 value blocks: few programs, so every walk pipelines 3 stages (KernelConfig.walk_stages)
    assert {m["num_stages"] for name in ("falcon_delta_fwd", "falcon_delta_dstate_walk")
            for m in by_name[name]} == {3}
    # 16 value columns of bf16 tiles: on a GPU with ~228 KB of shared memory per SM (an H200 stood in for here) the
    # output walk pipelines 4 stages, the recompute walk (no outputs) 3; elsewhere (an A100's 164 KB) both 3
    def fwd_walk_stages():
        return sorted(m["num_stages"] for m in lower_kernels("1x256x4x64", "block_v=16,outputs=pallas")
                      if m["name"] == "falcon_delta_fwd")

    assert fwd_walk_stages() == [3, 3]
    with mock.patch("falcon_jax.kernels.decayed_delta_rule.api.large_shared_memory", lambda: True):
        assert fwd_walk_stages() == [3, 4]
    # the V-forming prepare kernel: the state walk's warps unless prepare_warps is set
    assert {m["num_warps"] for m in by_name["falcon_delta_dstate_prepare"]} == {4}
    assert {m["num_warps"] for m in lower_kernels("1x256x4x64", "prepare_warps=8")
            if m["name"] == "falcon_delta_dstate_prepare"} == {8}
    (grads,) = by_name["falcon_delta_chunk_grads_stored"]
    assert (grads["num_warps"], grads["num_stages"]) == (8, 3) and grads["ttir"].count("scf.for") == 2
    (unrolled,) = [m for m in lower_kernels("1x256x4x64", "grad_loops=unrolled")
                   if m["name"] == "falcon_delta_chunk_grads_stored"]
    assert "scf.for" not in unrolled["ttir"]
    # fwd_scores="kernel": one scores kernel, and the output walk (the forward walk storing o) takes no QXᵀ dot
    def output_walk_dots(cfg):
        modules = lower_kernels("1x256x4x64", cfg)
        walks = [m["ttir"] for m in modules if m["name"] == "falcon_delta_fwd" and m["ttir"].count("tt.store") == 2]
        return [m["name"] for m in modules].count("falcon_delta_masked_scores"), [w.count("tt.dot") for w in walks]
    assert output_walk_dots("outputs=pallas,fwd_scores=walk") == (0, [6])
    assert output_walk_dots("outputs=pallas,fwd_scores=kernel") == (1, [5])
    # "auto": 4 batch·heads x 4 value blocks is far under 264 output-walk programs, so the scores kernel
    assert output_walk_dots("outputs=pallas") == (1, [5])
    # dstate_q="prepare" (one piece): (c ⊙ Q)ᵀ dO moves from the reverse walk (dots 4 -> 3, and it loads neither
    # q nor dO: one load for two) to dstate_prepare (3 -> 4 dots, a second store)
    def walk_and_prepare(cfg):
        return {m["name"]: (m["ttir"].count("tt.dot"), m["ttir"].count("tt.load"), m["ttir"].count("tt.store"))
                for m in lower_kernels("1x256x4x64", cfg)
                if m["name"] in ("falcon_delta_dstate_walk", "falcon_delta_dstate_prepare")}
    walk = walk_and_prepare("target_programs=1")
    prepared = walk_and_prepare("target_programs=1,dstate_q=prepare")
    assert prepared["falcon_delta_dstate_walk"][:2] == (walk["falcon_delta_dstate_walk"][0] - 1,
                                                      walk["falcon_delta_dstate_walk"][1] - 1)
    (dots, _, stores), (dots_p, _, stores_p) = (walk["falcon_delta_dstate_prepare"],
                                                prepared["falcon_delta_dstate_prepare"])
    assert (dots_p, stores_p) == (dots + 1, stores + 1)
    attention = {m["name"]: m for m in lower_kernels("1x256x4x64", "grad_loops=fori,grad_stages=3", op="attention")}
    assert {"falcon_decayed_attention_fwd", "falcon_decayed_attention_dstate",
            "falcon_decayed_attention_chunk_grads"} <= set(attention)
    grads = attention["falcon_decayed_attention_chunk_grads"]
    assert grads["num_stages"] == 3 and grads["ttir"].count("scf.for") == 1
    (unrolled,) = [m for m in lower_kernels("1x256x4x64", "", op="attention")  # its default: unrolled
                   if m["name"] == "falcon_decayed_attention_chunk_grads"]
    assert "scf.for" not in unrolled["ttir"]
    with pytest.raises(ValueError, match="tri_warps=2.* is not name=value with a KernelConfig field"):
        lower_kernels("1x256x4x64", "tri_warps=2", op="attention")  # a regression-kernel field
    assert all(isinstance(m["num_stages"], int) for m in modules)


def test_benchmark_kernel_config_parser():
    """The H200 scripts' ``--kernel-config name=value,...``: ints, booleans and strings become a KernelConfig;
    a misspelt name or a bad value is an error naming it (a typo must not silently time the defaults)."""
    from benchmarks.common import kernel_config

    assert kernel_config("  ") is None
    cfg = kernel_config("tri_dtype=fp32, save_tri=True,grad_block_k=64,split_block_v=None")
    assert cfg == KernelConfig(tri_dtype="fp32", save_tri=True, grad_block_k=64, split_block_v=None)
    with pytest.raises(ValueError, match="'tri_dtyp=fp32' is not name=value with a KernelConfig field"):
        kernel_config("tri_dtyp=fp32")
    with pytest.raises(ValueError, match="save_tri must be True or False"):
        kernel_config("save_tri=yes")


def operand_aliases(custom_call_line):
    """``{(output index, operand index)}``: the outputs a lowered custom call writes over its operands."""
    return {(int(o), int(i)) for o, i in re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)",
                                                    custom_call_line)}


def test_saved_inverse_skips_the_backward_solve():
    """``save_tri=True``: the backward reads the forward's T — one triangular-inverse kernel in the lowered
    forward + backward instead of two; ``stored_v="input"`` (what the default "auto" picks for Falcon-1): V leaves
    the prepare kernel in bf16, ``"fp32"`` in fp32; the reverse walk's dR aliases V where they share a dtype, and
    with ``dstate_q="prepare"`` its dh aliases the q-term."""
    B, T, H, D = 1, 256, 2, 128
    q = jnp.zeros((B, H, T, D), jnp.bfloat16)
    gate = jnp.zeros((B, H, T), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def lowered(config):
        def loss(q, x, y, eta, log_gamma, s0):
            o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu",
                                      interpret=False, config=config)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
            lowering_platforms=("cuda",)).as_text()

    def calls(text, name):
        return text.count(f'name = "falcon_delta_{name}')

    def call_lines(text, name):
        return [line for line in text.splitlines() if f'name = "falcon_delta_{name}' in line]

    default, saved = lowered(KernelConfig()), lowered(KernelConfig(save_tri=True, stored_v="input"))
    assert calls(default, "tri_inverse") == 2 and calls(saved, "tri_inverse") == 1
    assert calls(saved, "dstate_prepare") == 1
    prepare = call_lines(saved, "dstate_prepare")
    # V (its first output; the only one when the reverse walk forms B from T, the default) in bf16
    assert re.search(rf"-> \(?tensor<{B * H}x{T}x{D}xbf16>", prepare[0])
    fp32_v = lowered(KernelConfig(stored_v="fp32"))
    prepare = call_lines(fp32_v, "dstate_prepare")
    assert re.search(rf"-> \(?tensor<{B * H}x{T}x{D}xf32>", prepare[0])
    prepare = call_lines(default, "dstate_prepare")
    assert re.search(rf"-> \(?tensor<{B * H}x{T}x{D}xbf16>", prepare[0])  # the default: bf16 V
    # the reverse walk writes dR (output 0) over V (operand 6) where they share a dtype (bf16 V, not fp32 V), and
    # with dstate_q="prepare" dh (output 1) into the buffer of the q-term prepare made (operand 10): no new buffers
    for config, want in ((KernelConfig(target_programs=1), {(0, 6)}),
                         (KernelConfig(target_programs=1, stored_v="fp32"), set()),
                         (KernelConfig(target_programs=1, dstate_q="prepare"), {(0, 6), (1, 10)})):
        (walk,) = call_lines(lowered(config), "dstate_walk")
        got = operand_aliases(walk)
        assert got == want, (config, got)


@pytest.mark.parametrize("chunk_grads,kernel,p_index,dx_index,dy_over_dr", [
    ("pallas_stored", "chunk_grads_stored", 10, 2, {(0, 11)}), ("pallas_stored_split", "chunk_grads_keys", 9, 1, set()),
    ("pallas_split", "chunk_grads_keys", 9, 1, set())])
def test_chunk_gradients_write_over_stored_buffers(chunk_grads, kernel, p_index, dx_index, dy_over_dr):
    """The kernel that writes dx writes it over the stored P (its operand ``p_index``), in the model's layout and in
    the flat one, where dk = dv and P is in x's dtype; the one-program stored chunk gradients also write dy over
    dR (operand 11) where dR is in y's dtype.  With dk ≠ dv only dy's; with P and dR in fp32 (``walk_operands=
    "fp32"``) neither."""
    B, T, H = 1, 256, 2

    def aliases(layout, dk, dv, walk_operands="input"):
        shape = (lambda d: (B, T, H, d)) if layout == "BTHD" else (lambda d: (B, H, T, d))
        q, y = jnp.zeros(shape(dk), jnp.bfloat16), jnp.zeros(shape(dv), jnp.bfloat16)
        gate = jnp.zeros(shape(1)[:3], jnp.float32)
        run = jnp.zeros(shape(1)[:3], jnp.int32)
        s0 = jnp.zeros((B, H, dk, dv), jnp.float32)

        def loss(q, x, y):
            o, s = decayed_delta_rule(q, x, y, gate, gate, run, s0, implementation="pallas_gpu", interpret=False,
                                      layout=layout, config=KernelConfig(chunk_grads=chunk_grads,
                                                                         walk_operands=walk_operands))
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, y).lower(lowering_platforms=("cuda",)).as_text()
        (line,) = [ln for ln in text.splitlines() if f'name = "falcon_delta_{kernel}"' in ln]
        return operand_aliases(line)

    assert aliases("BTHD", 64, 64) == {(dx_index, p_index)} | dy_over_dr
    assert aliases("BHTD", 64, 64) == {(dx_index, p_index)} | dy_over_dr
    assert aliases("BTHD", 32, 64) == dy_over_dr
    assert aliases("BTHD", 64, 64, walk_operands="fp32") == set()


def test_kernel_config_tri_dtype_per_backend_and_inputs():
    """T is stored in the inputs' dtype only for bf16/fp16 inputs on the GPU with ``tri_dtype="input"`` (the
    default)."""
    bf16, fp32 = KernelConfig().tri_kw, KernelConfig(tri_dtype="fp32").tri_kw
    assert bf16("pallas_gpu", jnp.bfloat16)["t_dtype"] == jnp.bfloat16
    assert bf16("pallas_gpu", jnp.float16)["t_dtype"] == jnp.float16
    assert bf16("pallas_gpu", jnp.float32)["t_dtype"] == jnp.float32
    assert fp32("pallas_gpu", jnp.bfloat16)["t_dtype"] == jnp.float32
    assert "t_dtype" not in bf16("pallas_tpu", jnp.bfloat16)  # the TPU kernels keep T in fp32
    assert bf16("pallas_gpu", jnp.bfloat16)["elimination"] == "columns"
    assert KernelConfig(tri_elimination="rows").tri_kw("pallas_gpu", jnp.float32)["elimination"] == "rows"
    assert "elimination" not in bf16("pallas_tpu", jnp.bfloat16)  # the TPU kernel has its own solve


@pytest.mark.parametrize("stored_dr,tri_dtype", [("input", "input"), ("fp32", "input"),
                                                 pytest.param("input", "fp32", marks=pytest.mark.slow)])
def test_bf16_stored_residual_gradients(stored_dr, tri_dtype, rng):
    """bf16 inputs through the GPU default backward (P stored by the recompute walk, dR by the state-gradient walk
    in bf16 or fp32; T in fp32 or bf16): every gradient within a few bf16 units of the float64 reference, all
    written."""
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=48, dv=32, segments=True)
    ct_o = jnp.asarray(rng.normal(size=y.shape))
    bf = lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float64)  # noqa: E731 - the bf16 values, exactly
    q, x, y = (bf(a) for a in (q, x, y))
    config = KernelConfig(stored_dr=stored_dr, tri_dtype=tri_dtype)

    def loss_kernel(q_, x_, y_, e, lg, s):
        with poisoned_outputs():
            o, _ = decayed_delta_rule(q_, x_, y_, e, lg, run, s, implementation="pallas_gpu", chunk_size=16,
                                      config=config)
        return jnp.sum(o.astype(jnp.float32) * ct_o.astype(jnp.float32))

    def loss_ref(*a):
        return jnp.sum(decayed_delta_rule_reference(*a[:5], run, a[5])[0] * ct_o)

    args = (q, x, y, eta, log_gamma, s0)
    got = jax.grad(loss_kernel, argnums=tuple(range(6)))(
        *(jnp.asarray(a, jnp.bfloat16) for a in args[:3]), *(jnp.asarray(a, jnp.float32) for a in args[3:]))
    want = jax.grad(loss_ref, argnums=tuple(range(6)))(*(jnp.asarray(a) for a in args))
    for name, g, w in zip(["q", "x", "y", "eta", "log_gamma", "initial_state"], got, want):
        assert np.all(np.isfinite(np.asarray(g, np.float32))), name
        assert rel_err(np.asarray(g, np.float32), w) < 1.5e-2, name  # about four bf16 units


def test_bf16_walk_operands_leave_fp32_inputs_alone(rng):
    """``walk_operands="input"`` and ``tri_dtype="input"`` round operands only for bf16/fp16 inputs: fp32 runs are
    bit-identical."""
    q, x, y, eta, log_gamma, run, s0 = op_inputs(rng, T=40)
    a = kernel(q, x, y, eta, log_gamma, run, s0, config=KernelConfig(walk_operands="input", tri_dtype="input"))
    b = kernel(q, x, y, eta, log_gamma, run, s0, config=KernelConfig(walk_operands="fp32"))
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("variant", ["1", pytest.param("3", marks=pytest.mark.slow)])
def test_bf16_gradients_within_a_few_times_the_xla_forms(variant, rng):
    """bf16 inputs, backward: the kernel stores its per-chunk states and their gradients in bf16 (read back
    into fp32 for its products), the XLA chunk form computes in fp32 from the same bf16 inputs; the
    kernel's gradient error against fp64 stays within 3× the XLA form's."""
    q, k, v, beta, lam = falcon_inputs(rng, T=80)
    ct = rng.normal(size=v.shape)
    for name, g_kernel, err_kernel, err_xla in bf16_gradient_errors(q, k, v, beta, lam, ct, variant=variant,
                                                                    chunk_size=16):
        assert np.all(np.isfinite(np.asarray(g_kernel, np.float64))), name
        assert err_kernel <= 3 * err_xla + 1e-3, (name, err_kernel, err_xla)


def test_rules_without_kernel_raise_or_fall_back(rng):
    q, k, v, beta, lam = falcon_inputs(rng, T=20)
    with pytest.raises(NotImplementedError, match="Gated DeltaNet"):
        gated_deltanet(q, k, v, beta, -lam, impl="pallas")
    with pytest.raises(NotImplementedError, match="window=32"):
        falcon(q, k, v, beta, lam, variant="3", window=32, impl="pallas")
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon(q, k, v, beta, lam, variant="1", impl="pallas", chunk_size=8)
    # on CPU "auto" is the XLA chunk form, exactly
    np.testing.assert_array_equal(falcon(q, k, v, beta, lam, variant="3", impl="auto"),
                                  falcon(q, k, v, beta, lam, variant="3", impl="xla"))


@pytest.mark.parametrize("implementation,platform,dtype,pieces", [
    ("pallas_gpu", "cuda", jnp.bfloat16, 2), ("pallas_gpu", "cuda", jnp.float32, 1),
    ("pallas_tpu", "tpu", jnp.bfloat16, 1),
])
def test_kernels_lower_for_the_accelerator(implementation, platform, dtype, pieces):
    """Cross-lower forward + backward for the real accelerator on CPU (no device needed): every
    ``pallas_call`` goes through the Triton (or Mosaic TPU) lowering rules, d = 128, chunk 64.
    Catches unsupported ops in the kernels; compiling the lowered kernels needs the device.  The Pallas
    chunk-gradient kernel is asked for explicitly (the GPU default computes those gradients in XLA)."""
    B, H, T, D = 1, 2, 512, 128
    q = jnp.zeros((B, H, T, D), dtype)
    gate = jnp.zeros((B, H, T), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation=implementation, interpret=False,
                                  pieces=pieces, config=KernelConfig(chunk_grads="pallas"))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    lowered = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
        lowering_platforms=(platform,))
    text = lowered.as_text()
    for name in ("tri_inverse", "fwd", "dstate", "chunk_grads"):
        assert f"falcon_delta_{name}" in text, name


# ---- per-column gates (Falcon-2) ---------------------------------------------------------------------


def column_inputs(rng, T=41, dk=16, dv=32, segments=True, eta_range=(0.1, 1.9), decay_range=(0.0, 0.5)):
    """Per-column η and log γ [B, H, T, dv] that differ per column (independent draws)."""
    q, x, y, _, _, run, s0 = op_inputs(rng, B=1, H=1, T=T, dk=dk, dv=dv, segments=segments)
    eta = rng.uniform(*eta_range, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
    log_gamma = -rng.uniform(*decay_range, size=y.shape)
    return q, x, y, eta, log_gamma, run, s0


def test_per_column_forward_matches_reference(rng):
    """Odd T over three chunks, a segment start inside a chunk, non-zero initial state, dv = 32 in two
    value blocks."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng)
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, config=KernelConfig(column_block_v=16))
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("chunk,block_v", [(16, 16), pytest.param(32, 32, marks=pytest.mark.slow)])
def test_per_column_gradients_match_reference(chunk, block_v, rng):
    """Gradients w.r.t. q, x, y, per-column η and log γ, and S0 against the float64 token scan, with the
    row-by-row solve (``column_solve="rows"``; the blocked default at multi-block chunks: below)."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng)
    config = KernelConfig(column_solve="rows", column_block_v=block_v)
    assert_grads_match(rng, lambda *a: kernel(*a, chunk_size=chunk, config=config), decayed_delta_rule_reference,
                       (q, x, y, eta, log_gamma, s0), run, 5e-5)


def test_per_column_extreme_gates(rng):
    """β = η‖x‖² in (1.99, 1.999) per column with nearly parallel keys; per column, γ at the clamp (1e-6) on
    an independent third of the steps and γ = 1 elsewhere (as the Falcon-1 test; with γ tiny on *every* step
    and β ≈ 2 the transition γI − β uuᵀ has eigenvalue ≈ −2, the state grows like 2^T and the scalar and
    per-column kernels alike lose ~1e-4 to that conditioning)."""
    q, x, y, _, _, run, s0 = column_inputs(rng, T=40, dv=16, segments=False)
    x = x[..., :1, :] + 0.05 * x
    eta = rng.uniform(1.99, 1.999, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
    log_gamma = np.where(rng.uniform(size=y.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
    assert rel_err(o, o_ref) < 1e-4 and rel_err(final, final_ref) < 1e-4


def test_per_column_tiny_decay(rng):
    """γ = 1e-6 on every step in half the columns (cumulative log decay −440 within a chunk of 32), γ = 1 in
    a quarter, random in the rest: only differences g_a − g_b with a ≥ b are exponentiated."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=40, dv=16, segments=False)
    log_gamma[..., :8] = np.log(1e-6)
    log_gamma[..., 8:12] = 0.0
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(final, final_ref) < FP32_TOL


BLOCKED = KernelConfig(column_solve="blocked", column_block_v=16)


@pytest.mark.parametrize("case", ["values", "extreme", "tiny-decay", "no-residual", "gradients",
                                  "no-residual-gradients"])
def test_per_column_blocked_solve_matches_reference(case, rng):
    """``column_solve="blocked"`` (the default; 16-row blocks, dots between blocks with the decays renormalized at each
    block's last row) against the float64 token scan, with chunks of 32 and 64 rows (2 and 4 blocks): odd T,
    a segment start inside a chunk, non-zero initial state; β near 2 with nearly parallel keys and γ at its
    clamp on a third of the steps; γ = 1e-6 on every step in half the columns (cumulative log decay −884 in a
    chunk of 64: every factor is a difference of g within a chunk, ≤ 1); the inner-product rule (no residual);
    gradients of both rules w.r.t. every input at chunks of 32 and 64 (the blocked backward kernel: the
    transposed read and solve and the row-mixing gradients by blocks, the decay gradients elementwise).  Values: within the
    fp32 bound (1e-4 with the tiny decays, where the row-by-row solve loses ~1e-5 too) or 1.5× the row-by-row
    solve's error on the same inputs."""
    if case == "values":
        q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=77)
        tol = FP32_TOL
    elif case == "extreme":
        q, x, y, _, _, run, s0 = column_inputs(rng, T=70, dv=16, segments=False)
        x = x[..., :1, :] + 0.05 * x
        eta = rng.uniform(1.99, 1.999, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
        log_gamma = np.where(rng.uniform(size=y.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
        tol = 1e-4
    else:
        q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=70, dv=16, segments=case != "tiny-decay")
        if case == "tiny-decay":
            log_gamma[..., :8] = np.log(1e-6)
            log_gamma[..., 8:12] = 0.0
        tol = FP32_TOL if case != "tiny-decay" else 1e-4
    op, ref_op = ((attn_column_kernel, attn_column_reference) if case.startswith("no-residual")
                  else (kernel, reference))
    if case == "no-residual":
        for chunk in (32, 64):
            o, final = attn_column_kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=chunk, config=BLOCKED)
            o_ref, final_ref = attn_column_reference(q, x, y, eta, log_gamma, run, s0)
            assert rel_err(o, o_ref) < tol and rel_err(final, final_ref) < tol, chunk
        return
    if not case.endswith("gradients"):  # as exact as the row-by-row solve on the same inputs (tiny decays: ~1e-5 both)
        o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
        for chunk in (32, 64):
            errors = {}
            for config in (BLOCKED, KernelConfig(column_solve="rows", column_block_v=16)):
                o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=chunk, config=config)
                assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
                errors[config.column_solve] = (rel_err(o, o_ref), rel_err(final, final_ref))
            for blocked, rows in zip(errors["blocked"], errors["rows"]):
                assert blocked < max(tol, 1.5 * rows), (chunk, errors)
        return
    ct_o = jnp.asarray(rng.normal(size=y.shape))

    def loss(fn):
        def f(*a):
            o, _ = fn(*a[:5], run, a[5])
            return jnp.sum(o * ct_o.astype(o.dtype))
        return f

    want = jax.grad(loss(ref_op), argnums=tuple(range(6)))(q, x, y, eta, log_gamma, s0)
    for chunk in (32, 64):
        with poisoned_outputs():
            got = jax.grad(loss(lambda *a: op(*a, chunk_size=chunk, config=BLOCKED)), argnums=tuple(range(6)))(
                *(jnp.asarray(a, jnp.float32) for a in (q, x, y, eta, log_gamma, s0)))
        for name, g, w in zip(["q", "x", "y", "eta", "log_gamma", "initial_state"], got, want):
            assert np.all(np.isfinite(np.asarray(g))), (chunk, name)
            assert rel_err(g, w) < 5e-5, (chunk, name)


def per_column_falcon_inputs(rng, options):
    """``falcon`` inputs with per-column gains (β ``[B, T, H, dv]``, B = H = 1, T = 41) and the call's options:
    ``segments`` becomes ``segment_ids`` (starts inside chunks), ``clamp`` puts λ = 1e6 on a third of the steps
    (γ at the clamp).  Returns (q, k, v, beta, lam, options)."""
    q, k, v, _, lam = falcon_inputs(rng, B=1, H=1, T=41)
    beta = jnp.asarray(rng.uniform(0.05, 1.95, size=v.shape), jnp.float32)
    options = dict(options)
    if options.pop("segments", False):
        options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, size=(1, 41)), axis=1))
    if options.pop("clamp", False):
        lam = jnp.where(jnp.asarray(rng.uniform(size=lam.shape) < 0.3), 1e6, lam).astype(jnp.float32)
    return q, k, v, beta, lam, options


@pytest.mark.parametrize("options,check_grads", [
    ({"segments": True}, True),
    pytest.param({"timing": "rbw", "alignment": "same_step", "clamp": True}, True, marks=pytest.mark.slow),
])
def test_falcon2_pallas_equals_xla_chunk_form(options, check_grads, rng):
    """Falcon-2 with per-column gains against the XLA chunk form, continuing from a non-trivial state."""
    q, k, v, beta, lam, options = per_column_falcon_inputs(rng, options)
    kw = dict(variant="2", chunk_size=16, return_final_state=True, **options)
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, check_grads, rng, tol=FP32_TOL, same=())


def test_falcon2_tied_gains_equal_falcon1(rng):
    """Per-column gains that are all equal (the per-column kernel) give Falcon-1 (the scalar kernel)."""
    q, k, v, beta, lam = falcon_inputs(rng, B=1, H=1, T=40)
    beta_col = jnp.broadcast_to(beta[..., None], v.shape)
    with poisoned_outputs():
        got = falcon(q, k, v, beta_col, lam, variant="2", impl="pallas", chunk_size=16)
        want = falcon(q, k, v, beta, lam, variant="1", impl="pallas", chunk_size=16)
    assert rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("dtype,column_solve", [(jnp.bfloat16, "rows"), (jnp.float32, "rows"),
                                                (jnp.bfloat16, "blocked"), (jnp.float32, "blocked")])
def test_per_column_kernel_lowers_for_triton(dtype, column_solve):
    """Cross-lower the per-column forward + backward through the Triton lowering rules on CPU (d = 128,
    chunk 64), with the row-by-row and the blocked forward solve."""
    B, H, T, D = 1, 2, 256, 128
    q = jnp.zeros((B, H, T, D), dtype)
    gate = jnp.zeros((B, H, T, D), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", interpret=False,
                                  config=KernelConfig(column_solve=column_solve))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
        lowering_platforms=("cuda",)).as_text()
    for name in ("col_fwd", "col_bwd"):
        assert f"falcon_delta_{name}" in text, name


# ---- per-column gates without the residual (Falcon-2A) -----------------------------------------------


def attn_column_kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=16, implementation="pallas_gpu", **kw):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    with poisoned_outputs():
        return decayed_attention_per_column(f32(q), f32(x), f32(y), f32(eta), f32(log_gamma), run, f32(s0),
                                            chunk_size=chunk_size, implementation=implementation, **kw)


def attn_column_reference(q, x, y, eta, log_gamma, run, s0):
    return decayed_attention_per_column_reference(*(jnp.asarray(a) for a in (q, x, y, eta, log_gamma)), run,
                                                  jnp.asarray(s0))


def test_attention_per_column_forward_matches_reference(rng):
    """Odd T over three chunks, a segment start inside a chunk, non-zero initial state, dv = 32 in two value
    blocks, per-column η and log γ that differ per column."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng)
    o, final = attn_column_kernel(q, x, y, eta, log_gamma, run, s0, config=KernelConfig(column_block_v=16))
    o_ref, final_ref = attn_column_reference(q, x, y, eta, log_gamma, run, s0)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("chunk,block_v", [(16, 16), pytest.param(32, 32, marks=pytest.mark.slow)])
def test_attention_per_column_gradients_match_reference(chunk, block_v, rng):
    """Gradients w.r.t. q, x, y, per-column η and log γ, and S0 against the float64 token scan, with the
    row-by-row solve (the blocked default: ``test_per_column_blocked_solve_matches_reference``)."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng)
    config = KernelConfig(column_solve="rows", column_block_v=block_v)
    assert_grads_match(rng, lambda *a: attn_column_kernel(*a, chunk_size=chunk, config=config),
                       decayed_attention_per_column_reference, (q, x, y, eta, log_gamma, s0), run, 5e-5)


def test_attention_per_column_extreme_gates(rng):
    """Per column: γ at the clamp (1e-6) on an independent third of the steps and γ = 1 elsewhere; γ = 1e-6 on
    every step in a quarter of the columns (cumulative log decay −440 inside a chunk of 32): only
    differences g_a − g_b with a ≥ b are exponentiated.  Values and gradients."""
    q, x, y, eta, _, run, s0 = column_inputs(rng, T=40, dv=16, segments=False)
    log_gamma = np.where(rng.uniform(size=y.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
    log_gamma[..., :4] = np.log(1e-6)
    o, final = attn_column_kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = attn_column_reference(q, x, y, eta, log_gamma, run, s0)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(final, final_ref) < FP32_TOL
    ct = jnp.asarray(rng.normal(size=y.shape))

    def loss(fn):
        return lambda *a: jnp.sum(fn(q, x, *a, run, s0)[0] * ct.astype(jnp.float32))

    got = jax.grad(loss(lambda *a: attn_column_kernel(*a, chunk_size=32)), argnums=(0, 1, 2))(
        *(jnp.asarray(a, jnp.float32) for a in (y, eta, log_gamma)))
    want = jax.grad(loss(attn_column_reference), argnums=(0, 1, 2))(*(jnp.asarray(a) for a in (y, eta, log_gamma)))
    for name, g, w in zip(["y", "eta", "log_gamma"], got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, w) < 5e-5, name


@pytest.mark.parametrize("options,check_grads", [
    ({"segments": True}, True),
    ({"timing": "rbw", "alignment": "same_step", "clamp": True}, False),
    pytest.param({"timing": "rbw", "segments": True}, True, marks=pytest.mark.slow),
    pytest.param({"alignment": "same_step", "clamp": True}, True, marks=pytest.mark.slow),
])
def test_falcon2a_pallas_equals_xla_chunk_form(options, check_grads, rng):
    """Falcon-2A with per-column gains against the XLA chunk form, continuing from a non-trivial state."""
    q, k, v, beta, lam, options = per_column_falcon_inputs(rng, options)
    kw = dict(variant="2A", chunk_size=16, return_final_state=True, **options)
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, check_grads, rng, tol=FP32_TOL)


def test_falcon2a_tied_gains_equal_falcon1a(rng):
    """Per-column gains that are all equal (the per-column kernel) give Falcon-1A (the decayed-attention
    kernel)."""
    q, k, v, beta, lam = falcon_inputs(rng, B=1, H=1, T=40)
    beta_col = jnp.broadcast_to(beta[..., None], v.shape)
    with poisoned_outputs():
        got = falcon(q, k, v, beta_col, lam, variant="2A", impl="pallas", chunk_size=16)
        want = falcon(q, k, v, beta, lam, variant="1A", impl="pallas", chunk_size=16)
    assert rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("column_solve", ["rows", "blocked"])
def test_attention_per_column_kernel_lowers_for_triton(column_solve):
    """Cross-lower the Falcon-2A per-column forward + backward through the Triton lowering rules on CPU
    (bf16, d = 128, chunk 64), row by row and blocked."""
    B, H, T, D = 1, 1, 128, 128
    q = jnp.zeros((B, H, T, D), jnp.bfloat16)
    gate = jnp.zeros((B, H, T, D), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_attention_per_column(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu",
                                            interpret=False, config=KernelConfig(column_solve=column_solve))
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, q, gate, gate, s0).lower(
        lowering_platforms=("cuda",)).as_text()
    for name in ("col_fwd", "col_bwd"):
        assert f"falcon_attn_{name}" in text, name


# ---- per-column gates on the TPU kernel (pallas_tpu_columns, Falcon-2 and 2A) --------------------------
# TPU interpret mode on CPU against the float64 token scan (interpret mode fills unwritten outputs with NaN); the
# Mosaic TPU lowering rules by cross-lowering.  No TPU here: nothing below compiles or runs the kernels on one.


COLUMN_RULES = {"delta": (kernel, reference, decayed_delta_rule_reference),
                "attention": (attn_column_kernel, attn_column_reference, decayed_attention_per_column_reference)}


def test_per_column_tpu_value_block():
    """Mosaic's block rule: a value block of a multiple of 128 columns dividing dv, or all of dv; the GPU's
    narrower default (32) becomes 128 (or dv)."""
    from falcon_jax.kernels.decayed_delta_rule.pallas_tpu_columns import value_block

    assert [value_block(bv, dv) for bv, dv in [(32, 128), (32, 256), (128, 256), (256, 256), (16, 32), (32, 32),
                                                (64, 64), (512, 256), (128, 384)]] == [128, 128, 128, 256, 32, 32,
                                                                                         64, 256, 128]


@pytest.mark.parametrize("rule", ["delta", "attention"])
def test_per_column_tpu_forward_matches_reference(rule, rng):
    """The TPU kernel (Falcon-2, and Falcon-2A: ``residual=False``): odd T over three chunks of 16, a segment start
    inside a chunk, non-zero initial state, per-column η and log γ that differ per column, dv = 256 in two value
    blocks of 128 (the narrowest TPU block that is not all of dv)."""
    op, ref, _ = COLUMN_RULES[rule]
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=41, dv=256)
    o, final = op(q, x, y, eta, log_gamma, run, s0, implementation="pallas_tpu",
                  config=KernelConfig(column_block_v=128))
    o_ref, final_ref = ref(q, x, y, eta, log_gamma, run, s0)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("rule", ["delta", "attention"])
def test_per_column_tpu_gradients_match_reference(rule, rng):
    """Gradients of the TPU kernel w.r.t. q, x, y, per-column η and log γ, and the initial state (cotangents on o
    and the final state) against the float64 token scan: T = 41 over three chunks, a segment start inside a
    chunk, dv = 256 in two value blocks (dq, dx summed over the blocks' shares)."""
    op, _, ref_op = COLUMN_RULES[rule]
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=41, dv=256)
    assert_grads_match(rng, lambda *a: op(*a, implementation="pallas_tpu", config=KernelConfig(column_block_v=128)),
                       ref_op, (q, x, y, eta, log_gamma, s0), run, FP32_TOL)


@pytest.mark.parametrize("case", ["clamp", pytest.param("tiny-decay", marks=pytest.mark.slow)])
def test_per_column_tpu_extreme_gates(case, rng):
    """The TPU kernel at the gates' extremes, chunks of 32: ``"clamp"`` — β = η‖x‖² in (1.99, 1.999) per column
    with nearly parallel keys and, per column, γ at the clamp (1e-6) on an independent third of the steps, γ = 1
    elsewhere (values within 1e-4 as the GPU kernels', see ``test_per_column_extreme_gates``; gradients w.r.t.
    y, η, log γ within 1e-4); ``"tiny-decay"`` — γ = 1e-6 on every step in half the columns (cumulative log
    decay −440 inside a chunk), γ = 1 in a quarter: only differences g_a − g_b with a ≥ b are exponentiated
    (values and gradients within the fp32 bound)."""
    q, x, y, eta, _, run, s0 = column_inputs(rng, T=40, dv=16, segments=False)
    if case == "clamp":
        x = x[..., :1, :] + 0.05 * x
        eta = rng.uniform(1.99, 1.999, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
        log_gamma = np.where(rng.uniform(size=y.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
        tol = 1e-4
    else:
        log_gamma = -rng.uniform(0.0, 0.5, size=y.shape)
        log_gamma[..., :8] = np.log(1e-6)
        log_gamma[..., 8:12] = 0.0
        tol = FP32_TOL
    o, final = kernel(q, x, y, eta, log_gamma, run, s0, chunk_size=32, implementation="pallas_tpu")
    o_ref, final_ref = reference(q, x, y, eta, log_gamma, run, s0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
    assert rel_err(o, o_ref) < tol and rel_err(final, final_ref) < tol
    ct = jnp.asarray(rng.normal(size=y.shape))

    def loss(fn):
        return lambda *a: jnp.sum(fn(q, x, *a, run, s0)[0] * ct.astype(jnp.float32))

    got = jax.grad(loss(lambda *a: kernel(*a, chunk_size=32, implementation="pallas_tpu")), argnums=(0, 1, 2))(
        *(jnp.asarray(a, jnp.float32) for a in (y, eta, log_gamma)))
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(*(jnp.asarray(a) for a in (y, eta, log_gamma)))
    for name, g, w in zip(["y", "eta", "log_gamma"], got, want):
        assert np.all(np.isfinite(np.asarray(g))), name
        assert rel_err(g, w) < tol, name


@pytest.mark.parametrize("rule,dtype,dv", [("delta", jnp.bfloat16, 128), ("delta", jnp.float32, 256),
                                           ("attention", jnp.bfloat16, 128), ("attention", jnp.float32, 256)])
def test_per_column_tpu_kernels_lower_for_mosaic(rule, dtype, dv):
    """Cross-lower the TPU per-column forward + backward through the Mosaic TPU lowering rules on CPU (d = 128,
    chunk 64; dv = 256: two value blocks of 128).  Catches ops without a Mosaic lowering rule and blocks that
    break Mosaic's block rule; Mosaic's own compilation (layouts, VMEM) needs a TPU and is not checked."""
    B, H, T, D = 1, 2, 256, 128
    q = jnp.zeros((B, H, T, D), dtype)
    y = jnp.zeros((B, H, T, dv), dtype)
    gate = jnp.zeros((B, H, T, dv), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, dv), jnp.float32)
    op = decayed_delta_rule if rule == "delta" else decayed_attention_per_column

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = op(q, x, y, eta, log_gamma, run, s0, implementation="pallas_tpu", interpret=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, q, y, gate, gate, s0).lower(
        lowering_platforms=("tpu",)).as_text()
    prefix = "falcon_delta" if rule == "delta" else "falcon_attn"
    for name in ("col_fwd_tpu", "col_bwd_tpu"):
        assert f"{prefix}_{name}" in text, name
    assert "tpu_custom_call" in text


def test_per_column_tpu_refuses_unsupported_shapes(rng):
    """The per-column ops on ``pallas_tpu`` refuse what the kernels do not take, naming the argument."""
    q, x, y, eta, log_gamma, run, s0 = column_inputs(rng, T=16, dv=16, segments=False)
    for op in (decayed_delta_rule, decayed_attention_per_column):
        with pytest.raises(NotImplementedError, match="pallas_tpu .*chunk_size=8"):
            op(*(jnp.asarray(a, jnp.float32) for a in (q, x, y, eta, log_gamma)), run, jnp.asarray(s0, jnp.float32),
               chunk_size=8, implementation="pallas_tpu")


def test_per_column_gains_served_on_a_tpu_backend(monkeypatch):
    """``chunk_pallas.supports`` serves per-column gains on a TPU backend (the TPU kernel); windowed rules with
    per-column gains are still refused."""
    from falcon_jax.forms import chunk_pallas
    from falcon_jax.rules import falcon_rule

    monkeypatch.setattr(chunk_pallas.jax, "default_backend", lambda: "tpu")
    gains = {"beta": jnp.zeros((1, 1, 8, 16))}
    for variant in ("2", "2A"):
        assert chunk_pallas.supports(falcon_rule(variant), gains, 16, 16, jnp.float32) is None, variant
    assert "windowed" in chunk_pallas.supports(falcon_rule("3", window=4), gains, 16, 16, jnp.float32)


@pytest.mark.parametrize("variant,options", [
    ("2", {"segments": True}), ("2A", {"segments": True}),
    pytest.param("2", {"timing": "rbw", "alignment": "same_step", "clamp": True}, marks=pytest.mark.slow),
    pytest.param("2A", {"timing": "rbw", "alignment": "same_step", "clamp": True}, marks=pytest.mark.slow),
])
def test_falcon2_on_the_tpu_kernel_equals_xla_chunk_form(variant, options, rng, monkeypatch):
    """``falcon(variant="2" / "2A", impl="pallas")`` with per-column gains through the TPU kernel (what a TPU
    backend picks; here in TPU interpret mode) against the XLA chunk form, continuing from a non-trivial state:
    outputs, state, gradients."""
    from falcon_jax.forms import chunk_pallas

    monkeypatch.setattr(chunk_pallas, "_implementation", lambda: "pallas_tpu")
    q, k, v, beta, lam, options = per_column_falcon_inputs(rng, options)
    kw = dict(variant=variant, chunk_size=16, return_final_state=True, **options)
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, True, rng, tol=FP32_TOL,
                                         same=() if variant == "2" else ("last_key",))


# ---- windowed form (Falcon-3) ------------------------------------------------------------------------


def window_inputs(rng, W, T=37, H=1, dk=16, dv=16, segments=True, beta_range=(0.1, 1.9)):
    """Window pairs x, y ``[B, H, T+W-1, d]`` (the W−1 older pairs in front), weights ``w [B, H, T, W]`` with
    ``λmax(Σ_i w_{t,i} x_{t+i} x_{t+i}ᵀ) = β_t`` (the rank-W write's top eigenvalue, stable for β < 2)."""
    q, _, _, _, log_gamma, run, s0 = op_inputs(rng, H=H, T=T, dk=dk, dv=dv, segments=segments)
    x = rng.normal(size=(1, H, T + W - 1, dk)) / np.sqrt(dk)
    y = rng.normal(size=(1, H, T + W - 1, dv))
    x_win = np.stack([x[:, :, i:i + T] for i in range(W)], axis=3)
    lam_max = np.linalg.eigvalsh(np.einsum("bhtik,bhtjk->bhtij", x_win, x_win))[..., -1]  # = λmax(XᵀX)
    beta = rng.uniform(*beta_range, size=(1, H, T))
    w = np.broadcast_to((beta / lam_max)[..., None], (1, H, T, W)).copy()
    w *= rng.uniform(0.5, 1.0, size=w.shape)  # unequal slot weights (still stable)
    return q, x, y, w, log_gamma, run, s0


def window_kernel(q, x, y, w, log_gamma, run, s0, implementation="pallas_gpu", chunk_size=16, **kw):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    with poisoned_outputs():
        return windowed_delta_rule(f32(q), f32(x), f32(y), f32(w), f32(log_gamma), run, f32(s0),
                                   chunk_size=chunk_size, implementation=implementation, **kw)


def window_reference(q, x, y, w, log_gamma, run, s0):
    return windowed_delta_rule_reference(*(jnp.asarray(a) for a in (q, x, y, w, log_gamma)), run, jnp.asarray(s0))


@pytest.mark.parametrize("W,T,chunk,pieces,implementation", [
    (2, 37, 16, 1, "pallas_gpu"), (3, 29, 16, 1, "pallas_gpu"), (4, 45, 32, 2, "pallas_gpu"),
    (4, 1, 16, 1, "pallas_gpu"), (4, 21, 16, 1, "pallas_tpu"),
])
def test_windowed_forward_matches_reference(W, T, chunk, pieces, implementation, rng):
    """Odd T, segment starts inside chunks, non-zero initial state; W = 3 pads each step to 4 rows."""
    args = window_inputs(rng, W, T=T)
    kw = {} if implementation == "pallas_tpu" else {"pieces": pieces}
    o, final = window_kernel(*args, chunk_size=chunk, implementation=implementation, **kw)
    o_ref, final_ref = window_reference(*args)
    assert o.shape == o_ref.shape and final.shape == final_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


@pytest.mark.parametrize("W,pieces,implementation,chunk_grads", [
    (2, 1, "pallas_gpu", "pallas"), (4, 2, "pallas_gpu", "pallas"), (4, 1, "pallas_gpu", "xla"),
    (4, 1, "pallas_gpu", "pallas_split"), (3, 2, "pallas_gpu", "pallas_stored"),
    pytest.param(3, 1, "pallas_gpu", "pallas", marks=pytest.mark.slow),
    pytest.param(4, 1, "pallas_tpu", "pallas", marks=pytest.mark.slow),
])
def test_windowed_gradients_match_reference(W, pieces, implementation, chunk_grads, rng):
    """Gradients w.r.t. q, the window pairs x and y (each pair recurs in W steps' rows), the per-slot weights,
    log γ and S0; segments inside chunks; dv = 32 in two value blocks."""
    q, x, y, w, log_gamma, run, s0 = window_inputs(rng, W, T=29, dv=32)
    kw = {} if implementation == "pallas_tpu" else {"pieces": pieces}
    config = KernelConfig(block_v=16, chunk_grads=chunk_grads)
    assert_grads_match(rng, lambda *a: window_kernel(*a, config=config, implementation=implementation, **kw),
                       windowed_delta_rule_reference, (q, x, y, w, log_gamma, s0), run, 5e-5,
                       out_shape=(*q.shape[:3], 32), names=("q", "x", "y", "w", "log_gamma", "initial_state"))


def test_windowed_extreme_gates(rng):
    """The rank-W write's top eigenvalue β = 1.999 with nearly parallel keys (the transition's eigenvalue
    along them ≈ −0.999, the triangular inverse alternates in sign), γ at the clamp (1e-6) on a third of
    the steps and γ = 1 elsewhere."""
    W, T = 4, 40
    q, x, y, _, _, run, s0 = window_inputs(rng, W, T=T, segments=False)
    x = x[..., :1, :] + 0.05 * x
    x_win = np.stack([x[:, :, i:i + T] for i in range(W)], axis=3)
    lam_max = np.linalg.eigvalsh(np.einsum("bhtik,bhtjk->bhtij", x_win, x_win))[..., -1]
    w = np.broadcast_to((1.999 / lam_max)[..., None], (*lam_max.shape, W))
    log_gamma = np.where(rng.uniform(size=lam_max.shape) < 0.33, np.log1p(-(1 - 1e-6)), 0.0)
    o, final = window_kernel(q, x, y, w, log_gamma, run, s0, chunk_size=32)
    o_ref, final_ref = window_reference(q, x, y, w, log_gamma, run, s0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(final)))
    assert rel_err(o, o_ref) < 1e-4 and rel_err(final, final_ref) < 1e-4


def test_windowed_single_live_slot_equals_delta_rule(rng):
    """W = 2 with slot 0's weights zero: every step writes only its current pair, i.e. Falcon-1's op (the
    2-row step groups, their group-strict system and the per-step gates, against the plain kernel)."""
    q, x, y, w, log_gamma, run, s0 = window_inputs(rng, 2, T=37)
    w[..., 0] = 0.0
    got = window_kernel(q, x, y, w, log_gamma, run, s0)
    want = kernel(q, x[:, :, 1:], y[:, :, 1:], w[..., 1], log_gamma, run, s0)
    assert rel_err(got[0], want[0]) < FP32_TOL and rel_err(got[1], want[1]) < FP32_TOL


@pytest.mark.parametrize("window,options,check_grads", [
    (2, {}, False),
    (4, {"timing": "rbw", "segments": True}, True),
    (4, {"alignment": "same_step", "extreme": True}, False),
    pytest.param(2, {"timing": "rbw", "alignment": "same_step", "extreme": True, "segments": True}, True,
                 marks=pytest.mark.slow),
    pytest.param(3, {"scale_coupled": True, "segments": True}, True, marks=pytest.mark.slow),
])
def test_falcon3_pallas_equals_xla_chunk_form(window, options, check_grads, rng):
    """Falcon-3 against the XLA chunk form, continuing from a state saved 9 steps in (its window tail feeds the
    first W−1 windows), odd T; ``extreme``: β = 1.99 and λ = 1e6 on a third of the steps (γ at its clamp)."""
    q, k, v, beta, lam = falcon_inputs(rng, B=1, H=1, T=33)
    options = dict(options)
    if options.pop("segments", False):
        options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, size=(1, 33)), axis=1))
    if options.pop("extreme", False):
        beta = jnp.full_like(beta, 1.99)
        lam = jnp.where(jnp.asarray(rng.uniform(size=lam.shape) < 0.3), 1e6, lam).astype(jnp.float32)
    kw = dict(variant="3", window=window, chunk_size=16, return_final_state=True, **options)
    assert_pallas_matches_xla_chunk_form(q, k, v, beta, lam, kw, check_grads, rng, tol=FP32_TOL,
                                         same=("tail_x", "tail_y", "tail_valid", "last_key"))


def test_falcon3_window1_equals_falcon1(rng):
    """Falcon-3 with a window of one pair is Falcon-1 (λmax of one pair = ‖x‖²)."""
    q, k, v, beta, lam = falcon_inputs(rng, B=1, H=1, T=40)
    with poisoned_outputs():
        got = falcon(q, k, v, beta, lam, variant="3", window=1, impl="pallas", chunk_size=16)
        want = falcon(q, k, v, beta, lam, variant="1", impl="pallas", chunk_size=16)
    assert rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("implementation,platform,dtype,pieces", [
    ("pallas_gpu", "cuda", jnp.bfloat16, 2), ("pallas_gpu", "cuda", jnp.float32, 1),
    ("pallas_tpu", "tpu", jnp.bfloat16, 1),
])
def test_windowed_kernel_lowers_for_the_accelerator(implementation, platform, dtype, pieces):
    """Cross-lower the windowed forward + backward (W = 4, d = 128, chunk 64 rows = 16 steps) on CPU."""
    B, H, T, D, W = 1, 2, 256, 128, 4
    q = jnp.zeros((B, H, T, D), dtype)
    xy = jnp.zeros((B, H, T + W - 1, D), dtype)
    w = jnp.zeros((B, H, T, W), jnp.float32)
    gate = jnp.zeros((B, H, T), jnp.float32)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, x, y, w, log_gamma, s0):
        kw = {} if implementation == "pallas_tpu" else {"pieces": pieces}
        o, s = windowed_delta_rule(q, x, y, w, log_gamma, run, s0, implementation=implementation, interpret=False,
                                   config=KernelConfig(chunk_grads="pallas"), **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(q, xy, xy, w, gate, s0).lower(
        lowering_platforms=(platform,)).as_text()
    for name in ("tri_inverse", "fwd", "dstate", "chunk_grads"):
        assert f"falcon_delta_{name}" in text, name
