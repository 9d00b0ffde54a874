"""Trainer configuration: sections, presets, config files and ``--set`` overrides.

A config is a :class:`TrainConfig` of six sections (``model``, ``data``, ``optim``, ``train``,
``mesh``, ``checkpoint``).  ``model`` is a dict of :class:`falcon_jax.nn.LMConfig` fields
(validated against them); the others are dataclasses.  Sources, later ones winning::

    preset (--preset NAME)  <  config file (--config run.toml | run.json)  <  --model NAME  <  --set key=value

``--set`` keys are dotted (``optim.lr=3e-4``, ``model.d_model=128``, ``data.eval_widths=[9,10]``);
values are parsed as JSON when they parse (numbers, booleans, lists, null), else taken as strings; a
string-valued key (``train.run_dir=5``, ``data.cache_dir=007``) keeps the text as it is.
An unknown section or key is an error that names it and suggests the nearest valid key; every value
is then checked (:func:`validate`), so a bad one stops the command line at once with exit code 2.
``data.paths`` given as one string is one path.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import Any

from falcon_jax.nn import LMConfig
from falcon_jax.train.addition import LISTED_WIDTH, heldout_problems


@dataclasses.dataclass
class DataConfig:
    """``kind="addition"``: the paper's task (docs/results.md; train widths uniform in [train_min_width, train_max_width],
    eval widths split into in-distribution and longer-than-trained by the training range).
    ``pack=true`` fills rows of ``seq_len`` tokens with many problems, each its own segment, widths drawn per
    problem by ``width_sampling`` ("uniform" or "token_balanced": the same share of tokens per width);
    ``curriculum_steps > 0`` lets the widest training width grow by equal steps from ``curriculum_start_width``
    to ``train_max_width`` over that many steps (packed rows only).
    ``kind="text"``: local files (``paths``), packed windows of ``seq_len`` tokens.
    ``loader``: "grain" (Grain pipeline, per-host rows, iterator state in checkpoints) or
    "builtin" (index-based; every host builds the global batch); see :mod:`falcon_jax.train.loader`."""

    kind: str = "addition"
    seed: int = 0
    loader: str = "grain"
    grain_threads: int = 1  # Grain read-ahead threads (0 = read in the training thread)
    grain_prefetch: int = 2  # host batches the read-ahead threads may buffer
    # addition
    train_min_width: int = 1
    train_max_width: int = 8
    eval_widths: list = dataclasses.field(default_factory=lambda: list(range(1, 13)))
    eval_examples: int = 256
    greedy_widths: list | None = None  # widths for free-running greedy eval (None = all eval widths)
    greedy_examples: int = 64  # <= eval_examples: the greedy prompts are the eval set's first rows
    heldout_frac: float = 0.05
    split_seed: int = 1234
    pack: bool = False  # many problems per row of seq_len tokens, one segment each (else one problem a row)
    width_sampling: str = "uniform"  # packed rows: "uniform" width per problem, or "token_balanced"
    curriculum_steps: int = 0  # packed rows: the widest width grows from curriculum_start_width to train_max_width
    curriculum_start_width: int = 4  # over this many steps (0 = no curriculum)
    # text (and packed addition: seq_len)
    paths: list = dataclasses.field(default_factory=list)
    seq_len: int = 256
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    val_frac: float = 0.05
    val_batches: int = 8
    text_key: str = "text"
    cache_dir: str = ".cache/falcon-train"

    def in_dist_widths(self) -> list[int]:
        """The evaluated widths an addition run trains on (``eval_widths`` up to ``train_max_width``): the widths
        its in-distribution means average over; none for text."""
        if self.kind != "addition":
            return []
        return sorted(w for w in set(self.eval_widths) if w <= self.train_max_width)


@dataclasses.dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``lr * min_lr_ratio``; global-norm clip.
    Weight decay applies to matrices only (projection and conv kernels); never to norms,
    biases, per-head gate vectors (``lam_bias``, ``dt_bias``, ``A_log``...), and to the
    embedding only if ``decay_embedding``."""

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    decay_embedding: bool = False


