"""Per-kernel GPU time of Falcon-1, 2, 3 (ours) and the peers, from CUPTI through torch.profiler (run on the H200).

    python benchmarks/profile_kernels.py [--shapes 8x2048x16x128,1x32768x16x128] [--out profile.json]

The whole-op timings (bench_regression.py) say how far apart the implementations are; this says where:
every CUDA kernel launched during ``--iters`` calls — ours through ``falcon(variant="1", impl="pallas")``
(and Falcon-2 with per-column gains, Falcon-3 with W = 4, as ``bench_regression.py`` times them)
(gates and layout in XLA fusions, the Pallas kernels by name), the op alone in place, jax-linear-attention
0.1.0 ``gated_deltanet`` and fla 0.6.0 ``chunk_delta_rule`` — with its calls and microseconds per
iteration.  CUPTI records every kernel of the process, so the JAX programs' kernels are seen by torch's
profiler as well as torch's own.  Also prints the sum of kernel time per iteration beside the wall time
(the difference is launch gaps and idle GPU).  bf16 q, k, v; fp32 gates.  Needs torch (CUDA) and jax on
one GPU; the peers are skipped when not installed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import jax

from benchmarks.bench_regression import (fla_delta_rule_calls, fwd_and_bwd, jla_op, kernel_only_in_place, make_inputs,
                                         ours_falcon, ours_falcon2, ours_falcon3, per_column_gains)
from benchmarks.common import parse_shape, parsed_kernel_config, time_jax, time_torch, write_json
from falcon_jax.forms import chunk_pallas


def kernel_times(run, sync, iters):
    """{kernel name: [calls, µs]} per iteration of ``run`` (after one warm-up call), ``sync`` waiting for it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # kernels: device events
        for _ in range(iters):
            run()
        sync()
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        entry = table[evt.name[:90]]
        entry[0] += 1 / iters
        entry[1] += evt.time_range.elapsed_us() / iters
    return dict(table)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8x2048x16x128,1x32768x16x128")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=14, help="kernels printed per case (all go to the JSON)")
    parser.add_argument("--impls", default="", help="comma-separated substrings: only the matching implementations "
                        "(default: all), e.g. 'falcon-1,fla'")
    parser.add_argument("--kernel-config", default="", help="our whole op's regression kernels on this KernelConfig, "
                        "'name=value,...' (default: the op's defaults), e.g. 'gate_transpose=pallas'")
    parser.add_argument("--out", default="profile_kernels.json")
    args = parser.parse_args()
    import torch

    chunk_pallas.KERNEL_CONFIG = parsed_kernel_config(parser, args.kernel_config)
    wanted = [s for s in args.impls.split(",") if s]

    def want(impl):
        return not wanted or any(s in impl for s in wanted)

    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "torch": torch.__version__,
               "kernel config": repr(chunk_pallas.KERNEL_CONFIG), "cases": []}
    t_start = time.time()

    def record(impl, shape, mode, run, sync, wall_ms):
        try:
            table = kernel_times(run, sync, args.iters)
        except Exception as e:  # noqa: BLE001 - record and go on to the next case
            results["cases"].append({"impl": impl, "shape": shape, "mode": mode, "error": repr(e)[:400]})
            print(f"{impl} {shape} {mode}: {e!r}"[:400], flush=True)
            write_json(args.out, results)
            return
        total = sum(us for _, us in table.values())
        rows = sorted(((name, calls, us) for name, (calls, us) in table.items()), key=lambda r: -r[2])
        results["cases"].append({"impl": impl, "shape": shape, "mode": mode, "wall_ms": wall_ms,
                                 "kernel_us_per_iter": total,
                                 "kernels": [{"name": n, "calls": c, "us": u} for n, c, u in rows]})
        write_json(args.out, results)
        print(f"\n== {impl}, {shape}, {mode}: wall {wall_ms:.3f} ms, kernels {total / 1e3:.3f} ms per call "
              f"({len(rows)} kinds) [{time.time() - t_start:.0f} s]", flush=True)
        for name, calls, us in rows[:args.top]:
            print(f"  {us:9.1f} us  {calls:5.1f}x  {name}", flush=True)

    for shape in shapes:
        label = "x".join(map(str, shape))
        B, T, H, D = shape
        q, k, v, beta, lam, log_decay = make_inputs(*shape)
        beta_col = per_column_gains(beta, D)
        for impl, op, a in (("falcon-1 pallas (ours)", ours_falcon, (q, k, v, beta, lam)),
                            ("falcon-2 per-column pallas (ours)", ours_falcon2, (q, k, v, beta_col, lam)),
                            ("falcon-3 W=4 pallas (ours)", ours_falcon3, (q, k, v, beta, lam)),
                            ("op alone, BTHD in place (ours)", kernel_only_in_place, (q, k, v, beta, log_decay)),
                            ("jla 0.1.0 gated_deltanet", jla_op("gated_deltanet"), (q, k, v, beta, log_decay))):
            if not want(impl):
                continue
            try:
                f, b = fwd_and_bwd(op, len(a))
            except Exception as e:  # noqa: BLE001 - e.g. jla not installed
                print(f"{impl}: {e!r}"[:300], flush=True)
                continue
            for mode, fn in (("fwd", f), ("fwd+bwd", b)):
                try:
                    wall = time_jax(fn, *a)
                except Exception as e:  # noqa: BLE001
                    print(f"{impl} {mode}: {e!r}"[:300], flush=True)
                    continue
                last = {}  # the latest call's outputs: syncing on them waits for every kernel before them

                def run(fn=fn, last=last):
                    last["out"] = fn(*a)

                record(impl, label, mode, run, lambda last=last: jax.block_until_ready(last["out"]), wall)
        if not want("fla 0.6.0 chunk_delta_rule"):
            continue
        try:
            _, fla_fwd, fla_fwd_bwd = fla_delta_rule_calls(B, T, H, D)
        except Exception as e:  # noqa: BLE001
            print(f"fla: {e!r}"[:300], flush=True)
            continue
        for mode, fn in (("fwd", fla_fwd), ("fwd+bwd", fla_fwd_bwd)):
            try:
                wall = time_torch(fn)
            except Exception as e:  # noqa: BLE001
                print(f"fla {mode}: {e!r}"[:300], flush=True)
                continue
            record("fla 0.6.0 chunk_delta_rule", label, mode, fn, torch.cuda.synchronize, wall)
    results["seconds"] = time.time() - t_start
    write_json(args.out, results)
    print(f"done in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
