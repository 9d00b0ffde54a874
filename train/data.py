"""Data for the trainer: the addition task (docs/results.md), local text corpora, packing, loaders.

Two loaders feed the training loop (``data.loader``, see :mod:`falcon_jax.train.loader`):

* ``"grain"`` (default): a Grain ``MapDataset`` over a *row stream* -- row ``g`` of the training
  stream is a pure function of ``(seed, g)`` (:meth:`AdditionData.rows`; for text, Grain's lazy
  per-epoch shuffle of window starts, then :meth:`TextData.windows`).  Global batch ``i`` is
  the rows ``[i*B, (i+1)*B)``; each host reads only its share of them.  The iterator's state
  (Grain's ``get_state()``, a small JSON dict) is saved in every checkpoint.
* ``"builtin"``: the index-based iterator of the first version: batch ``i`` is computed from
  the seed and ``i`` alone (:meth:`AdditionData.batch`, :meth:`TextData.batch`), state
  ``{"step": i}``; every host builds the whole global batch.

Batches are dicts of numpy arrays, all ``[B, T]``:

* ``tokens`` int32 — the token ids (position t predicts t+1);
* ``segment_ids`` int32 — packed-document ids (the model never passes information across a
  change of id; pairs that cross one are not trained on);
* ``loss_mask`` bool — whether the token at t is a training *target* (used for ``t >= 1``).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Iterable

import numpy as np

# ----------------------------------------------------------------------------- addition
# Character vocabulary of the addition task.  PAD fills the right end of short rows, BOS starts
# every row (the first token the model reads), EOS ends the target (so free-running decoding
# knows when a sum is finished; it is a target too).
PAD, BOS, EOS, PLUS, EQUALS = 0, 1, 2, 3, 4
DIGIT0 = 5  # '0'..'9' are ids 5..14
ADDITION_VOCAB = ("<pad>", "<bos>", "<eos>", "+", "=") + tuple("0123456789")
ADDITION_VOCAB_SIZE = 16  # 15 symbols, rounded up to 16


def addition_seq_len(width: int) -> int:
    """Row length of one width-n problem: BOS, n digits, '+', n digits, '=', n+1 sum digits, EOS."""
    return 3 * width + 5


def decode_addition(ids: Iterable[int]) -> str:
    """Token ids -> a readable string (for logs and docs)."""
    return "".join(ADDITION_VOCAB[int(i)] if 0 <= int(i) < len(ADDITION_VOCAB) else "?" for i in ids)


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (a fast, well-spread integer hash)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def problem_hash(a: np.ndarray, b: np.ndarray, split_seed: int) -> np.ndarray:
    """A 64-bit hash of the *unordered* problem {a, b} at its width.

    a, b: ``[N, n]`` digit arrays (most significant first, zero-padded to width n).
    Returns ``[N]`` uint64.  ``problem_hash(a, b) == problem_hash(b, a)``: the pair is put in
    a canonical order (lexicographic on the digits = numeric order) before hashing, so a+b and
    b+a always land on the same side of the train / held-out split.
    """
    a = np.asarray(a, np.int64)
    b = np.asarray(b, np.int64)
    n = a.shape[1]
    diff = a != b
    first = np.argmax(diff, axis=1)
    rows = np.arange(a.shape[0])
    a_less = np.where(diff.any(axis=1), a[rows, first] < b[rows, first], True)
    lo = np.where(a_less[:, None], a, b)
    hi = np.where(a_less[:, None], b, a)
    with np.errstate(over="ignore"):
        h = _mix64(np.full(a.shape[0], np.uint64(split_seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(n)))
        for col in np.concatenate([lo, hi], axis=1).T:
            h = _mix64(h ^ (col.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))
    return h


def is_heldout(a: np.ndarray, b: np.ndarray, split_seed: int, heldout_frac: float) -> np.ndarray:
    """``[N]`` bool: whether problem {a, b} belongs to the held-out bucket (never trained on)."""
    u = (problem_hash(a, b, split_seed) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < heldout_frac


def _is_heldout_ragged(a: np.ndarray, b: np.ndarray, n: np.ndarray, split_seed: int,
                       heldout_frac: float) -> np.ndarray:
    """:func:`is_heldout` for rows of mixed widths in one pass: ``a, b [N, W]`` digits, row r
    of width ``n[r] <= W`` in its first ``n[r]`` columns and zero after.  Equal to
    ``is_heldout(a[r:r+1, :n[r]], b[r:r+1, :n[r]], ...)`` row by row (tested)."""
    a = np.asarray(a, np.int64)
    b = np.asarray(b, np.int64)
    n = np.asarray(n, np.int64)
    N, W = a.shape
    diff = a != b  # padding is equal in a and b, so the order is decided inside the width
    first = np.argmax(diff, axis=1)
    rows = np.arange(N)
    a_less = np.where(diff.any(axis=1), a[rows, first] < b[rows, first], True)
    lo = np.where(a_less[:, None], a, b)
    hi = np.where(a_less[:, None], b, a)
    with np.errstate(over="ignore"):
        h = _mix64(np.uint64(split_seed) * np.uint64(0x9E3779B97F4A7C15) + n.astype(np.uint64))
        for j in range(2 * W):  # row r hashes lo[:n] then hi[:n]: 2n columns
            col = np.where(j < n, lo[:, min(j, W - 1)], hi[rows, np.clip(j - n, 0, W - 1)])
            h = np.where(j < 2 * n, _mix64(h ^ (col.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))), h)
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return u < heldout_frac


def add_digits(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum of digit arrays ``[N, n]`` (MSD first) as ``[N, n+1]`` digits, *least* significant first."""
    N, n = a.shape
    out = np.zeros((N, n + 1), np.int64)
    carry = np.zeros(N, np.int64)
    for i in range(n):  # from the least significant column
        s = a[:, n - 1 - i] + b[:, n - 1 - i] + carry
        out[:, i] = s % 10
        carry = s // 10
    out[:, n] = carry
    return out


