"""The trainer under bad configs and faults: every config error is one line and exit code 2 before any
work; a checkpoint with flipped bits is caught and the previous one used; --resume without a usable
checkpoint refuses unless --resume-or-start; SIGINT stops after the current step with a checkpoint; a
failed save (a write past the file-size limit, as on a full disk) stops the run at that step with one line
and leaves no temporary folder; an unwritable run directory is one line; a step or an evaluation that runs out
of device memory stops the run with the batch and the fixes, keeping what the run wrote.
--resume with another model than the run's refuses and moves nothing; a disk full at the checksum write of a
save keeps the previous checkpoints (keep-N deletes only after the new step is checksummed).
(SIGTERM mid-run and the exact continuation after it: test_train_resume.py.)"""
import errno
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.errors import JaxRuntimeError

from falcon_jax.train import checkpoint, cli, trainer
from falcon_jax.train.checkpoint import CHECKSUMS, CheckpointError, Checkpointer
from falcon_jax.train.config import ConfigError, build_config, resume_mismatch, split_mismatch
from falcon_jax.train.memory import DeviceMemoryError, explain, is_out_of_memory, requested_size, suggest_grad_accum
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
    (["--set", "data.greedy_widths=[2, 40]"], "data.greedy_widths=[2, 40]: must be <= 8, the widest of data.eval_widths"),
    # the greedy prompts are the first rows of each width's eval set: 300 would run (and report) 256
    (["--set", "data.greedy_examples=300"], "data.greedy_examples=300: must be <= data.eval_examples=256"),
    (["--set", "mesh.data=0"], "mesh.data=0: must be a positive integer or -1"),
    (["--set", "model.n_heads=5"], "model: "),
    (["--set", "train.seed=4294967296"], "train.seed=4294967296: must be an integer in [0, 2**32)"),  # = seed 0
    (["--set", "data.seed=1e30"], "data.seed=1000000000000000019884624838656: must be an integer in [0, 2**32)"),
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
    # the run directory itself a file: said so (not "File exists"), and the file kept
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(blocker), *sum((["--set", o] for o in TINY), [])],
                        capsys)
    assert rc == 2 and err == (f"falcon-train: error: the run directory {blocker} is a file, not a folder; choose "
                               f"another one with --run-dir DIR (train.run_dir).\n")
    assert blocker.read_text() == "not a directory"


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """Not a failed save at the end of the training: refused at once, the file kept."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("a file")
    monkeypatch.setattr(trainer, "build_data", lambda cfg: pytest.fail("data built for a run that cannot save"))
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), *sum((["--set", o] for o in TINY), [])],
                        capsys)
    assert rc == 2 and err.startswith(f"falcon-train: error: {run_dir / 'checkpoints'} is a file, not a folder")
    assert err.count("\n") == 1 and "--run-dir" in err and "checkpoint.enabled=false" in err
    assert (run_dir / "checkpoints").read_text() == "a file"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "checkpoints"]  # no config.json, no metrics


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
    assert (run_dir / "width_shares.json").exists()  # a fresh addition run writes its width shares too
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
    # the earlier run's records of steps 3-9 (its final evaluation included) are not this run's
    train, evals = read_metrics(str(run_dir))
    assert sorted(train) == [1, 2] and [e["step"] for e in evals] == [2]


_SLOW_CLEANUP = """
import asyncio, sys
from orbax.checkpoint import checkpoint_manager
original = checkpoint_manager.temporary_paths.cleanup_temporary_paths

async def slow(*args, **kwargs):  # the manager's start-up clean-up of temporary folders, in its thread, takes 1 s
    await asyncio.sleep(1.0)
    return await original(*args, **kwargs)

checkpoint_manager.temporary_paths.cleanup_temporary_paths = slow
from falcon_jax.train.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], every=1, keep=1)
ckpt._quarantine(3)  # a broken step moved aside: the manager is closed and opened again
ckpt.close()
print("closed", flush=True)
"""


def test_closing_waits_for_the_managers_cleanup_thread(tmp_path):
    """A process that exits right after closing its checkpoints (a refused --resume: "no usable checkpoint") printed
    an orbax traceback after its last line when the clean-up thread of a manager was still running at exit."""
    res = subprocess.run([sys.executable, "-c", _SLOW_CLEANUP, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=240, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert res.returncode == 0 and res.stdout == "closed\n", res.stdout + res.stderr
    assert "cannot schedule new futures" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_resume_with_another_model_refuses_and_moves_nothing(tmp_path):
    """The failures this guards against: a wider model quarantining every good checkpoint as "corrupt" (then
    --resume-or-start begins a new run over the old config.json), and another rule with the same parameter shapes
    loading silently."""
    run_dir = tmp_path / "run"

    def cfg(*extra):
        return build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", *extra])

    trainer.run(cfg("train.steps=3"), log=lambda line: None)
    saved = (run_dir / "config.json").read_text()
    for extra, named in (("model.d_model=64", "model.d_model: 32 in the run, 64 here"),
                         ("model.mixer=falcon-3A.3", "model.mixer: 'falcon-1A.3' in the run, 'falcon-3A.3' here")):
        with pytest.raises(RunDirError, match=rf"--resume: .*was trained with another model.*{named}"):
            trainer.run(cfg("train.steps=6", extra), resume_or_start=True, log=lambda line: None)
        assert checkpoint_steps(str(run_dir)) == [3] and not (run_dir / "checkpoints_corrupt").exists()
        assert (run_dir / "config.json").read_text() == saved
    # without the run's config.json, a checkpoint that verifies but does not fit is refused, not moved aside
    (run_dir / "config.json").unlink()
    with pytest.raises(RunDirError, match=r"checkpoint 3 in .* is intact .* but does not fit this model"):
        trainer.run(cfg("train.steps=6", "model.d_model=64"), resume=True, log=lambda line: None)
    assert checkpoint_steps(str(run_dir)) == [3] and not (run_dir / "checkpoints_corrupt").exists()
    # and one that fits another model's shapes is compared with the config saved in the checkpoint (it loaded)
    with pytest.raises(RunDirError, match=r"--resume: checkpoint 3 in .* was saved from another model than this "
                                          r"command's \(model.mixer: 'falcon-1A.3' in the run, 'falcon-3A.3' here\)"):
        trainer.run(cfg("train.steps=6", "model.mixer=falcon-3A.3"), resume=True, log=lambda line: None)
    assert checkpoint_steps(str(run_dir)) == [3] and not (run_dir / "checkpoints_corrupt").exists()
    assert not (run_dir / "config.json").exists()


def test_resume_with_fewer_steps_than_the_checkpoint_refuses_and_changes_nothing(tmp_path):
    """The failure this guards against: the loop runs no step and the final evaluation of step 3's parameters is
    recorded as step 2's (and config.json then says train.steps=2)."""
    run_dir = tmp_path / "run"

    def cfg(steps, *extra):
        return build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", f"train.steps={steps}",
                                                                      *extra])

    trainer.run(cfg(3), log=lambda line: None)
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    # another data setting too: the refused command must not rewrite the run's width_shares.json with its own
    for resume, extra in (("resume", []), ("resume_or_start", []), ("resume", ["data.train_max_width=4"])):
        with pytest.raises(RunDirError, match=rf"--resume: the latest checkpoint in {run_dir / 'checkpoints'} is step "
                                              r"3, past train.steps=2.*--set train.steps=3"):
            trainer.run(cfg(2, *extra), **{resume: True}, log=lambda line: None)
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files
        assert checkpoint_steps(str(run_dir)) == [3]


