"""Benchmarks of falcon-jax on one GPU, through one entry point.

    python -m benchmarks.run --suite {bench,memory,profile,compare} [--shapes BxTxHxD,...] [--rules PATTERNS]
                             [--out DIR] [--budget SECONDS] [--smoke] [--tree NAME=PATH ...] [--rounds N]
    python -m benchmarks.run --suite lm [--mixers PATTERNS] [--lengths T|BxT,...] [--jobs N] [--packed]
                             [--cold-compiles] [--out DIR] [--budget SECONDS] [--smoke]

Suites — each a list of named steps, run one after another, each under its own time limit (a step that
overruns is reported and skipped; results are written as they come):

``bench``    median ms of the forward and the forward+backward at the standard shapes — bf16 q, k, v, fp32 gates,
             H = 16, d = 128, (B, T) = (8, 2048), (2, 8192), (1, 32768) — of ``falcon(...)`` for Falcon-1A, 3A
             (W = 4), 1, 3 (W = 4), 2 and 2A (per-column gains), of Falcon-3 through its XLA compact chunk form
             (``falcon-3-xla``; it and the two per-column rules at the first shape only unless ``--rules`` names
             them), of the library's baselines (decayed linear attention, DeltaNet, Gated
             DeltaNet), and of the peers that import in the same process: jax-linear-attention 0.1.0
             (``simple_gla`` ≈ Falcon-1A's recurrence, ``gated_deltanet`` ≈ Falcon-1, ``deltanet``), fla 0.6.0
             (``chunk_simple_gla``, ``chunk_gated_delta_rule`` — its backward refuses Triton < 3.7.1: recorded as
             refused —, ``chunk_delta_rule``) and cuDNN causal softmax attention.  ``benchmarks/ops.py`` says how
             each is called.
``memory``   compiled peak bytes (temporaries + outputs, ``compiled.memory_analysis()``) of the forward+backward
             of every JAX op of ``bench`` at 1×32768 and 1×131072 (compiled, not run).
``profile``  GPU time per kernel of one forward+backward (CUPTI through ``torch.profiler``), one table per rule,
             at 8×2048.
``lm``       the train step of the 130M language model (the ``lm-130m`` preset's shape: D = 768, 12 layers, 12 heads
             of 64, vocabulary 50304, bf16 compute, fp32 parameters; the trainer's ``make_train_step``:
             forward, backward, clipping, AdamW) for each mixer of the paper's tables — Falcon-1A.3, 1.3,
             Transformer, Gated DeltaNet, Mamba-2, RetNet, DeltaNet, Falcon-3A.3, 3.3, 2A.3, 2.3 (``--mixers``
             takes names or patterns) — at T = 4096, 16384, 32768 with B = 32768 / T (``--lengths``, e.g.
             ``4096,2x16384``; 32,768 tokens per step): tokens/s, the allocator's peak device memory, the
             compile time, and the mixers' share of the step's device time from a profile (``mixer``: the
             whole mixer layer; ``core``: its rule or attention alone; shown as ``–`` when most of the
             device time matches no instruction; ``mixer kernels``: the mixers' own kernels found by
             name; ``benchmarks/trace_scopes.py``).  Rows are one sequence each (no ``segment_ids``: the
             Transformer takes cuDNN attention on a GPU); ``--packed`` passes the trainer's
             ``segment_ids`` (the Transformer then takes the Pallas flash attention).  Every configuration runs in a fresh process
             (the peak is its own).  ``--jobs N`` builds and compiles N configurations at once (CPU-bound),
             then times them one after another with nothing else running; rows are written as each finishes.
             Under ``--budget`` a wave's compiles end early enough for those that compiled to be timed
             (``lm_suite.LM_MEASURE_RESERVE`` seconds each); a compile still running then is reported as timed out.
             On a GPU the first configuration compiles alone and the others read its GEMMs' autotuning
             results (``--cold-compiles``: each tunes its own).  docs/kernels.md#benchmarks has the table.
``compare``  the ``bench`` rows of Falcon-1A, 3A, 1, 3 (forward and forward+backward, the standard shapes) for
             two or more source trees, ``--tree NAME=PATH`` (e.g. ``--tree old=benchmarks/trees/5798878 --tree
             new=.``), each in its own process importing that tree (``benchmarks/source_tree.py``; the older API's
             ``impl="pallas"`` is detected), the trees interleaved per rule (old, new, old, new with ``--rounds
             2``) so that drift shows; one table with every tree's times and their ratio to the first tree's.
             The trees' processes live at once, so each gets an even share of 90 % of the GPU's memory
             (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless the environment sets the allocator itself).

Timing (one method for everything): a jitted call is warmed up twice (the first call compiles), then timed as
the median over 7 samples of the mean time per call of 20 back-to-back calls; torch ops (fla) by
``triton.testing.do_bench`` (median).  Forward+backward is the gradient of every floating input under a
cotangent of ones.  Measurements run in a child process (``benchmarks/worker.py``) with the measured tree on
``PYTHONPATH``; the parent kills it when a step overruns and starts a fresh one for the next step.

``--out DIR`` (default ``benchmarks/results/latest/``, git-ignored) receives ``SUITE.json`` — rows, steps, the
GPU, driver, jax/jaxlib/triton/torch versions, each tree's git commit and source hash, the date, shapes,
dtypes and the timing method — and ``SUITE.log``, the printed log.  ``--rules`` takes names or shell patterns
(``'falcon-*,jla:*'``; names in ``benchmarks/ops.py``); ``--budget`` stops starting steps past that many
seconds (a device call has a hard limit).  ``--smoke``: tiny shapes on the CPU, the Triton kernels in
interpret mode, no peers — the whole entry point on any machine.

Context parallelism has its own entry point, ``python -m benchmarks.context_parallel`` (the 130M LM's training
step compiled for mocked multi-GPU meshes on one GPU, memory per device).

The peers are optional wheels: ``pip install --no-deps --target /tmp/site .whl/*.whl`` and
``PYTHONPATH=/tmp/site`` (the child processes inherit it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time

from benchmarks import lm_suite, ops, source_tree
from benchmarks.common import ROOT, Log, ResultFiles, Worker, exit_on_sigterm, note, table, worker_scratch

SUITES = ("bench", "memory", "profile", "compare", "lm")
STANDARD_SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (1, 32768, 16, 128)]
MEMORY_SHAPES = [(1, 32768, 16, 128), (1, 131072, 16, 128)]
SMOKE_SHAPES = [(1, 128, 2, 16), (2, 64, 2, 16)]
SMOKE_MEMORY_SHAPES = [(1, 128, 2, 16), (1, 256, 2, 16)]
TIMING = {"calls": 20, "repeats": 7, "warmup": 2}
SMOKE_TIMING = {"calls": 2, "repeats": 2, "warmup": 1}
GPU_MEMORY_SHARED = 0.9  # of the GPU's memory, split evenly between the workers that live at once (compare)
FALCON = [op.name for op in ops.OPS if op.family == "falcon"]
DEFAULT_RULES = {"bench": [op.name for op in ops.OPS], "profile": FALCON,
                 "memory": [op.name for op in ops.OPS if not op.torch],
                 "compare": ["falcon-1A", "falcon-3A", "falcon-1", "falcon-3"]}
ALLOWED = {"bench": lambda op: True, "profile": lambda op: True, "memory": lambda op: not op.torch,
           "compare": lambda op: op.family == "falcon"}


def step_limit(suite: str, op: ops.Op, smoke: bool) -> float:
    """Seconds a step may take: its compiles (fla autotunes its Triton kernels on first use: ~140 s on the H200)
    and its timing."""
    if smoke:
        return 900
    if op.needs == "fla":
        return 420
    if suite == "compare":
        return 300  # three shapes, forward and forward+backward
    return 300 if op.slow or suite in ("memory", "profile") else 180


def parse_shapes(text):
    """``"8x2048x16x128,2x512x4x64"`` -> ``[(8, 2048, 16, 128), (2, 512, 4, 64)]``: four positive sizes each."""
    error = argparse.ArgumentTypeError(f"expected BxTxHxD shapes of four positive sizes such as 8x2048x16x128, "
                                       f"got {text!r}")
    try:
        shapes = [tuple(int(n) for n in item.strip().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise error from None
    if not shapes or any(len(s) != 4 or min(s) < 1 for s in shapes):  # an empty list would measure nothing
        raise error
    return shapes


def parse_lengths(text):
    """``"4096,2x16384"`` -> ``[(None, 4096), (2, 16384)]`` (a bare T takes the suite's batch)."""
    out = []
    try:
        for item in (i.strip() for i in text.split(",") if i.strip()):
            b, _, t = item.rpartition("x")
            out.append((int(b) if b else None, int(t)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lengths T or BxT such as 4096,2x16384, got {text!r}") from None
    if not out or any(t < 2 or (b is not None and b < 1) for b, t in out):
        raise argparse.ArgumentTypeError(f"expected lengths T >= 2 (and batches B >= 1), got {text!r}")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated BxTxHxD (default: the suite's)")
    p.add_argument("--rules", help="comma-separated op names or patterns, e.g. 'falcon-*,jla:*' (default: the "
                   "suite's; names in benchmarks/ops.py)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "latest"))
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="compare: a source tree (two or more)")
    p.add_argument("--rounds", type=int, default=None, help="compare: measurements of each tree per rule (default 2)")
    p.add_argument("--budget", type=float, help="start no step after this many seconds")
    p.add_argument("--commit", help="the commit of this checkout where its git metadata is missing or stale "
                   "(recorded as given)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode, no peers")
    p.add_argument("--mixers", help="lm: comma-separated mixer names or patterns (default: all of "
                   f"{', '.join(lm_suite.LM_MIXERS)})")
    p.add_argument("--lengths", type=parse_lengths, help="lm: comma-separated T (batch 32768 / T) or BxT "
                   f"(default: {','.join(map(str, lm_suite.LM_LENGTHS))})")
    p.add_argument("--jobs", type=int, help="lm: configurations built and compiled at once, each in its own "
                   "process, after the first alone (default: 3/4 of the CPU cores, at most 12)")
    p.add_argument("--packed", action="store_true", help="lm: rows carry the trainer's segment_ids (zeros)")
    p.add_argument("--cold-compiles", action="store_true", help="lm: no autotuning results shared between the "
                   "configurations (each compile tunes every GEMM itself)")
    args = p.parse_args(argv)
    if args.budget is not None and not 0 < args.budget < float("inf"):  # NaN compares False: no limit at all
        p.error(f"--budget {args.budget:g}: give a number of seconds > 0 (steps past it are skipped)")
    if args.rounds is not None and args.suite != "compare":  # (it was ignored without a word)
        p.error(f"--rounds {args.rounds}: for --suite compare (it measures each tree that many times per rule)")
    args.rounds = 2 if args.rounds is None else args.rounds
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1 (compare measures each tree that many times per rule)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: a file, not a folder; give the folder the results go into")
    # checked here, not at the first write after the workers started (nothing is created yet)
    existing = os.path.abspath(args.out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not args.out or not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        p.error(f"--out {args.out!r}: cannot create or write that folder ({existing} is "
                f"{'not a folder' if not os.path.isdir(existing) else 'not writable'}); give a folder the results "
                f"can go into")

    lm_only = [f"--{k.replace('_', '-')}" for k in ("mixers", "lengths", "jobs", "packed", "cold_compiles")
               if getattr(args, k) not in (None, False)]
    if args.suite == "lm":
        if args.tree or args.shapes or args.rules:
            p.error("--suite lm takes --mixers and --lengths (not --tree, --shapes or --rules)")
        args.trees = {"measured": ROOT}
        try:
            args.mixers = lm_suite.select_mixers(args.mixers)
        except ValueError as e:
            p.error(str(e))
        tokens = lm_suite.SMOKE_LM_TOKENS if args.smoke else lm_suite.LM_TOKENS
        default = lm_suite.SMOKE_LM_LENGTHS if args.smoke else lm_suite.LM_LENGTHS
        lengths = args.lengths or [(None, t) for t in default]
        args.lm_shapes = [(b if b is not None else max(1, tokens // t), t) for b, t in lengths]
        configs = len(args.mixers) * len(args.lm_shapes)
        if args.jobs is None:
            args.jobs = max(1, min(configs, (os.cpu_count() or 2) * 3 // 4, 12))
        elif args.jobs < 1:
            p.error(f"--jobs {args.jobs}: give at least 1")
        return args
    if lm_only:
        p.error(f"{', '.join(lm_only)}: for --suite lm")
    if args.suite == "compare":
        if len(args.tree) < 2:
            p.error("--suite compare needs two or more --tree NAME=PATH")
        trees = {}
        for item in args.tree:
            name, sep, path = item.partition("=")
            if not sep or not name or not os.path.isdir(path) or name in trees:
                p.error(f"--tree {item!r}: expected a new NAME=PATH with PATH a source tree folder")
            if not os.path.isfile(os.path.join(path, "falcon_jax", "validation.py")):
                p.error(f"--tree {item!r}: {path} holds no falcon_jax/validation.py: not a falcon-jax source tree "
                        f"(a checkout of this repository, or an extracted git archive of one)")
            trees[name] = path
        args.trees = trees
    elif args.tree:
        p.error("--tree is for --suite compare")
    else:
        args.trees = {"measured": ROOT}
    try:
        args.ops = ops.select(args.rules, DEFAULT_RULES[args.suite], ALLOWED[args.suite])
    except ValueError as e:
        p.error(str(e))
    if args.shapes is None:
        default = {"memory": MEMORY_SHAPES, "profile": STANDARD_SHAPES[:1]}.get(args.suite, STANDARD_SHAPES)
        smoke = SMOKE_MEMORY_SHAPES if args.suite == "memory" else SMOKE_SHAPES
        args.shapes = (smoke[:1] if args.suite == "profile" else smoke) if args.smoke else default
    return args


def plan(args, environment):
    """The suite's steps ``(name, tree, [requests], limit)`` and the rows of ops that cannot run here."""
    steps, skipped = [], []
    timing = SMOKE_TIMING if args.smoke else TIMING
    available = environment.get("available", {})
    cmd = {"bench": "time", "compare": "time", "memory": "memory", "profile": "profile"}[args.suite]

    def request(op, shape):
        return {"cmd": cmd, "op": op.name, "shape": list(shape), "timing": timing, "iters": 10}

    def runnable(op, shape):
        reason = None
        if op.needs and args.smoke:
            reason = "no peers in --smoke"
        elif op.needs and not available.get(op.needs):
            reason = {"jla": "jax-linear-attention not importable", "fla": "fla or torch with CUDA not importable",
                      "gpu": "needs a GPU"}[op.needs]
        if reason:
            skipped.append({"op": op.name, "shape": "x".join(map(str, shape)), "notes": {"skipped": reason}})
        return reason is None

    if args.suite == "compare":
        for op in args.ops:
            for r in range(args.rounds):
                for tree in args.trees:
                    steps.append((f"{op.name} [{tree}, round {r + 1}]", tree,
                                  [dict(request(op, s), round=r + 1) for s in args.shapes],
                                  step_limit("compare", op, args.smoke)))
        return steps, skipped
    tree = next(iter(args.trees))
    named = {name.strip() for name in (args.rules or "").split(",")}
    for i, shape in enumerate(args.shapes):
        for op in args.ops:  # the slow rules at the first shape only, unless --rules names them
            slow_here = op.slow and i > 0 and args.suite == "bench" and op.name not in named
            if not slow_here and runnable(op, shape):
                steps.append((f"{op.name} @ {'x'.join(map(str, shape))}", tree, [request(op, shape)],
                              step_limit(args.suite, op, args.smoke)))
    return steps, skipped


# ---- tables ------------------------------------------------------------------------------------------------


def mb(key):
    return lambda row: None if row.get(key) is None else row[key] / 2**20


def report(args, rows):
    """The suite's tables as text, rows by shape, then op, as the catalogue lists them."""
    shapes = ["x".join(map(str, s)) for s in args.shapes]
    order = {op.name: i for i, op in enumerate(ops.OPS)}
    rows = sorted(rows, key=lambda r: (shapes.index(r["shape"]) if r.get("shape") in shapes else len(shapes),
                                       order.get(r.get("op"), len(order))))
    if args.suite == "bench":
        return table(rows, [("op", "op"), ("shape", "shape"), ("impl", "impl"), ("fwd ms", "fwd_ms"),
                            ("fwd+bwd ms", "fwd_bwd_ms"), ("note", note)])
    if args.suite == "memory":
        return table(rows, [("op", "op"), ("shape", "shape"), ("impl", "impl"), ("peak MiB", mb("peak_bytes")),
                            ("temp MiB", mb("temp_bytes")), ("output MiB", mb("output_bytes")), ("note", note)])
    if args.suite == "profile":
        parts = []
        for row in rows:
            head = f"== {row['op']} {row['shape']}"
            if "kernels" not in row:
                parts.append(f"{head}: {note(row) or row.get('error', 'no result')}")
                continue
            parts.append(f"{head} ({row.get('impl')}): wall {row['wall_ms']:.3f} ms, kernels {row['kernel_ms']:.3f} "
                         f"ms per forward+backward ({len(row['kernels'])} kinds)")
            parts.append(table(row["kernels"][:20], [("us", "us"), ("calls", "calls"), ("kernel", "name")]))
        return "\n\n".join(parts)
    return compare_table(args, rows)


def compare_table(args, rows):
    """One row per (op, shape, mode): each tree's median over the rounds (the rounds in brackets) and each
    later tree's ratio to the first."""
    trees = list(args.trees)
    out = []
    for op in args.ops:
        for shape in ("x".join(map(str, s)) for s in args.shapes):
            for key, mode in (("fwd_ms", "fwd"), ("fwd_bwd_ms", "fwd+bwd")):
                line = {"op": op.name, "shape": shape, "mode": mode}
                medians = {}
                for tree in trees:
                    times = [r[key] for r in rows if r.get("tree") == tree and r.get("op") == op.name
                             and r.get("shape") == shape and r.get(key) is not None]
                    if times:
                        medians[tree] = statistics.median(times)
                        line[tree] = f"{medians[tree]:.3f} ({', '.join(f'{t:.3f}' for t in times)})"
                for tree in trees[1:]:
                    if tree in medians and trees[0] in medians:
                        line[f"{tree}/{trees[0]}"] = medians[tree] / medians[trees[0]]
                out.append(line)
    columns = [("op", "op"), ("shape", "shape"), ("mode", "mode")] + [(f"{t} ms", t) for t in trees]
    columns += [(f"{t}/{trees[0]}", f"{t}/{trees[0]}") for t in trees[1:]]
    return table(out, columns)


def worker_memory_env(n_workers: int, environ=os.environ) -> dict:
    """The environment that gives each of ``n_workers`` live measuring processes its own share of the GPU's
    memory.  The compare suite keeps one process per tree alive; each would preallocate 75 % of the memory, so a
    third tree's process found none left and did not start.  The user's own XLA_PYTHON_CLIENT_* settings win."""
    if n_workers < 2 or any(k in environ for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                   "XLA_PYTHON_CLIENT_ALLOCATOR")):
        return {}
    share = int(GPU_MEMORY_SHARED / n_workers * 1000) / 1000  # rounded down: the shares never sum past it
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{share:.3f}"}


# ---- the run -------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.suite == "lm":
        return lm_suite.run(args, argv)
    exit_on_sigterm()
    os.makedirs(args.out, exist_ok=True)
    files = ResultFiles(os.path.join(args.out, f"{args.suite}.json"))
    log = Log(files.log_now)
    if files.note():
        log(files.note())
    started = time.monotonic()
    scratch, harness = worker_scratch("falcon-bench-")
    trees, workers = {}, {}
    worker_env = worker_memory_env(len(args.trees))
    for name, path in args.trees.items():
        trees[name] = source_tree.describe(path)
        if args.commit and os.path.abspath(path) == ROOT:  # this checkout (compare: the tree given as ".")
            trees[name]["commit"] = args.commit
        import_path = source_tree.import_path(path, os.path.join(scratch, f"tree-{len(workers)}"))
        workers[name] = Worker(name, import_path, harness, args.smoke, log, env=worker_env,
                               torch=any(op.torch for op in args.ops) and not args.smoke)
    payload = {"suite": args.suite, "smoke": args.smoke, "date": datetime.datetime.now(datetime.timezone.utc)
               .isoformat(timespec="seconds"), "command": ["python", "-m", "benchmarks.run", *(argv or sys.argv[1:])],
               "shapes": ["x".join(map(str, s)) for s in args.shapes],
               "dtype": {"q, k, v": "bfloat16", "beta, lam, log decay": "float32"},
               "timing": {"jax": "median over {repeats} samples of the mean ms per call of {calls} back-to-back "
                                 "calls of the jitted function, after {warmup} warm-up calls (the first compiles)"
                                 .format(**(SMOKE_TIMING if args.smoke else TIMING)),
                          "torch": "triton.testing.do_bench(fn, warmup=25, rep=100, return_mode='median')",
                          "fwd+bwd": "gradients of every floating input under a cotangent of ones"},
               "trees": trees, "worker_env": worker_env, "environment": None, "steps": [], "rows": []}

    def save():
        payload["seconds"] = round(time.monotonic() - started, 1)
        with open(files.json_now, "w") as f:
            json.dump(payload, f, indent=1, default=str)

    described = [f"{n} = {t['path']} ({t['commit'] or 'no git commit'}, source {t['source_sha1']})"
                 for n, t in trees.items()]
    log(f"benchmarks.run --suite {args.suite}{' --smoke' if args.smoke else ''}: {'; '.join(described)}")
    failed = False
    try:
        for name, worker in workers.items():  # start every worker first: the environment shapes the plan
            status = worker.start()
            trees[name]["environment"] = worker.environment
            if status != "ok":
                log(f"{name}: {status}")
                save()
                return 1
        env = payload["environment"] = workers[next(iter(workers))].environment
        log(f"device {env['device']} ({env['backend']}), driver {env['driver']}, "
            + ", ".join(f"{p} {v}" for p, v in env["versions"].items()))
        steps, skipped = plan(args, env)
        payload["rows"].extend(skipped)
        for i, (name, tree, requests, limit) in enumerate(steps):
            elapsed = time.monotonic() - started
            if args.budget is not None and elapsed >= args.budget:
                payload["steps"].append({"name": name, "tree": tree, "status": "skipped: past --budget"})
                log(f"[{elapsed:5.0f} s] {name}: skipped (past --budget {args.budget:.0f} s)")
                continue
            if args.budget is not None:
                limit = min(limit, args.budget - elapsed)
            t0, status = time.monotonic(), "ok"
            for req in requests:
                status, result = workers[tree].request(req, max(limit - (time.monotonic() - t0), 1))
                if status != "ok":
                    payload["rows"].append({"op": req["op"], "shape": "x".join(map(str, req["shape"])),
                                            "tree": tree, "notes": {"step": status}})
                    break
                row = {**result, "tree": tree}
                if "round" in req:
                    row["round"] = req["round"]
                if "error" in result:
                    row = {"op": req["op"], "shape": "x".join(map(str, req["shape"])), "tree": tree,
                           "notes": {"error": result["error"]}}
                    status = "error"
                payload["rows"].append(row)
            failed |= status != "ok"
            seconds = round(time.monotonic() - t0, 1)
            payload["steps"].append({"name": name, "tree": tree, "status": status, "seconds": seconds,
                                     "limit_s": round(limit)})
            save()
            log(f"[{time.monotonic() - started:5.0f} s] {i + 1}/{len(steps)} {name}: {status} ({seconds} s)")
        rows = payload["rows"] if args.suite != "compare" else [r for r in payload["rows"] if "round" in r]
        log("\n" + report(args, rows))
    finally:
        for worker in workers.values():
            worker.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        save()
    log(f"\n{args.suite}: {len(payload['steps'])} steps in {payload['seconds']:.0f} s; wrote {files.json}")
    files.finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
