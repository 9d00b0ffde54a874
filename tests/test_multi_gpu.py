"""The multi-GPU runner (falcon_jax.train.multi_gpu, run by experiments/multi_gpu.py): its summary of a run's
metrics (median throughput after the first record, scaling per GPU, the loss gap over the second half), the
budget (a run starts only when its estimate fits; skipped runs are recorded and a cheaper later one still runs),
the checkpoint restore on another device count, the halving of an out-of-memory sequence, and, marked slow, the
whole plan with a tiny model on two simulated CPU devices.

The runner tests replace the training processes by a stand-in that writes seeded metrics records (and
checkpoint folders) into each run's folder, and the clock by one that the stand-in advances."""

import json
import os
import shlex
import statistics
import sys
import tarfile

import numpy as np
import pytest

from falcon_jax.train import multi_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- the summary of one run
def test_speed_is_the_median_after_the_first_record_per_gpu(rng):
    tps = rng.uniform(1e5, 2e5, size=6)
    tps[0] = 1e3  # the first record: far off, it must not count
    sps = rng.uniform(0.05, 0.2, size=6)
    peaks = rng.integers(1, 2**36, size=6)
    records = [{"kind": "train", "step": 1, "loss": 3.0}, {"kind": "first_step", "step": 1, "seconds": 80.0}]
    records += [{"kind": "speed", "step": 10 * (i + 1), "tokens_per_s": float(t), "s_per_step": float(s),
                 "peak_bytes_per_device": int(p)} for i, (t, s, p) in enumerate(zip(tps, sps, peaks))]
    out = multi_gpu.speed_summary(records, gpus=4)
    assert out["speed_records"] == 5
    assert out["tokens_per_s"] == pytest.approx(float(np.median(tps[1:])))
    assert out["tokens_per_s_per_gpu"] == pytest.approx(float(np.median(tps[1:])) / 4)
    assert out["s_per_step"] == pytest.approx(float(np.median(sps[1:])))
    assert out["peak_gib_per_gpu"] == pytest.approx(int(peaks.max()) / 2**30)
    assert multi_gpu.first_step_seconds(records) == 80.0
    assert multi_gpu.speed_summary(records[:2], gpus=1)["tokens_per_s"] is None


def test_loss_gap_is_over_the_second_half_of_the_shared_steps(rng):
    steps = 9  # odd: the second half is steps 5..9
    a = {s: float(v) for s, v in zip(range(1, steps + 1), rng.uniform(2, 4, size=steps))}
    offsets = rng.uniform(-0.1, 0.1, size=steps)
    b = {s: a[s] + float(o) for s, o in zip(range(1, steps + 1), offsets)}
    b[1] += 5.0  # a large gap in the first half: only max_abs_diff sees it
    del b[7]  # a step one run lacks is left out
    gap = multi_gpu.loss_gap(a, b, steps)
    late = [s for s in range(5, steps + 1) if s != 7]
    assert gap["steps_compared"] == len(late) and gap["from_step"] == 5
    assert gap["mean_abs_diff_second_half"] == pytest.approx(np.mean([abs(offsets[s - 1]) for s in late]))
    assert gap["max_abs_diff_second_half"] == pytest.approx(max(abs(offsets[s - 1]) for s in late))
    assert gap["max_abs_diff"] == pytest.approx(abs(offsets[0] + 5.0))
    assert multi_gpu.loss_gap(a, {1: 1.0, 2: 2.0}, steps) is None


def test_scaling_and_comparisons_against_the_reference():
    runs = multi_gpu.plan(2)
    curve = [[s, 4.0 - 0.1 * s] for s in range(1, 11)]
    base = {"status": "ok", "seed": 0, "loss": curve}
    results = {
        "g1": dict(base, gpus=1, batch=32, seq_len=1024, tokens_per_s=1000.0, tokens_per_s_per_gpu=1000.0),
        "g2-data": dict(base, gpus=2, batch=32, seq_len=1024, tokens_per_s=1500.0, tokens_per_s_per_gpu=750.0,
                        loss=[[s, v + 0.01 * (s > 5)] for s, v in curve]),
        "g1-T16k": dict(base, gpus=1, batch=2, seq_len=16384, tokens_per_s=900.0, tokens_per_s_per_gpu=900.0),
        "g2-data-T16k": dict(base, gpus=2, batch=4, seq_len=16384, tokens_per_s=1620.0, tokens_per_s_per_gpu=810.0),
        "g1-repeat": dict(base, gpus=1, batch=32, seq_len=1024, loss=[[s, v + 0.02] for s, v in curve]),
    }
    multi_gpu.compare(results, runs, steps=10)
    assert results["g2-data"]["scaling_efficiency"] == pytest.approx(0.75)
    assert results["g2-data"]["vs_reference"]["mean_abs_diff_second_half"] == pytest.approx(0.01)
    # a different batch: throughput per GPU still compared, the loss not
    assert results["g2-data-T16k"]["scaling_efficiency"] == pytest.approx(0.9)
    assert results["g2-data-T16k"]["vs_reference"] is None and "4 x 16384" in results["g2-data-T16k"][
        "vs_reference_note"]
    assert "scaling_efficiency" not in results["g1-repeat"]  # one GPU against one GPU
    assert multi_gpu.noise(results, 10)["same_seed"]["mean_abs_diff_second_half"] == pytest.approx(0.02)


