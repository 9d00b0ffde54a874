"""Running the Pallas kernel path once per device shard under a sharded ``jit``.

XLA's SPMD partitioner cannot split a kernel's custom call: given batch-sharded inputs it
gathers them onto every device and runs the whole kernel there (jax-ml/jax#32098 describes the
same for FFI calls).  The rules are independent across batch rows and heads, so inside
:func:`kernel_sharding` the kernel path of :func:`falcon_jax.falcon` is wrapped in
``jax.shard_map``: each device runs the kernels on its own rows and heads, with no collectives.

    with kernel_sharding(mesh, batch_axes=("data", "fsdp"), head_axis="tensor"):
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)   # traced in here

The context is read while tracing, and ``jit`` does not retrace for it: trace (first call or
``.lower``) the function inside the block; one traced outside keeps its un-sharded trace.  Axes
the mesh lacks, or of size 1, are ignored; a batch or head count the shards do not divide falls
back to the un-wrapped path (correct, but the kernel runs replicated) with a one-time warning.
Inside the block ``FalconLM`` also pins its activations to the batch axes
(:func:`constrain_batch`).  ``falcon-train`` enters it for its steps.

**Per-shard kernels not on GPUs (yet).** With jax 0.11.2 on two H200s, XLA's GPU compiler
crashed (SIGSEGV while compiling) on every program that put the Falcon Pallas kernels inside
``shard_map`` (one ``falcon(..., impl="pallas")`` forward+backward, also with the sequence in one
piece, and the LM training step), while a one-line Pallas kernel and the XLA chunk form inside
``shard_map`` compiled, and so did the LM step with the activation constraints alone
(``benchmarks/gpu_check_sharding.py``).  So on a mesh of GPU devices the context keeps the
constraints (``shard_kernels=False``: the FSDP step no longer gathers activations) and leaves the
kernels to the partitioner (correct; each device runs them on the whole batch), with a one-time
warning.  ``allow_gpu=True`` applies the per-shard kernels anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from falcon_jax.state import FalconState


@dataclasses.dataclass(frozen=True)
class KernelSharding:
    mesh: Mesh
    batch_axes: tuple[str, ...]  # mesh axes that split the batch (only those of size > 1)
    head_axis: str | None  # mesh axis that splits the heads (None: heads whole on every device)
    shard_kernels: bool = True  # False: only the activation constraints (GPU meshes, see the module docstring)

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def head_shards(self) -> int:
        return self.mesh.shape[self.head_axis] if self.head_axis else 1

    @property
    def batch_entry(self):
        """The batch axes as one ``PartitionSpec`` entry: a name, a tuple of names, or None."""
        return self.batch_axes[0] if len(self.batch_axes) == 1 else (self.batch_axes or None)


_CURRENT: contextvars.ContextVar[KernelSharding | None] = contextvars.ContextVar("falcon_kernel_sharding",
                                                                               default=None)
_warned: set = set()  # warnings given once: (shape key) tuples and "gpu"


def mesh_platforms(mesh: Mesh) -> set[str]:
    """The platforms of the mesh's devices ("cpu", "gpu", "tpu")."""
    return {d.platform for d in mesh.devices.flat}


