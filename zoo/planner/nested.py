"""Multi-level checkpoint schedules of a chain, with per-block options, and their exact solver.

A *nested schedule* cuts units ``a..b`` into segments, each either *stored* (a unit run plainly:
autograd keeps what it saves) or *checkpointed* (one ``zoo.checkpoint`` region keeping only its
input) with an *inner* schedule of its own units: the schedule its recompute runs, which may
checkpoint again. This is rotor's persistent schedule (Beaumont et al. 2019, "Optimal
checkpointing for heterogeneous chains", arXiv:1911.13214; Beaumont et al. 2021, rockmate's
chain level): a checkpointed segment ``[a, c)`` inside a recompute runs forward saving nothing
(``F_∅``), the rest of the recompute goes on, and ``[a, c)`` is recomputed again, by its inner
schedule, when backward reaches it. Every stored unit also picks a *variant*: the plain block
(variant 0) or the block in one of the model's intra-block checkpoint modes (DenseNet's
``bottleneck``, ResNet's ``halves``, ...), each profiled as a whole chain (``profiles[v]``).

The memory model is the one-level model of :mod:`.solve` (whose event-by-event
``predict_peak`` it reproduces on one-level schedules; tests/planner/test_planner_nested.py checks
it)
applied recursively: the peak of a schedule is ``base + need`` where a segment contributes
``need = max(local, hold + need of the segments after it)`` (``hold``: what it keeps until its
backward; ``local``: its own peaks above what earlier segments hold). A checkpointed segment's
backward peak is its hold plus its inner schedule's need, so the same recursion solves the inner
schedules. The recompute in a segment runs while its gradient and the parameter gradients of the
units after it are alive (``offset`` below), and its last unit stops early (``recompute_flops``).

:func:`solve_nested` finds the schedule with the least recompute cost under a budget by dynamic
programming over Pareto fronts of (need, cost): ``R[e][a][s]`` holds the schedules of units
``a..e`` run as the recompute of a segment ending at ``e``, ``T[a][s]`` those of the top level;
``s``: unit ``a``'s input is already held. Fronts are combined exactly (no memory
discretisation), so the result is exact for the model: tests compare it with an exhaustive
search over every nested schedule and variant of small chains.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .profile import ChainProfile
from .solve import smallest_peak

__all__ = ["Nested", "NestedModel", "solve_nested", "schedule_cost", "least_peak",
           "chain_floor", "MAX_UNITS"]

# Longer chains are planned one level deep (ResNet-1202's 602 units: the programme is cubic in
# the units, and its fronts take units^2 x slots floats; the slots shrink past ~110 units so
# that stays under 400 MB).
MAX_UNITS = 200

Nested = list  # [(a, b, None | Nested)]: None = stored units, a list = checkpointed, its inner plan
INF = float("inf")


@dataclass
class NestedModel:
    """The per-unit terms the recursion needs, from the chain's profiles (one per variant)."""

    profiles: Sequence[ChainProfile]

    def __post_init__(self) -> None:
        p = self.profiles[0]
        for q in self.profiles[1:]:
            if q.units != p.units or q.act != p.act:
                raise ValueError("every variant's profile must have the same units and boundaries")
        self.n = p.n_units
        self.grads_after = [sum(p.grads[b:]) for b in range(self.n + 1)]
        self.rise_ckpt = [max(q.fwd_rise_ckpt[u] for q in self.profiles) for u in range(self.n)]
        self.flops_before = [0, *itertools.accumulate(p.flops)]
        self.fwd_ckpt = [[0] * (self.n + 1) for _ in range(self.n + 1)]  # unsaved forward peaks
        for a in range(self.n):
            top = 0
            for b in range(a + 1, self.n + 1):
                top = max(top, (p.act[b - 1] if b - 1 > a else 0) + self.rise_ckpt[b - 1])
                self.fwd_ckpt[a][b] = top

    def offset(self, e: int | None) -> int:
        """What is alive above the level while a recompute of a segment ending at ``e`` runs
        forward (``None``: the top level's forward, nothing)."""
        p = self.profiles[0]
        return 0 if e is None else p.bwd_misc + self.grads_after[e] + p.dgrad[e]

    def stored(self, u: int, v: int, s: bool, e: int | None) -> tuple[int, int, bool, int]:
        """(hold, local, output held, cost) of unit ``u`` stored in variant ``v``; ``e``: the end
        of the recompute it runs in (``None``: top level)."""
        q, p = self.profiles[v], self.profiles[0]
        act = p.act
        local = self.offset(e) + (0 if s else act[u]) + q.fwd_rise[u]
        hold = q.saved[u] + (act[u] if q.keeps_input[u] and not s else 0)
        if q.keeps_output[u]:
            hold += act[u + 1]
        back = p.bwd_misc + self.grads_after[u + 1] + p.dgrad[u + 1] + hold + q.bwd_rise[u]
        cost = _inner_flops(q, u)
        if e is not None:
            cost += p.flops[u] if u < e - 1 else q.recompute_flops[u]
        return hold, max(local, back), bool(q.keeps_output[u]), cost

    def checkpointed(self, a: int, b: int, s: bool, e: int | None) -> tuple[int, int, int]:
        """(hold, forward local peak, cost without the inner schedule) of segment ``[a, b)``
        checkpointed in a recompute ending at ``e`` (``None``: top level)."""
        hold = 0 if s else self.profiles[0].act[a]
        local = self.offset(e) + hold + self.fwd_ckpt[a][b]
        cost = 0 if e is None else self.flops_before[b] - self.flops_before[a]
        return hold, local, cost

    def end(self, s: bool, e: int | None) -> int:
        """Need after the last segment's forward: the head at the top level, nothing inside."""
        p = self.profiles[0]
        return (0 if s else p.act[self.n]) + p.head_rise if e is None else 0