def test_the_plan_and_its_selection():
    names = [r.name for r in multi_gpu.plan(2)]
    assert names[:5] == ["g1", "g2-data", "g2-fsdp", "g1-repeat", "g2-to-1"] and "g2-data-fsdp" not in names
    eight = {r.name: r for r in multi_gpu.plan(8)}
    assert eight["g8-data-fsdp"].mesh == {"data": 2, "fsdp": 4, "seq": 1, "tensor": 1}
    assert eight["g8-seq"].mesh["seq"] == 8 and eight["g8-seq"].tokens_per_step == 65_536
    assert eight["g8-data-T16k"].batch == 8  # one row per GPU at least
    for r in multi_gpu.plan(2) + multi_gpu.plan(8):
        assert r.batch % (r.mesh["data"] * r.mesh["fsdp"]) == 0 and r.seq_len % r.mesh["seq"] == 0
    assert [r.name for r in multi_gpu.select(multi_gpu.plan(4), "gN-fsdp, g1", 4)] == ["g1", "g4-fsdp"]
    with pytest.raises(ValueError, match="g3-data"):
        multi_gpu.select(multi_gpu.plan(2), "g3-data", 2)
    with pytest.raises(ValueError, match="add g2-fsdp"):
        multi_gpu.select(multi_gpu.plan(2), "g1,gN-to-1", 2)


@pytest.mark.parametrize("smoke", [False, True])
def test_every_run_command_is_a_valid_trainer_config(smoke):
    """The settings of every planned run build a trainer config (a renamed key fails here, not on a GPU), with the
    run's shape and mesh."""
    from falcon_jax.train.cli import parser, resolve

    for n in (2, 8):
        for r in multi_gpu.plan(n, smoke):
            if r.restore_from:
                continue  # resumes the source's saved config: covered by the source's
            cmd = multi_gpu.command(r, "runs/x", multi_gpu.settings(r, steps=100, corpus="c.jsonl", smoke=smoke,
                                                                     extra=["optim.lr=3e-4"]))
            assert cmd[1:3] == ["-m", "falcon_jax.train"]
            cfg = resolve(parser().parse_args(cmd[3:]))
            assert (cfg.train.batch_size, cfg.data.seq_len, cfg.data.paths) == (r.batch, r.seq_len, ["c.jsonl"])
            assert {k: getattr(cfg.mesh, k) for k in r.mesh} == r.mesh and cfg.optim.lr == 3e-4
            assert cfg.checkpoint.enabled == r.checkpoints and cfg.data.loader == "builtin"
            assert cfg.model["d_model"] == (64 if smoke else 768)


