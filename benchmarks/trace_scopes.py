"""Device time per named scope, from a ``jax.profiler`` trace and the compiled program's HLO text.

The model runs its mixers under ``jax.named_scope("mixer")`` and their sequence-mixing op under
``mixer/core`` (``falcon_jax/nn/blocks.py``).  JAX writes the scope path into every HLO instruction's
``op_name`` metadata (``jit(step)/transpose(jvp())/mixer/core/pallas_call``; the backward keeps the
scopes).  So:

    device time in scope S = Σ durations of the device events whose instruction's op_name has S as
                             consecutive path components

over the kernels (and copies) the trace records on the device's streams — on a GPU the
``Stream ...`` lines of the ``/device:GPU:N`` processes, not the lines the profiler derives from them
(``XLA Ops``, ``XLA Modules``, ...); on the CPU, whose ops run on host threads, every event that
names an HLO instruction.  A fusion counts wholly on one side of a scope boundary it crosses (its own
op_name, else its root's: :func:`op_names`).

An event is matched to the step's program (:func:`program`), first method that applies:

1. ``hlo_op``: the instruction the event's args name.  XLA's GPU runtime annotates each launch
   ``XlaModule:#prefix=P,hlo_module=M,program_id=N#::Thunk:#name=OP_NAME,hlo_op=INSTRUCTION#`` and the
   profiler copies those keys into the kernel's args (``hlo_op``, ``hlo_module``, ``name``,
   ``prefix``; ``tf_op`` holds the outermost annotation's name); the CPU's thunks carry ``hlo_op`` and
   ``hlo_module``.  A ``long_name`` holding an instruction's text (``%fusion.3 = ...``) names it too.
2. ``annotation``: the op_name XLA wrote into the annotation itself (``prefix`` + ``/`` + ``name``,
   or a ``tf_op`` that is a path), for an instruction missing from the text.
3. ``kernel_name``: the kernel's own name.  XLA names a fusion's kernel after the instruction
   (``loop_add_fusion.2`` -> ``loop_add_fusion_2``); a Pallas Triton call's kernel is its backend
   config's ``name``; a Mosaic GPU call's kernel carries its host function's name
   (``NAME_mosaic_gpu``) as a prefix.  This is what is left inside a CUDA graph, whose kernels all
   name the graph's launch (``hlo_op=command_buffer_N``): such an event takes this method alone (the
   graph's instruction or op_name would put all of its kernels in one scope).  A kernel XLA reuses
   for identical fusions keeps the first one's name, and a kernel name shared by instructions of
   different scopes is not attributed; vendor kernels (cuBLAS, cuDNN) have no such name and need
   method 1 — which is why ``benchmarks/lm.py`` profiles an executable compiled without CUDA graphs.

Events of another program (an ``hlo_module`` other than the step's, when the step's appears in the
trace) and events nothing matches are unattributed; the largest of them are listed
(:func:`scope_times`) so that a trace in an unforeseen layout shows what it holds.  Shares are only
meaningful while the unattributed time stays small (:data:`MAX_UNATTRIBUTED`).

Independently of all metadata, :func:`named_kernel_time` sums the kernels whose names mark them as a
mixer's sequence-mixing kernels (:data:`MIXER_KERNELS`).

No jax import: this module only reads text and JSON.
"""

from __future__ import annotations

import dataclasses
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
_MODULE = re.compile(r"^\s*HloModule\s+([\w.\-]+)", re.M)
# a custom call's kernel name in its backend config: Triton's ``name = "K"`` (``"name": "K"`` as JSON), and the
# host function ``K_mosaic_gpu`` inside a Mosaic GPU call's serialized module (a NUL-separated string table)
_CONFIG_NAME = re.compile(r'(?:^|[\s{,])"?(?:kernel_)?name"?\s*[=:]\s*"([\w.$\-]+)"')
_MOSAIC_HOST = re.compile(r"\\00(\w+_mosaic_gpu)\\00")
_LONG_NAME = re.compile(r"^\s*%?([\w.\-]+)\s*=")
# the mixers' own sequence-mixing kernels, by name: falcon-jax's Pallas kernels (every ``name=`` /
# ``kernel_name=`` under pallas_kernels/ starts ``falcon_`` or is the gate transpose; Mosaic GPU appends
# ``_mosaic_gpu_kernel``), the Pallas flash attention of the softmax layers (JAX's ``mha_forward``,
# ``mha_preprocess_backward``, ``mha_backward``) and cuDNN's attention kernels (``..._sdpa_...``, ``..._fmha_...``,
# flash)
MIXER_KERNELS = re.compile(r"^(falcon_|gate_transpose|mha_)|sdpa|fmha|flash", re.IGNORECASE)
# past this share of unattributed device time the scope shares say nothing and are withheld
MAX_UNATTRIBUTED = 0.5
METHODS = ("hlo_op", "annotation", "kernel_name")


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


