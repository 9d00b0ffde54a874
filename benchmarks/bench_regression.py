"""Benchmark the regression rule (Falcon-1) on one GPU; prints a table and writes JSON.

    python benchmarks/bench_regression.py [--out bench_regression.json] [--quick] [--smoke]

Rows (bf16, H = 16, d = 128, median ms, fwd and fwd+bwd): ours — falcon(variant="1") through
the Pallas kernel (gates and layout included), the kernel op alone (``decayed_delta_rule``),
the XLA chunk form, and at the first shape falcon(variant="2") with per-column gains (the
per-column kernel) and falcon(variant="3", window=4) (the windowed kernel) —; peers when importable — jax-linear-attention 0.1.0 ``gated_deltanet``
and ``deltanet`` (impl="mosaic_gpu"), fla ``chunk_gated_delta_rule`` (forward only: its gated
backward refuses Triton < 3.7.1 on Hopper) and ``chunk_delta_rule`` (fwd+bwd).  The
``x ours`` columns are each row's time over falcon-1 Pallas's at the same shape (> 1: slower
than ours).  Also the compiled peak memory of fwd+bwd at 1×32768 and 1×131072.  A failing
row prints its error and the script goes on.  ``--smoke``: tiny shapes, our kernels in
interpret mode (any machine; a crash test of the script).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import (add_row_filter, compiled_memory, kernel_config, parse_shape, parsed_kernel_config,
                               print_table, row_filter, time_jax, time_torch, with_kernel_config, write_json)
from falcon_jax import falcon
from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig

SHAPES = [(8, 2048, 16, 128), (2, 8192, 16, 128), (1, 32768, 16, 128)]
MEMORY_SHAPES = [(1, 32768, 16, 128), (1, 131072, 16, 128)]
SMOKE_SHAPES = [(1, 64, 2, 16)]
SMOKE_MEMORY_SHAPES = [(1, 128, 2, 16)]


def make_inputs(B, T, H, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = (jax.random.normal(keys[0], (B, T, H, D)) / D**0.5).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)  # unit keys (delta-rule peers)
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


def ours_falcon(q, k, v, beta, lam):
    return falcon(q, k, v, beta, lam, variant="1", impl="pallas")


def falcon1_programs(shape_text: str, config_text: str = ""):
    """The diagnostic scripts' program: ``(fwd, fwd+bwd, operands)`` of the whole Falcon-1 op (``ours_falcon``)
    on a ``"BxTxHxD"`` shape, with ``falcon(impl="pallas")``'s kernels on the ``--kernel-config`` text (set for
    the rest of the process)."""
    from falcon_jax.forms import chunk_pallas

    chunk_pallas.KERNEL_CONFIG = kernel_config(config_text)
    q, k, v, beta, lam, _ = make_inputs(*parse_shape(shape_text))
    fwd, both = fwd_and_bwd(ours_falcon, 5)
    return fwd, both, (q, k, v, beta, lam)


def per_column_gains(beta, dv):
    """Falcon-2's per-column gains ``[B, T, H, dv]`` from scalar ones: β scaled by 0.9…1.1 across the columns,
    so that the gains differ per column."""
    return beta[..., None] * jnp.linspace(0.9, 1.1, dv, dtype=beta.dtype)


def ours_falcon2(q, k, v, beta, lam):
    """Falcon-2 with per-column gains (β [B, T, H, D]: the per-column kernel)."""
    return falcon(q, k, v, beta, lam, variant="2", impl="pallas")


def ours_falcon3(q, k, v, beta, lam):
    """Falcon-3, window 4 (the windowed kernel: 4 virtual writes per step, 16 steps per 64-row chunk)."""
    return falcon(q, k, v, beta, lam, variant="3", window=4, impl="pallas")


def ours_xla(q, k, v, beta, lam):
    return falcon(q, k, v, beta, lam, variant="1", impl="xla")


def kernel_only(q, k, v, beta, log_decay, chunk_size=64, config=None):
    """The op on the same stream as the peers (x = k, η = β, a = log γ), [B, H, T, D] layout."""
    B, T, H, _ = q.shape
    tr = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    run = jnp.zeros((B, H, T), jnp.int32)
    s0 = jnp.zeros((B, H, q.shape[-1], v.shape[-1]), jnp.float32)
    return decayed_delta_rule(tr(q), tr(k), tr(v), tr(beta), tr(log_decay), run, s0, implementation="pallas_gpu",
                              chunk_size=chunk_size, config=config)[0]


def kernel_only_in_place(q, k, v, beta, log_decay, chunk_size=64, config=None):
    """The same op on the model's [B, T, H, D] layout, read and written in place (layout="BTHD")."""
    B, T, H, _ = q.shape
    run = jnp.zeros((B, T, H), jnp.int32)
    s0 = jnp.zeros((B, H, q.shape[-1], v.shape[-1]), jnp.float32)
    return decayed_delta_rule(q, k, v, beta, log_decay, run, s0, implementation="pallas_gpu",
                              chunk_size=chunk_size, config=config, layout="BTHD")[0]


