"""Plots in the run directory (matplotlib is optional: without it the plots are skipped)."""

from __future__ import annotations

import os

from falcon_jax.train.rundir import read_metrics


def make_plots(run_dir: str, cfg) -> str | None:
    """Write ``loss.png`` (training loss per step) and, for addition, ``accuracy_vs_width.png``
    (the last evaluation).  Returns a note when plotting was skipped, else None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "[plots] matplotlib is not installed; skipping PNGs (pip install matplotlib)."
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
        fig.tight_layout(), fig.savefig(os.path.join(run_dir, "loss.png"), dpi=120), plt.close(fig)
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
        fig.tight_layout(), fig.savefig(os.path.join(run_dir, "accuracy_vs_width.png"), dpi=120), plt.close(fig)
    return None
