"""A plan keeps its promise: on every family of the zoo and on torchvision's and timm's ResNets,
at budgets from the plain peak down to the least plan in ten steps, the plan each budget picks
is applied and one real training step of it (forward, mean of squares, backward from fresh
gradients) peaks at the bytes the plan predicts (``zoo.planner.sweep``). Small sizes here; the
full sizes are ``python scripts/benchmark.py planner-promise`` (docs/planner.md).

The step is counted with no module hooks (``zoo.memory.step.peak_bytes``). ``MemTracker``'s own
module hooks hold a module's input gradients until the last one arrives, which a DenseNet layer
(fed every earlier map) makes visible: the last test shows that this, and nothing in the step,
is what ``MemTracker`` adds.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torchvision

import zoo
from test_planner_modes import small
from zoo.planner.sweep import budget_sweep, real_peak

pytestmark = pytest.mark.usefixtures("one_thread")


def zoo_model(name: str, batch: int, *shape: int, **kwargs) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = zoo.create_model(name, **kwargs)
    return model, model.example_input(batch, *shape)


def rev_vit() -> tuple[torch.nn.Module, torch.Tensor]:
    from zoo.models.rev_vit import RevVisionTransformer

    torch.manual_seed(0)
    model = RevVisionTransformer(img_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=2,
                                 num_classes=10)
    return model, model.example_input(4)


def outside(make, side: int = 32) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return make(), torch.randn(2, 3, side, side)


CASES = {  # under ~20 s each on one of two shared cores
    "cifar_cnn": lambda: small("cifar_cnn"),
    "densenet_bc": lambda: small("densenet"),
    "rev_vit_cifar": rev_vit,
    "torchvision_resnet18": lambda: outside(lambda: torchvision.models.resnet18(num_classes=10)),
    "timm_resnet18": lambda: outside(lambda: timm.create_model("resnet18", num_classes=10)),
}
SLOW = {  # 20-100 s each there
    "resnet20": lambda: zoo_model("resnet20", 4),
    "densenet40": lambda: zoo_model("densenet40", 2),
    "vit_cifar": lambda: small("vit"),
    "bert_base": lambda: small("bert"),
    "gpt2_small": lambda: small("gpt2"),
    "revnet38": lambda: zoo_model("revnet38", 2),
    "resnet56": lambda: zoo_model("resnet56", 4),
    "resnet110": lambda: zoo_model("resnet110", 2),
    "densenet_bc_100": lambda: zoo_model("densenet_bc_100", 2),
    "torchvision_resnet50": lambda: outside(lambda: torchvision.models.resnet50(num_classes=10)),
    "timm_resnet50": lambda: outside(lambda: timm.create_model("resnet50", num_classes=10)),
}


def check_sweep(case) -> None:
    """Eleven budgets (and 0.6 and 0.35 of the plain peak) planned: each plan's real step
    peaks within 0.1% of its prediction, and at or below its budget."""
    model, x = case()
    rows = budget_sweep(model, x, fractions=(0.6, 0.35), measure=real_peak)
    assert rows[0].predicted == rows[0].budget  # the plain step first, the least plan last
    assert len({r.predicted for r in rows}) >= 2
    for r in rows:
        assert abs(r.error) <= 1e-3, (r.budget, r.predicted, r.measured, r.mode, r.levels)
        assert r.measured <= r.budget * (1 + 1e-3)


@pytest.mark.parametrize("name", CASES)
def test_every_budgets_plan_peaks_where_it_predicts(name):
    check_sweep(CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_every_budgets_plan_peaks_where_it_predicts_on_every_family(name):
    check_sweep(SLOW[name])


def test_the_sweep_leaves_the_model_without_a_plan():
    model, x = small("cifar_cnn")
    plain = real_peak(model, x)
    budget_sweep(model, x, steps=2)
    assert model.checkpoint_plan is None and model.grad_checkpointing is None
    assert real_peak(model, x) == plain


def test_memtrackers_module_hooks_are_what_it_adds_to_a_dense_layers_step(monkeypatch):
    """DenseNet-40 in its ``bottleneck`` mode: ``MemTracker`` counts more than the step holds;
    the same counter under ``ModTracker`` (MemTracker's module hooks) counts as much as
    MemTracker, and without the ``"all"``-mode gradient hooks it puts on each module's inputs,
    exactly the step."""
    import torch.distributed._tools.mod_tracker as mod_tracker
    from zoo.memory import cpu_peak_bytes, train_step
    from zoo.memory.tracker import StepCounter

    model, x = zoo_model("densenet40", 2, efficient="bottleneck")
    step = train_step(model, x)

    def hooked() -> int:
        model.zero_grad(set_to_none=True)
        counter = StepCounter()
        counter.track(model)
        with mod_tracker.ModTracker(), counter:
            step()
        return counter.peak

    held = real_peak(model, x)
    model.zero_grad(set_to_none=True)
    memtracker = cpu_peak_bytes(step, [model])
    assert memtracker == hooked() > held

    every = mod_tracker.register_multi_grad_hook

    def without_all_mode(tensors, fn, mode="all"):
        return every(tensors, fn, mode=mode) if mode == "any" else _NoHandle()

    monkeypatch.setattr(mod_tracker, "register_multi_grad_hook", without_all_mode)
    assert hooked() == held


class _NoHandle:
    @staticmethod
    def remove() -> None:
        return None
