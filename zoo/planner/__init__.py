"""Checkpoint a model to a memory budget: ``zoo.planner.plan(model, x, "10GB")``.

The planner answers the user's question ("my card has 12 GB: recompute as little as possible")
instead of asking them to pick segments: it profiles the model's chain of blocks on the CPU
under ``FakeTensorMode`` (:mod:`.profile`), finds by dynamic programming the segmentation of the
chain whose predicted peak fits the budget with the fewest recomputed FLOPs (:mod:`.solve`;
rotor's optimal chain checkpointing, Beaumont et al. 2019, with one level of checkpointing),
and applies it with ``model.set_checkpoint_plan``. :mod:`.batch` finds the largest batch that fits
a budget (``train.py --batch_size auto``); :mod:`.measure` measures a step without running it.

Files: ``profile.py`` (what each block costs), ``solve.py`` (the memory model and the DP),
``batch.py``, ``measure.py``; this file holds the user-facing :func:`plan` and :class:`Plan`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..memory import format_bytes, parse_bytes
from .batch import largest_batch
from .measure import measure_step
from .profile import ChainProfile, default_loss, profile_chain
from .solve import fronts, normalise, predict_peak, recompute_flops, smallest_peak, solve

__all__ = ["plan", "Plan", "BudgetTooSmallError", "ChainProfile", "profile_chain", "solve_profile",
           "predict_peak", "recompute_flops", "smallest_peak", "uniform_segments",
           "default_loss", "largest_batch", "measure_step"]


class BudgetTooSmallError(ValueError):
    """No checkpoint schedule fits the budget; ``smallest`` is the lowest feasible budget."""

    def __init__(self, budget: int, smallest: int, plain: int) -> None:
        self.budget, self.smallest, self.plain = budget, smallest, plain
        super().__init__(
            f"memory budget {format_bytes(budget)} ({budget} bytes) is below the smallest peak "
            f"any checkpoint schedule of this model reaches on this input: "
            f"{format_bytes(smallest)} ({smallest} bytes; plain training needs "
            f"{format_bytes(plain)}). Give a budget of at least {smallest} bytes, or use a "
            f"smaller batch.")


@dataclass
class Plan:
    """A checkpoint schedule for a model's chain and what the planner predicts it costs.

    ``segments`` is block-level, as ``model.set_checkpoint_plan`` takes it. Peaks are bytes of
    one training step (forward, loss, backward; parameters and gradients included) as
    ``zoo.memory.cpu_peak_bytes`` measures them; ``overhead`` is recompute FLOPs over a plain
    step's FLOPs.
    """

    segments: list[tuple[int, int, bool]]
    budget: int
    predicted_peak: int
    plain_peak: int
    smallest_peak: int
    recompute_flops: int
    step_flops: int
    profile: ChainProfile

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def checkpointed_blocks(self) -> list[int]:
        return [j for a, b, ck in self.segments if ck for j in range(a, b)]

    def __str__(self) -> str:
        p = self.profile
        unit_of = {j: u for u, (a, b) in enumerate(p.units) for j in range(a, b)}
        lines = ["| block | name | segment | activations | kept after forward | fwd MFLOP |",
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
        roomy = "; at or above the plain peak: nothing checkpointed" \
            if self.budget >= self.plain_peak else ""
        lines += [
            "",
            f"budget {format_bytes(self.budget)}: predicted peak "
            f"{format_bytes(self.predicted_peak)}"
            f" (plain {format_bytes(self.plain_peak)}, smallest feasible "
            f"{format_bytes(self.smallest_peak)}{roomy})",
            f"{n_ck} of {p.n_blocks} blocks recomputed in {sum(c for *_, c in self.segments)} "
            f"checkpointed segments: +{_flops(self.recompute_flops)} recomputed, "
            f"+{100 * self.overhead:.1f}% of a plain step's {_flops(self.step_flops)}",
        ]
        return "\n".join(lines)


def _flops(n: int) -> str:
    return f"{n / 1e9:.2f} GFLOP" if n >= 1e9 else f"{n / 1e6:.1f} MFLOP"


def uniform_segments(profile: ChainProfile, segments: int) -> list[tuple[int, int, bool]]:
    """``checkpoint_sequential``'s schedule at unit level: ``segments`` balanced checkpointed
    segments covering the chain (the last one too, as ``zoo.checkpoint_sequential`` does)."""
    from ..checkpoint import split_segments
    return [(r.start, r.stop, True) for r in split_segments(profile.n_units, segments)]


def solve_profile(profile: ChainProfile, memory_budget: int | float | str,
                  front: Any = None) -> Plan:
    """The cheapest schedule for a profiled chain under ``memory_budget`` (nothing applied)."""
    budget = parse_bytes(memory_budget)
    p = profile
    front = front or fronts(p)
    plain_segments = [(0, p.n_units, False)]
    plain = predict_peak(p, plain_segments)
    smallest = smallest_peak(p, front)
    if budget >= plain:
        segments, peak = plain_segments, plain
    else:
        found = solve(p, budget, front)
        if found is None:
            raise BudgetTooSmallError(budget, smallest, plain)
        segments, peak = found
    return Plan(p.block_segments(normalise(segments)), budget, peak, plain, smallest,
                recompute_flops(p, segments), p.step_flops, p)


def plan(model: nn.Module, example_input: torch.Tensor, memory_budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, apply: bool = True) -> Plan:
    """Checkpoint ``model``'s chain so one training step fits ``memory_budget`` with the least
    recompute, and return the :class:`Plan` (``print`` it for a table).

    Args:
        model: a ``ZooModel`` exposing ``checkpoint_chain`` (any model of the zoo).
        example_input: one batch as training will see it (shape, dtype and device decide the
            figures; its values do not matter). Nothing is computed on it: the model is
            profiled under ``FakeTensorMode``.
        memory_budget: bytes, or a string like ``"10GB"`` / ``"12GiB"``, for one training step:
            parameters, gradients and activations (not optimizer state: leave room for it).
        loss_fn: output -> scalar loss of the step (default: mean of squares; its memory is part
            of the prediction, usually negligible).
        apply: call ``model.set_checkpoint_plan`` with the result (default True).

    A budget at or above the plain model's peak checkpoints nothing. A budget below the lowest
    peak any schedule reaches raises :class:`BudgetTooSmallError` naming that peak.
    """
    budget = parse_bytes(memory_budget)
    result = solve_profile(profile_chain(model, example_input, loss_fn), budget)
    if apply:
        model.set_checkpoint_plan(result.segments)
    return result