def test_resume_mismatch_ignores_the_implementation_and_the_training_schedule():
    base = build_config(preset="addition-tiny", overrides=TINY)
    same = build_config(preset="addition-tiny", overrides=TINY + ["model.form=chunk", "model.impl=xla", "model.remat=true",
                                                                   "train.steps=99", "optim.lr=1e-4"])
    assert resume_mismatch(base.to_dict(), same) == []
    other = build_config(preset="addition-tiny", overrides=TINY + ["model.n_layers=2", "model.window=3"])
    assert [d.split(":")[0] for d in resume_mismatch(base.to_dict(), other)] == ["model.n_layers", "model.window"]


def test_disk_full_at_the_checksum_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """keep=1: the failure this guards against is orbax deleting step 3 when step 6 is renamed into place, and
    the failed checksum write then removing step 6: no checkpoint left."""
    ck = Checkpointer(str(tmp_path), every=1, keep=1, log=lambda line: None)
    assert ck.save(3, {"w": jnp.arange(4.0)}, {"data": {"step": 3}})
    real = checkpoint.write_checksums

    def full(step_dir):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(step_dir, CHECKSUMS + ".tmp"))

    monkeypatch.setattr(checkpoint, "write_checksums", full)
    with pytest.raises(CheckpointError, match=r"step 6 .*No space left on device: '.*/checkpoints/6/checksums"
                                              r".json.tmp'.*The last good checkpoint is step 3"):
        ck.save(6, {"w": jnp.arange(4.0) + 1}, {"data": {"step": 6}})
    monkeypatch.setattr(checkpoint, "write_checksums", real)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]
    ck = Checkpointer(str(tmp_path), every=1, keep=1, log=lambda line: None)
    step, got, meta = ck.restore_latest({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    assert step == 3 and meta["data"]["step"] == 3
    np.testing.assert_array_equal(got["w"], np.arange(4.0))
    assert ck.save(9, {"w": jnp.zeros(4)}, {"data": {"step": 9}})  # a good save still keeps only `keep`
    ck.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["9"]


def test_a_process_whose_main_failed_the_checksum_write_stops_before_the_collective_delete(tmp_path, monkeypatch):
    """Another process of a multi-process run: process 0's checksum write failed (told by the broadcast), so
    this one raises too instead of going on to the keep-N delete, which would wait for process 0 forever."""
    ck = Checkpointer(str(tmp_path), every=1, keep=1, log=lambda line: None)
    assert ck.save(3, {"w": jnp.arange(4.0)}, {"data": {"step": 3}})
    ck.is_main = False  # this process writes no checksums; process 0's outcome comes by the broadcast
    deletes = []
    monkeypatch.setattr(ck.manager, "delete", lambda step: deletes.append(step))
    monkeypatch.setattr(checkpoint, "checksums_written_everywhere", lambda written: False)
    with pytest.raises(CheckpointError, match="process 0 could not write the checksums of step 6"):
        ck.save(6, {"w": jnp.arange(4.0) + 1}, {"data": {"step": 6}})
    assert deletes == []


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
    # the failure is the log's first line: the log is written under the same limit and may be cut short
    assert "File too large" in (run_dir / "checkpoint-3-error.log").read_text().splitlines()[0]


def test_a_disk_error_writing_the_metrics_says_what_is_kept_and_how_to_continue(tmp_path, capsys, monkeypatch):
    """More than the OS error alone (``[Errno 28] No space left on device: '.../metrics.jsonl'``)."""
    from falcon_jax.train import rundir

    run_dir = tmp_path / "run"
    real, writes = rundir.Logger.write, []

    def write(self, rec):
        writes.append(rec)
        if rec.get("kind") == "train" and rec["step"] == 5:  # after the checkpoint of step 3
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return real(self, rec)

    monkeypatch.setattr(rundir.Logger, "write", write)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=9",
                         *sum((["--set", o] for o in TINY), [])], capsys)
    assert rc == 1 and err == (f"falcon-train: error: [Errno 28] No space left on device: '{run_dir / 'metrics.jsonl'}'"
                               f"; the checkpoints in {run_dir} (the latest: step 3) are kept: fix the cause, then "
                               f"continue with: falcon-train --run-dir {run_dir} --resume\n"), err
    assert checkpoint_steps(str(run_dir)) == [3]


def test_sigint_before_the_first_step_is_one_line(tmp_path, capsys, monkeypatch):
    def interrupted_while_building(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "build_data", interrupted_while_building)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 130 and err.startswith("falcon-train: interrupted (SIGINT)") and err.count("\n") == 1


# ----------------------------------------------------------------------------- divergence
def _poisoned_step(monkeypatch, at, value):
    """The trainer's own step, except that the ``at``-th call multiplies the parameters by ``value`` first (NaN:
    every later loss is NaN, as after a diverged update)."""
    real = trainer.make_train_step

    def make(graphdef, tx, shardings=None):
        step, calls = real(graphdef, tx, shardings), []

        def poisoned(params, rest, opt_state, batch):
            calls.append(1)
            if len(calls) == at:
                params = jax.tree.map(lambda p: p * value, params)
            return step(params, rest, opt_state, batch)

        return poisoned

    monkeypatch.setattr(trainer, "make_train_step", make)


def test_a_diverged_run_stops_before_saving_and_keeps_the_last_finite_checkpoint(tmp_path, monkeypatch, capsys):
    """The failure this guards against: the run going on with NaN parameters, saving them at steps 6 and 9,
    deleting step 3 (keep=1: the only finite checkpoint) and exiting 0."""
    run_dir = tmp_path / "run"
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=9",
                                                                 "checkpoint.keep=1", "train.log_every=2"])
    _poisoned_step(monkeypatch, at=5, value=jnp.nan)
    with pytest.raises(trainer.TrainingDiverged) as info:
        trainer.run(cfg, log=lambda line: None)
    msg = str(info.value)
    assert info.value.step == 5 and msg.startswith("training diverged: the loss of step 5 is nan (grad_norm nan)"), msg
    for part in ("Nothing was saved from step 5 on", f"the checkpoints (the latest: step 3) in {run_dir} are kept",
                 "a lower optim.lr (now 0.002)", f"falcon-train --run-dir {run_dir} --resume --set optim.lr=0.001"):
        assert part in msg, (part, msg)
    assert checkpoint_steps(str(run_dir)) == [3] and (run_dir / "checkpoints" / "3" / CHECKSUMS).exists()
    train_records, _ = read_metrics(str(run_dir))
    assert sorted(train_records) == [1, 2, 3, 4, 5, 6]  # recorded as they were, up to the log point that saw it
    assert all(np.isfinite(train_records[s]["loss"]) for s in (1, 2, 3, 4)) and np.isnan(train_records[5]["loss"])
    # the command line: one message, exit code 1
    monkeypatch.setattr(trainer, "run", lambda *a, **k: (_ for _ in ()).throw(info.value))
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(tmp_path / "other")], capsys)
    assert rc == 1 and err == f"falcon-train: error: {msg}\n"