# ----------------------------------------------------------------------------- the runner, with stand-in runs
class FakeTraining:
    """Stands in for ``Runner.execute``: writes the records a run would write, with seeded losses (the same for
    every mesh, plus ``drift`` per extra GPU), 1M tokens/s per GPU (3M for a restored run), and advances the clock
    by ``wall`` seconds; more than ``oom_above`` tokens per GPU run out of memory."""

    def __init__(self, clock, *, wall=100.0, first=60.0, oom_above=None, drift=0.001):
        self.clock, self.wall, self.first, self.oom_above, self.drift = clock, wall, first, oom_above, drift
        self.started = []  # (run name, seconds left, the JSON's status of the run while it ran)

    def __call__(self, runner, run, run_dir, cmd, env, limit):
        doc = json.load(open(runner.files.json_now))  # multi-gpu.partial.json in a rerun
        self.started.append((run.name, runner.left(), doc["runs"][run.name]["status"], limit))
        steps = runner.doc["settings"]["steps"]
        self.clock[0] += self.wall
        os.makedirs(run_dir, exist_ok=True)
        if self.oom_above and run.tokens_per_step // run.gpus > self.oom_above:
            with open(os.path.join(run_dir, multi_gpu.RUN_LOG), "a") as f:
                f.write("falcon-train: error: the train step ran out of device memory at the first step\n")
            return 1, self.wall
        done = multi_gpu.checkpoint_steps(run_dir)
        start = done[-1] if done else 0
        if run.restore_from:
            assert done == [steps // 2], done  # the source's last checkpoint was left out
        rng = np.random.default_rng(1234 + run.seed)
        curve = rng.uniform(2, 4, size=steps) + self.drift * (run.gpus - 1)
        tps = 3e6 if run.restore_from else 1e6 * run.gpus
        recs = [{"kind": "first_step", "step": start + 1, "seconds": self.first}]
        recs += [{"kind": "train", "step": s, "loss": float(curve[s - 1])} for s in range(start + 1, steps + 1)]
        recs += [{"kind": "speed", "step": s, "tokens_per_s": tps, "s_per_step": run.tokens_per_step / tps,
                  "peak_bytes_per_device": 2**30 * run.seq_len // run.mesh["seq"]}
                 for s in range(start + 2, steps + 1)]
        with open(os.path.join(run_dir, multi_gpu.METRICS), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        with open(os.path.join(run_dir, multi_gpu.RUN_LOG), "a") as f:
            f.write(f"model falcon-1A.3 | steps {steps}\n")
        for s in ([steps // 2, steps] if run.checkpoints else []):
            os.makedirs(os.path.join(run_dir, "checkpoints", str(s)))
            with open(os.path.join(run_dir, "checkpoints", str(s), "state"), "w") as f:
                f.write(str(s))
        if run.restore_from:
            os.makedirs(os.path.join(run_dir, "checkpoints", str(steps)))
        return 0, self.wall


@pytest.fixture
def fake(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(multi_gpu, "now", lambda: clock[0])
    monkeypatch.setattr(multi_gpu, "probe", lambda env: {"platform": "gpu", "count": 2, "kind": "Stand-in",
                                                         "jax": "0"})

    def make(**kw):
        training = FakeTraining(clock, **kw)
        monkeypatch.setattr(multi_gpu.Runner, "execute", lambda self, *a: training(self, *a))
        return training
    return make


def _main(tmp_path, *args):
    out = tmp_path / "out"
    rc = multi_gpu.main(["--out", str(out), "--work", str(tmp_path / "work"), "--steps", "10", *args],
                        root=ROOT)
    return rc, json.loads((out / multi_gpu.JSON_NAME).read_text())


def test_budget_skips_what_would_not_fit_and_later_cheaper_runs_still_start(tmp_path, fake):
    training = fake(wall=100.0, first=60.0)
    rc, doc = _main(tmp_path, "--budget", "330")
    assert rc == 0 and doc["finished"]
    ran = [name for name, *_ in training.started]
    # g1 (the defaults' 196 s fit 330 s), g2-data (measured 100 s, 230 s left); g2-fsdp's two checkpoint saves do
    # not fit the 130 s left, the compiled-step-cached g1-repeat does; then 30 s is too little for anything
    assert ran == ["g1", "g2-data", "g1-repeat"]
    for name, left, status, limit in training.started:
        assert status == "running" and doc["runs"][name]["estimate_s"] <= left
        assert limit <= left  # killed before the budget ends
    skipped = {s["run"]: s["reason"] for s in doc["skipped"]}
    assert set(skipped) == set(doc["plan"]) - set(ran) and all(skipped.values())
    assert "budget" in skipped["g2-fsdp"]
    assert doc["runs"]["g2-data"]["scaling_efficiency"] == pytest.approx(1.0)
    assert doc["runs"]["g2-data"]["vs_reference"]["mean_abs_diff_second_half"] == pytest.approx(0.001)
    assert doc["noise"]["same_seed"]["mean_abs_diff_second_half"] == 0.0
    assert doc["corpus"]["files"] > 50 and len(doc["corpus"]["sha256"]) == 64
    assert doc["label"]["gpus"] == 2 and doc["label"]["device_kind"] == "Stand-in"
    assert sorted(os.listdir(tmp_path / "out")) == sorted([multi_gpu.JSON_NAME, multi_gpu.LOG_NAME,
                                                           multi_gpu.PACK_NAME])
    assert "| g2-data | data=2 | 2 |" in (tmp_path / "out" / multi_gpu.LOG_NAME).read_text()


def test_restore_on_one_gpu_reads_only_what_the_resumed_run_wrote(tmp_path, fake):
    fake(drift=0.0)
    rc, doc = _main(tmp_path, "--runs", "gN-fsdp,gN-to-1")
    assert rc == 0
    src, res = doc["runs"]["g2-fsdp"], doc["runs"]["g2-to-1"]
    assert res["restored_step"] == 5 and res["gpus"] == 1
    assert res["vs_source"]["first_step"] == 6 and res["vs_source"]["max_abs_diff"] == 0.0
    assert [s for s, _ in res["loss"]] == list(range(6, 11))
    # the copied folder holds the source's records too: a summary of the whole file would mix the two speeds
    assert res["tokens_per_s"] == 3e6 and src["tokens_per_s"] == 2e6
    work = os.path.join(tmp_path, "work")
    (stamp,) = [d for d in os.listdir(work) if not d.startswith("corpus")]
    source_metrics = open(os.path.join(work, stamp, "g2-fsdp", multi_gpu.METRICS)).read().splitlines()
    assert [json.loads(r)["step"] for r in source_metrics if '"train"' in r] == list(range(1, 11))
    assert multi_gpu.checkpoint_steps(os.path.join(work, stamp, "g2-fsdp")) == [5, 10]  # the source kept both
    cmd = shlex.split(res["command"])
    assert "--resume" in cmd and "mesh.fsdp=1" in cmd and "--preset" not in cmd


def test_the_long_run_halves_its_sequence_until_it_fits(tmp_path, fake):
    fake(oom_above=32_768)
    rc, doc = _main(tmp_path, "--runs", "gN-seq,g1-long")
    assert rc == 0
    long, seq = doc["runs"]["g1-long"], doc["runs"]["g2-seq"]
    assert [a["seq_len"] for a in long["attempts"]] == [65_536, 32_768]
    assert [a["status"] for a in long["attempts"]] == ["out of memory", "ok"]
    assert long["status"] == "ok" and long["seq_len"] == 32_768
    assert seq["scaling_efficiency"] == pytest.approx(1.0)
    assert seq["vs_reference"] is None and "32768" in seq["vs_reference_note"]
    assert seq["peak_gib_per_gpu"] == pytest.approx(32_768)  # the stand-in's memory: T / seq GiB


def test_a_sigterm_kills_the_run_in_flight_and_keeps_what_finished(tmp_path, fake, monkeypatch):
    training = fake()

    def stop_at_the_second(runner, run, *rest):
        if run.name != "g1":
            raise multi_gpu.Stopped(15)  # as the signal handler raises it
        return training(runner, run, *rest)
    monkeypatch.setattr(multi_gpu.Runner, "execute", lambda self, *a: stop_at_the_second(self, *a))
    rc, doc = _main(tmp_path, "--runs", "g1,gN-data,gN-fsdp")
    assert rc == 128 + 15 and not doc["finished"]
    assert doc["runs"]["g1"]["status"] == "ok" and doc["runs"]["g2-data"]["status"] == "interrupted"
    assert "g2-fsdp" not in doc["runs"]


def test_a_rerun_replaces_the_earlier_results_only_when_it_ends(tmp_path, fake, monkeypatch, capsys):
    """With an earlier multi-gpu.json in --out, a rerun writes multi-gpu.partial.{json,log} and
    multi-gpu-logs.partial.tar.gz: a rerun stopped by SIGTERM or by an exception leaves the earlier three files as
    they were, and one that ends moves its own over them."""
    training = fake()
    out = tmp_path / "out"
    names = sorted([multi_gpu.JSON_NAME, multi_gpu.LOG_NAME, multi_gpu.PACK_NAME])

    def rerun(work, runs="g1,gN-data"):
        return multi_gpu.main(["--out", str(out), "--work", str(tmp_path / work), "--steps", "10", "--runs", runs],
                              root=ROOT)

    assert rerun("w1", runs="g1") == 0
    earlier = {name: (out / name).read_bytes() for name in names}
    assert sorted(os.listdir(out)) == names and json.loads(earlier[multi_gpu.JSON_NAME])["finished"]

    def stop_at_the_second(runner, run, *rest):
        if run.name != "g1":
            raise multi_gpu.Stopped(15)
        return training(runner, run, *rest)
    monkeypatch.setattr(multi_gpu.Runner, "execute", lambda self, *a: stop_at_the_second(self, *a))
    capsys.readouterr()
    assert rerun("w2") == 128 + 15
    assert {name: (out / name).read_bytes() for name in names} == earlier
    printed = capsys.readouterr().out
    assert f"replacing {out / multi_gpu.JSON_NAME} (the results of an earlier run) when this run ends" in printed
    assert f"{out / 'multi-gpu.partial.json'} has the runs that finished; {out / multi_gpu.JSON_NAME} keeps" in printed
    partial = json.loads((out / "multi-gpu.partial.json").read_text())
    assert not partial["finished"] and partial["runs"]["g2-data"]["status"] == "interrupted"
    assert sorted(os.listdir(out)) == sorted(names + ["multi-gpu.partial.json", "multi-gpu.partial.log",
                                                      "multi-gpu-logs.partial.tar.gz"])

    def crash(runner, run, *rest):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(multi_gpu.Runner, "execute", lambda self, *a: crash(self, *a))
    with pytest.raises(OSError, match="No space left"):
        rerun("w3")
    assert {name: (out / name).read_bytes() for name in names} == earlier

    monkeypatch.setattr(multi_gpu.Runner, "execute", lambda self, *a: training(self, *a))
    assert rerun("w4") == 0
    assert sorted(os.listdir(out)) == names  # the partial files moved over the earlier ones
    doc = json.loads((out / multi_gpu.JSON_NAME).read_text())
    assert doc["finished"] and sorted(doc["runs"]) == ["g1", "g2-data"]
    log = (out / multi_gpu.LOG_NAME).read_text()
    assert "replacing" in log and "| g2-data | data=2 | 2 |" in log and "stopped by signal" not in log
    with tarfile.open(out / multi_gpu.PACK_NAME) as tar:
        assert {os.path.dirname(n) for n in tar.getnames()} == {"g1", "g2-data"}


def test_a_run_past_its_time_is_killed(tmp_path):
    args = multi_gpu.parser().parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    runner = multi_gpu.Runner(args, str(tmp_path))
    run = multi_gpu.plan(1)[0]
    rc, wall = runner.execute(run, str(tmp_path / "r"), [sys.executable, "-c", "import time; print('up', "
                              "flush=True); time.sleep(60)"], dict(os.environ), limit=2.0)
    assert rc is None and 2.0 <= wall < 30
    assert "up" in (tmp_path / "r" / multi_gpu.RUN_LOG).read_text()


@pytest.mark.parametrize("argv, message", [
    (["--runs", "g2-data"], "--out DIR is required"),
    (["--out", "x", "--steps", "1"], "--steps=1"),
    (["--out", "x", "--budget", "-5"], "--budget=-5"),
    (["--out", "x", "--runs", "g1,gN-to-1"], "add g2-fsdp"),
    # these made no run, or meant no limit, and exited 0
    (["--out", "x", "--budget", "nan"], "--budget=nan"),
    (["--out", "x", "--runs", ","], "--runs ',' names no run"),
    (["--out", "x", "--run-timeout", "-5"], "--run-timeout=-5.0: give seconds > 0"),
])
def test_bad_arguments_are_refused(fake, capsys, argv, message):
    fake()
    with pytest.raises(SystemExit) as e:
        multi_gpu.main(argv, root=ROOT)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real thing, tiny
@pytest.mark.slow
def test_smoke_on_two_simulated_devices(tmp_path):
    """Four real training processes (about a minute on two cores): the sharded runs' losses equal one device's and
    the restored run continues the source's loss."""
    out = tmp_path / "out"
    rc = multi_gpu.main(["--out", str(out), "--work", str(tmp_path / "work"), "--smoke", "--runs",
                         "g1,gN-data,gN-fsdp,gN-to-1"], root=ROOT)
    doc = json.loads((out / multi_gpu.JSON_NAME).read_text())
    assert rc == 0, {n: r.get("log_tail") for n, r in doc["runs"].items()}
    runs = doc["runs"]
    assert all(r["status"] == "ok" for r in runs.values())
    for name in ("g2-data", "g2-fsdp"):  # fp32 on the CPU: the same losses up to summation order
        assert runs[name]["vs_reference"]["max_abs_diff"] < 1e-4
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["scaling_efficiency"] > 0
    assert runs["g2-to-1"]["restored_step"] == 3 and runs["g2-to-1"]["vs_source"]["max_abs_diff"] < 1e-4
    assert statistics.fmean(v for _, v in runs["g1"]["loss"][-3:]) < runs["g1"]["loss"][0][1]
