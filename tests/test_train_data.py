"""Trainer data: the addition task (determinism, correctness, disjointness) and packing."""
import json
import os
import re

import numpy as np
import pytest

from falcon_jax.train import addition as ad, text as txt


def _num(digits) -> int:
    return int("".join(str(int(d)) for d in digits)) if len(digits) else 0


def test_addition_batches_are_deterministic_per_step():
    d = ad.AdditionData(seed=3, train_min_width=1, train_max_width=6)
    b1, b2 = d.batch(17, 32), ad.AdditionData(seed=3, train_min_width=1, train_max_width=6).batch(17, 32)
    for k in b1:
        np.testing.assert_array_equal(b1[k], b2[k])
    assert not np.array_equal(d.batch(18, 32)["tokens"], b1["tokens"])
    assert not np.array_equal(ad.AdditionData(seed=4, train_max_width=6).batch(17, 32)["tokens"], b1["tokens"])


def test_addition_rows_encode_the_sum_lsd_first_and_mask_only_the_target():
    d = ad.AdditionData(seed=0, train_min_width=1, train_max_width=7)
    b = d.batch(0, 200)
    widths = set()
    for tok, mask in zip(b["tokens"], b["loss_mask"]):
        text = ad.decode_addition(tok)
        assert text.startswith("<bos>")
        body = text[len("<bos>"):].split("<eos>")[0]
        lhs, rhs = body.split("=")
        a, bb = lhs.split("+")
        n = len(a)
        widths.add(n)
        assert len(bb) == n and len(rhs) == n + 1
        assert int(rhs[::-1]) == int(a) + int(bb)  # the target is the sum, least significant digit first
        sl = ad.target_slice(n)
        expect = np.zeros_like(mask)
        expect[sl.start:sl.stop + 1] = True  # n+1 digits and EOS
        np.testing.assert_array_equal(mask, expect)
        assert (tok[ad.addition_seq_len(n):] == ad.PAD).all()
    assert widths == set(range(1, 8))  # uniform widths cover the whole configured range


def test_problem_hash_is_symmetric_and_split_is_disjoint():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 10, (500, 5)), rng.integers(0, 10, (500, 5))
    np.testing.assert_array_equal(ad.problem_hash(a, b, 7), ad.problem_hash(b, a, 7))
    assert len(set(ad.problem_hash(a, b, 7).tolist())) > 490  # spreads distinct problems
    frac = ad.is_heldout(rng.integers(0, 10, (20000, 6)), rng.integers(0, 10, (20000, 6)), 7, 0.1).mean()
    assert 0.08 < frac < 0.12


@pytest.mark.parametrize("width", [2, 3])
def test_train_stream_never_contains_heldout_problems(width):
    d = ad.AdditionData(seed=1, train_min_width=width, train_max_width=width, eval_widths=(width,),
                       eval_examples=64, heldout_frac=0.1)
    train = set()
    for step in range(60):
        for row in d.batch(step, 64)["tokens"]:
            a, b = _num(row[1:1 + width] - ad.DIGIT0), _num(row[2 + width:2 + 2 * width] - ad.DIGIT0)
            train.add((min(a, b), max(a, b)))
    ev = d.eval_set(width)
    held = {(min(_num(x), _num(y)), max(_num(x), _num(y))) for x, y in zip(ev["a"], ev["b"])}
    assert held and train and not (held & train)  # a+b and b+a are one problem
    assert len(train) > 0.5 * (10 ** width) ** 2 / 2 * 0.9 if width == 2 else True


def test_eval_sets_are_fixed_and_heldout_at_every_width():
    d = ad.AdditionData(seed=0, train_max_width=4, eval_widths=(1, 4, 9), eval_examples=32)
    for n in (1, 4, 9):
        e1, e2 = d.eval_set(n), d.eval_set(n)
        np.testing.assert_array_equal(e1["tokens"], e2["tokens"])
        assert e1["tokens"].shape == (32 if n > 1 else 10, d.eval_seq_len)  # width 1: 10 held-out problems
        assert ad.is_heldout(e1["a"], e1["b"], d.split_seed, d.heldout_frac).all()
        assert ad.is_heldout(e1["b"], e1["a"], d.split_seed, d.heldout_frac).all()


def _every_heldout(n, split_seed, heldout_frac):
    grid = np.indices((10,) * (2 * n)).reshape(2 * n, -1).T  # every (a, b) digit string
    keep = ad.is_heldout(grid[:, :n], grid[:, n:], split_seed, heldout_frac)
    return {(_num(r[:n]), _num(r[n:])) for r in grid[keep]}


