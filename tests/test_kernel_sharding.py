"""``kernel_sharding``: under a sharded jit the Pallas kernel path runs once per device shard
(shard_map), with the same values and gradients as unsharded.  8 simulated CPU devices in a
subprocess (the count is fixed before jax starts), kernels in interpret mode."""
import textwrap

import jax
import numpy as np
import pytest

from falcon_jax.sharding import kernel_sharding
from tests.helpers import run_on_simulated_devices


SCRIPT = textwrap.dedent(r"""
    import json, sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from falcon_jax import falcon
    from falcon_jax.sharding import kernel_sharding
    assert jax.device_count() == 8

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    out = {}

    from falcon_jax.testing import pallas_call_operand_shapes

    def kernel_shapes(fn, *args):  # the first operand's shape of every kernel call
        return [list(operands[0]) for operands in pallas_call_operand_shapes(fn, *args)]

    variants = sys.argv[1].split(",")  # of 1A, 3A, 1 and 2; the first also runs without the context
    for variant, window, per_col in (("1A", 4, False), ("3A", 3, False), ("1", 4, False), ("2", 4, True)):
        if variant not in variants:
            continue
        B, T, H, D = 4, 40, 4, 16
        ks = jax.random.split(jax.random.key(hash(variant) % 1000), 6)
        q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks[:3])
        beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D) if per_col else (B, T, H)))
        lam = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
        seg = jnp.asarray(np.repeat(np.arange(2), T // 2)[None].repeat(B, 0))

        def loss(q, k, v, beta, lam):
            o = falcon(q, k, v, beta, lam, variant=variant, window=window, impl="triton", chunk_size=16,
                       segment_ids=seg)
            return jnp.sum(o * jnp.cos(o)), o

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
        (l0, o0), g0 = f(q, k, v, beta, lam)
        tok = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
        args = [jax.device_put(a, tok) for a in (q, k, v, beta, lam)]
        with kernel_sharding(mesh):
            f_sh = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
            (l1, o1), g1 = f_sh(*args)
            shapes = kernel_shapes(f_sh, *args)
        rel = lambda a, b: float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))
        out[variant] = {"o": rel(o1, o0), "grads": max(rel(a, b) for a, b in zip(g1, g0)),
                        "kernel_first_dims": sorted({tuple(s[:1]) for s in shapes}), "n_kernels": len(shapes)}
        # without the context the same jit runs the kernels on the whole batch
        if variant == variants[0]:
            out["unsharded_first_dims"] = sorted({tuple(s[:1]) for s in kernel_shapes(f, *args)})
    if sys.argv[2:] != ["fallback"]:
        print("RESULT" + json.dumps(out))
        raise SystemExit

    # a batch the shards do not divide: warned once, replicated kernels, same values
    B = 2
    q = jax.random.normal(jax.random.key(1), (B, 24, 4, 16))
    beta = jnp.full((B, 24, 4), 0.5)
    ref = falcon(q, q, q, beta, beta, variant="1A", impl="triton", chunk_size=16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with kernel_sharding(mesh):
            got = jax.jit(lambda q, b: falcon(q, q, q, b, b, variant="1A", impl="triton", chunk_size=16))(q, beta)
    out["fallback_warning"] = [str(x.message) for x in w if "replicated" in str(x.message)]
    out["fallback_err"] = float(jnp.max(jnp.abs(got - ref)))
    print("RESULT" + json.dumps(out))
""")


