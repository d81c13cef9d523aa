"""``zoo.plan(..., cost="time")``: the chain's costs as measured time on the
input's device (here the CPU; on a GPU the same code times CUDA kernels), planned by the same
dynamic programme: within the budget as measured, and no dearer in time than the FLOP plan.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.planner import (measure_step, predict_peak, profile_chain, recompute_flops,
                         smallest_peak, solve_profile)
from zoo.planner.profiling.timing import time_profile


@pytest.fixture(scope="module")
def resnet20():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = zoo.create_model("resnet20")
    x = model.example_input(8)
    yield model, x, profile_chain(model, x)
    torch.set_num_threads(threads)


def test_time_plan_is_no_dearer_in_time_than_the_flop_plan(resnet20):
    model, x, p = resnet20
    tp = time_profile(model, x, p)
    assert tp.units == p.units and tp.act == p.act and tp.saved == p.saved
    assert min(tp.flops) > 0 and tp.step_flops > 0
    plain = predict_peak(p, [(0, p.n_units, False)])
    for f in (0.1, 0.5):
        budget = int(smallest_peak(p) + f * (plain - smallest_peak(p)))
        by_flops, by_time = solve_profile(p, budget), solve_profile(tp, budget)
        assert by_time.predicted_peak <= budget
        flop_segments = p.unit_segments(by_flops.segments)
        assert by_time.recompute_flops <= recompute_flops(tp, flop_segments)


def test_plan_with_cost_time_fits_as_measured(resnet20):
    model, x, p = resnet20
    plain = predict_peak(p, [(0, p.n_units, False)])
    budget = (smallest_peak(p) + plain) // 2
    result = zoo.plan(model, x, budget, cost="time")
    assert result.cost == "time" and " ms" in str(result)
    peak = measure_step(model, x)[0]
    model.set_checkpoint_plan(None)
    assert peak <= budget and abs(peak - result.predicted_peak) <= 0.05 * peak
    with pytest.raises(ValueError, match="cost must be 'flops' or 'time'"):
        zoo.plan(model, x, budget, cost="watts")
