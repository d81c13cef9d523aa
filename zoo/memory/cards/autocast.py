"""CUDA's autocast op lists on a step whose (fake) tensors live on the CPU.

``torch.autocast("cuda", dtype=torch.bfloat16)`` casts per op by lists of its own
(aten/src/ATen/autocast_mode.cpp): matmuls and convolutions to bfloat16, LayerNorm, softmax,
exp, log, the losses and the norms to float32, ``cat``/``stack`` to the widest input, and
nothing for the rest. CPU autocast keeps other lists (LayerNorm and softmax, for one, stay in
bfloat16), and a card's fake step must run on the CPU (:mod:`.kernels` says why). While
:class:`CudaAutocast` is active, CPU autocast does what CUDA's would: every op with an autocast
kernel on either device gets one at the ``AutocastCPU`` key that asks CUDA's own kernel what it
casts to, once per op and input dtypes, by calling it on fake CUDA tensors (FakeTensorMode
needs no GPU for a forward op; the autograd engine is what needs one), then casts the CPU
arguments alike and runs the op with autocast off for what it calls (as CUDA's kernels do). An
op CUDA has no kernel for falls through, so the ops it is made of are cast one by one. No list
is copied: the policy is CUDA's kernel's, on the torch installed. Where autocast's cache is on,
parameters cast to bfloat16 are cached until the outermost autocast exits, as its cache keeps
them.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import _torch
from ..._torch import tree_flatten, tree_map_only

__all__ = ["CudaAutocast", "cuda_autocast"]

_ELIGIBLE = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts (not float64)


class CudaAutocast:
    """While active (a context manager), CPU autocast follows CUDA's op lists (module
    docstring); outside ``torch.autocast("cpu", ...)`` nothing changes. Registrations and the
    wrapped ``torch.clear_autocast_cache`` are process-wide for the duration."""

    def __init__(self) -> None:
        self.casts: dict[tuple, torch.dtype | None] = {}  # (op, input dtypes) -> CUDA's cast
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def __enter__(self) -> CudaAutocast:
        has = _torch.dispatch_has_kernel_for_dispatch_key
        self._library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for name in _torch.dispatch_get_all_op_names():
                cuda, cpu = has(name, "AutocastCUDA"), has(name, "AutocastCPU")
                if name.startswith("aten::") and (cuda or cpu):
                    op = _overload(name)
                    self._library.impl(op, self._kernel(op) if cuda
                                       else torch.library.fallthrough_kernel, "AutocastCPU")
        self._clear = torch.clear_autocast_cache

        def clear() -> None:  # the outermost autocast exits: its casts go, so do ours
            self._cache.clear()
            self._clear()

        torch.clear_autocast_cache = clear
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.clear_autocast_cache = self._clear
        _torch.library_destroy(self._library)
        self._cache.clear()

    def _kernel(self, op: Any) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            target = self._cast_to(op, args, kwargs)
            if target is not None:
                args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, target),
                                             (args, kwargs))
            with torch.autocast("cpu", enabled=False):
                return op(*args, **kwargs)

        return kernel

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype not in _ELIGIBLE or t.dtype == dtype:
            return t
        cached = t.requires_grad and t.is_leaf and t.dtype == torch.float32 and \
            torch.is_autocast_cache_enabled()
        hit = self._cache.get(id(t)) if cached else None
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(dtype)
        if cached:
            self._cache[id(t)] = (weakref.ref(t), out)
        return out

    def _cast_to(self, op: Any, args: Any, kwargs: Any) -> torch.dtype | None:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        key = (op, tuple(t.dtype for t in tensors))
        if key not in self.casts:
            self.casts[key] = _cuda_cast(op, args, kwargs)
        return self.casts[key]


_ACTIVE: list[CudaAutocast] = []  # the one in force (registrations are process-wide)


@contextlib.contextmanager
def cuda_autocast(needed: bool = True) -> Iterator[None]:
    """:class:`CudaAutocast` for the duration when ``needed`` and none is in force already (a
    planning enters it once for its many fake steps; a step inside it does not again)."""
    if not needed or _ACTIVE:
        yield
        return
    with CudaAutocast() as active:
        _ACTIVE.append(active)
        try:
            yield
        finally:
            _ACTIVE.remove(active)


def _overload(name: str) -> Any:
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@functools.cache
def _spare_mode() -> Any:
    """A fake mode for the probe where the argument is a fake tensor wrapped by a tracer
    (AOTAutograd's functional tensors, compiling a step): any fake mode makes the probe's
    tensors."""
    return _torch.FakeTensorMode()


def _like(t: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor of ``t``'s shape, strides and dtype on ``device``."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


class _MetaWhereFakeNeedsDevice(_torch.TorchDispatchMode):
    """Below CUDA's autocast kernel in the probe: each op its kernel calls (on the cast
    arguments) runs in the fake mode; where that fake kernel asks the device itself (torch
    2.8 and 2.9's fake convolution picks its cuDNN backend, which needs a CUDA driver), the
    op's meta kernel gives the same shapes and dtypes without one."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any device query: the meta kernel has the dtypes
            meta = functools.partial(_like, device="meta")
            with _torch.disable_current_modes():
                out = func(*tree_map_only(torch.Tensor, meta, args),
                           **tree_map_only(torch.Tensor, meta, kwargs))
            return tree_map_only(torch.Tensor, functools.partial(_like, device="cuda"), out)


def _cuda_cast(op: Any, args: Any, kwargs: Any) -> torch.dtype | None:
    """The floating dtype CUDA's autocast kernel gives ``op``'s first output on arguments like
    these (fake CUDA tensors of the same shapes and dtypes, under CUDA autocast at CPU
    autocast's dtype), where that is a dtype autocast casts to; None where it does not cast
    or cannot say (the op then runs on its arguments as they are)."""
    on_cuda = functools.partial(_like, device="cuda")
    fake = next((getattr(t, "fake_mode", None) or _spare_mode()
                 for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and _torch.is_fake(t)), None)
    if fake is None:
        return None
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    try:
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", torch.get_autocast_dtype("cpu"))
        # the fake mode (and its meta fallback) alone: the probe is no op of the step (no
        # counter sees it)
        with _torch.disable_current_modes(), fake, _MetaWhereFakeNeedsDevice(), \
                torch.no_grad():
            out = op(*tree_map_only(torch.Tensor, on_cuda, args),
                     **tree_map_only(torch.Tensor, on_cuda, kwargs))
    except Exception:  # noqa: BLE001 - an op fake CUDA tensors cannot run: left uncast
        return None
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
    first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
    return first.dtype if first is not None and first.dtype in _ELIGIBLE else None
