"""``zoo.plan`` on any ``nn.Module``: a user's model, torchvision's ResNet-18
and a Hugging Face BERT, planned over the blocks ``zoo.blocks.find_blocks`` names, profiled under
``FakeTensorMode``, with the budget met as measured (MemTracker's exact bytes on a fake step,
which tests/planner/test_planner.py checks against a real one) and the same outputs and gradients
as the
plain model.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from zoo.blocks import is_checkpointed
from zoo.memory import default_loss
from zoo.memory.step import peak_bytes
from zoo.memory.training import train_step
from zoo.planner import BudgetTooSmallError, ModulePlan, measure_step


pytestmark = pytest.mark.usefixtures("one_thread")


class Tower(nn.Module):
    """A user's model: an ``nn.ModuleList`` of MLP blocks of uneven widths, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(h, 64))
                                    for h in (256, 64, 512, 128, 384, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def tower() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Tower(), torch.randn(64, 64)


def resnet18() -> tuple[nn.Module, torch.Tensor]:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10), torch.randn(8, 3, 32, 32)


def hf_bert() -> tuple[nn.Module, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, intermediate_size=64)
    return transformers.BertModel(config), torch.randint(0, 100, (8, 32))


@pytest.mark.parametrize("make", [tower, hf_bert], ids=["user", "hf"])
def test_any_module_is_planned_within_its_budget_as_measured(make):
    """Blocks the forward does not hand on one to the next (a residual sum between them, a loop
    passing keyword arguments): planned over those blocks, each choice measured."""
    model, x = make()
    model.train()
    roomy = zoo.plan(model, x, float("inf"))
    assert isinstance(roomy, ModulePlan) and roomy.checkpointed == []
    plain, least = roomy.plain_peak, roomy.smallest_peak
    assert least < plain and measure_step(model, x)[0] == plain
    previous = len(roomy.blocks) + 1
    for budget in (least, (least + plain) // 2, plain - 1):
        result = zoo.plan(model, x, budget)
        peak, flops = measure_step(model, x)
        assert peak == result.predicted_peak <= budget
        assert flops - roomy.step_flops == result.recompute_flops > 0
        blocks = dict(model.named_modules())
        assert [n for n in result.blocks if is_checkpointed(blocks[n])] == result.checkpointed
        assert len(result.checkpointed) <= previous
        previous = len(result.checkpointed)
    with pytest.raises(BudgetTooSmallError, match=f"at least {least} bytes"):
        zoo.plan(model, x, least - 1)


def test_a_module_with_a_spine_is_planned_over_it_exactly():
    """torchvision's ResNet-18 hands each call's output to the next (stem, blocks, pooling):
    planned over that spine, every module of it a candidate region, its predictions exact."""
    model, x = resnet18()
    model.train()
    roomy = zoo.plan(model, x, float("inf"))
    assert roomy.spine[:4] == ["conv1", "bn1", "relu", "maxpool"] and roomy.recompute_flops == 0
    plain, least = roomy.plain_peak, roomy.smallest_peak
    assert least < plain and measure_step(model, x)[0] == plain
    for budget in (least, (least + plain) // 2, plain - 1):
        result = zoo.plan(model, x, budget)
        peak, flops = measure_step(model, x)
        assert peak == result.predicted_peak <= budget
        assert flops - roomy.step_flops == result.recompute_flops
    with pytest.raises(BudgetTooSmallError, match=f"at least {least} bytes"):
        zoo.plan(model, x, least - 1)
    zoo.plan(model, x, float("inf"))
    assert not any("_zoo_spine" in m.__dict__ for m in model.modules())
    x = torch.randn(4, 3, 64, 64)  # larger maps, more plans: every third measured
    planner = zoo.planner.spine_planner(model, x)
    for plan in planner.choices[::3]:
        plan.apply(model)
        assert measure_step(model, x)[0] == plan.predicted_peak


def test_a_planned_module_trains_as_the_plain_one():
    """Outputs and every parameter's gradient equal the plain model's (dropout included)."""
    model, x = tower()
    torch.manual_seed(1)
    out = model(x)
    default_loss(out).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    result = zoo.plan(model, x, (zoo.plan(model, x, "inf").smallest_peak + 1))
    assert result.checkpointed
    torch.manual_seed(1)
    again = model(x)
    default_loss(again).backward()
    assert torch.equal(out, again)
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)


class Loop(nn.Module):
    """One block called four times (ALBERT's sharing): one module under four names."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.blocks = nn.ModuleList([block] * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_block_called_in_a_loop_is_planned_exactly_and_left_real():
    # the fake step swaps fake parameters in by name; a module under four names was swapped
    # four times, and the way out left fakes in the model for good
    torch.manual_seed(0)
    model, x = Loop(), torch.randn(128, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(BudgetTooSmallError) as info:
        zoo.plan(model, x, 1, optimizer=opt, apply=False)
    for budget in (info.value.smallest, info.value.plain):
        result = zoo.plan(model, x, budget, optimizer=opt)
        assert all(type(p) is nn.Parameter for p in model.parameters())
        step = train_step(model, x, optimizer=opt)
        step()  # the momentum buffers exist from the first step on, as the plan assumes
        assert peak_bytes(step, [model, opt]) == result.predicted_peak
    assert result.checkpointed == [] and info.value.smallest < info.value.plain


def test_every_plan_of_a_plain_mlp_is_exact():
    # a stored segment inside a region held its input through the whole segment, from the
    # caller's frame, where the plain model frees it after its first layer (a ReLU's input):
    # the least plan measured 9,002,072 B against 7,431,256 B predicted
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(2048, 64)
    planner = zoo.planner.spine_planner(model, x)
    assert len(planner.choices) == 3
    for plan in planner.choices:
        plan.apply(model)
        assert measure_step(model, x)[0] == plan.predicted_peak
