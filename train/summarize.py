"""Tables and plots from the packed results of an experiment suite (:mod:`falcon_jax.train.suite`).

    python experiments/summarize.py addition results.tar.gz --tag h200-2026-11-29
    python experiments/summarize.py lm lm.tar.gz --tag h200-2026-11-29
    python experiments/summarize.py addition-sweep sweep.tar.gz --tag h200-2026-11-29

Writes ``<out-dir>/<suite>-<tag>.json`` (the numbers every table is made from),
``<img-dir>/<suite>-<tag>-*.png`` and prints the markdown tables; ``experiments/summarize.py``
sets the two folders to the repository's ``experiments/results`` and ``docs/img`` (docs/results.md).

Addition: the reported step of a run is the one with the best *in-distribution* validation
exact match (held-out problems at the trained widths), so the longer-width numbers are not
chosen by looking at them; the final step's free-running (greedy) exact match is printed too.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile

from falcon_jax.train.rundir import CONFIG, METRICS, dumps_strict, parse_records


def load_runs(path: str, suite: str) -> dict[str, dict]:
    """``{run name: {"config": ..., "train": {step: rec}, "evals": [...], "speed": [...]}}``."""
    runs: dict[str, dict] = {}

    def add(name, fname, text):
        r = runs.setdefault(name, {"train": {}, "evals": {}, "speed": []})
        if fname == CONFIG:
            r["config"] = json.loads(text)
        elif fname == METRICS:
            for rec in parse_records(text.splitlines()):
                kind = rec.get("kind")
                if kind == "train":
                    r["train"][rec["step"]] = rec  # a resumed run rewrites steps: the last one wins
                elif kind == "eval":
                    r["evals"][rec["step"]] = rec
                elif kind == "speed":
                    r["speed"].append(rec)

    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            for f in (CONFIG, METRICS):
                p = os.path.join(path, name, f)
                if os.path.exists(p):
                    with open(p, encoding="utf-8", errors="replace") as fh:  # a bad byte: a skipped line
                        add(name, f, fh.read())
    else:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                parts = m.name.split("/")
                if len(parts) == 3 and parts[0] == suite and parts[2] in (CONFIG, METRICS):
                    add(parts[1], parts[2], tar.extractfile(m).read().decode(errors="replace"))
    for r in runs.values():
        r["evals"] = [r["evals"][s] for s in sorted(r["evals"])]
    return runs


def addition_rows(runs: dict) -> list[dict]:
    rows = []
    for name, r in runs.items():
        if not r["evals"]:
            continue
        max_w = r["config"]["data"]["train_max_width"]
        best = max(r["evals"], key=lambda e: (e["in_dist_exact"], e["step"]))
        last = r["evals"][-1]
        tf = best["teacher_forced"]
        longer = sorted((int(w) for w in tf if int(w) > max_w))
        rows.append({
            "run": name, "mixer": r["config"]["model"]["mixer"],
            "alignment": r["config"]["model"].get("alignment", "shifted"),
            "timing": r["config"]["model"].get("timing", "raw"), "seed": r["config"]["train"]["seed"],
            "best_step": best["step"], "in_dist_exact": best["in_dist_exact"],
            "heldout_mean_exact": best["heldout_width_exact"],
            "exact_at": {w: tf[str(w)]["exact"] for w in (longer[0], longer[-1])} if longer else {},
            "digit_at": {w: tf[str(w)]["digit"] for w in (1, 2, 4, 8, max_w, *longer[-1:]) if str(w) in tf},
            "exact_by_width": {int(w): v["exact"] for w, v in tf.items()},
            "final_step": last["step"], "final_greedy_exact": last.get("greedy", {}),
            "final_loss": r["train"][max(r["train"])]["loss"] if r["train"] else None,
        })
    return rows


def lm_rows(runs: dict) -> list[dict]:
    rows = []
    for name, r in runs.items():
        vals = [e for e in r["evals"] if "val_loss" in e]
        if not vals:
            continue
        c = r["config"]
        tok_per_step = c["train"]["batch_size"] * (c["data"]["seq_len"] - 1)
        steady = [s["tokens_per_s"] for s in r["speed"] if s["step"] > 2 * c["train"]["log_every"]]
        rows.append({
            "run": name, "mixer": c["model"]["mixer"], "steps": vals[-1]["step"],
            "tokens": vals[-1]["step"] * tok_per_step, "val_loss": vals[-1]["val_loss"],
            "val_ppl": vals[-1]["val_ppl"], "val_tokens": vals[-1]["val_tokens"],
            "val_curve": [(e["step"], e["val_loss"]) for e in vals],
            "tokens_per_s_median": sorted(steady)[len(steady) // 2] if steady else None,
        })
    return rows


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def addition_markdown(rows: list[dict]) -> str:
    out = io.StringIO()
    out.write("| run | best step | in-dist exact | longer widths mean | at first longer | at last longer "
              "| greedy exact (final, widths) |\n|---|---|---|---|---|---|---|\n")
    for r in rows:
        ex = list(r["exact_at"].values())
        g = ", ".join(f"{w}: {pct(v)}" for w, v in r["final_greedy_exact"].items())
        out.write(f"| {r['run']} | {r['best_step']} | {pct(r['in_dist_exact'])} | {pct(r['heldout_mean_exact'])} | "
                  f"{pct(ex[0]) if ex else '–'} | {pct(ex[-1]) if ex else '–'} | {g or '–'} |\n")
    return out.getvalue()


def lm_markdown(rows: list[dict]) -> str:
    out = io.StringIO()
    out.write("| model | steps | tokens | val loss (nats/byte) | val ppl | tokens/s (median) |\n"
              "|---|---|---|---|---|---|\n")
    for r in rows:
        tps = f"{r['tokens_per_s_median'] / 1e3:,.0f}k" if r["tokens_per_s_median"] else "–"
        out.write(f"| {r['run']} | {r['steps']} | {r['tokens'] / 1e6:.1f}M | {r['val_loss']:.4f} | "
                  f"{r['val_ppl']:.3f} | {tps} |\n")
    return out.getvalue()


def plots(suite: str, rows: list[dict], runs: dict, prefix: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[summarize] matplotlib missing: no plots")
        return []
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        if r["train"]:
            s = sorted(r["train"])
            ax.plot(s, [r["train"][i]["loss"] for i in s], lw=1, label=name)
    ax.set_xlabel("step"), ax.set_ylabel("training loss (nats/token)"), ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:  # runs without training records draw nothing to label
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(prefix + "-loss.png", dpi=110), plt.close(fig)
    written.append(prefix + "-loss.png")
    if suite != "lm":
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in rows:
            w = sorted(r["exact_by_width"])
            ax.plot(w, [100 * r["exact_by_width"][i] for i in w], ".-", lw=1, label=r["run"])
        ax.set_xlabel("digit width"), ax.set_ylabel("teacher-forced exact match (%)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(prefix + "-accuracy-vs-width.png", dpi=110), plt.close(fig)
        written.append(prefix + "-accuracy-vs-width.png")
    return written


def main(argv=None, *, out_dir: str = ".", img_dir: str = ".") -> int:
    """The command line; ``out_dir`` and ``img_dir``: the defaults of ``--out-dir`` and ``--img-dir``."""
    p = argparse.ArgumentParser(description="Summarize a packed experiment suite.")
    p.add_argument("suite", choices=("addition", "addition-sweep", "addition-m", "lm"))
    p.add_argument("results", help="the .tar.gz written by suite.py --pack, or a runs/exp/<suite> folder")
    p.add_argument("--tag", required=True, help="name of this result set, e.g. h200-2026-11-29")
    p.add_argument("--out-dir", default=out_dir, help=f"where the JSON goes (default: {out_dir})")
    p.add_argument("--img-dir", default=img_dir, help=f"where the plots go (default: {img_dir})")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier result of this suite and tag")
    args = p.parse_args(argv)
    if not args.tag or os.sep in args.tag:
        p.error(f"--tag {args.tag!r}: a name without '{os.sep}' (it names the files SUITE-TAG.json and the plots)")
    out = os.path.join(args.out_dir, f"{args.suite}-{args.tag}.json")
    if os.path.exists(out) and not args.overwrite:  # the defaults are the repository's published results
        p.error(f"{out} exists: pass --overwrite to replace it (and its plots), or choose another --tag")
    runs = load_runs(args.results, args.suite)
    if not runs:  # a mistyped suite name or folder would write an empty result over a good one
        p.error(f"{args.results} holds no run of the suite {args.suite!r}: check the suite name and the path")
    rows = lm_rows(runs) if args.suite == "lm" else addition_rows(runs)
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.img_dir, exist_ok=True)
    with open(out, "w") as f:  # strict JSON: a diverged run's NaN loss is the string "nan", as in metrics.jsonl
        f.write(dumps_strict({"suite": args.suite, "tag": args.tag, "rows": rows,
                              "configs": {n: r.get("config") for n, r in runs.items()}}, indent=1))
    print(lm_markdown(rows) if args.suite == "lm" else addition_markdown(rows))
    for f in plots(args.suite, rows, runs, os.path.join(args.img_dir, f"{args.suite}-{args.tag}")):
        print("wrote", f)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
