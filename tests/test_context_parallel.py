"""Context parallelism (falcon_jax.context_parallel): a sequence split over a ``seq`` mesh axis gives what one device
gives, forward and backward, for every rule, the baselines and the LM; the compiled program moves no token array
over the axis.  8 simulated CPU devices in a subprocess (the count is fixed before jax starts)."""
import json
import re
import textwrap
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from falcon_jax.context_parallel import plan
from falcon_jax.rules import falcon_rule
from falcon_jax.sharding import current, kernel_sharding
from tests.helpers import run_on_simulated_devices

TOL = 1e-10  # fp64, XLA forms
KERNEL_TOL = 1e-5  # fp32, the Pallas kernels in interpret mode

# Shared by the scripts: inputs for one rule; the comparison of a split call with the same call on one device (the
# function traced outside the context); the collectives of a compiled program.
COMMON = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
jax.config.update("jax_enable_x64", True)
from falcon_jax import FalconState, falcon, kernel_sharding
from falcon_jax.baselines import decayed_linear_attention, deltanet, gated_deltanet
from falcon_jax.testing import pallas_call_operand_shapes
assert jax.device_count() == 8

def inputs(seed, B, T, H, dk, dv, per_column=False, window=1, dtype=np.float64):
    '''q, k, v, beta, lam and an initial state: row 0 carries a key and a full tail, row 1 is fresh.'''
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, H, dk)) / np.sqrt(dk) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv))
    beta = rng.uniform(0.2, 1.9, (B, T, H, dv) if per_column else (B, T, H))
    lam = rng.uniform(0.0, 0.5, (B, T, H))
    L = window - 1
    fresh = np.arange(B) % 2 == 1
    state = FalconState(S=0.5 * rng.standard_normal((B, H, dk, dv)),
                        last_key=rng.standard_normal((B, H, dk)) / np.sqrt(dk), has_key=~fresh,
                        tail_x=rng.standard_normal((B, H, L, dk)) / np.sqrt(dk),
                        tail_y=rng.standard_normal((B, H, L, dv)),
                        tail_valid=np.repeat(~fresh[:, None], L, axis=1))
    cast = lambda a: jnp.asarray(a) if a.dtype == bool else jnp.asarray(a, dtype)
    return [cast(a) for a in (q, k, v, beta, lam)], jax.tree_util.tree_map(cast, state)

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    den = float(np.max(np.abs(b))) if b.size else 0.0
    num = float(np.max(np.abs(a - b))) if a.size else 0.0
    return num / den if den else num

def state_errors(got, want):
    '''Errors of a final state against another (FalconState or the reference's dict); tails where valid.'''
    fields = ("S", "last_key", "has_key", "tail_x", "tail_y", "tail_valid")
    want = want if isinstance(want, dict) else {f: getattr(want, f) for f in fields}
    valid = np.asarray(want["tail_valid"], bool)[:, None, :, None]
    return {"S": rel(got.S, want["S"]), "last_key": rel(got.last_key, want["last_key"]),
            "flags": bool(np.array_equal(got.has_key, want["has_key"])
                          and np.array_equal(got.tail_valid, want["tail_valid"])),
            "tail": max(rel(np.where(valid, a, 0), np.where(valid, b, 0))
                        for a, b in ((got.tail_x, want["tail_x"]), (got.tail_y, want["tail_y"])))}

def collectives(compiled):
    '''(kind, result shape) of every collective in a compiled program.'''
    found = []
    for line in compiled.as_text().splitlines():
        m = re.search(r"= (\([^()]*\)|\S+?)(?:\{[^}]*\})? "
                      r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", line)
        if m:  # the result type without layouts: f32[4,2] or a tuple (s32[2,1], s32[2,1])
            found.append((m.group(2), re.sub(r"\{[^}]*\}|/\*[^*]*\*/", "", m.group(1))))
    return sorted(found)

def compare(call, args, mesh, axes, hlo=False, run=True):
    '''call(*args) -> (o, FalconState).  Errors of the split call against one device: output, final state, and the
    gradients of a loss of both (a cosine weight per output) with respect to every argument.  hlo: also the
    collectives of the split program; run=False: only those (compiled, not run).'''
    def loss(*a):
        o, st = call(*a)
        return jnp.sum(jnp.cos(3 * o) * o) + jnp.sum(jnp.sin(st.S)) + jnp.sum(st.last_key ** 2), (o, st)
    grad = lambda f: jax.value_and_grad(f, argnums=tuple(range(len(args))), has_aux=True, allow_int=True)
    with kernel_sharding(mesh, *axes):
        split = jax.jit(grad(lambda *a: loss(*a)))
        found = collectives(split.lower(*args).compile()) if hlo else None
        if not run:
            return found
        (_, (o1, s1)), g1 = split(*args)
    (_, (o0, s0)), g0 = jax.jit(grad(loss))(*args)
    out = dict(state_errors(s1, s0), o=rel(o1, o0),
               grads=max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0))
                         if jnp.issubdtype(b.dtype, jnp.floating)))
    return (out, found) if hlo else out

