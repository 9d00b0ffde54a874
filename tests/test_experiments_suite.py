"""The experiment-suite runner (falcon_jax.train.suite, run by experiments/suite.py): each lane's
share of GPU memory, the runs' commands, resuming and skipping, and bad --gpu-share values refused."""
import json
import os
import sys

import pytest

from falcon_jax.train import suite


class _FinishedProcess:
    """Stands in for a training run that exits at once."""

    launched: list[dict] = []

    def __init__(self, cmd, stdout, stderr, env, start_new_session):
        self.pid = 0
        _FinishedProcess.launched.append({"cmd": cmd, "env": env})

    def poll(self):
        return 0


@pytest.mark.parametrize("lanes, share, expected", [(2, 0.5, "0.250"), (7, 0.5, "0.071"), (3, 0.9, "0.300"),
                                                   (1, 0.6, "0.600"), (1, 0.9, None)])
def test_each_lane_gets_its_share_of_gpu_memory(tmp_path, monkeypatch, lanes, share, expected):
    monkeypatch.chdir(tmp_path)  # main(root=...) changes into it; this puts the test's own cwd back
    monkeypatch.setattr(suite.subprocess, "Popen", _FinishedProcess)
    monkeypatch.setattr(suite.time, "sleep", lambda s: None)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    _FinishedProcess.launched = []
    names = list(suite.ADDITION_RUNS)[:lanes]
    assert suite.main(["addition-m", "--only", *names, "--lanes", str(lanes), "--gpu-share", str(share)],
                      root=str(tmp_path)) == 0
    assert [run["cmd"][-1] for run in _FinishedProcess.launched] == [f"runs/exp/addition-m/{n}" for n in names]
    for run in _FinishedProcess.launched:
        assert run["cmd"][:3] == [sys.executable, "-m", "falcon_jax.train"]
        assert run["env"].get("XLA_PYTHON_CLIENT_MEM_FRACTION") == expected
        settings = [a for a in run["cmd"] if "=" in a]  # the last --set of a key wins
        assert [a for a in settings if a.startswith("train.steps=")][-1] == "train.steps=2000"
        assert [a for a in settings if a.startswith("model.d_model=")][-1] == "model.d_model=512"


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2"])
def test_gpu_share_outside_0_1_is_refused(tmp_path, monkeypatch, capsys, share):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        suite.main(["addition-m", "--only", "transformer-s0", "--gpu-share", share], root=str(tmp_path))
    assert e.value.code == 2 and "--gpu-share must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--lanes", "0"], "--lanes must be >= 1"), (["--deadline-min", "-5"], "--deadline-min must be 0 (none) or"),
    # below a minute (or NaN) no run could start: the suite exited 0 with every run unfinished
    (["--deadline-min", "0.4"], "--deadline-min must be 0 (none) or at least 1"),
    (["--deadline-min", "nan"], "--deadline-min must be 0 (none) or at least 1"),
    # `--only $NAMES` with NAMES empty ran every run of the suite
    (["--only"], "--only: give one or more run names"),
    (["--pack", "no/such/folder/out.tar.gz"], "give a file path in an existing, writable folder"),
    (["--pack", "."], "give a file path in an existing, writable folder"),
])
def test_bad_lanes_deadline_or_pack_path_are_refused_before_any_run(tmp_path, monkeypatch, capsys, flags, named):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite.subprocess, "Popen", lambda *a, **k: pytest.fail("a run was started"))
    with pytest.raises(SystemExit) as e:
        suite.main(["addition-m", "--only", "transformer-s0", *flags], root=str(tmp_path / "root"))
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_pack_path_is_the_callers_not_roots(tmp_path, monkeypatch):
    (tmp_path / "root").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite.subprocess, "Popen", _FinishedProcess)
    monkeypatch.setattr(suite.time, "sleep", lambda s: None)
    assert suite.main(["addition-m", "--only", "transformer-s0", "--pack", "out.tar.gz"],
                      root=str(tmp_path / "root")) == 0
    assert (tmp_path / "out.tar.gz").is_file() and not (tmp_path / "root" / "out.tar.gz").exists()


def test_finished_runs_are_skipped_and_started_ones_resumed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done, started = (tmp_path / suite.run_dir("lm", n) for n in ("transformer", "falcon-3A.3"))
    for d in (done, started):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"train": {"steps": 600}}))
    # the final evaluation, then a line cut by a kill; the started run has an evaluation before the end
    (done / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 600}) + "\n{\"kind\": \"ev")
    (started / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 200}) + "\n")
    assert suite.finished(str(done)) and not suite.finished(str(started))
    assert not suite.finished(str(tmp_path / "nothing"))
    # an addition run cut during its final free-running decoding has the teacher-forced record only
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "config.json").write_text(json.dumps({"train": {"steps": 600}, "data": {"kind": "addition"}}))
    (cut / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 600}) + "\n")
    assert not suite.finished(str(cut))
    with open(cut / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "eval", "step": 600, "greedy": {"8": 0.5}}) + "\n")
    assert suite.finished(str(cut))
    monkeypatch.setattr(suite.subprocess, "Popen", _FinishedProcess)
    monkeypatch.setattr(suite.time, "sleep", lambda s: None)
    _FinishedProcess.launched = []
    assert suite.main(["lm", "--only", "transformer", "falcon-3A.3", "falcon-1A.3"], root=str(tmp_path)) == 0
    cmds = {run["cmd"][run["cmd"].index("--run-dir") + 1]: run["cmd"] for run in _FinishedProcess.launched}
    assert sorted(cmds) == ["runs/exp/lm/falcon-1A.3", "runs/exp/lm/falcon-3A.3"]  # the finished one skipped
    # the started run was killed before its first checkpoint (config.json, no checkpoints): --resume would refuse
    # it for good (exit code 2); --resume-or-start continues from its last checkpoint or starts it again
    assert cmds["runs/exp/lm/falcon-3A.3"][-1] == "--resume-or-start"
    assert not any(a.startswith("--resume") for a in cmds["runs/exp/lm/falcon-1A.3"])


def test_a_stopped_suite_stops_its_runs_with_a_checkpoint_signal(tmp_path, monkeypatch, capsys):
    """Each run is its own process group: on Ctrl-C (or a time limit's SIGTERM) the runner died with a
    traceback and its training processes went on as orphans, holding the GPU.  Now each gets SIGTERM (the trainer
    stops after its step with a checkpoint) and the runner exits 130 saying so."""
    import signal
    import threading
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "stopped"
    child = ("import signal, sys, time\n"
             f"def stop(s, f):\n    open({str(marker)!r}, 'w').write('term')\n    sys.exit(143)\n"
             "signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)\n")
    monkeypatch.setattr(suite, "command", lambda s, name: [sys.executable, "-c", child])
    before = signal.getsignal(signal.SIGINT)
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    assert suite.main(["addition-m", "--only", "transformer-s0"], root=str(tmp_path)) == 130
    assert marker.read_text() == "term"
    assert "[suite] stopped (SIGINT); the runs that were going stopped too: ['transformer-s0']" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back
