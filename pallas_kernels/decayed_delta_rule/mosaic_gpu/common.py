"""What the Mosaic GPU kernels of ``decayed_delta_rule`` share: the chunk size and SMEM loads."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from jax.experimental import pallas as pl

from falcon_jax.kernels.common import plgpu

CHUNK = 64  # rows of a chunk: a wgmma's M
F32 = jnp.float32


def _load(ref, layout):
    """SMEM → registers in ``layout``: the whole ref (jax 0.11's ``plgpu.load`` indexes it whole by default; an
    explicit empty index there fails its layout inference, while jax 0.10's requires the index)."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _token_rows(ref, heads, b, h, start, cols=None):
    """A chunk's ``C`` token rows from ``start`` (optionally a column block ``cols``): ``[b, rows, h]`` in place
    (``heads`` set), ``[b·H + h, rows]`` head-major (``heads`` None: one head per grid row)."""
    span = pl.ds(pl.multiple_of(start, CHUNK), CHUNK)
    idx = (b, span, h) if heads is not None else (b + h, span)
    return ref.at[idx] if cols is None else ref.at[(*idx, cols)]


