"""``python -m benchmarks.run --suite bench --smoke`` and ``--suite lm --smoke`` on the CPU (tiny shapes, the Triton
kernels in interpret mode, no peers): the whole entry point runs as a subprocess, and the JSON it writes holds
every row with finite times and the metadata a result needs.  The lm suite's split of device time by named scope
(``benchmarks/trace_scopes.py``, which imports nothing heavy) is also checked on hand-written programs and traces
in the GPU profiler's layouts: launches that name their instruction, kernels inside a CUDA graph (found by kernel
name), annotations carrying only the op_name, other programs' kernels; its printed table on hand-written rows; which
executable its measurement runs when; and its deadlines under ``--budget``, with stand-in workers."""

import datetime
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("falcon-1A", "falcon-3A", "falcon-1", "falcon-3", "falcon-3-xla", "falcon-2", "falcon-2A", "linear-attention",
        "deltanet", "gated-deltanet")
SLOW = ("falcon-3-xla", "falcon-2", "falcon-2A")  # at the first shape only
PEERS = ("jla:simple_gla", "jla:gated_deltanet", "jla:deltanet", "fla:chunk_simple_gla",
         "fla:chunk_gated_delta_rule", "fla:chunk_delta_rule", "cudnn:softmax")
SHAPES = ("1x128x2x16", "2x64x2x16")


@pytest.mark.parametrize("shapes", ["8x2048x16", "0x16x2x8", "2x16x2x0", "8x16x2x8x1", ",", "2x16x2x8,4x9"])
def test_bad_shapes_are_a_usage_error(capsys, shapes):
    """Three or five sizes, a zero, or no shape at all (which would write a results file of no rows)."""
    from benchmarks.run import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--suite", "bench", "--smoke", "--shapes", shapes])
    assert e.value.code == 2 and "expected BxTxHxD shapes of four positive sizes" in capsys.readouterr().err
    assert parse_args(["--suite", "bench", "--smoke", "--shapes", "2x16x2x8, 1x9x1x4"]).shapes == [(2, 16, 2, 8),
                                                                                                 (1, 9, 1, 4)]


@pytest.mark.parametrize("argv, named", [
    (["--suite", "bench", "--rules", ","], "--rules ',' names no op"),
    (["--suite", "memory", "--rules", ""], "--rules '' names no op"),
    (["--suite", "lm", "--mixers", " , "], "--mixers ' , ' names no mixer"),
])
def test_rules_or_mixers_naming_nothing_are_a_usage_error(capsys, argv, named):
    from benchmarks.run import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--smoke"])
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    # a compare of no rounds measures nothing and writes a results file of no rows
    (["--suite", "compare", "--tree", "a=.", "--tree", "b=.", "--rounds", "0"], "--rounds 0: give at least 1"),
    # past a budget <= 0 every step is skipped (exit code 0); a NaN budget is never reached: no limit at all
    (["--suite", "bench", "--budget", "0"], "--budget 0: give a number of seconds > 0"),
    (["--suite", "bench", "--budget", "-5"], "--budget -5: give a number of seconds > 0"),
    (["--suite", "bench", "--budget", "nan"], "--budget nan: give a number of seconds > 0"),
    (["--suite", "lm", "--budget", "inf"], "--budget inf: give a number of seconds > 0"),
    (["--suite", "compare", "--tree", "a=.", "--tree", "b=docs"], "--tree 'b=docs': docs holds no falcon_jax/"),
    # ignored without a word outside compare; a traceback from os.makedirs after parsing
    (["--suite", "bench", "--rounds", "5"], "--rounds 5: for --suite compare"),
    (["--suite", "bench", "--out", "README.md/sub"], "--out 'README.md/sub': cannot create or write that folder"),
    (["--suite", "bench", "--out", ""], "--out '': cannot create or write that folder"),
])
def test_rounds_budgets_and_trees_that_measure_nothing_are_a_usage_error(capsys, monkeypatch, argv, named):
    from benchmarks.run import parse_args

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--smoke"])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_compare_workers_share_the_gpu_memory_unless_the_user_set_it():
    from benchmarks.run import GPU_MEMORY_SHARED, worker_memory_env

    assert worker_memory_env(1, {}) == {}  # one process: JAX's own default
    for n in (2, 3, 8):
        fraction = float(worker_memory_env(n, {})["XLA_PYTHON_CLIENT_MEM_FRACTION"])
        assert n * fraction <= GPU_MEMORY_SHARED + 1e-9 and fraction >= 0.99 * GPU_MEMORY_SHARED / n
    for key in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        assert worker_memory_env(4, {key: "x"}) == {}