def test_eval_sets_hold_distinct_problems_or_every_heldout_one():
    """Width n has 100**n problems (ordered pairs), about heldout_frac of them held out: 10 at width 1 and 501 at
    width 2 with split seed 1234.  An eval set holds eval_examples distinct held-out problems, or every held-out
    problem of a width that has fewer, each once."""
    every = {n: _every_heldout(n, 1234, 0.05) for n in (1, 2)}
    assert (len(every[1]), len(every[2])) == (10, 501)
    for examples in (300, 600):
        d = ad.AdditionData(seed=0, train_max_width=4, eval_widths=(1, 2, 3, 9), eval_examples=examples)
        for n in (1, 2, 3, 9):
            ev = d.eval_set(n)
            got = [(_num(x), _num(y)) for x, y in zip(ev["a"], ev["b"])]
            assert len(set(got)) == len(got) == len(ev["tokens"]), (examples, n)  # no problem twice
            assert ad.is_heldout(ev["a"], ev["b"], d.split_seed, d.heldout_frac).all()
            if n in every and len(every[n]) <= examples:
                assert set(got) == every[n]
            else:
                assert len(got) == examples and (n not in every or set(got) <= every[n])
            for row, (a, b) in zip(ev["tokens"], got):  # the rows are the listed problems
                lhs = ad.decode_addition(row)[len("<bos>"):].split("=")[0]
                assert lhs == f"{a:0{n}d}+{b:0{n}d}"
    empty = next(s for s in range(100) if not _every_heldout(1, s, 0.02))
    with pytest.raises(ValueError, match=rf"^data.eval_widths: width 1 has no held-out problem with "
                                         rf"data.split_seed={empty}, data.heldout_frac=0.02"):
        ad.AdditionData(eval_widths=(1,), heldout_frac=0.02, split_seed=empty).eval_set(1)


def test_teacher_forced_accuracy_counts_each_problem_once(monkeypatch):
    """A width with fewer held-out problems than eval_examples is padded to one shape (one compiled program) but
    scored on its own rows; the record says how many there were."""
    from falcon_jax.train import evaluate as ev_mod
    d = ad.AdditionData(seed=0, train_max_width=4, eval_widths=(1, 2, 5), eval_examples=64)
    shapes = []

    def first_row_right(graphdef, state, tokens):  # teacher-forced oracle on row 0 only; wrong digits elsewhere
        tokens = np.asarray(tokens)
        shapes.append(tokens.shape)
        pred = np.full(tokens[:, 1:].shape, ad.PLUS)
        pred[0] = tokens[0, 1:]
        return pred

    monkeypatch.setattr(ev_mod, "_predict", first_row_right)
    acc = ev_mod.addition_accuracy(None, None, d, [1, 2, 5])
    assert set(shapes) == {(64, d.eval_seq_len)}
    assert {n: acc[n]["problems"] for n in acc} == {1: 10, 2: 64, 5: 64}
    for n, k in ((1, 10), (2, 64), (5, 64)):
        assert acc[n]["exact"] == acc[n]["digit"] == 1 / k


