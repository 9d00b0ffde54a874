"""TPU kernels (Pallas, Mosaic TPU lowering) for the decayed delta rule: not written yet."""

from __future__ import annotations


def _missing(*args, **kwargs):
    raise NotImplementedError("pallas_tpu decayed_delta_rule: no TPU kernel yet")


tri_inverse_pass = forward_pass = state_grad_pass = chunk_grad_pass = _missing
