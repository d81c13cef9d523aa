"""Where a plan is chosen: :func:`plan` (``zoo.plan``), and the :class:`Planner` it asks.

:func:`plan` takes three routes: a zoo model (one with ``checkpoint_chain``) is planned over its
chain by a :class:`Planner`; any other module over its spine (:func:`spine_planner`), or, where
the spine leaves out its repeated blocks, over those (``modules.plan_module``); ``cost="time"``
plans the chain for least recompute time. A :class:`Planner` gathers every plan worth having
into one list, peak ascending and recompute strictly falling, and a budget takes the cheapest
that fits, so as the budget falls the chosen peak never rises. Predicted peaks are exact
(tests/planner/test_planner_exact.py, test_planner_promise.py)."""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..memory import parse_budget
from ..memory.inputs import Batch, check_model
from ..memory.optimizer import Optimizers, check_optimizer, unstepped, warn_unstepped
from ..memory.cards.on_card import current_card, planning_on
from ..memory.precision import Precision, current_precision, step_precision
from ..memory.training import check_accumulate, loss_used
from ..memory.cards import Card
from ..memory.fake import FakeStep, collector_paused
from .errors import BudgetTooSmallError
from .modules.plan_module import ModulePlan, plan_module
from .modules.spine import Spine, clear_spine, find_spine
from .plans import Plan, cheapest, plan_set_aside
from .profiling.profile import ChainProfile, profile_chain
from .profiling.timing import time_profile
from .search.front import Front
from .search.modes import ModeCost, profile_modes
from .search.multi_level import MAX_UNITS
from .search.one_level import predict_peak, schedules
from .search.savesets import SAVE_SETS
from ..memory.quiet import fake_logs_quiet
from .offload_choice import plan_module_offload, plan_offload
from .whole_step import WholeStep, describe_step

__all__ = ["plan", "Planner", "solve_profile", "profile_block_modes", "block_plan", "plan_choices",
           "spine_planner"]


def block_plan(p: ChainProfile, schedule: list) -> list[tuple[int, int, Any]]:
    """A unit-level nested schedule -> the block-level plan ``set_checkpoint_plan`` takes."""
    bounds = [a for a, _ in p.units] + [p.n_blocks]
    return [(bounds[a], bounds[b], False if inner is None else block_plan(p, inner))
            for a, b, inner in schedule]


def plan_choices(profile: ChainProfile, variants: Sequence[ChainProfile] = (),
                 modes: Sequence[ModeCost] = (), slots: int = 2000,
                 one_level: bool = False) -> list[Plan]:
    """Every plan worth having (budget left at ``inf``): peak ascending, recompute strictly
    falling, and the plain chain last (after a plan as cheap as it, when regions that cost no
    FLOPs, such as a BatchNorm-ReLU's, lower the peak for free). ``one_level``: one-level
    schedules of plain blocks only."""
    p = profile
    plain = predict_peak(p, [(0, p.n_units, False)])
    kinds = [p, *(q for q in variants if q.units == p.units and q.act == p.act)]
    common = dict(budget=float("inf"), plain_peak=plain, smallest_peak=0,
                  step_flops=p.step_flops, profile=p, modes=tuple(modes))
    out: list[Plan] = []
    if p.n_units <= MAX_UNITS and not one_level:
        names = [q.block_mode for q in kinds]
        for f in Front(kinds, slots=slots).plans:
            block_modes = [names[f.variants[u]] for u, (a, b) in enumerate(p.units)
                           for _ in range(a, b)]
            out.append(Plan(segments=block_plan(p, f.schedule), predicted_peak=f.peak,
                            recompute_flops=f.cost,
                            block_modes=block_modes if any(block_modes) else None, **common))
    else:
        for segments, peak, cost in schedules(p):
            out.append(Plan(segments=p.block_segments(segments), predicted_peak=peak,
                            recompute_flops=cost, **common))
    out += [Plan(segments=[], predicted_peak=m.peak, recompute_flops=m.recompute_flops,
                 mode=m.mode, **common) for m in modes]
    chosen: list[Plan] = []
    for c in sorted(out, key=lambda c: (c.predicted_peak, c.recompute_flops, c.mode or "")):
        if not chosen or c.recompute_flops < chosen[-1].recompute_flops:
            chosen.append(c)
    if chosen[-1].predicted_peak < plain:  # a free region (BatchNorm-ReLU: no FLOPs) stays
        chosen.append(Plan(segments=[(0, p.n_blocks, False)], predicted_peak=plain,
                           recompute_flops=0, **common))  # optional: plain is kept
    least = chosen[0].predicted_peak
    return [dataclasses.replace(c, smallest_peak=least) for c in chosen]


