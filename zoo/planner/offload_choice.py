"""The planner's third choice: keep, recompute or offload each part of the chain, by time on a card.

Recomputation alone stops at a floor (:attr:`Planner.least_peak`); below it, and wherever it is
faster than recomputing, a segment of the chain can keep its saved tensors in host memory
instead (``zoo.checkpoint(..., offload=True)``: exact, nothing recomputed). Whether that pays
depends on the card's host link and on the compute that hides the copies, so offload plans are
priced by the card's predicted step (:func:`zoo.memory.predict_step`: its peak with the copies
gone from the device between forward and backward, and its time with what the compute stream
waits for them, ``zoo.checkpoint.offload_cost.link_wait``). Candidates: recompute alone's
choice for the budget; each recompute plan that recomputes less, with the segments it keeps
offloaded instead; and the whole chain offloaded (what torch's ``save_on_cpu`` does, with
prefetch), its blocks plain or in the per-block modes of the least-peak recompute plan (which
recompute a block's cheap parts, such as DenseNet's concatenation and BatchNorm-ReLU, from
inputs the offload region moves). The fastest that fits wins, so a plan's predicted time is
never worse than recompute alone's at the same budget, and offload is chosen only where it
pays (docs/benchmarks/offload.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..checkpoint.sequential import OFFLOAD
from ..memory.cards import Card
from ..memory.cards.step import CardStep, predict_step
from ..memory.optimizer import Optimizers
from .errors import BudgetTooSmallError
from .modules.plan_module import ModulePlan, plain_module, plan_module
from .plans import Plan, plan_applied, plan_set_aside

__all__ = ["with_offload", "offloaded", "plan_offload", "plan_module_offload",
           "largest_offload_batch", "CANDIDATES"]

#: How many of the chain's recompute plans are tried with their kept segments offloaded
#: (evenly spread over those that recompute less than recompute alone's choice).
CANDIDATES = 12


def offloaded(plan: Plan) -> Plan:
    """``plan`` with every segment it keeps (top level, not checkpointed) offloaded instead."""
    segments = [(a, b, OFFLOAD if ck is False else ck) for a, b, ck in plan.segments]
    return dataclasses.replace(plan, segments=segments, mode=None)


def _spread(plans: Sequence[Plan], n: int) -> list[Plan]:
    if len(plans) <= n:
        return list(plans)
    step = (len(plans) - 1) / (n - 1)
    return [plans[round(i * step)] for i in range(n)]


def _price(model: nn.Module, batch: Any, plan: Plan, on: Card,
           loss_fn: Callable[[Any], torch.Tensor] | None,
           optimizer: Optimizers) -> CardStep:
    """The card's predicted step of ``model`` running ``plan`` (the model is left as it was)."""
    with plan_applied(model, plan):
        return predict_step(model, batch, on, loss_fn, optimizer=optimizer)


def with_offload(model: nn.Module, batch: Any, budget: float, choices: Sequence[Plan],
                 recompute: Plan | None, on: Card,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 optimizer: Optimizers = None) -> Plan:
    """The fastest plan on card ``on`` whose predicted peak fits ``budget``, among recompute
    alone's choice ``recompute`` (None: nothing recomputed fits), the chain's ``choices`` that
    recompute less with their kept segments offloaded, and the whole chain offloaded. Its
    ``predicted_peak``, ``predicted_time`` and ``offloaded_bytes`` are ``predict_step``'s for
    the planned model; :class:`BudgetTooSmallError` names the least peak of them all."""
    chain = [c for c in choices if c.mode is None]
    n = chain[-1].profile.n_blocks
    whole = [dataclasses.replace(c, segments=[(0, n, OFFLOAD)]) for c in {
        str(c.block_modes): c for c in (chain[-1], chain[0])}.values()]
    cheaper = [c for c in chain if recompute is None
               or c.recompute_flops < recompute.recompute_flops]
    candidates = [*whole, *(offloaded(c) for c in _spread(cheaper, CANDIDATES))]
    candidates.append(recompute if recompute is not None else chain[0])  # the least named
    unique: dict[tuple[str, str], Plan] = {}
    for c in candidates:  # the plain plan offloaded is the whole chain offloaded: priced once
        unique.setdefault((str(c.segments), str(c.block_modes)), c)
    priced = [(c, _price(model, batch, c, on, loss_fn, optimizer)) for c in unique.values()]
    plain = _price(model, batch, chain[-1], on, loss_fn, optimizer).peak
    least = min(step.peak for _, step in priced)
    fitting = [(c, step) for c, step in priced if step.peak <= budget]
    if not fitting:
        raise BudgetTooSmallError(budget, least, plain)
    chosen, step = min(fitting, key=lambda cs: (cs[1].time.step, cs[1].offloaded_bytes,
                                                cs[1].peak))
    return dataclasses.replace(chosen, budget=budget, predicted_peak=step.peak, plain_peak=plain,
                               smallest_peak=least, offloaded_bytes=step.offloaded_bytes,
                               predicted_time=step.time.step, card=on.name)


