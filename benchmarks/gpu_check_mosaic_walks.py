"""The Mosaic GPU cluster walks (``pallas_kernels/decayed_delta_rule/mosaic_gpu_walks.py``) on a Hopper GPU.

1. Values: the output walk (o, end state) and the recompute walk (P, chunk start states h, end state) against a
   float64 walk of the same rounded inputs (T and the masked scores as the Triton passes form them on the GPU),
   next to the Triton walk's error on the same inputs (``pallas_gpu.forward_pass``, tested in interpret mode
   on CPU).  Cases: both token layouts, segment starts inside chunks, a nonzero initial state, d 64 and 128,
   value blocks of 16, 32 and 64 columns, one chunk; both forms of the step (``form="smem"``, ``"registers"``).
   PASS: every value finite, and each error within 2x the Triton walk's + half a bf16 unit.
2. Time: both walks alone at the benchmark shapes (H16, d128, bf16, in place), the Triton walk as the op runs
   it (its value block and stages), the Mosaic walk for each form, block width and pipeline depth (the depth
   is capped by what fits the SMEM).

    python benchmarks/gpu_check_mosaic_walks.py [--out FILE] [--skip-timing]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import finish_checks, print_table, rel_err, time_jax, write_json
from falcon_jax.kernels.decayed_delta_rule import mosaic_gpu_walks, pallas_gpu
from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig

C = 64
BF = jnp.bfloat16


def make_case(rng, B, L, H, dk, dv, *, segments: bool, s0_scale: float = 1.0, first_row_zero: bool = False,
              interpret: bool = False):
    """Rounded bf16 q, write features x, y in ``[B, L, H, d]``; η, chunk-local g, g⁻ and run index ``[B·H, L]``;
    the fp32 initial state ``[B·H, 1, dk, dv]``; and T and the masked scores as the Triton passes form them.
    ``first_row_zero``: x's row 0 is zero (the write features of keys read one row back, :func:`as_keys`)."""
    q, x = (jnp.asarray(rng.normal(size=(B, L, H, dk)) / np.sqrt(dk), BF) for _ in range(2))
    if first_row_zero:
        x = x.at[:, 0].set(0)
    y = jnp.asarray(rng.normal(size=(B, L, H, dv)), BF)
    norms = np.swapaxes(np.asarray(jnp.asarray(x, jnp.float32), np.float64) ** 2, 1, 2).sum(-1).reshape(B * H, L)
    eta = rng.uniform(0.2, 1.9, size=(B * H, L)) / (norms + 0.05)
    lg = -rng.uniform(0.001, 0.1, size=(B * H, L // C, C))
    g = np.cumsum(lg, axis=-1)
    gp = (g - lg).reshape(B * H, L)
    starts = rng.random((B * H, L)) < (0.03 if segments else 0.0)
    run = np.cumsum(starts.reshape(B * H, L // C, C), axis=-1)
    rl = (run - run[..., :1]).reshape(B * H, L)
    s0 = jnp.asarray(s0_scale * rng.normal(size=(B * H, 1, dk, dv)) / np.sqrt(dk), jnp.float32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    eta, g, gp, rl = f32(eta), f32(g.reshape(B * H, L)), f32(gp), jnp.asarray(rl, jnp.int32)
    tinv = pallas_gpu.tri_inverse_pass(x, eta, g, gp, rl, chunk=C, interpret=interpret, heads=H, t_dtype=BF,
                                       num_warps=1)
    scores = pallas_gpu.masked_scores_pass(q, x, g, rl, chunk=C, interpret=interpret, heads=H, dtype=BF)
    return q, x, y, eta, g, gp, rl, tinv, s0, scores


def reference(q, x, y, eta, g, gp, rl, tinv, s0, scores):
    """float64 walk of the rounded inputs (``[B, L, H, d]`` tokens): o, P ``[B·H, L, dv]``, h ``[B·H, n, dk, dv]``
    and the end state ``[B·H, dk, dv]``."""
    B, L, H, _ = q.shape
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    qh, xh, yh = (np.swapaxes(f64(a), 1, 2).reshape(B * H, L, -1) for a in (q, x, y))
    eta, g, gp, rl, tinv, scores = (f64(a) for a in (eta, g, gp, rl, tinv, scores))
    S = f64(s0)[:, 0]
    n = L // C
    o, P = np.zeros_like(yh), np.zeros_like(yh)
    h = np.zeros((B * H, n, *S.shape[1:]))
    for c in range(n):
        r = slice(c * C, (c + 1) * C)
        gc, gpc, rc = g[:, r], gp[:, r], rl[:, r]
        first = rc == 0
        cont, cont_p = np.where(first, np.exp(gc), 0.0), np.where(first, np.exp(gpc), 0.0)
        w = np.where(rc == rc[:, -1:], np.exp(gc[:, -1:] - gc), 0.0)
        a = np.where(rc[:, -1] == 0, np.exp(gc[:, -1]), 0.0)
        h[:, c] = S
        resid = eta[:, r, None] * (yh[:, r] - cont_p[..., None] * np.einsum("btk,bkv->btv", xh[:, r], S))
        P[:, r] = np.einsum("bts,bsv->btv", tinv[:, r], resid)
        o[:, r] = np.einsum("bts,bsv->btv", scores[:, r], P[:, r]) + cont[..., None] * np.einsum(
            "btk,bkv->btv", qh[:, r], S)
        S = a[:, None, None] * S + np.einsum("btk,btv->bkv", xh[:, r], w[..., None] * P[:, r])
    return o, P, h, S


def as_keys(x):
    """The keys whose rows read one row back are the write features x (x's row 0 zero): ``k[t] = x[t + 1]``."""
    return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)


def reverse_reference(x, eta, g, gp, rl, tinv, v, q_term, ds_end):
    """float64 split reverse walk of the rounded inputs (x, v ``[B, L, H, d]``, the q-term ``[B·H, n, dk, dv]``,
    ds_end ``[B·H, 1, dk, dv]``): dR ``[B·H, L, dv]``, dh ``[B·H, n, dk, dv]``, dS_start ``[B·H, dk, dv]``."""
    B, L, H, _ = x.shape
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    xh, vh = (np.swapaxes(f64(a), 1, 2).reshape(B * H, L, -1) for a in (x, v))
    eta, g, gp, rl, tinv, qt = (f64(a) for a in (eta, g, gp, rl, tinv, q_term))
    dS = f64(ds_end)[:, 0]
    n = L // C
    dr, dh = np.zeros_like(vh), np.zeros_like(qt)
    for c in reversed(range(n)):
        r = slice(c * C, (c + 1) * C)
        gc, gpc, rc = g[:, r], gp[:, r], rl[:, r]
        cont_p = np.where(rc == 0, np.exp(gpc), 0.0)
        w = np.where(rc == rc[:, -1:], np.exp(gc[:, -1:] - gc), 0.0)
        a = np.where(rc[:, -1] == 0, np.exp(gc[:, -1]), 0.0)
        dh[:, c] = dS
        xds = w[..., None] * np.einsum("btk,bkv->btv", xh[:, r], dS)
        dr[:, r] = vh[:, r] + np.einsum("bst,bsv->btv", tinv[:, r], xds)
        dS = (a[:, None, None] * dS + qt[:, c]
              - np.einsum("btk,btv->bkv", xh[:, r], (eta[:, r] * cont_p)[..., None] * dr[:, r]))
    return dr, dh, dS


def q_term_reference(q, do, g, rl):
    """float64 ``(c ⊙ Q)ᵀ dO`` per chunk of the rounded q, dO ``[B, L, H, d]`` (c_t = e^{g_t} while the chunk's
    first segment runs, else 0): ``[B·H, L/C, dk, dv]``."""
    B, L, H, _ = q.shape
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    qh, doh = (np.swapaxes(f64(a), 1, 2).reshape(B * H, L // C, C, -1) for a in (q, do))
    cont = np.where(f64(rl) == 0, np.exp(f64(g)), 0.0).reshape(B * H, L // C, C)
    return np.einsum("bntk,bntv->bnkv", cont[..., None] * qh, doh)


def v_reference(q, x, do, g, rl, tinv):
    """float64 ``V = Tᵀ (QXᵀ ⊙ D)ᵀ dO`` per chunk of the rounded q, x (the write features), dO ``[B, L, H, d]``
    and T: ``[B·H, L, dv]``."""
    B, L, H, _ = q.shape
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    n = L // C
    qh, xh, doh = (np.swapaxes(f64(a), 1, 2).reshape(B * H, n, C, -1) for a in (q, x, do))
    gc, rc, tc = f64(g).reshape(B * H, n, C), f64(rl).reshape(B * H, n, C), f64(tinv).reshape(B * H, n, C, C)
    keep = (np.tril(np.ones((C, C), bool)) & (rc[..., :, None] == rc[..., None, :]))
    decay = np.where(keep, np.exp(np.where(keep, gc[..., :, None] - gc[..., None, :], 0.0)), 0.0)
    scores = np.einsum("bntk,bnsk->bnts", qh, xh) * decay
    v = np.einsum("bnsj,bnts,bntv->bnjv", tc, scores, doh)
    return v.reshape(B * H, L, -1)


# what the reverse walk is given: V and the q-term ("given", as prepare_vb writes both), V alone (the q-term formed
# in the walk), or neither (both formed in the walk; the Triton walk, which cannot, reads V from Triton's prepare_vb)
REVERSE_MODES = ("given", "q in walk", "v and q in walk")


def reverse_call(impl, mode="given"):
    """The jitted split reverse walk (``"mosaic"`` or ``"triton"``) as Falcon-1's backward calls it (in place,
    keys one row back, B from T, dR and dh written), on (x as keys, q, dO, η, g, g⁻, rl, T, V, q-term, ds_end) with
    ``heads`` from x's shape; ``mode`` (:data:`REVERSE_MODES`) says which of V and the q-term it is given."""
    def run(keys, q, do, eta, g, gp, rl, tinv, v, q_term, ds_end):
        H = keys.shape[2]
        if mode == "v and q in walk" and impl == "triton":
            v, _, _ = pallas_gpu.prepare_vb(q, keys, eta, g, gp, rl, tinv, do, chunk=C, interpret=False, heads=H,
                                            v_dtype=BF, with_b=False, walk_operands=BF, key_shift=True)
        elif mode == "v and q in walk":
            v = None
        if mode != "given":
            q_term = None
        kw = dict(chunk=C, pieces=1, block_v=64, write_dh=True, vb=(v, None, q_term), write_dr=BF, b_from_t=True,
                  walk_operands=BF, heads=H, key_shift=True)
        if impl == "mosaic":
            return mosaic_gpu_walks.reverse_walk(q, keys, eta, g, gp, rl, tinv, do, ds_end, **kw)
        return pallas_gpu.state_grad_split_pass(q, keys, eta, g, gp, rl, tinv, do, ds_end, interpret=False,
                                                num_warps=4, num_stages=3, **kw)

    return jax.jit(run)


def check_reverse(rng, results) -> bool:
    """The Mosaic reverse walk's dR, dh and dS_start against float64, next to the Triton walk's, in each of
    :data:`REVERSE_MODES`."""
    ok = True
    for B, L, H, d, segments in ((2, 512, 4, 128, True), (1, 64, 2, 128, True), (1, 384, 2, 64, False),
                                 (1, 4096, 2, 128, False)):
        q, x, y, eta, g, gp, rl, tinv, s0, _ = make_case(rng, B, L, H, d, d, segments=segments,
                                                         first_row_zero=True)
        do = jnp.asarray(rng.normal(size=(B, L, H, d)), BF)
        given_v = y
        given = jnp.asarray(rng.normal(size=(B * H, L // C, d, d)) / np.sqrt(d), BF)
        for mode in REVERSE_MODES:
            q_term = given if mode == "given" else q_term_reference(q, do, g, rl)
            if mode == "v and q in walk":
                v = v_reference(q, x, do, g, rl, tinv)
                v = np.swapaxes(v.reshape(B, H, L, d), 1, 2)  # [B, L, H, dv], as reverse_reference takes V
                want = reverse_reference(x, eta, g, gp, rl, tinv, v, q_term, s0)
            else:
                want = reverse_reference(x, eta, g, gp, rl, tinv, given_v, q_term, s0)
            errs = {}
            for impl in ("mosaic", "triton"):
                try:
                    dr, dh, ds = reverse_call(impl, mode)(as_keys(x), q, do, eta, g, gp, rl, tinv, given_v, given, s0)
                    jax.block_until_ready(ds)
                except Exception as e:  # noqa: BLE001
                    print(f"FAIL  reverse walk: {impl} ({mode}) did not run: "
                          f"{type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:400]}", flush=True)
                    results.setdefault("reverse", []).append(dict(B=B, L=L, H=H, d=d, mode=mode, ok=False,
                                                                  error=impl))
                    return False
                finite = all(bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))) for a in (dr, dh, ds))
                errs[impl] = dict(dR=rel_err(_as_ref_tokens(dr, True, B, L, H), want[0]), dh=rel_err(dh, want[1]),
                                  ds=rel_err(ds[:, 0], want[2]), finite=finite)
            passed = errs["mosaic"]["finite"]
            for name in ("dR", "dh", "ds"):
                bound = 2 * errs["triton"][name] + 2.0**-9
                passed &= errs["mosaic"][name] <= bound
                print(f"  {name:3s} rel err mosaic {errs['mosaic'][name]:.3e}  triton {errs['triton'][name]:.3e}  "
                      f"(bound {bound:.3e})", flush=True)
            print(f"{'PASS' if passed else 'FAIL'}  reverse walk  [B={B}, L={L}, H={H}, d={d}, segments={segments}, "
                  f"{mode}]", flush=True)
            results.setdefault("reverse", []).append(dict(B=B, L=L, H=H, d=d, segments=segments, mode=mode,
                                                          ok=passed, mosaic=errs["mosaic"], triton=errs["triton"]))
            ok &= passed
    return ok


def time_reverse(rng, results) -> None:
    """Each reverse walk alone at 8x2048x16x128 in each of :data:`REVERSE_MODES` (V, the q-term and dO fresh jit
    arguments: XLA copies what the in-place kernels write over, which the op does not; the Triton walk's
    "v and q in walk" includes Triton's prepare_vb)."""
    rows = []
    B, L, H, d = 8, 2048, 16, 128
    q, x, y, eta, g, gp, rl, tinv, s0, _ = make_case(rng, B, L, H, d, d, segments=False, first_row_zero=True)
    q_term = jnp.asarray(rng.normal(size=(B * H, L // C, d, d)) / np.sqrt(d), BF)
    do = jnp.asarray(rng.normal(size=(B, L, H, d)), BF)
    args = (as_keys(x), q, do, eta, g, gp, rl, tinv, y, q_term, s0)
    for mode in REVERSE_MODES:
        row = {"shape": f"{B}x{L}x{H}x{d}", "walk": "reverse", "given": mode}
        for impl in ("triton", "mosaic"):
            row[f"{impl} ms"] = time_jax(reverse_call(impl, mode), *args)
        print(row, flush=True)
        rows.append(row)
    results["reverse timing"] = rows


def walk_call(impl, *, heads, outputs, block_v, stages, n_heads, form="smem", key_shift=False):
    """The jitted walk (``"mosaic"`` or ``"triton"``) on (q, x, y, η, g, g⁻, rl, T, s0, scores): the output walk
    (``outputs``: o, end state) or the recompute walk (P, h, end state); ``key_shift``: x holds the keys, read
    one row back."""
    kw = dict(chunk=C, heads=heads, block_v=block_v, walk_operands=BF, write_o=outputs, write_p=not outputs,
              write_h=not outputs, key_shift=key_shift)
    if impl == "mosaic":
        fn, kw = mosaic_gpu_walks.forward_walk, dict(kw, stages=stages, form=form)
    else:
        fn, kw = pallas_gpu.forward_pass, dict(kw, pieces=1, interpret=False, num_warps=4, num_stages=stages)

    def run(q, x, y, eta, g, gp, rl, tinv, s0, scores):
        return fn(q, x, y, eta, g, gp, rl, tinv, s0, scores=scores if outputs else None, **kw)

    return jax.jit(run)


def _as_ref_tokens(a, in_place, B, L, H):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    return np.swapaxes(a, 1, 2).reshape(B * H, L, -1) if in_place else a


def _head_major(a):
    B, L, H, d = a.shape
    return jnp.swapaxes(a, 1, 2).reshape(B * H, L, d)


def check_values(rng, results) -> bool:
    """Every case of each form until one fails (that form is then not timed); True when all pass."""
    ok, failed_forms = True, set()
    cases = [dict(B=2, L=512, H=4, dk=128, dv=128, block_v=64, segments=True, in_place=True, form="registers"),
             dict(B=2, L=256, H=4, dk=128, dv=128, block_v=64, segments=True, in_place=True, form="registers",
                  key_shift=True),  # Falcon-1's call: the keys one row back, read in place (Mosaic: shifted copy)
             dict(B=1, L=64, H=2, dk=128, dv=128, block_v=64, segments=True, in_place=True, form="registers"),
             dict(B=1, L=384, H=2, dk=64, dv=64, block_v=64, segments=False, in_place=True, form="registers"),
             dict(B=3, L=320, H=1, dk=128, dv=128, block_v=64, segments=True, in_place=False, form="registers"),
             dict(B=1, L=4096, H=2, dk=128, dv=128, block_v=64, segments=False, in_place=True, form="registers"),
             dict(B=2, L=512, H=4, dk=128, dv=128, block_v=16, segments=True, in_place=True),
             dict(B=2, L=512, H=4, dk=128, dv=128, block_v=32, segments=True, in_place=True),
             dict(B=2, L=512, H=4, dk=128, dv=128, block_v=64, segments=True, in_place=True),
             dict(B=1, L=64, H=2, dk=128, dv=128, block_v=16, segments=True, in_place=True),
             dict(B=1, L=384, H=2, dk=64, dv=64, block_v=16, segments=False, in_place=True),
             dict(B=3, L=320, H=1, dk=128, dv=128, block_v=16, segments=True, in_place=False),
             dict(B=1, L=4096, H=2, dk=128, dv=128, block_v=16, segments=False, in_place=True)]
    for case in cases:
        B, L, H = case["B"], case["L"], case["H"]
        key_shift = case.get("key_shift", False)
        inputs = make_case(rng, B, L, H, case["dk"], case["dv"], segments=case["segments"], first_row_zero=key_shift)
        o_ref, p_ref, h_ref, s_ref = reference(*inputs)
        q, x, y, *rest = inputs
        if key_shift:
            x = as_keys(x)
        if not case["in_place"]:
            q, x, y = (_head_major(a) for a in (q, x, y))
        heads = H if case["in_place"] else None
        label = ", ".join(f"{key}={val}" for key, val in case.items())
        form = case.get("form", "smem")
        if form in failed_forms:
            continue
        for outputs in (True, False):
            errs = {}
            for impl in ("mosaic", "triton"):
                block_v = case["block_v"] if impl == "mosaic" else min(32, case["dv"])
                try:
                    outs = walk_call(impl, heads=heads, outputs=outputs, block_v=block_v, stages=3, n_heads=H,
                                     form=form, key_shift=key_shift)(q, x, y, *rest)
                    jax.block_until_ready(outs)
                except Exception as e:  # noqa: BLE001 - report; this form is then left out of the timing
                    print(f"FAIL  {impl} did not run: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [repr(e)])[0][:400]}  [{label}]", flush=True)
                    results.setdefault("values", []).append(dict(case, outputs=outputs, ok=False,
                                                                 error=f"{impl} did not run"))
                    failed_forms.add(form)
                    ok = False
                    break
                finite = all(bool(jnp.all(jnp.isfinite(jnp.asarray(a, jnp.float32)))) for a in outs)
                if outputs:
                    o, s_end = outs
                    errs[impl] = dict(o=rel_err(_as_ref_tokens(o, case["in_place"], B, L, H), o_ref),
                                      s_end=rel_err(s_end[:, 0], s_ref), finite=finite)
                else:
                    p, h, s_end = outs
                    errs[impl] = dict(P=rel_err(_as_ref_tokens(p, case["in_place"], B, L, H), p_ref),
                                      h=rel_err(h, h_ref), s_end=rel_err(s_end[:, 0], s_ref), finite=finite)
            if form in failed_forms:  # did not run
                break
            passed = errs["mosaic"]["finite"]
            for name in errs["mosaic"]:
                if name == "finite":
                    continue
                bound = 2 * errs["triton"][name] + 2.0**-9
                passed &= errs["mosaic"][name] <= bound
                print(f"  {name:5s} rel err mosaic {errs['mosaic'][name]:.3e}  triton {errs['triton'][name]:.3e}  "
                      f"(bound {bound:.3e})", flush=True)
            walk = "output walk" if outputs else "recompute walk"
            print(f"{'PASS' if passed else 'FAIL'}  {walk}  [{label}]", flush=True)
            results.setdefault("values", []).append(dict(case, outputs=outputs, mosaic=errs["mosaic"],
                                                         triton=errs["triton"], ok=passed))
            ok &= passed
            if not passed:
                failed_forms.add(form)
                break
    results["forms failed"] = sorted(failed_forms)
    return ok


def time_passes(rng, results) -> None:
    rows = []
    for B, L in ((1, 32768), (2, 8192), (8, 2048)):
        H, d = 16, 128
        inputs = make_case(rng, B, L, H, d, d, segments=False)
        config = KernelConfig()
        for outputs in (True, False):
            walk = "output" if outputs else "recompute"
            tri_block = config.block_v_for(B * H, d, BF, d)
            tri_stages = config.walk_stages(None, B * H * (d // tri_block) if outputs else 0)
            row = {"shape": f"{B}x{L}x{H}x{d}", "walk": walk,
                   "triton ms": time_jax(walk_call("triton", heads=H, outputs=outputs, block_v=tri_block,
                                                   stages=tri_stages, n_heads=H), *inputs),
                   "triton block": tri_block}
            for form, block_v, stages in (("smem", 32, 3), ("smem", 64, 3), ("registers", 64, 2),
                                          ("registers", 64, 3), ("registers", 64, 4)):
                if form in results.get("forms failed", ()):
                    continue
                try:
                    ms = time_jax(walk_call("mosaic", heads=H, outputs=outputs, block_v=block_v, stages=stages,
                                            n_heads=H, form=form), *inputs)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at this depth
                    print(f"  mosaic {form} {block_v} columns, {stages} stages: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [repr(e)])[0][:200]}", flush=True)
                    continue
                row[f"{form} {block_v}/{stages}"] = ms
            rows.append(row)
            print(row, flush=True)
    columns = ["shape", "walk", "triton block", "triton ms"] + sorted({k for r in rows for k in r if
                                                                       k.startswith(("smem", "registers"))})
    print_table(rows, columns)
    results["timing"] = rows


def main() -> int:
    """As ``values_then_timing``, but the forms that passed are timed even when another failed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--reverse-only", action="store_true", help="only the reverse walk (values, then timing)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    t0 = time.time()
    ok = True
    if not args.reverse_only:
        ok = check_values(rng, results)
    reverse_ok = check_reverse(rng, results)
    ok &= reverse_ok
    results.setdefault("forms failed", [])
    results["values seconds"] = time.time() - t0
    if args.out:
        write_json(args.out, results)
    if not args.skip_timing and reverse_ok:
        time_reverse(rng, results)
    if not args.skip_timing and not args.reverse_only and len(results["forms failed"]) < 2:
        time_passes(rng, results)
    return finish_checks(results, ok, args.out)


if __name__ == "__main__":
    sys.exit(main())
