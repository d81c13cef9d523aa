"""Checkpoint a model to a memory budget: ``zoo.planner.plan(model, x, "10GB")``.

The planner answers the user's question ("my card has 12 GB: recompute as little as possible")
instead of asking them to pick segments: it profiles the model's chain of blocks on the CPU
under ``FakeTensorMode`` (:mod:`.profile`), finds by dynamic programming the multi-level
schedule of the chain (checkpointed segments whose recompute checkpoints again: rotor's
persistent schedules, Beaumont et al. 2019) whose predicted peak fits the budget with the fewest
recomputed FLOPs, each block run plainly or in one of the model's intra-block checkpoint modes
(:mod:`.nested`; :mod:`.solve` holds the one-level model it reproduces), and applies it with
``model.set_checkpoint_plan`` and ``model.set_checkpoint_block_modes``. The model's own
checkpoint modes (:mod:`.modes`) are measured and compete with those schedules, so a plan never
recomputes more than a hand mode that fits the same budget.
:mod:`.batch` finds the largest batch that fits a budget (``train.py --batch_size auto``);
:mod:`.measure` measures a step without running it.

Files, each importing only those listed before it (no circles): ``fake.py`` (fake state, the
default loss), ``measure.py`` (one fake step's peak and FLOPs), ``modes.py`` (hand modes as
candidates), ``profile.py`` (what each block costs), ``solve.py`` (the one-level memory model
and its DP), ``nested.py`` (multi-level schedules and their DP), ``batch.py``,
``module_nesting.py`` and ``modules.py`` (any ``nn.Module``); this file holds the user-facing
:func:`plan` and :class:`Plan`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import split_segments
from ..memory import format_bytes, parse_budget
from .batch import largest_batch
from .errors import BudgetTooSmallError
from .fake import default_loss
from .measure import measure_step
from .modes import ModeCost, profile_modes
from .modules import ModulePlan, plan_module
from .profile import ChainProfile, profile_chain
from .timing import time_profile
from .nested import MAX_UNITS, chain_floor, least_peak, solve_nested
from .solve import predict_peak, recompute_flops, smallest_peak, solve

__all__ = ["plan", "Plan", "BudgetTooSmallError", "ChainProfile", "profile_chain", "solve_profile",
           "predict_peak", "recompute_flops", "smallest_peak", "uniform_segments",
           "default_loss", "largest_batch", "measure_step", "ModeCost", "profile_modes",
           "solve_measured", "ModulePlan", "plan_module", "profile_block_modes", "least_peak",
           "solve_nested"]


@dataclass
class Plan:
    """A checkpoint schedule for a model's chain and what the planner predicts it costs.

    ``segments`` is block-level, as ``model.set_checkpoint_plan`` takes it: ``(start, stop,
    checkpointed)`` where ``checkpointed`` is False (stored), True, or the inner plan the
    segment's recompute runs (multi-level); ``block_modes`` (one entry per block, or None) runs
    blocks in an intra-block checkpoint mode. When ``mode`` is set, the plan is that hand mode
    of the model (``model.set_grad_checkpointing(mode)``) and ``segments`` is empty. Peaks are
    bytes of one training step (forward, loss, backward; parameters and gradients included) as
    ``zoo.memory.cpu_peak_bytes`` measures them; ``overhead`` is recompute FLOPs over a plain
    step's FLOPs; ``modes``: the hand modes that were candidates, as measured.
    """

    segments: list[tuple[int, int, Any]]
    budget: int | float
    predicted_peak: int
    plain_peak: int
    smallest_peak: int
    recompute_flops: int
    step_flops: int
    profile: ChainProfile
    mode: str | None = None
    modes: tuple[ModeCost, ...] = ()
    block_modes: list[str | None] | None = None
    cost: str = "flops"

    def apply(self, model: nn.Module) -> None:
        """Make ``model`` run this plan (its chain's segments with their block modes, or its
        hand mode)."""
        with_modes = hasattr(model, "set_checkpoint_block_modes")
        if self.mode is None:
            model.set_checkpoint_plan(self.segments)
            if with_modes:
                model.set_checkpoint_block_modes(self.block_modes)
        else:
            model.set_checkpoint_plan(None)
            if with_modes:
                model.set_checkpoint_block_modes(None)
            model.set_grad_checkpointing(self.mode)

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def checkpointed_blocks(self) -> list[int]:
        """Blocks inside a checkpointed segment (recomputed at least once)."""
        return [j for a, b, ck in self.segments if ck is not False for j in range(a, b)]

    @property
    def levels(self) -> int:
        """How deep the checkpoints nest: 0 (none), 1 (one-level segments), 2, ..."""
        return _depth(self.segments)

    def _amount(self, n: int) -> str:
        return f"{n / 1e6:.2f} ms" if self.cost == "time" else _flops(n)

    def _summary(self) -> str:
        roomy = "; at or above the plain peak: nothing checkpointed" \
            if self.budget >= self.plain_peak else ""
        return (f"budget {_budget(self.budget)}: predicted peak {format_bytes(self.predicted_peak)}"
                f" (plain {format_bytes(self.plain_peak)}, smallest feasible "
                f"{format_bytes(self.smallest_peak)}{roomy})")

    def __str__(self) -> str:
        if self.mode is not None:
            others = ", ".join(f"{m.mode} {format_bytes(m.peak)} +{_flops(m.recompute_flops)}"
                               for m in self.modes)
            return "\n".join([
                f"the model's own checkpoint mode {self.mode!r} (measured; cheapest that fits)",
                self._summary(),
                f"+{_flops(self.recompute_flops)} recomputed, +{100 * self.overhead:.1f}% of a "
                f"plain step's {_flops(self.step_flops)}; modes measured: {others}"])
        p = self.profile
        unit = "fwd ms" if self.cost == "time" else "fwd MFLOP"
        lines = [f"| block | name | checkpointed in (outer to inner) | activations | block mode "
                 f"| {unit} |", "|---:|---|---|---|---|---:|"]
        path = _paths(self.segments, p.n_blocks)
        flops = {a: p.flops[u] for u, (a, _) in enumerate(p.units)}
        for j in range(p.n_blocks):
            mode = (self.block_modes or [None] * p.n_blocks)[j] or ""
            what = "recomputed" if path[j] else "saved"
            f = f"{flops[j] / 1e6:.1f}" if j in flops else ""
            lines.append(f"| {j} | {p.block_names[j]} | {' > '.join(path[j]) or '-'} | {what} | "
                         f"{mode} | {f} |")
        n_ck = len(self.checkpointed_blocks)
        lines += [
            "",
            self._summary(),
            f"{n_ck} of {p.n_blocks} blocks recomputed, checkpoints {self.levels} level(s) deep: "
            f"+{self._amount(self.recompute_flops)} recomputed, +{100 * self.overhead:.1f}% of "
            f"a plain step's {self._amount(self.step_flops)}",
        ]
        return "\n".join(lines)


def _depth(segments: list) -> int:
    return max((1 + (_depth(ck) if isinstance(ck, list) else 0) for *_, ck in segments
                if ck is not False), default=0)


def _paths(segments: list, n: int, outer: tuple[str, ...] = ()) -> list[list[str]]:
    """For each block, the checkpointed segments around it, outermost first ("3-9")."""
    out: list[list[str]] = [[] for _ in range(n)]
    for a, b, ck in segments:
        here = (*outer, f"{a}-{b - 1}") if ck is not False else outer
        if isinstance(ck, list):
            inner = _paths(ck, n, here)
            for j in range(a, b):
                out[j] = inner[j]
        else:
            for j in range(a, b):
                out[j] = list(here)
    return out


def _budget(n: int | float) -> str:
    return "inf (no limit)" if n == float("inf") else format_bytes(n)


def _flops(n: int) -> str:  # ns when a plan's cost is "time"
    return f"{n / 1e9:.2f} GFLOP" if n >= 1e9 else f"{n / 1e6:.1f} MFLOP"


def uniform_segments(profile: ChainProfile, segments: int) -> list[tuple[int, int, bool]]:
    """``checkpoint_sequential``'s schedule at unit level: ``segments`` balanced checkpointed
    segments covering the chain (the last one too, as ``zoo.checkpoint_sequential`` does)."""
    return [(r.start, r.stop, True) for r in split_segments(profile.n_units, segments)]


def _block_plan(p: ChainProfile, schedule: list) -> list[tuple[int, int, Any]]:
    """A unit-level nested schedule -> the block-level plan ``set_checkpoint_plan`` takes."""
    bounds = [a for a, _ in p.units] + [p.n_blocks]
    return [(bounds[a], bounds[b], False if inner is None else _block_plan(p, inner))
            for a, b, inner in schedule]


def solve_profile(profile: ChainProfile, memory_budget: int | float | str,
                  modes: tuple[ModeCost, ...] | list[ModeCost] = (),
                  block_profiles: tuple[ChainProfile, ...] | list[ChainProfile] = (),
                  slots: int = 4000) -> Plan:
    """The cheapest plan under ``memory_budget`` (nothing applied): over the multi-level
    schedules of ``profile``'s chain (:mod:`.nested`) whose blocks each run plainly or in one of
    the intra-block modes profiled in ``block_profiles`` (:func:`profile_block_modes`), and the
    measured hand ``modes``. Ties go to the lower peak. Chains longer than ``nested.MAX_UNITS``
    units are planned one level deep."""
    budget = parse_budget(memory_budget)
    p, modes = profile, tuple(modes)
    variants = [p, *(q for q in block_profiles if q.units == p.units and q.act == p.act)]
    plain = predict_peak(p, [(0, p.n_units, False)])
    # the least peak named to the user: plain blocks (exact) or a hand mode (measured); block
    # modes are predicted, so a plan with them below it is returned only if it measures in
    nested = p.n_units <= MAX_UNITS
    smallest = min([chain_floor(p), *(m.peak for m in modes)])
    if budget >= plain:
        return Plan(_block_plan(p, [(0, p.n_units, None)]), budget, plain, plain, smallest, 0,
                    p.step_flops, p, None, modes)
    candidates = [Plan([], budget, m.peak, plain, smallest, m.recompute_flops, p.step_flops, p,
                       m.mode, modes) for m in modes if m.peak <= budget]
    one_level = solve(p, int(budget))  # exact; the grid's rounding may cost a little more
    if one_level is not None:
        segments, peak = one_level
        candidates.append(Plan(p.block_segments(segments), budget, peak, plain, smallest,
                               recompute_flops(p, segments), p.step_flops, p, None, modes))
    found = solve_nested(variants, budget, slots) if nested else None
    if found is not None:
        schedule, chosen, peak, cost = found
        names = [q.block_mode for q in variants]
        block_modes = [names[chosen[u]] for u, (a, b) in enumerate(p.units) for _ in range(a, b)]
        candidates.append(Plan(_block_plan(p, schedule), budget, peak, plain, smallest, cost,
                               p.step_flops, p, None, modes,
                               block_modes if any(block_modes) else None))
    if not candidates:
        raise BudgetTooSmallError(budget, smallest, plain)
    return min(candidates, key=lambda c: (c.recompute_flops, c.predicted_peak))


def plan(model: nn.Module, example_input: torch.Tensor, memory_budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, apply: bool = True,
         modes: bool = True, block_modes: bool = True,
         modules: Any = None, cost: str = "flops") -> Plan | ModulePlan:
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
        block_modes: also profile the chain with every block in each of those modes (as
            per-block options, at any level of the schedule) and search those
            schedules (default True; each mode costs a profile).

    A budget at or above the plain model's peak checkpoints nothing. A budget below the lowest
    peak any schedule reaches raises :class:`BudgetTooSmallError` naming that peak; nan,
    negative or unreadable budgets raise a one-line ValueError.
    """
    device = example_input.device if isinstance(example_input, torch.Tensor) else None
    budget = parse_budget(memory_budget, device)
    if cost not in ("flops", "time"):
        raise ValueError(f"cost must be 'flops' or 'time', got {cost!r}")
    if cost == "time" and hasattr(model, "checkpoint_chain") and budget != float("inf"):
        profile = time_profile(model, example_input, profile_chain(model, example_input, loss_fn),
                               loss_fn)
        result = dataclasses.replace(solve_profile(profile, budget), cost="time")
        if apply:
            result.apply(model)
        return result
    if not hasattr(model, "checkpoint_chain") or modules is not None:
        result = plan_module(model, example_input, budget, loss_fn, modules)
    elif budget == float("inf"):
        result = _no_limit(model, example_input, loss_fn)
    else:
        profile = profile_chain(model, example_input, loss_fn)
        found = profile_modes(model, example_input, profile.step_flops, loss_fn) \
            if modes else []
        inner = profile_block_modes(model, example_input, loss_fn) if block_modes else []
        result = solve_measured(model, example_input, loss_fn, profile, budget, found, inner)
    if apply:
        result.apply(model)
    return result