# ----------------------------------------------------------------------------- out of device memory
# the message of the first step of addition-packed on one H200 with XLA_PYTHON_CLIENT_PREALLOCATE=false
OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 98.42GiB with allocator GPU_0_bfc on device 0. "
       "[executable_name='jit_step']")


class _Unreadable:
    """An output of a program that failed on the device after it was launched: waiting on it or reading it
    raises the failure, as a JAX array does after an asynchronous execution error."""

    def __init__(self, message):
        self.message = message

    def block_until_ready(self):
        raise JaxRuntimeError(self.message)

    def __array__(self, *args, **kwargs):
        raise JaxRuntimeError(self.message)

    def copy_to_host_async(self):
        pass


def _failing_step(monkeypatch, fail_at, message, deferred):
    """The trainer's own step, except that the ``fail_at``-th call fails with ``message``: at the call
    (``deferred=False``: a program that cannot be compiled or launched), or in its outputs (a program that
    fails on the device after it was launched), which then fail every later step that takes them.
    Returns the errors raised at the call."""
    real, calls, raised = trainer.make_train_step, [], []

    def make(graphdef, tx, shardings=None):
        step = real(graphdef, tx, shardings)

        def failing(params, rest, opt_state, batch):
            calls.append(None)
            failed = any(isinstance(x, _Unreadable) for x in jax.tree.leaves(params))
            if len(calls) < fail_at and not failed:
                return step(params, rest, opt_state, batch)
            if not deferred:
                raised.append(JaxRuntimeError(message))
                raise raised[-1]
            bad = lambda tree: jax.tree.map(lambda _: _Unreadable(message), tree)  # noqa: E731
            return bad(params), bad(opt_state), {k: _Unreadable(message) for k in ("loss", "grad_norm", "tokens")}

        return failing

    monkeypatch.setattr(trainer, "make_train_step", make)
    return raised


def test_out_of_memory_in_a_later_step_names_the_step_the_fix_and_keeps_the_run(tmp_path, monkeypatch):
    """Step 7 fails on the device; its error surfaces at step 8's wait (a checkpoint step).  The error names
    step 7, the size and ``--set train.grad_accum=4`` (batch 8 in 2 micro-batches), chains JAX's error, and
    the run keeps config.json, the records of steps 1-6 and the checkpoint of step 4; nothing is saved of
    steps 7 or 8."""
    run_dir = tmp_path / "run"
    cfg = build_config(preset="addition-tiny", overrides=TINY + [
        f"train.run_dir={run_dir}", "train.steps=10", "train.grad_accum=2", "checkpoint.every=4"])
    _failing_step(monkeypatch, fail_at=7, message=OOM, deferred=True)
    with pytest.raises(DeviceMemoryError) as info:
        trainer.run(cfg, log=lambda line: None)
    e = info.value
    assert type(e.__cause__) is JaxRuntimeError and str(e.__cause__) == OOM
    assert (e.program, e.step, e.requested, e.grad_accum) == ("train step", 7, "98.42 GiB", 4)
    msg = str(e)
    assert msg.startswith("the train step ran out of device memory at step 7 (it tried to allocate 98.42 GiB)."), msg
    for part in ("train.batch_size=8", "train.grad_accum=2 micro-batches of 4 rows", "mesh data=1 x fsdp=1",
                 "1. --set train.grad_accum=4: the step then runs micro-batches of 2 rows",
                 "a smaller train.batch_size", "more devices",
                 f"(the latest: step 4) in {run_dir} are kept; continue with the fix: "
                 f"falcon-train --run-dir {run_dir} --resume --set train.grad_accum=4"):
        assert part in msg, (part, msg)
    assert "XLA_PYTHON_CLIENT" not in msg  # the GPU allocator's settings: not on CPU
    assert json.loads((run_dir / "config.json").read_text()) == cfg.to_dict()
    train_records, _ = read_metrics(str(run_dir))
    assert sorted(train_records) == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 for r in train_records.values())
    assert checkpoint_steps(str(run_dir)) == [4]
    assert (run_dir / "checkpoints" / "4" / CHECKSUMS).exists()


def test_out_of_memory_at_the_first_step_is_a_message_and_exit_1(tmp_path, capsys, monkeypatch):
    """The step fails at its call (as a program too large to compile or launch).  Every row of the batch is
    already its own micro-batch, so no train.grad_accum helps and none is offered."""
    run_dir = tmp_path / "run"
    _failing_step(monkeypatch, fail_at=1, message=OOM, deferred=False)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.grad_accum=8",
                         *sum((["--set", o] for o in TINY), [])], capsys)
    assert rc == 1 and "Traceback" not in err, err
    assert err.startswith("falcon-train: error: the train step ran out of device memory at the first step "
                          "(it tried to allocate 98.42 GiB)."), err
    assert "train.grad_accum cannot go higher: each of the 1 data-parallel device(s) holds 1 row(s)" in err
    assert "--set train.grad_accum=" not in err and "--resume " not in err
    assert f"config.json and metrics.jsonl in {run_dir} are kept (no checkpoint yet): run the command again with " \
           f"--resume-or-start" in err
    assert json.loads((run_dir / "config.json").read_text())["train"]["grad_accum"] == 8
    assert read_metrics(str(run_dir))[0] == {} and checkpoint_steps(str(run_dir)) == []


@pytest.mark.parametrize("part, program, names", [
    ("addition_accuracy", "evaluation", ["data.eval_examples=8 problems per width", "1. a smaller data.eval_examples"]),
    ("addition_greedy", "greedy evaluation", ["data.greedy_examples=4 problems for each of the 1 data.greedy_widths",
                                              "1. a smaller data.greedy_examples or fewer data.greedy_widths"]),
])
def test_out_of_memory_in_the_evaluation_names_its_batch(tmp_path, monkeypatch, part, program, names):
    """The final evaluation's teacher-forced part or its free-running decoding runs out (a message that counts
    bytes); the steps before it and their checkpoint stay (and the teacher-forced record when the decoding ran
    out), and the fix is that part's batch, not train.grad_accum."""
    from falcon_jax.train import evaluate

    message = "RESOURCE_EXHAUSTED: Out of memory allocating 3221225472 bytes."

    def out_of_memory(*args, **kwargs):
        raise JaxRuntimeError(message)

    monkeypatch.setattr(evaluate, part, out_of_memory)
    run_dir = tmp_path / "run"
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=2",
                                                                 "checkpoint.every=2", "data.greedy_widths=[2]"])
    with pytest.raises(DeviceMemoryError) as info:
        trainer.run(cfg, log=lambda line: None)
    e = info.value
    assert str(e.__cause__) == message and (e.program, e.step, e.requested, e.grad_accum) == \
        (program, 2, "3.00 GiB", None)
    assert str(e).startswith(f"the {program} of step 2 ran out of device memory (it tried to allocate 3.00 GiB).")
    assert all(n in str(e) for n in names) and "train.grad_accum" not in str(e), str(e)
    train_records, evals = read_metrics(str(run_dir))
    assert sorted(train_records) == [1, 2] and checkpoint_steps(str(run_dir)) == [2]
    assert [r["step"] for r in evals] == ([2] if part == "addition_greedy" else [])


