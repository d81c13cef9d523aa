"""LoRA fine-tuning with Hugging Face PEFT under zoo.set_grad_checkpointing, the way it is done
most: a causal LM built offline from a small config, its base frozen, LoRA adapters on the
attention's q and v projections with dropout on. Each test trains the checkpointed model beside
the plain one (train mode, same seeds, AdamW over the adapters) and compares bit for bit: the
losses, the adapters, the untouched base. peft and transformers are test dependencies only."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch

import zoo
from test_integrations import recomputes_with_zoo
from zoo.memory.step import measure_step, peak_bytes
from zoo.planner import BudgetTooSmallError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def llama(layers: int = 2, attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with LoRA adapters (rank 4, dropout 0.1) on q_proj and v_proj; the base frozen."""
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    return peft.get_peft_model(model, config)


def batch() -> dict[str, torch.Tensor]:
    """A padded batch with labels, as a fine-tuning collator gives it."""
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 40:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: torch.nn.Module, forward: Any = None, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` AdamW steps over the adapters in train mode, reseeding before each forward;
    the losses."""
    model.train()
    forward = model if forward is None else forward
    opt, losses = adamw(model), []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = forward(**batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def assert_same_lora_training(plain: torch.nn.Module, ckpt: torch.nn.Module, forward: Any = None,
                              steps: int = 3) -> None:
    """``ckpt`` (run by ``forward``) trains as ``plain``: losses and every weight bit for bit,
    the adapters moved and the base where it was."""
    base = {n: p.detach().clone() for n, p in ckpt.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in ckpt.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    expected, losses = train(plain, steps=steps), train(ckpt, forward, steps=steps)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected)), (losses, expected)
    got, want = ckpt.state_dict(), plain.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    now = dict(ckpt.named_parameters())
    assert all(torch.equal(now[n], p) for n, p in base.items())
    assert not any(torch.equal(now[n], p) for n, p in adapters.items() if "lora_A" in n)


@pytest.mark.parametrize("modules, via", [(None, "hf"), ("LlamaDecoderLayer", "blocks")],
                         ids=["hf-hook", "by-name"])
def test_lora_trains_bit_for_bit_as_plain(modules, via, capsys):
    plain, ckpt = lora(llama()), lora(llama())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zoo.set_grad_checkpointing(ckpt, modules=modules) is ckpt
        assert ckpt.get_base_model()._zoo_grad_checkpointing["via"] == via
        assert_same_lora_training(plain, ckpt)
        assert recomputes_with_zoo(lambda b: ckpt(**b).loss, batch())
    plain.print_trainable_parameters()
    ckpt.print_trainable_parameters()
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 2 and shown[0] == shown[1] and "trainable params: 896 " in shown[0]


def layer_calls(model: torch.nn.Module) -> list[bool]:
    """Whether each attention call of one forward and backward ran in a zoo recompute."""
    seen: list[bool] = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a: seen.append(zoo.is_recomputing()))
        for layer in model.get_base_model().model.layers]
    model(**batch()).loss.backward()
    model.zero_grad(set_to_none=True)
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("modules", [None, "LlamaDecoderLayer", "model.layers.1"],
                         ids=["hf-hook", "by-name", "one-by-name"])
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}], ids=["default", "reentrant"])
def test_a_later_gradient_checkpointing_enable_through_peft_keeps_zoo(kwargs, modules):
    """The PeftModel hands ``gradient_checkpointing_enable`` (the Trainer's
    ``gradient_checkpointing=True``) to the Hugging Face model inside, whose hook zoo holds:
    every layer is then checkpointed once, by zoo.checkpoint: each recomputed once, by zoo, not
    wrapped again in torch's checkpoint (which would run each three times); a layer zoo
    checkpoints by name already is not wrapped again; ``enable=False`` turns it all off."""
    model = zoo.set_grad_checkpointing(lora(llama()), modules=modules).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # HF 5 renamed the switch
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert layer_calls(model) == [False] * 2 + [True] * 2
    assert_same_lora_training(lora(llama()), model)
    zoo.set_grad_checkpointing(model, enable=False)  # Hugging Face's switch off with zoo's
    assert layer_calls(model) == [False] * 2
    assert "_set_gradient_checkpointing" not in vars(model.get_base_model())


def test_dotted_names_from_the_peft_model_name_its_layers():
    """Names read off ``peft_model.named_modules()`` reach the layers of the model inside, where
    zoo checkpoints them: only the one named here is recomputed."""
    model = lora(llama()).train()
    zoo.set_grad_checkpointing(model, modules=["base_model.model.model.layers.1"])
    assert layer_calls(model) == [False] * 2 + [True]
    zoo.set_grad_checkpointing(model, modules="model.layers.0")  # the inner model's own names
    assert layer_calls(model) == [False] * 2 + [True]
    zoo.set_grad_checkpointing(model, enable=False)
    assert layer_calls(model) == [False] * 2


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph-breaks", "fullgraph"])
def test_lora_compiled_trains_bit_for_bit_as_eager_plain(fullgraph):
    """Compiled (``aot_eager``: eager kernels, so bit for bit) through the PeftModel. In one
    graph a Llama layer's attention-kernel global, set and undone inside its forward, needs
    torch's switch for side effects under checkpoint (docs/outside-models.md)."""
    switch = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if fullgraph and not hasattr(torch._dynamo.config, switch):
        pytest.skip("this torch's Dynamo has no switch for a region's side effects")
    plain, ckpt = lora(llama()), zoo.set_grad_checkpointing(lora(llama()))
    torch._dynamo.reset()
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=fullgraph)
    patch = {switch: True} if fullgraph else {}
    try:
        with torch._dynamo.config.patch(**patch):
            assert_same_lora_training(plain, ckpt, compiled, steps=2)
    finally:
        torch._dynamo.reset()


def measured_peak(model: torch.nn.Module, opt: torch.optim.Optimizer,
                  inputs: dict[str, torch.Tensor]) -> int:
    """The peak of one training step on ``inputs`` (MemTracker, exact), in the steady state the
    planner predicts: the optimizer's state made by a step before. Leaves the step's gradients."""
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        del loss

    step()
    opt.zero_grad(set_to_none=True)
    return peak_bytes(step, [model, opt])


def test_a_plan_for_lora_is_measured_to_the_byte_and_trains_as_plain():
    """zoo.plan with AdamW over the adapters: only they hold gradients and optimizer state, and
    the step's peak predicted is the peak measured (this CPU, MemTracker), halfway between the
    least and the plain step's peak."""
    plain, model = lora(llama(4)), lora(llama(4))
    opt = adamw(model)
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(model, batch(), 1, optimizer=opt, apply=False)
    least, top = e.value.smallest, e.value.plain
    plan = zoo.plan(model, batch(), (least + top) // 2, optimizer=opt)
    assert least <= plan.predicted_peak <= plan.budget < top and plan.recompute_flops > 0
    assert_same_lora_training(plain, model)
    assert measured_peak(model, opt, batch()) == plan.predicted_peak
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in opt.state} == trained == {id(p) for p in model.parameters()
                                                     if p.grad is not None}
    zoo.set_grad_checkpointing(model, enable=False)  # the plan's regions too
    assert classes(model.merge_and_unload()) == classes(plain.merge_and_unload())


def test_without_padding_sdpa_is_planned_as_the_padded_batch():
    """Documented (docs/outside-models.md): with SDPA, Hugging Face skips the causal mask when
    the batch has no padding, which it cannot tell on the fake tensors zoo plans on; there it
    builds the mask and repeats the keys and values, so the prediction is the padded batch's,
    and the step's measured peak differs (below it on torch 2.14's CPU kernels, above it on
    2.8's). ``attn_implementation="eager"`` is exact with and without padding."""
    model = lora(llama())
    opt = adamw(model)
    ids = batch()["input_ids"]
    unpadded = {"input_ids": ids, "labels": ids}
    predicted = measure_step(model, unpadded, optimizer=opt)[0]
    assert predicted == measure_step(model, batch(), optimizer=opt)[0]
    assert measured_peak(model, opt, unpadded) != predicted
    model = lora(llama(attn="eager"))
    opt = adamw(model)
    for each in (unpadded, batch()):
        assert measured_peak(model, opt, each) == measure_step(model, each, optimizer=opt)[0]


def classes(model: torch.nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


@pytest.mark.parametrize("modules", [None, "LlamaDecoderLayer"], ids=["hf-hook", "by-name"])
@pytest.mark.parametrize("off_first", [True, False], ids=["off-then-merge", "merge-then-off"])
def test_merge_and_unload_gives_the_plain_merged_model(modules, off_first):
    """After training, ``merge_and_unload()`` gives the Hugging Face model with the adapters
    folded in. zoo's state lives on that model, so ``enable=False`` before or after the merge
    leaves nothing of zoo in it: the plain merged model's classes, state_dict and outputs."""
    plain, ckpt = lora(llama()), zoo.set_grad_checkpointing(lora(llama()), modules=modules)
    assert_same_lora_training(plain, ckpt, steps=2)
    want = plain.merge_and_unload().requires_grad_(True)
    if off_first:
        zoo.set_grad_checkpointing(ckpt, enable=False)
        merged = ckpt.merge_and_unload().requires_grad_(True)  # frozen: to take a backward
    else:
        merged = ckpt.merge_and_unload().requires_grad_(True)
        assert recomputes_with_zoo(lambda b: merged(**b).loss, batch())  # still checkpointed
        zoo.set_grad_checkpointing(merged, enable=False)
    assert classes(merged) == classes(want)
    assert not any(k.startswith("_zoo") for m in merged.modules() for k in vars(m))
    assert "_set_gradient_checkpointing" not in vars(merged)
    got, expected = merged.state_dict(), want.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    assert not recomputes_with_zoo(lambda b: merged(**b).loss, batch())
    for train_mode in (True, False):
        outs = []
        for model in (want.train(train_mode), merged.train(train_mode)):
            torch.manual_seed(5)
            outs.append(model(**batch()).logits)
        assert torch.equal(*outs)


class Texts(torch.utils.data.Dataset):
    """Eight padded sequences with labels, for the Trainer."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        mask[12 + i % 4:] = 0
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}


def trainer_steps(model: torch.nn.Module, out: str, checkpointing: bool) -> float:
    """Two steps of the Hugging Face ``Trainer`` on the CPU, its own checkpointing switch
    (``activation_checkpointing``, ``gradient_checkpointing`` before HF 5) as given; the loss."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    switch = "activation_checkpointing" if "activation_checkpointing" in fields \
        else "gradient_checkpointing"
    args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-2, use_cpu=True, report_to=[],
                                          seed=0, save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, **{switch: checkpointing})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Texts())
    return trainer.train().training_loss


def test_the_trainer_with_its_checkpointing_on_trains_lora_as_plain(tmp_path):
    """The Trainer turns its checkpointing on through the PeftModel; zoo's checkpoint stays the
    one in use, and two steps give the plain model's loss and weights bit for bit."""
    pytest.importorskip("accelerate")
    plain, ckpt = lora(llama()), zoo.set_grad_checkpointing(lora(llama()))
    want = trainer_steps(plain, str(tmp_path / "plain"), checkpointing=False)
    assert trainer_steps(ckpt, str(tmp_path / "zoo"), checkpointing=True) == want
    for layer in ckpt.get_base_model().model.layers:
        assert layer.gradient_checkpointing and layer._gradient_checkpointing_func.func is \
            zoo.checkpoint
    got, expected = ckpt.state_dict(), plain.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
