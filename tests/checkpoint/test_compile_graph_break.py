"""zoo.checkpoint under torch.compile when Dynamo cannot trace a region as one subgraph.

A graph break inside a region (an unsupported call, ``torch._dynamo.graph_break()``, a
``momentum=None`` BatchNorm, whose update factor is read from a tensor) makes Dynamo run the
region's checkpoint eagerly; the region must then still update BatchNorm once per forward and
replay dropout, as the eager plain model does. Each test compiles without ``fullgraph`` and
compares three SGD steps in float64 with the eager, uncheckpointed model: outputs, gradients,
parameters and buffers, bit for bit with ``aot_eager`` (eager kernels), to rounding with inductor.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoo
from helpers import GraphRecorder, assert_same_training
from test_compile import TAG

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's compile notices


class Breaks(nn.Module):
    """The identity, with a graph break: stands for any call Dynamo cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x


class ConvBNReLU(nn.Module):
    def __init__(self, width: int, momentum: float | None, graph_break: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.brk = Breaks() if graph_break else nn.Identity()
        self.bn = nn.BatchNorm2d(width, momentum=momentum)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.brk(self.conv(x)))))


class TwoRegions(nn.Module):
    def __init__(self, checkpointed: bool, momentum: float | None, graph_break: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(ConvBNReLU(4, momentum, graph_break) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = zoo.checkpoint(block, x) if self.checkpointed else block(x)
        return x


def compiled_steps_match_eager_plain(plain: nn.Module, ckpt: nn.Module, x: torch.Tensor,
                                     backend: object) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(ckpt, backend=backend)
    assert_same_training(plain, plain, ckpt, compiled, x, steps=3, exact=backend != "inductor")


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(4, 4, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("momentum, graph_break", [(0.1, True), (None, False), (None, True)],
                         ids=["graph_break", "momentum_none", "both"])
def test_a_region_dynamo_cannot_trace_whole_updates_batchnorm_once(images, momentum, graph_break):
    torch.manual_seed(0)
    plain = TwoRegions(False, momentum, graph_break).double()
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    rec = GraphRecorder()
    compiled_steps_match_eager_plain(plain, ckpt, images, rec)
    assert [b.bn.num_batches_tracked.item() for b in ckpt.blocks] == [3, 3]
    assert rec.count("dynamo", TAG) == 0, "a region with a graph break became a subgraph"


@pytest.mark.slow
def test_a_region_with_a_graph_break_updates_batchnorm_once_with_inductor(images):
    torch.manual_seed(0)
    plain = TwoRegions(False, 0.1, True).double()
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    compiled_steps_match_eager_plain(plain, ckpt, images, "inductor")
    assert [b.bn.num_batches_tracked.item() for b in ckpt.blocks] == [3, 3]


def test_a_graph_break_inside_a_zoo_models_region_updates_batchnorm_once():
    """ResNet-20 in its ``block`` mode (each residual block one region) with a graph break in
    its first block: that region runs eagerly, the others stay subgraphs."""
    torch.manual_seed(0)
    plain = zoo.create_model("resnet20", num_classes=10).double()
    plain.layer1[0].relu = nn.Sequential(Breaks(), plain.layer1[0].relu)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing("block")
    x = plain.example_input(2).double()
    rec = GraphRecorder()
    compiled_steps_match_eager_plain(plain, ckpt, x, rec)
    assert {m.num_batches_tracked.item() for m in ckpt.modules()
            if isinstance(m, nn.BatchNorm2d)} == {3}
    assert rec.count("dynamo", TAG) > 0, "the regions without a graph break are subgraphs"
