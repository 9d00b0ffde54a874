"""Context parallelism of the 130M LM, compiled for several GPUs on one, through JAX's mock GPU topology.

    python -m benchmarks.context_parallel [--cases NAME,...] [--out FILE.json] [--budget SECONDS] [--hlo DIR]
                                          [--commit HASH] [--smoke | --cpu]

Each case compiles (and does not run) ``falcon-train``'s whole training step — forward, backward, AdamW — of the
``lm-130m`` model (Falcon-1A.3, 12 layers, d = 768, bf16 compute, its kernels on the GPU) under its mesh, in a
``benchmarks.worker`` process of its own (``benchmarks/common.py``'s ``Worker``, as the ``lm`` suite runs its
configurations): the mock topology (``1xNx1``: N mocked processes of one GPU each, all on this GPU) is set before
the backend starts, and a compiler crash (an XLA check failure aborts the process) ends only that case, recorded
as failed with the last lines its process printed.  XLA's sharded autotuning is off
(``--xla_gpu_shard_autotuning=false``: it would wait for the mocked peers).

``seq2``            data=1 x seq=2, batch 1 x 65,536 tokens: the sequence split over 2 GPUs.
``data2-seq2``      data=2 x seq=2, batch 2 x 65,536.
``seq8-262k``       data=1 x seq=8, batch 1 x 262,144: the memory per device of a 262K-token sequence on 8 GPUs.
``one-32k``         one GPU (no mock), batch 1 x 32,768 = 262,144 / 8: what ``seq8-262k`` should be close to
                    if memory per device is ∝ T / (devices on seq).

Per case: the seconds of its phases (``start_s``: the process, jax and the backend; ``lower_s``: tracing the step
to StableHLO; ``compile_s``: XLA), ``compiled.memory_analysis()`` of one device (arguments, outputs, aliased,
temporaries, generated code, and the step's peak estimate: arguments + outputs - aliased + temporaries), the
collectives of the compiled step (kind, count, the largest result) and the kernels' largest output (a per-device
slice, not the whole sequence).  Each case's line is printed as it finishes, and ``--out`` is rewritten after
every case (a case in flight reads ``running``), so a run cut short keeps the cases it finished; a SIGTERM (e.g.
from ``timeout``) stops the case in flight, records it as ``interrupted`` and writes the file.  ``--budget``: no
case starts after that many seconds (``not started (budget)``), and a case still compiling then is stopped (a
failure: timed out).  With ``--out X.json`` the printed log is also kept in ``X.log``.

``--smoke``: the same cases, a tiny LM and short sequences on simulated CPU devices, to check the script anywhere.
``--cpu``: the full-size cases compiled for simulated CPU devices instead (no GPU needed; the chunk form runs in
XLA there, not in the kernels, so the memory is XLA-CPU's estimate of that program, not a GPU's).

For tests, ``FALCON_CP_FAIL=NAME=abort[,NAME=raise]`` makes case NAME's process abort (SIGABRT, as an XLA check
failure does) or raise a RuntimeError before it lowers the step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # name: (data, seq, batch, T)
    "seq2": (1, 2, 1, 65_536),
    "data2-seq2": (2, 2, 2, 65_536),
    "seq8-262k": (1, 8, 1, 262_144),
    "one-32k": (1, 1, 1, 32_768),
}
SMOKE_T = {65_536: 256, 262_144: 1024, 32_768: 128}
TIMEOUT = 1800  # seconds per case: its process's start, lowering and compile
FAIL_ENV = "FALCON_CP_FAIL"
FAIL_MODES = ("abort", "raise")
MEMORY_KEYS = ("argument", "output", "alias", "temp", "generated_code")
# a fatal log line (absl's "F1204 12:00:00.000000 ..." of a failed CHECK) or Python's report of a fatal signal
FATAL = re.compile(r"^F\d{4} |Check failed|Fatal Python error")


def compile_case(case: dict) -> dict:
    """Lower and compile one case (``benchmarks.worker``'s ``cp_compile``, in the case's own process, whose
    ``hello`` set the mock topology); the phases are printed as they end."""
    import jax

    import falcon_jax

    if case.get("fail") == "abort":
        print(f"{case['name']}: aborting ({FAIL_ENV})", flush=True)
        os.abort()
    if case.get("fail") == "raise":
        raise RuntimeError(f"{case['name']}: failure injected by {FAIL_ENV}")
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.sharding import kernel_sharding
    from falcon_jax.train.config import PRESETS, OptimConfig
    from falcon_jax.train.mesh import AXES, BATCH_AXES, SEQ_AXIS, batch_sharding
    from falcon_jax.train.optim import make_optimizer
    from falcon_jax.train.trainer import make_train_step

    t0 = time.perf_counter()
    devices = case["data"] * case["seq"]
    sizes = {"data": case["data"], "fsdp": 1, "seq": case["seq"], "tensor": 1}
    mesh = Mesh(np.asarray(jax.devices()[:devices]).reshape([sizes[a] for a in AXES]), AXES)
    model = dict(PRESETS["lm-130m"]["model"])
    if case["smoke"]:
        model.update(vocab_size=256, d_model=64, n_layers=2, n_heads=2, chunk_size=16, dtype="float32")
    cfg = LMConfig(**model)
    abstract = nnx.eval_shape(lambda: FalconLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    tx, _ = make_optimizer(OptimConfig(), 1000, params)
    # fsdp = tensor = 1: every parameter and optimizer moment is replicated
    whole = NamedSharding(mesh, P())
    def place(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), tree)

    params, rest = place(params), place(rest)
    opt_state = place(jax.eval_shape(tx.init, params))
    rows = batch_sharding(mesh, accum=True)
    B, T = case["batch"], case["T"]
    batch = {name: jax.ShapeDtypeStruct((1, B, T + 1), dtype, sharding=rows)
             for name, dtype in (("tokens", jnp.int32), ("segment_ids", jnp.int32), ("loss_mask", jnp.bool_))}
    t1 = time.perf_counter()
    with kernel_sharding(mesh, BATCH_AXES, "tensor", seq_axis=SEQ_AXIS):
        lowered = make_train_step(graphdef, tx).lower(params, rest, opt_state, batch)
    t2 = time.perf_counter()
    print(f"{case['name']}: lowered in {t2 - t1:.1f} s; compiling", flush=True)
    compiled = lowered.compile()
    t3 = time.perf_counter()
    print(f"{case['name']}: compiled in {t3 - t2:.1f} s", flush=True)
    hlo = compiled.as_text()
    if case.get("hlo"):
        with open(os.path.join(case["hlo"], f"{case['name']}.hlo.txt"), "w") as f:
            f.write(hlo)
    stats = compiled.memory_analysis()
    memory = None
    if stats is not None:
        memory = {key: int(getattr(stats, f"{key}_size_in_bytes")) for key in MEMORY_KEYS}
        memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    collectives = hlo_collectives(hlo)
    kernels = []
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if " custom-call(" in line and target and any(s in target.group(1) for s in ("triton", "mosaic")):
            kernels.append(line.split(" = ", 1)[1].split(" custom-call(", 1)[0])
    largest_kernel = max(kernels, key=_bytes, default=None)
    return {"build_s": round(t1 - t0, 2), "lower_s": round(t2 - t1, 2), "compile_s": round(t3 - t2, 2),
            "backend": jax.default_backend(), "jax": jax.__version__, "falcon_jax": falcon_jax.__file__,
            "memory_per_device": memory, "collectives": collectives, "kernel_calls": len(kernels),
            "largest_kernel_output": largest_kernel}


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
          "s64": 8}


def _bytes(shape_text: str) -> int:
    """Bytes of an HLO result type, e.g. ``f32[4,128]`` or a tuple ``(f32[2], bf16[3,4])``."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_COLLECTIVE_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def _tuple_parts(type_text: str) -> list[str]:
    """The top-level elements of an HLO tuple type (``"(a, (b, c))"`` -> ``["a", "(b, c)"]``); a type that is
    not a tuple is its own single part."""
    if not type_text.startswith("("):
        return [type_text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):
        depth += (ch == "(") - (ch == ")")
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(type_text[start:i].strip())
            start = i + 1
    return [p for p in parts if p]


