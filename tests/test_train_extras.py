"""Trainer paths that need the ``train`` extras or more set-up: the locally trained BPE
tokenizer, jsonl / parquet corpora, the memory-mapped token cache, the PNG plots, and a
bf16-compute step on fp32 master parameters."""
import json
import os

import numpy as np
import pytest

from falcon_jax.train import addition as ad, text as txt

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Fast weights are written by an outer product and read by a query.",
    "Ünïcödé text — with em dashes, ümlauts and 漢字 — must round-trip.",
    "def f(x):\n    return x + 1  # code, tabs\tand newlines\n",
] + [f"document number {i} talks about topic {i % 7} and item {i * 13 % 29}." for i in range(60)]


def test_bpe_tokenizer_trained_locally(tmp_path):
    pytest.importorskip("tokenizers")
    tok = txt.BPETokenizer.train(TEXTS, vocab_size=320, path=str(tmp_path / "bpe.json"))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 259 < tok.vocab_size <= 320  # 3 specials + 256 byte symbols + learned merges
    for t in TEXTS[:4] + ["unseen words: zebra quokka ÆØÅ 🙂"]:
        ids = tok.encode(t)
        assert tok.decode(ids) == t  # byte-level: any text, seen or not, round-trips
        assert all(3 <= i < tok.vocab_size for i in ids)
    assert len(tok.encode(TEXTS[0])) < 0.6 * len(TEXTS[0].encode())  # merges learned on the corpus
    again = txt.BPETokenizer.train(TEXTS, vocab_size=320)  # deterministic training
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1]) and again.vocab_size == tok.vocab_size
    loaded = txt.BPETokenizer.train(["something else entirely"], vocab_size=300, path=str(tmp_path / "bpe.json"))
    assert loaded.encode(TEXTS[2]) == tok.encode(TEXTS[2])  # the saved tokenizer is reused as is


