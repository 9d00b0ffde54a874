"""``python -m benchmarks.run --suite bench --smoke`` and ``--suite lm --smoke`` on the CPU (tiny shapes, the Triton
kernels in interpret mode, no peers): the whole entry point runs as a subprocess, and the JSON it writes holds
every row with finite times and the metadata a result needs.  The lm suite's split of device time by named scope
(``benchmarks/trace_scopes.py``, which imports nothing heavy) is also checked on a hand-written program and trace
in the GPU profiler's layout."""

import datetime
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("falcon-1A", "falcon-3A", "falcon-1", "falcon-3", "falcon-2", "falcon-2A", "linear-attention", "deltanet",
        "gated-deltanet")
SLOW = ("falcon-2", "falcon-2A")  # at the first shape only
PEERS = ("jla:simple_gla", "jla:gated_deltanet", "jla:deltanet", "fla:chunk_simple_gla",
         "fla:chunk_gated_delta_rule", "fla:chunk_delta_rule", "cudnn:softmax")
SHAPES = ("1x128x2x16", "2x64x2x16")


@pytest.mark.slow  # ~3 minutes on a 2-core machine: 16 interpret-mode programs, forward and forward+backward
def test_bench_smoke_writes_every_row_and_the_metadata(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "bench", "--smoke", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench.json").read_text())

    assert (data["suite"], data["smoke"], tuple(data["shapes"])) == ("bench", True, SHAPES)
    datetime.datetime.fromisoformat(data["date"])
    assert "median" in data["timing"]["jax"] and "do_bench" in data["timing"]["torch"]
    assert data["dtype"] == {"q, k, v": "bfloat16", "beta, lam, log decay": "float32"}
    env = data["environment"]
    assert env["backend"] == "cpu" and env["device"] and "driver" in env
    assert env["versions"]["jax"] == jax.__version__ and "jaxlib" in env["versions"]
    tree = data["trees"]["measured"]
    assert Path(tree["path"]) == ROOT and re.fullmatch(r"[0-9a-f]{12}", tree["source_sha1"])
    assert tree["commit"] is None or re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", tree["commit"])
    # the worker imported a copy of this tree's falcon_jax in the installed layout, not some other install
    assert env["falcon_jax"].endswith("falcon_jax/__init__.py") and "falcon-bench-" in env["falcon_jax"]

    assert data["steps"] and all(step["status"] == "ok" for step in data["steps"]), data["steps"]
    measured = {(r["op"], r["shape"]): r for r in data["rows"] if "fwd_ms" in r}
    want = {(op, shape) for shape in SHAPES for op in OURS if shape == SHAPES[0] or op not in SLOW}
    assert set(measured) == want
    for (op, _), row in measured.items():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms")), row
        assert row["impl"] == "triton", row  # every rule and baseline through its kernels, interpreted
    skipped = {(r["op"], r["shape"]): r["notes"]["skipped"] for r in data["rows"] if "skipped" in r.get("notes", {})}
    assert skipped == {(op, shape): "no peers in --smoke" for op in PEERS for shape in SHAPES}

    log = (tmp_path / "bench.log").read_text()
    assert "fwd+bwd ms" in log and all(op in log for op in OURS)


def test_lm_smoke_times_the_train_step_and_splits_it_by_scope(tmp_path):
    from falcon_jax.nn import LMConfig, expected_param_count

    mixers = ("falcon-1A.3", "transformer")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "lm", "--smoke", "--mixers",
                           ",".join(mixers), "--lengths", "64", "--jobs", "2", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "lm.json").read_text())

    assert (data["suite"], data["smoke"], data["shapes"], tuple(data["mixers"])) == ("lm", True, ["2x64"], mixers)
    assert data["packed"] is False and data["dtype"] == {"compute": "bfloat16", "parameters": "float32"}
    assert "median" in data["timing"] and "make_train_step" in data["step"] and "peak_bytes_in_use" in data["memory"]
    env = data["environment"]
    assert env["backend"] == "cpu" and env["versions"]["jax"] == jax.__version__
    assert env["falcon_jax"].endswith("falcon_jax/__init__.py") and "falcon-bench-" in env["falcon_jax"]
    tree = data["trees"]["measured"]
    assert Path(tree["path"]) == ROOT and re.fullmatch(r"[0-9a-f]{12}", tree["source_sha1"])
    assert [s["status"] for s in data["steps"]] == ["ok", "ok"], data["steps"]

    rows = {r["mixer"]: r for r in data["rows"]}
    assert set(rows) == set(mixers)
    for mixer, row in rows.items():
        assert (row["shape"], row["batch"], row["length"], row["tokens_per_step"]) == ("2x64", 2, 64, 128), row
        assert row["notes"] == {} and row["kernels"] == "xla", row  # the CPU: XLA serves every mixer
        assert row["compiled_alongside"] == 1, row  # --jobs 2: compiled together
        cfg = LMConfig.preset(f"{mixer}-tiny", dtype="bfloat16", param_dtype="float32")
        assert row["params"] == expected_param_count(cfg)["total"], row
        # random tokens and a fresh model: the first losses sit near ln(vocabulary)
        assert abs(row["loss"] - math.log(cfg.vocab_size)) < 0.5, row
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("step_ms", "compile_s", "lower_s", "device_ms"))
        assert row["tokens_per_s"] == pytest.approx(128 / (row["step_ms"] / 1e3), rel=1e-9)
        assert row["step_ms"] == pytest.approx(statistics.median(row["step_ms_samples"]), abs=1e-3)
        assert row["peak_bytes"] is None  # the CPU keeps no allocator statistics
        # the mixer and its core are real parts of the step, and nearly every device event is attributed
        assert 0 < row["core_share"] < row["mixer_share"] < 1, row
        assert row["unattributed_share"] < 0.05, row

    log = (tmp_path / "lm.log").read_text()
    assert "tokens/s" in log and "x falcon-1A.3" in log and all(m in log for m in mixers)


