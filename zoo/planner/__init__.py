"""Checkpoint a model to a memory budget: ``zoo.planner.plan(model, x, "10GB")``.

The planner answers the user's question ("my card has 12 GB: recompute as little as possible")
instead of asking them to pick segments: it profiles the model's chain of blocks on the CPU
under ``FakeTensorMode`` (:mod:`.profile`), finds by dynamic programming the segmentation of the
chain whose predicted peak fits the budget with the fewest recomputed FLOPs (:mod:`.solve`;
rotor's optimal chain checkpointing, Beaumont et al. 2019, with one level of checkpointing),
and applies it with ``model.set_checkpoint_plan``. The model's own checkpoint modes (:mod:`.modes`:
they cut inside blocks, where a chain cannot) are measured and compete with those schedules, so a
plan never recomputes more than a hand mode that fits the same budget; the chain is also profiled
with every block in each of those modes, inside checkpointed segments too (two levels).
:mod:`.batch` finds the largest batch that fits a budget (``train.py --batch_size auto``);
:mod:`.measure` measures a step without running it.

Files, each importing only those listed before it (no circles): ``fake.py`` (fake state, the
default loss), ``measure.py`` (one fake step's peak and FLOPs), ``modes.py`` (hand modes as
candidates), ``profile.py`` (what each block costs), ``solve.py`` (the memory model and the DP),
``batch.py``; this file holds the user-facing :func:`plan` and :class:`Plan`.
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
from .solve import fronts, normalise, predict_peak, recompute_flops, smallest_peak, solve

__all__ = ["plan", "Plan", "BudgetTooSmallError", "ChainProfile", "profile_chain", "solve_profile",
           "predict_peak", "recompute_flops", "smallest_peak", "uniform_segments",
           "default_loss", "largest_batch", "measure_step", "ModeCost", "profile_modes",
           "solve_measured", "ModulePlan", "plan_module", "profile_block_modes"]


@dataclass
class Plan:
    """A checkpoint schedule for a model's chain and what the planner predicts it costs.

    ``segments`` is block-level, as ``model.set_checkpoint_plan`` takes it; when ``mode`` is
    set, the plan is that hand mode of the model (``model.set_grad_checkpointing(mode)``) and
    ``segments`` is empty. Peaks are bytes of one training step (forward, loss, backward;
    parameters and gradients included) as ``zoo.memory.cpu_peak_bytes`` measures them;
    ``overhead`` is recompute FLOPs over a plain step's FLOPs; ``modes``: the hand modes that
    were candidates, as measured.
    """

    segments: list[tuple[int, int, bool]]
    budget: int | float
    predicted_peak: int
    plain_peak: int
    smallest_peak: int
    recompute_flops: int
    step_flops: int
    profile: ChainProfile
    mode: str | None = None
    modes: tuple[ModeCost, ...] = ()
    block_mode: str | None = None
    cost: str = "flops"

    def apply(self, model: nn.Module) -> None:
        """Make ``model`` run this plan (its chain's segments, each block in ``block_mode``, or
        its hand mode)."""
        if self.mode is None:
            model.set_checkpoint_plan(self.segments)
            if hasattr(model, "set_checkpoint_block_modes"):
                n = self.profile.n_blocks
                model.set_checkpoint_block_modes(None if self.block_mode is None
                                                 else [self.block_mode] * n)
        else:
            model.set_checkpoint_plan(None)
            if hasattr(model, "set_checkpoint_block_modes"):
                model.set_checkpoint_block_modes(None)
            model.set_grad_checkpointing(self.mode)

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def checkpointed_blocks(self) -> list[int]:
        return [j for a, b, ck in self.segments if ck for j in range(a, b)]

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
        unit_of = {j: u for u, (a, b) in enumerate(p.units) for j in range(a, b)}
        unit = "fwd ms" if self.cost == "time" else "fwd MFLOP"
        lines = [f"| block | name | segment | activations | kept after forward | {unit} |",
                 "|---:|---|---|---|---:|---:|"]
        for i, (a, b, ck) in enumerate(self.segments):
            kind = "checkpointed" if ck else "stored"
            for j in range(a, b):
                u = unit_of[j]
                first = p.units[u][0] == j
                if ck:
                    kept = format_bytes(p.act[u]) if j == a else "-"
                    what = "recomputed"
                else:
                    kept = format_bytes(p.saved[u] + p.act[u + 1] * p.keeps_output[u]) \
                        if first else "(same unit)"
                    what = "saved"
                seg = f"{'┌' if j == a else ('└' if j == b - 1 else '│')} {i} {kind}"
                flops = f"{p.flops[u] / 1e6:.1f}" if first else ""
                lines.append(f"| {j} | {p.block_names[j]} | {seg} | {what} | {kept} | {flops} |")
        n_ck = len(self.checkpointed_blocks)
        inner = "" if self.block_mode is None else (
            f"every block in its {self.block_mode!r} mode (inside checkpointed segments too: two "
            f"levels), +{_flops(self.profile.inner_flops)} recomputed by it")
        lines += [
            "",
            *([inner] if inner else []),
            self._summary(),
            f"{n_ck} of {p.n_blocks} blocks recomputed in {sum(c for *_, c in self.segments)} "
            f"checkpointed segments: +{self._amount(self.recompute_flops)} recomputed, "
            f"+{100 * self.overhead:.1f}% of a plain step's {self._amount(self.step_flops)}",
        ]
        return "\n".join(lines)


def _budget(n: int | float) -> str:
    return "inf (no limit)" if n == float("inf") else format_bytes(n)


def _flops(n: int) -> str:  # ns when a plan's cost is "time"
    return f"{n / 1e9:.2f} GFLOP" if n >= 1e9 else f"{n / 1e6:.1f} MFLOP"


def uniform_segments(profile: ChainProfile, segments: int) -> list[tuple[int, int, bool]]:
    """``checkpoint_sequential``'s schedule at unit level: ``segments`` balanced checkpointed
    segments covering the chain (the last one too, as ``zoo.checkpoint_sequential`` does)."""
    return [(r.start, r.stop, True) for r in split_segments(profile.n_units, segments)]


def _chain_plan(p: ChainProfile, budget: int | float, front: Any, plain: int,
                smallest: int, modes: tuple[ModeCost, ...]) -> Plan | None:
    """The cheapest schedule of profile ``p``'s chain under ``budget``, or None."""
    stored = [(0, p.n_units, False)]
    peak = predict_peak(p, stored)
    if budget >= peak:
        segments = stored
    else:
        found = solve(p, int(budget), front or fronts(p))
        if found is None:
            return None
        segments, peak = found
    return Plan(p.block_segments(normalise(segments)), budget, peak, plain, smallest,
                p.inner_flops + recompute_flops(p, segments), p.step_flops, p, None, modes,
                p.block_mode)


