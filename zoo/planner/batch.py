"""The largest batch that fits a memory budget with a planned schedule (``--batch_size auto``).

Profiling costs seconds per batch size, so the search does not profile every candidate: every
figure of a chain's profile (bytes at a boundary, bytes saved, rises, FLOPs) is affine in the
batch size for the models here (activations grow with the batch, parameters and their gradients
do not), so the profiles at batch 1 and 2 give the profile at any batch by extrapolation. The
solver (cheap) then bisects on that for the largest feasible batch, and a real profile at the
answer confirms it (stepping down while it does not fit). Chen et al. 2016 and rotor (Beaumont et
al. 2019) both present the budget -> batch question as the point of planning; this is it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..memory import parse_budget, parse_bytes
from ..memory.cards.on_card import current_card
from ..memory.inputs import Batch
from ..memory.precision import current_precision
from ..memory.optimizer import (Optimizers, check_optimizer, state_bytes, unstepped_said,
                                warn_unstepped)
from .errors import BudgetTooSmallError
from .profiling.profile import ChainProfile, profile_chain
from .choose import plan, profile_block_modes
from .search.multi_level import MAX_UNITS, least_peak
from .search.one_level import smallest_peak

__all__ = ["extrapolate", "largest_batch", "largest_feasible"]


def extrapolate(pa: ChainProfile, pb: ChainProfile, batch: int, batch_a: int = 1,
                batch_b: int = 2) -> ChainProfile:
    """The profile at ``batch`` from the profiles at ``batch_a`` (``pa``) and ``batch_b``
    (``pb``), every byte and FLOP figure on the line through the two."""
    def line(a: Any, b: Any) -> Any:
        if isinstance(a, bool) or not isinstance(a, int) or not isinstance(b, int):
            return a
        return max(0, round(a + (batch - batch_a) * (b - a) / (batch_b - batch_a)))

    fields = {}
    for f in dataclasses.fields(ChainProfile):
        a, b = getattr(pa, f.name), getattr(pb, f.name)
        if isinstance(a, list) and any(isinstance(v, int) and not isinstance(v, bool)
                                       for v in a):
            fields[f.name] = [line(x, y) for x, y in zip(a, b)]
        else:
            fields[f.name] = line(a, b)
    return ChainProfile(**fields)


def largest_feasible(fits: Callable[[int], bool], limit: int = 1 << 20) -> int:
    """The largest ``b`` in ``1..limit`` with ``fits(b)``, for ``fits`` monotone (0 if none)."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_batch(model: nn.Module, make_input: Callable[[int], Any] | Any,
                  memory_budget: int | float | str,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  limit: int = 1 << 16, tries: int = 6,
                  optimizer: Optimizers = None,
                  compiled: bool = False) -> tuple[int, ChainProfile | None]:
    """The largest batch whose best schedule fits ``memory_budget``, and its profile: the
    least peak of the schedules the planner searches (nested, with per-block modes) against
    the budget.

    ``make_input(b)`` builds an example batch of size ``b`` (a tensor, tuple or dict); or give
    one batch, which is resized along the batch dimension it is found to have
    (``zoo.memory.inputs.Batch.resized``). ``optimizer``: its state is taken off the budget,
    and where the whole step counts more than the chain (an optimizer's step, autocast, a
    card) the answer is checked by ``zoo.plan`` of that step and lowered until a plan of it fits
    (Adam's foreach step needs temporaries beside its state). ``compiled``:
    the step will run under ``torch.compile``, so only the one-level schedules
    ``zoo.plan(..., compiled=True)`` chooses from count (their floor lies above a nested
    schedule's). Extrapolates from two profiles,
    profiles the answer, and refines the line through the two closest profiles until the answer
    repeats (a peak is a maximum of affine terms: at tiny batches a constant term such as the
    parameters' gradients can hide the slope). Returns ``(0, profile at batch 1)`` when not even
    batch 1 fits. A model without the zoo's chain (torchvision, timm, Hugging Face, yours) has
    no profile to extrapolate: each candidate batch is planned whole by ``zoo.plan``
    (:func:`_planned_largest`), and the profile returned is None.
    """
    if compiled:
        _torch.require_compiled_plan()
    warn_unstepped(model, check_optimizer(optimizer, model))
    with unstepped_said():  # said once above, not at every batch planned
        return _largest_batch(model, make_input, memory_budget, loss_fn, limit, tries,
                              optimizer, compiled)


def _largest_batch(model: nn.Module, make_input: Callable[[int], Any] | Any,
                   memory_budget: int | float | str,
                   loss_fn: Callable[[Any], torch.Tensor] | None, limit: int, tries: int,
                   optimizer: Optimizers, compiled: bool) -> tuple[int, ChainProfile | None]:
    """:func:`largest_batch`, its arguments checked."""
    if not callable(make_input):
        make_input = Batch.of(make_input).resized
    memory_budget = _bytes(memory_budget, make_input)
    if not callable(getattr(model, "checkpoint_chain", None)):
        return _planned_largest(model, make_input, memory_budget, loss_fn, limit, optimizer,
                                compiled), None
    best, profile = _chain_largest(model, make_input, memory_budget, loss_fn, limit, tries,
                                   optimizer, compiled)
    if best == 0 or (optimizer is None and current_precision().dtype is None
                     and current_card() is None):  # the chain's model is the whole step
        return best, profile

    def fits(b: int) -> bool:
        return _plan_fits(model, make_input(b), memory_budget, loss_fn, optimizer, compiled)

    if fits(best):
        return best, profile
    best = largest_feasible(fits, best - 1)
    return best, _profiles(model, make_input(max(best, 1)), loss_fn, compiled)[0]


