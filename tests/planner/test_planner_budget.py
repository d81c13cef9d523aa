"""Memory budgets as ``zoo.plan`` reads them, and the planner package's
imports.

Bytes or strings with units ("2GB", "2GiB", "1500MB"); ``inf`` plans no checkpointing; a fraction
of a GPU's memory is refused on a CPU input; nan, negative, zero and unreadable budgets are a
one-line ValueError that says what was expected.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo
from zoo.memory import parse_budget, parse_bytes
from zoo.planner import measure_step

PLANNER = Path(zoo.__file__).parent / "planner"


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 * 10**9), ("2GiB", 2 * 2**30), ("1500MB", 1500 * 10**6), (" 3 kib ", 3 * 2**10),
    ("1e9", 10**9), (1500, 1500), (1.5e9, 1_500_000_000), ("inf", math.inf),
    (float("inf"), math.inf), ("Infinity", math.inf)])
def test_budgets_in_bytes_and_units(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("bad", [float("nan"), "nan", -1, 0, -2.5e9, "-2GB", "0B", "ten gigs",
                                 "12 parsecs", True, None, "80%", 0.5, "150%", 1.5, "2.5B"])
def test_bad_budgets_are_one_line_value_errors(bad):
    with pytest.raises(ValueError) as info:
        parse_budget(bad)
    message = str(info.value)
    assert "\n" not in message and ("expected" in message or "give bytes" in message)
    if bad in (-1, -2.5e9, "-2GB", 0, "0B"):
        assert "must be positive" in message, message
    if bad in (1.5, "2.5B"):
        assert "not a whole number of bytes" in message, message


def test_a_memory_size_is_finite():
    """Sizes that are not budgets (train.py's --memory_budget goes through its own room for the
    optimizer state) refuse inf with the same one line."""
    with pytest.raises(ValueError, match="finite"):
        parse_bytes("inf")
    assert parse_bytes("2GiB") == 2 * 2**30


def test_fraction_of_a_gpu_on_a_cpu_input_names_the_device():
    with pytest.raises(ValueError, match="fraction of a GPU's memory.*on cpu"):
        parse_budget("80%", torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fraction_of_a_gpu():
    total = torch.cuda.get_device_properties(0).total_memory
    assert parse_budget(0.5, "cuda") == parse_budget("50%", "cuda") == int(0.5 * total)


def test_plan_with_an_infinite_budget_checkpoints_nothing():
    """``zoo.plan(model, x, float("inf"))`` plans nothing (it once raised OverflowError)."""
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn")
    x = model.example_input(4)
    plain = measure_step(model, x)
    for budget in (float("inf"), "inf"):
        result = zoo.plan(model, x, budget)
        assert result.recompute_flops == 0 and result.checkpointed_blocks == []
        assert result.predicted_peak == result.plain_peak == plain[0]
        assert measure_step(model, x) == plain
        assert "inf (no limit)" in str(result)
    model.set_checkpoint_plan(None)


@pytest.mark.parametrize("name", ["resnet20", "revnet38"])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_an_infinite_budgets_smallest_feasible_is_the_least_any_plan_reaches(name, with_optimizer):
    """The plan at ``inf`` prints the smallest feasible peak: the one a budget below it is told,
    per-block modes, hand modes (RevNet's rebuild) and the optimizer's state included."""
    model = zoo.create_model(name)
    x = model.example_input(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if with_optimizer else None
    with pytest.raises(zoo.planner.BudgetTooSmallError) as too_small:
        zoo.plan(model, x, 1, optimizer=opt, apply=False)
    roomy = zoo.plan(model, x, "inf", optimizer=opt, apply=False)
    assert roomy.smallest_peak == too_small.value.smallest < roomy.plain_peak
    assert roomy.predicted_peak == roomy.plain_peak == too_small.value.plain
    assert roomy.recompute_flops == 0 and roomy.mode is None and roomy.checkpointed_blocks == []


@pytest.mark.parametrize("bad", [float("nan"), -1, "lots"])
def test_plan_refuses_bad_budgets_before_profiling(bad):
    model = zoo.create_model("cifar_cnn")
    with pytest.raises(ValueError) as info:
        zoo.plan(model, model.example_input(2), bad)
    assert "\n" not in str(info.value)
    assert model.checkpoint_plan is None


@pytest.mark.parametrize("bad, says", [("inf", "sets no limit"), (0.8, "fraction of a GPU"),
                                       ("-2GB", "must be positive"), (1.5, "whole number")])
def test_largest_batch_reads_budgets_as_plan_does(bad, says):
    from zoo.planner import largest_batch
    model = zoo.create_model("cifar_cnn")
    for candidate in (model, nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))):
        with pytest.raises(ValueError, match=says):
            largest_batch(candidate, model.example_input(2), bad)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLANNER.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _planner_imports(path: Path) -> set[str]:
    """The zoo.planner modules ``path`` imports, relative imports resolved to dotted names."""
    here = _module_name(path).split(".")
    package = here if path.stem == "__init__" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
            if name.startswith("zoo.planner"):
                found.add(name)
    return found


def test_no_import_circle_inside_the_planner():
    """Every module of zoo/planner imports only modules that do not import it back, directly
    or through others (a fake step's measure and the profile once imported each other)."""
    graph = {_module_name(p): _planner_imports(p) for p in PLANNER.rglob("*.py")}
    assert set().union(*graph.values()) <= set(graph)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    for module in graph:
        # a package's __init__ importing its own submodules is no circle
        reached = {m for m in reach(module) if not module.startswith(m + ".")}
        assert module not in reached, f"{module} imports itself back"


def test_a_plan_is_within_its_budget_as_measured_at_the_predicted_floor():
    """The CIFAR CNN at batch 32, at the one-level floor the memory model predicts (on some
    versions 0.7% below what MemTracker measures): ``zoo.plan`` either returns a plan whose step
    is measured within it, or refuses naming a least peak it measured, at which it then plans
    within the budget as measured."""
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn")
    x = model.example_input(32)
    p = zoo.planner.profile_chain(model, x)
    budget = zoo.planner.smallest_peak(p)
    try:
        result = zoo.plan(model, x, budget, modes=False, block_modes=False)
    except zoo.planner.BudgetTooSmallError as e:
        assert e.smallest > budget and f"at least {e.smallest} bytes" in str(e)
        budget = e.smallest
        result = zoo.plan(model, x, budget, modes=False, block_modes=False)
    assert measure_step(model, x)[0] == result.predicted_peak <= budget
    model.set_checkpoint_plan(None)


@pytest.mark.slow
def test_a_planned_model_planned_again_is_planned_as_the_fresh_model():
    """A zoo model planned at one budget and then at another is profiled without the first plan
    (its segments, block modes and save sets): both plans equal those of a fresh model, and
    ``apply=False`` leaves the applied plan in place."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(4)
    fresh = zoo.create_model("resnet20")
    with pytest.raises(zoo.planner.BudgetTooSmallError) as floor:
        zoo.plan(fresh, x, 1, apply=False)
    least = zoo.plan(fresh, x, floor.value.smallest, apply=False)
    first = zoo.plan(model, x, (least.predicted_peak + least.plain_peak) // 2)
    applied = (model.checkpoint_plan, model.checkpoint_block_modes)
    again = zoo.plan(model, x, least.predicted_peak, apply=False)
    assert (model.checkpoint_plan, model.checkpoint_block_modes) == applied
    assert (again.segments, again.block_modes, again.predicted_peak) == \
        (least.segments, least.block_modes, least.predicted_peak)
    assert again.plain_peak == first.plain_peak == least.plain_peak
    zoo.plan(model, x, least.predicted_peak)
    assert measure_step(model, x)[0] == least.predicted_peak
