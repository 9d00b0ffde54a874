"""The parallel per-chunk passes of the decayed delta rule as batched XLA matmuls.

``chunk_grads``: the same equations as ``pallas_gpu._chunk_grad_kernel`` (see there and
``pallas_gpu``'s module docstring), computed for every (batch·head, chunk) at once with ``einsum``
instead of one Triton program per chunk.  The Triton program holds ``[C, C]`` and five ``[C, dk]`` fp32 tiles per chunk
and was the largest pass of the backward on the H200 (≈4.3 of ≈9 ms at 8×2048×16×128, bf16);
here every intermediate is a batched ``[.., C, C]`` or ``[.., C, d]`` array in HBM, which XLA
runs as batched GEMMs (more memory traffic, no register spills).  Chosen by
``KernelConfig(chunk_grads="xla")``; any backend.

``outputs``: the forward's outputs from the chunk start states, so that the sequential walk only
carries the state (three dots per chunk instead of six) — the split fla and jax-linear-attention
make.  Chosen by ``KernelConfig(outputs="xla")``.

Precision follows the kernels: dots of the inputs in their dtype with fp32 accumulation; dots
with fp32 operands (states, ``T``, ``P``) at HIGHEST for fp32 inputs, the backend's default
(TF32 on Hopper) for bf16/fp16.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from falcon_jax.kernels.common import precision_for
from falcon_jax.kernels.decayed_delta_rule.pallas_gpu import _gates as _kernel_gates
from falcon_jax.kernels.decayed_delta_rule.pallas_gpu import _masks

F32 = jnp.float32


def _chunked(a, heads, chunk):
    """``[BH, L, d]`` (or ``[B, L, H, d]`` with ``heads=H``) → ``[BH, n, C, d]``."""
    if heads is not None:
        B, L, H, d = a.shape
        a = jnp.swapaxes(a, 1, 2).reshape(B * H, L, d)
    BH, L, d = a.shape
    return a.reshape(BH, L // chunk, chunk, d)


def _unchunked(a, heads, like):
    """Inverse of :func:`_chunked`, in the layout and dtype of ``like``."""
    BH, n, C, d = a.shape
    a = a.reshape(BH, n * C, d).astype(like.dtype)
    if heads is None:
        return a
    B = BH // heads
    return jnp.swapaxes(a.reshape(B, heads, n * C, d), 1, 2)


def _gates(g, gp, rl):
    """``pallas_gpu._gates`` for ``[BH, n, C]`` rows: (c, c⁻, w, a), a of shape ``[BH, n]``."""
    cont, cont_p, w_last, a_last = _kernel_gates(None, g, gp, rl, g[..., -1:], rl[..., -1:])
    return cont, cont_p, w_last, a_last[..., 0]


def _precisions(dtype):
    """(precision of dots of the inputs, precision of dots with fp32 operands), as the kernels use them."""
    prec_in = precision_for(dtype)
    return prec_in, (lax.Precision.HIGHEST if prec_in is not None else None)


def outputs(q, x, y, eta, g, gp, rl, tinv, h, *, chunk, heads=None):
    """Every chunk's outputs from its start state, in parallel (the forward walk then only carries the state):

        P = T (η ⊙ (Y − c⁻ ⊙ X h)),   o = c ⊙ Q h + (Q Xᵀ ⊙ D) P

    Shapes as :func:`chunk_grads`; h ``[BH, n, dk, dv]``.  Returns o in the layout and dtype of y."""
    prec_in, p32 = _precisions(q.dtype)

    def mm(spec, a, b, precision=p32):
        return jnp.einsum(spec, a, b, preferred_element_type=F32, precision=precision)

    qc, xc = _chunked(q, heads, chunk), _chunked(x, heads, chunk)
    yc = _chunked(y, heads, chunk).astype(F32)
    BH, n, C, _ = qc.shape
    eta, g, gp, rl = (a.reshape(BH, n, C) for a in (eta, g, gp, rl))
    h = h.astype(F32)
    cont, cont_p, _, _ = _gates(g, gp, rl)
    P = mm("bnst,bntv->bnsv", tinv.reshape(BH, n, C, C).astype(F32),  # T may be stored in bf16
           eta[..., None] * (yc - cont_p[..., None] * mm("bnck,bnkv->bncv", xc.astype(F32), h)))
    scores = mm("bnsk,bntk->bnst", qc, xc, prec_in) * _masks(g, g, rl, rl, strict=False)
    o = mm("bnst,bntv->bnsv", scores, P) + cont[..., None] * mm("bnck,bnkv->bncv", qc.astype(F32), h)
    return _unchunked(o, heads, y)


def chunk_grads(q, x, y, eta, g, gp, rl, tinv, do, h, dh, *, chunk, group=1, heads=None, operands=None):
    """Per-chunk gradients, as ``pallas_gpu.chunk_grad_pass`` returns them.

    q, x ``[BH, L, dk]``, y, do ``[BH, L, dv]`` (or ``[B, L, H, d]`` with ``heads=H``); eta, g, gp, rl
    ``[BH, L]``; tinv ``[BH, L, C]``; h, dh ``[BH, n, dk, dv]`` (chunk start states, end-state
    gradients).  Returns dq, dx, dy in the layouts of q, x, y and fp32 ``[BH, L]`` dη, dg, dgp.

    Dots whose operands are all held in the inputs' dtype (q, x, dO and the stored h, dh) run on it
    (exact: a bf16 value is a TF32 value).  ``operands`` (None, or the bf16/fp16 inputs' dtype, as
    ``KernelConfig(walk_operands="input")`` gives it): the computed fp32 operands (scores, P, dR and
    the score and Gram gradients) are rounded to it for their dots too, as the walks do; dots with
    ``T`` keep fp32 operands (its entries can be far from 1).
    """
    prec_in, p32 = _precisions(q.dtype)

    def mm(spec, a, b):  # a computed fp32 operand: at p32, or rounded for a bf16 MMA as in the walks
        if operands is not None:
            return jnp.einsum(spec, a.astype(operands), b.astype(operands), preferred_element_type=F32)
        return jnp.einsum(spec, a, b, preferred_element_type=F32, precision=p32)

    def mm_in(spec, a, b):  # both operands held in the inputs' dtype: no rounding
        return jnp.einsum(spec, a, b, preferred_element_type=F32, precision=prec_in)

    def mm_t(spec, a, b):  # with T: fp32 operands
        return jnp.einsum(spec, a, b, preferred_element_type=F32, precision=p32)

    qc, xc = _chunked(q, heads, chunk), _chunked(x, heads, chunk)
    do_in = _chunked(do, heads, chunk)
    yc, doc = _chunked(y, heads, chunk).astype(F32), do_in.astype(F32)
    BH, n, C, dk = qc.shape
    eta, g, gp, rl = (a.reshape(BH, n, C) for a in (eta, g, gp, rl))
    tinv = tinv.reshape(BH, n, C, C).astype(F32)  # T may be stored in bf16 (KernelConfig.tri_dtype)
    # the kernels store h, dh in the inputs' dtype for bf16/fp16 inputs: those dots take them as they are
    h_in, dh_in = (a if a.dtype == qc.dtype else a.astype(F32) for a in (h, dh))
    h, dh = h.astype(F32), dh.astype(F32)
    qf, xf = qc.astype(F32), xc.astype(F32)
    x_for_h = xc if h_in.dtype == xc.dtype else xf
    do_for_h = do_in if h_in.dtype == do_in.dtype else doc
    cont, cont_p, w_last, a_last = _gates(g, gp, rl)

    decay = _masks(g, g, rl, rl, strict=False)
    scores = mm_in("bnsk,bntk->bnst", qc, xc) * decay
    gram = mm_in("bnsk,bntk->bnst", xc, xc)
    gamma = _masks(gp, g, rl, rl, strict=True, group=group)

    xh = mm_in("bnck,bnkv->bncv", x_for_h, h_in)
    target = yc - cont_p[..., None] * xh
    P = mm_t("bnst,bntv->bnsv", tinv, eta[..., None] * target)
    xdh = mm_in("bnck,bnkv->bncv", x_for_h, dh_in)
    dP = mm("bnts,bntv->bnsv", scores, doc) + w_last[..., None] * xdh
    dR = mm_t("bnts,bntv->bnsv", tinv, dP)
    d_a = -mm("bnsv,bntv->bnst", dR, P)
    d_op = mm("bnsv,bntv->bnst", doc, P)
    do_h = mm_in("bncv,bnkv->bnck", do_for_h, h_in)
    dr_h = mm("bncv,bnkv->bnck", dR, h)
    p_dh = mm("bncv,bnkv->bnck", P, dh)
    dy = eta[..., None] * dR
    d_eta = jnp.sum(dR * target, axis=-1)
    d_cp = -jnp.sum(dR * xh, axis=-1)
    d_wl = jnp.sum(xdh * P, axis=-1)
    h_dh = jnp.sum(h * dh, axis=(-2, -1))

    d_scores = d_op * decay
    d_k = d_a * eta[..., None] * gamma  # gradient w.r.t. the Gram (zero off A's support)
    a_grad = d_k * gram
    dq = cont[..., None] * do_h + mm("bnst,bntk->bnsk", d_scores, xf)
    dx = (mm("bnts,bntk->bnsk", d_scores, qf) + w_last[..., None] * p_dh - (eta * cont_p)[..., None] * dr_h
          + mm("bnst,bntk->bnsk", d_k + jnp.swapaxes(d_k, -1, -2), xf))
    d_decay = d_op * scores
    wl_term = w_last * d_wl
    end = jnp.sum(wl_term, axis=-1) + a_last * h_dh  # [BH, n]
    last = jnp.arange(C) == C - 1
    dg = (jnp.sum(d_decay, axis=-1) - jnp.sum(d_decay, axis=-2) + cont * jnp.sum(do_h * qf, axis=-1)
          - jnp.sum(a_grad, axis=-2) - wl_term + jnp.where(last, end[..., None], 0.0))
    deta = d_eta + jnp.sum(d_a * gram * gamma, axis=-1)
    dgp = eta * cont_p * d_cp + jnp.sum(a_grad, axis=-1)
    flat = lambda a: a.reshape(BH, n * C)  # noqa: E731
    return (_unchunked(dq, heads, q), _unchunked(dx, heads, x), _unchunked(dy, heads, y), flat(deta), flat(dg),
            flat(dgp))
