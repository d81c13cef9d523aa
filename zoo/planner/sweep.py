"""A plan keeps its promise: every plan a model is offered, from the plain peak down to the least
one, applied and its step measured against the peak it predicts.

:func:`budget_sweep` plans ``model`` once (:func:`planner_for`), takes budgets from the plain
peak down to the least plan's in equal steps, applies the plan each picks and measures one
training step of it, under ``FakeTensorMode`` (``zoo.memory.step.measure_step``) or with the
``measure`` given (a real step: :func:`real_peak`). The measure counts live storages with no
module hooks: ``MemTracker``'s ``ModTracker`` holds the gradients of a module's many inputs
(a DenseNet layer's) until the last arrives, longer than the step itself does. The model is
left without a plan afterwards."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..memory.fake import collector_paused
from ..memory.training import default_loss
from ..memory.step import measure_step, peak_bytes
from .choose import Planner, spine_planner
from .plans import Plan, clear_plan, plan_set_aside

__all__ = ["SweepRow", "planner_for", "budget_sweep", "sweep_budgets", "real_peak"]


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One budget of a sweep: the plan it picked, what the plan predicts and what its step
    measured (bytes)."""

    budget: int
    predicted: int
    measured: int
    recompute_flops: int
    levels: int
    mode: str | None

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted."""
        return (self.measured - self.predicted) / self.predicted


def planner_for(model: nn.Module, example_input: Any,
                loss_fn: Callable[[Any], torch.Tensor] | None = None,
                compiled: bool = False) -> Planner:
    """The :class:`Planner` ``zoo.plan`` answers ``model``'s budgets from: over a zoo model's
    chain (a plan applied before set aside), else over its spine. A module whose repeated blocks
    its spine does not cover (planned by ``plan_module``, measured per budget) is refused."""
    with collector_paused():
        if hasattr(model, "checkpoint_chain"):
            with plan_set_aside(model):
                return Planner(model, example_input, loss_fn, compiled=compiled)
        planner = spine_planner(model, example_input, loss_fn, compiled=compiled)
    if planner is None:
        raise ValueError(f"{type(model).__name__} has no spine that covers its repeated blocks; "
                         f"a sweep needs a Planner: use zoo.plan per budget instead")
    return planner


def sweep_budgets(plain: int, least: int, steps: int = 10,
                  fractions: tuple[float, ...] = ()) -> list[int]:
    """``steps + 1`` budgets from ``plain`` down to ``least`` in equal steps, and each fraction
    of ``plain`` that is at least ``least``; descending, without repeats."""
    grid = {plain - (plain - least) * i // steps for i in range(steps + 1)}
    grid |= {int(f * plain) for f in fractions if f * plain >= least}
    return sorted(grid, reverse=True)


def real_peak(model: nn.Module, example_input: Any,
              loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """Peak bytes of one real training step of ``model`` as configured now, from fresh
    gradients, its parameters and buffers counted from the start (no module hooks)."""
    loss_fn = loss_fn or default_loss

    def step() -> None:
        loss_fn(model(example_input)).backward()

    model.zero_grad(set_to_none=True)
    try:
        return peak_bytes(step, [model])
    finally:
        model.zero_grad(set_to_none=True)


def budget_sweep(model: nn.Module, example_input: Any, steps: int = 10,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 measure: Callable[[nn.Module, Any], int] | None = None,
                 fractions: tuple[float, ...] = (), planner: Planner | None = None
                 ) -> list[SweepRow]:
    """Each budget of :func:`sweep_budgets` planned, applied and measured (module docstring);
    a plan picked by several budgets is measured once. ``measure(model, example_input)``: the
    step's peak bytes (default: the fake step's)."""
    planner = planner or planner_for(model, example_input, loss_fn)
    if measure is None:
        def measure(m: nn.Module, x: Any) -> int:
            return measure_step(m, x, loss_fn)[0]
    rows, seen = [], {}
    try:
        for budget in sweep_budgets(planner.plain_peak, planner.least_peak, steps, fractions):
            plan = planner.plan(budget)
            key = _key(plan)
            if key not in seen:
                plan.apply(model)
                seen[key] = measure(model, example_input)
            rows.append(SweepRow(budget, plan.predicted_peak, seen[key], plan.recompute_flops,
                                 plan.levels, plan.mode))
    finally:
        clear_plan(model, planner.choices[-1])
    return rows


def _key(plan: Plan) -> tuple[str, str, str | None]:
    return str(plan.segments), str(plan.block_modes), plan.mode
