"""Benchmarks of falcon-jax on one GPU, through one entry point.

    python -m benchmarks.run --suite {bench,memory,profile,compare} [--shapes BxTxHxD,...] [--rules PATTERNS]
                             [--out DIR] [--budget SECONDS] [--smoke] [--tree NAME=PATH ...] [--rounds N]
    python -m benchmarks.run --suite lm [--mixers PATTERNS] [--lengths T|BxT,...] [--jobs N] [--packed]
                             [--cold-compiles] [--out DIR] [--budget SECONDS] [--smoke]

Suites — each a list of named steps, run one after another, each under its own time limit (a step that
overruns is reported and skipped; results are written as they come):

``bench``    median ms of the forward and the forward+backward at the standard shapes — bf16 q, k, v, fp32 gates,
             H = 16, d = 128, (B, T) = (8, 2048), (2, 8192), (1, 32768) — of ``falcon(...)`` for Falcon-1A, 3A
             (W = 4), 1, 3 (W = 4), 2 and 2A (per-column gains; these two slow rules at the first shape only
             unless ``--rules`` names them), of the library's baselines (decayed linear attention, DeltaNet, Gated
             DeltaNet), and of the peers that import in the same process: jax-linear-attention 0.1.0
             (``simple_gla`` ≈ Falcon-1A's recurrence, ``gated_deltanet`` ≈ Falcon-1, ``deltanet``), fla 0.6.0
             (``chunk_simple_gla``, ``chunk_gated_delta_rule`` — its backward refuses Triton < 3.7.1: recorded as
             refused —, ``chunk_delta_rule``) and cuDNN causal softmax attention.  ``benchmarks/ops.py`` says how
             each is called.
``memory``   compiled peak bytes (temporaries + outputs, ``compiled.memory_analysis()``) of the forward+backward
             of Falcon-1A, Falcon-1 and the jla peers at 1×32768 and 1×131072 (compiled, not run).
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
             On a GPU the first configuration compiles alone and the others read its GEMMs' autotuning
             results (``--cold-compiles``: each tunes its own).  docs/kernels.md#benchmarks has the table.
``compare``  the ``bench`` rows of Falcon-1A, 3A, 1, 3 (forward and forward+backward, the standard shapes) for
             two or more source trees, ``--tree NAME=PATH`` (e.g. ``--tree old=benchmarks/trees/5798878 --tree
             new=.``), each in its own process importing that tree (``benchmarks/source_tree.py``; the older API's
             ``impl="pallas"`` is detected), the trees interleaved per rule (old, new, old, new with ``--rounds
             2``) so that drift shows; one table with every tree's times and their ratio to the first tree's.

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
import fnmatch
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import ops, source_tree, trace_scopes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITES = ("bench", "memory", "profile", "compare", "lm")
STANDARD_SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (1, 32768, 16, 128)]
MEMORY_SHAPES = [(1, 32768, 16, 128), (1, 131072, 16, 128)]
SMOKE_SHAPES = [(1, 128, 2, 16), (2, 64, 2, 16)]
SMOKE_MEMORY_SHAPES = [(1, 128, 2, 16), (1, 256, 2, 16)]
TIMING = {"calls": 20, "repeats": 7, "warmup": 2}
SMOKE_TIMING = {"calls": 2, "repeats": 2, "warmup": 1}
FALCON = [op.name for op in ops.OPS if op.family == "falcon"]
DEFAULT_RULES = {"bench": [op.name for op in ops.OPS], "profile": FALCON,
                 "memory": ["falcon-1A", "falcon-1", "jla:simple_gla", "jla:gated_deltanet", "jla:deltanet"],
                 "compare": ["falcon-1A", "falcon-3A", "falcon-1", "falcon-3"]}
ALLOWED = {"bench": lambda op: True, "profile": lambda op: True, "memory": lambda op: not op.torch,
           "compare": lambda op: op.family == "falcon"}
HELLO_LIMIT = 300  # a cold start: jax, the GPU client, falcon_jax
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
# processes share the GPU while others compile: each allocates as it goes (the peak is still per process)
LM_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
RESULT = "@@RESULT "


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


class Log:
    """Prints, and keeps the same lines in ``path``."""

    def __init__(self, path):
        self.file = open(path, "w")
        self.lock = threading.Lock()  # the lm suite's workers log from several threads

    def __call__(self, text=""):
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")
            self.file.flush()


class Worker:
    """One measuring process (``benchmarks.worker``) importing one tree; restarted after a timeout or crash."""

    def __init__(self, name, pythonpath, harness, smoke, log, torch=False, env=None):
        self.name, self.pythonpath, self.harness, self.smoke, self.log = name, pythonpath, harness, smoke, log
        self.torch = torch  # whether the process may run torch ops (fla)
        self.env = env or {}  # set in the process's environment (over the inherited one)
        self.proc, self.lines, self.environment = None, None, None

    def _start(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, env.get("PYTHONPATH")) if p)
        if self.smoke:
            env["JAX_PLATFORMS"] = "cpu"
        # cwd: a folder holding only a link to this benchmarks/, so that neither it nor the tree's own
        # benchmarks/ shadows the measured tree's falcon_jax
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "benchmarks.worker"],
                                     cwd=self.harness, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        status, env_info = self._exchange({"cmd": "hello", "smoke": self.smoke, "torch": self.torch}, HELLO_LIMIT)
        if status != "ok" or "error" in env_info:
            raise RuntimeError(f"the {self.name} worker did not start: {status} {env_info.get('error', '')}")
        self.environment = self.environment or env_info

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _exchange(self, request, limit):
        proc = self.proc  # the lm suite may stop this worker from another thread meanwhile
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + limit
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.stop()
                return f"timed out after {limit:.0f} s", {}
            if line is None:
                code = proc.wait()
                if self.proc is proc:
                    self.proc = None
                return f"worker died (exit code {code})", {}
            if line.startswith(RESULT):
                return "ok", json.loads(line[len(RESULT):])
            self.log(f"    [{self.name}] {line}")

    def start(self) -> str:
        """"ok", or why the process did not start (it is started again by the next request)."""
        try:
            if self.proc is None:
                self._start()
        except RuntimeError as e:
            self.stop()
            return str(e)
        return "ok"

    def request(self, request, limit):
        """``(status, result)``: status "ok", or why there is no result."""
        status = self.start()
        return self._exchange(request, limit) if status == "ok" else (status, {})

    def stop(self):
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def parse_shapes(text):
    try:
        return [tuple(int(n) for n in item.strip().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxTxHxD shapes such as 8x2048x16x128, got {text!r}") from None


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


def select_mixers(patterns: str | None) -> list[str]:
    """The lm suite's mixers named by ``patterns`` (comma-separated names or shell patterns over
    ``LM_MIXERS``, case-insensitive; None: all), in ``LM_MIXERS`` order."""
    if patterns is None:
        return list(LM_MIXERS)
    chosen = set()
    for pattern in (p.strip().lower() for p in patterns.split(",") if p.strip()):
        hits = [m for m in LM_MIXERS if fnmatch.fnmatchcase(m.lower(), pattern)]
        if not hits:
            raise ValueError(f"--mixers: {pattern!r} matches none of {', '.join(LM_MIXERS)}")
        chosen.update(hits)
    return [m for m in LM_MIXERS if m in chosen]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, required=True)
    p.add_argument("--shapes", type=parse_shapes, help="comma-separated BxTxHxD (default: the suite's)")
    p.add_argument("--rules", help="comma-separated op names or patterns, e.g. 'falcon-*,jla:*' (default: the "
                   "suite's; names in benchmarks/ops.py)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "latest"))
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="compare: a source tree (two or more)")
    p.add_argument("--rounds", type=int, default=2, help="compare: measurements of each tree per rule")
    p.add_argument("--budget", type=float, help="start no step after this many seconds")
    p.add_argument("--commit", help="the commit of this checkout where its git metadata is missing or stale "
                   "(recorded as given)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode, no peers")
    p.add_argument("--mixers", help="lm: comma-separated mixer names or patterns (default: all of "
                   f"{', '.join(LM_MIXERS)})")
    p.add_argument("--lengths", type=parse_lengths, help="lm: comma-separated T (batch 32768 / T) or BxT "
                   f"(default: {','.join(map(str, LM_LENGTHS))})")
    p.add_argument("--jobs", type=int, help="lm: configurations built and compiled at once, each in its own "
                   "process, after the first alone (default: 3/4 of the CPU cores, at most 12)")
    p.add_argument("--packed", action="store_true", help="lm: rows carry the trainer's segment_ids (zeros)")
    p.add_argument("--cold-compiles", action="store_true", help="lm: no autotuning results shared between the "
                   "configurations (each compile tunes every GEMM itself)")
    args = p.parse_args(argv)
    lm_only = [f"--{k.replace('_', '-')}" for k in ("mixers", "lengths", "jobs", "packed", "cold_compiles")
               if getattr(args, k) not in (None, False)]
    if args.suite == "lm":
        if args.tree or args.shapes or args.rules:
            p.error("--suite lm takes --mixers and --lengths (not --tree, --shapes or --rules)")
        args.trees = {"measured": ROOT}
        try:
            args.mixers = select_mixers(args.mixers)
        except ValueError as e:
            p.error(str(e))
        tokens = SMOKE_LM_TOKENS if args.smoke else LM_TOKENS
        lengths = args.lengths or [(None, t) for t in (SMOKE_LM_LENGTHS if args.smoke else LM_LENGTHS)]
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

def table(rows, columns):
    """Right-aligned text table of ``rows`` (dicts) by ``columns`` (``(header, key or function)``)."""
    def cell(row, key):
        value = key(row) if callable(key) else row.get(key)
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    cells = [[cell(r, key) for _, key in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    lines = [" | ".join(h.rjust(w) for (h, _), w in zip(columns, widths)),
             "-+-".join("-" * w for w in widths)]
    return "\n".join(lines + [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells])


def note(row):
    notes = row.get("notes") or {}
    return "; ".join(f"{key}: {text}" if key != "skipped" else f"skipped: {text}" for key, text in notes.items())


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


# ---- the run -------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.suite == "lm":
        return lm_main(args, argv)
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, f"{args.suite}.log"))
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="falcon-bench-")
    harness = os.path.join(scratch, "harness")
    os.makedirs(harness)
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(harness, "benchmarks"))
    trees, workers = {}, {}
    for name, path in args.trees.items():
        trees[name] = source_tree.describe(path)
        if args.commit and os.path.abspath(path) == ROOT:  # this checkout (compare: the tree given as ".")
            trees[name]["commit"] = args.commit
        import_path = source_tree.import_path(path, os.path.join(scratch, f"tree-{len(workers)}"))
        workers[name] = Worker(name, import_path, harness, args.smoke, log,
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
               "trees": trees, "environment": None, "steps": [], "rows": []}
    out_json = os.path.join(args.out, f"{args.suite}.json")

    def save():
        payload["seconds"] = round(time.monotonic() - started, 1)
        with open(out_json, "w") as f:
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
    log(f"\n{args.suite}: {len(payload['steps'])} steps in {payload['seconds']:.0f} s; wrote {out_json}")
    return 1 if failed else 0


# ---- the lm suite -----------------------------------------------------------------------------------------

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

def lm_main(args, argv) -> int:
    """The lm suite: waves of ``--jobs`` configurations, each in a fresh worker process, built and compiled
    together, then measured one at a time; the JSON is rewritten after every row."""
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, "lm.log"))
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="falcon-bench-")
    harness = os.path.join(scratch, "harness")
    os.makedirs(harness)
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(harness, "benchmarks"))
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
                          "attention), from the names alone; on a GPU the step is compiled with "
                          "xla_enable_command_buffers_during_profiling=false, so that the traced step launches "
                          "the CUDA graphs' kernels one at a time, each naming its instruction (untraced steps keep "
                          "the graphs) (benchmarks/trace_scopes.py)".format(**timing),
               "compile": "lower_s: tracing the step to StableHLO; compile_s: XLA's compilation, with "
                          "compiled_alongside other configurations compiling in their processes at the same time"
                          + ("" if autotune is None else "; the configurations share XLA's per-fusion autotuning "
                             "results (xla_gpu_per_fusion_autotune_cache_dir): the first row's compile is cold and "
                             "alone, the later ones find the GEMMs they share with it tuned"),
               "jobs": args.jobs, "worker_env": LM_ENV, "timing_parameters": timing, "limits_s": limits,
               "trees": {"measured": tree}, "environment": None, "steps": [], "rows": []}
    out_json = os.path.join(args.out, "lm.json")

    def save():
        payload["seconds"] = round(time.monotonic() - started, 1)
        with open(out_json, "w") as f:
            json.dump(payload, f, indent=1, default=str)

    def left():
        return None if args.budget is None else args.budget - (time.monotonic() - started)

    def limit(kind):
        budget = left()
        return limits[kind] if budget is None else max(min(limits[kind], budget), 1)

    log(f"benchmarks.run --suite lm{' --smoke' if args.smoke else ''}: {tree['path']} "
        f"({tree['commit'] or 'no git commit'}, source {tree['source_sha1']}); {len(configs)} configurations, "
        f"{args.jobs} compiled at once")
    save()
    workers = []
    failed = False
    # a time limit's SIGTERM ends the run through the finally below: workers stopped, the JSON written
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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

            def prepare(i, mixer, b, t, worker, deadline):
                prepared[i] = worker.request({"cmd": "lm_prepare", "mixer": mixer, "batch": b, "length": t,
                                              "packed": args.packed, "autotune_cache": autotune}, deadline)

            deadline = limit("prepare")
            threads = [threading.Thread(target=prepare, args=(i, *config, worker, deadline), daemon=True)
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
                        reply = worker.request({"cmd": "lm_measure", "timing": timing}, limit("measure"))
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
            f"wrote {out_json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
