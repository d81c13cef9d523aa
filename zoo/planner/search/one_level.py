"""The planner's memory model and its exact solver, one level of checkpointing.

A schedule cuts the chain's units into segments, each stored or one ``zoo.checkpoint`` region
(only its input kept; backward reruns it): Chen et al. 2016's segmenting (arXiv:1604.06174)
with free, unequal segments, rotor's dynamic programme (Beaumont et al. 2019, arXiv:1911.13214)
restricted to one level. :func:`predict_peak` walks one step event by event and is the
reference. :func:`solve` finds the least-recompute schedule that fits a budget by dynamic
programming over the cut positions, keeping per position and input-holding state the Pareto
front of (memory the rest needs, recompute) pairs: no memory is discretised, so the result is
exact for the model (the tests check it against brute force)."""
from __future__ import annotations

from collections.abc import Sequence

from ...checkpoint import split_segments
from ..profiling.chain_profile import ChainProfile

__all__ = ["predict_peak", "recompute_flops", "solve", "normalise", "Segments", "schedules",
           "uniform_segments"]

Segments = list[tuple[int, int, bool]]


def _check(p: ChainProfile, segments: Sequence[tuple[int, int, bool]]) -> Segments:
    segs = [(int(a), int(b), bool(c)) for a, b, c in segments]
    pos = 0
    for a, b, _ in segs:
        if a != pos or b <= a:
            raise ValueError(f"segments must cover units 0..{p.n_units} in order, got {segs}")
        pos = b
    if pos != p.n_units:
        raise ValueError(f"segments cover units 0..{pos}, the chain has {p.n_units}")
    return segs


def recompute_flops(p: ChainProfile, segments: Sequence[tuple[int, int, bool]]) -> int:
    """FLOPs the checkpointed segments rerun in backward (the last unit of a segment may stop
    early: ``recompute_flops``)."""
    return sum(sum(p.flops[a:b - 1]) + p.recompute_flops[b - 1]
               for a, b, ck in _check(p, segments) if ck)


def predict_peak(p: ChainProfile, segments: Sequence[tuple[int, int, bool]]) -> int:
    """Peak bytes of one training step with the chain's units run by ``segments``.

    Boundary ``k`` (unit ``k``'s input) is kept while any of its holders still needs it: the unit
    before it if that unit is stored and saves its output, the unit itself if stored and saving
    its input, a checkpointed segment starting at ``k``. It belongs to the first holder.
    """
    segs = _check(p, segments)
    forward = _Forward(p, segs)
    return max(forward.peak, _backward_peak(p, segs, forward))


class _Forward:
    """The forward pass of :func:`predict_peak`: its peak (the head's rise included), the bytes
    held at its end, the owner segment of each kept boundary, each segment's saved bytes."""

    def __init__(self, p: ChainProfile, segs: list[tuple[int, int, bool]]) -> None:
        act = p.act
        self.peak = max(p.pre_peak, p.tail_peak)
        self.owner: dict[int, int] = {}
        self.held = 0
        self.seg_saved: list[int] = []
        for i, (a, b, ck) in enumerate(segs):
            kept = 0
            if ck and a not in self.owner:
                self.owner[a] = i
                self.held += act[a]
            for u in range(a, b):
                rise = p.fwd_rise_ckpt[u] if ck else p.fwd_rise[u]
                self.peak = max(self.peak, p.base + self.held
                                + (0 if u in self.owner else act[u]) + rise)
                if not ck:
                    self.held += p.saved[u]
                    kept += p.saved[u]
                    for k, keep in ((u, p.keeps_input[u]), (u + 1, p.keeps_output[u])):
                        if keep and k not in self.owner:
                            self.owner[k] = i
                            self.held += act[k]
            self.seg_saved.append(kept)
        n = p.n_units
        self.peak = max(self.peak, p.base + self.held + (0 if n in self.owner else act[n])
                        + p.head_rise)


def _recompute_held(p: ChainProfile, a: int, b: int, u: int, live: set[int]) -> int:
    """Bytes a checkpointed segment ``[a, b)``'s recompute adds once unit ``u`` has run: what
    ``u`` saves and the boundaries it keeps (``live`` gains them)."""
    added = p.saved[u]
    for k, keep in ((u, p.keeps_input[u]), (u + 1, p.keeps_output[u])):
        if keep and k != a and k not in live:
            live.add(k)
            added += p.act[k]
    return added


