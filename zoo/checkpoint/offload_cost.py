"""When offload pays: the copy time a step cannot hide, from bytes, a host link and compute time.

An offloaded region's saved tensors cross the card's host link twice: out during the forward,
behind the compute that follows the region, and back during the backward, behind the backward
of the region after it (the prefetch :mod:`zoo.checkpoint.offload` starts there). A copy runs
on its own stream, so it costs the step nothing while ``bandwidth * compute_time >= bytes``;
past that the step waits for the rest. Pure functions of bytes and seconds: a card's predicted
step (``zoo.memory.cards``) gives :func:`link_wait` the copies its fake step queued and the
compute time between them, and the planner weighs keep, recompute and offload by the result
(DeepSpeed's planned offload and torchtitan's budget-aware activation checkpointing weigh the
same terms).
"""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["copy_time", "exposed_copy_time", "link_wait"]


def copy_time(nbytes: int, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` over a link of ``bandwidth`` bytes/s (one direction)."""
    if bandwidth <= 0:
        raise ValueError(f"offload cost: link bandwidth must be positive bytes/s, got {bandwidth}")
    if nbytes < 0:
        raise ValueError(f"offload cost: bytes to copy must be >= 0, got {nbytes}")
    return nbytes / bandwidth


def exposed_copy_time(nbytes: int, bandwidth: float, compute_time: float) -> float:
    """The part of a copy the step waits for: what ``compute_time`` of overlapping work on the
    compute stream does not hide (0 when ``bandwidth * compute_time >= nbytes``)."""
    if compute_time < 0:
        raise ValueError(f"offload cost: compute time must be >= 0 s, got {compute_time}")
    return max(0.0, copy_time(nbytes, bandwidth) - compute_time)


def link_wait(events: Iterable[tuple[str, int, int, float]], bandwidth: float) -> float:
    """Seconds a step's compute stream waits on its offload copies.

    ``events``, in the order the step reaches them: ``(kind, storage, bytes, compute)``, where
    ``compute`` is the compute stream's time since the event before, and ``kind`` is ``"out"``
    (a saved storage copied to the host), ``"back"`` (brought back: prefetched when the
    backward reaches the region after it, or on demand) or ``"use"`` (the backward reads it).
    Every copy runs on one side stream, in order, from when it is queued, so copies share the
    link and a late one delays the next; only a ``"use"`` whose copy back has not finished makes
    the compute stream wait (the forward never waits for a copy out: the allocator holds its
    source until the copy has read it). What ``zoo.checkpoint.offload`` does on CUDA.
    """
    now = link_free = waited = 0.0
    ready: dict[int, float] = {}
    for kind, storage, nbytes, compute in events:
        if compute < 0:
            raise ValueError(f"offload cost: compute time must be >= 0 s, got {compute}")
        now += compute
        if kind in ("out", "back"):
            link_free = max(link_free, now) + copy_time(nbytes, bandwidth)
            if kind == "back":
                ready[storage] = link_free
        elif kind == "use":
            late = ready.get(storage, now) - now
            if late > 0:
                waited, now = waited + late, now + late
        else:
            raise ValueError(f"offload cost: an event is 'out', 'back' or 'use', got {kind!r}")
    return waited
