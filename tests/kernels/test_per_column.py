"""The per-column ops (Falcon-2: ``decayed_delta_rule_per_column``; Falcon-2A: ``decayed_attention_per_column``)
against their definitions in float64.  Value column c has its own write weight and decay::

    Falcon-2:   s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} x_t (y_{t,c} − (S'_{t-1}ᵀ x_t)_c)
    Falcon-2A:  s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t               o_t = S_tᵀ q_t

The Triton kernels solve each column's system in 16-row blocks (chunks of 32 and 64: 2 and 4 blocks, the decays
renormalized at each block's last row); the TPU kernel row by row.  One class of checks per lowering
(``IMPLEMENTATION``, ``INTERPRET = False``); the ``Test...Interpret`` subclasses run in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule
from falcon_jax.kernels.per_column import KernelConfig, decayed_attention_per_column, decayed_delta_rule_per_column
from falcon_jax.kernels.per_column import mosaic_tpu
from falcon_jax.kernels.per_column.config import tuned_config
from falcon_jax.kernels.per_column.reference import (decayed_attention_per_column_reference,
                                                     decayed_delta_rule_reference)
from tests.kernels.helpers import (S, check_op, delta_inputs, lowered_text, nearly_parallel, on_backend,
                                   time_major)

NAMES = ("q", "x", "y", "eta", "log_gamma", "initial_state")
RULES = {"delta": (decayed_delta_rule_per_column, decayed_delta_rule_reference),
         "attention": (decayed_attention_per_column, decayed_attention_per_column_reference)}


def column_inputs(rng, T=41, dk=16, dv=32, segments=True, decay_range=(0.0, 0.5)):
    """``(q, x, y, η, log γ, s0)`` with per-column η and log γ ``[B, H, T, dv]`` drawn per column, and the run
    index; B = H = 1."""
    q, x, y, _, _, run, s0 = delta_inputs(rng, B=1, H=1, T=T, dk=dk, dv=dv, segments=segments)
    eta = rng.uniform(0.1, 1.9, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
    log_gamma = -rng.uniform(*decay_range, size=y.shape)
    return (q, x, y, eta, log_gamma, s0), run


def reference(rule, run):
    ref = RULES[rule][1]
    return lambda q, x, y, eta, log_gamma, s0: ref(q, x, y, eta, log_gamma, run, s0)


class PerColumnChecks:
    IMPLEMENTATION: str
    INTERPRET: bool = False
    BLOCK_V = 16  # value columns per program (dv = 32: two blocks)

    def op(self, rule, run, chunk=32, dv=32):
        config = KernelConfig(block_v=min(self.BLOCK_V, dv))
        return lambda q, x, y, eta, log_gamma, s0: RULES[rule][0](
            q, x, y, eta, log_gamma, run, s0, chunk_size=chunk, implementation=self.IMPLEMENTATION,
            interpret=self.INTERPRET, config=config)

    @pytest.mark.parametrize("rule,chunk", [("delta", 64), ("attention", 32),
                                            pytest.param("delta", 32, marks=pytest.mark.slow),
                                            pytest.param("attention", 64, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, rule, chunk):
        """Odd T over several chunks, a segment start inside a chunk, non-zero initial state, two value
        blocks."""
        args, run = column_inputs(rng, T=77, dv=2 * self.BLOCK_V)
        check_op(rng, self.op(rule, run, chunk, dv=2 * self.BLOCK_V), reference(rule, run), args, NAMES, grads=False)

    @pytest.mark.parametrize("rule,chunk", [("delta", 64), ("attention", 32),
                                            pytest.param("delta", 32, marks=pytest.mark.slow),
                                            pytest.param("attention", 64, marks=pytest.mark.slow)])
    def test_gradients_match_float64(self, rng, rule, chunk):
        """Every input's gradient (the reverse walk's transposed solve, dq and dx summed over the value blocks'
        shares)."""
        args, run = column_inputs(rng, T=53, dv=2 * self.BLOCK_V)
        check_op(rng, self.op(rule, run, chunk, dv=2 * self.BLOCK_V), reference(rule, run), args, NAMES)

    def test_extreme_gates(self, rng):
        """β = η‖x‖² in (1.99, 1.999) per column with nearly parallel keys, and per column γ = 1e-6 on an
        independent third of the steps, 1 elsewhere: within 1e-4 (the conditioning, for any kernel), values and
        gradients."""
        (q, x, y, _, _, s0), run = column_inputs(rng, T=70, dv=16, segments=False)
        x = nearly_parallel(x)
        eta = rng.uniform(1.99, 1.999, size=y.shape) / np.sum(x * x, axis=-1)[..., None]
        log_gamma = np.where(rng.uniform(size=y.shape) < 0.33, np.log(1e-6), 0.0)
        check_op(rng, self.op("delta", run, 64, dv=16), reference("delta", run), (q, x, y, eta, log_gamma, s0),
                 NAMES, tol=1e-4, grad_tol=1e-4)

    def test_tiny_decays(self, rng):
        """γ = 1e-6 on every step in half the columns (cumulative log decay −884 in a chunk of 64), γ = 1 in a
        quarter: only differences with the later row first are exponentiated."""
        (q, x, y, eta, log_gamma, s0), run = column_inputs(rng, T=70, dv=16, segments=False)
        log_gamma[..., :8] = np.log(1e-6)
        log_gamma[..., 8:12] = 0.0
        check_op(rng, self.op("delta", run, 64, dv=16), reference("delta", run), (q, x, y, eta, log_gamma, s0),
                 NAMES, tol=1e-4, grads=False)


class TritonPerColumn(PerColumnChecks):
    IMPLEMENTATION = "triton"

    def test_decayed_delta_rule_hands_per_column_gates_over(self, rng):
        """``decayed_delta_rule`` with ``[B, T, H, dv]`` gates runs the per-column kernels, from the model's
        layout and with the keys one row back (the op shifts them for these kernels)."""
        (q, k, y, eta, log_gamma, s0), run = column_inputs(rng, T=37)
        first_key = rng.normal(size=(1, 1, 16)) / 4

        def op(q, k, y, eta, log_gamma, s0, first_key):
            o, s = decayed_delta_rule(*(time_major(a) for a in (q, k, y, eta, log_gamma, run)), s0, chunk_size=32,
                                      layout="BTHD", shifted_keys=True, first_key=first_key,
                                      implementation=self.IMPLEMENTATION, interpret=self.INTERPRET)
            return time_major(o), s

        def ref(q, k, y, eta, log_gamma, s0, first_key):
            x = jnp.concatenate([first_key[:, :, None], k[:, :, :-1]], axis=2)
            return decayed_delta_rule_reference(q, x, y, eta, log_gamma, run, s0)

        check_op(rng, op, ref, (q, k, y, eta, log_gamma, s0, first_key), NAMES + ("first_key",))


class TestTritonPerColumnInterpret(TritonPerColumn):
    INTERPRET = True


class MosaicTPUPerColumn(PerColumnChecks):
    IMPLEMENTATION = "mosaic_tpu"
    BLOCK_V = 128  # Mosaic's blocks: a multiple of 128 columns or all of dv (dv = 256: two blocks)


class TestMosaicTPUPerColumnInterpret(MosaicTPUPerColumn):
    INTERPRET = True


def test_tpu_value_block_follows_mosaics_block_rule():
    """A multiple of 128 columns dividing dv, or all of dv; the GPU's narrower widths become 128 (or dv)."""
    assert [mosaic_tpu.value_block(bv, dv) for bv, dv in [(32, 128), (32, 256), (128, 256), (256, 256), (16, 32),
                                                            (32, 32), (64, 64), (512, 256), (128, 384), (16, 96)]] \
        == [128, 128, 128, 256, 32, 32, 64, 256, 128, 96]


