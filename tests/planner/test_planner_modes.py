"""``zoo.plan`` never recomputes more than one of the model's own checkpoint modes that fits the
same budget, predicted and measured, on a small member of every family.

A mode's peak is measured (``measure_step``: one training step under ``FakeTensorMode``,
MemTracker's exact bytes and FlopCounterMode's FLOPs, byte-identical to a real CPU step as
tests/planner/test_planner.py checks); that peak is given as the budget; the plan is applied and
its step
measured the same way: within the budget, and its recompute (step FLOPs beyond the plain step's)
at most the mode's.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.models.densenet import DenseNet
from zoo.models.gpt2 import GPT2
from zoo.models.vit import VisionTransformer
from zoo.planner import (BudgetTooSmallError, measure_step, predict_peak, profile_block_modes,
                         profile_chain, smallest_peak, solve_profile, least_peak)


pytestmark = pytest.mark.usefixtures("one_thread")


def small(family: str) -> tuple[zoo.ZooModel, torch.Tensor]:
    """A few-block member of ``family`` and a batch for it (kept small: CPU tests)."""
    torch.manual_seed(0)
    if family == "resnet":
        model = zoo.create_model("resnet20")
        return model, model.example_input(4)
    if family == "densenet":  # DenseNet-BC (bottleneck, compression) with 3 x 3 layers
        model = DenseNet(growth_rate=12, block_config=(3, 3, 3), num_init_features=24,
                         num_classes=10, stem="cifar")
        return model, model.example_input(4)
    if family == "cifar_cnn":
        model = zoo.create_model("cifar_cnn")
        return model, model.example_input(8)
    if family == "vit":
        model = VisionTransformer(img_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=2,
                                  num_classes=10)
        return model, model.example_input(4)
    if family.startswith("bert"):
        model = zoo.create_model("bert_base", vocab_size=200, max_positions=64, embed_dim=64,
                                 depth=3, num_heads=2)
        if family.endswith("1/0 mask"):  # Hugging Face's convention, padded after 20
            mask = torch.ones(4, 32, dtype=torch.float if "float" in family else torch.long)
            mask[:, 20:] = 0
            return model, {"x": model.example_input(4, 32), "attention_mask": mask}
        return model, model.example_input(4, 32)
    model = GPT2(num_classes=200, context_length=64, embed_dim=64, depth=3, num_heads=2)
    return model, model.example_input(4, 32)


@pytest.mark.parametrize("family", ["resnet", "densenet", "cifar_cnn", "vit", "bert", "gpt2"])
def test_plan_at_a_modes_peak_recomputes_at_most_that_mode(family):
    model, x = small(family)
    plain_peak, plain_flops = measure_step(model, x)
    result = zoo.plan(model, x, plain_peak, apply=False, block_modes=False)  # profiles it once
    assert result.recompute_flops == 0 and result.modes
    assert {m.mode for m in result.modes} <= set(model.checkpoint_modes)
    for mode in result.modes:
        for budget in (mode.peak, (mode.peak + plain_peak) // 2):
            chosen = zoo.planner.solve_profile(result.profile, budget, modes=result.modes)
            assert chosen.recompute_flops <= mode.recompute_flops, (mode, budget)
            chosen.apply(model)
            peak, flops = measure_step(model, x)
            model.set_checkpoint_plan(None)
            model.set_grad_checkpointing(False)
            assert peak <= budget, (mode, budget, chosen.mode, chosen.segments)
            assert flops - plain_flops == chosen.recompute_flops <= mode.recompute_flops


def test_a_mode_below_every_chain_schedule_lowers_the_smallest_peak():
    """The CIFAR CNN's chain has two blocks; its ``halves`` mode cuts inside them and peaks below
    any schedule of whole blocks: the plan takes it there instead of refusing the budget."""
    model, x = small("cifar_cnn")
    result = zoo.plan(model, x, float("inf"), apply=False, modes=False, block_modes=False)
    least_chain = result.smallest_peak  # whole blocks only
    modes = zoo.planner.profile_modes(model, x, result.step_flops)
    lowest = min(modes, key=lambda m: m.peak)
    assert lowest.peak < least_chain
    chosen = zoo.plan(model, x, lowest.peak, block_modes=False)
    assert chosen.mode == lowest.mode and model.grad_checkpointing == lowest.mode
    assert model.checkpoint_plan is None
    assert measure_step(model, x)[0] == chosen.predicted_peak <= lowest.peak
    assert chosen.smallest_peak == lowest.peak and "own checkpoint mode" in str(chosen)
    with pytest.raises(BudgetTooSmallError, match=f"at least {lowest.peak} bytes"):
        zoo.plan(model, x, lowest.peak - 1, block_modes=False)
    model.set_grad_checkpointing(False)
    # with the modes as per-block options the chain reaches that peak too, for less
    mixed = zoo.plan(model, x, lowest.peak)
    assert measure_step(model, x)[0] == mixed.predicted_peak <= lowest.peak
    assert mixed.recompute_flops <= lowest.recompute_flops


@pytest.fixture(scope="module")
def resnet20_profiles():
    """ResNet-20, batch 8: the chain profiled plainly and with every block in each mode."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(8)
    plain = profile_chain(model, x)
    return model, x, plain, profile_block_modes(model, x)


