"""Trainer loaders: the Grain pipeline (row streams, per-host shards, iterator state), the
builtin loader, batch placement of a host's shard, and the loader errors."""
import json
import sys

import numpy as np
import pytest

from falcon_jax.train import addition as ad, text as txt
from falcon_jax.train.config import ConfigError
from falcon_jax.train.loader import BuiltinLoader, GrainLoader, make_loader

pytest.importorskip("grain")


def _num(digits) -> int:
    return int("".join(str(int(d)) for d in digits)) if len(digits) else 0


def _text_data(tmp_path, **kw):
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i} " * (3 + i % 4) for i in range(30)))
    return txt.TextData(paths=(str(tmp_path / "a.txt"),), seq_len=17, seed=0, val_frac=0.1,
                      cache_dir=str(tmp_path / "cache"), **kw)


def test_ragged_heldout_equals_is_heldout_row_by_row(rng):
    N, W = 3000, 7
    n = rng.integers(1, W + 1, N)
    a, b = rng.integers(0, 10, (N, W)), rng.integers(0, 10, (N, W))
    b[:40] = a[:40]  # a == b: the canonical order's tie case
    a[40:80], b[40:80] = b[40:80], a[40:80].copy()
    pad = np.arange(W)[None] < n[:, None]
    a, b = a * pad, b * pad
    got = ad._is_heldout_ragged(a, b, n, 11, 0.3)
    want = np.array([ad.is_heldout(a[r:r + 1, :n[r]], b[r:r + 1, :n[r]], 11, 0.3)[0] for r in range(N)])
    np.testing.assert_array_equal(got, want)
    assert 0.25 < got.mean() < 0.35


def test_addition_rows_depend_on_the_row_index_only():
    d = ad.AdditionData(seed=5, train_min_width=1, train_max_width=7)
    all_rows = d.rows(np.arange(300))
    some = d.rows(np.array([299, 7, 150]))  # other neighbours, other order: the same rows
    for k in all_rows:
        np.testing.assert_array_equal(some[k], all_rows[k][[299, 7, 150]])
    assert not np.array_equal(ad.AdditionData(seed=6, train_max_width=7).rows(np.arange(300))["tokens"],
                              all_rows["tokens"])
    widths = set()
    for tok, mask in zip(all_rows["tokens"], all_rows["loss_mask"]):
        lhs, rhs = ad.decode_addition(tok)[len("<bos>"):].split("<eos>")[0].split("=")
        x, y = lhs.split("+")
        n = len(x)
        widths.add(n)
        assert len(y) == n and len(rhs) == n + 1 and int(rhs[::-1]) == int(x) + int(y)
        sl = ad.target_slice(n)
        assert mask.sum() == n + 2 and mask[sl].all() and mask[sl.stop]  # the sum digits and EOS
    assert widths == set(range(1, 8))
    assert (all_rows["segment_ids"] == 0).all()


def test_grain_addition_stream_never_contains_heldout_problems():
    w = 2
    d = ad.AdditionData(seed=1, train_min_width=w, train_max_width=w, eval_widths=(w,), eval_examples=64,
                       heldout_frac=0.1)
    rows = d.rows(np.arange(20000))["tokens"]
    train = {(min(p, q), max(p, q)) for p, q in
             ((_num(r[1:1 + w] - ad.DIGIT0), _num(r[2 + w:2 + 2 * w] - ad.DIGIT0)) for r in rows)}
    ev = d.eval_set(w)
    held = {(min(_num(x), _num(y)), max(_num(x), _num(y))) for x, y in zip(ev["a"], ev["b"])}
    assert held and not (held & train)
    # 20,000 draws cover ~98.8% of the ~4,545 training problems {a, b} (a+b and b+a count once)
    assert len(train) > 0.95 * 0.9 * (100 * 101 / 2)


@pytest.mark.parametrize("threads", [0, 1])
def test_grain_loader_batches_and_checkpointable_state(threads):
    d = ad.AdditionData(seed=2, train_min_width=1, train_max_width=5)
    B = 12
    it = GrainLoader(d, B, threads=threads, prefetch=2)
    got = [next(it) for _ in range(3)]
    for i, b in enumerate(got):  # global batch i = stream rows [iB, (i+1)B)
        np.testing.assert_array_equal(b["tokens"], d.rows(np.arange(i * B, (i + 1) * B))["tokens"])
        assert b["tokens"].shape == (B, d.seq_len) and b["tokens"].dtype == np.int32
    state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
    assert state == {"next_index": 3}
    nxt = [next(it) for _ in range(2)]
    it.close()
    again = GrainLoader(d, B, threads=threads)
    again.set_state(state)
    for want in nxt:
        b = next(again)
        for k in want:
            np.testing.assert_array_equal(b[k], want[k])
    again.close()


