"""Device mesh, multi-host start-up and batch placement.

The mesh has the axes ``("data", "fsdp", "seq", "tensor")`` (sizes from :class:`falcon_jax.train.config.MeshConfig`,
one of them may be -1 = whatever is left).  Parameters are placed by their logical axes through
:func:`falcon_jax.nn.state_shardings` (FSDP over the model width, tensor parallelism over heads /
MLP hidden / vocabulary); a batch ``[B, T]`` is split over ``data`` x ``fsdp`` on B.  ``seq`` is context
parallelism: inside the step every activation ``[B, T, ...]`` and every recurrent layer's sequence is split over it
on T (:mod:`falcon_jax.context_parallel`); the token batch itself, a few bytes per position, stays whole on T.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "seq", "tensor")
BATCH_AXES = ("data", "fsdp")
SEQ_AXIS = "seq"


class MeshError(ValueError):
    """A mesh that does not fit the devices, or a batch the mesh cannot split."""


def multihost_env() -> str | None:
    """The name of the multi-host launcher found in the environment, or None."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_JOB_ID"):
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "Open MPI"
    if env.get("TPU_WORKER_HOSTNAMES") and "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return "TPU pod"
    return None


def maybe_initialize_distributed(mode: str = "auto") -> bool:
    """Call ``jax.distributed.initialize()`` when ``mode == "on"``, or ``"auto"`` and a
    multi-host launcher is detected.  Must run before anything touches the devices.  Returns
    whether it initialised.

    SLURM, Open MPI and TPU pods describe the cluster themselves.  A plain launcher (or
    ``python -m falcon_jax.train.launch``) sets ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0),
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, optionally ``JAX_LOCAL_DEVICE_IDS`` (GPU
    indices this process drives).  On CPU, cross-process collectives go through gloo."""
    if mode not in ("auto", "on", "off"):
        raise MeshError(f"mesh.distributed={mode!r}: use 'auto', 'on' or 'off'.")
    if mode == "off" or (mode == "auto" and multihost_env() is None):
        return False
    kw = {}
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS") and not any(env.get(k) for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")):
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if not env.get(k)]
        if missing:
            raise MeshError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} is not; set "
                            f"JAX_NUM_PROCESSES (the number of processes) and JAX_PROCESS_ID (0 .. N-1) for every "
                            f"process, or unset JAX_COORDINATOR_ADDRESS for a single-process run.")
        try:
            kw = {"num_processes": int(env["JAX_NUM_PROCESSES"]), "process_id": int(env["JAX_PROCESS_ID"])}
        except ValueError as e:
            raise MeshError(f"JAX_NUM_PROCESSES={env['JAX_NUM_PROCESSES']!r} and JAX_PROCESS_ID="
                            f"{env['JAX_PROCESS_ID']!r} must be integers.") from e
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only; GPUs use NCCL
    jax.distributed.initialize(**kw)
    return True