def test_pack_windows_segments_follow_documents():
    tok = txt.ByteTokenizer()
    stream, docs = txt.tokenize_documents(["ab", "cde", "f"], tok)
    assert stream.tolist() == [257, 97, 98, 258, 257, 99, 100, 101, 258, 257, 102, 258]
    b = txt.pack_windows(stream, docs, np.array([2, 0]), 8)
    assert b["segment_ids"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 2]
    assert b["segment_ids"][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(b["tokens"][1], stream[:8])


def test_packed_rows_do_not_leak_across_segments():
    """A packed row gives the same logits as each document run alone, and the loss skips the
    pairs that cross a boundary (changing the other document changes nothing)."""
    import jax.numpy as jnp
    from flax import nnx

    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.train.evaluate import loss_terms as loss_terms_eager

    cfg = LMConfig.preset("falcon-1A.3-tiny", vocab_size=32, chunk_size=8, dtype="float32", param_dtype="float32")
    model = FalconLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    d1, d2 = rng.integers(3, 32, 11), rng.integers(3, 32, 13)
    row = np.concatenate([d1, d2])[None].astype(np.int32)
    seg = np.concatenate([np.zeros(11), np.ones(13)])[None].astype(np.int32)
    # jitted: eager, the six calls below dispatched op by op for over a minute on the 2-core CI machine
    logits = nnx.jit(lambda m, tokens, segment_ids: m(tokens, segment_ids=segment_ids))
    loss_terms = nnx.jit(loss_terms_eager)
    packed = np.asarray(logits(model, jnp.asarray(row), jnp.asarray(seg)))
    alone1 = np.asarray(logits(model, jnp.asarray(d1[None].astype(np.int32)), None))
    alone2 = np.asarray(logits(model, jnp.asarray(d2[None].astype(np.int32)), None))
    np.testing.assert_allclose(packed[0, :11], alone1[0], atol=2e-5)
    np.testing.assert_allclose(packed[0, 11:], alone2[0], atol=2e-5)
    # the loss of the packed row = the two documents' losses (the crossing pair is left out)
    mask = np.ones_like(row, bool)
    s, n = loss_terms(model, jnp.asarray(row), jnp.asarray(seg), jnp.asarray(mask))
    s1, n1 = loss_terms(model, jnp.asarray(d1[None].astype(np.int32)), jnp.zeros((1, 11), jnp.int32),
                        jnp.ones((1, 11), bool))
    s2, n2 = loss_terms(model, jnp.asarray(d2[None].astype(np.int32)), jnp.zeros((1, 13), jnp.int32),
                        jnp.ones((1, 13), bool))
    assert float(n) == float(n1 + n2) == 22
    np.testing.assert_allclose(float(s), float(s1 + s2), rtol=1e-5)


def test_text_data_from_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph number {i} " * 5 for i in range(40)))
    with open(tmp_path / "b.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"json doc {i} " * 6}) + "\n")
    kw = dict(paths=(str(tmp_path),), seq_len=33, seed=0, val_frac=0.1, cache_dir=str(tmp_path / "cache"))
    d = txt.TextData(**kw)
    b = d.batch(5, 4)
    assert b["tokens"].shape == (4, 33) and b["tokens"].max() < d.vocab_size
    np.testing.assert_array_equal(b["tokens"], txt.TextData(**kw).batch(5, 4)["tokens"])  # cached + deterministic
    assert len(d.splits["val"][0]) > 0 and len(d.splits["train"][0]) > 0
    vb = list(d.val_batches(4, 2))
    assert vb and vb[0]["tokens"].shape == (4, 33)
    with pytest.raises(FileNotFoundError, match="matched no"):
        txt.TextData(**dict(kw, paths=(str(tmp_path / "nothing*.txt"),)))


def test_text_data_keys_its_token_cache_by_the_files_it_read(tmp_path, monkeypatch):
    """data.paths is listed once: a file that appears after the listing (another process writing into the corpus
    folder) is neither read nor in the cache key, so a later run over both files tokenizes them, rather than
    reusing a cache keyed by both files that holds the first file's tokens only."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"first file {i} " * 4 for i in range(8)))
    expand = txt.expand_paths

    def a_file_appears_after_the_listing(paths):
        files = expand(paths)
        (corpus / "b.txt").write_text("\n\n".join(f"second file {i} " * 4 for i in range(8)))
        return files

    kw = dict(paths=(str(corpus),), seq_len=16, val_frac=0.0, cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(txt, "expand_paths", a_file_appears_after_the_listing)
    first = txt.TextData(**kw)
    monkeypatch.setattr(txt, "expand_paths", expand)
    second = txt.TextData(**kw)
    only_a = txt.tokenize_documents(txt.read_documents([str(corpus / "a.txt")]), txt.ByteTokenizer())[0]
    both = txt.tokenize_documents(txt.read_documents([str(corpus)]), txt.ByteTokenizer())[0]
    np.testing.assert_array_equal(first.splits["train"][0], only_a)
    np.testing.assert_array_equal(second.splits["train"][0], both)
    assert first.corpus != second.corpus


class _OracleAdder:
    """A stand-in for ``FalconLM.generate``: writes each row's true sum (LSD first) and EOS after its
    own prompt, except the first ``wrong`` rows of width ``bad_width`` (their first sum digit off by one)."""

    def __init__(self, bad_width, wrong):
        self.bad_width, self.wrong, self.calls = bad_width, wrong, 0

    def generate(self, tokens, max_new_tokens, *, lengths, greedy):
        assert greedy
        self.calls += 1
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        out = np.zeros((tokens.shape[0], tokens.shape[1] + max_new_tokens), np.int32)
        seen = {}
        for r, (row, L) in enumerate(zip(tokens, lengths)):
            n = (L - 3) // 2  # BOS, n digits, '+', n digits, '='
            a, b = row[1:1 + n] - ad.DIGIT0, row[2 + n:2 + 2 * n] - ad.DIGIT0
            s = ad.add_digits(a[None], b[None])[0]
            k = seen[n] = seen.get(n, -1) + 1
            if n == self.bad_width and k < self.wrong:
                s[0] = (s[0] + 1) % 10
            out[r, :L] = row[:L]
            out[r, L:L + n + 1] = s + ad.DIGIT0
            out[r, L + n + 1:L + n + 2] = ad.EOS  # where the row has room for it
        return out


def test_greedy_accuracy_reads_each_rows_own_answer_from_one_generate_call():
    from falcon_jax.train.evaluate import addition_greedy
    d = ad.AdditionData(seed=1, train_max_width=4, eval_widths=(1, 3, 7), eval_examples=16)
    oracle = _OracleAdder(bad_width=3, wrong=4)
    got = addition_greedy(oracle, d, [1, 3, 7], examples=8)
    assert oracle.calls == 1  # every width in one call: one compiled program
    assert got == {1: 1.0, 3: 0.5, 7: 1.0}


def test_greedy_accuracy_of_a_model_equals_one_generate_call_per_width():
    import jax.numpy as jnp
    from flax import nnx
    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.train.evaluate import addition_greedy
    d = ad.AdditionData(seed=2, train_max_width=5, eval_widths=(2, 5), eval_examples=8)
    model = FalconLM(LMConfig(vocab_size=ad.ADDITION_VOCAB_SIZE, d_model=32, n_layers=1, n_heads=2, mixer="falcon-1A",
                              chunk_size=4, init_std=0.3, dtype="float32", param_dtype="float32"), rngs=nnx.Rngs(0))
    widths, k = [2, 5], 6
    # an untrained model gets nothing right: compare with a version of the model's own answers as the targets
    alone = {}
    for n in widths:
        sl = ad.target_slice(n)
        gen = np.asarray(model.generate(jnp.asarray(d.eval_set(n)["tokens"][:k, :sl.start]), n + 1, greedy=True))
        alone[n] = gen[:, sl.start:]
        d.eval_set(n)["tokens"][:k // 2, sl] = alone[n][:k // 2]  # half the rows: the model's answer is "right"
    assert addition_greedy(model, d, widths, examples=k) == {n: 0.5 for n in widths}


def _text_data(tmp_path, paths, **kw):
    return txt.TextData(paths=tuple(str(p) for p in paths), seq_len=9, cache_dir=str(tmp_path / "cache"), **kw)


def test_text_cache_is_keyed_by_the_text_field(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"a": f"alpha {i}", "b": f"beta {i}"}) + "\n" for i in range(30)))
    a = _text_data(tmp_path, [f], text_key="a")
    b = _text_data(tmp_path, [f], text_key="b")  # the same file, size and mtime: another field
    assert a.tok.decode(a.splits["train"][0]).startswith("alpha 0")
    assert b.tok.decode(b.splits["train"][0]).startswith("beta 0")


def test_text_cache_is_keyed_by_the_file_contents(tmp_path, monkeypatch):
    """A file rewritten with other text of the same size and the same mtime (e.g. within the file system's
    mtime resolution) is tokenized again, not served from the previous text's cache."""
    f = tmp_path / "rows.jsonl"
    lines = lambda word: "".join(json.dumps({"text": f"{word} {i}"}) + "\n" for i in range(30))
    f.write_text(lines("alpha"))
    stat = os.stat(f)
    a = _text_data(tmp_path, [f])
    assert a.tok.decode(a.splits["train"][0]).startswith("alpha 0")
    f.write_text(lines("gamma"))  # as many bytes as "alpha"
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (os.stat(f).st_size, os.stat(f).st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    b = _text_data(tmp_path, [f])
    assert b.tok.decode(b.splits["train"][0]).startswith("gamma 0")
    fresh = txt.TextData(paths=(str(f),), seq_len=9, cache_dir=str(tmp_path / "fresh"))
    for name in ("train", "val"):
        for got, want in zip(b.splits[name], fresh.splits[name]):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the first text again: its cache entry is still there and is read back without tokenizing
    f.write_text(lines("alpha"))
    monkeypatch.setattr(txt, "tokenize_documents", lambda *a: pytest.fail("the token cache was not reused"))
    c = _text_data(tmp_path, [f])
    np.testing.assert_array_equal(np.asarray(c.splits["train"][0]), np.asarray(a.splits["train"][0]))


def test_every_path_entry_must_match_and_globbed_directories_are_read(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("\n\n".join(f"sub paragraph {i}" for i in range(20)))
    (tmp_path / "b.txt").write_text("top level text " * 10)
    with pytest.raises(FileNotFoundError, match="at '.*typo.txt'.*fix that entry"):
        _text_data(tmp_path, [tmp_path / "b.txt", tmp_path / "typo.txt"])  # one entry's data would be dropped
    docs = txt.read_documents([str(tmp_path / "*")])  # the glob matches the directory sub/ and b.txt
    assert docs == [("top level text " * 10).strip()] + [f"sub paragraph {i}" for i in range(20)]  # sorted paths


@pytest.mark.parametrize("name, content, error", [
    ("latin1.txt", "café au lait\n".encode("latin-1"), r"latin1.txt is not UTF-8 text \(byte 3, line 1"),
    ("latin1.jsonl", '{"text": "ok"}\n{"text": "café"}\n'.encode("latin-1"), r"latin1.jsonl is not UTF-8.*line 2"),
    ("null.jsonl", b'{"text": "ok"}\n{"text": null}\n', r"null.jsonl:2: 'text' is NoneType"),
    ("number.json", b'[{"text": "ok"}, {"text": 7}]', r"number.json: row 1: 'text' is int"),
    ("list.jsonl", b'["text", "a"]\n', r"list.jsonl:1: a row must be a JSON object"),
    ("cut.jsonl", b'{"text": "ok"}\n{"text": "cut\n', r"cut.jsonl:2: not a JSON row"),
    ("corpus.txt.gz", b"\x1f\x8b\x08\x00", r"corpus.txt.gz is compressed"),
])
def test_corpus_bytes_and_rows_that_are_not_text_are_errors(tmp_path, name, content, error):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=error):
        txt.read_documents([str(tmp_path / name)])


def test_json_arrays_and_a_byte_order_mark_are_read(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "first"}, {"text": "second"}], indent=2))
    (tmp_path / "b.jsonl").write_bytes('\ufeff{"text": "third"}\n'.encode())
    (tmp_path / "c.txt").write_bytes("\ufeffüber".encode())
    assert txt.read_documents([str(tmp_path)]) == ["first", "second", "third", "über"]


