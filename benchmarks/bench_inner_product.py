"""Benchmark the inner-product rules' chunk form on one GPU; prints a table and writes JSON.

    python benchmarks/bench_inner_product.py [--out bench.json] [--quick]

Rows (bf16, median ms): ours (falcon 1A and 3A through the Pallas kernel — and 2A with per-column
gains through the per-column kernel, at the first shape —, gates and layout included; the kernel
alone; the XLA chunk form), cuDNN causal softmax attention,
jax-linear-attention ``simple_gla`` (impl="mosaic_gpu") and fla ``chunk_simple_gla``
when those packages are importable (optional; install them as wheels on the GPU
machine). Also the HBM floor (q, k, v read and o written once at the measured copy
bandwidth) and the compiled peak memory of fwd+bwd at long T.
"""

from __future__ import annotations

import argparse
import functools
import sys
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import (add_row_filter, compiled_memory, copy_bandwidth_gbs, parsed_kernel_config,
                               print_table, row_filter, time_jax, time_torch, with_kernel_config, write_json)
from falcon_jax import falcon
from falcon_jax.forms import chunk_pallas
from falcon_jax.kernels.decayed_attention import decayed_attention
from falcon_jax.kernels.decayed_attention.api import KernelConfig
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig as RegressionConfig  # the per-column kernel's

SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (1, 32768, 16, 128), (8, 2048, 16, 64)]
MEMORY_SHAPES = [(1, 32768, 16, 128), (1, 131072, 16, 128)]


def make_inputs(B, T, H, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = (jax.random.normal(keys[0], (B, T, H, D)) / D**0.5).astype(jnp.bfloat16)
    k = (jax.random.normal(keys[1], (B, T, H, D)) / D**0.5).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D)).astype(jnp.bfloat16)
    beta = jax.random.uniform(keys[3], (B, T, H), minval=0.1, maxval=1.9)
    lam = jax.random.uniform(keys[4], (B, T, H), maxval=0.05)
    log_decay = -jax.random.uniform(keys[5], (B, T, H), minval=0.001, maxval=0.1)
    return q, k, v, beta, lam, log_decay


def fwd_and_bwd(op, n_diff):
    """(fwd, fwd+bwd) jitted callables for op(*args) -> array."""
    fwd = jax.jit(op)

    def both(*args):
        out, vjp = jax.vjp(lambda *d: op(*d, *args[n_diff:]), *args[:n_diff])
        return vjp(jnp.ones_like(out))

    return fwd, jax.jit(both)


def ours_falcon(variant):
    return lambda q, k, v, beta, lam: falcon(q, k, v, beta, lam, variant=variant, impl="pallas")


def ours_falcon_head_major(variant):
    """``falcon`` with the kernels on [B, H, T, D] copies (the layout before in-place [B, T, H, D] reads)."""
    from falcon_jax.forms import chunk_pallas

    def op(q, k, v, beta, lam):
        chunk_pallas.PREFER_TIME_MAJOR = False  # read while tracing; restored right after
        try:
            return falcon(q, k, v, beta, lam, variant=variant, impl="pallas")
        finally:
            chunk_pallas.PREFER_TIME_MAJOR = True
    return op


def ours_xla(q, k, v, beta, lam):
    return falcon(q, k, v, beta, lam, variant="1A", impl="xla")


def kernel_only(q, k, v, log_decay, config=None, chunk_size=64, implementation="pallas_gpu"):
    B, T, H, _ = q.shape
    tr = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  (the kernel's [B, H, T, D] layout)
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, q.shape[-1], v.shape[-1]), jnp.float32)
    return decayed_attention(tr(q), tr(k), tr(v), tr(log_decay), run, s0, implementation=implementation,
                             config=config, chunk_size=chunk_size)[0]


kernel_only_mosaic = functools.partial(kernel_only, implementation="mosaic_gpu")


