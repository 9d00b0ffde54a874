"""Device time per named scope, from a ``jax.profiler`` trace and the compiled program's HLO text.

The model runs its mixers under ``jax.named_scope("mixer")`` and their sequence-mixing op under
``mixer/core`` (``falcon_jax/nn/blocks.py``).  JAX writes the scope path into every HLO instruction's
``op_name`` metadata (``jit(step)/transpose(jvp())/mixer/core/pallas_call``; the backward keeps the
scopes), and the profiler names the HLO instruction each device event ran (``args.hlo_op``).  So:

    device time in scope S = Σ durations of the device events whose instruction's op_name has S as
                             consecutive path components

over the kernels (and copies) the trace records on the device's streams — on a GPU the
``Stream ...`` lines of the ``/device:GPU:N`` processes, not the lines the profiler derives from them
(``XLA Ops``, ``XLA Modules``, ...); on the CPU, whose ops run on host threads, every event that
names an HLO instruction.  A fusion counts wholly on one side of a scope boundary it crosses (its own
op_name, else its root's: :func:`op_names`).  Events whose instruction is not in the program (a CUDA
graph's ``command_buffer`` launch, a copy without an instruction) are counted as unattributed.

No jax import: this module only reads text and JSON.
"""

from __future__ import annotations

import gzip
import json
import os
import re

_INSTRUCTION = re.compile(r'^\s*(ROOT\s+)?%?([\w.\-]+)\s*=(.*)$')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'(?:calls|to_apply)=%?([\w.\-]+)')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DEVICE = re.compile(r"/device:(GPU|TPU):\d+")
# custom-call targets (substrings) and fusion kinds -> the kernel family a report names
KERNEL_FAMILIES = (("triton", "triton"), ("mosaic_gpu", "mosaic_gpu"), ("tpu_custom_call", "mosaic_tpu"),
                   ("cudnn", "cudnn"))


def _operands(rest: str) -> list[str]:
    """The ``%names`` an instruction's text refers to before its attributes (its operands)."""
    return re.findall(r"%([\w.\-]+)", re.split(r", (?:calls|to_apply|metadata|backend_config)=", rest)[0])


def _common_path(paths: list[str]) -> str | None:
    """The longest common leading components of op_name paths (None when they share none)."""
    if not paths:
        return None
    parts = [p.split("/") for p in paths]
    common = []
    for column in zip(*parts):
        if any(c != column[0] for c in column):
            break
        common.append(column[0])
    return "/".join(common) or None


def _instructions(hlo_text: str):
    """``(computation, name, is_root, op_name or None, called computation or None, line)`` per instruction."""
    computation = None
    for line in hlo_text.splitlines():
        if line.startswith("}"):
            computation = None
            continue
        m = _INSTRUCTION.match(line)
        if m and computation is not None:
            rest = m.group(3)
            op_name, calls = _OP_NAME.search(rest), _CALLS.search(rest)
            yield (computation, m.group(2), bool(m.group(1)), op_name.group(1) if op_name else None,
                   calls.group(1) if calls else None, line)
            continue
        c = _COMPUTATION.match(line)
        if c and not line.startswith(" "):
            computation = c.group(1)


def op_names(hlo_text: str) -> dict[str, str]:
    """``{instruction name: op_name}`` for the instructions (nested computations included) of a compiled
    program's HLO text (``compiled.as_text()``).  An instruction without ``op_name`` metadata (XLA drops it
    from some fusions, converts and the ops its passes create) takes that of the computation it calls (its
    root's, else the most common among that computation's instructions), else the longest common path of
    its operands' op_names (a copy or convert between two ops of one mixer stays in that mixer)."""
    rows = list(_instructions(hlo_text))
    by_computation: dict[str, list] = {}
    by_name: dict[tuple[str, str], tuple] = {}
    for row in rows:
        by_computation.setdefault(row[0], []).append(row)
        by_name[(row[0], row[1])] = row
    resolved: dict[str, str | None] = {}
    computed: dict[str, str | None] = {}

    def of_computation(name, depth=0):
        if name not in computed:
            computed[name] = None  # guards against cycles
            members = by_computation.get(name, [])
            paths = [of_instruction(r, depth + 1) for r in members]
            roots = [p for r, p in zip(members, paths) if r[2] and p]
            named = [p for p in paths if p]
            computed[name] = roots[0] if roots else (max(set(named), key=named.count) if named else None)
        return computed[name]

    def of_instruction(row, depth=0):
        computation, name, _, op_name, calls, line = row
        key = (computation, name)
        if key not in resolved:
            resolved[key] = None  # guards against cycles
            path = op_name or (of_computation(calls, depth) if calls and depth < 50 else None)
            if path is None and depth < 50:
                rest = line.split("=", 1)[1]
                operands = [by_name[(computation, o)] for o in _operands(rest) if (computation, o) in by_name]
                path = _common_path([p for p in (of_instruction(r, depth + 1) for r in operands) if p])
            resolved[key] = path
        return resolved[key]

    out = {}
    for row in rows:
        path = of_instruction(row)
        if path:
            out[row[1]] = path
    return out


