"""The per-column ops (Falcon-2: ``decayed_delta_rule_per_column``; Falcon-2A: ``decayed_attention_per_column``)
against their definitions in float64.  Value column c has its own write weight and decay::

    Falcon-2:   s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} x_t (y_{t,c} − (S'_{t-1}ᵀ x_t)_c)
    Falcon-2A:  s_{t,c} = e^{a_{t,c}} s'_{t-1,c} + η_{t,c} y_{t,c} x_t               o_t = S_tᵀ q_t

Falcon-2's Triton kernels work in 16-row sub-blocks (chunks of 32 and 64: 2 and 4 sub-blocks, the decays factored
at the sub-blocks' last rows); Falcon-2A's split a chunk's pairs by a binary tree of row groups, the decays
factored at each group's pivot row (chunk 64: 6 levels; ``test_attention_one_tree_level`` isolates single
levels); the TPU kernel row by row.  One class of checks per lowering (``IMPLEMENTATION``, ``INTERPRET = False``);
the ``Test...Interpret`` subclasses run in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import falcon
from falcon_jax.kernels.decayed_delta_rule import decayed_delta_rule
from falcon_jax.kernels.per_column import KernelConfig, decayed_attention_per_column, decayed_delta_rule_per_column
from falcon_jax.kernels.per_column import mosaic_tpu
from falcon_jax.kernels.per_column.config import tuned_config
from falcon_jax.kernels.per_column.reference import (decayed_attention_per_column_reference,
                                                     decayed_delta_rule_reference)
from tests.kernels.helpers import (S, check_op, delta_inputs, lowered_text, nearly_parallel, on_backend,
                                   pallas_call_avals, pallas_calls, time_major)

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


def long_runs(T, *starts):
    """``[1, 1, T]`` run index with segments starting at ``starts`` only (long runs, unlike ``column_inputs``')."""
    return jnp.asarray(sum((np.arange(T) >= s).astype(np.int32) for s in starts)[None, None])


def reference(rule, run):
    ref = RULES[rule][1]
    return lambda q, x, y, eta, log_gamma, s0: ref(q, x, y, eta, log_gamma, run, s0)


class PerColumnChecks:
    IMPLEMENTATION: str
    INTERPRET: bool = False
    BLOCK_V = 16  # value columns per program (dv = 32: two blocks)

    def op(self, rule, run, chunk=32, dv=32, **kw):
        width = min(self.BLOCK_V, dv)  # every pass's value blocks (Falcon-2A's walks and per-chunk passes too)
        config = KernelConfig(block_v=width, walk_block_v=width, out_block_v=width, grad_block_v=width)

        def op(q, x, y, eta, log_gamma, s0):
            return RULES[rule][0](q, x, y, eta, log_gamma, run, s0, chunk_size=chunk,
                                  implementation=self.IMPLEMENTATION, interpret=self.INTERPRET, config=config, **kw)

        op.config = config
        return op

    @pytest.mark.parametrize("rule,chunk", [("delta", 64), ("attention", 64),
                                            pytest.param("delta", 32, marks=pytest.mark.slow),
                                            pytest.param("attention", 32, marks=pytest.mark.slow)])
    def test_forward_matches_float64(self, rng, rule, chunk):
        """Odd T over several chunks, a segment start inside a chunk, non-zero initial state, two value
        blocks."""
        args, run = column_inputs(rng, T=77, dv=2 * self.BLOCK_V)
        check_op(rng, self.op(rule, run, chunk, dv=2 * self.BLOCK_V), reference(rule, run), args, NAMES, grads=False)

    @pytest.mark.parametrize("rule,chunk", [("delta", 64), ("attention", 64),
                                            pytest.param("delta", 32, marks=pytest.mark.slow),
                                            pytest.param("attention", 32, marks=pytest.mark.slow)])
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

    @pytest.mark.parametrize("rule", ["delta", "attention"])
    def test_log_decay_below_the_floor(self, rng, rule):
        """Per column, one step of log γ = −1e30 and one of −inf (hard resets) among small ones count as −30:
        finite, and the chunk's later small decays are not lost to rounding in its cumulative sums."""
        (q, x, y, eta, log_gamma, s0), run = column_inputs(rng, T=41, dv=16, segments=False)
        log_gamma[:, :, 5, :8], log_gamma[:, :, 20, 4:] = -1e30, -np.inf
        floored = lambda q, x, y, eta, log_gamma, s0: reference(rule, run)(q, x, y, eta, jnp.maximum(log_gamma, -30.0),
                                                                          s0)
        check_op(rng, self.op(rule, run, 32, dv=16), floored, (q, x, y, eta, log_gamma, s0), NAMES, grads=False)


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

    def test_attention_extreme_decays(self, rng):
        """Falcon-2A with log γ from −30 to −10 per step in a quarter of the columns (a chunk's cumulative decay
        down to −1900), γ = 1 in another quarter, the rest ordinary; one segment start inside a chunk (long runs:
        every level's pairs within a segment), an initial state: values and every gradient.  Only differences
        with the later row first are exponentiated, so nothing overflows and the exact decays (however small)
        come out."""
        (q, x, y, eta, log_gamma, s0), _ = column_inputs(rng, T=70, dv=32)
        run = long_runs(70, 41)
        log_gamma[..., :8] = -rng.uniform(10.0, 30.0, size=log_gamma[..., :8].shape)
        log_gamma[..., 8:16] = 0.0
        check_op(rng, self.op("attention", run, 64), reference("attention", run), (q, x, y, eta, log_gamma, s0),
                 NAMES)

    # the top level (the halves of a chunk) and the bottom one (neighbouring rows) in the default set: the levels
    # between run the same per-level code of the kernels (_level(k, chunk)) at other strides
    @pytest.mark.parametrize("level", [5, pytest.param(4, marks=pytest.mark.slow),
                                       pytest.param(2, marks=pytest.mark.slow), 0])
    def test_attention_one_tree_level(self, rng, level):
        """Falcon-2A's pairs at one level of the kernels' pair tree alone, values and every gradient: segments of
        ``2m = 2^{level+1}`` rows (the level's groups), queries only on each group's second half, keys and values
        only on its first half, so o's in-chunk terms are exactly the pairs split at that level's pivot (level 5:
        the two halves of a chunk of 64; level 0: neighbouring rows).  Per-column decays: ordinary, γ = 1, log γ
        from −30 to −10 per step and up to −2: a backward that pairs a level's source and target factors wrongly
        (or exponentiates a positive difference, which overflows in the steep columns) fails here."""
        T, dv, m = 141, 32, 1 << level
        (q, x, y, eta, log_gamma, s0), _ = column_inputs(rng, T=T, dv=dv, segments=False)
        second_half = (np.arange(T) // m) % 2 == 1
        q = np.where(second_half[:, None], q, 0.0)
        x, y = (np.where(second_half[:, None], 0.0, a) for a in (x, y))
        log_gamma[..., 8:16] = 0.0
        log_gamma[..., 16:24] = -rng.uniform(10.0, 30.0, size=log_gamma[..., 16:24].shape)
        log_gamma[..., 24:] = -rng.uniform(0.0, 2.0, size=log_gamma[..., 24:].shape)
        run = jnp.asarray((np.arange(T) // (2 * m))[None, None].astype(np.int32))
        check_op(rng, self.op("attention", run, 64), reference("attention", run), (q, x, y, eta, log_gamma, s0),
                 NAMES)

    def test_attention_sums_dA_over_value_blocks(self, rng):
        """Falcon-2A with dv = 4 × ``grad_block_v``, each value block with its own decays (γ = 1; log γ from −30
        to −10 per step; ordinary; down to −2) and values scaled by 1, 1.5, 2, 2.5: dq and dx take dA summed
        over the four blocks' shares (the column gradient pass writes one share per block, XLA sums them), so a
        share dropped, counted twice or written to another block's place fails against float64."""
        dv = 4 * self.BLOCK_V
        (q, x, y, eta, log_gamma, s0), run = column_inputs(rng, T=77, dv=dv)
        blocks = np.arange(dv) // self.BLOCK_V
        log_gamma = np.where(blocks == 0, 0.0, log_gamma)
        log_gamma = np.where(blocks == 1, -rng.uniform(10.0, 30.0, size=log_gamma.shape), log_gamma)
        log_gamma = np.where(blocks == 3, -rng.uniform(0.0, 2.0, size=log_gamma.shape), log_gamma)
        y = y * (1.0 + 0.5 * blocks)
        check_op(rng, self.op("attention", run, 32, dv=dv), reference("attention", run),
                 (q, x, y, eta, log_gamma, s0), NAMES)

    def test_attention_pieces(self, rng):
        """Falcon-2A's walks cut into 4 pieces of one chunk (each column's slope over a piece, a scan over the
        pieces, forward and in reverse) with two segment starts (one where no piece starts) and an initial state:
        values and gradients."""
        args, _ = column_inputs(rng, T=250, dv=32)
        run = long_runs(250, 41, 150)
        check_op(rng, self.op("attention", run, 64, pieces=4), reference("attention", run), args, NAMES)

    def test_attention_in_place(self, rng):
        """Falcon-2A from the model's layout (``layout="BTHD"``: q, x, y, the gates, the run index and o
        ``[B, T, H, ...]``, which its Triton kernels read and write in place), B = 2, H = 2, two pieces, per-head η
        (broadcast over the columns) and per-column log γ: values and gradients."""
        B, H, T, dk, dv = 2, 2, 90, 16, 32
        q, x, y, _, _, run, s0 = delta_inputs(rng, B=B, H=H, T=T, dk=dk, dv=dv)
        eta = rng.uniform(0.1, 1.9, size=(B, H, T))
        log_gamma = -rng.uniform(0.0, 0.5, size=(B, H, T, dv))
        op = self.op("attention", None, 32, pieces=2)

        def in_place(q, x, y, eta, log_gamma, s0):
            o, s = decayed_attention_per_column(*(time_major(a) for a in (q, x, y, eta, log_gamma, run)), s0,
                                                chunk_size=32, implementation=self.IMPLEMENTATION,
                                                interpret=self.INTERPRET, config=op.config, layout="BTHD", pieces=2)
            return time_major(o), s

        check_op(rng, in_place, reference("attention", run), (q, x, y, eta, log_gamma, s0), NAMES)

    def test_attention_runs_its_passes(self, rng):
        """Falcon-2A's forward is the state walk and the per-chunk output; its backward recomputes the states,
        walks the state gradients in reverse and forms the gradients per chunk and value block, then dq and dx
        per chunk (with pieces: each walk from zero first)."""
        args, run = column_inputs(rng, T=100, dv=32)
        args = tuple(jnp.asarray(a, jnp.float32) for a in args)

        def loss(pieces, *a):
            o, s = self.op("attention", run, 32, pieces=pieces)(*a)
            return jnp.sum(o) + jnp.sum(s)

        walk, out, back, col, row = ("falcon_attn_col_state", "falcon_attn_col_out", "falcon_attn_col_dstate",
                                     "falcon_attn_col_grads", "falcon_attn_row_grads")
        assert pallas_calls(lambda *a: loss(1, *a), *args) == [walk, out]
        assert pallas_calls(jax.grad(lambda *a: loss(1, *a)), *args) == [walk, out, walk, back, col, row]
        assert pallas_calls(jax.grad(lambda *a: loss(2, *a)), *args) == [walk, walk, out, walk, back, back, col,
                                                                         row]

    def test_attention_pieces_validated(self, rng):
        args, run = column_inputs(rng, T=20, dv=16)
        for bad in (3, 0, 2.0):
            with pytest.raises(ValueError, match="`pieces` must be a power of two"):
                decayed_attention_per_column(*args[:5], run, args[5], pieces=bad, implementation=self.IMPLEMENTATION,
                                             interpret=self.INTERPRET)


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
                       ({"num_warps": 3}, "num_warps must be 1, 2, 4, 8 or 16"),
                       ({"grad_block_v": 8}, "grad_block_v must be a power of two >= 16"),
                       ({"out_warps": 5}, "out_warps must be 1, 2, 4, 8 or 16"),
                       ({"row_grad_warps": 32}, "row_grad_warps must be 1, 2, 4, 8 or 16"),
                       ({"pieces_below": 0}, "pieces_below must be an int >= 1")):
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
    if rule == "attention" and platform == "gpu":
        names = ("falcon_attn_col_state", "falcon_attn_col_out", "falcon_attn_col_dstate", "falcon_attn_col_grads",
                 "falcon_attn_row_grads")
    else:
        prefix = "falcon_delta" if rule == "delta" else "falcon_attn"
        names = tuple(f"{prefix}_{name}{'_tpu' if platform == 'tpu' else ''}" for name in ("col_fwd", "col_bwd"))
    for name in names:
        assert f'"{name}' in text, name


def test_falcon_2a_kernels_read_the_model_layout(monkeypatch):
    """``falcon(variant="2A")`` with per-column gains hands its Triton kernels the model's ``[B, T, H, ...]`` arrays
    (queries, keys, the weighted values and the per-column log decays, padded in time only) and its output and
    gradients come back in that layout; forward + backward lower through the Triton (CUDA) lowering rules."""
    on_backend(monkeypatch, "gpu")
    B, T, H, D = 2, 200, 2, 128
    bf16, f32 = jnp.bfloat16, jnp.float32

    def loss(q, k, v, beta, lam):
        return jnp.sum(falcon(q, k, v, beta, lam, variant="2A", impl="triton").astype(f32))

    specs = [S((B, T, H, D), bf16)] * 3 + [S((B, T, H, D), f32), S((B, T, H), f32)]
    grad = jax.grad(loss, argnums=tuple(range(5)))
    text = lowered_text(grad, specs)
    for name in ("falcon_attn_col_state", "falcon_attn_col_out", "falcon_attn_col_dstate", "falcon_attn_col_grads",
                 "falcon_attn_row_grads"):
        assert f'"{name}' in text, name
    L, n, width = 256, 4, tuned_config().grad_block_v  # 200 rows padded to 4 chunks of 64
    for name in ("falcon_attn_col_grads", "falcon_attn_row_grads"):
        operands, _ = pallas_call_avals(grad, specs, name)[0]
        assert [shape for shape, _ in operands[:4]] == [(B, L, H, D)] * 4, name  # q, x, u, g in place
    _, outputs = pallas_call_avals(grad, specs, "falcon_attn_col_grads")[0]
    # du, dg in place; each value block's share of dA
    assert outputs == [((B, L, H, D), bf16), ((B, L, H, D), f32), ((B * H, n, D // width, 64, 64), f32)]
    _, outputs = pallas_call_avals(grad, specs, "falcon_attn_row_grads")[0]
    assert [shape for shape, _ in outputs] == [(B, L, H, D)] * 2  # dq, dx