def kernel_only_in_place(q, k, v, log_decay, config=None, chunk_size=64):
    """The op on the model's [B, T, H, D] layout, read and written in place (layout="BTHD")."""
    B, T, H, _ = q.shape
    run = jnp.zeros((B, T, H), jnp.int32)
    s0 = jnp.zeros((B, H, q.shape[-1], v.shape[-1]), jnp.float32)
    return decayed_attention(q, k, v, log_decay, run, s0, implementation="pallas_gpu", config=config,
                             chunk_size=chunk_size, layout="BTHD")[0]


TUNE_CONFIGS = [
    dict(chunk_size=64, config=KernelConfig()),  # the default (target_programs=128 since the fourth H200 run)
    dict(chunk_size=64, config=KernelConfig(block_v=128)),
    dict(chunk_size=64, config=KernelConfig(fwd_warps=8, state_warps=8, grad_warps=8)),
    dict(chunk_size=128, config=KernelConfig(fwd_warps=8, state_warps=8, grad_warps=8)),
    dict(chunk_size=32, config=KernelConfig()),
    # the piece count: 264 was the default until the fourth run, where 128 beat it at both shapes and 64 tied
    # at 8x2048 but lost at 1x32768; 528 was slower than 264 at every shape (first run)
    dict(chunk_size=64, config=KernelConfig(target_programs=264)),
    dict(chunk_size=64, config=KernelConfig(target_programs=64)),
    # the chunk gradients' value loop as a lax.fori_loop at 1 and 2 stages (next43, with dy before the value sums:
    # 1.157 and 1.140 ms fwd+bwd at 8x2048 vs 1.258 unrolled; the sums come first again now: next49)
    dict(chunk_size=64, config=KernelConfig(grad_loops="fori")),
    dict(chunk_size=64, config=KernelConfig(grad_loops="fori", grad_stages=2)),
]


def tune(out_path: str, shapes=None, configs=None) -> None:
    """Time the kernel alone (fwd, fwd+bwd) for each launch configuration (or those numbered in ``configs``) at
    every shape."""
    import functools

    rows = []
    for shape in shapes or SHAPES:
        q, k, v, _, _, log_decay = make_inputs(*shape)
        for i, cfg in enumerate(TUNE_CONFIGS):
            if configs is not None and i not in configs:
                continue
            op = functools.partial(kernel_only, **cfg)
            f, b = fwd_and_bwd(op, 4)
            row = {"shape": "x".join(map(str, shape)), "config": i, "chunk": cfg["chunk_size"], **dataclasses_asdict(cfg["config"])}
            for key, fn in (("fwd_ms", f), ("fwd_bwd_ms", b)):
                try:
                    row[key] = time_jax(fn, q, k, v, log_decay, calls=10, repeats=5)
                except Exception as e:  # noqa: BLE001
                    row[key] = None
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
            write_json(out_path, rows)  # after every row: a run cut off by its time limit keeps what it measured
    print_table(rows, ["shape", "config", "chunk", "block_v", "fwd_warps", "fwd_stages", "target_programs", "fwd_ms", "fwd_bwd_ms"])
    write_json(out_path, rows)


def dataclasses_asdict(c):
    import dataclasses

    return dataclasses.asdict(c)


