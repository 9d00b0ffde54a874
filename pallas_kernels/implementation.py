"""Which lowering runs a kernel op: one vocabulary for every op and for ``falcon(impl=...)``.

* ``"mosaic_gpu"`` — the GPU kernels with the Pallas Mosaic GPU passes (wgmma + TMA) where an op has them and
  they serve the call, Triton for the rest; a Hopper GPU (sm_90) under jax >= 0.11.
* ``"triton"`` — the GPU kernels, every pass in Pallas's Triton lowering.
* ``"mosaic_tpu"`` — the TPU kernels (Pallas Mosaic TPU).
* ``"xla"`` — plain JAX (the op's reference, or ``falcon``'s XLA chunk form).

``"auto"`` is the machine's ordered fallback: on a GPU ``("mosaic_gpu", "triton", "xla")``, on a TPU
``("mosaic_tpu", "xla")``, elsewhere ``("xla",)``.  A sequence is tried in order; a single name is taken or
refused.  Each implementation that cannot serve a call declines with its reason: a single name raises
``NotImplementedError`` with it, a sequence whose every member declines raises :class:`NoImplementation` (an
``ExceptionGroup`` and a ``NotImplementedError``) holding them all.  A kernel asked for by name off its own
accelerator runs in Pallas's interpret mode (``interpret=None``), which is how the tests run them on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import jax

Implementation: TypeAlias = Literal["mosaic_gpu", "triton", "mosaic_tpu", "xla"]
IMPLEMENTATIONS: tuple[str, ...] = ("mosaic_gpu", "triton", "mosaic_tpu", "xla")
NATIVE_PLATFORM = {"mosaic_gpu": "gpu", "triton": "gpu", "mosaic_tpu": "tpu"}


class NoImplementation(ExceptionGroup, NotImplementedError):
    """Every implementation asked for declined the call; ``exceptions`` holds each one's reason."""


def platform_default() -> tuple[str, ...]:
    """The ordered fallback of ``"auto"`` on this machine's default backend."""
    return {"gpu": ("mosaic_gpu", "triton", "xla"), "tpu": ("mosaic_tpu", "xla")}.get(jax.default_backend(), ("xla",))


def candidates(implementation, argname: str = "implementation") -> tuple[tuple[str, ...], bool]:
    """``(names to try in order, whether the caller named them)`` for ``"auto"``, a name or a sequence of names;
    anything else is a ``ValueError`` naming ``argname`` and the choices."""
    if implementation is None or implementation == "auto":
        return platform_default(), False
    names = (implementation,) if isinstance(implementation, str) else implementation
    if not isinstance(names, Sequence) or not names or any(n not in IMPLEMENTATIONS for n in names):
        raise ValueError(f"`{argname}` must be 'auto', one of {IMPLEMENTATIONS} or a sequence of them; got "
                         f"{implementation!r}.")
    return tuple(names), True


def interpret_mode(name: str, interpret: bool | None) -> bool:
    """Whether kernel implementation ``name`` runs in interpret mode: off its own accelerator unless
    ``interpret`` says otherwise."""
    if interpret is not None:
        return bool(interpret)
    return NATIVE_PLATFORM.get(name) != jax.default_backend()


def select(op: str, implementation, decline: Callable[[str], str | None], argname: str = "implementation") -> str:
    """The first of ``implementation``'s candidates that ``decline(name)`` accepts (returns None for), else
    raise with every reason (see the module docstring)."""
    names, _ = candidates(implementation, argname)
    declined = []
    for name in names:
        reason = decline(name)
        if reason is None:
            return name
        declined.append(NotImplementedError(f"{op}: {argname}={name!r} declined: {reason}"))
    if len(declined) == 1:
        raise declined[0]
    raise NoImplementation(f"{op}: no implementation of {names} serves this call", declined)


def accelerator_reason(name: str, interpret: bool | None) -> str | None:
    """The reason kernel implementation ``name`` declines for lack of its accelerator: Mosaic GPU needs a Hopper
    GPU (it has no interpreter here); Triton and Mosaic TPU run anywhere (interpreted off their accelerator)."""
    from falcon_jax.kernels.common import on_hopper

    if name == "mosaic_gpu":
        if interpret:
            return "its Mosaic GPU passes run on the GPU only (no interpret mode); use 'triton'"
        if not on_hopper():
            return "needs a Hopper GPU (sm_90) and jax >= 0.11; 'triton' serves other GPUs"
    if name == "mosaic_tpu" and interpret is False and jax.default_backend() != "tpu":
        return "interpret=False off a TPU"
    if name == "triton" and interpret is False and jax.default_backend() != "gpu":
        return "interpret=False off a GPU"
    return None


def kernel_reason(name: str, q, y, chunk_size: int, interpret: bool | None, *, no_mosaic_gpu: str | None = None
                  ) -> str | None:
    """Why implementation ``name`` declines an op's call with these q, y (``[..., dk]``, ``[..., dv]``) and
    chunk: "xla" never does; ``no_mosaic_gpu`` is the reason of an op without Mosaic GPU passes; then the
    accelerator (:func:`accelerator_reason`) and the kernels' shape rule (every matrix-product dimension a power
    of two ≥ 16)."""
    from falcon_jax.kernels.common import unsupported_dims_reason

    if name == "xla":
        return None
    if name == "mosaic_gpu" and no_mosaic_gpu is not None:
        return no_mosaic_gpu
    return accelerator_reason(name, interpret) or unsupported_dims_reason(
        q.shape[-1], y.shape[-1], chunk_size, q.dtype, interpret_mode(name, interpret))
