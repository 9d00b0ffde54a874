"""The measuring process of ``benchmarks.run``: one per source tree, started with that tree on ``PYTHONPATH``.

It reads one JSON request per line on stdin and answers each with one line ``@@RESULT {json}`` on stdout
(anything else it prints is log).  Requests (``"cmd"``):

* ``hello``: the environment — device, driver, versions, which ``falcon_jax`` was imported, its API;
* ``time``: median ms of an op's forward and forward+backward at a shape (:func:`time_jax`, :func:`time_torch`);
* ``memory``: the compiled forward+backward's memory (``compiled.memory_analysis()``), nothing run;
* ``profile``: GPU time per kernel of one forward+backward, from CUPTI through ``torch.profiler`` (it records
  every kernel of the process, JAX's included).
* ``lm_prepare`` / ``lm_measure``: the ``lm`` suite's train step of one configuration, built and compiled, then
  timed, its peak memory read and its device time split by named scope (:mod:`benchmarks.lm`; the parent,
  :mod:`benchmarks.lm_suite`, starts a fresh process per configuration, so the allocator's peak is that
  configuration's).
* ``cp_compile``: one case of :mod:`benchmarks.context_parallel`, the LM's train step compiled (not run) under
  a context-parallel mesh; one process per case, its mock GPU topology set by ``hello``'s ``jax_config``.

Compiled functions and inputs are kept for the life of the process, so a second ``time`` request for the same
op and shape measures again without compiling.  The parent kills the process when a request overruns.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback

import jax

from benchmarks import ops

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "torch", "numpy",
            "jax-linear-attention", "flash-linear-attention", "fla-core")
STATE = {"inputs": {}, "abstract": {}, "programs": {}, "smoke": False, "impl": "auto", "candidates": ()}


def time_jax(fn, args, calls: int = 20, repeats: int = 7, warmup: int = 2) -> float:
    """Median over ``repeats`` samples of the mean ms per call of ``calls`` back-to-back calls (dispatch of the
    next call overlaps the running one, as in a training loop), after ``warmup`` calls (the first compiles)."""
    for _ in range(warmup):
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
    """Median ms of a torch callable by ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def hello(req):
    """Set up the process (``smoke`` or not; ``jax_config``: jax.config options, set before anything starts the
    backend) and describe it (``torch``: whether fla can run, which imports torch)."""
    for key, value in req.get("jax_config", {}).items():
        jax.config.update(key, value)
    import falcon_jax
    from falcon_jax import validation

    STATE["smoke"] = bool(req.get("smoke"))
    old_api = "pallas" in validation.IMPLS
    backend = jax.default_backend()
    if old_api:
        STATE["impl"], STATE["candidates"] = "pallas", ()
    elif STATE["smoke"]:  # the Triton kernels in interpret mode on the CPU; XLA where no kernel serves
        STATE["impl"] = STATE["candidates"] = ("triton", "xla")
    else:
        from falcon_jax.kernels.implementation import platform_default

        STATE["impl"], STATE["candidates"] = "auto", platform_default()
    device = jax.devices()[0]
    return {"backend": backend, "device": getattr(device, "device_kind", str(device)),
            "device_count": jax.device_count(), "driver": _driver(), "python": platform.python_version(),
            "versions": {p: v for p in PACKAGES if (v := _version(p))},
            "falcon_jax": falcon_jax.__file__, "api": "impl='pallas'" if old_api else "impl='auto'",
            "impl": list(STATE["impl"]) if isinstance(STATE["impl"], tuple) else STATE["impl"],
            "available": {"jla": importlib.util.find_spec("jla") is not None, "gpu": backend == "gpu",
                          # importing torch takes seconds: only where a torch op or the profiler may run
                          "fla": bool(req.get("torch")) and importlib.util.find_spec("fla") is not None
                          and _torch_cuda()}}


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _inputs(shape, abstract=False):
    cache = STATE["abstract" if abstract else "inputs"]
    if shape not in cache:
        cache[shape] = ops.make_inputs(shape, abstract=abstract)
    return cache[shape]


def _programs(name, shape):
    """``(fwd, fwd+bwd, args)`` of a JAX op at ``shape``, compiled once per process."""
    key = (name, shape)
    if key not in STATE["programs"]:
        op = ops.BY_NAME[name]
        fwd, both = ops.fwd_and_bwd(ops.jax_fn(name, STATE["impl"]), len(op.args))
        STATE["programs"][key] = (fwd, both, [_inputs(shape)[a] for a in op.args])
    return STATE["programs"][key]


def _impl_label(name, shape):
    op = ops.BY_NAME[name]
    if op.family == "peer":
        return {"jla": "mosaic_gpu", "fla": "triton (torch)", "gpu": "cudnn"}[op.needs]
    if op.impl:
        return op.impl
    if not STATE["candidates"]:
        return STATE["impl"]
    return ops.served_by(name, _inputs(shape, abstract=True), STATE["candidates"])  # traced, nothing allocated


