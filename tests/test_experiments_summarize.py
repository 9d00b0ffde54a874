"""Suite summaries (falcon_jax.train.summarize, run by experiments/summarize.py): tables from a
packed suite (addition-style and LM), written into temporary folders, from run folders with
seeded random numbers."""

import io
import json
import tarfile

import numpy as np
import pytest

from falcon_jax.train import summarize
from falcon_jax.train.rundir import Logger


def _pack(path, suite, runs):
    with tarfile.open(path, "w:gz") as tar:
        for name, (config, records) in runs.items():
            for fname, text in (("config.json", json.dumps(config)),
                                ("metrics.jsonl", "\n".join(json.dumps(r) for r in records) + "\n{cut")):
                data = text.encode()
                info = tarfile.TarInfo(f"{suite}/{name}/{fname}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_no_runs_or_an_existing_result_is_refused(tmp_path, capsys):
    """A mistyped suite name or folder wrote an empty result (exit 0), and a --tag used again replaced the
    earlier files, by default the repository's published ones, without a word."""
    config = {"data": {"train_max_width": 4}, "model": {"mixer": "falcon-1A.3"}, "train": {"seed": 0}}
    evals = [{"kind": "eval", "step": 100, "in_dist_exact": 0.5, "heldout_width_exact": 0.1,
              "teacher_forced": {"2": {"exact": 0.5, "digit": 0.5}}, "greedy": {"2": 0.0}}]
    _pack(tmp_path / "p.tar.gz", "addition-m", {"run-a": (config, evals)})
    dirs = dict(out_dir=str(tmp_path / "results"), img_dir=str(tmp_path / "img"))
    for argv, named in ((["lm", str(tmp_path / "p.tar.gz")], "holds no run of the suite 'lm'"),
                        (["addition-m", str(tmp_path)], "holds no run of the suite 'addition-m'"),
                        (["addition-m", str(tmp_path / "p.tar.gz"), "--tag", "a/b"], "a name without '/'")):
        with pytest.raises(SystemExit) as e:
            summarize.main([*argv, "--tag", "t"] if "--tag" not in argv else argv, **dirs)
        assert e.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "results").exists()
    assert summarize.main(["addition-m", str(tmp_path / "p.tar.gz"), "--tag", "t"], **dirs) == 0
    with pytest.raises(SystemExit) as e:
        summarize.main(["addition-m", str(tmp_path / "p.tar.gz"), "--tag", "t"], **dirs)
    assert e.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    assert summarize.main(["addition-m", str(tmp_path / "p.tar.gz"), "--tag", "t", "--overwrite"], **dirs) == 0


@pytest.mark.parametrize("suite", ["addition-sweep", "addition-m"])
def test_addition_suites_pick_the_best_in_distribution_step(tmp_path, rng, suite):
    in_dist = rng.uniform(size=4)
    evals = [{"kind": "eval", "step": 100 * (i + 1), "in_dist_exact": float(a), "heldout_width_exact": float(a) / 2,
              "teacher_forced": {str(w): {"exact": float(a) / w, "digit": 0.5} for w in range(1, 7)},
              "greedy": {"4": 0.0}} for i, a in enumerate(in_dist)]
    config = {"data": {"train_max_width": 4}, "model": {"mixer": "falcon-1A.3"}, "train": {"seed": 0}}
    _pack(tmp_path / "p.tar.gz", suite, {"run-a": (config, evals + [{"kind": "train", "step": 400, "loss": 1.5}])})
    assert summarize.main([suite, str(tmp_path / "p.tar.gz"), "--tag", "t"], out_dir=str(tmp_path / "results"),
                          img_dir=str(tmp_path / "img")) == 0
    (row,) = json.loads((tmp_path / "results" / f"{suite}-t.json").read_text())["rows"]
    best = int(np.argmax(in_dist))
    assert row["best_step"] == 100 * (best + 1)
    assert row["in_dist_exact"] == pytest.approx(in_dist[best])
    assert row["exact_at"] == {"5": pytest.approx(in_dist[best] / 5), "6": pytest.approx(in_dist[best] / 6)} or \
        row["exact_at"] == {5: pytest.approx(in_dist[best] / 5), 6: pytest.approx(in_dist[best] / 6)}
    pytest.importorskip("matplotlib")
    assert (tmp_path / "img" / f"{suite}-t-accuracy-vs-width.png").stat().st_size > 0