def sample_problems(rng: np.random.Generator, n: int, count: int, *, split_seed: int, heldout_frac: float,
                    heldout: bool) -> tuple[np.ndarray, np.ndarray]:
    """``count`` problems of width n from the train (``heldout=False``) or held-out bucket.

    Operands are uniform n-digit strings (leading zeros allowed: the task writes every operand
    with exactly n digits).  Rejection sampling keeps only problems of the requested bucket,
    so the training stream can never contain a held-out problem.  Returns digit arrays
    ``a, b [count, n]`` (MSD first).
    """
    if heldout and heldout_frac <= 0:
        raise ValueError("sample_problems: heldout_frac is 0, there is no held-out bucket to sample from.")
    a_out, b_out, have = [], [], 0
    for _ in range(10_000):
        m = max(2 * (count - have), 16)
        a = rng.integers(0, 10, size=(m, n))
        b = rng.integers(0, 10, size=(m, n))
        keep = is_heldout(a, b, split_seed, heldout_frac) == heldout
        a_out.append(a[keep]), b_out.append(b[keep])
        have += int(keep.sum())
        if have >= count:
            return np.concatenate(a_out)[:count], np.concatenate(b_out)[:count]
    raise RuntimeError(f"sample_problems: could not find {count} {'held-out' if heldout else 'training'} "
                       f"problems of width {n} (heldout_frac={heldout_frac}).")


