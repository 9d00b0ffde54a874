"""Plots of packed-addition runs from their result files: mean in-distribution exact match against training
tokens, and teacher-forced accuracy by operand width at each run's last evaluation; and each run's row in
Table 3's columns.

    python experiments/plot_addition_packed.py OUT_PREFIX LABEL=RESULT.json [LABEL=RESULT.json ...]

writes ``OUT_PREFIX-learning-curves.png``, ``OUT_PREFIX-accuracy-vs-width.png`` and
``OUT_PREFIX-exact-by-width.png`` (each run's exact match per width at every evaluation, one panel a run) and
prints the table (:func:`table3_row`).  A result file is the JSON
``experiments/results/addition-packed-*.json`` holds: the run's ``config`` and every record of its
``metrics.jsonl`` (``kind`` "eval": ``teacher_forced`` per width, ``exact`` and ``digit``).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from falcon_jax.train.config import ConfigError, TrainConfig  # noqa: E402

TARGET = 95.0  # the in-distribution target of the addition experiment, % exact


class ResultError(ValueError):
    """A result file that cannot be plotted (the command line prints it in one line, exit code 2)."""


def load(path: str):
    """``(tokens per step, eval records by step, trained widths)`` of one result file; the trained widths are the
    evaluated ones the trainer's in-distribution means average over (``DataConfig.in_dist_widths()``), and a step
    evaluated twice (the last evaluation repeated at the end of a run) keeps its last record.  ResultError naming
    the file when it is missing, not JSON, not an addition result file, or holds no evaluation."""
    try:
        with open(path) as f:
            res = json.load(f)
    except OSError as e:
        raise ResultError(f"{path}: {e.strerror or type(e).__name__}") from None
    except ValueError as e:
        raise ResultError(f"{path}: not JSON, or cut short ({e})") from None
    try:
        cfg = res["config"]
        tokens = cfg["train"]["batch_size"] * cfg["data"]["seq_len"]
        evals = {r["step"]: r for r in res["metrics"] if r.get("kind") == "eval"}
        # the trainer's own rule: the evaluated widths up to the widest trained one
        widths = TrainConfig.from_dict(cfg).data.in_dist_widths()
    except (KeyError, TypeError, AttributeError) as e:
        raise ResultError(f"{path}: not an addition result file of experiments/record_run.py (no {e})") from None
    except ConfigError as e:
        raise ResultError(f"{path}: its config is not one falcon-train reads ({e})") from None
    if not widths:
        raise ResultError(f"{path}: not an addition run (data.kind {cfg['data'].get('kind')!r}), or it evaluates "
                          "none of its trained widths")
    if not evals or any("teacher_forced" not in r for r in evals.values()):
        raise ResultError(f"{path}: holds no evaluation with per-width accuracies (a run stopped before its first)")
    return tokens, dict(sorted(evals.items())), list(widths)


def mean_exact(record, widths) -> float:
    return 100.0 * sum(record["teacher_forced"][str(w)]["exact"] for w in widths) / len(widths)


def exact_by_width(evals):
    """``(steps, widths, exact)``: every evaluated width (trained and longer), and exact match in % as a
    ``[len(widths)][len(steps)]`` list of rows: the learning curve of each width."""
    steps = list(evals)
    widths = sorted({int(w) for r in evals.values() for w in r["teacher_forced"]})
    exact = [[100.0 * evals[s]["teacher_forced"][str(w)]["exact"] if str(w) in evals[s]["teacher_forced"]
              else float("nan") for s in steps] for w in widths]
    return steps, widths, exact


def best_step(evals, widths) -> int:
    """The checkpoint Table 3 reports: the trainer's own choice (``best_in_dist`` of the last evaluation: best
    in-distribution exact match, ties to the better per-digit accuracy), else the first step of the best mean
    exact match on the trained widths.  The longer widths are not looked at."""
    last = next(reversed(evals.values()))
    if "best_in_dist" in last:
        return last["best_in_dist"]["step"]
    return max(evals, key=lambda s: (mean_exact(evals[s], widths), -s))


def table3_row(evals, widths) -> dict:
    """Table 3's columns at :func:`best_step`, in %: teacher-forced per-digit accuracy and exact match, their
    means over the trained widths and over the longer ones, and both at the shortest and the longest of the
    longer widths."""
    step = best_step(evals, widths)
    tf = evals[step]["teacher_forced"]
    longer = sorted(int(w) for w in tf if int(w) > max(widths))

    def mean(ws, key):
        return 100.0 * sum(tf[str(w)][key] for w in ws) / len(ws)

    row = {"step": step, "trained_digit": mean(widths, "digit"), "trained_exact": mean(widths, "exact")}
    if longer:
        row.update(longer_digit=mean(longer, "digit"), longer_exact=mean(longer, "exact"),
                   first_longer=longer[0], last_longer=longer[-1],
                   first_digit=100.0 * tf[str(longer[0])]["digit"], last_digit=100.0 * tf[str(longer[-1])]["digit"])
    return row


def print_table3(loaded) -> None:
    print("| run | best step | trained widths: per digit (exact) | longer widths: per digit (exact) | "
          "first / last longer width, per digit |")
    print("|---|---|---|---|---|")
    for label, _, evals, widths in loaded:
        r = table3_row(evals, widths)
        longer = (f"{r['longer_digit']:.1f} ({r['longer_exact']:.1f}) | {r['first_longer']}: {r['first_digit']:.1f} / "
                  f"{r['last_longer']}: {r['last_digit']:.1f}") if "longer_digit" in r else "– | –"
        print(f"| {label} | {r['step']} | {r['trained_digit']:.1f} ({r['trained_exact']:.1f}) | {longer} |")


def main(argv) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    prefix, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
    if any(not label or not path for label, path in runs):
        print("give every run as LABEL=RESULT.json, neither part empty", file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        print(f"{prefix}: the folder {folder} does not exist", file=sys.stderr)
        return 2
    try:  # every file read before any plot is written
        loaded = [(label, *load(path)) for label, path in runs]
    except ResultError as e:
        print(e, file=sys.stderr)
        return 2

    # One colour per run in both line plots (its exact and per-digit lines share it); tab20 keeps ten
    # or more runs apart.
    colours = plt.get_cmap("tab10" if len(loaded) <= 10 else "tab20").colors
    fig, ax = plt.subplots(figsize=(10.5, 4.5))
    for (label, tokens, evals, widths), colour in zip(loaded, colours):
        steps = list(evals)
        ax.plot([s * tokens / 1e9 for s in steps], [mean_exact(evals[s], widths) for s in steps], marker="o",
                markersize=3, label=label, color=colour)
    ax.axhline(TARGET, color="gray", linestyle=":", linewidth=1)
    _save(fig, ax, "training tokens (B)", "mean exact match, trained widths (%)", f"{prefix}-learning-curves.png")

    fig, ax = plt.subplots(figsize=(10.5, 4.5))
    for (label, _, evals, widths), colour in zip(loaded, colours):
        step, last = next(reversed(evals.items()))
        all_widths = sorted(int(w) for w in last["teacher_forced"])
        for key, style in (("exact", "-"), ("digit", "--")):
            ax.plot(all_widths, [100.0 * last["teacher_forced"][str(w)][key] for w in all_widths], style,
                    marker="o", markersize=3, color=colour, label=f"{label}, step {step}: {'exact' if key == 'exact' else 'per digit'}")
        ax.axvline(max(widths) + 0.5, color="gray", linestyle=":", linewidth=1)
    _save(fig, ax, "digits per operand", "teacher-forced accuracy (%)", f"{prefix}-accuracy-vs-width.png")
    cols = min(3, len(loaded))
    rows = -(-len(loaded) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.2, 3.4 * rows), squeeze=False, layout="constrained")
    for ax, (label, tokens, evals, widths) in zip(axes.flat, loaded):
        steps, all_widths, exact = exact_by_width(evals)
        image = ax.imshow(exact, aspect="auto", origin="lower", vmin=0, vmax=100, cmap="viridis",
                          extent=(steps[0] * tokens / 1e9, steps[-1] * tokens / 1e9, all_widths[0] - 0.5,
                                  all_widths[-1] + 0.5), interpolation="nearest")
        ax.axhline(max(widths) + 0.5, color="white", linestyle=":", linewidth=1)
        ax.set_title(textwrap.fill(label, 36), fontsize=8)
        ax.set_xlabel("training tokens (B)", fontsize=8)
        ax.set_ylabel("digits per operand", fontsize=8)
    for ax in list(axes.flat)[len(loaded):]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes, label="teacher-forced exact match (%)", shrink=0.8)
    fig.savefig(f"{prefix}-exact-by-width.png", dpi=100)
    plt.close(fig)
    print_table3(loaded)
    return 0


def _save(fig, ax, xlabel: str, ylabel: str, path: str):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-2, 102)
    # Outside the axes: with many runs a legend inside hides the curves.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
