"""The training loop: build, (re)start from a checkpoint, train, evaluate, report.

One optimizer step (``train_step``, jit-compiled, params and optimizer state donated)::

    batch [A, B/A, T]  --lax.scan over the A micro-batches-->  Σ grad(Σ nll), Σ count
    grads = Σ grad / Σ count            (= the gradient of the token-mean loss of the whole batch)
    params, opt_state <- AdamW(clip(grads))

Params are stored in ``param_dtype`` (fp32 master copy); the model computes in ``dtype``
(bf16 on GPU presets), so the casts happen inside the layers.  Batches come from
:mod:`falcon_jax.train.loader` (Grain by default), whose state is saved with every checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from falcon_jax.nn import FalconLM, param_counts, state_shardings
from falcon_jax.sharding import kernel_sharding
from falcon_jax.train import evaluate as ev
from falcon_jax.train.addition import ADDITION_VOCAB_SIZE, AdditionData
from falcon_jax.train.checkpoint import Checkpointer
from falcon_jax.train.config import (ConfigError, TrainConfig, resume_mismatch, settings_changed, split_error,
                                     split_mismatch, validate)
from falcon_jax.train.loader import make_loader
from falcon_jax.train.memory import EVALUATION, GREEDY, TRAIN_STEP, VALIDATION, explain, is_out_of_memory
from falcon_jax.train.mesh import (BATCH_AXES, SEQ_AXIS, batch_shards, check_batch, check_sequence, host_shard,
                                   make_mesh, maybe_initialize_distributed, put_batch, replicate)
from falcon_jax.train.optim import make_optimizer
from falcon_jax.train.preemption import Interrupted, StopRequest
from falcon_jax.train.report import finish, percent, start_lines, widths_with_fewer_problems
from falcon_jax.train.rundir import (CONFIG, RESUME, WIDTH_SHARES, Logger, RunDirError,  # noqa: F401 - re-exported
                                     check_can_start, check_checkpoint_folder, check_writable, checkpoint_steps,
                                     hold_run_lock, metric_records, read_metrics, release_run_lock, write_atomic)
from falcon_jax.train.text import CACHE_FORMAT, ONE_DOCUMENT, TextData


def build_data(cfg: TrainConfig):
    """The dataset of ``cfg.data``; ConfigError (exit code 2) when the data cannot serve the config."""
    try:
        return _build_data(cfg)
    except (ValueError, KeyError) as e:
        raise ConfigError(str(e).strip("'\"")) from None


def _build_data(cfg: TrainConfig):
    d = cfg.data
    if d.kind == "addition":
        return AdditionData(seed=d.seed, train_min_width=d.train_min_width, train_max_width=d.train_max_width,
                            eval_widths=tuple(d.eval_widths), eval_examples=d.eval_examples,
                            heldout_frac=d.heldout_frac, split_seed=d.split_seed, pack=d.pack,
                            pack_len=d.seq_len, width_sampling=d.width_sampling,
                            curriculum_rows=d.curriculum_steps * cfg.train.batch_size if d.pack else 0,
                            curriculum_start_width=d.curriculum_start_width)
    if d.kind == "text":
        if not d.paths:
            raise ValueError("data.paths is empty: give local text files, e.g. "
                             "--set 'data.paths=[\"corpus/*.jsonl\"]'.")
        data = TextData(paths=tuple(d.paths), seq_len=d.seq_len + 1, seed=d.seed, tokenizer=d.tokenizer,
                        bpe_vocab_size=d.bpe_vocab_size, val_frac=d.val_frac, text_key=d.text_key,
                        cache_dir=d.cache_dir)
        if d.val_batches > 0 and data.num_val_windows == 0:  # every evaluation would record no loss
            n_val, n_docs = len(data.splits["val"][0]), len(np.unique(data.splits["val"][1]))
            if n_docs == 0 and len(np.unique(data.splits["train"][1])) == 1:
                raise ValueError(f"data: the corpus {list(d.paths)} is one document, and the training / validation "
                                 f"split (data.val_frac={d.val_frac}) gave it to training: {ONE_DOCUMENT} set "
                                 "data.val_batches=0 to train without validation.")
            raise ValueError(f"data: the validation split has {n_val} tokens ({n_docs} documents), fewer than one "
                             f"window of data.seq_len + 1 = {data.seq_len}; raise data.val_frac, add documents, "
                             "lower data.seq_len, or set data.val_batches=0 to train without validation.")
        return data
    raise ValueError(f"data.kind={d.kind!r}: use 'addition' or 'text'.")


def make_train_step(graphdef, tx, shardings=None):
    """The jitted step ``(params, rest, opt_state, batch) -> (params, opt_state, metrics)``.

    ``batch``: ``tokens``, ``loss_mask`` and optionally ``segment_ids``, each ``[A, B/A, T]``
    (without ``segment_ids`` every row is one sequence).

    ``shardings``: optional ``(params, opt_state)`` sharding pytrees; pinning the outputs to
    the input shardings keeps every call on the one compiled program (otherwise the first
    call's outputs may come back with an equivalent but differently spelled sharding and
    trigger a second compilation)."""

    def step(params, rest, opt_state, batch):
        def micro(carry, mb):
            g_acc, s_acc, n_acc = carry

            def f(p):
                return ev.loss_terms(nnx.merge(graphdef, p, rest), mb["tokens"], mb.get("segment_ids"),
                                     mb["loss_mask"])

            (s, n), g = jax.value_and_grad(f, has_aux=True)(params)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_acc, g)
            return (g_acc, s_acc + s, n_acc + n), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        (g, s, n), _ = jax.lax.scan(micro, init, batch)
        n = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda a, p: (a / n).astype(p.dtype), g, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
        gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(grads)))
        return params, opt_state, {"loss": s / n, "grad_norm": gnorm, "tokens": n}

    if shardings is None:
        return jax.jit(step, donate_argnums=(0, 2))
    return jax.jit(step, donate_argnums=(0, 2), out_shardings=(shardings[0], shardings[1], None))


def place_like_params(opt_state, params, mesh):
    """Put every optimizer-state leaf on the sharding of the parameter it belongs to (AdamW's
    mu/nu mirror the params; matched by key path suffix), scalars replicated.  Without this
    the state leaves start uncommitted and the train step would compile a second time."""
    by_path = {jax.tree_util.keystr(p): (x.shape, x.sharding) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    repl = NamedSharding(mesh, PartitionSpec())

    def one(path, x):
        key = jax.tree_util.keystr(path)
        for pk, (shape, sh) in by_path.items():
            if key.endswith(pk) and tuple(x.shape) == tuple(shape):
                return jax.device_put(x, sh)
        return jax.device_put(x, repl)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def peak_device_memory() -> int | None:
    """The largest ``peak_bytes_in_use`` over this process's devices (None where the backend
    keeps no allocator statistics, e.g. CPU)."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without allocator statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def device_memory_limit(devices) -> int | None:
    """The smallest ``bytes_limit`` (the memory JAX may use) over ``devices``; None where the backend
    reports none (CPU)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without allocator statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def run(cfg: TrainConfig, *, resume: bool = False, resume_or_start: bool = False, log=None,
        standalone: bool = False) -> dict:
    """Train with ``cfg``; returns a summary dict (final metrics and the last evaluation).

    ``resume``: continue from the latest good checkpoint, RunDirError if there is none;
    ``resume_or_start``: the same, but start from step 0 when there is none.  SIGINT / SIGTERM stop the
    run after the current step with a checkpoint of it: :class:`~falcon_jax.train.preemption.Interrupted`.
    ``standalone``: this process ends when ``run`` raises (the command line; see ``Checkpointer``).
    ``train.time_limit_s > 0``: before that many seconds from this call, the run saves a checkpoint and
    returns with ``summary["stopped"] == "time_limit"`` (the command line exits 0); ``--resume`` continues
    it with the same batches as an uninterrupted run.
    A train step or evaluation that runs out of device memory raises
    :class:`~falcon_jax.train.memory.DeviceMemoryError` (the JAX error chained), naming the batch and the fixes;
    the steps before it keep their records and checkpoints, and nothing is saved from the failed state.  A step
    whose loss or gradient norm is not finite stops the run at the next log point or save, before anything is
    saved from it: :class:`TrainingDiverged`."""
    run_dir = getattr(getattr(cfg, "train", None), "run_dir", None)
    try:
        return _run(cfg, resume=resume, resume_or_start=resume_or_start, log=log, standalone=standalone)
    finally:
        if isinstance(run_dir, str):
            release_run_lock(run_dir)


def _run(cfg: TrainConfig, *, resume: bool, resume_or_start: bool, log, standalone: bool) -> dict:
    """:func:`run` while this process holds the run folder's lock (taken once the folder exists)."""
    t_begin = time.perf_counter()
    validate(cfg)
    resume = resume or resume_or_start
    run_dir = cfg.train.run_dir
    # before any model or data work: refuse to overwrite another run, or to resume nothing
    if resume and not cfg.checkpoint.enabled:
        raise ConfigError("--resume needs checkpoints: checkpoint.enabled is false.")
    check_can_start(run_dir, resume, must_exist=not resume_or_start)
    if resume:
        check_same_model(run_dir, cfg)
    maybe_initialize_distributed(cfg.mesh.distributed)
    is_main = jax.process_index() == 0
    check_writable(run_dir)
    if is_main:
        hold_run_lock(run_dir)  # before anything is written: a second process in the folder is refused
    if cfg.checkpoint.enabled:
        check_checkpoint_folder(run_dir)
    logger = Logger(run_dir, is_main)
    say = log or logger.print
    for line in start_lines(cfg):
        say(line)

    mesh = make_mesh(cfg.mesh)
    micro = check_batch(mesh, cfg.train.batch_size, cfg.train.grad_accum)
    model_fields = cfg.lm_config(vocab_size=16)  # the layers' windows (the vocabulary comes with the data)
    windows = [model_fields.window for spec in model_fields.layer_specs() if spec.variant in ("3", "3A")]
    check_sequence(mesh, cfg.data.seq_len if cfg.data.kind == "text" else None, max(windows, default=1))
    data = build_data(cfg)
    shard = host_shard(mesh, cfg.train.batch_size, cfg.train.grad_accum) if cfg.data.loader == "grain" else (0, 1)
    loader = make_loader(cfg.data.loader, data, cfg.train.batch_size, shard=shard,
                         threads=cfg.data.grain_threads, prefetch=cfg.data.grain_prefetch)
    vocab = ADDITION_VOCAB_SIZE if cfg.data.kind == "addition" else data.vocab_size
    if cfg.data.kind == "text" and "vocab_size" not in cfg.model:
        vocab = 64 * math.ceil(vocab / 64)  # a multiple of 64 keeps the unembedding matmul aligned
    lm_cfg = cfg.lm_config(vocab_size=vocab)
    if lm_cfg.vocab_size < vocab:
        raise ConfigError(f"model.vocab_size={lm_cfg.vocab_size} is smaller than the tokenizer's {vocab}.")

    # ---- model and optimizer, initialised directly on their shards
    rngs_seed = cfg.train.seed
    abstract = nnx.eval_shape(lambda: FalconLM(lm_cfg, rngs=nnx.Rngs(rngs_seed)))
    graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
    p_shard = state_shardings(abs_params, mesh)
    r_shard = state_shardings(abs_rest, mesh)

    def init_fn():
        _, p, r = nnx.split(FalconLM(lm_cfg, rngs=nnx.Rngs(rngs_seed)), nnx.Param, ...)
        return p, r

    if cfg.train.init == "jit":
        params, rest = jax.jit(init_fn, out_shardings=(p_shard, r_shard))()
    elif cfg.train.init == "eager":
        params, rest = jax.device_put(init_fn(), (p_shard, r_shard))
    else:
        raise ConfigError(f"train.init={cfg.train.init!r}: use 'eager' (build, then place on the shards) or "
                          f"'jit' (build on the shards; for models larger than one device).")
    tx, sched = make_optimizer(cfg.optim, cfg.train.steps, params)
    opt_state = place_like_params(jax.jit(tx.init)(params), params, mesh)
    # step and RNG key replicated over the mesh: orbax cannot save process-local arrays on several hosts
    rng = replicate(np.asarray(jax.random.key_data(jax.random.key(cfg.train.seed))), mesh)
    state = {"params": params, "opt_state": opt_state, "step": replicate(np.zeros((), np.int32), mesh), "rng": rng}

    # ---- checkpoints (an existing run without --resume was refused at the start)
    ckpt = None
    start = 0
    if cfg.checkpoint.enabled:
        ckpt = Checkpointer(run_dir, every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save, log=say, is_main=is_main, standalone=standalone)
        if resume:
            abs_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            try:
                got = ckpt.restore_latest(abs_state)
            except RunDirError:
                ckpt.close()
                loader.close()
                raise
            if got is None and not resume_or_start:
                ckpt.close()
                loader.close()
                raise RunDirError(f"--resume: no usable checkpoint in {ckpt.dir} (the broken ones are in "
                                  f"{ckpt.corrupt_dir}); pass --resume-or-start to start from step 0 instead.")
            if got is None:
                say(f"[resume] no usable checkpoint in {ckpt.dir}; starting from step 0 (--resume-or-start).")
            else:
                step0, state, meta = got
                start = int(meta["data"]["step"])
                if start != step0:  # a step folder renamed or copied under another number
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"--resume: checkpoint folder {os.path.join(ckpt.dir, str(step0))} holds the "
                                      f"state of step {start} (its data position), not of step {step0}: was it "
                                      f"renamed or copied from another step? Give it back its name "
                                      f"({start}), or move it out of {ckpt.dir}. Nothing was moved.")
                differences = saved_mismatch(meta, cfg)
                if differences:  # a model with the same parameter shapes restores without an error
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"--resume: checkpoint {step0} in {ckpt.dir} was saved from another model than "
                                      f"this command's ({'; '.join(differences)}). Resume with the run's model, or "
                                      f"train the new model in another --run-dir. Nothing was moved.")
                other_split = saved_mismatch(meta, cfg, split_mismatch)
                if other_split:  # the evaluations from here on would draw on problems or documents trained on
                    ckpt.close()
                    loader.close()
                    raise RunDirError(split_error(f"checkpoint {step0} in {ckpt.dir}", other_split, meta["config"]))
                saved_tok, tok = meta.get("tokenizer"), getattr(getattr(data, "tok", None), "fingerprint", None)
                if saved_tok is not None and saved_tok != tok:  # a BPE trained on a corpus that changed since
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"--resume: checkpoint {step0} in {ckpt.dir} was trained with another tokenizer "
                                      f"than data.paths gives now ({saved_tok} in the run, {tok} here): the corpus "
                                      f"changed since, and the same token ids would stand for other tokens. Resume "
                                      f"with the run's files as they were, or train on the new corpus in another "
                                      f"--run-dir. Nothing was moved.")
                saved_corpus = meta.get("corpus")  # absent in checkpoints of runs before it was recorded
                if saved_corpus is not None and saved_corpus != getattr(data, "corpus", None):
                    # relative data.paths read from another directory, or files edited since: the batches from the
                    # saved loader position and the validation split would be another text's
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"--resume: checkpoint {step0} in {ckpt.dir} was trained on other text than "
                                      f"data.paths={cfg.data.paths} reads now from {os.getcwd()} (the files' "
                                      f"contents differ: corpus {saved_corpus} in the run, {data.corpus} here). "
                                      f"Resume from the directory the run started in (relative paths) with the "
                                      f"files as they were, or train on the new text in another --run-dir. "
                                      f"Nothing was moved.")
                if start > cfg.train.steps:  # no step would run, and the final evaluation would be mislabelled
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"--resume: the latest checkpoint in {ckpt.dir} is step {start}, past "
                                      f"train.steps={cfg.train.steps}; the run has trained beyond the end asked for. "
                                      f"Continue it with --set train.steps={start} or more (train.steps={start} "
                                      f"evaluates it again), or train the shorter run in another --run-dir. Nothing "
                                      f"was changed.")
                saved = meta["data"].get("loader", "builtin")  # checkpoints before Grain: builtin
                if saved != loader.kind:
                    ckpt.close()
                    loader.close()
                    raise RunDirError(f"checkpoint {step0} in {ckpt.dir} was written with data.loader={saved!r} "
                                      f"but this run uses data.loader={loader.kind!r} (the two draw different "
                                      f"batches); resume with --set data.loader={saved}.")
                loader.set_state(meta["data"].get("state", {"step": start}))
                say(f"[resume] restored step {step0} from {ckpt.dir}.")
                if cfg.data.kind == "text":
                    note = text_format_note(meta.get("text_format"), data.empty_rows)
                    if note:
                        say(f"[resume] checkpoint {step0} {note}")
                if isinstance(meta.get("config"), dict):
                    changed, stream = settings_changed(meta["config"], cfg)
                    if changed:
                        say(f"[resume] settings changed since checkpoint {step0}: {', '.join(changed)}"
                            + ("; the batches from here on differ from an uninterrupted run's" if stream else ""))
    # the run's files change only once the run is accepted: a refused --resume leaves the run as it was
    if is_main:  # a kill mid-write leaves the previous config.json
        write_atomic(os.path.join(run_dir, CONFIG), json.dumps(cfg.to_dict(), indent=2))
        if cfg.data.kind == "addition":
            write_width_shares(data, run_dir, say, run_rows=cfg.train.steps * cfg.train.batch_size)
    if resume:  # the records of steps after `start` that are in metrics.jsonl are of steps trained again from here
        logger.write({"kind": RESUME, "step": start})

    counts = param_counts(abstract)
    say(f"model {lm_cfg.mixer} ({counts['total'] / 1e6:.3f}M params, D={lm_cfg.d_model}, L={lm_cfg.n_layers}, "
        f"compute {lm_cfg.dtype}, params {lm_cfg.param_dtype}) | mesh {dict(mesh.shape)} on "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s) | batch {cfg.train.batch_size} "
        f"(micro {micro} x {cfg.train.grad_accum}) | loader {loader.kind}"
        + (f" (this host: rows slice {shard[0] + 1} of {shard[1]})" if shard[1] > 1 else "")
        + f" | steps {cfg.train.steps}")

    params, opt_state = state["params"], state["opt_state"]
    step_fn = make_train_step(graphdef, tx, (jax.tree.map(lambda x: x.sharding, params),
                                             jax.tree.map(lambda x: x.sharding, opt_state)))
    pending: list[tuple[int, dict]] = []
    last_train: dict = {}

    non_finite = None  # (step, loss, grad_norm) of the first step whose loss or gradient norm is not finite

    def flush(t_elapsed, n_steps_timed, tokens_timed):
        nonlocal last_train, non_finite
        while pending:  # a step leaves the list once its record is written: a failed one stays first
            s, m = pending[0]
            m = jax.device_get(m)
            last_train = {"kind": "train", "step": s, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                          "lr": float(sched(s - 1))}
            logger.write(last_train)
            pending.pop(0)
            if non_finite is None and not (math.isfinite(last_train["loss"]) and math.isfinite(last_train["grad_norm"])):
                non_finite = (s, last_train["loss"], last_train["grad_norm"])

    running = {"program": TRAIN_STEP}  # what a device out-of-memory error is reported against

    def memory_error(err, program, at):
        return explain(err, cfg, program=program, step=at, row_tokens=data.seq_len - 1, mesh_shape=dict(mesh.shape),
                       shards=batch_shards(mesh), platform=jax.devices()[0].platform,
                       limit_bytes=device_memory_limit(mesh.local_devices), checkpoints=checkpoint_steps(run_dir),
                       env=os.environ)

    def meta(step):
        # the loader has handed out exactly `step` batches: its state is the one to resume from
        out = {"data": {"step": step, "loader": loader.kind, "state": loader.get_state()}, "config": cfg.to_dict()}
        if cfg.data.kind == "text":
            out["tokenizer"] = data.tok.fingerprint
            out["corpus"] = data.corpus
            out["text_format"] = CACHE_FORMAT
        return out

    earlier_evals = metric_records(run_dir, "eval")  # a resumed run's, read once
    in_dist = cfg.data.in_dist_widths()
    best = best_in_dist(earlier_evals, in_dist)  # the checkpoint choice so far, kept up to date by do_eval
    if cfg.data.kind == "addition" and best_in_dist(earlier_evals) != best:
        say(f"[resume] the earlier evaluations on other in-distribution widths than {compact_widths(in_dist)} are "
            f"left out of the checkpoint choice (their means are of other widths)")

    def do_eval(step, final=False):
        nonlocal best
        running["program"] = EVALUATION if cfg.data.kind == "addition" else VALIDATION
        model_state = nnx.merge(graphdef, params, rest)
        gd, st = nnx.split(model_state)
        rec = {"kind": "eval", "step": step}
        put = lambda x: replicate(x, mesh)  # noqa: E731
        if cfg.data.kind == "addition":
            acc = ev.addition_accuracy(gd, st, data, cfg.data.eval_widths, put=put)
            rec["teacher_forced"] = {str(k): v for k, v in acc.items()}
            rec["in_dist_widths"] = in_dist
            for metric in ("exact", "digit"):
                ind = [v[metric] for k, v in acc.items() if k in in_dist]
                ood = [v[metric] for k, v in acc.items() if k not in in_dist]
                rec[f"in_dist_{metric}"] = float(np.mean(ind)) if ind else None
                rec[f"heldout_width_{metric}"] = float(np.mean(ood)) if ood else None
            best = rec["best_in_dist"] = best_in_dist([rec] + ([best] if best else []), in_dist)
            say(f"[eval step {step}] teacher-forced exact (per digit): in-distribution widths "
                f"{percent(rec['in_dist_exact'])} ({percent(rec['in_dist_digit'])}), longer-than-trained widths "
                f"{percent(rec['heldout_width_exact'])} ({percent(rec['heldout_width_digit'])}); best in-distribution "
                f"so far: " + (f"step {best['step']}" if best else "n/a (no eval width <= data.train_max_width)"))
            say("  exact by width: " + " ".join(f"{k}:{100 * v['exact']:.0f}" for k, v in acc.items()))
            few = widths_with_fewer_problems(acc, cfg.data.eval_examples)
            if few:
                say(f"  widths with fewer than data.eval_examples={cfg.data.eval_examples} held-out problems, evaluated "
                    f"on all of them: {', '.join(few)}")
            if final:  # the teacher-forced record first: a command cut during decoding keeps it
                logger.write(rec)
                running["program"] = GREEDY
                t_greedy = time.perf_counter()
                gw = cfg.data.greedy_widths if cfg.data.greedy_widths is not None else cfg.data.eval_widths
                greedy = ev.addition_greedy(model_state, data, gw, cfg.data.greedy_examples)
                rec = {**rec, "greedy": {str(k): v for k, v in greedy.items()},
                       "greedy_s": time.perf_counter() - t_greedy}
                say("  free-running greedy exact by width: " + " ".join(f"{k}:{100 * v:.0f}" for k, v in greedy.items()))
        else:
            rec.update(ev.lm_validation(gd, st, data.val_batches(micro, cfg.data.val_batches), put=put))
            if "val_loss" in rec:
                say(f"[eval step {step}] val loss {rec['val_loss']:.4f}  ppl {rec['val_ppl']:.2f}")
        logger.write(rec)
        running["program"] = TRAIN_STEP
        return rec

    if cfg.train.eval_every and start % cfg.train.eval_every == 0 \
            and 0 < start < cfg.train.steps and not any(r.get("step") == start for r in earlier_evals):
        try:
            do_eval(start)  # a run stopped at an evaluation step before evaluating it
        except jax.errors.JaxRuntimeError as err:
            if not is_out_of_memory(err):
                raise
            loader.close()
            if ckpt is not None:
                ckpt.close()
            raise memory_error(err, running["program"], start) from err

    tokens_per_step = cfg.train.batch_size * (data.seq_len - 1)
    every = max(cfg.train.log_every, 1)
    n_devices = mesh.devices.size
    t_last, steps_since = time.perf_counter(), 0
    last_eval = None
    step = start
    # wall-clock budget (train.time_limit_s) and time-based checkpoints (checkpoint.every_s): each iteration
    # waits for the previous step (one step stays in flight, so the host prepares the next batch while the
    # device computes); the step time is the interval between completions; estimates start pessimistic
    limit, every_s = cfg.train.time_limit_s, cfg.checkpoint.every_s
    timed = limit > 0 or every_s > 0
    in_flight, t_done = None, None
    # measured seconds; until measured, 15 s a save, 30 s an evaluation, 60 s the final one's free-running decoding
    est = {"step": None, "save": None, "eval": None}
    t_saved = time.perf_counter()
    stopped = None
    # the step and evaluations are traced in this loop: in there the Pallas kernels run once per device shard, and
    # the recurrent layers split the sequence over mesh.seq
    sharded_kernels = kernel_sharding(mesh, BATCH_AXES, "tensor", seq_axis=SEQ_AXIS)
    sharded_kernels.__enter__()
    stop = StopRequest(multiprocess=jax.process_count() > 1).__enter__()
    out_of_memory = None
    try:
        for step in range(start + 1, cfg.train.steps + 1):
            batch = put_batch(next(loader), mesh, cfg.train.grad_accum, shard=loader.shard)
            params, opt_state, metrics = step_fn(params, rest, opt_state, batch)
            pending.append((step, metrics))
            out_of_time = False
            if timed:
                if in_flight is not None:
                    jax.block_until_ready(in_flight)
                now = time.perf_counter()
                if t_done is not None:  # the first interval holds the compilation: later ones replace it
                    est["step"] = now - t_done if step > start + 3 or est["step"] is None else min(est["step"], now - t_done)
                in_flight, t_done = metrics["loss"], now
                # stop when the next step, a save and an evaluation might not fit before the limit (before the
                # last step: the final evaluation, with its decoding)
                reserve = 2 * (est["step"] or 0.0) + (est["save"] or 15.0) + (est["eval"] or 30.0) + 5.0
                if step + 1 == cfg.train.steps and cfg.data.kind == "addition":
                    reserve += 60.0
                out_of_time = limit > 0 and step < cfg.train.steps and now - t_begin + reserve > limit
            steps_since += 1
            if cfg.train.step_sleep:
                time.sleep(cfg.train.step_sleep)
            first = step == start + 1  # reported at once: its time is mostly compilation
            stopping = stop.requested(step) and step < cfg.train.steps
            log_now = first or step % every == 0 or step == cfg.train.steps or stopping
            save_now = ckpt is not None and (ckpt.should_save(step) or step == cfg.train.steps or stopping
                                             or out_of_time or (every_s > 0 and time.perf_counter() - t_saved >= every_s))
            log_now = log_now or out_of_time
            if ckpt is not None:
                ckpt.poll()  # an asynchronous save that failed stops the run here
            if log_now or save_now or cfg.train.step_sleep:
                jax.block_until_ready(metrics["loss"])
                dt = time.perf_counter() - t_last
                flush(dt, steps_since, tokens_per_step * steps_since)
                if non_finite is not None:  # stop before a save: non-finite parameters never recover
                    raise _Diverged
                if first:
                    say(f"step {step:>6}/{cfg.train.steps} | loss {last_train['loss']:.4f} | "
                        f"gnorm {last_train['grad_norm']:.3f} | lr {last_train['lr']:.2e} | "
                        f"first step {dt:.1f}s (compilation included)"
                        + (f"; next line at step {min(cfg.train.steps, (step // every + 1) * every)}"
                           if step < cfg.train.steps else ""))
                    logger.write({"kind": "first_step", "step": step, "seconds": dt})
                    t_last, steps_since = time.perf_counter(), 0
                elif log_now:
                    tps = tokens_per_step * steps_since / max(dt, 1e-9)
                    eta = (cfg.train.steps - step) * dt / max(steps_since, 1)
                    peak = peak_device_memory()
                    say(f"step {step:>6}/{cfg.train.steps} | loss {last_train['loss']:.4f} | "
                        f"gnorm {last_train['grad_norm']:.3f} | lr {last_train['lr']:.2e} | "
                        f"{tps / 1e3:,.1f}k tok/s ({tps / n_devices / 1e3:,.1f}k/device) | "
                        + (f"peak {peak / 2**30:.2f} GiB/device | " if peak is not None else "")
                        + f"eta {eta:,.0f}s")
                    logger.write({"kind": "speed", "step": step, "tokens_per_s": tps, "s_per_step": dt / steps_since,
                                  "devices": n_devices, "tokens_per_s_per_device": tps / n_devices,
                                  "peak_bytes_per_device": peak})
                    t_last, steps_since = time.perf_counter(), 0
            if save_now:
                t_save = time.perf_counter()
                ckpt.save(step, {"params": params, "opt_state": opt_state,
                                 "step": replicate(np.asarray(step, np.int32), mesh), "rng": state["rng"]},
                          meta(step), force=step == cfg.train.steps or out_of_time)
                t_saved = time.perf_counter()
                est["save"] = t_saved - t_save
                t_done = None  # the next interval holds the save: not a step time
            if out_of_time:
                ckpt.wait()
                elapsed = time.perf_counter() - t_begin
                logger.write({"kind": "time_limit", "step": step, "elapsed_s": elapsed, "limit_s": limit})
                say(f"[time limit] train.time_limit_s={limit:g} s: stopped after step {step}/{cfg.train.steps} "
                    f"at {elapsed:.0f} s with a checkpoint of step {step}; continue with: "
                    f"falcon-train --run-dir {run_dir} --resume")
                stopped = "time_limit"
                break
            if stopping:
                if ckpt is not None:
                    ckpt.wait()
                raise Interrupted(stop.signum, step, saved=ckpt is not None, run_dir=run_dir)
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != cfg.train.steps:
                t_eval = time.perf_counter()
                last_eval = do_eval(step)
                t_last, steps_since = time.perf_counter(), 0
                est["eval"] = max(est["eval"] or 0.0, t_last - t_eval)
                t_done = None
        if pending:
            flush(0, 0, 0)
        if stopped is None and non_finite is None:
            if ckpt is not None:
                ckpt.wait()  # the last step's checkpoint is on disk before a signal may end the run
            stop.training_finished(cfg.train.steps, saved=ckpt is not None, run_dir=run_dir)
            last_eval = do_eval(cfg.train.steps, final=True) if cfg.train.steps > 0 else last_eval
    except _Diverged:
        pass  # reported below, once the checkpointer has closed
    except jax.errors.JaxRuntimeError as err:
        if not is_out_of_memory(err):
            raise
        # steps run asynchronously: a failed step's error may surface at a later step's wait or in an
        # evaluation that reads its params; the first pending step whose result cannot be read is the one
        program, at = running["program"], step
        try:
            flush(0, 0, 0)  # the steps that finished keep their records
        except jax.errors.JaxRuntimeError:
            program, at = TRAIN_STEP, pending[0][0]
        out_of_memory = (err, program, at)
    finally:
        stop.__exit__(None, None, None)
        sharded_kernels.__exit__(None, None, None)
        loader.close()
        if ckpt is not None:
            ckpt.close()
    if out_of_memory is not None:  # after the checkpointer closed: a save still in flight has finished
        err, program, at = out_of_memory
        raise memory_error(err, program, at) from err
    if non_finite is not None:
        raise diverged_error(cfg, *non_finite, checkpoints=checkpoint_steps(run_dir))

    summary = {"final_step": step, "final_loss": last_train.get("loss"), "eval": last_eval, "stopped": stopped}
    if is_main and stopped is None:
        finish(cfg, last_eval, say)
    return summary


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm of a step was not finite: the run stopped before saving (exit code 1).
    ``step``: the first such step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class _Diverged(Exception):
    """Leaves the training loop once a non-finite step is recorded (reported as :class:`TrainingDiverged`)."""


