"""A run's result file for ``experiments/results/``: its resolved config, every record of its ``metrics.jsonl``
and its training stream's token share per width, with what was run, on which machine, when and at which commit.

    python experiments/record_run.py RUN_DIR OUT.json --what TEXT --machine TEXT --commit SHA --command TEXT \
        [--date YYYY-MM-DD]

``RUN_DIR`` is a ``falcon-train`` run folder (``config.json``, ``metrics.jsonl``, ``width_shares.json`` for the
addition task) or a copy of those files.  The result is strict JSON (a non-finite loss is the string "nan", as
in ``metrics.jsonl``); ``experiments/plot_addition_packed.py`` plots such files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from falcon_jax.train.rundir import CONFIG, METRICS, WIDTH_SHARES, dumps_strict, parse_records


def record(run_dir: str, *, what: str, machine: str, commit: str, command: str, date: str) -> dict:
    """The result of the run in ``run_dir``: FileNotFoundError naming the missing file when the folder holds no
    ``config.json`` or ``metrics.jsonl``."""
    paths = {name: os.path.join(run_dir, name) for name in (CONFIG, METRICS, WIDTH_SHARES)}
    for name in (CONFIG, METRICS):
        if not os.path.isfile(paths[name]):
            raise FileNotFoundError(f"{run_dir} holds no {name}: give the run folder (or a copy of its "
                                    f"{CONFIG} and {METRICS})")
    with open(paths[CONFIG]) as f:
        config = json.load(f)
    with open(paths[METRICS]) as f:
        metrics = parse_records(f)
    out = {"what": what, "machine": machine, "date": date, "commit": commit, "command": command,
           "config": config}
    if os.path.isfile(paths[WIDTH_SHARES]):
        with open(paths[WIDTH_SHARES]) as f:
            shares = json.load(f)
        out["token_share_per_width"] = {"padding": shares["padding"],
                                        "widths": {w: v["tokens"] for w, v in shares["widths"].items()},
                                        "source": f"the run's {WIDTH_SHARES}"}
    out["metrics"] = metrics
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--what", required=True, help="what was run: model, preset, schedule, how it was split")
    p.add_argument("--machine", required=True, help="the GPU or CPU, jax version and settings that matter")
    p.add_argument("--commit", required=True, help="the commit of the code that ran")
    p.add_argument("--command", required=True, help="the command(s) that made the run")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    try:
        result = record(args.run_dir, what=args.what, machine=args.machine, commit=args.commit,
                        command=args.command, date=args.date)
    except FileNotFoundError as e:
        print(f"record_run: error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        f.write(dumps_strict(result))
    evals = [r for r in result["metrics"] if r.get("kind") == "eval"]
    print(f"wrote {args.out}: {len(result['metrics'])} records, last evaluation at step "
          f"{evals[-1]['step'] if evals else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
