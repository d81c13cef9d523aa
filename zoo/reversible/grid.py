"""The fixed-point grid of the reversible streams: their integer format (:class:`Grid`), the
conversions to and from floats, and the additions the coupling makes, range-checked."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Grid", "grid_for", "to_fixed", "from_fixed"]


@dataclass(frozen=True)
class Grid:
    """A fixed-point stream format: ``stream`` integers counting steps of ``2**-frac_bits``,
    with float views of dtype ``view``. ``limit`` is the largest magnitude a stream value or an
    ``F``/``G`` output may reach: below it no addition can overflow."""

    stream: torch.dtype
    frac_bits: int
    view: torch.dtype

    @property
    def scale(self) -> float:
        return 2.0 ** self.frac_bits

    @property
    def step(self) -> float:
        return 2.0 ** -self.frac_bits

    @property
    def limit(self) -> float:
        return 2.0 ** (torch.iinfo(self.stream).bits - 2 - self.frac_bits)


def grid_for(dtype: torch.dtype) -> Grid:
    """The grid of streams whose float views are ``dtype``: 64-bit integers with 32 fractional
    bits for float64, 32-bit integers with 16 fractional bits for float32 and narrower."""
    if not dtype.is_floating_point:
        raise TypeError(f"reversible streams are floating-point tensors, got {dtype}")
    if dtype == torch.float64:
        return Grid(torch.int64, 32, dtype)
    return Grid(torch.int32, 16, dtype)


def to_fixed(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``x`` on the grid: ``trunc(x * 2**frac_bits)`` as stream integers (half floats widened
    first, so that the scaling cannot overflow)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return (x * grid.scale).to(grid.stream)


def from_fixed(k: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The float view of stream ``k``: ``k * 2**-frac_bits``, rounded once to the view dtype
    (through float32 for float16, whose range the integers exceed)."""
    if grid.view == torch.float16:
        return k.float().mul_(grid.step).half()
    return k.to(grid.view).mul_(grid.step)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """max |x| (NaN if x holds a NaN): what the range check of the sequence's outputs reads."""
    return torch.linalg.vector_norm(x, float("inf"))


def _enter(x: torch.Tensor, grid: Grid, checks: list[torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor onto the grid: (stream, float view); its magnitude joins ``checks``."""
    checks.append(_magnitude(x))
    k = to_fixed(x, grid)
    return k, from_fixed(k, grid)


def _add(k: torch.Tensor, out: torch.Tensor, grid: Grid, checks: list[torch.Tensor],
         inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream ``k`` plus ``out`` on the grid (into ``k`` itself if ``inplace``): (stream, float
    view); the magnitudes of ``out`` and of the new view join ``checks`` (every addition then
    has both terms below the limit). ``out`` must have the stream's shape: a broadcast one would
    be added by the stored network but could not be taken off by the rebuild's backward."""
    if out.shape != k.shape:
        raise ValueError(f"reversible_sequence: a block's f or g returned shape "
                         f"{tuple(out.shape)} for streams of shape {tuple(k.shape)}; f and g "
                         f"must return their input's shape (residual branches)")
    checks.append(_magnitude(out))
    fixed = to_fixed(out, grid)
    k = k.add_(fixed) if inplace else k + fixed
    del fixed
    view = from_fixed(k, grid)
    checks.append(_magnitude(view))
    return k, view


def _checked(v1: torch.Tensor, v2: torch.Tensor, grid: Grid, checks: list[torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs, NaN if an input, a stream or an F/G output reached the limit or was not
    finite (adding 0 changes no value: a float view is never -0), and the 0 or NaN added."""
    worst = torch.stack(checks).amax()
    bad = torch.where(worst < grid.limit, 0.0, float("nan"))
    return v1 + bad, v2 + bad, bad
