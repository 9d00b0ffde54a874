"""The Mosaic GPU chunk gradients (``mosaic_gpu.chunk_grad_stored_pass``) on a Hopper GPU.

1. Values: dq, dx, dy, dη, dg, dg⁻ against a float64 reference of the same rounded inputs (the stored P, dR and
   chunk states drawn at random: the pass is a function of them alone), next to the Triton pass's error on the
   same inputs (``pallas_gpu.chunk_grad_stored_pass``, itself tested in interpret mode on CPU).  Cases: keys read
   one row back in place or not, segment starts inside chunks, both token layouts, dk and dv 64 or 128, one
   chunk.  PASS: every value finite, and each Mosaic error within 2x the Triton pass's + half a bf16 unit.
2. Time: both passes alone at the benchmark shapes (H16, d128, bf16, in place, keys one row back).

    python benchmarks/gpu_check_mosaic_chunk_grads.py [--out FILE] [--skip-timing]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table, rel_err, time_jax, values_then_timing
from falcon_jax.kernels.decayed_delta_rule import mosaic_gpu, pallas_gpu

C = 64
BF = jnp.bfloat16
NAMES = ("dq", "dx", "dy", "deta", "dg", "dgp")


def make_case(rng, B, L, H, dk, dv, *, segments: bool, in_place: bool):
    """Rounded bf16 tokens (q, keys ``[.., dk]``; y, dO, P, dR ``[.., dv]``) in ``[B, L, H, d]`` (or head-major),
    chunk states h, dh ``[B·H, L/C, dk, dv]``, and the gate rows η, g, g⁻, rl ``[B·H, L]``."""
    def tokens(d, scale):
        a = jnp.asarray(rng.normal(scale=scale, size=(B, L, H, d)), BF)
        return a if in_place else jnp.swapaxes(a, 1, 2).reshape(B * H, L, d)
    q, k = tokens(dk, dk**-0.5), tokens(dk, dk**-0.5)
    y, do, p, dr = (tokens(dv, 1.0) for _ in range(4))
    h, dh = (jnp.asarray(rng.normal(scale=0.3, size=(B * H, L // C, dk, dv)), BF) for _ in range(2))
    eta = rng.uniform(0.1, 1.9, size=(B * H, L))
    lg = -rng.uniform(0.001, 0.1, size=(B * H, L // C, C))
    g = np.cumsum(lg, axis=-1)
    gp = (g - lg).reshape(B * H, L)  # g before the row's own decay
    starts = rng.random((B * H, L)) < (0.03 if segments else 0.0)
    run = np.cumsum(starts.reshape(B * H, L // C, C), axis=-1)
    rl = (run - run[..., :1]).reshape(B * H, L)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return (q, k, y, f32(eta), f32(g.reshape(B * H, L)), f32(gp), jnp.asarray(rl, jnp.int32), do, h, dh, p, dr)


def head_major64(a, heads):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    if heads is None:
        return a
    B, L, H, d = a.shape
    return np.swapaxes(a, 1, 2).reshape(B * H, L, d)


def reference(args, *, heads, key_shift: bool):
    """float64 (dq, dx by write-feature row, dy, dη, dg, dg⁻), all ``[B·H, L, ...]``."""
    q, k, y, eta, g, gp, rl, do, h, dh, p, dr = args
    q, k, y, do, p, dr = (head_major64(a, heads) for a in (q, k, y, do, p, dr))
    h, dh = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (h, dh))
    eta, g, gp = (np.asarray(a, np.float64) for a in (eta, g, gp))
    rl = np.asarray(rl)
    x = np.concatenate([np.zeros_like(k[:, :1]), k[:, :-1]], axis=1) if key_shift else k
    out = {name: np.zeros_like(ref) for name, ref in zip(NAMES, (q, x, y, eta, g, gp))}
    tri, strict = np.tril(np.ones((C, C), bool)), np.tril(np.ones((C, C), bool), -1)
    ein = np.einsum
    for c in range(q.shape[1] // C):
        r = slice(c * C, (c + 1) * C)
        Q, X, Y, dO, P, dR = (a[:, r] for a in (q, x, y, do, p, dr))
        e, gc, gpc, rc = eta[:, r], g[:, r], gp[:, r], rl[:, r]
        hc, dhc = h[:, c], dh[:, c]
        same = rc[:, :, None] == rc[:, None, :]

        def masked(keep, expo):
            return np.where(keep, np.exp(np.where(keep, expo, 0.0)), 0.0)

        decay = masked(tri & same, gc[:, :, None] - gc[:, None, :])
        gamma = masked(strict & same, gpc[:, :, None] - gc[:, None, :])
        first = rc == 0
        cont, cont_p = np.where(first, np.exp(gc), 0.0), np.where(first, np.exp(gpc), 0.0)
        w = np.where(rc == rc[:, -1:], np.exp(gc[:, -1:] - gc), 0.0)
        a_last = np.where(rc[:, -1] == 0, np.exp(gc[:, -1]), 0.0)
        d_a = -ein("btv,bsv->bts", dR, P)
        d_op = ein("btv,bsv->bts", dO, P)
        scores = ein("btk,bsk->bts", Q, X) * decay
        gram = ein("btk,bsk->bts", X, X)
        d_k = d_a * e[:, :, None] * gamma
        a_grad = d_k * gram
        d_decay = d_op * scores
        deta = (dR * Y).sum(-1) + (d_a * gram * gamma).sum(-1)
        dgp = a_grad.sum(-1)
        dg = d_decay.sum(-1) - d_decay.sum(-2) - a_grad.sum(-2)
        d_s = d_op * decay
        d_sym = d_k + np.swapaxes(d_k, 1, 2)
        do_h, dr_h, p_dh = ein("btv,bkv->btk", dO, hc), ein("btv,bkv->btk", dR, hc), ein("btv,bkv->btk", P, dhc)
        out["dq"][:, r] = cont[:, :, None] * do_h + ein("bts,bsk->btk", d_s, X)
        out["dx"][:, r] = (ein("bts,btk->bsk", d_s, Q) + w[:, :, None] * p_dh
                           - (e * cont_p)[:, :, None] * dr_h + ein("bts,bsk->btk", d_sym, X))
        d_xh, d_wl = (dr_h * X).sum(-1), (p_dh * X).sum(-1)
        out["deta"][:, r] = deta - cont_p * d_xh
        out["dgp"][:, r] = dgp - e * cont_p * d_xh
        dg = dg - w * d_wl + cont * (do_h * Q).sum(-1)
        dg[:, -1] += (w * d_wl).sum(-1) + a_last * (hc * dhc).sum((-1, -2))
        out["dg"][:, r] = dg
        out["dy"][:, r] = e[:, :, None] * dR
    return tuple(out[name] for name in NAMES)


def pass_call(impl, *, heads, key_shift):
    """The jitted pass (``"mosaic"`` or ``"triton"``) as the op's backward calls it (default KernelConfig)."""
    if impl == "mosaic":
        fn, kw = mosaic_gpu.chunk_grad_stored_pass, {}
    else:
        fn = pallas_gpu.chunk_grad_stored_pass
        kw = dict(block_v=64, num_warps=4, num_stages=3, block_k=32, loops="fori")  # KernelConfig().resolved
    return jax.jit(lambda *a: fn(*a, chunk=C, interpret=False, group=1, heads=heads, walk_operands=BF,
                                 key_shift=key_shift, **kw))


