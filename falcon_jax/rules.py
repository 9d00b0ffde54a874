"""The update rules, each reduced to the one shape every form executes.

Every rule in this library (the six Falcon rules and the baselines) is a
write of *pairs* ``(x_j, y_j)`` into a decaying matrix state (per head)::

    inner product:  S_t = γ_t ⊙ S_{t-1} + Σ_{i<W} x_{t,i} (w_{t,i} ⊙ y_{t,i})ᵀ
    regression:     S_t = γ_t ⊙ S_{t-1} + Σ_{i<W} x_{t,i} (w_{t,i} ⊙ (y_{t,i} − Ŝᵀ x_{t,i}))ᵀ

where ``(x_{t,i}, y_{t,i})`` are the last ``W`` pairs up to ``t`` (oldest
first; ``W = 1`` except for the sliding-window rules 3/3A), ``w_{t,i}`` the
write weights, ``γ_t`` the decay and ``Ŝ`` the state the residual is measured
on: the undecayed ``S_{t-1}`` for Falcon-1/2/3, the decayed ``γ_t S_{t-1}``
for Gated DeltaNet.  Weights and decays have a trailing *group* axis ``G``:
``G = 1`` for scalar gates, ``G = dv`` for the per-column rules 2/2A, where
column ``c`` of ``S`` uses gate ``c``.

A :class:`Rule` says which of these shapes a rule has and how it computes
``(w, log γ)`` from the window of write features (``gates``).  The forms in
:mod:`falcon_jax.forms` only ever see rules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

VARIANTS = ("1", "2", "3", "1A", "2A", "3A")
REGRESSION_VARIANTS = ("1", "2", "3")
PER_COLUMN_VARIANTS = ("2", "2A")
WINDOW_VARIANTS = ("3", "3A")

# gates(gram, in_win, valid, inputs) -> (w, log_gamma)
#   gram   [..., W, W]   Gram of the window's write features x_{t,i}·x_{t,j}, oldest first (current last), in at
#                        least fp32: every statistic a gate takes of the keys is a function of it
#   in_win [..., W]      bool: entry is a real pair of the current segment
#   valid  [...]         bool: the current position writes (False at the sentinel)
#   inputs dict of per-position gate inputs, [...] or [..., dv]
#   w      [..., W, G]   write weights;  log_gamma [..., G]
GateFn = Callable[[jax.Array, jax.Array, jax.Array, dict], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    regression: bool
    window: int
    alignment: str  # "shifted": x_t = k_{t-1} (with sentinel);  "same_step": x_t = k_t
    timing: str  # "raw": read S_t;  "rbw": read S_{t-1}
    decay_before_residual: bool
    gates: GateFn = dataclasses.field(compare=False)


# Windows up to this size find their top eigenvector by Jacobi rotations written elementwise (fused per sweep);
# larger ones call jnp.linalg.eigh (a solver call per batch of W × W matrices).
JACOBI_MAX_WINDOW = 8
# cyclic sweeps: the off-diagonal mass falls quadratically once it is small, so a fixed count is exact to the
# dtype's precision (the tests check fp32 and fp64 Grams against numpy's eigvalsh)
JACOBI_SWEEPS = {2: 1, 3: 5, 4: 6}


def jacobi_sweeps(n: int) -> int:
    """Cyclic Jacobi sweeps for an ``n × n`` symmetric matrix (one rotation solves ``n = 2`` exactly)."""
    return JACOBI_SWEEPS.get(n, 8)


def top_eigenvector_jacobi(gram: jax.Array, sweeps: int | None = None) -> jax.Array:
    """Unit eigenvector of the largest eigenvalue of symmetric ``[..., n, n]`` matrices: ``[..., n]``.

    Cyclic Jacobi (Golub & Van Loan, Alg. 8.5.2): each rotation ``J(p, q, θ)`` zeroes ``A[p, q]`` in
    ``Jᵀ A J`` and is accumulated into ``V``; after the sweeps ``A`` is diagonal to the dtype's precision
    and the top eigenvector is the column of ``V`` at the largest diagonal entry.  The matrix is held as
    ``n²`` arrays of the batch's shape, so each sweep is elementwise arithmetic that XLA fuses into one
    kernel — unlike a batched ``eigh``, which on a GPU is a solver call over many tiny matrices.
    """
    n = gram.shape[-1]
    if gram.shape[-2] != n:
        raise ValueError(f"gram must be square in its last two axes, got shape {gram.shape}")
    sweeps = jacobi_sweeps(n) if sweeps is None else sweeps
    a = [[gram[..., i, j] for j in range(n)] for i in range(n)]
    one, zero = jnp.ones_like(a[0][0]), jnp.zeros_like(a[0][0])
    v = [[one if i == j else zero for j in range(n)] for i in range(n)]

    def sweep(_, carry):
        a, v = [list(row) for row in carry[0]], [list(row) for row in carry[1]]
        for p in range(n - 1):
            for q in range(p + 1, n):
                apq = a[p][q]
                live = apq != 0
                tau = (a[q][q] - a[p][p]) / (2 * jnp.where(live, apq, 1))
                # the smaller root of t² + 2τt − 1 = 0 (|θ| ≤ π/4); a huge τ gives t → 0, no overflow to NaN
                t = jnp.where(tau >= 0, 1.0, -1.0) / (jnp.abs(tau) + jnp.sqrt(1 + jnp.minimum(tau * tau, 1e30)))
                t = jnp.where(live, t, 0)
                c = jax.lax.rsqrt(1 + t * t)
                s = t * c
                for k in range(n):  # rows p, q of Jᵀ A
                    a[p][k], a[q][k] = c * a[p][k] - s * a[q][k], s * a[p][k] + c * a[q][k]
                for k in range(n):  # columns p, q of (Jᵀ A) J, and of V J
                    a[k][p], a[k][q] = c * a[k][p] - s * a[k][q], s * a[k][p] + c * a[k][q]
                    v[k][p], v[k][q] = c * v[k][p] - s * v[k][q], s * v[k][p] + c * v[k][q]
                a[p][q] = a[q][p] = zero
        return a, v

    # one sweep per loop step keeps the traced graph (and the compile time) at one sweep's size
    a, v = jax.lax.fori_loop(0, sweeps, sweep, (a, v))
    diag = jnp.stack([a[i][i] for i in range(n)], axis=-1)
    top = jnp.argmax(diag, axis=-1)
    vecs = jnp.stack([jnp.stack(row, axis=-1) for row in v], axis=-2)  # [..., n (component), n (eigenvector)]
    return jnp.take_along_axis(vecs, top[..., None, None], axis=-1)[..., 0]


def window_gram(x_win: jax.Array) -> jax.Array:
    """``X Xᵀ`` of each window ``[..., W, dk]`` → ``[..., W, W]``, in at least fp32 (the recurrent step's
    gates; the whole-sequence forms take the same entries from :func:`falcon_jax.forms.stream.window_grams`).

    A product and a sum rather than a dot: exact fp32 on every backend (an fp32 dot at default precision runs
    in TF32 on a GPU)."""
    x = x_win.astype(jnp.promote_types(x_win.dtype, jnp.float32))
    return jnp.sum(x[..., :, None, :] * x[..., None, :, :], axis=-1)


def gram_lambda_max(gram: jax.Array) -> jax.Array:
    """Largest eigenvalue of each symmetric positive semi-definite ``[..., W, W]`` Gram → ``[...]``, with the
    exact gradient.

    With ``v`` the top unit eigenvector, ``λ = vᵀ G v``; ``v`` is held constant (its derivative does not move a
    simple eigenvalue), so the gradient is ``dG = v vᵀ``, and no eigenvector is differentiated (which is
    undefined for the repeated zero eigenvalues of a partially empty window).  ``v`` comes from
    :func:`top_eigenvector_jacobi` for ``W ≤ JACOBI_MAX_WINDOW``, else from ``jnp.linalg.eigh``.
    """
    held = jax.lax.stop_gradient(gram)
    if gram.shape[-1] <= JACOBI_MAX_WINDOW:
        top = top_eigenvector_jacobi(held)
    else:
        top = jnp.linalg.eigh(held)[1][..., :, -1]
    top = jax.lax.stop_gradient(top)
    return jnp.sum(top[..., :, None] * gram * top[..., None, :], axis=(-2, -1))


def window_lambda_max(x_win: jax.Array) -> jax.Array:
    """Largest eigenvalue of each window's Gram ``X Xᵀ`` (``x_win`` ``[..., W, dk]`` → ``[...]``), in at
    least fp32: :func:`gram_lambda_max` of :func:`window_gram`; the gradient w.r.t. the keys is ``2 v vᵀ X``."""
    return gram_lambda_max(window_gram(x_win))


def falcon_gates(gram, in_win, valid, inputs, *, statistic: str, step: str, scale_coupled: bool,
                 eps: float, eps_gamma: float, per_column: bool):
    """Falcon step size, decay and write weights (docs/rules.md).

    ``E_t`` is ``mean_{j∈I_t} ‖x_j‖²`` (``statistic="mean_sq_norm"``; for
    ``W = 1`` this is ``‖x_t‖²``) or ``λ_max(X_tᵀX_t)/B_t``
    (``statistic="lambda_max"``, Falcon-3); ``B_t = |I_t|``.

        λ_t = λ̄_t · sg(E_t) if scale_coupled else λ_t
        η_t = β_t / (E_t + λ_t + ε)  (step="normalized")  or  β_t  (step="direct")
        α_t = min(η_t λ_t, 1 − ε_γ),  log γ_t = log1p(−α_t)   (1 − ε_γ taken below 1 in the compute dtype)
        w_{t,i} = η_t / B_t · [pair i ∈ I_t]
    and η = α = 0 at the sentinel and wherever ``E_t + λ_t + ε = 0``.
    """
    beta, lam = inputs["beta"], inputs["lam"]
    mask = in_win.astype(gram.dtype)
    count = jnp.sum(mask, axis=-1)
    inv_count = 1.0 / jnp.maximum(count, 1.0)
    if statistic == "lambda_max":  # the Gram of the window's keys with the pairs outside I_t zeroed
        energy = gram_lambda_max(gram * mask[..., :, None] * mask[..., None, :]) * inv_count
    else:  # the squared norms are the Gram's diagonal
        energy = jnp.sum(jnp.diagonal(gram, axis1=-2, axis2=-1) * mask, axis=-1) * inv_count
    lam_eff = lam * jax.lax.stop_gradient(energy) if scale_coupled else lam
    # group axis: [..., G] with G = dv for per-column gains, else 1
    beta_g = beta if (per_column and beta.ndim == energy.ndim + 1) else beta[..., None]
    energy_g, lam_g, valid_g = energy[..., None], lam_eff[..., None], valid[..., None]
    if step == "normalized":
        denom = energy_g + lam_g + eps
        # η := 0 where the denominator vanishes (zero key, λ = 0, eps = 0: the paper's convention
        # at Eq. 3.4, the gradient is zero there); keep the unused branch finite for the gradient
        valid_g = valid_g & (denom != 0)
        eta = beta_g / jnp.where(valid_g, denom, 1.0)
    else:
        eta = beta_g
    eta = jnp.where(valid_g, eta, 0.0)
    # the cap 1 − ε_γ in the compute dtype, below 1: an ε_γ under its resolution (1e-30 in fp32) would round
    # the cap to 1, γ to 0 and log γ to −inf, whose gradient through the clamp is 0 · inf = NaN
    one = jnp.ones((), eta.dtype)
    cap = jnp.minimum(jnp.asarray(1.0 - eps_gamma, eta.dtype), jnp.nextafter(one, jnp.zeros((), eta.dtype)))
    alpha = jnp.where(valid_g, jnp.minimum(eta * lam_g, cap), 0.0)
    log_gamma = jnp.log1p(-alpha)
    w = eta[..., None, :] * (mask * inv_count[..., None])[..., :, None]
    return w, log_gamma


def falcon_rule(variant: str, *, window: int = 4, alignment: str = "shifted", timing: str = "raw",
                step: str = "normalized", scale_coupled: bool = False, eps: float = 1e-6,
                eps_gamma: float = 1e-6) -> Rule:
    """The :class:`Rule` of Falcon-``variant`` (arguments already validated)."""
    win = window if variant in WINDOW_VARIANTS else 1
    gates = functools.partial(falcon_gates,
                     statistic="lambda_max" if variant == "3" else "mean_sq_norm",
                     step=step, scale_coupled=scale_coupled, eps=eps, eps_gamma=eps_gamma,
                     per_column=variant in PER_COLUMN_VARIANTS)
    return Rule(name=f"falcon-{variant}", regression=variant in REGRESSION_VARIANTS, window=win,
                alignment=alignment, timing=timing, decay_before_residual=False, gates=gates)


def _baseline_gates(gram, in_win, valid, inputs):
    """Same-step baselines: w = β (default 1), log γ = the given log decay (default 0)."""
    like = inputs["log_decay"] if "log_decay" in inputs else inputs["beta"]
    beta = inputs.get("beta", jnp.ones_like(like))
    log_gamma = inputs.get("log_decay", jnp.zeros_like(like))
    w = jnp.where(valid, beta, 0.0)[..., None, None]
    return w.astype(gram.dtype), log_gamma[..., None].astype(gram.dtype)


def baseline_rule(name: str, *, timing: str = "raw") -> Rule:
    """``"linear_attention"`` (RetNet/Mamba-2 decayed), ``"deltanet"`` or ``"gated_deltanet"``."""
    return Rule(name=name, regression=name != "linear_attention", window=1, alignment="same_step",
                timing=timing, decay_before_residual=name == "gated_deltanet",
                gates=_baseline_gates)