def sanitized(name: str) -> str:
    """The kernel name XLA gives an instruction's kernel: characters other than ``[A-Za-z0-9_$]`` become
    ``_`` (``loop_add_fusion.2`` -> ``loop_add_fusion_2``), and a leading digit gets a ``_`` before it."""
    out = re.sub(r"[^A-Za-z0-9_$]", "_", name) or "__unnamed"
    return "_" + out if out[0].isdigit() else out


@dataclasses.dataclass
class Program:
    """What attribution reads from a compiled program's HLO text (:func:`program`).

    ``module``: the ``HloModule`` name (``None`` when unknown); ``names``: :func:`op_names`;
    ``kernels``: ``{kernel name: [instruction, ...]}`` by XLA's naming (:func:`sanitized`);
    ``stems``: ``{kernel name or prefix: [custom call, ...]}`` from the custom calls' backend configs."""
    module: str | None
    names: dict[str, str]
    kernels: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    stems: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def program(hlo_text: str) -> Program:
    """The :class:`Program` of a compiled program's HLO text (``compiled.as_text()``)."""
    module = _MODULE.search(hlo_text)
    kernels: dict[str, list[str]] = {}
    stems: dict[str, list[str]] = {}
    for _, name, _, _, _, line in _instructions(hlo_text):
        kernels.setdefault(sanitized(name), []).append(name)
        if "custom-call(" in line:
            for stem in {*_CONFIG_NAME.findall(line), *_MOSAIC_HOST.findall(line)}:
                stems.setdefault(stem, []).append(name)
    return Program(module.group(1) if module else None, op_names(hlo_text), kernels, stems)


def _as_program(names) -> Program:
    return names if isinstance(names, Program) else Program(None, dict(names))


def _instruction_candidates(args: dict) -> list[str]:
    """The instruction names an event's args give: ``hlo_op`` (as written, without ``%``, each of a list,
    the last ``/`` component) and the instruction a ``long_name`` holding HLO text defines."""
    out = []
    raw = str(args.get("hlo_op") or "").strip()
    if raw:
        out.append(raw)
        for piece in re.split(r"[,;\s]+", raw):
            piece = piece.lstrip("%")
            out += [piece, piece.rsplit("/", 1)[-1]]
    long_name = _LONG_NAME.match(str(args.get("long_name") or ""))
    if long_name:
        out.append(long_name.group(1))
    return [c for c in dict.fromkeys(out) if c]


def _graph_launch(args: dict) -> bool:
    """Whether an event's args name a CUDA graph's launch (``hlo_op=command_buffer_N``) rather than the
    kernel's own instruction."""
    return str(args.get("hlo_op") or "").strip().lstrip("%").startswith("command_buffer")


def _annotation_path(args: dict) -> str | None:
    """The op_name XLA's launch annotation carries: ``prefix/name`` (``name`` is the op_name without the
    module's common prefix), else a ``tf_op`` that is a path."""
    name = str(args.get("name") or "").strip()
    if name and ("hlo_op" in args or "hlo_module" in args):
        prefix = str(args.get("prefix") or "").strip().rstrip("/")
        return f"{prefix}/{name}" if prefix else name
    tf_op = str(args.get("tf_op") or "")
    return tf_op if "/" in tf_op else None


