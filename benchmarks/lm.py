"""The ``lm`` suite's measurements, run inside a ``benchmarks.worker`` process (one process per configuration,
started by :mod:`benchmarks.lm_suite`).

One configuration is a mixer name and a shape ``B × T``: the ``lm-130m`` preset's model (``train/config.py``:
D = 768, 12 layers, 12 heads of 64, SwiGLU 2048, vocabulary 50304, chunk 64, bf16 compute, fp32 parameters)
with that mixer, and the trainer's own train step (``falcon_jax.train.trainer.make_train_step``: forward,
backward, global-norm clipping and AdamW from ``falcon_jax.train.optim.make_optimizer`` with the preset's
settings, parameters and optimizer state donated).  ``--smoke`` uses the ``tiny`` model size instead.

* :func:`prepare`: build the model eagerly (``train.init="eager"``, the trainer's default), the optimizer
  state and a batch of random tokens, then trace and compile the step (timed apart: ``lower_s`` and
  ``compile_s``; on a GPU with ``xla_enable_command_buffers_during_profiling=false``, which affects profiled
  steps only: they launch the CUDA graphs' kernels one at a time, each naming its instruction; and with
  ``autotune_cache``, a folder of XLA's per-fusion autotuning results shared by the run's processes);
* :func:`measure`: time the step (``warmup`` steps, then the median over ``repeats`` samples of the mean time
  of ``calls`` back-to-back steps), read the process's peak device memory, and profile ``profile_steps``
  steps to split their device time by named scope (:mod:`benchmarks.trace_scopes`) and to find the time
  spent in the mixers' own kernels by kernel name.

The batch has no ``segment_ids`` (every row one sequence, so the Transformer takes cuDNN attention on a
GPU) unless ``packed``: then ``segment_ids`` of zeros, as the trainer's text loader passes, which sends the
mixers down their segment-aware paths (the Transformer to the Pallas flash attention with the ids in the
kernel, ``falcon_jax.kernels.flash_attention``: ``kernels`` reads ``triton``).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import trace_scopes

SCOPES = ("mixer", "mixer/core")
STATE: dict = {}
UNKNOWN_OPTION_EFFECTS = {
    "xla_gpu_per_fusion_autotune_cache_dir": "autotuning results not shared",
    "xla_enable_command_buffers_during_profiling": "the profiled step runs as this XLA runs it under a profiler",
}


def _config(mixer: str, smoke: bool):
    from falcon_jax.nn.config import SIZES
    from falcon_jax.train.config import PRESETS, TrainConfig

    cfg = TrainConfig.from_dict(PRESETS["lm-130m"])
    cfg.model["mixer"] = mixer
    if smoke:
        cfg.model.update(SIZES["tiny"])
    return cfg


def _batch(batch: int, length: int, vocab: int, packed: bool, seed: int = 0) -> dict:
    """A trainer batch ``[1, B, T + 1]`` (one micro-batch; the model reads T tokens, the loss the next ones)."""
    rng = np.random.default_rng(seed)
    shape = (1, batch, length + 1)
    out = {"tokens": rng.integers(0, vocab, shape, dtype=np.int32), "loss_mask": np.ones(shape, bool)}
    if packed:
        out["segment_ids"] = np.zeros(shape, np.int32)
    return {k: jnp.asarray(v) for k, v in out.items()}


def prepare(req: dict) -> dict:
    """Build and compile one configuration (``req``: mixer, batch, length, packed, smoke); kept in
    ``STATE`` for :func:`measure`."""
    from flax import nnx

    from falcon_jax.nn import FalconLM
    from falcon_jax.train.optim import make_optimizer
    from falcon_jax.train.trainer import make_train_step

    cfg = _config(req["mixer"], bool(req.get("smoke")))
    lm_cfg = cfg.lm_config()
    t0 = time.perf_counter()
    model = FalconLM(lm_cfg, rngs=nnx.Rngs(cfg.train.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx, _ = make_optimizer(cfg.optim, cfg.train.steps, params)
    opt_state = jax.jit(tx.init)(params)
    batch = _batch(req["batch"], req["length"], lm_cfg.vocab_size, bool(req.get("packed")))
    jax.block_until_ready((params, opt_state, batch))
    t1 = time.perf_counter()
    lowered = make_train_step(graphdef, tx).lower(params, rest, opt_state, batch)
    t2 = time.perf_counter()
    lower_s = t2 - t1
    options = {}
    if jax.default_backend() == "gpu":
        # a profiled step runs the CUDA graphs' thunks one by one, so that each kernel's launch names its HLO
        # instruction (inside a graph every kernel names the graph); steps run without a profiler keep the graphs
        options["xla_enable_command_buffers_during_profiling"] = False
        if req.get("autotune_cache"):
            # XLA's per-fusion autotuning results, shared by the run's processes (the layers and the MLP are
            # the same in every configuration: their GEMMs are tuned once, by the first compile, on a quiet GPU)
            options["xla_gpu_per_fusion_autotune_cache_dir"] = req["autotune_cache"]
    notes = {}
    compiled, t2 = compile_with(lowered, options, notes)
    t3 = time.perf_counter()
    hlo = compiled.as_text()
    prog = trace_scopes.program(hlo)
    STATE.clear()
    STATE.update(compiled=compiled, params=params, rest=rest, opt_state=opt_state, batch=batch, program=prog,
                 tokens=req["batch"] * req["length"])
    row = {"init_s": round(t1 - t0, 2), "lower_s": round(lower_s, 2), "compile_s": round(t3 - t2, 2),
           "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
           "kernels": "+".join(trace_scopes.kernel_families(hlo, "mixer/core", prog.names)) or "xla",
           "hlo_module": prog.module,
           "model": {k: v for k, v in cfg.model.items() if k != "mixer"}, "notes": notes}
    analysis = compiled.memory_analysis()
    if analysis is not None:
        row["compiled_bytes"] = {k: int(getattr(analysis, f"{k}_size_in_bytes"))
                                 for k in ("argument", "output", "temp", "alias")}
    return row


def compile_with(lowered, options: dict, notes: dict):
    """``(lowered.compile(...), start time of the compile that succeeded)`` with XLA ``options``, dropping any
    option this XLA does not know (each noted in ``notes``, with what its absence means) and compiling again."""
    options = dict(options)
    while True:
        start = time.perf_counter()
        try:
            return lowered.compile(compiler_options=options or None), start
        except Exception as e:  # noqa: BLE001 - an XLA without an option: compile without it
            if not options or "No such compile option" not in str(e):
                raise
            for key in [k for k in options if k in str(e)] or list(options):
                del options[key]
                notes[key] = f"this XLA has no {key}: " + UNKNOWN_OPTION_EFFECTS.get(key, "compiled without it")


def _steps(n: int):
    """Run ``n`` train steps back to back; returns the last step's metrics (not waited for)."""
    s = STATE
    metrics = None
    for _ in range(n):
        s["params"], s["opt_state"], metrics = s["compiled"](s["params"], s["rest"], s["opt_state"], s["batch"])
    return metrics


