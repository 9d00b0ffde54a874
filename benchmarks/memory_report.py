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
            print(f"  {int(size) * mb:9.1f} MB  {name}{{{index}}}  {shape}  {_op_name(line)[-110:]}")
        total = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", text)
        if total:
            print(f"  peak: {int(total.group(1).replace(' ', '')) * mb:.1f} MB")
        assignment = path.replace("-live-range.txt", "-buffer-assignment.txt")
        if os.path.exists(assignment):
            print_temp_layout(open(assignment).read(), text, defs, args.lines)
        else:
            print(f"  (no {os.path.basename(assignment)}: {sorted(os.listdir(args.out))[:20]})")
    return 0


def _op_name(hlo_line: str) -> str:
    """The jax op (``op_name`` metadata) behind an HLO instruction's defining line, or ''."""
    op = re.search(r'op_name="([^"]*)"', hlo_line)
    return op.group(1) if op else ""


def temp_layout(assignment: str, live_range: str):
    """The preallocated temp allocation of an XLA buffer-assignment dump, laid out: ``(size, rows)`` with rows
    ``(offset, size, start, end, name)`` sorted by offset — each value's place in the allocation and its live
    range (instruction positions of the live-range dump; -1 where it has none).  Where the allocation is larger
    than the most temp bytes live at once, the difference is XLA's packing."""
    ranges = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"^\s+([\w.\-]+\{\d*\}):(\d+)-(\d+)$", live_range, re.M)}
    size, rows = 0, []
    for block in re.split(r"^(?=allocation \d+:)", assignment, flags=re.M):
        head = re.match(r"allocation \d+: size (\d+), (?:page \d+, )?preallocated-temp", block)
        if not head:
            continue
        size = int(head.group(1))
        for m in re.finditer(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\)", block):
            name = m.group(1) + (m.group(2) or "{}")
            start, end = ranges.get(name, (-1, -1))
            rows.append((int(m.group(4)), int(m.group(3)), start, end, name))
    return size, sorted(rows)


def live_temp_peak(rows):
    """``(bytes, position)``: the most temp bytes live at one instruction position, from :func:`temp_layout`'s
    rows (values without a live range left out; values aliasing one buffer counted once by offset)."""
    events = sorted({r[2] for r in rows if r[2] >= 0})
    best = (0, -1)
    for t in events:
        spans = {}  # offset -> bytes: values aliasing one buffer (same offset) counted once
        for offset, nbytes, start, end, _ in rows:
            if start <= t <= end:  # XLA's live ranges include both ends
                spans[offset] = max(spans.get(offset, 0), nbytes)
        live = sum(spans.values())
        best = max(best, (live, t))
    return best


def print_temp_layout(assignment, live_range, defs, lines):
    mb = 1e-6
    size, rows = temp_layout(assignment, live_range)
    if not rows:
        heads = re.findall(r"^allocation \d+: size \d+, [^\n]{0,60}", assignment, re.M)
        largest = sorted(heads, key=lambda h: -int(h.split()[3][:-1]))[:5]
        print(f"  (no preallocated-temp allocation; the largest: {largest})")
        return
    peak, at = live_temp_peak(rows)
    print(f"== temp allocation {size * mb:.1f} MB; at most {peak * mb:.1f} MB of it live at once (position {at}): "
          f"{(size - peak) * mb:.1f} MB is packing.  Values of 1 MB or more by offset:")
    print(f"  {'offset MB':>9} {'size MB':>8}  live       value  op")
    shown = 0
    for offset, nbytes, start, end, name in rows:
        if nbytes < 1e6 or shown >= lines:
            continue
        shown += 1
        op = _op_name(defs.get(name.split("{")[0], ""))[-80:]
        print(f"  {offset * mb:9.1f} {nbytes * mb:8.1f}  {start:>4}-{end:<4}  {name}  {op}")


if __name__ == "__main__":
    sys.exit(main())
