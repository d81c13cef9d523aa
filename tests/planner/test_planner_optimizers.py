"""zoo.plan with the optimizers a loop steps: several at once (Muon on the hidden weight matrices
beside AdamW on the rest, a GAN's two), and trainable parameters none of them steps, whose
gradients ``opt.zero_grad()`` never clears. Each plan's predicted peak against the real loop's
measured bytes at its second and third step, and the planned model trained bit for bit like
plain."""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import zoo
from zoo.memory import default_loss, predict_step
from zoo.memory.step import measure_step, peak_bytes
from zoo.planner import BudgetTooSmallError, largest_batch

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                reason="torch.optim.Muon is new in torch 2.9")
Optimizers = Sequence[torch.optim.Optimizer]


def autocast(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()


def user_loop(model: nn.Module, batch: Any, opts: Optimizers,
              precision: str = "fp32") -> Callable[[], None]:
    """The user's loop step: forward and loss, backward, each opt.step() in order, then each
    opt.zero_grad(); the loss held until the step ends, as a loop that logs it holds it."""
    model.train()

    def step() -> None:
        with autocast(precision):
            out = model(**batch) if isinstance(batch, dict) else model(batch)
            loss = default_loss(out)
        del out
        loss.backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()
        del loss

    return step


def loop_peaks(model: nn.Module, batch: Any, opts: Optimizers, precision: str = "fp32",
               steps: int = 3) -> list[int]:
    """Measured peaks of the loop's steps 2..``steps`` (step 1 makes the optimizers' state and
    the gradients no optimizer clears), the model's and optimizers' tensors counted from the
    start."""
    step = user_loop(model, batch, opts, precision)
    step()
    return [peak_bytes(step, [model, *opts]) for _ in range(steps - 1)]


def bounds(model: nn.Module, batch: Any, opts: Any, **kwargs: Any) -> tuple[int, int]:
    """(least, plain) peak of the whole step."""
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, batch, 1, optimizer=opts, apply=False, **kwargs)
    return e.value.smallest, e.value.plain


# ---- Muon beside AdamW on a small GPT-2
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).train()


def tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def muon_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The LLM recipe: Muon on the blocks' 2-D weight matrices, AdamW on the embeddings, norms,
    biases and the (tied) head."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".h." in n)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