def _bare(component: str) -> str:
    """A path component without transformation wrappers: ``transpose(jvp(mixer))`` -> ``mixer``."""
    while True:
        m = re.fullmatch(r"[\w\-]+\((.*)\)", component)
        if not m:
            return component
        component = m.group(1)


def in_scope(path: str, scope: str) -> bool:
    """Whether the op_name ``path`` lies in ``scope`` (``"mixer"`` or ``"mixer/core"``): the scope's
    components appear consecutively among the path's (each bared of transformation wrappers)."""
    parts = [_bare(c) for c in path.split("/")]
    want = scope.split("/")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def kernel_families(hlo_text: str, scope: str, names: dict[str, str] | None = None) -> list[str]:
    """The kernel families (``triton``, ``mosaic_gpu``, ``mosaic_tpu``, ``cudnn``) of the custom calls
    and cuDNN fusions whose op_name (``names``: :func:`op_names` of the text) lies in ``scope``, sorted;
    empty when XLA's own ops serve it."""
    found = set()
    names = op_names(hlo_text) if names is None else names
    for _, name, _, _, _, line in _instructions(hlo_text):
        if name not in names or not in_scope(names[name], scope):
            continue
        target = _TARGET.search(line)
        text = target.group(1) if target else ("cudnn" if "__cudnn$" in line else "")
        for needle, family in KERNEL_FAMILIES:
            if needle in text:
                found.add(family)
    return sorted(found)


def load_trace(log_dir: str) -> list[dict]:
    """The events of the trace ``jax.profiler`` wrote under ``log_dir`` (``HOST.trace.json.gz``, else
    ``perfetto_trace.json.gz``: the same events)."""
    found = [os.path.join(base, f) for base, _, files in os.walk(log_dir) for f in files]
    paths = ([p for p in found if p.endswith(".trace.json.gz") and not p.endswith("perfetto_trace.json.gz")]
             or [p for p in found if p.endswith("perfetto_trace.json.gz")])
    if len(paths) != 1:
        raise FileNotFoundError(f"expected one trace (*.trace.json.gz) under {log_dir}, found {sorted(found)}")
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict], host: bool = False) -> list[dict]:
    """The complete (``ph == "X"``) events of device work; see the module docstring.  ``host``: the
    backend runs its ops on host threads (the CPU); otherwise a trace without a device process has no
    device events (a GPU profiled without CUPTI), and host-side events are not taken for them."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = (e.get("args") or {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = (e.get("args") or {}).get("name", "")
    devices = {pid for pid, name in processes.items() if _DEVICE.search(name)}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not devices:  # the CPU: XLA's thunks on host threads
        return [e for e in complete if (e.get("args") or {}).get("hlo_op")] if host else []
    streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}
    if streams:
        return [e for e in complete if (e.get("pid"), e.get("tid")) in streams]
    return [e for e in complete if e.get("pid") in devices and (e.get("args") or {}).get("hlo_op")]


def scope_times(events: list[dict], names: dict[str, str], scopes: tuple[str, ...], host: bool = False) -> dict:
    """``{"total_us", "unattributed_us", "events", "by_scope_us": {scope: us}}`` over the device events
    of ``events`` (a trace's; ``host`` as in :func:`device_events`), attributed through ``names``
    (:func:`op_names` of the program)."""
    total = unattributed = 0.0
    by_scope = dict.fromkeys(scopes, 0.0)
    chosen = device_events(events, host)
    for e in chosen:
        dur = float(e["dur"])
        total += dur
        args = e.get("args") or {}
        path = names.get(args.get("hlo_op", ""))
        if path is None and "/" in str(args.get("tf_op", "")):
            path = args["tf_op"]
        if path is None:
            unattributed += dur
            continue
        for scope in scopes:
            if in_scope(path, scope):
                by_scope[scope] += dur
    return {"total_us": total, "unattributed_us": unattributed, "events": len(chosen), "by_scope_us": by_scope}