def measure(req: dict) -> dict:
    """Time, peak memory and the scope split of the prepared configuration (``req["timing"]``:
    warmup, calls, repeats, profile_steps)."""
    from falcon_jax.train.trainer import peak_device_memory

    timing = req["timing"]
    for _ in range(timing["warmup"]):
        jax.block_until_ready(_steps(1))
    samples = []
    metrics = None
    for _ in range(timing["repeats"]):
        start = time.perf_counter()
        metrics = jax.block_until_ready(_steps(timing["calls"]))
        samples.append((time.perf_counter() - start) / timing["calls"])
    step_s = statistics.median(samples)
    row = {"step_ms": step_s * 1e3, "tokens_per_s": STATE["tokens"] / step_s,
           "step_ms_samples": [round(t * 1e3, 3) for t in samples], "peak_bytes": peak_device_memory(),
           "loss": float(metrics["loss"]), "notes": {}}
    if not math.isfinite(row["loss"]):
        row["notes"]["loss"] = f"not finite ({row['loss']})"
    row.update(_profile(timing["profile_steps"], row["notes"]))
    return row


def _profile(steps: int, notes: dict) -> dict:
    """Device time per step and its split by named scope, from a trace of ``steps`` steps
    (:func:`benchmarks.trace_scopes.scope_times`).

    ``mixer_share`` and ``core_share`` are ``None`` when more than ``MAX_UNATTRIBUTED`` of the device time
    matches no instruction of the step (they would count only the part that did);
    ``mixer_kernels_share`` (kernel names alone) stands regardless.  ``attributed_by``: the share each
    matching method covered; ``unattributed_top``: the largest unattributed kernels, ms per step, with their
    args, so that a trace the attribution does not read shows what it holds."""
    if steps < 1:
        return {}
    host = jax.default_backend() == "cpu"
    try:
        with tempfile.TemporaryDirectory(prefix="falcon-lm-trace-") as log_dir:
            jax.profiler.start_trace(log_dir)
            try:
                start = time.perf_counter()
                jax.block_until_ready(_steps(steps))
                wall = time.perf_counter() - start
            finally:
                jax.profiler.stop_trace()
            events = trace_scopes.load_trace(log_dir)
        split = trace_scopes.scope_times(events, STATE["program"], SCOPES, host=host)
        named = trace_scopes.named_kernel_time(events, host=host)
    except Exception as e:  # noqa: BLE001 - the timing stands without the profile
        notes["profile"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        return {}
    total = split["total_us"]
    if not total:
        notes["profile"] = "the trace holds no device events (on a GPU the profiler reads them through CUPTI)"
        return {}
    unattributed = split["unattributed_us"] / total
    shares_hold = unattributed <= trace_scopes.MAX_UNATTRIBUTED
    if not shares_hold:
        notes["profile"] = (f"{unattributed:.0%} of the device time matches no instruction of the step: mixer and "
                            "core shares withheld (unattributed_top lists the largest kernels)")
    return {"device_ms": total / steps / 1e3, "profiled_wall_ms": wall / steps * 1e3,
            "mixer_share": split["by_scope_us"]["mixer"] / total if shares_hold else None,
            "core_share": split["by_scope_us"]["mixer/core"] / total if shares_hold else None,
            "unattributed_share": unattributed, "mixer_kernels_share": named / total,
            "attributed_by": {m: us / total for m, us in split["by_method_us"].items()},
            "trace_events": split["events"], "trace_modules": {m: round(us / total, 4) for m, us in
                                                               list(split["modules_us"].items())[:5]},
            "unattributed_top": [{"name": r["name"], "ms": round(r["us"] / steps / 1e3, 4), "events": r["events"],
                                  "args": r["args"]} for r in split["unattributed_top"]]}