def test_jsonl_and_parquet_corpora(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    with open(tmp_path / "a.jsonl", "w") as f:
        for t in TEXTS[:3]:
            f.write(json.dumps({"body": t, "id": 1}) + "\n\n")  # blank lines are skipped
    pq.write_table(pa.table({"body": TEXTS[3:6], "n": [1, 2, 3]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("first block\n\nsecond block\n")
    docs = txt.read_documents([str(tmp_path)], text_key="body")
    assert docs == TEXTS[:3] + TEXTS[3:6] + ["first block", "second block"]  # sorted file order
    with pytest.raises(KeyError, match="no key 'text'.*data.text_key"):
        txt.read_documents([str(tmp_path / "a.jsonl")])
    with pytest.raises(Exception, match="text"):
        txt.read_documents([str(tmp_path / "b.parquet")])  # no 'text' column


def test_pretokenized_cache_is_memory_mapped_and_reused(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("tokenizers")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.table({"text": TEXTS[:40]}), corpus / "a.parquet")
    with open(corpus / "b.jsonl", "w") as f:
        for t in TEXTS[40:]:
            f.write(json.dumps({"text": t}) + "\n")
    kw = dict(paths=(str(corpus),), seq_len=25, seed=0, tokenizer="bpe", bpe_vocab_size=300, val_frac=0.1,
              cache_dir=str(tmp_path / "cache"))
    d = txt.TextData(**kw)
    stream, dids = d.splits["train"]
    assert isinstance(stream, np.memmap) and isinstance(dids, np.memmap) and stream.dtype == np.int32
    assert len(d.splits["val"][0]) > 0
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len([f for f in files if f.endswith(".npy")]) == 4 and any(f.endswith("-bpe.json") for f in files)
    assert not any("tmp" in f for f in files)  # written atomically
    docs = txt.read_documents(kw["paths"])
    n_train = sum(1 for i in range(len(docs)) if i not in set(np.unique(d.splits["val"][1]).tolist()))
    assert stream[0] == d.tok.bos_id and (np.asarray(stream) == d.tok.bos_id).sum() == n_train
    b = d.batch(3, 4)
    assert b["tokens"].shape == (4, 25) and b["tokens"].max() < d.vocab_size <= 300

    # a second run reads the arrays back without tokenizing anything
    monkeypatch.setattr(txt, "tokenize_documents", lambda *a: pytest.fail("the token cache was not reused"))
    d2 = txt.TextData(**kw)
    np.testing.assert_array_equal(d2.batch(3, 4)["tokens"], b["tokens"])
    # changing a file's bytes invalidates its cache entry
    with open(corpus / "b.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(pytest.fail.Exception, match="not reused"):
        txt.TextData(**kw)


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    from falcon_jax.train.config import build_config
    from falcon_jax.train.report import make_plots

    cfg = build_config(preset="addition-tiny")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, 41):
            f.write(json.dumps({"kind": "train", "step": s, "loss": 2.5 * 0.95 ** s, "grad_norm": 1.0}) + "\n")
        tf = {str(w): {"exact": max(0.0, 1 - 0.2 * w), "digit": max(0.1, 1 - 0.1 * w)} for w in range(1, 9)}
        f.write(json.dumps({"kind": "eval", "step": 40, "teacher_forced": tf, "greedy": {"2": 0.9, "8": 0.0}}) + "\n")
        f.write('{"kind": "train", "step": 41, "loss"')  # a line cut by a kill is skipped
    written, note = make_plots(str(tmp_path), cfg)
    assert note is None
    assert written == [str(tmp_path / "loss.png"), str(tmp_path / "accuracy_vs_width.png")]
    for name in ("loss.png", "accuracy_vs_width.png"):
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(path)
        assert img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.05  # something is drawn, not a blank canvas
    # an LM run: no accuracy plot, a validation curve on the loss plot
    lm = tmp_path / "lm"
    lm.mkdir()
    with open(lm / "metrics.jsonl", "w") as f:
        for s in range(1, 11):
            f.write(json.dumps({"kind": "train", "step": s, "loss": 5.0 / s}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": 10, "val_loss": 0.7}) + "\n")
    assert make_plots(str(lm), build_config(preset="lm-tiny")) == ([str(lm / "loss.png")], None)
    assert (lm / "loss.png").stat().st_size > 1000 and not (lm / "accuracy_vs_width.png").exists()


def test_bf16_compute_with_fp32_master_params_overfits_a_batch():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from falcon_jax.nn import FalconLM
    from falcon_jax.train.config import build_config
    from falcon_jax.train.mesh import make_mesh, put_batch
    from falcon_jax.train.optim import make_optimizer
    from falcon_jax.train.trainer import make_train_step

    cfg = build_config(preset="addition-tiny", overrides=[
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "model.dtype=bfloat16", "model.param_dtype=float32", "data.train_max_width=3",
        "optim.lr=1e-2", "optim.warmup_steps=2"])
    lm = cfg.lm_config(vocab_size=16)
    model = FalconLM(lm, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(ad.AdditionData(train_max_width=3).batch(0, 8)["tokens"])
    # the projections compute in bf16 (the fast-weight recurrence itself runs in fp32)
    dots = [ln for ln in str(jax.make_jaxpr(lambda t: model(t))(tokens)).splitlines() if "dot_general" in ln]
    assert sum(":bf16[" in ln for ln in dots) >= 4, dots
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    tx, _ = make_optimizer(cfg.optim, 40, params)
    opt_state = tx.init(params)
    step = make_train_step(graphdef, tx)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    batch = put_batch(ad.AdditionData(train_max_width=3).batch(0, 8), mesh, 1)
    losses = []
    for _ in range(40):  # the same 8 problems every step: an overfit
        params, opt_state, m = step(params, rest, opt_state, batch)
        losses.append(float(m["loss"]))
    assert np.isfinite(losses).all()
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}  # master copy stays fp32
    assert {x.dtype for x in jax.tree.leaves(opt_state) if hasattr(x, "dtype") and x.ndim} == {jnp.dtype("float32")}
    assert losses[-1] < 0.5 * losses[0], losses


def test_text_run_through_grain_with_bpe_and_plots(tmp_path):
    """End to end on a local corpus: BPE, Grain-loaded packed windows, validation, loss.png."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("matplotlib")
    from falcon_jax.train.config import build_config
    from falcon_jax.train.rundir import metric_records, read_metrics
    from falcon_jax.train.trainer import run

    with open(tmp_path / "c.jsonl", "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    cfg = build_config(preset="lm-tiny", overrides=[
        f'data.paths=["{tmp_path / "c.jsonl"}"]', "data.tokenizer=bpe", "data.bpe_vocab_size=300",
        "data.seq_len=16", f"data.cache_dir={tmp_path / 'cache'}", "data.val_frac=0.2", "data.val_batches=2",
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8",
        "train.steps=6", "train.batch_size=4", "train.eval_every=0", "train.log_every=3",
        f"train.run_dir={tmp_path / 'run'}", "checkpoint.enabled=false"])
    lines = []
    summary = run(cfg, log=lines.append)
    run_dir = tmp_path / "run"
    assert lines[0] == f"Run directory: {run_dir}"  # said first, as an absolute path
    assert any("loader grain" in ln for ln in lines)
    # progress: step 1 at once (with the time it took), then every log_every steps
    progress = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split("|")[0].split()[1] for ln in progress] == ["1/6", "3/6", "6/6"]
    assert "first step" in progress[0] and "next line at step 3" in progress[0] and "tok/s" in progress[1]
    train, evals = read_metrics(run_dir)
    assert sorted(train) == list(range(1, 7)) and all(np.isfinite(r["loss"]) for r in train.values())
    assert evals[-1]["val_tokens"] > 0 and np.isfinite(evals[-1]["val_loss"])
    (first,) = metric_records(run_dir, "first_step")
    assert first["step"] == 1 and first["seconds"] > 0
    assert [r["step"] for r in metric_records(run_dir, "speed")] == [3, 6]
    assert summary["final_step"] == 6 and (run_dir / "loss.png").stat().st_size > 1000
    # the end: the table saved as report.txt, and the files listed
    assert (run_dir / "report.txt").read_text().startswith("Validation at step 6: loss ")
    listing = lines[lines.index(f"Files in {run_dir}:") + 1:]
    assert [ln.split()[0] for ln in listing] == ["report.txt", "loss.png", "metrics.jsonl", "config.json"]


def test_resume_refuses_a_bpe_tokenizer_other_than_the_checkpoints(tmp_path):
    """The BPE tokenizer is trained on data.paths: a corpus that changed since the checkpoint gives another one,
    whose ids stand for other tokens than the ones the model learned.  --resume refuses and moves nothing; with
    the run's corpus it continues, the tokenizer trained again (another cache_dir) being the same."""
    pytest.importorskip("tokenizers")
    from falcon_jax.train.config import build_config
    from falcon_jax.train.rundir import RunDirError, checkpoint_steps, read_metrics
    from falcon_jax.train.trainer import run

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(TEXTS))
    run_dir = tmp_path / "run"

    def cfg(steps, cache):
        return build_config(preset="lm-tiny", overrides=[
            f'data.paths=["{corpus}"]', "data.tokenizer=bpe", "data.bpe_vocab_size=300", "data.seq_len=16",
            f"data.cache_dir={tmp_path / cache}", "data.val_frac=0.2", "data.val_batches=1", "model.d_model=32",
            "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=64", "model.chunk_size=8", f"train.steps={steps}",
            "train.batch_size=4", "train.eval_every=0", "train.plots=false", f"train.run_dir={run_dir}",
            "checkpoint.every=2"])

    run(cfg(2, "cache"), log=lambda line: None)
    files = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    corpus.write_text("\n\n".join(TEXTS + [f"another corpus: river {i}, bridge {i * 3}, castle." for i in range(40)]))
    with pytest.raises(RunDirError, match=r"--resume: checkpoint 2 in .* was trained with another tokenizer than "
                                          r"data.paths gives now \(BPE .* in the run, BPE .* here\).*Nothing was "
                                          r"moved"):
        run(cfg(4, "cache"), resume=True, log=lambda line: None)
    assert checkpoint_steps(str(run_dir)) == [2] and not (run_dir / "checkpoints_corrupt").exists()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == files
    corpus.write_text("\n\n".join(TEXTS))
    run(cfg(4, "another-cache"), resume=True, log=lambda line: None)
    assert checkpoint_steps(str(run_dir)) == [2, 4] and sorted(read_metrics(str(run_dir))[0]) == [1, 2, 3, 4]
