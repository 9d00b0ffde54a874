"""Do Falcon-1's Triton walks get faster with 128-row chunks? (H200 probe for the long-sequence walks.)

At 1x32768x16x128 the walks are latency-bound: 512 chunk steps of ~1.4 us each, one program per SM
(docs/kernels.md, twenty-third and twenty-fourth runs).  A step's chain is the same three dependent dots at
C = 128 as at C = 64, on twice the rows, so a walk over 128-row chunks takes half the steps.  This times, at
the long shapes (H16, d128, bf16, tokens in place, keys read one row back), each pass a forward needs at
C = 64 and C = 128 (the triangular inverse, the masked scores, the output walk under several launch
parameters), the backward's recompute walk and its split reverse walk (T read per step, V and the q-term
given as jit arguments, so XLA copies them first in both rows), and compares the two output walks' o
(each from its own T and scores; both are the same chunk form of the same rule).

    python benchmarks/probe_walk_chunk.py [--shapes 1x32768x16x128,2x8192x16x128] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import parse_shape, print_table, rel_err, time_jax, write_json
from falcon_jax.kernels.decayed_delta_rule import pallas_gpu

BF = jnp.bfloat16
F32 = jnp.float32
INTERPRET = False  # --interpret: a CPU smoke run of the calls (its times mean nothing)


def chunk_gates(lg, chunk):
    """Chunk-local inclusive cumsum g, g⁻ = g − log γ and run index 0 (no segments) for ``chunk``-row chunks."""
    BH, L = lg.shape
    g = jnp.cumsum(lg.reshape(BH, L // chunk, chunk), axis=-1).reshape(BH, L)
    return g, g - lg, jnp.zeros((BH, L), jnp.int32)


def make_inputs(rng, B, L, H, d):
    q, k = (jnp.asarray(rng.normal(size=(B, L, H, d)) / np.sqrt(d), BF) for _ in range(2))
    y = jnp.asarray(rng.normal(size=(B, L, H, d)), BF)
    norms = np.swapaxes(np.asarray(jnp.asarray(k, F32), np.float64) ** 2, 1, 2).sum(-1).reshape(B * H, L)
    norms = np.concatenate([np.zeros((B * H, 1)), norms[:, :-1]], axis=1)  # write feature t is key t − 1
    eta = jnp.asarray(rng.uniform(0.2, 1.9, size=(B * H, L)) / (norms + 0.05), F32)
    lg = jnp.asarray(-rng.uniform(0.001, 0.1, size=(B * H, L)), F32)
    s0 = jnp.asarray(rng.normal(size=(B * H, 1, d, d)) / np.sqrt(d), F32)
    return q, k, y, eta, lg, s0


def per_chunk(chunk, q, k, y, eta, lg, H):
    g, gp, rl = chunk_gates(lg, chunk)
    kw = dict(chunk=chunk, interpret=INTERPRET, heads=H, key_shift=True)
    tinv = jax.jit(lambda k, eta, g, gp, rl: pallas_gpu.tri_inverse_pass(k, eta, g, gp, rl, num_warps=1,
                                                                         t_dtype=BF, **kw))(k, eta, g, gp, rl)
    scores = jax.jit(lambda q, k, g, rl: pallas_gpu.masked_scores_pass(q, k, g, rl, dtype=BF, **kw))(q, k, g, rl)
    return g, gp, rl, tinv, scores


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x32768x16x128,2x8192x16x128")
    parser.add_argument("--out", default=None)
    parser.add_argument("--interpret", action="store_true", help="interpret mode (CPU smoke run)")
    args = parser.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": [], "values": []}
    rows = results["rows"]
    t0 = time.time()

    def record(shape, what, chunk, launch, fn, *a):
        try:
            ms = time_jax(fn, *a, **(dict(calls=1, repeats=1) if INTERPRET else {}))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
            ms = None
            print(f"{shape} {what} C={chunk} {launch}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  flush=True)
        row = {"shape": shape, "pass": what, "C": chunk, "launch": launch, "ms": ms}
        rows.append(row)
        print(row, f"[{time.time() - t0:.0f} s]", flush=True)

    for text in args.shapes.split(","):
        B, L, H, d = parse_shape(text)
        shape = f"{B}x{L}x{H}x{d}"
        q, k, y, eta, lg, s0 = make_inputs(rng, B, L, H, d)
        do = jnp.asarray(rng.normal(size=y.shape), BF)
        outs = {}
        for chunk in (64, 128):
            g, gp, rl, tinv, scores = per_chunk(chunk, q, k, y, eta, lg, H)
            kw = dict(chunk=chunk, interpret=INTERPRET, heads=H, key_shift=True)
            record(shape, "inverse", chunk, "1 warp", jax.jit(
                lambda k, eta, g, gp, rl: pallas_gpu.tri_inverse_pass(k, eta, g, gp, rl, num_warps=1, t_dtype=BF,
                                                                     **kw)), k, eta, g, gp, rl)
            record(shape, "scores", chunk, "4 warps", jax.jit(
                lambda q, k, g, rl: pallas_gpu.masked_scores_pass(q, k, g, rl, dtype=BF, **kw)), q, k, g, rl)
            for block_v, warps, stages in ((16, 4, 2), (16, 4, 3), (16, 8, 2), (32, 4, 2), (32, 8, 2), (16, 4, 1)):
                def output_walk(q, k, y, eta, g, gp, rl, tinv, s0, scores, block_v=block_v, warps=warps,
                                stages=stages):
                    return pallas_gpu.forward_pass(q, k, y, eta, g, gp, rl, tinv, s0, pieces=1, block_v=block_v,
                                                   write_o=True, write_h=False, num_warps=warps, num_stages=stages,
                                                   walk_operands=BF, scores=scores, **kw)

                fn = jax.jit(output_walk)
                record(shape, "output walk", chunk, f"{block_v} cols {warps} warps {stages} stages", fn,
                       q, k, y, eta, g, gp, rl, tinv, s0, scores)
                if (block_v, warps, stages) == (16, 4, 2):
                    try:
                        outs[chunk] = np.asarray(jnp.asarray(fn(q, k, y, eta, g, gp, rl, tinv, s0, scores)[0], F32))
                    except Exception:  # noqa: BLE001 - recorded above
                        pass
            for block_v, stages in ((16, 3), (16, 2), (32, 3)):
                def recompute_walk(q, k, y, eta, g, gp, rl, tinv, s0, block_v=block_v, stages=stages):
                    return pallas_gpu.forward_pass(q, k, y, eta, g, gp, rl, tinv, s0, pieces=1, block_v=block_v,
                                                   write_o=False, write_h=True, write_p=True, num_warps=4,
                                                   num_stages=stages, walk_operands=BF, **kw)

                record(shape, "recompute walk", chunk, f"{block_v} cols 4 warps {stages} stages",
                       jax.jit(recompute_walk), q, k, y, eta, g, gp, rl, tinv, s0)
            v = jnp.asarray(rng.normal(size=y.shape), BF)
            q_term = jnp.asarray(rng.normal(size=(B * H, L // chunk, d, d)) / np.sqrt(d), BF)
            ds_end = jnp.zeros((B * H, 1, d, d), F32)
            for block_v, stages in ((16, 3), (16, 2), (32, 3)):
                def reverse_walk(q, k, eta, g, gp, rl, tinv, do, ds_end, v, q_term, block_v=block_v, stages=stages):
                    return pallas_gpu.state_grad_split_pass(q, k, eta, g, gp, rl, tinv, do, ds_end, pieces=1,
                                                            block_v=block_v, write_dh=True, num_warps=4,
                                                            num_stages=stages, walk_operands=BF,
                                                            vb=(v, None, q_term), write_dr=BF, b_from_t=True, **kw)

                record(shape, "reverse walk (V, q-term copied)", chunk, f"{block_v} cols 4 warps {stages} stages",
                       jax.jit(reverse_walk), q, k, eta, g, gp, rl, tinv, do, ds_end, v, q_term)
        if 64 in outs and 128 in outs:
            err = rel_err(outs[128], outs[64])
            finite = bool(np.isfinite(outs[128]).all())
            results["values"].append({"shape": shape, "o C=128 vs C=64 rel err": err, "finite": finite})
            print(f"{shape}: o at C=128 vs C=64: rel err {err:.3e}, finite {finite}", flush=True)
    print_table(rows, ["shape", "pass", "C", "launch", "ms"])
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