@needs_muon
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_muon_beside_adamw_is_planned_to_the_byte_and_trains_like_plain(precision):
    plain, batch = gpt2(), tokens()
    model = copy.deepcopy(plain)
    opts = muon_adamw(model)
    with autocast(precision):
        least, top = bounds(model, batch, opts)
        plan = zoo.plan(model, batch, (least + top) // 2, optimizer=opts)
    assert least < plan.predicted_peak <= plan.budget < top
    assert "optimizers Muon, AdamW (stepped in that order)" in str(plan)
    assert loop_peaks(model, batch, opts, precision) == [plan.predicted_peak] * 2
    step = user_loop(plain, batch, muon_adamw(plain), precision)
    for _ in range(3):  # as many as the planned model's loop ran
        step()
    a, b = plain.state_dict(), model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- several optimizers, any torch: a zoo chain model and a module of one's own
def two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SGD with momentum on the convolutions' and linears' weights, AdamW on the rest."""
    weights = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [torch.optim.SGD(weights, lr=0.1, momentum=0.9), torch.optim.AdamW(rest)]


def resnet20() -> nn.Module:
    torch.manual_seed(0)
    return zoo.create_model("resnet20", num_classes=10).train()


def test_two_optimizers_on_a_zoo_model_are_planned_to_the_byte():
    model, x = resnet20(), torch.randn(8, 3, 16, 16)
    opts = two_optimizers(model)
    least, top = bounds(model, x, opts)
    plan = zoo.plan(model, x, (least + top) // 2, optimizer=tuple(opts))
    assert plan.segments and least <= plan.predicted_peak <= plan.budget
    assert "optimizers SGD, AdamW" in str(plan)
    assert loop_peaks(model, x, opts) == [plan.predicted_peak] * 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)),
                         nn.Linear(64, 10)).train()


def test_two_optimizers_on_a_module_of_ones_own_are_planned_to_the_byte():
    model, x = mlp(), torch.randn(32, 64)
    opts = two_optimizers(model)
    least, top = bounds(model, x, opts)
    plan = zoo.plan(model, x, (least + top) // 2, optimizer=opts)
    assert loop_peaks(model, x, opts) == [plan.predicted_peak] * 2


def test_measure_step_and_a_cards_step_take_several_optimizers():
    model, x = resnet20(), torch.randn(8, 3, 16, 16)
    opts = two_optimizers(model)
    peak, _ = measure_step(model, x, optimizer=opts)
    assert [peak] == loop_peaks(model, x, opts, steps=2)
    card = zoo.plan(model, x, "inf", device="h100", optimizer=opts, apply=False)
    assert predict_step(model, x, "h100", optimizer=opts).peak == card.predicted_peak


def test_largest_batch_takes_several_optimizers():
    model, x = mlp(), torch.randn(32, 64)
    opts = two_optimizers(model)
    budget = measure_step(model, x, optimizer=opts)[0]
    best, _ = largest_batch(model, x, budget, optimizer=opts, limit=256)
    assert best >= 32
    assert zoo.plan(model, torch.randn(best, 64), budget, optimizer=opts,
                    apply=False).predicted_peak <= budget
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, torch.randn(best + 1, 64), budget, optimizer=opts, apply=False)


@pytest.mark.slow
def test_offload_takes_several_optimizers():
    model, x = resnet20(), torch.randn(32, 3, 32, 32)
    opts = two_optimizers(model)
    floor = zoo.plan(model, x, "inf", device="h100", optimizer=opts, apply=False)
    plan = zoo.plan(model, x, floor.smallest_peak, device="h100", optimizer=opts,
                    offload=True)
    assert predict_step(model, x, "h100", optimizer=opts).peak == plan.predicted_peak


# ---- trainable parameters no optimizer steps
def test_gradients_no_optimizer_clears_are_planned_held_and_said_once():
    # the stem's gradients are made last in a step's backward: held from its start, they lift
    # the peak (the head's, made first, would be alive at the peak anyway)
    model, x = resnet20(), torch.randn(8, 3, 16, 16)
    stem = [*model.conv1.parameters(), *model.bn1.parameters()]
    ids = {id(p) for p in stem}
    opt = torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids])
    nbytes = sum(p.numel() * p.element_size() for p in stem)
    with pytest.warns(UserWarning) as said:
        least, top = bounds(model, x, opt)
        plan = zoo.plan(model, x, (least + top) // 2, optimizer=opt)
    lines = [str(w.message) for w in said if "no optimizer steps them" in str(w.message)]
    assert lines == [f"{len(stem)} parameter(s) ({nbytes:,} B) require grad but no optimizer "
                     f"steps them: their gradients accumulate across steps and are held all "
                     f"step (planned so); freeze them with p.requires_grad_(False) or add them "
                     f"to an optimizer"] * 2  # once per zoo.plan call
    assert f"({len(stem)} trainable parameter(s) in none: their gradients held)" in str(plan)
    assert loop_peaks(model, x, [opt], steps=4) == [plan.predicted_peak] * 3


def test_unstepped_parameters_in_a_gpt2_with_a_bf16_batch_dict_are_held():
    model, batch = gpt2(), tokens()
    skip = {"transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wpe.weight"}
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in skip])
    with autocast("bf16"), pytest.warns(UserWarning, match="3 parameter"):
        least, top = bounds(model, batch, opt)
        plan = zoo.plan(model, batch, (least + top) // 2, optimizer=opt)
    assert loop_peaks(model, batch, [opt], "bf16") == [plan.predicted_peak] * 2


def test_largest_batch_says_the_unstepped_parameters_once():
    model, x = mlp(), torch.randn(32, 64)
    opt = torch.optim.SGD(model[:4].parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        largest_batch(model, x, 1 << 20, optimizer=opt, limit=256)
    assert sum("no optimizer steps them" in str(w.message) for w in said) == 1


def test_frozen_parameters_and_no_optimizer_are_not_warned_about():
    model, x = resnet20(), torch.randn(8, 3, 16, 16)
    model.get_classifier().requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = zoo.plan(model, x, "inf", optimizer=opt)
        zoo.plan(model, x, "inf")
    assert "in none" not in str(plan)
    assert loop_peaks(model, x, [opt]) == [plan.predicted_peak] * 2


# ---- bad input, one line each
def _linear_opts() -> tuple[nn.Module, dict[str, Any]]:
    model = nn.Linear(8, 2)
    a = torch.optim.SGD([model.weight], lr=0.1)
    b = torch.optim.AdamW([model.bias])
    shared = torch.optim.AdamW(model.parameters())
    return model, {"a": a, "b": b, "shared": shared}


@pytest.mark.parametrize("make, error, expected", [
    (lambda o: "adamw", TypeError, "or a list or tuple of them, got str"),
    (lambda o: [o["a"], nn.Linear(2, 2)], TypeError, "optimizer[1] must be a torch.optim"),
    (lambda o: [], ValueError, "optimizer is an empty list"),
    (lambda o: (o["a"], o["a"]), ValueError, "optimizer[1] is optimizer[0] again"),
    (lambda o: [o["a"], o["shared"]], ValueError, "optimizer[0] (SGD) and optimizer[1] (AdamW) "
                                                  "share a parameter"),
], ids=["not-optimizer", "not-optimizer-in-list", "empty", "twice", "shared-parameter"])
def test_bad_optimizers_are_one_line(make, error, expected):
    model, opts = _linear_opts()
    for call in (lambda o: zoo.plan(model, torch.randn(2, 8), "1GB", optimizer=o),
                 lambda o: largest_batch(model, torch.randn(2, 8), "1GB", optimizer=o),
                 lambda o: predict_step(model, torch.randn(2, 8), "h100", optimizer=o)):
        with pytest.raises(error) as e:
            call(make(opts))
        assert expected in str(e.value) and "\n" not in str(e.value)
