"""The host-cost benchmark's measurement: each way to train (an :class:`Entry`) counted and
timed beside its plain model, and the *floor* of its regions.

The floor is what a region cannot avoid: the plain step's ops plus, for every region, the forward
ops its recompute must redo, counted on their own (:func:`recompute_ops`: the region's forward up
to the last tensor it saves for backward, without the running-statistics update and without the
ops a selective region keeps). ``ops - floor`` is what the checkpoint itself costs. The floor is
timed too, as a step of its own: the plain step, then each region's rerun replayed
(:class:`Floor`). Ops are counted with ``zoo.memory.host.OpCounter`` and timed with
``zoo.memory.host.host_times``.

:mod:`.host_peers` builds what is compared (the zoo's modes and their peers); :mod:`.host_report`
is the command (``scripts/benchmark.py host-cost``).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zoo.checkpoint.region import observing
from zoo.memory.host import COPY, OpCounter, Region, count_ops, host_times, recorded_regions, \
    recording

__all__ = ["Entry", "recorded_regions", "recompute_ops", "replay", "Floor", "floor_of",
           "measure"]


@dataclass
class Entry:
    """One measured way to train: ``step()`` is one training step of ``model``.

    ``group`` names the plain entry its ratios are taken against (peers built on another library's
    model have their own plain row); ``floor`` is computed for the zoo's checkpoint modes only.
    """

    name: str
    group: str
    model: nn.Module
    step: Callable[[], Any]
    note: str = ""
    floor: bool = False
    result: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# The floor: each region's forward replayed on its own.
# --------------------------------------------------------------------------------------------
@contextmanager
def _statistics_frozen(model: nn.Module) -> Iterator[None]:
    """Normalisation layers that leave their running statistics as they are while a region is
    replayed: a recompute must not update them, so their update is not part of the floor.

    Each runs the same op with the same arguments as in the forward (its running statistics
    passed in), at momentum 0 and with ``num_batches_tracked`` set aside, as the zoo's recompute
    runs it: on ``meta`` a BatchNorm given running statistics costs the host a third more than
    one without, so a floor timed without them would not be the forward's work. SyncBatchNorm,
    whose forward insists on its counter, runs without running statistics instead.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
             and m.track_running_stats]
    saved = [(m.momentum, m._buffers.get("num_batches_tracked")) for m in norms]
    for m in norms:
        if isinstance(m, nn.SyncBatchNorm):
            m.track_running_stats = False
        else:
            m.momentum = 0.0
            if "num_batches_tracked" in m._buffers:
                m._buffers["num_batches_tracked"] = None
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, saved):
            m.track_running_stats, m.momentum = True, momentum
            if "num_batches_tracked" in m._buffers:
                m._buffers["num_batches_tracked"] = count


def recompute_ops(fn: Callable, args: tuple, kwargs: dict, save_ops: Any = None,
                  nested: list[Region] | None = None) -> tuple[int, int]:
    """(ops, saved tensors) a recompute of ``fn(*args, **kwargs)`` must redo: the ops of its
    forward up to the one that saves the last tensor for backward (what comes after is not
    needed), less those whose outputs a selective region keeps (``save_ops``), and how many
    tensors that part saves. ``nested``: gets the regions that part opens inside (each made
    again by the recompute, so each recomputed in its turn). Run it inside
    :func:`_statistics_frozen`."""
    at_pack: list[tuple[int, int]] = []
    inner: list[tuple[Region, int]] = []  # with the tensors saved before it opened
    with recording(lambda *r: inner.append((r, len(at_pack)))), torch.enable_grad(), \
            OpCounter(save_ops or ()) as counter:
        @observing
        def pack(tensor: torch.Tensor) -> None:
            at_pack.append((counter.total, counter.excluded))

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
            fn(*args, **kwargs)
    if not at_pack:
        return 0, 0
    if nested is not None:
        nested += [r for r, packs in inner if packs < len(at_pack)]
    total, kept = at_pack[-1]
    return total - kept, len(at_pack)


class _LastSaved(Exception):
    """Ends a replay at the region's last saved tensor."""