def test_grain_host_shards_partition_each_global_batch():
    """Host s of k reads rows (i*B/k + j)*k + s of the stream; together the k hosts hold exactly the
    rows of the one-host batch, and put_batch's layout puts host s's rows in slice s of every
    micro-batch."""
    d = ad.AdditionData(seed=0, train_min_width=1, train_max_width=4)
    B, k, A = 16, 4, 2
    one = GrainLoader(d, B, threads=0)
    hosts = [GrainLoader(d, B, shard=(s, k), threads=0) for s in range(k)]
    for i in range(2):
        full = next(one)["tokens"]
        parts = [next(h)["tokens"] for h in hosts]
        for s, p in enumerate(parts):
            assert p.shape == (B // k, d.seq_len)
            np.testing.assert_array_equal(p, d.rows((i * (B // k) + np.arange(B // k)) * k + s)["tokens"])
        both = np.concatenate(parts)
        assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, full.tolist()))
        # the global [A, B/A] layout: micro-batch a holds slice s of k at rows s*m_loc.. of host s
        m_loc = B // k // A
        glob = np.stack([np.concatenate([p.reshape(A, m_loc, -1)[a] for p in parts]) for a in range(A)])
        assert sorted(map(tuple, glob.reshape(B, -1).tolist())) == sorted(map(tuple, full.tolist()))
    with pytest.raises(ConfigError, match="batch_size=10 does not split over the 4 hosts"):
        GrainLoader(d, 10, shard=(0, 4))


def test_grain_text_loader_shuffles_each_epoch_and_resumes(tmp_path):
    d = _text_data(tmp_path)
    n = d.num_train_starts
    every = d.windows(np.arange(n))["tokens"]
    it = GrainLoader(d, n, threads=0)  # one batch = one epoch
    e0, e1 = next(it)["tokens"], next(it)["tokens"]
    key = lambda x: sorted(map(tuple, x.tolist()))  # noqa: E731
    assert key(e0) == key(every) == key(e1)  # each epoch visits every window start once
    assert not np.array_equal(e0, e1) and not np.array_equal(e0, every)  # reshuffled, not in order
    it2 = GrainLoader(d, 8, threads=1)
    [next(it2) for _ in range(5)]
    st = it2.get_state()
    want = next(it2)
    it3 = GrainLoader(d, 8, threads=1)
    it3.set_state(st)
    b = next(it3)
    for k in want:
        np.testing.assert_array_equal(b[k], want[k])
    seg = b["segment_ids"]
    assert (np.diff(seg, axis=1) >= 0).all() and b["loss_mask"].all()


def test_builtin_loader_is_the_index_based_iterator():
    d = ad.AdditionData(seed=3, train_max_width=4)
    it = make_loader("builtin", d, 8)
    assert isinstance(it, BuiltinLoader) and it.shard == (0, 1)
    next(it), next(it)
    assert it.get_state() == {"step": 2}
    np.testing.assert_array_equal(next(it)["tokens"], d.batch(2, 8)["tokens"])
    it.set_state({"step": 7})
    np.testing.assert_array_equal(next(it)["tokens"], d.batch(7, 8)["tokens"])
    it.close()


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_builtin_read_ahead_keeps_the_stream_across_state_changes(read_ahead):
    d = ad.AdditionData(seed=5, train_max_width=6, pack=True, pack_len=64)
    it = BuiltinLoader(d, 4, read_ahead=read_ahead)
    order = [0, 1, 2]
    got = [next(it)["tokens"] for _ in order]
    it.set_state({"step": 1})  # batches built ahead for steps 3.. are dropped, not served
    order += [1, 2, 3, 4]
    got += [next(it)["tokens"] for _ in range(4)]
    it.close()
    for i, g in zip(order, got):
        np.testing.assert_array_equal(g, d.batch(i, 4)["tokens"])
    with pytest.raises(ValueError, match="read_ahead"):
        BuiltinLoader(d, 4, read_ahead=-1)


def test_loader_errors_name_the_setting_and_the_fix(monkeypatch):
    d = ad.AdditionData(train_max_width=3)
    with pytest.raises(ConfigError, match="data.loader='tf.data'.*'grain', 'builtin'"):
        make_loader("tf.data", d, 8)
    monkeypatch.setitem(sys.modules, "grain", None)  # import grain -> ImportError
    with pytest.raises(ConfigError) as e:
        make_loader("grain", d, 8)
    assert "pip install grain" in str(e.value) and "data.loader=builtin" in str(e.value)
    assert isinstance(make_loader("builtin", d, 8), BuiltinLoader)  # works without grain


def test_put_batch_places_a_host_shard():
    import jax

    from falcon_jax.train.mesh import MeshError, host_shard, make_mesh, put_batch

    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    assert host_shard(mesh, 8, 2) == (0, 1)  # one process holds every row
    x = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    out = put_batch({"tokens": x}, mesh, 2)["tokens"]
    assert out.shape == (2, 4, 3)
    np.testing.assert_array_equal(np.asarray(out).reshape(8, 3), x)
    with pytest.raises(MeshError, match="holds rows \\[2, 4\\).*needs \\[0, 4\\)"):
        put_batch({"tokens": x[:4]}, mesh, 2, shard=(1, 2))  # half the rows cannot fill the device
