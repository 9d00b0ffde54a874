"""Falcon-3's window statistic λmax(X_t X_tᵀ) on the GPU: ``jnp.linalg.eigh`` against the elementwise Jacobi solve.

    python benchmarks/probe_lambda_max.py [--shape 8x2048x16x128] [--windows 2,4,8] [--out probe.json]

``falcon_gates`` takes Falcon-3's energy as the top eigenvalue of each step's ``W × W`` window Gram
(``rules.window_lambda_max``).  Its eigenvector came from a batched ``eigh`` (on a GPU a solver call over
``B·T·H`` tiny matrices); ``rules.top_eigenvector_jacobi`` does it with Jacobi rotations that XLA fuses.
This times, for both: the statistic alone (forward, and forward+backward w.r.t. the window's keys), and the
whole Falcon-3 op (``falcon(variant="3", window=W, impl="pallas")``, bf16 q/k/v) — and checks the two
statistics agree with each other and with float64 ``numpy.linalg.eigvalsh`` on the host.  The choice is
``rules.JACOBI_MAX_WINDOW`` (0 forces eigh), read while tracing.  The Gram is ``rules.window_gram`` (a product
and a sum); ``--gram dot`` times the statistic alone on the batched fp32 dot ``falcon_gates`` used before.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_regression import fwd_and_bwd, make_inputs
from benchmarks.common import parse_shape, print_table, time_jax, write_json
from falcon_jax import falcon, rules


def energy(x_win, gram_kind="elementwise"):
    """λmax of each window's Gram, as falcon_gates forms it (``rules.window_gram``, or with ``gram_kind="dot"``
    the full-precision batched dot it used before)."""
    if gram_kind == "dot":
        return rules.window_lambda_max(x_win, gram_fn=lambda x: jnp.einsum("...ik,...jk->...ij", x, x,
                                                                            precision=jax.lax.Precision.HIGHEST))
    return rules.window_lambda_max(x_win)


def with_method(method, fn):
    """``fn`` traced with the λmax method set (``rules.JACOBI_MAX_WINDOW`` is read while tracing)."""
    def run(*args):
        saved = rules.JACOBI_MAX_WINDOW
        rules.JACOBI_MAX_WINDOW = 0 if method == "eigh" else 16
        try:
            return fn(*args)
        finally:
            rules.JACOBI_MAX_WINDOW = saved
    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8x2048x16x128")
    parser.add_argument("--windows", default="2,4,8")
    parser.add_argument("--skip-op", action="store_true", help="time the statistic only")
    parser.add_argument("--gram", default="elementwise", choices=("elementwise", "dot"),
                        help="the statistic alone on rules.window_gram (falcon_gates' Gram) or on a batched dot")
    parser.add_argument("--out", default="probe_lambda_max.json")
    args = parser.parse_args()
    statistic = functools.partial(energy, gram_kind=args.gram)
    B, T, H, D = parse_shape(args.shape)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": args.shape, "gram": args.gram,
               "rows": []}
    start = time.time()
    for W in (int(w) for w in args.windows.split(",") if w):
        x_win = jax.random.normal(jax.random.key(W), (B, T, H, W, D)).astype(jnp.bfloat16)
        values = {}
        for method in ("eigh", "jacobi"):
            f = jax.jit(with_method(method, statistic))
            fb = jax.jit(with_method(method, jax.grad(lambda x: jnp.sum(statistic(x)))))
            t0 = time.time()
            values[method] = np.asarray(f(x_win))
            compile_s = time.time() - t0
            row = {"what": f"lambda_max alone, W={W}", "method": method, "fwd_ms": time_jax(f, x_win),
                   "fwd_bwd_ms": time_jax(fb, x_win), "first_call_s": compile_s}
            results["rows"].append(row)
            print(row, f"[{time.time() - start:.0f} s]", flush=True)
        sample = np.asarray(x_win[0, :64].astype(jnp.float32), np.float64)  # [64, H, W, D] on the host
        ref = np.linalg.eigvalsh(np.einsum("...ik,...jk->...ij", sample, sample))[..., -1]
        err = {m: float(np.max(np.abs(values[m][0, :64] - ref) / ref)) for m in values}
        agree = float(np.max(np.abs(values["jacobi"] - values["eigh"]) / np.abs(values["eigh"])))
        check = {"what": f"lambda_max values, W={W}", "rel err vs float64 (64 steps)": err,
                 "jacobi vs eigh (all steps)": agree, "ok": max(err.values()) < 1e-5 and agree < 1e-5}
        results["rows"].append(check)
        print(check, flush=True)
        if args.skip_op:
            continue
        q, k, v, beta, lam, _ = make_inputs(B, T, H, D)
        for method in ("eigh", "jacobi"):
            op = with_method(method, lambda q, k, v, beta, lam, W=W: falcon(q, k, v, beta, lam, variant="3", window=W,
                                                                             impl="pallas"))
            f, fb = fwd_and_bwd(op, 5)
            row = {"what": f"falcon-3 W={W} whole op", "method": method,
                   "fwd_ms": time_jax(f, q, k, v, beta, lam), "fwd_bwd_ms": time_jax(fb, q, k, v, beta, lam)}
            results["rows"].append(row)
            print(row, f"[{time.time() - start:.0f} s]", flush=True)
        write_json(args.out, results)
    print_table([r for r in results["rows"] if "method" in r], ["what", "method", "fwd_ms", "fwd_bwd_ms"])
    results["seconds"] = time.time() - start
    write_json(args.out, results)
    ok = all(r["ok"] for r in results["rows"] if "ok" in r)
    print("ALL PASS" if ok else "FAIL", f"done in {results['seconds']:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
