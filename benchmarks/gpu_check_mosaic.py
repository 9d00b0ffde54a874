"""Check the Mosaic GPU (wgmma + TMA) forward of decayed attention on the H200.

    python benchmarks/gpu_check_mosaic.py [--out benchmarks/results/h200_mosaic_check.json]

Compares implementation="mosaic_gpu" with "pallas_gpu" (Triton) and the float64 reference
(``reference.py``), outputs and final state, with an initial state, with and without segments:
  * bf16, T = 8192 and odd T (1000, 4133), pieces from the op and forced (2, 8);
  * fp32 inputs: mosaic_gpu must refuse them (NotImplementedError), recorded as such;
  * gradients through the custom VJP (Mosaic forward, Triton backward) equal the Triton op's;
  * kernel-only forward timing, mosaic_gpu vs pallas_gpu, at 8x2048x16 and 1x32768x16 (d128).
Pass criterion (bf16): mosaic's max error vs fp64 <= 1.5x Triton's + 1e-3 (relative to max |ref|).
Prints PASS/FAIL per check and rewrites the JSON after every check; exit 1 if any fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import rel_err, time_jax, write_json  # noqa: E402
from falcon_jax.kernels.decayed_attention import decayed_attention  # noqa: E402
from falcon_jax.kernels.decayed_attention.reference import decayed_attention_reference  # noqa: E402


def inputs(seed, B, H, T, dk, dv, dtype, segments):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    x = rng.normal(size=(B, H, T, dk)) / np.sqrt(dk)
    y = rng.normal(size=(B, H, T, dv))
    log_decay = -rng.uniform(0.0, 0.2, size=(B, H, T))
    if segments:
        starts = rng.uniform(size=(B, 1, T)) < 0.002
        starts[..., 0] = False
        run = np.broadcast_to(np.cumsum(starts, axis=-1), (B, H, T))
    else:
        run = np.zeros((B, H, T), np.int64)
    s0 = rng.normal(size=(B, H, dk, dv)) * 0.3
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(q), cast(x), cast(y), jnp.asarray(log_decay, jnp.float32), jnp.asarray(run, jnp.int32),
            jnp.asarray(s0, jnp.float32))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200_mosaic_check.json")
    args = ap.parse_args()
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "checks": []}
    failed = []

    def record(name, ok, **info):
        status = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
        print(f"{status} {name} {info}", flush=True)
        report["checks"].append(dict(name=name, status=status, **info))
        if ok is False:
            failed.append(name)
        write_json(args.out, report)

    def run(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record and go on to the next check
            traceback.print_exc(limit=4)
            record(name, False, error=f"{type(e).__name__}: {str(e)[:600]}")

    op = jax.jit(decayed_attention, static_argnames=("chunk_size", "implementation", "pieces"))

    def compare(B, H, T, segments, pieces, seed):
        name = f"bf16 B{B} H{H} T{T} d128 segments={segments} pieces={pieces}"

        def check():
            a = inputs(seed, B, H, T, 128, 128, jnp.bfloat16, segments)
            t0 = time.time()
            om, sm = op(*a, implementation="mosaic_gpu", pieces=pieces)
            om.block_until_ready()
            t_first = time.time() - t0
            ot, st = op(*a, implementation="pallas_gpu", pieces=pieces)
            ro, rs = jax.jit(decayed_attention_reference)(*(v.astype(jnp.float64) if v.dtype == jnp.bfloat16 else v
                                                           for v in a))
            e = dict(mosaic_o=rel_err(om, ro), mosaic_s=rel_err(sm, rs), triton_o=rel_err(ot, ro), triton_s=rel_err(st, rs),
                     mosaic_vs_triton_o=rel_err(om, ot), finite=bool(np.isfinite(np.asarray(om, np.float32)).all()),
                     first_call_s=t_first)
            ok = e["finite"] and all(e[f"mosaic_{k}"] <= 1.5 * e[f"triton_{k}"] + 1e-3 for k in ("o", "s"))
            record(name, ok, **e)

        run(name, check)

    compare(1, 4, 8192, False, None, 0)
    compare(1, 4, 8192, True, None, 1)
    compare(2, 3, 1000, False, None, 2)
    compare(1, 2, 4133, True, None, 3)
    compare(1, 2, 8192, True, 8, 4)
    compare(2, 16, 2048, False, 2, 5)

    def fp32_refused():
        a = inputs(6, 1, 2, 512, 128, 128, jnp.float32, False)
        try:
            op(*a, implementation="mosaic_gpu")
        except NotImplementedError as e:
            record("fp32 refused (NotImplementedError)", True, message=str(e)[:200])
            return
        record("fp32 refused (NotImplementedError)", False, error="fp32 inputs were accepted")

    run("fp32 refused", fp32_refused)

    def grads():
        a = inputs(7, 1, 4, 1000, 128, 128, jnp.bfloat16, True)

        def loss(impl):
            def f(q, x, y, ld, s0):
                o, s = decayed_attention(q, x, y, ld, a[4], s0, implementation=impl)
                return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[2]))[:, None]) + jnp.sum(s)
            return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

        gm = loss("mosaic_gpu")(*a[:4], a[5])
        gt = loss("pallas_gpu")(*a[:4], a[5])
        e = {f"d{n}": rel_err(u.astype(jnp.float32), v.astype(jnp.float32))
             for n, u, v in zip(("q", "x", "y", "log_decay", "s0"), gm, gt)}
        record("grads mosaic fwd + triton bwd vs triton", all(v < 2e-2 for v in e.values()), **e)

    run("grads", grads)

    for B, T in ((8, 2048), (1, 32768)):
        def timing(B=B, T=T):
            a = inputs(8, B, 16, T, 128, 128, jnp.bfloat16, False)
            ms = {impl: time_jax(jax.jit(lambda *v, impl=impl: decayed_attention(*v, implementation=impl)[0]), *a)
                  for impl in ("mosaic_gpu", "pallas_gpu")}
            record(f"timing kernel-only fwd B{B} T{T} H16 d128", None, **{f"{k}_ms": v for k, v in ms.items()})

        run(f"timing B{B} T{T}", timing)

    print("FAILED: " + ", ".join(failed) if failed else "ALL PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
