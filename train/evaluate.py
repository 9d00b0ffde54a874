"""Evaluation: addition accuracy per width (teacher-forced and free-running greedy), LM loss."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from falcon_jax.sharding import constrain_replicated
from falcon_jax.train.addition import DIGIT0, AdditionData, target_slice


def loss_terms(model, tokens, segment_ids, loss_mask):
    """Summed next-token NLL and the number of target positions, for ``[B, T]`` inputs.

    Position t predicts t+1; a pair is counted when its target has ``loss_mask`` true and it
    does not cross a ``segment_ids`` change (None: every row is one sequence, and the model runs
    without segments, e.g. cuDNN attention).  Returning (sum, count) instead of a mean lets
    gradient accumulation and multi-batch evaluation weight every token equally."""
    logits = model(tokens[:, :-1], segment_ids=None if segment_ids is None else segment_ids[:, :-1])
    logits = logits.astype(jnp.float32)
    tgt = tokens[:, 1:]
    mask = loss_mask[:, 1:]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, 1:] == segment_ids[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tgt[..., None], axis=-1)[..., 0]
    m = mask.astype(jnp.float32)
    return jnp.sum(nll * m), jnp.sum(m)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(graphdef, state, tokens):
    """Argmax next-token predictions ``[B, T-1]`` under teacher forcing."""
    model = nnx.merge(graphdef, state)
    # replicated: under a sharded mesh the rows would otherwise stay split over processes,
    # and every process reads all predictions back
    return constrain_replicated(jnp.argmax(model(tokens[:, :-1]), axis=-1).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _eval_loss(graphdef, state, tokens, segment_ids, loss_mask):
    return loss_terms(nnx.merge(graphdef, state), tokens, segment_ids, loss_mask)


def to_host(x) -> np.ndarray:
    """The whole of ``x`` as numpy on every process (arrays spanning other processes' devices
    are gathered; a fully replicated one is read from a local copy)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def addition_accuracy(graphdef, state, data: AdditionData, widths, *, put=lambda x: x) -> dict[int, dict]:
    """Teacher-forced accuracy per width: ``{n: {"exact": f, "digit": f, "problems": k}}``.

    ``exact``: fraction of problems whose whole (n+1)-digit target is predicted correctly when
    every earlier target digit is given; ``digit``: fraction of target digits correct; ``problems``: how many
    distinct problems the width's eval set holds (``eval_examples``, or all of a width's held-out problems where
    it has fewer).  All widths share one padded shape (rows repeated up to ``eval_examples``, not counted), so
    one compiled program serves every width."""
    out = {}
    for n in widths:
        ev = data.eval_set(n)
        k = len(ev["tokens"])
        rows = np.concatenate([ev["tokens"], np.repeat(ev["tokens"][:1], data.eval_examples - k, axis=0)])
        pred = to_host(_predict(graphdef, state, put(rows)))[:k]
        sl = target_slice(n)
        # the token at column j is predicted by the logits at column j - 1
        got = pred[:, sl.start - 1:sl.stop - 1]
        want = ev["tokens"][:, sl]
        ok = got == want
        out[int(n)] = {"exact": float(ok.all(axis=1).mean()), "digit": float(ok.mean()), "problems": k}
    return out


def addition_greedy(model, data: AdditionData, widths, examples: int) -> dict[int, float]:
    """Free-running greedy exact match per width through ``model.generate`` (prefill + O(1)
    decode steps): the model writes all n+1 sum digits itself.  Every width's prompts go into one
    call (right-padded, with their lengths), so one compiled program serves all widths."""
    widths = [int(n) for n in widths]
    if not widths:
        return {}
    rows, lengths, spans = [], [], []
    for n in widths:
        ev = data.eval_set(n)
        k = min(examples, len(ev["tokens"]))
        sl = target_slice(n)
        rows += list(ev["tokens"][:k, :sl.start])
        lengths += [sl.start] * k
        spans.append((n, len(rows) - k, k, ev["tokens"][:k, sl]))
    P = max(lengths)
    prompt = np.zeros((len(rows), P), np.int32)
    for i, r in enumerate(rows):
        prompt[i, :len(r)] = r
    gen = to_host(model.generate(jnp.asarray(prompt), max(widths) + 1, lengths=np.asarray(lengths, np.int32),
                                 greedy=True))
    out = {}
    for n, first, k, want in spans:
        start = target_slice(n).start  # row b's new tokens follow its own prompt (generate's right-padded layout)
        got = gen[first:first + k, start:start + n + 1]
        out[n] = float((got == want).all(axis=1).mean())
    return out


def lm_validation(graphdef, state, batches, *, put=lambda x: x) -> dict:
    """Token-weighted validation loss (nats) and perplexity over ``batches``."""
    tot, cnt = 0.0, 0.0
    for b in batches:
        s, c = _eval_loss(graphdef, state, put(b["tokens"]), put(b["segment_ids"]), put(b["loss_mask"]))
        tot += float(s)
        cnt += float(c)
    if cnt == 0:
        return {}
    loss = tot / cnt
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(cnt)}


def digits_of(ids) -> str:
    return "".join(str(int(i) - DIGIT0) if DIGIT0 <= int(i) < DIGIT0 + 10 else "?" for i in ids)
