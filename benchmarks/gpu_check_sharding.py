"""Which part of the sharded step breaks XLA's GPU compiler?  (issue #8; needs >= 2 GPUs)

On the two-H200 machine the lm-130m step compiled on one GPU but the compiler crashed (SIGSEGV)
for mesh data=2 and fsdp=2 once the Pallas kernels ran per shard (``kernel_sharding``) and the
activations were pinned to the batch axes (``constrain_batch``).  Each case below compiles and runs
one forward+backward in its own process (a crash ends only that case) and prints one line:

    python benchmarks/gpu_check_sharding.py [--cases op-plain,lm-full] [--limit 150] [--out result.json]

Cases: ``op-*`` are one ``falcon(..., impl="pallas")`` forward+backward (B8 T1024 H12 d64, bf16)
on a two-device batch-sharded mesh: without a context (the partitioner places the kernels), inside
``kernel_sharding`` (``shard_map``; the model's [B, T, H, d] layout read in place), the same with
the head-major layout, and with rows enough (B32) that the kernels need no sequence pieces, so no
XLA scan surrounds them inside ``shard_map`` (a scan in a manual-sharded region once crashed XLA's
GPU compiler: jax-ml/jax#18384).  Controls: the XLA chunk form inside the context (``shard_map``,
no Pallas call) and a one-line Pallas kernel under ``shard_map``.  ``lm-*`` are ``python -m
train`` on the lm-130m preset cut to 2 layers, 3 steps, mesh data=2: no context (as before the
change), the context with the kernels left whole (``constrain_batch`` only), the context with
``shard_map`` only, and both (the trainer on CPU meshes; on GPU meshes the trainer now runs the
constrain-only path).  The context's GPU gate is lifted in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import write_json  # noqa: E402

OP_CASES = ("op-plain", "op-shard_map", "op-shard_map-head-major", "op-shard_map-one-piece", "op-shard_map-xla",
            "op-shard_map-trivial-pallas")
LM_CASES = ("lm-no-context", "lm-constrain-only", "lm-shard_map-only", "lm-full")
LM_ARGS = ["--preset", "lm-130m", "--set", 'data.paths=["data/python-docs.jsonl"]', "--set",
           "data.cache_dir=/tmp/falcon-cache", "--set", "model.n_layers=2", "--set", "train.steps=3",
           "--set", "train.batch_size=8", "--set", "train.log_every=1", "--set", "train.eval_every=0",
           "--set", "checkpoint.every=0", "--set", "train.plots=false", "--set", "mesh.data=2",
           "--set", "mesh.fsdp=1"]


def run_op_case(case: str) -> str:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import falcon_jax
    from falcon_jax.forms import chunk_pallas

    mesh = Mesh(jax.devices()[:2], ("data",))
    # 4 rows x 12 heads per device leave the GPU idle, so the kernels cut the sequence into pieces joined by an
    # XLA scan; "one-piece" uses 16 rows per device (192 programs): no pieces, no scan around the kernels
    B, T, H, d = (32 if case.endswith("one-piece") else 8), 1024, 12, 64
    keys = jax.random.split(jax.random.key(0), 5)
    row = NamedSharding(mesh, P("data"))
    q, k, v = (jax.device_put(jax.random.normal(kk, (B, T, H, d), jnp.bfloat16), row) for kk in keys[:3])
    beta = jax.device_put(jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H))), row)
    lam = jax.device_put(0.1 * jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H))), row)
    if case.endswith("head-major"):
        chunk_pallas.PREFER_TIME_MAJOR = False
    impl = "xla" if case.endswith("-xla") else "pallas"

    def loss(q, k, v):
        if case.endswith("trivial-pallas"):  # the smallest Pallas kernel, per shard: o = 2 q
            from jax.experimental import pallas as pl

            def double(q_ref, o_ref):
                o_ref[...] = q_ref[...] * 2

            def per_device(q):
                q = q[:, :, :1]  # one head
                return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                                      grid=(q.shape[0],), in_specs=[pl.BlockSpec((None, T, 1, d),
                                                                                 lambda b: (b, 0, 0, 0))],
                                      out_specs=pl.BlockSpec((None, T, 1, d), lambda b: (b, 0, 0, 0)),
                                      interpret=jax.default_backend() == "cpu")(q)
            # forward only (the kernel has no VJP): its input is cut from the gradient
            o = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False)(jax.lax.stop_gradient(q))
            return jnp.sum(o.astype(jnp.float32) ** 2) + 0 * jnp.sum(k) + 0 * jnp.sum(v)
        o = falcon_jax.falcon(q, k, v, beta, lam, variant="1A", impl=impl)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    ctx = (falcon_jax.kernel_sharding(mesh, ("data",), None, allow_gpu=True) if case != "op-plain"
           else contextlib.nullcontext())
    with ctx:
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        t0 = time.perf_counter()
        compiled = step.lower(q, k, v).compile()
        t1 = time.perf_counter()
        value, grads = compiled(q, k, v)
        jax.block_until_ready(grads)
    return f"compile {t1 - t0:.1f}s, loss {float(value):.4g}"


def run_lm_case(case: str) -> str:
    import falcon_jax
    import falcon_jax.train.trainer
    from falcon_jax.train.cli import main

    # the modules by name: the package attribute `falcon_jax.falcon` is the function, not its module
    falcon_module, model_module = sys.modules["falcon_jax.falcon"], sys.modules["falcon_jax.nn.model"]
    if case == "lm-no-context":
        falcon_jax.train.trainer.kernel_sharding = lambda *a, **k: contextlib.nullcontext()
    else:  # the trainer enters the context; the GPU gate is lifted so the case runs what it names
        import falcon_jax.sharding
        entered = falcon_jax.sharding.kernel_sharding
        falcon_jax.train.trainer.kernel_sharding = lambda *a, **k: entered(*a, **k, allow_gpu=True)
    if case == "lm-constrain-only":
        falcon_module.per_shard = lambda fn, **kw: fn
    elif case == "lm-shard_map-only":
        model_module.constrain_batch = lambda x, **kw: x
    run_dir = f"/tmp/falcon-sharding-check/{case}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time (a scratch folder of this check)
    t0 = time.perf_counter()
    rc = main(LM_ARGS + ["--run-dir", run_dir])
    if rc != 0:
        raise SystemExit(f"falcon-train exited with {rc}")
    return f"3 steps in {time.perf_counter() - t0:.1f}s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(OP_CASES + LM_CASES))
    p.add_argument("--limit", type=float, default=150, help="seconds per case")
    p.add_argument("--out")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one case in this process
    args = p.parse_args()
    if args.one:
        print("RESULT", run_op_case(args.one) if args.one.startswith("op-") else run_lm_case(args.one), flush=True)
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in OP_CASES + LM_CASES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {', '.join(OP_CASES + LM_CASES)}")
    results = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--one", case], cwd=ROOT,
                                  capture_output=True, text=True, timeout=args.limit)
            out = proc.stdout + proc.stderr
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
            status = f"ok: {line[7:]}" if proc.returncode == 0 and line else f"FAILED rc {proc.returncode}"
            if not status.startswith("ok"):
                tail = [ln for ln in out.splitlines() if "Error" in ln or "Fatal" in ln or "error:" in ln][-3:]
                status += " | " + " | ".join(t[:200] for t in tail)
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT after {args.limit:.0f}s"
        results[case] = dict(status=status, seconds=round(time.perf_counter() - t0, 1))
        print(f"{case:24s} {status}  [{results[case]['seconds']} s]", flush=True)
        if args.out:  # after every case: a call cut off by its time limit keeps what it found
            write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
