"""The ``lm`` suite's runner (``python -m benchmarks.run --suite lm``; the suite is described there): waves of
configurations, each in a fresh ``benchmarks.worker`` process that runs :mod:`benchmarks.lm`'s ``prepare`` and
``measure``, their rows merged into ``lm.json`` and the table of :func:`lm_table`.  Runs in the parent process:
nothing here imports jax."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import threading
import time

from benchmarks import source_tree, trace_scopes
from benchmarks.common import (ROOT, Log, ResultFiles, Worker, exit_on_sigterm, note, select_names, table,
                               worker_scratch)

# the lm suite: the paper's mixers, the reference (Falcon-1A.3) first and the slow per-column rules last, so
# that a run cut short has the rows that matter most
LM_MIXERS = ("falcon-1A.3", "falcon-1.3", "transformer", "gated_deltanet", "mamba2", "retnet", "deltanet",
             "falcon-3A.3", "falcon-3.3", "falcon-2A.3", "falcon-2.3")
LM_REFERENCE = "falcon-1A.3"
LM_TOKENS, LM_LENGTHS = 32768, (4096, 16384, 32768)  # B = tokens per step // T: 8, 2, 1
SMOKE_LM_TOKENS, SMOKE_LM_LENGTHS = 128, (16, 64, 128)
LM_TIMING = {"warmup": 2, "calls": 2, "repeats": 5, "profile_steps": 1}
SMOKE_LM_TIMING = {"warmup": 1, "calls": 1, "repeats": 2, "profile_steps": 1}
LM_LIMITS = {"prepare": 420, "measure": 180}  # seconds per configuration: build + compile, then timing + profile
# seconds one configuration's measurement takes (warm-up, timed and profiled steps, reading the trace): 2.4-4.7 s
# a row on an H200 at 32,768 tokens per step with the timed executable profiled, plus here one untraced step of
# the profiled executable; ~34 s for the per-column Falcon-2.3 (2.5 s steps), the last mixer measured.  Under
# --budget a wave's compiles end this long per configuration before the budget, so that those which compiled are
# measured; a measurement, once started, gets at least this long
LM_MEASURE_RESERVE = 6.0
LM_MIN_PREPARE = 5.0  # seconds a wave's compiles get however little of the budget is left
# processes share the GPU while others compile: each allocates as it goes (the peak is still per process)
LM_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def select_mixers(patterns: str | None) -> list[str]:
    """The lm suite's mixers named by ``patterns`` (comma-separated names or shell patterns over
    ``LM_MIXERS``, case-insensitive; None: all), in ``LM_MIXERS`` order."""
    if patterns is None:
        return list(LM_MIXERS)
    return select_names(patterns, list(LM_MIXERS), "--mixers", "mixer", fold_case=True)


def lm_table(rows):
    """One line per configuration, with tokens/s against Falcon-1A.3's at the same shape."""
    reference = {r["shape"]: r["tokens_per_s"] for r in rows
                 if r.get("mixer") == LM_REFERENCE and r.get("tokens_per_s")}

    def ratio(r):
        ref = reference.get(r.get("shape"))
        return f"{r['tokens_per_s'] / ref:.2f}" if ref and r.get("tokens_per_s") else None

    def fixed(key, scale=1.0, digits=1):
        return lambda r: None if r.get(key) is None else f"{r[key] * scale:,.{digits}f}"

    def scope_share(key):
        # "–" once most of the device time is unattributed: the share of the rest would read as a measurement
        def cell(r):
            if r.get("unattributed_share") is None:
                return None  # no profile
            if r["unattributed_share"] > trace_scopes.MAX_UNATTRIBUTED or r.get(key) is None:
                return "–"
            return f"{r[key] * 100:,.1f}"
        return cell

    def kernels_share(r):
        # "–" where XLA's own ops serve the mixer: no kernel of its own to find by name
        if r.get("mixer_kernels_share") is None:
            return None
        return "–" if r.get("kernels") == "xla" else f"{r['mixer_kernels_share'] * 100:,.1f}"

    return table(rows, [("mixer", "mixer"), ("BxT", "shape"), ("kernels", "kernels"),
                        ("tokens/s", fixed("tokens_per_s", digits=0)), (f"x {LM_REFERENCE}", ratio),
                        ("step ms", fixed("step_ms")), ("peak GiB", fixed("peak_bytes", 2**-30, 2)),
                        ("compile s", fixed("compile_s")), ("mixer %", scope_share("mixer_share")),
                        ("core %", scope_share("core_share")), ("unattr. %", fixed("unattributed_share", 100)),
                        ("mixer kernels %", kernels_share), ("note", note)])


def prepare_deadline(limit: float, left: float | None, configurations: int) -> float:
    """Seconds a wave of ``configurations`` may build and compile for: ``limit``; under ``--budget`` (``left``:
    its seconds left) at most what remains after ``LM_MEASURE_RESERVE`` s of measuring per configuration, and at
    least ``LM_MIN_PREPARE`` s."""
    if left is None:
        return limit
    return max(min(limit, left - LM_MEASURE_RESERVE * configurations), LM_MIN_PREPARE)


