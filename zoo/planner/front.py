"""Every plan a chain's profiles offer, as one front of (predicted peak, recompute): solved once,
read at any budget.

The dynamic programme of :mod:`.nested` runs once over a fixed memory grid from nothing to the
plain step's need (rotor discretises memory the same way): ``R[e][a][s]`` is an array over the
grid of the least recompute of units ``a..e`` run as the recompute of a segment ending at ``e``,
``T[a][s]`` the same for the top level, ``s`` how unit ``a``'s input is held (``nested.STATES``).
Needs are rounded to the nearest slot, so the grid only proposes schedules: each proposal is
traced back and priced exactly (``nested.schedule_cost``), and the front keeps the proposals no
other beats on both peak and recompute, together with the least-peak schedule (exact) and the
plain one. A budget then takes the cheapest plan of the front that fits it. Because the front
does not depend on the budget, a lower budget never gets a plan with a higher peak: the chosen
plan changes only when it no longer fits, and the next one fits.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .nested import (BY_REGION, BY_UNIT, NOT_HELD, STATES, Nested, NestedModel, _Least,
                     merge_stored, schedule_cost)
from .chain_profile import ChainProfile

__all__ = ["Front", "FrontPlan", "solve_nested"]

INF = float("inf")


@dataclass(frozen=True)
class FrontPlan:
    """One plan of a front: unit-level nested schedule, variant per unit, exact predicted peak
    (bytes of the step) and recomputed FLOPs."""

    schedule: Nested
    variants: tuple[int, ...]
    peak: int
    cost: int


@dataclass
class Front:
    """The Pareto front of a chain's nested schedules with per-unit variants (module docstring).

    ``plans`` run from the least peak to the plain step, cost strictly falling; ``at(budget)``
    is the cheapest that fits (None when none does)."""

    profiles: Sequence[ChainProfile]
    slots: int = 2000
    samples: int = 400
    step: int | None = None
    plans: list[FrontPlan] = field(default_factory=list)

    def __post_init__(self) -> None:
        m = NestedModel(self.profiles)
        p = self.profiles[0]
        self.model = m
        candidates = [self._priced([(0, m.n, None)], [0] * m.n)]
        least = _Least(m)
        variants = [0] * m.n
        candidates.append(self._priced(least.schedule(None, 0, NOT_HELD, variants), variants))
        top = candidates[0].peak - p.base
        if top > 0 and m.n > 0:
            grid = _Grid(m, top, self.step or max(1, math.ceil(top / self._slots(m.n))))
            candidates += [self._priced(*grid.schedule(k)) for k in grid.levels(self.samples)]
        self.plans = _envelope(c for c in candidates if c.peak < INF)

    def _slots(self, n: int) -> int:
        """Fewer slots on long chains: the tables hold about 1.5 n^2 slots of floats."""
        return max(200, min(self.slots, int(6e7 // (1.5 * n * n))))

    def _priced(self, schedule: Nested, variants: Sequence[int]) -> FrontPlan:
        p = self.profiles[0]
        need, cost = schedule_cost(self.model, schedule, variants)
        peak = max(p.pre_peak, p.tail_peak, p.base + need) if need < INF else INF
        return FrontPlan(schedule, tuple(variants), peak, cost)

    @property
    def least(self) -> FrontPlan:
        return self.plans[0]

    def at(self, budget: float) -> FrontPlan | None:
        """The cheapest plan whose peak fits ``budget`` (the lowest peak among equals)."""
        fitting = [q for q in self.plans if q.peak <= budget]
        return fitting[-1] if fitting else None


def _envelope(candidates: Any) -> list[FrontPlan]:
    """Peak ascending, cost strictly descending: each plan beats every cheaper one on peak."""
    out: list[FrontPlan] = []
    for c in sorted(candidates, key=lambda c: (c.peak, c.cost)):
        if not out or c.cost < out[-1].cost:
            out.append(c)
    return out


class _Grid:
    """The dynamic programme's tables over ``slots`` memory slots of ``step`` bytes."""

    def __init__(self, m: NestedModel, top: int, step: int) -> None:
        self.m, self.step = m, step
        self.size = int(round(top / step)) + 1
        self._options: dict[tuple, list[tuple]] = {}  # (e, a, s): made once, traced again
        self.R: list[Any] = [None] * (m.n + 1)
        for e in range(1, m.n + 1):
            self.R[e] = self._solve(e)
        self.T = self._solve(None)

    def slot(self, nbytes: float) -> int:
        return int(round(nbytes / self.step))

    def options(self, F: list, a: int, s: int, e: int | None, last: int) -> list[tuple]:
        """Each way to start a schedule at unit ``a``: (choice, floor slot, hold slot, cost,
        tables whose sum, shifted by the hold, is the rest's cost)."""
        found = self._options.get((e, a, s))
        if found is None:
            found = self._options[e, a, s] = self._make_options(F, a, s, e, last)
        return found

    def _make_options(self, F: list, a: int, s: int, e: int | None, last: int) -> list[tuple]:
        m, out = self.m, []
        for v in range(len(m.profiles)):
            terms = m.stored(a, v, s, e)
            if terms is not None:
                hold, local, s2, cost = terms
                out.append((("s", v, s2), self.slot(local), self.slot(hold), cost,
                            (F[a + 1][s2],)))
        for b in range(a + 1, last + (1 if e is None else 0)):
            hold, local, cost = m.checkpointed(a, b, s, e)
            if local == INF:  # a unit in it runs stored only
                continue
            out.append((("c", b), self.slot(local), self.slot(hold), cost,
                        (self.R[b][a][BY_REGION], F[b][NOT_HELD])))
        return out

    def _states(self, a: int, e: int | None) -> tuple[int, ...]:
        """The input states that differ at unit ``a``: the top level has no region, and where no
        variant's backward tells a region from a unit holding its input, they share a table (a
        variant that runs the unit stored at the top level only is not asked)."""
        if e is None:
            return (NOT_HELD, BY_UNIT)
        if all(q.rise_in_backward(a, True, BY_UNIT) == q.rise_in_backward(a, True, BY_REGION)
               is not None for q in self.m.profiles if not q.is_opaque(a)):
            return (NOT_HELD, BY_UNIT)
        return STATES

    def _solve(self, e: int | None) -> list[list[Any]]:
        size = self.size
        last = self.m.n if e is None else e
        F: list[list[Any]] = [[None] * 3 for _ in range(last + 1)]
        for s in STATES:
            F[last][s] = np.full(size, INF)
            F[last][s][min(size, max(0, self.slot(self.m.end(s, e)))):] = 0.0
        for a in range(last - 1, -1, -1):
            states = self._states(a, e)
            for s in states:
                best = np.full(size, INF)
                for _, floor, hold, cost, parts in self.options(F, a, s, e, last):
                    start = max(floor, hold, 0)
                    if start >= size:
                        continue
                    hold = max(hold, 0)
                    total = parts[0][:size - hold] if len(parts) == 1 else \
                        parts[0][:size - hold] + parts[1][:size - hold]
                    np.minimum(best[start:], total[start - hold:] + cost, out=best[start:])
                F[a][s] = best
            if BY_REGION not in states:
                F[a][BY_REGION] = F[a][BY_UNIT]
        return F

    def levels(self, samples: int) -> list[int]:
        """Grid slots where the top level's least recompute falls: each is one proposal (evenly
        thinned to ``samples``)."""
        t = self.T[0][NOT_HELD]
        finite = np.isfinite(t)
        steps = [int(k) for k in np.flatnonzero(finite[1:] & (~finite[:-1] | (t[1:] < t[:-1])))
                 + 1]
        if finite[0]:
            steps.insert(0, 0)
        if len(steps) > samples:
            idx = np.linspace(0, len(steps) - 1, samples).round().astype(int)
            steps = [steps[i] for i in sorted(set(idx))]
        return steps

    def schedule(self, k: int) -> tuple[Nested, list[int]]:
        """The top-level schedule (and variants) whose rounded need is at most ``k`` slots."""
        variants = [0] * self.m.n
        return self._trace(None, 0, NOT_HELD, k, variants), variants

    def _trace(self, e: int | None, a: int, s: int, k: int, variants: list[int]) -> Nested:
        F = self.T if e is None else self.R[e]
        last = self.m.n if e is None else e
        segments: Nested = []
        while a < last:
            target = F[a][s][k]
            for choice, floor, hold, cost, parts in self.options(F, a, s, e, last):
                hold = max(hold, 0)
                if k >= max(floor, hold) and sum(f[k - hold] for f in parts) + cost == target:
                    break
            else:
                raise AssertionError("no choice reaches a table's cost")  # pragma: no cover
            k -= hold
            if choice[0] == "s":
                variants[a] = choice[1]
                segments.append((a, a + 1, None))
                a, s = a + 1, choice[2]
            else:
                b = choice[1]
                segments.append((a, b, self._trace(b, a, BY_REGION, k, variants)))
                a, s = b, NOT_HELD
        return merge_stored(segments)


def solve_nested(profiles: Sequence[ChainProfile], budget: int | float, slots: int = 2000,
                 step: int | None = None) -> tuple[Nested, list[int], int, int] | None:
    """The cheapest plan of the chain's front that fits ``budget``: (unit-level schedule,
    variant per unit, predicted peak, recompute FLOPs), or None when none fits. ``step``: the
    grid's step in bytes (1 on small integer sizes proposes every schedule worth having)."""
    found = Front(profiles, slots=slots, samples=10 ** 9 if step == 1 else 400, step=step) \
        .at(budget)
    if found is None:
        return None
    return found.schedule, list(found.variants), found.peak, found.cost
