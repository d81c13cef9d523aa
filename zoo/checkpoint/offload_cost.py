"""When offload pays: the copy time a step cannot hide, from bytes, a host link and compute time.

An offloaded region's saved tensors cross the card's host link twice: out during the forward,
behind the compute that follows the region, and back during the backward, behind the backward
of the region after it (the prefetch :mod:`zoo.checkpoint.offload` starts there). A copy runs
on its own stream, so it costs the step nothing while ``bandwidth * compute_time >= bytes``;
past that the step waits for the rest. Pure functions, so the planner can weigh keep, recompute
and offload per unit without running anything (DeepSpeed's planned offload and torchtitan's
budget-aware activation checkpointing weigh the same terms).
"""
from __future__ import annotations

__all__ = ["copy_time", "exposed_copy_time", "offload_step_time"]


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


def offload_step_time(units: list[tuple[int, float, float]], bandwidth: float) -> float:
    """Seconds a step spends waiting on its offload copies.

    ``units``: for each offloaded unit in forward order, ``(bytes, forward_after, backward_after)``:
    its bytes, the forward compute time that follows it (hides the copy out) and the backward
    compute time of what runs before its own backward (hides the prefetch back). The copies of
    one direction share the link, so a copy that is not finished delays the next: a copy starts
    when the link is free and when its unit is reached.
    """
    waited = 0.0
    for direction in (1, 2):
        link_free = 0.0  # time, relative to the start of this pass, when the link is idle
        now = 0.0
        order = units if direction == 1 else units[::-1]
        for unit in order:
            nbytes, hide = unit[0], unit[direction]
            start = max(now, link_free)
            link_free = start + copy_time(nbytes, bandwidth)
            now += hide
            if link_free > now:  # the step reaches the next use before the copy is done
                waited += link_free - now
                now = link_free
    return waited