def _failure(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text[:300]}"


def time_op(req):
    """``{op, shape, impl, fwd_ms, fwd_bwd_ms, notes}``: a failing mode leaves its time None and says why."""
    name, shape = req["op"], tuple(req["shape"])
    timing = req.get("timing", {})
    row = {"op": name, "shape": "x".join(map(str, shape)), "impl": _impl_label(name, shape), "notes": {}}
    peer = ops.BY_NAME[name].family == "peer"
    if ops.BY_NAME[name].torch:
        calls = dict(zip(("fwd_ms", "fwd_bwd_ms"), ops.torch_calls(name, shape)))
        measure = {key: (lambda call=call: time_torch(call)) for key, call in calls.items()}
    else:
        fwd, both, args = _programs(name, shape)
        measure = {key: (lambda fn=fn: time_jax(fn, args, **timing))
                   for key, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", both))}
    for key in ("fwd_ms", "fwd_bwd_ms"):
        if key[:-3].replace("_", "+") not in req.get("modes", ("fwd", "fwd+bwd")):
            continue
        try:
            row[key] = measure[key]()
        except Exception as e:  # noqa: BLE001 - a mode that fails is reported, the other still measured
            traceback.print_exc(limit=3)
            row[key] = None
            row["notes"][key] = ("refused: " if peer else "error: ") + _failure(e)
    return row


def memory(req):
    """Bytes of the compiled forward+backward (abstract inputs: nothing allocated, nothing run); the peak is
    temporaries + outputs, as XLA reports them."""
    name, shape = req["op"], tuple(req["shape"])
    op = ops.BY_NAME[name]
    _, both = ops.fwd_and_bwd(ops.jax_fn(name, STATE["impl"]), len(op.args))
    abstract = _inputs(shape, abstract=True)
    analysis = both.lower(*[abstract[a] for a in op.args]).compile().memory_analysis()
    row = {"op": name, "shape": "x".join(map(str, shape)), "impl": _impl_label(name, shape)}
    if analysis is None:
        return dict(row, notes={"memory": "no memory analysis on this backend"})
    temp, out, arg = (int(getattr(analysis, f"{k}_size_in_bytes")) for k in ("temp", "output", "argument"))
    return dict(row, peak_bytes=temp + out, temp_bytes=temp, output_bytes=out, argument_bytes=arg)


def kernel_times(run, sync, iters):
    """``{kernel name: [calls, µs]}`` per iteration of ``run`` (after one warm-up call): every GPU kernel CUPTI
    records while ``iters`` calls run, ``sync`` waiting for the last."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        sync()
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = table[event.name[:100]]
            entry[0] += 1 / iters
            entry[1] += event.time_range.elapsed_us() / iters
    return dict(table)


def profile_op(req):
    """``{op, shape, wall_ms, kernel_ms, kernels: [{name, calls, us}]}`` of one forward+backward, kernels by
    GPU time."""
    name, shape = req["op"], tuple(req["shape"])
    row = {"op": name, "shape": "x".join(map(str, shape))}
    if not _torch_cuda():
        return dict(row, notes={"profile": "needs a GPU (CUPTI through torch.profiler, torch with CUDA)"})
    import torch

    row["impl"] = _impl_label(name, shape)
    if ops.BY_NAME[name].torch:
        _, run = ops.torch_calls(name, shape)
        sync, row["wall_ms"] = torch.cuda.synchronize, time_torch(run)
    else:
        _, both, args = _programs(name, shape)
        row["wall_ms"] = time_jax(both, args, **req.get("timing", {}))
        last = {}

        def run():
            last["out"] = both(*args)

        def sync():
            jax.block_until_ready(last["out"])
    table = kernel_times(run, sync, req.get("iters", 10))
    kernels = sorted(({"name": n, "calls": c, "us": us} for n, (c, us) in table.items()), key=lambda r: -r["us"])
    return dict(row, kernel_ms=sum(k["us"] for k in kernels) / 1e3, kernels=kernels)


def lm_prepare(req):
    from benchmarks import lm

    return lm.prepare(dict(req, smoke=STATE["smoke"]))


def lm_measure(req):
    from benchmarks import lm

    return lm.measure(req)


def cp_compile(req):
    from benchmarks import context_parallel

    return context_parallel.compile_case(req["case"])


HANDLERS = {"hello": hello, "time": time_op, "memory": memory, "profile": profile_op, "lm_prepare": lm_prepare,
            "lm_measure": lm_measure, "cp_compile": cp_compile}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        started = time.perf_counter()
        try:
            result = HANDLERS[request["cmd"]](request)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which goes on to the next step
            traceback.print_exc()
            result = {"error": _failure(e)}
        result["seconds"] = round(time.perf_counter() - started, 2)
        print("@@RESULT " + json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
