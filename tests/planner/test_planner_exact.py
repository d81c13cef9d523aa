"""The planner's memory model is exact: on a small member of every family, every plan it offers
and random nested schedules with a block mode or a save set per block (DenseNet's
``bottleneck``, a transformer's ``selective``, ``ops:matmul`` everywhere) are predicted to the
byte and the FLOP of a measured step. And the byte counter it measures with is ``MemTracker``'s
figure.

Measured: one training step under ``FakeTensorMode`` (``zoo.planner.measure_step``, the lean
counter of ``zoo.memory.tracker``; a real CPU step counts the same bytes, checked here too).
"""
from __future__ import annotations

import random

import pytest
import torch

from test_planner_modes import small
from test_planner_nested import nested_schedules
from zoo.planner import Planner, block_plan, default_loss, measure_step
from zoo.memory.step import peak_bytes
from zoo.planner.search.multi_level import NestedModel, schedule_cost
from zoo.planner.search.savesets import apply_save_sets
from zoo.memory.tracker import StepCounter

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["resnet", "densenet", "cifar_cnn", "vit", "bert", "gpt2"]


def measured(model: torch.nn.Module, x: torch.Tensor | dict, segments: list,
             block_modes: list | None) -> tuple[int, int]:
    """A step's (peak, FLOPs) with the chain run by ``segments`` and ``block_modes`` (model
    modes, or save sets: op-level choices)."""
    chain = model.checkpoint_chain()
    model.set_checkpoint_plan(segments)
    model.set_checkpoint_block_modes(apply_save_sets(model, chain, block_modes))
    try:
        return measure_step(model, x)
    finally:
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(apply_save_sets(model, chain, None))


def random_schedule(rng: random.Random, n: int) -> list:
    """A nested schedule of ``n`` units: every one of a short chain, else random cuts with
    segments stored, checkpointed, or checkpointed with an inner region."""
    if n <= 5:
        return rng.choice(list(nested_schedules(0, n, False)))
    bounds = [0, *sorted(rng.sample(range(1, n), 3)), n]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        kind = rng.randrange(3)
        if kind == 0:
            out.append((a, b, None))
        elif kind == 1 or b - a < 2:
            out.append((a, b, [(a, b, None)]))
        else:
            c = rng.randint(a + 1, b - 1)
            out.append((a, b, [(a, c, [(a, c, None)]), (c, b, None)]))
    return out


@pytest.mark.parametrize("family", ["vit", "bert", "gpt2", "resnet"])
def test_the_finer_save_sets_are_predicted_to_the_byte_stored_and_nested(family):
    """The save set that spares a block's last linear (``ops:matmul-last``) and the
    transformers' ``selective_sublayer`` mode and, pre-norm, ``selective_mlp`` and
    ``selective_stream``, on every block, stored and inside a checkpointed segment: measured =
    predicted. The save set is offered to pre-norm blocks with
    two linear layers or more only, so a ResNet's planning profiles neither."""
    model, x = small(family)
    planner = Planner(model, x, modes=False)
    plain_flops = measure_step(model, x)[1]
    profiles = [planner.profile, *planner.variants]
    names = [q.block_mode for q in profiles]
    finer = {"ops:matmul-last", "selective_sublayer", "selective_mlp", "selective_stream"}
    if family == "bert":  # post-norm: its norms' backward needs the last linear's output
        finer = {"selective_sublayer"}
        assert not {"ops:matmul-last", "selective_mlp", "selective_stream"} & set(names)
    if family == "resnet":
        assert not finer & set(names)
        return
    assert finer <= set(names)
    m, p = NestedModel(profiles), planner.profile
    n = p.n_units
    for name in finer:
        v = names.index(name)
        for schedule in ([(0, n, None)], [(0, 1, None), (1, n, [(1, n, None)])]):
            need, cost = schedule_cost(m, schedule, [v] * n)
            if need == float("inf"):  # a selective block inside a checkpointed segment
                continue
            modes = [name for a, b in p.units for _ in range(a, b)]
            peak, flops = measured(model, x, block_plan(p, schedule), modes)
            assert (peak, flops - plain_flops) == (max(p.pre_peak, p.tail_peak, p.base + need),
                                                   cost), (name, schedule)


@pytest.mark.parametrize("family", [*FAMILIES, "bert with a 1/0 mask",
                                    "bert with a float 1/0 mask"])
