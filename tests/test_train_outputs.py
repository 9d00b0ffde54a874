"""What a run says about its files: where it writes (at the start), the refusal to start over an
existing run before any model or data work, the note on missing plots, and the end-of-run report
and file list.  No training here (the end-to-end runs are in test_train_extras / test_train_resume)."""
import json
import math
import sys

import pytest

from falcon_jax.train import cli, report, trainer
from falcon_jax.train.config import build_config
from falcon_jax.train.rundir import Logger, RunDirError, checkpoint_steps, metric_records, parse_records, read_metrics


def _fake_checkpoints(run_dir, steps):
    for s in steps:
        (run_dir / "checkpoints" / str(s) / "state").mkdir(parents=True)
    (run_dir / "checkpoints" / f"{max(steps) + 3}.orbax-checkpoint-tmp-1").mkdir()  # a save cut by a kill


def test_existing_run_is_refused_before_any_model_or_data_work(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _fake_checkpoints(run_dir, [6, 3])
    assert checkpoint_steps(str(run_dir)) == [3, 6]  # finished steps only, in order

    def forbidden(*a, **k):
        pytest.fail("the refusal came after mesh, data or model work")

    for name in ("maybe_initialize_distributed", "make_mesh", "build_data", "make_loader", "FalconLM"):
        monkeypatch.setattr(trainer, name, forbidden)
    cfg = build_config(preset="addition-tiny", overrides=[f"train.run_dir={run_dir}"])
    with pytest.raises(RunDirError, match=r"already has checkpoints at steps \[3, 6\]; pass --resume"):
        trainer.run(cfg, log=lambda line: pytest.fail(f"printed before refusing: {line}"))
    assert cli.main(["--preset", "addition-tiny", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-train: error: {run_dir} already has checkpoints at steps [3, 6]") and \
        "--resume" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[:2] == ["3", "6"]  # untouched


@pytest.mark.parametrize("files", [("config.json", "metrics.jsonl"), ("metrics.jsonl",), ("config.json",)])
def test_a_run_without_checkpoints_is_not_overwritten_by_a_new_one(tmp_path, monkeypatch, capsys, files):
    """A run with checkpoint.enabled=false (or one stopped before its first checkpoint): a new run in its folder
    appended to its metrics (readers then mixed the two runs' steps) and replaced its config.json."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    before = {"config.json": json.dumps({"model": {"d_model": 32}}),
              "metrics.jsonl": json.dumps({"kind": "train", "step": 1, "loss": 2.5}) + "\n"}
    for name in files:
        (run_dir / name).write_text(before[name])

    def forbidden(*a, **k):
        pytest.fail("the refusal came after mesh, data or model work")

    for name in ("maybe_initialize_distributed", "make_mesh", "build_data", "make_loader", "FalconLM"):
        monkeypatch.setattr(trainer, name, forbidden)
    cfg = build_config(preset="addition-tiny", overrides=[f"train.run_dir={run_dir}", "checkpoint.enabled=false"])
    with pytest.raises(RunDirError, match=rf"{run_dir} already holds a run without checkpoints \({', '.join(files)}\)"
                                          r".*another train.run_dir.*--resume-or-start"):
        trainer.run(cfg, log=lambda line: pytest.fail(f"printed before refusing: {line}"))
    assert cli.main(["--preset", "addition-tiny", "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.startswith(f"falcon-train: error: {run_dir} already holds a run")
    assert {p.name: p.read_text() for p in run_dir.iterdir()} == {name: before[name] for name in files}


@pytest.mark.parametrize("preset, plots", [("addition-tiny", "loss.png, accuracy_vs_width.png"),
                                           ("lm-tiny", "loss.png")])
def test_start_lines_name_the_absolute_run_directory(tmp_path, monkeypatch, preset, plots):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report, "plots_available", lambda: True)  # installed or not: that case is below
    lines = report.start_lines(build_config(preset=preset, overrides=["train.run_dir=runs/x"]))
    assert lines[0] == f"Run directory: {tmp_path / 'runs' / 'x'}"
    assert lines[1] == f"  while training: config.json, metrics.jsonl, checkpoints/; at the end: report.txt, {plots}"
    off = report.start_lines(build_config(preset=preset, overrides=["train.plots=false", "checkpoint.enabled=false"]))
    assert off[1] == "  while training: config.json, metrics.jsonl; at the end: report.txt"


def test_a_run_shorter_than_its_warm_up_is_told_so():
    short = report.start_lines(build_config(preset="addition-packed", overrides=["train.steps=5"]))
    assert any("optim.warmup_steps=200 >= train.steps=5" in line for line in short), short
    full = report.start_lines(build_config(preset="addition-packed"))
    assert not any("warmup" in line for line in full), full


def test_without_matplotlib_the_note_says_how_to_get_the_plots(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    cfg = build_config(preset="addition-tiny", overrides=[f"train.run_dir={tmp_path}"])
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    start = report.start_lines(cfg)  # said at the start already, and no plots promised
    assert start[1:] == ["  while training: config.json, metrics.jsonl, checkpoints/; at the end: report.txt",
                         "  " + report.NO_MATPLOTLIB]
    assert 'pip install -e ".[train]"' in report.NO_MATPLOTLIB
    assert report.make_plots(str(tmp_path), cfg) == ([], report.NO_MATPLOTLIB)
    assert not list(tmp_path.glob("*.png"))


def test_finish_saves_the_table_and_lists_the_files(tmp_path, monkeypatch, rng):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the list without plots; plots: test_train_extras
    run_dir = tmp_path / "run"
    _fake_checkpoints(run_dir, [750, 1500])
    cfg = build_config(preset="addition-tiny", overrides=[f"train.run_dir={run_dir}"])
    exact = rng.uniform(size=8)
    rec = {"step": 1500, "teacher_forced": {str(w): {"exact": float(exact[w - 1]), "digit": 0.5} for w in range(1, 9)},
           "greedy": {"2": 0.25}, "in_dist_exact": float(exact[:4].mean()), "heldout_width_exact": float(exact[4:].mean()),
           "in_dist_digit": 0.5, "heldout_width_digit": 0.5,
           "best_in_dist": {"step": 750, "in_dist_exact": 0.9, "heldout_width_exact": 0.125, "heldout_width_digit": 0.25}}
    lines = []
    written = report.finish(cfg, rec, say=lines.append)
    assert written == [str(run_dir / "report.txt")]
    table = (run_dir / "report.txt").read_text().splitlines()
    assert table == lines[1:1 + len(table)] and table[0].startswith("Addition accuracy at step 1500")
    row2 = next(ln for ln in table if ln.split("|")[0].strip() == "2")
    assert f"{100 * exact[1]:.1f}%" in row2 and "25.0%" in row2
    assert table[-2] == (f"mean teacher-forced exact (per digit): in-distribution {100 * exact[:4].mean():.1f}% "
                         f"(50.0%), longer-than-trained {100 * exact[4:].mean():.1f}% (50.0%)")
    assert table[-1] == ("checkpoint choice (best in-distribution exact, longer widths not looked at): step 750: "
                         "in-distribution 90.0%, longer-than-trained 12.5% (25.0% per digit)")
    assert report.NO_MATPLOTLIB in lines
    listing = lines[lines.index(f"Files in {run_dir}:") + 1:]
    assert [ln.split()[0] for ln in listing] == ["report.txt", "metrics.jsonl", "config.json", "checkpoints/"]
    assert listing[-1].endswith("steps 750, 1500")


def test_the_table_names_widths_evaluated_on_fewer_problems():
    """The header gives eval_examples distinct problems per width and lists the widths that had fewer (all their
    held-out problems); a record without counts gets the plain header."""
    cfg = build_config(preset="addition-tiny")
    E = cfg.data.eval_examples
    tf = {"1": {"exact": 1.0, "digit": 1.0, "problems": 10}, "2": {"exact": 0.5, "digit": 0.75, "problems": E},
          "3": {"exact": 0.0, "digit": 0.25, "problems": E}}
    rec = {"step": 8, "teacher_forced": tf}
    assert report.summary_lines(cfg, rec)[0].endswith(
        f"held-out problems; {E} distinct per width; all of them at widths with fewer: 1 (10))")
    old = {k: {m: v[m] for m in ("exact", "digit")} for k, v in tf.items()}
    assert report.summary_lines(cfg, {"step": 8, "teacher_forced": old})[0].endswith(
        f"held-out problems; {E} distinct per width)")


def test_metric_records_skip_a_cut_line_and_filter_by_kind(tmp_path):
    recs = [{"kind": "train", "step": 1, "loss": 2.0}, {"kind": "first_step", "step": 1, "seconds": 3.5},
            {"kind": "train", "step": 2, "loss": 1.5}, {"kind": "speed", "step": 2, "tokens_per_s": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tra')
    assert metric_records(str(tmp_path)) == recs
    assert metric_records(str(tmp_path), "train") == [recs[0], recs[2]]
    assert parse_records(['{"kind": "eval"}', "{cut"], "eval") == [{"kind": "eval"}]
    assert metric_records(str(tmp_path / "none")) == []


def test_a_resumed_run_appends_after_a_cut_line_without_losing_its_first_record(tmp_path):
    """The failure this guards against: the first record of the resumed run glued to the cut line, and both
    skipped."""
    first = {"kind": "train", "step": 1, "loss": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(first) + "\n" + '{"kind": "train", "st')
    logger = Logger(str(tmp_path), is_main=True)
    later = [{"kind": "train", "step": 2, "loss": 1.5}, {"kind": "train", "step": 3, "loss": 1.0}]
    for rec in later:
        logger.write(rec)
    assert metric_records(str(tmp_path)) == [first, *later]


def test_bytes_that_are_not_utf8_are_a_skipped_line_and_the_run_appends_after_them(tmp_path):
    """Bytes a crash or a disk error left in metrics.jsonl: a resumed run (which reads the file for the
    evaluations so far) and the report read the other records, and the next record is a line of its own."""
    first = {"kind": "eval", "step": 1, "in_dist_exact": 0.5}
    (tmp_path / "metrics.jsonl").write_bytes(json.dumps(first).encode() + b"\n\xff\xfe\x80garbage")
    logger = Logger(str(tmp_path), is_main=True)
    later = {"kind": "eval", "step": 2, "in_dist_exact": 0.75}
    logger.write(later)
    assert metric_records(str(tmp_path), "eval") == [first, later]
    assert [e["step"] for e in read_metrics(str(tmp_path))[1]] == [1, 2]


def test_records_of_steps_trained_again_after_a_resume_are_dropped(tmp_path):
    """A run killed at step 5 after its checkpoint of step 3 (or whose checkpoint of step 6 was corrupt, or that
    diverged): its records of steps 4-5 are not the run's once a command continues it from step 3."""
    def rec(kind, step, **kw):
        return {"kind": kind, "step": step, **kw}
    abandoned = [rec("train", 4, loss=9.0), rec("eval", 5, in_dist_exact=0.9), rec("train", 5, loss=9.5)]
    kept = [rec("train", 1, loss=2.0), rec("train", 2, loss=1.9), rec("eval", 3, in_dist_exact=0.1),
            rec("train", 3, loss=1.8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept + abandoned))
    logger = Logger(str(tmp_path), is_main=True)
    later = [rec("resume", 3), rec("train", 4, loss=1.7)]  # stopped again after step 4
    for r in later:
        logger.write(r)
    assert metric_records(str(tmp_path)) == kept + later
    assert metric_records(str(tmp_path), "eval") == [kept[2]]
    train, evals = read_metrics(str(tmp_path))
    assert sorted(train) == [1, 2, 3, 4] and train[4]["loss"] == 1.7
    assert [e["step"] for e in evals] == [3]
    # --resume-or-start without a checkpoint: step 0 drops every earlier step
    assert parse_records([json.dumps(r) for r in kept + [rec("resume", 0)]]) == [rec("resume", 0)]


def strict_json(line: str):
    """``json.loads`` that refuses the non-standard tokens NaN, Infinity and -Infinity."""
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(line, parse_constant=refuse)


def _diverged_records():
    nan, inf = float("nan"), float("inf")
    return [{"kind": "train", "step": 1, "loss": 2.5, "grad_norm": 1.25, "lr": 1e-3},
            {"kind": "train", "step": 2, "loss": nan, "grad_norm": inf, "lr": 1e-3},
            {"kind": "eval", "step": 2, "val_loss": -inf, "in_dist_exact": None,
             "teacher_forced": {"1": {"exact": nan, "digit": 0.5}, "2": {"exact": 0.25, "digit": inf}}}]


def test_non_finite_metrics_are_strict_json_and_read_back_as_floats(tmp_path):
    """A diverged step's NaN / inf are written as the strings "nan" / "inf" / "-inf" (bare NaN and Infinity
    tokens are not JSON: jq and strict parsers refuse the line); the readers give them back as floats."""
    recs = _diverged_records()
    logger = Logger(str(tmp_path), is_main=True)
    for rec in recs:
        logger.write(rec)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [strict_json(line) for line in lines]
    assert parsed[1]["loss"] == "nan" and parsed[1]["grad_norm"] == "inf" and parsed[2]["val_loss"] == "-inf"
    assert parsed[2]["teacher_forced"] == {"1": {"exact": "nan", "digit": 0.5}, "2": {"exact": 0.25, "digit": "inf"}}
    assert parsed[0] == recs[0] and parsed[2]["in_dist_exact"] is None  # null stays "not measured"
    back = metric_records(str(tmp_path))
    assert repr(back) == repr(recs)  # repr: NaN == NaN, and floats stay floats
    assert math.isnan(back[1]["loss"]) and back[1]["grad_norm"] == math.inf and back[2]["val_loss"] == -math.inf
    train, evals = read_metrics(str(tmp_path))
    assert math.isnan(train[2]["loss"]) and evals[0]["val_loss"] == -math.inf


def test_the_report_reads_a_diverged_run(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = Logger(str(run_dir), is_main=True)
    for rec in _diverged_records():
        logger.write(rec)
    cfg = build_config(preset="addition-tiny", overrides=[f"train.run_dir={run_dir}"])
    last_eval = metric_records(str(run_dir), "eval")[-1]
    lines = []
    if report.plots_available():
        written, note = report.make_plots(str(run_dir), cfg)
        assert note is None and [p.rsplit("/", 1)[-1] for p in written] == ["loss.png", "accuracy_vs_width.png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report.finish(cfg, last_eval, say=lines.append)
    row1 = next(ln for ln in lines if ln.split("|")[0].strip() == "1")
    assert "nan%" in row1, lines