def hlo_collectives(hlo: str) -> dict:
    """``{kind: {"count", "largest", "largest_bytes"}}`` over the collectives of an HLO module's text: the
    synchronous ops and the ``-start`` halves of asynchronous ones (a GPU's), each counted once.  The result
    type is everything between ``=`` and the op's name, so nested tuples (an asynchronous op's
    ``((operands), (results))``) are read whole; ``largest_bytes`` is the bytes of a synchronous op's result
    (every array of a tuple) or of an asynchronous start's largest part."""
    found = {}
    for line in hlo.splitlines():
        m = _COLLECTIVE_OP.search(line)
        if not m or " = " not in line[:m.start()]:
            continue
        kind_type = re.sub(r"\{[^{}]*\}|/\*[^*]*\*/", "", line[line.index(" = ") + 3:m.start()]).strip()
        entry = found.setdefault(m.group(1), {"count": 0, "largest": "", "largest_bytes": 0})
        entry["count"] += 1
        # an asynchronous start's type holds its operands beside its results (and a permute's contexts):
        # its size is that of its largest part, not their sum
        size = max(map(_bytes, _tuple_parts(kind_type))) if m.group(2) else _bytes(kind_type)
        if size > entry["largest_bytes"]:
            entry.update(largest=kind_type, largest_bytes=size)
    return found


