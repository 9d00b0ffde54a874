"""Packed addition rows: layout, loss mask, held-out split, determinism, width distribution; the model on a
packed row equals each problem run alone; a run stopped by train.time_limit_s resumes on the same batches."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from falcon_jax.train import addition as ad


def _packed(**kw):
    args = dict(seed=3, train_min_width=1, train_max_width=9, pack=True, pack_len=200, heldout_frac=0.2)
    args.update(kw)
    return ad.AdditionData(**args)


def _problems(row):
    """Split a packed row by segment and parse every problem: [(segment, a, b, sum_lsd_first, columns)]."""
    out = []
    for s in np.unique(row["segment_ids"]):
        cols = np.nonzero(row["segment_ids"] == s)[0]
        assert (np.diff(cols) == 1).all(), "a segment is one run of columns"
        out.append((int(s), row["tokens"][cols], row["loss_mask"][cols], cols))
    return out


def test_packed_rows_decode_to_valid_problems_one_segment_each():
    d = _packed()
    b = d.packed_rows(np.arange(40), with_widths=True)
    L = d.pack_len + 1
    assert all(b[k].shape == (40, L) for k in ("tokens", "segment_ids", "loss_mask"))
    assert (b["segment_ids"][:, 0] == 0).all() and (np.diff(b["segment_ids"], axis=1) >= 0).all()
    n_problems = 0
    for r in range(40):
        row = {k: b[k][r] for k in b}
        segs = _problems(row)
        widths = [w for w in row["widths"] if w > 0]
        assert len(widths) >= 1
        for s, tok, mask, cols in segs:
            text = ad.decode_addition(tok)
            if s == len(widths):  # the padding after the last problem: its own segment, no targets
                assert set(tok.tolist()) == {ad.PAD} and not mask.any() and cols[-1] == L - 1
                continue
            n = widths[s]
            assert text.startswith("<bos>") and text.endswith("<eos>") and len(tok) == ad.addition_seq_len(n)
            lhs, rhs = text[len("<bos>"):-len("<eos>")].split("=")
            x, y = lhs.split("+")
            assert len(x) == len(y) == n and len(rhs) == n + 1
            assert int(rhs[::-1]) == int(x) + int(y)
            # the loss mask: exactly the n+1 sum digits and EOS
            assert mask.tolist() == [False] * (2 * n + 3) + [True] * (n + 2)
            n_problems += 1
        assert len([s for s in segs if s[0] < len(widths)]) == len(widths)
        # packing stops at the first problem that does not fit: the padding is shorter than that problem
        pad = L - sum(ad.addition_seq_len(w) for w in widths)
        assert 0 <= pad < ad.addition_seq_len(d.train_max_width)
    assert n_problems > 40 * 5


def test_packed_rows_hold_no_heldout_problem_and_depend_on_the_row_index_only():
    d = _packed(train_max_width=3, pack_len=300, heldout_frac=0.3)
    b = d.packed_rows(np.arange(64), with_widths=True)
    seen = 0
    for r in range(64):
        for s, tok, mask, cols in _problems({k: b[k][r] for k in ("tokens", "segment_ids", "loss_mask")}):
            if tok[0] != ad.BOS:
                continue
            text = ad.decode_addition(tok)[len("<bos>"):]
            x, y = text.split("=")[0].split("+")
            a = np.array([[int(c) for c in x]])
            bb = np.array([[int(c) for c in y]])
            assert not ad.is_heldout(a, bb, d.split_seed, d.heldout_frac)[0]
            assert not ad.is_heldout(bb, a, d.split_seed, d.heldout_frac)[0]
            seen += 1
    assert seen > 64 * 20
    # held-out problems do exist at these widths (30 %): the rejection is what keeps them out
    some = d.eval_set(2)
    assert ad.is_heldout(some["a"], some["b"], d.split_seed, d.heldout_frac).all()
    # row g is a function of (seed, g): other neighbours, other order, other batch -> the same rows
    again = d.packed_rows(np.array([63, 5, 20]))
    for k in again:
        np.testing.assert_array_equal(again[k], b[k][[63, 5, 20]])
    assert not np.array_equal(_packed(seed=4, train_max_width=3, pack_len=300, heldout_frac=0.3)
                              .packed_rows(np.arange(64))["tokens"], b["tokens"])
    # a step's batch is rows [step*B, (step+1)*B) of the stream
    np.testing.assert_array_equal(d.batch(2, 16)["tokens"], b["tokens"][32:48])


@pytest.mark.parametrize("sampling", ["uniform", "token_balanced"])
def test_packed_width_distribution(sampling):
    """uniform: each width about equally often (the problem that does not fit at a row's end is dropped, which
    takes a little from the longer widths); token_balanced: each width about the same share of tokens."""
    d = _packed(train_min_width=2, train_max_width=12, pack_len=512, width_sampling=sampling, seed=0)
    w = d.packed_rows(np.arange(1500), with_widths=True)["widths"]
    w = w[w > 0]
    count = np.array([(w == n).sum() for n in range(2, 13)], float)
    tokens = count * ad.addition_seq_len(np.arange(2, 13))
    if sampling == "uniform":
        p = count / count.sum()
        np.testing.assert_allclose(p, 1 / 11, rtol=0.12)
    else:
        t = tokens / tokens.sum()
        np.testing.assert_allclose(t, 1 / 11, rtol=0.12)
        assert count[0] > 2.5 * count[-1]  # short widths drawn far more often
    shares = d.width_shares(rows=300)
    assert abs(sum(v["tokens"] for k, v in shares.items() if k != "padding") + shares["padding"] - 1) < 1e-9
    assert abs(sum(v["problems"] for k, v in shares.items() if k != "padding") - 1) < 1e-9


@pytest.mark.parametrize("sampling", ["uniform", "token_balanced"])
def test_curriculum_caps_each_rows_widths_and_then_opens_the_full_range(sampling):
    """Row g draws widths in [min, cap(g)], cap growing by equal steps from the start width to the widest over
    curriculum_rows rows; within the cap the sampling keeps its shape; past the curriculum the stream draws
    from the full range (the rows past it differ from the no-curriculum stream only by the cap)."""
    kw = dict(train_min_width=1, train_max_width=9, pack_len=256, width_sampling=sampling, seed=4)
    d = _packed(curriculum_rows=600, curriculum_start_width=3, **kw)
    idx = np.arange(900)
    cap = d.width_cap(idx)
    assert cap[0] == 3 and cap[-1] == 9 and (np.diff(cap) >= 0).all()
    steps = [int((cap[:600] == c).sum()) for c in range(3, 10)]  # 600 rows in 7 equal steps
    assert sum(steps) == 600 and max(steps) - min(steps) <= 1
    w = d.packed_rows(idx, with_widths=True)["widths"]
    assert ((w <= cap[:, None]) | (w == 0)).all()
    for c in (3, 6, 9):  # every width up to the cap is drawn, in the sampling's proportions
        ws = w[cap == c]
        ws = ws[ws > 0]
        assert set(np.unique(ws)) == set(range(1, c + 1))
    late = w[idx >= 600]
    late = late[late > 0]
    count = np.array([(late == n).sum() for n in range(1, 10)], float)
    if sampling == "uniform":
        np.testing.assert_allclose(count / count.sum(), 1 / 9, rtol=0.2)
    # past the curriculum: the same rows as without one
    np.testing.assert_array_equal(d.packed_rows(idx[600:])["tokens"], _packed(**kw).packed_rows(idx[600:])["tokens"])
    shares = d.width_shares(rows=200, span=900)
    assert shares[9]["problems"] > 0  # measured over the whole span, not the first (capped) rows
    with pytest.raises(ValueError, match="curriculum_start_width"):
        _packed(curriculum_rows=10, curriculum_start_width=12, **kw)
    with pytest.raises(ValueError, match="pack"):
        ad.AdditionData(curriculum_rows=10)


def test_packed_config_errors_name_the_key():
    from falcon_jax.train.config import ConfigError, build_config
    with pytest.raises(ConfigError, match="data.seq_len"):
        build_config("addition-packed", overrides=["data.seq_len=64"])
    with pytest.raises(ConfigError, match="data.width_sampling"):
        build_config("addition-packed", overrides=["data.width_sampling=balanced"])
    with pytest.raises(ConfigError, match="train.time_limit_s"):
        build_config("addition-packed", overrides=["train.time_limit_s=-1"])
    with pytest.raises(ConfigError, match="data.curriculum_start_width"):
        build_config("addition-packed", overrides=["data.curriculum_steps=100", "data.curriculum_start_width=40"])
    with pytest.raises(ConfigError, match="data.curriculum_steps.*data.pack=true"):
        build_config("addition-paper", overrides=["data.curriculum_steps=100"])
    with pytest.raises(ValueError, match="width_sampling"):
        ad.AdditionData(width_sampling="by-length")
    cfg = build_config("addition-packed", overrides=["model.mixer=transformer"])
    assert cfg.train.batch_size * cfg.data.seq_len * cfg.train.steps > 1e9


# The packed row's problems, segment ids and loss mask are the data's, the same for every mixer: the Transformer's
# masked attention (the cheapest) checks them in the default set.  Each mixer's packed segments are checked where
# they cost less: a Falcon-1A.3 LM's in test_train_data.py's test_packed_rows_do_not_leak_across_segments, Mamba-2's
# layer in test_layers.py's test_mixer_packed_segments_equal_separate_sequences, the flash attention against the
# masked layer on packed rows in test_layers.py.
@pytest.mark.parametrize("mixer,attn_impl", [pytest.param("falcon-1A.3", "auto", marks=pytest.mark.slow),
                                             ("transformer", "auto"),
                                             pytest.param("transformer", "triton", marks=pytest.mark.slow),
                                             pytest.param("mamba2", "auto", marks=pytest.mark.slow)])
def test_model_on_a_packed_row_equals_each_problem_alone(mixer, attn_impl):
    """The logits of every problem of a packed addition row equal those of the problem run alone, and the
    packed loss is the sum of the problems' losses (float32, small shapes).  The Transformer runs both its
    masked attention (XLA on a CPU) and the Pallas flash attention (``attn_impl="triton"``, interpreted)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.train.evaluate import loss_terms

    cfg = LMConfig(mixer=mixer, vocab_size=16, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64,
                   chunk_size=8, attn_impl=attn_impl, dtype="float32", param_dtype="float32")
    model = FalconLM(cfg, rngs=nnx.Rngs(1))
    d = _packed(train_max_width=5, pack_len=60, seed=7)
    row = d.packed_rows(np.array([11]))
    seg = row["segment_ids"][0]
    logits = nnx.jit(lambda m, t, s: m(t, segment_ids=s))
    packed = np.asarray(logits(model, jnp.asarray(row["tokens"]), jnp.asarray(row["segment_ids"])))
    # problems exclude the trailing padding (its positions see only padding)
    n_seg = int(seg.max()) + (1 if row["tokens"][0, -1] != ad.PAD else 0)
    assert n_seg >= 3
    lt = jax.jit(lambda m, *a: loss_terms(m, *a))
    total_s, total_n = 0.0, 0.0
    for s in range(n_seg):
        cols = np.nonzero(seg == s)[0]
        toks = row["tokens"][:, cols]
        alone = np.asarray(model(jnp.asarray(toks)))
        np.testing.assert_allclose(packed[0, cols], alone[0], atol=5e-5, rtol=1e-5)
        s_, n_ = lt(model, jnp.asarray(toks), jnp.zeros_like(jnp.asarray(toks)), jnp.asarray(row["loss_mask"][:, cols]))
        total_s, total_n = total_s + float(s_), total_n + float(n_)
    s_all, n_all = lt(model, jnp.asarray(row["tokens"]), jnp.asarray(row["segment_ids"]), jnp.asarray(row["loss_mask"]))
    assert float(n_all) == total_n == row["loss_mask"].sum()  # every target's pair lies inside its problem
    np.testing.assert_allclose(float(s_all), total_s, rtol=1e-5)


TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.mlp_hidden=32", "model.chunk_size=8",
        "data.seq_len=40", "data.eval_widths=[1,4]", "data.eval_examples=8", "data.greedy_widths=[]",
        "train.batch_size=4", "train.plots=false", "train.log_every=1", "train.eval_every=2",
        "optim.warmup_steps=1", "checkpoint.every=100", "checkpoint.keep=1"]


def _main(run_dir, *extra, resume=False):
    from falcon_jax.train.cli import main
    if resume:
        return main(["--run-dir", str(run_dir), "--resume"])
    args = ["--preset", "addition-packed-tiny", "--run-dir", str(run_dir), "--set", "train.steps=4"]
    for o in TINY + list(extra):
        args += ["--set", o]
    return main(args)


def test_time_limit_stops_with_a_checkpoint_and_resume_continues_the_same_stream(tmp_path, capsys):
    """train.time_limit_s=1 stops every command after its first step (exit 0, a checkpoint, a line saying how
    to continue); the run dir, copied elsewhere, resumes command after command; every step's loss equals the
    uninterrupted run's (so every batch does), and the evaluation skipped at the stop is made on resume."""
    import shutil

    from falcon_jax.train.rundir import metric_records, read_metrics

    assert _main(tmp_path / "ref") == 0
    ref, ref_evals = read_metrics(tmp_path / "ref")
    assert sorted(ref) == [1, 2, 3, 4] and [e["step"] for e in ref_evals] == [2, 4]
    capsys.readouterr()

    first = tmp_path / "first"
    assert _main(first, "train.time_limit_s=1") == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[time limit] train.time_limit_s=1 s: stopped after step 1/4") \
        and last.endswith(f"continue with: falcon-train --run-dir {first} --resume")
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(first, moved)  # the lead carries a run dir to another path: nothing absolute is baked in
    shutil.rmtree(first)
    for want in (2, 3):
        assert _main(moved, resume=True) == 0
        assert max(read_metrics(moved)[0]) == want
        assert f"stopped after step {want}/4" in capsys.readouterr().out
    assert _main(moved, resume=True) == 0  # the last step, then the final evaluation and report
    got, evals = read_metrics(moved)
    assert sorted(got) == [1, 2, 3, 4]
    for s in ref:
        assert got[s]["loss"] == ref[s]["loss"], (s, got[s]["loss"], ref[s]["loss"])
    by_step = {e["step"]: e for e in evals}
    assert sorted(by_step) == [2, 4]
    assert by_step[4]["teacher_forced"] == ref_evals[-1]["teacher_forced"]
    assert [r["step"] for r in metric_records(moved, "time_limit")] == [1, 2, 3]
    assert (moved / "report.txt").exists() and not first.exists()
    assert os.path.exists(moved / "width_shares.json")
    shares = json.load(open(moved / "width_shares.json"))
    assert set(shares["widths"]) == {"1", "2", "3"} and 0 <= shares["padding"] < 0.3


@pytest.mark.slow  # ~1 minute of CPU training
def test_packed_tiny_preset_learns_widths_1_to_3(tmp_path):
    """`falcon-train --preset addition-packed-tiny` (packed rows of 64 tokens) learns the trained widths: mean
    teacher-forced exact match over widths 1-3 of held-out problems >= 90 % at the end."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "falcon_jax.train", "--preset", "addition-packed-tiny", "--run-dir",
                          str(tmp_path / "run"), "--set", "train.plots=false"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    from falcon_jax.train.rundir import read_metrics
    final = read_metrics(tmp_path / "run")[1][-1]
    assert final["step"] == 700 and final["in_dist_exact"] >= 0.9, final["teacher_forced"]
