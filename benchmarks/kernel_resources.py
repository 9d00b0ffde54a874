"""Registers, spills and shared memory of every Triton kernel in an op's forward+backward — on any machine.

    python benchmarks/kernel_resources.py [--op delta|attention] [--shape 8x2048x16x128] [--kernel-config ...]
                                          [--only NAME] [--out DIR] [--json FILE]

The op (``decayed_delta_rule`` — Falcon-1's kernels — or ``decayed_attention`` — Falcon-1A's — with
``implementation="pallas_gpu"`` on the model's ``[B, T, H, D]`` layout, bf16 tokens, fp32 gates, its value and
gradient) is *cross-lowered* for CUDA, so no GPU is needed.  While lowering, each
``pallas_call``'s Triton IR (TTIR, as text) is kept together with its ``num_warps`` / ``num_stages``; a
standalone Triton (``pip install triton``; the H200 image has 3.6) compiles each module for ``--arch`` and
Triton's own ``ptxas -v`` reports the function's registers, stack frame and spill stores / loads.

XLA compiles these kernels with the Triton it embeds, not this one, so the numbers are the standalone
compiler's — close, not identical (the same TTIR; the passes may differ by a version).  Under jax 0.11.2
Pallas hands XLA the IR (there is no ``triton.compile`` call to wrap, the twelfth session's form), and XLA's
``--xla_dump_to`` writes no PTX of them: this route works on both.  A kernel at 255 registers with spill
stores holds more live tiles than the register file: the first thing to check when it is far from its roofline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager

TRITON_CALL = "__gpu$xla.gpu.triton"


@contextmanager
def captured_triton_modules():
    """Yields a list that fills, while lowering, with ``{name, ttir, num_warps, num_stages}`` per pallas_call."""
    from jax._src.interpreters import mlir
    from jax._src.pallas.triton import lowering

    modules: list[dict] = []
    lower, custom_call = lowering.lower_jaxpr_to_triton_module, mlir.custom_call

    def keep_ttir(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append({"ttir": result.module.operation.get_asm(enable_debug_info=False)})
        return result

    def keep_params(call_target_name, *args, backend_config=None, **kwargs):
        if call_target_name == TRITON_CALL and modules and isinstance(backend_config, dict):
            attr = lambda key: str(backend_config[key]).split(":")[0].strip().strip('"')  # noqa: E731
            modules[-1].update(name=attr("name"), num_warps=int(attr("num_warps")), num_stages=int(attr("num_stages")))
        return custom_call(call_target_name, *args, backend_config=backend_config, **kwargs)

    lowering.lower_jaxpr_to_triton_module, mlir.custom_call = keep_ttir, keep_params
    try:
        yield modules
    finally:
        lowering.lower_jaxpr_to_triton_module, mlir.custom_call = lower, custom_call


def lower_kernels(shape_text: str, config_text: str, op: str = "delta", shifted_keys: bool = False) -> list[dict]:
    """The Triton modules of the value and gradient of Falcon-1's kernels (``op="delta"``) or Falcon-1A's
    (``"attention"``) on ``BxTxHxD``, cross-lowered for CUDA; ``config_text`` names fields of that op's
    KernelConfig; ``shifted_keys``: the delta rule reading its keys one row back in place (as Falcon-1 calls it)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import kernel_config, parse_shape
    from falcon_jax.kernels.decayed_attention.api import KernelConfig as AttentionConfig
    from falcon_jax.kernels.decayed_attention.api import decayed_attention
    from falcon_jax.kernels.decayed_delta_rule.api import decayed_delta_rule

    if op not in ("delta", "attention"):
        raise ValueError(f"op must be 'delta' or 'attention', got {op!r}")
    B, T, H, D = parse_shape(shape_text)
    config = kernel_config(config_text, AttentionConfig if op == "attention" else None)
    tokens = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    gate = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    run = jnp.zeros((B, T, H), jnp.int32)
    s0 = jnp.zeros((B, H, D, D), jnp.float32)

    def loss(q, k, v, *gates):  # (η, log γ) for the delta rule, (log γ,) for attention
        if op == "delta":
            o, s = decayed_delta_rule(q, k, v, *gates, run, s0, implementation="pallas_gpu", interpret=False,
                                      layout="BTHD", config=config, shifted_keys=shifted_keys)
        else:
            o, s = decayed_attention(q, k, v, *gates, run, s0, implementation="pallas_gpu", interpret=False,
                                     layout="BTHD", config=config)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    args = (tokens, tokens, tokens) + (gate,) * (2 if op == "delta" else 1)
    with captured_triton_modules() as modules:
        jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(lowering_platforms=("cuda",))
    return modules