@contextlib.contextmanager
def kernel_sharding(mesh: Mesh, batch_axes=("data", "fsdp"), head_axis: str | None = "tensor", *,
                    allow_gpu: bool = False):
    """Within this block, ``falcon``'s Pallas kernel path runs per shard of ``mesh``: batch
    rows split over ``batch_axes``, heads over ``head_axis`` (see the module docstring).  On a
    mesh of GPU devices only the activation constraints apply, with a one-time warning, unless
    ``allow_gpu`` (XLA's GPU compiler crashed on the per-shard kernels with jax 0.11.2)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"kernel_sharding: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    named = [*batch_axes, *([head_axis] if head_axis else [])]
    batch = tuple(a for a in batch_axes if a in mesh.shape and mesh.shape[a] > 1)
    head = head_axis if head_axis in mesh.shape and mesh.shape[head_axis] > 1 else None
    if not any(a in mesh.shape for a in named):
        raise ValueError(f"kernel_sharding: none of the axes {named} is in the mesh "
                         f"(its axes: {list(mesh.shape)}); name the mesh axes that split the batch and heads.")
    shard_kernels = True
    if (batch or head) and "gpu" in mesh_platforms(mesh) and not allow_gpu:
        if "gpu" not in _warned:
            _warned.add("gpu")
            warnings.warn("kernel_sharding: per-shard kernels not applied on GPU devices (XLA's GPU compiler "
                          "crashed compiling the Falcon Pallas kernels inside shard_map with jax 0.11.2); the "
                          "activations are still pinned to the batch axes, and the kernels run where the "
                          "partitioner puts them (correct; on the whole batch). Pass allow_gpu=True to try it.",
                          stacklevel=3)
        shard_kernels = False
    token = _CURRENT.set(KernelSharding(mesh, batch, head, shard_kernels) if (batch or head) else None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> KernelSharding | None:
    return _CURRENT.get()


def constrain_replicated(x: jax.Array) -> jax.Array:
    """``x`` replicated on every device of the context's mesh (identity outside a context): for
    results that every process reads back whole, e.g. evaluation predictions."""
    ks = current()
    return x if ks is None else jax.lax.with_sharding_constraint(x, NamedSharding(ks.mesh, P()))


def constrain_batch(x: jax.Array, *, split_last: bool = False) -> jax.Array:
    """``x [B, ...]`` pinned to rows over the context's batch axes (identity outside a
    :func:`kernel_sharding` context, or when the shards do not divide B).  Placed between the
    layers it keeps an FSDP step batch-sharded: left free, XLA's partitioner may gather
    activations (even the logits) onto every device instead of gathering the weights.
    ``split_last``: also split the last axis over the head axis where it divides (the logits'
    vocabulary under tensor parallelism)."""
    ks = current()
    if ks is None or not ks.batch_axes or x.shape[0] % ks.batch_shards:
        return x
    spec = [ks.batch_entry] + [None] * (x.ndim - 1)
    if split_last and ks.head_axis and x.ndim > 1 and x.shape[-1] % ks.head_shards == 0:
        spec[-1] = ks.head_axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(ks.mesh, P(*spec)))


def per_shard(fn, *, batch: int, heads: int, head_dim: int):
    """``fn(q, k, v, inputs, resets, state) -> (o, final_state)`` wrapped in ``shard_map`` when a
    :func:`kernel_sharding` context is active and divides the shapes, else ``fn`` itself.

    ``head_dim``: the heads' axis in the token arrays (2 for ``[B, T, H, d]``, 1 for
    ``[B, H, T, d]``); inputs share it, ``resets`` is ``[B, T]``, the state's fields are
    ``[B, H, ...]`` (``has_key``, ``tail_valid``: ``[B, ...]``)."""
    ks = current()
    if ks is None or not ks.shard_kernels:
        return fn
    if batch % ks.batch_shards or heads % ks.head_shards:
        key = (batch, heads, ks.batch_shards, ks.head_shards)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"falcon: batch {batch} / heads {heads} do not split over the mesh's "
                          f"{ks.batch_shards} batch x {ks.head_shards} head shards; the Pallas kernels run "
                          f"replicated on every device (correct, slower). Use a batch divisible by "
                          f"{ks.batch_shards} and heads divisible by {ks.head_shards}.", stacklevel=3)
        return fn
    b, h = ks.batch_entry, ks.head_axis
    tok = P(*([b] + [None] * (head_dim - 1) + [h]))
    state_spec = FalconState(S=P(b, h), last_key=P(b, h), has_key=P(b), tail_x=P(b, h), tail_y=P(b, h),
                             tail_valid=P(b))

    def wrapped(q, k, v, inputs, resets, state):
        in_specs = (tok, tok, tok, {name: tok for name in inputs}, P(b), state_spec)
        # check_vma off: pallas_call has no replication rule, and nothing here is replicated
        return jax.shard_map(fn, mesh=ks.mesh, in_specs=in_specs, out_specs=(tok, state_spec),
                             check_vma=False)(q, k, v, inputs, resets, state)

    return wrapped