def test_lm_rows_report_the_last_validation_and_median_speed(tmp_path, rng):
    losses = rng.uniform(1.0, 2.0, size=3)
    speeds = rng.uniform(1e5, 1e6, size=7)
    recs = [{"kind": "eval", "step": 10 * (i + 1), "val_loss": float(v), "val_ppl": float(np.exp(v)),
             "val_tokens": 1000} for i, v in enumerate(losses)]
    recs += [{"kind": "speed", "step": 5 * (i + 1), "tokens_per_s": float(s)} for i, s in enumerate(speeds)]
    config = {"model": {"mixer": "transformer"}, "train": {"batch_size": 4, "log_every": 5},
              "data": {"seq_len": 65}}
    _pack(tmp_path / "lm.tar.gz", "lm", {"transformer": (config, recs)})
    # the folders from the command line win over the caller's defaults
    assert summarize.main(["lm", str(tmp_path / "lm.tar.gz"), "--tag", "t", "--out-dir", str(tmp_path / "o"),
                           "--img-dir", str(tmp_path / "i")], out_dir=str(tmp_path / "unused"),
                          img_dir=str(tmp_path / "unused")) == 0
    assert not (tmp_path / "unused").exists()
    (row,) = json.loads((tmp_path / "o" / "lm-t.json").read_text())["rows"]
    assert row["val_loss"] == pytest.approx(losses[-1])
    assert row["tokens"] == 30 * 4 * 64
    steady = sorted(speeds[2:])  # steps 15..35: after twice the log interval
    assert row["tokens_per_s_median"] == pytest.approx(steady[len(steady) // 2])


def _strict_json(text: str):
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("suite", ["addition", "lm"])
def test_a_diverged_run_is_summarized_as_strict_json(tmp_path, rng, suite):
    """A run whose loss went NaN (metrics.jsonl written by the trainer's Logger): the summary reads it and its
    JSON stays strict, with the non-finite numbers as the strings "nan" / "inf"."""
    nan, inf = float("nan"), float("inf")
    run = tmp_path / suite / "run-a"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({
        "data": {"train_max_width": 2, "seq_len": 65}, "model": {"mixer": "falcon-1A.3"},
        "train": {"seed": 0, "batch_size": 4, "log_every": 1}}))
    a = float(rng.uniform(0.5, 1.0))
    evals = ([{"kind": "eval", "step": 2, "in_dist_exact": a, "heldout_width_exact": None,
               "teacher_forced": {"1": {"exact": a, "digit": inf}, "3": {"exact": nan, "digit": 0.5}}}]
             if suite == "addition" else
             [{"kind": "eval", "step": 2, "val_loss": nan, "val_ppl": inf, "val_tokens": 64}])
    logger = Logger(str(run), is_main=True)
    for rec in [{"kind": "train", "step": 1, "loss": a}, {"kind": "train", "step": 2, "loss": nan}] + evals:
        logger.write(rec)
    assert summarize.main([suite, str(tmp_path / suite), "--tag", "t"], out_dir=str(tmp_path / "results"),
                          img_dir=str(tmp_path / "img")) == 0
    (row,) = _strict_json((tmp_path / "results" / f"{suite}-t.json").read_text())["rows"]
    if suite == "addition":
        assert row["final_loss"] == "nan" and row["in_dist_exact"] == pytest.approx(a)
        assert row["exact_at"] in ({"3": "nan"}, {3: "nan"}) and row["heldout_mean_exact"] is None
    else:
        assert row["val_loss"] == "nan" and row["val_ppl"] == "inf" and row["val_curve"] == [[2, "nan"]]


def _plot_module(name="plot_addition_packed"):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_packed_addition_plots_read_the_last_record_of_each_step(tmp_path, rng, capsys):
    plot = _plot_module()
    exact = rng.uniform(size=(3, 6))
    evals = [{"kind": "eval", "step": step, "teacher_forced": {str(w): {"exact": float(exact[i, w - 1]), "digit": 0.5}
                                                               for w in range(1, 7)}}
             for i, step in enumerate((100, 200, 200))]
    result = {"config": {"train": {"batch_size": 4}, "data": {"seq_len": 256, "train_min_width": 1,
                                                               "train_max_width": 4}},
              "metrics": [{"kind": "train", "step": 1, "loss": 2.0}, *evals]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    tokens, by_step, widths = plot.load(str(path))
    assert tokens == 1024 and widths == [1, 2, 3, 4] and list(by_step) == [100, 200]
    # step 200 was evaluated twice: the later record counts, and only the trained widths enter the mean
    assert plot.mean_exact(by_step[200], widths) == pytest.approx(100 * exact[2, :4].mean())
    prefix = tmp_path / "img" / "p"
    prefix.parent.mkdir()
    assert plot.main([str(prefix), f"run={path}"]) == 0
    assert (tmp_path / "img" / "p-learning-curves.png").stat().st_size > 0
    assert (tmp_path / "img" / "p-accuracy-vs-width.png").stat().st_size > 0
    assert (tmp_path / "img" / "p-exact-by-width.png").stat().st_size > 0
    steps, all_widths, curve = plot.exact_by_width(by_step)
    # every evaluated width, trained or longer, one row each; the later record of step 200
    assert steps == [100, 200] and all_widths == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(curve, [[100 * exact[0, w], 100 * exact[2, w]] for w in range(6)])
    assert plot.main([str(prefix), str(path)]) == 2
    # bad result files are one line each and write nothing (a file without evaluations wrote the first plot, then
    # failed with a StopIteration traceback); missing, cut or foreign files were tracebacks
    (tmp_path / "cut.json").write_text(json.dumps(result)[:50])
    (tmp_path / "noeval.json").write_text(json.dumps({**result, "metrics": result["metrics"][:1]}))
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    other = tmp_path / "other-img" / "q"
    other.parent.mkdir()
    for arg, named in ((f"x={tmp_path / 'missing.json'}", "No such file"), (f"x={tmp_path / 'cut.json'}", "not JSON"),
                       (f"x={tmp_path / 'noeval.json'}", "holds no evaluation"),
                       (f"x={tmp_path / 'other.json'}", "not an addition result file"), (f"={path}", "neither part"),
                       ("x=", "neither part")):
        capsys.readouterr()
        assert plot.main([str(other), f"run={path}", arg]) == 2, arg
        assert named in capsys.readouterr().err and not list(other.parent.iterdir()), arg
    assert plot.main([str(tmp_path / "no" / "folder" / "p"), f"run={path}"]) == 2


def test_packed_addition_plots_average_over_the_widths_the_trainer_does(tmp_path, rng):
    # evaluated widths that skip a trained width (3): the trainer's in-distribution mean leaves it out, and so
    # must the plots' (a mean over train_min_width..train_max_width would read a width never evaluated)
    plot = _plot_module()
    exact = rng.uniform(size=7)
    tf = {str(w): {"exact": float(exact[w]), "digit": 0.5} for w in (1, 2, 4, 6)}
    data = {"seq_len": 64, "train_min_width": 1, "train_max_width": 4, "eval_widths": [6, 1, 2, 4]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": {"train": {"batch_size": 2}, "data": data},
                                "metrics": [{"kind": "eval", "step": 10, "teacher_forced": tf}]}))
    _, by_step, widths = plot.load(str(path))
    assert widths == [1, 2, 4]
    assert plot.table3_row(by_step, widths)["trained_exact"] == pytest.approx(100 * exact[[1, 2, 4]].mean())
    text = tmp_path / "text.json"
    text.write_text(json.dumps({"config": {"train": {"batch_size": 2}, "data": {**data, "kind": "text"}},
                                "metrics": [{"kind": "eval", "step": 10, "teacher_forced": tf}]}))
    with pytest.raises(plot.ResultError, match="not an addition run"):
        plot.load(str(text))