def compile_resources(module: dict, path: str, arch: str) -> dict:
    """Compile one TTIR module with the standalone Triton; ``ptxas -v`` on its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    with open(path, "w") as fh:
        fh.write(module["ttir"])
    cc = int(re.sub(r"\D", "", arch))
    kernel = triton.compile(path, target=GPUTarget("cuda", cc, 32),
                            options=dict(num_warps=module.get("num_warps", 4), num_stages=module.get("num_stages", 1)))
    ptx_path = path.replace(".ttir", ".ptx")
    with open(ptx_path, "w") as fh:
        fh.write(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    proc = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_path, "-o", os.devnull], capture_output=True,
                          text=True, timeout=600)
    text = proc.stderr + proc.stdout
    row = {"registers": None, "stack": 0, "spill_stores": 0, "spill_loads": 0,
           "shared": getattr(kernel.metadata, "shared", None)}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        row.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    m = re.search(r"Used (\d+) registers", text)
    if m:
        row["registers"] = int(m.group(1))
    if proc.returncode != 0:
        row["error"] = text[-400:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", default="delta", choices=("delta", "attention"),
                        help="Falcon-1's kernels (decayed_delta_rule) or Falcon-1A's (decayed_attention)")
    parser.add_argument("--shape", default="8x2048x16x128")
    parser.add_argument("--kernel-config", default="", help="the op's KernelConfig fields, e.g. 'grad_warps=8'")
    parser.add_argument("--only", default="", help="only kernels whose name contains this text")
    parser.add_argument("--shifted-keys", action="store_true",
                        help="the delta rule's kernels reading the keys one row back in place (Falcon-1's call)")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--out", default="kernel_dump", help="folder for each kernel's TTIR and PTX")
    parser.add_argument("--json", default="", help="also write the table here")
    args = parser.parse_args()
    try:
        import triton
    except ImportError:
        print("kernel_resources needs a standalone Triton to compile the captured IR: pip install triton")
        return 1
    os.makedirs(args.out, exist_ok=True)
    try:
        modules = lower_kernels(args.shape, args.kernel_config, args.op, args.shifted_keys)
    except ValueError as err:  # a bad --shape / --kernel-config: the message names it
        print(f"kernel_resources: {err}")
        return 2
    seen, rows = set(), []
    for i, module in enumerate(modules):
        name = module.get("name", f"kernel{i}")
        key = (name, module["ttir"])
        if args.only not in name or key in seen:
            continue
        seen.add(key)
        path = os.path.join(args.out, f"{i:02d}_{name}_w{module.get('num_warps')}_s{module.get('num_stages')}.ttir")
        try:
            row = compile_resources(module, path, args.arch)
        except Exception as err:  # a module this Triton cannot parse: say so, go on with the rest
            row = {"registers": None, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        rows.append({"kernel": name, "num_warps": module.get("num_warps"), "num_stages": module.get("num_stages"),
                     **row})
    keys = ", keys read one row back in place" if args.shifted_keys else ""
    print(f"{args.op} {args.shape} {args.kernel_config or '(default config)'}{keys}: {len(rows)} distinct kernel(s), "
          f"standalone triton {triton.__version__}, {args.arch}")
    print(f"  {'registers':>9} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>7} {'warps':>5}  kernel")
    for r in sorted(rows, key=lambda r: (-r.get("spill_stores", 0), -(r["registers"] or 0))):
        if r["registers"] is None:
            print(f"  {'?':>9} {'':>9} {'':>9} {'':>6} {'':>7} {r['num_warps'] or '':>5}  {r['kernel']}: "
                  f"{r.get('error', '')}")
            continue
        print(f"  {r['registers']:9d} {r['spill_stores']:9d} {r['spill_loads']:9d} {r['stack']:6d} "
              f"{r['shared'] if r['shared'] is not None else '?':>7} {r['num_warps']:5d}  {r['kernel']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"op": args.op, "shape": args.shape, "kernel_config": args.kernel_config, "arch": args.arch,
                       "triton": triton.__version__, "kernels": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
