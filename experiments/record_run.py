"""A run's result file for ``experiments/results/``: its resolved config, every record of its ``metrics.jsonl``
and its training stream's token share per width, with what was run, on which machine, when and at which commit.

    python experiments/record_run.py RUN_DIR OUT.json --what TEXT --machine TEXT --commit SHA --command TEXT \
        [--date YYYY-MM-DD] [--overwrite]

``RUN_DIR`` is a ``falcon-train`` run folder (``config.json``, ``metrics.jsonl``, ``width_shares.json`` for the
addition task) or a copy of those files; its ``metrics.jsonl`` must hold at least one evaluation record.  The
result is strict JSON (a non-finite loss is the string "nan", as in ``metrics.jsonl``);
``experiments/plot_addition_packed.py`` plots such files.  An existing ``OUT.json`` is replaced only with
``--overwrite``, and never when it is one of the run's own files; OUT is checked before the run folder is read,
and the file is written whole or not at all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from falcon_jax.train.rundir import CONFIG, METRICS, WIDTH_SHARES, dumps_strict, metric_records, write_atomic


class RecordError(ValueError):
    """The run folder or the output cannot be used (one line, exit code 2)."""


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:  # a file cut by a kill, or not a run's file
        raise RecordError(f"{path} is not JSON ({e}); give a run folder written by falcon-train") from None


def record(run_dir: str, *, what: str, machine: str, commit: str, command: str, date: str) -> dict:
    """The result of the run in ``run_dir``: FileNotFoundError naming the missing file when the folder holds no
    ``config.json`` or ``metrics.jsonl``; :class:`RecordError` when a file cannot be read as the run's, or when
    ``metrics.jsonl`` holds no evaluation record (a result without one cannot be plotted or tabled)."""
    paths = {name: os.path.join(run_dir, name) for name in (CONFIG, METRICS, WIDTH_SHARES)}
    for name in (CONFIG, METRICS):
        if not os.path.isfile(paths[name]):
            raise FileNotFoundError(f"{run_dir} holds no {name}: give the run folder (or a copy of its "
                                    f"{CONFIG} and {METRICS})")
    config = _read_json(paths[CONFIG])
    metrics = metric_records(run_dir)  # read as the trainer's own readers read it
    if not metrics:  # a result without a record would pass for a run that was measured
        raise RecordError(f"{paths[METRICS]} holds no records: the run has not logged a step yet")
    if not any(r.get("kind") == "eval" for r in metrics):  # the plots and tables read the evaluations
        raise RecordError(f"{run_dir} holds no evaluation record (no \"kind\": \"eval\" line in its {METRICS}): "
                          f"record the run once it has evaluated (every train.eval_every steps, and at its end)")
    out = {"what": what, "machine": machine, "date": date, "commit": commit, "command": command,
           "config": config}
    if os.path.isfile(paths[WIDTH_SHARES]):
        shares = _read_json(paths[WIDTH_SHARES])
        try:
            out["token_share_per_width"] = {"padding": shares["padding"],
                                            "widths": {w: v["tokens"] for w, v in shares["widths"].items()},
                                            "source": f"the run's {WIDTH_SHARES}"}
        except (KeyError, TypeError, AttributeError):
            raise RecordError(f"{paths[WIDTH_SHARES]} is not a width shares file (it needs \"padding\" and "
                              f"\"widths\" with each width's \"tokens\"); remove it or take it from the run") from None
    out["metrics"] = metrics
    return out


def check_out(out: str, run_dir: str, overwrite: bool) -> None:
    """``out`` may be written: its folder exists, it is not one of the run's files, and it is new (or
    ``overwrite``).  RecordError otherwise.  It looks at paths only, so :func:`main` runs it before the run
    folder is read: a wrong OUT is reported at once, not after a long ``metrics.jsonl`` has been parsed, and
    not hidden behind a fault of the run folder."""
    own = {os.path.realpath(os.path.join(run_dir, name)): name for name in (CONFIG, METRICS, WIDTH_SHARES)}
    if os.path.realpath(out) in own:
        raise RecordError(f"{out} is the run's own {own[os.path.realpath(out)]}; write the result elsewhere, e.g. "
                          f"experiments/results/NAME.json")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise RecordError(f"the folder {folder} of the output does not exist; create it first")
    if os.path.isdir(out):
        raise RecordError(f"{out} is a folder; give the result file's path, e.g. {os.path.join(out, 'NAME.json')}")
    if os.path.exists(out) and not overwrite:
        raise RecordError(f"{out} already exists; pass --overwrite to replace it, or choose another name")


def _date(text: str) -> str:
    try:
        return datetime.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"--date {text!r}: expected YYYY-MM-DD, e.g. 2026-01-02") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--what", required=True, help="what was run: model, preset, schedule, how it was split")
    p.add_argument("--machine", required=True, help="the GPU or CPU, jax version and settings that matter")
    p.add_argument("--commit", required=True, help="the commit of the code that ran")
    p.add_argument("--command", required=True, help="the command(s) that made the run")
    p.add_argument("--date", type=_date, default=datetime.date.today().isoformat(), help="YYYY-MM-DD (default: today)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = p.parse_args(argv)
    empty = [f"--{k}" for k in ("what", "machine", "commit", "command") if not getattr(args, k).strip()]
    if empty:  # the labels the docs cite each number with
        p.error(f"{', '.join(empty)}: give a non-empty description")
    try:
        check_out(args.out, args.run_dir, args.overwrite)  # first: a wrong OUT is reported before any reading
        replaced = os.path.exists(args.out)
        result = record(args.run_dir, what=args.what, machine=args.machine, commit=args.commit,
                        command=args.command, date=args.date)
        write_atomic(args.out, dumps_strict(result))
    except (FileNotFoundError, RecordError) as e:
        print(f"record_run: error: {e}", file=sys.stderr)
        return 2
    evals = [r for r in result["metrics"] if r.get("kind") == "eval"]
    print(f"{'replaced' if replaced else 'wrote'} {args.out}: {len(result['metrics'])} records, last evaluation at "
          f"step {evals[-1]['step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
