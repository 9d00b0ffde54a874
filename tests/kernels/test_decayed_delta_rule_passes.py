"""The passes of ``decayed_delta_rule`` one at a time, and their lowerings.

* the triangular inverse ``T = (I + A)⁻¹`` of every chunk (Triton and Mosaic TPU) and the piece maps
  ``S_end = M S_start + E`` against float64, in interpret mode;
* cross-lowered for CUDA on a CPU (Triton's lowering rules; compiling needs a GPU): every pass of the forward and
  backward in both token layouts and dtypes, which outputs are written over which operands (dx over P, dy over dR,
  dR over V, dh over the q-term) and that nothing of ``[B, T, H, d]`` is transposed around the kernels; and for
  a TPU (Mosaic TPU's rules).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.common import poisoned_outputs
from falcon_jax.kernels.decayed_delta_rule import KernelConfig, decayed_delta_rule, mosaic_tpu
from falcon_jax.kernels.decayed_delta_rule.op import _gates
from falcon_jax.kernels.decayed_delta_rule.reference import decayed_delta_rule_reference
from falcon_jax.kernels.decayed_delta_rule.triton import forward, state_grads
from falcon_jax.kernels.decayed_delta_rule.triton.triangular_inverse import tri_inverse_pass
from tests.kernels.helpers import (FP32_TOL, S, assert_matches, custom_call_lines, delta_inputs, lowered_text,
                                   nearly_parallel, on_backend, operand_aliases)


def inverse_reference(x, eta, g, gp, rl, chunk, group=1):
    """float64 ``[B·H, L, C]``: row cC + s holds row s of chunk c's ``(I + A)⁻¹``, ``A[s, j] = η_s (x_s·x_j)
    e^{g⁻_s − g_j}`` for j in an earlier group of ``group`` rows than s (group 1: j < s), in the same segment."""
    BH, L, _ = x.shape
    n = L // chunk
    rows = lambda a: np.asarray(a, np.float64).reshape(BH, n, chunk)  # noqa: E731
    eta, g, gp, rl = rows(eta), rows(g), rows(gp), rows(rl)
    xc = np.asarray(x, np.float64).reshape(BH, n, chunk, -1)
    step = np.arange(chunk) // group
    keep = (step[:, None] > step[None, :]) & (rl[..., :, None] == rl[..., None, :])
    A = eta[..., :, None] * np.einsum("bnsk,bnjk->bnsj", xc, xc) * np.exp(np.where(keep, gp[..., :, None]
                                                                                   - g[..., None, :], -np.inf))
    return np.linalg.inv(np.eye(chunk) + A).reshape(BH, L, chunk)


def inverse_inputs(rng, extreme, group, BH=2, T=192, d=32, C=64):
    """Keys, η and the chunk-local gates of a triangular inverse; ``extreme``: nearly parallel keys with
    η‖x‖² = 1.999 and a third of the decays at the clamp (T's entries reach ~1e5)."""
    x = rng.normal(size=(BH, T, d))
    if extreme:
        x = nearly_parallel(x)
    eta = (1.999 if extreme else rng.uniform(0.1, 1.9, size=(BH, T))) / np.sum(x * x, axis=-1)
    steps = T // group
    log_gamma = (np.where(rng.uniform(size=(BH, steps)) < 0.33, np.log(1e-6), 0.0) if extreme
                 else -rng.uniform(0.0, 0.2, size=(BH, steps)))
    run = np.cumsum(rng.uniform(size=(BH, steps)) < 0.05, axis=1)
    g, gp, rl = _gates(jnp.asarray(log_gamma, jnp.float32), jnp.asarray(run, jnp.int32), C, group)
    return jnp.asarray(x, jnp.float32), jnp.asarray(eta, jnp.float32), g, gp, rl


@pytest.mark.parametrize("group,extreme", [(1, True), (2, False), pytest.param(1, False, marks=pytest.mark.slow)])
def test_triton_triangular_inverse_matches_float64(rng, group, extreme):
    """Chunks of 64 (four 16-row diagonal blocks and the blocks below them), segment starts inside chunks,
    poisoned outputs; ``group = 2``: rows couple only to earlier groups (a window's virtual writes).  Extreme
    gates stay exact to fp32 rounding: no powers of A are formed."""
    x, eta, g, gp, rl = inverse_inputs(rng, extreme, group)
    with poisoned_outputs():
        tinv = jax.jit(lambda *a: tri_inverse_pass(*a, chunk=64, interpret=True, group=group))(x, eta, g, gp, rl)
    want = inverse_reference(x, eta, g, gp, rl, 64, group)
    assert not extreme or np.max(np.abs(want)) > 1e3  # the case is as hard as it says
    assert_matches(tinv, want, 1e-5, "T")


@pytest.mark.parametrize("group", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_mosaic_tpu_triangular_inverse_matches_float64(rng, group):
    """The TPU's row-by-row substitution over whole ``[C, C]`` tiles, in TPU interpret mode (unwritten memory
    NaN), with extreme gates."""
    x, eta, g, gp, rl = inverse_inputs(rng, True, group, T=128)
    tinv = jax.jit(lambda *a: mosaic_tpu.tri_inverse_pass(*a, chunk=64, interpret=True, group=group))(x, eta, g, gp,
                                                                                                       rl)
    assert_matches(tinv, inverse_reference(x, eta, g, gp, rl, 64, group), 1e-5, "T")


@pytest.mark.parametrize("pieces,block_v,segments,dtype", [
    (4, 16, False, jnp.float32), pytest.param(4, 16, True, jnp.float32, marks=pytest.mark.slow),
    pytest.param(2, 32, False, jnp.bfloat16, marks=pytest.mark.slow)])
def test_piece_maps_match_float64(rng, pieces, block_v, segments, dtype):
    """Every piece's ``S_end = M S_start + E`` from ``prepare_wu``'s W, U: against float64 scans of that piece
    alone, ``M`` from ``S_start = I`` with zero values, ``E`` from ``S_start = 0`` (a segment start inside the
    piece makes M zero: its run index counts from the token before); dk = dv = 32, two map and two value blocks
    of 16 columns; poisoned outputs.  bf16: inputs and the walk's dots in bf16, against the scans of the
    bf16-rounded inputs."""
    T, chunk, dk, dv, BH = 128, 16, 32, 32, 2
    # slow decay, small steps: a piece's transition stays far from zero (M's entries up to ~1)
    q, x, y, eta, log_gamma, run, _ = delta_inputs(rng, T=T, dk=dk, dv=dv, segments=segments,
                                                   eta_range=(0.05, 0.3), decay_range=(0.0, 0.01))
    x, y = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float64)) for a in (x, y))  # what the kernels read
    flat = lambda a: jnp.asarray(a).reshape(BH, T, *np.shape(a)[3:])  # noqa: E731
    g, gp, rl = _gates(flat(np.asarray(log_gamma, np.float32)), flat(np.asarray(run)), chunk)
    xk, yk, ek = flat(x).astype(dtype), flat(y).astype(dtype), flat(np.asarray(eta, np.float32))
    lo = jnp.bfloat16 if dtype == jnp.bfloat16 else None

    def maps(xk, yk, ek, g, gp, rl):
        tinv = tri_inverse_pass(xk, ek, g, gp, rl, chunk=chunk, interpret=True)
        w, u = forward.prepare_wu(xk, yk, ek, g, gp, rl, tinv, chunk=chunk, interpret=True, w_dtype=lo or jnp.float32)
        return forward.piece_maps(xk, w, u, g, rl, chunk=chunk, pieces=pieces, block_v=block_v, interpret=True,
                                  walk_operands=lo)

    with poisoned_outputs():
        M, E = jax.jit(maps)(xk, yk, ek, g, gp, rl)
    assert M.shape == (BH, pieces, dk, dk) and E.shape == (BH, pieces, dk, dv)
    Lp, run = T // pieces, np.asarray(run)
    tol = 1e-2 if dtype == jnp.bfloat16 else FP32_TOL
    for p in range(pieces):
        sl = slice(p * Lp, (p + 1) * Lp)
        before = run[..., p * Lp - 1:p * Lp] if p else np.zeros_like(run[..., :1])
        xp, etap, lgp = (jnp.asarray(a[:, :, sl], jnp.float64) for a in (x, eta, log_gamma))
        r = jnp.asarray(run[:, :, sl] - before, jnp.int32)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float64), (1, BH, dk, dk))
        _, m_ref = decayed_delta_rule_reference(xp, xp, jnp.zeros((1, BH, Lp, dk)), etap, lgp, r, eye)
        _, e_ref = decayed_delta_rule_reference(xp, xp, jnp.asarray(y[:, :, sl]), etap, lgp, r,
                                                jnp.zeros((1, BH, dk, dv)))
        assert segments or np.max(np.abs(np.asarray(m_ref))) > 0.5  # M is a real transition
        assert_matches(M[:, p], m_ref.reshape(BH, dk, dk), tol, f"M of piece {p}")
        assert_matches(E[:, p], e_ref.reshape(BH, dk, dv), tol, f"E of piece {p}")


