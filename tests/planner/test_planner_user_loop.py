"""zoo.plan against the training loop a user writes by hand: ``opt.zero_grad()``, the loss kept
in a variable for logging, ``loss.backward()``, ``opt.step()``, several steps; the plan's
predicted peak beside each steady-state step's measured bytes (this CPU, exact)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from zoo.memory.step import peak_bytes


def mlp(width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(4)],
                         nn.Linear(width, 10))


def loop_peaks(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer,
               steps: int = 3) -> list[int]:
    """Measured peak of each of ``steps`` steps after a first one (the optimizer's state made),
    the loss held until after ``opt.step()`` and read for the log there."""
    logged = []

    def step() -> None:
        opt.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        logged.append(loss.item())

    model.train()
    step()
    return [peak_bytes(step, [model, opt]) for _ in range(steps)]


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.AdamW(p, foreach=True),
                                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)],
                         ids=["adamw-foreach", "sgd-momentum"])
def test_a_loss_held_through_the_optimizers_step_is_in_the_predicted_peak(make_opt):
    # a batch of 2: the optimizer's step, with the loss still held, is the step's peak
    model = mlp()
    opt = make_opt(model.parameters())
    x = torch.randn(2, 64)
    plan = zoo.plan(model, x, "inf", optimizer=opt)
    assert loop_peaks(model, x, opt) == [plan.predicted_peak] * 3


class WithUnused(nn.Module):
    """A classifier with a module its forward never calls (a pooler a head skips): a real
    optimizer never makes state for its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.unused = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("make_opt", [torch.optim.AdamW, torch.optim.Adagrad],
                         ids=["adamw", "adagrad-state-from-its-constructor"])
def test_a_parameter_the_forward_never_reaches_holds_no_optimizer_state(make_opt):
    model = WithUnused()
    opt = make_opt(model.parameters())
    x = torch.randn(64, 64)
    plan = zoo.plan(model, x, "inf", optimizer=opt)
    assert loop_peaks(model, x, opt) == [plan.predicted_peak] * 3
    with pytest.raises(zoo.planner.BudgetTooSmallError) as e:
        zoo.plan(model, x, 1, optimizer=opt, apply=False)
    assert e.value.plain == plan.predicted_peak


def test_predict_step_holds_no_state_for_a_parameter_the_forward_never_reaches():
    model = WithUnused()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 64)
    plan = zoo.plan(model, x, "inf", optimizer=opt, device="h100")
    without = zoo.memory.predict_step(model.body, x, "h100",
                                      optimizer=torch.optim.AdamW(model.body.parameters()))
    assert zoo.memory.predict_step(model, x, "h100", optimizer=opt).peak == plan.predicted_peak
    assert plan.predicted_peak == without.peak + 256 * 257 * 4  # the unused weights, no state



class Sliced(nn.Module):
    """A forward that slices a Sequential (``self.body[:4]``): the slice is a new instance of the
    Sequential's class, which a plan that checkpoints ``body`` has swapped."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body[:4](x).square()


def test_a_forward_slicing_a_planned_sequential_runs_and_is_planned_exactly():
    model = Sliced()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 64)
    with pytest.raises(zoo.planner.BudgetTooSmallError) as e:
        zoo.plan(model, x, 1, optimizer=opt, apply=False)
    plan = zoo.plan(model, x, e.value.smallest, optimizer=opt)
    assert loop_peaks(model, x, opt) == [plan.predicted_peak] * 3


class ModelFirst(torch.optim.SGD):
    """An optimizer whose constructor takes the model, not torch's ``params`` first."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        super().__init__(model.parameters(), lr=lr, momentum=0.9)


@pytest.mark.parametrize("make, kwargs, expected", [
    (lambda m: torch.randn(8, 64), dict(optimizer=lambda m: torch.optim.LBFGS(m.parameters())),
     "LBFGS.step needs a closure"),
    (lambda m: torch.randn(8, 64), dict(optimizer=lambda m: torch.optim.SparseAdam(
        m.parameters())), "SparseAdam steps on sparse gradients"),
    (lambda m: torch.randn(8, 64), dict(optimizer=ModelFirst),
     "ModelFirst cannot be made again over the planned copies"),
    (lambda m: torch.randn(8, 64), dict(loss_fn="cross_entropy"),
     "loss_fn must be a function of the model's output"),
    (lambda m: torch.randn(8, 64, device="meta"), {}, "are not on one device"),
], ids=["lbfgs", "sparse-adam", "optimizer-taking-the-model", "loss-fn-a-string",
        "batch-on-another-device"])
def test_a_step_planning_cannot_take_is_one_line(make, kwargs, expected):
    model = mlp()
    kwargs = {k: v(model) if k == "optimizer" else v for k, v in kwargs.items()}
    with pytest.raises((TypeError, ValueError)) as e:
        zoo.plan(model, make(model), "inf", **kwargs)
    assert expected in str(e.value) and "\n" not in str(e.value)