# a compiled program's HLO text, as ``compiled.as_text()`` prints it, reduced to what the attribution reads
HLO = """HloModule jit_step, entry_computation_layout={()->()}

%fused_core (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %sin.1 = f32[4]{0} sine(%param_0), metadata={op_name="jit(step)/transpose(jvp(mixer))/core/sin" stack_frame_id=3}
  ROOT %mul.1 = f32[4]{0} multiply(%sin.1, %param_0), metadata={op_name="jit(step)/transpose(jvp(mixer))/core/mul"}
}

%fused_mlp (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  %add.2 = f32[4]{0} add(%param_0.1, %param_0.1), metadata={op_name="jit(step)/jvp(mlp)/add"}
  ROOT %convert.2 = f32[4]{0} convert(%add.2), metadata={stack_frame_id=7}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %proj = f32[4]{0} custom-call(%p), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp(mixer)/dot_general"}
  %kernel = f32[4]{0} custom-call(%proj), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jvp(mixer)/core/pallas_call"}
  %attn = f32[4]{0} fusion(%kernel), kind=kCustom, calls=%fused_core, backend_config={"kind":"__cudnn$fusion"}
  %loop_fusion = f32[4]{0} fusion(%kernel), kind=kLoop, calls=%fused_core, metadata={stack_frame_id=3}
  %copy.3 = f32[4]{0} copy(%kernel)
  %mlp_fusion = f32[4]{0} fusion(%copy.3), kind=kLoop, calls=%fused_mlp
  %both = f32[4]{0} add(%loop_fusion, %mlp_fusion)
  %scope_lookalike = f32[4]{0} negate(%both), metadata={op_name="jit(step)/token_mixer/core_x/neg"}
  ROOT %head = f32[4]{0} multiply(%scope_lookalike, %p), metadata={op_name="jit(step)/mixer_head/mul"}
}
"""