# data=2 x seq=4: T = 37 is 4 slices of 10, the last padded by 3.  Row 0 starts segments exactly at a slice start
# (10), inside a slice (14) and two positions before a slice start (28: the window tail that reaches into the next
# slice holds a segment start); row 1 is one segment.
MESH = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "seq"))
B, T, H, DK, DV = 2, 37, 2, 4, 3
SEG = np.zeros((B, T), np.int32)
for c in (10, 14, 28):
    SEG[0, c:] += 1
SEG = jnp.asarray(SEG + 5)
"""

# Every rule's forward against the float64 recurrence; two rules' gradients against one device and the collectives of
# their compiled programs at two lengths; the Pallas kernels (interpret mode) for Falcon-1; the LM.  Its argument
# (JSON) names the parts to run: DEFAULT_PARTS in the default set, the rest in a test marked slow.
DEFAULT_SCRIPT = COMMON + textwrap.dedent(r"""
    import sys
    from falcon_jax.reference import (reference_decayed_linear_attention, reference_falcon,
                                      reference_gated_deltanet)
    PARTS = json.loads(sys.argv[1])
    out = {"reference": {}, "gradients": {}, "collectives": {}}
    cases = {"1-rbw": dict(variant="1", timing="rbw"), "2": dict(variant="2"), "3": dict(variant="3"),
             "1A": dict(variant="1A"), "2A": dict(variant="2A"),
             "3A-same_step": dict(variant="3A", alignment="same_step")}
    for i, (name, opts) in enumerate(cases.items()):
        if name not in PARTS["reference"]:
            continue
        (q, k, v, beta, lam), state = inputs(i, B, T, H, DK, DV, per_column=opts["variant"] in ("2", "2A"),
                                             window=3 if opts["variant"] in ("3", "3A") else 1)
        with kernel_sharding(MESH, ("data",), None):
            o, st = jax.jit(lambda *a, opts=opts: falcon(*a[:5], window=3, chunk_size=4, segment_ids=SEG,
                            initial_state=a[5], return_final_state=True, impl="xla", **opts))(q, k, v, beta, lam, state)
        o_ref, st_ref = reference_falcon(q, k, v, beta, lam, window=3, segment_ids=SEG, initial_state=state, **opts)
        out["reference"][name] = dict(state_errors(st, st_ref), o=rel(o, o_ref))
    (q, k, v, beta, lam), state = inputs(10, B, T, H, DK, DV)
    for name, fn, ref in (("linear_attention",
                           lambda q, k, v, b, g, s, **kw: decayed_linear_attention(q, k, v, -g, **kw),
                           lambda q, k, v, b, g, **kw: reference_decayed_linear_attention(q, k, v, -g, **kw)),
                          ("gated_deltanet", lambda q, k, v, b, g, s, **kw: gated_deltanet(q, k, v, b / 2, -g, **kw),
                           lambda q, k, v, b, g, **kw: reference_gated_deltanet(q, k, v, b / 2, -g, **kw))):
        if name not in PARTS["reference"]:
            continue
        with kernel_sharding(MESH, ("data",), None):
            o, st = jax.jit(lambda *a, fn=fn: fn(*a, chunk_size=4, segment_ids=SEG, initial_state=a[5],
                                                 return_final_state=True, impl="xla"))(q, k, v, beta, lam, state)
        o_ref, st_ref = ref(q, k, v, beta, lam, segment_ids=SEG, initial_state=state)
        out["reference"][name] = {"o": rel(o, o_ref), "S": rel(st.S, st_ref["S"])}

    for name, variant, window in (("1", "1", 1), ("3A", "3A", 3)):
        if name not in PARTS["gradients"]:
            continue
        for length in (40, 80):  # slices of 10 and 20: a T the slices divide keeps every array split over seq
            (q, k, v, beta, lam), state = inputs(20, B, length, H, DK, DV, window=window)
            seg = jnp.concatenate([SEG, SEG + 10, SEG + 20], axis=1)[:, :length]
            call = lambda q, k, v, beta, lam, state, variant=variant, seg=seg: falcon(
                q, k, v, beta, lam, variant=variant, window=window, chunk_size=4, segment_ids=seg,
                initial_state=state, return_final_state=True, impl="xla")
            if length == 40:
                out["gradients"][name], found = compare(call, (q, k, v, beta, lam, state), MESH, (("data",), None),
                                                        hlo=True)
            else:  # compiled only
                found = compare(call, (q, k, v, beta, lam, state), MESH, (("data",), None), hlo=True, run=False)
            out["collectives"][f"{name}-T{length}"] = found

    # the Pallas kernels (interpret mode, fp32) on data x seq x tensor: Falcon-1 runs its values widened to dv + dk
    if PARTS["kernels"]:
        mesh3 = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "seq", "tensor"))
        (q, k, v, beta, lam), state = inputs(30, B, 60, H, 16, 16, dtype=np.float32)
        call = lambda q, k, v, beta, lam, state: falcon(q, k, v, beta, lam, variant="1", chunk_size=16,
                                                        segment_ids=jnp.concatenate([SEG, SEG[:, -23:] + 7], axis=1),
                                                        initial_state=state, return_final_state=True, impl="triton")
        out["kernels"] = compare(call, (q, k, v, beta, lam, state), mesh3, (("data",), "tensor"))
        with kernel_sharding(mesh3, ("data",), "tensor"):
            shapes = pallas_call_operand_shapes(call, q, k, v, beta, lam, state)
        out["kernel_shapes"] = [[list(shape) for shape in operands] for operands in shapes]

    # the LM: Falcon-3 layers (window 3, short convolutions) on packed rows, loss and gradients, at two lengths
    if PARTS["lm"]:
        from flax import nnx
        from falcon_jax.nn import FalconLM, LMConfig
        from falcon_jax.nn.model import lm_loss
        cfg = LMConfig(mixer="falcon-3", layer_mixers=("falcon-3", "falcon-1A.3"), vocab_size=64, d_model=64,
                       n_layers=2, n_heads=2, chunk_size=8, window=3, dtype="float64", param_dtype="float64")
        graphdef, params = nnx.split(FalconLM(cfg, rngs=nnx.Rngs(0)))
        rng = np.random.default_rng(40)
        out["lm"] = {}
        for length in (40, 80):
            tokens = jnp.asarray(rng.integers(0, 64, (4, length + 1)), jnp.int32)
            seg = jnp.asarray(np.sort(rng.integers(0, 3, (4, length + 1)), axis=1), jnp.int32)
            f = jax.value_and_grad(lambda p, t, s: lm_loss(nnx.merge(graphdef, p), t, segment_ids=s))
            with kernel_sharding(MESH, ("data",), None):
                split = jax.jit(lambda *a: f(*a))
                out["lm"][length] = {"collectives": collectives(split.lower(params, tokens, seg).compile())}
                if length == 40:
                    l1, g1 = split(params, tokens, seg)
            if length == 40:
                l0, g0 = jax.jit(f)(params, tokens, seg)
                out["lm"][length].update(loss=rel(l1, l0), grads=max(rel(a, b) for a, b in zip(jax.tree.leaves(g1),
                                                                                                  jax.tree.leaves(g0))))
    print("RESULT" + json.dumps(out))