def test_kernel_config_is_validated():
    assert tuned_config() == KernelConfig()
    for bad, match in (({"block_v": 24}, "block_v must be a power of two"), ({"block_v": None}, "block_v must be"),
                       ({"num_warps": 3}, "num_warps must be 1, 2, 4, 8 or 16")):
        with pytest.raises(ValueError, match=f"KernelConfig: {match}"):
            KernelConfig(**bad)


@pytest.mark.parametrize("rule", ["delta", "attention"])
@pytest.mark.parametrize("implementation,dtype,dv", [("triton", jnp.bfloat16, 128), ("triton", jnp.float32, 128),
                                                     ("mosaic_tpu", jnp.bfloat16, 256)])
def test_lowers_for_the_accelerator(monkeypatch, rule, implementation, dtype, dv):
    """Forward + backward through the Triton (CUDA) or Mosaic TPU lowering rules on this CPU: d = 128, chunk
    64; on the TPU dv = 256, two value blocks of 128."""
    platform = "tpu" if implementation == "mosaic_tpu" else "gpu"
    on_backend(monkeypatch, platform)
    B, H, T, D = 1, 2, 256, 128
    run = jnp.zeros((B, H, T), jnp.int32)

    def loss(q, x, y, eta, log_gamma, s0):
        o, s = RULES[rule][0](q, x, y, eta, log_gamma, run, s0, implementation=implementation)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    gate = S((B, H, T, dv), jnp.float32)
    text = lowered_text(jax.grad(loss, argnums=tuple(range(6))),
                        [S((B, H, T, D), dtype), S((B, H, T, D), dtype), S((B, H, T, dv), dtype), gate, gate,
                         S((B, H, D, dv), jnp.float32)], platform="tpu" if platform == "tpu" else "cuda")
    prefix = "falcon_delta" if rule == "delta" else "falcon_attn"
    suffix = "_tpu" if platform == "tpu" else ""
    for name in ("col_fwd", "col_bwd"):
        assert f'"{prefix}_{name}{suffix}' in text, name