def solve_measured(model: nn.Module, example_input: torch.Tensor,
                   loss_fn: Callable[[Any], torch.Tensor] | None, profile: ChainProfile,
                   budget: int | float, modes: list[ModeCost], inner: list[ChainProfile],
                   tries: int = 6) -> Plan:
    """:func:`solve_profile`, with the chosen schedule measured (one fake step) before it is
    returned, so the budget is met as measured. The model of plain blocks, nested or not, is
    byte-exact on the zoo's chains (tests/planner/test_planner_nested.py). Blocks in intra-block
    modes
    are predicted on the heavy side (within 10% on ResNet-20), checked on few combinations: a
    plan with block modes measured over budget is dropped and the plain blocks are planned
    again. A plan over budget by some bytes is searched again with that much less room. The
    plan reports the measured peak."""
    room, reached = budget, None  # reached: the least peak a plan tried here measured
    for _ in range(tries):
        try:
            result = solve_profile(profile, room, modes=modes, block_profiles=inner)
        except BudgetTooSmallError as e:
            least = e.smallest if reached is None or e.smallest > budget else reached
            raise BudgetTooSmallError(budget, least, e.plain) from None
        if result.mode is not None or room >= result.plain_peak:
            break  # a hand mode's peak is measured; the plain peak is exact
        saved = (model.checkpoint_plan, model.checkpoint_block_modes)
        result.apply(model)
        try:
            peak = measure_step(model, example_input, loss_fn)[0]
        finally:
            model.set_checkpoint_plan(saved[0])
            model.set_checkpoint_block_modes(saved[1])
        if peak <= budget:
            result.predicted_peak = peak
            break
        if result.block_modes is not None:  # mixed block modes are predicted, not exact:
            inner = []  # plan again over plain blocks, whose model is exact
            continue
        reached = peak if reached is None else min(reached, peak)
        room -= peak - result.predicted_peak
    else:
        raise BudgetTooSmallError(budget, reached or result.smallest_peak, result.plain_peak)
    return dataclasses.replace(result, budget=budget)


def profile_block_modes(model: nn.Module, example_input: torch.Tensor,
                        loss_fn: Callable[[Any], torch.Tensor] | None = None
                        ) -> list[ChainProfile]:
    """The chain profiled with every block in each of ``model.checkpoint_modes``; a mode that
    has no per-block form (a block refuses it with a ValueError, e.g. a whole-model schedule)
    is left out."""
    profiles = []
    for mode in getattr(model, "checkpoint_modes", ()):
        try:
            profiles.append(profile_chain(model, example_input, loss_fn, mode))
        except ValueError:
            continue
    return profiles


def _no_limit(model: nn.Module, example_input: torch.Tensor,
              loss_fn: Callable[[Any], torch.Tensor] | None) -> Plan:
    """The plan for an infinite budget: nothing checkpointed (the chain is profiled once so the
    plan still reports the plain peak)."""
    p = profile_chain(model, example_input, loss_fn)
    plain = predict_peak(p, [(0, p.n_units, False)])
    return Plan([(0, p.n_blocks, False)], float("inf"), plain, plain, chain_floor(p), 0,
                p.step_flops, p)
