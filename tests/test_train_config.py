"""Trainer config, CLI errors, the optimizer's decay mask and gradient accumulation."""
import json

import numpy as np
import pytest

from falcon_jax.train import cli
from falcon_jax.train.config import ConfigError, build_config

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "data.train_max_width=3", "train.batch_size=8", "train.plots=false"]


def _run_cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bad_preset_is_a_clear_error(capsys):
    rc, _, err = _run_cli(["--preset", "addition-tiyn"], capsys)
    assert rc == 2 and "unknown preset 'addition-tiyn'" in err and "addition-tiny" in err


@pytest.mark.parametrize("key,named,hint", [
    ("optim.lrr=1e-3", "optim.lrr", "'lr'"),
    ("model.d_modle=64", "model.d_modle", "'d_model'"),
    ("optimizer.lr=1", "optimizer.lr", "'optim'"),
    ("steps=3", "steps", "section.field"),
])
def test_bad_override_key_names_the_key(capsys, key, named, hint):
    rc, _, err = _run_cli(["--preset", "addition-tiny", "--set", key], capsys)
    assert rc == 2 and repr(named) in err and hint in err


def test_resuming_a_run_dir_that_holds_no_run_says_so(tmp_path, capsys):
    missing = tmp_path / "runs" / "gone"
    for flag in ("--resume", "--resume-or-start"):
        rc, _, err = _run_cli(["--run-dir", str(missing), flag], capsys)
        assert rc == 2 and f"{missing} {flag}: {missing} does not exist" in err and "no run to resume" in err
        assert "--preset" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _run_cli(["--run-dir", str(empty), "--resume"], capsys)
    assert rc == 2 and f"{empty} holds no config.json" in err
    assert not (missing.exists() or any(empty.iterdir()))  # nothing created
    rc, _, err = _run_cli([], capsys)  # no run dir at all: the general message
    assert rc == 2 and "give --preset NAME or --config FILE" in err


def test_bad_override_value_type(capsys):
    rc, _, err = _run_cli(["--preset", "addition-tiny", "--set", "train.steps=many"], capsys)
    assert rc == 2 and "'train.steps' must be a number" in err
    rc, _, err = _run_cli(["--preset", "addition-tiny", "--model", "falcon-9"], capsys)
    assert rc == 2 and "falcon-9" in err  # LMConfig's own message for an unknown mixer
    for value in ("5", '{"a": 1, "b": 2}'):  # not a list: named, with the length wanted
        rc, _, err = _run_cli(["--preset", "addition-tiny", "--set", f"model.layer_mixers={value}"], capsys)
        assert rc == 2 and "LMConfig.layer_mixers must be a sequence of n_layers=2 mixer names" in err


def test_string_fields_keep_the_override_text(capsys):
    """A string-valued key (a path, a name) takes the text after '=' as it is, even all digits; other keys parse it."""
    rc, out, err = _run_cli(["--preset", "lm-tiny", "--run-dir", "5", "--set", "data.cache_dir=007",
                             "--set", "data.paths=123", "--set", "data.text_key=0", "--set", "train.steps=12",
                             "--print-config"], capsys)
    assert rc == 0, err
    cfg = json.loads(out)
    assert cfg["train"]["run_dir"] == "5" and cfg["data"]["cache_dir"] == "007"
    assert cfg["data"]["paths"] == ["123"] and cfg["data"]["text_key"] == "0"
    assert cfg["train"]["steps"] == 12  # a number key still parses
    cfg = build_config(preset="lm-tiny", overrides=['train.run_dir="runs/x"', 'data.paths=["1", "b"]'])
    assert cfg.train.run_dir == "runs/x" and cfg.data.paths == ["1", "b"]  # JSON strings and lists as before


