"""The planner's promise on the step a user runs: each model with AdamW and with SGD, in fp32 and
in bf16 autocast, at three budgets from the plain step's peak down to the least a plan reaches;
the plan's ``predicted_peak`` beside the real step's measured peak (forward, loss, backward,
``optimizer.step()``, on this CPU, exact bytes, without MemTracker's module hooks:
:func:`zoo.memory.step.peak_bytes`), and whether the planned model trains bit for bit like the
plain one for three optimizer steps. Beside it, the arithmetic the planner used to leave to its users ("the budget
is for parameters, gradients and activations: leave room for the optimizer"): a float32 plan
for the budget less the optimizer's state, its predicted peak plus that state, and its own
step measured the same way.

Used by ``python scripts/benchmark.py planner-step`` and by the tests on small models.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..memory.inputs import Batch
from ..memory.optimizer import state_bytes
from ..memory.step import peak_bytes
from ..memory.training import train_step
from .choose import plan
from .errors import BudgetTooSmallError
from .plans import Plan

__all__ = ["StepRow", "step_budgets", "step_rows", "real_whole_peak", "trains_like_plain"]

Optimizers = dict[str, Callable[[nn.Module], torch.optim.Optimizer]]
OPTIMIZERS: Optimizers = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
}


@dataclass
class StepRow:
    """One budget's plan of one model, optimizer and precision, measured."""

    model: str
    optimizer: str
    precision: str
    budget: int
    predicted: int
    measured: int
    exact: bool  # three optimizer steps bit for bit like plain's
    arithmetic: int = 0  # fp32 plan for the budget less the state, plus the state
    arithmetic_measured: int = 0  # that plan's real whole step

    @property
    def error(self) -> float:
        return (self.measured - self.predicted) / self.predicted


def _precision(name: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if name == "bf16" \
        else contextlib.nullcontext()


def step_budgets(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
                 precision: str) -> list[int]:
    """The plain whole step's peak, the least a plan reaches, and halfway between."""
    with _precision(precision):
        try:
            plan(model, batch, 1, optimizer=optimizer, apply=False)
        except BudgetTooSmallError as e:
            least, plain = e.smallest, e.plain
    return [plain, (plain + least) // 2, least]


def real_whole_peak(model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer,
                    precision: str) -> int:
    """Measured peak bytes of one real whole step in the steady state (the optimizer's state
    made by a step before), the model's and optimizer's tensors counted from the start."""
    with _precision(precision):
        step = train_step(model, batch, optimizer=optimizer)
    step()
    model.zero_grad(set_to_none=True)
    try:
        return peak_bytes(step, [model, optimizer])
    finally:
        model.zero_grad(set_to_none=True)


def trains_like_plain(plain: nn.Module, planned: nn.Module, batch: Any, make_opt: Callable,
                      precision: str, steps: int = 3) -> bool:
    """Whether ``planned`` (a copy of ``plain`` with a plan applied) ends ``steps`` optimizer
    steps with the same parameters and buffers as ``plain``, bit for bit."""
    for model in (plain, planned):
        torch.manual_seed(0)  # the same dropout masks for both
        opt = make_opt(model)
        with _precision(precision):
            step = train_step(model, batch, optimizer=opt)
        for _ in range(steps):
            step()
    a, b = plain.state_dict(), planned.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _arithmetic(make: Callable[[], nn.Module], batch: Batch, make_opt: Callable,
                precision: str, budget: int) -> tuple[int, int]:
    """The old arithmetic's promise and what its plan's whole step measures (module docstring);
    (0, 0) where the budget less the state is below the fp32 chain's least peak."""
    torch.manual_seed(0)
    model = make().train()
    optimizer = make_opt(model)
    state = state_bytes(optimizer)
    try:
        old = plan(model, batch, budget - state)
    except BudgetTooSmallError:
        return 0, 0
    return old.predicted_peak + state, real_whole_peak(model, batch, optimizer, precision)


def step_rows(name: str, make: Callable[[], nn.Module], batch: Any,
              optimizers: Optimizers = OPTIMIZERS,
              precisions: tuple[str, ...] = ("fp32", "bf16")) -> list[StepRow]:
    """Every optimizer, precision and budget of :func:`step_budgets` for model ``make()``."""
    rows = []
    batch = Batch.of(batch)
    for opt_name, make_opt in optimizers.items():
        for precision in precisions:
            torch.manual_seed(0)
            model = make().train()
            budgets = step_budgets(model, batch, make_opt(model), precision)
            for budget in budgets:
                torch.manual_seed(0)
                plain, model = make().train(), make().train()
                model.load_state_dict(plain.state_dict())
                optimizer = make_opt(model)
                with _precision(precision):
                    chosen: Plan = plan(model, batch, budget, optimizer=optimizer)
                measured = real_whole_peak(model, batch, optimizer, precision)
                planned = copy.deepcopy(model)
                chosen.apply(planned)
                planned.load_state_dict(plain.state_dict())
                exact = trains_like_plain(plain, planned, batch, make_opt, precision)
                arithmetic, arithmetic_measured = _arithmetic(make, batch, make_opt, precision,
                                                              budget)
                rows.append(StepRow(name, opt_name, precision, budget, chosen.predicted_peak,
                                    measured, exact, arithmetic, arithmetic_measured))
    return rows
