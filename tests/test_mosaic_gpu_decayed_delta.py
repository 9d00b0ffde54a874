"""The Mosaic GPU (Hopper wgmma + TMA) ``dstate_prepare`` of ``decayed_delta_rule``, without a GPU.

Its values are checked on the H200 only (``benchmarks/gpu_check_mosaic_prepare.py``: V and the q-term against a
float64 reference and against the Triton pass, which the interpret-mode tests cover): jax 0.10.2's CPU
interpreter of Mosaic GPU has no transposed wgmma operands.  Here: what it refuses, that it cross-lowers for
CUDA with the Triton pass's output shapes, and which pass the op's backward takes under each
``KernelConfig.prepare``.
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import pytest

from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule, mosaic_gpu
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig
from tests.helpers import mosaic_lowering_available

needs_lowering = pytest.mark.skipif(not mosaic_lowering_available(),
                                    reason="this jax cannot lower Mosaic GPU kernels for CUDA on CPU")
BF = jnp.bfloat16
S = jax.ShapeDtypeStruct
C = 64


def _prepare_args(B, L, H, d, dtype=BF, t_dtype=None, in_place=True):
    """Zero q, x, η, g, gp, rl, T, dO for ``prepare_vb`` (``[B, L, H, d]`` tokens, or head-major)."""
    tokens = jnp.zeros((B, L, H, d) if in_place else (B * H, L, d), dtype)
    rows = jnp.zeros((B * H, L), jnp.float32)
    return (tokens, tokens, rows, rows, rows, jnp.zeros((B * H, L), jnp.int32),
            jnp.zeros((B * H, L, C), t_dtype or dtype), tokens)


PREPARE_KW = dict(chunk=C, heads=2, v_dtype=BF, q_term_dtype=BF, key_shift=True, with_b=False, walk_operands=BF)


def test_prepare_config_is_validated():
    for value in ("auto", "triton", "mosaic"):
        assert KernelConfig(prepare=value).prepare == value
    with pytest.raises(ValueError, match="prepare must be 'auto' or 'triton' or 'mosaic'"):
        KernelConfig(prepare="wgmma")


def test_auto_takes_the_triton_pass_off_hopper():
    assert not mosaic_gpu.on_hopper()  # CI and this machine: CPU


@pytest.mark.parametrize("platform,capability,version,want", [
    ("gpu", "9.0", "0.11.2", True),
    ("gpu", "9.0", "0.12.0.dev20270101", True),
    ("gpu", "9.0", "0.10.2", False),  # lowers there, never ran there
    ("gpu", "8.0", "0.11.2", False),  # A100: no wgmma
    ("gpu", "10.0", "0.11.2", False),  # Blackwell: not checked
    ("tpu", "", "0.11.2", False),
])
def test_on_hopper_needs_sm90_and_the_checked_jax(monkeypatch, platform, capability, version, want):
    device = types.SimpleNamespace(platform=platform, compute_capability=capability)
    monkeypatch.setattr(mosaic_gpu.jax, "devices", lambda: [device])
    monkeypatch.setattr(mosaic_gpu.jax, "__version__", version)
    assert mosaic_gpu.on_hopper() is want


@pytest.mark.parametrize("change,match", [
    (dict(interpret=True), "Hopper GPU only"),
    (dict(chunk=32), "chunk_size=32"),
    (dict(with_b=True), "B = Tᵀ"),
    (dict(walk_operands=None), "walk's operands in fp32"),
    (dict(v_dtype=jnp.float32), "V stored in float32"),
    (dict(q_term_dtype=jnp.float32), "q-term stored in float32"),
])
def test_prepare_refuses_calls_it_does_not_serve(change, match):
    kw = dict(PREPARE_KW, **change)
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        mosaic_gpu.prepare_vb(*_prepare_args(1, 128, 2, 64), **kw)


@pytest.mark.parametrize("d,dtype,t_dtype,match", [
    (64, jnp.float32, None, "bf16 or fp16 only"),
    (32, BF, None, "dk=32"),
    (256, BF, None, "dk=256"),
    (64, BF, jnp.float32, "T stored in float32"),
])
def test_prepare_refuses_dtypes_and_widths(d, dtype, t_dtype, match):
    """Inputs of another dtype or width (V, the q-term and the walk operands in the inputs' dtype, as the op
    passes them), or T in fp32."""
    kw = dict(PREPARE_KW, v_dtype=dtype, q_term_dtype=dtype, walk_operands=dtype)
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        mosaic_gpu.prepare_vb(*_prepare_args(1, 128, 2, d, dtype=dtype, t_dtype=t_dtype), **kw)


def _result_types(text):
    """``[(shape, dtype), ...]`` of the lowered Mosaic GPU custom call's results."""
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    results = line.rsplit("->", 1)[1]
    return [(tuple(int(n) for n in m.group(1).split("x")), m.group(2))
            for m in re.finditer(r"tensor<([\dx]+)x(bf16|f16|f32)>", results)]