# launch and pass variants timed alongside the default (since the ninth H200 run: the chunk gradients from the P
# and dR the walks store; since the eighth: the split state-gradient walk on the GPU, the split forward below 128
# fused-walk programs; bf16 walk operands and a one-warp triangular inverse since the seventh)
FUSED = dict(outputs="pallas", state_grads="pallas")
VARIANTS = {
    "kernel only, seventh-run default (fused walks, XLA chunk gradients)":
        dict(config=KernelConfig(chunk_grads="xla", tri_dtype="fp32", **FUSED)),
    "kernel only, sixth-run default (fp32 walk operands, fused walks, Pallas chunk gradients)":
        dict(config=KernelConfig(walk_operands="fp32", tri_dtype="fp32", chunk_grads="pallas", **FUSED)),
    "kernel only, fp32 walk operands": dict(config=KernelConfig(walk_operands="fp32")),
    "kernel only, one-program Pallas chunk gradients": dict(config=KernelConfig(chunk_grads="pallas")),
    "kernel only, chunk gradients as XLA matmuls": dict(config=KernelConfig(chunk_grads="xla")),
    # the eighth run's default: the two-program chunk gradients forming P and dR again from T
    "kernel only, eighth-run default (two-program chunk gradients)":
        dict(config=KernelConfig(chunk_grads="pallas_split", tri_dtype="fp32")),
    "kernel only, stored-P/dR chunk gradients 64 key columns": dict(config=KernelConfig(grad_block_k=64)),
    "kernel only, stored-P/dR chunk gradients fp32 dR": dict(config=KernelConfig(stored_dr="fp32")),
    "kernel only, stored-P/dR chunk gradients fp32 dR, 64 key columns":
        dict(config=KernelConfig(stored_dr="fp32", grad_block_k=64)),
    "kernel only, outputs in XLA": dict(config=KernelConfig(outputs="xla")),
    "kernel only, split forward at every shape": dict(config=KernelConfig(outputs="split")),
    "kernel only, fused forward at every shape": dict(config=KernelConfig(outputs="pallas")),
    "kernel only, fused state-gradient walk": dict(config=KernelConfig(state_grads="pallas")),
    "kernel only, split walks 32 columns": dict(config=KernelConfig(split_block_v=32)),
    "kernel only, 64 value columns": dict(config=KernelConfig(block_v=64)),
    "kernel only, C=32": dict(chunk_size=32),
    "kernel only, triangular inverse 4 warps": dict(config=KernelConfig(tri_warps=4)),  # the default until run 7
    "kernel only, triangular inverse 2 warps": dict(config=KernelConfig(tri_warps=2)),
    "kernel only, Pallas chunk gradients 8 warps": dict(config=KernelConfig(grad_warps=8)),
    # the stored-P/dR chunk gradients, the largest pass in the eleventh run's profile (966 us at 8x2048)
    "kernel only, chunk gradients 1 stage": dict(config=KernelConfig(grad_stages=1)),
    "kernel only, chunk gradients 16 key columns": dict(config=KernelConfig(grad_block_k=16)),
    "kernel only, chunk gradients 8 warps, 64 key columns": dict(config=KernelConfig(grad_warps=8, grad_block_k=64)),
    "kernel only, chunk gradients 2 warps": dict(config=KernelConfig(grad_warps=2)),
    # twelfth session: the same kernel as two programs per chunk (value sums through memory, then key columns)
    "kernel only, chunk gradients stored split": dict(config=KernelConfig(chunk_grads="pallas_stored_split")),
    "kernel only, chunk gradients stored split, 64 key columns":
        dict(config=KernelConfig(chunk_grads="pallas_stored_split", grad_block_k=64)),
    "kernel only, chunk gradients stored split, 8 warps":
        dict(config=KernelConfig(chunk_grads="pallas_stored_split", grad_warps=8)),
    "kernel only, state walk 8 warps": dict(config=KernelConfig(state_warps=8)),
    "kernel only, state walk 2 warps": dict(config=KernelConfig(state_warps=2)),
    "kernel only, forward walk 2 warps": dict(config=KernelConfig(fwd_warps=2)),
    # how far to cut the sequence into pieces when batch·heads·value blocks leave the GPU idle
    "kernel only, no pieces": dict(config=KernelConfig(target_programs=1)),
    "kernel only, pieces to 128 programs": dict(config=KernelConfig(target_programs=128)),
    "kernel only, pieces to 256 programs": dict(config=KernelConfig(target_programs=256)),
    "kernel only, walks 8 warps": dict(config=KernelConfig(fwd_warps=8, state_warps=8)),
    "kernel only, walks 1 stage": dict(config=KernelConfig(fwd_stages=1, state_stages=1)),
    "kernel only, walks 2 stages": dict(config=KernelConfig(fwd_stages=2, state_stages=2)),
    "kernel only, walks 3 stages": dict(config=KernelConfig(fwd_stages=3, state_stages=3)),
    # tenth run: T = (I + A)⁻¹ stored in bf16 (the default since; its dots bf16 MMA) or fp32, longer chunks,
    # 16-column walks at long T
    "kernel only, ninth-run default (fp32 triangular inverse)": dict(config=KernelConfig(tri_dtype="fp32")),
    "kernel only, C=128": dict(chunk_size=128),
    "kernel only, C=128, fp32 triangular inverse": dict(chunk_size=128, config=KernelConfig(tri_dtype="fp32")),
    "kernel only, 16 value columns": dict(config=KernelConfig(block_v=16)),
    "kernel only, 16 value columns, fp32 triangular inverse": dict(config=KernelConfig(tri_dtype="fp32", block_v=16)),
    # prepared in the tenth session, not yet timed: V in bf16, the forward's T kept for the backward
    "kernel only, bf16 V": dict(config=KernelConfig(stored_v="input")),
    "kernel only, saved inverse": dict(config=KernelConfig(save_tri=True)),
    "kernel only, bf16 V + saved inverse": dict(config=KernelConfig(stored_v="input", save_tri=True)),
}

