"""Context parallelism of the 130M LM, compiled for several GPUs on one, through JAX's mock GPU topology.

    python -m benchmarks.context_parallel [--cases NAME,...] [--out FILE.json] [--hlo DIR] [--smoke | --cpu]

Each case compiles (and does not run) ``falcon-train``'s whole training step — forward, backward, AdamW — of the
``lm-130m`` model (Falcon-1A.3, 12 layers, d = 768, bf16 compute, its kernels on the GPU) under its mesh, in a
process of its own: the mock topology (``1xNx1``: N mocked processes of one GPU each, all on this GPU) is fixed
before the backend starts, and a compiler crash ends only that process.  XLA's sharded autotuning is off
(``--xla_gpu_shard_autotuning=false``: it would wait for the mocked peers).

``seq2``            data=1 x seq=2, batch 1 x 65,536 tokens: the sequence split over 2 GPUs.
``data2-seq2``      data=2 x seq=2, batch 2 x 65,536.
``seq8-262k``       data=1 x seq=8, batch 1 x 262,144: the memory per device of a 262K-token sequence on 8 GPUs.
``one-32k``         one GPU (no mock), batch 1 x 32,768 = 262,144 / 8: what ``seq8-262k`` should be close to
                    if memory per device is ∝ T / (devices on seq).

Per case: ``compiled.memory_analysis()`` of one device (arguments, outputs, aliased, temporaries, and their sum
less the aliased bytes: the step's peak estimate), the collectives of the compiled step (kind, count, the largest
result) and the kernels' largest output (a per-device slice, not the whole sequence).  ``--smoke``: the same cases,
a tiny LM and short sequences on simulated CPU devices, to check the script anywhere.  ``--cpu``: the full-size
cases compiled for simulated CPU devices instead (no GPU needed; the chunk form runs in XLA there, not in the
kernels, so the memory is XLA-CPU's estimate of that program, not a GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # name: (data, seq, batch, T)
    "seq2": (1, 2, 1, 65_536),
    "data2-seq2": (2, 2, 2, 65_536),
    "seq8-262k": (1, 8, 1, 262_144),
    "one-32k": (1, 1, 1, 32_768),
}
SMOKE_T = {65_536: 256, 262_144: 1024, 32_768: 128}
TIMEOUT = 1800
RESULT = "@@RESULT "


def child(case: dict) -> dict:
    """Compile one case; runs in its own process (the mock topology must be set before jax starts its backend)."""
    import jax

    import falcon_jax

    devices = case["data"] * case["seq"]
    if case["platform"] == "gpu" and devices > 1:
        jax.config.update("mock_num_gpu_processes", devices)
        jax.config.update("jax_mock_gpu_topology", f"1x{devices}x1")
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
    with kernel_sharding(mesh, BATCH_AXES, "tensor", seq_axis=SEQ_AXIS):
        lowered = make_train_step(graphdef, tx).lower(params, rest, opt_state, batch)
    print(f"{case['name']}: lowered", flush=True)
    compiled = lowered.compile()
    if case.get("hlo"):
        with open(os.path.join(case["hlo"], f"{case['name']}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
    stats = compiled.memory_analysis()
    memory = {key: int(getattr(stats, f"{key}_size_in_bytes")) for key in ("argument", "output", "alias", "temp")}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    collectives, kernels = {}, []
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (\([^()]*\)|\S+?)(?:\{[^}]*\})? (all-gather|all-reduce|all-to-all|collective-permute|"
                      r"reduce-scatter)(?:-start)?\(", line)
        if m:
            entry = collectives.setdefault(m.group(2), {"count": 0, "largest": "", "largest_bytes": 0})
            entry["count"] += 1
            kind_type = re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", m.group(1))  # without layouts
            size = _bytes(kind_type)
            if size > entry["largest_bytes"]:
                entry.update(largest=kind_type, largest_bytes=size)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if " custom-call(" in line and target and any(s in target.group(1) for s in ("triton", "mosaic")):
            kernels.append(line.split(" = ", 1)[1].split(" custom-call(", 1)[0])
    largest_kernel = max(kernels, key=_bytes, default=None)
    return {"name": case["name"], "mesh": sizes, "batch": B, "T": T, "devices": devices,
            "backend": jax.default_backend(), "jax": jax.__version__, "falcon_jax": falcon_jax.__file__, "memory_per_device": memory, "collectives": collectives,
            "kernel_calls": len(kernels), "largest_kernel_output": largest_kernel}


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


def run_case(name: str, smoke: bool, hlo: str | None, import_path: str, cpu: bool = False) -> dict:
    data, seq, batch, T = CASES[name]
    platform = "cpu" if smoke or cpu else "gpu"
    case = {"name": name, "data": data, "seq": seq, "batch": batch, "T": SMOKE_T[T] if smoke else T, "smoke": smoke,
            "platform": platform, "hlo": hlo and os.path.abspath(hlo)}
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    flags = env.get("XLA_FLAGS", "")
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags = " ".join([f for f in flags.split() if "device_count" not in f]
                         + [f"--xla_force_host_platform_device_count={data * seq}"])
    else:
        flags = (flags + " --xla_gpu_shard_autotuning=false").strip()
    env["XLA_FLAGS"] = flags
    # this checkout's falcon_jax in its installed layout (benchmarks/source_tree.py), ahead of any installed one; the
    # child runs this file as a script from that folder, so the checkout's own root is not on its path
    env["PYTHONPATH"] = os.pathsep.join([import_path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--child",
                               json.dumps(case)], env=env, cwd=import_path, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return {"name": name, "error": f"timed out after {TIMEOUT} s", "log": str(e.stdout or "")[-3000:]}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)), None)
    if line is None:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        return {"name": name, "error": f"no compiled program ({how})", "log": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(line[len(RESULT):])


def _short(type_text: str) -> str:
    """An HLO result type for a log line: a tuple of many arrays as its count."""
    arrays = re.findall(r"\w+\[[\d,]*\]", type_text)
    return type_text if len(arrays) <= 2 else f"a tuple of {len(arrays)} arrays"


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def report(results: list[dict]) -> str:
    lines = ["case          mesh              batch x T        args GiB  out GiB  alias GiB  temp GiB  peak GiB",
             "-" * 100]
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']:<13} FAILED: {r['error']}")
            continue
        m = r["memory_per_device"]
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "one device"
        lines.append(f"{r['name']:<13} {mesh:<17} {r['batch']} x {r['T']:<12,} {gib(m['argument']):>8} "
                     f"{gib(m['output']):>8} {gib(m['alias']):>10} {gib(m['temp']):>9} {gib(m['peak']):>9}")
    lines.append("")
    for r in results:
        if "error" in r:
            lines.append(f"{r['name']}: {r['log']}")
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
    p.add_argument("--out", help="also write the results to this JSON file")
    p.add_argument("--hlo", metavar="DIR", help="also write each case's compiled HLO to DIR/CASE.hlo.txt")
    p.add_argument("--smoke", action="store_true", help="a tiny LM on simulated CPU devices")
    p.add_argument("--cpu", action="store_true", help="the full-size cases on simulated CPU devices (XLA chunk form)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child(json.loads(args.child))
        print(RESULT + json.dumps(result), flush=True)
        os._exit(0)  # a mocked process may wait for its missing peers at exit
    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    from benchmarks import source_tree  # here: the child runs this file as a script, without the benchmarks package

    results = []
    with tempfile.TemporaryDirectory(prefix="falcon-cp-") as scratch:
        import_path = source_tree.import_path(ROOT, os.path.join(scratch, "tree"))
        for name in names:
            print(f"compiling {name} ...", flush=True)
            results.append(run_case(name, args.smoke, args.hlo, import_path, cpu=args.cpu))
    print(report(results))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python -m benchmarks.context_parallel"] + (argv or sys.argv[1:])),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit.stdout.strip() or None,
                       "cases": results}, f, indent=2)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
