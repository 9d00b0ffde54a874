"""Context parallelism (falcon_jax.context_parallel): a sequence split over a ``seq`` mesh axis gives what one device
gives, forward and backward, for every rule and the baselines; the compiled program moves no token array over the
axis.  8 simulated CPU devices in a subprocess (the count is fixed before jax starts)."""
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from falcon_jax import falcon
from falcon_jax.context_parallel import plan
from falcon_jax.rules import falcon_rule
from falcon_jax.sharding import current, kernel_sharding
from tests.helpers import run_on_simulated_devices

# Shared by the scripts: inputs for one rule and the comparison of a context-parallel call with the same call on
# one device (the same function traced outside the context), values, final state and gradients.
COMMON = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
jax.config.update("jax_enable_x64", True)
from falcon_jax import FalconState, falcon, kernel_sharding
from falcon_jax.baselines import decayed_linear_attention, deltanet, gated_deltanet
assert jax.device_count() == 8

def inputs(seed, B, T, H, dk, dv, per_column=False, window=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, H, dk)) / np.sqrt(dk) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv))
    beta = rng.uniform(0.2, 1.9, (B, T, H, dv) if per_column else (B, T, H))
    lam = rng.uniform(0.0, 0.5, (B, T, H))
    L = window - 1
    state = FalconState(S=0.5 * rng.standard_normal((B, H, dk, dv)), last_key=rng.standard_normal((B, H, dk)),
                        has_key=np.array([True, False] * (B // 2)), tail_x=rng.standard_normal((B, H, L, dk)),
                        tail_y=rng.standard_normal((B, H, L, dv)), tail_valid=np.ones((B, L), bool))
    cast = lambda a: jnp.asarray(a, dtype) if a.dtype != bool else jnp.asarray(a)
    return [cast(a) for a in (q, k, v, beta, lam)], jax.tree_util.tree_map(cast, state)

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    den = float(np.max(np.abs(b))) if b.size else 0.0
    num = float(np.max(np.abs(a - b))) if a.size else 0.0
    return num / den if den else num

def compare(call, args, mesh, axes):
    '''call(*args) -> (o, FalconState); errors of the split call against one device: output, final state, and the
    gradients of a loss of both with respect to every float argument (poisoned: a cosine weight per output).'''
    def loss(*a):
        o, st = call(*a)
        return jnp.sum(jnp.cos(3 * o) * o) + jnp.sum(jnp.sin(st.S)) + jnp.sum(st.last_key ** 2), (o, st)
    grad = lambda f: jax.value_and_grad(f, argnums=tuple(range(len(args))), has_aux=True, allow_int=True)
    (l0, (o0, s0)), g0 = jax.jit(grad(loss))(*args)
    with kernel_sharding(mesh, *axes):
        (l1, (o1, s1)), g1 = jax.jit(grad(lambda *a: loss(*a)))(*args)
    out = {"o": rel(o1, o0), "S": rel(s1.S, s0.S), "last_key": rel(s1.last_key, s0.last_key),
           "flags": bool(np.array_equal(s1.has_key, s0.has_key) and np.array_equal(s1.tail_valid, s0.tail_valid)),
           "tail": max(rel(jnp.where(s0.tail_valid[:, None, :, None], a, 0), jnp.where(s0.tail_valid[:, None, :, None], b, 0))
                       for a, b in ((s1.tail_x, s0.tail_x), (s1.tail_y, s0.tail_y))),
           "grads": max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0))
                        if jnp.issubdtype(b.dtype, jnp.floating))}
    return out
