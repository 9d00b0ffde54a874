"""Summarise the runs of experiments/multi_gpu.sh (issue #8): throughput per device and scaling
efficiency against the 1-GPU run, peak memory per device, and how closely each run's loss curve
follows the 1-GPU run with the same global batch (and the resumed run follows the run it was
restored from).

    python experiments/multi_gpu_summary.py runs/mgpu --resume-from 200 --out multi_gpu.json

Throughput is the median of the logged intervals after the first (which holds compilation).
"Noise" is the loss's own step-to-step scatter in the 1-GPU run: the standard deviation of the
loss minus its centred 11-step moving average, over the last two thirds of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from falcon_jax.train.trainer import metric_records, read_metrics  # noqa: E402

RUNS = {"g1": "1 GPU", "g2-fsdp": "2 GPUs, 1 process, data=1 x fsdp=2", "g2-data": "2 GPUs, 1 process, data=2",
        "g2-proc": "2 GPUs, 2 processes (jax.distributed), data=2", "g2to1": "g2-fsdp restored on 1 GPU"}


def last_process(records: list[dict]) -> list[dict]:
    """The records a resumed run's process wrote: they follow those of the run it was copied from, from
    the last point where the step number goes back (all of them if it never does)."""
    starts = [i for i in range(1, len(records)) if records[i]["step"] <= records[i - 1]["step"]]
    return records[starts[-1] if starts else 0:]


def loss_noise(losses: np.ndarray, width: int = 11) -> float:
    tail = losses[len(losses) // 3:]
    if len(tail) < 2 * width:
        return float("nan")
    smooth = np.convolve(tail, np.ones(width) / width, mode="valid")
    h = width // 2
    return float(np.std(tail[h:len(tail) - h] - smooth))


def summarize(base: str, resume_from: int) -> dict:
    res = {}
    for name in RUNS:
        d = os.path.join(base, name)
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            continue
        train, evals = read_metrics(d)
        sp = metric_records(d, "speed")
        if name == "g2to1":  # only the intervals the resumed process ran
            sp = [r for r in last_process(sp) if r["step"] > resume_from]
        timed = sp[1:] if len(sp) > 1 else sp
        res[name] = {
            "label": RUNS[name],
            "steps": sorted(train),
            "loss": [train[s]["loss"] for s in sorted(train)],
            "devices": sp[-1].get("devices") if sp else None,
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in timed])) if timed else None,
            "tokens_per_s_per_device": float(np.median([r.get("tokens_per_s_per_device", float("nan"))
                                                        for r in timed])) if timed else None,
            "s_per_step": float(np.median([r["s_per_step"] for r in timed])) if timed else None,
            "peak_gib_per_device": (max(peaks) / 2**30) if (peaks := [r["peak_bytes_per_device"] for r in sp
                                                                       if r.get("peak_bytes_per_device")]) else None,
            "val_loss": evals[-1].get("val_loss") if evals else None,
        }
    if "g1" in res:
        ref = dict(zip(res["g1"]["steps"], res["g1"]["loss"]))
        res["g1"]["loss_noise"] = loss_noise(np.asarray(res["g1"]["loss"]))
        for name, r in res.items():
            if name == "g1":
                continue
            common = [s for s in r["steps"] if s in ref]
            diff = np.asarray([r["loss"][r["steps"].index(s)] - ref[s] for s in common])
            r["vs_g1"] = {"steps": len(common), "max_abs_diff": float(np.max(np.abs(diff))) if len(diff) else None,
                          "mean_diff": float(np.mean(diff)) if len(diff) else None}
            if (r.get("devices") or 1) > 1 and r.get("tokens_per_s_per_device") and res["g1"].get("tokens_per_s"):
                r["scaling_efficiency"] = r["tokens_per_s_per_device"] / res["g1"]["tokens_per_s"]
    if "g2to1" in res and "g2-fsdp" in res:
        src = dict(zip(res["g2-fsdp"]["steps"], res["g2-fsdp"]["loss"]))
        # the resumed process's own records (the folder also holds the copied run's, up to its last step)
        train = {r["step"]: r["loss"] for r in last_process(metric_records(os.path.join(base, "g2to1"), "train"))
                 if r["step"] > resume_from}
        diff = np.asarray([train[s] - src[s] for s in sorted(train) if s in src])
        res["g2to1"]["vs_g2_fsdp_after_restore"] = {
            "steps": len(diff), "max_abs_diff": float(np.max(np.abs(diff))) if len(diff) else None,
            "first_loss_after_restore": train.get(resume_from + 1),
            "source_loss_at_that_step": src.get(resume_from + 1)}
    return res


def table(res: dict) -> str:
    rows = ["| run | devices | tok/s | tok/s per device | scaling eff. | s/step | peak GiB/device | final val loss "
            "| max abs loss diff vs 1 GPU |", "|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, fmt)

    for name, r in res.items():
        rows.append(f"| {name}: {r['label']} | {f(r['devices'], 'd')} | {f(r['tokens_per_s'], ',.0f')} | "
                    f"{f(r['tokens_per_s_per_device'], ',.0f')} | {f(r.get('scaling_efficiency'), '.2f')} | "
                    f"{f(r['s_per_step'], '.4f')} | {f(r['peak_gib_per_device'], '.2f')} | {f(r['val_loss'], '.4f')} | "
                    f"{f(r.get('vs_g1', {}).get('max_abs_diff'), '.4f')} |")
    lines = ["\n".join(rows)]
    if "g1" in res:
        lines.append(f"1-GPU loss noise (std about an 11-step moving average): {res['g1']['loss_noise']:.4f}")
    if "g2to1" in res and "vs_g2_fsdp_after_restore" in res["g2to1"]:
        v = res["g2to1"]["vs_g2_fsdp_after_restore"]
        lines.append(f"restored on 1 GPU: {v['steps']} steps after the restore, max |loss - g2-fsdp's| = "
                     f"{f(v['max_abs_diff'], '.5f')}; first step {f(v['first_loss_after_restore'], '.4f')} vs "
                     f"{f(v['source_loss_at_that_step'], '.4f')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the folder holding g1/, g2-fsdp/, g2-proc/, g2to1/")
    p.add_argument("--resume-from", type=int, default=100)
    p.add_argument("--out", help="write the summary JSON here")
    a = p.parse_args(argv)
    res = summarize(a.base, a.resume_from)
    if not res:
        print(f"no runs under {a.base}", file=sys.stderr)
        return 1
    print(table(res))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
