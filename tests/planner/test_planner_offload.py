"""The planner's third choice, offload: exact peaks and times on a simulated card, chosen only
where it pays, and a planned model that trains bit for bit like plain."""
import dataclasses

import pytest
import torch
from torch import nn

import zoo
from zoo.checkpoint import host_copies, offloaded_bytes, reset_offloaded_bytes
from zoo.memory import predict_step
from zoo.planner import BudgetTooSmallError
from zoo.planner.offload_choice import largest_offload_batch
from zoo.planner.plans import clear_plan

from helpers import assert_same_training
from test_planner import run_main

CARD = "h100"


def _resnet(batch: int = 32):
    torch.manual_seed(0)
    return zoo.create_model("resnet20", num_classes=10), torch.randn(batch, 3, 32, 32)


def _recompute_alone(model, x, budget):
    """Recompute alone's plan for ``budget`` on the card, and its predicted step there."""
    try:
        p = zoo.plan(model, x, budget, device=CARD)
    except BudgetTooSmallError:
        return None, None
    step = predict_step(model, x, CARD)
    clear_plan(model, p)
    return p, step


@pytest.fixture(scope="module")
def floors():
    model, x = _resnet()
    recompute = zoo.plan(model, x, float("inf"), device=CARD, apply=False)
    at_floor = zoo.plan(model, x, recompute.smallest_peak, device=CARD, offload=True, apply=False)
    least = zoo.plan(model, x, at_floor.smallest_peak, device=CARD, offload=True, apply=False)
    return recompute, least


def test_offload_reaches_below_recompute_floor_with_exact_peak_and_time(floors):
    recompute, least = floors
    assert least.smallest_peak < recompute.smallest_peak and least.offloaded_bytes > 0
    model, x = _resnet()
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, x, least.smallest_peak, device=CARD, apply=False)
    p = zoo.plan(model, x, least.smallest_peak, device=CARD, offload=True)
    assert p.offloaded_bytes > 0 and p.offloaded_blocks
    step = predict_step(model, x, CARD)  # the planned model, as the user would check it
    assert step.peak == p.predicted_peak <= p.budget
    assert step.time.step == p.predicted_time and step.time.link >= 0
    assert step.offloaded_bytes == p.offloaded_bytes
    assert "offloaded" in str(p) and f"{1e3 * p.predicted_time:.2f} ms" in str(p)
    assert not p.compile_safe


@pytest.mark.slow  # three budgets, each planned twice: the whole suite's lane
def test_offload_is_chosen_only_where_it_pays(floors):
    """At every budget from plain down to recompute's floor the plan's predicted time is no
    more than recompute alone's at that budget, on the same card model."""
    recompute, least = floors
    plain, floor = recompute.plain_peak, recompute.smallest_peak
    for budget in (plain, (plain + floor) // 2, floor):
        model, x = _resnet()
        alone, alone_step = _recompute_alone(model, x, budget)
        p = zoo.plan(model, x, budget, device=CARD, offload=True, apply=False)
        assert p.predicted_peak <= budget
        assert p.predicted_time <= alone_step.time.step
        if p.offloaded_bytes == 0:  # then it is recompute alone's plan
            assert p.segments == alone.segments


def test_offloaded_plan_trains_like_plain_bit_for_bit(floors):
    _, least = floors
    plain, x = _resnet(4)
    model, _ = _resnet(4)
    least.apply(model)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    reset_offloaded_bytes()
    with host_copies():  # the offload regions move CPU tensors through host copies
        assert_same_training(plain, plain, model, model, x, steps=3, exact=True)
    assert offloaded_bytes() > 0


def _flat():
    torch.manual_seed(0)  # flat layers: planned over the calls of its spine
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))


def test_a_module_planned_over_its_spine_with_offload():
    """Its floor is one layer's working set already (recompute reaches it), so offload reaches
    no lower; there, offloading the last segment instead of recomputing it is faster, and is
    chosen at the same peak. The spine runs an offloaded segment bit for bit like plain."""
    model, x = _flat(), torch.randn(8192, 64)
    floor = zoo.plan(model, x, float("inf"), device=CARD, apply=False).smallest_peak
    _, alone = _recompute_alone(model, x, floor)
    p = zoo.plan(model, x, floor, device=CARD, offload=True)
    assert p.spine is not None and p.offloaded_bytes > 0
    assert predict_step(model, x, CARD).peak == p.predicted_peak <= floor
    assert p.predicted_time < alone.time.step
    moved = dataclasses.replace(p, segments=[(0, len(p.spine), "offload")])
    plain, model = _flat(), _flat()
    moved.apply(model)
    reset_offloaded_bytes()
    with host_copies():
        assert_same_training(plain, plain, model, model, x[:16], steps=3, exact=True)
    assert offloaded_bytes() > 0


def test_whole_step_with_optimizer_and_bf16_on_the_card():
    model, x = _resnet()
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        floor = zoo.plan(model, x, float("inf"), device=CARD, optimizer=opt,
                         apply=False).smallest_peak
        p = zoo.plan(model, x, floor, device=CARD, optimizer=opt, offload=True)
        step = predict_step(model, x, CARD, optimizer=opt)
    assert step.peak == p.predicted_peak <= floor
    assert "bf16" in str(p)