@pytest.mark.parametrize("deferred", [False, True])
def test_a_runtime_error_that_is_not_out_of_memory_passes_through(tmp_path, monkeypatch, deferred):
    message = "INTERNAL: an XLA failure that is not about memory"
    raised = _failing_step(monkeypatch, fail_at=1, message=message, deferred=deferred)
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(JaxRuntimeError) as info:
        trainer.run(cfg, log=lambda line: None)
    assert type(info.value) is JaxRuntimeError and str(info.value) == message and info.value.__cause__ is None
    if not deferred:
        assert raised == [info.value]  # the very object the step raised


@pytest.mark.parametrize("message, oom, size", [
    (OOM, True, "98.42 GiB"),
    ("RESOURCE_EXHAUSTED: Out of memory allocating 105678889943 bytes.", True, "98.42 GiB"),
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 12.00G. That was not possible. "
     "There are 5.50G free.", True, "12.00G"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm.", True, None),
    ("RESOURCE_EXHAUSTED: Received message larger than max (5242880 vs. 4194304)", False, None),
    ("INTERNAL: Generated function failed", False, None),
])
def test_out_of_memory_messages_and_their_sizes(message, oom, size):
    assert is_out_of_memory(JaxRuntimeError(message)) is oom
    if oom:
        assert requested_size(message) == size


def test_suggested_grad_accum_halves_the_micro_batch_and_splits_over_the_shards():
    assert suggest_grad_accum(512, 1) == 2  # addition-packed
    assert suggest_grad_accum(48, 16) == 48  # 32 does not divide 48
    assert suggest_grad_accum(64, 4, shards=8) == 8
    assert suggest_grad_accum(64, 8, shards=8) is None  # one row per device already
    for batch in range(1, 49):
        for accum in (a for a in range(1, batch + 1) if batch % a == 0):
            for shards in (s for s in (1, 2, 4, 8) if (batch // accum) % s == 0):
                got = suggest_grad_accum(batch, accum, shards)
                fits = [a for a in range(accum + 1, batch + 1) if batch % a == 0 and (batch // a) % shards == 0
                        and batch // a <= batch // accum // 2]
                assert got == (fits[0] if fits else None), (batch, accum, shards)


def test_the_gpu_allocator_settings_are_named_only_when_they_leave_memory_unused():
    """addition-packed's first step with XLA_PYTHON_CLIENT_PREALLOCATE=false on a GPU of 140 GiB (JAX's
    default limit: 75% of it)."""
    cfg = build_config(preset="addition-packed")
    mesh = {"data": 1, "fsdp": 1, "seq": 1, "tensor": 1}

    def message(platform, env):
        return str(explain(JaxRuntimeError(OOM), cfg, program="train step", step=1, row_tokens=1024, mesh_shape=mesh,
                           shards=1, platform=platform, limit_bytes=int(0.75 * 140 * 2**30), checkpoints=[], env=env))

    msg = message("gpu", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert msg.startswith("the train step ran out of device memory at the first step (it tried to allocate "
                          "98.42 GiB; JAX may use 105.00 GiB per device in all)."), msg
    for part in ("train.batch_size=512 rows of 1,024 tokens (data.seq_len) in train.grad_accum=1 micro-batch of "
                 "512 rows", "1. --set train.grad_accum=2", "2. --set model.remat=true",
                 "3. a smaller train.batch_size or data.seq_len", "4. more devices",
                 "5. JAX uses at most 75% of a GPU's memory by default: "
                 "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9", "unset XLA_PYTHON_CLIENT_PREALLOCATE=false",
                 "run the command again with --resume-or-start (it starts over from step 0 in that folder) and the fix "
                 "(--set train.grad_accum=2)."):
        assert part in msg, (part, msg)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 caps" in message("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    cfg.model["remat"] = True  # already on: not offered again
    assert "model.remat" not in message("gpu", {})
    cfg.model.pop("remat")
    greedy = str(explain(JaxRuntimeError(OOM), cfg, program="greedy evaluation", step=2000, row_tokens=1024,
                         mesh_shape=mesh, shards=1, platform="cpu", limit_bytes=None, checkpoints=[2000], env={}))
    assert greedy.startswith("the greedy evaluation of step 2000 ran out of device memory (it tried to allocate "
                             "98.42 GiB).\nIt decodes data.greedy_examples=128 problems for each of the 6 "
                             "data.greedy_widths in one batch"), greedy
    assert "train.grad_accum" not in greedy and greedy.endswith("--run-dir runs/addition-packed --resume")
    for platform, env in (("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.93"}), ("tpu", {})):
        assert "XLA_PYTHON_CLIENT" not in message(platform, env) and "  5. " not in message(platform, env)


@pytest.mark.parametrize("text", ['{"model": {"d_model": 3', "[1, 2]", "\xff\xfe"])
def test_a_cut_or_foreign_config_file_is_one_line(tmp_path, capsys, text):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "3").mkdir(parents=True)
    (run_dir / "config.json").write_bytes(text.encode("latin-1"))
    rc, out, err = _cli(["--run-dir", str(run_dir), "--resume"], capsys)
    assert rc == 2 and out == "" and err.startswith(f"falcon-train: error: config file '{run_dir / 'config.json'}'")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("widths", ["[]", "[5]"])
def test_eval_widths_without_an_in_distribution_width_finish_the_run(tmp_path, widths):
    """The failure this guards against: the run trains, then stops with a TypeError in the final evaluation's
    message."""
    cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={tmp_path / 'run'}", "train.steps=2",
                                                                 f"data.eval_widths={widths}", "checkpoint.every=0"])
    lines = []
    summary = trainer.run(cfg, log=lines.append)
    assert any("best in-distribution so far: n/a (no eval width <= data.train_max_width)" in ln for ln in lines)
    assert summary["final_step"] == 2 and checkpoint_steps(str(tmp_path / "run")) == [2]


def test_text_corpus_too_short_for_a_window_or_a_validation_window(tmp_path):
    """A training split of exactly one window trains; a validation split with no window is a config error
    unless validation is off (every evaluation would record nothing)."""
    build_data = trainer.build_data
    (tmp_path / "one.txt").write_text("x" * 15)  # BOS + 15 bytes + EOS = 17 tokens = data.seq_len + 1
    sets = [f"data.paths={tmp_path / 'one.txt'}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(ConfigError, match=r"is one document.*gave it to training.*data.val_batches=0"):
        build_data(build_config(preset="lm-tiny", overrides=sets))
    data = build_data(build_config(preset="lm-tiny", overrides=sets + ["data.val_batches=0"]))
    assert data.num_train_starts == 1 and data.num_val_windows == 0
    with pytest.raises(ConfigError, match=r"training split has 17 tokens.*one window of 18 tokens \(data.seq_len"):
        build_data(build_config(preset="lm-tiny", overrides=sets[:1] + ["data.seq_len=17", sets[2],
                                                                         "data.val_batches=0"]))


def test_a_second_signal_stops_at_once_and_says_how_to_continue(capsys):
    """The second SIGTERM (e.g. during the checkpoint the first one asked for) ends the process at once: its
    line names what is lost and the two ways to continue."""
    from falcon_jax.train.preemption import StopRequest
    previous = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        stop._handle(signal.SIGTERM, None)
        assert stop.requested(1) and "stopping after the current step" in capsys.readouterr().err
        with pytest.raises(SystemExit) as e:
            stop._handle(signal.SIGTERM, None)
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) == previous
    err = capsys.readouterr().err
    assert "without a checkpoint of the current step" in err and "--resume-or-start" in err


def test_resume_names_the_settings_that_changed_and_whether_the_batches_do(tmp_path):
    """A resumed run says which settings differ from its checkpoint's; a changed batch size or data setting
    also says the batches now differ from an uninterrupted run's.  Same settings: no such line."""
    run_dir = tmp_path / "run"

    def resume(*overrides):
        lines = []
        cfg = build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", *overrides])
        trainer.run(cfg, resume=True, log=lines.append)
        return [line for line in lines if line.startswith("[resume] settings changed")]

    trainer.run(build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=3"]),
                log=lambda line: None)
    assert resume("train.steps=3") == []
    [line] = resume("train.steps=6", "optim.lr=0.001")
    assert "checkpoint 3: " in line and "train.steps 3 -> 6" in line and "optim.lr 0.002 -> 0.001" in line
    assert "batches" not in line
    [line] = resume("train.steps=9", "train.batch_size=4", "data.seed=5")
    assert "train.batch_size 8 -> 4" in line and "data.seed 0 -> 5" in line and "train.steps 6 -> 9" in line
    assert line.endswith("the batches from here on differ from an uninterrupted run's")


def test_a_second_process_in_a_run_folder_is_refused_and_the_lock_goes_with_the_run(tmp_path, capsys):
    """Two processes in one folder (a job started twice) both exited 0, leaving one's config, the other's last
    checkpoint and their metrics interleaved.  The folder's lock is held by another process here (a flock on its
    own open file, as another process's would be): the run is refused naming that PID, and writes nothing."""
    import fcntl
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, b"4242")
        rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=2",
                             *sum((["--set", o] for o in TINY), [])], capsys)
        assert rc == 2 and f"another process (pid 4242) is training in {run_dir}" in err, err
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written
    finally:
        os.close(fd)
    # free again: the run trains, and its lock is released when it returns (a later run in this process or any
    # other may take the folder)
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=2",
                         *sum((["--set", o] for o in TINY), [])], capsys)
    assert rc == 0, err
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the run still held it
    finally:
        os.close(fd)