def _pick(choices: Sequence[Plan], budget: float) -> Plan:
    """The cheapest plan that fits ``budget`` (:func:`cheapest`); at or above the plain peak,
    the plain step (the last choice)."""
    fitting = [c for c in choices if c.predicted_peak <= budget]
    if not fitting:
        raise BudgetTooSmallError(budget, choices[0].predicted_peak, choices[-1].plain_peak)
    if fitting[-1] is choices[-1] and budget >= choices[-1].plain_peak:
        return dataclasses.replace(choices[-1], budget=budget)
    chosen = min(fitting, key=cheapest)
    return dataclasses.replace(chosen, budget=budget)


def solve_profile(profile: ChainProfile, memory_budget: int | float | str,
                  modes: Sequence[ModeCost] = (), block_profiles: Sequence[ChainProfile] = (),
                  slots: int = 2000) -> Plan:
    """The cheapest plan under ``memory_budget`` (nothing applied): over the multi-level
    schedules of ``profile``'s chain whose blocks each run plainly or in one of the intra-block
    modes profiled in ``block_profiles`` (:func:`profile_block_modes`), and the measured hand
    ``modes``. Ties go to the lower peak. Chains longer than ``search.multi_level.MAX_UNITS``
    units are planned one level deep."""
    return _pick(plan_choices(profile, block_profiles, modes, slots), parse_budget(memory_budget))


def profile_block_modes(model: nn.Module, example_input: torch.Tensor,
                        loss_fn: Callable[[Any], torch.Tensor] | None = None,
                        like: ChainProfile | None = None) -> list[ChainProfile]:
    """The chain profiled with every block in each of ``model.checkpoint_modes`` and each save
    set of ``zoo.planner.search.savesets`` (op-level choices); left out: a
    mode that has no per-block form (a block refuses it with a ValueError, e.g. a whole-model
    schedule) and one that checkpoints each block whole and nothing else (what a one-block
    checkpointed segment does). ``like``: the chain's plain profile (its repeated units are
    then profiled once)."""
    return _block_mode_profiles(model, example_input, loss_fn, like)[0]


def _block_mode_profiles(model: nn.Module, example_input: torch.Tensor,
                         loss_fn: Callable[[Any], torch.Tensor] | None,
                         like: ChainProfile | None, fake: FakeStep | None = None
                         ) -> tuple[list[ChainProfile], set[str]]:
    """:func:`profile_block_modes` and the modes that have a per-block form. A model's
    ``planner_hand_modes`` (a reversible model's ``reversible``: its rebuild keeps its streams,
    which the chain's memory model does not describe) are left to be measured whole."""
    profiles, per_block = [], set()
    hand_only = set(getattr(model, "planner_hand_modes", ()))
    for mode in [*getattr(model, "checkpoint_modes", ()), *SAVE_SETS]:
        if mode in hand_only:
            continue
        try:
            found = profile_chain(model, example_input, loss_fn, mode, like=like, whole=False,
                                  fake=fake, max_units=MAX_UNITS)
        except ValueError:
            continue
        per_block.add(mode)
        if found is not None:
            profiles.append(found)
    return profiles, per_block