""")


# The default set runs each path of the split once.  Against the float64 recurrence: read before write (1-rbw),
# per-column gates (2, 2A), a window in both rule families (3, 3A; 3A with same-step pairs), Gated DeltaNet's
# transition.  The inner product with window 1 (1A; decayed linear attention takes the same path) runs in the LM's
# Falcon-1A.3 layer.  Gradients and collectives: Falcon-1's (the regression rules' widened run); the LM's Falcon-3 and
# Falcon-1A.3 layers take the windowed and inner-product splits' gradients.  The rest runs in a test marked slow.
REFERENCE_CASES = ("1-rbw", "2", "3", "1A", "2A", "3A-same_step", "linear_attention", "gated_deltanet")
GRADIENT_RULES = ("1", "3A")
DEFAULT_PARTS = {"reference": ["1-rbw", "2", "3", "2A", "3A-same_step", "gated_deltanet"], "gradients": ["1"],
                 "kernels": True, "lm": True}
SLOW_PARTS = {"reference": [c for c in REFERENCE_CASES if c not in DEFAULT_PARTS["reference"]],
              "gradients": [r for r in GRADIENT_RULES if r not in DEFAULT_PARTS["gradients"]],
              "kernels": False, "lm": False}


@pytest.fixture(scope="module")
def default_results():
    return run_on_simulated_devices(DEFAULT_SCRIPT, 8, json.dumps(DEFAULT_PARTS), timeout=900)


def check_reference(results, names):
    assert sorted(results) == sorted(names), sorted(results)
    for name, r in results.items():
        assert r.get("flags", True), (name, r)
        for key, err in r.items():
            if key != "flags":
                assert err <= TOL, (name, key, r)


def check_gradients_and_collectives(results, rules):
    grads, found = results["gradients"], results["collectives"]
    assert sorted(grads) == sorted(rules), sorted(grads)
    for name, r in grads.items():
        assert r["flags"], (name, r)
        for key in ("o", "S", "last_key", "tail", "grads"):
            assert r[key] <= TOL, (name, key, r)
    for rule in rules:
        short, long = found[f"{rule}-T40"], found[f"{rule}-T80"]
        assert short == long, (rule, short, long)
        kinds = {kind for kind, _ in short}
        assert {"all-gather", "collective-permute"} <= kinds, short
        for kind, shape in short:
            dims = {int(n) for group in re.findall(r"\[([\d,]*)\]", shape) for n in group.split(",") if n}
            assert not dims & {40, 80, 10, 20}, (rule, kind, shape)


def test_rules_split_over_seq_match_the_float64_recurrence(default_results):
    """Falcon-1 (read before write), 2, 3 (window 3), 2A, 3A (window 3, same-step pairs) and Gated DeltaNet on 4
    slices of a T = 37 sequence, from a random initial state, with segments starting at, inside and just before slice
    starts: outputs and final state equal the float64 NumPy recurrence's."""
    check_reference(default_results["reference"], DEFAULT_PARTS["reference"])