def test_an_out_that_is_a_file_is_a_usage_error_and_an_earlier_result_is_named(tmp_path, capsys, monkeypatch):
    """--out names a folder; a results file already there is replaced, and the log's first line says so."""
    from benchmarks import run

    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    for suite in ("bench", "lm"):
        with pytest.raises(SystemExit) as e:
            run.parse_args(["--suite", suite, "--smoke", "--out", str(blocker)])
        assert e.value.code == 2 and f"--out {blocker}: a file, not a folder" in capsys.readouterr().err
    assert blocker.read_text() == "kept"
    # an earlier result is replaced only when the new run ends: an interrupted or failed rerun (an empty payload
    # written at its start, or its first rows) replaced a complete result before
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text('{"date": "2026-01-02T03:04:05+00:00", "rows": [1, 2]}')
    (out / "bench.log").write_text("the earlier log")
    files = run.ResultFiles(str(out / "bench.json"))
    assert files.note().startswith(f"replacing {out / 'bench.json'} (the results of 2026-01-02T03:04:05+00:00) "
                                   f"when this run ends; until then it writes {out / 'bench.partial.json'}")
    for path, text in ((files.json_now, '{"rows": []}'), (files.log_now, "cut short")):
        with open(path, "w") as f:
            f.write(text)
    assert json.loads((out / "bench.json").read_text())["rows"] == [1, 2]  # the run has not ended: kept
    assert (out / "bench.log").read_text() == "the earlier log"
    assert files.finish() == str(out / "bench.json")
    assert json.loads((out / "bench.json").read_text()) == {"rows": []} and not (out / "bench.partial.json").exists()
    assert (out / "bench.log").read_text() == "cut short"
    lm = run.ResultFiles(str(out / "lm.json"))  # nothing earlier: straight to lm.json (a time limit keeps what ran)
    assert lm.note() is None and (lm.json_now, lm.log_now) == (str(out / "lm.json"), str(out / "lm.log"))


@pytest.mark.parametrize("ours", [
    ("falcon-1A", "falcon-3-xla"),  # a kernel op and the XLA-only op: the runner and its metadata (about 15 s)
    pytest.param(OURS, marks=pytest.mark.slow),  # the whole catalogue with the peers' rows (about 65 s)
], ids=["two-ops", "every-op"])
def test_bench_smoke_writes_every_row_and_the_metadata(tmp_path, ours):
    rules = [] if ours == OURS else ["--rules", ",".join(ours)]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "bench", "--smoke", "--out",
                           str(tmp_path), *rules], cwd=ROOT, capture_output=True, text=True, timeout=1800)
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
    # a slow op runs at the first shape only, unless --rules names it
    want = {(op, shape) for shape in SHAPES for op in ours if shape == SHAPES[0] or op not in SLOW or ours != OURS}
    assert set(measured) == want
    for (op, _), row in measured.items():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms")), row
        # every rule and baseline through its kernels, interpreted; falcon-3-xla through XLA whatever impl is passed
        assert row["impl"] == ("xla" if op == "falcon-3-xla" else "triton"), row
    skipped = {(r["op"], r["shape"]): r["notes"]["skipped"] for r in data["rows"] if "skipped" in r.get("notes", {})}
    peers = PEERS if ours == OURS else ()
    assert skipped == {(op, shape): "no peers in --smoke" for op in peers for shape in SHAPES}

    log = (tmp_path / "bench.log").read_text()
    assert "fwd+bwd ms" in log and all(op in log for op in ours)


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
        assert row["profile_compile_s"] is None, row  # no CUDA graphs: the timed executable is the profiled one
        assert row["compiled_alongside"] == 1, row  # --jobs 2: compiled together
        cfg = LMConfig.preset(f"{mixer}-tiny", dtype="bfloat16", param_dtype="float32")
        assert row["params"] == expected_param_count(cfg)["total"], row
        # random tokens and a fresh model: the first losses sit near ln(vocabulary)
        assert abs(row["loss"] - math.log(cfg.vocab_size)) < 0.5, row
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("step_ms", "compile_s", "lower_s", "device_ms"))
        assert row["tokens_per_s"] == pytest.approx(128 / (row["step_ms"] / 1e3), rel=1e-9)
        assert row["step_ms"] == pytest.approx(statistics.median(row["step_ms_samples"]), abs=1e-3)
        assert row["peak_bytes"] is None  # the CPU keeps no allocator statistics
        # the mixer and its core are real parts of the step, and nearly every device event is attributed, by the
        # instruction the CPU's thunks name
        assert 0 < row["core_share"] < row["mixer_share"] < 1, row
        assert row["unattributed_share"] < 0.05, row
        assert row["attributed_by"]["hlo_op"] > 0.95, row
        assert sum(row["attributed_by"].values()) + row["unattributed_share"] == pytest.approx(1.0, abs=1e-9)
        assert row["hlo_module"].startswith("jit_") and row["trace_modules"][row["hlo_module"]] > 0.95, row
        assert row["mixer_kernels_share"] == 0.0, row  # interpret mode: no kernel of the mixer's own
        assert len(row["unattributed_top"]) <= 10
        assert all(set(r) == {"name", "ms", "events", "args"} for r in row["unattributed_top"]), row

    log = (tmp_path / "lm.log").read_text()
    assert "tokens/s" in log and "x falcon-1A.3" in log and all(m in log for m in mixers)
    assert "mixer kernels %" in log


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