# Every kernel runs through one wrapper (sharding.per_shard); what differs is the layout and the state it carries.
# The default set: Falcon-3A (decayed attention in the model's layout, its state with a window tail) and Falcon-2 (the
# per-column kernels on flattened rows, gates with a value axis), and the fallback.  Falcon-1A is 3A's op without
# the tail (the LM's Falcon-1A.3 layer runs per shard in test_sharded_lm_train_step_runs_the_kernels_per_shard);
# Falcon-1's kernels run per shard in test_context_parallel.py's test_kernels_split_over_seq_match_one_device.
@pytest.mark.parametrize("variants", ["3A,2", pytest.param("1A,1", marks=pytest.mark.slow)])
def test_kernels_run_per_shard_with_the_same_values_and_gradients(variants):
    default = variants == "3A,2"
    out = run_on_simulated_devices(SCRIPT, 8, variants, *(["fallback"] if default else []))
    for variant in variants.split(","):
        r = out[variant]
        assert r["o"] < 1e-5 and r["grads"] < 1e-5, (variant, r)
        assert r["n_kernels"] > 0, variant
    # kernels see [B*H/shards, ...] (flattened rows) or [B/4, ...] (in place): never the whole batch of 4 x 4 heads
    unsharded = out["unsharded_first_dims"]
    for variant in variants.split(","):
        for dims in out[variant]["kernel_first_dims"]:
            assert dims[0] in (1, 2), (variant, dims)  # B/4 = 1 (BTHD in place) or (B/4)*(H/2) = 2 (flattened)
    assert any(d[0] in (4, 16) for d in unsharded), unsharded
    if default:
        assert len(out["fallback_warning"]) == 1 and "batch 2" in out["fallback_warning"][0]
        assert out["fallback_err"] < 1e-5


def test_kernel_sharding_argument_errors():
    from jax.sharding import Mesh
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    with pytest.raises(ValueError, match="none of the axes"):
        with kernel_sharding(mesh):
            pass
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        with kernel_sharding("mesh"):
            pass
    with kernel_sharding(mesh, batch_axes=("x",), head_axis=None):  # all axes of size 1: a no-op
        from falcon_jax.sharding import current
        assert current() is None
    with kernel_sharding(mesh, batch_axes=None, head_axis="y"):  # no batch axes
        assert current() is None
    # an axis named twice: the specs would name it twice (a DuplicateSpecError deep in the trace) or count its
    # devices twice (a false "does not split" fallback)
    with pytest.raises(ValueError, match="head_axis='x' is also a batch axis"):
        with kernel_sharding(mesh, batch_axes=("x",), head_axis="x"):
            pass
    with pytest.raises(ValueError, match="names an axis twice"):
        with kernel_sharding(mesh, batch_axes=("x", "x"), head_axis=None):
            pass
    for kw in (dict(head_axis=("y",)), dict(seq_axis=["y"]), dict(batch_axes=3)):  # not axis names: not ignored
        with pytest.raises(TypeError, match="must be"):
            with kernel_sharding(mesh, **kw):
                pass


NO_EMPTY_SCRIPT = textwrap.dedent(r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from falcon_jax import falcon
    from falcon_jax.sharding import kernel_sharding

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    row = NamedSharding(mesh, P("data"))
    out = {}
    for variant in ("1A", "1", "3A", "3", "2A"):
        B, T, H, D = 4, 32, 2, 16
        bshape = (B, T, H, D) if variant.startswith("2") else (B, T, H)
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=row) for s in [(B, T, H, D)] * 3 + [bshape, (B, T, H)]]

        def loss(q, k, v, beta, lam):
            return jnp.sum(falcon(q, k, v, beta, lam, variant=variant, impl="triton", chunk_size=16) ** 2)

        with kernel_sharding(mesh, ("data",), None):
            txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).as_text()
        calls = [m.group(0) for m in re.finditer(r"sdy\.manual_computation\([^\n]*", txt)]
        calls += [m.group(0) for m in re.finditer(r"sdy\.return[^\n]*", txt)]
        # every tensor type on a manual computation's operand and return lines, and any zero-size one
        types = [t for c in calls for t in re.findall(r"tensor<([^>]*)>", c)]
        out[variant] = {"manual": len([c for c in calls if "manual_computation" in c]),
                        "zero_size": [t for t in types if re.match(r"(?:\d+x)*0(?:x|$)", t)]}
    print("RESULT" + json.dumps(out))