def measure_deadline(limit: float, left: float | None) -> float:
    """Seconds a measurement (started while ``left`` > 0) may take: ``limit``; under ``--budget`` what is left of
    it, but at least ``LM_MEASURE_RESERVE`` s (so the run ends at most that long past the budget)."""
    return limit if left is None else min(limit, max(left, LM_MEASURE_RESERVE))


def _merge_reply(row: dict, stage: str, status: str, reply) -> str:
    """Fold a worker's reply to ``stage`` ("prepare" or "measure") into ``row``: its numbers as fields (its
    "seconds" as ``<stage>_s``) and its notes, or the error under ``row["notes"][stage]``.  Returns the status."""
    if status == "ok" and "error" in reply:
        row["notes"][stage] = reply["error"]
        return "error"
    if status != "ok":
        row["notes"][stage] = status
        return status
    row["notes"].update(reply.pop("notes", {}))
    row[f"{stage}_s"] = reply.pop("seconds", None)
    row.update(reply)
    return status


def run(args, argv) -> int:
    """The lm suite: waves of ``--jobs`` configurations, each in a fresh worker process, built and compiled
    together, then measured one at a time; the JSON is rewritten after every row.

    ``--budget``: no wave starts, and no measurement starts, past it; a wave's compiles are stopped at
    :func:`prepare_deadline` (the budget less ``LM_MEASURE_RESERVE`` s per configuration of the wave), those cut
    there reported as timed out and the others measured, each for at most :func:`measure_deadline`."""
    os.makedirs(args.out, exist_ok=True)
    files = ResultFiles(os.path.join(args.out, "lm.json"))
    log = Log(files.log_now)
    if files.note():
        log(files.note())
    started = time.monotonic()
    scratch, harness = worker_scratch("falcon-bench-")
    tree = source_tree.describe(ROOT)
    if args.commit:
        tree["commit"] = args.commit
    import_path = source_tree.import_path(ROOT, os.path.join(scratch, "tree-0"))
    timing = SMOKE_LM_TIMING if args.smoke else LM_TIMING
    limits = {k: 300 for k in LM_LIMITS} if args.smoke else LM_LIMITS
    configs = [(mixer, b, t) for b, t in args.lm_shapes for mixer in args.mixers]
    # sharing XLA's autotuning results (GPU; nothing to share on the CPU of --smoke): the first configuration
    # compiles alone (cold and uncontended) and seeds them, then waves of --jobs
    autotune = None if args.cold_compiles or args.smoke else os.path.join(scratch, "autotune")
    if autotune:
        os.makedirs(autotune)
    seeded = 1 if autotune else 0
    waves = [configs[:seeded]] * seeded + [configs[i:i + args.jobs] for i in range(seeded, len(configs), args.jobs)]
    payload = {"suite": "lm", "smoke": args.smoke, "date": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), "command": ["python", "-m", "benchmarks.run", *(argv or sys.argv[1:])],
               "model": "the lm-130m preset (train/config.py)" + (" at the tiny size" if args.smoke else ""),
               "mixers": args.mixers, "shapes": [f"{b}x{t}" for b, t in args.lm_shapes], "packed": args.packed,
               "dtype": {"compute": "bfloat16", "parameters": "float32"},
               "step": "falcon_jax.train.trainer.make_train_step (forward, backward, clip_by_global_norm, AdamW; "
                       "parameters and optimizer state donated), one micro-batch, one device",
               "timing": "median over {repeats} samples of the mean time of {calls} back-to-back train steps, "
                         "after {warmup} warm-up steps; tokens/s = B*T / that time".format(**timing),
               "memory": "peak_bytes: device.memory_stats()['peak_bytes_in_use'] of the configuration's own "
                         "process (parameters, AdamW state, batch, the step's temporaries); compiled_bytes: "
                         "XLA's memory_analysis() of the step",
               "profile": "shares of the device time of {profile_steps} traced step(s) (kernels and copies on the "
                          "device streams) whose HLO instruction's op_name lies in the named scope 'mixer' (the "
                          "whole mixer layer) or 'mixer/core' (its rule or attention alone), each event matched to "
                          "an instruction of the step by its args' hlo_op, else the op_name its launch annotation "
                          "carries, else its kernel name (attributed_by: the share each method covered); "
                          "unattributed: events matching no instruction of the step (unattributed_top: the "
                          "largest, with their args); mixer_share and core_share are null when over "
                          f"{trace_scopes.MAX_UNATTRIBUTED:.0%} of the time is unattributed; mixer_kernels_share: "
                          "kernels whose names mark them as the mixers' own (falcon-jax's Pallas kernels, cuDNN "
                          "attention), from the names alone; on a GPU the traced steps run a second executable of "
                          "the same step compiled without CUDA graphs (xla_gpu_enable_command_buffer empty; "
                          "profile_compile_s), which launches each kernel on its own, naming its instruction "
                          "(inside a graph every kernel names the graph); the timed steps run the executable with "
                          "the graphs, and peak_bytes is read before the other one first runs "
                          "(benchmarks/trace_scopes.py)".format(**timing),
               "compile": "lower_s: tracing the step to StableHLO; compile_s: XLA's compilation, with "
                          "compiled_alongside other configurations compiling in their processes at the same time"
                          + ("" if autotune is None else "; the configurations share XLA's per-fusion autotuning "
                             "results (xla_gpu_per_fusion_autotune_cache_dir): the first row's compile is cold and "
                             "alone, the later ones find the GEMMs they share with it tuned"),
               "jobs": args.jobs, "worker_env": LM_ENV, "timing_parameters": timing, "limits_s": limits,
               "budget_s": args.budget, "measure_reserve_s": LM_MEASURE_RESERVE,
               "trees": {"measured": tree}, "environment": None, "steps": [], "rows": []}

    def save():
        payload["seconds"] = round(time.monotonic() - started, 1)
        with open(files.json_now, "w") as f:
            json.dump(payload, f, indent=1, default=str)

    def left():
        return None if args.budget is None else args.budget - (time.monotonic() - started)

    log(f"benchmarks.run --suite lm{' --smoke' if args.smoke else ''}: {tree['path']} "
        f"({tree['commit'] or 'no git commit'}, source {tree['source_sha1']}); {len(configs)} configurations, "
        f"{args.jobs} compiled at once")
    save()
    workers = []
    failed = False
    exit_on_sigterm()  # a time limit's SIGTERM ends the run through the finally below
    try:
        for index, wave in enumerate(waves):
            first = sum(map(len, waves[:index]))
            if left() is not None and left() <= 0:
                for mixer, b, t in configs[first:]:
                    payload["rows"].append({"mixer": mixer, "shape": f"{b}x{t}", "notes": {"skipped": "past --budget"}})
                log(f"[{time.monotonic() - started:5.0f} s] past --budget {args.budget:.0f} s: "
                    f"{len(configs) - first} configurations not started")
                break
            wave_workers = [Worker(f"{mixer} {b}x{t}", import_path, harness, args.smoke, log, env=LM_ENV)
                            for mixer, b, t in wave]
            workers.extend(wave_workers)
            prepared = [None] * len(wave)

            def prepare(i, mixer, b, t, worker, end):
                # the wave's compiles end together: a worker's start-up counts against its deadline
                status = worker.start()
                prepared[i] = (status, {}) if status != "ok" else worker.request(
                    {"cmd": "lm_prepare", "mixer": mixer, "batch": b, "length": t, "packed": args.packed,
                     "autotune_cache": autotune}, max(end - time.monotonic(), 1))

            end = time.monotonic() + prepare_deadline(limits["prepare"], left(), len(wave))
            threads = [threading.Thread(target=prepare, args=(i, *config, worker, end), daemon=True)
                       for i, (config, worker) in enumerate(zip(wave, wave_workers))]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if payload["environment"] is None:
                env = next((worker.environment for worker in wave_workers if worker.environment), None)
                if env:
                    payload["environment"] = env
                    log(f"device {env['device']} ({env['backend']}), driver {env['driver']}, "
                        + ", ".join(f"{p} {v}" for p, v in env["versions"].items()))
                    if env["backend"] == "cpu" and not args.smoke:  # every full-size step would run out of memory
                        for mixer, b, t in configs[first:]:
                            payload["rows"].append({"mixer": mixer, "shape": f"{b}x{t}",
                                                    "notes": {"skipped": "no GPU (use --smoke on a CPU)"}})
                        log("no GPU: the lm suite measures the 130M model's train step on a GPU; on a CPU run it "
                            "with --smoke (the tiny model)")
                        failed = True
                        break
            for (mixer, b, t), worker, (status, prep) in zip(wave, wave_workers, prepared):
                name, t0 = f"{mixer} @ {b}x{t}", time.monotonic()
                row = {"mixer": mixer, "shape": f"{b}x{t}", "batch": b, "length": t, "tokens_per_step": b * t,
                       "wave": index, "compiled_alongside": len(wave) - 1, "notes": {}}
                status = _merge_reply(row, "prepare", status, prep)
                if status == "ok":
                    if left() is not None and left() <= 0:
                        status = "skipped: past --budget"
                        row["notes"]["skipped"] = "past --budget (compiled, not measured)"
                    else:
                        reply = worker.request({"cmd": "lm_measure", "timing": timing},
                                               measure_deadline(limits["measure"], left()))
                        status = _merge_reply(row, "measure", *reply)
                worker.stop()
                failed |= status != "ok" and not status.startswith("skipped")
                payload["rows"].append(row)
                payload["steps"].append({"name": name, "status": status, "seconds": round(time.monotonic() - t0, 1)})
                save()
                speed = f", {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else ""
                log(f"[{time.monotonic() - started:5.0f} s] {len(payload['steps'])}/{len(configs)} {name}: {status} "
                    f"(compile {row.get('compile_s', '-')} s{speed})")
        log("\n" + lm_table(payload["rows"]))
    finally:
        for worker in workers:
            worker.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        save()
        log(f"\nlm: {len(payload['steps'])} of {len(configs)} configurations in {payload['seconds']:.0f} s; "
            f"wrote {files.json_now}")
    files.finish()
    return 1 if failed else 0
