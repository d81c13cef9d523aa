"""A model's own checkpoint modes as candidates of the plan.

The families' hand modes cut *inside* blocks (DenseNet's bottleneck halves, ResNet's halves and
BN-ReLU regions, a transformer's selective ``save_ops``), which a chain of whole blocks cannot
express; DenseNet's ``bottleneck`` mode does not even store the concatenations a chain boundary
must hold. So each mode is measured as it runs (one fake training step, exact bytes and FLOPs:
:func:`measure_step`) and enters the search beside the chain's schedules. The plan at a budget is
the cheapest of everything that fits, so at every budget at or above a mode's peak it recomputes
at most what that mode does, by construction, and what it predicts for a mode is a measurement.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...memory.fake import FakeStep
from ...memory.step import measure_step

__all__ = ["ModeCost", "profile_modes"]


@dataclass(frozen=True)
class ModeCost:
    """One hand mode of a model on one input: its step's peak bytes and recomputed FLOPs."""

    mode: str
    peak: int
    recompute_flops: int


def profile_modes(model: nn.Module, example_input: torch.Tensor, plain_flops: int,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  only: list[str] | None = None, fake: FakeStep | None = None
                  ) -> list[ModeCost]:
    """Every mode in ``model.checkpoint_modes`` (or in ``only``) measured on
    ``example_input`` (under ``FakeTensorMode``; the model's own mode and plan are restored
    afterwards). ``plain_flops``: a plain step's FLOPs, so a mode's recompute is its step's
    FLOPs beyond them."""
    modes = tuple(getattr(model, "checkpoint_modes", ())) if only is None else tuple(only)
    if not modes:
        return []
    active, plan = model.grad_checkpointing, model.checkpoint_plan
    costs = []
    try:
        model.set_checkpoint_plan(None)
        for mode in modes:
            try:
                model.set_grad_checkpointing(mode)
            except ValueError:  # e.g. a ResNet built with checkpoint_every > 1 has 'block' only
                continue
            peak, flops = measure_step(model, example_input, loss_fn, fake)
            costs.append(ModeCost(mode, peak, max(0, flops - plain_flops)))
    finally:
        model.set_grad_checkpointing(active if active is not None else False)
        model.set_checkpoint_plan(plan)
    return costs
