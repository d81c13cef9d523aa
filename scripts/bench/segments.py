"""Memory and time against the number of segments of ``checkpoint_sequential``.

Users of torch.utils.checkpoint_sequential report "almost no memory improvement" and runtime growing with the number of segments.
Two causes, both visible here on a model's chain of blocks:

* ``torch.utils.checkpoint.checkpoint_sequential`` never checkpoints its last segment: with one
  segment nothing is checkpointed, with two half the chain keeps all its activations;
* ``zoo.checkpoint_sequential`` checkpoints every segment, so one segment already keeps only the
  chain's input (and recomputes the whole chain once).

The chain is the model's ``checkpoint_chain()``; the rest of the model (e.g. the head) runs as
usual. Each row: peak memory, FLOPs and median step time, ratios against no checkpointing.
"""
from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.models import ZooModel

from .measure import measure_variants
from .variants import PLAIN, Variant

__all__ = ["IMPLEMENTATIONS", "default_segments", "segment_variants", "sweep_segments"]

IMPLEMENTATIONS = ("torch", "zoo")


def default_segments(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n`` blocks, and ``n`` itself (one segment per block)."""
    counts = [1]
    while counts[-1] * 2 < n:
        counts.append(counts[-1] * 2)
    return sorted({*counts, n})


def _run_chain(impl: str, segments: int) -> Any:
    def run(self: ZooModel, blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        if impl == "torch":
            return torch_checkpoint.checkpoint_sequential(nn.Sequential(*blocks), segments, x,
                                                          use_reentrant=False)
        return zoo.checkpoint_sequential(blocks, x, segments=segments)
    return run


class _SegmentVariant(Variant):
    """The model's chain run by ``impl``'s checkpoint_sequential with ``segments`` segments."""

    def __init__(self, model: ZooModel, impl: str, segments: int) -> None:
        super().__init__(f"{impl} segments={segments}", model, False,
                         f"{impl} checkpoint_sequential, {segments} segment(s)")
        self.impl, self.segments = impl, segments

    def prepare(self) -> None:
        n = len(self.model.checkpoint_chain())
        self.model.set_grad_checkpointing(False)
        self.model.set_checkpoint_plan([(0, n, False)])  # forward goes through run_chain
        self.model.run_chain = types.MethodType(_run_chain(self.impl, self.segments), self.model)


class _Plain(Variant):
    def prepare(self) -> None:
        self.model.set_checkpoint_plan(None)
        self.model.__dict__.pop("run_chain", None)
        self.model.set_grad_checkpointing(False)


def segment_variants(model: ZooModel, segments: Sequence[int] | None = None,
                     impls: Sequence[str] = IMPLEMENTATIONS) -> list[Variant]:
    """Plain, then each implementation at each number of segments (default
    :func:`default_segments`), all sharing ``model``."""
    try:
        n = len(model.checkpoint_chain())
    except NotImplementedError as e:
        raise ValueError(f"the segments sweep needs a chain model: {e}") from None
    counts = list(segments) if segments else default_segments(n)
    bad = [s for s in counts if not 1 <= int(s) <= n]
    if bad:
        raise ValueError(f"segments must be from 1 to {n} (the chain's blocks), got {bad}")
    unknown = [i for i in impls if i not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; expected {IMPLEMENTATIONS}")
    variants: list[Variant] = [_Plain(PLAIN, model, False, "no checkpointing")]
    variants += [_SegmentVariant(model, impl, int(s)) for impl in impls for s in counts]
    return variants


def sweep_segments(model: ZooModel, x: torch.Tensor, segments: Sequence[int] | None = None,
                   repeats: int = 5, warmup: int = 1, timed: bool = True) -> list[dict]:
    """Measure every (implementation, segments) variant; rows carry ``impl`` and ``segments``."""
    variants = segment_variants(model, segments)
    rows = measure_variants(variants, x, repeats=repeats, warmup=warmup, timed=timed,
                            exact=False)
    for row, v in zip(rows, variants):
        row["impl"] = getattr(v, "impl", None)
        row["segments"] = getattr(v, "segments", 0)
    variants[0].prepare()  # leave the model plain
    return rows