def test_crlf_paragraphs_and_line_separators_inside_json_strings(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first para\r\nstill first\r\n\r\nsecond para\r\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one\u2028row"}, ensure_ascii=False) + "\n"
                                      + json.dumps({"text": "two"}) + "\r\n")
    assert txt.read_documents([str(tmp_path)]) == ["first para\nstill first", "second para", "one\u2028row", "two"]


def test_a_cut_saved_bpe_tokenizer_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "bpe.json"
    txt.BPETokenizer.train(["some text to train on"] * 4, vocab_size=270, path=str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["bpe.json"]  # no temporary file left
    path.write_text(path.read_text()[:100])
    with pytest.raises(ValueError, match="bpe.json cannot be read.*delete it"):
        txt.BPETokenizer.train(["other"], vocab_size=270, path=str(path))


def test_token_cache_writers_do_not_share_a_temporary_file(tmp_path):
    """Another process writing the same cache file (a second host of the run, sharing cache_dir) keeps its
    temporary file: with a shared name this writer's rename would take it, and the other's rename fail."""
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i} " * 4 for i in range(30)))
    first = _text_data(tmp_path, [tmp_path / "a.txt"])
    arrays = sorted((tmp_path / "cache").glob("*.npy"))
    assert len(arrays) == 4
    others = []
    for f in arrays:
        other = f.with_name(f.name + ".tmp.npy")
        other.write_bytes(b"another writer, mid-write")
        others.append(other)
        f.unlink()
    again = _text_data(tmp_path, [tmp_path / "a.txt"])
    np.testing.assert_array_equal(again.splits["train"][0], first.splits["train"][0])
    assert all(o.read_bytes() == b"another writer, mid-write" for o in others)
    assert sorted((tmp_path / "cache").glob("*.npy")) == sorted(arrays + others)  # nothing else left behind