def encode_addition(a: np.ndarray, b: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Problems ``a, b [N, n]`` -> a right-padded batch of ``seq_len`` columns.

    Row layout (n = width): ``BOS a_1..a_n + b_1..b_n = s_0..s_n EOS PAD...`` with the sum
    least-significant digit first.  ``loss_mask`` is true on the n+1 sum digits and EOS only.
    """
    N, n = a.shape
    L = addition_seq_len(n)
    if L > seq_len:
        raise ValueError(f"encode_addition: width {n} needs {L} tokens but seq_len is {seq_len}.")
    s = add_digits(a, b)
    tokens = np.full((N, seq_len), PAD, np.int32)
    tokens[:, 0] = BOS
    tokens[:, 1:1 + n] = a + DIGIT0
    tokens[:, 1 + n] = PLUS
    tokens[:, 2 + n:2 + 2 * n] = b + DIGIT0
    tokens[:, 2 + 2 * n] = EQUALS
    tokens[:, 3 + 2 * n:4 + 3 * n] = s + DIGIT0
    tokens[:, 4 + 3 * n] = EOS
    loss_mask = np.zeros((N, seq_len), bool)
    loss_mask[:, 3 + 2 * n:5 + 3 * n] = True
    return {"tokens": tokens, "segment_ids": np.zeros((N, seq_len), np.int32), "loss_mask": loss_mask}


WIDTH_SAMPLING = ("uniform", "token_balanced")


def _hash_digits(key: np.ndarray, count: int) -> np.ndarray:
    """``count`` uniform decimal digits per uint64 ``key`` ``[P]`` -> ``[P, count]`` int64.

    Each splitmix64 value gives a 53-bit fraction u; its first 8 decimal digits are read off
    by ``d = floor(10 u), u = 10 u - d`` (in integers), which leaves every digit uniform to within
    ``10**8 / 2**53 ≈ 1e-8``."""
    per = 8
    words = -(-count // per)
    with np.errstate(over="ignore"):
        h = _mix64(_mix64(key[:, None] ^ (np.arange(words, dtype=np.uint64)[None, :] + np.uint64(0xD16175))))
        u = h >> np.uint64(11)
        mask, ten = np.uint64((1 << 53) - 1), np.uint64(10)
        out = np.empty((len(key), words, per), np.int64)
        for i in range(per):
            u = u * ten
            out[:, :, i] = (u >> np.uint64(53)).astype(np.int64)
            u &= mask
    return out.reshape(len(key), words * per)[:, :count]


def _draw_train_operands(key: np.ndarray, n: np.ndarray, wmax: int, split_seed: int, heldout_frac: float):
    """Operands of problems with keys ``key`` ``[P]`` and widths ``n`` ``[P]``, none in the held-out
    bucket: ``a, b [P, wmax]`` digits, MSD first, zero after each problem's width.  Attempt i of
    problem p draws from ``key[p]`` and i alone, so a problem does not depend on its neighbours."""
    P = len(key)
    a = np.zeros((P, wmax), np.int64)
    b = np.zeros((P, wmax), np.int64)
    pending = np.arange(P)
    pos = np.arange(wmax)[None, :]
    for attempt in range(10_000):
        if not len(pending):
            return a, b
        with np.errstate(over="ignore"):
            k = _mix64(key[pending] + np.uint64(attempt + 1) * np.uint64(0xBF58476D1CE4E5B9))
        digits = _hash_digits(k, 2 * wmax)
        m = n[pending, None]
        ca = np.where(pos < m, digits[:, :wmax], 0)
        cb = np.where(pos < m, digits[:, wmax:], 0)
        ok = np.ones(len(pending), bool)
        for w in np.unique(n[pending]):  # the hash per width: 2n columns each, not 2 * wmax
            r = np.nonzero(n[pending] == w)[0]
            ok[r] = ~is_heldout(ca[r, :w], cb[r, :w], split_seed, heldout_frac)
        a[pending[ok]], b[pending[ok]] = ca[ok], cb[ok]
        pending = pending[~ok]
    raise RuntimeError(f"could not draw training problems (heldout_frac={heldout_frac}).")


def _encode_ragged(a: np.ndarray, b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Problems of mixed widths -> ``(tokens, loss_mask)`` ``[P, 3*wmax + 5]``, problem p laid out
    as :func:`encode_addition` in its first ``addition_seq_len(n[p])`` columns (PAD after)."""
    P, wmax = a.shape
    rows = np.arange(P)[:, None]
    col = np.arange(wmax)[None, :]
    # right-align the operands (zeros in front) to add them column by column
    src = np.clip(col - (wmax - n[:, None]), 0, wmax - 1)
    lead = col < (wmax - n[:, None])
    ar = np.where(lead, 0, a[rows, src])
    br = np.where(lead, 0, b[rows, src])
    s = add_digits(ar, br)  # [P, wmax + 1], LSD first; digit n is the carry, zeros after it
    j = np.arange(3 * wmax + 5)[None, :]
    m = n[:, None]
    tok = np.full((P, 3 * wmax + 5), PAD, np.int64)
    tok = np.where(j == 0, BOS, tok)
    tok = np.where((j >= 1) & (j <= m), a[rows, np.clip(j - 1, 0, wmax - 1)] + DIGIT0, tok)
    tok = np.where(j == m + 1, PLUS, tok)
    tok = np.where((j >= m + 2) & (j <= 2 * m + 1), b[rows, np.clip(j - m - 2, 0, wmax - 1)] + DIGIT0, tok)
    tok = np.where(j == 2 * m + 2, EQUALS, tok)
    target = (j >= 2 * m + 3) & (j <= 3 * m + 3)
    tok = np.where(target, s[rows, np.clip(j - 2 * m - 3, 0, wmax)] + DIGIT0, tok)
    tok = np.where(j == 3 * m + 4, EOS, tok)
    return tok.astype(np.int32), target | (j == 3 * m + 4)


def target_slice(width: int) -> slice:
    """Columns of the n+1 sum digits in a row of :func:`encode_addition` (EOS excluded)."""
    return slice(3 + 2 * width, 4 + 3 * width)


@dataclasses.dataclass
class AdditionData:
    """The addition task: training stream and fixed evaluation sets.

    * training, one problem a row (``pack=False``): every row has its own width, uniform in
      ``[train_min_width, train_max_width]``; rows are padded to
      ``seq_len = addition_seq_len(train_max_width)``;
    * training, packed (``pack=True``): rows of ``pack_len + 1`` tokens (the model reads
      ``pack_len``), each filled with problems one after another, each problem its own segment
      (:meth:`packed_rows`); ``width_sampling`` draws every problem's width: ``"uniform"`` (each
      width equally likely, so longer widths get more tokens) or ``"token_balanced"`` (width n with
      probability ∝ 1 / addition_seq_len(n): each width gets about the same share of tokens);
    * a width curriculum (packed rows, ``curriculum_rows > 0``): row ``g`` draws its widths from
      ``[train_min_width, cap(g)]`` with ``cap(g) = curriculum_start_width + ⌊(train_max_width −
      curriculum_start_width + 1) · g / curriculum_rows⌋`` (at most ``train_max_width``): the widest width
      grows by equal steps over the first ``curriculum_rows`` rows, then stays at ``train_max_width``;
    * evaluation: ``eval_examples`` held-out problems per width in ``eval_widths``, all padded
      to one length (one compiled program for every width).  Eval problems come from the
      held-out bucket of the hash split at *every* width, so they are disjoint from training
      even where the eval widths overlap the training widths.
    """

    seed: int = 0
    train_min_width: int = 1
    train_max_width: int = 8
    eval_widths: tuple[int, ...] = ()
    eval_examples: int = 256
    heldout_frac: float = 0.05
    split_seed: int = 1234
    pack: bool = False
    pack_len: int = 1024
    width_sampling: str = "uniform"
    curriculum_rows: int = 0
    curriculum_start_width: int = 1

    def __post_init__(self):
        if not 1 <= self.train_min_width <= self.train_max_width:
            raise ValueError(f"data: need 1 <= train_min_width <= train_max_width; got "
                             f"{self.train_min_width}, {self.train_max_width}.")
        if not 0 < self.heldout_frac < 1:
            raise ValueError(f"data.heldout_frac={self.heldout_frac} must be in (0, 1).")
        if self.width_sampling not in WIDTH_SAMPLING:
            raise ValueError(f"data.width_sampling={self.width_sampling!r}: use one of "
                             f"{', '.join(repr(w) for w in WIDTH_SAMPLING)}.")
        if self.curriculum_rows < 0 or (self.curriculum_rows and not self.pack):
            raise ValueError(f"data.curriculum_steps: a width curriculum needs packed rows (data.pack=true) and "
                             f"a count >= 0; got {self.curriculum_rows} rows with pack={self.pack}.")
        if self.curriculum_rows and not self.train_min_width <= self.curriculum_start_width <= self.train_max_width:
            raise ValueError(f"data.curriculum_start_width={self.curriculum_start_width} must lie in "
                             f"[train_min_width, train_max_width] = [{self.train_min_width}, {self.train_max_width}].")
        if self.pack and self.pack_len + 1 < addition_seq_len(self.train_max_width):
            raise ValueError(f"data.seq_len={self.pack_len}: a packed row must hold one problem of "
                             f"train_max_width={self.train_max_width} ({addition_seq_len(self.train_max_width)} "
                             f"tokens); use data.seq_len >= {addition_seq_len(self.train_max_width) - 1}.")

    @property
    def seq_len(self) -> int:
        """Columns of a training row (the model reads ``seq_len - 1`` of them)."""
        return self.pack_len + 1 if self.pack else addition_seq_len(self.train_max_width)

    def width_probs(self) -> np.ndarray:
        """Probability of each width ``train_min_width..train_max_width`` for one problem."""
        n = np.arange(self.train_min_width, self.train_max_width + 1)
        p = np.ones(len(n)) if self.width_sampling == "uniform" else 1.0 / addition_seq_len(n)
        return p / p.sum()

    @property
    def eval_seq_len(self) -> int:
        return addition_seq_len(max((*self.eval_widths, self.train_max_width)))

    def batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The training batch of ``step`` (a pure function of ``seed`` and ``step``): ``[B, seq_len]``.
        Packed: the rows ``[step*B, (step+1)*B)`` of :meth:`packed_rows`."""
        if self.pack:
            return self.packed_rows(int(step) * batch_size + np.arange(batch_size))
        rng = np.random.default_rng([self.seed, 0xADD, int(step)])
        widths = rng.integers(self.train_min_width, self.train_max_width + 1, size=batch_size)
        out = {k: np.empty((batch_size, self.seq_len), dt) for k, dt in
               (("tokens", np.int32), ("segment_ids", np.int32), ("loss_mask", bool))}
        for n in np.unique(widths):
            rows = np.nonzero(widths == n)[0]
            a, b = sample_problems(rng, int(n), len(rows), split_seed=self.split_seed,
                                   heldout_frac=self.heldout_frac, heldout=False)
            enc = encode_addition(a, b, self.seq_len)
            for k in out:
                out[k][rows] = enc[k]
        return out

    def rows(self, idx) -> dict[str, np.ndarray]:
        """Rows ``idx`` ``[N]`` (int) of the training row stream (the Grain loader's records):
        ``[N, seq_len]``.

        Row ``g`` depends on ``(seed, g)`` only -- not on the batch size, the host count or the
        rows it is computed with -- through counter-based hashing (splitmix64): its width, then
        candidate operands per attempt, the first candidate outside the held-out bucket kept.
        Vectorised over the rows, so one call per batch is cheap.  Packed data: :meth:`packed_rows`."""
        if self.pack:
            return self.packed_rows(idx)
        idx = np.asarray(idx, np.int64).reshape(-1)
        N, wmax = len(idx), self.train_max_width
        with np.errstate(over="ignore"):
            key = _mix64(_mix64(np.full(N, np.uint64(self.seed) ^ np.uint64(0x5EEDADD0)))
                         + idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            span = np.uint64(wmax - self.train_min_width + 1)
            widths = self.train_min_width + (_mix64(key ^ np.uint64(0xA11CE)) % span).astype(np.int64)
            a = np.zeros((N, wmax), np.int64)
            b = np.zeros((N, wmax), np.int64)
            pending = np.arange(N)
            cols = np.arange(2 * wmax, dtype=np.uint64)
            pos = np.arange(wmax)[None, :]
            for attempt in range(10_000):
                if not len(pending):
                    break
                salt = np.uint64(attempt + 1) << np.uint64(32)
                h = _mix64(_mix64(key[pending, None] ^ (salt | cols[None, :])))
                digits = ((h >> np.uint64(11)) % np.uint64(10)).astype(np.int64)  # [P, 2*wmax]
                n = widths[pending, None]
                ca = np.where(pos < n, digits[:, :wmax], 0)  # zero beyond each row's width
                cb = np.where(pos < n, digits[:, wmax:], 0)
                ok = ~_is_heldout_ragged(ca, cb, widths[pending], self.split_seed, self.heldout_frac)
                a[pending[ok]], b[pending[ok]] = ca[ok], cb[ok]
                pending = pending[~ok]
        if len(pending):
            raise RuntimeError(f"AdditionData.rows: could not draw training problems "
                               f"(heldout_frac={self.heldout_frac}).")
        out = {k: np.empty((N, self.seq_len), dt) for k, dt in
               (("tokens", np.int32), ("segment_ids", np.int32), ("loss_mask", bool))}
        for n in np.unique(widths):
            r = np.nonzero(widths == n)[0]
            enc = encode_addition(a[r, :n], b[r, :n], self.seq_len)
            for k in out:
                out[k][r] = enc[k]
        return out

    def packed_rows(self, idx, *, with_widths: bool = False) -> dict[str, np.ndarray]:
        """Packed training rows ``idx`` ``[N]``: ``[N, pack_len + 1]``; ``with_widths`` adds
        ``widths`` ``[N, K]`` (the width of each row's problems in order, 0 after the last one).

        Row layout: problems ``BOS a + b = s EOS`` (as :func:`encode_addition`) one after another,
        problem k in segment k (the recurrent state resets and attention stops at every
        problem), then PAD to the end in a segment of its own.  Problems are added while they
        fit: a row ends at the first drawn problem that does not.  ``loss_mask`` is true on every
        problem's n+1 sum digits and EOS.  Row ``g`` depends on ``(seed, g)`` only
        (counter-based splitmix64, as :meth:`rows`): slot k's width, then per attempt its
        operands, the first candidate outside the held-out bucket kept."""
        idx = np.asarray(idx, np.int64).reshape(-1)
        N, L, wmax = len(idx), self.pack_len + 1, self.train_max_width
        slots = -(-L // addition_seq_len(self.train_min_width))  # the most problems a row can hold
        with np.errstate(over="ignore"):
            key = _mix64(_mix64(np.full(N, np.uint64(self.seed) ^ np.uint64(0x9ACCED)))
                         + idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            pkey = _mix64(key[:, None] ^ (np.arange(slots, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
                                          + np.uint64(0x51075)))  # [N, slots]: one key per problem slot
            u = (_mix64(pkey ^ np.uint64(0xA11CE)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        cdf = np.cumsum(self.width_probs())
        # a row whose widest width is cap draws from the first cap - min + 1 widths, with their probabilities
        # renormalised: u scaled into [0, cdf[cap - min])
        top = len(cdf) - 1 if not self.curriculum_rows else self.width_cap(idx) - self.train_min_width
        u = u * cdf[top][..., None] if self.curriculum_rows else u
        widths = self.train_min_width + np.minimum(np.searchsorted(cdf, u, side="right"), np.asarray(top)[..., None])
        ends = np.cumsum(addition_seq_len(widths), axis=1)
        fits = ends <= L  # a prefix of every row's slots (ends grow along a row)
        widths = np.where(fits, widths, 0)
        K = max(int(fits.sum(axis=1).max()), 1)
        widths, fits, ends, pkey = widths[:, :K], fits[:, :K], ends[:, :K], pkey[:, :K]
        rows_p, slot_p = np.nonzero(fits)  # the problems, row-major
        n_p, key_p = widths[rows_p, slot_p], pkey[rows_p, slot_p]
        start_p = ends[rows_p, slot_p] - addition_seq_len(n_p)
        a, b = _draw_train_operands(key_p, n_p, wmax, self.split_seed, self.heldout_frac)
        tmpl, tmask = _encode_ragged(a, b, n_p)  # [P, 3*wmax + 5]
        out = {"tokens": np.full((N, L), PAD, np.int32), "loss_mask": np.zeros((N, L), bool)}
        j = np.arange(tmpl.shape[1])
        inside = j[None, :] < addition_seq_len(n_p)[:, None]
        flat = (rows_p * L + start_p)[:, None] + j[None, :]
        out["tokens"].reshape(-1)[flat[inside]] = tmpl[inside]
        out["loss_mask"].reshape(-1)[flat[inside]] = tmask[inside]
        # segment of column c = the number of problems that end at or before c
        used = np.where(fits, ends, L + 1)
        seg = np.zeros((N, L + 1), np.int32)
        np.add.at(seg, (np.repeat(np.arange(N), K), np.minimum(used, L).reshape(-1)), 1)
        out["segment_ids"] = np.cumsum(seg[:, :L], axis=1, dtype=np.int32)
        if with_widths:
            out["widths"] = widths.astype(np.int32)
        return out

    def width_cap(self, idx) -> np.ndarray:
        """The widest width of packed rows ``idx`` under the curriculum (``train_max_width`` without one)."""
        idx = np.asarray(idx, np.int64)
        if not self.curriculum_rows:
            return np.full(idx.shape, self.train_max_width, np.int64)
        lo, hi = self.curriculum_start_width, self.train_max_width
        return np.minimum(lo + (hi - lo + 1) * idx // self.curriculum_rows, hi)

    def width_shares(self, rows: int = 4096, span: int | None = None) -> dict[int, dict[str, float]]:
        """Measured over ``rows`` training rows spread evenly over the first ``span`` (default: the first
        ``rows``): per width, its share of the problems and of the row tokens (problem tokens over all
        columns, padding included), and ``"padding"``: the share of columns that are padding."""
        idx = np.arange(rows) if span is None or span <= rows else np.linspace(0, span - 1, rows).astype(np.int64)
        w = self.packed_rows(idx, with_widths=True)["widths"] if self.pack else None
        if w is None:  # one problem a row: the width of row g, read back from its tokens
            toks = self.rows(idx)["tokens"]
            w = ((toks == PLUS).argmax(axis=1) - 1)[:, None]
            cols = toks.shape[1]
        else:
            cols = self.seq_len
        w = w[w > 0]
        total = rows * cols
        out = {}
        for n in range(self.train_min_width, self.train_max_width + 1):
            k = int((w == n).sum())
            out[n] = {"problems": k / max(len(w), 1), "tokens": k * addition_seq_len(n) / total}
        out["padding"] = 1.0 - float(addition_seq_len(w).sum()) / total
        return out

    def eval_set(self, width: int) -> dict[str, np.ndarray]:
        """The fixed held-out set of ``width``: ``eval_examples`` rows of ``eval_seq_len``, plus
        ``a``/``b`` digit arrays (for checks).  Independent of the training seed's stream; drawn once
        per width and kept (every evaluation of a run reads the same set)."""
        cache = self.__dict__.setdefault("_eval_sets", {})
        if width not in cache:
            cache[width] = self._draw_eval_set(width)
        return cache[width]

    def _draw_eval_set(self, width: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xE7A1, int(width)])
        a, b = sample_problems(rng, width, self.eval_examples, split_seed=self.split_seed,
                               heldout_frac=self.heldout_frac, heldout=True)
        out = encode_addition(a, b, self.eval_seq_len)
        out["a"], out["b"] = a, b
        return out


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then PAD=256, BOS=257, EOS=258 (vocab 259)."""

    kind = "byte"

    def __init__(self):
        self.pad_id, self.bos_id, self.eos_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE trained locally with HF ``tokenizers`` (no download); special tokens
    ``<pad>``, ``<bos>``, ``<eos>`` get the ids 0, 1, 2."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.pad_id, self.bos_id, self.eos_id = (tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>"))
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, path: str | None = None) -> "BPETokenizer":
        try:
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        except ImportError as e:
            raise RuntimeError("data.tokenizer='bpe' needs the 'tokenizers' package: "
                               "pip install 'falcon-jax[train]' (or pip install tokenizers), "
                               "or use data.tokenizer='byte'.") from e
        if path and os.path.exists(path):
            return cls(Tokenizer.from_file(path))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        if path:
            tok.save(path)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