@dataclasses.dataclass
class LoopConfig:
    """``batch_size`` is the *global* batch (rows per optimizer step, all devices and
    accumulation steps together); ``grad_accum`` splits it into that many micro-batches.
    ``init``: "eager" builds the parameters op by op and then places them on their shards (the
    whole model passes through one device); "jit" builds them inside one compiled program
    straight onto their shards (for models larger than a device), which on GPU for the 130M
    preset took over 3 minutes of ptxas time on an H200."""

    steps: int = 1000
    batch_size: int = 64
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 50
    eval_every: int = 0  # 0 = only at the end
    run_dir: str = "runs/default"
    plots: bool = True
    init: str = "eager"
    step_sleep: float = 0.0  # testing aid: seconds to sleep after every step (the SIGKILL test)
    time_limit_s: float = 0.0  # > 0: checkpoint and exit 0 before this many seconds (--resume continues)


@dataclasses.dataclass
class MeshConfig:
    """Device mesh axis sizes (one of them may be -1 = all remaining devices) and
    ``distributed``: "auto" calls ``jax.distributed.initialize()`` when a multi-host
    environment (SLURM, Open MPI, a TPU pod, or JAX_COORDINATOR_ADDRESS) is detected.
    ``seq`` splits every sequence over that many devices (context parallelism: data.seq_len must be a multiple
    of it; docs/training.md)."""

    data: int = -1
    fsdp: int = 1
    seq: int = 1
    tensor: int = 1
    distributed: str = "auto"


@dataclasses.dataclass
class CheckpointConfig:
    """``keep`` >= 1 newest checkpoints are kept.  ``async_save``: write in the background while training
    goes on (a failed write then stops the run at the first step after it, not at its own step)."""

    every: int = 500  # 0 = no periodic checkpoints (the final step is still saved)
    every_s: float = 0.0  # > 0: also save when this many seconds have passed since the last save
    keep: int = 3
    async_save: bool = False
    enabled: bool = True


SECTIONS = {"data": DataConfig, "optim": OptimConfig, "train": LoopConfig, "mesh": MeshConfig,
            "checkpoint": CheckpointConfig}
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))


@dataclasses.dataclass
class TrainConfig:
    model: dict = dataclasses.field(default_factory=dict)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        cfg = cls()
        apply_dict(cfg, d)
        return cfg

    def lm_config(self, vocab_size: int | None = None) -> LMConfig:
        """The model's :class:`LMConfig` (``vocab_size`` from the data unless set explicitly)."""
        fields = dict(self.model)
        if vocab_size is not None and "vocab_size" not in fields:
            fields["vocab_size"] = vocab_size
        for k in ("lam_init", "layer_mixers"):
            if isinstance(fields.get(k), list):
                fields[k] = tuple(fields[k])
        return LMConfig(**fields)


class ConfigError(ValueError):
    """A bad preset, config file or override; the message names the offending key."""


def _suggest(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def set_key(cfg: TrainConfig, key: str, value: Any) -> None:
    """Set a dotted key (``"optim.lr"``, ``"model.d_model"``); ConfigError naming it if unknown."""
    section, _, name = key.partition(".")
    if not name:
        raise ConfigError(f"config key {key!r} must be 'section.field' with section in "
                          f"{['model', *SECTIONS]} (e.g. optim.lr=3e-4).")
    if section == "model":
        if name not in MODEL_FIELDS:
            raise ConfigError(f"unknown config key {key!r}: LMConfig has no field {name!r}."
                              + _suggest(name, MODEL_FIELDS))
        cfg.model[name] = value
        return
    if section not in SECTIONS:
        raise ConfigError(f"unknown config key {key!r}: no section {section!r}; sections are "
                          f"{['model', *SECTIONS]}." + _suggest(section, ["model", *SECTIONS]))
    obj = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(obj)]
    if name not in names:
        raise ConfigError(f"unknown config key {key!r}: section {section!r} has no field {name!r}."
                          + _suggest(name, names) + f" Valid: {', '.join(names)}.")
    old = getattr(obj, name)
    if section == "data" and name == "paths" and isinstance(value, str):
        value = [value]  # one path or glob pattern, not a sequence of characters
    if isinstance(old, bool) and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false; got {value!r}.")
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a number; got {value!r}.")
        if isinstance(old, int) and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"config key {key!r} must be an integer; got {value!r}.")
        value = type(old)(value)
    setattr(obj, name, value)


