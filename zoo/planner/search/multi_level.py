"""Multi-level checkpoint schedules of a chain, with per-block options, and their exact solver.

A *nested schedule* cuts units ``a..b`` into segments, each *stored* (run plainly) or
*checkpointed* (one ``zoo.checkpoint`` region keeping only its input) with an *inner* schedule:
the one its recompute runs, which may checkpoint again. This is rotor's persistent schedule
(Beaumont et al. 2019, arXiv:1911.13214; rockmate's chain level, Beaumont et al. 2021). Every
stored unit also picks a *variant*: the plain block (0) or one of the model's intra-block modes,
each profiled as a whole chain (``profiles[v]``).

The memory model is :mod:`.one_level`'s applied recursively (it reproduces ``predict_peak`` on
one-level schedules: tests/planner/test_planner_nested.py): a segment contributes ``need =
max(local, hold + need of the segments after it)``, and a checkpointed segment's backward peak
is its hold plus its inner schedule's need. Each unit's terms depend on how its input is held
when it starts (``STATES``). This file holds the model (:class:`NestedModel`,
:func:`schedule_cost`, the reference) and the exact least-peak recursion (:func:`least_peak`);
:mod:`.front` solves for every budget at once."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..profiling.chain_profile import ChainProfile

__all__ = ["Nested", "NestedModel", "schedule_cost", "least_peak", "MAX_UNITS",
           "merge_stored", "NOT_HELD", "BY_UNIT", "BY_REGION", "STATES"]

# Longer chains (ResNet-1202's 602 units) have their units joined a few blocks at a time, to at
# most half this many (``repeats.joined``): the programme is cubic in the units, and its fronts
# take units^2 x slots floats (the slots shrink past ~110 units so that stays under 400 MB).
MAX_UNITS = 200

Nested = list  # [(a, b, None | Nested)]: None: stored units; a list: checkpointed, its inner plan
INF = float("inf")

# HELD_BY: how a unit's input is held when it starts. Memory-wise the last two are the same (the
# input costs the unit nothing), but a unit whose input the unit before still holds frees it no
# earlier than that unit's backward, while the enclosing region lets go of it inside.
NOT_HELD, BY_UNIT, BY_REGION = 0, 1, 2
STATES = (NOT_HELD, BY_UNIT, BY_REGION)


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
        # a checkpointed segment's forward saves nothing: its units' variants barely matter
        # (the rises agree on the zoo's models); a unit that runs stored only does not count,
        # and one that runs stored in every variant is never checkpointed
        self.rise_ckpt = [max((q.fwd_rise_ckpt[u] for q in self.profiles if not q.is_opaque(u)),
                              default=INF) for u in range(self.n)]
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

    def stored(self, u: int, v: int, s: int, e: int | None) -> tuple[int, int, int, int] | None:
        """(hold, local, state after, cost) of unit ``u`` stored in variant ``v``, or None where
        it cannot run so (a unit keeping part of its tensors out of the hooks' sight runs stored
        at the top level only); ``s``: how its input is held (:data:`HELD_BY`); ``e``: the end of
        the recompute it runs in (``None``: top level)."""
        q, p = self.profiles[v], self.profiles[0]
        if e is not None and q.is_opaque(u):
            return None
        act = p.act
        rise = q.rise_in_recompute(u, u == e - 1) if e is not None else q.fwd_rise[u]
        local = self.offset(e) + (0 if s else act[u]) + rise
        hold = q.saved[u] + (act[u] if q.keeps_input[u] and not s else 0)
        if q.keeps_output[u]:
            hold += act[u + 1]
        rise_back = q.rise_in_backward(u, e is not None, s)
        if rise_back is None:  # a context this unit's profile never saw
            return None
        back = p.bwd_misc + self.grads_after[u + 1] + p.dgrad[u + 1] + hold + rise_back
        cost = _inner_flops(q, u)
        if e is not None:
            cost += p.flops[u] if u < e - 1 else q.recompute_flops[u]
        return hold, max(local, back), BY_UNIT if q.keeps_output[u] else NOT_HELD, cost

    def checkpointed(self, a: int, b: int, s: int, e: int | None) -> tuple[int, int, int]:
        """(hold, forward local peak, cost without the inner schedule) of segment ``[a, b)``
        checkpointed in a recompute ending at ``e`` (``None``: top level)."""
        hold = 0 if s else self.profiles[0].act[a]
        local = self.offset(e) + hold + self.fwd_ckpt[a][b]
        cost = 0 if e is None else self.flops_before[b] - self.flops_before[a]
        return hold, local, cost

    def end(self, s: int, e: int | None) -> int:
        """Need after the last segment's forward: the head at the top level, nothing inside."""
        p = self.profiles[0]
        return (0 if s else p.act[self.n]) + p.head_rise if e is None else 0