def test_passes_refuse_what_they_cannot_walk():
    x = S((1, 64, 16), jnp.float32)
    u = S((1, 64, 64), jnp.float32)
    g = S((1, 64), jnp.float32)
    rl = S((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="piece_maps: block_v=32 must divide dk=16"):
        jax.eval_shape(lambda *a: forward.piece_maps(*a, chunk=16, pieces=2, block_v=32, interpret=True),
                       x, x, u, g, rl)
    tinv = S((1, 64, 16), jnp.float32)
    s0 = S((1, 2, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="key_shift .* walks one piece, got pieces=2"):
        jax.eval_shape(lambda *a: forward.forward_pass(*a, chunk=16, pieces=2, block_v=16, write_o=True,
                                                       write_h=False, interpret=True, key_shift=True),
                       x, x, u, g, g, g, rl, tinv, s0)
    q_term = S((1, 4, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="a prepared q-term needs one piece, write_dh"):
        jax.eval_shape(lambda *a: state_grads.state_grad_walk(*a[:9], chunk=16, pieces=2, block_v=16, write_dh=True,
                                                              interpret=True, prepared=(a[2], a[9])),
                       x, x, u, g, g, g, rl, tinv, u, s0, q_term)


# ---- cross-lowered for CUDA and for a TPU ---------------------------------------------------------------------

def lowered(monkeypatch, *, dtype=jnp.bfloat16, layout="BTHD", config=None, dk=128, dv=128, B=1, T=256, H=2,
            shifted=True, pieces=None, implementation="triton"):
    """StableHLO text of the forward + backward of a Falcon-1 call of the op (keys one row back), lowered for
    ``implementation``'s accelerator on this CPU."""
    platform = "tpu" if implementation == "mosaic_tpu" else "gpu"
    on_backend(monkeypatch, platform)
    tok = (lambda d: (B, T, H, d)) if layout == "BTHD" else (lambda d: (B, H, T, d))
    gate = S(tok(1)[:3], jnp.float32)
    run = jnp.zeros(gate.shape, jnp.int32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation=implementation, layout=layout,
                                  config=config, pieces=pieces, shifted_keys=shifted)
        assert o.shape == y.shape and o.dtype == dtype
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    specs = [S(tok(dk), dtype), S(tok(dk), dtype), S(tok(dv), dtype), gate, gate, S((B, H, dk, dv), jnp.float32)]
    return lowered_text(jax.grad(loss, argnums=tuple(range(6))), specs,
                        platform="tpu" if platform == "tpu" else "cuda")


def kernel_counts(text, names, prefix="falcon_delta_"):
    return {name: len(custom_call_lines(text, prefix + name)) for name in names}


FUSED = KernelConfig(fill_programs=1, pieces_below=1)
PASSES = ("tri_inverse", "masked_scores", "fwd", "prepare_wu", "piece_maps", "state_walk", "outputs",
          "dstate_prepare", "dstate_walk", "chunk_grads")


@pytest.mark.parametrize("config,pieces,want", [
    (FUSED, None, dict(tri_inverse=2, masked_scores=1, fwd=2, dstate_prepare=1, dstate_walk=1, chunk_grads=1)),
    (KernelConfig(), 2, dict(tri_inverse=2, fwd=1, prepare_wu=1, piece_maps=1, state_walk=1, outputs=1,
                             dstate_prepare=1, dstate_walk=2, chunk_grads=1)),
], ids=["one-piece-fused", "pieces-split"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_triton_lowering_reads_the_model_layout_in_place(monkeypatch, config, pieces, want, dtype):
    """Every pass of the forward and backward lowers through Triton's rules at d = 128, chunk 64: one piece
    with the fused walk (its scores from their own kernel), and pieces with the split forward (the piece maps,
    the pieces' own reverse walks from zero then from their true end states).  The tokens are read and written in
    ``[B, T, H, d]`` (no transpose of them) and the gates go through the transpose kernel and back."""
    text = lowered(monkeypatch, dtype=dtype, config=config, pieces=pieces)
    assert kernel_counts(text, PASSES) == {name: want.get(name, 0) for name in PASSES}
    assert kernel_counts(text, ("gate_transpose", "gate_transpose_back"), prefix="") == {
        "gate_transpose": 3, "gate_transpose_back": 2}  # η, log γ, run; the gradients of η and log γ
    transposed = [line for line in text.splitlines() if "stablehlo.transpose" in line
                  and any(f"tensor<1x{a}x{b}x" in line for a, b in ((256, 2), (2, 256)))]
    assert not transposed, transposed[:2]


def aliases_of(text, name):
    (line,) = custom_call_lines(text, f"falcon_delta_{name}")
    return operand_aliases(line)


@pytest.mark.parametrize("layout", ["BTHD", "BHTD"])
@pytest.mark.parametrize("dk,config,chunk_grads,dstate_walk", [
    (128, FUSED, {(0, 11), (2, 10)}, {(0, 6)}),  # dy over dR, dx over P; dR over V
    (64, FUSED, {(0, 11)}, {(0, 6)}),  # dk ≠ dv: P is not shaped like dx
    (128, KernelConfig(fill_programs=1, pieces_below=1, q_term_in_prepare_from=1), {(0, 11), (2, 10)},
     {(0, 6), (1, 10)}),  # and dh over the q-term prepare formed
    (128, KernelConfig(fill_programs=1, pieces_below=1, stored_dr="fp32"), {(2, 10)}, set()),  # fp32 dR, bf16 V
    (128, KernelConfig(fill_programs=1, pieces_below=1, walk_operands="fp32"), set(), {(0, 6)}),  # fp32 P, V, dR
])
def test_backward_writes_over_the_buffers_it_stored(monkeypatch, layout, dk, config, chunk_grads, dstate_walk):
    """bf16, dv = 128: the chunk gradients write dy over dR (operand 11) and dx over P (operand 10) where
    shapes and dtypes agree, the reverse walk writes dR over V (operand 6) and, reading prepare's q-term
    (operand 10), dh over it: the backward's peak holds no separate gradient buffers.  In either layout."""
    text = lowered(monkeypatch, layout=layout, config=config, dk=dk)
    assert aliases_of(text, "chunk_grads") == chunk_grads
    assert aliases_of(text, "dstate_walk") == dstate_walk


def test_mosaic_tpu_lowering(monkeypatch):
    """Forward + backward through the Mosaic TPU lowering rules (bf16, d = 128, chunk 64, keys shifted in XLA
    and the model's layout transposed): every TPU pass; compiling for a TPU needs one."""
    text = lowered(monkeypatch, implementation="mosaic_tpu")
    for name in ("tri_inverse_tpu", "fwd_tpu", "dstate_tpu", "chunk_grads_tpu"):
        assert f"falcon_delta_{name}" in text, name
    assert "tpu_custom_call" in text
