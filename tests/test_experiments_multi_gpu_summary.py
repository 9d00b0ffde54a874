"""experiments/multi_gpu_summary.py: the restored run (a copy of the 2-GPU run's folder, resumed on
one GPU) is measured on its own process's records only, not on the copied run's."""

import json

import numpy as np

from experiments import multi_gpu_summary


def _write(folder, records):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(rng, steps, tok_s, devices, log_every=25):
    """Train records for ``steps`` and speed records every ``log_every`` steps at ``tok_s``."""
    out = []
    for s in steps:
        out.append({"kind": "train", "step": int(s), "loss": float(5 - s / 100 + 0.01 * rng.normal())})
        if s % log_every == 0:
            out.append({"kind": "speed", "step": int(s), "tokens_per_s": tok_s * (1 + 0.01 * rng.normal()),
                        "s_per_step": 0.1, "devices": devices, "tokens_per_s_per_device": tok_s / devices,
                        "peak_bytes_per_device": 2**30 * devices})
    return out


def test_restored_run_uses_only_its_own_records(tmp_path):
    rng = np.random.default_rng()
    g1 = _run(rng, range(1, 201), 3.5e5, 1)
    fsdp = _run(rng, range(1, 201), 2.4e5, 2)
    resumed = _run(rng, range(101, 151), 3.6e5, 1)  # restored at 100, cut after step 150
    resumed[0]["loss"] = fsdp[[r.get("step") for r in fsdp].index(101)]["loss"] + 1e-4  # first step reproduced
    _write(tmp_path / "g1", g1)
    _write(tmp_path / "g2-fsdp", fsdp)
    _write(tmp_path / "g2to1", fsdp + resumed)  # the copied folder, then the resumed process's lines
    res = multi_gpu_summary.summarize(str(tmp_path), resume_from=100)
    want = [r["tokens_per_s"] for r in resumed if r["kind"] == "speed"][1:]  # first interval holds compilation
    assert res["g2to1"]["tokens_per_s"] == np.median(want)
    assert res["g2to1"]["devices"] == 1
    after = res["g2to1"]["vs_g2_fsdp_after_restore"]
    assert after["steps"] == 50  # steps 101-150, not the copied 101-200
    assert after["first_loss_after_restore"] == resumed[0]["loss"]
    assert 0 < after["max_abs_diff"] < 0.1
    assert res["g2-fsdp"]["scaling_efficiency"] == res["g2-fsdp"]["tokens_per_s_per_device"] / res["g1"]["tokens_per_s"]


def test_last_process_without_a_restart_keeps_everything():
    records = [{"step": s} for s in (25, 50, 75)]
    assert multi_gpu_summary.last_process(records) == records
    assert multi_gpu_summary.last_process(records + [{"step": 50}, {"step": 75}]) == [{"step": 50}, {"step": 75}]