def apply_dict(cfg: TrainConfig, d: dict, prefix: str = "") -> None:
    """Merge a nested dict (from a preset or a config file) into ``cfg``."""
    for k, v in d.items():
        if not prefix and k == "model":
            if not isinstance(v, dict):
                raise ConfigError("config 'model' must be a table/dict of LMConfig fields.")
            for mk, mv in v.items():
                set_key(cfg, f"model.{mk}", mv)
        elif not prefix and isinstance(v, dict):
            for sk, sv in v.items():
                set_key(cfg, f"{k}.{sk}", sv)
        else:
            set_key(cfg, f"{prefix}{k}", v)


def _is_text_field(key: str) -> bool:
    """Whether ``key`` names a string-valued field (a path, a name), ``data.paths`` (a list of them) included."""
    section, _, name = key.partition(".")
    cls = LMConfig if section == "model" else SECTIONS.get(section)
    types = {f.name: f.type for f in dataclasses.fields(cls)} if cls is not None else {}
    return key == "data.paths" or types.get(name) in (str, "str")


def parse_override(text: str) -> tuple[str, Any]:
    """``"optim.lr=3e-4"`` -> ``("optim.lr", 0.0003)``; values parse as JSON if they can.  A string-valued key keeps
    the text as it is (``train.run_dir=5`` is the directory ``"5"``) unless it is a JSON string (or, for
    ``data.paths``, a JSON list)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value (e.g. --set optim.lr=3e-4).")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if _is_text_field(key) and not isinstance(value, list if key == "data.paths" else str):
        value = raw
    return key, value


def load_file(path: str) -> dict:
    """A config file: ``.json`` or ``.toml`` (sections as tables)."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist.")
    if not path.endswith((".toml", ".json")):
        raise ConfigError(f"config file {path!r}: use a .json or .toml file.")
    try:
        if path.endswith(".toml"):
            import tomllib
            with open(path, "rb") as f:
                d = tomllib.load(f)
        else:
            with open(path) as f:
                d = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, TOMLDecodeError, bad UTF-8
        raise ConfigError(f"config file {path!r} cannot be read ({type(e).__name__}: {e}); fix or replace it (a "
                          f"run's config.json cut by a kill: give the run's --preset and --set options "
                          f"again).") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config file {path!r} must hold a table of sections (model, data, optim, ...); got "
                          f"a {type(d).__name__}.")
    return d


