"""``zoo.plan(..., device="h100")``: a plan for a CUDA card made on a machine without one.

The planner's profile then counts the card's bytes (its attention and dropout kernels, the
caching allocator's blocks), so its prediction is checked against ``predict_step`` on the same
card, as the CPU plan's is against a measured CPU step; ``cost="time"`` prices each block by its
predicted time on the card.
"""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo.memory import on_card, predict_step
from zoo.planner import BudgetTooSmallError, measure_step, profile_chain, smallest_peak
from zoo.planner.plans import clear_plan
from zoo.train.cli import command

from helpers import call_command


@pytest.fixture(scope="module")
def bert() -> tuple[torch.nn.Module, torch.Tensor]:
    """A small BERT with dropout: CPU and CUDA attention save different tensors."""
    torch.manual_seed(0)
    model = zoo.create_model("bert_base", vocab_size=200, max_positions=128, embed_dim=64,
                             depth=4, num_heads=2).train()
    return model, model.example_input(8, 128)


def test_a_card_profile_counts_the_cards_bytes(bert):
    model, x = bert
    with on_card("h100"):
        card_peak = measure_step(model, x)[0]
        card = profile_chain(model, x)
    cpu = profile_chain(model, x)
    assert card_peak == pytest.approx(predict_step(model, x, "h100").peak, rel=1e-3)
    # the CPU's math attention keeps B x H x L x L probabilities and a float mask per layer
    assert sum(card.saved) < 0.8 * sum(cpu.saved)
    assert card.measured_plain_peak - card.base < cpu.measured_plain_peak - cpu.base
    assert card.base - cpu.base >= 2 * (32 << 20)  # two cuBLAS workspaces, held from the start


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_a_plan_for_a_card_keeps_its_promise_on_that_card(bert, cost):
    model, x = bert
    with on_card("h100"):
        p = profile_chain(model, x)
    plain, low = p.measured_plain_peak, smallest_peak(p)
    budget = int(low + 0.3 * (plain - low))
    result = zoo.plan(model, x, budget, cost=cost, device="h100")
    try:
        reached = predict_step(model, x, "h100")
    finally:
        clear_plan(model, result)
    assert reached.peak <= budget
    assert abs(reached.peak - result.predicted_peak) <= 0.03 * reached.peak
    if cost == "time":  # nanoseconds of the card: the plain step's predicted time
        assert result.cost == "time"
        assert result.step_flops == pytest.approx(
            1e9 * predict_step(model, x, "h100").time.step, rel=1e-6)


def test_a_card_budget_is_a_fraction_of_the_cards_memory(bert):
    model, x = bert
    result = zoo.plan(model, x, "1%", device="a100", apply=False)
    assert result.budget == int(0.01 * 80e9)
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, x, "1MB", device="h100", apply=False)


def test_bad_card_requests_are_one_line_errors_and_time_without_a_chain_is_said(bert):
    model, x = bert
    with pytest.raises(ValueError, match="unknown card 'h1000'; expected one of h100"):
        zoo.plan(model, x, "1GB", device="h1000")
    outside = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="has none, so it is planned by FLOPs"):
        result = zoo.plan(outside, torch.zeros(2, 4), "1GB", cost="time", device="h100",
                          apply=False)
    assert result.budget == 10**9


# ---- train.py --card ----

TINY = dict(model="resnet20", dataset="synthetic", train_size=16, test_size=8, epochs=1,
            device="cpu", batch_size="auto")


def _chosen(out: str) -> int:
    return int(out.split("batch_size auto: ")[1].split()[0])


@pytest.mark.slow
def test_train_batch_size_auto_for_a_card_picks_what_the_card_fits(capsys, tmp_path):
    main = command("train.py")
    code, out, err = call_command(main, capsys, **TINY, memory_budget="300MB", card="h100",
                                  out_dir=str(tmp_path / "card"))
    assert code in (0, None), err
    on_card_batch = _chosen(out)
    assert "on the NVIDIA H100 SXM5 80GB (predicted here)" in out
    assert "predicted on the NVIDIA H100 SXM5 80GB: a step of" in out and "samples/s" in out
    code, out, err = call_command(main, capsys, **TINY, memory_budget="300MB",
                                  out_dir=str(tmp_path / "cpu"))
    assert code in (0, None), err
    # the card holds two 32 MiB cuBLAS workspaces the CPU does not: fewer samples fit
    assert 8 <= on_card_batch < _chosen(out)


@pytest.mark.parametrize("flags, says", [
    (dict(card="h100", batch_size=8), "--card h100 sizes the step for a memory budget"),
    (dict(card="h1000", memory_budget="1GB"), "card: unknown card 'h1000'"),
    (dict(card="l4", memory_budget="30GB"), "more than the 22.35 GiB of a NVIDIA L4"),
])
def test_train_bad_card_flags_are_one_line_errors(capsys, tmp_path, flags, says):
    code, out, err = call_command(command("train.py"), capsys,
                                  **{**TINY, **flags, "out_dir": str(tmp_path / "run")})
    assert code == 2 and says in err and "Traceback" not in err
