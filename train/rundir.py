"""The run directory: what a run writes where, its metrics file, and the refusal to start over
an existing run.

Layout of ``<run_dir>`` (``train.run_dir``)::

    config.json             the resolved config (``--run-dir DIR --resume`` starts from it)
    metrics.jsonl           one JSON record a line: "train" (every step), "first_step" (the time the
                            first step of a process took, compilation included), "speed" (log
                            points), "eval"; a resumed run appends, readers take the last record
                            of each step; "time_limit" (a stop by train.time_limit_s); "resume"
                            (a command continued the run from the checkpoint of its step: readers
                            drop the earlier records of later steps, :func:`parse_records`).  Strict
                            JSON: a NaN / ±inf number (a diverged loss) is the string "nan" /
                            "inf" / "-inf" (:func:`encode_non_finite`); null is a value not measured
    width_shares.json       addition: the training stream's share of problems and tokens per width
    checkpoints/<step>/     orbax checkpoints (:mod:`falcon_jax.train.checkpoint`)
    .lock                   held (``flock``) by the process training in the folder, its PID inside
    report.txt              the end-of-run table
    loss.png, accuracy_vs_width.png   plots (matplotlib, the ``train`` extra)

Only the standard library here: the command line uses it before it imports JAX, and ``benchmarks.common``
loads this file by its path (for :class:`ResultFiles`), without the package.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from typing import BinaryIO, Callable

CONFIG = "config.json"
WIDTH_SHARES = "width_shares.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
REPORT = "report.txt"
LOSS_PLOT = "loss.png"
ACCURACY_PLOT = "accuracy_vs_width.png"
RESUME = "resume"  # the metrics record of a command that continued the run (see parse_records)
LOCK = ".lock"
# The checkpoint item holding the run's config and data position, and the file orbax's JsonSave writes it to
# (``checkpoints/<step>/<METADATA_ITEM>/<METADATA_FILE>``); train.checkpoint saves it under this name.
METADATA_ITEM = "meta"
METADATA_FILE = "metadata"
# a finished step's ``{"sha256": {relative path: [size, sha256]}}`` of its other files (train.checkpoint)
CHECKSUMS = "checksums.json"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (exit code 2 on the command line)."""


def checkpoint_steps(run_dir: str) -> list[int]:
    """The finished checkpoint steps in ``<run_dir>/checkpoints`` (orbax names a finished step's
    folder by its number; one being written has a temporary name)."""
    path = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(path):
        return []
    return sorted(int(d) for d in os.listdir(path) if d.isdigit() and os.path.isdir(os.path.join(path, d)))


def checkpoint_config(run_dir: str) -> tuple[int, dict] | None:
    """``(step, config)``: the config saved in the newest checkpoint whose metadata matches its recorded checksum
    (each checkpoint's metadata item holds the run's full config; a step with flipped bits there, or one whose
    save did not finish, is passed over as the restore would pass over it), or None.  For a run whose
    ``config.json`` is gone."""
    rel = os.path.join(METADATA_ITEM, METADATA_FILE)
    for step in reversed(checkpoint_steps(run_dir)):
        step_dir = os.path.join(run_dir, CHECKPOINTS, str(step))
        try:
            with open(os.path.join(step_dir, CHECKSUMS), "rb") as f:
                want = json.loads(f.read())["sha256"][rel]
            with open(os.path.join(step_dir, rel), "rb") as f:
                data = f.read()
            if [len(data), hashlib.sha256(data).hexdigest()] != want:
                continue
            meta = json.loads(data)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return step, meta["config"]
    return None


def check_can_start(run_dir: str, resume: bool, must_exist: bool = False) -> None:
    """Refuse to start a new run over an earlier one: over its checkpoints (``--resume`` continues it), or,
    without checkpoints, over its ``config.json`` or ``metrics.jsonl`` (a new run would replace the one and
    append to the other, and readers take the last record of each step: the two runs' steps would mix), or any
    other file a run writes there (a report or plot, which a new run would replace).  With
    ``must_exist`` (``--resume``) refuse to resume a run that has no checkpoint.  Reads the file system only,
    so it runs before any model or data work."""
    existing = checkpoint_steps(run_dir)
    if existing and not resume:
        raise RunDirError(f"{run_dir} already has checkpoints at steps {existing}; pass --resume to "
                          f"continue that run, or choose another train.run_dir.")
    # every file a run writes at the top of its folder: a new run would replace or mix into each of them
    earlier = [name for name in (CONFIG, METRICS, REPORT, WIDTH_SHARES, LOSS_PLOT, ACCURACY_PLOT)
               if os.path.isfile(os.path.join(run_dir, name)) and os.path.getsize(os.path.join(run_dir, name)) > 0]
    if earlier and not existing and not resume:
        raise RunDirError(f"{run_dir} already holds a run without checkpoints ({', '.join(earlier)}); a new run "
                          f"there would replace its config and mix its metrics with the new run's. Choose "
                          f"another train.run_dir (--run-dir DIR), pass --resume-or-start to train that run again "
                          f"from step 0 in its folder, or delete those files first.")
    if resume and must_exist and not existing:
        raise RunDirError(f"--resume: {os.path.join(run_dir, CHECKPOINTS)} has no checkpoint to continue from; "
                          f"pass --resume-or-start to start from step 0 when there is none.")


