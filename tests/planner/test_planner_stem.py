"""``zoo.plan`` on a stem: every module of a spine is a candidate region, nested inside another,
with an in-place activation of the spine run out of place so that the planner may cut at it.

torchvision's ResNet-18 at 112 px spends most of its activation memory in the stem (four maps
of 64 x 56 x 56 per sample). A region over ``conv1, bn1`` inside one over ``conv1 ... maxpool``
keeps at most three of them alive at once in backward (the ReLU's backward runs before
BatchNorm's input is made again), which takes the least plan to half the plain activations.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training, needs_plans_for_compile
from zoo.planner import measure_step
from zoo.planner.modules.spine import Spine, SpineStep

pytestmark = pytest.mark.usefixtures("one_thread")


def _param_and_grad_bytes(model: nn.Module) -> int:
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def _stem_regions(segments: list) -> list[tuple[int, int]]:
    """The checkpointed (start, stop) spans of a block-level plan, outer before inner."""
    spans = []
    for a, b, ck in segments:
        if ck is not False:
            spans.append((a, b))
            if isinstance(ck, list):
                spans += _stem_regions(ck)
    return spans


def test_resnet18_least_plan_holds_half_its_activations_as_measured():
    """torchvision ResNet-18, batch 16 at 112 px: the least plan nests ``conv1, bn1`` inside a
    region over the stem, and its measured peak (its prediction, to the byte) holds at most half
    the plain step's activations (the peak less parameters and their gradients)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(16, 3, 112, 112)
    plan = zoo.plan(model, x, zoo.plan(model, x, float("inf")).smallest_peak)
    assert plan.spine[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert (0, 4) in _stem_regions(plan.segments) and (0, 2) in _stem_regions(plan.segments)
    assert measure_step(model, x)[0] == plan.predicted_peak
    fixed = _param_and_grad_bytes(model)
    assert plan.predicted_peak - fixed <= (plan.plain_peak - fixed) / 2
    assert model.relu.inplace  # the module is left as it was made


def least_spine(planner: zoo.planner.Planner) -> list[str]:
    return planner.choices[0].spine


class Stem(nn.Module):
    """A user's net whose spine has in-place activations (and in-place dropout, which keeps its
    own kernel: its random draws are the plain step's) between BatchNorm and pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.Hardtanh(inplace=True)
        self.drop = nn.Dropout(0.2, inplace=True)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.act(self.bn(self.conv(x))))
        return self.head(self.drop(self.act2(self.conv2(x))))


def test_in_place_steps_run_out_of_place_and_train_as_plain():
    """Every plan of the spine (the least nests regions over the stem) trains bit for bit as
    the plain model: outputs, gradients, BatchNorm buffers, dropout masks."""
    torch.manual_seed(0)
    plain = Stem()
    x = torch.randn(32, 3, 16, 16)
    model = copy.deepcopy(plain)
    planner = zoo.planner.spine_planner(model, x)
    steps = {s.name: s.out_of_place
             for s in Spine(model, least_spine(planner)).checkpoint_chain()}
    assert steps["act"] and steps["act2"] and not steps["drop"] and not steps["conv"]
    least = planner.plan(planner.least_peak)
    assert least.levels >= 2
    for plan in (least, *planner.choices[::2]):
        plan.apply(model)
        assert measure_step(model, x)[0] == plan.predicted_peak
        assert_same_training(plain, plain, model, model, x, exact=True)
        model.load_state_dict(plain.state_dict())
    assert model.act.inplace and model.act2.inplace and model.drop.inplace
    step = SpineStep(model.act, "act")
    y = torch.randn(4, 8)
    out = step(y)
    assert out is not y and torch.equal(out, y.relu()) and y.min() < 0


@needs_plans_for_compile
def test_a_spine_planned_for_compile_keeps_its_in_place_steps():
    """The partitioner's way: planned with ``compiled=True``, the spine's in-place steps stay in
    place (the compiled graph is functional: nothing to run out of place)."""
    torch.manual_seed(0)
    compiled = zoo.planner.spine_planner(Stem(), torch.randn(32, 3, 16, 16), compiled=True)
    assert not any(c.spine_out_of_place for c in compiled.choices)