def resolve_axes(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill a -1 axis and check that the product equals the device count (MeshError if not)."""
    bad = [f"{k}={v}" for k, v in sizes.items() if not isinstance(v, int) or (v < 1 and v != -1)]
    if bad:
        raise MeshError(f"mesh axes must be positive ints or -1 (fill); got {', '.join(bad)}.")
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise MeshError(f"mesh: at most one axis may be -1 (fill); got {fill}.")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    if fill:
        if n_devices % fixed:
            raise MeshError(f"mesh {desc}: the fixed axes multiply to {fixed}, which does not divide the "
                            f"{n_devices} available devices; choose sizes whose product divides {n_devices}.")
        sizes = dict(sizes, **{fill[0]: n_devices // fixed})
    elif fixed != n_devices:
        raise MeshError(f"mesh {desc} has {fixed} devices but {n_devices} are available; make the product "
                        f"equal {n_devices} or set one axis to -1.")
    return sizes


def make_mesh(cfg, devices=None) -> Mesh:
    """A ``Mesh`` with axes ``("data", "fsdp", "seq", "tensor")`` from a MeshConfig (or dict; ``seq`` may be left
    out: 1)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = {a: (cfg.get(a, 1) if a == SEQ_AXIS else cfg[a]) if isinstance(cfg, dict) else getattr(cfg, a)
             for a in AXES}
    sizes = resolve_axes(sizes, len(devices))
    return Mesh(np.asarray(devices).reshape([sizes[a] for a in AXES]), AXES)


def batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(mesh: Mesh, batch_size: int, grad_accum: int) -> int:
    """The micro-batch size; MeshError unless the global batch splits into ``grad_accum``
    micro-batches that each split evenly over the data-parallel shards."""
    if grad_accum < 1 or batch_size % grad_accum:
        raise MeshError(f"train.batch_size={batch_size} is not divisible by train.grad_accum={grad_accum}.")
    micro = batch_size // grad_accum
    n = batch_shards(mesh)
    if micro % n:
        raise MeshError(f"the micro-batch of {micro} rows (train.batch_size={batch_size} / grad_accum={grad_accum}) "
                        f"is not divisible by the {n} data-parallel shards (mesh data={mesh.shape['data']} x "
                        f"fsdp={mesh.shape['fsdp']}); pick a batch size that is a multiple of {n * grad_accum}.")
    return micro


def check_sequence(mesh: Mesh, seq_len: int | None, window: int = 1) -> None:
    """MeshError unless the model's sequences (``seq_len`` positions; None: lengths vary, as in the addition task)
    split evenly over the ``seq`` axis into slices of at least ``window`` positions (the longest window of the
    model's Falcon-3/3A layers)."""
    n = mesh.shape.get(SEQ_AXIS, 1)
    if n == 1 or seq_len is None:
        return
    if seq_len % n:
        raise MeshError(f"data.seq_len={seq_len} is not divisible by mesh.seq={n}: context parallelism gives every "
                        f"device seq_len / {n} positions; pick a multiple of {n}.")
    if seq_len // n < window:
        raise MeshError(f"data.seq_len={seq_len} over mesh.seq={n} gives slices of {seq_len // n} positions, fewer "
                        f"than the model's window of {window}; use fewer devices on seq or a longer sequence.")


def batch_sharding(mesh: Mesh, accum: bool) -> NamedSharding:
    """Rows over ``data`` x ``fsdp``; with ``accum`` the leading micro-batch axis is replicated."""
    return NamedSharding(mesh, P(None, BATCH_AXES) if accum else P(BATCH_AXES))


def host_shard(mesh: Mesh, batch_size: int, grad_accum: int) -> tuple[int, int]:
    """``(index, count)``: which of ``count`` equal, contiguous slices of every micro-batch's
    rows this process's devices hold (the share of the batch this host has to load).

    One process: ``(0, 1)``.  On several hosts this is like Grain's ``ShardByJaxProcess`` but
    read off the mesh, so hosts that hold the same rows (a batch replicated over a ``tensor``
    axis that spans hosts) load the same slice.  A layout that is not one contiguous equal
    slice per host gives ``(0, 1)``: the host then loads the whole batch."""
    m = batch_size // grad_accum
    sh = batch_sharding(mesh, accum=True)
    spans = {idx[1].indices(m)[:2] for idx in sh.addressable_devices_indices_map((grad_accum, m)).values()}
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    covered = np.zeros(m, bool)
    for a, b in spans:
        covered[a:b] = True
    size = hi - lo
    if not covered[lo:hi].all() or m % size or lo % size:
        return 0, 1
    return lo // size, m // size


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh, grad_accum: int,
              shard: tuple[int, int] = (0, 1)) -> dict[str, jax.Array]:
    """Host numpy ``[B_host, T]`` -> global arrays ``[A, B/A, T]`` sharded over the batch axes.

    ``shard = (s, k)`` (from :func:`host_shard`): the host's rows are slice s of k of every
    micro-batch, i.e. row ``a * B_host/A + r`` of the host batch is row ``s * B_host/A + r`` of
    micro-batch a (``B = k * B_host``).  With ``(0, 1)`` the host holds the whole global batch
    (the builtin loader).  ``make_array_from_callback`` copies only the shards this host's
    devices own."""
    s, k = shard
    sh = batch_sharding(mesh, accum=True)
    out = {}
    for name, v in batch.items():
        v = np.asarray(v)
        if v.shape[0] % grad_accum:
            raise MeshError(f"put_batch: {name!r} has {v.shape[0]} rows, not divisible by grad_accum={grad_accum}.")
        m_loc = v.shape[0] // grad_accum
        v = v.reshape((grad_accum, m_loc) + v.shape[1:])
        off = s * m_loc

        def local(idx, v=v, off=off, m_loc=m_loc):
            lo, hi, _ = idx[1].indices(k * m_loc)
            if lo < off or hi > off + m_loc:
                raise MeshError(f"put_batch: this host holds rows [{off}, {off + m_loc}) of each micro-batch "
                                f"but a local device needs [{lo}, {hi}); the batch shard does not match the mesh.")
            return v[(idx[0], slice(lo - off, hi - off)) + tuple(idx[2:])]

        out[name] = jax.make_array_from_callback((grad_accum, k * m_loc) + v.shape[2:], sh, local)
    return out


def replicate(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array replicated on every device of the mesh (eval inputs)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda idx: x[idx])
