"""Multi-GPU training of the ``lm-130m`` model in one command, most valuable runs first
(``experiments/multi_gpu.py`` calls it from the repository root).

    python experiments/multi_gpu.py --out $OUT --budget 540                 # every run, on all visible GPUs
    python experiments/multi_gpu.py --out $OUT --budget 540 --runs g1,gN-data,gN-fsdp,g1-repeat,gN-to-1
    python experiments/multi_gpu.py --list --gpus 2                         # the plan and its commands
    python experiments/multi_gpu.py --out /tmp/mg --smoke                   # tiny model, 2 simulated CPU devices

Every run is ``python -m falcon_jax.train`` in a process of its own, one after another, in
``<work>/<time>/<run>``.  For N visible GPUs, in this order (``--runs`` picks some; ``gN`` stands for ``g<N>``):

=================  ====================================================================================
``g1``             one GPU (``CUDA_VISIBLE_DEVICES`` = the first), ``lm-130m``, batch 32 x 1,024
``gN-data``        N GPUs, mesh data=N
``gN-fsdp``        N GPUs, mesh data=1 x fsdp=N, checkpoints at half the steps and at the end
``g1-repeat``      ``g1`` again: the one-GPU run-to-run noise of the loss
``gN-to-1``        ``gN-fsdp``'s folder without its last checkpoint, resumed on one GPU to the end
``gN-data-fsdp``   (N >= 4, even) mesh data=2 x fsdp=N/2
``gN-seq``         ``lm-130m-long``: batch 1 x 65,536, every sequence split over the N GPUs (mesh seq=N)
``g1-long``        one GPU, batch 1 x 65,536 (``gN-seq``'s job); on running out of memory the sequence is
                   halved (down to 16,384) until a length fits
``g1-T16k``        one GPU, batch 2 x 16,384 (32,768 tokens a step)
``gN-data-T16k``   N GPUs, data=N, batch max(2, N) x 16,384
``g1-seed1``       ``g1`` with train.seed=1: the scale of seed-to-seed differences
=================  ====================================================================================

Settings common to every run: ``--steps`` optimizer steps (100 by default: the model compiles in a
minute or two per run, so the steps are a small part of a run's time), warm-up 15 % of them, cosine to
0.1 x lr, a speed record every steps / 10, no validation, the builtin (index-based) loader, no checkpoints
but ``gN-fsdp``'s and ``gN-to-1``'s.  The corpus: every ``.py`` and ``.md`` file of this repository's source,
tests and docs, one document a file, written to ``<work>/corpus-<hash>.jsonl`` (deterministic for a commit;
its hash is in the JSON), with the preset's BPE tokenizer trained on it.  A persistent compilation cache
(``<work>/jax-cache``) serves the runs that repeat a compiled step (``g1-repeat``, ``gN-to-1``,
``g1-seed1``); ``--no-compile-cache`` turns it off.

``--budget`` seconds: a run starts only when its estimate (start-up + compilation + steps + checkpoint
saves, from the runs measured so far, else pessimistic defaults) ends before it; a run that does not fit
is skipped and recorded, and a later, cheaper one may still start.  A run still going at the budget's end
is killed.  ``--out DIR`` gets ``multi-gpu.json`` (rewritten atomically after every run: a command cut off
keeps what finished; the run in flight reads ``running``), ``multi-gpu.log`` (this runner's lines) and
``multi-gpu-logs.tar.gz`` (every run's stdout log, metrics.jsonl and config.json).  Where ``DIR`` holds an
earlier ``multi-gpu.json``, the command writes ``multi-gpu.partial.json``, ``.partial.log`` and
``multi-gpu-logs.partial.tar.gz`` instead and moves them over the earlier three when it ends (every planned run
made, failed or skipped): an interrupted or crashed rerun leaves the earlier results as they were
(``benchmarks.common``'s suites write through the same :class:`~falcon_jax.train.rundir.ResultFiles`).

Summary per run: tokens/s is the median over the speed records after the first (each record covers
``log_every`` steps; the first step, with the compilation, is never in one); tokens/s per GPU; scaling
efficiency = tokens/s per GPU / the one-GPU reference's; s/step the median likewise; peak GiB per GPU the
largest ``peak_bytes_in_use`` the trainer recorded; the loss at every step and, against the reference run
(same batch and sequence length), the mean and largest |Δloss| over the second half of the steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time

from falcon_jax.train.launch import simulated_cpu_env
from falcon_jax.train.memory import is_out_of_memory
from falcon_jax.train.rundir import (CONFIG, METRICS, ResultFiles, checkpoint_steps, dumps_strict, parse_records,
                                     write_atomic)

JSON_NAME, LOG_NAME, PACK_NAME = "multi-gpu.json", "multi-gpu.log", "multi-gpu-logs.tar.gz"
RUN_LOG = "stdout.log"
CORPUS_DIRS = ("falcon_jax", "pallas_kernels", "train", "benchmarks", "experiments", "tests", "docs", "examples")
SMOKE_CORPUS_DIRS = ("docs",)

# (rows, sequence length) of the three shapes: 32 x 1,024 (lm-130m), 2 x 16,384 (the same tokens a step), 1 x 65,536
FULL_SHAPES = {"short": (32, 1024), "mid": (2, 16_384), "long": (1, 65_536)}
SMOKE_SHAPES = {"short": (8, 64), "mid": (2, 256), "long": (1, 512)}
SMOKE_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.chunk_size=16",
               "model.vocab_size=320", "model.dtype=float32", "data.tokenizer=byte"]
# pessimistic first estimates (seconds), replaced by measurements as runs finish
FULL_DEFAULTS = {"startup": 45.0, "compile": 150.0, "compile_cached": 30.0, "save": 25.0, "token_s": 0.1 / 32768}
SMOKE_DEFAULTS = {"startup": 10.0, "compile": 20.0, "compile_cached": 10.0, "save": 5.0, "token_s": 0.05 / 512}
KILL_MARGIN_S = 5.0  # a run still going this long before the budget's end is killed: time to write the files
EFFICIENCY_GUESS = 0.5  # the scaling assumed for a multi-GPU run's step time before one is measured
now = time.time  # the runner's clock (a test steps it by hand)


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Run:
    """One ``falcon-train`` process: ``gpus`` devices, ``mesh`` axis sizes, ``batch`` rows of ``seq_len`` tokens.
    ``reference``: the run it is compared with (its loss at the same steps, its tokens/s per GPU);
    ``restore_from``: a run whose folder, without its last checkpoint, this one resumes; ``halve_on_oom``: retry
    with half the sequence length while it runs out of memory."""

    name: str
    gpus: int
    mesh: dict
    batch: int
    seq_len: int
    preset: str = "lm-130m"
    seed: int = 0
    reference: str | None = None
    checkpoints: bool = False
    restore_from: str | None = None
    halve_on_oom: bool = False
    what: str = ""

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def program(self) -> tuple:
        """What the compiled train step depends on: runs of equal programs share one entry of the compilation cache."""
        return self.preset, self.batch, self.seq_len, tuple(sorted(self.mesh.items())), self.gpus


def mesh_of(data=1, fsdp=1, seq=1) -> dict:
    return {"data": data, "fsdp": fsdp, "seq": seq, "tensor": 1}


def plan(n: int, smoke: bool = False) -> list[Run]:
    """The runs for ``n`` GPUs, most valuable first (one-GPU runs only when ``n`` is 1)."""
    shapes = SMOKE_SHAPES if smoke else FULL_SHAPES
    (b1, t1), (b2, t2), (b3, t3) = shapes["short"], shapes["mid"], shapes["long"]
    g = f"g{n}"
    runs = [Run("g1", 1, mesh_of(), b1, t1, what="one GPU")]
    if n > 1:
        runs += [Run(f"{g}-data", n, mesh_of(data=n), b1, t1, reference="g1", what=f"data={n}"),
                 Run(f"{g}-fsdp", n, mesh_of(fsdp=n), b1, t1, reference="g1", checkpoints=True,
                     what=f"data=1 x fsdp={n}, checkpoints")]
    runs.append(Run("g1-repeat", 1, mesh_of(), b1, t1, reference="g1", what="g1 again (noise)"))
    if n > 1:
        runs.append(Run(f"{g}-to-1", 1, mesh_of(), b1, t1, reference="g1", restore_from=f"{g}-fsdp",
                        what=f"{g}-fsdp's checkpoint of half the steps, resumed on one GPU"))
        if n >= 4 and n % 2 == 0:
            runs.append(Run(f"{g}-data-fsdp", n, mesh_of(data=2, fsdp=n // 2), b1, t1, reference="g1",
                            what=f"data=2 x fsdp={n // 2}"))
        runs.append(Run(f"{g}-seq", n, mesh_of(seq=n), b3, t3, preset="lm-130m-long", reference="g1-long",
                        what=f"seq={n}: every sequence split over the GPUs"))
    runs.append(Run("g1-long", 1, mesh_of(), b3, t3, preset="lm-130m-long", halve_on_oom=True,
                    what="one GPU, the longest sequence that fits (from the seq run's length down)"))
    runs.append(Run("g1-T16k", 1, mesh_of(), b2, t2, what="one GPU, long rows"))
    if n > 1:
        runs.append(Run(f"{g}-data-T16k", n, mesh_of(data=n), max(b2, n), t2, reference="g1-T16k",
                        what=f"data={n}, long rows"))
    runs.append(Run("g1-seed1", 1, mesh_of(), b1, t1, seed=1, reference="g1",
                    what="g1 with train.seed=1 (another initialization, the same batches)"))
    return runs


def select(runs: list[Run], names: str | None, n: int) -> list[Run]:
    """The runs named in the comma list ``names`` (``gN`` = ``g<n>``), in plan order; ValueError naming an unknown
    one, or a restore whose source is not selected."""
    if names is None:
        return runs
    wanted = [w.strip().replace("gN", f"g{n}") for w in names.split(",") if w.strip()]
    known = {r.name: r for r in runs}
    if not wanted:  # ("," or "": the command would make no run and exit 0)
        raise ValueError(f"--runs {names!r} names no run; choose from {', '.join(known)}, or leave --runs out for all.")
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"--runs: unknown run(s) {unknown} for {n} GPU(s); choose from {', '.join(known)}.")
    chosen = [r for r in runs if r.name in wanted]
    for r in chosen:
        if r.restore_from and r.restore_from not in wanted:
            raise ValueError(f"--runs: {r.name} resumes {r.restore_from}'s checkpoint, written in the same command; "
                             f"add {r.restore_from} to --runs.")
    return chosen


def settings(run: Run, *, steps: int, corpus: str, smoke: bool, extra: list[str]) -> list[str]:
    """The ``--set`` values of ``run``: the common schedule, the run's shape, mesh and checkpoints, then ``extra``."""
    out = [f"data.paths={json.dumps([corpus])}", "data.loader=builtin", "data.val_batches=0",
           f"data.seq_len={run.seq_len}", f"train.batch_size={run.batch}", f"train.steps={steps}",
           f"train.log_every={max(1, steps // 10)}", "train.eval_every=0", "train.plots=false",
           f"train.seed={run.seed}", f"optim.warmup_steps={max(1, (15 * steps) // 100)}",
           *(f"mesh.{k}={v}" for k, v in run.mesh.items())]
    if run.checkpoints:
        out += ["checkpoint.enabled=true", f"checkpoint.every={max(1, steps // 2)}", "checkpoint.keep=3"]
    else:
        out.append("checkpoint.enabled=false")
    return out + (SMOKE_MODEL if smoke else []) + list(extra)