def test_a_run_folder_with_a_bracket_in_its_path_is_refused_before_any_work(tmp_path, capsys):
    """orbax finds a checkpoint's per-process parts with a glob under the folder's path: '[0]' read as a character
    class skipped their merge, the run exited 0, and none of its checkpoints could be restored."""
    run_dir = tmp_path / "seed=[0]"
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=2",
                         *sum((["--set", o] for o in TINY), [])], capsys)
    assert rc == 2 and "has a '[' in its path" in err and "checkpoint.enabled=false" in err, err
    assert not (run_dir / "config.json").exists() and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("setting, named", [
    # split seed 15 leaves width 1 (100 problems) no held-out one at the default share: found at the first
    # evaluation before, after training up to it, as a traceback with exit code 1
    ("data.split_seed=15", "data.eval_widths: width 1 has no held-out problem with data.split_seed=15"),
    # a traceback from the training draw before, with config.json already written (the rerun was refused)
    ("data.heldout_frac=0.999", "data.heldout_frac=0.999: must be in (0, 0.5]"),
])
def test_an_addition_split_that_cannot_serve_the_run_is_refused_before_any_work(tmp_path, capsys, setting, named):
    run_dir = tmp_path / "run"
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", setting], capsys)
    assert rc == 2 and named in err and err.count("\n") == 1, err
    assert not run_dir.exists()


# one optimizer chain with both slots either way (train/optim.py): switching clipping on is switching it off backwards
@pytest.mark.parametrize("first,then", [("1.0", "0"), pytest.param("0", "1.0", marks=pytest.mark.slow)])
def test_gradient_clipping_can_be_switched_on_or_off_on_resume(tmp_path, capsys, first, then):
    """Optimizer settings may change on resume; clip_norm=0 left the clip out of the optimizer chain, so the state's
    layout changed and the checkpoint was refused as 'intact but does not fit this model'."""
    tiny = sum((["--set", o] for o in TINY), [])
    run_dir = tmp_path / f"clip-{first}"
    rc, _, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), *tiny, "--set", "train.steps=3",
                       "--set", f"optim.clip_norm={first}"], capsys)
    assert rc == 0, err
    rc, out, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=6",
                         "--set", f"optim.clip_norm={then}"], capsys)
    assert rc == 0 and "restored step 3" in out, (first, then, err)
    assert checkpoint_steps(run_dir)[-1] == 6


