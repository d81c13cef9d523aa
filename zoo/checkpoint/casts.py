"""Autocast's cache of parameter casts, and forwards that run without it.

``torch.autocast`` keeps the low-precision copy of each leaf tensor that requires grad (a
parameter) it casts until its outermost block exits (``cache_enabled=True``, the default), so a
parameter used twice in one forward is cast once. What the cache also does is hold every copy until
the forward ends: in a checkpointed region, the copies of all its weights, which the region saves
for nothing (its recompute casts again); in a stored block, the casts no op saved (biases). The
forward's end is the step's peak where gradients are already held (gradient accumulation).

Where each parameter is cast once per forward the cache spares no cast, and a forward without it
gives the same values and gradients, bit for bit, each copy alive only while an op or a saved
tensor needs it. Where one is cast twice (a weight shared by two layers, a layer called twice),
both uses share one cached copy whose gradient sums them in low precision; without the cache two
copies sum in float32, and the gradients differ. So the cache goes only where casting once is
known: every zoo model (:func:`casts_once`, a test trains each both ways bit for bit), or any
module whose first forward showed it (:func:`set_casts_once`). The cache and its switch:
https://pytorch.org/docs/stable/amp.html#torch.autocast (``cache_enabled``). A zoo region records
the cache's state, so its recompute casts as its forward did (:mod:`.recompute`).
"""
from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch import TorchDispatchMode, to_copy_op
from .recompute import autocast_cache_on

__all__ = ["casts_once", "set_casts_once", "CastTwiceError"]


def casts_once(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A ``forward`` known to cast each parameter once, run with autocast's cache off (module
    doc; every zoo model's ``forward``). Under ``torch.compile`` it is the forward itself (a
    compiled graph keeps no cache)."""
    @functools.wraps(forward)
    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or not autocast_cache_on():
            return forward(self, *args, **kwargs)
        torch.set_autocast_cache_enabled(False)
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.set_autocast_cache_enabled(True)
    return run


class CastTwiceError(ValueError):
    """A module given :func:`set_casts_once` cast one parameter more than once in a forward."""


class _CastCount(TorchDispatchMode):
    """Counts the casts to another dtype of each leaf tensor that requires grad (what
    autocast's cache keeps: a parameter, or an input that requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[int] = Counter()
        self.tensors: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is to_copy_op and args[0].is_leaf and args[0].requires_grad \
                and kwargs.get("dtype", args[0].dtype) != args[0].dtype:
            self.casts[id(args[0])] += 1
            self.tensors[id(args[0])] = args[0]
        return func(*args, **kwargs)

    def cast_twice(self, module: nn.Module) -> str | None:
        """The name of a tensor cast more than once (a parameter's, else its shape), or None."""
        twice = [key for key, n in self.casts.items() if n > 1]
        if not twice:
            return None
        names = {id(p): name for name, p in module.named_parameters()}
        key = twice[0]
        return names.get(key, f"a tensor of shape {tuple(self.tensors[key].shape)}")


_HANDLES = "_zoo_casts_once"  # on the module: its hooks' handles
_local = threading.local()  # per thread (nn.DataParallel runs a forward per replica thread)


class _CastsOnceHooks:
    """The hooks :func:`set_casts_once` puts around a module's forward: the cache off for the
    forward, its casts counted until a forward has shown each parameter cast once."""

    def __init__(self) -> None:
        self.checked = False

    def before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = _local.__dict__.setdefault("stack", [])
        if not (torch.is_grad_enabled() and autocast_cache_on()):
            stack.append(None)  # nothing cached to drop (or an outer forward dropped it)
            return
        count = None if self.checked else _CastCount()
        if count is not None:
            count.__enter__()
        torch.set_autocast_cache_enabled(False)
        stack.append((count,))

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        entry = _local.stack.pop()
        if entry is None:
            return
        torch.set_autocast_cache_enabled(True)
        count = entry[0]
        if count is None:
            return
        count.__exit__(None, None, None)
        twice = count.cast_twice(module)
        if twice is not None:
            raise CastTwiceError(
                f"{type(module).__name__} casts {twice} more than once per forward under "
                "autocast, so without autocast's cache its gradients would differ: leave "
                "casts_once off for this model")
        self.checked = output is not None  # a forward that raised (output None) shows nothing


def set_casts_once(module: nn.Module, enable: bool = True) -> nn.Module:
    """Run ``module``'s forward without autocast's cache of parameter casts, where that is exact.

    Each forward under autocast with the cache on and gradients enabled runs with the cache off
    (the module doc: each cast then lives only while an op or a saved tensor needs it, no longer
    to the forward's end). The first such forward counts every cast of a parameter; where one is
    cast twice it raises :class:`CastTwiceError` (a one-line ``ValueError``) before backward, as
    the gradients would then differ from the cached forward's. Autocast entered inside
    ``forward`` re-enables its cache there: enter it around the call. ``enable=False`` removes the
    hooks. Parameters, buffers, state_dict and class stay as they were. Returns ``module``.
    """
    for handle in module.__dict__.pop(_HANDLES, ()):
        handle.remove()
    if enable:
        hooks = _CastsOnceHooks()
        module.__dict__[_HANDLES] = (
            module.register_forward_pre_hook(hooks.before),
            module.register_forward_hook(hooks.after, always_call=True))
    return module
