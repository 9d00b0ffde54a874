"""Checkpoints through ``orbax.checkpoint.CheckpointManager``, with a content checksum.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta,checksums.json}``; ``state`` (orbax StandardSave) holds
the params, optimizer state, step and RNG key data; ``meta`` (JSON) the data-iterator state, the full
config and, for text, the tokenizer's fingerprint; ``checksums.json`` the size and SHA-256 of every other file
of the step.  Orbax writes each step into a temporary directory and renames it when complete (atomic), so a
process killed mid-save leaves the previous checkpoints intact.  Keep-N deletes old steps only once a newer
one is finalised *and* checksummed (here, not by orbax, which would delete them at the rename): a save that
fails before its checksums are written, a full disk among other causes, leaves the previous checkpoints as
they were.

Integrity: the checksums are written once the step is complete and verified before it is restored, so
truncated files *and* flipped bits are caught.  A checkpoint that fails to verify or to restore is
reported, moved to ``<run_dir>/checkpoints_corrupt/<step>-<time>`` (kept for inspection, never deleted) and
the next older one is tried; one that verifies but does not fit the model asked for (another config) stays
where it is and the restore refuses (:class:`~falcon_jax.train.rundir.RunDirError`).  A step without ``checksums.json`` (the process stopped between orbax's
rename and the checksum write) cannot be verified and is treated the same way.  A file that cannot be read
(permissions, a file-system error) is not taken for corruption: the restore stops (RunDirError) and moves nothing;
so does a verified checkpoint whose restore fails for a resource (a read error, memory), named as such.

A failed save is a :class:`CheckpointError` in the training loop: with ``async_save=False`` (the default)
at the step being saved; with ``async_save=True`` (the write overlaps the next steps) at the first step
after the failure, naming the step whose save failed.  Either way its temporary folder is removed.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from falcon_jax.train.rundir import CHECKSUMS, METADATA_ITEM, RunDirError, write_atomic  # noqa: F401 - re-exported


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the run stops: continuing would risk losing more work).
    ``terminal``: where to report it when stderr was diverted (see ``Checkpointer(standalone=True)``)."""

    terminal = None


def _divert_stderr(log_path: str):
    """File descriptor 2 to ``log_path`` for the rest of the process; returns a stream to the old stderr.

    After a failed write, orbax's and tensorstore's threads go on reporting it for a while (log records,
    tracebacks of callbacks on a closed event loop, "Task exception was never retrieved" at exit)."""
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 2)
    os.close(fd)
    return terminal


def _file_digests(step_dir: str) -> dict[str, list]:
    """``{relative path: [size, sha256]}`` of every file under ``step_dir`` but the checksum file."""
    out = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, step_dir)
            if rel in (CHECKSUMS, CHECKSUMS + ".tmp"):
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = [os.path.getsize(path), h.hexdigest()]
    return dict(sorted(out.items()))


def checksums_written_everywhere(written: bool) -> bool:
    """Process 0's ``written`` (it alone writes the checksums), known to every process: the keep-N delete that
    follows is collective, so all processes must agree on whether to go on."""
    if jax.process_count() == 1:
        return written
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(written)))


def write_checksums(step_dir: str) -> None:
    """Record the size and SHA-256 of every file of a finished step (written atomically)."""
    write_atomic(os.path.join(step_dir, CHECKSUMS), json.dumps({"sha256": _file_digests(step_dir)}, indent=0))