def _unique_modes(model: nn.Module, per_block: set[str]) -> list[str]:
    """The hand modes the chain cannot express, to be measured: those without a per-block
    form (a schedule of the whole model), and every mode when a chain block that takes a mode
    is not one of the model's own modules (DenseNet's links concatenate where its hand modes
    keep lists: another computation)."""
    modes = list(getattr(model, "checkpoint_modes", ()))
    own = {id(m) for m in model.modules()}
    for block in model.checkpoint_chain():
        fn = block.func if isinstance(block, partial) else block
        owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
        target = owner.forward if isinstance(fn, nn.Module) else fn
        if "mode" in inspect.signature(target).parameters and id(owner) not in own:
            return modes
    return [m for m in modes if m not in per_block]


class Planner:
    """A zoo model's plans on ``example_input``: ``plan(budget)`` for each budget, ``choices``
    for all of them, ``least_peak`` and ``plain_peak``.

    ``modes``: measure the model's own hand modes the chain cannot express
    (:func:`_unique_modes`); ``block_modes``: profile the chain with every block in each of them,
    as per-block options at any level of a schedule; ``slots``: the nested search's memory grid.
    A chain of more than ``MAX_UNITS`` units (ResNet-1202's 602) is searched over joined units
    (``repeats.joined``: runs of identical blocks, each profiled whole, so the model stays
    exact). ``compiled``: one-level schedules of plain blocks only, what AOTAutograd's
    partitioner keeps (it recomputes each tagged op once: tests/planner/test_planner_compile.py).
    ``optimizer`` and ``accumulate``: the whole step each plan is measured as
    (``whole_step.WholeStep``: its state and step; micro-batches per optimizer step).
    Python's cyclic garbage collector is paused meanwhile (``fake.collector_paused``)."""

    def __init__(self, model: nn.Module, example_input: Any,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, *, modes: bool = True,
                 block_modes: bool = True, slots: int = 2000,
                 profile: ChainProfile | None = None, compiled: bool = False,
                 optimizer: Optimizers = None, accumulate: int = 1) -> None:
        accumulate = check_accumulate(accumulate)
        if compiled:
            _torch.require_compiled_plan()
            modes = block_modes = False
        with collector_paused(), step_precision() as precision:
            self.whole = WholeStep.of(model, example_input, loss_fn, optimizer, precision,
                                      accumulate)
            fake = FakeStep(model, example_input)
            self.profile = profile or profile_chain(model, example_input, loss_fn, fake=fake,
                                                    max_units=MAX_UNITS)
            self.variants, per_block = _block_mode_profiles(model, example_input, loss_fn,
                                                            self.profile, fake) \
                if block_modes and profile is None else ([], set())
            self.modes = profile_modes(model, example_input, self.profile.step_flops, loss_fn,
                                       _unique_modes(model, per_block), fake) if modes else []
            self.choices = [dataclasses.replace(c, compiled=compiled)
                            for c in plan_choices(self.profile, self.variants, self.modes, slots,
                                                  one_level=compiled)]

    @property
    def least_peak(self) -> int:
        """The least peak of a whole step any plan reaches."""
        if self.whole is not None:
            return self.whole.peak(self.choices[0])
        return self.choices[0].predicted_peak

    @property
    def plain_peak(self) -> int:
        """The peak of the whole step checkpointing nothing."""
        if self.whole is not None:
            return self.whole.peak(self.choices[-1])
        return self.choices[-1].plain_peak

    def plan(self, memory_budget: int | float | str) -> Plan:
        """The cheapest plan that fits ``memory_budget`` (bytes or ``"10GB"``); raises
        :class:`BudgetTooSmallError` below :attr:`least_peak`."""
        budget = parse_budget(memory_budget)
        if self.whole is None:
            return _pick(self.choices, budget)
        return self.whole.pick(self.choices, budget)