def command(run: Run, run_dir: str, sets: list[str]) -> list[str]:
    if run.restore_from:  # the config comes from the copied folder; only the mesh changes
        base = ["--run-dir", run_dir, "--resume"]
        sets = [s for s in sets if s.startswith("mesh.")]
    else:
        base = ["--preset", run.preset, "--run-dir", run_dir]
    return [sys.executable, "-m", "falcon_jax.train", *base, *(a for s in sets for a in ("--set", s))]


# ----------------------------------------------------------------------------- the summary of a run
def speed_summary(records: list[dict], gpus: int) -> dict:
    """Throughput of a run's metrics ``records``: the medians over its speed records after the first (only one:
    that one), and the largest peak memory any of them recorded."""
    speed = [r for r in records if r.get("kind") == "speed"]
    timed = speed[1:] if len(speed) > 1 else speed
    if not timed:
        return {"speed_records": 0, "tokens_per_s": None, "tokens_per_s_per_gpu": None, "s_per_step": None,
                "peak_gib_per_gpu": None}
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    peaks = [r["peak_bytes_per_device"] for r in speed if r.get("peak_bytes_per_device") is not None]
    return {"speed_records": len(timed), "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / gpus,
            "s_per_step": statistics.median(r["s_per_step"] for r in timed),
            "peak_gib_per_gpu": max(peaks) / 2**30 if peaks else None}


