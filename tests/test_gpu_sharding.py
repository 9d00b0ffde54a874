"""The per-shard kernels compile for 2-GPU meshes, on one GPU, through JAX's mock GPU topology.

Marked ``gpu`` and skipped without a GPU.  Each case runs in its own process, because the mock topology (two
processes of one GPU each, ``mock_num_gpu_processes`` and ``jax_mock_gpu_topology``) is set before the backend
starts and because a compiler crash ends the process; nothing runs, the sharded program is lowered and compiled.
XLA's sharded autotuning is turned off (``--xla_gpu_shard_autotuning=false``): it would wait for the mocked
peer process forever.  The cases run side by side (they compile on the CPU).

* The forward+backward of Falcon-1A, 3A, 1 and 3 under ``kernel_sharding(mesh, batch_axes, "tensor")`` for a
  data=2, an fsdp=2 and a tensor=2 mesh compiles, and every kernel in it works on a per-device shard; so does the
  sequence split over a seq=2 mesh (context parallelism).
* XLA's bug that ``shard_map_nonempty`` avoids: a pure-XLA ``jax.shard_map`` with a zero-size ``[8, 0]`` operand
  crashes XLA's GPU compiler (SIGSEGV) under Shardy (jax 0.11.2) and compiles with the GSPMD partitioner
  (``JAX_USE_SHARDY_PARTITIONER=false``).  The Shardy case is a strict xfail: when a jax compiles it, the test
  fails as XPASS, saying that the workaround may go.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs a GPU: compiles the sharded kernels through JAX's mock "
                                 "GPU topology (run `python -m pytest -m gpu tests/test_gpu_*.py` on a GPU machine)")]

B, T, H, D = 8, 1024, 12, 64
RULES = ("1A", "3A", "1", "3")
AXES = ("data", "fsdp", "tensor", "seq")
TIMEOUT = 300

CHILD = textwrap.dedent(r"""
    import json, os, re, sys
    import jax
    jax.config.update("mock_num_gpu_processes", 2)
    jax.config.update("jax_mock_gpu_topology", "1x2x1")
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    case = json.loads(sys.argv[1])
    B, T, H, D = case["shape"]
    axis = case["axis"]
    mesh = Mesh(np.asarray(jax.devices()), (axis,))
    assert mesh.size == 2, jax.devices()

    if case["kind"] == "zero-size":  # pure XLA: one [8, 0] operand crosses the shard_map
        sh = NamedSharding(mesh, P(axis))
        a, z = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh) for s in ((8, 64), (8, 0)))
        f = jax.shard_map(lambda a, z: a * 2 + z.sum(), mesh=mesh, in_specs=(P(axis),) * 2, out_specs=P(axis),
                          check_vma=False)
        lowered = jax.jit(f).lower(a, z)
    else:
        import falcon_jax

        tokens = NamedSharding(mesh, {"tensor": P(None, None, axis), "seq": P(None, axis)}.get(axis, P(axis)))
        args = ((jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=tokens),) * 3
                + (jax.ShapeDtypeStruct((B, T, H), jnp.float32, sharding=tokens),) * 2)
        kw = {"window": 4} if case["variant"] in ("3", "3A") else {}

        def loss(q, k, v, beta, lam):
            out = falcon_jax.falcon(q, k, v, beta, lam, variant=case["variant"], impl=("mosaic_gpu", "triton"), **kw)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        with falcon_jax.kernel_sharding(mesh, () if axis in ("tensor", "seq") else (axis,), "tensor", seq_axis="seq"):
            lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args)
    hlo = lowered.compile().as_text()
    kernels = []  # the output shapes of every Triton or Mosaic GPU kernel call in the compiled module
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if " custom-call(" in line and target and ("triton" in target.group(1) or "mosaic" in target.group(1)):
            result = line.split(" = ", 1)[1].split(" custom-call(", 1)[0]
            kernels.append([[int(n) for n in dims.split(",") if n] for dims in re.findall(r"\w+\[([\d,]*)\]", result)])
    print("RESULT " + json.dumps({"kernels": kernels}), flush=True)
    os._exit(0)  # a mocked process may wait for its missing peer at exit
