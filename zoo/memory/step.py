"""Measure one training step of a model without running it: peak bytes and FLOPs.

The step (forward, loss, backward, the optimizer's step when there is one: :mod:`.training`)
runs under ``FakeTensorMode`` with the model's parameters and
buffers swapped for fake copies, inside :class:`~zoo.memory.tracker.StepCounter` (live bytes as
``MemTracker`` counts them, without its module hooks, and ``FlopCounterMode``'s FLOPs). The byte
count is identical to a real CPU step's, so this is the planner's independent check of its own
predictions (tests, ``python scripts/benchmark.py planner``) and it costs a fraction of a second even
for batches this machine could not hold.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .fake import FakeStep
from .optimizer import Optimizers
from .precision import step_precision
from .training import accumulated_backward, check_accumulate
from .cards.on_card import current_card, held_from_start, step_counter, workspaces_as_used
from .tracker import StepCounter

__all__ = ["measure_step", "peak_bytes", "micro_batches_run"]


def measure_step(model: nn.Module, example_input: Any,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 fake: FakeStep | None = None,
                 optimizer: Optimizers = None,
                 accumulate: int = 1) -> tuple[int, int]:
    """(peak bytes, FLOPs) of one fake training step of ``model`` as it is configured now
    (checkpoint mode or plan included) on the batch ``example_input`` (a tensor, a tuple or a
    dict: :class:`~.inputs.Batch`), in the caller's precision (:mod:`.precision`), with
    ``optimizer``'s state and step when given (one or several, stepped in order:
    :mod:`.optimizer`; a trainable parameter none steps holds its gradient all step, as from a
    loop's second step on). ``model`` itself is left untouched. ``fake``: the fake state to run
    on (made for this step when not given; its optimizers, if any, are the step's).
    ``accumulate``: the step accumulates that many micro-batches of ``example_input`` before
    the optimizer's step
    (:func:`~.training.accumulated_backward`); its FLOPs are all of them, its peak is the
    whole step's, of the micro-batches :func:`micro_batches_run` runs."""
    from zoo._torch import reparametrize_module as _reparametrize_module

    fake = fake or FakeStep(model, example_input, optimizer)
    accumulate = check_accumulate(accumulate)
    runs = micro_batches_run(accumulate)
    batches = fake.micro_batches(runs)  # made before the step: a list the loop runs over
    marks: list[tuple[int, int]] = []  # (bytes held, FLOPs) after each micro-batch

    def run(threads: tuple[bool, ...]) -> StepCounter:
        fake.clear()
        counter, kernels = step_counter(threads)  # the CPU's, or a card's under on_card
        counter.track(held_from_start(fake, accumulate))
        marks.clear()
        try:
            with fake.mode, step_precision(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
                with kernels, counter, _reparametrize_module(model, fake.state):
                    loss = accumulated_backward(
                        model, batches, loss_fn, accumulate,
                        lambda: marks.append((counter.current, counter.flops)))
                    fake.step_optimizers()
                    del loss  # held through the optimizer's step, as a training loop does
        finally:
            fake.clear()
        return counter

    drops = fake.drops
    counter = workspaces_as_used(run)
    if fake.drops != drops:  # it held state no real step makes: measured again without it
        counter = workspaces_as_used(run)
    if runs == accumulate:
        return counter.peak, counter.flops
    (held, flops), (held_before, flops_before) = marks[-1], marks[-2]
    unrun = accumulate - runs  # each like the last one run (micro_batches_run)
    return counter.peak + unrun * (held - held_before), counter.flops + unrun * (
        flops - flops_before)


def micro_batches_run(accumulate: int) -> int:
    """How many of an accumulating step's ``accumulate`` micro-batches a fake step runs. On
    this CPU three at most: from the second on, each runs the same ops beside the same held
    tensors (every gradient, the loss before, the micro-batches before), and adds to them only
    what it leaves held when it ends (a model's view of its own micro-batch, as a classifier's
    of its labels: a storage of its own in each), so each one more lifts the later peaks, and
    the optimizer's, by the third's bytes held less the second's. On a card
    (``zoo.memory.on_card``) all of them: the caching allocator places each micro-batch's blocks
    among those the ones before left free, which no such sum describes."""
    return accumulate if current_card() is not None else min(accumulate, 3)


def peak_bytes(step: Callable[[], Any], track: Any = ()) -> int:
    """Peak bytes while ``step()`` runs for real, counting ``track``'s tensors (modules,
    optimizers, tensors) from the start: ``zoo.memory.cpu_peak_bytes``' figure without
    ``MemTracker``'s module hooks, which keep a recompute's graph alive a little longer than a
    step without them does (:mod:`.tracker`)."""
    counter = StepCounter()
    counter.track(*track) if isinstance(track, (list, tuple)) else counter.track(track)
    with counter:
        step()
    return counter.peak