def check_values(rng, results) -> bool:
    ok = True
    cases = [dict(B=2, L=512, H=4, dk=128, dv=128, key_shift=True, segments=True, in_place=True),
             dict(B=2, L=512, H=4, dk=128, dv=128, key_shift=False, segments=True, in_place=True),
             dict(B=2, L=512, H=4, dk=128, dv=128, key_shift=True, segments=False, in_place=True),
             dict(B=1, L=64, H=2, dk=128, dv=128, key_shift=True, segments=True, in_place=True),
             dict(B=1, L=384, H=2, dk=64, dv=128, key_shift=True, segments=True, in_place=True),
             dict(B=1, L=256, H=2, dk=128, dv=64, key_shift=False, segments=True, in_place=True),
             dict(B=2, L=256, H=2, dk=128, dv=128, key_shift=False, segments=True, in_place=False),
             dict(B=3, L=320, H=1, dk=64, dv=64, key_shift=True, segments=True, in_place=False)]
    for case in cases:
        args = make_case(rng, case["B"], case["L"], case["H"], case["dk"], case["dv"], segments=case["segments"],
                         in_place=case["in_place"])
        heads = case["H"] if case["in_place"] else None
        want = reference(args, heads=heads, key_shift=case["key_shift"])
        label = ", ".join(f"{key}={val}" for key, val in case.items())
        errs = {}
        for impl in ("mosaic", "triton"):
            try:
                got = pass_call(impl, heads=heads, key_shift=case["key_shift"])(*args)
            except Exception as e:  # noqa: BLE001 - report every case, keep going
                print(f"FAIL  {impl} did not run: {type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:300]}  [{label}]",
                      flush=True)
                errs[impl] = None
                continue
            got = [head_major64(a, heads) if a.ndim == (4 if heads else 3) else np.asarray(a, np.float64)
                   for a in got]
            errs[impl] = ([rel_err(a, b) for a, b in zip(got, want)], all(bool(np.isfinite(a).all()) for a in got))
        if errs["mosaic"] is None or errs["triton"] is None:
            results.setdefault("values", []).append(dict(case, ok=False, error="did not run"))
            print("stopping: the other cases would fail the same way (a failed layout inference takes minutes)")
            return False
        passed = errs["mosaic"][1]
        for i, name in enumerate(NAMES):
            bound = 2 * errs["triton"][0][i] + 2.0**-9
            passed &= errs["mosaic"][0][i] <= bound
            print(f"  {name:5s} rel err mosaic {errs['mosaic'][0][i]:.3e}  triton {errs['triton'][0][i]:.3e}  "
                  f"(bound {bound:.3e})", flush=True)
        print(f"{'PASS' if passed else 'FAIL'}  {label}", flush=True)
        results.setdefault("values", []).append(dict(case, mosaic=errs["mosaic"], triton=errs["triton"], ok=passed))
        ok &= passed
    return ok


def time_passes(rng, results) -> None:
    rows = []
    for B, L in ((8, 2048), (2, 8192), (1, 32768)):
        H, d = 16, 128
        args = make_case(rng, B, L, H, d, d, segments=False, in_place=True)
        row = {"shape": f"{B}x{L}x{H}x{d}"}
        for impl in ("mosaic", "triton"):
            row[f"{impl} ms"] = time_jax(pass_call(impl, heads=H, key_shift=True), *args)
        row["mosaic / triton"] = row["mosaic ms"] / row["triton ms"]
        rows.append(row)
        print(row, flush=True)
    print_table(rows, ["shape", "mosaic ms", "triton ms", "mosaic / triton"])
    results["timing"] = rows


if __name__ == "__main__":
    sys.exit(values_then_timing(check_values, time_passes))
