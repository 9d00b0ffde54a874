"""Device memory errors of the training loop: what ran out, the batch it ran with, and the fixes.

A train step or an evaluation that needs more device memory than JAX may use fails with a JAX runtime
error such as ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate 98.42GiB with allocator
GPU_0_bfc on device 0.``  The trainer re-raises it, chained, as :class:`DeviceMemoryError`, whose message
names the program, the step, the size asked for, the devices' limit, the batch and the fixes in the order
to try them (:func:`explain`).  The command line reports it in a few lines with exit code 1.

Only the standard library here: the command line imports it at its top, before the trainer.
"""

from __future__ import annotations

import math
import re

# the programs a DeviceMemoryError names (the trainer tracks which one is running)
TRAIN_STEP, EVALUATION, GREEDY, VALIDATION = "train step", "evaluation", "greedy evaluation", "validation"
SAFE_FRACTION = 0.9  # the XLA_PYTHON_CLIENT_MEM_FRACTION to suggest: the rest is for memory outside JAX's allocator


class DeviceMemoryError(RuntimeError):
    """A train step or an evaluation ran out of device memory (the original JAX error is ``__cause__``).

    ``program``: "train step", "evaluation", "greedy evaluation" or "validation"; ``step``: the optimizer
    step it belongs to; ``requested``: the size of the failed allocation as the message gave it (e.g.
    "98.42 GiB"; None if it gave none); ``limit_bytes``: the memory JAX may use per device (None where the
    backend reports no limit, e.g. CPU); ``grad_accum``: a ``train.grad_accum`` that halves the micro-batch
    (None if no value does, or for an addition evaluation, whose batch it does not size)."""

    def __init__(self, message: str, *, program: str, step: int, requested: str | None,
                 limit_bytes: int | None, grad_accum: int | None):
        super().__init__(message)
        self.program, self.step, self.requested = program, step, requested
        self.limit_bytes, self.grad_accum = limit_bytes, grad_accum


def is_out_of_memory(err: BaseException) -> bool:
    """Whether a JAX runtime error is a device allocation that failed.  A RESOURCE_EXHAUSTED status that
    is not about memory (a message over gRPC's size limit between hosts) is not."""
    msg = str(err)
    low = msg.lower()
    return "out of memory" in low or ("RESOURCE_EXHAUSTED" in msg and ("memory" in low or "allocat" in low))


_SIZE = re.compile(r"allocat\w*\s+(\d+(?:\.\d+)?)\s*([KMGTP]i?B|[KMGTP]|bytes?|B)(?![A-Za-z])")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def requested_size(message: str) -> str | None:
    """The size of the failed allocation in an out-of-memory message, as written there ("98.42 GiB"; a
    count of bytes in GiB), or None when the message names none."""
    m = _SIZE.search(message)
    if m is None:
        return None
    number, unit = m.groups()
    if unit.startswith("byte") or unit == "B":
        return gib(float(number))
    return f"{number} {unit}" if unit.endswith("B") else f"{number}{unit}"


def suggest_grad_accum(batch_size: int, grad_accum: int, shards: int = 1) -> int | None:
    """The smallest ``train.grad_accum`` >= 2 x ``grad_accum`` that divides ``batch_size`` into micro-batches
    the ``shards`` data-parallel devices split evenly (at most half the micro-batch rows per device), or
    None when there is none (every device already holds one row of a micro-batch)."""
    for a in range(2 * grad_accum, batch_size + 1):
        if batch_size % a == 0 and (batch_size // a) % shards == 0:
            return a
    return None


def gpu_hint(env) -> str | None:
    """What JAX's GPU allocator settings in ``env`` (``os.environ``) leave to gain, or None."""
    tips = []
    fraction = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        f = float(fraction) if fraction is not None else None
    except ValueError:
        f = None
    if fraction is None:
        tips.append(f"JAX uses at most 75% of a GPU's memory by default: XLA_PYTHON_CLIENT_MEM_FRACTION="
                    f"{SAFE_FRACTION} raises that")
    elif f is None or f < SAFE_FRACTION:
        tips.append(f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} caps JAX at that share of the GPU's memory: "
                    f"{SAFE_FRACTION} raises it")
    if env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() in ("false", "0"):
        tips.append("unset XLA_PYTHON_CLIENT_PREALLOCATE=false: without preallocation the memory is reserved in "
                    "growing pieces, and one large allocation can fail although the total would fit")
    return "; ".join(tips) if tips else None


