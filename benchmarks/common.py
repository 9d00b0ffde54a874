"""Timing, memory and table helpers shared by the benchmark scripts (GPU machine)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np


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


def rel_err(a, b) -> float:
    """Max-norm relative error of ``a`` against the reference ``b`` (any float dtype, bf16 included)."""
    a, b = (np.asarray(x).astype(np.float64) for x in (a, b))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def finish_checks(results: dict, ok: bool, out: str | None) -> int:
    """A GPU check script's end: its JSON written (when ``out``), the verdict printed; the exit status."""
    if out:
        write_json(out, results)
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def values_then_timing(check_values, time_passes) -> int:
    """A kernel check script's ``main``: ``--out FILE`` (JSON) and ``--skip-timing``; ``check_values(rng, results)``
    (True when every case passes), then, if they all pass, ``time_passes(rng, results)``; the exit status
    (:func:`finish_checks`).  One seeded generator draws every case."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    t0 = time.time()
    ok = check_values(rng, results)
    results["values seconds"] = time.time() - t0
    if args.out:
        write_json(args.out, results)
    if ok and not args.skip_timing:
        time_passes(rng, results)
    return finish_checks(results, ok, args.out)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2x8192x16x128"`` -> ``(2, 8192, 16, 128)`` (a ValueError names the text otherwise)."""
    try:
        return tuple(int(n) for n in text.strip().split("x"))
    except ValueError:
        raise ValueError(f"expected a BxTxHxD shape such as 2x8192x16x128, got {text!r}") from None


def add_row_filter(parser, rows_note: str = "") -> None:
    """The benchmark scripts' ``--skip`` / ``--rows`` row selection (see :func:`row_filter`)."""
    parser.add_argument("--skip", default="", help="comma-separated substrings: rows whose name holds one are "
                        "not measured (e.g. 'xla,C=32')")
    parser.add_argument("--rows", default="", help="semicolon-separated substrings (names hold commas): only the "
                        f"rows whose name holds one are measured{rows_note} (default: all)")


def row_filter(args):
    """``wanted(name)``: a row is measured unless a ``--skip`` substring is in its name and, with ``--rows``, only
    if one of its substrings is."""
    skip = [t.strip() for t in args.skip.split(",") if t.strip()]
    only = [t.strip() for t in args.rows.split(";") if t.strip()]

    def wanted(name):
        return not any(t in name for t in skip) and (not only or any(t in name for t in only))
    return wanted


def selected_groups(parser, groups, only_text: str, skip_text: str | None = None) -> list:
    """The GPU checks' groups to run, in order: those named in ``only_text`` (``--only``, comma-separated; empty:
    all) less those in ``skip_text`` (``--skip``, where the script has it).  A name not in ``groups`` is a parser
    error: a misspelt group would otherwise run nothing and report that everything passed."""
    only = {g.strip() for g in only_text.split(",") if g.strip()}
    skip = {g.strip() for g in (skip_text or "").split(",") if g.strip()}
    if (only | skip) - set(groups):
        flags = "--only" if skip_text is None else "--skip/--only"
        parser.error(f"{flags}: unknown group(s) {sorted((only | skip) - set(groups))}; "
                     f"choose from {', '.join(groups)}")
    return [g for g in groups if g not in skip and (not only or g in only)]


def parsed_kernel_config(parser, text: str, config_class=None, flag: str = "--kernel-config"):
    """:func:`kernel_config`, a bad setting reported as a parser error naming ``flag``."""
    try:
        return kernel_config(text, config_class)
    except ValueError as e:
        parser.error(f"{flag}: {e}" if not str(e).startswith(flag) else str(e))


def kernel_config(text: str, config_class=None):
    """``KernelConfig`` of the regression kernels (or of ``config_class``, e.g. the inner-product kernels') from
    ``"name=value,..."`` (ints as ints, True/False/None as themselves; empty: None, the defaults), e.g.
    ``"tri_dtype=input,save_tri=True"``; an unknown name or value is an error naming it."""
    import dataclasses

    from falcon_jax.kernels.decayed_delta_rule.api import KernelConfig as RegressionConfig

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

