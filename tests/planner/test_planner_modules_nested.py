"""``zoo.plan`` on any module, nested: outer regions around checkpointed
blocks (a stage, a slice of a plain ``nn.Sequential``) lower the least peak below "every block
checkpointed"; they train exactly like the plain model (outputs, gradients, BatchNorm buffers
after two SGD steps, bit for bit); and a timm model is planned within its budget as measured.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zoo
from helpers import run_steps
from zoo.blocks import checkpoint_module, find_blocks, is_checkpointed
from zoo.planner import BudgetTooSmallError, measure_step
from zoo.planner.modules.nesting import SegmentedSequential, outer_candidates, set_nested

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    """A residual MLP block with BatchNorm (buffers to keep exact) and dropout (RNG)."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.GELU(),
                               nn.Dropout(0.1), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


def stages() -> tuple[nn.Module, torch.Tensor]:
    """A user's net of two stages of three blocks, activations far above its parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(Block(), Block(), Block()) for _ in range(2)),
                          nn.Linear(16, 4))
    return model, torch.randn(1024, 16)


def assert_trains_exactly(plain: nn.Module, ckpt: nn.Module, x: torch.Tensor) -> None:
    """Two SGD steps: the same outputs, gradients and final state (BatchNorm buffers), bitwise."""
    ref, got = run_steps(plain, plain, x), run_steps(ckpt, ckpt, x)
    for (out_r, g_r), (out_g, g_g) in zip(ref, got):
        assert torch.equal(out_r, out_g)
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(g_r, g_g))
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("regions", [["layer1", "layer2", "layer3", "layer4"],
                                     ["layer1[0:1]", "layer1[1:2]", "layer3", "layer4[0:2]"]],
                         ids=["stages", "slices"])
def test_nested_regions_train_exactly_as_plain(regions):
    """torchvision ResNet-18: every block checkpointed and stages (or slices) around them."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    ckpt = copy.deepcopy(plain)
    for _, block in find_blocks(ckpt):
        checkpoint_module(block)
    set_nested(ckpt, regions)
    assert is_checkpointed(ckpt.layer3) and is_checkpointed(ckpt.layer2) == ("layer2" in regions)
    assert isinstance(ckpt.layer1, SegmentedSequential) == ("layer1[0:1]" in regions)
    assert_trains_exactly(plain, ckpt, torch.randn(2, 3, 32, 32))


class LastHidden(nn.Module):
    """A Hugging Face model's ``last_hidden_state``, so it trains through ``run_steps``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).last_hidden_state


def test_a_hf_encoder_around_its_checkpointed_layers_trains_exactly_as_plain():
    """BERT's layers sit in a ModuleList looped by ``encoder``: the outer region is ``encoder``
    (keyword arguments, a ModelOutput returned, dropout inside)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=2, intermediate_size=64)
    plain = transformers.BertModel(config)
    ckpt = copy.deepcopy(plain)
    names = [n for n, _ in find_blocks(ckpt)]
    assert outer_candidates(ckpt, names) == [[["encoder"]]]
    for _, block in find_blocks(ckpt):
        checkpoint_module(block)
    set_nested(ckpt, ["encoder"])
    assert_trains_exactly(LastHidden(plain), LastHidden(ckpt), torch.randint(0, 100, (8, 32)))


def test_nesting_lowers_the_floor_and_meets_the_budget_as_measured():
    """Below every block checkpointed, outer regions are added until the measured step fits;
    below the least peak they reach, the error names that nested floor."""
    model, x = stages()
    plain = copy.deepcopy(model)
    with pytest.raises(BudgetTooSmallError) as caught:
        zoo.plan(model, x, 1, modules=[Block])
    floor = caught.value.smallest
    spine_floor = zoo.plan(model, x, float("inf"), apply=False).smallest_peak
    assert spine_floor <= floor  # its spine (every call of it a region) reaches lower
    result = zoo.plan(model, x, floor + 1, modules=[Block])
    assert floor < result.every_block_peak and f"at least {floor} bytes" in str(caught.value)
    assert result.nested and result.checkpointed == result.blocks and "nested: " in str(result)
    peak, flops = measure_step(model, x)
    assert peak == result.predicted_peak <= floor + 1
    assert flops - result.step_flops == result.recompute_flops > 0
    assert_trains_exactly(plain, model, x)
    zoo.plan(model, x, float("inf"))  # re-planning a nested model undoes its regions
    assert not any(is_checkpointed(m) or isinstance(m, SegmentedSequential)
                   for m in model.modules())


def test_a_flat_sequential_of_blocks_is_nested_in_slices():
    """The model itself a plain ``nn.Sequential`` of blocks (ViT's ``blocks``): its floor is
    reached by checkpointing slices of it around the checkpointed blocks."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(Block() for _ in range(9))), torch.randn(1024, 16)
    plain = copy.deepcopy(model)
    with pytest.raises(BudgetTooSmallError) as caught:
        zoo.plan(model, x, 1, modules=[Block])
    result = zoo.plan(model, x, caught.value.smallest, modules=[Block])
    assert result.nested and all(r.startswith("[") for r in result.nested)
    assert isinstance(model, SegmentedSequential)
    assert measure_step(model, x)[0] == result.predicted_peak < result.every_block_peak
    assert_trains_exactly(plain, model, x)
    zoo.set_grad_checkpointing(model, False)  # undoes the slices too
    assert type(model) is nn.Sequential and not any(map(is_checkpointed, model.modules()))


def test_a_timm_model_is_planned_within_its_budget_and_trains_as_plain():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    plain, x = copy.deepcopy(model), torch.randn(4, 3, 64, 64)
    roomy = zoo.plan(model, x, float("inf"))
    budget = (roomy.smallest_peak + roomy.plain_peak) // 2
    result = zoo.plan(model, x, budget)  # over its spine: stem, 8 blocks, pooling, head
    assert measure_step(model, x)[0] == result.predicted_peak <= budget
    assert 0 < len(result.checkpointed_blocks) < len(result.spine)
    assert_trains_exactly(plain, model, x)
