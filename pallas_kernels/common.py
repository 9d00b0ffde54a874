"""Helpers shared by the kernel ops: the Triton launch parameters, dot precision, the Mosaic GPU SMEM tiles
and products, the poisoned-outputs testing aid, shape checks and the sequence split into pieces."""

from __future__ import annotations

import contextlib
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # the Triton lowering is chosen by its compiler params (without them a GPU kernel goes to Mosaic GPU)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unit_lower_inverse(N, precision=None):
    """``(I + N)⁻¹`` for strictly lower-triangular ``N [..., C, C]``, by merging diagonal blocks of doubling
    size, ``[[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]``: log₂ C levels of batched matmuls.

    The XLA forms use it instead of ``lax.linalg.triangular_solve``: on the CPU (jaxlib 0.10) that is a batched
    LAPACK call which waits on XLA's own thread pool, and two of them running at once (a gradient's solves)
    can deadlock the pool."""
    C = N.shape[-1]
    size = next_pow2(C)
    N = jnp.pad(N, [(0, 0)] * (N.ndim - 2) + [(0, size - C), (0, size - C)])
    blocks = jnp.ones((*N.shape[:-2], size, 1, 1), N.dtype)  # the 1 × 1 diagonal blocks of I + N
    s = 1
    while s < size:
        j = jnp.arange(size // (2 * s))[:, None, None]
        a = jnp.arange(s)
        B = N[..., 2 * s * j + s + a[:, None], 2 * s * j + a[None, :]]  # [..., size / 2s, s, s]
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        low = -jnp.einsum("...ij,...jk,...kl->...il", second, B, first, precision=precision)
        blocks = jnp.concatenate([jnp.concatenate([first, jnp.zeros_like(first)], axis=-1),
                                  jnp.concatenate([low, second], axis=-1)], axis=-2)
        s *= 2
    return blocks[..., 0, :C, :C]


LAYOUTS = ("BHTD", "BTHD")  # the ops' token layouts: [B, H, T, d] or the model's [B, T, H, d]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS} (the order of the axes of q, x, y); got {layout!r}.")


def check_operands(op: str, q, x, y, gates: dict, run, initial_state, *, chunk_size, layout: str = "BHTD",
                   per_column: bool = False, extra: int = 0) -> tuple[int, int, int, int, int]:
    """A kernel op's operands checked on their static shapes and dtypes (Python, at trace time: nothing is added
    to the computation), before a lowering is chosen.  Without these checks mismatched operands broadcast, or the
    kernels read past an operand's end, and the op returns numbers without an error.

    ``gates``: ``{name: array}``, each ``[B, H, T]`` (``[B, T, H]`` under ``"BTHD"``), also ``[..., dv]`` when
    ``per_column``; ``extra``: how many more rows x and y have than q (the windowed op's W − 1 older pairs).
    Returns ``(B, T, H, dk, dv)``; errors name the op, the argument and the shape wanted."""
    check_layout(layout)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"{op}: `chunk_size` must be an int >= 1 (the kernels take a power of two >= 16, e.g. 64); "
                         f"got {chunk_size!r}.")
    time_major = layout == "BTHD"
    axes = "B, T, H" if time_major else "B, H, T"

    def lead(B, T, H):
        return (B, T, H) if time_major else (B, H, T)

    for name, a in (("q", q), ("x", x), ("y", y), ("initial_state", initial_state)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{op}: `{name}` must be an array; got {type(a).__name__}.")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{op}: `{name}` must be a floating-point array (bf16, fp16 or fp32); got dtype {a.dtype}.")
    if q.ndim != 4:
        raise ValueError(f"{op}: `q` must be [{axes}, dk] (rank 4, layout={layout!r}); got shape {tuple(q.shape)}.")
    B, T, H, dk = (q.shape if time_major else (q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
    if T < 1:
        raise ValueError(f"{op}: `q` must have at least one time step; got shape {tuple(q.shape)}.")
    rows = f"T + {extra} = {T + extra}" if extra else "T"
    want_x = (*lead(B, T + extra, H), dk)
    if tuple(x.shape) != want_x:
        raise ValueError(f"{op}: `x` must be [{axes}{' + ' + str(extra) if extra else ''}, dk] = {list(want_x)} "
                         f"(B, H, dk of `q`, {rows} rows, layout={layout!r}); got {tuple(x.shape)}.")
    if y.ndim != 4 or tuple(y.shape[:3]) != want_x[:3]:
        raise ValueError(f"{op}: `y` must be [{axes}{' + ' + str(extra) if extra else ''}, dv] with the leading "
                         f"dims {list(want_x[:3])} of `x`; got {tuple(y.shape)}.")
    dv = y.shape[3]
    if dk < 1 or dv < 1:
        raise ValueError(f"{op}: the head dims must be >= 1; got dk = {dk}, dv = {dv}.")
    dtypes = {name: jnp.dtype(a.dtype) for name, a in (("q", q), ("x", x), ("y", y))}
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{op}: `q`, `x` and `y` must have one dtype (the kernels' input dtype); got {got}. Cast "
                        f"them with .astype(q.dtype).")
    gate_shape = lead(B, T, H)
    allowed = [gate_shape] + ([(*gate_shape, dv)] if per_column else [])
    for name, a in gates.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{op}: `{name}` must be a floating-point array; got "
                            f"{getattr(a, 'dtype', type(a).__name__)}.")
        if tuple(a.shape) not in allowed:
            wants = " or ".join(str(list(s)) for s in allowed)
            raise ValueError(f"{op}: `{name}` must be [{axes}]{' or [' + axes + ', dv]' if per_column else ''} = "
                             f"{wants} (layout={layout!r}); got {tuple(a.shape)}.")
    if not hasattr(run, "shape") or not hasattr(run, "dtype") or not jnp.issubdtype(run.dtype, jnp.integer):
        raise TypeError(f"{op}: `run` must be an integer array [{axes}] (the number of segment starts up to each "
                        f"step, e.g. jnp.zeros(..., jnp.int32)); got {getattr(run, 'dtype', type(run).__name__)}.")
    if tuple(run.shape) != gate_shape:
        raise ValueError(f"{op}: `run` must be [{axes}] = {list(gate_shape)} (layout={layout!r}); got "
                         f"{tuple(run.shape)}.")
    if tuple(initial_state.shape) != (B, H, dk, dv):
        raise ValueError(f"{op}: `initial_state` must be [B, H, dk, dv] = {[B, H, dk, dv]} (whatever the layout); "
                         f"got {tuple(initial_state.shape)}.")
    return B, T, H, dk, dv


# A step's log decay below this counts as this (γ = e^-30 = 9e-14, a reset to within fp32 rounding): in the kernel
# ops (floor_log_decay says why) and in the baselines' gates (falcon_jax.validation)
LOG_DECAY_FLOOR = -30.0


def floor_log_decay(log_decay):
    """``log_decay`` with every entry below :data:`LOG_DECAY_FLOOR` raised to it (NaN stays NaN; zero gradient
    where raised).  The chunk forms subtract cumulative sums of log decays: one step of −1e30 (or −inf, a hard
    reset) leaves the later small decays of its chunk to rounding, and −inf − (−inf) is NaN."""
    return jnp.maximum(log_decay, jnp.asarray(LOG_DECAY_FLOOR, log_decay.dtype))


def empty_result(B: int, T: int, H: int, dk: int, dv: int, dtype, layout: str = "BHTD"):
    """``(o, final_state)`` of an op over no batch rows or no heads (``B·H = 0``), in the shapes, layout and
    dtypes a call returns (outputs in ``dtype``, the state fp32): the kernels' grids and the windowed op's
    chunks cannot be empty, so the ops return this before any lowering."""
    o_shape = (B, T, H, dv) if layout == "BTHD" else (B, H, T, dv)
    return jnp.zeros(o_shape, dtype), jnp.zeros((B, H, dk, dv), jnp.float32)


def check_pieces(op: str, pieces) -> None:
    """``pieces``: None (chosen by the program count) or a power of two >= 1.  The piece scans reshape the
    chunks into ``pieces`` equal groups; another count fails deep inside, or cuts them unevenly."""
    if pieces is not None and (isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer)) or pieces < 1
                               or pieces & (pieces - 1)):
        raise ValueError(f"{op}: `pieces` must be a power of two >= 1 (or None: chosen by the program count); got "
                         f"{pieces!r}.")


