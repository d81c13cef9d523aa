"""Every plan a chain's profiles offer, as one front of (predicted peak, recompute): solved once,
read at any budget.

:mod:`.multi_level`'s dynamic programme runs once over a fixed memory grid (as rotor
discretises memory): ``R[e][a][s]``, the least recompute of units ``a..e`` run as a segment's
recompute, and ``T[a][s]`` for the top level, over the grid, ``s`` how unit ``a``'s input is
held. The grid only proposes: each proposal is traced back and priced exactly
(``multi_level.schedule_cost``), and the front keeps those no other beats on both peak and
recompute, with the exact least-peak schedule and the plain one. The front does not depend on
the budget, so a lower budget never gets a plan with a higher peak."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .multi_level import (BY_REGION, BY_UNIT, NOT_HELD, STATES, Nested, NestedModel, _Least,
                     merge_stored, schedule_cost)
from ..profiling.chain_profile import ChainProfile

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
    """The dynamic programme's tables over ``slots`` memory slots of ``step`` bytes.

    A table ``F[a][s]`` is the elementwise least, over every way to start at unit ``a``, of
    the rest's table shifted by what that start holds. The ways that checkpoint ``[a, b)``
    share their hold for every ``b`` and start at a slot that grows with ``b`` (a longer
    segment's unsaved forward rises no less), so they are taken together
    (:meth:`_least_checkpointed`): one running least down the rows ``b``, read at each slot
    from the last row that may start there. Mins of the same sums, in the same order of
    additions: the tables are those of taking the ways one by one."""

    def __init__(self, m: NestedModel, top: int, step: int) -> None:
        self.m, self.step = m, step
        self.size = int(round(top / step)) + 1
        self._options: dict[tuple, list[tuple]] = {}  # (e, a, s): made once, traced again
        # by_region[a][b - a - 1] is R[b][a][BY_REGION]: the rows a checkpointed start reads
        self.by_region = [np.empty((m.n - a, self.size)) for a in range(m.n)]
        self.rise = np.array(m.fwd_ckpt, dtype=float)
        self.flops_before = np.array(m.flops_before, dtype=np.int64)
        self._work = np.empty((m.n, self.size))  # reused: a fresh one per unit costs more
        self._slots = np.arange(self.size)
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
            found = self._options[e, a, s] = self._stored_options(F, a, s, e) \
                + self._checkpointed_options(F, a, s, e, last)
        return found

    def _stored_options(self, F: list, a: int, s: int, e: int | None) -> list[tuple]:
        out = []
        for v in range(len(self.m.profiles)):
            terms = self.m.stored(a, v, s, e)
            if terms is not None:
                hold, local, s2, cost = terms
                out.append((("s", v, s2), self.slot(local), self.slot(hold), cost,
                            (F[a + 1][s2],)))
        return out

    def _checkpointed_options(self, F: list, a: int, s: int, e: int | None, last: int
                              ) -> list[tuple]:
        out = []
        for b in range(a + 1, last + (1 if e is None else 0)):
            hold, local, cost = self.m.checkpointed(a, b, s, e)
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
        size, m = self.size, self.m
        last = m.n if e is None else e
        F: list[list[Any]] = [[None] * 3 for _ in range(last + 1)]
        not_held = np.empty((last + 1, size))  # row b: F[b][NOT_HELD]
        for s in STATES:
            F[last][s] = not_held[last] if s == NOT_HELD else np.empty(size)
            F[last][s][:] = INF
            F[last][s][min(size, max(0, self.slot(m.end(s, e)))):] = 0.0
        for a in range(last - 1, -1, -1):
            states = self._states(a, e)
            runs = self._checkpointed_runs(not_held, a, e, last)
            for s in states:
                best = not_held[a] if s == NOT_HELD else self._region_row(a, e) \
                    if s == BY_REGION else np.empty(size)
                best[:] = INF
                for _, floor, hold, cost, parts in self._stored_options(F, a, s, e):
                    start = max(floor, hold, 0)
                    if start >= size:
                        continue
                    hold = max(hold, 0)
                    total = parts[0][:size - hold]
                    np.minimum(best[start:], total[start - hold:] + cost, out=best[start:])
                if runs is not None:
                    self._least_checkpointed(best, runs, a, s, e)
                F[a][s] = best
            if BY_REGION not in states:
                F[a][BY_REGION] = F[a][BY_UNIT]
                if e is not None:  # a checkpointed start reads a region's table by row
                    np.copyto(self._region_row(a, e), F[a][BY_UNIT])
        return F

    def _region_row(self, a: int, e: int | None) -> np.ndarray:
        return self.by_region[a][e - a - 1]

    def _checkpointed_runs(self, not_held: np.ndarray, a: int, e: int | None, last: int
                           ) -> np.ndarray | None:
        """Row ``i``: the least, over ``b`` up to ``a + 1 + i``, of the rest's table after
        checkpointing ``[a, b)``, unshifted (``R[b][a][BY_REGION] + F[b][NOT_HELD]`` plus
        the segment's recompute); None when no segment starts at ``a``."""
        stop = last + (1 if e is None else 0)
        if stop <= a + 1:
            return None
        rest = np.add(self.by_region[a][:stop - a - 1], not_held[a + 1:stop],
                      out=self._work[:stop - a - 1])
        if e is not None:
            rest += (self.flops_before[a + 1:stop] - self.flops_before[a])[:, None]
        for i in range(1, len(rest)):  # np.minimum.accumulate down axis 0 takes 7x longer
            np.minimum(rest[i - 1], rest[i], out=rest[i])
        return rest

    def _least_checkpointed(self, best: np.ndarray, runs: np.ndarray, a: int, s: int,
                            e: int | None) -> None:
        """``best`` lowered by every segment ``[a, b)`` checkpointed, input held as ``s``:
        at each slot, the running least (``runs``) of the segments that may start there
        (their starting slots grow with ``b``)."""
        size, m = self.size, self.m
        hold = 0 if s else m.profiles[0].act[a]
        h = max(self.slot(hold), 0)
        if h >= size:
            return
        rise = self.rise[a, a + 1:a + 1 + len(runs)]
        floors = np.rint((m.offset(e) + hold + rise) / self.step)  # inf: runs stored only
        starts = np.maximum(floors, h) - h  # slots of the rest's table, shifted by the hold
        cols = self._slots[:size - h]
        row = np.searchsorted(starts, cols, side="right") - 1
        least = runs[np.maximum(row, 0), cols]
        least[row < 0] = INF
        np.minimum(best[h:], least, out=best[h:])

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