# a GPU program: fusions named as XLA names them, a cuBLAS GEMM, Pallas calls lowered through Triton (the kernel
# name in the backend config; a quote inside the serialized IR is escaped) and Mosaic GPU (the host function
# ``NAME_mosaic_gpu`` in the serialized module's string table), and one Triton kernel called in two scopes
HLO_GPU = r"""HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(bf16[8]{0})->bf16[8]{0}}

%fused_gate (param_0: bf16[8]) -> bf16[8] {
  %param_0 = bf16[8]{0} parameter(0)
  ROOT %multiply.4 = bf16[8]{0} multiply(%param_0, %param_0), metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mixer/mul"}
}

%fused_up (param_0.1: bf16[8]) -> bf16[8] {
  %param_0.1 = bf16[8]{0} parameter(0)
  ROOT %add.7 = bf16[8]{0} add(%param_0.1, %param_0.1), metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mlp/add"}
}

ENTRY %main.9 (p: bf16[8]) -> bf16[8] {
  %p = bf16[8]{0} parameter(0)
  %custom-call.3 = bf16[8]{0} custom-call(%p), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mixer/dot_general"}
  %loop_multiply_fusion.2 = bf16[8]{0} fusion(%custom-call.3), kind=kLoop, calls=%fused_gate
  %pallas_call.1 = bf16[8]{0} custom-call(%loop_multiply_fusion.2), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, backend_config={debug = false, grid_x = 4 : i32, ir = "ML\EFR\00k\00falcon_attn_col_grads\00name = \22decoy\22", name = "falcon_attn_col_grads", num_warps = 4 : i32}, metadata={op_name="jit(train_step)/transpose(jvp(FalconLM))/blocks/mixer/core/pallas_call"}
  %pallas_call.2 = bf16[8]{0} custom-call(%pallas_call.1), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, backend_config={kernel_hash = "G\CC", module = "ML\EFR\01\00falcon_delta_walk_mgpu\00pallas_call:\00llvm.emit_c_interface\00falcon_delta_walk_mgpu_mosaic_gpu\00ordering\00"}, metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mixer/core/pallas_call"}
  %pallas_call.5 = bf16[8]{0} custom-call(%pallas_call.2), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "gate_transpose", num_warps = 4 : i32}, metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mixer/core/pallas_call"}
  %pallas_call.6 = bf16[8]{0} custom-call(%pallas_call.5), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "gate_transpose", num_warps = 4 : i32}, metadata={op_name="jit(train_step)/jvp(FalconLM)/blocks/mlp/pallas_call"}
  ROOT %loop_add_fusion = bf16[8]{0} fusion(%pallas_call.6), kind=kLoop, calls=%fused_up
}
"""
SCOPES = ("mixer", "mixer/core", "mlp")
# (instruction, kernel name, µs): what the GPU launches for HLO_GPU, durations powers of two so that sums tell
LAUNCHES = (("custom-call.3", "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", 1.0),
            ("loop_multiply_fusion.2", "loop_multiply_fusion_2", 2.0),
            ("pallas_call.1", "falcon_attn_col_grads", 4.0),
            ("pallas_call.2", "falcon_delta_walk_mgpu_mosaic_gpu_kernel", 8.0),
            ("pallas_call.5", "gate_transpose", 16.0),
            ("pallas_call.6", "gate_transpose", 32.0),
            ("loop_add_fusion", "loop_add_fusion", 64.0))
