"""zoo.plan on the step a user runs: their batch (tensor, tuple, dict), the model's own loss, their
optimizer's state and step, their autocast; each plan's predicted peak against the real step's
measured bytes, and the planned model trained bit for bit like plain."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
import warnings

import pytest
import torch
import transformers
from torch import nn

import zoo
from helpers import needs_plans_for_compile
from zoo.memory import default_loss, format_bytes
from zoo.memory.inputs import Batch
from zoo.planner import BudgetTooSmallError, largest_batch
from zoo.planner import plans
from zoo.planner.modules.spine import Spine
from zoo.memory.quiet import BatchError
from zoo.memory.step import peak_bytes
from zoo.memory.training import train_step
from zoo.planner.profiling.profile import profile_chain
from zoo.planner.profiling.trace import traced_step
from zoo.planner.step_sweep import real_whole_peak, step_rows, trains_like_plain


def bert_classifier() -> nn.Module:
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, num_labels=3,
                                     attn_implementation="eager")
    return transformers.BertForSequenceClassification(config)


def gpt2_lm() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=3, n_head=2,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def bert_batch(masked: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (4, 16), generator=g)
    mask = torch.ones_like(ids)
    if masked:
        mask[:, 10:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}


class TwoInputs(nn.Module):
    """A model called with two positional tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.b = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(y)