def test_largest_offload_batch_grows_past_recompute():
    model, x = _resnet()
    budget = zoo.plan(model, x, float("inf"), device=CARD, apply=False).smallest_peak
    b = largest_offload_batch(model, lambda n: torch.randn(n, 3, 32, 32), budget,
                              zoo.memory.card(CARD), start=32)
    assert b > 32
    whole = [(0, len(model.checkpoint_chain()), "offload")]
    model.set_checkpoint_plan(whole)
    assert predict_step(model, torch.randn(b, 3, 32, 32), CARD).peak <= budget
    assert predict_step(model, torch.randn(b + 1, 3, 32, 32), CARD).peak > budget


def test_offload_needs_a_card_and_an_eager_step():
    model, x = _resnet(2)
    with pytest.raises(ValueError, match="needs device=") as no_card:  # each names its own cause
        zoo.plan(model, x, "1GB", offload=True)
    assert "compile" not in str(no_card.value)
    with pytest.raises(ValueError, match="eager step") as compiled:
        zoo.plan(model, x, "1GB", device=CARD, offload=True, compiled=True)
    assert "device=" not in str(compiled.value)
    with pytest.raises(BudgetTooSmallError):
        zoo.plan(model, x, 1000, device=CARD, offload=True)


TINY = dict(model="resnet20", dataset="synthetic", train_size=16, test_size=8, epochs=1,
            device="cpu", card="h100", batch_size="auto", memory_budget="75MB")


@pytest.mark.slow  # three short training runs
def test_train_offload_fits_a_larger_batch_on_the_card(capsys, tmp_path):
    code, out, err = run_main(capsys, **TINY, out_dir=str(tmp_path / "a"))
    assert code in (0, None), err
    alone = int(out.split("batch_size auto: ")[1].split()[0])
    code, out, err = run_main(capsys, **TINY, offload=True, out_dir=str(tmp_path / "b"))
    assert code in (0, None), err
    chosen = int(out.split("batch_size auto: ")[1].split()[0])
    assert chosen > alone and "offloaded to host memory" in out
    code, out, err = run_main(capsys, **{**TINY, "card": None}, offload=True,
                              out_dir=str(tmp_path / "c"))
    assert code == 2 and "--offload True" in err and "--card" in err


def test_planning_with_offload_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", efficient=True)
    mode, x = model.grad_checkpointing, torch.randn(8, 3, 32, 32)
    zoo.plan(model, x, "200MB", device=CARD, offload=True, apply=False)
    assert model.grad_checkpointing == mode and model.checkpoint_plan is None


def _hf_classifier():
    import transformers
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4,
                                     num_attention_heads=4, intermediate_size=512,
                                     max_position_embeddings=128, num_labels=4,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def test_a_hugging_face_batch_dict_with_labels_adamw_and_bf16_plans_with_offload():
    """The user's step: a Hugging Face classifier's batch dict with labels, AdamW's state, bf16
    autocast, its encoder layers (looped with keyword arguments) planned with offload at the
    least peak any candidate reaches; predict_step of the planned model agrees to the byte.
    Every layer offloaded trains bit for bit like plain through host copies."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (64, 64), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.randint(0, 4, (64,), generator=g)}
    model = _hf_classifier().train()
    opt = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(BudgetTooSmallError) as too_small:
            zoo.plan(model, batch, 1000, device=CARD, optimizer=opt, offload=True)
        with pytest.raises(BudgetTooSmallError) as alone:
            zoo.plan(model, batch, 1000, device=CARD, optimizer=opt)
        floor = too_small.value.smallest
        p = zoo.plan(model, batch, floor, device=CARD, optimizer=opt, offload=True)
        step = predict_step(model, batch, CARD, optimizer=opt)
    assert floor <= alone.value.smallest and "offloaded to host memory" in str(p)
    assert step.peak == p.predicted_peak <= floor and step.time.step == p.predicted_time
    assert "labels" in p.step and "AdamW" in p.step and "bf16" in p.step
    every = dataclasses.replace(p, checkpointed=[], nested=[], offloaded=p.blocks)
    plain, moved = _hf_classifier().train(), _hf_classifier().train()
    every.apply(moved)
    small = {k: v[:4, :16] if v.dim() == 2 else v[:4] for k, v in batch.items()}
    reset_offloaded_bytes()
    with host_copies():
        for m in (plain, moved):
            torch.manual_seed(1)
            m(**small).loss.backward()
    assert offloaded_bytes() > 0
    for a, b in zip(plain.parameters(), moved.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_predicted_offloaded_bytes_are_what_the_planned_model_moves():
    """The card's step swaps fake parameters in; what it moves must be what the model moves
    with its own parameters (a linear layer's saved ``weight.t()`` stays in both)."""
    model, x = _flat(), torch.randn(256, 64)
    p = zoo.plan(model, x, float("inf"), device=CARD, apply=False)
    dataclasses.replace(p, segments=[(0, len(p.spine), "offload")]).apply(model)
    predicted = predict_step(model, x, CARD).offloaded_bytes
    reset_offloaded_bytes()
    with host_copies():
        model(x).square().mean().backward()
    assert predicted == offloaded_bytes() > 0
