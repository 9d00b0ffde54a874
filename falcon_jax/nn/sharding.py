"""From logical parameter axes to a device mesh.

Parameters carry logical axis names (see :mod:`falcon_jax.nn.layers`), e.g. the embedding
``("vocab", "embed")``, q/k/v projections ``("embed", "heads")``, output projections
``("heads", "embed")``, SwiGLU ``("embed", "mlp")`` / ``("mlp", "embed")``.  A *rule* maps a
logical name to a mesh axis (or a tuple of them, or None = replicated).  The default for a
``("data", "fsdp", "tensor")`` mesh (:func:`logical_to_mesh_rules`)::

    batch -> ("data", "fsdp")    activations' batch axis
    vocab -> "tensor"            embed -> "fsdp"
    heads -> "tensor"            mlp   -> "tensor"
    norm  -> None                conv  -> None

i.e. FSDP over the model width and tensor parallelism over heads / MLP hidden / vocabulary.
Mesh axes the mesh does not have are dropped, so the same rules serve a 1-D data mesh.
A dimension that a mesh axis does not divide stays replicated on that axis (with 12 heads on
8 tensor shards, say), and a mesh axis is used at most once per parameter.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("conv", None),
)


def _as_tuple(axes):
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def logical_to_mesh_rules(mesh_axes=("data", "fsdp", "tensor"), rules=DEFAULT_RULES) -> tuple:
    """``((logical, mesh_axes_or_None), ...)`` restricted to the axes of ``mesh_axes`` (a
    ``Mesh`` or a sequence of axis names).  The result also works as flax's
    ``nnx.logical_axis_rules`` context."""
    names = tuple(mesh_axes.axis_names) if hasattr(mesh_axes, "axis_names") else tuple(mesh_axes)
    out = []
    for logical, target in rules:
        kept = tuple(a for a in _as_tuple(target) if a in names)
        out.append((logical, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


def logical_spec(axes, shape, mesh, rules=None) -> PartitionSpec:
    """The ``PartitionSpec`` of an array of ``shape`` with logical ``axes`` on ``mesh``."""
    table = dict(logical_to_mesh_rules(mesh, DEFAULT_RULES if rules is None else rules))
    used, spec = set(), []
    for dim, name in zip(shape, axes or ()):
        chosen = []
        size = 1
        for ax in _as_tuple(table.get(name)):
            n = mesh.shape[ax]
            if ax in used or dim % (size * n):
                continue
            chosen.append(ax)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def state_shardings(state, mesh, rules=None):
    """A pytree like ``state`` (an ``nnx.State``; concrete or abstract) of ``NamedSharding``s
    from each variable's logical axes (metadata ``out_sharding``); replicated if it has none."""

    def one(x):
        if isinstance(x, nnx.Variable):
            axes = x.get_metadata().get("out_sharding")
            value = x.get_value()
            return x.replace(NamedSharding(mesh, logical_spec(axes, value.shape, mesh, rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh, rules=None) -> nnx.Module:
    """Place every variable of ``model`` on ``mesh`` by its logical axes (in place; returns it)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh, rules)))
    return model


def create_sharded(make_model, mesh, rules=None) -> nnx.Module:
    """Build ``make_model()`` directly sharded (each parameter initialised on its shards), for
    models too large for one device: ``create_sharded(lambda: FalconLM(cfg, rngs=nnx.Rngs(0)), mesh)``."""
    abstract = nnx.eval_shape(make_model)
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh, rules)

    init = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)
    return nnx.merge(graphdef, init())


def batch_spec(mesh, rules=None, ndim: int = 2, batch_size: int | None = None) -> PartitionSpec:
    """``PartitionSpec`` of a ``[B, ...]`` batch: the batch axis on the ``batch`` rule's mesh axes."""
    shape = (batch_size if batch_size is not None else math.prod(mesh.shape.values()),) + (1,) * (ndim - 1)
    return logical_spec(("batch",) + (None,) * (ndim - 1), shape, mesh, rules)
