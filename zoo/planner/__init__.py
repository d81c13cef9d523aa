"""Checkpoint a model to a memory budget: ``zoo.plan(model, x, "10GB")``.

The planner answers the user's question ("my card has 12 GB: recompute as little as possible")
instead of asking them to pick segments: it profiles the model's chain of blocks on the CPU under
``FakeTensorMode`` (byte-exact), finds every multi-level schedule of the chain worth having
(checkpointed segments whose recompute checkpoints again: rotor's persistent schedules, Beaumont
et al. 2019), each block run plainly or in one of the model's intra-block checkpoint modes, next
to the model's own hand modes, and takes the one with the least recompute whose predicted peak
fits the budget.

Files, by phase (each imports only what sits below it, no circles):

* choosing: ``choose.py`` (:func:`plan`, :class:`Planner`: where a plan is chosen),
  ``plans.py`` (:class:`Plan`, what a plan is and how it is applied), ``batch.py`` (the largest
  batch that fits a budget), ``whole_step.py`` (the plan's peak for the whole step: the
  optimizer's state and step, autocast), ``sweep.py`` and ``step_sweep.py`` (every budget's
  plan measured against its prediction; the whole step against a real one), ``errors.py``;
* ``profiling/``: what each block costs: ``trace.py`` (an instrumented fake step),
  ``repeats.py`` (repeated blocks profiled once), ``contexts.py``, ``profile.py`` and its record
  ``chain_profile.py``, ``timing.py`` (measured times for ``cost="time"``);
* ``search/``: the schedules a profile allows: ``one_level.py`` (the one-level memory model),
  ``multi_level.py`` (nested schedules), ``front.py`` (their search), ``savesets.py`` (op-level
  choices), ``modes.py`` (a model's hand modes as candidates);
* ``modules/``: any other module: ``spine.py`` (its run of calls as a chain), ``nesting.py``,
  ``plan_module.py`` (a plan over its repeated blocks).

Measuring (a step's peak bytes and FLOPs, fake or real) is ``zoo.memory``'s.
"""
from __future__ import annotations

from ..memory.training import default_loss
from ..memory.step import measure_step
from .batch import largest_batch
from .choose import (Planner, block_plan, plan, plan_choices, profile_block_modes,
                     solve_profile, spine_planner)
from .errors import BudgetTooSmallError
from .modules.plan_module import ModulePlan, plan_module
from .plans import Plan
from .profiling.profile import ChainProfile, profile_chain
from .search.front import Front, solve_nested
from .search.modes import ModeCost, profile_modes
from .search.multi_level import least_peak
from .search.one_level import (predict_peak, recompute_flops, smallest_peak,
                               uniform_segments)

__all__ = ["plan", "Plan", "Planner", "BudgetTooSmallError", "ChainProfile", "profile_chain",
           "solve_profile", "predict_peak", "recompute_flops", "smallest_peak",
           "uniform_segments", "default_loss", "largest_batch", "measure_step", "ModeCost",
           "profile_modes", "ModulePlan", "plan_module", "profile_block_modes", "least_peak",
           "solve_nested", "Front", "plan_choices", "block_plan", "spine_planner"]