def spine_planner(model: nn.Module, example_input: Any,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  slots: int = 2000, compiled: bool = False,
                  optimizer: Optimizers = None, accumulate: int = 1
                  ) -> Planner | None:
    """A :class:`Planner` over ``model``'s spine (``modules.spine``: every submodule call of it a
    candidate region, the stem too), or None when the spine leaves out some of the repeated
    blocks ``zoo.blocks.find_blocks`` names (a Hugging Face encoder's layers, looped with keyword
    arguments): those are planned by ``modules.plan_module``. The model is profiled as it runs
    without checkpoints; it is left as it was."""
    from ..blocks import NoBlocksError, checkpoint_module, find_blocks, is_checkpointed
    from .modules.nesting import clear_nested, restore_nested

    segmented = clear_nested(model, [])
    wrapped = {m: dict(m._zoo_checkpoint_options) for m in model.modules() if is_checkpointed(m)}
    for m in wrapped:
        checkpoint_module(m, False)
    spine = {m: m.__dict__["forward"] for m in model.modules() if "_zoo_spine" in m.__dict__}
    clear_spine(model)
    try:
        names = find_spine(model, example_input)
        try:
            blocks = [n for n, _ in find_blocks(model)]
        except NoBlocksError:
            blocks = []
        covered = all(any(b == n or b.startswith(n + ".") for n in names) for b in blocks)
        if len(names) < 2 or not covered:
            return None
        planner = Planner(Spine(model, names, out_of_place=not compiled), example_input,
                          loss_fn, modes=False, slots=slots, compiled=compiled,
                          optimizer=optimizer, accumulate=accumulate)
        planner.choices = [dataclasses.replace(c, spine=list(names),
                                               spine_out_of_place=not compiled)
                           for c in planner.choices]
        return planner
    finally:
        for m, options in wrapped.items():
            checkpoint_module(m, True, **options)
        restore_nested(segmented)
        for m, forward in spine.items():
            m.forward, m._zoo_spine = forward, True