def parse_fail(text: str, names: list[str]) -> dict:
    """``{case: mode}`` from ``FALCON_CP_FAIL``'s ``NAME=MODE,...`` (tests only)."""
    out = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, _, mode = item.partition("=")
        if name not in names or mode not in FAIL_MODES:
            raise ValueError(f"{FAIL_ENV}={text!r}: expected NAME=MODE,... with NAME one of the cases run "
                             f"({', '.join(names)}) and MODE one of {', '.join(FAIL_MODES)}")
        out[name] = mode
    return out


def case_request(name: str, smoke: bool, cpu: bool, hlo: str | None, fail: str | None) -> dict:
    data, seq, batch, T = CASES[name]
    return {"name": name, "data": data, "seq": seq, "batch": batch, "T": SMOKE_T[T] if smoke else T,
            "smoke": smoke, "platform": "cpu" if smoke or cpu else "gpu", "hlo": hlo and os.path.abspath(hlo),
            "fail": fail}


def case_worker(case: dict, import_path: str, harness: str, log):
    """The case's ``Worker``: simulated CPU devices, or the GPU with a mock topology of ``data * seq`` one-GPU
    processes (none for one device)."""
    from benchmarks.common import Worker

    devices = case["data"] * case["seq"]
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    flags = os.environ.get("XLA_FLAGS", "")
    config = {}
    if case["platform"] == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags = " ".join([f for f in flags.split() if "device_count" not in f]
                         + [f"--xla_force_host_platform_device_count={devices}"])
    else:
        flags = (flags + " --xla_gpu_shard_autotuning=false").strip()
        if devices > 1:
            config = {"mock_num_gpu_processes": devices, "jax_mock_gpu_topology": f"1x{devices}x1"}
    env["XLA_FLAGS"] = flags
    return Worker(case["name"], import_path, harness, case["smoke"], log, env=env, config=config)


def run_case(worker, case: dict, limit: float) -> dict:
    """Start the case's process and compile the case within ``limit`` seconds: the fields of its entry
    (``status`` "ok" or "failed"; a failure's ``error`` and ``log_tail``)."""
    from benchmarks.common import HELLO_LIMIT

    t0 = time.monotonic()
    status, reply = worker.start(min(HELLO_LIMIT, limit)), {}
    start_s = round(time.monotonic() - t0, 2)
    if status == "ok":
        status, reply = worker.request({"cmd": "cp_compile", "case": case}, max(limit - start_s, 1))
    entry = {"seconds": round(time.monotonic() - t0, 2), "start_s": start_s}
    if status == "ok" and "error" not in reply:
        reply.pop("seconds", None)
        return dict(entry, status="ok", **reply)
    error = reply.get("error", status)
    fatal = [line for line in worker.tail if FATAL.search(line)]
    if "error" not in reply and fatal:  # a crash: the check that failed, as the process logged it
        error += f": {fatal[0].strip()[:300]}"
    return dict(entry, status="failed", error=error, log_tail=_tail(worker))


def _tail(worker) -> str:
    """The last lines a case's process printed, each cut at 2,000 characters (XLA may print whole programs)."""
    return "\n".join(line[:2000] for line in worker.tail)


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def _mesh(case: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in zip(("data", "seq"), CASES[case["name"]][:2]) if v > 1) or "one device"