@needs_lowering
@pytest.mark.parametrize("B,L,H,d,key_shift,q_term,in_place", [
    (2, 256, 4, 128, True, True, True),  # Falcon-1's call: keys one row back, in place, the q-term
    (2, 256, 4, 128, True, False, True),
    (1, 64, 2, 64, False, True, True),  # one chunk, d64
    (3, 320, 1, 128, True, True, False),  # head-major, odd number of chunks
])
def test_prepare_lowers_with_the_triton_pass_shapes(B, L, H, d, key_shift, q_term, in_place):
    args = _prepare_args(B, L, H, d, in_place=in_place)
    kw = dict(PREPARE_KW, heads=H if in_place else None, key_shift=key_shift, q_term_dtype=BF if q_term else None)

    def fn(*a):
        return mosaic_gpu.prepare_vb(*a, **kw)

    text = jax.jit(fn).trace(*(S(a.shape, a.dtype) for a in args)).lower(lowering_platforms=("cuda",)).as_text()
    want = [(args[-1].shape, "bf16")] + ([((B * H, L // C, d, d), "bf16")] if q_term else [])
    assert _result_types(text) == want


def _lowered_falcon1_grads(config, dtype, B=2, T=256, H=2, D=128):
    """StableHLO text of the forward + backward of Falcon-1's kernel call (keys one row back, read in place from
    ``[B, T, H, D]``), cross-lowered for CUDA with ``config``."""
    gate = jnp.zeros((B, T, H), jnp.float32)
    run = jnp.zeros((B, T, H), jnp.int32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="pallas_gpu", layout="BTHD",
                                  interpret=False, config=config, shifted_keys=True)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    tokens = S((B, T, H, D), dtype)
    return jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(
        tokens, tokens, tokens, S(gate.shape, gate.dtype), S(gate.shape, gate.dtype),
        S((B, H, D, D), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
def test_op_backward_takes_the_configured_prepare():
    """The lowered forward + backward of Falcon-1's call (keys one row back, in place): ``prepare="mosaic"``
    replaces the Triton ``dstate_prepare`` with the Mosaic GPU kernel for bf16 and keeps the Triton one for fp32
    (its fallback); "triton" and, off a Hopper GPU, "auto" keep the Triton one."""
    def passes(text):
        return (text.count('name = "falcon_delta_dstate_prepare"'), text.count("falcon_delta_dstate_prepare_mgpu") > 0)

    assert passes(_lowered_falcon1_grads(KernelConfig(prepare="mosaic"), BF)) == (0, True)
    assert passes(_lowered_falcon1_grads(KernelConfig(prepare="mosaic"), jnp.float32)) == (1, False)
    assert passes(_lowered_falcon1_grads(KernelConfig(prepare="triton"), BF)) == (1, False)
    assert passes(_lowered_falcon1_grads(KernelConfig(), BF)) == (1, False)  # "auto", and this is no Hopper GPU


@pytest.mark.parametrize("key_shift,in_place", [(True, True), (False, False)])
def test_gpu_check_reference_matches_the_triton_pass(key_shift, in_place):
    """The float64 reference that ``benchmarks/gpu_check_mosaic_prepare.py`` holds the Mosaic pass to agrees
    with the Triton pass in interpret mode (to bf16 rounding), segment starts inside chunks included."""
    import numpy as np

    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_prepare import as_head_major, make_case, reference
    from falcon_jax.kernels.decayed_delta_rule import pallas_gpu

    B, L, H, d = 2, 192, 2, 64
    q, k, do, g, rl, tinv = make_case(np.random.default_rng(1), B, L, H, d, segments=True)
    assert float(jnp.mean((rl > 0).astype(jnp.float32))) > 0.2  # several segments per chunk
    V, qt = reference(q, k, do, g, rl, tinv, key_shift=key_shift)
    args = (q, k, do) if in_place else tuple(as_head_major(a) for a in (q, k, do))
    v, _, q_term = pallas_gpu.prepare_vb(args[0], args[1], g, g, g, rl, tinv, args[2], chunk=C,
                                         heads=H if in_place else None, v_dtype=BF, q_term_dtype=BF,
                                         key_shift=key_shift, with_b=False, walk_operands=BF, interpret=True)
    v = np.asarray(v.astype(jnp.float32))
    if in_place:
        v = np.swapaxes(v, 1, 2).reshape(B * H, L, d)
    assert rel_err(v, V) < 8e-3 and rel_err(q_term, qt) < 8e-3
    # and the reference is not trivially satisfied: without the key shift it disagrees
    V_other, _ = reference(q, k, do, g, rl, tinv, key_shift=not key_shift)
    assert rel_err(v, V_other) > 0.1


# the Mosaic GPU stored chunk gradients (mosaic_gpu.chunk_grad_stored_pass; opt-in, chunk_grads_kernel="mosaic")

def _grad_args(B, L, H, dk, dv, dtype=BF, state_dtype=None, p_dtype=None, dr_dtype=None, in_place=True):
    """Zero q, x, y, η, g, g⁻, rl, dO, h, dh, P, dR as the op's backward passes them."""
    def tokens(d, dt=dtype):
        return jnp.zeros((B, L, H, d) if in_place else (B * H, L, d), dt)
    rows = jnp.zeros((B * H, L), jnp.float32)
    state = jnp.zeros((B * H, L // C, dk, dv), state_dtype or dtype)
    return (tokens(dk), tokens(dk), tokens(dv), rows, rows, rows, jnp.zeros((B * H, L), jnp.int32), tokens(dv),
            state, state, tokens(dv, p_dtype or dtype), tokens(dv, dr_dtype or dtype))


GRAD_KW = dict(chunk=C, heads=2, walk_operands=BF, key_shift=True, group=1)


def test_chunk_grads_kernel_config_is_validated():
    assert KernelConfig().chunk_grads_kernel == "triton"  # the Mosaic pass is slower on the H200 (next81)
    for value in ("auto", "triton", "mosaic"):
        assert KernelConfig(chunk_grads_kernel=value).chunk_grads_kernel == value
    with pytest.raises(ValueError, match="chunk_grads_kernel must be 'auto' or 'triton' or 'mosaic'"):
        KernelConfig(chunk_grads_kernel="wgmma")


@pytest.mark.parametrize("args_change,kw_change,match", [
    ({}, dict(interpret=True), "Hopper GPU only"),
    ({}, dict(chunk=32), "chunk_size=32"),
    ({}, dict(group=4), "group=4"),
    ({}, dict(walk_operands=None), "walk's operands in fp32"),
    (dict(dtype=jnp.float32), dict(walk_operands=jnp.float32), "bf16 or fp16 only"),
    (dict(dk=32), {}, "dk=32"),
    (dict(dv=256), {}, "dv=256"),
    (dict(state_dtype=jnp.float32), {}, "the chunk states stored in float32"),
    (dict(p_dtype=jnp.float32), {}, "P stored in float32"),
    (dict(dr_dtype=jnp.float32), {}, "dR stored in float32"),  # KernelConfig(stored_dr="fp32")
])
def test_chunk_grads_refuse_calls_they_do_not_serve(args_change, kw_change, match):
    args = _grad_args(**dict(dict(B=1, L=128, H=2, dk=64, dv=64), **args_change))
    with pytest.raises(NotImplementedError, match=re.escape(match)):
        mosaic_gpu.chunk_grad_stored_pass(*args, **dict(GRAD_KW, **kw_change))


def _aliases(text):
    """{output index: operand index} of the lowered Mosaic GPU custom call's ``output_operand_aliases``."""
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    return {int(out): int(arg) for out, arg in re.findall(
        r"output_operand_alias<output_tuple_indices = \[(\d+)\],\s*operand_index = (\d+)", line)}


@needs_lowering
@pytest.mark.parametrize("B,L,H,dk,dv,key_shift,in_place", [
    (2, 256, 4, 128, 128, True, True),  # Falcon-1's call: keys one row back, in place
    (1, 64, 2, 64, 64, False, True),  # one chunk, d64
    (1, 192, 2, 64, 128, True, True),  # dk != dv: dx is not written over P
    (3, 320, 1, 128, 128, True, False),  # head-major, odd number of chunks
])
def test_chunk_grads_lower_with_the_triton_pass_shapes_and_aliases(B, L, H, dk, dv, key_shift, in_place):
    """The kernel's results: dy over dR (operand 5 of the kernel), dq, dx (over P, operand 4, where shapes
    match), then dη, dg, dg⁻ and the last-row term, each ``[B·H, L]`` fp32; the pass returns the Triton
    pass's shapes."""
    args = _grad_args(B, L, H, dk, dv, in_place=in_place)
    kw = dict(GRAD_KW, heads=H if in_place else None, key_shift=key_shift)

    def fn(*a):
        return mosaic_gpu.chunk_grad_stored_pass(*a, **kw)

    specs = [S(a.shape, a.dtype) for a in args]
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    q, y = args[0], args[2]
    vec = ((B * H, L), "f32")
    assert _result_types(text) == [(y.shape, "bf16"), (q.shape, "bf16"), (q.shape, "bf16"), vec, vec, vec, vec]
    assert _aliases(text) == ({0: 5, 2: 4} if dk == dv else {0: 5})
    out = jax.eval_shape(fn, *specs)
    assert [o.shape for o in out] == [q.shape, q.shape, y.shape, (B * H, L), (B * H, L), (B * H, L)]


@needs_lowering
def test_op_backward_takes_the_configured_chunk_grads():
    """``chunk_grads_kernel="mosaic"`` replaces the Triton stored chunk gradients in Falcon-1's lowered backward
    for bf16 and keeps them for fp32 (the fallback) or fp32 dR; the default keeps them."""
    def passes(text):
        return (text.count('name = "falcon_delta_chunk_grads_stored"'), "falcon_delta_chunk_grads_mgpu" in text)

    assert passes(_lowered_falcon1_grads(KernelConfig(chunk_grads_kernel="mosaic"), BF)) == (0, True)
    assert passes(_lowered_falcon1_grads(KernelConfig(chunk_grads_kernel="mosaic"), jnp.float32)) == (1, False)
    assert passes(_lowered_falcon1_grads(KernelConfig(chunk_grads_kernel="mosaic", stored_dr="fp32"), BF)) == (1, False)
    assert passes(_lowered_falcon1_grads(KernelConfig(), BF)) == (1, False)


@pytest.mark.parametrize("key_shift,in_place,dk,dv", [(True, True, 128, 64), (False, False, 64, 64)])
def test_chunk_grads_gpu_check_reference_matches_the_triton_pass(key_shift, in_place, dk, dv):
    """The float64 reference of ``benchmarks/gpu_check_mosaic_chunk_grads.py`` agrees with the Triton stored
    chunk gradients in interpret mode (dq, dx, dy to bf16 rounding; the fp32 gate gradients to 1e-5), segment
    starts inside chunks included; and it tells the key shift apart."""
    import numpy as np

    from benchmarks.common import rel_err
    from benchmarks.gpu_check_mosaic_chunk_grads import head_major64, make_case, reference
    from falcon_jax.kernels.decayed_delta_rule import pallas_gpu

    H = 2
    heads = H if in_place else None
    args = make_case(np.random.default_rng(1), 1, 128, H, dk, dv, segments=True, in_place=in_place)
    want = reference(args, heads=heads, key_shift=key_shift)
    got = pallas_gpu.chunk_grad_stored_pass(*args, chunk=C, interpret=True, group=1, heads=heads, walk_operands=BF,
                                            key_shift=key_shift, block_v=64, num_warps=4, num_stages=3, block_k=32,
                                            loops="fori")
    got = [head_major64(a, heads) if a.ndim == (4 if in_place else 3) else np.asarray(a, np.float64) for a in got]
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    assert max(errs[:3]) < 8e-3 and max(errs[3:]) < 1e-5, errs
    other = reference(args, heads=heads, key_shift=not key_shift)
    assert rel_err(got[1], other[1]) > 0.1  # dx


@needs_lowering
def test_chunk_grads_lower_through_pallas_call_without_mpmd_map(monkeypatch):
    """jax without ``mpmd_map`` (``common.mosaic_gpu_call``'s other path, ``pallas_call`` on GMEM operands) lowers
    the same results and aliases."""
    from falcon_jax.kernels import common

    monkeypatch.setattr(common, "_mpmd_map", lambda: None)
    args = _grad_args(1, 128, 2, 64, 64)

    def fn(*a):
        return mosaic_gpu.chunk_grad_stored_pass(*a, **GRAD_KW)

    text = jax.jit(fn).trace(*(S(a.shape, a.dtype) for a in args)).lower(lowering_platforms=("cuda",)).as_text()
    assert "falcon_delta_chunk_grads_mgpu" in text
    assert _aliases(text) == {0: 5, 2: 4}
    assert len(_result_types(text)) == 7
