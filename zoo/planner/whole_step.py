"""A plan's peak for the whole step the user runs: with their optimizer, in their precision.

The chain's memory model (``profiling/``, ``search/``) predicts the forward and backward of a
step in float32 to the byte. Two things of a user's step lie outside it: the optimizer (its state
held all step, AdamW two copies of the parameters; its ``step()`` after the backward, with the
temporaries of its foreach or fused kernels) and autocast (which keeps a cast copy of every
parameter it casts until the forward's autocast block ends, and runs the ops of its own lists in
bf16 or fp16). :class:`WholeStep` takes the chain's choices for the budget less the optimizer's
state, then runs the chosen plan's whole step once under ``FakeTensorMode``
(:func:`zoo.memory.step.measure_step`: forward and loss under the autocast, backward, the
optimizer's step, on a card under ``zoo.memory.on_card``), whose bytes a real step holds to the
byte; a plan over the budget gives way to the next with a lower peak. That measured peak is the
plan's ``predicted_peak``: nothing of the step is run for real.

Gradient accumulation (``accumulate=k``: ``k`` micro-batches, each ``loss / k`` backward, then
one optimizer step) is planned the same way: every choice is measured as the whole accumulating
step (``measure_step(..., accumulate=k)``). The chain's model is not taught that gradients are
held, because that would not stay exact: its figures are a fresh step's, in which autograd keeps
each new gradient as the parameter's (a unit's backward rise includes its own gradients, and
they stay), whereas with gradients held it adds each new one into the held one and frees it (a
transient beside the held gradient, of another shape in time), and on a card the caching
allocator places every block around the held gradients. Adding the gradients' bytes to the
chain's figures would be an estimate; the whole step's measurement is exact by construction.
The chain's peak stays a lower bound: each op of a later micro-batch runs beside the tensors of
the same op of a fresh step, plus gradients, so the chain's choices that do not fit the budget
less the optimizer's state cannot fit accumulating either, and are not measured. What this
gives up: the candidates are the fresh chain's front (least recompute for each fresh peak), so a
plan that front drops for a cheaper one of a lower fresh peak is not offered; every plan given
keeps its budget and its predicted peak.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..memory.cards.on_card import current_card
from ..memory.fake import FakeStep
from ..memory.inputs import Batch
from ..memory.precision import Precision, step_precision
from ..memory.step import measure_step
from ..memory.optimizer import Optimizers, as_optimizers, describe_optimizers, held_bytes
from .errors import BudgetTooSmallError
from .modules.spine import Spine
from .plans import Plan, cheapest, plan_applied

__all__ = ["WholeStep", "describe_step"]


def describe_step(batch: Batch, loss: str, optimizer: Optimizers,
                  precision: Precision, accumulate: int = 1, unstepped: int = 0) -> str:
    """The step a plan was made for, in one line (a plan's printout); ``accumulate``: its
    micro-batches per optimizer step, said when more than one; ``unstepped``: how many
    trainable parameters no optimizer steps (their gradients held all step), said when any."""
    opt = describe_optimizers(as_optimizers(optimizer))
    if unstepped:
        opt += f" ({unstepped} trainable parameter(s) in none: their gradients held)"
    micro = "" if accumulate == 1 else \
        f", {accumulate} micro-batches accumulated per optimizer step (loss / {accumulate})"
    return f"step: batch {batch.describe()}{micro}, loss: {loss}, {opt}, {precision.name}"


class WholeStep:
    """The whole step of ``model`` on ``batch`` with ``optimizer`` in ``precision``, accumulating
    ``accumulate`` micro-batches of ``batch`` per optimizer step (module docstring); peaks of
    plans measured once each."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                 optimizer: Optimizers, precision: Precision,
                 accumulate: int = 1) -> None:
        self.model, self.batch, self.loss_fn = model, Batch.of(batch), loss_fn
        self.precision, self.accumulate = precision, accumulate
        self.fake = FakeStep(model, self.batch, optimizer)
        self._peaks: dict[tuple, int] = {}

    def state_held(self) -> int:
        """Bytes of the optimizers' state the step holds: after a step is measured, only the
        trained parameters' (``FakeStep.drop_untrained_state``)."""
        return sum(held_bytes(opt) for opt in self.fake.optimizers)

    @staticmethod
    def of(model: nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
           optimizer: Optimizers, precision: Precision,
           accumulate: int = 1) -> WholeStep | None:
        """A :class:`WholeStep`, or None for the step the chain's model predicts exactly by
        itself (no optimizer, float32, on this machine, one micro-batch per optimizer step). On
        a card (``zoo.memory.on_card``) the caching allocator's block splitting can put a large
        tensor's step a few blocks above the chain's sum (ResNet-50 at batch 256 on the H100:
        3,932,160 B over its 5.15 GB least), so every card plan is checked by its whole step."""
        if not as_optimizers(optimizer) and precision.dtype is None and current_card() is None \
                and accumulate == 1:
            return None
        return WholeStep(model, batch, loss_fn, optimizer, precision, accumulate)

    def peak(self, plan: Plan) -> int:
        """The peak of the whole step with ``plan`` applied (the model is left as it was)."""
        key = (str(plan.segments), str(plan.block_modes), plan.mode)
        if isinstance(self.model, Spine):  # planned over the wrapper: its own names
            plan = dataclasses.replace(plan, spine=None)
        if key not in self._peaks:
            with step_precision(self.precision), plan_applied(self.model, plan):
                self._peaks[key] = measure_step(self.model, self.batch, self.loss_fn,
                                                self.fake, accumulate=self.accumulate)[0]
        return self._peaks[key]

    def pick(self, choices: Sequence[Plan], budget: float) -> Plan:
        """The cheapest of ``choices`` (peak ascending, recompute falling) whose whole step fits
        ``budget``, with its measured peak as ``predicted_peak`` and the whole step's plain and
        least peaks; :class:`BudgetTooSmallError` when not even the least fits. A choice whose
        chain peak is over the budget less the optimizer's state is not measured: the whole
        step, accumulating or not, holds at least that (module docstring)."""
        plain, least = self.peak(choices[-1]), self.peak(choices[0])
        if least > budget:
            raise BudgetTooSmallError(budget, least, plain)
        room = budget - self.state_held()
        fitting = sorted((c for c in choices if c.predicted_peak <= room), key=cheapest)
        for chosen in fitting:  # the casts can reorder close peaks: each one measured
            peak = self.peak(chosen)
            if peak <= budget:
                return dataclasses.replace(chosen, budget=budget, predicted_peak=peak,
                                           plain_peak=plain, smallest_peak=least)
        return dataclasses.replace(choices[0], budget=budget, predicted_peak=least,
                                   plain_peak=plain, smallest_peak=least)