def plan(model: nn.Module, batch: Any, memory_budget: int | float | str, *,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, apply: bool = True,
         modes: bool = True, block_modes: bool = True,
         modules: Any = None, cost: str = "flops", compiled: bool = False,
         device: str | Card | None = None,
         optimizer: Optimizers = None, offload: bool = False,
         accumulate: int = 1) -> Plan | ModulePlan:
    """Checkpoint ``model`` so the training step the user runs fits ``memory_budget`` with the
    least recompute, and return the :class:`Plan` (``print`` it for a table).

    Args:
        model: any ``nn.Module``. A zoo model is planned over its chain of blocks, its hand
            modes and multi-level schedules with per-block modes; any other module (torchvision,
            timm, Hugging Face, yours) over its repeated blocks (``zoo.blocks.find_blocks``: the
            ones ``zoo.set_grad_checkpointing`` takes; ``modules`` overrides them), nested in
            containers where every block alone does not fit, returning a :class:`ModulePlan`
            whose peak is measured (:func:`plan_module`).
        batch: one batch as the model takes it and training will see it: a tensor or a
            dataclass, a tuple of positional arguments or a dict of keyword arguments (a Hugging
            Face batch with ``input_ids``, ``attention_mask``, ``labels``), tensors nested in
            them found at any depth (:class:`zoo.memory.inputs.Batch`); shapes, dtypes and
            devices decide the figures, values do not. Nothing is computed on it: the model is
            profiled under ``FakeTensorMode``.
        memory_budget: bytes, or a string like ``"10GB"`` / ``"12GiB"`` / ``"1500MB"``, for one
            whole training step: parameters, gradients, activations and, with ``optimizer``,
            its state and step. ``inf`` (or ``"inf"``) checkpoints nothing; for an input on a
            GPU or a ``device`` card, a fraction of its memory (``0.8`` or ``"80%"``).
        loss_fn: output -> scalar loss of the step. Default: the output's own ``loss`` when it
            carries one (a Hugging Face model given ``labels``), else the mean of squares; the
            plan's printout says which.
        apply: make the model run the result (default True).
        cost: ``"flops"`` (default, exact) or ``"time"``: each block's forward timed on the
            input's device (or predicted on ``device``'s card), and the chain planned for
            least recompute time (the plan's ``recompute_flops`` and ``step_flops`` are then
            nanoseconds, ``plan.cost == "time"``; hand modes and per-block modes are left out
            of that search; a module without a zoo chain is planned by FLOPs, with a warning).
        modes: measure the model's own checkpoint modes too and take one where it is the
            cheapest that fits (default True).
        block_modes: also profile the chain with every block in each of those modes and save
            sets (op-level choices: ``zoo.planner.search.savesets``), as per-block options at any
            level of the schedule, and search those schedules (default True).
        compiled: the model will run under ``torch.compile``: plan only what AOTAutograd's
            partitioner keeps (one-level schedules of plain blocks; see :class:`Planner`).
        device: plan for a CUDA card that is not here: a name of ``zoo.memory.cards.CARDS``
            (``"h100"``, ``"a100"``, ``"l4"``, ``"rtx4090"``) or a ``Card`` of your own
            numbers. Every step is measured with the card's kernels and caching allocator
            (``zoo.memory.on_card``) on the input as it is (a CPU input is fine), a fraction
            budget is of the card's memory, and ``cost="time"`` prices blocks by their
            predicted time on the card. Default: the input's own device.
        optimizer: the optimizer training will step, or a list or tuple of those it steps
            (``torch.optim.Muon`` on the hidden weight matrices beside ``AdamW`` on the rest):
            their states (AdamW: two copies of its parameters) held all step and their
            ``step()`` calls, in the given order after the backward, count in the budget and in
            ``predicted_peak`` (``zoo.planner.whole_step``). A parameter that requires grad but
            is in none of them keeps its gradient across steps (``opt.zero_grad()`` clears only
            the optimizer's own), so the plan holds it all step, as the loop does from its
            second step on, and a warning names how many there are.
        offload: also let segments keep their saved tensors in host memory instead of
            recomputing them, priced on ``device``'s card by predicted step time
            (``zoo.planner.offload_choice``: below recompute's floor, and wherever the host
            link hides the copies); the plan says ``offloaded_bytes`` and ``predicted_time``.
        accumulate: micro-batches of ``batch`` per optimizer step (gradient accumulation:
            ``loss = loss_fn(model(mb)) / accumulate; loss.backward()`` for each, then
            ``optimizer.step()``). From the second on, every gradient is held through the
            forward and backward; each plan is measured as that whole step
            (``zoo.planner.whole_step``), and the budget and ``predicted_peak`` are its.

    Inside ``torch.autocast(...)`` the plan is for that precision, as PyTorch's mixed-precision
    recipe runs it (``zoo.memory.precision``). A budget at or above the plain step's peak
    checkpoints nothing; below the lowest peak any schedule reaches, :class:`BudgetTooSmallError`
    names that peak; a wrong argument is a one-line error.
    """
    model = check_model(model)
    inputs = Batch.of(batch)
    device = device if device is not None else current_card()  # inside zoo.memory.on_card
    optimizers = check_optimizer(optimizer, model)
    warn_unstepped(model, optimizers)
    accumulate = check_accumulate(accumulate)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of the model's output returning the loss, "
                        f"got {type(loss_fn).__name__}; e.g. "
                        f"loss_fn=lambda out: F.cross_entropy(out, y)")
    if cost not in ("flops", "time"):
        raise ValueError(f"cost must be 'flops' or 'time', got {cost!r}")
    if offload and device is None:
        raise ValueError("zoo.plan: offload=True needs device= (a card whose host link prices "
                         "the copies), e.g. device='h100'")
    if offload and compiled:
        raise ValueError("zoo.plan: offload=True plans an eager step (torch.compile keeps what "
                         "it saves in its own graph); pass compiled=False or offload=False")
    if offload and accumulate > 1:
        raise ValueError("zoo.plan: offload=True prices a single step's copies; with "
                         f"accumulate={accumulate} plan with offload=False")
    if compiled:
        _torch.require_compiled_plan()
    ambient = Precision.ambient()
    with fake_logs_quiet(model, inputs):
        if device is not None:
            with planning_on(device) as target:  # CUDA's op lists, run by the CPU's autocast
                budget = parse_budget(memory_budget, total=target.memory)
                result = _plan(model, inputs, budget, loss_fn, modes, block_modes, modules,
                               cost, compiled, target, optimizer, offload, accumulate)
        else:
            with step_precision(ambient):
                budget = parse_budget(memory_budget, inputs.device)
                result = _plan(model, inputs, budget, loss_fn, modes, block_modes, modules,
                               cost, compiled, None, optimizer, accumulate=accumulate)
        precision = dataclasses.replace(ambient, device_type="cuda") \
            if device is not None and ambient.dtype is not None else ambient
        result = dataclasses.replace(result, step=describe_step(
            inputs, loss_used(), optimizer, precision, accumulate,
            len(unstepped(model, optimizers))))
    if apply:
        result.apply(model)
    return result


