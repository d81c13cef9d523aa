"""Checkpoint a model to a memory budget: ``zoo.planner.plan(model, x, "10GB")``.

The planner answers the user's question ("my card has 12 GB: recompute as little as possible")
instead of asking them to pick segments: it profiles the model's chain of blocks on the CPU
under ``FakeTensorMode`` (:mod:`.profile`, byte-exact), finds every multi-level schedule of the
chain worth having (checkpointed segments whose recompute checkpoints again: rotor's persistent
schedules, Beaumont et al. 2019), each block run plainly or in one of the model's intra-block
checkpoint modes (:mod:`.nested` the model, :mod:`.front` the search; :mod:`.solve` holds the
one-level model it reproduces), next to the model's own hand modes (:mod:`.modes`), and takes
the one with the least recompute whose predicted peak fits the budget (:mod:`.planner`). It
applies it with ``model.set_checkpoint_plan`` and ``model.set_checkpoint_block_modes``.
:mod:`.batch` finds the largest batch that fits a budget (``train.py --batch_size auto``);
:mod:`.measure` measures a step without running it; :mod:`.modules` plans any other module.

Files, each importing only those listed before it (no circles): ``errors.py``, ``tracker.py``
(bytes and FLOPs op by op), ``fake_mode.py`` (``FakeTensorMode`` with quicker cache keys),
``fake.py`` (fake state, the default loss), ``measure.py`` (one fake step's peak and FLOPs),
``modes.py`` (hand modes as candidates), ``module_nesting.py``, ``spine.py`` (any module's run of
calls as a chain), ``savesets.py`` (op-level choices), ``trace.py`` (an instrumented step),
``repeats.py`` (repeated units profiled once), ``contexts.py`` (the runs that show each unit in
every context), ``profile.py`` (what each unit costs), ``solve.py`` (the one-level memory model),
``nested.py`` (multi-level schedules), ``front.py`` (their search), ``plans.py`` (the
:class:`Plan`), ``modules.py`` (blocks of any module), ``batch.py``, ``timing.py``, ``planner.py``
(:class:`Planner`); this file holds :func:`plan`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpoint import split_segments
from ..memory import parse_budget
from .batch import largest_batch
from .errors import BudgetTooSmallError
from ..memory.fake import collector_paused
from ..memory.training import default_loss
from .search.front import Front, solve_nested
from ..memory.step import measure_step
from .search.modes import ModeCost, profile_modes
from .modules.plan_module import ModulePlan, plan_module
from .search.multi_level import MAX_UNITS, chain_floor, least_peak
from .choose import (Planner, block_plan, plan_choices, profile_block_modes, solve_profile,
                      spine_planner)
from .plans import Plan, plan_set_aside
from .profiling.profile import ChainProfile, profile_chain
from .search.one_level import predict_peak, recompute_flops, smallest_peak
from .profiling.timing import time_profile

__all__ = ["plan", "Plan", "Planner", "BudgetTooSmallError", "ChainProfile", "profile_chain",
           "solve_profile", "predict_peak", "recompute_flops", "smallest_peak",
           "uniform_segments", "default_loss", "largest_batch", "measure_step", "ModeCost",
           "profile_modes", "solve_measured", "ModulePlan", "plan_module", "profile_block_modes",
           "least_peak", "solve_nested", "Front", "plan_choices", "spine_planner"]

_block_plan = block_plan  # the name the planner's scripts knew


def uniform_segments(profile: ChainProfile, segments: int) -> list[tuple[int, int, bool]]:
    """``checkpoint_sequential``'s schedule at unit level: ``segments`` balanced checkpointed
    segments covering the chain (the last one too, as ``zoo.checkpoint_sequential`` does)."""
    return [(r.start, r.stop, True) for r in split_segments(profile.n_units, segments)]


def plan(model: nn.Module, example_input: torch.Tensor, memory_budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, apply: bool = True,
         modes: bool = True, block_modes: bool = True,
         modules: Any = None, cost: str = "flops", compiled: bool = False) -> Plan | ModulePlan:
    """Checkpoint ``model`` so one training step fits ``memory_budget`` with the least
    recompute, and return the :class:`Plan` (``print`` it for a table).

    Args:
        model: any ``nn.Module``. A zoo model is planned over its chain of blocks, its hand
            modes and multi-level schedules with per-block modes; any other module (torchvision,
            timm, Hugging Face, yours) over its repeated blocks (``zoo.blocks.find_blocks``: the
            ones ``zoo.set_grad_checkpointing`` takes; ``modules`` overrides them), nested in
            containers where every block alone does not fit, returning a :class:`ModulePlan`
            whose peak is measured (:func:`plan_module`).
        example_input: one batch as training will see it (shape, dtype and device decide the
            figures; its values do not matter). Nothing is computed on it: the model is
            profiled under ``FakeTensorMode``.
        memory_budget: bytes, or a string like ``"10GB"`` / ``"12GiB"`` / ``"1500MB"``, for one
            training step: parameters, gradients and activations (not optimizer state: leave
            room for it). ``inf`` (or ``"inf"``) checkpoints nothing; for an input on a GPU, a
            fraction of its memory (``0.8`` or ``"80%"``).
        loss_fn: output -> scalar loss of the step (default: mean of squares; its memory is part
            of the prediction, usually negligible).
        apply: make the model run the result (default True).
        cost: ``"flops"`` (default, exact) or ``"time"``: each block's forward timed on the
            input's device, and the chain planned for least recompute time (the plan's
            ``recompute_flops`` and ``step_flops`` are then nanoseconds, ``plan.cost ==
            "time"``; hand modes and per-block modes are left out of that search).
        modes: measure the model's own checkpoint modes too and take one where it is the
            cheapest that fits (default True).
        block_modes: also profile the chain with every block in each of those modes and save
            sets (op-level choices: ``zoo.planner.search.savesets``), as per-block options at any
            level of the schedule, and search those schedules (default True).
        compiled: the model will run under ``torch.compile``: plan only what AOTAutograd's
            partitioner keeps (one-level schedules of plain blocks; see :class:`Planner`).

    A budget at or above the plain model's peak checkpoints nothing. A budget below the lowest
    peak any schedule reaches raises :class:`BudgetTooSmallError` naming that peak; nan,
    negative or unreadable budgets raise a one-line ValueError.
    """
    device = example_input.device if isinstance(example_input, torch.Tensor) else None
    budget = parse_budget(memory_budget, device)
    if cost not in ("flops", "time"):
        raise ValueError(f"cost must be 'flops' or 'time', got {cost!r}")
    with collector_paused():
        if hasattr(model, "checkpoint_chain") and modules is None:
            with plan_set_aside(model):  # a plan applied before is not the plain step's
                result = _plan_zoo_model(model, example_input, budget, loss_fn, cost, modes,
                                         block_modes, compiled)
        else:
            spine = spine_planner(model, example_input, loss_fn, compiled=compiled) \
                if modules is None else None
            result = spine.plan(budget) if spine is not None else \
                plan_module(model, example_input, budget, loss_fn, modules)
    if apply:
        result.apply(model)
    return result


def _plan_zoo_model(model: nn.Module, example_input: torch.Tensor, budget: float,
                    loss_fn: Callable[[Any], torch.Tensor] | None, cost: str, modes: Any,
                    block_modes: Any, compiled: bool) -> Plan:
    """:func:`plan` for a model with the zoo's chain, with no plan applied to it."""
    if budget == float("inf"):
        return _no_limit(model, example_input, loss_fn)
    if cost == "time":
        profile = time_profile(model, example_input, profile_chain(model, example_input, loss_fn),
                               loss_fn)
        return dataclasses.replace(solve_profile(profile, budget), cost="time")
    return Planner(model, example_input, loss_fn, modes=modes, block_modes=block_modes,
                   compiled=compiled).plan(budget)


def solve_measured(model: nn.Module, example_input: torch.Tensor,
                   loss_fn: Callable[[Any], torch.Tensor] | None, profile: ChainProfile,
                   budget: int | float, modes: list[ModeCost], inner: list[ChainProfile],
                   tries: int = 6) -> Plan:
    """:func:`solve_profile` (kept for callers from when plans with block modes were measured
    before being returned: their predicted peaks are now exact, so nothing is measured)."""
    return dataclasses.replace(solve_profile(profile, budget, modes=modes, block_profiles=inner),
                               budget=budget)


def _no_limit(model: nn.Module, example_input: torch.Tensor,
              loss_fn: Callable[[Any], torch.Tensor] | None) -> Plan:
    """The plan for an infinite budget: nothing checkpointed (the chain is profiled once so the
    plan still reports the plain peak)."""
    p = profile_chain(model, example_input, loss_fn, max_units=MAX_UNITS)
    plain = predict_peak(p, [(0, p.n_units, False)])
    return Plan([(0, p.n_blocks, False)], float("inf"), plain, plain, chain_floor(p), 0,
                p.step_flops, p)
