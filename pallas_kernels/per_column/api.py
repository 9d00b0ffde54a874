"""The per-column ops: Falcon-2 (``decayed_delta_rule_per_column``) and Falcon-2A
(``decayed_attention_per_column``), with a hand-written backward (``jax.custom_vjp``).

Value column c has its own write weight and decay (:mod:`.reference`)::

    Falcon-2:   s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} x_t (y_{t,c} − (S'_{t-1}ᵀ x_t)_c)
    Falcon-2A:  s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t               o_t = S_tᵀ q_t

One program per (batch·head, value block) walks the chunks (:mod:`.triton` on a GPU, :mod:`.mosaic_tpu` on a
TPU: grid steps over the chunks, the state in VMEM) and solves each column's own unit-lower-triangular system
(they share the Gram ``X Xᵀ``) inside the walk; the backward is one reverse walk per (batch·head, value block)
after a forward walk that stores the chunk start states.  No pieces (a piece map would be a ``dk × dk`` matrix
per column).  No Mosaic GPU kernel: ``"mosaic_gpu"`` declines and ``"auto"`` takes Triton on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from falcon_jax.kernels import implementation as impl
from falcon_jax.kernels.common import chunk_local, flatten_pad, next_pow2, reverse_chunk_cumsum
from falcon_jax.kernels.per_column import mosaic_tpu, triton
from falcon_jax.kernels.per_column.config import KernelConfig, tuned_config
from falcon_jax.kernels.per_column.reference import decayed_attention_per_column_reference, decayed_delta_rule_reference

_KERNELS = {"triton": triton, "mosaic_tpu": mosaic_tpu}


def unsupported_reason(name: str, q, y, chunk_size: int, interpret: bool | None = None) -> str | None:
    """Why implementation ``name`` declines a per-column call (None: it serves it)."""
    return impl.kernel_reason(name, q, y, chunk_size, interpret,
                              no_mosaic_gpu="no Mosaic GPU kernel for per-column gates; 'triton' serves the GPU")


@dataclasses.dataclass(frozen=True)
class _Static:
    chunk: int
    config: KernelConfig
    interpret: bool
    residual: bool
    implementation: str

    def kw(self):
        return dict(chunk=self.chunk, block_v=self.config.block_v, interpret=self.interpret,
                    num_warps=self.config.num_warps, residual=self.residual)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _column_op(q, x, y, eta, log_gamma, run, s0, st: _Static):
    out, _ = _column_forward(q, x, y, eta, log_gamma, run, s0, st)
    return out


def _column_forward(q, x, y, eta, log_gamma, run, s0, st: _Static):
    g, rl = chunk_local(log_gamma, run, st.chunk)
    gp = g - log_gamma
    o, s_end = _KERNELS[st.implementation].forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=True, write_h=False,
                                                        **st.kw())
    return (o, s_end), (q, x, y, eta, g, gp, rl, s0)


def _column_backward(st: _Static, res, cts):
    q, x, y, eta, g, gp, rl, s0 = res
    do, ds_final = cts
    kernels = _KERNELS[st.implementation]
    h, _ = kernels.forward_pass(q, x, y, eta, g, gp, rl, s0, write_o=False, write_h=True, **st.kw())
    dq, dx, dy, deta, dg, dgp, ds0 = kernels.backward_pass(
        q, x, y, eta, g, gp, rl, do.astype(y.dtype), h, ds_final.astype(jnp.float32), **st.kw())
    # g = chunk-local inclusive cumsum, gp = g − log γ (unused without the residual)
    chunk = st.chunk
    dlog = reverse_chunk_cumsum(dg + dgp, chunk) - dgp if st.residual else reverse_chunk_cumsum(dg, chunk)
    return (jnp.sum(dq, axis=1).astype(q.dtype), jnp.sum(dx, axis=1).astype(x.dtype), dy, deta, dlog, None, ds0)


_column_op.defvjp(_column_forward, _column_backward)


def _per_column(op, q, x, y, eta, log_gamma, run, initial_state, *, chunk_size, implementation, config, interpret,
                residual):
    reference = decayed_delta_rule_reference if residual else decayed_attention_per_column_reference
    name = impl.select(op, implementation, lambda n: unsupported_reason(n, q, y, chunk_size, interpret))
    if name == "xla":
        o, final = reference(q, x, y, eta, log_gamma, run, initial_state)
        return o.astype(y.dtype), final
    interpret = impl.interpret_mode(name, interpret)
    B, H, T, dk = q.shape
    dv = y.shape[-1]
    dtype, f32 = q.dtype, jnp.float32
    L = next_pow2(-(-T // chunk_size)) * chunk_size
    config = config or tuned_config()
    block_v = min(config.block_v, dv)
    if name == "mosaic_tpu":  # Mosaic: a multiple of 128 columns or all of dv (interpret mode alike)
        block_v = mosaic_tpu.value_block(block_v, dv)
    st = _Static(chunk_size, dataclasses.replace(config, block_v=block_v), interpret, residual, name)
    eta, log_gamma = (a if a.ndim == 4 else jnp.broadcast_to(a[..., None], (*a.shape, dv)) for a in (eta, log_gamma))
    flat = functools.partial(flatten_pad, length=L)  # zero pairs, write weight, log decay; run continued
    o, final = _column_op(flat(q.astype(dtype)), flat(x.astype(dtype)), flat(y.astype(dtype)),
                          flat(eta.astype(f32)), flat(log_gamma.astype(f32)), flat(run.astype(jnp.int32), mode="edge"),
                          initial_state.astype(f32).reshape(B * H, dk, dv), st)
    return o[:, :T].reshape(B, H, T, dv), final.reshape(B, H, dk, dv)


def decayed_delta_rule_per_column(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                                  implementation="auto", config: KernelConfig | None = None,
                                  interpret: bool | None = None):
    """The decayed delta rule with per-column gates (Falcon-2's recurrence).

    Args:
      q, x: ``[B, H, T, dk]``; y: ``[B, H, T, dv]`` (bf16, fp16 or fp32; same dtype).
      eta, log_gamma: ``[B, H, T, dv]`` write weight and log decay ≤ 0 per value column (``[B, H, T]``: the same
        in every column); cast to fp32.
      run: ``[B, H, T]`` int, number of segment starts up to t (0 = continues ``initial_state``).
      initial_state: ``[B, H, dk, dv]``.
      implementation: ``"auto"``, ``"triton"``, ``"mosaic_tpu"``, ``"xla"`` or a sequence
        (:mod:`falcon_jax.kernels.implementation`; ``"mosaic_gpu"`` declines).
      config: :class:`KernelConfig` (None: tuned).  interpret: Pallas interpret mode (None: off the accelerator).
    Returns:
      ``(o [B, H, T, dv] in y's dtype, final_state [B, H, dk, dv] fp32)``.
    """
    return _per_column("decayed_delta_rule_per_column", q, x, y, eta, log_gamma, run, initial_state,
                       chunk_size=chunk_size, implementation=implementation, config=config, interpret=interpret,
                       residual=True)


def decayed_attention_per_column(q, x, y, eta, log_gamma, run, initial_state, *, chunk_size: int = 64,
                                 implementation="auto", config: KernelConfig | None = None,
                                 interpret: bool | None = None):
    """Decayed linear attention with per-column gates (Falcon-2A's recurrence): the per-column kernel without
    the residual (``P = η ⊙ Y``, no triangular system).  Arguments and returns as
    :func:`decayed_delta_rule_per_column`."""
    return _per_column("decayed_attention_per_column", q, x, y, eta, log_gamma, run, initial_state,
                       chunk_size=chunk_size, implementation=implementation, config=config, interpret=interpret,
                       residual=False)