def _gpu_trace():
    """Events in the layout ``jax.profiler`` writes on a GPU: kernels on a device process's ``Stream`` lines,
    the same work again on the lines derived from them, and host-side events naming HLO ops."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 5, "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "Stream #8(MemcpyD2D)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Ops"}}]
    kernels = [("proj", 7, 10.0), ("kernel", 7, 20.0), ("attn", 7, 40.0), ("loop_fusion", 7, 80.0),
               ("copy.3", 8, 160.0), ("mlp_fusion", 7, 320.0), ("both", 7, 640.0), ("scope_lookalike", 7, 1280.0),
               ("head", 7, 2560.0), ("command_buffer", 7, 5120.0)]
    events = [{"ph": "X", "pid": 2, "tid": tid, "name": f"kernel_{op}", "ts": 0, "dur": dur,
               "args": {"hlo_op": op, "hlo_module": "jit_step"}} for op, tid, dur in kernels]
    events.append({"ph": "X", "pid": 2, "tid": 7, "name": "sm90_gemm", "ts": 0, "dur": 10240.0,
                   "args": {"hlo_op": "gone.1", "tf_op": "jit(step)/jvp(mixer)/core/dot_general"}})
    derived = [dict(e, tid=9) for e in events]  # "XLA Ops": a second view of the same time
    host = [{"ph": "X", "pid": 1, "tid": 5, "name": "ThunkExecute", "ts": 0, "dur": 1e6, "args": {"hlo_op": "proj"}}]
    return meta + events + derived + host


def test_trace_scopes_attributes_device_time_through_op_names():
    from benchmarks import trace_scopes as ts

    names = ts.op_names(HLO)
    assert names["attn"] == names["loop_fusion"] == "jit(step)/transpose(jvp(mixer))/core/mul"  # the root's
    assert names["mlp_fusion"] == "jit(step)/jvp(mlp)/add"  # the called computation's only named instruction
    assert names["copy.3"] == "jit(step)/jvp(mixer)/core/pallas_call"  # its operand's
    assert names["both"] == "jit(step)"  # operands in the mixer and the MLP: only what they share
    assert "p" not in names and "param_0" not in names

    assert ts.in_scope("jit(step)/transpose(jvp(mixer))/core/mul", "mixer/core")
    assert ts.in_scope("jit(step)/while/body/jvp(mixer)/x", "mixer")
    assert not ts.in_scope("jit(step)/token_mixer/core_x/neg", "mixer")
    assert not ts.in_scope("jit(step)/mixer/conv/core", "mixer/core")
    assert not ts.in_scope("jit(step)/mixer_head/mul", "mixer")

    assert ts.kernel_families(HLO, "mixer/core") == ["cudnn", "triton"]  # the cuBLAS projection is outside core
    assert ts.kernel_families(HLO, "mlp") == []

    split = ts.scope_times(_gpu_trace(), names, ("mixer", "mixer/core", "mlp"))
    core = 20.0 + 40.0 + 80.0 + 160.0 + 10240.0  # kernel, attn, loop_fusion, copy.3, and the tf_op event
    assert split["by_scope_us"] == {"mixer": 10.0 + core, "mixer/core": core, "mlp": 320.0}
    assert split["unattributed_us"] == 5120.0  # the command buffer names no instruction of the program
    assert split["total_us"] == sum([10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 5120.0, 10240.0])
    assert split["events"] == 11  # the Stream lines only: not the derived "XLA Ops" line, not the host


def test_trace_scopes_reads_the_cpu_layout():
    from benchmarks import trace_scopes as ts

    # no device process: XLA's CPU thunks on host threads, each naming its instruction; "end:" markers do not
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 1, "tid": 3, "name": "kernel", "dur": 3.0, "args": {"hlo_op": "kernel"}},
              {"ph": "X", "pid": 1, "tid": 3, "name": "end: kernel", "dur": 1.0, "args": {}},
              {"ph": "X", "pid": 1, "tid": 4, "name": "head", "dur": 5.0, "args": {"hlo_op": "head"}},
              {"ph": "X", "pid": 1, "tid": 4, "name": "$python", "dur": 100.0}]
    split = ts.scope_times(events, ts.op_names(HLO), ("mixer", "mixer/core"), host=True)
    assert split == {"total_us": 8.0, "unattributed_us": 0.0, "events": 2,
                     "by_scope_us": {"mixer": 3.0, "mixer/core": 3.0}}
    # on a GPU the same trace means the profiler saw no device: host-side events do not stand in for them
    assert ts.scope_times(events, ts.op_names(HLO), ("mixer",))["events"] == 0
