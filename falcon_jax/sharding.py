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

With a sequence axis (``seq_axis``, default ``"seq"``, when the mesh has it with size > 1) every form of ``falcon``
and the baselines, and ``FalconLM``'s short convolutions, split the sequence over it too (context parallelism,
:mod:`falcon_jax.context_parallel`), and ``FalconLM``'s activations are pinned to (batch, sequence).

**No zero-size array crosses the shard_map.**  XLA's GPU compiler (jax 0.11.2, its Shardy partitioner)
dies with SIGSEGV on a ``shard_map`` that takes a zero-size operand — a pure-XLA one too — and the
Falcon state of every rule but 3 and 3A has zero-length tails (``[B, H, 0, d]``), as do some residuals
its backward saves.  So :func:`per_shard` passes no zero-size input or output through the boundary
(it makes them again on the other side) and differentiates the shard itself: a ``custom_vjp`` whose
forward returns the shard's residuals stacked along a new leading axis over the mesh axes in use
(each device gets its own back), the zero-size ones left out (docs/kernels.md, "Per-shard kernels";
``tests/test_gpu_sharding.py`` compiles it for 2-GPU meshes on one GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from falcon_jax.state import FalconState


@dataclasses.dataclass(frozen=True)
class KernelSharding:
    mesh: Mesh
    batch_axes: tuple[str, ...]  # mesh axes that split the batch (only those of size > 1)
    head_axis: str | None  # mesh axis that splits the heads (None: heads whole on every device)
    seq_axis: str | None = None  # mesh axis that splits the sequence (context parallelism; None: whole)

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def head_shards(self) -> int:
        return self.mesh.shape[self.head_axis] if self.head_axis else 1

    @property
    def seq_shards(self) -> int:
        return self.mesh.shape[self.seq_axis] if self.seq_axis else 1

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Every mesh axis the kernels' operands are split over."""
        return (*self.batch_axes, *([self.head_axis] if self.head_axis else []))

    def splits(self, batch: int, heads: int, who: str, what: str) -> bool:
        """Whether ``batch`` rows and ``heads`` heads split evenly over this mesh's shards; if not, warn once
        (per shape) that ``who``'s ``what`` run replicated on every device instead."""
        if batch % self.batch_shards == 0 and heads % self.head_shards == 0:
            return True
        key = (who, batch, heads, self.batch_shards, self.head_shards)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"{who}: batch {batch} / heads {heads} do not split over the mesh's {self.batch_shards} "
                          f"batch x {self.head_shards} head shards; {what} run replicated on every device "
                          f"(correct, slower). Use a batch divisible by {self.batch_shards} and heads divisible by "
                          f"{self.head_shards}.", stacklevel=4)
        return False

    @property
    def batch_entry(self):
        """The batch axes as one ``PartitionSpec`` entry: a name, a tuple of names, or None."""
        return self.batch_axes[0] if len(self.batch_axes) == 1 else (self.batch_axes or None)


_CURRENT: contextvars.ContextVar[KernelSharding | None] = contextvars.ContextVar("falcon_kernel_sharding",
                                                                               default=None)
_warned: set = set()  # warnings given once: (shape key) tuples