"""

RULES_SCRIPT = COMMON + textwrap.dedent(r"""
    # data=2 x seq=4: T = 37 -> 4 slices of 10 (the last padded by 3); segments: row 0 starts one exactly at a slice
    # start (10), one inside a slice (14) and one two positions before a slice start (28, so that the window's tail
    # reaching into the next slice holds a segment start); row 1 has one segment
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "seq"))
    B, T, H, dk, dv = 2, 37, 2, 4, 3
    seg = np.zeros((B, T), np.int32)
    for c in (10, 14, 28):
        seg[0, c:] += 1
    seg = jnp.asarray(seg + 5)
    cases = {f"falcon-{v}": dict(variant=v) for v in ("1", "2", "3", "1A", "2A", "3A")}
    cases["falcon-1-rbw"] = dict(variant="1", timing="rbw")
    cases["falcon-3A-same_step-rbw"] = dict(variant="3A", alignment="same_step", timing="rbw")
    cases["falcon-3-direct-scale_coupled"] = dict(variant="3", step="direct", scale_coupled=True)
    out = {}
    for i, (name, opts) in enumerate(cases.items()):
        window = 3 if opts["variant"] in ("3", "3A") else 1
        (q, k, v, beta, lam), state = inputs(i, B, T, H, dk, dv, per_column=opts["variant"] in ("2", "2A"),
                                             window=window)
        if opts.get("step") == "direct":
            beta = beta / 4
        call = lambda q, k, v, beta, lam, state, opts=opts: falcon(
            q, k, v, beta, lam, window=3, chunk_size=4, segment_ids=seg, initial_state=state,
            return_final_state=True, impl="xla", **opts)
        out[name] = compare(call, (q, k, v, beta, lam, state), mesh, (("data",), None))
    for i, name in enumerate(("linear_attention", "deltanet", "gated_deltanet")):
        (q, k, v, beta, lam), state = inputs(20 + i, B, T, H, dk, dv)
        beta = beta / 2
        fn = {"linear_attention": lambda q, k, v, b, g, s: decayed_linear_attention(q, k, v, -g, b, **kw(s)),
              "deltanet": lambda q, k, v, b, g, s: deltanet(q, k, v, b, **kw(s)),
              "gated_deltanet": lambda q, k, v, b, g, s: gated_deltanet(q, k, v, b, -g, **kw(s))}[name]
        kw = lambda s: dict(chunk_size=4, segment_ids=seg, initial_state=s, return_final_state=True, impl="xla")
        out[name] = compare(fn, (q, k, v, beta, lam, state), mesh, (("data",), None))
    # the recurrent and parallel forms and a data x seq x tensor mesh (heads split too), T a multiple of 4
    mesh3 = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "seq", "tensor"))
    for i, (name, opts) in enumerate({"falcon-3-recurrent": dict(variant="3", form="recurrent"),
                                      "falcon-2A-parallel": dict(variant="2A", form="parallel")}.items()):
        (q, k, v, beta, lam), state = inputs(30 + i, B, 24, H, dk, dv, per_column=opts["variant"] == "2A",
                                             window=3)
        call = lambda q, k, v, beta, lam, opts=opts: falcon(
            q, k, v, beta, lam, window=3, segment_ids=seg[:, :24], return_final_state=True, **opts)
        out[name] = compare(call, (q, k, v, beta, lam), mesh3, (("data",), "tensor"))
    print("RESULT" + json.dumps(out))
""")


def test_every_rule_split_over_seq_matches_one_device():
    """Falcon-1, 2, 3, 1A, 2A, 3A (windows 3), the read-before-write and same-step ablations, the direct step with
    scale coupling, the three baselines, from a random initial state, with segments starting at, inside and just
    before slice starts and T not a multiple of the slices: outputs, final state and gradients to 1e-10 (fp64)."""
    out = run_on_simulated_devices(RULES_SCRIPT, 8, timeout=900)
    assert len(out) == 14, sorted(out)
    for name, r in out.items():
        assert r["flags"], (name, r)
        for key in ("o", "S", "last_key", "tail", "grads"):
            assert r[key] <= 1e-10, (name, key, r)


def test_plan_splits_only_what_it_can():
    """Without a ``seq`` axis (or of size 1) nothing is split; a decode step is not split; slices shorter than the
    window run whole, with a warning that says so."""
    rule = falcon_rule("3", window=4)
    assert plan(None, rule, 2, 64, 2) is None
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    with kernel_sharding(mesh, ("data",), None):
        assert current() is None
    with pytest.raises(ValueError, match="seq_axis='data' is also a batch or head axis"):
        with kernel_sharding(mesh, ("data",), None, seq_axis="data"):
            pass