SWEEP = {
    "resnet20 (zoo chain)": (lambda: zoo.create_model("resnet20", num_classes=10),
                             lambda: torch.randn(8, 3, 16, 16)),
    "BERT encoder, mask and labels": (bert_classifier, bert_batch),
    "GPT-2 decoder with labels": (gpt2_lm, lambda: {"input_ids": bert_batch()["input_ids"],
                                                    "labels": bert_batch()["input_ids"]}),
    "GPT-2 decoder, its cache, a padded mask": (gpt2_lm, lambda: {
        **bert_batch(), "labels": bert_batch()["input_ids"]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SWEEP))
def test_every_plan_of_the_whole_step_is_exact_and_trains_like_plain(name):
    make, batch = SWEEP[name]
    rows = step_rows(name, make, batch())
    assert len(rows) == 12  # 2 optimizers x 2 precisions x 3 budgets
    for r in rows:
        assert r.measured == r.predicted <= r.budget, r
        assert r.exact, r


def test_a_batch_dict_with_mask_and_labels_is_planned_with_the_models_own_loss():
    torch.manual_seed(0)
    model = bert_classifier().train()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, bert_batch(), 1, optimizer=opt, apply=False)
    plan = zoo.plan(model, bert_batch(), (e.value.smallest + e.value.plain) // 2, optimizer=opt)
    assert "loss: the output's own loss" in str(plan)
    assert "attention_mask=4x16 int64" in str(plan) and "optimizer AdamW" in str(plan)
    assert real_whole_peak(model, bert_batch(), opt, "fp32") == plan.predicted_peak
    assert plan.predicted_peak <= plan.budget


def test_a_tuple_batch_is_the_models_positional_arguments():
    torch.manual_seed(0)
    model = TwoInputs()
    batch = (torch.randn(32, 16), torch.randn(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = zoo.plan(model, batch, "inf", optimizer=opt)
    assert real_whole_peak(model, batch, opt, "fp32") == plan.predicted_peak


@dataclasses.dataclass(frozen=True)
class Pair:
    """A batch as a user's own dataclass: the model takes it whole."""
    images: torch.Tensor
    shift: torch.Tensor
    note: str = "train"


class TakesNested(nn.Module):
    """A chain of blocks taking a dataclass, or a list of tensors and a dict of lists."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                      for _ in range(6)])

    def forward(self, batch, extra=None) -> torch.Tensor:
        x, shift = (batch.images, batch.shift) if extra is None else (batch[0], extra["shift"][0])
        return self.blocks(x + shift)


@pytest.mark.parametrize("nested", ["dataclass", "tuple-dict-list"])
def test_a_batch_nesting_its_tensors_in_containers_is_planned_exactly(nested):
    torch.manual_seed(0)
    x, shift = torch.randn(16, 32), torch.randn(32, requires_grad=False)
    batch = Pair(x, shift) if nested == "dataclass" else ([x], {"shift": [shift]})
    plain = TakesNested()
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, batch, 1, optimizer=opt, apply=False)
    plan = zoo.plan(model, batch, (e.value.smallest + e.value.plain) // 2, optimizer=opt)
    assert plan.checkpointed and "shift" in plan.step and "32 float32" in plan.step
    assert trains_like_plain(copy.deepcopy(plain), copy.deepcopy(model), batch,
                             lambda m: torch.optim.AdamW(m.parameters()), "fp32")
    assert real_whole_peak(model, batch, opt, "fp32") == plan.predicted_peak <= plan.budget


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p),
    pytest.param(lambda p: torch.optim.AdamW(p, foreach=True), marks=pytest.mark.slow),
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), marks=pytest.mark.slow),
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.1), marks=pytest.mark.slow)],
    ids=["adamw", "adamw-foreach", "sgd-momentum", "sgd"])
def test_the_optimizers_state_and_step_are_in_the_predicted_peak(make_opt):
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(8, 3, 16, 16)
    opt = make_opt(model.parameters())
    bare = zoo.plan(model, x, "inf", apply=False).predicted_peak
    plan = zoo.plan(model, x, "inf", optimizer=opt)
    assert real_whole_peak(model, x, opt, "fp32") == plan.predicted_peak
    params = sum(p.numel() * 4 for p in model.parameters())
    copies = {"AdamW": 2, "SGD": 1 if opt.defaults.get("momentum") else 0}[type(opt).__name__]
    assert plan.predicted_peak >= bare + copies * params


def test_a_loss_closing_over_its_targets_and_a_tensor_lr_are_planned_exactly():
    # the loss reads real targets and Adam a real lr tensor beside the fake step's tensors
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    loss_fn = lambda out: nn.functional.cross_entropy(out, y)  # noqa: E731
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    with pytest.raises(BudgetTooSmallError) as info:
        zoo.plan(model, x, 1, loss_fn=loss_fn, optimizer=opt, apply=False)
    for budget in (info.value.smallest, info.value.plain):
        plan = zoo.plan(model, x, budget, loss_fn=loss_fn, optimizer=opt)
        step = train_step(model, x, loss_fn=loss_fn, optimizer=opt)
        step()  # Adam's state exists from the first step on
        model.zero_grad(set_to_none=True)
        assert peak_bytes(step, [model, opt]) == plan.predicted_peak


def test_a_bf16_autocast_plan_keeps_its_budget():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(32, 3, 32, 32)
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = zoo.plan(model, x, "inf", optimizer=opt, apply=False).plain_peak
        plan = zoo.plan(model, x, plain // 2, optimizer=opt)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is put back
    assert "bf16 autocast (cpu)" in str(plan)
    assert real_whole_peak(model, x, opt, "bf16") == plan.predicted_peak <= plan.budget


def small_bert() -> nn.Module:
    torch.manual_seed(0)
    return zoo.create_model("bert_base", vocab_size=200, max_positions=64, embed_dim=64,
                            depth=4, num_heads=2)


def bert_tokens(batch: int) -> dict[str, torch.Tensor]:
    return {"x": torch.zeros(batch, 32, dtype=torch.long),
            "attention_mask": torch.ones(batch, 32, dtype=torch.long)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_autocasts_cached_parameter_casts_leave_every_block_open_to_checkpointing(precision):
    # autocast keeps each parameter's bf16 copy in its cache until the autocast block exits,
    # checkpointed or not; a block's copies of its biases are saved by nothing, so the hooks
    # never see them: they are noted as cached, and the block stays one a recompute can run
    torch.manual_seed(0)
    user = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                           for _ in range(4)])
    model, x = Spine(user, [str(i) for i in range(4)]), torch.randn(8, 32)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else \
        contextlib.nullcontext()
    with amp:
        trace = traced_step(model, x, default_loss, [(0, 4, False)])[0]
        prof = profile_chain(model, x)
    biases = (64 + 32) * 2  # and the first weight, whose mm computes no input gradient
    expected = [biases + 32 * 64 * 2, *[biases] * 3] if precision == "bf16" else [0] * 4
    assert [trace.cached[i] for i in range(4)] == expected
    assert not any(prof.opaque)


def test_a_zoo_model_leaves_no_parameter_cast_in_autocasts_cache():
    """It casts each parameter once, without the cache (``zoo.checkpoint.casts.casts_once``)."""
    model = small_bert()
    n = len(model.checkpoint_chain())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace = traced_step(model, bert_tokens(4), default_loss, [(0, n, False)])[0]
    assert [trace.cached[i] for i in range(n)] == [0] * n


@pytest.mark.slow
def test_a_bf16_largest_batch_is_the_largest_the_whole_step_plan_fits():
    model = small_bert()
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        budget = zoo.plan(model, bert_tokens(32), "inf", optimizer=opt, apply=False).plain_peak
        budget //= 2
        best, _ = largest_batch(model, bert_tokens, budget, optimizer=opt)
        plan = zoo.plan(model, bert_tokens(best), budget, optimizer=opt, apply=False)
        assert plan.predicted_peak <= budget
        with pytest.raises(BudgetTooSmallError):  # per-block modes searched too: exact here
            zoo.plan(model, bert_tokens(best + 1), budget, optimizer=opt, apply=False)


def test_batchnorm_after_a_bf16_convolution_saves_float32_statistics_as_the_kernel_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = zoo.memory.step.measure_step(model, x)[0]
        step = zoo.memory.train_step(model, x)
    assert zoo.memory.step.peak_bytes(step, [model]) == fake


def test_largest_batch_resizes_a_batch_and_leaves_room_for_the_optimizer():
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(2, 3, 16, 16)
    opt = torch.optim.AdamW(model.parameters())
    budget = 30_000_000
    bare, _ = largest_batch(model, x, budget)
    with_opt, _ = largest_batch(model, x, budget, optimizer=opt)
    assert 0 < with_opt < bare


@pytest.mark.slow
def test_largest_batch_with_adams_foreach_step_is_one_its_whole_step_plan_fits():
    # Adam's foreach step needs temporaries beside its state, which the chain's profiles
    # leave out: the chain's answer is checked by the whole step's plan and lowered
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(2, 3, 16, 16)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    with pytest.raises(BudgetTooSmallError) as info:
        zoo.plan(model, x[:1], 1, optimizer=opt, apply=False)
    assert largest_batch(model, x, info.value.smallest - 1, optimizer=opt)[0] == 0
    budget = info.value.smallest + 600_000
    best, profile = largest_batch(model, x, budget, optimizer=opt)
    assert best > 1 and profile is not None
    assert zoo.plan(model, torch.randn(best, 3, 16, 16), budget, optimizer=opt,
                    apply=False).predicted_peak <= budget
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, torch.randn(best + 1, 3, 16, 16), budget, optimizer=opt, apply=False)


def test_largest_batch_of_a_hugging_face_model_is_the_largest_its_whole_step_plan_fits():
    # no zoo chain to extrapolate: every candidate is planned whole, so the answer is exact
    model = bert_classifier()
    opt = torch.optim.AdamW(model.parameters())
    batch = Batch.of(bert_batch())
    budget = zoo.plan(model, batch.resized(16), "inf", optimizer=opt, apply=False).plain_peak
    budget = budget * 2 // 3
    best, profile = largest_batch(model, bert_batch(), budget, optimizer=opt)
    assert profile is None and best > 4
    assert zoo.plan(model, batch.resized(best), budget, optimizer=opt,
                    apply=False).predicted_peak <= budget
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, batch.resized(best + 1), budget, optimizer=opt, apply=False)


def test_batch_size_is_found_from_the_tensors_and_resized():
    b = Batch.of({"input_ids": torch.zeros(6, 9), "mask": torch.zeros(6, 9), "t": torch.zeros(3)})
    assert b.size() == 6
    r = b.resized(10)
    assert r.kwargs["input_ids"].shape == (10, 9) and r.kwargs["t"].shape == (3,)
    assert Batch.of((torch.zeros(4, 2), 7)).resized(5).args[1] == 7


# ---- errors, one line each
@pytest.mark.parametrize("args,expected", [
    ((torch.randn(2, 8), nn.Linear(8, 2), "1GB"), "arguments look swapped"),
    (("resnet18", torch.randn(2, 8), "1GB"), "zoo.create_model('resnet18')"),
    ((nn.Linear(8, 2), 5, "1GB"), "batch must be a tensor, a dataclass, a tuple"),
    ((nn.Linear(8, 2), {"x": 1}, "1GB"), "holds no tensor"),
])
def test_a_wrong_argument_is_one_line(args, expected):
    with pytest.raises(TypeError) as e:
        zoo.plan(*args)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_foreign_optimizer_is_one_line():
    with pytest.raises(ValueError, match="not parameters of the model") as e:
        zoo.plan(nn.Linear(8, 2), torch.randn(2, 8), "1GB",
                 optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        zoo.plan(nn.Linear(8, 2), torch.randn(2, 8), "1GB", optimizer="adamw")


def test_a_batch_of_the_wrong_shape_is_one_line_and_torchs_fake_log_is_silent(caplog):
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with caplog.at_level(logging.DEBUG), pytest.raises(BatchError) as e:
        zoo.plan(seq, torch.randn(4, 7), "1GB")
    assert "(4x7 float32)" in str(e.value) and "\n" not in str(e.value)
    assert not [r for r in caplog.records if "meta" in r.getMessage()]


def test_a_batch_of_another_dtype_than_a_linears_is_one_line():
    # NumPy data comes as float64; torch's meta functions of mm and addmm do not check dtypes
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(RuntimeError):
        seq(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(BatchError, match=r"\(4x8 float64\).*different dtypes") as e:
        zoo.plan(seq, torch.randn(4, 8, dtype=torch.float64), "1GB")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("loss_fn, got", [(lambda out: out, "a tensor of shape (4, 4)"),
                                           (lambda out: (out.sum(), out.mean()), "tuple")])
def test_a_loss_fn_returning_more_than_one_number_is_its_own_fault_in_one_line(loss_fn, got):
    # torch's own error, "grad can be implicitly created only for scalar outputs", would be
    # said as the batch's fault
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for route in (lambda: zoo.plan(seq, torch.randn(4, 8), "1GB", loss_fn=loss_fn),
                  train_step(seq, torch.randn(4, 8), loss_fn=loss_fn)):
        expected = rf"loss \(the given loss_fn \(<lambda>\)\) is {re.escape(got)}, not one"
        with pytest.raises(ValueError, match=expected) as e:
            route()
        assert "\n" not in str(e.value) and not isinstance(e.value, BatchError)


def test_a_loss_reaching_no_trained_parameter_is_one_line():
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"loss \(the given loss_fn .*does not require grad"):
        zoo.plan(seq, torch.randn(4, 8), "1GB", loss_fn=lambda out: out.detach().sum())
    seq.requires_grad_(False)  # a model frozen whole: nothing to train, nothing to plan
    with pytest.raises(ValueError, match=r"loss \(mean of squares\) does not require") as e:
        zoo.plan(seq, torch.randn(4, 8), "1GB")
    assert "\n" not in str(e.value) and not isinstance(e.value, BatchError)


def test_a_value_read_in_the_step_is_one_line():
    # a fake tensor has a shape but no value: torch raises its DataDependentOutputException
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    loss_fn = lambda out: out.square().mean() * float(out.sum() > 0)  # noqa: E731
    with pytest.raises(BatchError, match=r"reads a tensor's value .*keep value reads out") as e:
        zoo.plan(seq, torch.randn(4, 8), "1GB", loss_fn=loss_fn)
    assert "\n" not in str(e.value)


def test_set_grad_checkpointing_modules_of_another_kind_is_one_line():
    with pytest.raises(TypeError, match="modules= takes module types") as e:
        zoo.set_grad_checkpointing(nn.Sequential(nn.Linear(2, 2)), modules=3)
    assert "\n" not in str(e.value)


def test_small_budgets_print_in_a_unit_that_shows_them():
    assert format_bytes(10) == "10 B" and format_bytes(1704) == "1.7 KiB"
    with pytest.raises(BudgetTooSmallError, match=r"10 B \(10 bytes\)"):
        zoo.plan(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                 torch.randn(2, 8), 10)


# ---- compiled steps and warnings
def test_a_compiled_step_calling_an_eager_plan_says_so_once():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(32, 3, 16, 16)
    least = zoo.plan(model, x, "inf", apply=False).smallest_peak
    plan = zoo.plan(model, x, least)
    assert not plan.compile_safe
    step = torch.compile(lambda inp: model(inp).square().mean(), backend="aot_eager")
    torch._dynamo.reset()
    plans._SAID.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            step(x).backward()
    said = [w for w in seen if "the step can peak above the predicted" in str(w.message)]
    assert len(said) == 1 and "compiled=True" in str(said[0].message)


def test_cpu_peak_bytes_of_a_planned_spine_gives_no_warning():
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
                          for _ in range(6)])
    x = torch.randn(4, 4, 8, 8)
    least = zoo.plan(seq, x, "inf", apply=False).smallest_peak
    zoo.plan(seq, x, least)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zoo.memory.cpu_peak_bytes(zoo.memory.train_step(seq, x), track=(seq,))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_card_plan_predicts_what_predict_step_says_of_the_planned_step(precision):
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(64, 3, 32, 32)
    opt = torch.optim.AdamW(model.parameters())
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else \
        contextlib.nullcontext()
    with amp:
        plain = zoo.plan(model, x, "inf", device="h100", optimizer=opt, apply=False)
        plan = zoo.plan(model, x, plain.predicted_peak * 5 // 6, device="h100", optimizer=opt)
        step = zoo.memory.predict_step(model, x, "h100", optimizer=opt)
    assert plan.segments != [] and step.peak == plan.predicted_peak <= plan.budget


@pytest.mark.slow
def test_an_fp16_plan_with_a_grad_scaler_is_the_scaled_step():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=10)
    x = torch.randn(16, 3, 32, 32)
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    step()
    measured = zoo.memory.step.peak_bytes(step, [model, opt])
    with torch.autocast("cpu", dtype=torch.float16):
        plan = zoo.plan(model, x, "inf", optimizer=opt, apply=False)
    assert "fp16 autocast (cpu)" in plan.step
    # the scaler's own scalars (its scale, found_inf, the inverse scale): a few bytes
    assert abs(measured - plan.predicted_peak) <= 16


@pytest.mark.parametrize("route", [
    pytest.param("chain", marks=pytest.mark.slow), pytest.param("time", marks=pytest.mark.slow),
    pytest.param("compiled", marks=[pytest.mark.slow, needs_plans_for_compile]), "spine"])
def test_every_route_of_plan_takes_a_batch_tuple(route):
    torch.manual_seed(0)
    if route == "spine":
        model = nn.Sequential(*[m for _ in range(6)
                                for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())])
        x = torch.randn(4, 4, 8, 8)
    else:
        model = zoo.create_model("resnet20", num_classes=10)
        x = torch.randn(8, 3, 16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = {"cost": "time"} if route == "time" else {"compiled": True} if route == "compiled" \
        else {}
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, (x,), 1, optimizer=opt, apply=False, **kw)
    plan = zoo.plan(model, (x,), (e.value.smallest + e.value.plain) // 2, optimizer=opt, **kw)
    if route == "spine":
        assert plan.spine is not None
    assert real_whole_peak(model, (x,), opt, "fp32") == plan.predicted_peak <= plan.budget


def test_predict_step_on_a_batch_of_the_wrong_shape_is_one_line(caplog):
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with caplog.at_level(logging.DEBUG), pytest.raises(BatchError) as e:
        zoo.memory.predict_step(seq, torch.randn(4, 7), "h100")
    assert "\n" not in str(e.value)
    assert not [r for r in caplog.records if "meta" in r.getMessage()]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "all_ones"])
def test_a_mask_of_all_ones_is_dropped_at_run_time_so_its_plan_is_over_by_the_mask(padded):
    # fake tensors carry no values: Hugging Face's SDPA path drops an all-ones mask when it runs,
    # which a fake step cannot see, so the plan counts the (batch, 1, tokens, tokens) mask
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4,
                                     num_attention_heads=2, intermediate_size=128,
                                     max_position_embeddings=64)
    model = transformers.BertForSequenceClassification(config)
    ids = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[:, 60:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.zeros(32, dtype=torch.long)}
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = zoo.plan(model, batch, "inf", optimizer=opt, apply=False).plain_peak
        plan = zoo.plan(model, batch, plain * 4 // 5, optimizer=opt)
        step = zoo.memory.train_step(model, batch, optimizer=opt)
    step()
    measured = zoo.memory.step.peak_bytes(step, [model, opt])
    assert plan.predicted_peak - measured == (0 if padded else 32 * 64 * 64)


@pytest.mark.parametrize("use_cache", [None, False], ids=["its_cache", "no_cache"])
def test_a_decoder_without_mask_or_cache_plans_the_mask_packed_sequences_would_need(use_cache):
    # with neither an attention mask nor a cache, Hugging Face reads the position ids' values to
    # see whether sequences are packed; a fake step cannot, so it plans the (batch, 1, tokens,
    # tokens) bool mask packing needs: here held by the checkpointed block until its backward
    ids = bert_batch()["input_ids"]
    batch = {"input_ids": ids, "labels": ids}
    if use_cache is not None:
        batch["use_cache"] = use_cache
    model = gpt2_lm()
    opt = torch.optim.AdamW(model.parameters())
    plain = zoo.plan(model, batch, "inf", optimizer=opt, apply=False).plain_peak
    plan = zoo.plan(model, batch, plain * 9 // 10, optimizer=opt)
    assert len(plan.checkpointed) == 1
    over = plan.predicted_peak - real_whole_peak(model, batch, opt, "fp32")
    assert over == (0 if use_cache is None else ids.numel() * ids.shape[1])


def whisper() -> nn.Module:
    config = transformers.WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=2,
                                        decoder_layers=2, d_model=32, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, max_source_positions=16,
                                        max_target_positions=32, decoder_start_token_id=1,
                                        pad_token_id=0)
    return transformers.WhisperForConditionalGeneration(config)


def test_a_hugging_face_models_blocks_are_its_own_checkpointing_layers():
    # counting would take Whisper's two attentions per decoder layer (the second reads the
    # cross-attention cache, so its recompute saved other tensors) and miss its encoder
    torch.manual_seed(0)
    model = whisper()
    assert [n for n, _ in zoo.blocks.find_blocks(model)] == [
        f"model.{part}.layers.{i}" for part in ("encoder", "decoder") for i in (0, 1)]
    g = torch.Generator().manual_seed(2)
    batch = {"input_features": torch.randn(2, 8, 32, generator=g),
             "labels": torch.randint(1, 64, (2, 12), generator=g)}
    opt = torch.optim.AdamW(model.parameters())
    plain = zoo.plan(model, batch, "inf", optimizer=opt, apply=False).plain_peak
    plan = zoo.plan(model, batch, plain * 95 // 100, optimizer=opt)
    assert plan.checkpointed and plan.predicted_peak == real_whole_peak(model, batch, opt, "fp32")
    planned, reference = whisper(), whisper()
    reference.load_state_dict(planned.state_dict())
    plan.apply(planned)
    assert trains_like_plain(reference, planned, batch,
                             lambda m: torch.optim.AdamW(m.parameters()), "fp32")
