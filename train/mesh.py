"""Device mesh, multi-host start-up and batch placement.

The mesh has the axes ``("data", "fsdp", "tensor")`` (sizes from :class:`train.config.MeshConfig`,
one of them may be -1 = whatever is left).  Parameters are placed by their logical axes through
:func:`falcon_jax.nn.state_shardings` (FSDP over the model width, tensor parallelism over heads /
MLP hidden / vocabulary); a batch ``[B, T]`` is split over ``data`` x ``fsdp`` on B.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


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
    """Call ``jax.distributed.initialize()`` (which reads the cluster from the environment)
    when ``mode == "on"``, or ``"auto"`` and a multi-host launcher is detected.  Must run
    before anything touches the devices.  Returns whether it initialised."""
    if mode not in ("auto", "on", "off"):
        raise MeshError(f"mesh.distributed={mode!r}: use 'auto', 'on' or 'off'.")
    if mode == "off" or (mode == "auto" and multihost_env() is None):
        return False
    jax.distributed.initialize()
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
    """A ``Mesh`` with axes ``("data", "fsdp", "tensor")`` from a MeshConfig (or dict)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = {a: (cfg[a] if isinstance(cfg, dict) else getattr(cfg, a)) for a in AXES}
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


def batch_sharding(mesh: Mesh, accum: bool) -> NamedSharding:
    """Rows over ``data`` x ``fsdp``; with ``accum`` the leading micro-batch axis is replicated."""
    return NamedSharding(mesh, P(None, BATCH_AXES) if accum else P(BATCH_AXES))


def put_batch(batch: dict[str, np.ndarray], mesh: Mesh, grad_accum: int) -> dict[str, jax.Array]:
    """Host numpy ``[B, T]`` -> global arrays ``[A, B/A, T]`` sharded over the batch axes.

    Every host holds the same global batch (the iterators are deterministic), and
    ``make_array_from_callback`` copies only the shards this host's devices own."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        v = v.reshape((grad_accum, v.shape[0] // grad_accum) + v.shape[1:])
        sh = batch_sharding(mesh, accum=True)
        out[k] = jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx])
    return out


def replicate(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array replicated on every device of the mesh (eval inputs)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda idx: x[idx])