def test_multi_level_plans_with_block_modes_are_measured_within_the_budget(resnet20_profiles):
    """Schedules nest (a checkpointed segment's recompute checkpoints again) and each block runs
    plainly or in one of the model's intra-block modes. At every budget from the lowest the
    search predicts to the plain peak, the plan's step is measured within the budget, its
    predicted peak is the measured one, and its recompute FLOPs are exact. The lowest budgets need more than one level."""
    model, x, p, inner = resnet20_profiles
    plain_peak, plain_flops = measure_step(model, x)
    assert predict_peak(p, [(0, p.n_units, False)]) == plain_peak
    lowest = least_peak([p, *inner])
    assert lowest < smallest_peak(p)  # below every one-level schedule of plain blocks
    levels = []
    for f in (0.0, 0.1, 0.3, 0.6, 0.9):
        budget = int(lowest + f * (plain_peak - lowest))
        result = solve_profile(p, budget, block_profiles=inner)
        result.apply(model)
        peak, flops = measure_step(model, x)
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(None)
        assert peak <= budget and peak == result.predicted_peak, (budget, result.segments)
        assert flops - plain_flops == result.recompute_flops, budget
        levels.append(result.levels)
    assert levels[0] >= 2 and levels == sorted(levels, reverse=True)


def test_block_modes_must_match_the_chain(resnet20_profiles):
    model = resnet20_profiles[0]
    n = len(model.checkpoint_chain())
    with pytest.raises(ValueError, match=f"{n} entries"):
        model.set_checkpoint_block_modes(["halves"] * (n - 1))
    with pytest.raises(ValueError, match="entries of None or .*halves"):
        model.set_checkpoint_block_modes(["sideways"] * n)
    assert model.checkpoint_block_modes is None


def test_nested_checkpoints_are_no_heavier_than_torchs():
    """Two checkpointed segments of four blocks, each block checkpointed again inside: the
    contract's "never heavier than torch.utils.checkpoint on the same region", nested (the
    lean region once kept inner regions' inputs through the outer forward: 21.1 vs 18.1 MiB on
    a wider chain; two-level plans rest on this)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from zoo.memory import cpu_peak_bytes, default_loss

    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
                           for _ in range(8))
    x = torch.randn(1024, 16, requires_grad=True)

    def torch_ck(fn, *args):
        return torch_checkpoint(fn, *args, use_reentrant=False)

    def peak(ck) -> int:
        def segment(h: torch.Tensor, a: int, b: int) -> torch.Tensor:
            for block in blocks[a:b]:
                h = ck(block, h)
            return h

        def step() -> None:
            default_loss(ck(segment, ck(segment, x, 0, 4), 4, 8)).backward()

        blocks.zero_grad(set_to_none=True)
        return cpu_peak_bytes(step, [blocks])

    assert peak(zoo.checkpoint) <= peak(torch_ck)
