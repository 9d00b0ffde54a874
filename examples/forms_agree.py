"""Run all six Falcon rules in all three forms and check that the forms agree.

    python examples/forms_agree.py [--T 256] [--dtype float64]

Prints one row per rule: the largest relative difference of the parallel and
chunk forms from the recurrent form (outputs and final state) and the
compiled run time of each form on this machine (one call after compiling).  Exits 1 if any form
disagrees by more than the tolerance of the dtype.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--T", type=int, default=256, help="sequence length")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dk", type=int, default=16)
    parser.add_argument("--dv", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from falcon_jax import VARIANTS, falcon

    tol = 1e-10 if args.dtype == "float64" else 1e-4
    rng = np.random.default_rng(args.seed)
    B, T, H, dk, dv = args.batch, args.T, args.heads, args.dk, args.dv

    def arr(x):
        return jnp.asarray(x, dtype=args.dtype)

    q = arr(rng.normal(size=(B, T, H, dk)) / np.sqrt(dk))
    k = arr(rng.normal(size=(B, T, H, dk)) / np.sqrt(dk))
    v = arr(rng.normal(size=(B, T, H, dv)))
    lam = arr(rng.uniform(0.0, 0.5, size=(B, T, H)))
    print(f"B={B} T={T} H={H} dk={dk} dv={dv} chunk={args.chunk_size} window={args.window} "
          f"dtype={args.dtype} device={jax.devices()[0].platform}")
    print(f"{'rule':>10} | {'parallel vs recurrent':>21} | {'chunk vs recurrent':>18} | "
          f"{'recurrent ms':>12} | {'parallel ms':>11} | {'chunk ms':>8}")
    worst = 0.0
    for variant in VARIANTS:
        beta_shape = (B, T, H, dv) if variant in ("2", "2A") else (B, T, H)
        beta = arr(rng.uniform(0.1, 1.9, size=beta_shape))
        results, times = {}, {}
        for form in ("recurrent", "parallel", "chunk"):
            fn = jax.jit(lambda q, k, v, b, l, form=form: falcon(
                q, k, v, b, l, variant=variant, form=form, chunk_size=args.chunk_size, window=args.window,
                return_final_state=True))
            jax.block_until_ready(fn(q, k, v, beta, lam))  # compile
            start = time.perf_counter()
            results[form] = jax.block_until_ready(fn(q, k, v, beta, lam))
            times[form] = (time.perf_counter() - start) * 1e3

        def rel(a, b):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)  # the state's flags and counters too
            return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30))

        ref_out, ref_state = results["recurrent"]
        # the output and every array of the final state (S, and the key/value window of Falcon-3/3A)
        diffs = {form: max([rel(results[form][0], ref_out)]
                           + [rel(a, b) for a, b in zip(jax.tree.leaves(results[form][1]), jax.tree.leaves(ref_state))])
                 for form in ("parallel", "chunk")}
        worst = max(worst, *diffs.values())
        print(f"{'Falcon-' + variant:>10} | {diffs['parallel']:21.2e} | {diffs['chunk']:18.2e} | "
              f"{times['recurrent']:12.2f} | {times['parallel']:11.2f} | {times['chunk']:8.2f}")
    ok = worst <= tol
    print(f"largest relative difference {worst:.2e} (tolerance {tol:.0e}): {'OK' if ok else 'FORMS DISAGREE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
