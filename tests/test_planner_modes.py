"""``zoo.plan`` never recomputes more than one of the model's own checkpoint modes that fits the
same budget (issue 14, item 1), predicted and measured, on a small member of every family.

A mode's peak is measured (``measure_step``: one training step under ``FakeTensorMode``,
MemTracker's exact bytes and FlopCounterMode's FLOPs, byte-identical to a real CPU step as
tests/test_planner.py checks); that peak is given as the budget; the plan is applied and its step
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
from zoo.planner import measure_step


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    if family == "bert":
        model = zoo.create_model("bert_base", vocab_size=200, max_positions=64, embed_dim=64,
                                 depth=3, num_heads=2)
        return model, model.example_input(4, 32)
    model = GPT2(num_classes=200, context_length=64, embed_dim=64, depth=3, num_heads=2)
    return model, model.example_input(4, 32)


@pytest.mark.parametrize("family", ["resnet", "densenet", "cifar_cnn", "vit", "bert", "gpt2"])
def test_plan_at_a_modes_peak_recomputes_at_most_that_mode(family):
    model, x = small(family)
    plain_peak, plain_flops = measure_step(model, x)
    result = zoo.plan(model, x, plain_peak, apply=False)  # profiles the model and its modes once
    assert result.recompute_flops == 0 and result.modes
    assert {m.mode for m in result.modes} == set(model.checkpoint_modes)
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
    result = zoo.plan(model, x, float("inf"), apply=False)
    least_chain = result.smallest_peak
    modes = zoo.planner.profile_modes(model, x, result.step_flops)
    lowest = min(modes, key=lambda m: m.peak)
    assert lowest.peak < least_chain
    chosen = zoo.plan(model, x, lowest.peak)
    assert chosen.mode == lowest.mode and model.grad_checkpointing == lowest.mode
    assert model.checkpoint_plan is None
    assert measure_step(model, x)[0] == chosen.predicted_peak <= lowest.peak
    assert chosen.smallest_peak == lowest.peak and "own checkpoint mode" in str(chosen)
    with pytest.raises(zoo.planner.BudgetTooSmallError, match=f"at least {lowest.peak} bytes"):
        zoo.plan(model, x, lowest.peak - 1)
