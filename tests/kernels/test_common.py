"""The helpers the kernel ops share (``falcon_jax.kernels.common``): the poisoned-outputs testing aid, the gate
transpose kernel, the sequence split into pieces, the GPU checks and the layouts."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from falcon_jax.kernels import common
from falcon_jax.kernels.common import poisoned_outputs, transpose_gates
from tests.kernels.helpers import pallas_call_avals


def half_writer(n_out=1, aliases=None):
    """``common.call`` of a kernel that writes only the first half of each output (2 x 8 floats; an int32 third
    output with ``n_out=3``), interpreted."""
    def kernel(x_ref, *out_refs):
        for o_ref in out_refs:
            o_ref[:4] = x_ref[:4].astype(o_ref.dtype)

    shapes = [jax.ShapeDtypeStruct((8,), jnp.float32)] * min(n_out, 2) + [jax.ShapeDtypeStruct((8,), jnp.int32)] * (
        n_out > 2)
    spec = pl.BlockSpec((8,), lambda: (0,))
    return jax.jit(lambda x: common.call(kernel, grid=(), in_specs=[spec], out_specs=[spec] * n_out,
                                         out_shape=shapes, args=(x,), compiler_params=None, interpret=True,
                                         name="half_writer", aliases=aliases))


def test_poisoned_outputs_show_what_a_kernel_leaves_unwritten():
    """Under ``poisoned_outputs()`` an output element the kernel does not write is NaN (integers: their most
    negative value), the kernel getting every output as a NaN-filled buffer it writes over; an output written
    over an input (``aliases``) starts as that input; outside it the kernel gets no such buffers."""
    x = jnp.arange(1.0, 9.0, dtype=jnp.float32)
    with poisoned_outputs():
        o, p, r = half_writer(3)(x)
        (aliased,) = half_writer(1, aliases={0: 0})(x)
    for out in (o, p):
        np.testing.assert_array_equal(np.asarray(out[:4]), np.asarray(x[:4]))
        assert np.all(np.isnan(np.asarray(out[4:])))
    assert np.all(np.asarray(r[4:]) == np.iinfo(np.int32).min)
    np.testing.assert_array_equal(np.asarray(aliased), np.asarray(x))  # the rest is the input's
    def operands(n_out):
        ((inputs, _),) = pallas_call_avals(half_writer(n_out), (x,), "half_writer")
        return len(inputs)

    with poisoned_outputs():
        assert operands(3) == 4
        with poisoned_outputs():
            assert operands(1) == 2
        assert operands(1) == 2
    assert operands(3) == 1  # the aid is off again


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
@pytest.mark.parametrize("B,L,H", [(2, 96, 4), (1, 512, 64), (1, 2048, 8)])
def test_gate_transpose_kernel(rng, dtype, B, L, H):
    """``[B, L, H] -> [B, H, L]`` by the Pallas kernel (blocks of 32, 128 or 256 rows), outputs poisoned: equal to
    ``swapaxes`` exactly; a float gate's cotangent comes back through the kernel with the blocks swapped."""
    a = jnp.asarray(rng.normal(size=(B, L, H)) * 100, dtype)
    with poisoned_outputs():
        got = jax.jit(lambda a: transpose_gates(a, interpret=True))(a)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.swapaxes(a, 1, 2)))
    if dtype == jnp.float32:
        ct = jnp.asarray(rng.normal(size=(B, H, L)), jnp.float32)
        with poisoned_outputs():
            grad = jax.jit(jax.grad(lambda a: jnp.sum(transpose_gates(a, interpret=True) * ct)))(a)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(jnp.swapaxes(ct, 1, 2)))


def test_pieces_fill_the_programs_and_keep_two_chunks_each():
    """Pieces double while batch·heads × value blocks × pieces is under the target and each piece keeps at least
    two chunks."""
    assert [common.pieces_for(bh, nv, n, 128) for bh, nv, n in (
        (128, 1, 64), (1, 8, 64), (1, 8, 8), (1, 1, 1), (3, 2, 1024), (16, 8, 2))] == [1, 16, 4, 1, 32, 1]


@pytest.mark.parametrize("platform,capability,version,want", [
    ("gpu", "9.0", "0.11.2", True), ("gpu", "9.0", "0.12.0.dev20270101", True),
    ("gpu", "9.0", "0.10.2", False),  # lowers there, never ran there
    ("gpu", "8.0", "0.11.2", False),  # an A100: no wgmma
    ("gpu", "10.0", "0.11.2", False),  # Blackwell: not checked
    ("tpu", "", "0.11.2", False), ("cpu", None, "0.11.2", False),
])
def test_on_hopper_needs_sm90_and_the_checked_jax(monkeypatch, platform, capability, version, want):
    device = types.SimpleNamespace(platform=platform, compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda: [device])
    monkeypatch.setattr(jax, "__version__", version)
    assert common.on_hopper() is want
    assert common.default_gpu_major() == (int(capability.split(".")[0]) if platform == "gpu" else None)


def test_layouts_and_time_shifts():
    with pytest.raises(ValueError, match="`layout` must be one of"):
        common.check_layout("BHDT")
    a = jnp.arange(12.0).reshape(1, 4, 3)
    np.testing.assert_array_equal(common.shift_time(a, 1, axis=1), jnp.concatenate([jnp.zeros((1, 1, 3)), a[:, :3]],
                                                                                   axis=1))
    np.testing.assert_array_equal(common.shift_time(a, -1, axis=1), jnp.concatenate([a[:, 1:], jnp.zeros((1, 1, 3))],
                                                                                    axis=1))
    np.testing.assert_array_equal(common.pad_time(jnp.array([[1, 2]]), 4, mode="edge"), [[1, 2, 2, 2]])
