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

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._subclass import reduce_as_original
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
        return _uncached(forward, self, args, kwargs)
    return run


def _uncached(forward: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``forward(module, *args, **kwargs)`` with autocast's cache off (on again after)."""
    torch.set_autocast_cache_enabled(False)
    try:
        return forward(module, *args, **kwargs)
    finally:
        torch.set_autocast_cache_enabled(True)


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


_STATE = "_zoo_casts_once"  # on the module: {"checked": bool}, shared with its replicas
_SWAPPED: dict[type, type] = {}


def _checked(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` as :func:`set_casts_once` runs it: uncached under autocast with the cache on
    and gradients enabled, its casts counted until a forward has shown each cast once. A
    forward given a leaf tensor that requires grad (an input whose gradient is wanted) keeps
    the cache: the check speaks for the parameters only, and such an input may be cast twice."""
    @functools.wraps(forward)
    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self.__dict__.get(_STATE)
        if state is None or torch.compiler.is_compiling() or not torch.is_grad_enabled() \
                or not autocast_cache_on() or _leaf_wanting_grad(args, kwargs):
            return forward(self, *args, **kwargs)  # no cast to keep, or the cache is needed
        count = None if state["checked"] else _CastCount()
        with count if count is not None else contextlib.nullcontext():
            out = _uncached(forward, self, args, kwargs)
        if count is not None:
            twice = count.cast_twice(self)
            if twice is not None:
                raise CastTwiceError(
                    f"{type(self).__name__} casts {twice} more than once per forward under "
                    "autocast, so without autocast's cache its gradients would differ: leave "
                    "casts_once off for this model")
            state["checked"] = True
        return out
    return run


def _leaf_wanting_grad(args: tuple, kwargs: dict) -> bool:
    """Whether an argument is a leaf tensor that requires grad (autocast's cache keeps its
    casts as it keeps a parameter's)."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf
               for a in (*args, *kwargs.values()))


def casts_once_class(cls: type) -> type:
    """``cls`` with its ``forward`` run as :func:`set_casts_once` says (made once, named as
    ``cls``, pickled as ``cls`` plus the swap: :mod:`zoo._subclass`)."""
    if "_zoo_casts_once_from" in cls.__dict__:
        return cls
    if cls not in _SWAPPED:
        def __reduce_ex__(self: nn.Module, protocol: int) -> Any:  # noqa: N807
            return reduce_as_original(self, protocol, casts_once_class, cls)

        _SWAPPED[cls] = type(cls.__name__, (cls,), {
            "forward": _checked(cls.forward), "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_zoo_casts_once_from": cls,
            "__reduce_ex__": __reduce_ex__})
    return _SWAPPED[cls]


def set_casts_once(module: nn.Module, enable: bool = True) -> nn.Module:
    """Run ``module``'s forward without autocast's cache of parameter casts, where that is exact.

    Each forward under autocast with the cache on and gradients enabled runs with the cache off
    (the module doc: each cast then lives only while an op or a saved tensor needs it, no longer
    to the forward's end). The first such forward counts every cast of a parameter; where one is
    cast twice it raises :class:`CastTwiceError` (a one-line ``ValueError``) before backward, as
    the gradients would then differ from the cached forward's. The module's class is swapped
    for a subclass of the same name whose ``forward`` does this (:mod:`zoo._subclass`), so a
    wrapper of ``forward`` made later, as Accelerate's autocast under mixed precision, runs it
    inside; autocast entered inside the original forward itself re-enables the cache there.
    ``enable=False`` gives back the class, or where a later swap subclassed it (FSDP2's
    ``fully_shard``) leaves it and turns it off. Returns ``module``.
    """
    swapped = next((c for c in type(module).__mro__ if "_zoo_casts_once_from" in c.__dict__),
                   None)
    module.__dict__.pop(_STATE, None)  # without its state the swapped forward is the original
    if swapped is type(module):
        module.__class__ = swapped._zoo_casts_once_from  # type: ignore[attr-defined]
        swapped = None
    if enable:
        module.__dict__[_STATE] = {"checked": False}
        if swapped is None:  # else a later swap (FSDP2's) made a subclass of the swapped class
            module.__class__ = casts_once_class(type(module))
        if "forward" in module.__dict__:  # a wrapper made earlier calls the class's old forward
            warnings.warn(f"{type(module).__name__}.forward is already wrapped (e.g. by "
                          "Accelerate's prepare), so casts_once takes no effect through it: "
                          "call zoo.set_grad_checkpointing(..., casts_once=True) before the "
                          "wrapping", stacklevel=3)
    return module