def check_flag(op: str, name: str, value) -> None:
    """A yes/no option must be a bool: a string such as "False" is truthy and would switch the option on."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}: `{name}` must be True or False; got {value!r}.")


def check_config(op: str, config, expected: type) -> None:
    """``config``: None (the tuned launch parameters) or the op's own ``KernelConfig``."""
    if config is not None and not isinstance(config, expected):
        raise TypeError(f"{op}: `config` must be a {expected.__module__}.{expected.__qualname__} (or None: the tuned "
                        f"values); got {type(config).__name__}.")


def swap_time_heads(a):
    """``[B, T, H, ...]`` <-> ``[B, H, T, ...]``."""
    return jnp.swapaxes(a, 1, 2)


def pad_time(a, length: int, mode: str = "constant"):
    """``[N, T, ...]`` padded at the end of axis 1 to ``length`` (zeros, or ``mode="edge"`` to repeat
    the last entry, e.g. to continue a run index)."""
    return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2), mode=mode)


def shift_time(a, d: int, axis: int):
    """``out[p] = a[p − d]`` along ``axis``, zeros where ``p − d`` falls outside (``d`` < 0: rows move earlier)."""
    if d == 0:
        return a
    T = a.shape[axis]
    widths = [(0, 0)] * a.ndim
    widths[axis] = (d, 0) if d > 0 else (0, -d)
    start = max(-d, 0)
    return jax.lax.slice_in_dim(jnp.pad(a, widths), start, start + T, axis=axis)


