"""The Mosaic GPU ``dstate_prepare`` (``pallas_kernels/decayed_delta_rule/mosaic_gpu.py``) on a Hopper GPU.

1. Values: V and the q-term against a float64 reference of the same rounded inputs, next to the Triton pass's
   error on the same inputs (``pallas_gpu.prepare_vb``, itself tested in interpret mode on CPU).  Cases: the
   keys read one row back in place or not, segment starts inside chunks, both token layouts, d = 64 and 128.
   PASS: no non-finite value, and the Mosaic error within 2x the Triton pass's + half a bf16 unit.
2. Time: both passes alone at the benchmark shapes (H16, d128, bf16, in place, keys one row back), with and
   without the q-term.

    python benchmarks/gpu_check_mosaic_prepare.py [--out FILE] [--skip-timing]
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


def make_case(rng, B, L, H, d, *, segments: bool):
    """Rounded bf16 q, keys, dO in ``[B, L, H, d]``; chunk-local g (inclusive cumsum of log γ), run index rl,
    and a T with the triangular inverse's shape and size, all ``[B·H, ...]``."""
    q, k, do = (jnp.asarray(rng.normal(size=(B, L, H, d)) / np.sqrt(d), BF) for _ in range(3))
    lg = -rng.uniform(0.001, 0.1, size=(B * H, L // C, C))
    g = np.cumsum(lg, axis=-1).reshape(B * H, L)
    starts = rng.random((B * H, L)) < (0.03 if segments else 0.0)
    run = np.cumsum(starts.reshape(B * H, L // C, C), axis=-1)
    rl = (run - run[..., :1]).reshape(B * H, L)
    low = np.tril(rng.normal(scale=0.2, size=(B * H, L // C, C, C)), -1) + np.eye(C)
    tinv = jnp.asarray(low.reshape(B * H, L, C), BF)
    return q, k, do, jnp.asarray(g, jnp.float32), jnp.asarray(rl, jnp.int32), tinv


def reference(q, k, do, g, rl, tinv, *, key_shift: bool):
    """float64 V ``[B·H, L, dv]`` and q-term ``[B·H, L/C, dk, dv]`` of the rounded inputs (``[B, L, H, d]``)."""
    B, L, H, _ = q.shape
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    qh, kh, doh = (np.swapaxes(f64(a), 1, 2).reshape(B * H, L, -1) for a in (q, k, do))
    x = np.concatenate([np.zeros_like(kh[:, :1]), kh[:, :-1]], axis=1) if key_shift else kh
    g, rl, tinv = np.asarray(g, np.float64), np.asarray(rl), f64(tinv)
    V = np.zeros_like(doh)
    qt = np.zeros((B * H, L // C, qh.shape[-1], doh.shape[-1]))
    tri = np.tril(np.ones((C, C), bool))
    for c in range(L // C):
        r = slice(c * C, (c + 1) * C)
        gc, rc = g[:, r], rl[:, r]
        keep = tri[None] & (rc[:, :, None] == rc[:, None, :])
        decay = np.where(keep, np.exp(np.where(keep, gc[:, :, None] - gc[:, None, :], 0.0)), 0.0)
        scores = np.einsum("btk,bsk->bts", qh[:, r], x[:, r]) * decay
        v_local = np.einsum("bts,btv->bsv", scores, doh[:, r])
        V[:, r] = np.einsum("bts,btv->bsv", tinv[:, r], v_local)  # Tᵀ Vloc
        cont = np.where(rc == 0, np.exp(gc), 0.0)
        qt[:, c] = np.einsum("btk,btv->bkv", qh[:, r], cont[:, :, None] * doh[:, r])
    return V, qt


def as_head_major(a):
    B, L, H, d = a.shape
    return jnp.swapaxes(a, 1, 2).reshape(B * H, L, d)


def pass_call(impl, *, heads, key_shift, q_term):
    """The jitted pass (``"mosaic"`` or ``"triton"``) as the op's backward calls it, on (q, keys, g, rl, T, dO);
    returns (V, None, q-term or None).  Neither reads η or g⁻ without B, so g stands in for them."""
    fn = mosaic_gpu.prepare_vb if impl == "mosaic" else pallas_gpu.prepare_vb
    kw = dict(chunk=C, heads=heads, v_dtype=BF, q_term_dtype=BF if q_term else None, key_shift=key_shift,
              with_b=False, walk_operands=BF, interpret=False)
    return jax.jit(lambda q, x, g, rl, tinv, do: fn(q, x, g, g, g, rl, tinv, do, **kw))


def check_values(rng, results) -> bool:
    ok = True
    cases = [dict(B=2, L=512, H=4, d=128, key_shift=False, segments=True, in_place=True, q_term=False),
             dict(B=2, L=512, H=4, d=128, key_shift=False, segments=True, in_place=True, q_term=True),
             dict(B=2, L=512, H=4, d=128, key_shift=True, segments=True, in_place=True, q_term=False),
             dict(B=2, L=512, H=4, d=128, key_shift=True, segments=True, in_place=True, q_term=True),
             dict(B=1, L=64, H=2, d=128, key_shift=True, segments=True, in_place=True, q_term=True),
             dict(B=1, L=384, H=2, d=64, key_shift=True, segments=False, in_place=True, q_term=True),
             dict(B=2, L=256, H=2, d=128, key_shift=False, segments=True, in_place=False, q_term=True),
             dict(B=3, L=320, H=1, d=128, key_shift=True, segments=True, in_place=False, q_term=True)]
    for case in cases:
        q, k, do, g, rl, tinv = make_case(rng, case["B"], case["L"], case["H"], case["d"], segments=case["segments"])
        V_ref, qt_ref = reference(q, k, do, g, rl, tinv, key_shift=case["key_shift"])
        B, L, H, _ = q.shape
        if case["in_place"]:
            args, heads = (q, k, do), H
            to_ref = lambda a: np.swapaxes(np.asarray(jnp.asarray(a, jnp.float32)), 1, 2).reshape(B * H, L, -1)  # noqa: E731
        else:
            args, heads = tuple(as_head_major(a) for a in (q, k, do)), None
            to_ref = lambda a: np.asarray(jnp.asarray(a, jnp.float32))  # noqa: E731
        errs = {}
        label = ", ".join(f"{key}={val}" for key, val in case.items())
        for impl in ("mosaic", "triton"):
            try:
                v, _, qt = pass_call(impl, heads=heads, key_shift=case["key_shift"], q_term=case["q_term"])(
                    args[0], args[1], g, rl, tinv, args[2])
            except Exception as e:  # noqa: BLE001 - report every case, keep going
                print(f"FAIL  {impl} did not run: {type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:300]}  [{label}]",
                      flush=True)
                errs[impl] = None
                continue
            finite = bool(jnp.all(jnp.isfinite(v.astype(jnp.float32))))
            qt_err = float("nan")
            if case["q_term"]:
                finite &= bool(jnp.all(jnp.isfinite(qt.astype(jnp.float32))))
                qt_err = rel_err(qt, qt_ref)
            errs[impl] = (rel_err(to_ref(v), V_ref), qt_err, finite)
        if errs["mosaic"] is None or errs["triton"] is None:
            results.setdefault("values", []).append(dict(case, ok=False, error="did not run"))
            print("stopping: the other cases would fail the same way (a failed layout inference takes minutes)")
            return False
        passed = errs["mosaic"][2]
        for i, name in enumerate(("V", "q-term") if case["q_term"] else ("V",)):
            bound = 2 * errs["triton"][i] + 2.0**-9
            passed &= errs["mosaic"][i] <= bound
            print(f"  {name:6s} rel err mosaic {errs['mosaic'][i]:.3e}  triton {errs['triton'][i]:.3e}  "
                  f"(bound {bound:.3e})  [{label}]", flush=True)
        print(f"{'PASS' if passed else 'FAIL'}  {label}", flush=True)
        results.setdefault("values", []).append(dict(case, mosaic=errs["mosaic"], triton=errs["triton"], ok=passed))
        ok &= passed
    return ok


def time_passes(rng, results) -> None:
    rows = []
    for B, L in ((8, 2048), (2, 8192), (1, 32768)):
        H, d = 16, 128
        q, k, do, g, rl, tinv = make_case(rng, B, L, H, d, segments=False)
        for q_term in (True, False):
            row = {"shape": f"{B}x{L}x{H}x{d}", "q-term": q_term}
            for impl in ("mosaic", "triton"):
                call = pass_call(impl, heads=H, key_shift=True, q_term=q_term)
                row[f"{impl} ms"] = time_jax(call, q, k, g, rl, tinv, do)
            row["mosaic / triton"] = row["mosaic ms"] / row["triton ms"]
            rows.append(row)
            print(row, flush=True)
    print_table(rows, ["shape", "q-term", "mosaic ms", "triton ms", "mosaic / triton"])
    results["timing"] = rows


if __name__ == "__main__":
    sys.exit(values_then_timing(check_values, time_passes))
