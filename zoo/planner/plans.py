"""What ``zoo.plan`` returns for a zoo model: :class:`Plan`, a checkpoint schedule of its chain (or
one of its own hand modes) with what it is predicted to cost, printable as a table."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..checkpoint.sequential import OFFLOAD
from ..memory import format_bytes
from .search.modes import ModeCost
from .profiling.chain_profile import ChainProfile
from .search.savesets import apply_save_sets, save_sets_removed
from .modules.spine import apply_spine, spine_steps

__all__ = ["Plan", "plan_set_aside", "plan_applied", "clear_plan", "cheapest"]


@contextlib.contextmanager
def plan_set_aside(model: nn.Module) -> Iterator[None]:
    """A zoo model without the plan applied to it before (its segments, block modes and save
    sets) and without its own checkpoint mode for the duration, put back afterwards: planning
    profiles the model's plain step, which a plan left in place would change (a model planned
    at one budget, then at another), and so would the mode a reversible model was built in
    (its chain's reversible part runs in the model's mode: built with ``efficient=True`` it
    would be profiled rebuilding, its recompute counted as none)."""
    plan, modes = model.checkpoint_plan, getattr(model, "checkpoint_block_modes", None)
    own = getattr(model, "grad_checkpointing", None)
    model.checkpoint_plan = None
    if modes is not None:
        model.checkpoint_block_modes = None
    if own is not None:
        model.set_grad_checkpointing(False)
    try:
        with save_sets_removed(model, model.checkpoint_chain()):
            yield
    finally:
        model.checkpoint_plan = plan
        if modes is not None:
            model.checkpoint_block_modes = modes
        if own is not None:
            model.set_grad_checkpointing(own)


@contextlib.contextmanager
def plan_applied(model: nn.Module, plan: Any) -> Iterator[nn.Module]:
    """``model`` running ``plan`` for the duration, then as it was: a plan applied before (its
    segments, block modes, save sets) and a hand mode the caller set are put back."""
    aside = plan_set_aside(model) if plan.spine is None else contextlib.nullcontext()
    mode = getattr(model, "grad_checkpointing", None)
    with aside:
        plan.apply(model)
        try:
            yield model
        finally:
            clear_plan(model, plan)
            if mode is not None:
                model.set_grad_checkpointing(mode)


@dataclass
class Plan:
    """A checkpoint schedule for a model's chain and what the planner predicts it costs.

    ``segments`` is block-level, as ``model.set_checkpoint_plan`` takes it: ``(start, stop,
    checkpointed)`` where ``checkpointed`` is False (stored), True, or the inner plan the
    segment's recompute runs (multi-level); ``block_modes`` (one entry per block, or None) runs
    blocks in an intra-block checkpoint mode or checkpointed with a save set (a name of
    ``zoo.planner.search.savesets.SAVE_SETS``: op-level choices). When ``mode`` is set, the plan is
    that hand mode of the model (``model.set_grad_checkpointing(mode)``) and ``segments`` is
    empty. Peaks are
    bytes of one training step (forward, loss, backward; parameters and gradients included) as
    ``zoo.memory.step.measure_step`` measures them; ``overhead`` is recompute FLOPs over a plain
    step's FLOPs; ``modes``: the hand modes that were candidates, as measured; ``spine``: for a
    module without the zoo's chain, the dotted names of the submodules it was planned over
    (``zoo.planner.modules.spine``), whose calls the segments cover; ``spine_out_of_place``: its
    in-place activations run out of place (``zoo.planner.modules.spine.SpineStep``; not so in a plan
    for ``torch.compile``); ``step``: the step planned for, in words (batch, loss, optimizer,
    precision: ``zoo.planner.whole_step.describe_step``). A segment flagged ``"offload"``
    keeps its saved tensors in host memory (``zoo.checkpoint(..., offload=True)``); such a plan
    is priced on ``card`` (``zoo.planner.offload_choice``): ``offloaded_bytes`` copied to the
    host per step, ``predicted_time`` seconds a step (the compute stream's wait for the copies
    included).
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
    spine: list[str] | None = None
    spine_out_of_place: bool = True
    compiled: bool = False
    step: str = ""
    offloaded_bytes: int = 0
    predicted_time: float | None = None
    card: str | None = None

    def apply(self, model: nn.Module) -> None:
        """Make ``model`` run this plan (its chain's segments with their block modes, or its
        hand mode; a module planned over its spine runs the segments there). Segments replace
        the model's own checkpoint mode, which is turned off: the chain runs as it was profiled
        (a reversible model's blocks then store their activations, unless the plan is its hand
        mode ``"reversible"``)."""
        _watch_compile(model, None if self.compile_safe else self._compile_warning())
        if self.spine is not None:
            apply_spine(model, self.spine, self.segments, self.spine_out_of_place)
            apply_save_sets(model, spine_steps(model, self.spine, self.spine_out_of_place),
                            self.block_modes)
            return
        with_modes = hasattr(model, "set_checkpoint_block_modes")
        chain = model.checkpoint_chain()
        if self.mode is None:
            if getattr(model, "grad_checkpointing", None) is not None:
                model.set_grad_checkpointing(False)
            model.set_checkpoint_plan(self.segments)
            modes = apply_save_sets(model, chain, self.block_modes)
            if with_modes:
                model.set_checkpoint_block_modes(modes)
        else:
            model.set_checkpoint_plan(None)
            apply_save_sets(model, chain, None)
            if with_modes:
                model.set_checkpoint_block_modes(None)
            model.set_grad_checkpointing(self.mode)

    @property
    def compile_safe(self) -> bool:
        """Whether ``torch.compile`` keeps this plan's peak: planned with ``compiled=True``, or
        checkpointing nothing, or one-level segments of plain blocks of a zoo model (what
        AOTAutograd's partitioner keeps: it recomputes each tagged op once, so a nested
        schedule, a block's own checkpoints, a save set and a hand mode are not kept, and a
        spine planned for eager runs its activations out of place). On torch 2.8 only a plan
        that checkpoints nothing: its compiled regions keep each BatchNorm's output
        (``_torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES``)."""
        if self._offloads:
            return False  # offload is a no-op while torch.compile traces: the graph keeps all
        if self.mode is None and not any(self.block_modes or ()) \
                and all(ck is False for *_, ck in self.segments):
            return True
        if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:
            return False
        return self.compiled or (self.spine is None and self.mode is None and self.levels <= 1
                                 and not any(self.block_modes or ()))

    @property
    def _offloads(self) -> bool:
        return bool(self.offloaded_bytes) or any(ck == OFFLOAD for *_, ck in self.segments)

    def _compile_warning(self) -> str:
        peak = format_bytes(self.predicted_peak)
        if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES and not self._offloads:  # no plan is kept
            return (f"zoo.plan: this model runs a plan that torch {torch.__version__}'s "
                    f"compiled regions do not keep (they keep each BatchNorm's output): "
                    f"compiled, the step can peak above the predicted {peak}; on torch >= 2.9 "
                    f"plan with zoo.plan(model, x, budget, compiled=True) before compiling")
        what = f"the hand mode {self.mode!r}" if self.mode is not None else \
            "offloaded segments" if self._offloads else \
            "checkpoints nested in a recompute" if self.levels > 1 else \
            "per-block modes" if any(self.block_modes or ()) else "an eager spine"
        return (f"zoo.plan: this model runs a plan made for eager steps ({what}), which "
                f"torch.compile's partitioner does not keep: compiled, the step can peak above "
                f"the predicted {peak}; plan with "
                f"zoo.plan(model, x, budget, compiled=True) before compiling")

    @property
    def overhead(self) -> float:
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def checkpointed_blocks(self) -> list[int]:
        """Blocks inside a checkpointed segment (recomputed at least once)."""
        return [j for a, b, ck in self.segments if ck is not False and ck != OFFLOAD
                for j in range(a, b)]

    @property
    def offloaded_blocks(self) -> list[int]:
        """Blocks whose saved tensors wait in host memory (top-level ``"offload"`` segments)."""
        return [j for a, b, ck in self.segments if ck == OFFLOAD for j in range(a, b)]

    @property
    def levels(self) -> int:
        """How deep the checkpoints nest: 0 (none), 1 (one-level segments), 2, ..."""
        return _depth(self.segments)

    def _amount(self, n: int) -> str:
        return f"{n / 1e6:.2f} ms" if self.cost == "time" else _flops(n)

    def _summary(self) -> str:
        roomy = "; at or above the plain peak: nothing checkpointed" \
            if self.budget >= self.plain_peak else ""
        peak = format_bytes(self.predicted_peak)
        line = (f"budget {_budget(self.budget)}: predicted peak {peak}"
                f" (plain {format_bytes(self.plain_peak)}, smallest feasible "
                f"{format_bytes(self.smallest_peak)}{roomy})")
        if self.predicted_time is not None:
            line += (f"\non {self.card}: predicted step {1e3 * self.predicted_time:.2f} ms, "
                     f"{format_bytes(self.offloaded_bytes)} offloaded to host memory")
        return f"{self.step}\n{line}" if self.step else line

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
        moved = set(self.offloaded_blocks)
        flops = {a: p.flops[u] for u, (a, _) in enumerate(p.units)}
        for j in range(p.n_blocks):
            mode = (self.block_modes or [None] * p.n_blocks)[j] or ""
            what = "recomputed" if path[j] else "offloaded" if j in moved else "saved"
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