# the variants whose compiled fwd+bwd peak memory is reported too
MEMORY_VARIANTS = ("kernel only, one-program Pallas chunk gradients",
                   "kernel only, seventh-run default (fused walks, XLA chunk gradients)",
                   "kernel only, eighth-run default (two-program chunk gradients)",
                   "kernel only, stored-P/dR chunk gradients fp32 dR",
                   "kernel only, ninth-run default (fp32 triangular inverse)",
                   "kernel only, bf16 V", "kernel only, saved inverse", "kernel only, bf16 V + saved inverse")

# the whole op (falcon(impl="pallas"), gates and layout included) on opt-in kernel choices
WHOLE_OP_VARIANTS = {
    "falcon-1 pallas (ours), ninth-run default (fp32 triangular inverse)": KernelConfig(tri_dtype="fp32"),
    "falcon-1 pallas (ours), bf16 V + saved inverse": KernelConfig(stored_v="input", save_tri=True),
    # the default until the twelfth run (gate_transpose="pallas" since: next33)
    "falcon-1 pallas (ours), XLA gate transpose": KernelConfig(gate_transpose="xla"),
    "falcon-1 pallas (ours), stored split chunk gradients": KernelConfig(chunk_grads="pallas_stored_split"),
    "falcon-1 pallas (ours), chunk gradients 8 warps": KernelConfig(grad_warps=8),
    "falcon-1 pallas (ours), triangular inverse 2 warps": KernelConfig(tri_warps=2),
    # the stored chunk gradients' column loops: unrolled (the default until the fourteenth run) or as
    # lax.fori_loop (the default since, with 2 stages: next43) at 1 and 3 stages
    "falcon-1 pallas (ours), unrolled chunk gradient loops": KernelConfig(grad_loops="unrolled", grad_stages=1),
    "falcon-1 pallas (ours), chunk gradient fori loops 1 stage": KernelConfig(grad_stages=1),
    "falcon-1 pallas (ours), chunk gradient fori loops 3 stages": KernelConfig(grad_stages=3),
    # the walks' stages: 2 everywhere (the default until the fourteenth run) and 3 everywhere, against the
    # default's choice by program count (KernelConfig.walk_stages)
    "falcon-1 pallas (ours), walks 2 stages": KernelConfig(fwd_stages=2, state_stages=2),
    "falcon-1 pallas (ours), walks 3 stages": KernelConfig(fwd_stages=3, state_stages=3),
}


