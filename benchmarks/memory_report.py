"""Which buffers make the peak of the whole Falcon-1 op's forward+backward (run on the GPU).

    python benchmarks/memory_report.py [--shape 1x32768x16x128] [--kernel-config ...] [--out DIR]

``benchmarks/bench_regression.py`` reports the compiled fwd+bwd's temporary + output bytes; this compiles the
same program with XLA's dumps on (``--xla_dump_to``) and prints the buffers live at the peak (XLA's live-range
dump) with their shapes and the operations that made them, so the peak can be traced to the arrays behind it.
With ``--peer jla`` it does the same for jax-linear-attention's ``gated_deltanet`` (installed from ``.whl``;
``--kernel-config`` is ours only).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1x32768x16x128")
    parser.add_argument("--kernel-config", default="")
    parser.add_argument("--peer", default="", help="'jla': jax-linear-attention gated_deltanet instead of ours")
    parser.add_argument("--out", default="memory_dump")
    parser.add_argument("--lines", type=int, default=60, help="lines of each report section to print")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    # before jax is imported: the dump flags are read when the backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.out}"
                               " --xla_dump_hlo_module_re=.*both.* --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_pass_re=^$").strip()

    from benchmarks.bench_regression import falcon1_programs, fwd_and_bwd, jla_op, make_inputs
    from benchmarks.common import parse_shape

    if args.peer == "jla":
        q, k, v, beta, _, log_decay = make_inputs(*parse_shape(args.shape))
        _, both = fwd_and_bwd(jla_op("gated_deltanet"), 5)
        operands = (q, k, v, beta, log_decay)
    else:
        _, both, operands = falcon1_programs(args.shape, args.kernel_config)
    compiled = both.lower(*operands).compile()
    analysis = compiled.memory_analysis()
    mb = 1e-6
    print(f"{args.peer or 'ours'} {args.shape}: temp {analysis.temp_size_in_bytes * mb:.1f} MB, output "
          f"{analysis.output_size_in_bytes * mb:.1f} MB, arguments {analysis.argument_size_in_bytes * mb:.1f} MB",
          flush=True)
    for path in sorted(glob.glob(os.path.join(args.out, "*both*after_optimizations-live-range.txt"))):
        hlo_path = path.replace("-live-range.txt", ".txt")
        # each instruction's defining line, by name (to print a peak buffer's shape and the op that made it)
        defs = {}
        if os.path.exists(hlo_path):
            for ln in open(hlo_path).read().splitlines():
                head = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", ln)
                if head:
                    defs.setdefault(head.group(1), ln)
        text = open(path).read()
        start = text.find("(peak):")
        if start < 0:
            continue
        print(f"== {os.path.basename(path)}: buffers live at the peak, largest first")
        rows = re.findall(r"^\s+(\S+)\{(\d*)\}: (\d+) bytes", text[start:].split("Stack trace")[0], re.M)
        for name, index, size in sorted(rows, key=lambda r: -int(r[2]))[:args.lines]:
            line = defs.get(name, "")
            shape = line.split(" = ", 1)[1].split(" ", 1)[0][:60] if line else "?"
            op = re.search(r'op_name="([^"]*)"', line)
            print(f"  {int(size) * mb:9.1f} MB  {name}{{{index}}}  {shape}  {op.group(1)[-110:] if op else ''}")
        total = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", text)
        if total:
            print(f"  peak: {int(total.group(1).replace(' ', '')) * mb:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