def flatten_pad(a, length: int, mode: str = "constant"):
    """``[B, H, T, ...]`` -> ``[B·H, length, ...]``, padded at the end of T (see :func:`pad_time`)."""
    return pad_time(a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), length, mode)


def _gate_transpose_kernel(a_ref, o_ref):
    o_ref[...] = a_ref[...].T


def _gate_transpose_call(a, interpret, heads_first: bool = True):
    """``[B, L, H]`` -> ``[B, H, L]`` (``heads_first``) or ``[B, H, L]`` -> ``[B, L, H]``."""
    B = a.shape[0]
    H, L = (a.shape[2], a.shape[1]) if heads_first else (a.shape[1], a.shape[2])
    # rows per block: a power of two dividing L (a multiple of the chunk), at most 256 and at most 8192 elements
    # per block (H a power of two), so that many heads do not make one block spill
    rows = min(L & -L, 256, max(8192 // H, 1))
    time_major = pl.BlockSpec((None, rows, H), lambda b, i: (b, i, 0))
    heads_major = pl.BlockSpec((None, H, rows), lambda b, i: (b, 0, i))
    src, dst = (time_major, heads_major) if heads_first else (heads_major, time_major)
    out_shape = (B, H, L) if heads_first else (B, L, H)
    (out,) = call(_gate_transpose_kernel, grid=(B, L // rows), in_specs=[src], out_specs=[dst],
                  out_shape=[jax.ShapeDtypeStruct(out_shape, a.dtype)], args=(a,),
                  compiler_params=triton_params(4, 1), interpret=interpret,
                  name="gate_transpose" if heads_first else "gate_transpose_back")
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gate_transpose_diff(a, interpret):
    return _gate_transpose_call(a, interpret)


def _gate_transpose_fwd(a, interpret):
    return _gate_transpose_call(a, interpret), None


def _gate_transpose_bwd(interpret, _, ct):
    # a kernel again: with swap_time_heads XLA fused the transpose into the gates' elementwise backward (the
    # β / λ / ‖x‖² chain of Falcon-1), one 271 µs fusion at 1x32768 on the H200
    return (_gate_transpose_call(ct, interpret, heads_first=False),)


_gate_transpose_diff.defvjp(_gate_transpose_fwd, _gate_transpose_bwd)


def transpose_gates(a, *, interpret: bool):
    """``[B, L, H]`` -> ``[B, H, L]`` by a Pallas Triton kernel (``H`` a power of two, ``L`` a multiple of 16).

    Why a kernel: a custom call's operand keeps XLA's row-major layout, so whatever produces the gates should
    write them time-major.  With ``jnp.swapaxes`` XLA's layout assignment folds the transpose into the producer
    instead, and for Falcon-1 that producer is the ‖x‖² reduction over ``[1, 32768, 16, 128]``: it then wrote
    its output time-minor, one 271 µs fusion on the H200 (a ``lax.optimization_barrier`` did not stop it; the
    kernel took the forward's fusion to 70 µs).
    Differentiable: the cotangent goes back through the same kernel with the blocks swapped.
    """
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return _gate_transpose_call(a, interpret)  # integer gates (run indices) have no gradient
    return _gate_transpose_diff(a, interpret)


def kernel_operands(in_place: bool, length: int, gate_kernel: bool = False, interpret: bool = False):
    """``(tokens, gates)``: how an op hands its arrays to the GPU passes, padded in time to ``length``.
    Tokens are ``[B, T, H, d]`` kept in place (``in_place``) or ``[B, H, T, d]`` flattened to
    ``[B·H, L, d]``; gates (``[B, T, H]`` or ``[B, H, T]``, maybe with a trailing column axis) always
    become ``[B·H, L, ...]``.  Both take ``mode`` (see :func:`pad_time`).  ``gate_kernel``: in place,
    ``[B, T, H]`` gates with a power-of-two ``H`` are transposed by :func:`transpose_gates` (in
    ``interpret`` mode or not) instead of by XLA."""
    def gates(a, mode="constant"):
        if in_place and gate_kernel and a.ndim == 3 and a.shape[2] & (a.shape[2] - 1) == 0:
            return flatten_pad(transpose_gates(pad_time(a, length, mode), interpret=interpret), length, mode)
        return flatten_pad(swap_time_heads(a) if in_place else a, length, mode)

    def tokens(a, mode="constant"):
        return pad_time(a, length, mode) if in_place else flatten_pad(a, length, mode)

    return tokens, gates


def layout_kw(heads: int | None) -> dict:
    """Keyword for the GPU passes: ``heads=H`` when the tokens are ``[B, L, H, d]`` read in place
    (:func:`row_block`), nothing for ``[B·H, L, d]`` (so backends without the option are called as before)."""
    return {} if heads is None else {"heads": heads}


def chunk_state_dtype(dtype):
    """The per-chunk states and state gradients a backward stores: in the inputs' dtype for bf16/fp16
    inputs (half the backward's largest buffers; the kernels read them back for their products), fp32
    otherwise."""
    return dtype if jnp.dtype(dtype).itemsize == 2 else jnp.float32


def dot(a, b, precision):
    """``a @ b`` with fp32 accumulation."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def precision_for(dtype):
    """fp32 inputs: true fp32 dots (default fp32 dots run in TF32 on Hopper); bf16/fp16: native."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def mosaic_smem(shape, dtype):
    """A Mosaic GPU SMEM tile tiled and swizzled for TMA and wgmma (the last dimension contiguous)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def mosaic_mma(a, b, shape, init=None):
    """``init + a @ b`` (fp32) on the tensor cores in a Mosaic GPU kernel; ``a`` an SMEM ref or 16-bit registers
    in the wgmma layout, ``b`` an SMEM ref.

    The product goes into a fresh scoped accumulator and ``init`` is added in registers afterwards: under jax
    0.11.2 an accumulator initialised from a value (``pl.run_state`` with ``plgpu.ACC.init``) inside a kernel's
    loop failed to lower on the H200 ("Shaped arrays must be represented by ir.Values, got: TypedInt(0)"); the
    extra fp32 add costs one pass over registers.  The result goes through an optimization barrier so that no
    arithmetic on it is scheduled ahead of the wgmma wait that reading the accumulator implies."""
    def scoped(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    out = lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32)))
    return out if init is None else out + init


def triton_params(num_warps, num_stages):
    """Compiler params that select the Pallas Triton lowering (without them a GPU kernel goes to Mosaic GPU)."""
    if pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def unsupported_dims_reason(dk: int, dv: int, chunk_size: int, dtype, interpret: bool) -> str | None:
    """Shapes and dtypes the kernels take: every matrix-product dimension must be a power of two ≥ 16 (the
    tensor cores' tiles), so dk, dv and the chunk are."""
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 16 or d & (d - 1):
            return f"{name}={d}: the kernels need a power of two >= 16"
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        return f"chunk_size={chunk_size}: the kernels need a power of two >= 16"
    if not interpret and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"dtype {dtype}: the kernels take bf16, fp16 or fp32"
    return None


def column_block(j, width):
    """``pl.ds`` of column block ``j``: static for a Python int, else a traced start aligned to ``width``."""
    return pl.ds(j * width if isinstance(j, int) else pl.multiple_of(j * width, width), width)


def pieces_for(bh: int, nv: int, n_chunks: int, target_programs: int, requested: int | None = None) -> int:
    """Pieces (a power of two, at most a quarter of the chunks) to cut the sequence into so that
    batch·heads · value blocks · pieces reaches ``target_programs``; or the caller's ``requested`` count (a power
    of two, :func:`check_pieces`), at most one piece per chunk."""
    if requested:
        return min(requested, n_chunks)
    P = 1
    while bh * nv * P < target_programs and P * 2 <= n_chunks // 2:
        P *= 2
    return P


_POISON_OUTPUTS = [False]


@contextlib.contextmanager
def poisoned_outputs():
    """Testing aid: every kernel output starts as NaN (aliased input buffers), so an element
    a kernel fails to write shows up as NaN instead of stale or zero memory."""
    _POISON_OUTPUTS.append(True)
    try:
        yield
    finally:
        _POISON_OUTPUTS.pop()


def call(kernel, *, grid, in_specs, out_specs, out_shape, args, compiler_params, interpret, name, aliases=None):
    """``pallas_call`` that, under :func:`poisoned_outputs`, hands the kernel NaN-filled outputs (integer ones:
    their most negative value).  ``aliases``: {input index: output index} — the output is written into that
    input's buffer (it starts as the input, so it is not poisoned)."""
    aliases = dict(aliases or {})
    if not _POISON_OUTPUTS[-1]:
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                              input_output_aliases=aliases, compiler_params=compiler_params, interpret=interpret,
                              name=name)(*args)
    n_in = len(args)
    poisoned = [i for i in range(len(out_shape)) if i not in aliases.values()]
    poison = [jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.inexact) else jnp.iinfo(s.dtype).min, s.dtype)
              for s in (out_shape[i] for i in poisoned)]  # integer outputs (run indices): never a run index

    def kernel_skipping_poison(*refs):
        kernel(*refs[:n_in], *refs[n_in + len(poison):])

    return pl.pallas_call(kernel_skipping_poison, grid=grid,
                          in_specs=list(in_specs) + [out_specs[i] for i in poisoned],
                          out_specs=out_specs, out_shape=out_shape,
                          input_output_aliases={**aliases, **{n_in + k: i for k, i in enumerate(poisoned)}},
                          compiler_params=compiler_params, interpret=interpret, name=name)(*args, *poison)


def chunk_local(log_decay, run, chunk):
    """Chunk-local inclusive cumsum of the log decay along axis 1 (``[BH, L]``, per column ``[BH, L, dv]``, or
    in the model's layout ``[B, L, H, dv]``) and the chunk-local run index of ``run`` ``[BH, L]`` (0 = same segment
    as the chunk's initial state)."""
    N, L = log_decay.shape[:2]
    # a constant log decay (DeltaNet's zeros, RetNet's per-head constants) would otherwise be cumsummed by XLA's
    # constant folding at compile time, slowly, into a [BH, L] constant
    log_decay = jax.lax.optimization_barrier(log_decay)
    g = jnp.cumsum(log_decay.reshape(N, L // chunk, chunk, *log_decay.shape[2:]), axis=2).reshape(log_decay.shape)
    r = run.reshape(run.shape[0], L // chunk, chunk)
    before = jnp.concatenate([jnp.zeros_like(r[:, :1, -1]), r[:, :-1, -1]], axis=1)
    return g, (r - before[:, :, None]).reshape(run.shape)


def reverse_chunk_cumsum(dg, chunk):
    """Gradient of a chunk-local inclusive cumsum: the reverse cumsum within each chunk (axis 1 of
    ``[BH, L]`` or ``[BH, L, dv]``)."""
    BH, L = dg.shape[:2]
    dg = dg.reshape(BH, L // chunk, chunk, *dg.shape[2:])
    return jnp.flip(jnp.cumsum(jnp.flip(dg, 2), 2), 2).reshape(BH, L, *dg.shape[3:])


def token_dims(a, heads: int | None = None) -> tuple[int, int, int]:
    """``(B·H, L, d)`` of a token array: ``[B·H, L, d]`` (``heads=None``) or ``[B, L, H, d]`` (``heads=H``)."""
    if heads is None:
        return a.shape
    B, L, H, d = a.shape
    return B * H, L, d


def row_block(heads: int | None, rows: int, cols: int, index_map):
    """BlockSpec of a ``[rows, cols]`` tile of one batch·head's token rows.

    ``index_map(*grid ids) -> (batch·head, row block, column block)``. With ``heads=None`` the array is
    ``[B·H, L, d]``; with ``heads=H`` it is ``[B, L, H, d]`` (the model's own layout, read in place: the
    tile's rows are ``H·d`` elements apart, which Triton loads with strides, so no transposed copy of
    q, k, v, o or their gradients is ever made)."""
    if heads is None:
        return pl.BlockSpec((None, rows, cols), index_map)

    def in_place(*ids):
        bh, r, c = index_map(*ids)
        return bh // heads, r, bh % heads, c

    return pl.BlockSpec((None, rows, None, cols), in_place)


def chunk_specs(q, dv, chunk, heads):
    """Block specs of the GPU per-chunk passes, grid (batch·head, chunk): token rows of q/x (``k``) and y/do
    (``v``) in their layout (:func:`row_block`), flat ``[BH, L, dk]`` / ``[BH, L, dv]`` rows, gate rows,
    ``[C, C]`` squares and the chunk's ``[dk, dv]`` state."""
    dk = token_dims(q, heads)[2]
    return types.SimpleNamespace(
        k=row_block(heads, chunk, dk, lambda b, c: (b, c, 0)), v=row_block(heads, chunk, dv, lambda b, c: (b, c, 0)),
        flat_k=pl.BlockSpec((None, chunk, dk), lambda b, c: (b, c, 0)),
        flat_v=pl.BlockSpec((None, chunk, dv), lambda b, c: (b, c, 0)),
        row=pl.BlockSpec((None, chunk), lambda b, c: (b, c)),
        square=pl.BlockSpec((None, chunk, chunk), lambda b, c: (b, c, 0)),
        state=pl.BlockSpec((None, None, dk, dv), lambda b, c: (b, c, 0, 0)))


def default_gpu_major() -> int | None:
    """The major compute capability of the default device if it is a GPU (9 for an H100 / H200), else None."""
    try:
        device = jax.devices()[0]
    except RuntimeError:  # pragma: no cover
        return None
    major = str(getattr(device, "compute_capability", "")).split(".")[0]
    return int(major) if device.platform == "gpu" and major.isdigit() else None


# the jax the Mosaic GPU kernels were checked and timed on (the H200's 0.11.2); older ones lower them (CI
# cross-lowers them on 0.10.2) but never ran them
MOSAIC_GPU_CHECKED_JAX = (0, 11)


def on_hopper() -> bool:
    """The default device is an sm_90 GPU (H100 / H200), and this jax has Pallas Mosaic GPU and is at least
    :data:`MOSAIC_GPU_CHECKED_JAX`: where the Mosaic GPU passes run."""
    if plgpu is None or tuple(int(p) for p in jax.__version__.split(".")[:2]) < MOSAIC_GPU_CHECKED_JAX:
        return False
    return default_gpu_major() == 9


def walk_layout(q, y, chunk, pieces, block_v, heads=None):
    """Grid and block specs of the GPU chunk walks: grid (batch·head, piece, value block), each program
    walking the ``n`` chunks of one piece for ``block_v`` value columns.  The per-chunk states a walk
    stores for the backward are in :func:`chunk_state_dtype` of q's dtype (piece states always fp32).
    ``heads``: see :func:`row_block` (the gates and states are always ``[B·H, ...]``)."""
    BH, L, dk = token_dims(q, heads)
    dv = y.shape[-1]
    Lp = L // pieces
    n = Lp // chunk
    specs = types.SimpleNamespace(
        rows_k=row_block(heads, Lp, dk, lambda b, p, v: (b, p, 0)),
        rows_v=row_block(heads, Lp, block_v, lambda b, p, v: (b, p, v)),
        gate=pl.BlockSpec((None, Lp), lambda b, p, v: (b, p)),
        piece_state=pl.BlockSpec((None, None, dk, block_v), lambda b, p, v: (b, p, 0, v)),
        chunk_states=pl.BlockSpec((None, n, dk, block_v), lambda b, p, v: (b, p, 0, v)),
    )
    shapes = types.SimpleNamespace(
        piece_states=jax.ShapeDtypeStruct((BH, pieces, dk, dv), jnp.float32),
        chunk_states=jax.ShapeDtypeStruct((BH, pieces * n, dk, dv), chunk_state_dtype(q.dtype)),
    )
    return (BH, pieces, dv // block_v), n, specs, shapes


def walk_outputs(specs, shapes, write_states, first=()):
    """(out_specs, out_shape) of a walk from :func:`walk_layout`: ``first`` — ``(spec, like)`` pairs, an output
    shaped and typed like ``like`` each —, then the per-chunk states if ``write_states``, then the piece states."""
    out_specs = [spec for spec, _ in first]
    out_shape = [jax.ShapeDtypeStruct(like.shape, like.dtype) for _, like in first]
    if write_states:
        out_specs.append(specs.chunk_states)
        out_shape.append(shapes.chunk_states)
    return out_specs + [specs.piece_state], out_shape + [shapes.piece_states]


def interpret_tpu(interpret: bool):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams() if interpret else False


__all__ = ["call", "check_config", "check_flag", "check_layout", "check_operands", "check_pieces", "chunk_local",
           "chunk_specs", "chunk_state_dtype", "column_block", "default_gpu_major", "dot", "empty_result",
           "flatten_pad", "floor_log_decay", "kernel_operands", "layout_kw", "LAYOUTS", "LOG_DECAY_FLOOR",
           "next_pow2", "on_hopper", "pad_time", "pieces_for", "poisoned_outputs", "precision_for",
           "reverse_chunk_cumsum", "row_block", "swap_time_heads", "token_dims", "transpose_gates", "triton_params",
           "unsupported_dims_reason", "walk_layout"]


WARPS = (1, 2, 4, 8, 16)


def check_launch_parameters(config, *, widths=(), warps=(), counts=(), thresholds=(), optional=()) -> None:
    """Validate a ``KernelConfig``'s fields by kind, raising ``ValueError`` naming the field: ``widths``
    (value columns per program: powers of two ≥ 16), ``warps`` (Triton warps: 1, 2, 4, 8 or 16), ``counts``
    (stages, program counts: ints ≥ 1), ``thresholds`` (program counts compared against: ints ≥ 0).  Fields in
    ``optional`` may also be None (chosen per call)."""
    for name in widths:
        value = getattr(config, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            where = " (or None)" if name in optional else ""
            raise ValueError(f"KernelConfig: {name} must be a power of two >= 16{where}, got {value!r}.")
    for name in warps:
        if getattr(config, name) not in WARPS:
            raise ValueError(f"KernelConfig: {name} must be 1, 2, 4, 8 or 16, got {getattr(config, name)!r}.")
    for names, low in ((counts, 1), (thresholds, 0)):
        for name in names:
            value = getattr(config, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                where = " (or None)" if name in optional else ""
                raise ValueError(f"KernelConfig: {name} must be an int >= {low}{where}, got {value!r}.")