# the per-column kernel (Falcon-2) on per-column gains, kernel only, with its launch parameters varied
COLUMN_VARIANTS = {
    "per-column op, default (blocked solve, 4 warps, 32 columns)": KernelConfig(),
    "per-column op, 2 warps": KernelConfig(column_warps=2),  # 1 warp (rows): 60 / 499 ms, eleventh run; dropped
    "per-column op, 16 columns": KernelConfig(column_block_v=16),
    "per-column op, row-by-row solve": KernelConfig(column_solve="rows"),  # the default until the eleventh run
}


def fla_delta_rule_calls(B, T, H, D):
    """fla 0.6.0 on CUDA torch inputs drawn as :func:`make_inputs` draws ours (unit keys, bf16 q, k, v, β; fp32
    log decay): ``(gated forward, delta-rule forward, delta-rule forward + backward)``, each a no-argument call.
    Raises ImportError without torch or fla."""
    import torch
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    tq = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) / D**0.5
    tk = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda", dtype=torch.float32), dim=-1)
    tk = tk.to(torch.bfloat16)
    tv = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    tg = -torch.rand(B, T, H, device="cuda", dtype=torch.float32) * 0.1
    tb = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (tq, tk, tv, tb)]

    def fwd_bwd():
        o, _ = chunk_delta_rule(*leaves[:3], beta=leaves[3])
        o.sum().backward()

    return (lambda: chunk_gated_delta_rule(tq, tk, tv, g=tg, beta=tb), lambda: chunk_delta_rule(tq, tk, tv, beta=tb),
            fwd_bwd)