def test_a_file_rewritten_while_it_is_read_caches_the_text_it_read_under_that_texts_key(tmp_path, monkeypatch):
    """The token cache is keyed by the files' digests.  A file rewritten right after it was read (another process
    finishing it) must not put the old text's tokens under the new text's key: every later run over the new text
    would train on the old one.  Documents and digest come from one read of the bytes, so the run trains on the
    text it read, and the next run tokenizes the new text."""
    f = tmp_path / "rows.jsonl"
    lines = lambda word: "".join(json.dumps({"text": f"{word} {i}"}) + "\n" for i in range(30))
    f.write_text(lines("alpha"))
    read = txt.read_bytes

    def rewritten_after_reading(path):
        data = read(path)
        f.write_text(lines("gamma"))
        return data

    monkeypatch.setattr(txt, "read_bytes", rewritten_after_reading)
    a = _text_data(tmp_path, [f])
    assert a.tok.decode(a.splits["train"][0]).startswith("alpha 0")
    monkeypatch.setattr(txt, "read_bytes", read)
    b = _text_data(tmp_path, [f])
    assert b.tok.decode(b.splits["train"][0]).startswith("gamma 0")
    assert a.corpus != b.corpus


def test_token_cache_key_holds_the_cache_format(tmp_path, monkeypatch):
    """A change to what the cache holds for the same files (``CACHE_FORMAT``) tokenizes them again rather than
    serving the tokens an older format wrote."""
    f = tmp_path / "a.txt"
    f.write_text("\n\n".join(f"paragraph {i} " * 4 for i in range(20)))
    _text_data(tmp_path, [f])
    calls = []
    tokenize = txt.tokenize_documents
    monkeypatch.setattr(txt, "tokenize_documents", lambda *a: calls.append(1) or tokenize(*a))
    _text_data(tmp_path, [f])
    assert calls == []  # the same format: read back
    monkeypatch.setattr(txt, "CACHE_FORMAT", txt.CACHE_FORMAT + 1)
    _text_data(tmp_path, [f])
    assert len(calls) == 2  # train and validation tokenized again


