"""The operations the benchmarks measure, by name: what each computes, which inputs it reads and how it is called.

Every operation reads one set of inputs per shape ``B×T×H×D`` (:func:`make_inputs`): bf16 q, k, v with unit keys
and queries of norm about 1, fp32 gates β ~ U(0.1, 1.9), λ ~ U(0, 0.05), log decay ~ −U(0.001, 0.1), and for the
per-column rules β scaled by 0.9…1.1 across the value columns (the gains differ per column).  The peers get the
same mathematics through their own conventions:

* jax-linear-attention 0.1.0 (``jla.ops.linear_attention(kind, ..., impl="mosaic_gpu")``): ``simple_gla`` with
  ``g = log decay`` (decayed linear attention, Falcon-1A's recurrence with η folded into v), ``gated_deltanet``
  with ``beta`` (in the tokens' dtype) and ``g = log decay`` (Falcon-1's nearest peer: the residual read from
  the decayed state), ``deltanet`` with ``beta``;
* fla 0.6.0 (torch, the same distributions drawn by torch): ``chunk_simple_gla(q, k, v, g)``,
  ``chunk_gated_delta_rule(q, k, v, g, beta)``, ``chunk_delta_rule(q, k, v, beta)`` with β ~ U(0, 1) in bf16;
* cuDNN causal softmax attention, ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
  implementation="cudnn")``.

Forward+backward differentiates every floating input with a cotangent of ones.  Nothing here imports jax or
torch at module level: ``run.py`` reads the catalogue without starting either.
"""

from __future__ import annotations

import dataclasses

from benchmarks.common import select_names


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    family: str  # "falcon" (ours), "baseline" (ours: the library's baselines) or "peer"
    args: tuple[str, ...]  # the inputs it reads (make_inputs' names); torch ops: ()
    description: str
    needs: str | None = None  # "jla", "fla" or "gpu" (cuDNN): skipped where that is missing
    slow: bool = False  # measured at the first shape only unless asked for
    variant: str | None = None  # our Falcon ops: the variant, when the name is not "falcon-<variant>"
    impl: str | None = None  # our ops: this implementation whatever the suite passes (e.g. "xla")

    @property
    def torch(self) -> bool:
        return self.needs == "fla"


FALCON_ARGS = ("q", "k", "v", "beta", "lam")
OPS = [
    Op("falcon-1A", "falcon", FALCON_ARGS, "falcon(variant='1A')"),
    Op("falcon-3A", "falcon", FALCON_ARGS, "falcon(variant='3A', window=4)"),
    Op("falcon-1", "falcon", FALCON_ARGS, "falcon(variant='1')"),
    Op("falcon-3", "falcon", FALCON_ARGS, "falcon(variant='3', window=4)"),
    Op("falcon-3-xla", "falcon", FALCON_ARGS, "falcon(variant='3', window=4, impl='xla'): the compact chunk form in XLA",
       slow=True, variant="3", impl="xla"),
    Op("falcon-2", "falcon", ("q", "k", "v", "beta_col", "lam"), "falcon(variant='2'), per-column gains", slow=True),
    Op("falcon-2A", "falcon", ("q", "k", "v", "beta_col", "lam"), "falcon(variant='2A'), per-column gains",
       slow=True),
    Op("linear-attention", "baseline", ("q", "k", "v", "log_decay"), "decayed_linear_attention(q, k, v, log_decay)"),
    Op("deltanet", "baseline", ("q", "k", "v", "beta"), "deltanet(q, k, v, beta)"),
    Op("gated-deltanet", "baseline", ("q", "k", "v", "beta", "log_decay"),
       "gated_deltanet(q, k, v, beta, log_decay)"),
    Op("jla:simple_gla", "peer", ("q", "k", "v", "log_decay"), "jla 0.1.0 simple_gla, impl='mosaic_gpu'", "jla"),
    Op("jla:gated_deltanet", "peer", ("q", "k", "v", "beta", "log_decay"),
       "jla 0.1.0 gated_deltanet, impl='mosaic_gpu'", "jla"),
    Op("jla:deltanet", "peer", ("q", "k", "v", "beta"), "jla 0.1.0 deltanet, impl='mosaic_gpu'", "jla"),
    Op("fla:chunk_simple_gla", "peer", (), "fla 0.6.0 chunk_simple_gla (torch)", "fla"),
    Op("fla:chunk_gated_delta_rule", "peer", (), "fla 0.6.0 chunk_gated_delta_rule (torch)", "fla"),
    Op("fla:chunk_delta_rule", "peer", (), "fla 0.6.0 chunk_delta_rule (torch)", "fla"),
    Op("cudnn:softmax", "peer", ("q", "k", "v"), "cuDNN causal softmax attention (jax.nn.dot_product_attention)",
       "gpu"),
]
BY_NAME = {op.name: op for op in OPS}
WINDOW = 4  # Falcon-3 / 3A


def select(patterns: str | None, default: list[str], allowed=None) -> list[Op]:
    """The ops named by ``patterns`` (comma-separated names or shell patterns, e.g. ``'falcon-*,jla:*'``; None:
    ``default``), in catalogue order, limited to ``allowed`` (a predicate).  A pattern matching nothing is an
    error naming the choices."""
    allowed = allowed or (lambda op: True)
    names = [op.name for op in OPS if allowed(op)]
    if patterns is None:
        return [BY_NAME[n] for n in names if n in default]
    return [BY_NAME[n] for n in select_names(patterns, names, "--rules", "op")]


# ---- inputs -------------------------------------------------------------------------------------------------