""")


def test_no_zero_size_array_crosses_the_shard_map():
    """XLA's GPU compiler (jax 0.11.2) dies on a shard_map with a zero-size operand; every rule's sharded
    forward+backward passes none (the window-1 rules' state tails and some residuals are zero-size)."""
    out = run_on_simulated_devices(NO_EMPTY_SCRIPT, devices=2)
    for variant, got in out.items():
        assert got["manual"] >= 2, (variant, got)  # the forward and the backward shard_map
        assert got["zero_size"] == [], (variant, got)


FSDP_SCRIPT = textwrap.dedent(r"""
    import json, re, sys
    import jax, numpy as np
    from flax import nnx
    from falcon_jax.nn import FalconLM, state_shardings
    from falcon_jax.sharding import kernel_sharding
    from falcon_jax.train.config import build_config
    from falcon_jax.train.mesh import make_mesh, put_batch
    from falcon_jax.train.optim import make_optimizer
    from falcon_jax.train.trainer import make_train_step, place_like_params

    B, T = 4, 16
    cfg = build_config(preset="lm-tiny", overrides=["model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                                                    "model.vocab_size=256", "mesh.data=1", "mesh.fsdp=2"])
    lm = cfg.lm_config(vocab_size=256)
    mesh = make_mesh(cfg.mesh)
    gd, ap, ar = nnx.split(nnx.eval_shape(lambda: FalconLM(lm, rngs=nnx.Rngs(0))), nnx.Param, ...)
    _, p, r = nnx.split(FalconLM(lm, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params, rest = jax.device_put((p, r), (state_shardings(ap, mesh), state_shardings(ar, mesh)))
    tx, _ = make_optimizer(cfg.optim, 10, params)
    opt = place_like_params(jax.jit(tx.init)(params), params, mesh)
    batch = put_batch({"tokens": np.ones((B, T + 1), np.int32), "segment_ids": np.zeros((B, T + 1), np.int32),
                       "loss_mask": np.ones((B, T + 1), bool)}, mesh, 1)
    out = {}
    for name in ("free", "constrained"):
        # a new step function each time: jit caches a trace regardless of the context it was made in
        step = make_train_step(gd, tx, (jax.tree.map(lambda x: x.sharding, params),
                                        jax.tree.map(lambda x: x.sharding, opt)))
        args = (params, rest, opt, batch)
        if name == "constrained":
            with kernel_sharding(mesh, ("data", "fsdp"), "tensor"):
                txt = step.lower(*args).compile().as_text()
        else:
            txt = step.lower(*args).compile().as_text()
        # floating-point results only: the loss's take_along_axis gathers its int32 [B, T, 1] target
        # indices (B*T*4 bytes), which is not worth a different loss formula
        out[name] = re.findall(r"= (?:f32|bf16|f16)\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(", txt)
    print("RESULT" + json.dumps(out))
""")


# The activations pinned to the batch axes (the LM's constrain_batch, whatever the impl): in the default set
# test_sharded_lm_train_step_runs_the_kernels_per_shard finds no whole-batch all-gather in a data x fsdp x tensor
# step.  This test adds the pure FSDP mesh and the control (left free, XLA gathers activations).
@pytest.mark.slow
def test_fsdp_step_gathers_weights_not_activations():
    """Under the context the LM pins its activations to the batch axes, so an FSDP step all-gathers
    only weights; left free, XLA gathered whole-batch activations (the logits among them)."""
    out = run_on_simulated_devices(FSDP_SCRIPT, 2)

    def whole_batch(shapes):  # gathered arrays that start [B, T, ...]: activations of every row
        return [s for s in shapes if s.startswith("4,16")]

    assert out["constrained"], "an FSDP step must all-gather its weights"
    assert not whole_batch(out["constrained"]), out["constrained"]
    assert whole_batch(out["free"]), out["free"]  # what the constraint prevents (XLA's choice without it)


STEP_SCRIPT = textwrap.dedent(r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from falcon_jax.nn import FalconLM, state_shardings
    from falcon_jax.sharding import kernel_sharding
    from falcon_jax.train.config import build_config
    from falcon_jax.train.mesh import make_mesh, put_batch
    from falcon_jax.train.optim import make_optimizer
    from falcon_jax.train.trainer import make_train_step, place_like_params

    from falcon_jax.testing import pallas_call_operand_shapes

    def kernel_shapes(fn, *args):  # the first operand's shape of every kernel call
        return [list(operands[0]) for operands in pallas_call_operand_shapes(fn, *args)]

    B, T = 8, 32
    out = {}
    for mixer in sys.argv[1:]:
        cfg = build_config(preset="lm-tiny", overrides=[
            f"model.mixer={mixer}", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.chunk_size=16",
            "model.vocab_size=64", "model.impl=triton", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
            "optim.warmup_steps=0"])
        lm = cfg.lm_config(vocab_size=64)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 64, (B, T + 1)).astype(np.int32)
        batch_np = {"tokens": tokens, "segment_ids": np.repeat(np.arange(2), (T + 1) // 2 + 1)[None, :T + 1]
                    .repeat(B, 0).astype(np.int32), "loss_mask": np.ones((B, T + 1), bool)}
        results = {}
        for name in ("one device", "sharded"):
            devices = jax.devices()[:1] if name == "one device" else jax.devices()
            mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2} if name == "sharded" else
                             {"data": 1, "fsdp": 1, "tensor": 1}, devices)
            gd, ap, ar = nnx.split(nnx.eval_shape(lambda: FalconLM(lm, rngs=nnx.Rngs(0))), nnx.Param, ...)
            _, p, r = nnx.split(FalconLM(lm, rngs=nnx.Rngs(0)), nnx.Param, ...)
            params, rest = jax.device_put((p, r), (state_shardings(ap, mesh), state_shardings(ar, mesh)))
            tx, _ = make_optimizer(cfg.optim, 10, params)
            opt = place_like_params(jax.jit(tx.init)(params), params, mesh)
            batch = put_batch(batch_np, mesh, 1)
            step = make_train_step(gd, tx)
            with kernel_sharding(mesh, ("data", "fsdp"), "tensor"):
                first_dims = sorted({s[0] for s in kernel_shapes(step, params, rest, opt, batch)})
                compiled = step.lower(params, rest, opt, batch).compile()
            hlo = compiled.as_text()
            _, _, metrics = compiled(params, rest, opt, batch)
            gathered = re.findall(r"= (?:f32|bf16|f16)\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
            results[name] = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                             "kernel_first_dims": first_dims,
                             "whole_batch_gathers": [g for g in gathered if g.startswith(f"{B},")]}
        one, sh = results["one device"], results["sharded"]
        out[mixer] = {"loss": [one["loss"], sh["loss"]], "grad_norm": [one["grad_norm"], sh["grad_norm"]],
                      "kernel_first_dims": [one["kernel_first_dims"], sh["kernel_first_dims"]],
                      "whole_batch_gathers": sh["whole_batch_gathers"]}
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("mixer", ["falcon-1A.3", pytest.param("falcon-1.3", marks=pytest.mark.slow)])
def test_sharded_lm_train_step_runs_the_kernels_per_shard(mixer):
    """The train step of a small Falcon LM on a data=2 x fsdp=2 x tensor=2 mesh of simulated devices: the kernels'
    operands carry the per-shard batch and heads (never the global batch of 8), nothing is all-gathered with the
    whole batch in front, and the loss and the gradients' norm equal the one-device step's."""
    out = run_on_simulated_devices(STEP_SCRIPT, 8, mixer)
    for mixer, got in out.items():
        one, sharded = got["kernel_first_dims"]
        # one device: [B, ...] in place (8) or flattened [B*H, ...] (16); sharded: B/4 = 2 or (B/4)*(H/2) = 2
        assert set(one) <= {8, 16} and one, (mixer, got)
        assert set(sharded) == {2}, (mixer, got)
        assert got["whole_batch_gathers"] == [], (mixer, got)
        for name in ("loss", "grad_norm"):
            a, b = got[name]
            assert abs(a - b) < 1e-5 * abs(a), (mixer, name, got)