class _KernelNames:
    """Kernel name -> op_name path through :attr:`Program.kernels` and :attr:`Program.stems`, cached;
    ``None`` when no instruction has that kernel name or its instructions disagree on ``scopes``."""

    def __init__(self, prog: Program, scopes):
        self.prog, self.scopes, self.cache = prog, scopes, {}

    def __call__(self, kernel: str) -> str | None:
        if kernel not in self.cache:
            instructions = self.prog.kernels.get(kernel)
            if not instructions:
                # a custom call's kernel: its name, or its name then ``_...`` (the longest such stem)
                stems = [s for s in self.prog.stems if kernel == s or kernel.startswith(s + "_")]
                instructions = self.prog.stems[max(stems, key=len)] if stems else []
            paths = [p for p in (self.prog.names.get(i) for i in instructions) if p]
            sides = {tuple(in_scope(p, s) for s in self.scopes) for p in paths}
            self.cache[kernel] = paths[0] if len(sides) == 1 else None
        return self.cache[kernel]


def _sample(event: dict, limit: int = 80, keys: int = 16) -> dict:
    """An event's args, at most ``keys`` of them, each value cut to ``limit`` characters."""
    args = event.get("args") or {}
    return {str(k): (str(v) if len(str(v)) <= limit else str(v)[:limit] + "...")
            for k, v in list(args.items())[:keys]}


def scope_times(events: list[dict], names, scopes: tuple[str, ...], host: bool = False, top: int = 10) -> dict:
    """The device time of ``events`` (a trace's; ``host`` as in :func:`device_events`) split by named scope.

    ``names``: the step's :class:`Program` (a plain ``{instruction: op_name}`` mapping is taken as a program
    of unknown module and kernel names).  Returns ``{"total_us", "unattributed_us", "events",
    "by_scope_us": {scope: us}, "by_method_us": {method: us} (METHODS), "modules_us": {hlo_module: us}
    (the device events naming one), "module_matched": whether the step's module was among them,
    "unattributed_top": [{"name", "us", "events", "args"}, ...]}`` — the ``top`` unattributed kernel names by
    time, each with the args of its longest event (values cut short)."""
    prog = _as_program(names)
    by_kernel_name = _KernelNames(prog, scopes)
    chosen = device_events(events, host)
    modules: dict[str, float] = {}
    for e in chosen:
        module = (e.get("args") or {}).get("hlo_module")
        if module:
            modules[str(module)] = modules.get(str(module), 0.0) + float(e["dur"])
    # the module filter applies only when the step's module is seen: a name spelled otherwise filters nothing
    strict = prog.module is not None and prog.module in modules
    total = unattributed = 0.0
    by_scope = dict.fromkeys(scopes, 0.0)
    by_method = dict.fromkeys(METHODS, 0.0)
    missed: dict[str, list] = {}
    for e in chosen:
        dur = float(e["dur"])
        total += dur
        args = e.get("args") or {}
        path = method = None
        if not (strict and args.get("hlo_module") and str(args["hlo_module"]) != prog.module):
            if not _graph_launch(args):
                path = next((prog.names[c] for c in _instruction_candidates(args) if c in prog.names), None)
                method = "hlo_op"
                if path is None:
                    path, method = _annotation_path(args), "annotation"
            if path is None:
                path, method = by_kernel_name(str(e.get("name", ""))), "kernel_name"
        if path is None:
            unattributed += dur
            entry = missed.setdefault(str(e.get("name", "")), [0.0, 0, 0.0, e])
            entry[0] += dur
            entry[1] += 1
            if dur > entry[2]:
                entry[2], entry[3] = dur, e
            continue
        by_method[method] += dur
        for scope in scopes:
            if in_scope(path, scope):
                by_scope[scope] += dur
    ranked = sorted(missed.items(), key=lambda kv: -kv[1][0])[:top]
    return {"total_us": total, "unattributed_us": unattributed, "events": len(chosen), "by_scope_us": by_scope,
            "by_method_us": by_method, "modules_us": dict(sorted(modules.items(), key=lambda kv: -kv[1])),
            "module_matched": strict,
            "unattributed_top": [{"name": name[:120], "us": us, "events": n, "args": _sample(longest)}
                                 for name, (us, n, _, longest) in ranked]}


def named_kernel_time(events: list[dict], pattern: re.Pattern = MIXER_KERNELS, host: bool = False) -> float:
    """Device time (µs) of the device events of ``events`` whose kernel name matches ``pattern`` (default:
    :data:`MIXER_KERNELS`) — from the names alone, no program or op_name needed."""
    return sum(float(e["dur"]) for e in device_events(events, host) if pattern.search(str(e.get("name", ""))))