def test_print_config_applies_sources_in_order(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('[optim]\nlr = 5e-4\n[model]\nd_model = 96\n[train]\nsteps = 7\n')
    rc, out, _ = _run_cli(["--preset", "addition-tiny", "--config", str(toml), "--model", "gated_deltanet",
                           "--set", "train.steps=9", "--print-config"], capsys)
    cfg = json.loads(out)
    assert rc == 0
    assert cfg["optim"]["lr"] == 5e-4 and cfg["model"]["d_model"] == 96 and cfg["model"]["mixer"] == "gated_deltanet"
    assert cfg["train"]["steps"] == 9  # --set beats the file
    assert cfg["data"]["train_max_width"] == 4  # the preset shows through


def test_every_preset_builds_a_valid_model_config():
    from falcon_jax.train.config import PRESETS
    for name in PRESETS:
        paths = ["data.paths=corpus"] if not PRESETS[name]["data"].get("paths", True) else []
        cfg = build_config(preset=name, overrides=paths)  # lm-130m has no default corpus
        cfg.lm_config(vocab_size=259)
    with pytest.raises(ConfigError, match="no field 'foo'"):
        build_config(preset="lm-tiny", overrides=["data.foo=1"])


def test_mesh_seq_is_checked_against_the_sequence(capsys):
    """Context parallelism: mesh.seq is a positive int or -1 and divides a text run's data.seq_len; the long preset
    splits 65,536 tokens over every device."""
    cfg = build_config(preset="lm-130m-long", overrides=["data.paths=corpus"])
    assert (cfg.data.seq_len, cfg.mesh.seq, cfg.mesh.data, cfg.train.batch_size) == (65_536, -1, 1, 8)
    assert build_config(preset="lm-tiny", overrides=["mesh.seq=4"]).mesh.seq == 4  # 256 / 4
    rc, _, err = _run_cli(["--preset", "lm-tiny", "--set", "mesh.seq=3"], capsys)
    assert rc == 2 and "mesh.seq=3: must divide data.seq_len=256" in err and "divisor of 256" in err
    rc, _, err = _run_cli(["--preset", "lm-tiny", "--set", "mesh.seq=0"], capsys)
    assert rc == 2 and "mesh.seq=0: must be a positive integer or -1" in err


def test_decay_mask_skips_norms_vectors_and_embedding():
    import jax
    from flax import nnx

    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.train.optim import decay_mask

    model = FalconLM(LMConfig.preset("mamba2-tiny"), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mask = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(decay_mask(params))}
    assert not mask["['embedding'].value"] and not mask["['final_norm']['scale'].value"]
    for k, v in mask.items():
        if any(s in k for s in ("norm", "A_log", "dt_bias", "D_skip")):
            assert not v, k
        if "_proj']['kernel']" in k:
            assert v, k
    mask_e = decay_mask(params, decay_embedding=True)
    assert jax.tree_util.tree_leaves(mask_e)[[jax.tree_util.keystr(p) for p, _ in
                                              jax.tree_util.tree_leaves_with_path(mask_e)].index("['embedding'].value")]


def test_gradient_accumulation_applies_the_gradient_of_the_whole_batch():
    """grad_accum=4 applies the gradient of the token-mean loss of all 16 rows (rows of different widths,
    so the micro-batches hold different numbers of target tokens).  Through SGD with learning rate 1 the
    parameter change is the applied gradient itself, compared with jax.grad of the whole batch's loss."""
    import jax
    import optax
    from flax import nnx

    from falcon_jax.nn import FalconLM
    from falcon_jax.train import evaluate as ev
    from falcon_jax.train.addition import AdditionData
    from falcon_jax.train.mesh import make_mesh, put_batch
    from falcon_jax.train.trainer import make_train_step

    cfg = build_config(preset="addition-tiny", overrides=TINY)
    graphdef, params, rest = nnx.split(FalconLM(cfg.lm_config(vocab_size=16), rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = AdditionData(train_max_width=3, seed=3).batch(0, 16)
    counts = batch["loss_mask"][:, 1:].reshape(4, 4, -1).sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1, counts  # unequal micro-batches: a mean of means would differ

    def whole_batch_loss(p):
        total, n = ev.loss_terms(nnx.merge(graphdef, p, rest), *(jax.numpy.asarray(batch[k]) for k in
                                                                  ("tokens", "segment_ids", "loss_mask")))
        return total / n

    want_loss, want_grad = jax.jit(jax.value_and_grad(whole_batch_loss))(params)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_grad))
    step = make_train_step(graphdef, optax.sgd(1.0))
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    for accum in (1, 4):
        before = jax.tree.map(lambda x: np.array(x), params)
        new_p, _, metrics = step(jax.tree.map(jax.numpy.array, params), rest, optax.sgd(1.0).init(params),
                                 put_batch(batch, mesh, accum))
        applied = jax.tree.map(lambda b, a: b - np.asarray(a), before, new_p)
        assert float(metrics["loss"]) == pytest.approx(float(want_loss), rel=1e-5)
        for got, want in zip(jax.tree.leaves(applied), jax.tree.leaves(want_grad)):
            np.testing.assert_allclose(got, np.asarray(want), rtol=0, atol=1e-4 * scale, err_msg=f"grad_accum={accum}")


def test_bad_init_mode_is_a_clear_error(capsys, tmp_path):
    rc, _, err = _run_cli(["--preset", "addition-tiny", "--set", "train.init=lazy", "--set", "train.steps=1",
                           "--run-dir", str(tmp_path / "run")], capsys)
    assert rc == 2 and "train.init='lazy'" in err and "'eager'" in err and "'jit'" in err