def _backward_peak(p: ChainProfile, segs: list[tuple[int, int, bool]], fwd: _Forward) -> int:
    """The backward pass of :func:`predict_peak`, last segment first: its peak."""
    act, held, grads, peak = p.act, fwd.held, 0, 0
    for i in reversed(range(len(segs))):
        a, b, ck = segs[i]
        mine = {k for k, o in fwd.owner.items() if o == i}
        prefix = held - fwd.seg_saved[i] - sum(act[k] for k in mine)
        level = p.base + prefix + p.bwd_misc
        if ck:  # the recompute: a stored forward of the segment, next to its kept input
            own, live, seg = sum(act[k] for k in mine), set(), 0
            for u in range(a, b):
                transient = 0 if u == a or u in live else act[u]
                peak = max(peak, level + grads + p.dgrad[b] + own + seg + transient
                           + p.rise_in_recompute(u, u == b - 1))
                seg += _recompute_held(p, a, b, u, live)
        else:
            own, live = 0, set(mine)
            seg = fwd.seg_saved[i] + sum(act[k] for k in mine)
        before = i > 0 and not segs[i - 1][2] and p.keeps_output[a - 1]
        for u in range(b - 1, a - 1, -1):
            peak = max(peak, level + grads + p.dgrad[u + 1] + own + seg
                       + p.rise_in_backward(u, ck, _held_by(p, u, a, ck, before)))
            seg -= p.saved[u]
            for k in (u + 1, u):
                if k in live and not (k == u and u > a and p.keeps_output[u - 1]):
                    live.discard(k)
                    seg -= act[k]
            grads += p.grads[u]
        held = prefix
    return peak


def _held_by(p: ChainProfile, u: int, a: int, ck: bool, before: bool) -> int:
    """Who holds unit ``u``'s input besides itself, in a segment starting at ``a`` (``before``:
    the segment before is stored and holds it): 0 nobody, 1 the unit before, 2 the region."""
    if u > a:
        return int(p.keeps_output[u - 1])
    return 2 if ck else int(before)


# ---- The dynamic programme.
def _segment_terms(p: ChainProfile, a: int, b: int, ck: bool, held_before: bool,
                   grads_after: int) -> tuple[int, int, bool]:
    """(bytes the segment holds for later, its local peak above ``base`` + what earlier
    segments hold, whether it holds its output) for segment ``[a, b)``; ``held_before``: its
    input is held by the segment before."""
    act = p.act
    local = 0
    if ck:
        hold = 0 if held_before else act[a]
        for u in range(a, b):
            local = max(local, hold + (act[u] if u > a else 0) + p.fwd_rise_ckpt[u])
        live: set[int] = set()
        seg = 0
        level = p.bwd_misc + grads_after + hold
        for u in range(a, b):  # recompute
            transient = 0 if u == a or u in live else act[u]
            local = max(local, level + p.dgrad[b] + seg + transient
                        + p.rise_in_recompute(u, u == b - 1))
            seg += p.saved[u]
            for k, keep in ((u, p.keeps_input[u]), (u + 1, p.keeps_output[u])):
                if keep and k != a and k not in live:
                    live.add(k)
                    seg += act[k]
        holds_output = False
    else:
        owned = {a} if held_before else set()
        live = set()
        hold = 0
        for u in range(a, b):
            local = max(local, hold + (0 if u in owned else act[u]) + p.fwd_rise[u])
            hold += p.saved[u]
            for k, keep in ((u, p.keeps_input[u]), (u + 1, p.keeps_output[u])):
                if keep and k not in owned:
                    owned.add(k)
                    live.add(k)
                    hold += act[k]
        seg, level = hold, p.bwd_misc + grads_after
        holds_output = b in live
    grads = 0
    for u in range(b - 1, a - 1, -1):
        local = max(local, level + grads + p.dgrad[u + 1] + seg
                    + p.rise_in_backward(u, ck, _held_by(p, u, a, ck, held_before)))
        seg -= p.saved[u]
        for k in (u + 1, u):
            if k in live and not (k == u and u > a and p.keeps_output[u - 1]):
                live.discard(k)
                seg -= act[k]
        grads += p.grads[u]
    return hold, local, holds_output


Option = tuple[int, int, tuple | None]  # (memory needed above base, cost, (b, ck, state, index))


