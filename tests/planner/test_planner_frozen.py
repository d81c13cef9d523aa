"""Fine-tuning: models with frozen parameters are measured and planned like any other.

MemTracker hooks every parameter's gradient, which torch refuses on a tensor that does not
require grad; ``zoo.memory.mem_tracker`` leaves frozen parameters unhooked (they get no
gradient) and counts their bytes. A frozen stem needs no gradient, so its blocks save nothing:
the planner joins them to the first block that does. Each case: the plan's predicted peak is the
measured one (fake step and real step, byte for byte) and the planned model trains exactly like
the plain one.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training
from zoo.memory import cpu_peak_bytes
from zoo.planner import BudgetTooSmallError, default_loss, measure_step

pytestmark = pytest.mark.usefixtures("one_thread")


def freeze(model: nn.Module, keep: tuple[str, ...] = (), only: tuple[str, ...] = ("",)
           ) -> nn.Module:
    """Freeze the parameters whose name starts with one of ``only`` (all by default), except
    those starting with one of ``keep``."""
    for name, p in model.named_parameters():
        if name.startswith(only) and not (keep and name.startswith(keep)):
            p.requires_grad_(False)
    return model


def zoo_resnet(frozen: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    stem = ("conv1.", "bn1.", "layer1.0.")
    return (freeze(model, only=stem) if frozen == "stem" else freeze(model, keep=("fc.",)),
            model.example_input(2))


def torchvision_resnet(frozen: str) -> tuple[nn.Module, torch.Tensor]:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    stem = ("conv1.", "bn1.", "layer1.")
    return (freeze(model, only=stem) if frozen == "stem" else freeze(model, keep=("fc.",)),
            torch.randn(4, 3, 96, 96))


def real_peak(model: nn.Module, x: torch.Tensor) -> int:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_loss(model(x)).backward()

    model.zero_grad(set_to_none=True)
    peak = cpu_peak_bytes(step, [model])
    model.zero_grad(set_to_none=True)
    return peak


def test_the_peak_of_a_model_with_a_frozen_parameter_is_measured():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(2)
    trained = real_peak(model, x)
    model.conv1.weight.requires_grad_(False)
    frozen = real_peak(model, x)
    assert model.conv1.weight.grad is None
    assert frozen == measure_step(model, x)[0] <= trained  # the fake step measures the same


@pytest.mark.parametrize("frozen", ["stem", "backbone"])
@pytest.mark.parametrize("make", [zoo_resnet, torchvision_resnet], ids=["zoo", "torchvision"])
def test_a_frozen_model_is_planned_exactly_and_trains_as_the_plain_one(make, frozen):
    model, x = make(frozen)
    plain = copy.deepcopy(model)
    roomy = zoo.plan(model, x, float("inf"))
    least, top = roomy.smallest_peak, roomy.plain_peak
    assert top == measure_step(model, x)[0] == real_peak(model, x)
    if frozen == "backbone":  # nothing but the head needs a gradient: nothing to checkpoint
        assert least == top
    else:
        assert least < top
    budgets = sorted({least, (least + top) // 2})
    for budget in budgets:
        result = zoo.plan(model, x, budget)
        assert result.predicted_peak == measure_step(model, x)[0] == real_peak(model, x)
        assert result.predicted_peak <= budget
    assert_same_training(plain, plain, model, model, x, steps=2, exact=True)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert p.requires_grad == q.requires_grad
        assert p.requires_grad or torch.equal(p, q)


def test_a_frozen_stem_is_planned_exactly_down_to_the_least_budget():
    """A frozen stem's blocks in an intra-block mode keep their own checkpoints' inputs, which
    need no gradient, out of an enclosing region's sight: each plan still predicts its peak to
    the byte, from the least feasible budget up, and trains as the plain model does."""
    model, x = zoo_resnet("stem")
    plain = copy.deepcopy(model)
    with pytest.raises(BudgetTooSmallError) as info:
        zoo.plan(model, x, 1)
    least, top = info.value.smallest, info.value.plain
    for budget in (least, least + (top - least) // 8, least + (top - least) // 4):
        result = zoo.plan(model, x, budget)
        assert result.predicted_peak == measure_step(model, x)[0] == real_peak(model, x), budget
        assert_same_training(plain, plain, model, model, x, steps=2, exact=True)
