"""Registers, spills and shared memory of every GPU kernel in the whole Falcon-1 op's forward+backward.

    python benchmarks/kernel_resources.py [--shape 8x2048x16x128] [--kernel-config ...] [--out DIR]

Under jaxlib > 0.10.2 Pallas compiles each Triton kernel itself (``jax._src.lib.triton.compile``) while
lowering; this wraps that call to keep every kernel's PTX, and ``ptxas -v`` (the CUDA toolkit's, else
Triton's) reports each function's registers, stack frame and spill stores / loads for sm_90a.  (XLA's
``--xla_dump_to`` does not write these kernels' PTX: tried in the twelfth run.)  A kernel that spills (or runs
at 255 registers) holds more live tiles than the register file: the first thing to check when a kernel is far
from its memory or MMA roofline.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def ptxas_binary() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def resources(ptxas: str, ptx_path: str, arch: str) -> list[dict]:
    """[{function, registers, stack, spill_stores, spill_loads, shared}] from ``ptxas -v`` on one PTX file."""
    proc = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_path, "-o", os.devnull], capture_output=True,
                          text=True, timeout=300)
    out, current = [], None
    for line in (proc.stderr + proc.stdout).splitlines():
        m = re.search(r"Compiling entry function '([^']+)'|Function properties for (\S+)", line)
        if m:
            name = m.group(1) or m.group(2)
            if current is None or current["function"] != name:
                current = {"function": name}
                out.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            shared = re.search(r"(\d+) bytes smem", line)
            current["shared"] = int(shared.group(1)) if shared else 0
    if proc.returncode != 0:
        print(f"  ptxas failed on {os.path.basename(ptx_path)}: {proc.stderr[-500:]}", flush=True)
    return [r for r in out if "registers" in r]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8x2048x16x128")
    parser.add_argument("--kernel-config", default="")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--out", default="kernel_dump")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from jax._src.pallas.triton import pallas_call_registration as registration

    from benchmarks.bench_regression import falcon1_programs

    compile_kernel = getattr(getattr(registration, "triton", None), "compile", None)
    if compile_kernel is None:
        print("this jax's Pallas Triton registration has no triton.compile to wrap; nothing to report")
        return 1
    files = []

    def keep_ptx(platform, module, arch, **kw):
        result = compile_kernel(platform, module, arch, **kw)
        asm = result.asm.decode() if isinstance(result.asm, bytes) else str(result.asm)
        entry = re.search(r"\.entry\s+(\w+)", asm)
        name = entry.group(1) if entry else f"kernel{len(files)}"
        path = os.path.join(args.out, f"{len(files):03d}_{name}_w{kw.get('num_warps')}_s{kw.get('num_stages')}.ptx")
        with open(path, "w") as fh:
            fh.write(asm)
        files.append(path)
        return result

    registration.triton.compile = keep_ptx
    _, both, operands = falcon1_programs(args.shape, args.kernel_config)
    both.lower(*operands)
    ptxas = ptxas_binary()
    print(f"{args.shape}: {len(files)} kernel(s) compiled while lowering, ptxas {ptxas}", flush=True)
    if not files:
        print("  none: this jaxlib hands the kernels to XLA uncompiled (jaxlib <= 0.10.2)")
        return 1
    if ptxas is None:
        print("  no ptxas found (CUDA toolkit or Triton)")
        return 1
    rows = [(path, r) for path in files for r in resources(ptxas, path, args.arch)]
    print(f"  {'registers':>9} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>7}  function")
    for path, r in sorted(rows, key=lambda pr: (-pr[1].get("spill_stores", 0), -pr[1]["registers"])):
        print(f"  {r['registers']:9d} {r.get('spill_stores', 0):9d} {r.get('spill_loads', 0):9d} "
              f"{r.get('stack', 0):6d} {r['shared']:7d}  {os.path.basename(path)[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
