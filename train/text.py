"""Local text corpora: tokenizers, reading and tokenizing documents, packed windows and
:class:`TextData`.

Rows for both loaders (:mod:`falcon_jax.train.loader`): :meth:`TextData.windows` at window starts
the Grain loader shuffles lazily per epoch (``"grain"``), :meth:`TextData.batch` from a seeded
permutation per epoch (``"builtin"``).  Batches are dicts of numpy ``[B, T]`` arrays ``tokens``,
``segment_ids``, ``loss_mask`` (see the loader module).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import uuid
from typing import Iterable

import numpy as np

from falcon_jax.train.hashing import mix64


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

    @property
    def fingerprint(self) -> str:
        """What the ids mean, in a few words: equal fingerprints, the same token for every id."""
        return "byte"


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
            try:
                return cls(Tokenizer.from_file(path))
            except Exception as e:  # tokenizers raises its own Exception type for a cut or foreign file
                raise ValueError(f"data.cache_dir: the saved BPE tokenizer {path} cannot be read ({e}); delete it "
                                 "and it is trained again.") from None
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        if path:  # written whole, then renamed: a killed run never leaves a cut tokenizer to reuse
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"  # this writer's own: hosts sharing cache_dir write at once
            tok.save(tmp)
            os.replace(tmp, path)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        """``"BPE <vocab size> sha256:<16 hex>"`` of the serialized tokenizer: training is deterministic, so the
        same corpus gives the same fingerprint; another corpus, in general another one (other tokens per id)."""
        digest = hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]
        return f"BPE {self.vocab_size} sha256:{digest}"


# ----------------------------------------------------------------------------- text corpora
EXTENSIONS = ("txt", "md", "jsonl", "json", "parquet")
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".7z", ".tar")


def expand_paths(patterns) -> list[str]:
    """Files, directories and glob patterns -> a sorted list of files.  A directory (given, or
    matched by a glob) contributes its .txt/.md/.jsonl/.json/.parquet files, recursively; a glob's
    plain files are taken as they are.  FileNotFoundError naming an entry that matches no file (a
    typo in one of several entries would otherwise drop its data without a word)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files = []
    for p in patterns:
        found = []
        for m in [p] if os.path.isdir(p) else glob.glob(p, recursive=True):
            if os.path.isdir(m):
                for ext in EXTENSIONS:
                    found += glob.glob(os.path.join(m, "**", f"*.{ext}"), recursive=True)
            else:
                found.append(m)
        if not found:
            raise FileNotFoundError(f"data.paths={list(patterns)!r} matched no .txt/.md/.jsonl/.json/.parquet files "
                                    f"at {p!r} (a missing file, an empty directory or a glob that matches nothing); "
                                    "fix that entry or remove it.")
        files += found
    # one file under two spellings ("small", "./small", an absolute path) is read once: twice would train on it
    # twice and could put a copy of a validation document into the training split
    first = {}
    for f in sorted(set(files)):
        first.setdefault(os.path.realpath(f), f)
    return sorted(first.values())


def _check_plain(f: str) -> None:
    if f.endswith(_COMPRESSED):
        raise ValueError(f"data.paths: {f} is compressed; decompress it first (only plain .txt/.md/.jsonl/.json "
                         "and .parquet files are read).")


def read_bytes(f: str) -> bytes:
    """The bytes of corpus file ``f``, read once: its documents are parsed from them and its cache key hashed from
    them, so a file rewritten meanwhile (another process finishing it) cannot key one text's tokens by another's
    digest.  ValueError for a compressed file."""
    _check_plain(f)
    with open(f, "rb") as fh:
        return fh.read()


def _lines(f: str, data: bytes):
    """``(line number, text)`` of each ``\\n``-ended line of ``data`` (file ``f``'s bytes) as UTF-8 (a leading
    byte-order mark dropped); ValueError naming the file, line and first bad byte otherwise: decoding with
    replacement would train on U+FFFD for every such byte."""
    offset = 0
    for i, raw in enumerate(io.BytesIO(data), 1):
        try:
            yield i, raw.decode("utf-8-sig" if i == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"data.paths: {f} is not UTF-8 text (byte {offset + e.start}, line {i}: "
                             f"{raw[e.start:e.start + 4]!r}); convert it, e.g. `iconv -f latin1 -t utf-8`, or "
                             "leave it out of data.paths.") from None
        offset += len(raw)