def losses(records: list[dict]) -> dict[int, float]:
    """``{step: training loss}`` (a rewritten step: the last record wins)."""
    return {int(r["step"]): float(r["loss"]) for r in records if r.get("kind") == "train"}


def loss_gap(a: dict[int, float], b: dict[int, float], steps: int) -> dict | None:
    """|a - b| at the steps both have: the mean and largest over the second half (steps > steps // 2), the
    largest over all; None without a shared step in the second half."""
    shared = sorted(set(a) & set(b))
    late = [s for s in shared if s > steps // 2]
    if not late:
        return None
    d = [abs(a[s] - b[s]) for s in late]
    return {"steps_compared": len(late), "from_step": late[0], "mean_abs_diff_second_half": statistics.fmean(d),
            "max_abs_diff_second_half": max(d), "max_abs_diff": max(abs(a[s] - b[s]) for s in shared)}


def scaling(per_gpu: float | None, ref_per_gpu: float | None) -> float | None:
    """Tokens/s per GPU over the one-GPU reference's (1 = linear scaling)."""
    return per_gpu / ref_per_gpu if per_gpu and ref_per_gpu else None


def loss_at(curve: dict[int, float], steps: int) -> dict[str, float]:
    """The loss at the first step, at each quarter of the steps and at the last (those it has)."""
    marks = sorted({1, *(max(1, steps * q // 4) for q in (1, 2, 3, 4))})
    return {str(s): curve[s] for s in marks if s in curve}


def warning_lines(log: str, most: int = 12) -> list[str]:
    """The distinct lines of a run's log that warn (a kernel falling back to the whole batch, say)."""
    seen = []
    for line in log.splitlines():
        line = line.strip()
        if "warn" in line.lower() and line not in seen:
            seen.append(line[:400])
    return seen[:most]


def first_step_seconds(records: list[dict]) -> float | None:
    r = [x["seconds"] for x in records if x.get("kind") == "first_step"]
    return r[-1] if r else None


def compare(results: dict[str, dict], runs: list[Run], steps: int) -> None:
    """Fill in every finished run's scaling efficiency and loss gaps against its reference (in place)."""
    by_name = {r.name: r for r in runs}
    for name, res in results.items():
        run = by_name.get(name)
        if run is None or res.get("status") != "ok":
            continue
        ref = results.get(run.reference) if run.reference else None
        if ref is None or ref.get("status") != "ok":
            continue
        res["reference"] = run.reference
        if run.gpus > 1 and ref["gpus"] == 1:
            res["scaling_efficiency"] = scaling(res.get("tokens_per_s_per_gpu"), ref.get("tokens_per_s_per_gpu"))
        if (res["batch"], res["seq_len"]) == (ref["batch"], ref["seq_len"]):
            res["vs_reference"] = loss_gap(dict(res["loss"]), dict(ref["loss"]), steps)
        else:
            res["vs_reference"] = None
            res["vs_reference_note"] = (f"not compared: {res['batch']} x {res['seq_len']} here, "
                                        f"{ref['batch']} x {ref['seq_len']} in {run.reference}")


def noise(results: dict[str, dict], steps: int) -> dict:
    """The one-GPU loss's run-to-run noise (g1 against g1-repeat, same seed) and seed-to-seed spread (g1-seed1)."""
    out = {}
    g1 = results.get("g1", {})
    for key, other in (("same_seed", "g1-repeat"), ("other_seed", "g1-seed1")):
        o = results.get(other, {})
        if g1.get("status") == "ok" and o.get("status") == "ok":
            out[key] = loss_gap(dict(g1["loss"]), dict(o["loss"]), steps)
    return out


# ----------------------------------------------------------------------------- estimates
class Estimator:
    """Seconds a run will take: start-up + compilation (less when an earlier run compiled the same step and the
    compilation cache holds it) + steps + checkpoint saves.  Starts from pessimistic defaults; every finished run
    replaces them with what it measured (the largest seen)."""

    def __init__(self, defaults: dict, cache: bool):
        self.d = dict(defaults)
        self.cache = cache
        self.seen: set = set()
        self.startup: list[float] = []
        self.compile: list[float] = []
        self.compile_cached: list[float] = []
        self.token_s: float | None = None  # seconds per token on one GPU

    def step_seconds(self, run: Run) -> float:
        per_token = self.token_s or self.d["token_s"]
        t = per_token * run.tokens_per_step
        return t if run.gpus == 1 else t / (run.gpus * EFFICIENCY_GUESS)

    def _cached(self, run: Run) -> bool:
        """An earlier run compiled this run's step, and the compilation cache holds it."""
        return self.cache and run.program() in self.seen

    def seconds(self, run: Run, steps: int) -> float:
        cached = self._cached(run)
        startup = max(self.startup) if self.startup else self.d["startup"]
        if cached:
            comp = max(self.compile_cached) if self.compile_cached else self.d["compile_cached"]
        else:
            comp = max(self.compile) if self.compile else self.d["compile"]
        n_steps = steps - steps // 2 if run.restore_from else steps
        saves = 2 if run.checkpoints else (1 if run.restore_from else 0)
        return startup + comp + n_steps * self.step_seconds(run) + saves * self.d["save"]

    def learn(self, run: Run, res: dict, steps: int) -> None:
        first, wall, sps = res.get("first_step_s"), res.get("wall_s"), res.get("s_per_step")
        if first is None or wall is None:
            return
        cached = self._cached(run)
        (self.compile_cached if cached else self.compile).append(first)
        self.seen.add(run.program())
        if sps and run.gpus == 1:
            self.token_s = max(self.token_s or 0.0, sps / run.tokens_per_step)
        if sps and not run.checkpoints and not run.restore_from:
            self.startup.append(max(0.0, wall - first - (steps - 1) * sps))


# ----------------------------------------------------------------------------- files
def make_corpus(root: str, work: str, dirs=CORPUS_DIRS) -> dict:
    """Every ``.py`` / ``.md`` file under ``dirs`` of ``root`` (and README.md), sorted, one JSONL row each, written to
    ``<work>/corpus-<sha256[:12]>.jsonl`` unless it is there (an unchanged file keeps the tokenizer's cache)."""
    files = []
    for d in dirs:
        for base, sub, names in os.walk(os.path.join(root, d)):
            sub[:] = sorted(s for s in sub if s not in ("results", "__pycache__") and not s.startswith("."))
            files += [os.path.join(base, n) for n in sorted(names) if n.endswith((".py", ".md"))]
    readme = os.path.join(root, "README.md")
    files += [readme] if os.path.exists(readme) else []
    rows = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            rows.append(json.dumps({"text": fh.read(), "path": os.path.relpath(f, root)}))
    data = ("\n".join(rows) + "\n").encode()
    digest = hashlib.sha256(data).hexdigest()
    path = os.path.join(work, f"corpus-{digest[:12]}.jsonl")
    if not os.path.exists(path):
        os.makedirs(work, exist_ok=True)
        write_atomic(path, data)
    return {"path": os.path.relpath(path, root), "files": len(files), "bytes": len(data), "sha256": digest,
            "source": "this repository's .py and .md files under " + ", ".join(dirs) + " and README.md, one "
                      "document a file (the device machines cannot build data/python-docs.jsonl)"}


def pack(path: str, run_dirs: dict[str, str]) -> None:
    """A .tar.gz of every run's stdout log, metrics and config (no checkpoints), written atomically."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, d in run_dirs.items():
            for f in (RUN_LOG, METRICS, CONFIG):
                p = os.path.join(d, f)
                if os.path.exists(p):
                    tar.add(p, arcname=os.path.join(name, f))
    write_atomic(path, buf.getvalue())


def copy_without_last_checkpoint(src: str, dst: str) -> int:
    """Copy the run folder ``src`` to ``dst`` leaving out its newest checkpoint (hard links where the file system
    allows); returns the step ``dst`` will resume from.  ValueError if ``src`` has fewer than two checkpoints."""
    steps = checkpoint_steps(src)
    if len(steps) < 2:
        raise ValueError(f"{src} has checkpoints at {steps}; a restore needs two (it drops the last).")
    last = str(steps[-1])

    ckpt_dir = os.path.abspath(os.path.join(src, "checkpoints"))

    def link_or_copy(a, b):
        # checkpoint files are only read by the restore: linked; the rest (metrics.jsonl, which the resumed run
        # appends to) copied, so that the source run's files stay as they were
        if os.path.abspath(a).startswith(ckpt_dir + os.sep):
            try:
                return os.link(a, b)
            except OSError:
                pass
        shutil.copy2(a, b)

    def ignore(folder, names):
        return [last] if os.path.abspath(folder) == ckpt_dir else []

    shutil.copytree(src, dst, ignore=ignore, copy_function=link_or_copy)
    return steps[-2]


def records_from(path: str, offset: int = 0) -> list[dict]:
    """The records of a metrics file from byte ``offset`` on (a resumed copy: only what the resumed run wrote)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        return parse_records(f.read().decode("utf-8", errors="replace").splitlines())


def git_commit(root: str) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


PROBE = ("import json, jax; d = jax.devices(); print('PROBE ' + json.dumps({'platform': d[0].platform, "
         "'count': len(d), 'kind': d[0].device_kind, 'jax': jax.__version__}))")


def probe(env: dict) -> dict:
    """The devices a child process sees (platform, count, kind) and its jax version, without touching them here."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false"),
                         capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(f"could not list the devices (exit code {out.returncode}):\n{out.stderr[-2000:]}")


# ----------------------------------------------------------------------------- the table
def fmt(x, spec: str, scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def table(results: dict[str, dict], steps: int) -> str:
    marks = [str(max(1, steps // 2)), str(steps)]
    out = io.StringIO()
    out.write("| run | mesh | GPUs | B x T | tokens/s | per GPU | scaling | s/step | peak GiB/GPU | "
              f"loss @{marks[0]} | loss @{marks[1]} | mean abs Δloss vs ref (2nd half) | status |\n")
    out.write("|---" * 13 + "|\n")
    for name, r in results.items():
        mesh = "x".join(f"{k}={v}" for k, v in r.get("mesh", {}).items() if v != 1) or "1"
        gap = r.get("vs_reference") or {}
        la = r.get("loss_at", {})
        ref = f" ({r['reference']})" if r.get("reference") and gap else ""
        out.write(f"| {name} | {mesh} | {r.get('gpus', '–')} | {r.get('batch', '–')} x {r.get('seq_len', '–')} | "
                  f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} | "
                  f"{fmt(r.get('scaling_efficiency'), '.2f')} | {fmt(r.get('s_per_step'), '.4f')} | "
                  f"{fmt(r.get('peak_gib_per_gpu'), '.1f')} | {fmt(la.get(marks[0]), '.4f')} | "
                  f"{fmt(la.get(marks[1]), '.4f')} | {fmt(gap.get('mean_abs_diff_second_half'), '.4f')}{ref} | "
                  f"{r.get('status')} |\n")
    return out.getvalue()


# ----------------------------------------------------------------------------- the runner
class Stopped(Exception):
    """SIGTERM reached the runner (a time limit's ``timeout``, say): the run in flight is killed, the files written."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


class Runner:
    def __init__(self, args, root: str):
        self.args, self.root = args, root
        self.t0 = now()
        self.deadline = self.t0 + args.budget if args.budget else None
        os.makedirs(args.out, exist_ok=True)
        # with an earlier result in --out, this command writes multi-gpu.partial.* and replaces it when it ends
        self.files = ResultFiles(os.path.join(args.out, JSON_NAME), others=(os.path.join(args.out, PACK_NAME),))
        self.log_path = self.files.log_now
        open(self.log_path, "w").close()
        self.work = os.path.join(root, args.work)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.base = os.path.join(self.work, stamp)
        self.run_dirs: dict[str, str] = {}
        self.doc: dict = {}

    def say(self, msg: str) -> None:
        line = f"[multi-gpu {now() - self.t0:6.0f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - now()

    def save(self) -> None:
        self.doc["elapsed_s"] = now() - self.t0
        write_atomic(self.files.json_now, dumps_strict(self.doc, indent=1).encode())
        pack(self.files.now(os.path.join(self.args.out, PACK_NAME)), self.run_dirs)

    def env(self, gpus: int, visible: list[str]) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.args.smoke:
            return simulated_cpu_env(env, gpus)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:gpus])
        if not self.args.no_compile_cache:
            env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(self.work, "jax-cache")
        return env

    def execute(self, run: Run, run_dir: str, cmd: list[str], env: dict, limit: float) -> tuple[int | None, float]:
        """Run one process (its output into ``run_dir``/stdout.log); kill it after ``limit`` seconds.
        Returns (exit code or None when killed, wall seconds)."""
        os.makedirs(run_dir, exist_ok=True)
        t = now()
        with open(os.path.join(run_dir, RUN_LOG), "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                rc = None
            except BaseException:  # this runner stopped (Stopped, Ctrl-C): the run goes with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            if rc is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return rc, now() - t

    def one(self, run: Run, est: Estimator, steps: int, visible: list[str], corpus: str) -> dict:
        res = {"what": run.what, "gpus": run.gpus, "mesh": run.mesh, "batch": run.batch, "seq_len": run.seq_len,
               "tokens_per_step": run.tokens_per_step, "preset": run.preset, "seed": run.seed}
        lengths = [run.seq_len]
        if run.halve_on_oom:
            t = run.seq_len
            while t // 2 >= (SMOKE_SHAPES if self.args.smoke else FULL_SHAPES)["mid"][1]:
                t //= 2
                lengths.append(t)
        attempts = []
        for i, t in enumerate(lengths):
            trial = dataclasses.replace(run, seq_len=t)
            estimate = est.seconds(trial, steps)
            if estimate > self.left():
                reason = f"budget: estimated {estimate:.0f} s, {max(0.0, self.left()):.0f} s left"
                if not attempts:
                    return dict(res, status="skipped", reason=reason, estimate_s=estimate)
                attempts.append({"seq_len": t, "status": "skipped", "reason": reason})
                break
            name = run.name if len(lengths) == 1 else f"{run.name}-T{t}"
            run_dir = os.path.join(self.base, name)
            self.run_dirs[name] = run_dir
            offset = 0
            if run.restore_from:
                src = self.run_dirs.get(run.restore_from)
                src_res = self.doc["runs"].get(run.restore_from, {})
                if src is None or src_res.get("status") != "ok":
                    return dict(res, status="skipped", reason=f"{run.restore_from} did not finish")
                try:
                    res["restored_step"] = copy_without_last_checkpoint(src, run_dir)
                except (ValueError, OSError) as e:
                    return dict(res, status="failed", reason=f"copying {run.restore_from}'s folder: {e}")
                offset = os.path.getsize(os.path.join(run_dir, METRICS))
            sets = settings(trial, steps=steps, corpus=corpus, smoke=self.args.smoke, extra=self.args.set)
            cmd = command(trial, os.path.relpath(run_dir, self.root), sets)
            env = self.env(run.gpus, visible)
            res.update(status="running", seq_len=t, tokens_per_step=trial.tokens_per_step, estimate_s=estimate,
                       command=" ".join(cmd[1:]),
                       env={k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "XLA_FLAGS") if k in env})
            self.doc["runs"][run.name] = res
            self.save()
            self.say(f"start {name} (estimate {estimate:.0f} s, {self.left():.0f} s left): {' '.join(cmd[2:])}")
            rc, wall = self.execute(trial, run_dir, cmd, env, min(self.left() - KILL_MARGIN_S, self.args.run_timeout))
            records = records_from(os.path.join(run_dir, METRICS), offset)
            with open(os.path.join(run_dir, RUN_LOG), errors="replace") as f:
                text = f.read()
            res.update(rc=rc, wall_s=wall, first_step_s=first_step_seconds(records), run_dir=name,
                       warnings=warning_lines(text))
            if rc == 0:
                curve = losses(records)
                res.update(status="ok", **speed_summary(records, run.gpus), loss=sorted(curve.items()),
                           loss_at=loss_at(curve, steps))
                if run.restore_from:
                    src_curve = dict(self.doc["runs"][run.restore_from]["loss"])
                    after = {s: v for s, v in curve.items() if s > res["restored_step"]}
                    first = min(after) if after else None
                    diffs = [abs(v - src_curve[s]) for s, v in after.items() if s in src_curve]
                    res["vs_source"] = {
                        "source": run.restore_from, "first_step": first,
                        "first_loss": after.get(first), "source_first_loss": src_curve.get(first),
                        "steps_compared": len(diffs), "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
                        "max_abs_diff": max(diffs, default=None)}
                res.pop("log_tail", None)  # an earlier attempt's (out of memory): its log is in the pack
                est.learn(trial, res, steps)
                attempts.append({"seq_len": t, "status": "ok"})
                break
            oom = rc == 1 and ("ran out of device memory" in text or is_out_of_memory(text))
            res.update(status="killed" if rc is None else ("out of memory" if oom else "failed"),
                       log_tail=text[-3000:])
            attempts.append({"seq_len": t, "status": res["status"]})
            self.say(f"{name}: {res['status']} (exit code {rc}) after {wall:.0f} s; log tail:\n{text[-1500:]}")
            if not (oom and run.halve_on_oom and i + 1 < len(lengths)):
                break
        if run.halve_on_oom:
            res["attempts"] = attempts
        return res

    def main(self, runs: list[Run], visible: list[str], label: dict, corpus: dict, steps: int) -> int:
        args = self.args
        est = Estimator(SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS, cache=not args.no_compile_cache)
        self.doc.update({
            "what": "Multi-GPU training of the lm-130m model (falcon_jax.train.multi_gpu): throughput, scaling, "
                    "loss agreement, checkpoint restore on another device count, context parallelism.",
            "label": label,
            "settings": {"steps": steps, "steps_note": "fewer than the 200 of the earlier hand-made runs: a run's "
                         "time is mostly start-up and compilation (a minute or two), and every run must fit one "
                         "command's time limit", "log_every": max(1, steps // 10),
                         "warmup_steps": max(1, (15 * steps) // 100), "budget_s": args.budget, "smoke": args.smoke,
                         "compile_cache": not args.no_compile_cache, "extra_sets": args.set,
                         "throughput": "median over the speed records after the first (tokens/s and s/step)",
                         "loss_gap": "mean and largest |loss - reference's loss| over steps > steps // 2"},
            "corpus": corpus, "plan": [r.name for r in runs], "runs": {}, "skipped": [], "noise": {},
            "finished": False})
        self.save()
        try:
            self.all(runs, est, steps, visible, corpus["path"])
        except (Stopped, KeyboardInterrupt) as e:
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            for name, r in self.doc["runs"].items():
                if r.get("status") == "running":
                    r["status"] = "interrupted"
            self.save()
            kept = f"; {self.files.json} keeps the earlier results" if self.files.earlier else ""
            self.say(f"stopped by signal {signum}: {self.files.json_now} has the runs that finished{kept}")
            return 128 + signum
        self.doc["finished"] = True
        self.save()
        self.report(steps)
        self.files.finish()
        failed = [n for n, r in self.doc["runs"].items() if r["status"] not in ("ok", "skipped")]
        return 1 if failed else 0

    def all(self, runs: list[Run], est: Estimator, steps: int, visible: list[str], corpus: str) -> None:
        for run in runs:
            res = self.one(run, est, steps, visible, corpus)
            self.doc["runs"][run.name] = res
            if res["status"] == "skipped":
                self.doc["skipped"].append({"run": run.name, "reason": res.get("reason")})
                self.say(f"skip {run.name}: {res.get('reason')}")
            elif res["status"] == "ok":
                self.say(f"done {run.name} in {res['wall_s']:.0f} s (first step {fmt(res['first_step_s'], '.0f')} s): "
                         f"{fmt(res['tokens_per_s'], ',.0f')} tokens/s, {fmt(res['s_per_step'], '.4f')} s/step, "
                         f"peak {fmt(res['peak_gib_per_gpu'], '.1f')} GiB/GPU")
            compare(self.doc["runs"], runs, steps)
            self.doc["noise"] = noise(self.doc["runs"], steps)
            self.save()

    def report(self, steps: int) -> None:
        args = self.args
        self.say("summary\n" + table(self.doc["runs"], steps))
        for key, gap in self.doc["noise"].items():
            if gap:
                self.say(f"noise ({key}, g1 vs g1-{'repeat' if key == 'same_seed' else 'seed1'}): mean |Δloss| "
                         f"{gap['mean_abs_diff_second_half']:.4f}, largest {gap['max_abs_diff_second_half']:.4f} over "
                         f"steps {gap['from_step']}-{steps}")
        for name, r in self.doc["runs"].items():
            if r.get("vs_source"):
                v = r["vs_source"]
                self.say(f"{name}: resumed at step {r['restored_step']} on one GPU; first step {v['first_step']} loss "
                         f"{fmt(v['first_loss'], '.4f')} vs {v['source']}'s {fmt(v['source_first_loss'], '.4f')}; "
                         f"mean |Δ| {fmt(v['mean_abs_diff'], '.4f')}, largest {fmt(v['max_abs_diff'], '.4f')}")
        self.say(f"wrote {self.files.json}, {self.files.log}, {os.path.join(args.out, PACK_NAME)}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python experiments/multi_gpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for multi-gpu.json, multi-gpu.log and multi-gpu-logs.tar.gz")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole command (0 = no limit): no run "
                   "starts that its estimate says would not end in time, and one still going then is killed")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 100; 6 with --smoke)")
    p.add_argument("--runs", help="comma list of run names to make (gN = g<number of GPUs>); default: all")
    p.add_argument("--gpus", type=int, default=None, help="use the first this many visible GPUs (default: all)")
    p.add_argument("--smoke", action="store_true", help="a tiny model and few steps on simulated CPU devices")
    p.add_argument("--smoke-devices", type=int, default=2, help="simulated devices with --smoke (default 2)")
    p.add_argument("--work", default=os.path.join("runs", "multi-gpu"), help="where the runs go (under the "
                   "repository root; each command in a new <time> folder)")
    p.add_argument("--run-timeout", type=float, default=420, help="kill one run after this many seconds")
    p.add_argument("--no-compile-cache", action="store_true", help="no persistent compilation cache")
    p.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD, where there is a .git)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra --set for every run")
    p.add_argument("--list", action="store_true", help="print the runs and their commands, then exit")
    return p


def main(argv=None, *, root: str | None = None) -> int:
    """The command line; ``root``: the repository (the runs' working directory; default: the current one)."""
    p = parser()
    args = p.parse_args(argv)
    root = os.path.abspath(root or os.getcwd())
    steps = args.steps if args.steps is not None else (6 if args.smoke else 100)
    if steps < 2:
        p.error(f"--steps={steps}: need at least 2 (the loss is compared over the second half).")
    if not args.budget >= 0:  # (NaN too: every comparison with it is false, so it meant no limit)
        p.error(f"--budget={args.budget}: give seconds > 0, or 0 for no limit.")
    if not args.run_timeout > 0:
        p.error(f"--run-timeout={args.run_timeout}: give seconds > 0.")
    if args.smoke and args.smoke_devices < 1:
        p.error(f"--smoke-devices={args.smoke_devices}: need at least 1.")
    if args.gpus is not None and args.gpus < 1:
        p.error(f"--gpus={args.gpus}: need at least 1 (or leave it out for all visible GPUs).")
    if not args.list and not args.out:
        p.error("--out DIR is required (where multi-gpu.json and the logs go).")
    if args.list and args.gpus:
        info = {"platform": "cpu" if args.smoke else "gpu", "count": args.gpus, "kind": None, "jax": None}
    else:
        base_env = simulated_cpu_env(dict(os.environ), args.smoke_devices) if args.smoke else dict(os.environ)
        info = probe(base_env)
    if not args.smoke and info["platform"] != "gpu":
        p.error(f"the devices are {info['platform']} ones, not GPUs; use --smoke for simulated CPU devices.")
    n = min(info["count"], args.gpus or info["count"])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") \
        else [str(i) for i in range(info["count"])]
    try:
        runs = select(plan(n, args.smoke), args.runs, n)
    except ValueError as e:
        p.error(str(e))
    if args.list:
        for r in runs:
            sets = settings(r, steps=steps, corpus="<corpus>", smoke=args.smoke, extra=args.set)
            print(f"{r.name:16s} {r.gpus} GPU(s) {r.what}\n    "
                  + " ".join(command(r, os.path.join(args.work, "<time>", r.name), sets)[2:]))
        return 0
    runner = Runner(args, root)
    if runner.files.note():
        runner.say(runner.files.note())
    label = {"device_kind": info["kind"], "platform": info["platform"], "gpus": n, "jax": info["jax"],
             "date": datetime.date.today().isoformat(), "commit": args.commit or git_commit(root),
             "python": sys.version.split()[0]}
    runner.say(f"{n} {info['platform']} device(s) ({info['kind']}), jax {info['jax']}; runs: "
               + ", ".join(r.name for r in runs))
    corpus = make_corpus(root, runner.work, SMOKE_CORPUS_DIRS if args.smoke else CORPUS_DIRS)
    runner.say(f"corpus {corpus['path']}: {corpus['files']} files, {corpus['bytes']:,} bytes")
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return runner.main(runs, visible, label, corpus, steps)
    finally:
        signal.signal(signal.SIGTERM, previous)
