"""Plans that survive ``torch.compile``: a model planned with ``compiled=True`` (zoo's and an
outside one), compiled, keeps its plan: the compiled training step's peak (measured exactly
on the CPU by replaying AOTAutograd's partitioned graphs, ``zoo.memory.compiled``) is no
higher than the eager plan's measured peak, and it recomputes no more FLOPs (BatchNorm's
running statistics written in place, as inductor writes them: no slack). A nested plan
(recompute within a recompute) is flattened by the partitioner, which recomputes each tagged
op once: compiled, it holds more than planned, which is why ``compiled=True`` leaves it out,
and why a model running such a plan made without it says so at its first compiled call.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import zoo
from helpers import call_command, needs_plans_for_compile
from zoo.memory.compiled import measure_compiled
from zoo.memory.inputs import Batch
from zoo.planner import (BudgetTooSmallError, Planner, default_loss, largest_batch, measure_step,
                         spine_planner)
from zoo.train.cli import command

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_plans_for_compile]


def check_compiled(make, x: torch.Tensor, planner: Planner, fractions: tuple) -> None:
    """Plans at ``fractions`` of the way from the least to the plain peak, compiled: peak no
    higher than eager, recompute no more."""
    plain_flops = measure_step(make(), x)[1]
    least, top = planner.least_peak, planner.plain_peak
    for f in fractions:
        plan = planner.plan(int(least + f * (top - least)))
        assert plan.levels <= 1 and not plan.block_modes and plan.mode is None
        model = make()
        plan.apply(model)
        eager, eager_flops = measure_step(model, x)
        compiled = measure_compiled(model, x, 1.0, default_loss)
        assert eager == plan.predicted_peak and eager_flops - plain_flops == plan.recompute_flops
        assert compiled["peak_bytes"] <= eager, f
        assert compiled["flops"] <= eager_flops, f


def tiny_conv() -> torch.nn.Sequential:
    """conv-BN-ReLU twice, pooled into a linear head (the model of test_planner_vs_compile)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class Residual(torch.nn.Module):
    """A transformer's MLP sublayer: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.norm, self.fc1, self.act, self.fc2 = (nn.LayerNorm(32), nn.Linear(32, 64),
                                                   nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TokenMean(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def tiny_mlp() -> torch.nn.Sequential:
    """Three MLP sublayers on tokens, pooled into a linear head: no BatchNorm, so no slack."""
    torch.manual_seed(0)
    return torch.nn.Sequential(Residual(), Residual(), Residual(), TokenMean(),
                               torch.nn.Linear(32, 10))


def tiny_chain() -> torch.nn.Sequential:
    """LayerNorm-Linear-GELU-Linear twice as flat layers, then a linear head: its regions end
    in a layer norm (one output of several) or a linear layer on tokens (a reshape)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(*[m for _ in range(2) for m in (
        nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))], nn.Linear(32, 10))


@pytest.mark.parametrize("make, shape", [(tiny_conv, (4, 3, 16, 16)), (tiny_mlp, (4, 16, 32)),
                                         (tiny_chain, (4, 16, 32))],
                         ids=["conv_bn", "mlp", "chain"])
def test_every_compile_safe_plan_keeps_its_peak_and_recompute_compiled(make, shape):
    """Every plan of the compile-safe search, a region's last op followed by a layer that saves
    its output included (the partitioner recomputed it and the chain before it: measured 341,288
    B and +5.6 MFLOP compiled where eager holds 284,648 B at +0.9 MFLOP on ``tiny_conv``), and
    a region whose output is a view or one output of a layer norm (the partitioner recomputed
    the region early in backward: 143,832 B compiled where eager holds 119,256 B on
    ``tiny_chain``)."""
    torch.manual_seed(0)
    x = torch.randn(*shape)
    planner = spine_planner(make(), x, compiled=True)
    assert len(planner.choices) > 2
    for choice in planner.choices:
        model = make()
        choice.apply(model)
        eager, eager_flops = measure_step(model, x)
        compiled = measure_compiled(model, x, 1.0, default_loss)
        assert compiled["flops"] == eager_flops, choice.predicted_peak
        assert compiled["peak_bytes"] <= eager, choice.predicted_peak


