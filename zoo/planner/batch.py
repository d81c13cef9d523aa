"""The largest batch that fits a memory budget with a planned schedule (``--batch_size auto``).

Profiling costs seconds per batch size, so the search does not profile every candidate: every
figure of a chain's profile (bytes at a boundary, bytes saved, rises, FLOPs) is affine in the
batch size for the models here (activations grow with the batch, parameters and their gradients
do not), so the profiles at batch 1 and 2 give the profile at any batch by extrapolation. The
solver (cheap) then bisects on that for the largest feasible batch, and a real profile at the
answer confirms it (stepping down while it does not fit). Chen et al. 2016 and rotor (Beaumont et
al. 2019) both present the budget -> batch question as the point of planning; this is it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..memory import parse_bytes
from .profile import ChainProfile, profile_chain
from .solve import fronts, smallest_peak

__all__ = ["extrapolate", "largest_batch", "largest_feasible"]


def extrapolate(p1: ChainProfile, p2: ChainProfile, batch: int) -> ChainProfile:
    """The profile at ``batch`` from the profiles at batch 1 (``p1``) and 2 (``p2``)."""
    def line(a: Any, b: Any) -> Any:
        if isinstance(a, bool) or not isinstance(a, int):
            return a
        return max(0, a + (batch - 1) * (b - a))

    fields = {}
    for f in dataclasses.fields(ChainProfile):
        a, b = getattr(p1, f.name), getattr(p2, f.name)
        if isinstance(a, list) and a and isinstance(a[0], int) and not isinstance(a[0], bool):
            fields[f.name] = [line(x, y) for x, y in zip(a, b)]
        else:
            fields[f.name] = line(a, b)
    return ChainProfile(**fields)


def largest_feasible(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
    """The largest ``b`` in ``1..limit`` with ``fits(b)``, for ``fits`` monotone (0 if none)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_batch(model: nn.Module, make_input: Callable[[int], torch.Tensor],
                  memory_budget: int | float | str,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  limit: int = 1 << 16) -> tuple[int, ChainProfile]:
    """The largest batch whose best schedule fits ``memory_budget``, and its profile.

    ``make_input(b)`` builds an example batch of size ``b``. Returns ``(0, profile at batch 1)``
    when not even batch 1 fits.
    """
    budget = parse_bytes(memory_budget)
    p1 = profile_chain(model, make_input(1), loss_fn)
    if smallest_peak(p1, fronts(p1)) > budget:
        return 0, p1
    p2 = profile_chain(model, make_input(2), loss_fn)

    def fits(b: int) -> bool:
        p = extrapolate(p1, p2, b)
        return smallest_peak(p, fronts(p)) <= budget

    batch = largest_feasible(fits, limit)
    while batch > 2:  # confirm on a real profile
        p = profile_chain(model, make_input(batch), loss_fn)
        if smallest_peak(p, fronts(p)) <= budget:
            return batch, p
        batch -= max(1, batch // 64)
    p = p2 if batch == 2 and smallest_peak(p2, fronts(p2)) <= budget else p1
    return (2 if p is p2 else 1), p
