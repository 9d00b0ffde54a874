"""The whole Falcon-1 op's forward+backward, compiled, then run ``--calls`` times: the program
``h200_run.sh`` hands to Nsight Compute (``ncu -k regex:<kernel>``) for one kernel's registers, occupancy,
throughput and stall reasons.

    python benchmarks/ncu_op.py [--shape 8x2048x16x128] [--kernel-config ...] [--calls 2]
"""

from __future__ import annotations

import argparse
import sys

import jax

from benchmarks.bench_regression import fwd_and_bwd, make_inputs, ours_falcon
from benchmarks.common import kernel_config
from falcon_jax.forms import chunk_pallas


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8x2048x16x128")
    parser.add_argument("--kernel-config", default="")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    chunk_pallas.KERNEL_CONFIG = kernel_config(args.kernel_config)
    q, k, v, beta, lam, _ = make_inputs(*(int(n) for n in args.shape.split("x")))
    _, both = fwd_and_bwd(ours_falcon, 5)
    for _ in range(args.calls):
        jax.block_until_ready(both(q, k, v, beta, lam))
    print(f"ran {args.calls} calls at {args.shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