def _read_text(f: str, data: bytes) -> str:
    """``data`` (file ``f``'s bytes) as UTF-8 text with universal newlines, so \\r\\n paragraphs split too
    (:func:`_lines`' errors)."""
    try:
        return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig").read()
    except UnicodeDecodeError:
        for _ in _lines(f, data):  # finds the line and byte, and raises
            pass
        raise


def _json_rows(f: str, data: bytes):
    """``(where, row)`` for each row of a .jsonl file (one JSON value per line, blank lines skipped) or a .json
    file (a JSON array of rows, one row, or JSON lines); ``data`` is file ``f``'s bytes."""
    lines = _lines(f, data)
    if f.endswith(".json"):
        text = _read_text(f, data)
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            lines = enumerate(text.split("\n"), 1)  # JSON lines in a .json file
        else:
            rows = whole if isinstance(whole, list) else [whole]
            yield from ((f"{f}: row {i}", row) for i, row in enumerate(rows))
            return
    for i, line in lines:
        line = line.strip()
        if line:
            try:
                yield f"{f}:{i}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{i}: not a JSON row ({e}); fix or remove that line.") from None


def _document(where: str, row, text_key: str) -> str:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object with a {text_key!r} field; got "
                         f"{type(row).__name__} {str(row)[:40]!r}.")
    if text_key not in row:
        raise KeyError(f"{where}: a row has no key {text_key!r} (set data.text_key; this row's keys: "
                       f"{', '.join(map(repr, list(row)[:8]))}).")
    value = row[text_key]
    if not isinstance(value, str):
        # str(None) would train on the text 'None'
        raise ValueError(f"{where}: {text_key!r} is {type(value).__name__} {str(value)[:40]!r}, not a string; "
                         "remove such rows or set data.text_key to a text field.")
    return value


# why a corpus can be one document, for the errors of a split that one document cannot serve
ONE_DOCUMENT = ("whole documents go to one side (a .txt/.md file is one document per blank-line-separated block, "
                "a .jsonl file one per line): separate the text into documents, add files, or")


def read_documents(paths, text_key: str = "text") -> list[str]:
    """Documents from local files: a .txt/.md file (or any other plain file a glob names) is one
    document per blank-line-separated block; .jsonl/.json rows give ``row[text_key]``; .parquet
    (needs pyarrow) its ``text_key`` column (a row whose text is empty or only whitespace is kept here, and
    left out of :class:`TextData`'s token streams).  Files must be UTF-8 and each row's ``text_key`` a
    string: ValueError (KeyError for a missing key) naming the file and row otherwise.  ``paths`` as for
    :func:`expand_paths`; :func:`read_files` reads a list it returned."""
    return read_files(expand_paths(paths), text_key)


def read_files(files: list[str], text_key: str = "text") -> list[str]:
    """The documents of ``files`` (a list from :func:`expand_paths`), in that order, as :func:`read_documents`."""
    return [doc for f in files for doc in file_documents(f, read_bytes(f), text_key)]


def file_documents(f: str, data: bytes, text_key: str = "text") -> list[str]:
    """The documents of file ``f`` parsed from ``data``, its bytes (:func:`read_bytes`), as :func:`read_documents`."""
    if f.endswith((".jsonl", ".json")):
        return [_document(where, row, text_key) for where, row in _json_rows(f, data)]
    if f.endswith(".parquet"):
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as e:
            raise RuntimeError(f"{f}: reading parquet needs pyarrow (pip install pyarrow).") from e
        names = pq.read_schema(pa.BufferReader(data)).names
        if text_key not in names:
            raise KeyError(f"{f}: no column {text_key!r} (set data.text_key; columns: "
                           f"{', '.join(map(repr, names[:8]))}).")
        column = pq.read_table(pa.BufferReader(data), columns=[text_key]).column(text_key)
        return [_document(f"{f}: row {i}", {text_key: t}, text_key) for i, t in enumerate(column.to_pylist())]
    return [blk.strip() for blk in _read_text(f, data).split("\n\n") if blk.strip()]


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