# ----------------------------------------------------------------------------- presets
_ADDITION_TINY = {
    # A 2-layer Falcon-1A.3 of width 192 (6 heads of 32) on CPU, trained on widths 1-4 and
    # evaluated on 1-8; about 1.5 minutes on a 2-core CPU (docs/training.md has the measured time).
    # The model learns the widths in stages (1-2, then width 3, then the middle digit of width 4)
    # with long, seed-dependent plateaus in between.  Width 64 (and 96) sat on them for 1,500-3,000
    # steps at every lr tried (lr >= 3e-3 stalled even earlier, with grad-norm spikes); width 192
    # with head dim 32 at lr 2e-3 usually gets past them in 1,500 steps (not every seed: seed 3
    # still stops at the width-4 middle digit).  A narrow SwiGLU (128) keeps the step cheap.
    # The parallel form is the fastest at T <= 24.
    "model": dict(mixer="falcon-1A.3", d_model=192, n_layers=2, n_heads=6, mlp_hidden=128, chunk_size=16,
                  form="parallel", dtype="float32", param_dtype="float32"),
    "data": dict(kind="addition", train_min_width=1, train_max_width=4, eval_widths=list(range(1, 9)),
                 eval_examples=256, greedy_widths=[2, 4, 6, 8], greedy_examples=64),
    "optim": dict(lr=2e-3, warmup_steps=200, weight_decay=0.1, min_lr_ratio=0.05),
    "train": dict(steps=1500, batch_size=64, log_every=100, eval_every=750, run_dir="runs/addition-tiny"),
    "checkpoint": dict(every=500, keep=2),
}
_ADDITION_PAPER = {
    # the paper's protocol (docs/results.md): train widths 1..32 uniform, held-out widths 33..48, loss on the target;
    # the paper's best step is ~2,000.  Model size and batch are this project's choice (the
    # paper does not state them): 4 layers of width 256, batch 256, bf16 compute.
    "model": dict(mixer="falcon-1A.3", d_model=256, n_layers=4, n_heads=8, chunk_size=64,
                  dtype="bfloat16", param_dtype="float32"),
    "data": dict(kind="addition", train_min_width=1, train_max_width=32, eval_widths=list(range(1, 49)),
                 eval_examples=512, greedy_widths=[8, 16, 32, 33, 40, 48], greedy_examples=128),
    "optim": dict(lr=1e-3, warmup_steps=200, weight_decay=0.1, min_lr_ratio=0.1),
    "train": dict(steps=4000, batch_size=256, log_every=50, eval_every=250, run_dir="runs/addition-paper"),
    "checkpoint": dict(every=250, keep=3),
}
_ADDITION_PACKED = {
    # the paper's protocol with packed rows: every row holds ~19 problems of widths 1..32 (uniform per problem),
    # one segment each, the loss on the sum digits and EOS.  Scale from the paper's LM recipe (App. B.1), which
    # its addition "best step" (~2,000) suggests it reused: seq 1,024, 512 rows (0.5M tokens a step), AdamW
    # lr 1e-3 cosine, 2,000 steps = 1.07B tokens.  Model: Falcon-1A.3 with 8 layers of width 512 (28M).  A width
    # curriculum (widest width 4 -> 32 over the first 1,000 steps): on one H200 it reached 76.8 % mean exact on
    # widths 1-32 after 0.47B tokens against 17.5 % without (docs/results.md).
    # One device needs about 103 GiB for this batch (H200); on smaller GPUs --set train.grad_accum=2 (or 4)
    # holds the activations of 256 (128) rows at a time, with the same updates.
    "model": dict(mixer="falcon-1A.3", d_model=512, n_layers=8, n_heads=8, chunk_size=64,
                  dtype="bfloat16", param_dtype="float32"),
    "data": dict(kind="addition", pack=True, seq_len=1024, width_sampling="uniform", grain_threads=2, grain_prefetch=4,
                 train_min_width=1, curriculum_steps=1000, curriculum_start_width=4,
                 train_max_width=32, eval_widths=list(range(1, 49)), eval_examples=256,
                 greedy_widths=[8, 16, 32, 33, 40, 48], greedy_examples=128),
    "optim": dict(lr=1e-3, warmup_steps=200, weight_decay=0.1, min_lr_ratio=0.1),
    "train": dict(steps=2000, batch_size=512, log_every=25, eval_every=100, run_dir="runs/addition-packed"),
    "checkpoint": dict(every=250, every_s=240.0, keep=2),
}
_ADDITION_PACKED_TINY = {
    # packed rows on CPU: addition-tiny's model on rows of 64 tokens (~6 problems of widths 1-3 each);
    # ~1 minute on 2 cores (tests/test_train_packed.py checks that it learns widths 1-3)
    "model": dict(mixer="falcon-1A.3", d_model=192, n_layers=2, n_heads=6, mlp_hidden=128, chunk_size=16,
                  form="chunk", dtype="float32", param_dtype="float32"),
    "data": dict(kind="addition", pack=True, seq_len=64, train_min_width=1, train_max_width=3,
                 eval_widths=[1, 2, 3, 4, 5], eval_examples=128, greedy_widths=[2, 3], greedy_examples=32),
    "optim": dict(lr=2e-3, warmup_steps=50, weight_decay=0.1, min_lr_ratio=0.05),
    "train": dict(steps=700, batch_size=16, log_every=50, eval_every=350, run_dir="runs/addition-packed-tiny"),
    "checkpoint": dict(every=350, keep=1),
}
_LM_TINY = {
    # Byte-level LM on local text (by default this repository's docs); CPU-sized.
    "model": dict(mixer="falcon-1A.3", d_model=128, n_layers=2, n_heads=4, chunk_size=32,
                  dtype="float32", param_dtype="float32"),
    "data": dict(kind="text", paths=["docs", "README.md"], seq_len=256,
                 tokenizer="byte", val_batches=4),
    "optim": dict(lr=2e-3, warmup_steps=50, weight_decay=0.1),
    "train": dict(steps=300, batch_size=16, log_every=25, eval_every=100, run_dir="runs/lm-tiny"),
    "checkpoint": dict(every=100, keep=2),
}
_LM_130M = {
    # the paper's LM recipe (App. B.1; docs/layers.md): AdamW lr 1e-3 cosine, 2,000 warm-up, betas (0.9, 0.95), wd 0.1,
    # clip 1.0, bf16, seq 1,024, global batch 480, 100k steps.  data.paths must be set.
    "model": dict(mixer="falcon-1A.3", vocab_size=50304, d_model=768, n_layers=12, n_heads=12, chunk_size=64,
                  dtype="bfloat16", param_dtype="float32"),
    "data": dict(kind="text", paths=[], seq_len=1024, tokenizer="bpe", bpe_vocab_size=50304, val_batches=50),
    "optim": dict(lr=1e-3, warmup_steps=2000, b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0,
                  min_lr_ratio=0.1),
    "train": dict(steps=100_000, batch_size=480, log_every=50, eval_every=2000, run_dir="runs/lm-130m"),
    "checkpoint": dict(every=1000, keep=3),
}
_LM_130M_LONG = {
    # lm-130m's model and optimizer at T = 65,536: each row one long window, every sequence split over all the
    # devices (context parallelism, mesh.seq = -1; falcon_jax.context_parallel).  8 rows of 65,536 tokens per step
    # (524,288 tokens, about lm-130m's 480 x 1,024).  data.paths must be set.
    "model": dict(_LM_130M["model"]),
    "data": dict(_LM_130M["data"], seq_len=65_536, val_batches=8),
    "optim": dict(_LM_130M["optim"]),
    "train": dict(_LM_130M["train"], batch_size=8, run_dir="runs/lm-130m-long"),
    "mesh": dict(data=1, fsdp=1, seq=-1, tensor=1),
    "checkpoint": dict(_LM_130M["checkpoint"]),
}
PRESETS = {"addition-tiny": _ADDITION_TINY, "addition-packed-tiny": _ADDITION_PACKED_TINY,
           "addition-paper": _ADDITION_PAPER, "addition-packed": _ADDITION_PACKED, "lm-tiny": _LM_TINY,
           "lm-130m": _LM_130M, "lm-130m-long": _LM_130M_LONG}


