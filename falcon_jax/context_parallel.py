"""Context parallelism: one sequence split over the devices of a mesh axis, exact for every rule.

Under ``kernel_sharding(mesh, ..., seq_axis="seq")`` with ``P = mesh.shape["seq"] > 1``, :func:`falcon_jax.falcon`
and the baselines cut the sequence into ``P`` slices of ``L = ⌈T/P⌉`` positions and device ``i`` runs slice ``i``
(with its share of the batch rows and heads, as the per-shard kernels do).  A ``T`` that ``P`` does not divide is
padded at its end with identity steps (zero q, k, v and gates, the last segment id repeated: no write, no decay),
which changes no output and not the final state.

Every rule is affine in its matrix state given the inputs.  Per head and gate group (the per-column rules 2 / 2A
have one group per value column)::

    S_t = A_t S_{t−1} + (writes of the values)
    A_t = γ_t I                                  inner product (1A, 2A, 3A, decayed linear attention)
    A_t = γ_t I − Σ_i w_{t,i} x_{t,i} x_{t,i}ᵀ     regression (1, 2, 3, DeltaNet)
    A_t = γ_t (I − β_t k_t k_tᵀ)                   Gated DeltaNet

so a slice maps the state ``S_in`` it starts from to the one it ends with, and its outputs, by::

    S_end = M S_in + E,        o_t = o⁰_t + S_inᵀ M_{≤t}ᵀ q_t

with ``M = Π_t A_t`` over the slice (0 once a segment starts in it), ``M_{≤t}`` the product up to t (up to t − 1
for read-before-write), and ``E``, ``o⁰`` the final state and outputs of the slice run from ``S_in = 0``.  Each
device:

1. receives the last ``W`` tokens of the previous slice (``ppermute`` of k, v and segment ids; ``W`` is the window
   of 3 / 3A, else 1) and makes from them the non-matrix part of its starting state — the carried key and the
   window's tail pairs — with the code that makes a final state (:func:`boundary_state`); device 0 takes the
   call's initial state.  A segment starting at the slice's first position resets that state;
2. runs its slice once from ``S = 0`` (the call's form and kernels) for ``o⁰`` and ``E``.  Inner product: ``M`` and
   ``M_{≤t}`` are products of decays, the exp of cumulative log γ (one number per head and group), computed from
   the gates.  Regression: the same run carries them — its values are widened by ``dk`` zero columns per group and
   its initial state by an identity block, ``[0 | I]``, so its final state is ``[E | M]`` and its outputs
   ``[o⁰_t | M_{≤t}ᵀ q_t]`` (one triangular solve serves both);
3. all-gathers ``(M, E)`` of every slice over the axis — ``dk·dv`` (inner product: ``M`` is a scalar per group)
   or ``dk² + dk·dv`` (regression; ``dk²·dv + dk·dv`` for the per-column Falcon-2) numbers per head, whatever
   ``T`` is — and composes them in order from the call's initial state: ``S_in`` and ``S_end`` of its own slice;
4. adds ``S_inᵀ M_{≤t}ᵀ q_t`` to ``o⁰``.

The final state is that of the slice holding position ``T − 1``.  The backward is JAX's transpose of this program
(the all-gather becomes a reduce-scatter, the ppermute runs backwards).  Memory per device is ∝ ``L = T/P``;
docs/kernels.md ("Context parallelism") gives the costs.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from falcon_jax.forms.stream import final_state, segment_starts, write_pairs, write_stream
from falcon_jax.rules import Rule
from falcon_jax.sharding import KernelSharding, current, shard_map_nonempty
from falcon_jax.state import FalconState, empty_state

_warned: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call is split: ``slices`` slices of ``length`` positions over ``ks.seq_axis``; rows over ``batch``
    and heads over ``heads`` (PartitionSpec entries; None: whole on every device)."""

    ks: KernelSharding
    slices: int
    length: int
    batch: object
    heads: str | None

    @property
    def axis(self) -> str:
        return self.ks.seq_axis

    @property
    def stack_axes(self) -> tuple[str, ...]:
        batch = () if self.batch is None else (self.batch,) if isinstance(self.batch, str) else tuple(self.batch)
        return (*batch, self.axis, *([self.heads] if self.heads else []))