def content_digest(data: bytes) -> str:
    """BLAKE2b of a file's bytes, the key of its token cache: the contents, not size + mtime, as a file rewritten
    at the same size within the mtime resolution would reuse the old text's tokens."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# part of every token cache key: a change to what the cache holds for the same files and settings (how rows
# become documents, how documents become tokens) must change it, or existing caches would serve the old tokens
CACHE_FORMAT = 2


def _load_cached(f_tok: str, f_doc: str) -> tuple[np.ndarray, np.ndarray]:
    """A split's cached token stream and document ids (memory-mapped); ValueError naming the file that cannot be
    read as one (cut short or overwritten outside this code: the writes themselves are atomic)."""
    arrays = []
    for f in (f_tok, f_doc):
        try:
            a = np.load(f, mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"data.cache_dir: the token cache file {f} cannot be read ({type(e).__name__}: {e}); "
                             "delete it and the text is tokenized again.") from None
        arrays.append(a)
    tok, doc = arrays
    for f, a in ((f_tok, tok), (f_doc, doc)):
        if a.ndim != 1 or a.dtype != np.int32 or len(a) != len(arrays[0]):
            raise ValueError(f"data.cache_dir: the token cache file {f} holds {a.dtype} {a.shape}, not the "
                             f"int32 [{len(arrays[0])}] of its split; delete it and the text is tokenized again.")
    return tok, doc


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
        # one listing for the documents and the cache key: a file added between two listings would be in the
        # key but not in the cached tokens
        files = expand_paths(self.paths)
        docs, digests = [], []
        for f in files:
            data = read_bytes(f)  # one read: the documents and the digest of the same bytes
            digests.append(content_digest(data))
            docs += file_documents(f, data, self.text_key)
        key = hashlib.sha1(json.dumps([[f, d] for f, d in zip(files, digests)]
                                      + [self.tokenizer, self.bpe_vocab_size, self.val_frac, self.text_key,
                                         CACHE_FORMAT]).encode()).hexdigest()[:16]
        # the corpus by content, in reading order, wherever its files lie: a resumed run compares it
        self.corpus = hashlib.sha1(json.dumps(digests).encode()).hexdigest()[:16]
        os.makedirs(self.cache_dir, exist_ok=True)
        base = os.path.join(self.cache_dir, key)
        if self.tokenizer == "byte":
            self.tok = ByteTokenizer()
        elif self.tokenizer == "bpe":
            self.tok = BPETokenizer.train(docs, self.bpe_vocab_size, base + "-bpe.json")
        else:
            raise ValueError(f"data.tokenizer={self.tokenizer!r}: use 'byte' or 'bpe'.")
        is_val = mix64(np.arange(len(docs), dtype=np.uint64) + np.uint64(7)) % np.uint64(10_000) \
            < np.uint64(int(self.val_frac * 10_000))
        texts = [i for i, d in enumerate(docs) if d.strip()]
        self.empty_rows = len(docs) - len(texts)  # rows of empty or whitespace text: no document (CACHE_FORMAT 2)
        if self.val_frac > 0 and not is_val[texts].any() and len(texts) > 1:
            is_val[texts[-1]] = True  # tiny corpora: still keep one validation document
        self.splits = {}
        for name, sel in (("train", ~is_val), ("val", is_val)):
            f_tok, f_doc = f"{base}-{name}-tokens.npy", f"{base}-{name}-docs.npy"
            if not (os.path.exists(f_tok) and os.path.exists(f_doc)):
                # a row of empty or whitespace text is no document (as a blank block of a .txt file); it keeps its
                # index, so the others keep their side of the split
                stream, dids = tokenize_documents([d for d, s in zip(docs, sel) if s and d.strip()], self.tok)
                for f, arr in ((f_tok, stream), (f_doc, dids)):
                    # atomic: a killed run never leaves half a file; the temporary name is this writer's own, as
                    # the hosts of one run (or two runs) sharing cache_dir may tokenize the same files at once
                    tmp = f"{f}.{uuid.uuid4().hex}.tmp.npy"
                    np.save(tmp, arr)
                    os.replace(tmp, f)
            self.splits[name] = _load_cached(f_tok, f_doc)
        n_train = len(self.splits["train"][0])
        if n_train < self.seq_len:
            if len(docs) == 1 and is_val[0]:
                raise ValueError(f"data: the corpus {list(self.paths)} is one document, and the training / validation "
                                 f"split (data.val_frac={self.val_frac}) gave it to validation: {ONE_DOCUMENT} set "
                                 "data.val_frac=0 and data.val_batches=0 to train on it without validation.")
            empty = sum(1 for d, v in zip(docs, is_val) if not v and not d.strip())
            left_out = f", {empty} of them empty or only whitespace, left out" if empty else ""
            raise ValueError(f"data: the training split has {n_train} tokens ({int((~is_val).sum())} of "
                             f"{len(docs)} documents{left_out}), fewer than one window of {self.seq_len} tokens "
                             "(data.seq_len + 1); add more text or lower data.seq_len or data.val_frac.")

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
    def num_val_windows(self) -> int:
        """How many non-overlapping windows of ``seq_len`` the validation stream has
        (:meth:`val_batches` reads them in order)."""
        return len(self.splits["val"][0]) // self.seq_len

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