def replay(fn: Callable, args: tuple, kwargs: dict, saved: int) -> None:
    """Rerun a region's forward up to its ``saved``-th saved tensor and no further: what its
    recompute must do, with nothing of a checkpoint around it (the floor's host time)."""
    if not saved:
        return
    count = [0]

    @observing
    def pack(tensor: torch.Tensor) -> None:
        count[0] += 1
        if count[0] == saved:
            raise _LastSaved

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
        try:
            fn(*args, **kwargs)
        except _LastSaved:
            pass


@dataclass
class Floor:
    """What a step's regions must redo: ``ops`` beyond the plain step, and the regions with the
    number of tensors each saves up to where its recompute may stop (to replay them)."""

    ops: int
    regions: list[Region]
    saved: list[int]

    def step(self, plain_step: Callable[[], Any], model: nn.Module) -> Callable[[], None]:
        """The floor as a step: the plain step, then every region's recompute replayed."""
        def run() -> None:
            plain_step()
            with _statistics_frozen(model):
                for (fn, args, kwargs, _), saved in zip(self.regions, self.saved):
                    replay(fn, args, kwargs, saved)
        return run


def floor_of(model: nn.Module, step: Callable[[], Any]) -> Floor:
    """The :class:`Floor` of ``step()``, a training step of ``model``: its regions' recomputes,
    and those of the regions each recompute opens again inside it (a nested mode's)."""
    todo, regions, counts = recorded_regions(step), [], []
    with _statistics_frozen(model):
        while todo:
            r = todo.pop(0)
            inner: list[Region] = []
            counts.append(recompute_ops(*r, nested=inner))
            regions.append(r)
            todo += inner
    return Floor(sum(ops for ops, _ in counts), regions, [saved for _, saved in counts])


def measure(entries: Sequence[Entry], repeats: int = 15, warmup: int = 2,
            time_steps: bool = True) -> list[dict[str, Any]]:
    """Ops, floor and host time of every entry; ratios against the plain entry of its group.

    An entry with a floor is also timed against it: its plain step plus the regions' recomputes
    replayed on their own, in the same interleaved rounds (per-op costs differ a hundredfold on
    ``meta``, where some kernels are Python decompositions, so the floor's time is measured, not
    scaled from its ops).
    """
    for entry in entries:
        entry.step()  # a first step outside the count (lazy initialisation, caches)
        ops = count_ops(entry.step)
        total = sum(ops.values())
        entry.result.update(ops=total, dispatched=total - ops[COPY],
                            by_op=dict(sorted(ops.items())))
    plain = {e.group: e for e in entries if e.name == e.group}
    steps = {e.name: e.step for e in entries}
    for entry in entries:
        if entry.floor:
            base, floor = plain[entry.group], floor_of(entry.model, entry.step)
            entry.result.update(floor=base.result["ops"] + floor.ops, regions=len(floor.regions),
                                floor_dispatched=base.result["dispatched"] + floor.ops)
            steps[f"{entry.name} (floor)"] = floor.step(base.step, entry.model)
    if time_steps:
        cuda = any(p.device.type == "cuda" for e in entries for p in e.model.parameters())
        times = {name: statistics.median(t) for name, t in
                 host_times(steps, repeats, warmup, cuda=cuda).items()}
        for entry in entries:
            entry.result["seconds"] = times[entry.name]
            if entry.floor:
                entry.result["floor_seconds"] = times[f"{entry.name} (floor)"]
    return [_row(entry, plain[entry.group].result) for entry in entries]


def _row(entry: Entry, base: dict[str, Any]) -> dict[str, Any]:
    """An entry's results with its ratios to ``base`` (its plain entry's results)."""
    r = entry.result
    row = {"variant": entry.name, "group": entry.group, "note": entry.note, **r,
           "ops_ratio": r["ops"] / base["ops"],
           "dispatched_ratio": r["dispatched"] / base["dispatched"]}
    if "floor" in r:
        regions = max(r["regions"], 1)
        row.update(floor_ratio=r["floor"] / base["ops"],
                   extra_per_region=(r["ops"] - r["floor"]) / regions,
                   extra_dispatched_per_region=(r["dispatched"] - r["floor_dispatched"]) / regions)
    if "seconds" in r:
        row["time_ratio"] = r["seconds"] / base["seconds"]
        if "floor_seconds" in r:
            row.update(floor_time_ratio=r["floor_seconds"] / base["seconds"],
                       time_vs_floor=r["seconds"] / r["floor_seconds"])
    return row