def _plan(model: nn.Module, example_input: Batch, budget: float,
          loss_fn: Callable[[Any], torch.Tensor] | None, modes: Any, block_modes: Any,
          modules: Any, cost: str, compiled: bool, on: Card | None,
          optimizer: Optimizers, offload: bool = False,
          accumulate: int = 1) -> Plan | ModulePlan:
    """:func:`plan`'s choice, not applied; ``on``: the card timed for ``cost="time"`` or
    offload."""
    with collector_paused():
        if hasattr(model, "checkpoint_chain") and modules is None:
            with plan_set_aside(model):  # a plan applied before is not the plain step's
                if offload:
                    planner = Planner(model, example_input, loss_fn, modes=modes,
                                      block_modes=block_modes, optimizer=optimizer)
                    return plan_offload(planner, model, example_input, budget, on, loss_fn,
                                        optimizer)
                return _plan_zoo_model(model, example_input, budget, loss_fn, cost, modes,
                                       block_modes, compiled, on, optimizer, accumulate)
        if cost == "time":  # said, not refused: the plan by FLOPs is still a correct plan
            warnings.warn(f"zoo.plan: cost='time' times a zoo model's chain of blocks; "
                          f"{type(model).__name__} has none, so it is planned by FLOPs",
                          UserWarning, stacklevel=3)
        spine = spine_planner(model, example_input, loss_fn, compiled=compiled,
                              optimizer=optimizer, accumulate=accumulate) \
            if modules is None else None
        if offload and spine is not None:
            return plan_offload(spine, model, example_input, budget, on, loss_fn, optimizer)
        if offload:
            return plan_module_offload(model, example_input, budget, on, loss_fn, optimizer,
                                       modules)
        return spine.plan(budget) if spine is not None else \
            plan_module(model, example_input, budget, loss_fn, modules, optimizer, accumulate)


def _plan_zoo_model(model: nn.Module, example_input: Batch, budget: float,
                    loss_fn: Callable[[Any], torch.Tensor] | None, cost: str, modes: Any,
                    block_modes: Any, compiled: bool, on: Card | None,
                    optimizer: Optimizers, accumulate: int = 1) -> Plan:
    """:func:`plan` for a model with the zoo's chain, with no plan applied to it."""
    whole = WholeStep.of(model, example_input, loss_fn, optimizer, current_precision(),
                         accumulate)
    if cost == "time":
        profile = time_profile(model, example_input, profile_chain(model, example_input, loss_fn),
                               loss_fn, on=on)
        choices = plan_choices(profile)
        chosen = _pick(choices, budget) if whole is None else whole.pick(choices, budget)
        return dataclasses.replace(chosen, cost="time")
    return Planner(model, example_input, loss_fn, modes=modes, block_modes=block_modes,
                   compiled=compiled, optimizer=optimizer, accumulate=accumulate).plan(budget)