def plan(ks: KernelSharding | None, rule: Rule, B: int, T: int, H: int) -> Plan | None:
    """The split of a ``[B, T, H, ...]`` call under the sharding context ``ks``, or None to run it whole: no
    context or no sequence axis, fewer positions than slices (a decode step), or slices shorter than the window
    (warned: every device then holds the whole sequence)."""
    if ks is None or ks.seq_axis is None or T < ks.seq_shards:
        return None
    slices = ks.seq_shards
    length = -(-T // slices)
    if length < rule.window:
        _warn_once(("window", T, rule.window, slices),
                   f"falcon: context parallelism needs slices of at least the window's {rule.window} positions; "
                   f"T = {T} over {slices} devices gives {length}. The sequence runs whole on every device "
                   f"(correct, memory ∝ T). Use fewer devices on {ks.seq_axis!r} or a longer sequence.")
        return None
    ks.splits(B, H, "falcon", "those of each sequence slice")  # warns once where they do not
    batch = ks.batch_entry if ks.batch_axes and B % ks.batch_shards == 0 else None
    heads = ks.head_axis if ks.head_axis and H % ks.head_shards == 0 else None
    return Plan(ks, slices, length, batch, heads)


def boundary_state(rule: Rule, k, v, segment_ids) -> FalconState:
    """The non-matrix part of the state after the last of ``W = rule.window`` tokens (``S`` zero): the carried key
    and the window's ``W − 1`` tail pairs.  k ``[B, W, H, dk]``, v ``[B, W, H, dv]``, segment_ids ``[B, W]``.

    Exact for any earlier history: the tail pairs' write features are keys among these ``W`` tokens
    (``x_t = k_{t−1}`` reaches one token back) and whether they count depends only on these tokens' segment ids."""
    B, W, H, dk = k.shape
    empty = empty_state(B, H, dk, v.shape[-1], rule.window - 1, k.dtype)
    pairs = write_pairs(rule, k, v, segment_starts(segment_ids, B, W), empty, time_axis=1)
    return final_state(pairs, empty.S, k, rule, time_axis=1)


def _pad_time(a, pad: int, mode: str = "constant"):
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, pad)
    return jnp.pad(a, widths, mode=mode)


def _groups(inputs: dict) -> int:
    """Gate groups G: one per value column for per-column gains (``[B, T, H, dv]`` inputs), else 1."""
    return max([a.shape[-1] for a in inputs.values() if a.ndim == 4], default=1)