def test_gradients_match_one_device_and_no_token_array_crosses_seq(default_results):
    """Falcon-1 (regression: the widened run) at T = 40: outputs, final state and the gradients with respect to every
    input and the initial state equal one device's.  The compiled forward+backward has the same collectives at T = 40
    and 80, none of them holding a length-T or length-T/4 array: nothing of size T (q, k, v, outputs, their
    gradients) is gathered or moved over ``seq``, only the maps, the halo and the state."""
    check_gradients_and_collectives(default_results, DEFAULT_PARTS["gradients"])


@pytest.mark.slow
def test_the_other_rules_split_over_seq_match_the_float64_recurrence_and_one_device():
    """The default set's tests on the rest of the catalogue: Falcon-1A and decayed linear attention against the
    float64 recurrence; Falcon-3A (inner product, window 3) at T = 40 against one device, gradients included, and its
    collectives at T = 40 and 80."""
    out = run_on_simulated_devices(DEFAULT_SCRIPT, 8, json.dumps(SLOW_PARTS), timeout=900)
    check_reference(out["reference"], SLOW_PARTS["reference"])
    check_gradients_and_collectives(out, SLOW_PARTS["gradients"])


def test_kernels_split_over_seq_match_one_device(default_results):
    """Falcon-1 through the Pallas kernels (interpret mode, fp32) on a data x seq x tensor mesh, T = 60 not a
    multiple of the 16-row chunk: values, final state and gradients equal one device's to 1e-5, and every kernel
    works on one device's slice: one row of the batch, one head, 30 positions."""
    r = default_results["kernels"]
    assert r["flags"], r
    for key in ("o", "S", "last_key", "tail", "grads"):
        assert r[key] <= KERNEL_TOL, (key, r)
    shapes = default_results["kernel_shapes"]
    assert shapes, "no Pallas kernel in the split program (did falcon fall back to XLA?)"
    for operands in shapes:  # one row and head of a 30-position slice (padded to 32, the kernels' chunk multiple)
        assert all(s[0] == 1 and not {60, 64} & set(s) for s in operands), operands
    # the values widened by dk zero columns (dv + dk = 32) go through the kernel too
    assert any(len(s) >= 3 and s[1] == 32 and s[-1] == 32 for operands in shapes for s in operands), shapes