def plan_offload(planner: Any, model: nn.Module, batch: Any, budget: float, on: Card | None,
                 loss_fn: Callable[[Any], torch.Tensor] | None,
                 optimizer: Optimizers) -> Plan:
    """:func:`with_offload` over a :class:`~zoo.planner.choose.Planner`'s choices, with its plan
    for ``budget`` as recompute alone's (None where nothing recomputed fits)."""
    if on is None:
        raise ValueError("zoo.plan: offload=True prices copies over a card's host link; pass "
                         "device='h100' (or another card of zoo.memory.cards.CARDS)")
    try:
        recompute = planner.plan(budget)
    except BudgetTooSmallError:
        recompute = None
    return with_offload(model, batch, budget, planner.choices, recompute, on, loss_fn, optimizer)


def largest_offload_batch(model: nn.Module, make_input: Callable[[int], Any], budget: float,
                          on: Card, start: int = 1,
                          loss_fn: Callable[[Any], torch.Tensor] | None = None,
                          optimizer: Optimizers = None,
                          limit: int = 1 << 16) -> int:
    """The largest batch (at least ``start``, which must fit, and at most ``limit``) whose step
    with the whole chain offloaded fits ``budget`` on card ``on``: the floor offload reaches,
    doubled then bisected (a step's peak grows with its batch). ``zoo.plan(...,
    offload=True)`` at the answer then picks the fastest plan that fits."""
    n = len(model.checkpoint_chain())
    whole = [(0, n, OFFLOAD)]

    def fits(b: int) -> bool:
        with plan_set_aside(model):
            model.set_checkpoint_plan(whole)
            try:
                return predict_step(model, make_input(b), on, loss_fn,
                                    optimizer=optimizer).peak <= budget
            finally:
                model.set_checkpoint_plan(None)

    low, high = start, start
    while high < limit and fits(min(2 * high, limit)):
        low = high = min(2 * high, limit)
    high = min(2 * high, limit) if high < limit else limit + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def plan_module_offload(model: nn.Module, batch: Any, budget: float, on: Card,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        optimizer: Optimizers, modules: Any = None
                        ) -> ModulePlan:
    """:func:`with_offload` for a module planned over its repeated blocks
    (``modules.plan_module``: a Hugging Face encoder's layers): the fastest on card ``on`` that
    fits ``budget`` among recompute alone's plan, that plan with the blocks it runs plainly
    offloaded (recompute's least plan where nothing recomputed fits), and every block offloaded,
    each priced by ``predict_step``."""
    roomy = plan_module(model, batch, float("inf"), loss_fn, modules, optimizer)
    try:
        recompute = plan_module(model, batch, budget, loss_fn, modules, optimizer)
    except BudgetTooSmallError as e:  # recompute's least, so the least of all is named
        recompute = plan_module(model, batch, e.smallest, loss_fn, modules, optimizer)
    candidates = [dataclasses.replace(roomy, checkpointed=[], nested=[], offloaded=roomy.blocks)]
    candidates.append(recompute)
    if not recompute.nested:  # inside a checkpointed container an offload does nothing
        candidates.append(dataclasses.replace(recompute, offloaded=[
            b for b in recompute.blocks if b not in recompute.checkpointed]))
    priced = []
    for c in candidates:
        with plain_module(model):
            c.apply(model)
            priced.append((c, predict_step(model, batch, on, loss_fn, optimizer=optimizer)))
    least = min(step.peak for _, step in priced)
    fitting = [(c, step) for c, step in priced if step.peak <= budget]
    if not fitting:
        raise BudgetTooSmallError(budget, least, roomy.plain_peak)
    chosen, step = min(fitting, key=lambda cs: (cs[1].time.step, cs[1].offloaded_bytes,
                                                cs[1].peak))
    return dataclasses.replace(chosen, budget=budget, predicted_peak=step.peak,
                               smallest_peak=least, offloaded_bytes=step.offloaded_bytes,
                               predicted_time=step.time.step, card=on.name)
