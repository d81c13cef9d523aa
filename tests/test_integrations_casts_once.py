"""zoo.set_grad_checkpointing(..., casts_once=True): a model outside the zoo run without
autocast's cache of parameter casts, exactly the plain model under bf16 autocast with the cache,
lighter where its checkpointed blocks' weight copies were held to the forward's end, and refused
in one line where a parameter is cast twice (there the cache changes the gradients)."""
from __future__ import annotations

import copy
import io
import types
from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training, freed_at_autocast_exit
from zoo._torch import get_current_dispatch_mode
from zoo.checkpoint import CastTwiceError, set_casts_once

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")


def bf16(model: nn.Module, call: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call(model, x).float()
    return run


def hf_bert() -> nn.Module:
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64)
    return transformers.BertModel(config)


def hf_gpt2_head() -> nn.Module:  # its head's weight is the token embedding's (tied)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2,
                                     n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def timm_vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3)


def token_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(3))


CASES = {  # build, forward, input
    "hf_bert": (hf_bert, lambda m, x: m(input_ids=x).last_hidden_state, token_ids),
    "hf_gpt2_tied": (hf_gpt2_head, lambda m, x: m(input_ids=x, use_cache=False).logits,
                     token_ids),
    "timm_vit": (timm_vit, lambda m, x: m(x), lambda: torch.randn(2, 3, 32, 32)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_casts_once_trains_like_the_plain_model_with_the_cache_bit_for_bit(name):
    build, call, make_input = CASES[name]
    torch.manual_seed(0)
    plain = build()
    model = zoo.set_grad_checkpointing(copy.deepcopy(plain), casts_once=True)
    assert_same_training(plain, bf16(plain, call), model, bf16(model, call), make_input(),
                         steps=2, exact=True)
    assert torch.is_autocast_cache_enabled()


def test_casts_once_leaves_no_weight_copy_of_a_checkpointed_block_to_the_forwards_end():
    torch.manual_seed(0)
    cached = zoo.set_grad_checkpointing(timm_vit())
    uncached = zoo.set_grad_checkpointing(copy.deepcopy(cached), casts_once=True)
    x = torch.randn(4, 3, 32, 32)
    block_weights = sum(2 * p.numel() for p in cached.blocks.parameters() if p.dim() > 1)
    # with the cache: the blocks' weight copies and the stored parts' unsaved casts
    assert freed_at_autocast_exit(cached, partial(cached, x)) > block_weights
    # its first forward under autocast, counted too, holds none
    assert freed_at_autocast_exit(uncached, partial(uncached, x)) == 0


class TwiceUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.tanh(self.shared(x)))


def albert() -> nn.Module:  # one layer's weights run by every layer
    config = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32,
                                       num_hidden_layers=3, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64)
    return transformers.AlbertModel(config)


@pytest.mark.parametrize("build,modules,x,name", [
    (TwiceUsed, ["shared"], torch.randn(4, 16), "shared.bias"),
    (albert, None, token_ids(),
     "encoder.albert_layer_groups.0.albert_layers.0.attention.query.bias")],
    ids=["user_module", "hf_albert"])
def test_a_parameter_cast_twice_is_refused_in_one_line_and_the_cache_is_on_again(build, modules,
                                                                                 x, name):
    torch.manual_seed(0)
    model = zoo.set_grad_checkpointing(build(), modules=modules, casts_once=True)
    for _ in range(2):  # not taken for checked after a refusal
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(CastTwiceError, match=f"casts {name} more than once") as err:
            model(x)
        assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
        assert torch.is_autocast_cache_enabled()
    assert get_current_dispatch_mode() is None  # the count ended with the forward


def test_casts_once_leaves_a_forward_without_autocast_or_gradients_untouched():
    model = set_casts_once(TwiceUsed())
    x = torch.randn(4, 16)
    model(x).sum().backward()  # float32: nothing cast, nothing checked
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # no gradients: the cache changes no value, so it stays
        assert torch.is_autocast_cache_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(CastTwiceError):
        model(x)


