"""Chains of blocks: :func:`checkpoint_sequential` (torch's interface, every segment
checkpointed) and :func:`run_plan`, which runs a planner's block-level plan."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .primitive import checkpoint

__all__ = ["checkpoint_sequential", "run_blocks", "run_plan", "split_segments", "in_place_groups",
           "OFFLOAD"]

#: A plan's flag for a segment whose saved tensors wait in host memory (``zoo.offload``).
OFFLOAD = "offload"


def split_segments(n: int, segments: int | None) -> list[range]:
    """Split ``n`` blocks into contiguous, balanced segments (sizes differ by at most one).

    ``segments=None`` gives one segment per block. Raises ValueError outside ``1..n``.
    """
    if n < 1:
        raise ValueError("checkpoint_sequential needs at least one block, got an empty sequence")
    if segments is None:
        segments = n
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
        raise ValueError(f"segments must be an int from 1 to {n} (the number of blocks) or None "
                         f"for one segment per block, got {segments!r}")
    base, extra = divmod(n, segments)
    bounds, start = [], 0
    for i in range(segments):
        stop = start + base + (1 if i < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def in_place_groups(blocks: Sequence[Any]) -> list[range]:
    """``blocks`` in consecutive groups where a block that acts in place on its input (an
    ``inplace=True`` module: ``nn.ReLU(inplace=True)``, in-place dropout) joins the block
    before it. A checkpointed segment keeps its input for the recompute; one that began with
    an in-place block would overwrite that input, which no recompute can undo (backward fails:
    "modified by an inplace operation"), so no segment may start there."""
    starts = [i for i, b in enumerate(blocks) if i == 0 or not getattr(b, "inplace", False)]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], len(blocks)])]


def _in_place_joined(blocks: Sequence[Any], segments: int | None) -> list[range]:
    """The blocks' segments, balanced over :func:`in_place_groups` (torch's
    ``checkpoint_sequential`` fails in backward where a segment starts with an in-place
    block). ``segments`` is checked against the blocks, and gives at most one segment per
    group."""
    per_block = split_segments(len(blocks), segments)
    groups = in_place_groups(blocks)
    if len(groups) == len(blocks):
        return per_block
    wanted = len(per_block) if segments is not None else len(groups)
    return [range(groups[r.start].start, groups[r.stop - 1].stop)
            for r in split_segments(len(groups), min(wanted, len(groups)))]


def run_blocks(blocks: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    """Apply ``blocks`` in order: the plain body of a checkpointed segment."""
    for block in blocks:
        x = block(x)
    return x


def run_plan(blocks: Sequence[Callable[[Any], Any]], plan: Sequence[tuple[int, int, Any]],
             x: Any, offset: int = 0, preserve_rng_state: bool = True) -> Any:
    """Run ``blocks`` by a block-level ``plan`` of ``(start, stop, checkpointed)`` segments
    (block indices start at ``offset``): stored segments plainly, checkpointed ones as one
    region each, nested plans (a list in place of the flag) inside their region, recursively.
    ``preserve_rng_state=False`` (blocks that draw no random number) is given to every region."""
    rng = preserve_rng_state
    for a, b, ck in plan:
        part = blocks[a - offset:b - offset]
        if isinstance(ck, list):
            x = checkpoint(run_plan, part, ck, x, a, rng, preserve_rng_state=rng)
        elif ck == OFFLOAD:
            x = checkpoint(run_blocks, part, x, offload=True)
        elif ck:
            x = checkpoint(run_blocks, part, x, preserve_rng_state=rng)
        else:
            box, x = [x], None
            x = _run_handed(part, box)
    return x


def _run_handed(blocks: Sequence[Callable[[Any], Any]], box: list) -> Any:
    """:func:`run_blocks` on the one input in ``box``, taken out: no caller's frame holds the
    stored segment's input while it runs, so the input lives as long as the plain model keeps
    it (a ReLU's input, saved by nothing, is freed once the ReLU has run)."""
    x = box.pop()
    for block in blocks:
        x = block(x)
    return x


def checkpoint_sequential(blocks: Sequence[Callable[[Any], Any]] | nn.Sequential, x: Any,
                          segments: int | None = None, skip_last: bool = False, *,
                          use_reentrant: bool | None = None, preserve_rng_state: bool = True,
                          context_fn: Callable[[], tuple[Any, Any]] | None = None,
                          determinism_check: str = "default", debug: bool = False,
                          early_stop: bool | None = None) -> Any:
    """Run a chain of one-input blocks, checkpointing each segment with :func:`checkpoint`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential`` the last segment is checkpointed too
    (with few segments torch's saves almost no memory, as users report on the PyTorch forum) unless
    ``skip_last=True``, which keeps its activations because backward needs them first anyway.
    This is a deliberate difference from torch's (tests/checkpoint/test_checkpoint_torch_utils.py
    pins it).

    Args:
        blocks: an ``nn.Sequential`` or any sequence of callables, applied in order.
        x: the input of the first block.
        segments: ``None`` checkpoints every block on its own; an int splits the blocks into that
            many balanced contiguous segments, each checkpointed as one region. A block that
            acts in place on its input (``nn.ReLU(inplace=True)``) always shares the segment of
            the block before it, whose output it overwrites (so ``segments`` is at most the
            number of blocks not in place).
        skip_last: run the last segment without checkpointing.

    torch's keywords (``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
    ``determinism_check``, ``debug``, ``early_stop``) are passed to every segment's
    :func:`checkpoint`.

    torch's argument order, ``checkpoint_sequential(functions, segments, input)``, is accepted
    too: a tensor given as ``segments`` after an int ``x`` is taken as the input.
    """
    if isinstance(segments, torch.Tensor) and isinstance(x, int) and not isinstance(x, bool):
        x, segments = segments, x  # torch's order: (functions, segments, input)
    if not isinstance(skip_last, bool):
        raise TypeError(f"checkpoint_sequential: skip_last must be True or False, got "
                        f"{type(skip_last).__name__} (blocks take one input; pass only one)")
    blocks = list(blocks)
    ranges = _in_place_joined(blocks, segments)
    if not torch.is_grad_enabled():
        return run_blocks(blocks, x)
    given = {"use_reentrant": use_reentrant, "preserve_rng_state": preserve_rng_state,
             "context_fn": context_fn, "determinism_check": determinism_check, "debug": debug,
             "early_stop": early_stop}
    for i, r in enumerate(ranges):
        part = blocks[r.start:r.stop]
        if skip_last and i == len(ranges) - 1:
            x = run_blocks(part, x)
        elif len(part) == 1:
            x = checkpoint(part[0], x, **given)
        else:
            x = checkpoint(run_blocks, part, x, **given)
    return x