def diverged_error(cfg: TrainConfig, step: int, loss: float, grad_norm: float, checkpoints: list[int]) -> TrainingDiverged:
    """The message of a run whose ``step`` had a non-finite loss or gradient norm: what was kept and the fixes."""
    o, run_dir = cfg.optim, cfg.train.run_dir
    lower = f"--set optim.lr={o.lr / 2:g}"
    if checkpoints:
        kept = (f"the checkpoints (the latest: step {checkpoints[-1]}) in {run_dir} are kept; continue from it with a "
                f"fix, e.g. falcon-train --run-dir {run_dir} --resume {lower}")
    else:
        kept = (f"there is no checkpoint to continue from; start again with a fix, e.g. falcon-train --run-dir "
                f"{run_dir} --resume-or-start {lower}")
    dtype = str(cfg.model.get("dtype", "float32"))
    fixes = [f"a lower optim.lr (now {o.lr:g})", f"a longer optim.warmup_steps (now {o.warmup_steps})",
             f"gradient clipping (optim.clip_norm, now {o.clip_norm:g})"]
    if dtype != "float32":
        fixes.append(f"float32 compute (--set model.dtype=float32, now {dtype})")
    return TrainingDiverged(
        f"training diverged: the loss of step {step} is {loss:g} (grad_norm {grad_norm:g}). Nothing was saved from "
        f"step {step} on (its parameters are not finite); {kept}. Fixes: {', '.join(fixes)}.", step)