def _inner_flops(q: ChainProfile, u: int) -> int:
    """What unit ``u``'s own checkpoints recompute in variant profile ``q``."""
    return q.unit_inner_flops[u] if q.unit_inner_flops else 0


# ------------------------------------------------------------------------------------------------
# The dynamic programme over a memory grid.
# ------------------------------------------------------------------------------------------------
class _Grid:
    """Every front of the dynamic programme as an array over memory slots: ``F[m]`` is the least
    cost of a schedule whose need is at most ``m * step`` bytes (``inf``: none). Needs are
    rounded up to slots at every step of the recursion (``step = 1`` on integer sizes: exact),
    so a schedule never looks lighter than it is. ``R[e][a][s]``: recomputes ending at ``e``;
    ``T[a][s]``: the top level; ``s``: unit ``a``'s input already held."""

    def __init__(self, m: NestedModel, room: float, step: int):
        self.m, self.step = m, max(1, int(step))
        self.slots = int(room // self.step) if room != INF else 0
        n = m.n
        self.R: list[list[list[np.ndarray]]] = [[] for _ in range(n + 1)]
        for e in range(1, n + 1):
            self.R[e] = self._solve(e)
        self.T = self._solve(None)

    def slot(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.step)

    def options(self, F: list[list[np.ndarray]], a: int, s: bool, e: int | None,
                last: int) -> list[tuple[tuple, int, int, float, list[np.ndarray]]]:
        """Each way to start a schedule at unit ``a``: (choice, floor slot, hold slot, cost,
        fronts whose sum, shifted by the hold, is the rest's cost)."""
        m, out = self.m, []
        for v in range(len(m.profiles)):
            hold, local, s2, cost = m.stored(a, v, s, e)
            out.append((("s", v, s2), self.slot(local), self.slot(hold), cost, [F[a + 1][s2]]))
        for b in range(a + 1, last + (1 if e is None else 0)):
            hold, local, cost = m.checkpointed(a, b, s, e)
            out.append((("c", b), self.slot(local), self.slot(hold), cost,
                        [self.R[b][a][True], F[b][False]]))
        return out

    def _solve(self, e: int | None) -> list[list[np.ndarray]]:
        n, size = self.m.n, self.slots + 1
        last = n if e is None else e
        F: list[list[Any]] = [[None, None] for _ in range(last + 1)]
        for s in (False, True):
            F[last][s] = np.full(size, np.inf)
            F[last][s][min(size, self.slot(self.m.end(s, e))):] = 0.0
        for a in range(last - 1, -1, -1):
            for s in (False, True):
                best = np.full(size, np.inf)
                for _, floor, hold, cost, parts in self.options(F, a, s, e, last):
                    start = max(floor, hold)
                    if start >= size:
                        continue
                    total = parts[0][:size - hold] if len(parts) == 1 else \
                        parts[0][:size - hold] + parts[1][:size - hold]
                    np.minimum(best[start:], total[start - hold:] + cost, out=best[start:])
                F[a][s] = best
        return F

    def schedule(self, e: int | None, a: int, s: bool, k: int, variants: list[int]) -> Nested:
        """The schedule of cost ``F[a][s][k]`` (variants written into ``variants``)."""
        F = self.T if e is None else self.R[e]
        last = self.m.n if e is None else e
        segments: Nested = []
        while a < last:
            target = F[a][s][k]
            for choice, floor, hold, cost, parts in self.options(F, a, s, e, last):
                if k >= max(floor, hold) and sum(f[k - hold] for f in parts) + cost == target:
                    break
            else:
                raise AssertionError("no choice reaches a front's cost")  # pragma: no cover
            k -= hold
            if choice[0] == "s":
                variants[a] = choice[1]
                segments.append((a, a + 1, None))
                a, s = a + 1, choice[2]
            else:
                b = choice[1]
                segments.append((a, b, self.schedule(b, a, True, k, variants)))
                a, s = b, False
        return _merge_stored(segments)


def _merge_stored(segments: Nested) -> Nested:
    out: Nested = []
    for a, b, inner in segments:
        if out and inner is None and out[-1][2] is None:
            out[-1] = (out[-1][0], b, None)
        else:
            out.append((a, b, inner))
    return out


def solve_nested(profiles: Sequence[ChainProfile], budget: int | float, slots: int = 1000,
                 step: int | None = None) -> tuple[Nested, list[int], int, int] | None:
    """The cheapest nested schedule whose predicted peak fits ``budget``: (unit-level schedule,
    variant per unit, predicted peak, recompute FLOPs), or None when none fits.

    Memory is searched on a grid of ``slots`` steps up to the budget, as rotor discretises it
    (``step``: the grid's step in bytes instead; 1 is exact on integer sizes). Rounding never
    makes a schedule look lighter than it is, and the peak returned is the schedule's exact
    predicted one (:func:`schedule_cost`)."""
    p = profiles[0]
    room = budget - p.base
    if room < 0 or max(p.pre_peak, p.tail_peak) > budget or room == INF:
        return None
    m = NestedModel(profiles)
    slots = min(slots, max(500, int(5e7 // m.n ** 2)))
    grid = _Grid(m, room, step or max(1, math.ceil(room / slots)))
    variants = [0] * p.n_units
    if math.isfinite(grid.T[0][False][-1]):
        schedule = grid.schedule(None, 0, False, grid.slots, variants)
    else:  # the grid's rounding may hide the very least schedule: take it if it fits
        least = _Least(m)
        if least.peak > budget:
            return None
        schedule = least.schedule(None, 0, False, variants)
    need, cost = schedule_cost(m, schedule, variants)
    return schedule, variants, max(p.pre_peak, p.tail_peak, p.base + need), cost


class _Least:
    """The recursion on least needs alone: each front's first entry, exact (the combination of
    least needs is the least need), and the schedule that reaches it."""

    def __init__(self, m: NestedModel):
        self.m = m
        n = m.n
        self.tables: dict[int | None, list[list[tuple[int, tuple]]]] = {}
        for e in [*range(1, n + 1), None]:
            last = n if e is None else e
            F: list[list[tuple[int, tuple]]] = [[(0, ()), (0, ())] for _ in range(last + 1)]
            F[last] = [(m.end(False, e), ()), (m.end(True, e), ())]
            for a in range(last - 1, -1, -1):
                for s in (False, True):
                    best: tuple[float, tuple] = (INF, ())
                    for v in range(len(m.profiles)):
                        hold, local, s2, _ = m.stored(a, v, s, e)
                        best = min(best, (max(local, hold + F[a + 1][s2][0]), ("s", v, s2)))
                    for b in range(a + 1, last + (1 if e is None else 0)):
                        hold, local, _ = m.checkpointed(a, b, s, e)
                        rest = max(self.tables[b][a][1][0], F[b][0][0])
                        best = min(best, (max(local, hold + rest), ("c", b)))
                    F[a][s] = best  # type: ignore[assignment]
            self.tables[e] = F
        p = m.profiles[0]
        self.peak = max(p.pre_peak, p.tail_peak, p.base + self.tables[None][0][0][0])

    def schedule(self, e: int | None, a: int, s: bool, variants: list[int]) -> Nested:
        """The least-need schedule of units ``a..`` (variants written into ``variants``)."""
        F, segments = self.tables[e], []
        while F[a][s][1]:
            choice = F[a][s][1]
            if choice[0] == "s":
                variants[a] = choice[1]
                segments.append((a, a + 1, None))
                a, s = a + 1, choice[2]
            else:
                segments.append((a, choice[1], self.schedule(choice[1], a, True, variants)))
                a, s = choice[1], False
        return _merge_stored(segments)


def least_peak(profiles: Sequence[ChainProfile]) -> int:
    """The lowest peak any nested schedule (any variants) reaches."""
    return _Least(NestedModel(profiles)).peak


def chain_floor(p: ChainProfile) -> int:
    """The lowest peak the planner reaches on ``p``'s plain blocks: nested schedules, or one
    level deep beyond ``MAX_UNITS`` units."""
    return least_peak([p]) if p.n_units <= MAX_UNITS else smallest_peak(p)


# ------------------------------------------------------------------------------------------------
# One schedule's need and cost, segment by segment (the reference the solver is tested against).
# ------------------------------------------------------------------------------------------------
def schedule_cost(m: NestedModel, schedule: Nested, variants: Sequence[int],
                  e: int | None = None, s: bool = False) -> tuple[int, int]:
    """(need above ``base``, cost) of ``schedule`` (top level, or the recompute of a segment
    ending at ``e`` whose first input is held when ``s``); cost: recomputed FLOPs."""
    terms: list[tuple[int, int]] = []  # (hold, local) per segment, in order
    cost = 0
    for a, b, inner in schedule:
        if inner is None:
            for u in range(a, b):
                hold, local, s, c = m.stored(u, variants[u], s, e)
                terms.append((hold, local))
                cost += c
        else:
            hold, local, c = m.checkpointed(a, b, s, e)
            need, inner_cost = schedule_cost(m, inner, variants, b, True)
            terms.append((hold, max(local, hold + need)))
            cost += c + inner_cost
            s = False
    need = m.end(s, e)
    for hold, local in reversed(terms):
        need = max(local, hold + need)
    return need, cost