def test_rows_of_empty_text_are_left_out_and_a_corpus_of_them_is_an_error(tmp_path):
    """A JSON row whose text is empty or only whitespace is no document (as a blank block of a .txt file): it adds
    no BOS, EOS pair to the token stream, and a corpus of such rows only is refused, not trained on its BOS and EOS
    tokens.  The other documents keep their training / validation side (drawn by their row's index)."""
    from falcon_jax.train.hashing import mix64
    f = tmp_path / "rows.jsonl"
    texts = [f"document {i} " * 3 if i % 3 else ("" if i % 2 else " \n\t") for i in range(60)]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    d = _text_data(tmp_path, [f], val_frac=0.2)
    is_val = mix64(np.arange(60, dtype=np.uint64) + np.uint64(7)) % np.uint64(10_000) < np.uint64(2_000)
    assert 0 < is_val.sum() < 60
    for name, side in (("train", ~is_val), ("val", is_val)):
        want = txt.tokenize_documents([t for t, s in zip(texts, side) if s and t.strip()], d.tok)[0]
        np.testing.assert_array_equal(np.asarray(d.splits[name][0]), want)
    # a corpus too small to draw a validation document keeps its last one with text, not a last empty row
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", "a" * 40, "b" * 40, ""]))
    d = _text_data(tmp_path, [few], val_frac=0.01)
    assert d.tok.decode(d.splits["val"][0]) == "b" * 40 and d.tok.decode(d.splits["train"][0]) == "a" * 40
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", "  ", "\n"] * 50))
    with pytest.raises(ValueError, match="150 of them empty or only whitespace"):
        _text_data(tmp_path, [empty], val_frac=0.0)


@pytest.mark.parametrize("damage", ["cut", "empty", "other"])
def test_a_damaged_token_cache_file_is_named(tmp_path, damage):
    """A cached token file cut short, emptied or replaced (a disk fault, a copy): an error naming the file and the
    fix, not numpy's 'mmap length is greater than file size' or an EOFError out of the trainer."""
    f = tmp_path / "a.txt"
    f.write_text("\n\n".join(f"paragraph {i} " * 4 for i in range(20)))
    _text_data(tmp_path, [f])
    (cached,) = (tmp_path / "cache").glob("*-train-tokens.npy")
    if damage == "cut":
        with open(cached, "r+b") as fh:
            fh.truncate(os.path.getsize(cached) // 2)
    elif damage == "empty":
        cached.write_bytes(b"")
    else:
        np.save(cached, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match=f"token cache file {re.escape(str(cached))} .*delete it"):
        _text_data(tmp_path, [f])
    cached.unlink()
    assert len(_text_data(tmp_path, [f]).splits["train"][0]) > 0