def solve_profile(profile: ChainProfile, memory_budget: int | float | str,
                  front: Any = None, modes: tuple[ModeCost, ...] | list[ModeCost] = (),
                  block_profiles: tuple[ChainProfile, ...] | list[ChainProfile] = ()) -> Plan:
    """The cheapest plan under ``memory_budget`` (nothing applied): over the schedules of
    ``profile``'s chain (``front``: its :func:`fronts`, if already computed), of the chain with
    every block in one intra-block mode (``block_profiles``: :func:`profile_chain` with
    ``block_mode``), and the measured hand ``modes``. Ties go to the lower peak."""
    budget = parse_budget(memory_budget)
    p, modes = profile, tuple(modes)
    front = front or fronts(p)
    plain = predict_peak(p, [(0, p.n_units, False)])
    smallest = min([smallest_peak(p, front), *(smallest_peak(q) for q in block_profiles),
                    *(m.peak for m in modes)])
    if budget >= plain:
        return Plan(p.block_segments([(0, p.n_units, False)]), budget, plain, plain, smallest, 0,
                    p.step_flops, p, None, modes)
    candidates = [_chain_plan(p, budget, front, plain, smallest, modes)]
    candidates += [_chain_plan(q, budget, None, plain, smallest, modes) for q in block_profiles]
    candidates += [Plan([], budget, m.peak, plain, smallest, m.recompute_flops, p.step_flops, p,
                        m.mode, modes) for m in modes if m.peak <= budget]
    fitting = [c for c in candidates if c is not None]
    if not fitting:
        raise BudgetTooSmallError(budget, smallest, plain)
    return min(fitting, key=lambda c: (c.recompute_flops, c.predicted_peak))


def plan(model: nn.Module, example_input: torch.Tensor, memory_budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, apply: bool = True,
         modes: bool = True, block_modes: bool = True,
         modules: Any = None, cost: str = "flops") -> Plan | ModulePlan:
    """Checkpoint ``model`` so one training step fits ``memory_budget`` with the least
    recompute, and return the :class:`Plan` (``print`` it for a table).

    Args:
        model: any ``nn.Module``. A zoo model is planned over its chain of blocks, its hand
            modes and their two-level combinations; any other module (torchvision, timm,
            Hugging Face, yours) over its repeated blocks (``zoo.blocks.find_blocks``: the ones
            ``zoo.set_grad_checkpointing`` takes; ``modules`` overrides them), returning a
            :class:`ModulePlan` whose peak is measured (:func:`plan_module`).
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
            "time"``; hand modes and two-level profiles are left out of that search).
        modes: measure the model's own checkpoint modes too and take one where it is the
            cheapest that fits (default True).
        block_modes: also profile the chain with every block in each of those modes (as
            per-block options, inside checkpointed segments too: two levels) and search those
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
    returned, so the budget is met as measured. The one-level model is within a percent of
    MemTracker (exact on most chains); a plan over by some bytes is searched again with that
    much less room. The two-level model is not exact yet (nested ``zoo.checkpoint`` regions
    keep their inputs through the outer forward), so a two-level plan over budget drops its
    profile. The plan reports the measured peak."""
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
        if result.block_mode is not None:
            inner = [q for q in inner if q is not result.profile]
        else:
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
    return Plan([(0, p.n_blocks, False)], float("inf"), plain, plain, smallest_peak(p), 0,
                p.step_flops, p)
