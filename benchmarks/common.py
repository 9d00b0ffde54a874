"""Timing, memory and table helpers shared by the benchmark scripts (GPU machine)."""

from __future__ import annotations

import json
import statistics
import time

import jax


def time_jax(fn, *args, calls: int = 20, repeats: int = 7) -> float:
    """Median milliseconds per call of a jitted ``fn``: ``calls`` back-to-back calls per sample,
    so per-call dispatch overlaps with the previous call's kernels."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def time_torch(fn) -> float:
    """Median milliseconds of a torch callable (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def compiled_memory(fn, *args) -> int | None:
    """Temporary + output bytes of the compiled executable (XLA memory analysis)."""
    try:
        analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - some backends do not report it
        return None


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured on 4 GiB."""
    import jax.numpy as jnp

    x = jnp.ones((1 << 30,), jnp.float32)
    ms = time_jax(jax.jit(lambda a: a * 1.0), x, calls=5, repeats=5)
    return 2 * x.nbytes / (ms * 1e-3) / 1e9


def print_table(rows: list[dict], columns: list[str]) -> None:
    if not rows:  # e.g. --memory-only: no timing rows
        return
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}
    print(" | ".join(c.rjust(widths[c]) for c in columns))
    print("-+-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def write_json(path: str, payload) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2x8192x16x128"`` -> ``(2, 8192, 16, 128)`` (a ValueError names the text otherwise)."""
    try:
        return tuple(int(n) for n in text.strip().split("x"))
    except ValueError:
        raise ValueError(f"expected a BxTxHxD shape such as 2x8192x16x128, got {text!r}") from None


def kernel_config(text: str, config_class=None):
    """``KernelConfig`` of the regression kernels (or of ``config_class``, e.g. the inner-product kernels') from
    ``"name=value,..."`` (ints as ints, True/False/None as themselves; empty: None, the defaults), e.g.
    ``"tri_dtype=input,save_tri=True"``; an unknown name or value is an error naming it."""
    import dataclasses

    from pallas_kernels.decayed_delta_rule.api import KernelConfig as RegressionConfig

    config_class = config_class or RegressionConfig
    if not text.strip():
        return None
    fields = {f.name for f in dataclasses.fields(config_class)}
    kw = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in fields:
            raise ValueError(f"--kernel-config: {item!r} is not name=value with a KernelConfig field "
                             f"({', '.join(sorted(fields))})")
        literal = {"None": None, "True": True, "False": False}
        kw[name] = int(value) if value.lstrip("-").isdigit() else literal.get(value, value)
    return config_class(**kw)


def with_kernel_config(op, config):
    """``op`` with ``falcon(impl="pallas")``'s regression kernels on ``config`` while it runs (and traces)."""
    from falcon_jax.forms import chunk_pallas

    def wrapped(*args, **kwargs):
        saved, chunk_pallas.KERNEL_CONFIG = chunk_pallas.KERNEL_CONFIG, config
        try:
            return op(*args, **kwargs)
        finally:
            chunk_pallas.KERNEL_CONFIG = saved
    return wrapped

