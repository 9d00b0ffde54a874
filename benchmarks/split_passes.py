"""Where the time of the GPU chunk kernels goes: each Triton pass timed alone (H200).

    python benchmarks/split_passes.py [--out split_passes.json] [--smoke]

For ``decayed_attention`` (Falcon-1A) and ``decayed_delta_rule`` (Falcon-1), on flattened bf16
inputs ``[B·H, T, d]`` (B, T, H, d = 8, 2048, 16, 128 and 1, 32768, 16, 128), with the op's own
launch parameters and piece count, the median ms of:

  decayed_attention:  fwd walk (write o) · pieces pre-pass · recompute walk (write h) ·
                      state-gradient walk (write dh) · chunk gradients · fwd walk and chunk
                      gradients reading [B, T, H, d] in place
  decayed_delta_rule: triangular inverse · fwd walk (write o) · recompute walk (write h) ·
                      state-gradient walk (write dh) · chunk gradients

plus the whole op's fwd and fwd+bwd for comparison (their difference to the passes' sum is the
XLA glue: gate cumsums, piece scans, reverse cumsums, layout). Prints a table, writes JSON.
``--smoke``: tiny shapes in interpret mode (any machine), to check the script runs.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table, time_jax, write_json
from falcon_jax.kernels.common import chunk_local, pieces_for
from falcon_jax.kernels.decayed_attention import api as attn_api
from falcon_jax.kernels.decayed_attention import pallas_gpu as attn_gpu
from falcon_jax.kernels.decayed_delta_rule import api as delta_api
from falcon_jax.kernels.decayed_delta_rule import pallas_gpu as delta_gpu
from falcon_jax.kernels.decayed_delta_rule import xla as delta_xla


def inputs(BH, T, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(BH, T, d)) / np.sqrt(d), dtype)
    x = jnp.asarray(rng.normal(size=(BH, T, d)) / np.sqrt(d), dtype)
    y = jnp.asarray(rng.normal(size=(BH, T, d)), dtype)
    do = jnp.asarray(rng.normal(size=(BH, T, d)), dtype)
    log_decay = jnp.asarray(-rng.uniform(0.0, 0.1, size=(BH, T)), jnp.float32)
    eta = jnp.asarray(rng.uniform(0.1, 1.0, size=(BH, T)), jnp.float32)
    run = jnp.zeros((BH, T), jnp.int32)
    return q, x, y, do, log_decay, eta, run


def split_attention(shape, interpret, rows):
    B, T, H, d = shape
    BH, C = B * H, 64
    cfg = attn_api.KernelConfig()
    q, x, y, do, log_decay, _, run = inputs(BH, T, d, jnp.bfloat16)
    P = pieces_for(BH, d // cfg.block_v, T // C, cfg.target_programs)
    g, rl = chunk_local(log_decay, run, C)
    s0 = jnp.zeros((BH, P, d, d), jnp.float32)
    kw = dict(chunk=C, pieces=P, block_v=cfg.block_v, interpret=interpret)
    kw["walk_operands"] = cfg.walk_operand_dtype(q.dtype)
    fwd_kw = dict(kw, num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    state_kw = dict(kw, num_warps=cfg.state_warps, num_stages=cfg.fwd_stages)
    name = f"{B}x{T}x{H}x{d}"
    fwd = jax.jit(functools.partial(attn_gpu.forward_pass, write_o=True, write_h=False, **fwd_kw))
    pre = jax.jit(functools.partial(attn_gpu.forward_pass, write_o=False, write_h=False, **fwd_kw))
    rec = jax.jit(functools.partial(attn_gpu.forward_pass, write_o=False, write_h=True, **fwd_kw))
    sgr = jax.jit(functools.partial(attn_gpu.state_grad_pass, write_dh=True, **state_kw))
    h, _ = rec(q, x, y, g, rl, s0)
    dh, _ = sgr(q, g, rl, do, s0)
    cgr = jax.jit(functools.partial(attn_gpu.chunk_grad_pass, chunk=C, block_v=cfg.block_v, interpret=interpret,
                                    num_warps=cfg.grad_warps, num_stages=cfg.grad_stages))
    timings = [("fwd walk (o)", fwd, (q, x, y, g, rl, s0))]
    if P > 1:
        timings.append(("pieces pre-pass", pre, (q, x, y, g, rl, s0)))
    timings += [("recompute walk (h)", rec, (q, x, y, g, rl, s0)),
                ("state-gradient walk (dh)", sgr, (q, g, rl, do, s0)),
                ("chunk gradients", cgr, (q, x, y, g, rl, do, h, dh))]
    # the same passes reading [B, T, H, d] in place (strided rows): what layout="BTHD" costs inside the kernels
    tm = [jnp.swapaxes(a.reshape(B, H, T, d), 1, 2) for a in (q, x, y, do)]
    fwd_tm = jax.jit(functools.partial(attn_gpu.forward_pass, write_o=True, write_h=False, heads=H, **fwd_kw))
    cgr_tm = jax.jit(functools.partial(attn_gpu.chunk_grad_pass, chunk=C, block_v=cfg.block_v, interpret=interpret,
                                       num_warps=cfg.grad_warps, num_stages=cfg.grad_stages, heads=H))
    timings += [("fwd walk (o), BTHD in place", fwd_tm, (tm[0], tm[1], tm[2], g, rl, s0)),
                ("chunk gradients, BTHD in place", cgr_tm, (tm[0], tm[1], tm[2], g, rl, tm[3], h, dh))]
    op_in = [a.reshape(B, H, T, -1) for a in (q, x, y)] + [log_decay.reshape(B, H, T), run.reshape(B, H, T),
                                                          jnp.zeros((B, H, d, d), jnp.float32)]
    impl = "pallas_gpu"

    def op(*a):
        return attn_api.decayed_attention(*a, implementation=impl, interpret=interpret)[0]

    def op_both(*a):
        return jax.grad(lambda *b: jnp.sum(op(*b).astype(jnp.float32)), argnums=(0, 1, 2, 3))(*a)

    timings += [("whole op fwd", jax.jit(op), op_in), ("whole op fwd+bwd", jax.jit(op_both), op_in)]
    for label, fn, args in timings:
        rows.append({"op": "decayed_attention", "shape": name, "pieces": P, "pass": label,
                     "ms": time_jax(fn, *args, calls=5 if interpret else 20, repeats=3 if interpret else 7)})
        print(rows[-1], flush=True)


def split_delta(shape, interpret, rows):
    B, T, H, d = shape
    BH, C = B * H, 64
    cfg = delta_api.KernelConfig().resolved(BH, d, jnp.bfloat16, d)  # the bf16 inputs below
    q, x, y, do, log_decay, eta, run = inputs(BH, T, d, jnp.bfloat16)
    eta = eta / d  # η‖x‖² ≈ η: inside (0, 2)
    P = pieces_for(BH, d // cfg.block_v, T // C, cfg.target_programs)
    g, gp, rl = delta_api._gates(log_decay, run, C)
    s0 = jnp.zeros((BH, P, d, d), jnp.float32)
    kw = dict(chunk=C, pieces=P, block_v=cfg.block_v, interpret=interpret)
    kw["walk_operands"] = cfg.walk_operand_dtype(q.dtype)
    programs = BH * P * (d // cfg.block_v)  # the walks' stages as the op picks them (KernelConfig.walk_stages)
    fwd_kw = dict(kw, num_warps=cfg.fwd_warps, num_stages=cfg.walk_stages(cfg.fwd_stages, output_programs=programs))
    state_kw = dict(kw, num_warps=cfg.state_warps, num_stages=cfg.walk_stages(cfg.state_stages))
    name = f"{B}x{T}x{H}x{d}"
    tri = jax.jit(functools.partial(delta_gpu.tri_inverse_pass, chunk=C, interpret=interpret,
                                    num_warps=cfg.tri_warps))
    tinv = tri(x, eta, g, gp, rl)
    fwd = jax.jit(functools.partial(delta_gpu.forward_pass, write_o=True, write_h=False, **fwd_kw))
    rec = jax.jit(functools.partial(delta_gpu.forward_pass, write_o=False, write_h=True, **fwd_kw))
    sgr = jax.jit(functools.partial(delta_gpu.state_grad_pass, write_dh=True, **state_kw))
    h, _ = rec(q, x, y, eta, g, gp, rl, tinv, s0)
    dh, _ = sgr(q, x, eta, g, gp, rl, tinv, do, s0)
    cgr = jax.jit(functools.partial(delta_gpu.chunk_grad_pass, chunk=C, block_v=cfg.block_v, interpret=interpret,
                                    num_warps=cfg.grad_warps, num_stages=cfg.grad_stages))
    timings = [("triangular inverse", tri, (x, eta, g, gp, rl)),
               ("fwd walk (o)", fwd, (q, x, y, eta, g, gp, rl, tinv, s0)),
               ("recompute walk (h)", rec, (q, x, y, eta, g, gp, rl, tinv, s0)),
               ("state-gradient walk (dh)", sgr, (q, x, eta, g, gp, rl, tinv, do, s0)),
               ("chunk gradients (Pallas)", cgr, (q, x, y, eta, g, gp, rl, tinv, do, h, dh)),
               ("chunk gradients (XLA, the GPU default)", jax.jit(functools.partial(delta_xla.chunk_grads, chunk=C)),
                (q, x, y, eta, g, gp, rl, tinv, do, h, dh))]
    op_in = [a.reshape(B, H, T, -1) for a in (q, x, y)] + [eta.reshape(B, H, T), log_decay.reshape(B, H, T),
                                                          run.reshape(B, H, T), jnp.zeros((B, H, d, d), jnp.float32)]

    def op(*a):
        return delta_api.decayed_delta_rule(*a, implementation="pallas_gpu", interpret=interpret)[0]

    def op_both(*a):
        return jax.grad(lambda *b: jnp.sum(op(*b).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))(*a)

    timings += [("whole op fwd", jax.jit(op), op_in), ("whole op fwd+bwd", jax.jit(op_both), op_in)]
    for label, fn, args in timings:
        rows.append({"op": "decayed_delta_rule", "shape": name, "pieces": P, "pass": label,
                     "ms": time_jax(fn, *args, calls=5 if interpret else 20, repeats=3 if interpret else 7)})
        print(rows[-1], flush=True)


def split_delta_passes(shape, interpret, rows, passes=()):
    """The split passes of ``decayed_delta_rule`` (``KernelConfig(outputs="split", state_grads="split",
    chunk_grads="pallas_split")``) one by one, with their block widths varied, next to the fused ones; then the
    walks storing P and dR and the chunk gradients reading them (``chunk_grads="pallas_stored"``)."""
    B, T, H, d = shape
    BH, C = B * H, 64
    cfg = delta_api.KernelConfig().resolved(BH, d, jnp.bfloat16, d)  # the bf16 inputs below
    q, x, y, do, log_decay, eta, run = inputs(BH, T, d, jnp.bfloat16)
    eta = eta / d
    g, gp, rl = delta_api._gates(log_decay, run, C)
    s0 = jnp.zeros((BH, 1, d, d), jnp.float32)
    lo = cfg.walk_operand_dtype(q.dtype)
    bv = min(cfg.block_v, d)  # the fused walks' and chunk gradients' value block (smoke shapes: d = 16)
    name = f"{B}x{T}x{H}x{d}"
    widths = [b for b in (16, 32, 64, 128) if b <= d]
    jit = lambda f, **kw: jax.jit(functools.partial(f, interpret=interpret, **kw))  # noqa: E731
    walk_kw = dict(chunk=C, pieces=1, walk_operands=lo)
    tinv = jit(delta_gpu.tri_inverse_pass, chunk=C, num_warps=cfg.tri_warps)(x, eta, g, gp, rl)
    prep = jit(delta_gpu.prepare_wu, chunk=C, w_dtype=lo or jnp.float32)
    w, u = prep(x, y, eta, g, gp, rl, tinv)
    h, _ = jit(delta_gpu.state_walk, block_v=bv, **walk_kw)(x, w, u, g, rl, s0)
    vb = jit(delta_gpu.prepare_vb, chunk=C, b_dtype=lo or jnp.float32)(q, x, eta, g, gp, rl, tinv, do)
    dh, _ = jit(delta_gpu.state_grad_split_pass, block_v=bv, write_dh=True, vb=vb, **walk_kw)(
        q, x, eta, g, gp, rl, tinv, do, s0)
    timings = [("triangular inverse", jit(delta_gpu.tri_inverse_pass, chunk=C, num_warps=cfg.tri_warps),
                (x, eta, g, gp, rl)),
               ("prepare W, U (T given)", prep, (x, y, eta, g, gp, rl, tinv)),
               ("fused fwd walk (o), the default", jit(delta_gpu.forward_pass, block_v=bv, write_o=True,
                                                        write_h=False, **walk_kw),
                (q, x, y, eta, g, gp, rl, tinv, s0)),
               ("fused recompute walk (h)", jit(delta_gpu.forward_pass, block_v=bv, write_o=False,
                                                write_h=True, **walk_kw), (q, x, y, eta, g, gp, rl, tinv, s0))]
    timings += [(f"state walk, {b} columns", jit(delta_gpu.state_walk, block_v=b, **walk_kw), (x, w, u, g, rl, s0))
                for b in widths]
    timings += [(f"output kernel, {b} columns", jit(delta_gpu.split_outputs, chunk=C, block_v=b, walk_operands=lo,
                                                    like=y), (q, x, w, u, g, rl, h)) for b in widths]
    timings += [("prepare V, B", jit(delta_gpu.prepare_vb, chunk=C, b_dtype=lo or jnp.float32),
                 (q, x, eta, g, gp, rl, tinv, do)),
                ("fused state-gradient walk (dh)", jit(delta_gpu.state_grad_pass, block_v=bv, write_dh=True,
                                                       **walk_kw), (q, x, eta, g, gp, rl, tinv, do, s0))]
    timings += [(f"split state-gradient walk, {b} columns",
                 jit(delta_gpu.state_grad_split_pass, block_v=b, write_dh=True, vb=vb, **walk_kw),
                 (q, x, eta, g, gp, rl, tinv, do, s0)) for b in widths]
    values = jit(delta_gpu.chunk_grad_values, chunk=C, block_v=bv, walk_operands=lo)
    _, sums = values(q, x, y, eta, g, gp, rl, tinv, do, h, dh)
    timings += [("chunk gradients, two programs", jit(delta_gpu.chunk_grad_split_pass, chunk=C, block_v=bv,
                                                       walk_operands=lo),
                 (q, x, y, eta, g, gp, rl, tinv, do, h, dh)),
                ("chunk gradients, value half", values, (q, x, y, eta, g, gp, rl, tinv, do, h, dh)),
                ("chunk gradients, key half", jit(delta_gpu.chunk_grad_keys, chunk=C, walk_operands=lo),
                 (q, x, eta, g, gp, rl, do, h, dh, sums)),
                ("chunk gradients, XLA", jax.jit(functools.partial(delta_xla.chunk_grads, chunk=C, operands=lo)),
                 (q, x, y, eta, g, gp, rl, tinv, do, h, dh))]
    # P and dR stored by the walks (chunk_grads="pallas_stored", the default since the ninth run): the walks with
    # the extra store (dR in fp32 or the inputs' dtype), the chunk gradients without T
    split_bv = cfg.split_block_v_for(BH, d)
    p, _, _ = jit(delta_gpu.forward_pass, block_v=bv, write_o=False, write_h=True, write_p=True, **walk_kw)(
        q, x, y, eta, g, gp, rl, tinv, s0)
    timings += [("fused recompute walk (h) + P stored",
                 jit(delta_gpu.forward_pass, block_v=bv, write_o=False, write_h=True, write_p=True, **walk_kw),
                 (q, x, y, eta, g, gp, rl, tinv, s0))]
    for dr_dtype in (jnp.float32, lo or jnp.float32):
        dr_name = jnp.dtype(dr_dtype).name
        walk = jit(delta_gpu.state_grad_split_pass, block_v=split_bv, write_dh=True, write_dr=dr_dtype, vb=vb,
                   **walk_kw)
        dr, _, _ = walk(q, x, eta, g, gp, rl, tinv, do, s0)
        timings += [(f"split state-gradient walk + dR {dr_name}, {split_bv} columns", walk,
                     (q, x, eta, g, gp, rl, tinv, do, s0))]
        timings += [(f"chunk gradients from stored P, dR {dr_name}, {k} key columns",
                     jit(delta_gpu.chunk_grad_stored_pass, chunk=C, block_v=bv, walk_operands=lo, block_k=k),
                     (q, x, y, eta, g, gp, rl, do, h, dh, p, dr)) for k in (32, 64)]
    # tenth run: T stored in bf16 (KernelConfig(tri_dtype="input")): the passes that read it; the recompute walk
    # at 16 value columns (twice the programs at 1x32768)
    tri_b = jit(delta_gpu.tri_inverse_pass, chunk=C, num_warps=cfg.tri_warps, t_dtype=q.dtype)
    tinv_b = tri_b(x, eta, g, gp, rl)
    recompute = functools.partial(delta_gpu.forward_pass, write_o=False, write_h=True, write_p=True, **walk_kw)
    timings += [("triangular inverse, bf16 T", tri_b, (x, eta, g, gp, rl)),
                ("prepare W, U, bf16 T", prep, (x, y, eta, g, gp, rl, tinv_b)),
                ("fused fwd walk (o), bf16 T", jit(delta_gpu.forward_pass, block_v=bv, write_o=True, write_h=False,
                                                   **walk_kw), (q, x, y, eta, g, gp, rl, tinv_b, s0)),
                ("fused recompute walk (h) + P stored, bf16 T", jit(recompute, block_v=bv),
                 (q, x, y, eta, g, gp, rl, tinv_b, s0)),
                ("fused recompute walk (h) + P stored, 16 columns", jit(recompute, block_v=16),
                 (q, x, y, eta, g, gp, rl, tinv, s0)),
                ("fused recompute walk (h) + P stored, bf16 T, 16 columns", jit(recompute, block_v=16),
                 (q, x, y, eta, g, gp, rl, tinv_b, s0)),
                ("prepare V, B, bf16 T", jit(delta_gpu.prepare_vb, chunk=C, b_dtype=lo or jnp.float32),
                 (q, x, eta, g, gp, rl, tinv_b, do))]
    # prepared in the tenth session: V stored in bf16 (KernelConfig(stored_v="input")), its prepare pass and the
    # reverse walk that reads it
    prep_vb16 = jit(delta_gpu.prepare_vb, chunk=C, b_dtype=lo or jnp.float32, v_dtype=lo or jnp.float32)
    vb16 = prep_vb16(q, x, eta, g, gp, rl, tinv_b, do)
    timings += [("prepare V, B, bf16 T, bf16 V", prep_vb16, (q, x, eta, g, gp, rl, tinv_b, do)),
                (f"split state-gradient walk + dR, bf16 V, {split_bv} columns",
                 jit(delta_gpu.state_grad_split_pass, block_v=split_bv, write_dh=True, write_dr=lo or jnp.float32,
                     vb=vb16, **walk_kw), (q, x, eta, g, gp, rl, tinv_b, do, s0))]
    for label, fn, args in timings:
        if passes and not any(part in label for part in passes):
            continue
        try:
            ms = time_jax(fn, *args, calls=5 if interpret else 20, repeats=3 if interpret else 7)
        except Exception as e:  # noqa: BLE001 - a width a kernel cannot take: record and go on
            ms, label = None, f"{label} (failed: {type(e).__name__}: {str(e)[:120]})"
        rows.append({"op": "decayed_delta_rule split", "shape": name, "pieces": 1, "pass": label, "ms": ms})
        print(rows[-1], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="split_passes.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)")
    ap.add_argument("--ops", default="attention,delta", help="comma-separated: attention, delta, delta_split")
    ap.add_argument("--shapes", default="8x2048x16x128,1x32768x16x128", help="comma-separated BxTxHxD")
    ap.add_argument("--passes", default="", help="delta_split: semicolon-separated substrings (labels hold "
                    "commas); only the passes whose label holds one are timed (default: all)")
    args = ap.parse_args()
    passes = tuple(p.strip() for p in args.passes.split(";") if p.strip())
    ops = {"attention": split_attention, "delta": split_delta, "delta_split": split_delta_passes}
    unknown = set(args.ops.split(",")) - set(ops)
    if unknown:
        ap.error(f"--ops: unknown {sorted(unknown)}; choose from {sorted(ops)}")
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = [(1, 256, 2, 16)] if args.smoke else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows, errors = [], {}
    for split in (ops[name] for name in args.ops.split(",")):
        for shape in shapes:
            try:
                split(shape, interpret, rows, **({"passes": passes} if split is split_delta_passes else {}))
            except Exception as e:  # noqa: BLE001 - record and go on
                errors[f"{split.__name__} {shape}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print("error", split.__name__, shape, errors, flush=True)
            write_json(args.out, {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                  "dtype": "bfloat16", "rows": rows, "errors": errors})
    print()
    print_table(rows, ["op", "shape", "pieces", "pass", "ms"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
