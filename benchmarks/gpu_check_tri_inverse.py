"""The delta rule's triangular inverse (``pallas_gpu.tri_inverse_pass``) on the GPU, in each of its variants.

1. Values: every chunk's ``T = (I + A)⁻¹`` against float64 inverses of the same rounded inputs, for each variant
   (``VARIANTS``: the elimination inside the 16-row diagonal blocks, one warp).  Cases: the keys read
   one row back in place (Falcon-1's call) or head-major without the shift, segment starts inside chunks, extreme
   gates (β = 1.999 on nearly parallel keys, decays at the clamp: T's entries reach ~1e6), d = 64 and 128, bf16
   and fp32 inputs.  PASS: every element finite, and each variant's error within 2x the row elimination's (the
   kernel's form until the twenty-second session) + half a unit of the stored dtype.
2. Time: each variant alone at the benchmark shapes (H16, d128, bf16, in place, keys one row back).

    python benchmarks/gpu_check_tri_inverse.py [--out FILE] [--skip-timing]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table, rel_err, time_jax, values_then_timing
from falcon_jax.kernels.decayed_delta_rule import pallas_gpu
from falcon_jax.kernels.decayed_delta_rule.api import _gates

C = 64
BASELINE = "rows, 1 warp"
VARIANTS = {BASELINE: dict(elimination="rows", num_warps=1),
            "columns, 1 warp": dict(elimination="columns", num_warps=1)}


def make_case(rng, B, L, H, d, *, dtype, segments: bool, extreme: bool):
    """Keys ``[B, L, H, d]`` in ``dtype``, and the kernel's ``[B·H, L]`` rows: η, chunk-local g, g⁻ and run index
    of the write features ``x_t = k_{t−1}``.  ``extreme``: keys within 5% of one direction, η‖x‖² = 1.999, and
    a third of the decays at the clamp γ = 1e-6."""
    k = rng.normal(size=(B, L, H, d)) / np.sqrt(d)
    if extreme:
        k = k[:, :1] + 0.05 * k
    k = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32), np.float64)  # what the kernel reads
    kh = np.swapaxes(k, 1, 2).reshape(B * H, L, d)
    x = np.concatenate([np.zeros_like(kh[:, :1]), kh[:, :-1]], axis=1)
    norm = np.maximum(np.sum(x * x, axis=-1), 1e-6)
    beta = np.full(norm.shape, 1.999) if extreme else rng.uniform(0.1, 1.9, size=norm.shape)
    log_gamma = (np.where(rng.uniform(size=norm.shape) < 0.33, np.log(1e-6), 0.0) if extreme
                 else -rng.uniform(0.001, 0.1, size=norm.shape))
    run = np.cumsum(rng.random(norm.shape) < (0.03 if segments else 0.0), axis=1)
    g, gp, rl = _gates(jnp.asarray(log_gamma, jnp.float32), jnp.asarray(run, jnp.int32), C)
    return jnp.asarray(k, dtype), x, jnp.asarray(beta / norm, jnp.float32), g, gp, rl


def reference(x, eta, g, gp, rl, chunk=C, group=1):
    """float64 ``[B·H, L, C]``: row cC + s holds row s of chunk c's ``(I + A)⁻¹``,
    ``A[s, j] = η_s (x_s·x_j) e^{g⁻_s − g_j}`` for j in an earlier group of ``group`` rows than s (group 1:
    j < s) in the same segment.  (The CPU tests check the kernel in interpret mode against it too.)"""
    BH, L, _ = x.shape
    n = L // chunk
    f64 = lambda a: np.asarray(a, np.float64).reshape(BH, n, chunk)  # noqa: E731
    eta, g, gp, rl = f64(eta), f64(g), f64(gp), f64(rl)
    xc = np.asarray(x, np.float64).reshape(BH, n, chunk, -1)
    step = np.arange(chunk) // group
    keep = (step[:, None] > step[None, :]) & (rl[..., :, None] == rl[..., None, :])
    expo = np.where(keep, gp[..., :, None] - g[..., None, :], -np.inf)
    A = eta[..., :, None] * np.einsum("bnsk,bnjk->bnsj", xc, xc) * np.exp(expo)
    return np.linalg.inv(np.eye(chunk) + A).reshape(BH, L, chunk)


def pass_call(variant, *, heads, key_shift, t_dtype):
    kw = dict(VARIANTS[variant], chunk=C, interpret=False, heads=heads, key_shift=key_shift, t_dtype=t_dtype)
    return jax.jit(lambda x, eta, g, gp, rl: pallas_gpu.tri_inverse_pass(x, eta, g, gp, rl, **kw))


def check_values(rng, results) -> bool:
    ok = True
    bf, f32 = jnp.bfloat16, jnp.float32
    cases = [dict(B=2, L=512, H=4, d=128, dtype=bf, segments=True, extreme=False, in_place=True),
             dict(B=2, L=512, H=4, d=128, dtype=bf, segments=False, extreme=True, in_place=True),
             dict(B=1, L=320, H=2, d=64, dtype=bf, segments=True, extreme=False, in_place=False),
             dict(B=2, L=256, H=2, d=128, dtype=f32, segments=True, extreme=False, in_place=True),
             dict(B=2, L=256, H=2, d=64, dtype=f32, segments=False, extreme=True, in_place=False)]
    for case in cases:
        spec = {key: val for key, val in case.items() if key not in ("dtype", "in_place")}
        k, x, eta, g, gp, rl = make_case(rng, **spec, dtype=case["dtype"])
        t_ref = reference(x, eta, g, gp, rl)
        B, L, H, d = k.shape
        if case["in_place"]:  # Falcon-1's call: [B, L, H, d] keys read one row back
            keys, heads, key_shift = k, H, True
        else:  # the write features themselves, head-major
            keys, heads, key_shift = jnp.asarray(x, case["dtype"]), None, False
        label = ", ".join(f"{key}={getattr(val, '__name__', val)}" for key, val in case.items())
        errs = {}
        for variant in VARIANTS:
            try:
                t = pass_call(variant, heads=heads, key_shift=key_shift, t_dtype=case["dtype"])(keys, eta, g, gp, rl)
            except Exception as e:  # noqa: BLE001 - report every variant, keep going
                print(f"FAIL  {variant} did not run: {type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:300]}"
                      f"  [{label}]", flush=True)
                errs[variant] = None
                continue
            t = np.asarray(jnp.asarray(t, f32))
            errs[variant] = (rel_err(t, t_ref), bool(np.all(np.isfinite(t))))
        base = errs[BASELINE]
        unit = 2.0**-9 if case["dtype"] == bf else 2.0**-24
        for variant, err in errs.items():
            passed = err is not None and base is not None and err[1] and err[0] <= 2 * base[0] + unit
            ok &= passed
            print(f"{'PASS' if passed else 'FAIL'}  {variant:18s} rel err {err[0] if err else float('nan'):.3e}  "
                  f"finite {err[1] if err else '-'}  [{label}]", flush=True)
            results.setdefault("values", []).append(dict(spec, dtype=jnp.dtype(case["dtype"]).name,
                                                         in_place=case["in_place"], variant=variant,
                                                         rel_err=err and err[0], ok=passed))
    return ok


def time_passes(rng, results) -> None:
    rows = []
    for B, L in ((8, 2048), (2, 8192), (1, 32768)):
        H, d = 16, 128
        k, _, eta, g, gp, rl = make_case(rng, B, L, H, d, dtype=jnp.bfloat16, segments=False, extreme=False)
        row = {"shape": f"{B}x{L}x{H}x{d}"}
        for variant in VARIANTS:
            call = pass_call(variant, heads=H, key_shift=True, t_dtype=jnp.bfloat16)
            row[variant] = time_jax(call, k, eta, g, gp, rl) * 1e3
        rows.append(row)
        print(row, flush=True)
    print("triangular inverse alone, us (bf16, in place, keys one row back)")
    print_table(rows, ["shape", *VARIANTS])
    results["timing us"] = rows


if __name__ == "__main__":
    sys.exit(values_then_timing(check_values, time_passes))