def check_same_model(run_dir: str, cfg: TrainConfig) -> None:
    """``--resume`` continues the run in ``run_dir`` only with its model: RunDirError naming every field that
    differs from the run's ``config.json`` (read from the file system, before any model or data work).  Without
    a readable ``config.json`` the restore itself refuses a checkpoint that does not fit."""
    path = os.path.join(run_dir, CONFIG)
    try:
        with open(path) as f:
            saved = json.load(f)
        differences = resume_mismatch(saved, cfg)
        other_split = split_mismatch(saved, cfg)
    except (OSError, ValueError, TypeError):
        return  # no config.json, or one cut by a kill: nothing to compare with
    if differences:
        raise RunDirError(f"--resume: {os.path.abspath(run_dir)} was trained with another model than this "
                          f"command's ({'; '.join(differences)}). Resume with the run's own config "
                          f"(falcon-train --run-dir {run_dir} --resume, without --preset, --config or --set for "
                          f"these keys), or train the new model in another --run-dir. Nothing was changed.")
    if other_split:
        raise RunDirError(split_error(f"the run in {os.path.abspath(run_dir)}", other_split, saved))


def saved_mismatch(meta: dict, cfg: TrainConfig, compare=resume_mismatch) -> list[str]:
    """``compare(saved, cfg)`` against the config a checkpoint was saved with (its ``meta["config"]``):
    :func:`~falcon_jax.train.config.resume_mismatch` (what makes ``cfg``'s model another) or
    :func:`~falcon_jax.train.config.split_mismatch` (the settings that split the data); nothing when the saved
    config is absent or unreadable (then only the restore's shapes are compared).  Covers runs whose
    ``config.json`` is gone or was edited."""
    saved = meta.get("config")
    if not isinstance(saved, dict):
        return []
    try:
        return compare(saved, cfg)
    except (ValueError, TypeError):  # ConfigError included: a config this version cannot read
        return []


