"""Checkpoints through ``orbax.checkpoint.CheckpointManager``.

Layout: ``<run_dir>/checkpoints/<step>/{state,meta}``; ``state`` (orbax StandardSave) holds the
params, optimizer state, step and RNG key data; ``meta`` (JSON) the data-iterator state and the
full config.  Orbax writes each step into a temporary directory and renames it when complete
(atomic), so a process killed mid-save leaves the previous checkpoints intact, and keep-N only
deletes old steps after a newer one is finalised.

A latest checkpoint that fails to restore (truncated or corrupt files) is reported, moved to
``<run_dir>/checkpoints_corrupt/<step>`` (kept for inspection, never deleted) and the next older
one is tried.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Periodic, keep-N, optionally async checkpoints of one run."""

    def __init__(self, run_dir: str, *, every: int, keep: int, async_save: bool = True, log=print):
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.corrupt_dir = os.path.abspath(os.path.join(run_dir, "checkpoints_corrupt"))
        self.every, self.keep, self.async_save, self.log = every, keep, async_save, log
        self._open()

    def _open(self):
        opts = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                            enable_async_checkpointing=self.async_save)
        self.manager = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``."""
        if step in self.manager.all_steps():
            return False
        return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                               meta=ocp.args.JsonSave(meta)), force=force)

    def restore_latest(self, abstract_state):
        """``(step, state, meta)`` of the newest checkpoint that restores, or None if none does.

        ``abstract_state``: the state pytree with ``jax.ShapeDtypeStruct`` leaves carrying
        the target shardings.  Broken checkpoints are reported and moved aside.
        """
        for step in reversed(self.steps()):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                state, meta = out["state"], out["meta"]
                if meta is None or "data" not in meta:
                    raise ValueError("the metadata item is missing or incomplete")
                jax.block_until_ready(state)
                return step, state, meta
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable
                self.log(f"[checkpoint] step {step} in {self.dir} is corrupt or truncated and cannot be "
                         f"restored ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                         f"moving it to {self.corrupt_dir} and trying the previous checkpoint.")
                self._quarantine(step)
        return None

    def _quarantine(self, step: int):
        self.manager.close()
        os.makedirs(self.corrupt_dir, exist_ok=True)
        src = os.path.join(self.dir, str(step))
        if os.path.exists(src):
            dst = os.path.join(self.corrupt_dir, f"{step}-{int(time.time())}")
            shutil.move(src, dst)
        self._open()

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