def cheapest(plan: Plan) -> tuple:
    """The order plans that fit a budget are taken in: least recompute, then one that
    ``torch.compile`` keeps (:attr:`Plan.compile_safe`: free, it costs no recompute), then
    the lowest peak."""
    return plan.recompute_flops, not plan.compile_safe, plan.predicted_peak


_WATCHED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _watch_compile(model: nn.Module, message: str | None) -> None:
    """Warn ``message`` the first time ``torch.compile`` traces ``model``, however the compile
    wraps it (the module, a function calling it, a whole training step): a forward pre-hook
    that reads ``torch.compiler.is_compiling()`` and calls :func:`_say`, which Dynamo runs for
    real while tracing (``_torch.run_while_tracing``: no graph break) and which says each
    message once. None: no warning (an earlier one is taken off)."""
    old = _WATCHED.pop(model, None)
    if old is not None:
        old.remove()
    if message is None:
        return
    _WATCHED[model] = model.register_forward_pre_hook(_CompileCheck(message))


class _CompileCheck:
    """The forward pre-hook of :func:`_watch_compile` (a class, so a pickled model keeps it)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            _say_while_tracing(self.message)


_SAID: set[str] = set()


def _say(message: str) -> bool:
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    return True


_say_while_tracing = _torch.run_while_tracing(_say)


def clear_plan(model: nn.Module, plan: Plan) -> None:
    """Undo ``plan.apply(model)`` (any plan of the same planning): the model checkpoints nothing,
    no segments, block modes, save sets or hand mode."""
    _watch_compile(model, None)
    if plan.spine is not None:
        apply_spine(model, plan.spine, None, plan.spine_out_of_place)
        apply_save_sets(model, spine_steps(model, plan.spine, plan.spine_out_of_place), None)
        return
    model.set_checkpoint_plan(None)
    apply_save_sets(model, model.checkpoint_chain(), None)
    if hasattr(model, "set_checkpoint_block_modes"):
        model.set_checkpoint_block_modes(None)
    model.set_grad_checkpointing(False)


def _depth(segments: list) -> int:
    return max((1 + (_depth(ck) if isinstance(ck, list) else 0) for *_, ck in segments
                if ck is not False and ck != OFFLOAD), default=0)


def _paths(segments: list, n: int, outer: tuple[str, ...] = ()) -> list[list[str]]:
    """For each block, the checkpointed segments around it, outermost first ("3-9")."""
    out: list[list[str]] = [[] for _ in range(n)]
    for a, b, ck in segments:
        here = (*outer, f"{a}-{b - 1}") if ck is not False and ck != OFFLOAD else outer
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
