"""The multi-process (multi-host) path on CPU: two processes joined by ``jax.distributed``
(``python -m falcon_jax.train.launch``, gloo collectives) train on a 2 x 2 mesh of simulated devices and
checkpoint; the checkpoint is restored on ONE process with a different device count and mesh
(orbax reshards), and the resumed steps reproduce the two-process run's losses."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from falcon_jax.train.mesh import MeshError, maybe_initialize_distributed

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "data.train_max_width=3", "data.eval_widths=[2]", "data.eval_examples=8", "data.greedy_widths=[2]",
        "data.greedy_examples=8",
        "train.batch_size=16", "train.steps=4", "train.log_every=1", "train.plots=false",
        "checkpoint.every=2", "checkpoint.keep=3"]


def _sets(keys):
    return [a for k in keys for a in ("--set", k)]


def _losses(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train":
                out.setdefault(r["step"], []).append(r["loss"])
    return out


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.mark.slow  # ~30-60 s of training subprocesses; CI keeps the in-process signal and bit-flip tests
def test_two_processes_train_then_restore_on_one_device(tmp_path):
    a, b = str(tmp_path / "two-proc"), str(tmp_path / "resumed")
    cmd = [sys.executable, "-m", "falcon_jax.train.launch", "--processes", "2", "--cpu-devices", "2", "--",
           "--preset", "addition-tiny", *_sets(TINY + ["mesh.data=2", "mesh.fsdp=2"]), "--run-dir", a]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "mesh {'data': 2, 'fsdp': 2, 'seq': 1, 'tensor': 1} on 4 cpu device(s)" in proc.stdout
    assert "this host: rows slice 1 of 2" in proc.stdout  # each process loaded half of every batch
    # evaluation reads sharded predictions and greedy decodes back on every process
    assert re.search(r"\n +2 \| in-dist +\| +[0-9.]+% \| +[0-9.]+% \| +[0-9.]+%", proc.stdout), proc.stdout[-2000:]
    assert sorted(os.listdir(os.path.join(a, "checkpoints"))) == ["2", "4"]
    two = _losses(a)
    assert sorted(two) == [1, 2, 3, 4] and all(len(v) == 1 for v in two.values())  # only process 0 logs

    # the run as if stopped after step 2, continued on a single device
    shutil.copytree(a, b)
    shutil.rmtree(os.path.join(b, "checkpoints", "4"))
    proc = subprocess.run([sys.executable, "-m", "falcon_jax.train", "--run-dir", b, "--resume",
                           *_sets(["mesh.data=1", "mesh.fsdp=1"])],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "restored step 2" in proc.stdout
    assert "on 1 cpu device(s)" in proc.stdout
    resumed = _losses(b)
    for s in (3, 4):
        assert len(resumed[s]) == 2  # the copied record and the resumed one
        assert resumed[s][1] == pytest.approx(two[s][0], rel=1e-5), s
    # a different continuation would show: the loss moves between steps
    assert abs(two[4][0] - two[2][0]) > 1e-3


def test_coordinator_without_process_count_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(MeshError, match="JAX_NUM_PROCESSES .*JAX_PROCESS_ID"):
        maybe_initialize_distributed("auto")


def test_launcher_argument_errors():
    from falcon_jax.train.launch import main
    for argv in (["--processes", "0", "--", "--preset", "addition-tiny"],
                 ["--processes", "2"],
                 ["--processes", "2", "--gpus-per-process", "1", "--cpu-devices", "2", "--", "--preset", "x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
