"""What a run tells its user about its outputs: where it writes them (at the start), the
end-of-run table (printed and saved as ``report.txt``), the plots, and the list of files it
wrote (at the end).

matplotlib is optional (the ``train`` extra): without it the plots are skipped with a note on
how to get them, and it is imported only when plotting (it takes a second to import).
"""

from __future__ import annotations

import importlib.util
import os

from falcon_jax.train.rundir import (ACCURACY_PLOT, CHECKPOINTS, CONFIG, LOSS_PLOT, METRICS, REPORT, checkpoint_steps,
                                     read_metrics, write_atomic)
NO_MATPLOTLIB = ('[plots] matplotlib is not installed, so no plots are written; to get them install the '
                 'train extra: pip install -e ".[train]" (in the falcon-jax checkout), or pip install matplotlib.')

DESCRIPTIONS = {
    REPORT: "the table above",
    LOSS_PLOT: "training loss per step",
    ACCURACY_PLOT: "accuracy per operand width at the last evaluation",
    METRICS: "every logged record, one JSON object a line",
    CONFIG: "the resolved config",
}


def percent(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def plots_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def planned_plots(cfg) -> list[str]:
    if not cfg.train.plots:
        return []
    return [LOSS_PLOT] + ([ACCURACY_PLOT] if cfg.data.kind == "addition" else [])


def start_lines(cfg) -> list[str]:
    """Where the run writes (said before any model or data work)."""
    run_dir = os.path.abspath(cfg.train.run_dir)
    during = [CONFIG, METRICS] + ([CHECKPOINTS + "/"] if cfg.checkpoint.enabled else [])
    plots = planned_plots(cfg)
    missing = plots and not plots_available()
    lines = [f"Run directory: {run_dir}",
             f"  while training: {', '.join(during)}; at the end: {', '.join([REPORT] + ([] if missing else plots))}"]
    if 0 < cfg.train.steps <= cfg.optim.warmup_steps:  # e.g. a short trial of a long preset
        lines.append(f"  note: optim.warmup_steps={cfg.optim.warmup_steps} >= train.steps={cfg.train.steps}: the "
                     f"learning rate stays in its warm-up and never reaches optim.lr={cfg.optim.lr:g} (--set "
                     f"optim.warmup_steps=N to shorten it)")
    ignored = ignored_data_settings(cfg.data)
    if ignored:
        lines.append(f"  note: not read with data.kind={cfg.data.kind!r}: {', '.join(ignored)}")
    return lines + (["  " + NO_MATPLOTLIB] if missing else [])


ADDITION_ONLY = ("train_min_width", "train_max_width", "eval_widths", "eval_examples", "greedy_widths",
                 "greedy_examples", "heldout_frac", "split_seed", "pack", "width_sampling", "curriculum_steps",
                 "curriculum_start_width")
TEXT_ONLY = ("paths", "tokenizer", "bpe_vocab_size", "val_frac", "val_batches", "text_key", "cache_dir")


def ignored_data_settings(data) -> list[str]:
    """``data.<field>=<value>`` for the settings of the other data kind that differ from their defaults (e.g.
    data.paths on an addition run: a forgotten data.kind=text)."""
    other = TEXT_ONLY if data.kind == "addition" else ADDITION_ONLY
    default = type(data)()
    return [f"data.{f}={getattr(data, f)!r}" for f in other if getattr(data, f) != getattr(default, f)]


def widths_with_fewer_problems(accuracy: dict, eval_examples: int) -> list[str]:
    """``"width (problems)"`` for each width of a teacher-forced ``{width: {"problems": k, ...}}`` evaluated on
    fewer than ``eval_examples`` problems (records without a count: none)."""
    return [f"{w} ({accuracy[w]['problems']})" for w in sorted(accuracy, key=int)
            if accuracy[w].get("problems", eval_examples) < eval_examples]


def summary_lines(cfg, rec: dict | None) -> list[str]:
    """The end-of-run table of the last evaluation ``rec`` (none without one)."""
    if not rec:
        return []
    if cfg.data.kind == "addition":
        tf, gr = rec.get("teacher_forced", {}), rec.get("greedy", {})
        few = widths_with_fewer_problems(tf, cfg.data.eval_examples)
        out = [f"Addition accuracy at step {rec['step']} (trained widths {cfg.data.train_min_width}-"
               f"{cfg.data.train_max_width}; held-out problems; {cfg.data.eval_examples} distinct per width"
               + (f"; all of them at widths with fewer: {', '.join(few)}" if few else "") + ")",
               f"{'width':>5} | {'split':<12} | {'exact (TF)':>10} | {'digit (TF)':>10} | {'greedy exact':>12}",
               "-" * 62]
        in_dist = set(cfg.data.in_dist_widths())
        for k in sorted(tf, key=int):
            split = "in-dist" if int(k) in in_dist else "longer"
            g = f"{100 * gr[k]:.1f}%" if k in gr else "-"
            out.append(f"{int(k):>5} | {split:<12} | {100 * tf[k]['exact']:>9.1f}% | "
                       f"{100 * tf[k]['digit']:>9.1f}% | {g:>12}")
        out += ["-" * 62, f"mean teacher-forced exact (per digit): in-distribution {percent(rec.get('in_dist_exact'))} "
                          f"({percent(rec.get('in_dist_digit'))}), longer-than-trained "
                          f"{percent(rec.get('heldout_width_exact'))} ({percent(rec.get('heldout_width_digit'))})"]
        best = rec.get("best_in_dist")
        if best:
            out.append(f"checkpoint choice (best in-distribution exact, longer widths not looked at): step "
                       f"{best['step']}: in-distribution {percent(best.get('in_dist_exact'))}, longer-than-trained "
                       f"{percent(best.get('heldout_width_exact'))} ({percent(best.get('heldout_width_digit'))} per digit)")
        return out
    if "val_loss" in rec:
        return [f"Validation at step {rec['step']}: loss {rec['val_loss']:.4f} nats/token, ppl {rec['val_ppl']:.2f} "
                f"({rec['val_tokens']} tokens)"]
    return []


def make_plots(run_dir: str, cfg) -> tuple[list[str], str | None]:
    """Write ``loss.png`` (training loss per step) and, for addition, ``accuracy_vs_width.png``
    (the last evaluation).  Returns (the paths written, a note when plotting was skipped)."""
    if not plots_available():
        return [], NO_MATPLOTLIB
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    train, evals = read_metrics(run_dir)
    if train:
        steps = sorted(train)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, [train[s]["loss"] for s in steps], lw=1, label="train")
        val = [(e["step"], e["val_loss"]) for e in evals if "val_loss" in e]
        if val:
            ax.plot(*zip(*val), "o-", label="validation")
        ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)"), ax.set_yscale("log"), ax.legend()
        ax.set_title(f"{cfg.model.get('mixer', '')} — {os.path.basename(os.path.abspath(run_dir))}")
        written.append(os.path.join(run_dir, LOSS_PLOT))
        fig.tight_layout(), _save_figure(fig, written[-1]), plt.close(fig)
    acc = [e for e in evals if "teacher_forced" in e]
    if acc:
        e = acc[-1]
        tf = e["teacher_forced"]
        ws = sorted(tf, key=int)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([int(w) for w in ws], [100 * tf[w]["exact"] for w in ws], "o-", label="exact (teacher-forced)")
        ax.plot([int(w) for w in ws], [100 * tf[w]["digit"] for w in ws], "s--", label="per digit (teacher-forced)")
        if e.get("greedy"):
            g = sorted(e["greedy"], key=int)
            ax.plot([int(w) for w in g], [100 * e["greedy"][w] for w in g], "^:", label="exact (greedy)")
        ax.axvline(cfg.data.train_max_width + 0.5, color="gray", lw=1, ls=":")
        ax.set_xlabel("digits per operand"), ax.set_ylabel("accuracy (%)"), ax.set_ylim(-2, 102), ax.legend()
        ax.set_title(f"step {e['step']}: trained on widths {cfg.data.train_min_width}-{cfg.data.train_max_width}")
        written.append(os.path.join(run_dir, ACCURACY_PLOT))
        fig.tight_layout(), _save_figure(fig, written[-1]), plt.close(fig)
    return written, None