def test_a_zoo_model_planned_for_compile_keeps_its_plan_compiled():
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return zoo.create_model("resnet20")

    x = make().example_input(8)
    check_compiled(make, x, Planner(make(), x, compiled=True), (0.0, 0.5))


@pytest.mark.slow  # the zoo model above keeps the contract in the fast lane
def test_an_outside_model_planned_for_compile_keeps_its_plan_compiled():
    torchvision = pytest.importorskip("torchvision")

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10).train()

    x = torch.randn(8, 3, 64, 64)
    check_compiled(make, x, spine_planner(make(), x, compiled=True), (0.0, 0.3, 0.7))


def zoo_plan_warnings(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The ``zoo.plan`` warnings of one eager call of ``model``, then two compiled calls."""
    import warnings

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # no graph break
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        compiled(x)
        compiled(x)
    return [str(w.message) for w in caught if str(w.message).startswith("zoo.plan")]


@pytest.mark.slow
def test_a_plan_compile_does_not_keep_says_so_once_at_the_first_compiled_call():
    """A nested plan made for eager steps, then compiled: one line at the first compiled call
    (none eagerly, none after), naming the fix; the plan ``compiled=True`` gives, and a plan
    that checkpoints nothing, say nothing."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(2)
    eager = Planner(model, x, modes=False, block_modes=False)
    nested = next(c for c in eager.choices if c.levels >= 2)
    assert not nested.compile_safe
    nested.apply(model)
    said = zoo_plan_warnings(model, x)
    assert len(said) == 1 and "\n" not in said[0] and "compiled=True" in said[0]
    for plan in (Planner(model, x, compiled=True).choices[0], eager.choices[-1]):
        assert plan.compile_safe
        plan.apply(model)
        assert zoo_plan_warnings(model, x) == []


def test_the_largest_batch_for_a_compiled_step_is_what_a_plan_for_compile_fits():
    """A nested schedule reaches below a one-level one, so an eager step fits a larger batch
    than a compiled one; the compiled answer is one ``compiled=True`` plans within the
    budget, and the next batch is one it does not."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = Batch.of(torch.randn(2, 3, 16, 16))
    budget = 12_000_000
    eager, _ = largest_batch(model, x.resized, budget)
    compiled, _ = largest_batch(model, x.resized, budget, compiled=True)
    assert 0 < compiled < eager
    fits = zoo.plan(model, x.resized(compiled), budget, compiled=True, apply=False)
    assert fits.compiled and fits.predicted_peak <= budget
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, x.resized(compiled + 1), budget, compiled=True, apply=False)


TINY = dict(model="resnet20", dataset="synthetic", train_size=16, test_size=8, epochs=1,
            device="cpu", compile="aot_eager")


@pytest.mark.parametrize("batch", [16, "auto"])
def test_train_compile_with_a_memory_budget_plans_the_compiled_step(capsys, tmp_path, batch):
    """train.py --compile --memory_budget: the plan is one torch.compile keeps, so the compiled
    run never warns that its plan was made for eager steps."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, out, err = call_command(command("train.py"), capsys, **TINY, batch_size=batch,
                                      memory_budget="20MB", out_dir=str(tmp_path / "run"))
    torch._dynamo.reset()
    assert code in (0, None), err
    assert "memory plan for memory_budget 19.1 MiB, the whole compiled step" in out
    assert "blocks recomputed" in out and " 0 of " not in out  # the budget checkpoints
    assert not [w for w in seen if "zoo.plan" in str(w.message)]


def test_train_compile_with_too_small_a_budget_names_the_compiled_floor(capsys, tmp_path):
    code, out, err = call_command(command("train.py"), capsys, **TINY, batch_size=16,
                                  memory_budget="1MB", out_dir=str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err
    assert "below the smallest peak any checkpoint schedule that torch.compile keeps" in err
