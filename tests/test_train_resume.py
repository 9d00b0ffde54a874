"""Checkpoints: SIGTERM and SIGKILL mid-run + --resume reproduce the uninterrupted losses step for step;
a corrupt latest checkpoint is reported and the previous one used."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from falcon_jax.train.rundir import read_metrics

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "data.train_max_width=3", "data.eval_widths=[2,4]", "data.eval_examples=8", "data.greedy_widths=[]",
        "data.greedy_examples=4", "train.batch_size=8", "train.plots=false", "train.log_every=5",
        "optim.warmup_steps=3", "checkpoint.every=3", "checkpoint.keep=2"]


def _cmd(run_dir, steps, *extra):
    args = [sys.executable, "-m", "falcon_jax.train", "--preset", "addition-tiny", "--run-dir", str(run_dir),
            "--set", f"train.steps={steps}"]
    for o in TINY + list(extra):
        args += ["--set", o]
    return args


def _env():
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=240, **kw)


def _wait_for(run_dir, proc, ready, timeout=200):
    """Poll the run's metrics until ``ready(steps, checkpoint_steps)``; True if it came before the run ended."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        got, _ = read_metrics(run_dir)
        ckpts = [int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()] \
            if (run_dir / "checkpoints").exists() else []
        if got and ready(max(got), ckpts):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # ~30-60 s of training subprocesses; CI keeps the in-process signal and bit-flip tests
def test_sigterm_then_sigkill_and_resume_reproduce_losses(tmp_path):
    """SIGTERM mid-run (a cluster's preemption): the step finishes, its checkpoint is written, the last line
    says how to resume, exit code 143.  The resumed run is then killed with SIGKILL (no chance to save) and
    resumed again: every step's loss equals the uninterrupted run's, bit for bit."""
    steps = 14
    ref = _run(_cmd(tmp_path / "ref", steps))
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses, _ = read_metrics(tmp_path / "ref")
    assert sorted(ref_losses) == list(range(1, steps + 1))

    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(_cmd(run_dir, steps, "train.step_sleep=0.3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    assert _wait_for(run_dir, proc, lambda step, ckpts: step >= 4), "the run ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    stopped_at = int(last.split("after step ")[1].split(";")[0])
    assert 4 <= stopped_at < steps and "Traceback" not in err
    assert last == (f"falcon-train: stopped by SIGTERM after step {stopped_at}; checkpoint of step {stopped_at} "
                    f"written; resume with: falcon-train --run-dir {run_dir} --resume")
    assert stopped_at in [int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()]
    assert max(read_metrics(run_dir)[0]) == stopped_at

    proc = subprocess.Popen([sys.executable, "-m", "falcon_jax.train", "--run-dir", str(run_dir), "--resume"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    assert _wait_for(run_dir, proc, lambda step, ckpts: step >= stopped_at + 3 and max(ckpts) > stopped_at), \
        "the resumed run finished (or hung) before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and max(read_metrics(run_dir)[0]) < steps

    res = _run([sys.executable, "-m", "falcon_jax.train", "--run-dir", str(run_dir), "--resume",
                "--set", "train.step_sleep=0"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[resume] restored step" in res.stdout
    got, evals = read_metrics(run_dir)
    assert sorted(got) == list(range(1, steps + 1))
    for s in range(1, steps + 1):  # bit-for-bit: same programs, same data, restored fp32 state
        assert got[s]["loss"] == ref_losses[s]["loss"], (s, got[s]["loss"], ref_losses[s]["loss"])
    assert evals and evals[-1]["step"] == steps
    # the data came through Grain, whose iterator state is in every checkpoint
    with open(run_dir / "checkpoints" / str(steps) / "meta" / "metadata") as f:
        meta = json.load(f)
    assert meta["data"] == {"step": steps, "loader": "grain", "state": {"next_index": steps}}


@pytest.mark.slow  # ~30-60 s of training subprocesses; CI keeps the in-process signal and bit-flip tests
def test_corrupt_latest_checkpoint_falls_back_and_existing_run_is_protected(tmp_path):
    run_dir = tmp_path / "run"
    first = _run(_cmd(run_dir, 6, "checkpoint.keep=3"))
    assert first.returncode == 0, first.stderr[-3000:]
    ck = run_dir / "checkpoints"
    assert sorted(int(d) for d in os.listdir(ck) if d.isdigit()) == [3, 6]

    # starting again without --resume must not touch the existing checkpoints
    again = _run(_cmd(run_dir, 6))
    assert again.returncode == 2 and "--resume" in again.stderr
    assert again.stdout == ""  # refused at once: not even the run directory line (before any model work)

    # corrupt step 6: truncate every file in it
    for root, _, files in os.walk(ck / "6"):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(0)
    res = _run(_cmd(run_dir, 9, "checkpoint.keep=3") + ["--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 6" in res.stdout and "corrupt" in res.stdout
    assert "[resume] restored step 3" in res.stdout
    assert os.listdir(run_dir / "checkpoints_corrupt")  # kept for inspection, not deleted
    steps_now = sorted(int(d) for d in os.listdir(ck) if d.isdigit())
    assert steps_now == [3, 6, 9]  # 6 re-made from the resumed run
    got, _ = read_metrics(run_dir)
    assert sorted(got) == list(range(1, 10))

    # resuming with the other loader would silently change the data: refused, with the fix
    other = _run(_cmd(run_dir, 12, "checkpoint.keep=3", "data.loader=builtin") + ["--resume"])
    assert other.returncode == 2, other.stderr[-3000:]
    assert "data.loader='grain'" in other.stderr and "--set data.loader=grain" in other.stderr
    assert sorted(int(d) for d in os.listdir(ck) if d.isdigit()) == [3, 6, 9]  # nothing touched
