"""TPU kernels (Pallas, Mosaic TPU lowering) for decayed attention with scalar gates.

Same passes and signatures as :mod:`.triton` (so ``api.py`` drives either),
in the TPU idiom: the grid walks (batch·head, chunk) with the chunk axis
``"arbitrary"`` (sequential on a core) and the state carried across grid steps
in a VMEM scratch buffer, the pattern of the TPU flash-attention op.  Per-
position gates come as column ``[C, 1]`` and row ``[1, C]`` blocks so no
in-kernel transposes of vectors are needed.  There is no sequence split on
TPU (``pieces`` must be 1): batch·heads run in parallel across cores.

No TPU is lent to this project: these kernels are tested in TPU interpret
mode on CPU (``interpret=pltpu.InterpretParams()``, which also fills
unwritten output memory with NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NT = (((1,), (1,)), ((), ()))  # a @ b.T
TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _mm(a, b, dims=None):
    dims = dims or (((1,), (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _gates(g_col_ref, g_row_ref, rl_col_ref, rl_row_ref, chunk):
    g_col, g_row = g_col_ref[...], g_row_ref[...]  # [C,1], [1,C]
    rl_col, rl_row = rl_col_ref[...], rl_row_ref[...]
    g_last = g_row[:, chunk - 1:chunk]  # [1,1]
    rl_last = rl_row[:, chunk - 1:chunk]
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    mask = (rows >= cols) & (rl_col == rl_row)
    decay = jnp.exp(jnp.where(mask, g_col - g_row, -jnp.inf))  # [C, C]
    cont = jnp.where(rl_col == 0, jnp.exp(g_col), 0.0)  # [C,1]
    w_last = jnp.where(rl_col == rl_last, jnp.exp(g_last - g_col), 0.0)  # [C,1]
    a_last = jnp.where(rl_last == 0, jnp.exp(g_last), 0.0)  # [1,1]
    return decay, cont, w_last, a_last


def _layout(g, rl, chunk):
    BH, L = g.shape
    n = L // chunk
    g4, r4 = g.reshape(BH, n, chunk), rl.reshape(BH, n, chunk)
    return g4[..., :, None], g4[..., None, :], r4[..., :, None], r4[..., None, :]


def _gate_specs(chunk, index):
    col = pl.BlockSpec((None, None, chunk, 1), index)
    row = pl.BlockSpec((None, None, 1, chunk), index)
    return [col, row, col, row]


def _forward_kernel(q_ref, x_ref, y_ref, gc_ref, gr_ref, rc_ref, rr_ref, s0_ref, *refs, chunk, write_o,
                    write_h):
    refs = list(refs)
    o_ref = refs.pop(0) if write_o else None
    h_ref = refs.pop(0) if write_h else None
    s_end_ref, state = refs
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _():
        state[...] = s0_ref[...].astype(jnp.float32)

    S = state[...]
    if write_h:
        h_ref[...] = S
    decay, cont, w_last, a_last = _gates(gc_ref, gr_ref, rc_ref, rr_ref, chunk)
    x, y = x_ref[...], y_ref[...]
    if write_o:
        q = q_ref[...]
        scores = _mm(q, x, NT) * decay
        o = _mm(scores.astype(y.dtype), y) + cont * _mm(q, S.astype(q.dtype))
        o_ref[...] = o.astype(o_ref.dtype)
    S = a_last * S + _mm((x * w_last).astype(x.dtype), y, TN)
    state[...] = S

    @pl.when(c == pl.num_programs(1) - 1)
    def _():
        s_end_ref[...] = S


def forward_pass(q, x, y, g, rl, s0, *, chunk, pieces, block_v, write_o, write_h, interpret, num_warps=None,
                 num_stages=None):
    """See :func:`.triton.forward_pass` (``pieces`` must be 1; block_v is the whole dv)."""
    del block_v, num_warps, num_stages
    if pieces != 1:
        raise NotImplementedError("mosaic_tpu decayed_attention: no sequence split (pieces must be 1)")
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    at = lambda b, c: (b, c, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, chunk, dk), at), pl.BlockSpec((None, chunk, dk), at),
                pl.BlockSpec((None, chunk, dv), at), *_gate_specs(chunk, lambda b, c: (b, c, 0, 0)),
                pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, 0, 0, 0))]
    out_shape, out_specs = [], []
    if write_o:
        out_shape.append(jax.ShapeDtypeStruct((BH, L, dv), y.dtype))
        out_specs.append(pl.BlockSpec((None, chunk, dv), at))
    if write_h:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, c, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((BH, 1, dk, dv), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, 0, 0, 0)))
    kernel = functools.partial(_forward_kernel, chunk=chunk, write_o=write_o, write_h=write_h)
    return pl.pallas_call(
        kernel, grid=(BH, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret), name="falcon_decayed_attention_fwd_tpu",
    )(q, x, y, *_layout(g, rl, chunk), s0)


def _state_grad_kernel(q_ref, gc_ref, gr_ref, rc_ref, rr_ref, do_ref, ds_end_ref, *refs, chunk, write_dh):
    refs = list(refs)
    dh_ref = refs.pop(0) if write_dh else None
    ds_start_ref, dstate = refs
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dstate[...] = ds_end_ref[...].astype(jnp.float32)

    dS = dstate[...]
    if write_dh:
        dh_ref[...] = dS
    _, cont, _, a_last = _gates(gc_ref, gr_ref, rc_ref, rr_ref, chunk)
    q, do = q_ref[...], do_ref[...]
    dS = a_last * dS + _mm((q * cont).astype(do.dtype), do, TN)
    dstate[...] = dS

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        ds_start_ref[...] = dS


def state_grad_pass(q, g, rl, do, ds_end, *, chunk, pieces, block_v, write_dh, interpret, num_warps=None,
                    num_stages=None):
    """See :func:`.triton.state_grad_pass` (reverse walk: grid step i visits chunk n-1-i)."""
    del block_v, num_warps, num_stages
    if pieces != 1:
        raise NotImplementedError("mosaic_tpu decayed_attention: no sequence split (pieces must be 1)")
    BH, L, dk = q.shape
    dv = do.shape[-1]
    n = L // chunk
    rev = lambda b, i: (b, n - 1 - i, 0)  # noqa: E731
    in_specs = [pl.BlockSpec((None, chunk, dk), rev), *_gate_specs(chunk, lambda b, i: (b, n - 1 - i, 0, 0)),
                pl.BlockSpec((None, chunk, dv), rev), pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, 0, 0, 0))]
    out_shape, out_specs = [], []
    if write_dh:
        out_shape.append(jax.ShapeDtypeStruct((BH, n, dk, dv), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, n - 1 - i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((BH, 1, dk, dv), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, dk, dv), lambda b, i: (b, 0, 0, 0)))
    gc, gr, rc, rr = _layout(g, rl, chunk)
    kernel = functools.partial(_state_grad_kernel, chunk=chunk, write_dh=write_dh)
    return pl.pallas_call(
        kernel, grid=(BH, n), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((dk, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret), name="falcon_decayed_attention_dstate_tpu",
    )(q, gc, gr, rc, rr, do, ds_end)


def _chunk_grad_kernel(q_ref, x_ref, y_ref, gc_ref, gr_ref, rc_ref, rr_ref, do_ref, h_ref, dh_ref, dq_ref,
                       dx_ref, dy_ref, dg_ref, *, chunk):
    """See :func:`.triton._chunk_grad_kernel`; ``dg`` is written as a ``[C, 1]`` column."""
    q, x, y, do = q_ref[...], x_ref[...], y_ref[...], do_ref[...]
    h, dh = h_ref[...], dh_ref[...]
    decay, cont, w_last, a_last = _gates(gc_ref, gr_ref, rc_ref, rr_ref, chunk)
    scores = (_mm(q, x, NT) * decay).astype(q.dtype)
    dscores = (_mm(do, y, NT) * decay).astype(q.dtype)
    y_dh = _mm(y, dh.astype(y.dtype), NT)  # [C, dk]
    dq = _mm(dscores, x) + cont * _mm(do, h.astype(do.dtype), NT)
    dx = _mm(dscores, q, TN) + w_last * y_dh
    dy = _mm(scores, do, TN) + w_last * _mm(x, dh.astype(x.dtype))
    xf, qf = x.astype(jnp.float32), q.astype(jnp.float32)
    end_term = a_last * jnp.sum(h * dh) + jnp.sum(w_last * jnp.sum(xf * y_dh, axis=1, keepdims=True))
    last = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) == chunk - 1
    dg_ref[...] = (jnp.sum(qf * dq, axis=1, keepdims=True) - jnp.sum(xf * dx, axis=1, keepdims=True)
                   + jnp.where(last, end_term, 0.0))
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dy_ref[...] = dy.astype(dy_ref.dtype)


def chunk_grad_pass(q, x, y, g, rl, do, h, dh, *, chunk, block_v, interpret, num_warps=None, num_stages=None):
    """See :func:`.triton.chunk_grad_pass` (the GPU launch parameters have no TPU meaning: the
    kernel takes the whole value width at once)."""
    del block_v, num_warps, num_stages
    BH, L, dk = q.shape
    dv = y.shape[-1]
    n = L // chunk
    at = lambda b, c: (b, c, 0)  # noqa: E731
    row_k, row_v = pl.BlockSpec((None, chunk, dk), at), pl.BlockSpec((None, chunk, dv), at)
    state = pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, c, 0, 0))
    dg_spec = pl.BlockSpec((None, None, chunk, 1), lambda b, c: (b, c, 0, 0))
    dq, dx, dy, dg = pl.pallas_call(
        functools.partial(_chunk_grad_kernel, chunk=chunk), grid=(BH, n),
        in_specs=[row_k, row_k, row_v, *_gate_specs(chunk, lambda b, c: (b, c, 0, 0)), row_v, state, state],
        out_specs=[row_k, row_k, row_v, dg_spec],
        out_shape=[jax.ShapeDtypeStruct((BH, L, dk), q.dtype), jax.ShapeDtypeStruct((BH, L, dk), x.dtype),
                   jax.ShapeDtypeStruct((BH, L, dv), y.dtype), jax.ShapeDtypeStruct((BH, n, chunk, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(interpret), name="falcon_decayed_attention_chunk_grads_tpu",
    )(q, x, y, *_layout(g, rl, chunk), do, h, dh)
    return dq, dx, dy, dg.reshape(BH, L)


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False