def make_inputs(shape, seed: int = 0, abstract: bool = False) -> dict:
    """``{name: array}`` for a ``(B, T, H, D)`` shape (see the module docstring); ``abstract``: the same as
    ``jax.ShapeDtypeStruct`` (nothing allocated: the memory suite compiles only)."""
    import jax
    import jax.numpy as jnp

    B, T, H, D = shape
    bf16, f32 = jnp.bfloat16, jnp.float32
    if abstract:
        token, gate = jax.ShapeDtypeStruct((B, T, H, D), bf16), jax.ShapeDtypeStruct((B, T, H), f32)
        return {"q": token, "k": token, "v": token, "beta": gate, "lam": gate, "log_decay": gate,
                "beta_col": jax.ShapeDtypeStruct((B, T, H, D), f32)}
    keys = jax.random.split(jax.random.key(seed), 6)
    k = jax.random.normal(keys[1], (B, T, H, D), f32)
    inputs = {
        "q": (jax.random.normal(keys[0], (B, T, H, D), f32) / D**0.5).astype(bf16),
        "k": (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(bf16),
        "v": jax.random.normal(keys[2], (B, T, H, D), f32).astype(bf16),
        "beta": jax.random.uniform(keys[3], (B, T, H), f32, 0.1, 1.9),
        "lam": jax.random.uniform(keys[4], (B, T, H), f32, 0.0, 0.05),
        "log_decay": -jax.random.uniform(keys[5], (B, T, H), f32, 0.001, 0.1),
    }
    inputs["beta_col"] = inputs["beta"][..., None] * jnp.linspace(0.9, 1.1, D, dtype=f32)
    return inputs


# ---- JAX ops --------------------------------------------------------------------------------------------------

def jax_fn(name: str, impl):
    """The op as a function of its inputs (:attr:`Op.args`), returning the output ``[B, T, H, D]``; ``impl``:
    what our ops pass as ``impl=`` (``"auto"``, a name or sequence of names, or ``"pallas"`` in the older API)."""
    if name.startswith("falcon-"):
        from falcon_jax import falcon

        op = BY_NAME[name]
        variant = op.variant or name.split("-", 1)[1]
        kw = {"window": WINDOW} if variant in ("3", "3A") else {}
        impl = op.impl or impl
        return lambda q, k, v, beta, lam: falcon(q, k, v, beta, lam, variant=variant, impl=impl, **kw)
    if name == "linear-attention":
        from falcon_jax import decayed_linear_attention

        return lambda q, k, v, log_decay: decayed_linear_attention(q, k, v, log_decay, impl=impl)
    if name == "deltanet":
        from falcon_jax import deltanet

        return lambda q, k, v, beta: deltanet(q, k, v, beta, impl=impl)
    if name == "gated-deltanet":
        from falcon_jax import gated_deltanet

        return lambda q, k, v, beta, log_decay: gated_deltanet(q, k, v, beta, log_decay, impl=impl)
    if name.startswith("jla:"):
        import jla.ops

        kind = name[4:]

        def jla_op(q, k, v, *gates):
            kw = {"g": gates[0]} if kind == "simple_gla" else {"beta": gates[0].astype(q.dtype)}
            if kind == "gated_deltanet":
                kw["g"] = gates[1]
            return jla.ops.linear_attention(kind, q, k, v, impl="mosaic_gpu", **kw)[0]
        return jla_op
    if name == "cudnn:softmax":
        import jax

        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    raise KeyError(f"{name} is not a JAX op")


def fwd_and_bwd(fn, n_args: int):
    """``(fwd, fwd+bwd)`` jitted: the output, and the gradients of every input under a cotangent of ones."""
    import jax
    import jax.numpy as jnp

    def both(*args):
        out, vjp = jax.vjp(fn, *args[:n_args])
        return vjp(jnp.ones_like(out))

    return jax.jit(fn), jax.jit(both)


def served_by(name: str, inputs: dict, candidates) -> str:
    """Which of ``candidates`` (implementation names, tried in order as ``impl="auto"`` does) serves one of our
    ops on these inputs: the first whose trace does not decline (``jax.eval_shape``: nothing runs)."""
    import jax

    op = BY_NAME[name]
    args = [inputs[a] for a in op.args]
    for candidate in candidates:
        try:
            jax.eval_shape(jax_fn(name, candidate), *args)
            return candidate
        except NotImplementedError:
            continue
    return "none"


# ---- torch ops (fla) ------------------------------------------------------------------------------------------

def torch_calls(name: str, shape, seed: int = 0):
    """``(fwd, fwd+bwd)`` no-argument calls of an fla op on CUDA tensors drawn as :func:`make_inputs` draws ours
    (β ~ U(0, 1) in bf16); the backward sums the output and runs ``backward()`` through every floating input."""
    import torch

    B, T, H, D = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*size, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*size, device="cuda", generator=gen) * scale).to(dtype)

    q = draw(B, T, H, D, scale=D**-0.5)
    k = torch.nn.functional.normalize(draw(B, T, H, D, dtype=torch.float32), dim=-1).to(torch.bfloat16)
    v = draw(B, T, H, D)
    g = -torch.rand(B, T, H, device="cuda", generator=gen) * 0.1
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(torch.bfloat16)
    kind = name[4:]
    if kind == "chunk_simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla as fn
        gates = {"g": g}
    elif kind == "chunk_gated_delta_rule":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        gates = {"g": g, "beta": beta}
    elif kind == "chunk_delta_rule":
        from fla.ops.delta_rule import chunk_delta_rule as fn
        gates = {"beta": beta}
    else:
        raise KeyError(f"{name} is not an fla op")
    leaf = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
    tokens, leaf_gates = [leaf(t) for t in (q, k, v)], {key: leaf(t) for key, t in gates.items()}

    def fwd_bwd():
        out, _ = fn(*tokens, **leaf_gates)
        out.sum().backward()

    return (lambda: fn(q, k, v, **gates)), fwd_bwd