def run(plan: Plan, rule: Rule, forward_for, q, k, v, inputs: dict, segment_ids, state: FalconState):
    """The rule on a sequence split by ``plan``: ``(o [B, T, H, dv] unscaled, final state)``.

    ``forward_for(width)`` gives the rule's forward on one slice with values ``width`` wide,
    ``forward(q, k, v, inputs, resets, state) -> (o, final)`` (q, k, v, inputs ``[B, L, H, ...]`` in the compute
    dtype).  q, k, v, inputs and ``state`` as in :func:`falcon_jax.falcon.run_rule`, cast."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    n, L, axis = plan.slices, plan.length, plan.axis
    pad = n * L - T
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    b, h = plan.batch, plan.heads
    if pad:
        # the un-padded arrays stay whole on the sequence axis, as the padded shard_map's operands and results are
        # gathered over it anyway: left free, XLA's partitioner split them unevenly over it, and the transpose of
        # an embedding lookup before them (a scatter-add) then added the padding positions' cotangents to the
        # table's row 0
        q, k, v, segment_ids = (_whole_on_seq(plan, a) for a in (q, k, v, jnp.asarray(segment_ids)))
        inputs = {name: _whole_on_seq(plan, a) for name, a in inputs.items()}
    q, k, v = (_pad_time(a, pad) for a in (q, k, v))
    inputs = {name: _pad_time(a, pad) for name, a in inputs.items()}
    segment_ids = _pad_time(jnp.asarray(segment_ids), pad, mode="edge")
    # the call's state reaches every device (device 0 starts from it, every device composes the maps from its S)
    stacked = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[None], (n, *a.shape)), state)

    tok, rows = P(b, axis, h), P(b, axis)
    state_spec = FalconState(S=P(axis, b, h), last_key=P(axis, b, h), has_key=P(axis, b), tail_x=P(axis, b, h),
                             tail_y=P(axis, b, h), tail_valid=P(axis, b))
    # the final state is read at position T − 1: slice `last`, local position `end` − 1
    last = (T - 1) // L
    end = T - last * L

    def body(q, k, v, inputs, segment_ids, stacked):
        o, S_end, enter_final = _slice(rule, forward_for, q, k, v, inputs, segment_ids,
                                       jax.tree_util.tree_map(lambda a: a[0], stacked), axis=axis, slices=n, end=end)
        final = enter_final.replace(S=S_end)
        return o, jax.tree_util.tree_map(lambda a: a[None], final)

    fn = shard_map_nonempty(body, plan.ks.mesh, (tok, tok, tok, {name: tok for name in inputs}, rows, state_spec),
                            (tok, state_spec), plan.stack_axes)
    o, finals = fn(q, k, v, inputs, segment_ids, stacked)
    o = _whole_on_seq(plan, o[:, :T]) if pad else o
    return o, jax.tree_util.tree_map(lambda a: a[last], finals)


def _whole_on_seq(plan: Plan, a):
    """``a [B, T, ...]`` pinned to rows over the plan's batch axes and heads (axis 2) over its head axis, and whole
    on the sequence axis."""
    spec = P(plan.batch, None, plan.heads) if a.ndim > 2 else P(plan.batch, None)
    return jax.lax.with_sharding_constraint(a, NamedSharding(plan.ks.mesh, spec))


def _slice(rule: Rule, forward_for, q, k, v, inputs, segment_ids, state: FalconState, *, axis: str, slices: int,
           end: int):
    """One device's slice (inside the shard_map): ``(o⁰ + correction, S_end, non-matrix state after local
    position end − 1)``."""
    B, L, H, dk = q.shape
    dv = v.shape[-1]
    W = rule.window
    index = jax.lax.axis_index(axis)
    first = index == 0
    # 1. the previous slice's last W tokens, and the state this slice starts from
    halo = jax.tree_util.tree_map(lambda a: from_previous_device(a, W, axis, slices), (k, v, segment_ids))
    received = boundary_state(rule, *halo)
    enter = jax.tree_util.tree_map(lambda mine, got: jnp.where(first, mine, got), state, received)
    reset = ~first & (segment_ids[:, 0] != halo[2][:, -1])  # [B] a segment starts at the slice's first position
    enter = enter.replace(has_key=enter.has_key & ~reset, tail_valid=enter.tail_valid & ~reset[:, None])
    resets = segment_starts(segment_ids, B, L)

    # 2. o⁰, E and the affine map (M, M_{≤t}) of the slice
    G = _groups(inputs)
    dg = dv // G
    if rule.regression:
        def widen(a, zeros_like_identity):  # [..., dv] -> [..., G (dg + dk)]: each group's columns, then dk more
            a = a.reshape(*a.shape[:-1], G, dg)
            wide = jnp.concatenate([a, zeros_like_identity(a.shape[:-1])], axis=-1)
            return wide.reshape(*a.shape[:-2], G * (dg + dk))

        zeros = lambda shape: jnp.zeros((*shape, dk), v.dtype)  # noqa: E731
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=v.dtype)[:, None, :], (dk, G, dk))
        identity = lambda shape: jnp.broadcast_to(eye, (*shape[:-2], dk, G, dk))  # noqa: E731
        start = enter.replace(S=widen(jnp.zeros((B, H, dk, dv), v.dtype), identity),
                              tail_y=widen(enter.tail_y, zeros))
        o_wide, fin = forward_for(G * (dg + dk))(q, k, widen(v, zeros), inputs, resets, start)
        o_wide = o_wide.reshape(B, L, H, G, dg + dk)
        o0, read = o_wide[..., :dg], o_wide[..., dg:]  # read[t] = M_{≤t}ᵀ q_t  [B, L, H, G, dk]
        S_wide = fin.S.reshape(B, H, dk, G, dg + dk)
        E, M = S_wide[..., :dg], S_wide[..., dg:]  # [B, H, dk, G, dg], [B, H, dk, G, dk]
        M = jnp.where(reset[:, None, None, None, None], 0.0, M)
    else:
        o0, fin = forward_for(dv)(q, k, v, inputs, resets, enter.replace(S=jnp.zeros((B, H, dk, dv), v.dtype)))
        o0 = o0.reshape(B, L, H, G, dg)
        E = fin.S.reshape(B, H, dk, G, dg)
        stream = write_stream(rule, k, v, inputs, resets, enter, time_axis=1)
        log_gamma = stream.log_gamma  # [B, L, H, G]
        g = jnp.cumsum(log_gamma, axis=1)
        same = (stream.run == 0)[:, :, None, None]  # still in the segment the slice starts in
        read = jnp.where(same, jnp.exp(g if rule.timing == "raw" else g - log_gamma), 0.0)  # [B, L, H, G]
        M = jnp.where(((stream.run[:, -1] == 0) & ~reset)[:, None, None], jnp.exp(g[:, -1]), 0.0)  # [B, H, G]

    def apply(M, S):  # M S_in per group: S [B, H, dk, G, dg]
        if rule.regression:
            return jnp.einsum("bhkgj,bhjgd->bhkgd", M, S)
        return M[:, :, None, :, None] * S

    # 3. every slice's map, composed in order from the call's initial state
    Ms, Es = jax.lax.all_gather(M, axis), jax.lax.all_gather(E, axis)
    S0 = state.S.reshape(B, H, dk, G, dg)

    def compose(S, map_):
        S = apply(map_[0], S) + map_[1]
        return S, S

    _, ends = jax.lax.scan(compose, S0, (Ms, Es))  # ends[j] = S_end of slice j
    before = jnp.concatenate([S0[None], ends[:-1]], axis=0)[index]
    S_in = jnp.where(reset[:, None, None, None, None], 0.0, before)
    S_end = ends[index]

    # 4. the outputs' share of S_in
    if rule.regression:
        o = o0 + jnp.einsum("blhgk,bhkgd->blhgd", read, S_in)
    else:
        o = o0 + read[..., None] * jnp.einsum("blhk,bhkgd->blhgd", q, S_in)
    ext = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], axis=1), halo, (k, v, segment_ids))
    after = boundary_state(rule, *(a[:, end:end + W] for a in ext))
    return o.reshape(B, L, H, dv), S_end.reshape(B, H, dk, dv), after


def from_previous_device(a, count: int, axis: str, devices: int):
    """Inside a shard_map over ``axis``: the previous device's last ``count`` positions of ``a`` (axis 1; zeros on
    device 0)."""
    return jax.lax.ppermute(a[:, a.shape[1] - count:], axis, [(i, i + 1) for i in range(devices - 1)])


def halo_map(fn, arrays: tuple, params: tuple, *, halo: int):
    """A causal window op over the sequence axis of the active context, each device on its own slice.

    ``arrays``: ``[B, T]`` or ``[B, T, C]`` arrays (or None, passed on as None); ``params``: ``[..., C]`` arrays
    (channel last, e.g. a depthwise kernel ``[K, C]``).  Each device calls ``fn(*extended, *params)`` with its
    slice of every array extended in front by the ``halo`` positions before it (the previous device's last
    ``halo``, by ``ppermute``; zeros before position 0) and gets ``[B, L, C]`` for its own ``L`` positions.  Channels
    split over the head axis where it divides them.  Returns None — the caller computes the whole sequence — without
    a sequence axis, or when ``T`` is not a multiple of it or its slices are shorter than ``halo``."""
    ks = current()
    present = [a for a in arrays if a is not None]
    B, T = present[0].shape[:2]
    if ks is None or ks.seq_axis is None or T % ks.seq_shards or T // ks.seq_shards < halo:
        return None
    axis, n = ks.seq_axis, ks.seq_shards
    b = ks.batch_entry if ks.batch_axes and B % ks.batch_shards == 0 else None
    C = present[0].shape[-1] if present[0].ndim == 3 else None
    h = ks.head_axis if ks.head_axis and C and C % ks.head_shards == 0 else None
    spec = lambda a: P(b, axis, h) if a.ndim == 3 else P(b, axis)  # noqa: E731

    def body(*local):
        extended = []
        for a in local[:len(present)]:
            extended.append(jnp.concatenate([from_previous_device(a, halo, axis, n), a], axis=1))
        it = iter(extended)
        return fn(*[None if a is None else next(it) for a in arrays], *local[len(present):])

    in_specs = tuple(spec(a) for a in present) + tuple(P(*([None] * (p.ndim - 1)), h) for p in params)
    return jax.shard_map(body, mesh=ks.mesh, in_specs=in_specs, out_specs=P(b, axis, h),
                         check_vma=False)(*present, *params)