def test_lm_split_over_seq_matches_one_device(default_results):
    """FalconLM (a Falcon-3 and a Falcon-1A.3 layer, with short convolutions) on data=2 x seq=4, packed rows: the
    loss and every parameter's gradient equal one device's at T = 40, and the compiled step's collectives are the
    same at T = 40 and 80 and hold no activation: the convolutions' halos, the rules' maps and halos, the gradients'
    all-reduce (no all-gather or all-to-all of an activation over seq)."""
    lm = default_results["lm"]
    assert lm["40"]["loss"] <= TOL and lm["40"]["grads"] <= TOL, lm["40"]
    found = lm["40"]["collectives"]
    assert found == lm["80"]["collectives"], lm
    assert {kind for kind, _ in found} == {"all-gather", "all-reduce", "collective-permute", "reduce-scatter"}, found
    for kind, shape in found:  # no activation moves: no array of the 40 or 80 positions or their slices of 10, 20
        dims = {int(n) for group in re.findall(r"\[([\d,]*)\]", shape) for n in group.split(",") if n}
        assert not dims & {40, 80, 10, 20}, (kind, shape)



PADDED_LM_SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    jax.config.update("jax_enable_x64", True)
    from flax import nnx
    from falcon_jax import kernel_sharding
    from falcon_jax.nn import FalconLM, LMConfig
    from falcon_jax.nn.model import lm_loss
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "seq"))
    cfg = LMConfig(mixer="falcon-1A", vocab_size=64, d_model=48, n_layers=1, n_heads=3, chunk_size=8,
                   dtype="float64", param_dtype="float64")
    graphdef, params = nnx.split(FalconLM(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(40).integers(0, 64, (3, 38)), jnp.int32)
    f = jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(graphdef, p), t))
    l0, g0 = jax.jit(f)(params, tokens)
    with kernel_sharding(mesh, ("data",), None):
        l1, g1 = jax.jit(lambda *a: f(*a))(params, tokens)
    rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    print("RESULT" + json.dumps({"loss": rel(l1, l0), "grads": {jax.tree_util.keystr(p): rel(a, b) for (p, a), b in
                                 zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0))}}))
""")


@pytest.mark.slow  # ~13 s: one LM step compiled twice in a subprocess
def test_lm_gradients_with_a_length_and_batch_the_mesh_does_not_divide():
    """T = 37 over seq=4 (padded slices) with 3 rows over data=2 (rows whole): left free, XLA's partitioner splits
    the un-padded activations unevenly over seq, and the embedding's scatter-add then adds the padding positions'
    cotangents to row 0 of the table (a wrong embedding gradient, the loss right).  Every gradient equals one
    device's."""
    out = run_on_simulated_devices(PADDED_LM_SCRIPT, 8, timeout=300)
    assert out["loss"] <= TOL, out
    for name, err in out["grads"].items():
        assert err <= TOL, (name, err)