def test_table3_row_reads_the_trainers_checkpoint_choice_and_averages_per_width(rng):
    """Table 3's columns at the trainer's chosen step (not the last, not the best on the longer widths); without
    that record, the first step of the best trained-width exact match.  Means are over widths, not problems."""
    plot = _plot_module()
    widths = [1, 2, 3]
    digit, exact = rng.uniform(size=(3, 6)), rng.uniform(size=(3, 6))

    def record(i, step, best=None):
        r = {"kind": "eval", "step": step,
             "teacher_forced": {str(w): {"exact": float(exact[i, w - 1]), "digit": float(digit[i, w - 1])}
                                for w in range(1, 7)}}
        return r if best is None else {**r, "best_in_dist": {"step": best}}

    exact[1, :3] = 1.0  # step 200 is the best on the trained widths, step 300 on the longer ones
    exact[2, :3], exact[2, 3:] = 0.0, 1.0
    evals = {100: record(0, 100), 200: record(1, 200), 300: record(2, 300, best=200)}
    row = plot.table3_row(evals, widths)
    assert row["step"] == 200
    assert row["trained_exact"] == pytest.approx(100.0)
    assert row["trained_digit"] == pytest.approx(100 * digit[1, :3].mean())
    assert row["longer_digit"] == pytest.approx(100 * digit[1, 3:].mean())
    assert row["longer_exact"] == pytest.approx(100 * exact[1, 3:].mean())
    assert (row["first_longer"], row["last_longer"]) == (4, 6)
    assert (row["first_digit"], row["last_digit"]) == pytest.approx((100 * digit[1, 3], 100 * digit[1, 5]))
    # no trainer's record: the first of equally good steps
    evals = {100: record(1, 100), 200: record(1, 200), 300: record(2, 300)}
    assert plot.table3_row(evals, widths)["step"] == 100