def explain(err: BaseException, cfg, *, program: str, step: int, row_tokens: int, mesh_shape: dict,
            shards: int, platform: str, limit_bytes: int | None, checkpoints: list[int], env) -> DeviceMemoryError:
    """The :class:`DeviceMemoryError` for ``err``, raised by ``program`` at optimizer ``step`` of a run
    with config ``cfg``.  ``row_tokens``: the tokens a training row feeds the model; ``mesh_shape``: the mesh's
    axis sizes; ``shards``: its data-parallel devices (data x fsdp); ``platform``: the devices' platform;
    ``limit_bytes``: the memory JAX may use per device (None: unknown); ``checkpoints``: the run's finished
    checkpoint steps; ``env``: the process environment."""
    t, d = cfg.train, cfg.data
    requested = requested_size(str(err))
    n_devices = math.prod(mesh_shape.values())
    seq_knob = d.kind == "text" or d.pack  # data.seq_len sets the row length (else the widest problem does)
    rows = f"rows of {row_tokens:,} tokens" + (" (data.seq_len)" if seq_knob else "")
    mesh = " x ".join(f"{k}={v}" for k, v in mesh_shape.items())
    devices = f"mesh {mesh} ({n_devices} {platform} device{'s' if n_devices > 1 else ''})"
    sizes = ([f"it tried to allocate {requested}"] if requested else []) + \
        ([f"JAX may use {gib(limit_bytes)} per device in all"] if limit_bytes else [])
    if program == TRAIN_STEP:
        head = f"the train step ran out of device memory at {'the first step' if step == 1 else f'step {step}'}"
    else:
        head = f"the {program} of step {step} ran out of device memory"
    head += (f" ({'; '.join(sizes)})." if sizes else ".")
    accum = suggest_grad_accum(t.batch_size, t.grad_accum, shards)
    micro = t.batch_size // t.grad_accum
    if accum:
        split = (f"--set train.grad_accum={accum}: the step then runs micro-batches of {t.batch_size // accum} rows "
                 f"one after another (the same update; grad_accum must divide train.batch_size)")
    else:
        split = (f"train.grad_accum cannot go higher: each of the {shards} data-parallel device(s) holds "
                 f"{micro // shards} row(s) of a micro-batch")
    more_devices = ("more devices: the rows split over mesh.data x mesh.fsdp"
                    + (", each sequence over mesh.seq" if d.kind == "text" else ""))
    if program == TRAIN_STEP:
        what = (f"Batch: train.batch_size={t.batch_size} {rows} in train.grad_accum={t.grad_accum} "
                f"micro-batch{'es' if t.grad_accum > 1 else ''} of {micro} rows, on {devices}.")
        fixes = [split] + ([] if cfg.model.get("remat") else [
            "--set model.remat=true: each layer's activations are recomputed in the backward pass instead of kept "
            "(the same update, a second forward pass of compute)"]) + [
            f"a smaller train.batch_size{' or data.seq_len' if seq_knob else ''} (this changes the run)", more_devices]
    elif program == VALIDATION:
        what = (f"Its batches are the train step's micro-batches: train.batch_size={t.batch_size} / "
                f"train.grad_accum={t.grad_accum} = {micro} {rows}, on {devices}.")
        fixes = [split, "a smaller data.seq_len (this changes the run)"]  # evaluation inputs are replicated
    elif program == EVALUATION:
        what = f"It runs data.eval_examples={d.eval_examples} problems per width as one batch, on {devices}."
        fixes = ["a smaller data.eval_examples"]
        accum = None  # the evaluation batch does not depend on train.grad_accum
    else:  # free-running decoding: every width's prompts in one call
        widths = d.greedy_widths if d.greedy_widths is not None else d.eval_widths
        what = (f"It decodes data.greedy_examples={d.greedy_examples} problems for each of the {len(widths)} "
                f"data.greedy_widths in one batch, on {devices}.")
        fixes = ["a smaller data.greedy_examples or fewer data.greedy_widths"]
        accum = None
    hint = gpu_hint(env) if platform == "gpu" else None
    if hint:
        fixes.append(hint)
    fix_arg = f" --set train.grad_accum={accum}" if accum else ""
    keep = "Nothing was saved from the failed state; "
    if checkpoints:
        keep += (f"config.json, metrics.jsonl and the checkpoints (the latest: step {checkpoints[-1]}) in {t.run_dir} "
                 f"are kept; continue with the fix: falcon-train --run-dir {t.run_dir} --resume{fix_arg}")
    else:
        keep += (f"config.json and metrics.jsonl in {t.run_dir} are kept (no checkpoint yet): run the command again "
                 f"with --resume-or-start (it starts over from step 0 in that folder) and the fix"
                 f"{f' ({fix_arg.strip()})' if fix_arg else ''}.")
    lines = [head, what, "Fixes, in order:", *(f"  {i}. {f}" for i, f in enumerate(fixes, 1)), keep]
    return DeviceMemoryError("\n".join(lines), program=program, step=step, requested=requested,
                             limit_bytes=limit_bytes, grad_accum=accum)
