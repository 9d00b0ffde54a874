"""Gradients: the three forms agree in fp64, and the recurrent form matches finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from falcon_jax import FalconState, falcon
from tests.helpers import ALL_VARIANTS, FORMS, make_initial_state, make_inputs, make_segment_ids, rel_err

TOL = 1e-8
B, T, H, DK, DV = 3, 12, 2, 4, 3
CHUNK = 4
WINDOW = 3
ARG_NAMES = ("q", "k", "v", "beta", "lam", "S0", "last_key", "tail_x", "tail_y")


def make_loss(variant, form, w, seg, init, opts, *, chunk_size=CHUNK, window=WINDOW):
    """loss(q, k, v, beta, lam, S0, last_key, tail_x, tail_y) = <w, falcon(...)>.

    The boolean state fields (has_key, tail_valid) are closed over; the float ones
    are arguments so that their gradients are checked too (ignored when init is None).
    """
    seg = None if seg is None else jnp.asarray(seg)

    def loss(q, k, v, beta, lam, S0, last_key, tail_x, tail_y):
        state = None
        if init is not None:
            state = FalconState(S=S0, last_key=last_key, has_key=jnp.asarray(init["has_key"]),
                                tail_x=tail_x, tail_y=tail_y, tail_valid=jnp.asarray(init["tail_valid"]))
        out = falcon(q, k, v, beta, lam, variant=variant, window=window, form=form, chunk_size=chunk_size,
                     segment_ids=seg, initial_state=state, **opts)
        return jnp.sum(out * w)

    return loss


def _args(arrays, init):
    if init is None:
        init_args = (np.zeros((1,)),) * 4  # unused placeholders
    else:
        init_args = tuple(init[n] for n in ("S", "last_key", "tail_x", "tail_y"))
    return tuple(jnp.asarray(a) for a in (*arrays, *init_args))


GRAD_CASES = {
    "default": dict(),
    "seg+init+coupled+rbw": dict(segments=True, initial_state=True, scale_coupled=True, timing="rbw"),
    "same_step+direct+seg+init": dict(alignment="same_step", step="direct", segments=True, initial_state=True),
}


# every variant with everything switched on; the default and the same-step/direct paths for
# half of the variants each (every rule family: regression / inner product, scalar / per
# column / window)
GRAD_GRID = ([(v, "seg+init+coupled+rbw") for v in ALL_VARIANTS]
             + [(v, "default") for v in ("1", "2A", "3")] + [("3A", "same_step+direct+seg+init")])


@pytest.mark.parametrize("variant,case", GRAD_GRID)
def test_forms_have_equal_gradients(rng, variant, case):
    opts = dict(GRAD_CASES[case])
    segments = opts.pop("segments", False)
    with_init = opts.pop("initial_state", False)
    arrays = make_inputs(rng, variant=variant, B=B, T=T, H=H, dk=DK, dv=DV, step=opts.get("step", "normalized"))
    seg = make_segment_ids(rng, B, T) if segments else None
    init = make_initial_state(rng, variant=variant, window=WINDOW, B=B, H=H, dk=DK, dv=DV) if with_init else None
    w = jnp.asarray(rng.standard_normal((B, T, H, DV)))
    args = _args(arrays, init)
    argnums = tuple(range(9 if with_init else 5))
    grads = {}
    for form in FORMS:
        g = jax.jit(jax.grad(make_loss(variant, form, w, seg, init, opts), argnums=argnums))(*args)
        grads[form] = [np.asarray(x) for x in g]
    for form in ("parallel", "chunk"):
        for name, a, b in zip(ARG_NAMES, grads[form], grads["recurrent"]):
            assert np.all(np.isfinite(a)), f"{form} d/d{name} not finite"
            err = rel_err(a, b)
            assert err <= TOL, f"{variant}/{case}: {form} vs recurrent d/d{name}: rel err {err:.2e}"
    # the gradients are not trivially zero
    unused = set()
    if variant not in ("3", "3A"):
        unused |= {"tail_x", "tail_y"}  # no window tail
    if opts.get("alignment") == "same_step":
        unused.add("last_key")  # x_0 = k_0, the carried key is not read
    if init is not None and seg is not None:
        # a segment start at t = 1 wipes whatever the carried key / tail wrote at t = 0
        cont = [b for b in range(B) if seg[b, 1] == seg[b, 0]]
        if not any(init["has_key"][b] for b in cont):
            unused.add("last_key")
        if not any(init["tail_valid"][b].any() for b in cont):
            unused |= {"tail_x", "tail_y"}
    for name, g in zip(ARG_NAMES, grads["recurrent"]):
        if name not in unused:
            assert np.max(np.abs(g)) > 1e-6, f"d/d{name} vanished"


FD_CASES = {
    "default": dict(),
    "same_step+rbw": dict(alignment="same_step", timing="rbw"),
    "direct": dict(step="direct"),
}


FD_GRID = [(v, "default") for v in ALL_VARIANTS] + [("3", "same_step+rbw"), ("2", "direct")]


@pytest.mark.parametrize("variant,case", FD_GRID)
def test_recurrent_gradient_matches_finite_differences(rng, variant, case):
    """Central differences along random joint directions of all inputs (and the initial state).

    Unit-norm keys, beta in (0.2, 1.8) (direct: (0.1, 0.9)) and lam in (0.05, 0.3) keep
    alpha = eta*lam <= 0.7 (E >= 1/W = 0.5 for Falcon-3), well below the clamp 1 - eps_gamma, so
    the function is smooth there; scale_coupled is not used here because its stop-gradient
    makes the gradient differ from the derivative on purpose.
    """
    opts = FD_CASES[case]
    b, t, h, dk, dv = 2, 6, 1, 3, 2
    window = 2
    q, k, v, beta, lam = make_inputs(rng, variant=variant, B=b, T=t, H=h, dk=dk, dv=dv,
                                     beta_range=(0.2, 1.8) if "step" not in opts else (0.1, 0.9),
                                     lam_range=(0.05, 0.3))
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    arrays = (q, unit(k), v, beta, lam)
    seg = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], np.int32)
    init = make_initial_state(rng, variant=variant, window=window, B=b, H=h, dk=dk, dv=dv)
    init["last_key"], init["tail_x"] = unit(init["last_key"]), unit(init["tail_x"])
    w = jnp.asarray(rng.standard_normal((b, t, h, dv)))
    loss = make_loss(variant, "recurrent", w, seg, init, opts, window=window)
    args = _args(arrays, init)
    f = jax.jit(loss)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(9))))(*args)
    eps = 1e-5
    for _ in range(4):
        d = [jnp.asarray(rng.standard_normal(a.shape)) for a in args]
        plus = f(*[a + eps * da for a, da in zip(args, d)])
        minus = f(*[a - eps * da for a, da in zip(args, d)])
        fd = float(plus - minus) / (2 * eps)
        an = float(sum(jnp.sum(g * da) for g, da in zip(grad, d)))
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), f"FD {fd:.10f} vs grad {an:.10f}"
    # and per argument, one direction each, so an error in a single input cannot hide
    for i, name in enumerate(ARG_NAMES):
        d = jnp.asarray(rng.standard_normal(args[i].shape))
        fd = float(f(*[a + eps * d if j == i else a for j, a in enumerate(args)])
                   - f(*[a - eps * d if j == i else a for j, a in enumerate(args)])) / (2 * eps)
        an = float(jnp.sum(grad[i] * d))
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), f"d/d{name}: FD {fd:.10f} vs grad {an:.10f}"