def test_a_recorded_run_holds_its_config_records_and_width_shares_and_plots(tmp_path, rng, capsys):
    record = _plot_module("record_run")
    run = tmp_path / "run"
    run.mkdir()
    config = {"train": {"batch_size": 4}, "data": {"seq_len": 64, "train_min_width": 1, "train_max_width": 3}}
    (run / "config.json").write_text(json.dumps(config))
    exact = rng.uniform(size=3)
    records = [{"kind": "train", "step": 1, "loss": float("nan"), "grad_norm": 1.0},
               {"kind": "eval", "step": 2, "teacher_forced": {str(w): {"exact": float(exact[w - 1]), "digit": 0.5}
                                                              for w in (1, 2, 3)}}]
    logger = Logger(str(run), is_main=True)
    for r in records:
        logger.write(r)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut by a kill
    shares = {"layout": "packed", "padding": 0.1, "widths": {str(w): {"problems": 0.3, "tokens": 0.3 * w / 2}
                                                             for w in (1, 2, 3)}}
    (run / "width_shares.json").write_text(json.dumps(shares))
    out = tmp_path / "r.json"
    argv = [str(run), str(out), "--what", "packed addition, tiny model", "--machine", "cpu", "--commit", "abc1234",
            "--command", "falcon-train --preset addition-packed-tiny",
            "--date", "2026-01-02"]
    assert record.main(argv) == 0
    got = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert (got["what"], got["machine"], got["commit"], got["command"], got["date"]) == \
        ("packed addition, tiny model", "cpu", "abc1234", "falcon-train --preset addition-packed-tiny", "2026-01-02")
    assert got["config"] == config
    assert got["metrics"][0]["loss"] == "nan" and got["metrics"][1:] == records[1:]
    assert got["token_share_per_width"]["widths"] == {"1": 0.15, "2": 0.3, "3": pytest.approx(0.45)}
    assert got["token_share_per_width"]["padding"] == 0.1
    tokens, by_step, widths = _plot_module().load(str(out))
    assert tokens == 256 and list(by_step) == [2] and widths == [1, 2, 3]
    (run / "config.json").unlink()
    written = out.read_bytes()
    assert record.main([*argv, "--overwrite"]) == 2  # OUT may be replaced: the run folder's fault is reported
    assert "holds no config.json" in capsys.readouterr().err
    assert out.read_bytes() == written
    # an empty label was written as the description a docs table cites
    with pytest.raises(SystemExit) as e:
        record.main([*argv[:5], " ", *argv[6:], "--overwrite"])
    assert e.value.code == 2 and "--machine: give a non-empty description" in capsys.readouterr().err
    assert out.read_bytes() == written