SWEEP_SCRIPT = COMMON + textwrap.dedent(r"""
    cases = {f"falcon-{v}": dict(variant=v) for v in ("1", "2", "3", "1A", "2A", "3A")}
    cases["falcon-1-rbw"] = dict(variant="1", timing="rbw")
    cases["falcon-3-same_step"] = dict(variant="3", alignment="same_step")
    cases["falcon-3A-same_step-rbw"] = dict(variant="3A", alignment="same_step", timing="rbw")
    cases["falcon-3-direct-scale_coupled"] = dict(variant="3", step="direct", scale_coupled=True)
    out = {}
    for i, (name, opts) in enumerate(cases.items()):
        window = 3 if opts["variant"] in ("3", "3A") else 1
        (q, k, v, beta, lam), state = inputs(i, B, T, H, DK, DV, per_column=opts["variant"] in ("2", "2A"),
                                             window=window)
        if opts.get("step") == "direct":
            beta = beta / 4
        call = lambda q, k, v, beta, lam, state, opts=opts: falcon(
            q, k, v, beta, lam, window=3, chunk_size=4, segment_ids=SEG, initial_state=state,
            return_final_state=True, impl="xla", **opts)
        out[name] = compare(call, (q, k, v, beta, lam, state), MESH, (("data",), None))
    kw = lambda s: dict(chunk_size=4, segment_ids=SEG, initial_state=s, return_final_state=True, impl="xla")
    for i, name in enumerate(("linear_attention", "deltanet", "gated_deltanet")):
        (q, k, v, beta, lam), state = inputs(20 + i, B, T, H, DK, DV)
        fn = {"linear_attention": lambda q, k, v, b, g, s: decayed_linear_attention(q, k, v, -g, b, **kw(s)),
              "deltanet": lambda q, k, v, b, g, s: deltanet(q, k, v, b / 2, **kw(s)),
              "gated_deltanet": lambda q, k, v, b, g, s: gated_deltanet(q, k, v, b / 2, -g, **kw(s))}[name]
        out[name] = compare(fn, (q, k, v, beta, lam, state), MESH, (("data",), None))
    # the recurrent and parallel forms on data x seq x tensor (heads split too), T a multiple of the slices
    mesh3 = Mesh(np.asarray(jax.devices()).reshape(2, 2, 2), ("data", "seq", "tensor"))
    for i, (name, opts) in enumerate({"falcon-3-recurrent": dict(variant="3", form="recurrent"),
                                      "falcon-2A-parallel": dict(variant="2A", form="parallel")}.items()):
        (q, k, v, beta, lam), _ = inputs(30 + i, B, 24, H, DK, DV, per_column=opts["variant"] == "2A")
        call = lambda q, k, v, beta, lam, opts=opts: falcon(
            q, k, v, beta, lam, window=3, segment_ids=SEG[:, :24], return_final_state=True, **opts)
        out[name] = compare(call, (q, k, v, beta, lam), mesh3, (("data",), "tensor"))
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_every_rule_and_baseline_gradients_match_one_device():
    """Every rule (windows 3) and its ablations (read before write, same-step pairs, direct step with scale
    coupling), the three baselines, and the recurrent and parallel forms with heads split too: outputs, final state
    and gradients with respect to every input and the initial state equal one device's to 1e-10 (fp64)."""
    out = run_on_simulated_devices(SWEEP_SCRIPT, 8, timeout=1800)
    assert len(out) == 15, sorted(out)
    for name, r in out.items():
        assert r["flags"], (name, r)
        for key in ("o", "S", "last_key", "tail", "grads"):
            assert r[key] <= TOL, (name, key, r)


def test_plan_splits_only_what_it_can():
    """No context, no ``seq`` axis or one of size 1: nothing is split.  A decode step (T < slices) is not split;
    slices shorter than the window run whole, with a warning that says so."""
    rule = falcon_rule("3", window=4)
    assert plan(None, rule, 2, 64, 2) is None
    one = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    with kernel_sharding(one, ("data",), None):
        assert current() is None
    with pytest.raises(ValueError, match="seq_axis='data' is also a batch or head axis"):
        with kernel_sharding(one, ("data",), None, seq_axis="data"):
            pass
    # a 4-device sequence axis, described without devices (plan reads only the sizes)
    from falcon_jax.sharding import KernelSharding
    ks = KernelSharding(mesh=_FakeMesh({"data": 2, "seq": 4}), batch_axes=("data",), head_axis=None, seq_axis="seq")
    assert plan(ks, rule, 2, 3, 2) is None  # a decode step
    split = plan(ks, rule, 2, 37, 2)
    assert (split.slices, split.length, split.batch, split.heads) == (4, 10, "data", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plan(ks, rule, 2, 13, 2).length == 4  # slices of 4 positions: enough for window 4 ...
        assert plan(ks, falcon_rule("3", window=5), 2, 13, 2) is None  # ... not for window 5
    assert len(caught) == 1 and "slices of at least the window's 5 positions" in str(caught[0].message), caught
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        odd = plan(ks, falcon_rule("1"), 3, 64, 2)  # 3 rows over 2 batch shards: rows whole per slice
    assert odd.batch is None and any("batch 3" in str(w.message) for w in caught)


class _FakeMesh:
    def __init__(self, shape):
        self.shape = shape


def _script(*args, env=None, **kwargs):
    """``python -m benchmarks.context_parallel ARGS`` from the checkout's root (``Popen`` keyword arguments)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.Popen([sys.executable, "-m", "benchmarks.context_parallel", *args], cwd=root, text=True,
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            **kwargs)


@pytest.mark.slow  # ~40 s: four compiles of the training step in their own processes
def test_mock_topology_script_smoke(tmp_path):
    """``python -m benchmarks.context_parallel --smoke`` (the lead's GPU command on simulated CPU devices, a tiny
    LM): every case compiles, and the training step's temporaries per device at T = 1,024 on 8 devices are within
    25 % of one device's at T = 128 (memory ∝ T / devices), with no all-to-all."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cp.json"
    proc = _script("--smoke", "--out", str(out))
    log = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, log[-6000:]
    results = {r["name"]: r for r in json.loads(out.read_text())["cases"]}
    assert set(results) == {"seq2", "data2-seq2", "seq8-262k", "one-32k"}
    assert all(r["status"] == "ok" for r in results.values()), results
    split, whole = results["seq8-262k"], results["one-32k"]
    assert split["T"] == 8 * whole["T"] and split["mesh"]["seq"] == 8
    assert 0 < split["memory_per_device"]["temp"] <= 1.25 * whole["memory_per_device"]["temp"], (split, whole)
    for r in results.values():
        assert "all-to-all" not in r["collectives"], r
        assert Path(r["falcon_jax"]).parents[1] != root  # this checkout, imported in its installed layout


def test_mock_topology_script_keeps_each_case_through_crashes_and_a_sigterm(tmp_path):
    """Each case's result is printed and written to ``--out`` as it finishes: a case whose process aborts (as an
    XLA check failure does) and one that raises are recorded as failures, with the end of their output, while the
    next case compiles; a SIGTERM during the last case (``timeout``'s) keeps the finished cases in the JSON and
    records the one in flight as interrupted."""
    import datetime
    import json
    import signal
    import time

    out, log = tmp_path / "cp.json", tmp_path / "cp.log"
    names = ["seq2", "data2-seq2", "one-32k", "seq8-262k"]
    proc = _script("--smoke", "--cases", ",".join(names), "--out", str(out),
                   env={"FALCON_CP_FAIL": "seq2=abort,data2-seq2=raise"})
    try:
        # the last case is lowered, compiling: the JSON already holds the three cases before it
        deadline = time.monotonic() + 300
        while not (log.exists() and "[seq8-262k] seq8-262k: lowered" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else ""
            time.sleep(0.05)
        during = json.loads(out.read_text())
        proc.send_signal(signal.SIGTERM)
        printed = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert [c["status"] for c in during["cases"]] == ["failed", "failed", "ok", "running"], during["cases"]
    assert proc.returncode == 128 + signal.SIGTERM, printed[-4000:]

    data = json.loads(out.read_text())
    cases = {c["name"]: c for c in data["cases"]}
    assert [c["name"] for c in data["cases"]] == names
    crashed, raised, ok, cut = (cases[n] for n in names)
    assert crashed["status"] == "failed" and "SIGABRT" in crashed["error"], crashed
    assert "seq2: aborting (FALCON_CP_FAIL)" in crashed["log_tail"], crashed
    assert raised["status"] == "failed", raised
    assert raised["error"] == "RuntimeError: data2-seq2: failure injected by FALCON_CP_FAIL", raised
    assert raised["log_tail"].splitlines()[-1] == raised["error"]  # the traceback's last line
    assert ok["status"] == "ok" and ok["compile_s"] > 0 and ok["lower_s"] > 0, ok
    m = ok["memory_per_device"]
    assert m["temp"] > 0 and m["generated_code"] >= 0
    assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"], m
    assert cut["status"] == "interrupted" and "SIGTERM" in cut["error"], cut
    assert "seq8-262k: lowered in" in cut["log_tail"], cut
    # the machine's and the tree's labels
    datetime.datetime.fromisoformat(data["date"])
    assert data["environment"]["versions"]["jax"] == jax.__version__ and data["environment"]["device"]
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", data["trees"]["measured"]["commit"] or "0" * 12)
    # each case's line printed as it ended, before the next case started
    lines = printed.splitlines()
    order = [next(i for i, line in enumerate(lines) if pattern in line) for pattern in (
        "seq2 (seq=2, 1 x 256): failed", "compiling data2-seq2", "data2-seq2 (data=2 x seq=2, 2 x 256): failed",
        "compiling one-32k", "one-32k (one device, 1 x 128): ok", "compiling seq8-262k",
        "seq8-262k (seq=8, 1 x 1,024): interrupted")]
    assert order == sorted(order), printed[-4000:]
    assert "per device GiB: argument" in lines[order[4]] and "compile" in lines[order[4]]


def test_mock_topology_script_starts_no_case_past_its_budget(tmp_path):
    """``--budget 0``: no case starts; each is recorded as not started, and the run is not a failure."""
    import json

    out = tmp_path / "cp.json"
    proc = _script("--smoke", "--cases", "seq2,one-32k", "--budget", "0", "--out", str(out))
    printed = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, printed
    data = json.loads(out.read_text())
    assert [(c["name"], c["status"]) for c in data["cases"]] == [("seq2", "not started (budget)"),
                                                                  ("one-32k", "not started (budget)")]
    assert data["budget_s"] == 0 and data["command"][-6:] == ["--cases", "seq2,one-32k", "--budget", "0", "--out",
                                                              str(out)]
    # a rerun writes cp.partial.json and replaces cp.json only when it ends (a rerun cut short replaced it)
    proc = _script("--smoke", "--cases", "seq2", "--budget", "0", "--out", str(out))
    printed = proc.communicate(timeout=120)[0]
    replaced = f"replacing {out} (the results of {data['date']}) when this run ends; until then it writes "
    assert proc.returncode == 0 and replaced + str(tmp_path / "cp.partial.json") in printed, printed
    assert [c["name"] for c in json.loads(out.read_text())["cases"]] == ["seq2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cp.json", "cp.log"]
    proc = _script("--smoke", "--cases", "seq2", "--out", str(tmp_path))  # a folder: refused before any case
    printed = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "give a .json file path" in printed, printed


def test_mock_topology_script_counts_asynchronous_collectives_of_a_gpu_program():
    """A GPU program's collectives are asynchronous ``-start``/``-done`` pairs, and a combined all-gather's result
    type is a nested tuple ``((operands), (results))``: each pair counts once, with its whole type; the
    ``-done`` halves and ops whose names merely contain a collective's (``%all-gather-done.3`` as an operand) do
    not count."""
    from benchmarks.context_parallel import hlo_collectives

    hlo = """
  %all-gather-start.3 = ((f32[1,12,64,1,64]{4,3,2,1,0}, f32[1,12,64]{2,1,0}), (f32[2,12,64,1,64]{4,3,2,1,0}, f32[2,12,64]{2,1,0})) all-gather-start(f32[1,12,64,1,64]{4,3,2,1,0} %a, f32[1,12,64]{2,1,0} %b), channel_id=3, dimensions={0}
  %all-gather-done.3 = (f32[2,12,64,1,64]{4,3,2,1,0}, f32[2,12,64]{2,1,0}) all-gather-done(%all-gather-start.3)
  %gte = f32[2,12,64]{2,1,0} get-tuple-element(%all-gather-done.3), index=1
  %all-reduce-start = ((f32[768]{0}, bf16[768,768]{1,0}), (f32[768]{0}, bf16[768,768]{1,0})) all-reduce-start(f32[768]{0} %p, bf16[768,768]{1,0} %q), to_apply=%add
  %all-reduce-done = (f32[768]{0}, bf16[768,768]{1,0}) all-reduce-done(%all-reduce-start)
  %collective-permute.1 = s32[1,1]{1,0} collective-permute(s32[1,1]{1,0} %r), source_target_pairs={{0,1}}
  ROOT %reduce-scatter.1 = f32[1,12]{1,0} reduce-scatter(f32[2,12]{1,0} %x), channel_id=4, dimensions={0}, to_apply=%add
"""
    found = hlo_collectives(hlo)
    assert {k: v["count"] for k, v in found.items()} == {"all-gather": 1, "all-reduce": 1, "collective-permute": 1,
                                                         "reduce-scatter": 1}
    assert found["all-gather"]["largest"] == ("((f32[1,12,64,1,64], f32[1,12,64]), "
                                              "(f32[2,12,64,1,64], f32[2,12,64]))")
    assert found["all-gather"]["largest_bytes"] == 4 * (12 * 64 * 64 + 12 * 64) * 2  # the results, not the operands
    assert found["all-reduce"]["largest_bytes"] == 2 * 768 * 768 + 4 * 768
    assert found["reduce-scatter"]["largest_bytes"] == 4 * 12  # synchronous: its result
    assert found["collective-permute"]["largest"] == "s32[1,1]"