def cudnn_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def jla_simple_gla(q, k, v, log_decay):
    import jla.ops

    return jla.ops.linear_attention("simple_gla", q, k, v, g=log_decay, impl="mosaic_gpu")[0]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_inner_product.json")
    parser.add_argument("--quick", action="store_true", help="first shape only")
    parser.add_argument("--kernel-config", default="", help="falcon(impl='pallas')'s inner-product kernels on this "
                        "decayed_attention KernelConfig for the whole-op rows, e.g. 'grad_loops=unrolled,grad_stages=1'")
    add_row_filter(parser, rows_note=", the memory rows only if one is 'memory'")
    parser.add_argument("--memory-only", action="store_true", help="only the compiled peak memory rows")
    parser.add_argument("--mosaic", action="store_true", help="also time the Mosaic GPU forward (its compile did "
                        "not finish within 75 s on the H200 under jax 0.11.2, so it is opt-in)")
    parser.add_argument("--tune", action="store_true", help="time launch configurations of the kernel, then stop")
    parser.add_argument("--tune-configs", default="", help="with --tune: comma-separated indices into TUNE_CONFIGS "
                        "(default: all)")
    args = parser.parse_args()
    if args.tune:  # with --quick: the first shape and the last shape only
        try:
            configs = {int(i) for i in args.tune_configs.split(",")} if args.tune_configs.strip() else None
        except ValueError:
            parser.error(f"--tune-configs: expected comma-separated indices into TUNE_CONFIGS (0-"
                         f"{len(TUNE_CONFIGS) - 1}), got {args.tune_configs!r}")
        bad = sorted(i for i in configs or () if not 0 <= i < len(TUNE_CONFIGS))
        if bad:
            parser.error(f"--tune-configs: index {bad[0]} is outside TUNE_CONFIGS (0-{len(TUNE_CONFIGS) - 1})")
        tune(args.out, [SHAPES[0], SHAPES[2]] if args.quick else None, configs)
        return 0
    bw = copy_bandwidth_gbs()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bw:.0f} GB/s", flush=True)
    rows, errors, memory = [], {}, []

    def save():  # after every result, so a run cut off by its time limit keeps what it measured
        write_json(args.out, {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_GBps": bw,
                              "dtype": "bfloat16", "rows": rows, "memory": memory, "errors": errors})

    chunk_pallas.ATTENTION_KERNEL_CONFIG = parsed_kernel_config(parser, args.kernel_config, KernelConfig)
    wanted = row_filter(args)

    def measure(name, shape, fn_fwd, fn_both, fwd_args, both_args):
        row = {"impl": name, "shape": "x".join(map(str, shape))}
        if not wanted(name):
            return row
        for key, fn, a in (("fwd_ms", fn_fwd, fwd_args), ("fwd_bwd_ms", fn_both, both_args)):
            if fn is None:
                continue
            try:
                row[key] = time_jax(fn, *a)
            except Exception as e:  # noqa: BLE001 - record and continue
                errors[f"{name} {row['shape']} {key}"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=2)
        rows.append(row)
        print(row, flush=True)
        save()
        return row

    for shape in [] if args.memory_only else SHAPES[:1] if args.quick else SHAPES:
        B, T, H, D = shape
        q, k, v, beta, lam, log_decay = make_inputs(*shape)
        floor = 4 * q.nbytes / (bw * 1e9) * 1e3
        rows.append({"impl": "HBM floor", "shape": "x".join(map(str, shape)), "fwd_ms": floor})
        for variant in ("1A", "3A"):
            f, b = fwd_and_bwd(ours_falcon(variant), 5)
            measure(f"falcon-{variant} pallas", shape, f, b, (q, k, v, beta, lam), (q, k, v, beta, lam))
            f, b = fwd_and_bwd(ours_falcon_head_major(variant), 5)
            measure(f"falcon-{variant} pallas, head-major", shape, f, b, (q, k, v, beta, lam), (q, k, v, beta, lam))
        if shape == SHAPES[0]:  # Falcon-2A: per-column gains, the per-column kernel without the residual
            try:
                beta_col = beta[..., None] * jnp.linspace(0.5, 1.0, D)  # [B, T, H, D], differs per column
                f, b = fwd_and_bwd(ours_falcon("2A"), 5)
                measure("falcon-2A pallas (per-column)", shape, f, b, (q, k, v, beta_col, lam),
                        (q, k, v, beta_col, lam))
                f, b = fwd_and_bwd(with_kernel_config(ours_falcon("2A"), RegressionConfig(column_solve="rows")), 5)
                measure("falcon-2A pallas (per-column), row-by-row solve", shape, f, b, (q, k, v, beta_col, lam),
                        (q, k, v, beta_col, lam))
            except Exception as e:  # noqa: BLE001
                errors[f"falcon-2A {shape}"] = repr(e)[:300]
        f, b = fwd_and_bwd(kernel_only, 4)
        measure("kernel only (decayed_attention)", shape, f, b, (q, k, v, log_decay), (q, k, v, log_decay))
        f, b = fwd_and_bwd(kernel_only_in_place, 4)
        measure("kernel only, BTHD in place", shape, f, b, (q, k, v, log_decay), (q, k, v, log_decay))
        try:  # Mosaic GPU forward (wgmma + TMA), Triton backward; not yet the default
            if not args.mosaic:
                raise NotImplementedError("not requested (--mosaic)")
            f, b = fwd_and_bwd(kernel_only_mosaic, 4)
            measure("kernel only mosaic_gpu fwd", shape, f, b, (q, k, v, log_decay), (q, k, v, log_decay))
        except Exception as e:  # noqa: BLE001
            errors[f"mosaic_gpu {shape}"] = repr(e)[:300]
        f, b = fwd_and_bwd(ours_xla, 5)
        measure("falcon-1A xla chunk", shape, f, b, (q, k, v, beta, lam), (q, k, v, beta, lam))
        f, b = fwd_and_bwd(cudnn_attention, 3)
        measure("cuDNN causal softmax", shape, f, b, (q, k, v), (q, k, v))
        try:
            f, b = fwd_and_bwd(jla_simple_gla, 4)
            measure("jla 0.1.0 simple_gla mosaic_gpu", shape, f, b, (q, k, v, log_decay), (q, k, v, log_decay))
        except Exception as e:  # noqa: BLE001
            errors[f"jla {shape}"] = repr(e)[:300]
        try:
            if not wanted("fla 0.6.0 chunk_simple_gla"):
                raise NotImplementedError("not requested (--rows / --skip)")
            import torch
            from fla.ops.simple_gla import chunk_simple_gla

            tq, tk, tv = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) / (D**0.5 if i < 2 else 1)
                          for i in range(3))
            tg = -torch.rand(B, T, H, device="cuda", dtype=torch.float32) * 0.1
            row = {"impl": "fla 0.6.0 chunk_simple_gla", "shape": "x".join(map(str, shape))}
            row["fwd_ms"] = time_torch(lambda: chunk_simple_gla(tq, tk, tv, g=tg))
            try:
                tq.requires_grad_(True)
                o, _ = chunk_simple_gla(tq, tk, tv, g=tg)
                o.sum().backward()
            except Exception as e:  # noqa: BLE001
                errors[f"fla bwd {shape}"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
            save()
        except Exception as e:  # noqa: BLE001
            errors[f"fla {shape}"] = repr(e)[:300]

    # memory after the timings: its compiles at T = 131072 are the slowest part
    for shape in MEMORY_SHAPES if args.memory_only else [] if args.quick or not wanted("memory") else MEMORY_SHAPES:
        q, k, v, beta, lam, log_decay = make_inputs(*shape)
        _, b = fwd_and_bwd(ours_falcon("1A"), 5)
        entry = {"shape": "x".join(map(str, shape)), "falcon-1A pallas fwd+bwd bytes": compiled_memory(b, q, k, v, beta, lam)}
        _, b = fwd_and_bwd(kernel_only, 4)
        entry["kernel only fwd+bwd bytes"] = compiled_memory(b, q, k, v, log_decay)
        _, b = fwd_and_bwd(kernel_only_in_place, 4)
        entry["kernel only BTHD in place fwd+bwd bytes"] = compiled_memory(b, q, k, v, log_decay)
        try:
            _, b = fwd_and_bwd(jla_simple_gla, 4)
            entry["jla simple_gla fwd+bwd bytes"] = compiled_memory(b, q, k, v, log_decay)
        except Exception as e:  # noqa: BLE001
            errors[f"jla memory {shape}"] = repr(e)[:300]
        memory.append(entry)
        print(entry, flush=True)
        save()

    print()
    print_table(rows, ["shape", "impl", "fwd_ms", "fwd_bwd_ms"])
    save()
    if errors:
        print("errors:", errors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