@contextlib.contextmanager
def kernel_sharding(mesh: Mesh, batch_axes=("data", "fsdp"), head_axis: str | None = "tensor",
                    seq_axis: str | None = "seq"):
    """Within this block ``falcon`` (and the baselines) run per shard of ``mesh``: the Pallas kernel path with
    batch rows split over ``batch_axes`` and heads over ``head_axis`` (see the module docstring); and, where
    ``seq_axis`` is in the mesh with size > 1, every form splits the sequence over it
    (:mod:`falcon_jax.context_parallel`).  ``batch_axes``: a mesh axis name, a sequence of them, or None; each axis
    splits one dimension (TypeError or ValueError naming the argument otherwise)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"kernel_sharding: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    batch_axes = () if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    if not isinstance(batch_axes, (tuple, list)) or not all(isinstance(a, str) for a in batch_axes):
        raise TypeError(f"kernel_sharding: batch_axes must be a mesh axis name or a sequence of them (e.g. "
                        f"('data', 'fsdp')), or None; got {batch_axes!r}.")
    batch_axes = tuple(batch_axes)
    for name, axis in (("head_axis", head_axis), ("seq_axis", seq_axis)):
        if axis is not None and not isinstance(axis, str):
            raise TypeError(f"kernel_sharding: {name} must be one mesh axis name or None; got {axis!r}.")
    if len(set(batch_axes)) < len(batch_axes):
        raise ValueError(f"kernel_sharding: batch_axes={batch_axes!r} names an axis twice; name each mesh axis once.")
    if head_axis is not None and head_axis in batch_axes:
        raise ValueError(f"kernel_sharding: head_axis={head_axis!r} is also a batch axis; one mesh axis splits one "
                         f"dimension (name the head axis apart, e.g. 'tensor', or head_axis=None).")
    if seq_axis is not None and (seq_axis in batch_axes or seq_axis == head_axis):
        raise ValueError(f"kernel_sharding: seq_axis={seq_axis!r} is also a batch or head axis; one mesh axis "
                         f"splits one dimension (name the sequence axis apart, e.g. 'seq').")
    named = [*batch_axes, *([head_axis] if head_axis else []), *([seq_axis] if seq_axis else [])]
    batch = tuple(a for a in batch_axes if a in mesh.shape and mesh.shape[a] > 1)
    head = head_axis if head_axis in mesh.shape and mesh.shape[head_axis] > 1 else None
    seq = seq_axis if seq_axis in mesh.shape and mesh.shape[seq_axis] > 1 else None
    if not any(a in mesh.shape for a in named):
        raise ValueError(f"kernel_sharding: none of the axes {named} is in the mesh "
                         f"(its axes: {list(mesh.shape)}); name the mesh axes that split the batch, heads and "
                         f"sequence.")
    token = _CURRENT.set(KernelSharding(mesh, batch, head, seq) if (batch or head or seq) else None)
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
    """``x [B, T, ...]`` pinned to rows over the context's batch axes and, under context parallelism, positions
    over its sequence axis (identity outside a :func:`kernel_sharding` context; a dimension its shards do not
    divide stays whole).  Placed between the layers it keeps an FSDP step batch-sharded: left free, XLA's
    partitioner may gather activations (even the logits) onto every device instead of gathering the weights.
    ``split_last``: also split the last axis over the head axis where it divides (the logits'
    vocabulary under tensor parallelism)."""
    ks = current()
    if ks is None:
        return x
    spec = [None] * x.ndim
    if ks.batch_axes and x.shape[0] % ks.batch_shards == 0:
        spec[0] = ks.batch_entry
    if ks.seq_axis and x.ndim > 2 and x.shape[1] % ks.seq_shards == 0:
        spec[1] = ks.seq_axis
    if split_last and ks.head_axis and x.ndim > 1 and x.shape[-1] % ks.head_shards == 0:
        spec[-1] = ks.head_axis
    if all(s is None for s in spec[:-1]):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(ks.mesh, P(*spec)))


def per_shard(fn, *, batch: int, heads: int, head_dim: int):
    """``fn(q, k, v, inputs, resets, state) -> (o, final_state)`` wrapped in ``shard_map`` when a
    :func:`kernel_sharding` context is active and divides the shapes, else ``fn`` itself.

    ``head_dim``: the heads' axis in the token arrays (2 for ``[B, T, H, d]``, 1 for
    ``[B, H, T, d]``); inputs share it, ``resets`` is ``[B, T]``, the state's fields are
    ``[B, H, ...]`` (``has_key``, ``tail_valid``: ``[B, ...]``)."""
    ks = current()
    if ks is None:
        return fn
    if not ks.splits(batch, heads, "falcon", "the Pallas kernels"):
        return fn
    b, h = ks.batch_entry, ks.head_axis
    tok = P(*([b] + [None] * (head_dim - 1) + [h]))
    state_spec = FalconState(S=P(b, h), last_key=P(b, h), has_key=P(b), tail_x=P(b, h), tail_y=P(b, h),
                             tail_valid=P(b))

    def wrapped(q, k, v, inputs, resets, state):
        in_specs = (tok, tok, tok, {name: tok for name in inputs}, P(b), state_spec)
        return shard_map_nonempty(fn, ks.mesh, in_specs, (tok, state_spec), ks.shard_axes)(
            q, k, v, inputs, resets, state)

    return wrapped


def _leaf_specs(specs, tree) -> list:
    """One PartitionSpec per leaf of ``tree``, from ``specs`` (a prefix of it, as shard_map's specs)."""
    out = []
    jax.tree_util.tree_map(lambda spec, sub: out.extend([spec] * len(jax.tree_util.tree_leaves(sub))), specs, tree,
                           is_leaf=lambda x: isinstance(x, P))
    return out


def _shards_per_dim(ndim: int, spec: P, mesh: Mesh) -> list[int]:
    """How many devices ``spec`` splits each of ``ndim`` dimensions over on ``mesh``."""
    shards = [1] * ndim
    for dim, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        shards[dim] = math.prod(mesh.shape[n] for n in names)
    return shards


def _local_shape(shape, spec: P, mesh: Mesh) -> tuple:
    """The per-device shape of a global ``shape`` split by ``spec`` over ``mesh``."""
    return tuple(n // k for n, k in zip(shape, _shards_per_dim(len(shape), spec, mesh)))


def _empty(a) -> bool:
    return math.prod(a.shape) == 0


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _zero_cotangent(aval):
    """A zero cotangent for an output of ``aval`` (float0 for integer and bool outputs)."""
    if _inexact(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def shard_map_nonempty(fn, mesh: Mesh, in_specs, out_specs, stack_axes: tuple[str, ...]):
    """``jax.shard_map(fn, mesh, in_specs, out_specs)`` (replication unchecked) through which no zero-size array
    passes: zero-size inputs and outputs are made again on the far side, and the shard's own ``jax.vjp`` gives
    the backward (a ``custom_vjp``), its residuals passed per device — stacked along a new leading axis split over
    ``stack_axes`` (the mesh axes the specs split) — without the zero-size ones.  See the module docstring."""
    stacked = P(stack_axes if len(stack_axes) > 1 else stack_axes[0])

    def call(*args):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        specs = _leaf_specs(in_specs, args)
        keep = [i for i, a in enumerate(leaves) if not _empty(a)]
        local_empty = {i: jax.ShapeDtypeStruct(_local_shape(a.shape, specs[i], mesh), a.dtype)
                       for i, a in enumerate(leaves) if _empty(a)}

        def local_args(kept):
            full = [None] * len(leaves)
            for i, a in zip(keep, kept):
                full[i] = a
            for i, sds in local_empty.items():
                full[i] = jnp.zeros(sds.shape, sds.dtype)
            return jax.tree_util.tree_unflatten(treedef, full)

        local_avals = [jax.ShapeDtypeStruct(_local_shape(leaves[i].shape, specs[i], mesh), leaves[i].dtype)
                       for i in keep]
        structure = {}

        def shard_forward(*kept):
            out, vjp = jax.vjp(lambda *a: fn(*a), *local_args(kept))
            out_leaves, structure["out"] = jax.tree_util.tree_flatten(out)
            res_leaves, structure["res"] = jax.tree_util.tree_flatten(vjp)
            return out_leaves, res_leaves

        # the shard's outputs and residuals, traced once for their structure and local shapes; inside a shard_map
        # (every result returned as it is, P()), so that the collectives of fn find their mesh axes
        out_avals, res_avals = jax.eval_shape(
            jax.shard_map(shard_forward, mesh=mesh, in_specs=tuple(specs[i] for i in keep), out_specs=P(),
                          check_vma=False), *[jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in keep])
        out_specs_flat = _leaf_specs(out_specs, jax.tree_util.tree_unflatten(structure["out"], out_avals))
        out_keep = [i for i, a in enumerate(out_avals) if not _empty(a)]
        res_keep = [i for i, a in enumerate(res_avals) if not _empty(a)]

        def fill(kept_values, keep_idx, avals):
            full = [jnp.zeros(a.shape, a.dtype) for a in avals]
            for i, a in zip(keep_idx, kept_values):
                full[i] = a
            return full

        def global_zeros(local_aval, spec):  # a zero-size output made again outside
            shards = _shards_per_dim(len(local_aval.shape), spec, mesh)
            return jnp.zeros([n * k for n, k in zip(local_aval.shape, shards)], local_aval.dtype)

        def smap(body, body_in_specs, body_out_specs):
            return jax.shard_map(body, mesh=mesh, in_specs=tuple(body_in_specs), out_specs=tuple(body_out_specs),
                                 check_vma=False)

        def forward_outputs(kept, with_residuals):
            def body(*kept_local):
                out_leaves, res_leaves = shard_forward(*kept_local)
                outs = [out_leaves[i] for i in out_keep]
                res = [res_leaves[i][None] for i in res_keep] if with_residuals else []
                return (*outs, *res)

            n_res = len(res_keep) if with_residuals else 0
            return smap(body, [specs[i] for i in keep], [out_specs_flat[i] for i in out_keep] + [stacked] * n_res)(
                *kept)

        def outputs_tree(values):
            full = [global_zeros(out_avals[i], out_specs_flat[i]) for i in range(len(out_avals))]
            for i, a in zip(out_keep, values):
                full[i] = a
            return jax.tree_util.tree_unflatten(structure["out"], full)

        @jax.custom_vjp
        def sharded(*kept):
            return forward_outputs(kept, with_residuals=False)

        def sharded_fwd(*kept):
            results = forward_outputs(kept, with_residuals=True)
            return results[:len(out_keep)], results[len(out_keep):]

        def sharded_bwd(residuals, cts):
            floats = [i for i, a in zip(keep, local_avals) if _inexact(a)]  # inputs with a cotangent
            ct_keep = [i for i in out_keep if _inexact(out_avals[i])]  # outputs with one
            cts = [ct for i, ct in zip(out_keep, cts) if _inexact(out_avals[i])]

            def body(*local):
                res_local, ct_local = local[:len(res_keep)], local[len(res_keep):]
                vjp = jax.tree_util.tree_unflatten(structure["res"], fill([r[0] for r in res_local], res_keep,
                                                                          res_avals))
                ct_full = [_zero_cotangent(a) for a in out_avals]
                for i, ct in zip(ct_keep, ct_local):
                    ct_full[i] = ct
                grads = jax.tree_util.tree_leaves(vjp(jax.tree_util.tree_unflatten(structure["out"], ct_full)))
                return tuple(grads[i] for i in floats)

            grads = smap(body, [stacked] * len(res_keep) + [out_specs_flat[i] for i in ct_keep],
                         [specs[i] for i in floats])(*residuals, *cts)
            by_leaf = dict(zip(floats, grads))
            return tuple(by_leaf.get(i) for i in keep)

        sharded.defvjp(sharded_fwd, sharded_bwd)
        return outputs_tree(sharded(*[leaves[i] for i in keep]))

    return call