def test_a_text_run_stopped_at_an_evaluation_step_evaluates_it_on_resume(tmp_path, capsys):
    """The evaluation due at the stop step is made when the run resumes, for text runs too (only addition runs
    made it: the step's validation loss was lost for good)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i}: fast weights are written and read, {i * 7 % 13} times."
                                  for i in range(80)))
    args = ["--preset", "lm-tiny", "--set", f"data.paths={corpus}", "--set", "data.seq_len=16", "--set",
            "train.batch_size=4", "--set", "data.val_batches=1", "--set", "data.val_frac=0.2", "--set",
            "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_layers=1", "--set", "train.plots=false",
            "--set", "optim.warmup_steps=1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set",
            "train.eval_every=2", "--set", "train.steps=4", "--set", "checkpoint.every=100"]
    assert _cli([*args, "--run-dir", str(tmp_path / "ref")], capsys)[0] == 0
    ref = {e["step"]: e["val_loss"] for e in read_metrics(tmp_path / "ref")[1]}
    assert sorted(ref) == [2, 4]
    run_dir = tmp_path / "cut"
    assert _cli([*args, "--run-dir", str(run_dir), "--set", "train.time_limit_s=1"], capsys)[0] == 0  # step 1
    for _ in range(3):  # one step a command: the second stops at the evaluation step 2 before evaluating it
        assert _cli(["--run-dir", str(run_dir), "--resume"], capsys)[0] == 0
    got = {e["step"]: e["val_loss"] for e in read_metrics(run_dir)[1]}
    assert got == ref


def test_a_text_run_resumed_on_other_text_is_refused(tmp_path, capsys, monkeypatch):
    """data.paths are read relative to the working directory and the byte tokenizer is the same for any text: a
    resume from another directory, or after the files were edited, trained on other text without a word.  The
    checkpoint records the corpus by content; the same files under the same relative path from elsewhere resume."""
    def corpus(folder, word):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "c.txt").write_text("\n\n".join(f"{word} {i}: fast weights, read and written." for i in range(60)))

    corpus(tmp_path / "a" / "docs", "alpha")
    corpus(tmp_path / "b" / "docs", "beta")
    corpus(tmp_path / "c" / "docs", "alpha")  # a copy of a's
    args = ["--preset", "lm-tiny", "--set", "data.paths=docs", "--set", "data.seq_len=16", "--set",
            "train.batch_size=4", "--set", "data.val_batches=1", "--set", "data.val_frac=0.2", "--set",
            "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_layers=1", "--set", "train.plots=false",
            "--set", "optim.warmup_steps=1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set",
            "train.eval_every=0", "--set", "train.steps=2", "--set", "checkpoint.every=2"]
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path / "a")
    assert _cli([*args, "--run-dir", str(run_dir)], capsys)[0] == 0
    monkeypatch.chdir(tmp_path / "b")
    rc, _, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=4"], capsys)
    assert rc == 2 and "was trained on other text than data.paths=['docs'] reads now from" in err, err
    assert checkpoint_steps(run_dir) == [2]  # nothing moved
    monkeypatch.chdir(tmp_path / "c")  # the same text from another directory
    rc, _, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=4"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("empty_rows", [0, 3])
def test_a_text_run_resumed_with_another_text_format_says_its_batches_may_differ(tmp_path, capsys, monkeypatch,
                                                                                 empty_rows):
    """How rows become token streams is versioned (text.CACHE_FORMAT: format 2 leaves rows of empty text out).  A
    checkpoint records the format its run read; a resume under another one, or from a checkpoint that records
    none over a corpus with empty rows, continues on other batches: it says so (it continued without a word)."""
    rows = [{"text": f"row {i}: fast weights are written and read, {i * 7 % 13} times."} for i in range(60)]
    rows[5:5 + empty_rows] = [{"text": " "}] * empty_rows
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--preset", "lm-tiny", "--set", f"data.paths={corpus}", "--set", "data.seq_len=16", "--set",
            "train.batch_size=4", "--set", "data.val_batches=1", "--set", "data.val_frac=0.2", "--set",
            "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_layers=1", "--set", "train.plots=false",
            "--set", "optim.warmup_steps=1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set",
            "train.eval_every=0", "--set", "train.steps=2", "--set", "checkpoint.every=1"]
    run_dir = tmp_path / "run"
    for saved in (trainer.CACHE_FORMAT, trainer.CACHE_FORMAT - 1, None):
        with monkeypatch.context() as m:
            m.setattr(trainer, "CACHE_FORMAT", saved)  # the format the checkpoints record
            assert _cli([*args, "--run-dir", str(run_dir), "--resume-or-start"], capsys)[0] == 0
        rc, out, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=3"], capsys)
        assert rc == 0, err
        noted = [line for line in out.splitlines() if "may differ from the ones the run had" in line]
        if saved == trainer.CACHE_FORMAT or (saved is None and not empty_rows):
            assert not noted, (saved, out)
        else:
            assert len(noted) == 1 and "[resume] checkpoint 2 " in noted[0], (saved, out)
            assert (f"{empty_rows} rows of empty" in noted[0]) == bool(empty_rows), noted
            assert ("does not record" in noted[0]) == (saved is None), noted
        shutil.rmtree(run_dir)


def test_one_file_under_two_spellings_is_read_once(tmp_path, monkeypatch):
    from falcon_jax.train.text import expand_paths
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "s.txt").write_text("text")
    monkeypatch.chdir(tmp_path)
    assert expand_paths(["small", "./small", str(tmp_path / "small")]) == [os.path.join(".", "small", "s.txt")]


def test_a_one_document_corpus_says_so(tmp_path, capsys):
    """A .txt without blank lines is one document; the per-document split left validation (or training) empty, and
    the errors sent the user from raising data.val_frac to lowering it.  Without validation it trains."""
    corpus = tmp_path / "novel.txt"
    corpus.write_text("\n".join(f"line {i} of one long story without blank lines." for i in range(200)))
    args = ["--preset", "lm-tiny", "--set", f"data.paths={corpus}", "--set", "data.seq_len=16", "--set",
            "train.batch_size=4", "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set",
            "model.n_layers=1", "--set", "train.plots=false", "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", "train.steps=2", "--set", "checkpoint.enabled=false"]
    for val_frac in ("0.05", "0.9"):
        rc, _, err = _cli([*args, "--run-dir", str(tmp_path / f"r{val_frac}"), "--set", f"data.val_frac={val_frac}"],
                          capsys)
        assert rc == 2 and "is one document" in err and "blank-line-separated" in err, err
        assert ("gave it to training" in err and "data.val_batches=0" in err) if val_frac == "0.05" else \
            ("gave it to validation" in err and "data.val_frac=0 and data.val_batches=0" in err), err
    rc, _, err = _cli([*args, "--run-dir", str(tmp_path / "r0"), "--set", "data.val_batches=0"], capsys)
    assert rc == 0, err


def test_a_checkpoint_folder_renamed_to_another_step_is_named(tmp_path, capsys):
    """A step folder copied or renamed under another number was a RuntimeError traceback (exit 1)."""
    run_dir = tmp_path / "run"
    tiny = sum((["--set", o] for o in TINY), [])
    assert _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), *tiny, "--set", "train.steps=3"],
                capsys)[0] == 0
    os.rename(run_dir / "checkpoints" / "3", run_dir / "checkpoints" / "30")
    rc, _, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=40"], capsys)
    assert rc == 2 and "holds the state of step 3 (its data position), not of step 30" in err, err
    assert err.count("\n") == 1 and checkpoint_steps(run_dir) == [30]


def test_a_signal_during_the_final_evaluation_stops_it_and_says_so(tmp_path, capsys, monkeypatch):
    """SIGINT after the last step printed 'stopping after the current step and writing a checkpoint', then the
    evaluation ran on and the command exited 0.  Now it stops the evaluation: exit 130, the last step's checkpoint
    kept, and --resume makes the final evaluation."""
    real = trainer.ev.addition_accuracy
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(trainer.ev, "addition_accuracy", interrupted)
    run_dir = tmp_path / "run"
    tiny = sum((["--set", o] for o in TINY), [])
    rc, out, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), *tiny, "--set", "train.steps=3",
                         "--set", "train.eval_every=0"], capsys)
    assert rc == 130, (rc, err)
    assert "every step has run: stopping the final evaluation" in err
    assert "stopped by SIGINT after step 3; checkpoint of step 3 written" in err
    assert checkpoint_steps(run_dir) == [3] and not (run_dir / "report.txt").exists()
    rc, out, err = _cli(["--run-dir", str(run_dir), "--resume"], capsys)
    assert rc == 0 and (run_dir / "report.txt").exists(), err
    assert [e["step"] for e in read_metrics(run_dir)[1]] == [3]


@pytest.mark.parametrize("name", ["report.txt", "width_shares.json", "loss.png", "accuracy_vs_width.png"])
def test_a_new_run_does_not_replace_a_report_or_plot_in_its_folder(tmp_path, capsys, name):
    """Only config.json, metrics.jsonl and checkpoints/ were protected: a file of the same name as a run's report
    or plots (a user's notes, another run's report) was overwritten without a word."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).write_text("mine")
    rc, _, err = _cli(["--preset", "addition-tiny", "--run-dir", str(run_dir), "--set", "train.steps=2",
                       *sum((["--set", o] for o in TINY), [])], capsys)
    assert rc == 2 and f"already holds a run without checkpoints ({name})" in err, err
    assert (run_dir / name).read_text() == "mine"