""")


def _env(shardy: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false").strip()
    if not shardy:
        env["JAX_USE_SHARDY_PARTITIONER"] = "false"
    return env


CASES = {f"falcon-{rule}-{axis}": ({"kind": "falcon", "variant": rule, "axis": axis, "shape": [B, T, H, D]}, True)
         for rule in RULES for axis in AXES}
CASES["zero-size-shardy"] = ({"kind": "zero-size", "axis": "data", "shape": [B, T, H, D]}, True)
CASES["zero-size-gspmd"] = ({"kind": "zero-size", "axis": "data", "shape": [B, T, H, D]}, False)


def _compile(name):
    case, shardy = CASES[name]
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD, json.dumps(case)], env=_env(shardy),
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        return {"returncode": None, "result": None, "log": f"timed out after {TIMEOUT} s\n{e.stdout or ''}"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return {"returncode": proc.returncode, "result": json.loads(line[7:]) if line else None,
            "log": (proc.stdout + proc.stderr)[-3000:]}


@pytest.fixture(scope="module")
def compiled(request):
    """The result of every case this pytest run selected, compiled side by side: ``{name: {returncode, result,
    log}}``."""
    names = sorted({item.callspec.params["case"] for item in request.session.items
                    if item.module is request.module and "case" in getattr(getattr(item, "callspec", None),
                                                                             "params", {})})
    jobs = max(1, min(8, (os.cpu_count() or 2) // 2))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return dict(zip(names, pool.map(_compile, names)))


class CompilerCrashed(AssertionError):
    """XLA's compiler ended the process (a signal), as XLA's zero-size shard_map operand bug does."""


def _assert_compiled(outcome):
    if outcome["returncode"] is not None and outcome["returncode"] < 0:
        raise CompilerCrashed(f"the compiler died with signal {-outcome['returncode']}:\n{outcome['log']}")
    assert outcome["result"] is not None, f"no compiled program (exit code {outcome['returncode']}):\n{outcome['log']}"


@pytest.mark.parametrize("case", [name for name in CASES if name.startswith("falcon-")])
def test_sharded_kernels_compile_per_shard(case, compiled):
    outcome = compiled[case]
    _assert_compiled(outcome)
    kernels = outcome["result"]["kernels"]
    assert kernels, "no Triton or Mosaic GPU kernel in the compiled program (did falcon fall back to XLA?)"
    assert all(any(len(dims) >= 2 for dims in outputs) for outputs in kernels), kernels
    # the kernels run on each device's shard, not on gathered arrays: their largest outputs (tokens, triangular
    # inverses, masked scores: B·T·H·64 elements, times the window for Falcon-3's virtual rows) are halved (split
    # over seq, the regression rules' values are widened by dk columns: context_parallel.py)
    rows = 4 if case.startswith("falcon-3-") else 1
    widened = 2 if case.endswith("-seq") and case.split("-")[1] in ("1", "3") else 1
    largest = max(_elements(dims) for outputs in kernels for dims in outputs)
    assert largest <= widened * rows * B * T * H * D // 2, (largest, kernels)


def _elements(dims):
    n = 1
    for d in dims:
        n *= d
    return n


@pytest.mark.parametrize("case", ["zero-size-gspmd"])
def test_zero_size_shard_map_operand_compiles_without_shardy(case, compiled):
    _assert_compiled(compiled[case])


@pytest.mark.xfail(strict=True, raises=CompilerCrashed,
                   reason="XLA's GPU compiler crashes (SIGSEGV) on a zero-size shard_map operand under Shardy "
                   "(jax 0.11.2); falcon_jax.sharding.shard_map_nonempty avoids it. An XPASS means this jax "
                   "compiles it: the workaround may go")
@pytest.mark.parametrize("case", ["zero-size-shardy"])
def test_zero_size_shard_map_operand_under_shardy(case, compiled):
    _assert_compiled(compiled[case])