def test_an_input_that_wants_its_gradient_keeps_the_cache_as_the_plain_model():
    # the input feeds two Linears: cast twice, its gradient would sum in float32 without the
    # cache; the check (on a forward whose input wanted no gradient) spoke for parameters only
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x)

    torch.manual_seed(0)
    plain = TwoHeads()
    model = set_casts_once(copy.deepcopy(plain))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 16))  # checked: every parameter cast once
    grads = []
    for m in (plain, model):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x).float().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_casts_once_after_a_forward_that_raised_puts_the_cache_back_and_checks_again():
    model = set_casts_once(nn.Linear(16, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 3))
        assert torch.is_autocast_cache_enabled()
        assert get_current_dispatch_mode() is None
        model(torch.randn(4, 16))


def test_casts_once_is_undone_with_checkpointing_and_kept_by_deepcopy_and_torch_save():
    torch.manual_seed(0)
    model = zoo.set_grad_checkpointing(TwiceUsed(), modules=["shared"], casts_once=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    twins = [copy.deepcopy(model), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
    zoo.set_grad_checkpointing(model, enable=False)
    assert type(model) is TwiceUsed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 16))  # plain again: the cache shares the cast
        for twin in twins:
            assert type(twin).__name__ == "TwiceUsed" and isinstance(twin, TwiceUsed)
            with pytest.raises(CastTwiceError):
                twin(torch.randn(4, 16))


def test_casts_once_compiles_with_fullgraph_like_the_plain_model():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    model = zoo.set_grad_checkpointing(copy.deepcopy(plain), modules=[nn.Linear],
                                       casts_once=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_plain = torch.compile(plain, backend="aot_eager", fullgraph=True)
    assert_same_training(plain, bf16(compiled_plain, lambda m, x: m(x)), model,
                         bf16(compiled, lambda m, x: m(x)), torch.randn(4, 16), exact=True)


def _autocast_wrapped(model: nn.Module) -> nn.Module:
    """``model`` with its forward wrapped in bf16 autocast as Accelerate's ``prepare`` wraps it
    under mixed precision: the class's forward, taken from the bound method, as an attribute."""
    model.forward = types.MethodType(
        torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__), model)
    return model


def test_casts_once_runs_inside_a_forward_wrapped_in_autocast_later():
    torch.manual_seed(0)
    plain = hf_bert()
    model = zoo.set_grad_checkpointing(copy.deepcopy(plain), casts_once=True)
    call = lambda m, x: m(input_ids=x).last_hidden_state.float()  # noqa: E731
    assert_same_training(_autocast_wrapped(plain), partial(call, plain),
                         _autocast_wrapped(model), partial(call, model), token_ids(),
                         exact=True)
    twice = zoo.set_grad_checkpointing(TwiceUsed(), modules=["shared"], casts_once=True)
    with pytest.raises(CastTwiceError):  # the count runs inside the wrapper's autocast
        _autocast_wrapped(twice)(torch.randn(4, 16))


def test_casts_once_after_the_forward_was_wrapped_says_it_takes_no_effect():
    model = _autocast_wrapped(TwiceUsed())  # wraps the class's forward before the swap
    with pytest.warns(UserWarning, match="already wrapped .* before the wrapping"):
        zoo.set_grad_checkpointing(model, modules=["shared"], casts_once=True)
    model(torch.randn(4, 16))  # the old forward: cached, nothing counted, nothing refused


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": torch.tensor(i % 2)}


def _trainer_steps(model: nn.Module, out: str) -> nn.Module:
    """Two bf16 steps of the Hugging Face ``Trainer`` on the CPU (Accelerate wraps the model's
    forward in autocast: autocast is entered inside the model's call)."""
    args = transformers.TrainingArguments(out, per_device_train_batch_size=4, max_steps=2,
                                          bf16=True, use_cpu=True, report_to=[], seed=0,
                                          save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
    return model


def test_the_hugging_face_trainer_in_bf16_trains_casts_once_like_the_plain_model(tmp_path):
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64)
    plain = transformers.BertForSequenceClassification(config)
    model = zoo.set_grad_checkpointing(copy.deepcopy(plain), casts_once=True)
    _trainer_steps(plain, str(tmp_path / "plain"))
    _trainer_steps(model, str(tmp_path / "casts_once"))
    assert model.__dict__["_zoo_casts_once"]["checked"]  # it ran, under the Trainer's autocast
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
