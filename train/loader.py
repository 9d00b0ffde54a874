"""Training-batch loaders (``data.loader``): Grain (default) or the builtin index-based iterator.

Both are iterators of host numpy batches, each ``[B_host, T]``, with ``get_state()`` /
``set_state()`` (small JSON dicts, saved in every checkpoint's ``meta`` item and restored on
``--resume``).  A batch is a dict of

* ``tokens`` int32 — the token ids (position t predicts t+1);
* ``segment_ids`` int32 — packed-document ids (the model never passes information across a
  change of id; pairs that cross one are not trained on);
* ``loss_mask`` bool — whether the token at t is a training *target* (used for ``t >= 1``).

Rows come from :mod:`falcon_jax.train.addition` (:class:`AdditionData`) or
:mod:`falcon_jax.train.text` (:class:`TextData`).

``grain`` -- a ``grain.MapDataset`` pipeline::

    row indices (addition: 0, 1, 2, ...; text: window starts, shuffled lazily per epoch, repeated)
      -> [s::k]             this host's rows (s, k from falcon_jax.train.mesh.host_shard)
      -> batch(B / k)       one host batch = the host's rows of one global batch
      -> map(rows)          vectorised: AdditionData.rows / TextData.windows
      -> to_iter_dataset    read-ahead in ``data.grain_threads`` threads (0 = in the caller)

  Global batch i is the stream rows ``[i*B, (i+1)*B)`` for any number of hosts (host s holds
  rows ``(i*B/k + j)*k + s``), so a run may resume on a different host count.  The iterator state is
  Grain's ``{"next_index": i}`` -- the same on every host, which is why one JSON copy in the
  checkpoint serves all of them.
``builtin`` -- batch i = ``data.batch(i, B)``, the whole global batch on every host, built two
  batches ahead in one background thread; state ``{"step": i}``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from falcon_jax.train.addition import AdditionData
from falcon_jax.train.config import ConfigError
from falcon_jax.train.hashing import mix64
from falcon_jax.train.text import TextData

LOADERS = ("grain", "builtin")
_ADDITION_ROWS = 1 << 62  # the addition row stream is endless; Grain needs a length


def import_grain():
    """The ``grain`` module, or a ConfigError that says how to get it or avoid it."""
    try:
        import grain
    except ImportError as e:
        raise ConfigError("data.loader='grain' needs the 'grain' package, which is not importable "
                          f"({e}); install it with `pip install grain` (it is a dependency of falcon-jax), "
                          "or use the builtin loader: --set data.loader=builtin.") from e
    return grain


class BuiltinLoader:
    """Batch i = ``data.batch(i, batch_size)`` (the whole global batch, on every host).

    ``read_ahead`` batches are built in one background thread while the device runs the step (batch i
    depends on i alone, so reading ahead changes nothing in the stream; 0 builds each in the caller)."""

    kind = "builtin"

    def __init__(self, data, batch_size: int, read_ahead: int = 2):
        if read_ahead < 0:
            raise ValueError(f"read_ahead={read_ahead} must be >= 0 (0 builds each batch in the caller).")
        self.data, self.batch_size, self.step = data, batch_size, 0
        self.shard = (0, 1)
        self.read_ahead = read_ahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches") if read_ahead else None
        self._ahead: dict[int, Future] = {}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        i = self.step
        if self._pool is None:
            b = self.data.batch(i, self.batch_size)
        else:
            for j in range(i, i + self.read_ahead + 1):
                if j not in self._ahead:
                    self._ahead[j] = self._pool.submit(self.data.batch, j, self.batch_size)
            b = self._ahead.pop(i).result()
        self.step += 1
        return b

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict):
        self._drop_ahead()
        self.step = int(state["step"])

    def _drop_ahead(self):
        for f in self._ahead.values():
            f.cancel()
        self._ahead.clear()

    def close(self):
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class GrainLoader:
    """This host's rows of every global batch through a Grain ``MapDataset`` (module docstring).

    ``shard = (s, k)``: the host reads slice s of k of each batch (``batch_size % k == 0``);
    ``threads``/``prefetch``: Grain's ``ReadOptions`` (threads reading ahead, and how many
    host batches they may buffer; ``threads=0`` reads in the training thread)."""

    kind = "grain"

    def __init__(self, data, batch_size: int, *, shard: tuple[int, int] = (0, 1), threads: int = 1,
                 prefetch: int = 2):
        grain = import_grain()
        s, k = shard
        if batch_size % k:
            raise ConfigError(f"train.batch_size={batch_size} does not split over the {k} hosts that load "
                              f"different rows; use a multiple of {k}.")
        if threads < 0 or prefetch < 0:
            raise ConfigError(f"data.grain_threads={threads} and data.grain_prefetch={prefetch} must be >= 0.")
        if isinstance(data, AdditionData):
            ds, fn = grain.MapDataset.range(_ADDITION_ROWS), data.rows
        elif isinstance(data, TextData):
            seed = int(mix64(np.asarray([data.seed], np.uint64) ^ np.uint64(0x7E77))[0] % np.uint64(1 << 31))
            ds = grain.MapDataset.range(data.num_train_starts).shuffle(seed=seed).repeat()
            fn = data.windows
        else:
            raise TypeError(f"GrainLoader: unsupported data source {type(data).__name__}.")
        self.shard = (s, k)
        self.dataset = ds[s::k].batch(batch_size // k, drop_remainder=True).map(fn)
        opts = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch if threads else 0)
        self._it = iter(self.dataset.to_iter_dataset(opts))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict:
        return self._it.get_state()

    def set_state(self, state: dict):
        self._it.set_state(state)

    def close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


def make_loader(kind: str, data, batch_size: int, *, shard: tuple[int, int] = (0, 1), threads: int = 1,
                prefetch: int = 2):
    """A loader by its ``data.loader`` name (ConfigError naming the key if unknown)."""
    if kind == "grain":
        return GrainLoader(data, batch_size, shard=shard, threads=threads, prefetch=prefetch)
    if kind == "builtin":
        return BuiltinLoader(data, batch_size)
    raise ConfigError(f"data.loader={kind!r}: use one of {', '.join(repr(x) for x in LOADERS)}.")