def jla_op(kind):
    def op(q, k, v, beta, log_decay):
        import jla.ops

        gates = {"beta": beta.astype(q.dtype)}
        if kind == "gated_deltanet":
            gates["g"] = log_decay
        return jla.ops.linear_attention(kind, q, k, v, impl="mosaic_gpu", **gates)[0]
    return op


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_regression.json")
    parser.add_argument("--quick", action="store_true", help="first shape only, no memory rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (any machine)")
    add_row_filter(parser, rows_note=", memory entries included")
    parser.add_argument("--shapes", default=None, help="comma-separated BxTxHxD timing shapes (default: all; "
                        "'' for none)")
    parser.add_argument("--memory-shapes", default=None, help="comma-separated BxTxHxD memory shapes (default: "
                        "1x32768x16x128,1x131072x16x128; '' for none)")
    parser.add_argument("--configs", default="", help="semicolon-separated KernelConfig settings, each timed as "
                        "one more whole-op row, e.g. 'state_warps=8;fwd_stages=3,block_v=64'")
    args = parser.parse_args()
    extra_configs = {f"falcon-1 pallas (ours), {text.strip()}": parsed_kernel_config(parser, text, flag="--configs")
                     for text in args.configs.split(";") if text.strip()}

    def shape_list(text, flag):
        try:
            return [parse_shape(item) for item in text.split(",") if item.strip()]
        except ValueError:
            parser.error(f"{flag}: expected comma-separated BxTxHxD shapes such as 2x8192x16x128, got {text!r}")

    t_start = time.time()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows, errors, memory = [], {}, []
    shapes = SMOKE_SHAPES if args.smoke else SHAPES[:1] if args.quick else SHAPES
    memory_shapes = SMOKE_MEMORY_SHAPES if args.smoke else [] if args.quick else MEMORY_SHAPES
    if args.shapes is not None:
        shapes = shape_list(args.shapes, "--shapes")
    if args.memory_shapes is not None:
        memory_shapes = shape_list(args.memory_shapes, "--memory-shapes")
    timing = dict(calls=1, repeats=1) if args.smoke else {}
    slow_timing = dict(calls=1, repeats=1) if args.smoke else dict(calls=3, repeats=3)

    def save():
        """Write what is measured so far (a run cut off by its time limit keeps it)."""
        write_json(args.out, {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dtype": "bfloat16",
                              "smoke": args.smoke, "rows": rows, "memory": memory, "errors": errors,
                              "seconds": time.time() - t_start})

    def record_error(key, e):
        errors[key] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  error {key}: {errors[key]}", flush=True)
        traceback.print_exc(limit=2)

    wanted = row_filter(args)

    def measure(name, shape, op, n_diff, op_args, fwd_only=False, slow=False):
        row = {"impl": name, "shape": "x".join(map(str, shape))}
        if not wanted(name):
            return row
        try:
            f, b = fwd_and_bwd(op, n_diff)
        except Exception as e:  # noqa: BLE001
            record_error(f"{name} {row['shape']}", e)
            return row
        for key, fn in (("fwd_ms", f), ("fwd_bwd_ms", None if fwd_only else b)):
            if fn is None:
                continue
            try:
                row[key] = time_jax(fn, *op_args, **(slow_timing if slow else timing))
            except Exception as e:  # noqa: BLE001 - record and continue
                record_error(f"{name} {row['shape']} {key}", e)
        rows.append(row)
        print(row, f"[{time.time() - t_start:.0f} s]", flush=True)
        save()
        return row

    for shape in shapes:
        B, T, H, D = shape
        q, k, v, beta, lam, log_decay = make_inputs(*shape)
        measure("falcon-1 pallas (ours)", shape, ours_falcon, 5, (q, k, v, beta, lam))
        for label, cfg in {**WHOLE_OP_VARIANTS, **extra_configs}.items():
            measure(label, shape, with_kernel_config(ours_falcon, cfg), 5, (q, k, v, beta, lam))
        measure("kernel only (decayed_delta_rule)", shape, kernel_only, 5, (q, k, v, beta, log_decay))
        measure("kernel only, BTHD in place", shape, kernel_only_in_place, 5, (q, k, v, beta, log_decay))
        if not args.smoke:  # peers (GPU only)
            for kind in ("gated_deltanet", "deltanet"):
                measure(f"jla 0.1.0 {kind} mosaic_gpu", shape, jla_op(kind), 5, (q, k, v, beta, log_decay))
        fla_rows = ("fla 0.6.0 chunk_gated_delta_rule", "fla 0.6.0 chunk_delta_rule")
        if not args.smoke and any(wanted(r) for r in fla_rows):  # --skip fla: not imported
            try:
                gated_fwd, delta_fwd, delta_fwd_bwd = fla_delta_rule_calls(B, T, H, D)
                row = {"impl": "fla 0.6.0 chunk_gated_delta_rule", "shape": "x".join(map(str, shape))}
                try:
                    row["fwd_ms"] = time_torch(gated_fwd)
                except Exception as e:  # noqa: BLE001
                    record_error(f"fla gated fwd {shape}", e)
                rows.append(row)
                print(row, flush=True)
                row = {"impl": "fla 0.6.0 chunk_delta_rule", "shape": "x".join(map(str, shape))}
                try:
                    row["fwd_ms"] = time_torch(delta_fwd)
                    row["fwd_bwd_ms"] = time_torch(delta_fwd_bwd)
                except Exception as e:  # noqa: BLE001
                    record_error(f"fla delta fwd/bwd {shape}", e)
                rows.append(row)
                print(row, f"[{time.time() - t_start:.0f} s]", flush=True)
            except Exception as e:  # noqa: BLE001
                record_error(f"fla {shape}", e)
        if shape == (SMOKE_SHAPES if args.smoke else SHAPES)[0]:  # Falcon-2 (per-column gains): 8x2048 only
            beta_col = per_column_gains(beta, D)
            measure("falcon-2 per-column pallas (ours)", shape, ours_falcon2, 5, (q, k, v, beta_col, lam))
            measure("falcon-2 per-column pallas (ours), row-by-row solve", shape,
                    with_kernel_config(ours_falcon2, KernelConfig(column_solve="rows")), 5,
                    (q, k, v, beta_col, lam))
            measure("falcon-3 W=4 pallas (ours)", shape, ours_falcon3, 5, (q, k, v, beta, lam))
            for label, cfg in extra_configs.items():  # --configs for Falcon-3 too (its op shares KernelConfig)
                measure(label.replace("falcon-1 pallas", "falcon-3 W=4 pallas"), shape,
                        with_kernel_config(ours_falcon3, cfg), 5, (q, k, v, beta, lam))
            for label, cfg in COLUMN_VARIANTS.items():
                measure(label, shape, functools.partial(kernel_only, config=cfg), 5, (q, k, v, beta_col, log_decay))
        for label, kw in VARIANTS.items():
            measure(label, shape, functools.partial(kernel_only, **kw), 5, (q, k, v, beta, log_decay))
        measure("falcon-1 xla chunk (ours)", shape, ours_xla, 5, (q, k, v, beta, lam), slow=True)
    for shape in memory_shapes:
        q, k, v, beta, lam, log_decay = make_inputs(*shape)
        entry = {"shape": "x".join(map(str, shape))}
        ops = [("falcon-1 pallas", ours_falcon, (q, k, v, beta, lam)),
               *((label, with_kernel_config(ours_falcon, cfg), (q, k, v, beta, lam))
                 for label, cfg in {**WHOLE_OP_VARIANTS, **extra_configs}.items()),
               ("kernel only", kernel_only, (q, k, v, beta, log_decay)),
               ("kernel only BTHD in place", kernel_only_in_place, (q, k, v, beta, log_decay)),
               *((label, functools.partial(kernel_only, **VARIANTS[label]), (q, k, v, beta, log_decay))
                 for label in MEMORY_VARIANTS),
               ("jla gated_deltanet", jla_op("gated_deltanet"), (q, k, v, beta, log_decay))]
        for label, op, a in ops:
            if not wanted(label):
                continue
            try:
                _, b = fwd_and_bwd(op, len(a))
                entry[f"{label} fwd+bwd bytes"] = compiled_memory(b, *a)
            except Exception as e:  # noqa: BLE001
                record_error(f"memory {label} {entry['shape']}", e)
        memory.append(entry)
        print(entry, f"[{time.time() - t_start:.0f} s]", flush=True)
        save()

    ours = {r["shape"]: r for r in rows if r["impl"] == "falcon-1 pallas (ours)"}
    for r in rows:
        base = ours.get(r["shape"], {})
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if r.get(key) and base.get(key):
                r[f"x ours {key[:-3]}"] = r[key] / base[key]
    print()
    print_table(rows, ["shape", "impl", "fwd_ms", "fwd_bwd_ms", "x ours fwd", "x ours fwd_bwd"])
    if memory:
        print()
        for entry in memory:
            print(entry)
    save()
    if errors:
        print("errors:", errors)
    print(f"done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
