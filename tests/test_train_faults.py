"""The trainer under bad configs and faults: every config error is one line and exit code 2 before any
work; a checkpoint with flipped bits is caught and the previous one used; --resume without a usable
checkpoint refuses unless --resume-or-start; SIGINT stops after the current step with a checkpoint; a
failed save (a write past the file-size limit, as on a full disk) stops the run at that step with one line
and leaves no temporary folder; an unwritable run directory is one line.
(SIGTERM mid-run and the exact continuation after it: test_train_resume.py.)"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from falcon_jax.train import cli, trainer
from falcon_jax.train.checkpoint import CHECKSUMS
from falcon_jax.train.config import build_config
from falcon_jax.train.preemption import Interrupted
from falcon_jax.train.rundir import RunDirError, checkpoint_steps, read_metrics

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "data.train_max_width=3", "data.eval_widths=[2]", "data.eval_examples=8", "data.greedy_widths=[]",
        "data.greedy_examples=4", "train.batch_size=8", "train.plots=false", "train.log_every=5",
        "optim.warmup_steps=3", "checkpoint.every=3", "checkpoint.keep=3"]


def _cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv, named", [
    (["--set", "optim.lr=-1e-3"], "optim.lr=-0.001: must be a finite number > 0"),
    (["--set", "train.steps=0"], "train.steps=0: must be an integer >= 1"),
    (["--set", "train.steps=-5"], "train.steps=-5: must be an integer >= 1"),
    (["--set", "train.batch_size=0"], "train.batch_size=0: must be an integer >= 1"),
    (["--set", "train.grad_accum=3"], "must divide train.batch_size=64"),
    (["--set", "checkpoint.keep=0"], "checkpoint.keep=0: must be an integer >= 1"),
    (["--set", "checkpoint.every=-1"], "checkpoint.every=-1: must be an integer >= 0"),
    (["--set", "data.kind=txt"], "data.kind='txt': use one of 'addition', 'text'. Did you mean 'text'?"),
    (["--set", "data.tokenizer=bpee"], "data.tokenizer='bpee': use one of 'byte', 'bpe'. Did you mean 'bpe'?"),
    (["--set", "data.train_min_width=6"], "data.train_max_width=4: must be an integer >= 6"),
    (["--set", "data.eval_widths=[0, 2]"], "data.eval_widths=[0, 2]: must be a list of integers >= 1"),
    (["--set", "mesh.data=0"], "mesh.data=0: must be a positive integer or -1"),
    (["--set", "model.n_heads=5"], "model: "),
])
def test_config_errors_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, argv, named):
    run_dir = tmp_path / "run"
    for extra in ([], ["--print-config"]):  # --print-config checks the values too
        rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), *argv, *extra], capsys)
        assert rc == 2 and out == "", (rc, out)
        assert err.startswith("falcon-train: error: ") and named in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not run_dir.exists()  # nothing written


def test_text_presets_need_paths_and_a_single_path_is_one_path(tmp_path, capsys):
    rc, out, err = _cli(["--preset", "lm-130m", "--print-config"], capsys)
    assert rc == 2 and "data.paths=[]: is empty" in err
    cfg = build_config(preset="lm-tiny", overrides=["data.paths=/nonexistent/corpus"])
    assert cfg.data.paths == ["/nonexistent/corpus"]  # not ['/', 'n', 'o', ...]
    rc, out, err = _cli(["--preset", "lm-tiny", "--set", "data.paths=/nonexistent/corpus", "--run-dir",
                         str(tmp_path / "run")], capsys)
    assert rc == 2 and "data.paths=['/nonexistent/corpus'] matched no" in err
    assert "model " not in out  # refused before the model is built


def test_unwritable_run_directory_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(blocker / "run"), *sum((["--set", o] for o in TINY), [])],
                        capsys)
    assert rc == 2 and err.startswith(f"falcon-train: error: cannot write to the run directory {blocker / 'run'}")
    assert err.count("\n") == 1 and "--run-dir" in err


def test_resume_without_a_checkpoint_refuses_before_any_work(tmp_path, capsys, monkeypatch):
    def forbidden(*a, **k):
        pytest.fail("the refusal came after mesh, data or model work")

    for name in ("make_mesh", "build_data", "FalconLM"):
        monkeypatch.setattr(trainer, name, forbidden)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(tmp_path / "run"), "--resume"], capsys)
    assert rc == 2 and "has no checkpoint to continue from; pass --resume-or-start" in err and out == ""


def _flip_a_bit(step_dir):
    """Flip one bit in the middle of the step's largest file (same size: no truncation to notice)."""
    path = max((os.path.join(r, n) for r, _, fs in os.walk(step_dir) for n in fs if n != CHECKSUMS),
               key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x04
    with open(path, "wb") as f:
        f.write(bytes(data))


def test_flipped_bits_fall_back_then_resume_refuses_or_starts_over(tmp_path):
    run_dir = tmp_path / "run"
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=6"])
    trainer.run(cfg, log=lambda line: None)
    ck = run_dir / "checkpoints"
    assert checkpoint_steps(str(run_dir)) == [3, 6]
    for s in (3, 6):
        assert json.loads((ck / str(s) / CHECKSUMS).read_text())["sha256"]  # written with every save

    _flip_a_bit(ck / "6")
    lines = []
    cfg9 = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=9"])
    trainer.run(cfg9, resume=True, log=lines.append)
    said = "\n".join(lines)
    assert "step 6" in said and "does not match its checksum" in said and "[resume] restored step 3" in said
    assert [p.name.split("-")[0] for p in (run_dir / "checkpoints_corrupt").iterdir()] == ["6"]  # moved aside
    assert checkpoint_steps(str(run_dir)) == [3, 6, 9]  # 6 made again by the resumed run
    assert sorted(read_metrics(str(run_dir))[0]) == list(range(1, 10))

    for s in (3, 6, 9):  # nothing usable left
        _flip_a_bit(ck / str(s))
    with pytest.raises(RunDirError, match="no usable checkpoint .* pass --resume-or-start"):
        trainer.run(cfg9, resume=True, log=lambda line: None)
    lines.clear()
    cfg2 = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=2"])
    trainer.run(cfg2, resume_or_start=True, log=lines.append)
    assert any("starting from step 0" in line for line in lines)
    assert checkpoint_steps(str(run_dir)) == [2]


def test_sigint_finishes_the_step_and_writes_a_checkpoint(tmp_path):
    """A real SIGINT to this process mid-run: no KeyboardInterrupt, a checkpoint of the step it stopped after,
    and the handlers that were there before are back."""
    run_dir = tmp_path / "run"
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=40",
                                                                 "train.step_sleep=0.1", "checkpoint.every=100"])
    before = signal.getsignal(signal.SIGINT)

    def interrupt_after_step_2():
        deadline = time.time() + 120
        while time.time() < deadline:
            got, _ = read_metrics(str(run_dir)) if (run_dir / "metrics.jsonl").exists() else ({}, [])
            if got and max(got) >= 2:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_after_step_2, daemon=True).start()
    with pytest.raises(Interrupted) as stopped:
        trainer.run(cfg, log=lambda line: None)
    e = stopped.value
    assert e.signum == signal.SIGINT and e.exit_code == 130 and 2 <= e.step < 40
    assert f"resume with: falcon-train --run-dir {run_dir} --resume" in str(e)
    assert checkpoint_steps(str(run_dir)) == [e.step]  # not a multiple of checkpoint.every: written on the signal
    assert (run_dir / "checkpoints" / str(e.step) / CHECKSUMS).exists()
    assert max(read_metrics(str(run_dir))[0]) == e.step
    assert signal.getsignal(signal.SIGINT) is before


def test_failed_save_stops_the_run_at_that_step(tmp_path):
    """Files larger than 16 KiB cannot be written (RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk); the
    tiny model's metrics and config fit, its first checkpoint does not."""
    run_dir = tmp_path / "run"
    argv = ["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=8"] + \
        sum((["--set", o] for o in TINY), [])
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
               "sys.argv = ['falcon-train'] + sys.argv[1:]; runpy.run_module('falcon_jax.train', run_name='__main__')")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    res = subprocess.run([sys.executable, "-c", limited, *argv], capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.startswith("falcon-train: error: saving the checkpoint of step 3") and \
        "File too large" in res.stderr and "There is no earlier checkpoint" in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr and "ERROR:absl" not in res.stderr
    assert os.listdir(run_dir / "checkpoints") == []  # no temporary folder, no half step
    assert max(read_metrics(str(run_dir))[0]) == 3  # stopped at the step whose save failed
    assert "File too large" in (run_dir / "checkpoint-3-error.log").read_text()


def test_sigint_before_the_first_step_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted_while_building(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "build_data", interrupted_while_building)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 130 and err.startswith("falcon-train: interrupted (SIGINT)") and err.count("\n") == 1