def test_settings_of_the_other_data_kind_are_named_as_not_read():
    """data.paths on an addition run (a forgotten data.kind=text), data.pack on a text run: trained without a
    word before.  The presets' own settings give no note."""
    from falcon_jax.train.report import start_lines
    cfg = build_config(preset="addition-tiny", overrides=["data.paths=corpus", "data.tokenizer=bpe"])
    assert "  note: not read with data.kind='addition': data.paths=['corpus'], data.tokenizer='bpe'" in start_lines(cfg)
    cfg = build_config(preset="lm-tiny", overrides=["data.pack=true", "data.train_max_width=20"])
    assert any(ln.startswith("  note: not read with data.kind='text': data.train_max_width=20, data.pack=True")
               for ln in start_lines(cfg))
    for preset, extra in (("addition-tiny", []), ("addition-packed", []), ("lm-tiny", ["data.paths=corpus"])):
        assert not any("not read with" in ln for ln in start_lines(build_config(preset=preset, overrides=extra)))


def test_resume_with_another_evaluation_split_is_refused_and_changes_nothing(tmp_path):
    """The failure this guards against: --resume with another data.split_seed or data.heldout_frac (addition), or
    data.val_frac or data.text_key (text), was accepted with a "settings changed" line, and every evaluation from
    there on was drawn from problems (documents) that the run had trained on, compared with the earlier ones."""
    run_dir = tmp_path / "run"

    def cfg(*extra):
        return build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=3",
                                                                      *extra])

    trainer.run(cfg(), log=lambda line: None)
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    for extra, named in ((["data.split_seed=5"], r"data.split_seed: 1234 in the run, 5 here\).*--set data.split_seed=1234"),
                         (["data.heldout_frac=0.2"], r"data.heldout_frac: 0.05 in the run, 0.2 here\).*--set "
                                                     r"data.heldout_frac=0.05")):
        with pytest.raises(RunDirError, match=rf"--resume: the run in {run_dir} split its data with other settings.*"
                                              rf"{named}.*Nothing was changed"):
            trainer.run(cfg("train.steps=6", *extra), resume=True, log=lambda line: None)
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files
    # config.json edited (or gone): the config saved in the checkpoint is compared too
    saved = json.loads(files["config.json"])
    saved["data"]["heldout_frac"] = 0.3
    (run_dir / "config.json").write_text(json.dumps(saved))
    with pytest.raises(RunDirError, match=r"--resume: checkpoint 3 in .* split its data .*data.heldout_frac: 0.05 in "
                                          r"the run, 0.3 here"):
        trainer.run(cfg("train.steps=6", "data.heldout_frac=0.3"), resume=True, log=lambda line: None)
    assert checkpoint_steps(str(run_dir)) == [3] and not (run_dir / "checkpoints_corrupt").exists()
    assert sorted(read_metrics(str(run_dir))[0]) == [1, 2, 3]
    # text: the validation share and the field read from JSON lines
    text = build_config(preset="lm-tiny", overrides=["data.paths=a.txt"]).to_dict()
    for key, value in (("val_frac", 0.2), ("text_key", "body")):
        other = build_config(preset="lm-tiny", overrides=["data.paths=a.txt", f"data.{key}={value}"])
        assert [d.split(":")[0] for d in split_mismatch(text, other)] == [f"data.{key}"]
    assert split_mismatch(text, build_config(preset="lm-tiny", overrides=["data.paths=a.txt", "data.seed=3"])) == []


