"""``cost="time"``: the chain's recompute costs as measured time on the input's device.

FLOPs price a BatchNorm, a ReLU or a concatenation at almost nothing, yet on a GPU such
memory-bound ops take time. Each block's forward is timed on ``example_input``'s device (median
after a warm-up, synchronised on CUDA), and a copy of the profile carries nanoseconds where it
carried FLOPs, so the same search plans for least recompute time. For a named card (``on``),
nothing runs for real: one fake step runs the card's kernels and each block is priced as
``zoo.memory.cards`` prices ops (the larger of the card's time and the host's)."""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...memory.cards.step import run_on_card
from ...memory.cards import H100_ACHIEVED, Card, step_time
from ...memory.cards.allocator import CachingAllocator
from ...memory.cards.peak import CudaCounter
from ...memory.inputs import Batch
from .profile import ChainProfile

__all__ = ["time_profile"]


def _block_seconds(model: nn.Module, example_input: torch.Tensor, n_blocks: int,
                   repeats: int) -> list[float]:
    """Median forward seconds of each chain block (grad enabled, as a recompute runs)."""
    cuda = example_input.device.type == "cuda"
    times: list[list[float]] = [[] for _ in range(n_blocks)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(example_input.device)

    def run_chain(blocks: Sequence[Callable], h: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(blocks):
            sync()
            start = time.perf_counter()
            h = block(h)
            sync()
            times[j].append(time.perf_counter() - start)
        return h

    previous = model.checkpoint_plan
    model.set_checkpoint_plan([(0, n_blocks, False)])
    model.run_chain = run_chain  # instance attribute: shadows the class's for these runs
    try:
        for _ in range(repeats + 1):
            Batch.of(example_input).call(model)
    finally:
        del model.run_chain
        model.set_checkpoint_plan(previous)
    return [statistics.median(t[1:]) for t in times]


def _card_seconds(model: nn.Module, example_input: torch.Tensor, n_blocks: int,
                  loss_fn: Callable[[Any], torch.Tensor] | None, on: Card
                  ) -> tuple[list[float], float]:
    """Each chain block's forward and the whole plain step, predicted on card ``on``."""
    counter = CudaCounter(CachingAllocator(), on.workspace)
    spans: list[tuple[int, int]] = []

    def run_chain(blocks: Sequence[Callable], h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            start = len(counter.records)
            h = block(h)
            spans.append((start, len(counter.records)))
        return h

    previous = model.checkpoint_plan
    model.set_checkpoint_plan([(0, n_blocks, False)])
    model.run_chain = run_chain  # instance attribute: shadows the class's for this step
    try:
        run_on_card(model, example_input, on, loss_fn, counter=counter)
    finally:
        del model.run_chain
        model.set_checkpoint_plan(previous)
    records = counter.records  # priced as predict_step prices a step (H100-fitted fractions)
    blocks = [step_time(records[a:b], 0, on, achieved=H100_ACHIEVED).step for a, b in spans]
    return blocks, step_time(records, counter.regions, on, achieved=H100_ACHIEVED).step


def time_profile(model: nn.Module, example_input: torch.Tensor, profile: ChainProfile,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 repeats: int = 3, on: Card | None = None) -> ChainProfile:
    """``profile`` with ``flops``, ``recompute_flops`` and ``step_flops`` in nanoseconds of
    ``example_input``'s device (a plain step's time for ``step_flops``), or of card ``on``,
    predicted. On the input's device the model runs for real: the input must fit there."""
    if on is not None:
        blocks, seconds = _card_seconds(model, example_input, profile.n_blocks, loss_fn, on)
        return _in_nanoseconds(profile, blocks, seconds)
    blocks = _block_seconds(model, example_input, profile.n_blocks, repeats)
    seconds = _step_seconds(model, example_input, loss_fn, repeats)
    return _in_nanoseconds(profile, blocks, seconds)


def _step_seconds(model: nn.Module, example_input: torch.Tensor,
                  loss_fn: Callable[[Any], torch.Tensor] | None, repeats: int) -> float:
    """Median seconds of a plain training step of ``model`` on ``example_input``, for real."""
    from ...memory import median_seconds
    from ...memory.training import train_step

    seconds, _ = median_seconds(train_step(model, example_input, loss_fn), repeats=repeats,
                                warmup=1, cuda=Batch.of(example_input).device.type == "cuda")
    model.zero_grad(set_to_none=True)
    return seconds


def _in_nanoseconds(profile: ChainProfile, blocks: list[float], seconds: float) -> ChainProfile:
    """``profile`` with each unit's cost the nanoseconds of its ``blocks`` (seconds each), and
    ``seconds`` for the plain step."""
    unit_ns = [round(1e9 * sum(blocks[a:b])) for a, b in profile.units]
    recompute = [t if f == 0 else round(t * r / f)
                 for t, f, r in zip(unit_ns, profile.flops, profile.recompute_flops)]
    return dataclasses.replace(profile, flops=unit_ns, recompute_flops=recompute,
                               step_flops=round(1e9 * seconds), inner_flops=0)