# ----------------------------------------------------------------------------- value checks
def _need(ok: bool, key: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {rule}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_at_least(key: str, value, low: int, meaning: str = "") -> None:
    _need(_is_int(value) and value >= low, key, value, f"must be an integer >= {low}{meaning}.")


def _seed(key: str, value) -> None:
    # jax.random.key keeps the low 32 bits without x64: seed 2**32 would repeat seed 0's run
    _need(_is_int(value) and 0 <= value < 2**32, key, value, "must be an integer in [0, 2**32).")


def _choice(key: str, value, choices) -> None:
    _need(value in choices, key, value, f"use one of {', '.join(repr(c) for c in choices)}."
          + _suggest(str(value), choices))


def _int_list(key: str, value, low: int) -> None:
    _need(isinstance(value, (list, tuple)) and all(_is_int(x) and x >= low for x in value), key, value,
          f"must be a list of integers >= {low} (e.g. [1, 2, 4]).")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every value of ``cfg`` (the model fields through :class:`LMConfig`); ConfigError naming the
    first bad key, its value and the valid range.  Runs before any model, data or file work."""
    o, t, d, c, m = cfg.optim, cfg.train, cfg.data, cfg.checkpoint, cfg.mesh
    # optimizer
    _need(_is_num(o.lr) and o.lr > 0, "optim.lr", o.lr, "must be a finite number > 0 (the peak learning rate).")
    _need(_is_num(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio,
          "must be in [0, 1] (the final learning rate as a fraction of optim.lr).")
    _int_at_least("optim.warmup_steps", o.warmup_steps, 0)
    for key, value in (("optim.b1", o.b1), ("optim.b2", o.b2)):
        _need(_is_num(value) and 0 <= value < 1, key, value, "must be in [0, 1) (an Adam moment decay).")
    _need(_is_num(o.eps) and o.eps > 0, "optim.eps", o.eps, "must be a number > 0.")
    _need(_is_num(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0.")
    _need(_is_num(o.clip_norm) and o.clip_norm >= 0, "optim.clip_norm", o.clip_norm,
          "must be >= 0 (0 = no gradient clipping).")
    # loop
    _int_at_least("train.steps", t.steps, 1, " (the number of optimizer steps)")
    _int_at_least("train.batch_size", t.batch_size, 1, " (rows per optimizer step)")
    _int_at_least("train.grad_accum", t.grad_accum, 1)
    _need(t.batch_size % t.grad_accum == 0, "train.grad_accum", t.grad_accum,
          f"must divide train.batch_size={t.batch_size} (the batch is split into grad_accum micro-batches).")
    _int_at_least("train.log_every", t.log_every, 1)
    _int_at_least("train.eval_every", t.eval_every, 0, " (0 = evaluate only at the end)")
    _seed("train.seed", t.seed)
    _need(isinstance(t.run_dir, str) and t.run_dir.strip() != "", "train.run_dir", t.run_dir,
          "must be a directory path.")
    _choice("train.init", t.init, ("eager", "jit"))
    _need(_is_num(t.step_sleep) and t.step_sleep >= 0, "train.step_sleep", t.step_sleep, "must be >= 0 seconds.")
    _need(_is_num(t.time_limit_s) and t.time_limit_s >= 0, "train.time_limit_s", t.time_limit_s,
          "must be >= 0 seconds (0 = no limit).")
    _need(t.time_limit_s == 0 or c.enabled, "train.time_limit_s", t.time_limit_s,
          "needs checkpoints to continue from (checkpoint.enabled is false).")
    # checkpoints
    _int_at_least("checkpoint.every", c.every, 0, " (0 = only the final step is saved)")
    _int_at_least("checkpoint.keep", c.keep, 1, " (the number of newest checkpoints kept; 1 keeps the last)")
    _need(_is_num(c.every_s) and c.every_s >= 0, "checkpoint.every_s", c.every_s,
          "must be >= 0 seconds (0 = save by steps only).")
    # mesh
    for key, value in (("mesh.data", m.data), ("mesh.fsdp", m.fsdp), ("mesh.seq", m.seq), ("mesh.tensor", m.tensor)):
        _need(_is_int(value) and (value >= 1 or value == -1), key, value,
              "must be a positive integer or -1 (all remaining devices).")
    _choice("mesh.distributed", m.distributed, ("auto", "on", "off"))
    if _is_int(m.seq) and m.seq > 1 and d.kind == "text" and _is_int(d.seq_len):
        _need(d.seq_len % m.seq == 0, "mesh.seq", m.seq, f"must divide data.seq_len={d.seq_len} (context "
              f"parallelism gives every device seq_len / mesh.seq positions); pick a divisor of {d.seq_len}.")
    # data
    _choice("data.kind", d.kind, ("addition", "text"))
    _choice("data.loader", d.loader, ("grain", "builtin"))
    _seed("data.seed", d.seed)
    _int_at_least("data.grain_threads", d.grain_threads, 0, " (0 = read in the training thread)")
    _int_at_least("data.grain_prefetch", d.grain_prefetch, 0)
    # every field is checked whatever data.kind is: a typo in the other kind's fields is still a typo
    _int_at_least("data.train_min_width", d.train_min_width, 1)
    _int_at_least("data.train_max_width", d.train_max_width, d.train_min_width,
                  f" (data.train_min_width={d.train_min_width})")
    _int_list("data.eval_widths", d.eval_widths, 1)
    _int_at_least("data.eval_examples", d.eval_examples, 1)
    if d.greedy_widths is not None:
        _int_list("data.greedy_widths", d.greedy_widths, 1)
        if d.kind == "addition" and _is_int(d.train_max_width) and all(_is_int(x) for x in d.eval_widths):
            # the greedy prompts come from the held-out rows, which are as wide as the widest eval or train width
            widest = max([*d.eval_widths, d.train_max_width])
            _need(all(x <= widest for x in d.greedy_widths), "data.greedy_widths", d.greedy_widths,
                  f"must be <= {widest}, the widest of data.eval_widths and data.train_max_width; add the wider "
                  f"widths to data.eval_widths.")
    _int_at_least("data.greedy_examples", d.greedy_examples, 1)
    if d.kind == "addition" and _is_int(d.eval_examples) and d.greedy_widths:
        # the greedy prompts are the first rows of each width's eval set: more than it holds would run fewer
        _need(d.greedy_examples <= d.eval_examples, "data.greedy_examples", d.greedy_examples,
              f"must be <= data.eval_examples={d.eval_examples} (the greedy prompts come from the eval set); raise "
              f"data.eval_examples or lower data.greedy_examples.")
    # above one half the training draw, which rejects held-out problems, could not find problems of the short widths
    _need(_is_num(d.heldout_frac) and 0 < d.heldout_frac <= 0.5, "data.heldout_frac", d.heldout_frac,
          "must be in (0, 0.5] (the share of problems held out for evaluation; training draws from the rest).")
    _seed("data.split_seed", d.split_seed)
    if d.kind == "addition":
        for w in sorted(set(d.eval_widths)):
            # a short width has few problems (100 at width 1): the split can leave it none, found at the first
            # evaluation otherwise, after training up to it
            if w <= LISTED_WIDTH and len(heldout_problems(w, d.split_seed, d.heldout_frac)[0]) == 0:
                raise ConfigError(f"data.eval_widths: width {w} has no held-out problem with data.split_seed="
                                  f"{d.split_seed} and data.heldout_frac={d.heldout_frac}; drop the width, or "
                                  f"change data.split_seed or raise data.heldout_frac.")
    _choice("data.width_sampling", d.width_sampling, ("uniform", "token_balanced"))
    _int_at_least("data.curriculum_steps", d.curriculum_steps, 0, " (0 = no width curriculum)")
    if d.kind == "addition" and d.curriculum_steps:
        _need(d.pack, "data.curriculum_steps", d.curriculum_steps, "needs packed rows: add --set data.pack=true.")
        _need(_is_int(d.curriculum_start_width) and d.train_min_width <= d.curriculum_start_width <= d.train_max_width,
              "data.curriculum_start_width", d.curriculum_start_width,
              f"must lie in [data.train_min_width, data.train_max_width] = [{d.train_min_width}, {d.train_max_width}].")
    if d.kind == "addition" and d.pack:
        need = 3 * d.train_max_width + 4  # one problem of the widest width (its last token is only a target)
        _need(_is_int(d.seq_len) and d.seq_len >= need, "data.seq_len", d.seq_len,
              f"must be >= {need} for packed addition rows: one problem of data.train_max_width="
              f"{d.train_max_width} has {need + 1} tokens.")
    _need(isinstance(d.paths, (list, tuple)) and all(isinstance(p, str) and p for p in d.paths),
          "data.paths", d.paths, "must be a list of files, directories or glob patterns.")
    _need(d.kind != "text" or len(d.paths) > 0, "data.paths", d.paths, "is empty: data.kind='text' needs "
          "local text files, e.g. --set 'data.paths=[\"corpus/*.jsonl\"]' (a single string is one path).")
    _int_at_least("data.seq_len", d.seq_len, 2)
    _choice("data.tokenizer", d.tokenizer, ("byte", "bpe"))
    if d.tokenizer == "bpe":
        _int_at_least("data.bpe_vocab_size", d.bpe_vocab_size, 260, " (the 256 byte tokens and a few merges)")
    _need(_is_num(d.val_frac) and 0 <= d.val_frac < 1, "data.val_frac", d.val_frac, "must be in [0, 1).")
    _int_at_least("data.val_batches", d.val_batches, 0)
    _need(isinstance(d.text_key, str) and d.text_key != "", "data.text_key", d.text_key, "must be a field name.")
    _need(isinstance(d.cache_dir, str) and d.cache_dir != "", "data.cache_dir", d.cache_dir,
          "must be a directory path.")
    try:
        cfg.lm_config(vocab_size=16)  # the model fields, with LMConfig's own messages
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    return cfg


# model fields that choose how the same function is computed, not which function: a resumed run may change them
IMPLEMENTATION_FIELDS = ("form", "chunk_size", "impl", "attn_impl", "dtype", "remat")


def resume_mismatch(saved: dict, cfg: TrainConfig) -> list[str]:
    """What makes ``cfg`` another model than the run whose config (``config.json``) is ``saved``: one
    ``"key: <there> in the run, <here> here"`` per differing :class:`LMConfig` field (the fields of
    :data:`IMPLEMENTATION_FIELDS` may change) and data field that fixes the vocabulary.  ConfigError if
    ``saved`` is not a config."""
    before = TrainConfig.from_dict(saved)
    old, new = dataclasses.asdict(before.lm_config(vocab_size=16)), dataclasses.asdict(cfg.lm_config(vocab_size=16))
    out = [f"model.{k}: {old[k]!r} in the run, {new[k]!r} here" for k in old
           if k not in IMPLEMENTATION_FIELDS and old[k] != new[k]]
    vocab = ["kind", "tokenizer"] + (["bpe_vocab_size"] if cfg.data.tokenizer == "bpe" else [])
    out += [f"data.{k}: {getattr(before.data, k)!r} in the run, {getattr(cfg.data, k)!r} here" for k in vocab
            if getattr(before.data, k) != getattr(cfg.data, k)]
    return out


# the data settings that choose the held-out problems (addition: every evaluation draws from them) or the documents and
# their validation share (text): changed on --resume, the evaluations from there on would include what the run trained on
SPLIT_KEYS = {"addition": ("split_seed", "heldout_frac"), "text": ("val_frac", "text_key")}


def split_mismatch(saved: dict, cfg: TrainConfig) -> list[str]:
    """The settings of :data:`SPLIT_KEYS` that differ between the run's ``saved`` config and ``cfg``, as
    ``"data.key: <there> in the run, <here> here"`` (none when the data kinds differ: :func:`resume_mismatch` names
    that).  ConfigError if ``saved`` is not a config."""
    before = TrainConfig.from_dict(saved)
    if before.data.kind != cfg.data.kind:
        return []
    return [f"data.{k}: {getattr(before.data, k)!r} in the run, {getattr(cfg.data, k)!r} here"
            for k in SPLIT_KEYS.get(cfg.data.kind, ()) if getattr(before.data, k) != getattr(cfg.data, k)]


def split_error(where: str, differences: list[str], saved: dict) -> str:
    """The message that refuses a --resume whose ``differences`` (:func:`split_mismatch`) change the evaluation split;
    ``where``: the run or checkpoint compared with, ``saved`` its config (for the values to resume with)."""
    before = TrainConfig.from_dict(saved).data
    values = [getattr(before, d.split(":")[0].split(".", 1)[1]) for d in differences]
    fix = " ".join(f"--set {d.split(':')[0]}={v if isinstance(v, str) else json.dumps(v)}"
                   for d, v in zip(differences, values))
    return (f"--resume: {where} split its data with other settings than this command's ({'; '.join(differences)}): "
            f"the held-out problems or validation documents would change, and the evaluations from here on would "
            f"include data the run has trained on. Resume with the run's settings ({fix}, or leave these keys "
            f"unset), or train with the new split in another --run-dir. Nothing was changed.")


# what draws the batches: a change on --resume makes the batches from there on differ from an uninterrupted run's
DATA_STREAM_KEYS = ("train.batch_size", "train.seed")


def settings_changed(saved: dict, cfg: TrainConfig) -> tuple[list[str], bool]:
    """The settings of ``cfg`` that differ from the run's ``saved`` config (a checkpoint's): ``"key: old -> new"``
    for each (``train.run_dir`` aside: a moved run is the same run), and whether any of them changes the batches
    (a ``data.*`` key or one of :data:`DATA_STREAM_KEYS`)."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out
    old, new = flat(saved), flat(json.loads(json.dumps(cfg.to_dict())))  # as saved: tuples become lists
    keys = [k for k in new if k != "train.run_dir" and k in old and old[k] != new[k]]
    stream = any(k.startswith("data.") or k in DATA_STREAM_KEYS for k in keys)
    return [f"{k} {old[k]!r} -> {new[k]!r}" for k in keys], stream


def build_config(preset: str | None = None, config_file: str | None = None, model: str | None = None,
                 overrides: list[str] = (), saved: dict | None = None) -> TrainConfig:
    """Assemble a config from its sources (see the module docstring) and check every value (:func:`validate`).
    ``saved``: a config as a dict (a checkpoint's), in place of a file."""
    cfg = TrainConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}."
                              + _suggest(preset, PRESETS))
        apply_dict(cfg, json.loads(json.dumps(PRESETS[preset])))
    if config_file is not None:
        apply_dict(cfg, load_file(config_file))
    if saved is not None:
        apply_dict(cfg, json.loads(json.dumps(saved)))
    if model is not None:
        set_key(cfg, "model.mixer", model)
    for o in overrides:
        set_key(cfg, *parse_override(o))
    return validate(cfg)