def _save_figure(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, whole or not at all: a full disk or a kill while saving leaves the earlier
    plot of a resumed run."""
    write_atomic(path, lambda f: fig.savefig(f, dpi=120, format="png"))


def finish(cfg, last_eval: dict | None, say=print) -> list[str]:
    """At the end of a run (process 0): print the table and save it as ``report.txt``, write the
    plots, then list the files in the run directory.  Returns the paths of the report and plots."""
    run_dir = os.path.abspath(cfg.train.run_dir)
    table = summary_lines(cfg, last_eval)
    written = []
    if table:
        say("")
        for line in table:
            say(line)
        written.append(os.path.join(run_dir, REPORT))
        write_atomic(written[-1], "\n".join(table) + "\n")  # a full disk or a kill leaves the earlier report
    if cfg.train.plots:
        plots, note = make_plots(run_dir, cfg)
        written += plots
        if note:
            say(note)
    files = [os.path.basename(p) for p in written] + [METRICS, CONFIG]
    say("")
    say(f"Files in {run_dir}:")
    for name in files:
        say(f"  {name:<22} {DESCRIPTIONS[name]}")
    steps = checkpoint_steps(run_dir)
    if steps:
        say(f"  {CHECKPOINTS + '/':<22} steps {', '.join(map(str, steps))}")
    return written
