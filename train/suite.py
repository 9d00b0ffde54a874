"""The paper-experiment suites (docs/results.md): their runs, and a runner that starts them as resumable
``falcon-train`` runs (``experiments/suite.py`` calls it from the repository root).

    python experiments/suite.py addition --lanes 6 --deadline-min 8 --pack $OUT/addition.tar.gz
    python experiments/suite.py lm --lanes 1 --deadline-min 8 --pack $OUT/lm.tar.gz
    python experiments/suite.py addition-sweep --lanes 6 --deadline-min 8 --pack $OUT/sweep.tar.gz
    python experiments/suite.py addition-m --only transformer-s0 falcon-1A.3-s0 --lanes 2 --deadline-min 9
    python experiments/suite.py addition --list          # the runs and their flags

Every run is ``python -m falcon_jax.train`` in ``runs/exp/<suite>/<name>`` (under the working directory
``root``; the LM suite reads ``data/python-docs.jsonl`` there) with the suite's settings (below).
A run that already finished (its metrics hold the final evaluation) is skipped; one that has
checkpoints is resumed (``--resume-or-start``: one cut off before its first checkpoint starts again), so a
suite cut off by ``--deadline-min`` (GPU leases are short) continues where it stopped when called again on
the same machine.  ``--lanes`` runs that many
at once on the one GPU (small models leave it mostly idle); each process gets an equal slice of
GPU memory.  Throughput is only meaningful with ``--lanes 1`` (the LM suite).

``--pack`` writes a .tar.gz of every run's metrics.jsonl, config.json, stdout log, report and PNGs (no
checkpoints), which ``experiments/summarize.py`` (:mod:`falcon_jax.train.summarize`) turns into the
tables of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

from falcon_jax.train.rundir import ACCURACY_PLOT, CONFIG, LOSS_PLOT, METRICS, REPORT, metric_records

# ---------------------------------------------------------------- the addition suite (docs/results.md)
# Same model size, data, steps and optimizer for every row: the addition-paper preset (4 layers,
# d_model 256, 8 heads, batch 256, bf16 compute), shortened to 2,000 steps (the paper's best step
# is about 2,000), evaluated every 250 steps on widths 1-48.
ADDITION_COMMON = ["--preset", "addition-paper", "--set", "train.steps=2000", "--set", "train.eval_every=250",
                   "--set", "optim.warmup_steps=200", "--set", "checkpoint.every=250"]
ADDITION_RUNS = {
    "transformer-s0": ["--model", "transformer"],
    "transformer-s1": ["--model", "transformer", "--set", "train.seed=1"],
    "retnet-s0": ["--model", "retnet"],
    "mamba2-s0": ["--model", "mamba2"],
    "falcon-1A.3-s0": ["--model", "falcon-1A.3"],
    "falcon-1A.3-s1": ["--model", "falcon-1A.3", "--set", "train.seed=1"],
    "falcon-3A.3-s0": ["--model", "falcon-3A.3"],
    "falcon-1.3-s0": ["--model", "falcon-1.3"],
    "falcon-3.3-s0": ["--model", "falcon-3.3"],
    # the 2x2 alignment ablation of Fig. 11 (shifted + raw is falcon-1A.3-s0 above)
    "falcon-1A.3-shifted-rbw-s0": ["--model", "falcon-1A.3", "--set", "model.timing=rbw"],
    "falcon-1A.3-samestep-raw-s0": ["--model", "falcon-1A.3", "--set", "model.alignment=same_step"],
    "falcon-1A.3-samestep-rbw-s0": ["--model", "falcon-1A.3", "--set", "model.alignment=same_step",
                                    "--set", "model.timing=rbw"],
}

# ---------------------------------------------------------------- the small LM comparison
# Byte-level LM on the Python 3.11 documentation sources (experiments/prepare_python_docs.py):
# 6 layers, d_model 256, 4 heads, seq 512, batch 32, 600 steps (9.8M tokens, about one epoch),
# bf16 compute, the same optimizer for every model.
LM_COMMON = ["--preset", "lm-tiny", "--set", 'data.paths=["data/python-docs.jsonl"]', "--set", "data.seq_len=512",
             "--set", "data.val_batches=24", "--set", "model.d_model=256", "--set", "model.n_layers=6",
             "--set", "model.n_heads=4", "--set", "model.chunk_size=64", "--set", "model.dtype=bfloat16",
             "--set", "train.batch_size=32", "--set", "train.steps=600", "--set", "train.eval_every=200",
             "--set", "train.log_every=50", "--set", "optim.lr=1e-3", "--set", "optim.warmup_steps=100",
             "--set", "checkpoint.every=200"]
LM_RUNS = {
    "falcon-1A.3": ["--model", "falcon-1A.3"],
    "falcon-3A.3": ["--model", "falcon-3A.3"],
    "transformer": ["--model", "transformer"],
    # parameter-matched: the Falcon models' gate projections make them 5.33M against the Transformer's 4.90M;
    # a SwiGLU hidden size of 800 (704 by default) gives the Transformer 5.34M
    "transformer-matched": ["--model", "transformer", "--set", "model.mlp_hidden=800"],
}

# ---------------------------------------------------------------- model-size sweep for the addition task
# The small size (4 layers, d_model 256) learns nothing beyond width 2 in 2,000 steps (docs/results.md);
# this sweep looks for the smallest size that learns widths 1-32: 1,000 steps, Transformer and Falcon-1A.3.
SIZES = {
    "s": ["--set", "model.n_layers=4", "--set", "model.d_model=256", "--set", "model.n_heads=8"],
    "m": ["--set", "model.n_layers=8", "--set", "model.d_model=512", "--set", "model.n_heads=8"],
    "l": ["--set", "model.n_layers=12", "--set", "model.d_model=768", "--set", "model.n_heads=12"],
}
SWEEP_COMMON = ADDITION_COMMON + ["--set", "train.steps=1000", "--set", "optim.warmup_steps=100"]
SWEEP_RUNS = {f"{m}-{size}": ["--model", m, *flags] for size, flags in SIZES.items()
              for m in ("transformer", "falcon-1A.3")}

# The sweep's `m` Falcon-1A.3 learned widths 1-3 in 1,000 steps and was still improving (docs/results.md):
# the Table 3 suite again at that size (8 layers, d_model 512) for 2,000 steps (the paper's best step).
# Twelve such runs fill two GPUs for about ten minutes: run them in two groups of six with --only, one
# group per GPU (CUDA_VISIBLE_DEVICES), within one lease (checkpoints stay on the machine only while held).
ADDITION_M_COMMON = ADDITION_COMMON + SIZES["m"] + ["--set", "train.steps=2000", "--set", "train.eval_every=500",
                                                    "--set", "checkpoint.every=500"]

SUITES = {"addition": (ADDITION_COMMON, ADDITION_RUNS), "lm": (LM_COMMON, LM_RUNS),
          "addition-sweep": (SWEEP_COMMON, SWEEP_RUNS), "addition-m": (ADDITION_M_COMMON, ADDITION_RUNS)}


def run_dir(suite: str, name: str) -> str:
    return os.path.join("runs", "exp", suite, name)


def finished(path: str) -> bool:
    """True once the run's metrics hold its final evaluation (the one at the last step; for addition, with its
    free-running decoding)."""
    cfg_f = os.path.join(path, CONFIG)
    if not os.path.exists(cfg_f):
        return False
    with open(cfg_f) as f:
        cfg = json.load(f)
    steps, addition = cfg["train"]["steps"], cfg.get("data", {}).get("kind") == "addition"
    return any(rec.get("step") == steps and (not addition or "greedy" in rec) for rec in metric_records(path, "eval"))


def command(suite: str, name: str) -> list[str]:
    common, runs = SUITES[suite]
    path = run_dir(suite, name)
    cmd = [sys.executable, "-m", "falcon_jax.train", *common, *runs[name], "--run-dir", path]
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.exists(os.path.join(path, CONFIG)):
        # not --resume: a run killed before its first checkpoint (or with none left that verifies) would be
        # refused at every later call; --resume-or-start starts it again from step 0
        cmd.append("--resume-or-start")
    return cmd


def pack(suite: str, out: str) -> None:
    base = os.path.join("runs", "exp", suite)
    with tarfile.open(out, "w:gz") as tar:
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            for f in (METRICS, CONFIG, "stdout.log", REPORT, LOSS_PLOT, ACCURACY_PLOT):
                p = os.path.join(base, name, f)
                if os.path.exists(p):
                    tar.add(p, arcname=os.path.join(suite, name, f))
    print(f"[suite] packed {out}", flush=True)


def main(argv=None, *, root: str | None = None) -> int:
    """The command line; ``root``: the working directory of the runs (default: the current one)."""
    p = argparse.ArgumentParser(description="Run one of the paper's experiment suites (resumable).")
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--only", nargs="*", help="run only these names")
    p.add_argument("--lanes", type=int, default=1, help="runs at once on the one device")
    p.add_argument("--deadline-min", type=float, default=0, help="stop every run after this many minutes (0 = none)")
    p.add_argument("--pack", help="write the results .tar.gz here at the end")
    p.add_argument("--gpu-share", type=float, default=0.9,
                   help="fraction of the GPU's memory all lanes together may take (leave room for other jobs)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--set", action="append", default=[], help="extra --set for every run (smoke tests)")
    args = p.parse_args(argv)
    if args.lanes < 1:  # no lane would start a run, and the suite would end at once with exit code 0
        p.error(f"--lanes must be >= 1, got {args.lanes}")
    # a run starts only while 30 s are left before the deadline: below one minute nothing would start (NaN: never)
    if not (args.deadline_min == 0 or args.deadline_min >= 1):
        p.error(f"--deadline-min must be 0 (none) or at least 1 (runs start only while 30 s are left before it), "
                f"got {args.deadline_min}")
    if args.only is not None and not args.only:
        p.error("--only: give one or more run names (without --only every run of the suite runs)")
    if args.pack:  # checked now, not after hours of runs; relative to the caller's folder, not root
        args.pack = os.path.abspath(args.pack)
        folder = os.path.dirname(args.pack)
        if os.path.isdir(args.pack) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--pack {args.pack}: give a file path in an existing, writable folder (e.g. "
                    f"{os.path.join(os.getcwd(), 'results.tar.gz')})")
    if root is not None:
        os.chdir(root)
    names = args.only or list(SUITES[args.suite][1])
    unknown = [n for n in names if n not in SUITES[args.suite][1]]
    if unknown:
        p.error(f"--only: unknown run(s) {unknown}; choose from {list(SUITES[args.suite][1])}")
    if args.list:
        for n in names:
            print(n, " ".join(command(args.suite, n)))
        return 0
    todo = [n for n in names if not finished(run_dir(args.suite, n))]
    print(f"[suite] {args.suite}: {len(names) - len(todo)} finished, {len(todo)} to run in {args.lanes} lane(s)",
          flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if not 0 < args.gpu_share <= 1:
        p.error(f"--gpu-share must be in (0, 1], got {args.gpu_share}")
    if args.lanes > 1 or args.gpu_share < 0.9:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.gpu_share / args.lanes:.3f}"
    t0 = time.time()
    deadline = t0 + 60 * args.deadline_min if args.deadline_min else None
    running: dict[str, tuple[subprocess.Popen, object, float]] = {}
    failed = []
    # SIGTERM (a time limit) as an exception, so that the runs are stopped below; ignored once stopping, so a
    # second one (coreutils timeout signals the whole group too) does not cut that short
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _stop_on_sigterm),
                signal.SIGINT: signal.getsignal(signal.SIGINT)}
    try:
        _run_all(args, todo, running, failed, env, deadline)
    except (KeyboardInterrupt, SystemExit) as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # each run is its own process group (start_new_session: a Ctrl-C in the terminal reaches only this
        # process): SIGTERM asks each to stop after its current step with a checkpoint, so the suite resumes where
        # it stopped
        for proc, log, _ in running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for name, (proc, log, _) in running.items():
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # resumable from its last finished checkpoint
                proc.wait()
            log.close()
        code = 130 if isinstance(stop, KeyboardInterrupt) else (stop.code if isinstance(stop.code, int) else 1)
        print(f"[suite] stopped ({'SIGINT' if code == 130 else 'SIGTERM'}); the runs that were going stopped "
              f"too: {sorted(running) or 'none'}; the same command continues the suite", flush=True)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    left = [n for n in names if not finished(run_dir(args.suite, n))]
    print(f"[suite] {time.time() - t0:.0f}s; unfinished: {left or 'none'}; failed: {failed or 'none'}", flush=True)
    if args.pack:
        pack(args.suite, args.pack)
    return 1 if failed else 0


STOP_WAIT_S = 60  # how long a stopped run may take to write its checkpoint before it is killed


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _run_all(args, todo, running, failed, env, deadline) -> None:
    """Start the runs ``todo`` on ``args.lanes`` lanes and wait for them (``running``: name -> (process, log,
    start time), kept up to date so that a stop can reach the runs going)."""
    while todo or running:
        while todo and len(running) < args.lanes and (deadline is None or time.time() < deadline - 30):
            name = todo.pop(0)
            os.makedirs(run_dir(args.suite, name), exist_ok=True)
            log = open(os.path.join(run_dir(args.suite, name), "stdout.log"), "a")
            cmd = command(args.suite, name) + [a for s in args.set for a in ("--set", s)]
            print(f"[suite] start {name}: {' '.join(cmd[2:])}", flush=True)
            running[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True), log, time.time())
        if not running:
            break  # the deadline leaves no time to start another run
        time.sleep(2)
        for name, (proc, log, ts) in list(running.items()):
            rc = proc.poll()
            if rc is None and deadline is not None and time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)  # resumable from its last checkpoint
                rc = proc.wait()
                print(f"[suite] {name}: stopped at the deadline after {time.time() - ts:.0f}s", flush=True)
            if rc is not None:
                log.close()
                del running[name]
                if rc == 0:
                    print(f"[suite] done {name} in {time.time() - ts:.0f}s", flush=True)
                elif rc != -signal.SIGKILL:
                    failed.append(name)
                    with open(os.path.join(run_dir(args.suite, name), "stdout.log")) as f:
                        tail = f.read()[-3000:]
                    print(f"[suite] FAILED {name} (rc {rc}); log tail:\n{tail}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
