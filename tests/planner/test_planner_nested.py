"""Multi-level checkpoint schedules: the solver against an exhaustive search
over every nested schedule, the model against the one-level ``predict_peak`` and against
measured steps, and nested plans training exactly like the plain model."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import zoo
from test_planner import all_schedules, random_profile
from zoo.models.densenet import DenseNet
from zoo.planner import (BudgetTooSmallError, ChainProfile, least_peak, measure_step,
                         predict_peak, profile_block_modes, profile_chain, recompute_flops,
                         smallest_peak, solve_profile)
from zoo.planner.search.front import solve_nested
from zoo.planner.search.multi_level import NestedModel, schedule_cost
from zoo.planner.search.savesets import apply_save_sets, is_save_set

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- exhaustive search ----

def nested_schedules(a: int, b: int, inner: bool):
    """Every nested schedule of units ``a..b``: each unit stored, or a checkpointed segment with
    any inner schedule; inside a recompute (``inner``) the last segment is not checkpointed (its
    recompute would be the same schedule inlined: the solver leaves it out)."""
    if a == b:
        yield []
        return
    for rest in nested_schedules(a + 1, b, inner):
        yield [(a, a + 1, None), *rest]
    for c in range(a + 1, b + (0 if inner else 1)):
        for ins in list(nested_schedules(a, c, True)):
            for rest in nested_schedules(c, b, inner):
                yield [(a, c, ins), *rest]


def variant_of(p: ChainProfile, rng: random.Random) -> ChainProfile:
    """Another way to run the same blocks (an intra-block mode): less saved, more recompute."""
    n = p.n_units
    return dataclasses.replace(
        p, saved=[rng.randint(0, s) for s in p.saved],
        keeps_input=[rng.random() < 0.5 for _ in range(n)],
        fwd_rise=[rng.randint(0, 60) for _ in range(n)],
        bwd_rise=[rng.randint(0, 120) for _ in range(n)],
        recompute_flops=[rng.randint(0, f) for f in p.flops],
        unit_inner_flops=[rng.randint(0, f) for f in p.flops], block_mode="inner")


def exhaustive(profiles: list[ChainProfile]) -> list[tuple[int, int]]:
    """(peak, recompute) of every nested schedule with every choice of variant per unit."""
    m = NestedModel(profiles)
    p, n = profiles[0], profiles[0].n_units
    out = []
    for schedule in nested_schedules(0, n, False):
        for k in range(len(profiles) ** n):
            variants = [(k // len(profiles) ** u) % len(profiles) for u in range(n)]
            need, cost = schedule_cost(m, schedule, variants)
            out.append((max(p.pre_peak, p.tail_peak, p.base + need), cost))
    return out


def assert_solver_equals_exhaustive(profiles: list[ChainProfile], rng: random.Random) -> None:
    table = exhaustive(profiles)
    peaks = sorted({peak for peak, _ in table})
    assert least_peak(profiles) == peaks[0]
    for budget in rng.sample(peaks, min(12, len(peaks))) + [peaks[0] - 1, peaks[-1]]:
        best = min((cost for peak, cost in table if peak <= budget), default=None)
        found = solve_nested(profiles, budget, step=1)  # step 1: exact on integer sizes
        if best is None:
            assert found is None, budget
            continue
        schedule, variants, peak, cost = found
        need, again = schedule_cost(NestedModel(profiles), schedule, variants)
        assert cost == again == best and peak <= budget, (budget, schedule, variants)


def test_solver_equals_exhaustive_search_on_chains_of_up_to_8_blocks():
    """The cheapest recompute under each budget, and the least peak, as an exhaustive search
    over all 41,586 nested schedules of an 8-unit chain finds them (and all of 7, 6, 3, 1)."""
    rng = random.Random(1)
    for n in (1, 3, 6, 7, 8):
        assert_solver_equals_exhaustive([random_profile(rng, n)], rng)


def test_solver_equals_exhaustive_search_with_a_variant_per_unit():
    """With a second way to run each unit (an intra-block mode), chosen unit by unit."""
    rng = random.Random(2)
    for n in (2, 4, 5):
        p = random_profile(rng, n)
        assert_solver_equals_exhaustive([p, variant_of(p, rng)], rng)


def test_one_level_schedules_cost_what_predict_peak_says():
    """Nested with one level, the model is the one-level event-by-event ``predict_peak``."""
    rng = random.Random(3)
    m_of = {}
    for _ in range(40):
        p = random_profile(rng, rng.randint(1, 6))
        m_of[id(p)] = m = NestedModel([p])
        for segments in all_schedules(p.n_units):
            nested = [(a, b, [(a, b, None)] if ck else None) for a, b, ck in segments]
            need, cost = schedule_cost(m, nested, [0] * p.n_units)
            peak = max(p.pre_peak, p.tail_peak, p.base + need)
            assert peak == predict_peak(p, segments), segments
            assert cost == recompute_flops(p, segments), segments


# ---- real models ----

@pytest.fixture(scope="module")
def resnet32():
    torch.manual_seed(0)
    model = zoo.create_model("resnet32")
    x = model.example_input(4)
    return model, x, profile_chain(model, x)


def test_nested_plans_are_byte_exact_below_the_one_level_floor(resnet32):
    """Below the least peak of one-level schedules, nested plans fit; their predicted peak and
    recompute are the measured ones, byte for byte and FLOP for FLOP."""
    model, x, p = resnet32
    plain_peak, plain_flops = measure_step(model, x)
    one_level, least = smallest_peak(p), least_peak([p])
    assert least < 0.9 * one_level
    for f in (0.0, 0.3, 0.7, 1.0):
        budget = int(least + f * (one_level - least))
        plan = solve_profile(p, budget)
        assert plan.levels >= 2 and plan.predicted_peak <= budget
        plan.apply(model)
        peak, flops = measure_step(model, x)
        model.set_checkpoint_plan(None)
        assert (peak, flops - plain_flops) == (plan.predicted_peak, plan.recompute_flops), f


def test_a_densenet_nests_exactly_too():
    torch.manual_seed(0)
    model = DenseNet(growth_rate=12, block_config=(4, 4, 4), num_init_features=24,
                     num_classes=10, stem="cifar")
    x = model.example_input(4)
    p = profile_chain(model, x)
    plain_flops = measure_step(model, x)[1]
    budget = (least_peak([p]) + smallest_peak(p)) // 2
    plan = solve_profile(p, budget)
    plan.apply(model)
    peak, flops = measure_step(model, x)
    model.set_checkpoint_plan(None)
    assert plan.levels >= 2 and peak == plan.predicted_peak <= budget
    assert flops - plain_flops == plan.recompute_flops


def sgd_steps(model: torch.nn.Module, x: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        out.square().mean().backward()
        outs.append(out.detach())
        opt.step()
    return outs


def test_a_three_level_plan_with_block_modes_trains_exactly_like_plain():
    """Outputs, parameters and BatchNorm buffers after two SGD steps, float64, dropout-free."""
    torch.manual_seed(0)
    plain = zoo.create_model("resnet20").double()
    planned = zoo.create_model("resnet20").double()
    planned.load_state_dict(plain.state_dict())
    n = len(planned.checkpoint_chain())
    planned.set_checkpoint_plan([(0, 7, [(0, 5, [(0, 2, True), (2, 5, False)]), (5, 7, False)]),
                                 (7, n, [(7, 9, True), (9, n, False)])])
    planned.set_checkpoint_block_modes(["halves" if j % 3 == 1 else
                                        "bn_relu" if j % 3 == 2 else None for j in range(n)])
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    for a, b in zip(sgd_steps(plain, x), sgd_steps(planned, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for (name, a), (_, b) in zip(plain.state_dict().items(), planned.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("bad, message", [
    ([(0, 5, [(0, 4, False)]), (5, 11, False)], "covers blocks 0..4, its segment ends at 5"),
    ([(0, 5, [(1, 5, False)]), (5, 11, False)], "cover 0..5 in order"),
    ([(0, 5, False), (5, 10, True)], "the chain has 11"),
])
def test_nested_plans_that_do_not_cover_their_segment_are_refused(bad, message):
    model = zoo.create_model("resnet20")
    with pytest.raises(ValueError, match=message):
        model.set_checkpoint_plan(bad)
    assert model.checkpoint_plan is None


def test_zoo_plan_goes_below_the_one_level_floor_and_prints_the_levels(resnet32):
    model, x, p = resnet32
    least = least_peak([p])
    plan = zoo.plan(model, x, least, modes=False, block_modes=False)
    assert plan.levels >= 2 and model.checkpoint_plan == plan.segments
    assert measure_step(model, x)[0] == plan.predicted_peak <= least
    assert "levels deep" in str(plan) or "level(s) deep" in str(plan)
    model.set_checkpoint_plan(None)
    with pytest.raises(BudgetTooSmallError, match=f"at least {least} bytes"):
        zoo.plan(model, x, least - 1, modes=False, block_modes=False)


def test_block_mode_profiles_count_what_the_blocks_own_checkpoints_keep():
    """A block in ``halves`` or ``block`` mode keeps its input in its own region, out of
    autograd's sight; the profiler counts it (``zoo.checkpoint.region.observers``). A checkpointed
    segment
    followed by such a block (whose input nobody else keeps) is then predicted byte-exact, for
    every pair of modes the model offers (a save set inside a recompute is a context its profile
    never saw: infinite, never planned); all blocks stored in one mode is predicted at or above
    the measured peak (within 10%)."""
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(8)
    p = profile_chain(model, x)
    profiles = [p, *profile_block_modes(model, x)]
    names = [q.block_mode for q in profiles]
    m, n = NestedModel(profiles), p.n_units
    assert [(a, b) for a, b in p.units] == [(j, j + 1) for j in range(n)]

    def measured(schedule: list, variants: list[int]) -> int:
        model.set_checkpoint_plan([(a, b, False if i is None else [(a, b, False)])
                                   for a, b, i in schedule])
        chain = model.checkpoint_chain()  # a save set goes on the block's own module
        model.set_checkpoint_block_modes(apply_save_sets(model, chain,
                                                         [names[v] for v in variants]))
        try:
            return measure_step(model, x)[0]
        finally:
            model.set_checkpoint_plan(None)
            apply_save_sets(model, chain, None)
            model.set_checkpoint_block_modes(None)

    schedule = [(0, 3, [(0, 3, None)]), (3, n, None)]
    for v1 in range(len(profiles)):
        for v2 in range(len(profiles)):
            variants = [0, 0, v1, v2] + [0] * (n - 4)
            need = schedule_cost(m, schedule, variants)[0]
            if need == float("inf"):  # a save set inside a recompute: a context never offered
                assert is_save_set(names[v1]) or is_save_set(names[v2])
                continue
            assert p.base + need == measured(schedule, variants), (names[v1], names[v2])
    for v in range(1, len(profiles)):
        need = schedule_cost(m, [(0, n, None)], [v] * n)[0]
        peak = measured([(0, n, None)], [v] * n)
        assert peak <= p.base + need <= 1.1 * peak, names[v]


@pytest.mark.parametrize("name, mode, refused", [("vit_cifar", "block", False),
                                                 ("resnet20", "block", True)])
def test_a_mode_that_checkpoints_units_whole_is_told_by_its_forward_alone(
        monkeypatch, name, mode, refused):
    """A block mode whose blocks are each one region keeping only their input (ViT's ``block``:
    what a one-unit checkpointed segment does, so no profile) or that keep more than their one
    region (ResNet's ``block``: refused, measured as a hand mode) is known once its forward has
    run: the profile's step stops there, no backward runs."""
    import zoo.planner.profiling.profile as profile_module

    torch.manual_seed(0)
    model = zoo.create_model(name)
    x = model.example_input(2)
    p = profile_chain(model, x)
    traces = []
    traced = profile_module.traced_step

    def spy(*args, **kwargs):
        found = traced(*args, **kwargs)
        traces.append(found[0])
        return found

    monkeypatch.setattr(profile_module, "traced_step", spy)
    if refused:
        with pytest.raises(ValueError, match="keeps more than its one checkpoint region"):
            profile_chain(model, x, None, mode, like=p, whole=False)
    else:
        assert profile_chain(model, x, None, mode, like=p, whole=False) is None
    assert len(traces) == 1 and traces[0].stopped
    assert not any(phase[0] in ("B", "BR", "tail") for phase in traces[0].mark)
    # the same mode profiled for its own sake (whole=True) runs its backward
    traces.clear()
    if not refused:
        assert profile_chain(model, x, None, mode, like=p) is not None
        assert not traces[0].stopped and any(ph[0] == "B" for ph in traces[0].mark)