# ----------------------------------------------------------------------------- text corpora
def expand_paths(patterns) -> list[str]:
    """Glob patterns / directories -> a sorted list of .txt/.md/.jsonl/.json/.parquet files."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for p in patterns:
        if os.path.isdir(p):
            for ext in ("txt", "md", "jsonl", "json", "parquet"):
                files += glob.glob(os.path.join(p, "**", f"*.{ext}"), recursive=True)
        else:
            files += glob.glob(p, recursive=True)
    return sorted(set(files))


def read_documents(paths, text_key: str = "text") -> list[str]:
    """Documents from local files: a .txt/.md file is one document per blank-line-separated
    block; .jsonl/.json rows give ``row[text_key]``; .parquet (needs pyarrow) its ``text_key``
    column."""
    files = expand_paths(paths)
    if not files:
        raise FileNotFoundError(f"data.paths={list(paths)!r} matched no .txt/.md/.jsonl/.parquet files.")
    docs: list[str] = []
    for f in files:
        if f.endswith((".jsonl", ".json")):
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    line = line.strip()
                    if line:
                        row = json.loads(line)
                        if text_key not in row:
                            raise KeyError(f"{f}: a row has no key {text_key!r} (set data.text_key).")
                        docs.append(str(row[text_key]))
        elif f.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise RuntimeError(f"{f}: reading parquet needs pyarrow (pip install pyarrow).") from e
            docs += [str(t) for t in pq.read_table(f, columns=[text_key]).column(text_key).to_pylist()]
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                docs += [blk.strip() for blk in fh.read().split("\n\n") if blk.strip()]
    return docs


def tokenize_documents(docs: list[str], tok) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> one token stream ``[N]`` (each doc ``BOS ... EOS``) and its ``[N]`` doc ids."""
    ids, doc_ids = [], []
    for i, d in enumerate(docs):
        t = [tok.bos_id] + tok.encode(d) + [tok.eos_id]
        ids.append(np.asarray(t, np.int32))
        doc_ids.append(np.full(len(t), i, np.int32))
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    return np.concatenate(ids), np.concatenate(doc_ids)