def _write_probe(folder: str) -> None:
    """Create ``folder`` and write (then remove) a file in it; OSError when that cannot be done."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".write-test-{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def check_writable(run_dir: str) -> None:
    """Create ``run_dir`` and write a file in it, or RunDirError with the reason in one line."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirError(f"the run directory {run_dir} is a file, not a folder; choose another one with --run-dir DIR "
                          f"(train.run_dir).")
    try:
        _write_probe(run_dir)
    except OSError as e:
        raise RunDirError(f"cannot write to the run directory {os.path.abspath(run_dir)} "
                          f"({e.strerror or type(e).__name__}); choose another one with --run-dir DIR "
                          f"(train.run_dir).") from None


_HELD_LOCKS: dict[str, int] = {}  # run folder (absolute) -> the open file descriptor holding its lock


def hold_run_lock(run_dir: str) -> None:
    """Take ``<run_dir>/.lock`` (an exclusive ``flock``, the PID written in it) for this process, or RunDirError
    naming the process that holds it: a second process in the folder (a job started twice) would mix its
    checkpoints, config and metrics with the first's.  Held until :func:`release_run_lock` or the process ends
    (the kernel drops the lock of a killed process, so a crash leaves no stale lock)."""
    key = os.path.abspath(run_dir)
    if key in _HELD_LOCKS:
        return
    path = os.path.join(key, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise RunDirError(f"another process (pid {holder}) is training in {run_dir}: two runs in one folder would "
                          f"mix their checkpoints, config and metrics. Wait for it to end or stop it, or choose "
                          f"another --run-dir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD_LOCKS[key] = fd


def release_run_lock(run_dir: str) -> None:
    """Drop this process's lock on ``run_dir`` (nothing if it holds none)."""
    fd = _HELD_LOCKS.pop(os.path.abspath(run_dir), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def check_checkpoint_folder(run_dir: str) -> None:
    """``<run_dir>/checkpoints`` a folder that can be written (created if absent), or RunDirError in one line:
    checked before any model or data work, not at the first save after training up to it."""
    path = os.path.abspath(os.path.join(run_dir, CHECKPOINTS))
    if "[" in path:
        # orbax finds the per-process parts of a checkpoint with a glob under this path: "[0]" reads as a character
        # class, nothing matches, the parts are not merged, and every checkpoint of the run is unreadable
        raise RunDirError(f"the run directory {os.path.abspath(run_dir)} has a '[' in its path, and orbax reads the "
                          f"checkpoint folder's path as a glob pattern ('[...]' a character class): its checkpoints "
                          f"could not be restored. Choose a path without brackets (e.g. seed-0 for seed=[0]) with "
                          f"--run-dir DIR, or train without checkpoints (--set checkpoint.enabled=false).")
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"{path} is a file, not a folder, and the checkpoints are written there; move that file "
                          f"away, choose another run directory with --run-dir DIR (train.run_dir), or train without "
                          f"checkpoints (--set checkpoint.enabled=false).")
    try:
        _write_probe(path)
    except OSError as e:
        raise RunDirError(f"cannot write to the checkpoint folder {path} ({e.strerror or type(e).__name__}); fix "
                          f"its permissions, or choose another run directory with --run-dir DIR "
                          f"(train.run_dir).") from None


def write_atomic(path: str, data: str | bytes | Callable[[BinaryIO], object]) -> None:
    """Write ``data`` to ``path`` whole or not at all: into ``path + ".tmp"``, flushed to disk, then renamed over
    ``path`` (a kill or a full disk mid-write leaves the previous file).  ``data`` is text, bytes, or a function
    that writes to the open binary file (a plot's ``savefig``)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)  # the part written before the failure
        except OSError:
            pass
        raise


class ResultFiles:
    """Where a command writes its results ``NAME.json``, its log ``NAME.log`` beside it, and the files ``others``
    (paths; ``benchmarks.run``'s suites and ``benchmarks.context_parallel`` have none, the multi-GPU runner its pack
    of run logs).  Without an earlier ``NAME.json``, straight to those names (a command cut by a time limit keeps
    what it measured).  With one, to ``NAME.partial.json`` / ``.partial.log`` (``X.partial.tar.gz`` for
    ``X.tar.gz``) until :meth:`finish` (the command ended without an exception) moves them over the earlier files:
    an interrupted or failed rerun leaves the earlier results as they were.  Standard library only:
    ``benchmarks.common`` loads this module from its file, without an install or JAX."""

    def __init__(self, json_path: str, others: tuple[str, ...] = ()):
        stem = os.path.splitext(json_path)[0]
        self.json, self.log = json_path, stem + ".log"
        self.earlier = _result_date(self.json) if os.path.isfile(self.json) else None
        if self.earlier is None:
            self.json_now, self.log_now = self.json, self.log
            self.others = {p: p for p in others}
        else:
            self.json_now, self.log_now = stem + ".partial.json", stem + ".partial.log"
            self.others = {p: _partial_name(p) for p in others}

    def now(self, path: str) -> str:
        """Where this command writes ``path``, one of ``others``."""
        return self.others[path]

    def note(self) -> str | None:
        """The line that says an earlier result is replaced once this run ends (None when there is none)."""
        if self.earlier is None:
            return None
        return (f"replacing {self.json} (the results of {self.earlier}) when this run ends; until then it writes "
                f"{self.json_now}, which an interrupted run leaves beside it. Keep the earlier one with another --out")

    def finish(self) -> str:
        """Move this run's files over the earlier ones (those of ``others`` it wrote); the path of the results."""
        if self.json_now != self.json:
            os.replace(self.json_now, self.json)
            os.replace(self.log_now, self.log)
            for path, now in self.others.items():
                if os.path.exists(now):
                    os.replace(now, path)
        return self.json


def _partial_name(path: str) -> str:
    """``X.partial.EXT`` for ``X.EXT`` (``.tar.gz`` counts as one extension)."""
    ext = ".tar.gz" if path.endswith(".tar.gz") else os.path.splitext(path)[1]
    return path[:len(path) - len(ext)] + ".partial" + ext


def _result_date(path: str) -> str:
    try:
        with open(path) as f:
            return json.load(f).get("date") or "an earlier run"
    except (OSError, ValueError, AttributeError):
        return "an earlier run"


NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_non_finite(value):
    """``value`` (dicts, lists and tuples walked) with each NaN / +inf / -inf float replaced by the string
    "nan" / "inf" / "-inf", so that ``json.dumps(..., allow_nan=False)`` writes strict JSON (the bare tokens
    NaN and Infinity that ``json.dumps`` writes by default are refused by jq and strict parsers).  Strings,
    not null: null already stands for a value not measured, and NaN and inf tell different stories."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: encode_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_non_finite(v) for v in value]
    return value


def decode_non_finite(value):
    """The inverse of :func:`encode_non_finite`: the strings "nan" / "inf" / "-inf" back to floats."""
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: decode_non_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_non_finite(v) for v in value]
    return value


def dumps_strict(value, **kwargs) -> str:
    """``json.dumps`` of ``value`` as strict JSON, non-finite floats as in :func:`encode_non_finite`."""
    return json.dumps(encode_non_finite(value), allow_nan=False, **kwargs)


def parse_records(lines, kind: str | None = None) -> list[dict]:
    """The JSON records of ``metrics.jsonl`` lines in order (all, or those of ``kind``), with "nan" / "inf" /
    "-inf" read back as floats (:func:`decode_non_finite`); a line cut by a kill is skipped.  A "resume" record
    (a command that continued the run from the checkpoint of its ``step``) drops the records before it whose
    step is later than that: they belong to steps that were trained again from the checkpoint (after a kill
    past the last checkpoint, a corrupt latest checkpoint, a diverged loss), not to the run as it went on."""
    out = []
    for line in lines:
        try:
            r = decode_non_finite(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if not isinstance(r, dict):
            continue
        if r.get("kind") == RESUME and isinstance(r.get("step"), int):
            out = [x for x in out if not (isinstance(x.get("step"), int) and x["step"] > r["step"])]
        if kind is None or r.get("kind") == kind:
            out.append(r)
    return out


def metric_records(run_dir: str, kind: str | None = None) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in file order (all, or those of ``kind``:
    "train", "first_step", "speed", "eval"); none if there is no file yet.  A line with bytes that are not
    UTF-8 (a crash or a disk error) is skipped like a cut one."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:  # bytes a crash left that are not UTF-8: a bad line
        return parse_records(f, kind)


def read_metrics(run_dir: str) -> tuple[dict[int, dict], list[dict]]:
    """``metrics.jsonl`` -> (the last train record of each step, the last eval record of each step in step
    order; the final evaluation is written twice, without and then with its free-running decoding)."""
    records = metric_records(run_dir)
    evals = {r["step"]: r for r in records if r.get("kind") == "eval"}
    return {r["step"]: r for r in records if r.get("kind") == "train"}, [evals[s] for s in sorted(evals)]


class Logger:
    """Progress lines on stdout and records in ``metrics.jsonl`` (appended, so a resumed run
    continues the file, after a line that a kill cut short; readers take the last record of each step).
    Each record is one line of strict JSON: a NaN / ±inf float (a diverged loss or gradient norm) is
    written as the string "nan" / "inf" / "-inf" and read back as the float by :func:`parse_records`.
    Only process 0 writes."""

    def __init__(self, run_dir: str, is_main: bool):
        self.path = os.path.join(run_dir, METRICS)
        self.is_main = is_main
        self._checked_end = False

    def write(self, rec: dict):
        if self.is_main:
            with open(self.path, "a+b") as f:
                if not self._checked_end:  # a line cut by a kill: end it, so that this record is a line of its own
                    self._checked_end = True
                    if f.seek(0, os.SEEK_END) > 0:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":
                            f.write(b"\n")
                f.write((dumps_strict(rec) + "\n").encode())

    def print(self, msg: str):
        if self.is_main:
            print(msg, flush=True)