def _inner_flops(q: ChainProfile, u: int) -> int:
    """What unit ``u``'s own checkpoints recompute in variant profile ``q``."""
    return q.unit_inner_flops[u] if q.unit_inner_flops else 0


class _Least:
    """The recursion on least needs alone: each front's first entry, exact (the combination of
    least needs is the least need), and the schedule that reaches it."""

    def __init__(self, m: NestedModel):
        self.m = m
        n = m.n
        self.tables: dict[int | None, list[list[tuple[float, tuple]]]] = {}
        for e in [*range(1, n + 1), None]:
            last = n if e is None else e
            F: list[list[tuple[float, tuple]]] = [[(INF, ())] * 3 for _ in range(last + 1)]
            F[last] = [(m.end(s, e), ()) for s in STATES]
            for a in range(last - 1, -1, -1):
                for s in STATES:
                    best: tuple[float, tuple] = (INF, ())
                    for v in range(len(m.profiles)):
                        terms = m.stored(a, v, s, e)
                        if terms is not None:
                            hold, local, s2, _ = terms
                            best = min(best, (max(local, hold + F[a + 1][s2][0]), ("s", v, s2)))
                    for b in range(a + 1, last + (1 if e is None else 0)):
                        hold, local, _ = m.checkpointed(a, b, s, e)
                        rest = max(self.tables[b][a][BY_REGION][0], F[b][NOT_HELD][0])
                        best = min(best, (max(local, hold + rest), ("c", b)))
                    F[a][s] = best
            self.tables[e] = F
        p = m.profiles[0]
        self.peak = max(p.pre_peak, p.tail_peak, p.base + self.tables[None][0][NOT_HELD][0])

    def schedule(self, e: int | None, a: int, s: int, variants: list[int]) -> Nested:
        """The least-need schedule of units ``a..`` (variants written into ``variants``)."""
        F, segments = self.tables[e], []
        while F[a][s][1]:
            choice = F[a][s][1]
            if choice[0] == "s":
                variants[a] = choice[1]
                segments.append((a, a + 1, None))
                a, s = a + 1, choice[2]
            else:
                segments.append((a, choice[1], self.schedule(choice[1], a, BY_REGION, variants)))
                a, s = choice[1], NOT_HELD
        return merge_stored(segments)


def least_peak(profiles: Sequence[ChainProfile]) -> int:
    """The lowest peak any nested schedule (any variants) reaches."""
    return _Least(NestedModel(profiles)).peak


# ---- One schedule's need and cost, segment by segment: the reference the solver is tested on.
def schedule_cost(m: NestedModel, schedule: Nested, variants: Sequence[int],
                  e: int | None = None, s: int = NOT_HELD) -> tuple[float, int]:
    """(need above ``base``, cost) of ``schedule`` (top level, or the recompute of a segment
    ending at ``e``, whose first input its region holds); cost: recomputed FLOPs. A schedule
    with a unit that cannot run where it is needs ``inf``."""
    terms: list[tuple[int, int]] = []  # (hold, local) per segment, in order
    cost = 0
    for a, b, inner in schedule:
        if inner is None:
            for u in range(a, b):
                found = m.stored(u, variants[u], s, e)
                if found is None:
                    return INF, cost
                hold, local, s, c = found
                terms.append((hold, local))
                cost += c
        else:
            hold, local, c = m.checkpointed(a, b, s, e)
            need, inner_cost = schedule_cost(m, inner, variants, b, BY_REGION)
            terms.append((hold, max(local, hold + need)))
            cost += c + inner_cost
            s = NOT_HELD
    need: float = m.end(s, e)
    for hold, local in reversed(terms):
        need = max(local, hold + need)
    return need, cost


def merge_stored(segments: Nested) -> Nested:
    """Neighbouring stored segments as one (the same schedule)."""
    out: Nested = []
    for a, b, inner in segments:
        if out and inner is None and out[-1][2] is None:
            out[-1] = (out[-1][0], b, None)
        else:
            out.append((a, b, inner))
    return out
