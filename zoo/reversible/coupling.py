"""What a reversible sequence runs: a block with ``f`` and ``g`` (:class:`ReversibleBlock`), and
:class:`Coupling`, such a block made of two modules."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["ReversibleBlock", "LeadBlock", "Coupling"]


class ReversibleBlock(Protocol):
    """What :func:`reversible_sequence` runs: an ``nn.Module`` with ``f`` and ``g``. It may
    also have ``f_parts()``/``g_parts()`` returning ``(head, tail)`` (or ``None``) with
    ``f(x, *args) == tail(head(x), *args)`` bit for bit, ``head`` a cheap deterministic
    normalisation: the rebuild then makes ``head``'s output again when backward needs it
    instead of keeping it through the recompute's backward."""

    def f(self, x: torch.Tensor, *args: Any) -> torch.Tensor: ...

    def g(self, x: torch.Tensor, *args: Any) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class LeadBlock(Protocol):
    """A sequence's non-invertible first unit (the RevNet paper's downsampling unit):
    ``y1 = f(x2) + shortcut1(x1)``, ``y2 = g(y1) + shortcut2(x2)``, on floats, with shortcuts
    that change the resolution or the width; what ``lead=`` of :func:`reversible_sequence`
    takes. Like :class:`ReversibleBlock` it may have ``f_parts()``/``g_parts()``."""

    def f(self, x: torch.Tensor) -> torch.Tensor: ...

    def g(self, x: torch.Tensor) -> torch.Tensor: ...

    def shortcut1(self, x: torch.Tensor) -> torch.Tensor: ...

    def shortcut2(self, x: torch.Tensor) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class Coupling(nn.Module):
    """A reversible block made of two modules: ``f`` and ``g`` are its submodules (so the
    state_dict names are ``f.*`` and ``g.*``); a sequence's extra arguments are passed on to
    both, as to any block's ``f`` and ``g`` (modules that take none need a sequence without)."""

    def __init__(self, f: nn.Module, g: nn.Module) -> None:
        super().__init__()
        self.f, self.g = f, g

    def f_parts(self) -> tuple[Any, Any] | None:
        """``f`` as ``(head, tail)`` if its module splits itself (a ``parts()`` method)."""
        return self.f.parts() if hasattr(self.f, "parts") else None

    def g_parts(self) -> tuple[Any, Any] | None:
        """``g`` as ``(head, tail)`` if its module splits itself (a ``parts()`` method)."""
        return self.g.parts() if hasattr(self.g, "parts") else None