def _bytes(memory_budget: int | float | str, make_input: Callable[[int], Any]) -> int:
    """The budget in bytes as ``zoo.plan`` reads it (a fraction of the card's memory, of the
    input's GPU's), refused in one line when it is no limit."""
    card = current_card()
    budget = parse_budget(memory_budget, Batch.of(make_input(1)).device,
                          total=None if card is None else card.memory)
    if math.isinf(budget):
        raise ValueError(f"largest_batch: memory budget {memory_budget!r} sets no limit, so "
                         "every batch fits; give a size such as 10GB")
    return int(budget)


def _chain_largest(model: nn.Module, make_input: Callable[[int], Any],
                   memory_budget: int | float | str,
                   loss_fn: Callable[[Any], torch.Tensor] | None, limit: int, tries: int,
                   optimizer: Optimizers,
                   compiled: bool) -> tuple[int, ChainProfile]:
    """:func:`largest_batch` by the chain's profiles (its docstring), the optimizer's state
    off the budget."""
    budget = parse_bytes(memory_budget) - state_bytes(optimizer)  # the state is held all step

    def profiled(b: int) -> list[ChainProfile]:
        return _profiles(model, make_input(b), loss_fn, compiled)

    def feasible(ps: list[ChainProfile]) -> bool:
        return _floor(ps, compiled) <= budget

    known = {1: profiled(1)}
    if not feasible(known[1]):
        return 0, known[1][0]
    known[2] = profiled(2)
    if not feasible(known[2]):
        return 1, known[1][0]
    best = max(b for b, p in known.items() if feasible(p))
    for _ in range(tries):
        bs = sorted(known)
        ba, bb = bs[-2], bs[-1]  # the two largest batches profiled so far

        def fits(b: int, ba: int = ba, bb: int = bb) -> bool:
            return feasible(_extrapolated(known[ba], known[bb], b, ba, bb))

        guess = largest_feasible(fits, limit)
        if guess in known:
            break
        known[guess] = profiled(guess)
        if feasible(known[guess]):
            best = max(best, guess)
        else:  # too optimistic: keep the line through the largest fitting and this one
            known = {b: p for b, p in known.items() if b <= best or b == guess}
    return best, known[best][0]


def _profiles(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
              compiled: bool) -> list[ChainProfile]:
    """The chain's plain profile on ``x``, then, where the planner searches them (eager, at
    most ``MAX_UNITS`` units), its profile in each per-block mode of the same units."""
    plain = profile_chain(model, x, loss_fn)
    if compiled or plain.n_units > MAX_UNITS:
        return [plain]
    return [plain, *(q for q in profile_block_modes(model, x, loss_fn, like=plain)
                     if q.units == plain.units and q.act == plain.act)]


def _floor(profiles: list[ChainProfile], compiled: bool) -> int:
    """The least peak of the plans the planner searches over ``profiles`` (:func:`_profiles`):
    one-level schedules of plain blocks under ``torch.compile`` and beyond ``MAX_UNITS`` units,
    else nested schedules with per-block modes (the model's hand modes, measured whole, aside)."""
    plain = profiles[0]
    if compiled or plain.n_units > MAX_UNITS:
        return smallest_peak(plain)
    return least_peak(profiles)


def _extrapolated(pa: list[ChainProfile], pb: list[ChainProfile], batch: int, batch_a: int,
                  batch_b: int) -> list[ChainProfile]:
    """:func:`extrapolate` for every profile of :func:`_profiles` found at both batches."""
    at_b = {q.block_mode: q for q in pb}
    return [extrapolate(q, at_b[q.block_mode], batch, batch_a, batch_b) for q in pa
            if q.block_mode in at_b]


def _planned_largest(model: nn.Module, make_input: Callable[[int], Any],
                     memory_budget: int | float | str,
                     loss_fn: Callable[[Any], torch.Tensor] | None, limit: int,
                     optimizer: Optimizers, compiled: bool) -> int:
    """The largest batch ``zoo.plan`` fits ``memory_budget`` for a model without the zoo's
    chain: doubling, then bisection, on whether a plan of the whole step exists (its least
    peak grows with the batch); each candidate costs one planning of the model."""
    return largest_feasible(lambda b: _plan_fits(model, make_input(b), memory_budget, loss_fn,
                                                 optimizer, compiled), limit)


def _plan_fits(model: nn.Module, batch: Any, memory_budget: int | float | str,
               loss_fn: Callable[[Any], torch.Tensor] | None,
               optimizer: Optimizers, compiled: bool) -> bool:
    """Whether ``zoo.plan`` finds a plan of the whole step on ``batch`` within the budget."""
    try:
        plan(model, batch, memory_budget, loss_fn=loss_fn, apply=False, optimizer=optimizer,
             compiled=compiled)
    except BudgetTooSmallError:
        return False
    return True