def test_a_checkpoint_that_cannot_be_read_is_refused_not_moved_aside_as_corrupt(tmp_path, monkeypatch):
    """The failure this guards against: a read error while verifying (permissions, a file system error) counted as
    corruption: every checkpoint was moved to checkpoints_corrupt, and --resume-or-start (a scheduler's restart)
    trained the run again from step 0."""
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    for s in (3, 6):
        assert ck.save(s, {"w": jnp.arange(4.0) + s}, {"data": {"step": s}})
    ck.close()
    real = checkpoint._file_digests

    def denied(step_dir):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(step_dir, "state", "_METADATA"))

    monkeypatch.setattr(checkpoint, "_file_digests", denied)
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    with pytest.raises(RunDirError, match=r"checkpoint 6 in .* cannot be read \(PermissionError: .*Permission denied: "
                                          r"'.*/6/state/_METADATA'\); fix the cause .* Nothing was moved"):
        ck.restore_latest({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    ck.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"] and not (tmp_path / "checkpoints_corrupt").exists()
    monkeypatch.setattr(checkpoint, "_file_digests", real)  # readable again: the newest one restores
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    step, got, _ = ck.restore_latest({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    ck.close()
    assert step == 6
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 6)


def test_a_verified_checkpoint_that_fails_to_load_for_a_resource_is_not_called_another_model(tmp_path, monkeypatch):
    """A read error or an out-of-memory while restoring a checkpoint whose checksums match says so: it read "does
    not fit this model", which sends the user to change a config that is right.  Nothing is moved either way."""
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    for s in (3, 6):
        assert ck.save(s, {"w": jnp.arange(4.0) + s}, {"data": {"step": s}})
    ck.close()
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    for failure, named in ((OSError(errno.EIO, "Input/output error"), "OSError"),
                           (MemoryError("out of host memory"), "MemoryError"),
                           (RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 bytes"), "RuntimeError")):
        ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)

        def failing_restore(*args, failure=failure, **kwargs):
            raise failure

        monkeypatch.setattr(ck.manager, "restore", failing_restore)
        with pytest.raises(RunDirError) as info:
            ck.restore_latest(abstract)
        ck.close()
        message = str(info.value)
        assert "checkpoint 6 in " in message and f"could not be restored ({named}" in message, message
        assert "does not fit" not in message and "Nothing was moved" in message
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
        assert not (tmp_path / "checkpoints_corrupt").exists()
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)  # a real mismatch still says so
    with pytest.raises(RunDirError, match="does not fit this model"):
        ck.restore_latest({"w": jax.ShapeDtypeStruct((5,), jnp.float32)})
    ck.close()


def test_a_verified_checkpoint_that_tensorstore_cannot_read_names_the_os_error(tmp_path, monkeypatch):
    """The failure this guards against: a file of a verified checkpoint that TensorStore fails to open (a failed
    system call, raised as a ValueError naming the OS error, wrapped by orbax) read "does not fit this model",
    with orbax's wrapper ("Encountered error while reading array index") as the cause.  The array file becomes
    unreadable after the checksums were checked (a symbolic link to itself: ELOOP); nothing is moved."""
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    for s in (3, 6):
        assert ck.save(s, {"w": jnp.arange(4096.0) + s}, {"data": {"step": s}})
    ck.close()
    state = tmp_path / "checkpoints" / "6" / "state"
    array_file = max((p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"),
                     key=lambda p: p.stat().st_size)
    array_file.unlink()
    array_file.symlink_to(array_file)
    monkeypatch.setattr(checkpoint, "verify_checksums", lambda step_dir: None)
    ck = Checkpointer(str(tmp_path), every=1, keep=2, log=lambda line: None)
    try:
        with pytest.raises(RunDirError) as info:
            ck.restore_latest({"w": jax.ShapeDtypeStruct((4096,), jnp.float32)})
    finally:
        ck.close()
    message = str(info.value)
    assert "checkpoint 6 in " in message and "could not be restored (ValueError: " in message, message
    assert "symbolic links" in message and "does not fit" not in message and "Nothing was moved" in message
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
    assert not (tmp_path / "checkpoints_corrupt").exists()



_REPORT_ON_A_FULL_DISK = """
import resource, sys
from falcon_jax.train import report
from falcon_jax.train.config import build_config
from falcon_jax.train.rundir import read_metrics
run_dir, part = sys.argv[1:]
cfg = build_config(config_file=run_dir + "/config.json", overrides=["train.plots=true"])
last_eval = read_metrics(run_dir)[1][-1]
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # writes past 64 bytes fail (EFBIG, as ENOSPC on a full disk)
try:
    report.finish(cfg, last_eval, say=lambda line: None) if part == "report" else report.make_plots(run_dir, cfg)
except OSError as e:
    print(e.strerror)
"""


def test_a_report_or_plot_that_cannot_be_written_leaves_the_earlier_one(tmp_path):
    """The failure this guards against: report.txt was opened for writing (emptied) before the new table was written,
    so a full disk at the end of a resumed run left a cut report in place of the earlier run's; the same for the
    plots, which matplotlib wrote straight to their names."""
    run_dir = tmp_path / "run"
    trainer.run(build_config(preset="addition-tiny", overrides=TINY + [f"train.run_dir={run_dir}", "train.steps=3"]),
                log=lambda line: None)
    earlier = {"report.txt": (run_dir / "report.txt").read_bytes(), "loss.png": b"the earlier plot " * 8}
    (run_dir / "loss.png").write_bytes(earlier["loss.png"])
    parts = ["report"] + (["plots"] if importlib.util.find_spec("matplotlib") is not None else [])
    for part, name in zip(parts, ["report.txt", "loss.png"]):
        res = subprocess.run([sys.executable, "-c", _REPORT_ON_A_FULL_DISK, str(run_dir), part], capture_output=True,
                             text=True, timeout=240, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert res.returncode == 0 and res.stdout == "File too large\n", res.stdout + res.stderr[-3000:]
        assert (run_dir / name).read_bytes() == earlier[name] and len(earlier[name]) > 64
        assert not (run_dir / (name + ".tmp")).exists()


def test_resume_with_other_eval_widths_chooses_among_evaluations_of_the_new_widths(tmp_path):
    """The failure this guards against: a run resumed with another ``data.eval_widths`` chose its best checkpoint by
    comparing in-distribution means over different widths (an earlier mean over widths 1-2 against a later one over
    width 1 alone).  The earlier evaluation's mean is raised to 100 % so that the old choice would pick it."""
    run_dir = tmp_path / "run"
    common = TINY + [f"train.run_dir={run_dir}", "checkpoint.every=2"]
    trainer.run(build_config(preset="addition-tiny", overrides=common + ["train.steps=2", "data.eval_widths=[1,2]"]),
                log=lambda line: None)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    for r in records:
        if r.get("kind") == "eval":
            assert r["in_dist_widths"] == [1, 2]
            r["in_dist_exact"] = 1.0
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = []
    trainer.run(build_config(preset="addition-tiny", overrides=common + ["train.steps=4", "data.eval_widths=[1]"]),
                resume=True, log=lines.append)
    assert any("evaluations on other in-distribution widths than 1 are left out" in ln for ln in lines), lines
    last = [json.loads(ln) for ln in metrics.read_text().splitlines() if '"eval"' in ln][-1]
    assert last["step"] == 4 and last["in_dist_widths"] == [1]
    assert last["best_in_dist"]["step"] == 4 and last["best_in_dist"]["in_dist_widths"] == [1]


def test_resume_without_config_json_uses_the_config_saved_in_the_checkpoint(tmp_path, capsys):
    """The failure this guards against: with config.json deleted, ``--run-dir DIR --resume`` said the folder held no
    run, although every checkpoint carries the run's config."""
    run_dir = tmp_path / "run"
    argv = ["--preset", "addition-tiny", "--run-dir", str(run_dir)] + \
        sum((["--set", o] for o in TINY + ["train.steps=2", "checkpoint.every=2", "model.d_model=48"]), [])
    assert _cli(argv, capsys)[0] == 0
    original = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").unlink()
    rc, out, err = _cli(["--run-dir", str(run_dir), "--resume", "--set", "train.steps=3"], capsys)
    assert rc == 0, err[-3000:]
    assert f"{run_dir / 'config.json'} is missing; resuming with the config saved in checkpoint 2" in err
    restored = json.loads((run_dir / "config.json").read_text())
    assert restored["model"]["d_model"] == 48 and restored["train"]["steps"] == 3
    assert {**restored, "train": {**restored["train"], "steps": 2}} == original
    assert max(read_metrics(str(run_dir))[0]) == 3


def test_resume_without_config_json_passes_over_a_checkpoint_whose_saved_config_has_flipped_bits(tmp_path, capsys):
    """The failure this guards against: with config.json gone, ``--run-dir DIR --resume`` took the config of the
    newest checkpoint whose metadata parsed, even one that fails its checksum (here a flipped digit of d_model):
    the restore then moved that checkpoint aside as corrupt and refused the previous one as another model, so
    the run could not be resumed by its folder alone.  The config must come from a checkpoint whose metadata
    matches its checksum."""
    run_dir = tmp_path / "run"
    argv = ["--preset", "addition-tiny", "--run-dir", str(run_dir)] + \
        sum((["--set", o] for o in TINY + ["train.steps=4", "checkpoint.every=2", "model.d_model=48"]), [])
    assert _cli(argv, capsys)[0] == 0
    (run_dir / "config.json").unlink()
    meta = run_dir / "checkpoints" / "4" / "meta" / "metadata"
    text = meta.read_text()
    assert text.count('"d_model": 48') == 1
    meta.write_text(text.replace('"d_model": 48', '"d_model": 40'))  # as many bytes, still valid JSON
    rc, out, err = _cli(["--run-dir", str(run_dir), "--resume"], capsys)
    assert rc == 0, err[-3000:]
    assert f"{run_dir / 'config.json'} is missing; resuming with the config saved in checkpoint 2" in err
    assert "[checkpoint] step 4 in " in out and "is corrupt" in out
    assert json.loads((run_dir / "config.json").read_text())["model"]["d_model"] == 48
    assert checkpoint_steps(str(run_dir)) == [2, 4] and len(os.listdir(run_dir / "checkpoints_corrupt")) == 1


def test_a_step_moved_aside_twice_in_one_second_keeps_both_copies_side_by_side(tmp_path, monkeypatch):
    """The failure this guards against: the second copy of a step moved aside within the same second went *into*
    the first one's folder (``checkpoints_corrupt/3-<time>/3``), where nothing looks for it."""
    monkeypatch.setattr(checkpoint.time, "time", lambda: 1_800_000_000.25)  # both moves in one second
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
    try:
        for text in ("first", "second"):
            step_dir = tmp_path / "checkpoints" / "3"
            step_dir.mkdir(parents=True)
            (step_dir / "note").write_text(text)
            ckpt._quarantine(3)
    finally:
        ckpt.close()
    moved = sorted((tmp_path / "checkpoints_corrupt").iterdir())
    assert len(moved) == 2 and [p.name.split("-")[0] for p in moved] == ["3", "3"]
    assert sorted((p / "note").read_text() for p in moved) == ["first", "second"]
