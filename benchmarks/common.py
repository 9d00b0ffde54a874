"""The parent's side of the measuring processes, shared by ``benchmarks.run``'s suites: :class:`Worker` (one
``benchmarks.worker`` process), :class:`Log` and text tables."""

from __future__ import annotations

import collections
import fnmatch
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLO_LIMIT = 300  # a cold start: jax, the GPU client, falcon_jax
RESULT = "@@RESULT "
TAIL_LINES = 60  # of a process's output, kept to report why it failed


def _load_rundir():
    """This checkout's ``train/rundir.py`` (``falcon_jax.train.rundir`` once installed; standard library only), loaded
    from its file: the harness runs without an install (``benchmarks.source_tree``) and does not import JAX, and
    the multi-GPU runner, an installed module, shares :class:`ResultFiles` with the suites."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "train", "rundir.py")
    spec = importlib.util.spec_from_file_location("benchmarks._rundir", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ResultFiles = _load_rundir().ResultFiles


def select_names(patterns: str, names: list[str], option: str, noun: str, fold_case: bool = False) -> list[str]:
    """The entries of ``names`` that ``patterns`` (comma-separated names or shell patterns; ``fold_case``: matched
    case-insensitively) names, in ``names`` order.  ValueError naming ``option`` and the choices for a pattern
    that matches nothing, or for patterns that name nothing at all ('' or ',' would run a suite of nothing)."""
    chosen = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        pattern = pattern.lower() if fold_case else pattern
        hits = [n for n in names if fnmatch.fnmatchcase(n.lower() if fold_case else n, pattern)]
        if not hits:
            raise ValueError(f"{option}: {pattern!r} matches none of {', '.join(names)}")
        chosen.update(hits)
    if not chosen:
        raise ValueError(f"{option} {patterns!r} names no {noun}; give names or patterns of {', '.join(names)}")
    return [n for n in names if n in chosen]


def worker_scratch(prefix: str) -> tuple[str, str]:
    """A scratch folder for the worker processes' trees, and in it ``harness``, the folder they run
    ``-m benchmarks.worker`` from: it holds only a link to this ``benchmarks/``, so that the checkout's root does
    not shadow the copy of falcon_jax they import.  Returns ``(scratch, harness)``; the caller removes scratch."""
    scratch = tempfile.mkdtemp(prefix=prefix)
    harness = os.path.join(scratch, "harness")
    os.makedirs(harness)
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(harness, "benchmarks"))
    return scratch, harness


def exit_on_sigterm() -> None:
    """SIGTERM (a time limit) ends the run as an exception, through the callers' ``finally``: workers stopped, the
    scratch folder removed, the JSON written.  Later SIGTERMs are ignored so that they do not cut that cleanup
    short (coreutils ``timeout`` signals the process and then its whole group: the process gets it twice)."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class Log:
    """Prints, and keeps the same lines in ``path``."""

    def __init__(self, path):
        self.file = open(path, "w")
        self.lock = threading.Lock()  # the lm suite's workers log from several threads

    def __call__(self, text=""):
        with self.lock:
            print(text, flush=True)
            self.file.write(text + "\n")
            self.file.flush()


class Worker:
    """One measuring process (``benchmarks.worker``) importing one tree; restarted after a timeout or crash.
    ``tail``: the last ``TAIL_LINES`` lines it printed (stdout and stderr), to say why it failed."""

    def __init__(self, name, pythonpath, harness, smoke, log, torch=False, env=None, config=None):
        self.name, self.pythonpath, self.harness, self.smoke, self.log = name, pythonpath, harness, smoke, log
        self.torch = torch  # whether the process may run torch ops (fla)
        self.env = env or {}  # set in the process's environment (over the inherited one)
        self.config = config or {}  # jax.config options set in the process before its backend starts
        self.proc, self.lines, self.environment = None, None, None
        self.tail = collections.deque(maxlen=TAIL_LINES)

    def _start(self, limit=HELLO_LIMIT):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.pythonpath, env.get("PYTHONPATH")) if p)
        if self.smoke:
            env["JAX_PLATFORMS"] = "cpu"
        # cwd: a folder holding only a link to this benchmarks/, so that neither it nor the tree's own
        # benchmarks/ shadows the measured tree's falcon_jax
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "benchmarks.worker"],
                                     cwd=self.harness, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines = queue.Queue()
        self.tail.clear()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        status, env_info = self._exchange({"cmd": "hello", "smoke": self.smoke, "torch": self.torch,
                                           "jax_config": self.config}, limit)
        if status != "ok" or "error" in env_info:
            raise RuntimeError(f"the {self.name} worker did not start: {status} {env_info.get('error', '')}")
        self.environment = self.environment or env_info

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _exchange(self, request, limit):
        proc = self.proc  # the lm suite may stop this worker from another thread meanwhile
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + limit
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.stop()
                return f"timed out after {limit:.0f} s", {}
            if line is None:
                code = proc.wait()
                if self.proc is proc:
                    self.proc = None
                return f"worker died ({ended(code)})", {}
            if line.startswith(RESULT):
                return "ok", json.loads(line[len(RESULT):])
            self.tail.append(line)
            self.log(f"    [{self.name}] {line}")

    def start(self, limit=HELLO_LIMIT) -> str:
        """"ok", or why the process did not start within ``limit`` seconds (it is started again by the next
        request)."""
        try:
            if self.proc is None:
                self._start(limit)
        except RuntimeError as e:
            self.stop()
            return str(e)
        return "ok"

    def request(self, request, limit):
        """``(status, result)``: status "ok", or why there is no result."""
        status = self.start()
        return self._exchange(request, limit) if status == "ok" else (status, {})

    def stop(self):
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def ended(code: int) -> str:
    """How a process ended, from its return code: ``exit code 1``, ``killed by SIGABRT``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def table(rows, columns):
    """Right-aligned text table of ``rows`` (dicts) by ``columns`` (``(header, key or function)``)."""
    def cell(row, key):
        value = key(row) if callable(key) else row.get(key)
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    cells = [[cell(r, key) for _, key in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    lines = [" | ".join(h.rjust(w) for (h, _), w in zip(columns, widths)),
             "-+-".join("-" * w for w in widths)]
    return "\n".join(lines + [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells])


def note(row):
    notes = row.get("notes") or {}
    return "; ".join(f"{key}: {text}" if key != "skipped" else f"skipped: {text}" for key, text in notes.items())