def test_record_run_refuses_bad_inputs_and_never_replaces_a_file_unasked(tmp_path, capsys):
    """One line and exit code 2 for each fault, the files as they were: an existing OUT (replaced only with
    --overwrite), an OUT that is one of the run's own files (never), a missing output folder, a cut config.json,
    a width_shares.json without its fields, a metrics.jsonl without records or without an evaluation record, a
    date not YYYY-MM-DD."""
    record = _plot_module("record_run")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {"batch_size": 4}}))
    records = [{"kind": "train", "step": 1, "loss": 2.5}, {"kind": "eval", "step": 1, "val_loss": 2.6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = ["--what", "w", "--machine", "cpu", "--commit", "abc1234", "--command", "falcon-train"]

    def refused(out, *extra, named):
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        try:
            rc = record.main([str(run), str(out), *meta, *extra])
        except SystemExit as e:  # argparse
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2, (rc, err)
        assert named in err and "Traceback" not in err, err
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
        return err

    out = tmp_path / "r.json"
    out.write_text("an earlier result")
    refused(out, named=f"{out} already exists; pass --overwrite to replace it")
    assert record.main([str(run), str(out), *meta, "--overwrite"]) == 0
    assert json.loads(out.read_text())["metrics"] == records
    for name in ("metrics.jsonl", "config.json"):
        refused(run / name, "--overwrite", named=f"is the run's own {name}")
    refused(tmp_path / "missing" / "r.json", named=f"the folder {tmp_path / 'missing'} of the output does not exist")
    refused(tmp_path / "r2.json", "--date", "yesterday", named="--date 'yesterday': expected YYYY-MM-DD")
    (run / "width_shares.json").write_text("{}")
    refused(tmp_path / "r2.json", named=f"{run / 'width_shares.json'} is not a width shares file")
    (run / "width_shares.json").unlink()
    (run / "config.json").write_text('{"train": {"batch')
    refused(tmp_path / "r2.json", named=f"{run / 'config.json'} is not JSON")
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    refused(tmp_path / "r2.json", named=f"{run / 'metrics.jsonl'} holds no records")
    # train records only, or an evaluation record cut by a kill: the plots and tables would find no evaluation
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps(records[1])[:20])
    err = refused(tmp_path / "r2.json", named=f"{run} holds no evaluation record (no \"kind\": \"eval\" line in "
                                             f"its metrics.jsonl)")
    assert err.startswith("record_run: error: ") and err.count("\n") == 1, err  # one line


def test_record_run_reports_a_wrong_out_before_reading_the_run_folder(tmp_path, capsys):
    """OUT is checked on its path alone, before the run folder is read: with a run folder that cannot be
    recorded (its metrics.jsonl holds no record, its config.json is cut, or it is missing), an existing OUT
    without --overwrite and an OUT in a missing folder are the errors reported, and nothing is written."""
    record = _plot_module("record_run")
    meta = ["--what", "w", "--machine", "cpu", "--commit", "abc1234", "--command", "falcon-train"]
    corrupt_metrics = tmp_path / "corrupt-metrics"
    corrupt_metrics.mkdir()
    (corrupt_metrics / "config.json").write_text(json.dumps({"train": {"batch_size": 4}}))
    (corrupt_metrics / "metrics.jsonl").write_text('{"kind": "train", "st\nnot json\n')
    cut_config = tmp_path / "cut-config"
    cut_config.mkdir()
    (cut_config / "config.json").write_text('{"train": {"batch')
    (cut_config / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.5}) + "\n")
    existing = tmp_path / "r.json"
    existing.write_text("an earlier result")
    missing_folder = tmp_path / "missing" / "r.json"
    for run in (corrupt_metrics, cut_config, tmp_path / "no-such-run"):
        for out, named in ((existing, f"{existing} already exists; pass --overwrite to replace it"),
                           (missing_folder, f"the folder {missing_folder.parent} of the output does not exist")):
            assert record.main([str(run), str(out), *meta]) == 2
            err = capsys.readouterr().err
            assert named in err and "Traceback" not in err, (run, err)
        # with OUT writable, the run folder's own fault is the one reported
        assert record.main([str(run), str(tmp_path / "new.json"), *meta]) == 2
        assert str(run) in capsys.readouterr().err
    assert existing.read_text() == "an earlier result"
    assert not (tmp_path / "new.json").exists() and not missing_folder.parent.exists()


@pytest.mark.parametrize("packed", [False, True])
def test_a_metrics_file_with_bytes_that_are_not_utf8_is_read_without_them(tmp_path, packed):
    """Bytes a crash left in a run's metrics.jsonl: the run's other records are summarized."""
    rec = {"kind": "train", "step": 1, "loss": 2.0}
    metrics = json.dumps(rec).encode() + b"\n\xff\xfe\x80garbage\n"
    if packed:
        with tarfile.open(tmp_path / "p.tar.gz", "w:gz") as tar:
            for fname, data in (("config.json", b"{}"), ("metrics.jsonl", metrics)):
                info = tarfile.TarInfo(f"s/run-a/{fname}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        path = tmp_path / "p.tar.gz"
    else:
        (tmp_path / "s" / "run-a").mkdir(parents=True)
        (tmp_path / "s" / "run-a" / "config.json").write_text("{}")
        (tmp_path / "s" / "run-a" / "metrics.jsonl").write_bytes(metrics)
        path = tmp_path / "s"
    assert summarize.load_runs(str(path), "s")["run-a"]["train"] == {1: rec}
