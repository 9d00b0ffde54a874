"""Mesh construction and placement on 8 simulated CPU devices (in a subprocess: the device
count must be fixed before jax is imported), plus the mesh/batch error messages."""
import textwrap

import pytest

from tests.helpers import run_on_simulated_devices
from falcon_jax.train.mesh import MeshError, resolve_axes

SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    import jax, numpy as np
    assert jax.device_count() == 8, jax.device_count()
    from falcon_jax.train.config import build_config
    from falcon_jax.train.mesh import make_mesh, check_batch, put_batch, MeshError
    from falcon_jax.train.trainer import run
    from falcon_jax.train.rundir import read_metrics

    out = {}
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": -1})
    out["mesh"] = dict(mesh.shape)
    b = put_batch({"tokens": np.arange(16 * 5, dtype=np.int32).reshape(16, 5)}, mesh, 2)["tokens"]
    out["batch_spec"] = str(b.sharding.spec)
    out["batch_shard_shape"] = list(b.sharding.shard_shape(b.shape))
    np.testing.assert_array_equal(np.asarray(b).reshape(16, 5), np.arange(16 * 5).reshape(16, 5))
    for bad in ({"data": 3, "fsdp": 1, "tensor": 1}, {"data": -1, "fsdp": 3, "tensor": 1}):
        try:
            make_mesh(bad); out.setdefault("mesh_errors", []).append(None)
        except MeshError as e:
            out.setdefault("mesh_errors", []).append(str(e))
    try:
        check_batch(make_mesh({"data": 4, "fsdp": 2, "tensor": 1}), 12, 1)
    except MeshError as e:
        out["batch_error"] = str(e)

    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
            "data.train_max_width=3", "data.eval_widths=[2]", "data.eval_examples=8", "data.greedy_widths=[]",
            "train.batch_size=16", "train.steps=3", "train.plots=false", "checkpoint.enabled=false"]
    losses = {}
    # *-pallas: the chunk form through the Pallas kernels (interpret mode), which on 8 devices run per
    # shard inside shard_map (falcon_jax.sharding.kernel_sharding, entered by the trainer)
    pallas = ["model.form=chunk", "model.impl=triton", "model.chunk_size=16"]
    one, eight = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    # data x seq x tensor: every sequence split over 2 devices (context parallelism)
    seq = ["mesh.data=2", "mesh.fsdp=1", "mesh.seq=2", "mesh.tensor=2"]
    runs = {"one": one, "eight": eight, "one-pallas": one + pallas, "eight-pallas": eight + pallas, "eight-seq": seq}
    for name in sys.argv[2].split(","):
        axes = runs[name]
        cfg = build_config(preset="addition-tiny", overrides=tiny + axes + [f"train.run_dir={sys.argv[1]}/{name}"])
        if name.startswith("one"):
            # a 1-device mesh on an 8-device host: restrict via the mesh itself
            import falcon_jax.train.trainer as T
            orig = T.make_mesh
            T.make_mesh = lambda c: orig(c, jax.devices()[:1])
            run(cfg, log=lambda *a: None)
            T.make_mesh = orig
        else:
            run(cfg, log=lambda *a: None)
        losses[name] = [r["loss"] for _, r in sorted(read_metrics(f"{sys.argv[1]}/{name}")[0].items())]
    out["losses"] = losses
    from falcon_jax.train.mesh import check_sequence
    for seq_len, window in ((30, 1), (8, 8)):
        try:
            check_sequence(make_mesh({"data": 2, "fsdp": 1, "seq": 4, "tensor": 1}), seq_len, window)
        except MeshError as e:
            out.setdefault("seq_errors", []).append(str(e))

    # parameter placement through the model's logical axes
    from flax import nnx
    from falcon_jax.nn import FalconLM, state_shardings
    cfg = build_config(preset="addition-tiny", overrides=tiny).lm_config(vocab_size=16)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, params, _ = nnx.split(FalconLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = jax.device_put(params, state_shardings(params, mesh))
    flat = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    out["embedding_spec"] = flat["['embedding'].value"]
    out["q_spec"] = flat["['layers'][0]['mixer']['q_proj']['kernel'].value"]
    print("RESULT" + json.dumps(out))
""")


# The training runs compared with one device's: XLA on the 2 x 2 x 2 mesh and with each sequence split over mesh.seq
# (inside the trainer's kernel_sharding context) in the default set; through the Pallas kernels (interpret mode), on
# one device and on the mesh, marked slow.  The kernels' train step runs per shard on that mesh, loss and gradient
# norm against one device's, in test_kernel_sharding.py's test_sharded_lm_train_step_runs_the_kernels_per_shard, and
# the kernels equal the XLA forms, values and gradients, in tests/kernels/test_falcon_kernels.py.
@pytest.mark.parametrize("runs", ["one,eight,eight-seq", pytest.param("one,one-pallas,eight-pallas",
                                                                      marks=pytest.mark.slow)])
def test_mesh_placement_and_training_on_8_simulated_devices(tmp_path, runs):
    out = run_on_simulated_devices(SCRIPT, 8, str(tmp_path), runs, timeout=240)
    assert out["mesh"] == {"data": 2, "fsdp": 2, "seq": 1, "tensor": 2}
    assert out["batch_spec"] == "P(None, ('data', 'fsdp'))"
    assert out["batch_shard_shape"] == [2, 2, 5]  # [accum, 8 rows / 4 data shards, T]
    e1, e2 = out["mesh_errors"]
    assert e1 and "3 devices but 8 are available" in e1
    assert e2 and "does not divide" in e2
    assert "not divisible by the 8 data-parallel shards" in out["batch_error"]
    assert out["embedding_spec"] == "P('tensor', 'fsdp')"
    assert out["q_spec"] == "P('fsdp', 'tensor')"
    losses = out["losses"]
    assert sorted(losses) == sorted(runs.split(","))
    for suffix in ("", "-pallas"):
        if "eight" + suffix not in losses:
            continue
        one, eight = losses["one" + suffix], losses["eight" + suffix]
        assert len(one) == len(eight) == 3
        for a, b in zip(one, eight):  # the same training run, sharded 2x2x2 instead of on one device
            assert a == pytest.approx(b, rel=1e-4)
    for a, b in zip(losses["one"], losses.get("one-pallas", [])):  # kernels = the XLA parallel form
        assert a == pytest.approx(b, rel=1e-4)
    for a, b in zip(losses["one"], losses.get("eight-seq", [])):  # each sequence split over 2 devices
        assert a == pytest.approx(b, rel=1e-4)
    not_divisible, too_short = out["seq_errors"]
    assert "data.seq_len=30 is not divisible by mesh.seq=4" in not_divisible
    assert "slices of 2 positions, fewer than the model's window of 8" in too_short


def test_resolve_axes_errors():
    assert resolve_axes({"data": -1, "fsdp": 2, "tensor": 1}, 8) == {"data": 4, "fsdp": 2, "tensor": 1}
    assert resolve_axes({"data": 2, "fsdp": 1, "seq": -1, "tensor": 1}, 8) == {"data": 2, "fsdp": 1, "seq": 4,
                                                                               "tensor": 1}
    with pytest.raises(MeshError, match="at most one axis"):
        resolve_axes({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(MeshError, match="positive ints"):
        resolve_axes({"data": 0, "fsdp": 1, "tensor": 1}, 8)
