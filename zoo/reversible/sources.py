"""Where a rebuilt sequence's outputs can be made again from: its integer streams.

A sequence with ``rebuild=True`` keeps its last integer streams for its backward, and its float
outputs are views of them (``from_fixed(k)``, plus the range check's ``0`` or NaN). A lead unit
of the next sequence (non-invertible: a downsampling) needs those float outputs again in its
own backward; keeping them would hold every value twice (as integers and as floats), so it
keeps their :class:`Source` instead and makes them again, bit for bit, when its backward needs
them. The streams are still the sequence's outputs then: the next sequence's backward runs
before this one's, which rebuilds the streams in place (a version check says if not).

:func:`join` and :func:`split` carry a source through the concatenation of the two streams
that a model passes between its stages (RevNet's stages hand on one tensor of channels).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._torch import tensor_version as _version
from .grid import Grid, from_fixed

__all__ = ["Source", "join", "split", "source_of", "remember"]

_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # float tensor -> its Source
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)


class Source:
    """A float tensor made again from a stream: ``from_fixed(k) + bad`` (``bad``: the range
    check's 0-dim ``0`` or NaN), valid while ``k`` is unchanged."""

    __slots__ = ("k", "grid", "bad", "version")

    def __init__(self, k: torch.Tensor, grid: Grid, bad: torch.Tensor) -> None:
        self.k: torch.Tensor | None = k  # None once the sequence's backward has begun
        self.grid, self.bad, self.version = grid, bad, _version(k)

    def make(self) -> torch.Tensor:
        if self.k is None or _version(self.k) != self.version:
            raise RuntimeError("reversible_sequence: a lead unit's input was made again from "
                               "streams already rebuilt below it (backward ran out of order); "
                               "run backward once through the whole model")
        return from_fixed(self.k, self.grid).add_(self.bad)  # from_fixed makes a new tensor


def remember(t: torch.Tensor, source: Source) -> None:
    """Record that ``t`` equals ``source.make()``, bit for bit (while ``t`` is not changed in
    place)."""
    _SOURCES[t] = (source, _version(t))


def source_of(t: torch.Tensor) -> Source | None:
    """``t``'s source if ``t`` is a rebuilt sequence's output (or a :func:`split` half of their
    :func:`join`) not changed in place since, else ``None``."""
    found = _SOURCES.get(t)
    if found is None or len(found) != 2 or found[1] != _version(t):
        return None
    return found[0]


def join(y1: torch.Tensor, y2: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``torch.cat([y1, y2], dim)``, remembering the halves' sources for :func:`split`."""
    out = torch.cat([y1, y2], dim=dim)
    if not _is_compiling():
        s1, s2 = source_of(y1), source_of(y2)
        if s1 is not None and s2 is not None and y1.shape == y2.shape:
            _SOURCES[out] = (s1, s2, dim, _version(out))
    return out


def split(x: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.chunk(2, dim)``; the halves of a :func:`join` of two rebuilt outputs get their
    sources back (a lead unit makes them contiguous, as their sources make them), unless ``x``
    was changed in place since the join (then its halves are kept as they are)."""
    x1, x2 = x.chunk(2, dim=dim)
    joined = None if _is_compiling() else _SOURCES.get(x)
    if joined is not None and len(joined) == 4 and joined[2:] == (dim, _version(x)):
        remember(x1, joined[0])
        remember(x2, joined[1])
    return x1, x2
