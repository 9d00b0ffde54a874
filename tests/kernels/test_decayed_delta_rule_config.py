"""``decayed_delta_rule``'s ``KernelConfig``: its validation, the rules that turn it into one call's choices
(value-block widths, fused or split forward, where the masked scores come from, pipelining stages, pieces,
storage dtypes), the tuned table per device kind and dtype, and that the op launches what they say (read from
the Triton custom calls cross-lowered for CUDA)."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import pytest

from falcon_jax.kernels.decayed_delta_rule import KernelConfig, decayed_delta_rule, tuned
from falcon_jax.kernels.decayed_delta_rule.api import keys_read_in_place
from falcon_jax.kernels.decayed_delta_rule.tuned import TUNED, device_key, tuned_config
from tests.kernels.helpers import S, custom_call_lines, lowered_text, on_backend

BF, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("kwargs,match", [
    ({"walk_operands": "bf16"}, "walk_operands must be 'input' or 'fp32'"),
    ({"tri_dtype": BF}, "tri_dtype must be 'input' or 'fp32'"),
    ({"stored_dr": "float32"}, "stored_dr must be 'input' or 'fp32'"),
    ({"block_v": 48}, "block_v must be a power of two >= 16"), ({"block_v": 8}, "block_v must be a power of two"),
    ({"split_block_v": 24}, "split_block_v must be a power of two"),
    ({"grad_block_v": 8}, "grad_block_v must be a power of two"),
    ({"grad_block_k": 32.0}, "grad_block_k must be a power of two"),
    ({"grad_block_v": None}, "grad_block_v must be a power of two"),
    ({"grad_block_k": None}, "grad_block_k must be a power of two"),
    ({"tri_warps": 3}, "tri_warps must be 1, 2, 4, 8 or 16"), ({"grad_warps": 32}, "grad_warps must be 1, 2, 4"),
    ({"prepare_warps": 0}, "prepare_warps must be"), ({"fwd_warps": None}, "fwd_warps must be"),
])
def test_kernel_config_refuses_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=f"KernelConfig: {match}"):
        KernelConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"fwd_stages": 0}, r"fwd_stages must be an int >= 1 \(or None\)"), ({"state_stages": -1}, "state_stages must be"),
    ({"grad_stages": 2.5}, "grad_stages must be an int >= 1"), ({"mosaic_walk_stages": 0}, "mosaic_walk_stages"),
    ({"narrow_output_walk_stages": None}, "narrow_output_walk_stages must be an int >= 1"),
    ({"pieces_below": None}, "pieces_below must be an int >= 0"), ({"fill_programs": -1}, "fill_programs must be"),
    ({"wide_walk_programs": 1.5}, r"wide_walk_programs must be an int >= 0 \(or None\)"),
    ({"q_term_in_prepare_from": True}, "q_term_in_prepare_from must be"),
])
def test_kernel_config_refuses_bad_stages_and_program_counts(kwargs, match):
    """Pipelining stages (ints >= 1) and program-count thresholds (ints >= 0) are checked where the config is
    made, not left to a Triton launch or a comparison deep inside a call; a threshold of 0 and the None
    fields stay valid."""
    with pytest.raises(ValueError, match=f"KernelConfig: {match}"):
        KernelConfig(**kwargs)
    KernelConfig(few_output_programs=0, fill_programs=0, fwd_stages=None, wide_walk_programs=None)


def test_precision_rules():
    """16-bit inputs round the walks' operands, T and dR to their dtype under "input"; fp32 inputs and "fp32"
    keep fp32; V is stored like the walks' operands for one row per step, fp32 for a window's rows."""
    cfg = KernelConfig()
    assert (cfg.walk_dtype(BF), cfg.walk_dtype(jnp.float16), cfg.walk_dtype(F32)) == (BF, jnp.float16, None)
    assert KernelConfig(walk_operands="fp32").walk_dtype(BF) is None
    assert (cfg.tri_store_dtype(BF), cfg.tri_store_dtype(F32), KernelConfig(tri_dtype="fp32").tri_store_dtype(BF)) \
        == (BF, F32, F32)
    assert (cfg.stored_dr_dtype(BF), cfg.stored_dr_dtype(F32), KernelConfig(stored_dr="fp32").stored_dr_dtype(BF),
            KernelConfig(walk_operands="fp32").stored_dr_dtype(BF)) == (BF, F32, F32, F32)
    assert (KernelConfig.stored_v_dtype(BF, 1), KernelConfig.stored_v_dtype(None, 1),
            KernelConfig.stored_v_dtype(BF, 4)) == (BF, F32, F32)


def test_value_block_widths_follow_the_program_count():
    """The fused walks: 64 columns for 16-bit tiles (dk ≤ 128) when that gives 256 to 264 programs, else 32,
    or 16 when 32 gives fewer than 128; never wider than dv; a set width is kept (capped at dv).  The split
    walks: the widest ≤ 64 that still gives 128 programs, at least 16."""
    cfg = KernelConfig()
    assert [cfg.block_v_for(bh, 128, BF, 128) for bh in (128, 132, 133, 127, 32, 31, 16)] == [64, 64, 32, 32, 32,
                                                                                               16, 16]
    assert [cfg.block_v_for(128, 128, dt, dk) for dt, dk in ((F32, 128), (BF, 256))] == [32, 32]
    assert dataclasses.replace(cfg, wide_walk_programs=None).block_v_for(128, 128, BF, 128) == 32
    assert (cfg.block_v_for(4, 32, BF, 16), cfg.block_v_for(4, 16, BF, 16), cfg.block_v_for(200, 32, BF, 16)) \
        == (16, 16, 32)
    assert KernelConfig(block_v=64).block_v_for(2, 32, BF, 16) == 32
    assert [cfg.split_block_v_for(bh, 128) for bh in (128, 64, 32, 16, 1)] == [64, 64, 32, 16, 16]
    assert cfg.split_block_v_for(128, 32) == 32 and KernelConfig(split_block_v=128).split_block_v_for(4, 64) == 64


def test_program_count_rules():
    """The forward is split below 128 programs; the output walk reads the masked scores from their own kernel up
    to 264 programs; it pipelines 2 stages above that, the narrow tiles' count below it, else 3 (a set
    ``fwd_stages`` wins); pieces until 64 programs walk, at most half the chunks each."""
    cfg = KernelConfig()
    assert [cfg.split_forward(bh, 128, 32) for bh in (31, 32, 64)] == [True, False, False]
    assert cfg.split_forward(1, 16, 32)  # a block wider than dv counts once
    assert [cfg.scores_kernel(n) for n in (1, 264, 265)] == [True, True, False]
    assert [cfg.output_walk_stages(n, narrow) for n, narrow in ((128, False), (128, True), (265, True))] == [3, 3, 2]
    assert dataclasses.replace(cfg, narrow_output_walk_stages=4).output_walk_stages(264, True) == 4
    assert KernelConfig(fwd_stages=1).output_walk_stages(512, True) == 1
    assert (cfg.walk_stages(), KernelConfig(fwd_stages=5).walk_stages()) == (3, 5)
    assert [cfg.pieces(bh, nv, n) for bh, nv, n in ((1, 8, 512), (64, 1, 512), (1, 1, 4), (1, 1, 1), (2, 4, 64))] \
        == [8, 1, 2, 1, 8]


def test_keys_read_in_place_only_where_every_gpu_pass_can():
    """One piece and the fused forward on a GPU implementation; the op shifts a copy of the keys for pieces, the
    split forward and the TPU kernels."""
    cfg = KernelConfig(block_v=32)
    assert keys_read_in_place(cfg, "triton", 64, 64, 1) and keys_read_in_place(cfg, "mosaic_gpu", 64, 64, 1)
    assert not keys_read_in_place(cfg, "triton", 64, 64, 2)
    assert not keys_read_in_place(cfg, "triton", 8, 64, 1)  # 16 programs: the split forward
    assert not keys_read_in_place(cfg, "mosaic_tpu", 64, 64, 1)


# ---- the tuned table ----------------------------------------------------------------------------------------

def gpu(capability):
    return types.SimpleNamespace(platform="gpu", compute_capability=capability)


@pytest.mark.parametrize("platform,capability,want", [
    ("gpu", "9.0", "sm90"), ("gpu", "10.0", "sm100"), ("gpu", "8.0", "gpu"), ("gpu", "12.0", "gpu"),
    ("tpu", None, "tpu"), ("cpu", None, "gpu")])
def test_device_key_names_the_row(monkeypatch, platform, capability, want):
    device = types.SimpleNamespace(platform=platform, compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda: [device])
    assert device_key() == want
    assert device_key(device) == want


def test_device_key_of_another_gpu_takes_the_generic_row(monkeypatch):
    first, second = gpu("9.0"), gpu("9.0")
    monkeypatch.setattr(jax, "devices", lambda: [first, second])
    assert (device_key(first), device_key(second)) == ("sm90", "gpu")


def test_tuned_rows_per_dtype(monkeypatch):
    """16-bit inputs take the H200's bf16 values (the dataclass defaults), fp32 the row with 64-column chunk
    gradients and no 64-column walks; the sm90 and sm100 rows add the 4-stage narrow output walk."""
    cpu = types.SimpleNamespace(platform="cpu")
    monkeypatch.setattr(jax, "devices", lambda: [cpu])  # a CPU takes the generic GPU row
    assert set(TUNED) == {"gpu", "sm90", "sm100", "tpu"}
    assert tuned_config(BF) is tuned_config(jnp.float16) is TUNED["gpu"]["16-bit"] == KernelConfig()
    assert tuned_config(F32) == KernelConfig(grad_block_v=64, wide_walk_programs=None)
    for key in ("sm90", "sm100"):
        assert TUNED[key]["16-bit"] == KernelConfig(narrow_output_walk_stages=4)
        assert TUNED[key]["fp32"] == TUNED["gpu"]["fp32"]
    h200 = gpu("9.0")
    monkeypatch.setattr(jax, "devices", lambda: [h200])
    assert tuned_config(BF) is TUNED["sm90"]["16-bit"] and tuned_config(F32) is TUNED["sm90"]["fp32"]
    assert tuned_config(BF, device=types.SimpleNamespace(platform="tpu")) is TUNED["tpu"]["16-bit"]


# ---- what the op launches -------------------------------------------------------------------------------------

def launches(text, name):
    """``[(grid, num_warps, num_stages)]`` of the lowered Triton calls of kernel ``name``."""
    out = []
    for line in custom_call_lines(text, f"falcon_delta_{name}"):
        grid = tuple(int(re.search(rf"grid_{a} = (\d+)", line).group(1)) for a in "xyz")
        out.append((grid, int(re.search(r"num_warps = (\d+)", line).group(1)),
                    int(re.search(r"num_stages = (\d+)", line).group(1))))
    return out


def lowered_forward(monkeypatch, B, H, dtype=BF, config=None, T=256, D=128):
    on_backend(monkeypatch, "gpu")
    run = jnp.zeros((B, T, H), jnp.int32)

    def fwd(q, x, y, eta, log_gamma, s0):
        return decayed_delta_rule(q, x, y, eta, log_gamma, run, s0, implementation="triton", layout="BTHD",
                                  config=config)

    tok, gate = S((B, T, H, D), dtype), S((B, T, H), jnp.float32)
    return lowered_text(fwd, [tok, tok, tok, gate, gate, S((B, H, D, D), jnp.float32)])


@pytest.mark.parametrize("row,stages", [(None, 3), (9, 4)])
def test_op_launches_the_tuned_row_of_the_device(monkeypatch, row, stages):
    """bf16, 16 heads of d = 128: 16 value columns per program (128 programs: the fused walk, its scores from
    their own kernel), whose narrow tiles pipeline 3 stages on the generic row and 4 on an H100 / H200's."""
    monkeypatch.setattr(tuned, "default_gpu_major", lambda: row)
    text = lowered_forward(monkeypatch, B=1, H=16)
    assert launches(text, "fwd") == [((16, 1, 8), 4, stages)]
    assert len(launches(text, "masked_scores")) == 1 and not launches(text, "state_walk")


@pytest.mark.parametrize("B,walk,scores", [
    (8, ((128, 1, 2), 4, 3), 1),  # 256 programs of 64 columns: the scores kernel, 3 stages for wide tiles
    (16, ((256, 1, 4), 4, 2), 0),  # 1024 programs of 32: the walk forms its scores, 2 stages
])
def test_op_launches_the_fused_walk_the_rules_say(monkeypatch, B, walk, scores):
    """bf16, 16 heads of d = 128, ``B`` sequences: the tuned rules' width, scores and stages reach the walk."""
    text = lowered_forward(monkeypatch, B=B, H=16)
    assert launches(text, "fwd") == [walk]
    assert len(launches(text, "masked_scores")) == scores


def test_op_launches_the_split_forward_below_fill_programs(monkeypatch):
    """32-column walks for 16 batch·heads are 64 programs: the forward is split, its walks with ``fwd_warps``."""
    text = lowered_forward(monkeypatch, B=1, H=16, config=KernelConfig(block_v=32, fwd_warps=8))
    assert not launches(text, "fwd") and not launches(text, "masked_scores")
    (state_walk,) = launches(text, "state_walk")
    assert state_walk[1] == 8 and len(launches(text, "prepare_wu")) == len(launches(text, "outputs")) == 1
