"""``python -m benchmarks.run --suite bench --smoke`` on the CPU (tiny shapes, the Triton kernels in interpret mode,
no peers): the whole entry point runs as a subprocess, and the JSON it writes holds every row with finite times
and the metadata a result needs (the tests do not import ``benchmarks/``)."""

import datetime
import json
import math
import re
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