def fronts(p: ChainProfile) -> list[list[list[Option]]]:
    """``front[a][s]``: the Pareto-optimal (need, cost) schedules of units ``a..n``, need
    ascending and cost strictly descending; ``s``: unit ``a``'s input is held by the segment
    before. Cost = recompute FLOPs x (n + 1) + recomputed units (fewer reruns break ties)."""
    n = p.n_units
    width = n + 1
    grads_after = [sum(p.grads[b:]) for b in range(n + 1)]
    front: list[list[list[Option]]] = [[[], []] for _ in range(n + 1)]
    front[n] = [[(p.act[n] + p.head_rise, 0, None)], [(p.head_rise, 0, None)]]
    for a in range(n - 1, -1, -1):
        for s in (False, True):
            if s and not p.held_in_plain(a):  # no stored segment before can hold its input
                continue
            cands: list[Option] = []
            for b in range(a + 1, n + 1):
                rerun = sum(p.flops[a:b - 1]) + p.recompute_flops[b - 1]
                for ck in (False, True):
                    hold, local, s2 = _segment_terms(p, a, b, ck, s, grads_after[b])
                    cost = rerun * width + (b - a) if ck else 0
                    for idx, (need, c, _) in enumerate(front[b][s2]):
                        cands.append((max(local, hold + need), cost + c, (b, ck, s2, idx)))
            cands.sort(key=lambda o: (o[0], o[1]))
            best = None
            kept: list[Option] = []
            for o in cands:
                if best is None or o[1] < best:
                    kept.append(o)
                    best = o[1]
            front[a][s] = kept
    return front


def normalise(segments: Segments) -> Segments:
    """Merge neighbouring stored segments (the same memory and cost, fewer regions)."""
    out: Segments = []
    for a, b, ck in segments:
        if out and not ck and not out[-1][2]:
            out[-1] = (out[-1][0], b, False)
        else:
            out.append((a, b, ck))
    return out


def solve(p: ChainProfile, budget: int,
          front: list[list[list[Option]]] | None = None) -> tuple[Segments, int] | None:
    """The cheapest schedule (unit-level segments) whose predicted peak fits ``budget``, with
    its predicted peak; None if no schedule fits."""
    front = front or fronts(p)
    room = budget - p.base
    if max(p.pre_peak, p.tail_peak) > budget:
        return None
    options = [o for o in front[0][False] if o[0] <= room]
    if not options:
        return None
    segments = _traced(front, options[-1])  # cost descending: the last that fits is cheapest
    return segments, predict_peak(p, segments)


def _traced(front: list[list[list[Option]]], choice: Option) -> Segments:
    """The schedule a top-front entry stands for."""
    segments: Segments = []
    a = 0
    while choice[2] is not None:
        b, ck, s2, idx = choice[2]
        segments.append((a, b, ck))
        a, choice = b, front[b][s2][idx]
    return normalise(segments)


def schedules(p: ChainProfile, front: list[list[list[Option]]] | None = None
              ) -> list[tuple[Segments, int, int]]:
    """Every schedule of the top front: (unit-level segments, predicted peak, recompute FLOPs),
    peak ascending, recompute falling (the one-level plans worth having)."""
    front = front or fronts(p)
    found = [_traced(front, choice) for choice in front[0][False]]
    return [(s, predict_peak(p, s), recompute_flops(p, s)) for s in found]


def _least_need(p: ChainProfile) -> int:
    """The front's first entry alone: the same recursion keeping only the least memory need
    (``max(local, hold + need)`` grows with ``need``, so the least suffix need is optimal), in a
    fraction of the time of :func:`fronts` (the batch search calls this many times)."""
    n = p.n_units
    grads_after = [sum(p.grads[b:]) for b in range(n + 1)]
    need = [[0, 0] for _ in range(n + 1)]
    need[n] = [p.act[n] + p.head_rise, p.head_rise]
    for a in range(n - 1, -1, -1):
        for s in ((False, True) if p.held_in_plain(a) else (False,)):
            options = []
            for b in range(a + 1, n + 1):
                for ck in (False, True):
                    hold, local, s2 = _segment_terms(p, a, b, ck, s, grads_after[b])
                    options.append(max(local, hold + need[b][s2]))
            need[a][s] = min(options)
    return need[0][0]


def smallest_peak(p: ChainProfile, front: list[list[list[Option]]] | None = None) -> int:
    """The lowest peak any schedule reaches."""
    least = front[0][False][0][0] if front else _least_need(p)
    return max(p.pre_peak, p.tail_peak, p.base + least)


def uniform_segments(profile: ChainProfile, segments: int) -> Segments:
    """``checkpoint_sequential``'s schedule at unit level: ``segments`` balanced checkpointed
    segments covering the chain (the last one too, as ``zoo.checkpoint_sequential`` does)."""
    return [(r.start, r.stop, True) for r in split_segments(profile.n_units, segments)]