def verify_checksums(step_dir: str) -> str | None:
    """None if every file of the step matches its recorded size and SHA-256, else what is wrong.  OSError (other
    than a missing file) when a file cannot be read: that says nothing about the content (permissions, a file
    system error), so the caller must not take the step for corrupt."""
    path = os.path.join(step_dir, CHECKSUMS)
    if not os.path.exists(path):
        return f"it has no {CHECKSUMS} (the save did not finish), so its content cannot be verified"
    try:
        with open(path, "rb") as f:
            want = json.loads(f.read())["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        return f"its {CHECKSUMS} is unreadable ({type(e).__name__})"
    got = _file_digests(step_dir)
    missing = sorted(set(want) - set(got))
    if missing:
        return f"files are missing: {', '.join(missing[:3])}"
    changed = [rel for rel in want if got[rel] != want[rel]]
    if changed:
        return f"the content of {', '.join(changed[:3])} does not match its checksum (flipped or truncated bytes)"
    return None


class _Captured:
    data = b""
    divert_to: str | None = None  # set inside the block: afterwards fd 2 goes to this log, not back
    header = b""  # with divert_to: the log's first line (the failure), written before the captured report
    terminal = None  # then: a stream to the old stderr

    def text(self) -> str:
        return self.data.decode(errors="replace")

    def replay(self):
        """Pass what was captured on to the real stderr (a successful save's warnings are not hidden)."""
        if self.data:
            sys.stderr.write(self.text())
            sys.stderr.flush()


def _headline(error: BaseException) -> str:
    """The first line of a failed save's error log: the exception itself, before the checkpointer's report."""
    return f"{type(error).__name__}: {error}\n\n"


@contextlib.contextmanager
def _stderr_captured():
    """File descriptor 2 (Python's and native threads' output alike) into a temporary file; on leaving, back
    to where it was, or (``divert_to`` set) on to that log file, which then starts with ``header`` and what was
    captured (the header first: on a full disk the log may be cut short)."""
    sys.stderr.flush()
    captured = _Captured()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            tmp.seek(0)
            captured.data = tmp.read()
            if captured.divert_to is None:
                os.dup2(saved, 2)
                os.close(saved)
            else:
                try:
                    with open(captured.divert_to, "wb") as f:
                        f.write(captured.header + captured.data)
                except OSError:
                    pass  # a full disk
                os.dup2(saved, 2)  # _divert_stderr starts from the terminal: no gap in between
                os.close(saved)
                captured.terminal = _divert_stderr(captured.divert_to)


# how TensorStore (orbax's array reader) ends the message of a failed system call, e.g. "Failed to open: ...: Too
# many levels of symbolic links [os_error_code='40']" (other versions: "... [OS error 40: ...]"); it raises ValueError
TENSORSTORE_OS_ERROR = ("[os_error_code=", "[OS error ")


def _resource_failure(e: BaseException) -> BaseException | None:
    """The exception in ``e``'s chain that says restoring failed for want of a resource (a read error, memory)
    rather than for the content: an ``OSError`` or ``MemoryError`` (also as the cause of orbax's own exception),
    a failed system call in TensorStore, or XLA's RESOURCE_EXHAUSTED; None if there is none."""
    while e is not None:
        text = str(e)
        if isinstance(e, (OSError, MemoryError)) or "RESOURCE_EXHAUSTED" in text \
                or any(mark in text for mark in TENSORSTORE_OS_ERROR):
            return e
        e = e.__cause__ or e.__context__
    return None


class Checkpointer:
    """Periodic, keep-N, checksummed checkpoints of one run (see the module docstring)."""

    def __init__(self, run_dir: str, *, every: int, keep: int, async_save: bool = False, log=print,
                 is_main: bool = True, standalone: bool = False):
        """``standalone``: the process ends when a save fails (the command line); from then on its stderr
        goes to the step's error log, and :class:`CheckpointError` carries the stream to report on."""
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint.keep={keep!r} must be >= 1 (keep=0 would delete the final checkpoint).")
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.corrupt_dir = os.path.abspath(os.path.join(run_dir, "checkpoints_corrupt"))
        self.every, self.keep, self.async_save, self.log, self.is_main = every, keep, async_save, log, is_main
        self.standalone = standalone
        self._pending: int | None = None  # an asynchronous save not yet finished and checksummed
        self._closed = False
        self._open()

    def _open(self):
        self._closed = False
        # max_to_keep=None: the old steps are deleted by _prune, after the new one's checksums are written
        opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=True, cleanup_tmp_directories=True,
                                            enable_async_checkpointing=self.async_save)
        self.manager = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", METADATA_ITEM))

    def _close_manager(self):
        """Close the orbax manager once the clean-up of temporary folders that its constructor started in a thread
        has ended: ``CheckpointManager.close`` does not wait for that thread (only ``save`` does), and one still
        running when the interpreter exits prints a traceback ("cannot schedule new futures after interpreter
        shutdown") after the command's own last line, e.g. after a refused ``--resume``."""
        await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)  # orbax's, private
        if await_cleanup is not None:
            await_cleanup()
        self.manager.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``; CheckpointError if the
        write fails (see the module docstring for when)."""
        self.poll(wait=True)  # the previous asynchronous save first: its failure is reported before this one
        if step in self.manager.all_steps():
            return False
        failure, saved = None, False
        # orbax and tensorstore report a failed write from their own threads (log records, tracebacks on
        # stderr): kept out of the terminal, it goes to a log file next to the checkpoints instead
        with _stderr_captured() as captured:
            try:
                saved = self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), **{METADATA_ITEM: ocp.args.JsonSave(meta)}), force=force)
                if saved and not self.async_save:
                    self.manager.wait_until_finished()
                    self.manager.check_for_errors()
            except Exception as e:  # noqa: BLE001 - any failure of the write
                failure = e
                if self.standalone:
                    captured.divert_to = self._error_log(step)
                    captured.header = _headline(e).encode(errors="replace")
        if failure is not None:
            self._failed(step, failure, captured.text(), terminal=captured.terminal)
        captured.replay()
        if saved:
            self._pending = step
            if not self.async_save:
                self.poll(wait=True)
        return saved

    def poll(self, wait: bool = False) -> None:
        """Finish the pending save once its write is done (``wait``: block until it is): raise
        CheckpointError if it failed, else write its checksums."""
        step = self._pending
        if step is None or (not wait and self.manager.is_saving_in_progress()):
            return
        self._pending = None
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - the background write failed
            self._failed(step, e)
        step_dir = os.path.join(self.dir, str(step))
        if not os.path.isdir(step_dir):
            self._failed(step, RuntimeError("the finished checkpoint folder is missing"))
        error = None
        if self.is_main:
            try:
                write_checksums(step_dir)
            except OSError as e:
                error = e
        if not checksums_written_everywhere(error is None):
            # every process stops here: a process that went on to the (collective) delete would wait forever
            self._failed(step, error or RuntimeError(f"process 0 could not write the checksums of step {step}"))
        self._prune()

    def _prune(self) -> None:
        """Delete all but the newest ``keep`` steps (every process calls it: orbax's delete is collective)."""
        for step in self.steps()[:-self.keep]:
            self.manager.delete(step)

    def _remove_leftovers(self, step: int, tries: int = 5) -> None:
        """The temporary folders of a failed save, and its step folder if it has no checksums (no other save
        is in flight); tried again while late writes of the failed save keep recreating them."""
        for attempt in range(tries):
            partial = os.path.join(self.dir, str(step))
            left = glob.glob(os.path.join(self.dir, "*.orbax-checkpoint-tmp*"))
            if os.path.isdir(partial) and not os.path.exists(os.path.join(partial, CHECKSUMS)):
                left.append(partial)
            if not left:
                return
            for path in left:
                shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.05 * (attempt + 1))

    def _error_log(self, step: int) -> str:
        return os.path.join(os.path.dirname(self.dir), f"checkpoint-{step}-error.log")

    def _failed(self, step: int, error: BaseException, report: str = "", terminal=None):
        """Remove what the failed save left, keep orbax's report in a log file, raise CheckpointError."""
        try:
            self.manager.close()  # stops its threads; writes of the failed save may still land for a moment
        except Exception:  # noqa: BLE001 - closing after a failure
            pass
        self._closed = True
        self._remove_leftovers(step)
        atexit.register(self._remove_leftovers, step)  # what lands later goes at exit at the latest
        log, log_note = self._error_log(step), ""
        if report.strip():
            try:
                if terminal is None:  # else the capture has written it there already
                    with open(log, "w") as f:
                        f.write(_headline(error) + report)  # the failure first
                if os.path.getsize(log):
                    log_note = f" (the checkpointer's own report is in {log})"
            except OSError:
                pass  # a full disk: the report cannot be kept
        good = [s for s in self._good_steps() if s != step]
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        if len(cause) > 300:
            cause = cause[:150] + " ... " + cause[-150:]  # the OS error is at the end
        err = CheckpointError(f"saving the checkpoint of step {step} in {self.dir} failed ({type(error).__name__}: "
                              f"{cause}){log_note}; the run stops here. "
                              + (f"The last good checkpoint is step {good[-1]}." if good else
                                 "There is no earlier checkpoint."))
        if self.standalone:
            err.terminal = terminal if terminal is not None else _divert_stderr(log)
        raise err from None

    def _good_steps(self) -> list[int]:
        if not os.path.isdir(self.dir):
            return []
        return sorted(int(d) for d in os.listdir(self.dir)
                      if d.isdigit() and os.path.exists(os.path.join(self.dir, d, CHECKSUMS)))

    # ------------------------------------------------------------------ restoring
    def restore_latest(self, abstract_state):
        """``(step, state, meta)`` of the newest checkpoint that verifies and restores, or None if none does.

        ``abstract_state``: the state pytree with ``jax.ShapeDtypeStruct`` leaves carrying
        the target shardings.  Broken checkpoints are reported and moved aside.
        """
        for step in reversed(self.steps()):
            try:
                problem = verify_checksums(os.path.join(self.dir, str(step)))
            except FileNotFoundError as e:  # removed while it was read
                problem = f"files are missing: {e.filename}"
            except OSError as e:  # unreadable is not corrupt: moved aside, the run would fall back or start over
                raise RunDirError(f"checkpoint {step} in {self.dir} cannot be read ({type(e).__name__}: {e}); fix "
                                  f"the cause (the files' permissions, the file system) and resume again. Nothing "
                                  f"was moved.") from None
            intact = False
            try:
                if problem is not None:
                    raise ValueError(problem)
                intact = True
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), **{METADATA_ITEM: ocp.args.JsonRestore()}))
                state, meta = out["state"], out[METADATA_ITEM]
                if meta is None or "data" not in meta:
                    raise ValueError("the metadata item is missing or incomplete")
                jax.block_until_ready(state)
                return step, state, meta
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                cause = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                failure = _resource_failure(e) if intact else None
                if failure is not None:  # the bytes verified: reading them failed, not the model
                    # the failure itself, not orbax's wrapper of it ("Encountered error while reading array index")
                    why = " ".join(str(failure).split()) or type(failure).__name__
                    if len(why) > 300:
                        why = why[:150] + " ... " + why[-150:]  # the OS error is at the end
                    raise RunDirError(f"checkpoint {step} in {self.dir} is intact (its checksums match) but could "
                                      f"not be restored ({type(failure).__name__}: {why}); fix the cause (the file "
                                      f"system, free memory) and resume again. Nothing was moved.") from None
                if intact and "metadata item" not in cause:
                    # the bytes are the ones written: the model asked for is not the one saved, so the
                    # checkpoint stays where it is (the older ones were saved from the same model)
                    raise RunDirError(f"checkpoint {step} in {self.dir} is intact (its checksums match) but does "
                                      f"not fit this model ({cause}); resume with the model config the run was "
                                      f"trained with (or the optimizer this version of falcon-train builds from "
                                      f"it), or train the new model in another --run-dir. Nothing was "
                                      f"moved.") from None
                self.log(f"[checkpoint] step {step} in {self.dir} is corrupt and cannot be restored "
                         f"({cause}); "
                         f"moving it to {self.corrupt_dir} and trying the previous checkpoint.")
                self._quarantine(step)
        return None

    def _quarantine(self, step: int):
        self._close_manager()
        os.makedirs(self.corrupt_dir, exist_ok=True)
        src = os.path.join(self.dir, str(step))
        if os.path.exists(src):
            stem = os.path.join(self.corrupt_dir, f"{step}-{int(time.time())}")
            dst, n = stem, 1
            while os.path.exists(dst):  # the same step moved aside twice within a second: moved into the first
                n += 1
                dst = f"{stem}-{n}"
            shutil.move(src, dst)
        self._open()

    def wait(self):
        self.poll(wait=True)

    def close(self):
        if self._closed:
            return
        try:
            self.poll(wait=True)
        finally:
            self._closed = True
            self._close_manager()
