"""experiments/suite.py: each lane's share of GPU memory, and bad --gpu-share values refused."""

import pytest

from experiments import suite


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
    monkeypatch.setattr(suite, "ROOT", str(tmp_path))
    monkeypatch.setattr(suite.subprocess, "Popen", _FinishedProcess)
    monkeypatch.setattr(suite.time, "sleep", lambda s: None)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    _FinishedProcess.launched = []
    names = list(suite.ADDITION_RUNS)[:lanes]
    assert suite.main(["addition-m", "--only", *names, "--lanes", str(lanes), "--gpu-share", str(share)]) == 0
    assert [run["cmd"][-1] for run in _FinishedProcess.launched] == [f"runs/exp/addition-m/{n}" for n in names]
    for run in _FinishedProcess.launched:
        assert run["env"].get("XLA_PYTHON_CLIENT_MEM_FRACTION") == expected
        settings = [a for a in run["cmd"] if "=" in a]  # the last --set of a key wins
        assert [a for a in settings if a.startswith("train.steps=")][-1] == "train.steps=2000"
        assert [a for a in settings if a.startswith("model.d_model=")][-1] == "model.d_model=512"


@pytest.mark.parametrize("share", ["0", "1.5", "-0.2"])
def test_gpu_share_outside_0_1_is_refused(tmp_path, monkeypatch, capsys, share):
    monkeypatch.setattr(suite, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        suite.main(["addition-m", "--only", "transformer-s0", "--gpu-share", share])
    assert e.value.code == 2 and "--gpu-share must be in (0, 1]" in capsys.readouterr().err
