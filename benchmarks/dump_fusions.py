"""Print the XLA fusions of the whole Falcon-1 op that profile_kernels.py names (run on the GPU).

    python benchmarks/dump_fusions.py [--shape 1x32768x16x128] [--names input_transpose_fusion.1,...] [--out DIR]
                                      [--kernel-config gate_transpose=pallas]

profile_kernels.py reports kernels by XLA's fusion names; this compiles the same jitted ``falcon(variant="1",
impl="pallas")`` forward and forward+backward, writes each optimized HLO module to ``DIR`` and prints the
computations of the fusions named (all fusions larger than ``--min-ops`` instructions when none are named), so
the XLA glue around the kernels can be traced to the lines of ``falcon_jax`` that make it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax

from benchmarks.bench_regression import falcon1_programs


def computations(hlo: str) -> dict[str, str]:
    """{computation name: its text} of an HLO module's text."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name, lines = head.group(1), [line]
        elif name is not None:
            lines.append(line)
            if line == "}":
                out[name] = "\n".join(lines)
                name = None
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1x32768x16x128")
    parser.add_argument("--names", default="", help="comma-separated fusion names (from profile_kernels.py)")
    parser.add_argument("--min-ops", type=int, default=0)
    parser.add_argument("--out", default="fusions")
    parser.add_argument("--kernel-config", default="", help="the op's KernelConfig, e.g. gate_transpose=pallas")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    f, b, operands = falcon1_programs(args.shape, args.kernel_config)
    wanted = [n for n in args.names.split(",") if n]
    for mode, fn in (("fwd", f), ("fwd_bwd", b)):
        hlo = jax.jit(fn).lower(*operands).compile().as_text()
        with open(os.path.join(args.out, f"falcon1_{mode}_{args.shape}.hlo.txt"), "w") as fh:
            fh.write(hlo)
        comps = computations(hlo)
        # the ENTRY's fusion instructions: name -> called computation
        calls = dict(re.findall(r"%?([\w.\-]+) = [^\n]*? fusion\([^\n]*?calls=%?([\w.\-]+)", hlo))
        print(f"== {mode}: {len(calls)} fusions", flush=True)
        for name, called in calls.items():
            body = comps.get(called, "")
            if (wanted and name not in wanted) or (not wanted and body.count("\n") < args.min_ops):
                continue
            line = next((ln.strip() for ln in hlo.splitlines() if re.search(rf"%?{re.escape(name)} = ", ln)), "")
            print(f"-- {name}: {line[:400]}\n{body[:6000]}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
