"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (how clusters and TPU pods preempt a job).

While :class:`StopRequest` is active, the first SIGINT or SIGTERM only records the request: the training
loop finishes its current step, writes a checkpoint and raises :class:`Interrupted`, which the command line
turns into one line saying how to resume and the exit code ``128 + signal`` (130 for SIGINT, 143 for
SIGTERM).  A second signal stops at once (the default behaviour, without a checkpoint), with a line saying how
to continue.

On several processes a signal reaches each process at a different step, and the checkpoint is a collective
write; there the processes agree on the step through JAX's preemption sync point (the coordination
service of ``jax.distributed``), which handles SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped on a signal after ``step``; ``saved``: a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, saved: bool, run_dir: str):
        self.signum, self.step, self.saved, self.run_dir = signum, step, saved, run_dir
        name = signal.Signals(signum).name
        if saved:
            what = f"checkpoint of step {step} written; resume with: falcon-train --run-dir {run_dir} --resume"
        else:
            what = "no checkpoint written (checkpoint.enabled is false): this run cannot be resumed"
        super().__init__(f"stopped by {name} after step {step}; {what}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """A context in which SIGINT and SIGTERM ask the loop to stop (``signum`` is then set).  Handlers are
    only installed in the main thread of a single-process run; they are restored on exit."""

    def __init__(self, multiprocess: bool = False):
        self.signum: int | None = None
        self.multiprocess = multiprocess
        self._previous: dict = {}
        self._finished: tuple | None = None  # (step, saved, run_dir) once every step has run

    def __enter__(self) -> "StopRequest":
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second signal: stop now, as without this handler
            self.__exit__()
            print(f"[{signal.Signals(signum).name}] again: stopping now, without a checkpoint of the current step "
                  "(a checkpoint being written is left unfinished and never restored); --resume continues from the "
                  "last finished checkpoint, --resume-or-start from step 0 if there is none.", file=sys.stderr,
                  flush=True)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        if self._finished is not None:  # no step left to finish: stop the final evaluation now
            step, saved, run_dir = self._finished
            print(f"[{signal.Signals(signum).name}] every step has run: stopping the final evaluation", file=sys.stderr,
                  flush=True)
            raise Interrupted(signum, step, saved=saved, run_dir=run_dir)
        print(f"[{signal.Signals(signum).name}] stopping after the current step and writing a checkpoint "
              f"(send it again to stop at once, without one)", file=sys.stderr, flush=True)

    def training_finished(self, step: int, saved: bool, run_dir: str) -> None:
        """Every step has run (the last one's checkpoint written when ``saved``): a signal from now on stops the
        final evaluation at once, and so does one that came during the last step (raised here)."""
        self._finished = (step, saved, run_dir)
        if self.signum is not None:
            raise Interrupted(self.signum, step, saved=saved, run_dir=run_dir)

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step``.  On several processes: JAX's preemption sync point (every process
        gets the same answer at the same step), when ``jax.distributed`` provides one."""
        if not self.multiprocess:
            return self.signum is not None
        try:
            from jax.experimental import multihost_utils
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
                return True
        except Exception:  # noqa: BLE001 - no preemption service in this jax.distributed setup
            pass
        return False
