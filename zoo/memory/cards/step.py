"""One training step of a model on a named CUDA card, predicted here: its peak and its time.

What a caller with a model and an input asks (the planner choosing by time on a card, a batch
search sizing for a card): the step (forward, loss, backward) runs once on fake copies of the
model's state (:class:`~zoo.memory.fake.FakeStep`, nothing allocated or computed) under
:func:`~zoo.memory.cards.peak.run_counted` (the card's kernels and allocator), and its ops are
timed by :mod:`.timing`. ``model`` is left untouched.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .allocator import CachingAllocator
from .timing import (H100_ACHIEVED, H100_HOST, Achieved, Card, HostCost, StepTime, card,
                     op_seconds, step_time)
from ...checkpoint.offload import simulated_host
from ...checkpoint.offload_cost import link_wait
from ... import _torch
from .peak import CudaCounter, run_counted
from .on_card import workspaces_as_used
from ..fake import FakeStep
from ..optimizer import Optimizers, check_optimizer
from ..inputs import Batch, check_model
from ..quiet import fake_logs_quiet
from ..precision import Precision, step_precision
from ..training import accumulated_backward, check_accumulate

__all__ = ["CardStep", "predict_step", "run_on_card"]


@dataclass(frozen=True)
class CardStep:
    """A step predicted on ``card``: ``peak`` (``max_memory_allocated``, bytes), ``time``
    (the compute stream's wait on offload copies included: ``time.link``) and
    ``offloaded_bytes``, what its offload regions copy to host memory."""

    card: Card
    peak: int
    time: StepTime
    offloaded_bytes: int = 0


def predict_step(model: nn.Module, example_input: Any, on: str | Card = "h100",
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 host: HostCost = H100_HOST, achieved: Achieved = H100_ACHIEVED,
                 limit: int | None = None, autocast: torch.dtype | None = None,
                 optimizer: Optimizers = None,
                 accumulate: int = 1) -> CardStep:
    """Peak and time of one training step of ``model`` (as configured: checkpoint mode or
    plan) on ``example_input``, on card ``on`` (a name of ``zoo.memory.cards.CARDS`` or a
    :class:`~zoo.memory.cards.Card`). ``host`` and ``achieved``: the host's costs and the
    fractions of the card's peaks its kernels reach (both calibrated on an H100 machine);
    ``limit``: a cap on reserved bytes, as ``set_per_process_memory_fraction`` sets;
    ``autocast``: the whole step under ``torch.autocast("cuda", dtype=autocast)`` with its cache
    of casts off, as the GPU suite measures (e.g. ``torch.bfloat16``: CUDA's autocast op lists,
    :mod:`.autocast`). Without it, the batch, loss, precision and ``optimizer`` (one or several,
    stepped in order) are read as
    :func:`zoo.memory.step.measure_step` reads them (called inside ``torch.autocast``, on CPU or
    CUDA, the forward runs CUDA's op lists at that dtype); a batch the model cannot run on is one
    line (:mod:`zoo.memory.quiet`). The step is one after the first: the cuBLAS workspaces of
    the threads that run a matmul are held from its start (as ``zoo.plan``'s card steps hold
    them, so a plan's peak is ``predict_step``'s of the planned model); offload regions move
    their saved tensors off the card and ``time.link`` is the wait for the copies.
    ``accumulate``: the step accumulates that many micro-batches of ``example_input`` before
    the optimizer's step, each run (``zoo.memory.training.accumulated_backward``); its peak and
    time are the whole step's."""
    target = card(on)
    batch = Batch.of(example_input)
    model = check_model(model)
    check_optimizer(optimizer, model)
    accumulate = check_accumulate(accumulate)

    copies: list[tuple[str, int, int, int]] = []  # the offload copies of the last step run

    fake = FakeStep(model, batch, optimizer)

    def counted(threads: tuple[bool, ...]) -> CudaCounter:
        drops = fake.drops
        counter = CudaCounter(CachingAllocator(limit), target.workspace)
        counter.hold_workspaces(threads)
        copies.clear()

        def note(kind: str, key: int, nbytes: int) -> None:
            copies.append((kind, key, nbytes, len(counter.records)))

        with fake_logs_quiet(model, batch), simulated_host(note):
            run_on_card(model, batch, target, loss_fn, counter=counter, autocast=autocast,
                        fake=fake, accumulate=accumulate)
        return counter if fake.drops == drops else counted(threads)

    counter = workspaces_as_used(counted)
    time = step_time(counter.records, counter.regions, target, host, achieved)
    waited = link_wait(_timed(copies, counter.records, target, achieved), target.host_link)
    return CardStep(target, counter.peak, dataclasses.replace(time, link=waited),
                    sum(n for kind, _, n, _ in copies if kind == "out"))


def _timed(copies: list[tuple[str, int, int, int]], records: list, on: Card,
           achieved: Achieved) -> list[tuple[str, int, int, float]]:
    """The copies a step queued, each with the card's compute time of the ops since the one
    before (``records`` up to its position), as ``link_wait`` takes them."""
    events, last = [], 0
    for kind, key, nbytes, at in copies:
        events.append((kind, key, nbytes,
                       sum(op_seconds(r, on, achieved) for r in records[last:at])))
        last = max(last, at)
    return events


def run_on_card(model: nn.Module, example_input: Any, on: str | Card,
                loss_fn: Callable[[Any], torch.Tensor] | None = None,
                limit: int | None = None, counter: CudaCounter | None = None,
                optimizer: Optimizers = None,
                autocast: torch.dtype | None = None, fake: FakeStep | None = None,
                accumulate: int = 1) -> CudaCounter:
    """:func:`predict_step`'s fake step, the counter returned (its ``peak``, ``records`` and
    ``regions``). ``counter``: a fresh one to count in, which ``model`` may read as it runs;
    ``fake``: the fake state to run on (its optimizer the step's; made here when not given).
    A step that changes ``fake.drops`` counted optimizer state no real step holds
    (:meth:`~zoo.memory.fake.FakeStep.drop_untrained_state`): the caller measures again.
    ``accumulate``: micro-batches accumulated before the optimizer's step, every one run."""
    target = card(on)
    fake = fake or FakeStep(model, example_input, optimizer)
    batches = fake.micro_batches(accumulate)  # the list the loop runs over, on the card

    def step() -> None:
        with _torch.reparametrize_module(model, fake.state):
            loss = accumulated_backward(model, batches, loss_fn, accumulate)
            fake.step_optimizers()
            del loss  # held through the optimizer's step, as a training loop does

    try:
        fake.clear()  # before the count starts: the gradients a loop holds are counted
        precision = Precision() if autocast is not None else Precision.ambient().on_cpu()
        with fake.mode, step_precision(precision), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            held = fake.tensors + [t for b in batches for t in b.tensors()]
            return run_counted(step, held, limit, workspace=target.workspace, counter=counter,
                               autocast=autocast)
    finally:
        fake.clear()
