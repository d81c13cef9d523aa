"""zoo.plan for gradient accumulation: ``accumulate=k`` micro-batches per optimizer step, each
``loss = loss_fn(model(mb)) / k; loss.backward()``, then ``opt.step()``. From the second
micro-batch on every gradient is held through the forward and the backward; each plan's
predicted peak against the real accumulating loop's measured bytes (this CPU, exact), against
the card model's step on an H100, and the planned model trained bit for bit like plain."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import zoo
from zoo.memory import default_loss, predict_step
from zoo.memory.step import measure_step, peak_bytes
from zoo.planner import BudgetTooSmallError

OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer] | None] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "none": None,
}


def autocast(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()


def call(model: nn.Module, mb: Any) -> Any:
    return model(**mb) if isinstance(mb, dict) else model(mb)


def accumulating_step(model: nn.Module, micro_batches: list, opt: torch.optim.Optimizer | None,
                      precision: str) -> Callable[[], None]:
    """The user's loop: gradients reset, each micro-batch's loss / k backward, one opt.step();
    the loss held until the step ends, as a loop that logs it holds it."""
    k = len(micro_batches)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for mb in micro_batches:
            with autocast(precision):
                loss = default_loss(call(model, mb)) / k
            loss.backward()
        if opt is not None:
            opt.step()
        del loss

    return step


def real_peak(model: nn.Module, micro_batches: list, opt: torch.optim.Optimizer | None,
              precision: str) -> int:
    """Measured peak of the real accumulating step in the steady state (the optimizer's state
    made by a step before), the model's and optimizer's tensors counted from the start."""
    model.train()
    step = accumulating_step(model, micro_batches, opt, precision)
    step()
    model.zero_grad(set_to_none=True)
    try:
        return peak_bytes(step, [model] if opt is None else [model, opt])
    finally:
        model.zero_grad(set_to_none=True)


def resnet20() -> nn.Module:
    torch.manual_seed(0)
    return zoo.create_model("resnet20", num_classes=10).train()


def images(k: int, batch: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, 16, 16, generator=g) for _ in range(k)]


def bounds(model: nn.Module, x: Any, opt: torch.optim.Optimizer | None, k: int,
           **kwargs: Any) -> tuple[int, int]:
    """(least, plain) peak of the whole step accumulating ``k`` micro-batches."""
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, x, 1, optimizer=opt, accumulate=k, apply=False, **kwargs)
    return e.value.smallest, e.value.plain


CASES = [("adamw", "fp32", 2), ("sgd", "bf16", 3), ("none", "fp32", 3), ("adamw", "bf16", 2)]
SLOW = [("sgd", "fp32", 2), ("adamw", "fp32", 3), ("none", "bf16", 2), ("adamw", "bf16", 3)]


@pytest.mark.parametrize("opt_name, precision, k", [
    *CASES, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW)],
    ids=[f"{o}-{p}-{k}mb" for o, p, k in CASES + SLOW])
def test_a_zoo_models_accumulating_plan_is_its_real_loops_peak(opt_name, precision, k):
    model = resnet20()
    make = OPTIMIZERS[opt_name]
    opt = make(model) if make else None
    mbs = images(k)
    with autocast(precision):  # one profiling for both budgets: zoo.plan's Planner
        planner = zoo.planner.Planner(model, mbs[0], optimizer=opt, accumulate=k)
    least, plain = planner.least_peak, planner.plain_peak
    for budget in (plain, (least + plain) // 2):
        plan = planner.plan(budget)
        plan.apply(model)
        assert least <= plan.predicted_peak <= budget
        assert real_peak(model, mbs, opt, precision) == plan.predicted_peak
    assert plan.recompute_flops > 0


def test_a_budget_a_fresh_plan_breaks_when_accumulating_gets_a_lower_plan():
    # the budget is the fresh step's plain peak: a fresh plan checkpoints nothing and, with
    # gradients held, would go over it; the accumulating plan checkpoints and keeps it
    model, k = resnet20(), 2
    opt = torch.optim.AdamW(model.parameters())
    mbs = images(k)
    planner = zoo.planner.Planner(model, mbs[0], optimizer=opt)
    least, plain = bounds(model, mbs[0], opt, k)
    budget = planner.plain_peak
    assert least < budget < plain
    fresh = planner.plan(budget)
    fresh.apply(model)
    assert real_peak(model, mbs, opt, "fp32") > budget  # the fresh plan, accumulating
    plan = zoo.plan(model, mbs[0], budget, optimizer=opt, accumulate=k)
    assert f"{k} micro-batches accumulated per optimizer step" in str(plan)
    assert plan.recompute_flops > fresh.recompute_flops
    assert real_peak(model, mbs, opt, "fp32") == plan.predicted_peak <= budget
    assert measure_step(model, mbs[0], optimizer=opt)[0] < fresh.predicted_peak


def test_the_planned_model_accumulates_and_trains_bit_for_bit_like_plain():
    plain, k = resnet20(), 3
    mbs = images(k)
    planned = copy.deepcopy(plain)
    least, _ = bounds(planned, mbs[0], torch.optim.SGD(planned.parameters(), lr=0.1), k)
    plan = zoo.plan(planned, mbs[0], least, accumulate=k,
                    optimizer=torch.optim.SGD(planned.parameters(), lr=0.1))
    assert plan.recompute_flops > 0
    grads = []
    for model in (plain, planned):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = accumulating_step(model, mbs, None, "fp32")
        step()  # gradients of k micro-batches, accumulated
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    a, b = plain.state_dict(), planned.state_dict()  # BatchNorm's statistics included
    assert all(torch.equal(a[n], b[n]) for n in a)


def bert_classifier() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, num_labels=3,
                                     attn_implementation="eager")
    return transformers.BertForSequenceClassification(config).train()


def bert_batches(k: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(k):
        ids = torch.randint(0, 100, (4, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[:, 10:] = 0
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": torch.randint(0, 3, (4,), generator=g)})
    return out


@pytest.mark.parametrize("opt_name, precision, k", [
    ("adamw", "bf16", 2), pytest.param("sgd", "fp32", 3, marks=pytest.mark.slow)],
    ids=["adamw-bf16-2mb", "sgd-fp32-3mb"])
def test_a_hugging_face_batch_dict_with_labels_is_planned_accumulating(opt_name, precision, k):
    model = bert_classifier()
    opt = OPTIMIZERS[opt_name](model)
    mbs = bert_batches(k)
    with autocast(precision):
        least, plain = bounds(model, mbs[0], opt, k)
        plan = zoo.plan(model, mbs[0], (least + plain) // 2, optimizer=opt, accumulate=k)
    assert "loss: the output's own loss" in str(plan)
    assert real_peak(model, mbs, opt, precision) == plan.predicted_peak <= plan.budget


@pytest.mark.parametrize("k", [4, 6])
def test_micro_batches_past_the_third_count_what_a_real_loop_holds_of_each(k):
    # the classifier views each micro-batch's labels: a storage of its own per micro-batch,
    # held by the list the loop runs over; the fake step runs three and adds the rest
    model = bert_classifier()
    opt = OPTIMIZERS["sgd"](model)
    mbs = bert_batches(k)
    three = measure_step(model, mbs[0], optimizer=opt, accumulate=3)[0]
    peak = measure_step(model, mbs[0], optimizer=opt, accumulate=k)[0]
    assert peak == real_peak(model, mbs, opt, "fp32") == three + (k - 3) * 4 * 8


@pytest.mark.parametrize("precision, k", [
    ("fp32", 2), pytest.param("bf16", 3, marks=pytest.mark.slow)], ids=["fp32-2mb", "bf16-3mb"])
def test_a_card_plan_is_the_card_models_accumulating_step(precision, k):
    model = resnet20()
    opt = torch.optim.AdamW(model.parameters())
    x = images(1)[0]
    with autocast(precision):
        fresh = zoo.plan(model, x, "inf", optimizer=opt, device="h100", apply=False)
        least, plain = bounds(model, x, opt, k, device="h100")
        assert plain > fresh.predicted_peak
        plan = zoo.plan(model, x, (least + plain) // 2, optimizer=opt, device="h100",
                        accumulate=k)
        card = predict_step(model, x, "h100", optimizer=opt, accumulate=k)
    assert plan.recompute_flops > 0
    assert card.peak == plan.predicted_peak <= plan.budget


def test_an_accumulating_measurement_counts_every_micro_batchs_flops():
    model = resnet20()
    x = images(1)[0]
    one = measure_step(model, x)[1]
    assert measure_step(model, x, accumulate=5)[1] == 5 * one


@pytest.mark.parametrize("accumulate, error", [
    (0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("2", TypeError),
    (None, TypeError)], ids=["zero", "negative", "float", "bool", "string", "none"])
def test_a_bad_accumulate_is_one_line(accumulate, error):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    for call_ in (lambda: zoo.plan(model, x, "inf", accumulate=accumulate),
                  lambda: measure_step(model, x, accumulate=accumulate),
                  lambda: predict_step(model, x, "h100", accumulate=accumulate)):
        with pytest.raises(error) as e:
            call_()
        assert "accumulate must be" in str(e.value) and "\n" not in str(e.value)


def test_offload_with_accumulation_is_refused_in_one_line():
    model = resnet20()
    with pytest.raises(ValueError, match="offload=True prices a single step") as e:
        zoo.plan(model, images(1)[0], "inf", device="h100", offload=True, accumulate=2)
    assert "\n" not in str(e.value)