def compact_widths(widths: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs = []
    for w in widths:
        if runs and w == runs[-1][1] + 1:
            runs[-1][1] = w
        else:
            runs.append([w, w])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


def text_format_note(saved: int | None, empty_rows: int) -> str | None:
    """Why a resumed text run's batches may differ from the ones it trained on: its text was turned into token
    streams another way (``CACHE_FORMAT``; ``saved`` None for checkpoints that do not record it).  Format 2 left
    rows of empty text out, so an unrecorded format matters only for a corpus with such rows."""
    if saved == CACHE_FORMAT or (saved is None and not empty_rows):
        return None
    rows = (f" ({empty_rows} rows of empty or whitespace text in this corpus, left out of the token streams)"
            if empty_rows else "")
    was = "does not record how its text became tokens" if saved is None else f"read its text in format {saved}"
    return (f"{was}; this version reads it in format {CACHE_FORMAT}{rows}, so the batches and validation windows "
            f"from here on may differ from the ones the run had.")


def best_in_dist(evals: list[dict], widths: list[int] | None = None) -> dict | None:
    """The evaluation with the best in-distribution exact match (the later one on a tie): the checkpoint
    choice, made without looking at the longer widths.  With ``widths``, only among the evaluations whose
    in-distribution means are over those widths (a resumed run may evaluate others; a record written before
    evaluations named their widths counts as theirs).  Returns its step and its summary numbers."""
    evals = [e for e in evals if e.get("in_dist_exact") is not None
             and (widths is None or e.get("in_dist_widths", widths) == widths)]
    if not evals:
        return None
    e = max(evals, key=lambda r: (r["in_dist_exact"], r["step"]))
    out = {k: e.get(k) for k in ("step", "in_dist_exact", "in_dist_digit", "heldout_width_exact",
                                 "heldout_width_digit")}
    return out | ({"in_dist_widths": e["in_dist_widths"]} if "in_dist_widths" in e else {})


def write_width_shares(data: AdditionData, run_dir: str, say, run_rows: int | None = None) -> dict:
    """Measure the training stream's share of problems and tokens per width (and of padding) over rows spread
    over the run's ``run_rows`` rows (the first rows when None), say it in one line and save it as
    ``<run_dir>/width_shares.json``."""
    shares = data.width_shares(rows=1024 if data.pack else 4096, span=run_rows)
    pad = shares.pop("padding")
    layout = (f"packed rows of {data.pack_len} tokens, widths {data.width_sampling} per problem" if data.pack
              else "one problem a row, widths uniform per row")
    if data.curriculum_rows:
        layout += (f", widest width growing from {data.curriculum_start_width} to {data.train_max_width} over the "
                   f"first {data.curriculum_rows} rows")
    say(f"[data] {layout}; token share per width (padding {100 * pad:.1f}%): "
        + " ".join(f"{n}:{100 * v['tokens']:.1f}%" for n, v in shares.items()))
    out = {"layout": layout, "padding": pad, "widths": {str(n): v for n, v in shares.items()}}
    write_atomic(os.path.join(run_dir, WIDTH_SHARES), json.dumps(out, indent=1))  # a kill leaves the previous file
    return out