def pack_windows(stream: np.ndarray, doc_ids: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Cut ``[B]`` windows of ``seq_len`` tokens from a packed stream.

    ``segment_ids`` number the documents inside each row from 0 (a document cut by the window
    start is just segment 0); the model resets its state at every change, and the loss skips
    the pair that crosses it.  ``loss_mask`` is all true (each doc's first token is its BOS,
    which is never a target because its pair crosses a boundary).
    """
    idx = starts[:, None] + np.arange(seq_len)[None, :]
    tokens = np.asarray(stream[idx], np.int32)
    d = np.asarray(doc_ids[idx])
    seg = np.concatenate([np.zeros((len(starts), 1), np.int32),
                          np.cumsum(d[:, 1:] != d[:, :-1], axis=1, dtype=np.int32)], axis=1)
    return {"tokens": tokens, "segment_ids": seg, "loss_mask": np.ones_like(tokens, bool)}


@dataclasses.dataclass
class TextData:
    """Packed LM data from local files, tokenized once into memory-mapped ``.npy`` arrays in
    ``cache_dir`` (reused by later runs with the same files and tokenizer).

    Documents are split into train / validation by a hash of their index (``val_frac``).  A
    training batch is ``B`` windows of ``seq_len`` tokens whose start offsets come from a seeded
    permutation of all window starts, a new one every epoch (:meth:`batch` for the builtin
    loader; the Grain loader shuffles the starts itself and reads them with :meth:`windows`).
    """

    paths: tuple[str, ...]
    seq_len: int
    seed: int = 0
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    val_frac: float = 0.05
    text_key: str = "text"
    cache_dir: str = ".cache/falcon-train"

    def __post_init__(self):
        docs = read_documents(self.paths, self.text_key)
        files = expand_paths(self.paths)
        key = hashlib.sha1(json.dumps([[f, os.path.getsize(f), os.path.getmtime(f)] for f in files]
                                      + [self.tokenizer, self.bpe_vocab_size, self.val_frac]).encode()).hexdigest()[:16]
        os.makedirs(self.cache_dir, exist_ok=True)
        base = os.path.join(self.cache_dir, key)
        if self.tokenizer == "byte":
            self.tok = ByteTokenizer()
        elif self.tokenizer == "bpe":
            self.tok = BPETokenizer.train(docs, self.bpe_vocab_size, base + "-bpe.json")
        else:
            raise ValueError(f"data.tokenizer={self.tokenizer!r}: use 'byte' or 'bpe'.")
        is_val = _mix64(np.arange(len(docs), dtype=np.uint64) + np.uint64(7)) % np.uint64(10_000) \
            < np.uint64(int(self.val_frac * 10_000))
        if self.val_frac > 0 and not is_val.any() and len(docs) > 1:
            is_val[-1] = True  # tiny corpora: still keep one validation document
        self.splits = {}
        for name, sel in (("train", ~is_val), ("val", is_val)):
            f_tok, f_doc = f"{base}-{name}-tokens.npy", f"{base}-{name}-docs.npy"
            if not (os.path.exists(f_tok) and os.path.exists(f_doc)):
                stream, dids = tokenize_documents([d for d, s in zip(docs, sel) if s], self.tok)
                for f, arr in ((f_tok, stream), (f_doc, dids)):
                    np.save(f + ".tmp.npy", arr)
                    os.replace(f + ".tmp.npy", f)  # atomic: a killed run never leaves half a file
            self.splits[name] = (np.load(f_tok, mmap_mode="r"), np.load(f_doc, mmap_mode="r"))
        n_train = len(self.splits["train"][0])
        if n_train < self.seq_len + 1:
            raise ValueError(f"data: the training split has {n_train} tokens, fewer than seq_len={self.seq_len}; "
                             "add more text or lower data.seq_len.")

    @property
    def vocab_size(self) -> int:
        return self.tok.vocab_size

    def _starts(self, name: str) -> int:
        return len(self.splits[name][0]) - self.seq_len + 1

    def _epoch_order(self, epoch: int, n: int) -> np.ndarray:
        """The seeded permutation of the ``n`` window starts for ``epoch``.  Drawing it costs
        O(n) (≈0.2 s for 10M starts), so the last two epochs' orders are kept."""
        cache = self.__dict__.setdefault("_orders", {})
        if epoch not in cache:
            if len(cache) >= 2:
                cache.pop(min(cache))
            cache[epoch] = np.random.default_rng([self.seed, 0x7E77, epoch]).permutation(n)
        return cache[epoch]

    @property
    def num_train_starts(self) -> int:
        """How many windows of ``seq_len`` the training stream has (the Grain loader shuffles
        these start offsets, lazily and afresh every epoch)."""
        return self._starts("train")

    def windows(self, starts) -> dict[str, np.ndarray]:
        """Training windows at the token offsets ``starts`` ``[N]``: ``[N, seq_len]``."""
        stream, dids = self.splits["train"]
        return pack_windows(stream, dids, np.asarray(starts, np.int64).reshape(-1), self.seq_len)

    def batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The training batch of ``step``: ``[B, seq_len]`` packed windows."""
        n = self._starts("train")
        pos = int(step) * batch_size + np.arange(batch_size)
        epochs, offs = pos // n, pos % n
        starts = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            starts[epochs == e] = self._epoch_order(int(e), n)[offs[epochs == e]]
        stream, dids = self.splits["train"]
        return pack_windows(stream, dids, starts, self.seq_len)

    def val_batches(self, batch_size: int, max_batches: int):
        """Non-overlapping validation windows, in order (the same every time)."""
        stream, dids = self.splits["val"]
        if len(stream) < self.seq_len:
            return
        starts = np.arange(0, len(stream) - self.seq_len + 1, self.seq_len)
        for i in range(min(max_batches, -(-len(starts) // batch_size))):
            s = starts[i * batch_size:(i + 1) * batch_size]
            if len(s) < batch_size:  # keep one static shape: pad by repeating, masked out below
                b = pack_windows(stream, dids, np.concatenate([s, np.repeat(s[:1], batch_size - len(s))]), self.seq_len)
                b["loss_mask"][len(s):] = False
                yield b
            else:
                yield pack_windows(stream, dids, s, self.seq_len)