def result_line(case: dict) -> str:
    """One case's outcome: its phases' seconds and memory per device, or why it failed."""
    head = f"{case['name']} ({_mesh(case)}, {case['batch']} x {case['T']:,}): {case['status']}"
    if "seconds" not in case:
        return head
    phases = ", ".join(f"{k[:-2]} {case[k]:.1f} s" for k in ("start_s", "build_s", "lower_s", "compile_s") if k in case)
    head += f" in {case['seconds']:.1f} s" + (f" ({phases})" if phases else "")
    if case["status"] != "ok":
        return f"{head}: {case['error']}"
    m = case["memory_per_device"]
    if m is None:
        return f"{head}; no memory analysis on this backend"
    return (f"{head}; per device GiB: argument {gib(m['argument'])}, output {gib(m['output'])}, alias "
            f"{gib(m['alias'])}, temp {gib(m['temp'])}, generated code {gib(m['generated_code'])}, "
            f"peak {gib(m['peak'])}")


def _short(type_text: str) -> str:
    """An HLO result type for a log line: a tuple of many arrays as its count."""
    arrays = re.findall(r"\w+\[[\d,]*\]", type_text)
    return type_text if len(arrays) <= 2 else f"a tuple of {len(arrays)} arrays"


def report(cases: list[dict]) -> str:
    lines = ["case          mesh              batch x T      lower s  compile s  args GiB  out GiB  alias GiB  "
             "temp GiB  code GiB  peak GiB", "-" * 124]
    for r in cases:
        m = r.get("memory_per_device")
        if r["status"] != "ok" or m is None:
            why = f": {r['error']}" if "error" in r else ""
            lines.append(f"{r['name']:<13} {_mesh(r):<17} {r['batch']} x {r['T']:<10,} {r['status'].upper()}{why}")
            continue
        lines.append(f"{r['name']:<13} {_mesh(r):<17} {r['batch']} x {r['T']:<10,} {r['lower_s']:>7.1f} "
                     f"{r['compile_s']:>10.1f} {gib(m['argument']):>9} {gib(m['output']):>8} {gib(m['alias']):>10} "
                     f"{gib(m['temp']):>9} {gib(m['generated_code']):>9} {gib(m['peak']):>9}")
    lines.append("")
    for r in cases:
        if r["status"] in ("failed", "interrupted"):
            tail = r.get("log_tail", "").splitlines()[-10:]
            lines.append(f"{r['name']}: the last lines of its process:" if tail else f"{r['name']}: no output")
            lines.extend(f"    {line}" for line in tail)
        if r["status"] != "ok":
            continue
        parts = [f"{kind} x{c['count']} (largest {_short(c['largest'])}, {c['largest_bytes'] / 2 ** 20:.2f} MiB)"
                 for kind, c in sorted(r["collectives"].items())]
        lines.append(f"{r['name']}: collectives: {'; '.join(parts) or 'none'}")
        lines.append(f"{r['name']}: {r['kernel_calls']} kernel calls, largest output {r['largest_kernel_output']}")
        lines.append(f"{r['name']}: falcon_jax from {r['falcon_jax']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--out", help="also write the results to this JSON file (rewritten after every case) and the "
                   "log next to it (.log)")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="start no case after this many seconds, and stop "
                   "a case still compiling then")
    p.add_argument("--hlo", metavar="DIR", help="also write each case's compiled HLO to DIR/CASE.hlo.txt")
    p.add_argument("--commit", help="the commit of this checkout where its git metadata is missing or stale "
                   "(recorded as given)")
    p.add_argument("--smoke", action="store_true", help="a tiny LM on simulated CPU devices")
    p.add_argument("--cpu", action="store_true", help="the full-size cases on simulated CPU devices (XLA chunk form)")
    args = p.parse_args(argv)
    if args.smoke and args.cpu:
        p.error("--smoke and --cpu: choose one (--smoke is already on simulated CPU devices)")
    if args.budget is not None and not args.budget >= 0:  # (NaN compared false everywhere: no limit)
        p.error(f"--budget {args.budget:g}: give seconds >= 0")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        p.error(f"--cases: unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    try:
        fail = parse_fail(os.environ.get(FAIL_ENV, ""), names)
    except ValueError as e:
        p.error(str(e))
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
    if args.out and (os.path.isdir(args.out) or not args.out.endswith(".json")):
        p.error(f"--out {args.out}: give a .json file path (the log goes beside it as .log)")
    if args.out and os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    from benchmarks import source_tree
    from benchmarks.common import Log, ResultFiles, worker_scratch

    files = ResultFiles(args.out) if args.out else None  # an earlier result is replaced when this run ends
    if args.out:
        log = Log(files.log_now)
        if files.note():
            log(files.note())
    else:
        def log(text=""):
            print(text, flush=True)
    started = time.monotonic()
    scratch, harness = worker_scratch("falcon-cp-")
    tree = source_tree.describe(ROOT)
    if args.commit:
        tree["commit"] = args.commit
    requests = [case_request(n, args.smoke, args.cpu, args.hlo, fail.get(n)) for n in names]
    payload = {"benchmark": "context_parallel", "smoke": args.smoke, "cpu": args.cpu,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": ["python", "-m", "benchmarks.context_parallel", *(sys.argv[1:] if argv is None else argv)],
               "budget_s": args.budget, "limit_s": TIMEOUT, "trees": {"measured": tree}, "environment": None,
               "memory": "memory_per_device: compiled.memory_analysis() of one device's program, in bytes; peak = "
                         "argument + output - alias + temp (generated_code apart)",
               "cases": [{"name": r["name"], "mesh": {"data": r["data"], "fsdp": 1, "seq": r["seq"], "tensor": 1},
                          "batch": r["batch"], "T": r["T"], "devices": r["data"] * r["seq"], "status": "not started"}
                         for r in requests]}

    def save():
        if args.out:
            payload["seconds"] = round(time.monotonic() - started, 1)
            with open(files.json_now + ".tmp", "w") as f:
                json.dump(payload, f, indent=2, default=str)
            os.replace(files.json_now + ".tmp", files.json_now)

    def stamp():
        return f"[{time.monotonic() - started:5.0f} s]"

    log(f"benchmarks.context_parallel{' --smoke' if args.smoke else ' --cpu' if args.cpu else ''}: {tree['path']} "
        f"({tree['commit'] or 'no git commit'}, source {tree['source_sha1']}); cases {', '.join(names)}")
    save()
    worker, current, case_started, ended_by = None, None, None, []

    def terminate(signum, frame):
        ended_by.append(signal.Signals(signum).name)
        sys.exit(128 + signum)

    # a time limit's SIGTERM ends the run through the finally below: the case in flight stopped, the JSON written
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        import_path = source_tree.import_path(ROOT, os.path.join(scratch, "tree"))
        for request, entry in zip(requests, payload["cases"]):
            elapsed = time.monotonic() - started
            if args.budget is not None and elapsed >= args.budget:
                entry["status"] = "not started (budget)"
                log(f"{stamp()} {entry['name']}: not started (past --budget {args.budget:g} s)")
                save()
                continue
            limit = TIMEOUT if args.budget is None else max(min(TIMEOUT, args.budget - elapsed), 1)
            entry["status"], current, case_started = "running", entry, time.monotonic()
            save()
            log(f"{stamp()} compiling {entry['name']} ({_mesh(entry)}, {entry['batch']} x {entry['T']:,}) ...")
            worker = case_worker(request, import_path, harness, log)
            entry.update(run_case(worker, request, limit))
            if limit < TIMEOUT and entry.get("error", "").startswith("timed out"):
                entry["error"] += f" (--budget {args.budget:g} s)"
            if payload["environment"] is None and worker.environment:
                payload["environment"] = env = worker.environment
                log(f"{stamp()} device {env['device']} ({env['backend']}), driver {env['driver']}, "
                    + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
            worker.stop()
            worker = current = None
            save()
            log(f"{stamp()} {result_line(entry)}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM (timeout signals the group) waits
        if current is not None:
            how = ended_by[0] if ended_by else getattr(sys.exc_info()[0], "__name__", "an error of this script")
            current.update(status="interrupted", seconds=round(time.monotonic() - case_started, 2),
                           error=f"the run ended ({how}) while this case ran",
                           log_tail=_tail(worker) if worker else "")
            log(f"{stamp()} {result_line(current)}")
        if worker is not None:
            worker.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        save()
        log("\n" + report(payload["cases"]))
        if args.out:
            log(f"\nwrote {files.json_now}")
        signal.signal(signal.SIGTERM, previous)
    if files:  # the run ended: its files replace the earlier ones
        files.finish()
    return 1 if any(c["status"] in ("failed", "interrupted") for c in payload["cases"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
