"""The runs that show each unit of a chain in every context a schedule puts it in, and what the
profiler reads off them (:mod:`.profile` runs them).

A unit's backward depends on whether its saved tensors were recomputed and on who else holds
its input (the unit before, the enclosing region, or nobody). :func:`nested_pattern` lays out
four runs, shifted by one unit each, that show every unit in each of those contexts (two where
no unit's input is held by the unit before); :func:`read_pattern` fills in the profile's
per-context figures."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .trace import Trace

if TYPE_CHECKING:
    from .chain_profile import ChainProfile

__all__ = ["nested_pattern", "blocks_of", "read_pattern", "fill_gaps", "unit_peak"]

REGION, AFTER_INNER, AFTER_UNIT, AFTER_SEGMENT = "region", "after inner", "after unit", "after"


def nested_pattern(n_units: int, shift: int, held: bool = True
                   ) -> tuple[list, dict[int, str]]:
    """Unit-level nested segments and each unit's role in them. From unit ``shift % 4`` on, every
    four units ``a..a+3`` run as ``[(a, a+3, [(a, a+1, [(a, a+1, None)]), (a+1, a+3, None)]),
    (a+3, a+4, None)]``: unit ``a`` is recomputed first in a region (``region``), ``a+1``
    recomputed right after an inner checkpointed segment (``after inner``: nobody holds its
    input but itself), ``a+2`` recomputed after a stored unit (``after unit``), ``a+3`` stored
    right after a checkpointed segment (``after``). The units before the first group form a
    shorter one.

    ``held=False``, for a chain none of whose units holds its input in the unit before in a
    plain step: from unit ``shift % 2`` on, every two units ``a, a+1`` run as the first two of
    such a group, ``(a, a+2, [(a, a+1, [(a, a+1, None)]), (a+1, a+2, None)])``, so that two
    runs show every unit in a region and after an inner one. The other two contexts add
    nothing there: recomputed after a stored unit, such a unit's input is held by nobody but
    itself (``after inner`` again), and stored after a segment it is as in the plain step."""
    size, span = (4, 3) if held else (2, 2)  # units per group; of them, in its region
    segments: list = []
    roles: dict[int, str] = {}
    start = shift % size if shift % size < n_units else 0
    if start >= 2:
        segments += [(0, start - 1, [(0, start - 1, None)]), (start - 1, start, None)]
        roles.update({0: REGION, start - 1: AFTER_SEGMENT})
        roles.update({u: AFTER_UNIT for u in range(1, start - 1)})
    elif start == 1:
        segments.append((0, 1, None))
    for a in range(start, n_units, size):
        b = min(a + span, n_units)
        inner: list = [(a, a + 1, [(a, a + 1, None)])] if b - a > 1 else [(a, a + 1, None)]
        if b - a > 1:
            inner.append((a + 1, b, None))
        segments.append((a, b, inner))
        roles.update({a: REGION, a + 1: AFTER_INNER})
        if held:
            roles[a + 2] = AFTER_UNIT
        if b < n_units and held:
            segments.append((b, b + 1, None))
            roles[b] = AFTER_SEGMENT
    return segments, {u: r for u, r in roles.items() if u < n_units}


def blocks_of(units: list[tuple[int, int]], segments: list) -> list:
    """Unit-level nested segments -> block positions."""
    return [(units[a][0], units[b - 1][1],
             False if inner is None else blocks_of(units, inner)) for a, b, inner in segments]


def unit_peak(trace: Trace, kinds: str, blocks: range, default: int = 0) -> int:
    vals = [trace.peak[(k, j)] for j in blocks for k in kinds if (k, j) in trace.peak]
    return max(vals, default=default)


def read_pattern(p: ChainProfile, trace: Trace, segments: list, roles: dict[int, str]) -> None:
    """Fill in what one :func:`nested_pattern` run shows of each unit (its role there)."""
    for a, b, inner in segments:
        if inner is None:
            if roles.get(a) == AFTER_SEGMENT:
                _fill(p.bwd_rise_alone, a, _rise(p, trace, a, [], None))
            continue
        for u in range(a, b):
            first, last = p.units[u]
            p.fwd_rise_ckpt[u] = unit_peak(trace, "FG", range(first, last)) \
                - trace.mark[("F", first)]
            if p.opaque and _kept_in_region(trace, range(first, last)):
                p.opaque[u] = True
        if inner[0][2] is None:  # one level: units a..b-1 recomputed together
            runs = [list(range(a, b))]
        else:  # unit a alone in an inner region, then a+1..b-1 in the outer recompute
            runs = [[a], list(range(a + 1, b))]
        for run in runs:
            if not run:
                continue
            u = run[-1]
            ran = sum(p.flops[w] for w in range(a, u))
            first, last = p.units[u]
            p.recompute_flops[u] = _recomputed(trace, range(first, last)) \
                - p.unit_inner_flops[u] - ran
            for w in run:
                table = {REGION: p.bwd_rise_region, AFTER_INNER: p.bwd_rise_recomputed_alone,
                         AFTER_UNIT: p.bwd_rise_recomputed if p.held_in_plain(w) else
                         p.bwd_rise_recomputed_alone}[roles[w]]
                _fill(table, w, _rise(p, trace, w, run if w == u else [], a))


def _kept_in_region(trace: Trace, blocks: range) -> bool:
    """Whether a unit run in a checkpointed segment's forward keeps more than its output there:
    a checkpoint of its own keeps those of its inputs that need no gradient (a frozen block's
    output) itself, out of the enclosing region's sight, until the unit's backward. Such a unit
    is *opaque*: it runs stored at the top level only."""
    first, last = blocks[0], blocks[-1]
    output = 0 if trace.out_key[last] == trace.in_key[first] else trace.out_bytes[last]
    cached = sum(trace.cached.get(j, 0) for j in blocks)  # autocast's casts: kept anyway
    return trace.after[last] - trace.mark[("F", first)] - output - cached > 0


def _rise(p: ChainProfile, trace: Trace, u: int, run: list[int], region_input: int | None
          ) -> int:
    """How far unit ``u``'s backward rises above the level when its output's gradient is ready;
    ``run``: the units a recompute that ends in ``u``'s backward rebuilt (their saved tensors
    and kept boundaries, but the region's input ``region_input``, come on top of that level)."""
    first, last = p.units[u]
    blocks = range(first, last)
    start = trace.mark.get(("B", last - 1))
    if start is None:  # its output needs no gradient (a frozen model): no backward runs
        return 0
    if not run or ("BR", last - 1) not in trace.mark:  # (a region keeping nothing: no recompute)
        return unit_peak(trace, "B", blocks, start) - start
    held, live = 0, set()
    for w in run:
        held += p.saved[w]
        for k, keep in ((w, p.keeps_input[w]), (w + 1, p.keeps_output[w])):
            if keep and k != region_input and k not in live:
                live.add(k)
                held += p.act[k]
    peaks = [trace.peak.get(("BR", last - 1), start)]
    peaks += [trace.peak[("B", j)] for j in blocks[:-1] if ("B", j) in trace.peak]
    return max(peaks) - start - held


def _fill(values: list, u: int, value: int) -> None:
    values[u] = value if values[u] is None else values[u]


def fill_gaps(p: ChainProfile) -> None:
    """A stored unit whose input nobody before it holds in a plain step is in that context
    already; contexts the runs did not show stay None (a schedule that would need them is not
    offered)."""
    for u in range(p.n_units):
        if p.bwd_rise_alone[u] is None and not p.held_in_plain(u):
            p.bwd_rise_alone[u] = p.bwd_rise[u]
        if p.fwd_rise_ckpt[u] is None:
            p.fwd_rise_ckpt[u] = p.fwd_rise[u]


def _recomputed(trace: Trace, blocks: range) -> int:
    return sum(trace.rflops.get((k, j), 0) for j in blocks for k in ("B", "BR"))
