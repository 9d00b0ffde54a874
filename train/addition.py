"""The addition task (docs/results.md): vocabulary, the hashed train / held-out split, problem
drawing, encoding, packed rows and :class:`AdditionData`.

Rows for both loaders (:mod:`falcon_jax.train.loader`): :meth:`AdditionData.rows` (row ``g`` of the
training stream is a pure function of ``(seed, g)``) for ``"grain"``, :meth:`AdditionData.batch`
(batch ``i`` from the seed and ``i`` alone) for ``"builtin"``.  Batches are dicts of numpy
``[B, T]`` arrays ``tokens``, ``segment_ids``, ``loss_mask`` (see the loader module).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from falcon_jax.train.hashing import mix64

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
        h = mix64(np.full(a.shape[0], np.uint64(split_seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(n)))
        for col in np.concatenate([lo, hi], axis=1).T:
            h = mix64(h ^ (col.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)))
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
        h = mix64(np.uint64(split_seed) * np.uint64(0x9E3779B97F4A7C15) + n.astype(np.uint64))
        for j in range(2 * W):  # row r hashes lo[:n] then hi[:n]: 2n columns
            col = np.where(j < n, lo[:, min(j, W - 1)], hi[rows, np.clip(j - n, 0, W - 1)])
            h = np.where(j < 2 * n, mix64(h ^ (col.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))), h)
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


LISTED_WIDTH = 3  # widths up to this one have few enough problems (10**(2n)) to list every held-out one


def heldout_problems(n: int, split_seed: int, heldout_frac: float) -> tuple[np.ndarray, np.ndarray]:
    """Every held-out problem of width ``n <= LISTED_WIDTH``: digit arrays ``a, b [M, n]`` (ordered pairs: a+b and
    b+a are two rows), in numeric order of ``(a, b)``."""
    if not 1 <= n <= LISTED_WIDTH:
        raise ValueError(f"heldout_problems: width {n} has too many problems to list (widths 1-{LISTED_WIDTH}).")
    i = np.arange(100 ** n, dtype=np.int64)
    place = 10 ** np.arange(n - 1, -1, -1, dtype=np.int64)
    a, b = (i // 10 ** n)[:, None] // place % 10, (i % 10 ** n)[:, None] // place % 10
    keep = is_heldout(a, b, split_seed, heldout_frac)
    return a[keep], b[keep]


def _first_occurrences(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``a, b [N, n]`` without repeats of a problem, the first of each kept, in order."""
    _, first = np.unique(np.concatenate([a, b], axis=1), axis=0, return_index=True)
    keep = np.sort(first)
    return a[keep], b[keep]


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
        h = mix64(mix64(key[:, None] ^ (np.arange(words, dtype=np.uint64)[None, :] + np.uint64(0xD16175))))
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
            k = mix64(key[pending] + np.uint64(attempt + 1) * np.uint64(0xBF58476D1CE4E5B9))
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
    * evaluation: ``eval_examples`` distinct held-out problems per width in ``eval_widths`` (every held-out
      problem of a width that has fewer, e.g. width 1's handful of its 100), all padded
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
            key = mix64(mix64(np.full(N, np.uint64(self.seed) ^ np.uint64(0x5EEDADD0)))
                         + idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            span = np.uint64(wmax - self.train_min_width + 1)
            widths = self.train_min_width + (mix64(key ^ np.uint64(0xA11CE)) % span).astype(np.int64)
            a = np.zeros((N, wmax), np.int64)
            b = np.zeros((N, wmax), np.int64)
            pending = np.arange(N)
            cols = np.arange(2 * wmax, dtype=np.uint64)
            pos = np.arange(wmax)[None, :]
            for attempt in range(10_000):
                if not len(pending):
                    break
                salt = np.uint64(attempt + 1) << np.uint64(32)
                h = mix64(mix64(key[pending, None] ^ (salt | cols[None, :])))
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
            key = mix64(mix64(np.full(N, np.uint64(self.seed) ^ np.uint64(0x9ACCED)))
                         + idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            pkey = mix64(key[:, None] ^ (np.arange(slots, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
                                          + np.uint64(0x51075)))  # [N, slots]: one key per problem slot
            u = (mix64(pkey ^ np.uint64(0xA11CE)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
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
        """The fixed held-out set of ``width``: ``k = min(eval_examples, held-out problems of the width)`` distinct
        problems as rows of ``eval_seq_len``, plus ``a``/``b`` digit arrays ``[k, width]`` (for checks).
        Independent of the training seed's stream; drawn once per width and kept (every evaluation of a run reads
        the same set)."""
        cache = self.__dict__.setdefault("_eval_sets", {})
        if width not in cache:
            cache[width] = self._draw_eval_set(width)
        return cache[width]

    def _draw_eval_set(self, width: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xE7A1, int(width)])
        want, draw = self.eval_examples, dict(split_seed=self.split_seed, heldout_frac=self.heldout_frac, heldout=True)
        pool = heldout_problems(width, self.split_seed, self.heldout_frac) if width <= LISTED_WIDTH else None
        if pool is not None and len(pool[0]) == 0:
            raise ValueError(f"data.eval_widths: width {width} has no held-out problem with "
                             f"data.split_seed={self.split_seed}, data.heldout_frac={self.heldout_frac}; drop the "
                             f"width or change the split.")
        if pool is not None and len(pool[0]) <= want:
            return self._encode_eval_set(*pool)  # all of them
        # drawn with replacement, repeats dropped, then topped up from the same stream
        a, b = _first_occurrences(*sample_problems(rng, width, want, **draw))
        if pool is not None and len(a) < want:  # from the problems not yet taken, in a random order
            place = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
            code = lambda x, y: (x @ place) * 10 ** width + y @ place  # noqa: E731
            rest = np.flatnonzero(~np.isin(code(*pool), code(a, b)))
            pick = rest[rng.permutation(len(rest))[:want - len(a)]]
            a, b = np.concatenate([a, pool[0][pick]]), np.concatenate([b, pool[1][pick]])
        for _ in range(1000):
            if len(a) >= want:
                return self._encode_eval_set(a, b)
            more_a, more_b = sample_problems(rng, width, want - len(a), **draw)
            a, b = _first_occurrences(np.concatenate([a, more_a]), np.concatenate([b, more_b]))
        raise RuntimeError(f"could not find {want} distinct held-out problems of width {width} "
                           f"(heldout_frac={self.heldout_frac}).")

    def _encode_eval_set(self, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        out = encode_addition(a, b, self.eval_seq_len)
        out["a"], out["b"] = a, b
        return out