MIXER, CORE, MLP = 1.0 + 2.0 + 4.0 + 8.0 + 16.0, 4.0 + 8.0 + 16.0, 32.0 + 64.0


def _device_trace(kernels, derived=True):
    """Events in the layout ``jax.profiler`` writes on a GPU: ``kernels`` (``(name, tid, µs, args)``) on a device
    process's ``Stream`` lines, the same work again on a line derived from them, and a host-side event."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 5, "args": {"name": "python"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7(Kernel,MemcpyD2D)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "Stream #8(MemcpyD2D)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Ops"}}]
    events = [{"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": 0, "dur": dur, "args": args}
              for name, tid, dur, args in kernels]
    derived_events = [dict(e, tid=9) for e in events] if derived else []  # "XLA Ops": a second view of the time
    host = [{"ph": "X", "pid": 1, "tid": 5, "name": "ThunkExecute", "ts": 0, "dur": 1e6,
             "args": {"hlo_op": "loop_add_fusion"}}]
    return meta + events + derived_events + host


def _annotated(hlo_op, module="jit_train_step", name=None, **extra):
    """A kernel's args as XLA's launch annotation gives them (``XlaModule:#prefix=...,hlo_module=...#::
    Thunk:#name=...,hlo_op=...#``), with the CUPTI record's own keys."""
    args = {"correlation_id": "4711", "kernel_details": "regs:32 static_shared:0 grid:4,1,1 block:128,1,1",
            "tf_op": "XlaModule", "hlo_module": module, "program_id": "17", "prefix": "jit(train_step)",
            "hlo_op": hlo_op}
    if name is not None:
        args["name"] = name
    return dict(args, **extra)


def _gpu_trace():
    """HLO's kernels, each naming its instruction, a kernel whose args carry a path, and a CUDA graph's launch."""
    kernels = [("proj", 7, 10.0), ("kernel", 7, 20.0), ("attn", 7, 40.0), ("loop_fusion", 7, 80.0),
               ("copy.3", 8, 160.0), ("mlp_fusion", 7, 320.0), ("both", 7, 640.0), ("scope_lookalike", 7, 1280.0),
               ("head", 7, 2560.0), ("command_buffer", 7, 5120.0)]
    events = [(f"kernel_{op}", tid, dur, {"hlo_op": op, "hlo_module": "jit_step"}) for op, tid, dur in kernels]
    events.append(("sm90_gemm", 7, 10240.0, {"hlo_op": "gone.1", "tf_op": "jit(step)/jvp(mixer)/core/dot_general"}))
    return _device_trace(events)


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

    prog = ts.program(HLO)
    assert prog.module == "jit_step" and prog.names == names
    split = ts.scope_times(_gpu_trace(), prog, SCOPES)
    core = 20.0 + 40.0 + 80.0 + 160.0 + 10240.0  # kernel, attn, loop_fusion, copy.3, and the tf_op event
    assert split["by_scope_us"] == {"mixer": 10.0 + core, "mixer/core": core, "mlp": 320.0}
    assert split["unattributed_us"] == 5120.0  # the command buffer names no instruction of the program
    assert split["total_us"] == sum([10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 5120.0, 10240.0])
    assert split["events"] == 11  # the Stream lines only: not the derived "XLA Ops" line, not the host
    assert split["by_method_us"] == {"hlo_op": split["total_us"] - 5120.0 - 10240.0, "annotation": 10240.0,
                                     "kernel_name": 0.0}
    assert [r["name"] for r in split["unattributed_top"]] == ["kernel_command_buffer"]
    # a bare {instruction: op_name} mapping still serves (no module, no kernel names)
    assert ts.scope_times(_gpu_trace(), names, SCOPES)["by_scope_us"] == split["by_scope_us"]


def test_trace_scopes_reads_gpu_kernels_by_instruction_annotation_and_kernel_name():
    from benchmarks import trace_scopes as ts

    prog = ts.program(HLO_GPU)
    assert prog.module == "jit_train_step"
    assert prog.kernels["loop_multiply_fusion_2"] == ["loop_multiply_fusion.2"]
    assert prog.stems == {"falcon_attn_col_grads": ["pallas_call.1"],  # not the escaped decoy inside the IR
                          "falcon_delta_walk_mgpu_mosaic_gpu": ["pallas_call.2"],
                          "gate_transpose": ["pallas_call.5", "pallas_call.6"]}
    total = sum(us for _, _, us in LAUNCHES)

    # standalone launches: every kernel, the cuBLAS one included, names its instruction
    split = ts.scope_times(_device_trace([(k, 7, us, _annotated(op)) for op, k, us in LAUNCHES]), prog, SCOPES)
    assert split["by_scope_us"] == {"mixer": MIXER, "mixer/core": CORE, "mlp": MLP}
    assert split["by_method_us"] == {"hlo_op": total, "annotation": 0.0, "kernel_name": 0.0}
    assert split["unattributed_us"] == 0.0 and split["unattributed_top"] == [] and split["module_matched"]
    assert split["modules_us"] == {"jit_train_step": total}

    # inside a CUDA graph every kernel names the graph's launch: XLA's fusions and the Pallas kernels are found by
    # kernel name; the cuBLAS kernel is not, and neither is the kernel two scopes' custom calls share; an op_name
    # the graph's annotation carries is the graph's, not the kernel's: not taken
    graph = [(k, 7, us, _annotated("command_buffer", cuda_graph_id="3")) for _, k, us in LAUNCHES]
    graph.append(("nvjet_in_graph", 7, 128.0, _annotated("command_buffer_1376", cuda_graph_id="4",
                                                          name="jvp(FalconLM)/blocks/mixer/dot_general")))
    split = ts.scope_times(_device_trace(graph), prog, SCOPES)
    assert split["by_scope_us"] == {"mixer": 2.0 + 4.0 + 8.0, "mixer/core": 4.0 + 8.0, "mlp": 64.0}
    assert split["by_method_us"] == {"hlo_op": 0.0, "annotation": 0.0, "kernel_name": 2.0 + 4.0 + 8.0 + 64.0}
    assert split["unattributed_us"] == 1.0 + 16.0 + 32.0 + 128.0
    top = split["unattributed_top"]
    assert [(r["name"], r["us"], r["events"]) for r in top] == [
        ("nvjet_in_graph", 128.0, 1), ("gate_transpose", 48.0, 2),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", 1.0, 1)]
    assert top[1]["args"]["hlo_op"] == "command_buffer" and top[1]["args"]["cuda_graph_id"] == "3"

    # the op_name the annotation carries stands in for an instruction the text lacks; a "%" and a long_name's
    # HLO text still name one
    events = [("nvjet_a", 7, 1.0, _annotated("custom-call.99", name="jvp(FalconLM)/blocks/mixer/core/dot_general")),
              ("nvjet_b", 7, 2.0, _annotated("%custom-call.3")),
              ("nvjet_c", 8, 4.0, {"long_name": "%loop_add_fusion = bf16[8]{0} fusion(%pallas_call.6), kind=kLoop"}),
              ("nvjet_d", 7, 8.0, _annotated("custom-call.98"))]  # no path, no such instruction or kernel
    split = ts.scope_times(_device_trace(events), prog, SCOPES)
    assert split["by_scope_us"] == {"mixer": 1.0 + 2.0, "mixer/core": 1.0, "mlp": 4.0}
    assert split["by_method_us"] == {"hlo_op": 2.0 + 4.0, "annotation": 1.0, "kernel_name": 0.0}
    assert split["unattributed_us"] == 8.0

    # another program's kernels are not the step's, whatever they are called; when the step's module never
    # appears (spelled otherwise), the module does not filter
    events = [("loop_add_fusion", 7, 1.0, _annotated("loop_add_fusion")),
              ("loop_add_fusion", 7, 2.0, _annotated("loop_add_fusion", module="jit_other"))]
    split = ts.scope_times(_device_trace(events), prog, SCOPES)
    assert (split["by_scope_us"]["mlp"], split["unattributed_us"], split["module_matched"]) == (1.0, 2.0, True)
    renamed = [(k, t, us, dict(a, hlo_module="jit_train_step.1")) for k, t, us, a in events[:1]]
    split = ts.scope_times(_device_trace(renamed), prog, SCOPES)
    assert (split["by_scope_us"]["mlp"], split["unattributed_us"], split["module_matched"]) == (1.0, 0.0, False)


def test_trace_scopes_lists_the_largest_unattributed_kernels_with_their_args():
    from benchmarks import trace_scopes as ts

    long_value = "x" * 300
    events = [(f"vendor_kernel_{i}", 7, float(i + 1), {"hlo_op": "command_buffer", "kernel_details": long_value})
              for i in range(14)]
    events += [("vendor_kernel_3", 7, 100.0, {"hlo_op": "command_buffer", "correlation_id": "9"})]  # longest: its args
    split = ts.scope_times(_device_trace(events), ts.program(HLO_GPU), SCOPES, top=10)
    top = split["unattributed_top"]
    assert [r["name"] for r in top] == ["vendor_kernel_3"] + [f"vendor_kernel_{i}" for i in range(13, 4, -1)]
    assert (top[0]["us"], top[0]["events"], top[0]["args"]) == (104.0, 2, {"hlo_op": "command_buffer",
                                                                            "correlation_id": "9"})
    assert top[1]["args"]["kernel_details"] == "x" * 80 + "..."
    assert split["unattributed_us"] == split["total_us"] == sum(range(1, 15)) + 100.0


def test_mixer_kernels_are_found_by_name_alone():
    from benchmarks import trace_scopes as ts

    # every kernel name pallas_kernels/ gives (Triton names, Mosaic GPU kernel names with the suffix Mosaic adds)
    source = "\n".join(p.read_text() for p in (ROOT / "pallas_kernels").rglob("*.py"))
    given = [name for expr in re.findall(r"(?<![\w.])(?:kernel_)?name=([^,)\n]+)", source)
             for name in re.findall(r'"(\w+)"', expr)]
    assert len(given) > 20 and "gate_transpose_back" in given
    for name in given + [n + "_mosaic_gpu_kernel" for n in given]:
        assert ts.MIXER_KERNELS.search(name), name
    for name in ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
                 "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
                 "mha_forward", "mha_preprocess_backward", "mha_backward"):  # the Pallas flash attention
        assert ts.MIXER_KERNELS.search(name), name
    for name in ("loop_multiply_fusion", "input_convert_reduce_select_fusion", "gemm_fusion_dot_3",
                 "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n",
                 "MemcpyD2D", "wrapped_sine", "triton_softmax_2"):
        assert not ts.MIXER_KERNELS.search(name), name

    graph = [(k, 7, us, _annotated("command_buffer")) for _, k, us in LAUNCHES]
    events = _device_trace(graph + [("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 8, 128.0, {})])
    assert ts.named_kernel_time(events) == 4.0 + 8.0 + 16.0 + 32.0 + 128.0  # not the fusions, not cuBLAS
    assert ts.named_kernel_time(events, re.compile("^loop_")) == 2.0 + 64.0


def test_lm_table_withholds_scope_shares_when_most_time_is_unattributed():
    from benchmarks.lm_suite import lm_table

    base = {"shape": "8x4096", "kernels": "triton", "tokens_per_s": 1000.0, "step_ms": 95.3, "notes": {}}
    rows = [dict(base, mixer="falcon-1A.3", mixer_share=0.41, core_share=0.22, unattributed_share=0.02,
                 mixer_kernels_share=0.131),
            dict(base, mixer="falcon-1.3", mixer_share=None, core_share=None, unattributed_share=0.998,
                 mixer_kernels_share=0.094),
            dict(base, mixer="transformer", kernels="xla", mixer_share=0.0015, core_share=0.0015,
                 unattributed_share=0.51, mixer_kernels_share=0.0),
            dict(base, mixer="mamba2")]  # no profile
    header, _, *lines = lm_table(rows).splitlines()
    columns = [c.strip() for c in header.split("|")]
    cells = {line.split("|")[0].strip(): dict(zip(columns, (c.strip() for c in line.split("|")))) for line in lines}
    share = lambda m: tuple(cells[m][c] for c in ("mixer %", "core %", "unattr. %", "mixer kernels %"))  # noqa: E731
    assert share("falcon-1A.3") == ("41.0", "22.0", "2.0", "13.1")
    assert share("falcon-1.3") == ("–", "–", "99.8", "9.4")
    assert share("transformer") == ("–", "–", "51.0", "–")  # numbers in the row, but over half unattributed
    assert share("mamba2") == ("-", "-", "-", "-")


def test_lm_compile_drops_the_options_an_xla_does_not_know():
    from benchmarks.lm import compile_with

    class Lowered:  # an XLA that knows only ``known``
        def __init__(self, known):
            self.known, self.calls = known, []

        def compile(self, compiler_options=None):
            self.calls.append(dict(compiler_options or {}))
            for key in compiler_options or {}:
                if key not in self.known:
                    raise RuntimeError(f"INVALID_ARGUMENT: No such compile option: '{key}'")
            return "compiled"

    options = {"xla_gpu_enable_command_buffer": "", "xla_gpu_per_fusion_autotune_cache_dir": "/a"}
    notes = {}
    lowered = Lowered({"xla_gpu_per_fusion_autotune_cache_dir"})
    assert compile_with(lowered, options, notes)[0] == "compiled"
    assert lowered.calls == [options, {"xla_gpu_per_fusion_autotune_cache_dir": "/a"}]
    assert list(notes) == ["xla_gpu_enable_command_buffer"]
    assert "has no" in notes["xla_gpu_enable_command_buffer"] and "CUDA graphs" in notes[
        "xla_gpu_enable_command_buffer"]
    assert len(options) == 2  # the caller's dict is left alone

    notes = {}
    lowered = Lowered(set())
    compile_with(lowered, options, notes)
    assert lowered.calls[-1] == {} and set(notes) == set(options)

    class Broken(Lowered):
        def compile(self, compiler_options=None):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_with(Broken(set()), options, {})


def test_lm_measure_times_one_executable_and_profiles_the_other_with_the_donated_state(monkeypatch):
    import jax.numpy as jnp

    import falcon_jax.train.trainer as trainer
    from benchmarks import lm, trace_scopes

    def step(params, rest, opt_state, batch):  # the train step's signature; the state counts the steps it took
        with jax.named_scope("mixer"):
            new = params + batch["x"] * rest
        return new, opt_state + 1, {"loss": jnp.sum(new)}

    args = (jnp.zeros(8), jnp.float32(2.0), jnp.int32(0), {"x": jnp.arange(8.0)})
    lowered = jax.jit(step, donate_argnums=(0, 2)).lower(*args)
    calls = []

    def logged(name, executable):
        def run(*a):
            calls.append(name)
            return executable(*a)
        return run

    profiled = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})  # accepted on any backend
    monkeypatch.setattr(trainer, "peak_device_memory", lambda: calls.append("peak") or 1234)
    lm.STATE.update(compiled=logged("timed", lowered.compile()), profiled=logged("profiled", profiled), params=args[0], rest=args[1], opt_state=args[2],
                    batch=args[3], program=trace_scopes.program(profiled.as_text()), tokens=8)
    try:
        row = lm.measure({"timing": {"warmup": 2, "calls": 3, "repeats": 2, "profile_steps": 2}})
        # the peak is read after the timed steps, before the profiled executable's untraced step and traced steps;
        # each step took the state the one before it left (donated), so the state counts them all
        assert calls == ["timed"] * (2 + 3 * 2) + ["peak"] + ["profiled"] * (1 + 2), calls
        assert int(lm.STATE["opt_state"]) == len(calls) - 1
        np.testing.assert_array_equal(lm.STATE["params"], np.arange(8.0) * 2.0 * (len(calls) - 1))
        assert row["peak_bytes"] == 1234 and row["loss"] == pytest.approx(float(np.arange(8.0).sum() * 2 * 8))
        assert row["device_ms"] > 0 and row["unattributed_share"] < 0.5, row
    finally:
        lm.STATE.clear()


def test_lm_budget_deadlines_leave_each_configuration_its_measuring_time():
    from benchmarks.lm_suite import LM_MEASURE_RESERVE as R
    from benchmarks.lm_suite import LM_MIN_PREPARE, measure_deadline, prepare_deadline

    assert prepare_deadline(420, None, 10) == 420  # no budget: the limit alone
    assert prepare_deadline(420, 1000.0, 10) == 420
    assert prepare_deadline(420, 112.0, 10) == pytest.approx(112.0 - 10 * R)  # 9 compiled in time get measured
    assert prepare_deadline(420, 112.0, 1) == pytest.approx(112.0 - R)
    assert prepare_deadline(420, 3 * R, 10) == LM_MIN_PREPARE
    assert measure_deadline(180, None) == 180 and measure_deadline(180, 1000.0) == 180
    assert measure_deadline(180, 100.0) == 100.0 and measure_deadline(180, 0.5) == R


def test_lm_budget_measures_the_compiled_configurations_of_a_wave_whose_slow_compile_times_out(tmp_path, monkeypatch):
    import signal
    import time

    from benchmarks import lm_suite
    from benchmarks.run import parse_args

    compile_s = {"falcon-1A.3": 30.0, "transformer": 0.2}  # the first would outlast the whole budget
    requests = []

    class Worker:  # benchmarks.common.Worker's interface, the worker process replaced by sleeps
        def __init__(self, name, *args, **kwargs):
            self.mixer, self.environment = name.split()[0], None

        def start(self):
            return "ok"

        def request(self, req, limit):
            requests.append((self.mixer, req["cmd"], limit))
            if req["cmd"] == "lm_prepare":
                if compile_s[self.mixer] > limit:
                    time.sleep(limit)
                    return f"timed out after {limit:.0f} s", {}
                time.sleep(compile_s[self.mixer])
                return "ok", {"seconds": compile_s[self.mixer], "compile_s": compile_s[self.mixer], "notes": {}}
            time.sleep(0.1)
            return "ok", {"seconds": 0.1, "step_ms": 1.0, "tokens_per_s": 128e3, "notes": {}}

        def stop(self):
            pass

    budget, reserve = 4.0, 1.5
    monkeypatch.setattr(lm_suite, "Worker", Worker)
    monkeypatch.setattr(lm_suite, "LM_MEASURE_RESERVE", reserve)
    monkeypatch.setattr(lm_suite, "LM_MIN_PREPARE", 0.5)
    argv = ["--suite", "lm", "--smoke", "--mixers", "falcon-1A.3,transformer", "--lengths", "64", "--jobs", "2",
            "--budget", str(budget), "--out", str(tmp_path)]
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert lm_suite.run(parse_args(argv), argv) == 1  # a configuration timed out
    finally:
        signal.signal(signal.SIGTERM, handler)

    data = json.loads((tmp_path / "lm.json").read_text())
    rows = {r["mixer"]: r for r in data["rows"]}
    # one wave of both: its compiles end two reserves before the budget; the slow one is cut there, the fast one
    # is measured in the time left
    prepares = [limit for _, cmd, limit in requests if cmd == "lm_prepare"]
    assert len(prepares) == 2 and all(budget - 2 * reserve - 0.5 < p <= budget - 2 * reserve for p in prepares)
    assert rows["falcon-1A.3"]["notes"] == {"prepare": "timed out after 1 s"}, rows
    assert rows["transformer"]["tokens_per_s"] == 128e3 and rows["transformer"]["notes"] == {}, rows
    (measure,) = [limit for mixer, cmd, limit in requests if cmd == "lm_measure"]
    assert reserve <= measure < budget - 1.0
    assert [s["status"] for s in data["steps"]] == ["timed out after 1 s", "ok"]
    assert data["budget_s"] == budget and data["measure_reserve_s"] == reserve


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path):
    """coreutils timeout signals the process and then its group: the second SIGTERM raised SystemExit again inside
    the suites' finally, leaving the workers running and the scratch folder behind (bench had no handler at all)."""
    done = tmp_path / "cleaned"
    code = ("import os, signal, time\nfrom benchmarks.common import exit_on_sigterm\nexit_on_sigterm()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(5)\nfinally:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(0.2)\n"
            f"    open({str(done)!r}, 'w').write('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143 and done.read_text() == "ok", proc.stderr


@pytest.mark.slow  # ~25 s: the first configuration's worker starts before the backend is known
def test_the_full_size_lm_suite_declines_on_a_cpu(tmp_path):
    """Without --smoke on a CPU it built the 130M model for every mixer (~20 s each) and printed an out-of-memory
    traceback for each; now the first worker's backend stops it, every configuration noted as skipped."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite", "lm", "--mixers",
                           "falcon-1A.3,transformer", "--lengths", "4096", "--jobs", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "no GPU: the lm suite measures" in proc.stdout, proc.stdout[-3000:]
    rows = json.loads((tmp_path / "lm.json").read_text())["rows"]
    assert [(r["mixer"], r["notes"]) for r in rows] == [(m, {"skipped": "no GPU (use --smoke on a CPU)"})
                                                         for m in ("falcon-1A.3", "transformer")]
