"""zoo.set_grad_checkpointing on Hugging Face models built offline from small configs: exactly the
plain model with dropout on, lighter, recomputed by zoo.checkpoint, still after a later
gradient_checkpointing_enable(), and plain again after enable=False. transformers is a test
dependency only: zoo itself must import without it."""
from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import warnings

import pytest
import torch

import zoo
from helpers import assert_same_training
from test_integrations import assert_exact_lighter_and_undone, recomputes_with_zoo

transformers = pytest.importorskip("transformers")


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64)
    return transformers.BertModel(config)


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2,
                                     n_positions=64)
    return transformers.GPT2Model(config)


def gpt2_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).last_hidden_state


def token_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(3))


def bert_hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("build,call", [(bert, bert_hidden), (gpt2, gpt2_hidden)],
                         ids=["bert", "gpt2"])
def test_hf_model_is_exact_lighter_and_undone(build, call):
    model = build()
    config = model.config
    assert getattr(config, "hidden_dropout_prob", None) or config.resid_pdrop  # dropout is on
    ckpt = assert_exact_lighter_and_undone(model, token_ids(), call=call, via="hf")
    assert "_set_gradient_checkpointing" not in ckpt.__dict__
    assert not any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())


def _hf_enable_calls(model: torch.nn.Module) -> list:
    """HF's public switches on this version: gradient_checkpointing_enable (and its successor
    activation_checkpointing_enable where it exists), with and without torch's keywords."""
    calls = [lambda: model.gradient_checkpointing_enable(),
             lambda: model.gradient_checkpointing_enable(
                 gradient_checkpointing_kwargs={"use_reentrant": True})]
    if hasattr(model, "activation_checkpointing_enable"):
        calls.append(lambda: model.activation_checkpointing_enable())
    return calls


def test_hf_later_gradient_checkpointing_enable_keeps_zoo():
    model = zoo.set_grad_checkpointing(gpt2())
    ids = token_ids()
    for enable in _hf_enable_calls(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # HF 5 renamed the switch
            enable()
        assert recomputes_with_zoo(lambda t: gpt2_hidden(model, t), ids)
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    assert not recomputes_with_zoo(lambda t: gpt2_hidden(model, t), ids)
    plain = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plain.gradient_checkpointing_enable()  # untouched by zoo: torch's checkpoint
    assert not recomputes_with_zoo(lambda t: gpt2_hidden(plain, t), ids)


def test_hf_deepcopy_keeps_zoo_on_the_copy():
    model = zoo.set_grad_checkpointing(bert())
    twin = copy.deepcopy(model)
    assert twin.__dict__["_set_gradient_checkpointing"].model is twin
    zoo.set_grad_checkpointing(model, enable=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        twin.gradient_checkpointing_enable()
    assert recomputes_with_zoo(lambda t: bert_hidden(twin, t), token_ids())


def test_hf_torch_keywords_reach_zoo_checkpoint():
    """gradient_checkpointing_kwargs (torch's keywords) are passed on to zoo.checkpoint, which
    takes them: a context_fn is entered around the forward and the recompute, not dropped."""
    model = zoo.set_grad_checkpointing(bert())
    entered = []

    @contextlib.contextmanager
    def note(what: str):
        entered.append(what)
        yield

    kwargs = {"use_reentrant": True, "context_fn": lambda: (note("forward"), note("recompute"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert recomputes_with_zoo(lambda t: bert_hidden(model, t), token_ids())
    layers = model.config.num_hidden_layers
    assert entered.count("forward") == layers and entered.count("recompute") == layers


def test_zoo_imports_without_transformers():
    code = "import sys, zoo; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_other_checkpoint_function_is_kept_with_a_warning():
    """A function that is not torch's checkpoint (HF's offload=True wraps it) is the user's
    choice: kept, and the warning says zoo's checkpoint is no longer the one in use."""
    model = zoo.set_grad_checkpointing(gpt2())
    calls = []

    def custom(function, *args, **kwargs):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    with pytest.warns(UserWarning, match="not zoo.checkpoint; BatchNorm stays exact"):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=custom)
    assert not recomputes_with_zoo(lambda t: gpt2_hidden(model, t), token_ids())
    assert len(calls) == model.config.n_layer


def test_hf_blocks_checkpointed_by_name_leave_the_cache_unwritten_as_hf_does():
    """Chosen blocks (``modules=``, a plan) run through zoo's region, not Hugging Face's flag:
    GPT-2 builds its key/value cache by default and hands it to each block, which writes it, so
    a recompute would write it twice (keys doubled, a padded mask then of the wrong length).
    The block runs without it, as under Hugging Face's own checkpointing."""
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[:, 40:] = 0
    plain, ckpt = gpt2(), zoo.set_grad_checkpointing(gpt2(), modules="GPT2Block")
    recomputed = []
    for block in ckpt.h:
        block.attn.register_forward_pre_hook(lambda m, a: recomputed.append(zoo.is_recomputing()))
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(0)
        out = model(input_ids=ids, attention_mask=mask)
        out.last_hidden_state.square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert recomputed == [False] * 3 + [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert all(layer.keys is None for layer in out.past_key_values.layers)



def test_hf_blocks_checkpointed_by_name_compile_in_one_graph():
    """Blocks chosen by name compile with fullgraph=True, as the plain model does: finding the
    key/value cache among a block's arguments is an isinstance Dynamo traces, not a walk of each
    argument's MRO (which Dynamo cannot iterate). Trained against the eager plain model, dropout
    on, bit for bit."""
    plain = gpt2()
    ckpt = zoo.set_grad_checkpointing(copy.deepcopy(plain), modules="GPT2Block")
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=True)
    assert_same_training(plain, lambda t: gpt2_hidden(plain, t), ckpt,
                         lambda t: gpt2_hidden(compiled, t), token_ids(), steps=2, exact=True)


@pytest.mark.skipif(not hasattr(torch._dynamo.config,
                                "skip_fwd_side_effects_in_bwd_under_checkpoint"),
                    reason="this torch's Dynamo has no switch for a region's side effects")
def test_llama_blocks_compile_in_one_graph_with_dynamos_side_effect_switch():
    """A Llama decoder layer sets a global for its attention's kernels and undoes it inside its
    forward; Dynamo refuses that inside any checkpoint under fullgraph=True unless told the
    backward need not replay it (torch's own switch, named in its message). With it, the layers
    checkpointed by name train as the eager plain model does, attention dropout on, bit for
    bit."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.1)
    plain = transformers.LlamaModel(config).train()
    ckpt = zoo.set_grad_checkpointing(copy.deepcopy(plain), modules="LlamaDecoderLayer")
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        assert_same_training(plain, lambda t: plain(input_ids=t).last_hidden_state, ckpt,
                             lambda t: compiled(input_ids=t).last_hidden_state, token_ids(),
                             steps=2, exact=True)
    torch._dynamo.reset()