def test_every_plan_and_random_schedules_are_predicted_to_the_byte(family):
    every_plan_is_exact(*small(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_plans_and_random_schedules_are_predicted_to_the_byte(family):
    """In bf16 autocast too: a zoo model casts each parameter where it uses it, without
    autocast's cache (``zoo.checkpoint.casts.casts_once``), so a checkpointed unit holds no cast
    until the forward ends and a stored one none but what its ops save."""
    model, x = small(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        every_plan_is_exact(model, x)


def every_plan_is_exact(model: torch.nn.Module, x: torch.Tensor | dict) -> None:
    """Every fifth plan the planner offers, and six random schedules, measured as predicted."""
    planner = Planner(model, x, modes=False)
    plain_flops = measure_step(model, x)[1]
    choices = planner.choices
    picks = sorted({0, len(choices) - 1, *range(0, len(choices), max(1, len(choices) // 5))})
    for i in picks:
        c = choices[i]
        peak, flops = measured(model, x, c.segments, c.block_modes)
        assert (peak, flops - plain_flops) == (c.predicted_peak, c.recompute_flops), i
    random_schedules_are_exact(model, x, planner, plain_flops, 6)


def random_schedules_are_exact(model: torch.nn.Module, x: torch.Tensor, planner: Planner,
                               plain_flops: int, count: int) -> None:
    """``count`` random nested schedules with a random variant per unit, each measured: peak and
    recompute as predicted."""
    p = planner.profile
    profiles = [p, *(q for q in planner.variants if q.units == p.units)]
    names = [q.block_mode for q in profiles]
    m, rng = NestedModel(profiles), random.Random(0)
    tried = 0
    while tried < count:
        schedule = random_schedule(rng, p.n_units)
        variants = [rng.randrange(len(profiles)) for _ in range(p.n_units)]
        need, cost = schedule_cost(m, schedule, variants)
        if need == float("inf"):  # a selective block inside a checkpointed segment
            continue
        tried += 1
        modes = [names[variants[u]] for u, (a, b) in enumerate(p.units) for _ in range(a, b)]
        peak, flops = measured(model, x, block_plan(p, schedule), modes)
        assert (peak, flops - plain_flops) == (max(p.pre_peak, p.tail_peak, p.base + need),
                                               cost), (schedule, modes)


def test_the_fake_step_counts_what_a_real_step_holds():
    model, x = small("densenet")
    planner = Planner(model, x, modes=False)
    plan = planner.choices[len(planner.choices) // 3]
    plan.apply(model)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_loss(model(x)).backward()

    model.zero_grad(set_to_none=True)
    assert peak_bytes(step, [model]) == measure_step(model, x)[0] == plan.predicted_peak


@pytest.mark.parametrize("mode", [None, "layer"])
def test_the_counter_is_memtrackers_figure_and_flop_counters(mode):
    """Without checkpoints the step counter and ``MemTracker`` agree; in a recompute that
    calls modules, ``MemTracker``'s module hooks keep the recompute's graph a little longer (a
    DenseNet ``layer``-mode step): the counter with those same hooks added agrees again. FLOPs
    are ``FlopCounterMode``'s."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils.flop_counter import FlopCounterMode

    model, x = small("densenet")
    model.set_grad_checkpointing(mode or False)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        default_loss(model(x)).backward()

    def counted(hooks: bool) -> StepCounter:
        model.zero_grad(set_to_none=True)
        counter = StepCounter()
        counter.track(model)
        with ModTracker() if hooks else torch.autograd.graph.saved_tensors_hooks(
                lambda t: t, lambda t: t), counter:
            step()
        return counter

    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    memtracker = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with FlopCounterMode(display=False) as flop_counter:
        step()
    plain, hooked = counted(False), counted(True)
    assert hooked.peak == memtracker and plain.flops == flop_counter.get_total_flops()
    assert (plain.peak == memtracker) == (mode is None)


@pytest.mark.parametrize("family", ["resnet", "densenet", "vit"])
def test_the_measured_peak_never_rises_as_the_budget_falls(family):
    """20 budgets from the plain peak down to the least peak: each plan measures within its
    budget and at or below the plan of the budget above it; its recompute never falls."""
    model, x = small(family)
    planner = Planner(model, x)
    top, least = planner.plain_peak, planner.least_peak
    last_peak, last_flops, seen = None, -1, {}
    for i in range(20):
        budget = top - (top - least) * i // 19
        plan = planner.plan(budget)
        key = (str(plan.segments), str(plan.block_modes), plan.mode)
        if key not in seen:  # a plan kept from the budget above is measured once
            plan.apply(model)
            seen[key] = measure_step(model, x)[0]
            model.set_checkpoint_plan(None)
            model.set_checkpoint_block_modes(None)
            model.set_grad_checkpointing(False)
        peak = seen[key]
        assert peak == plan.predicted_peak <= budget
        assert last_peak is None or peak <= last_peak, (i, budget)
        assert plan.recompute_flops >= last_flops
        last_peak, last_flops = peak, plan.recompute_flops


def test_a_long_chain_is_planned_nested_over_joined_units_to_the_byte(monkeypatch):
    """Past ``MAX_UNITS`` units (ResNet-1202's 602) the chain's runs of identical blocks are
    joined a few at a time; the plans, nested and with per-block modes, stay exact. Shown on
    ResNet-56 with the limit lowered to 24 units (its 29 join to 11)."""
    import zoo
    import zoo.planner.choose as planner_module

    monkeypatch.setattr(planner_module, "MAX_UNITS", 24)
    torch.manual_seed(0)
    model = zoo.create_model("resnet56")
    x = model.example_input(2)
    planner = Planner(model, x, modes=False)
    p = planner.profile
    assert p.joined and p.n_units <= 12 < len(model.checkpoint_chain())
    assert any(q.units == p.units for q in planner.variants)
    plain_flops = measure_step(model, x)[1]
    choices = planner.choices
    nested = [c for c in choices if c.levels >= 2]  # checkpoints inside a recompute
    assert nested
    for c in [nested[0], *choices[::max(1, len(choices) // 5)]]:
        peak, flops = measured(model, x, c.segments, c.block_modes)
        assert (peak, flops - plain_flops) == (c.predicted_peak, c.recompute_flops)
    random_schedules_are_exact(model, x, planner, plain_flops, 4)
