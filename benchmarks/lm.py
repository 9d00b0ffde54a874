"""The ``lm`` suite's measurements, run inside a ``benchmarks.worker`` process (one process per configuration,
started by :mod:`benchmarks.lm_suite`).

One configuration is a mixer name and a shape ``B × T``: the ``lm-130m`` preset's model (``train/config.py``:
D = 768, 12 layers, 12 heads of 64, SwiGLU 2048, vocabulary 50304, chunk 64, bf16 compute, fp32 parameters)
with that mixer, and the trainer's own train step (``falcon_jax.train.trainer.make_train_step``: forward,
backward, global-norm clipping and AdamW from ``falcon_jax.train.optim.make_optimizer`` with the preset's
settings, parameters and optimizer state donated).  ``--smoke`` uses the ``tiny`` model size instead.

* :func:`prepare`: build the model eagerly (``train.init="eager"``, the trainer's default), the optimizer
  state and a batch of random tokens, then trace and compile the step (timed apart: ``lower_s`` and
  ``compile_s``; with ``autotune_cache``, a folder of XLA's per-fusion autotuning results shared by the run's
  processes).  On a GPU the same lowered step is compiled a second time without CUDA graphs
  (``xla_gpu_enable_command_buffer`` empty; ``profile_compile_s``): the executable of the profiled steps.
  Inside a CUDA graph every kernel's launch names the graph (``hlo_op=command_buffer_N``), so cuBLAS and cuDNN
  kernels could not be told apart by scope; launched one at a time, each names its HLO instruction.  The
  timed steps run the executable with the graphs;
* :func:`measure`: time the step (``warmup`` steps, then the median over ``repeats`` samples of the mean time
  of ``calls`` back-to-back steps), read the process's peak device memory (before the profiled executable
  first runs, so the peak is the timed step's), and profile ``profile_steps`` steps of the profiled executable
  (on a GPU after one untraced step of it) to split their device time by named scope (:mod:`benchmarks.trace_scopes`)
  and to find the time spent in the mixers' own kernels by kernel name.

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
    "xla_gpu_enable_command_buffer": "the profiled steps run with CUDA graphs, whose kernels all name the graph: "
                                     "only kernel names attribute them (cuBLAS and cuDNN kernels stay unattributed)",
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
    graphs = jax.default_backend() == "gpu"  # XLA gathers a GPU program's kernels into CUDA graphs
    if graphs and req.get("autotune_cache"):
        # XLA's per-fusion autotuning results, shared by the run's processes (the layers and the MLP are the same
        # in every configuration: their GEMMs are tuned once, by the first compile, on a quiet GPU)
        options["xla_gpu_per_fusion_autotune_cache_dir"] = req["autotune_cache"]
    notes = {}
    compiled, t2 = compile_with(lowered, options, notes)
    t3 = time.perf_counter()
    profiled, profile_compile_s = compiled, None
    if graphs:
        # the profiled steps' executable: no command buffers (an empty list of the commands CUDA graphs may hold),
        # so every kernel is launched by its own thunk and names its instruction; the same autotuning results
        profile_options = {k: v for k, v in options.items() if k not in notes}
        profile_options["xla_gpu_enable_command_buffer"] = ""
        profiled, t4 = compile_with(lowered, profile_options, notes)
        profile_compile_s = round(time.perf_counter() - t4, 2)
    hlo = compiled.as_text()
    # a trace names the instructions of the executable that ran: the profiled one's
    prog = trace_scopes.program(hlo if profiled is compiled else profiled.as_text())
    names = prog.names if profiled is compiled else trace_scopes.op_names(hlo)
    STATE.clear()
    STATE.update(compiled=compiled, profiled=profiled, params=params, rest=rest, opt_state=opt_state, batch=batch,
                 program=prog, tokens=req["batch"] * req["length"])
    row = {"init_s": round(t1 - t0, 2), "lower_s": round(lower_s, 2), "compile_s": round(t3 - t2, 2),
           "profile_compile_s": profile_compile_s,
           "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
           "kernels": "+".join(trace_scopes.kernel_families(hlo, "mixer/core", names)) or "xla",
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


def _steps(n: int, executable: str = "compiled"):
    """Run ``n`` train steps back to back with ``STATE[executable]`` (``"compiled"``: the timed one,
    ``"profiled"``: the one without CUDA graphs); returns the last step's metrics (not waited for).  Parameters
    and optimizer state are donated: each step takes the current ones and its outputs replace them."""
    s = STATE
    metrics = None
    for _ in range(n):
        s["params"], s["opt_state"], metrics = s[executable](s["params"], s["rest"], s["opt_state"], s["batch"])
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
    # the peak is read before the profiled executable first runs: its buffers are not the timed step's
    row = {"step_ms": step_s * 1e3, "tokens_per_s": STATE["tokens"] / step_s,
           "step_ms_samples": [round(t * 1e3, 3) for t in samples], "peak_bytes": peak_device_memory(),
           "loss": float(metrics["loss"]), "notes": {}}
    if not math.isfinite(row["loss"]):
        row["notes"]["loss"] = f"not finite ({row['loss']})"
    row.update(_profile(timing["profile_steps"], row["notes"]))
    return row


def _profile(steps: int, notes: dict) -> dict:
    """Device time per step and its split by named scope, from a trace of ``steps`` steps of the profiled
    executable (:func:`prepare`; after one untraced step of it, where it is not the timed one)
    (:func:`benchmarks.trace_scopes.scope_times`).

    ``mixer_share`` and ``core_share`` are ``None`` when more than ``MAX_UNATTRIBUTED`` of the device time
    matches no instruction of the step (they would count only the part that did);
    ``mixer_kernels_share`` (kernel names alone) stands regardless.  ``attributed_by``: the share each
    matching method covered; ``unattributed_top``: the largest unattributed kernels, ms per step, with their
    args, so that a trace the attribution does not read shows what it holds.  ``device_ms`` and
    ``profiled_wall_ms`` are the profiled executable's: without CUDA graphs the host launches every kernel, so
    its wall time per step may exceed ``step_ms``."""
    if steps < 1:
        return {}
    host = jax.default_backend() == "cpu"
    try:
        if STATE["profiled"] is not STATE["compiled"]:
            # an untraced warm-up step: it loads the executable's kernels before the trace
            jax.block_until_ready(_steps(1, "profiled"))
        with tempfile.TemporaryDirectory(prefix="falcon-lm-trace-") as log_dir:
            jax.profiler.start_trace(log_dir)
            try:
                start = time.perf_counter()
                jax.block_until_ready(_steps(steps, "profiled"))
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
