"""The whole Falcon-1 op's forward+backward, compiled, then run ``--calls`` times: the program
``h200_run.sh`` hands to Nsight Compute (``ncu -k regex:<kernel>``) for one kernel's registers, occupancy,
throughput and stall reasons.

    python benchmarks/ncu_op.py [--shape 8x2048x16x128] [--kernel-config ...] [--calls 2]
"""

from __future__ import annotations

import argparse
import sys

import jax

from benchmarks.bench_regression import falcon1_programs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8x2048x16x128")
    parser.add_argument("--kernel-config", default="")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    _, both, operands = falcon1_programs(args.shape, args.kernel_config)
    for _ in range(args.calls):
        jax.block_until_ready(both(*operands))
    print(f"ran {args.calls} calls at {args.shape}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
