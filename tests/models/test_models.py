"""Every registered model: the uniform interface, and every checkpoint mode equals the plain model.

Parametrized over ``zoo.list_models()``, so a newly registered model is tested without a line
here. Equivalence is checked in train mode (BatchNorm batch statistics and dropout active): same
outputs, same gradients, same parameters and buffers after two SGD steps, same state_dict keys,
and lower peak memory (exact, MemTracker).
"""
from __future__ import annotations

import pytest
import torch

import zoo
from helpers import assert_same_training, train_step_peak
from zoo.memory import default_loss

# Big enough that CI time matters. They are marked slow (they still run in CI) and get the cheap
# generic tests plus the equivalence test of their recommended (efficient=True) mode; every finer
# mode is exercised on the smaller models of the same family, which share the block code, and the
# families' own test files measure their peaks at representative sizes (at the tiny inputs used
# here, a giant's peak is its parameters and gradients, not its activations).
GIANTS = {"densenet_bc_190", "densenet_bc_250", "densenet161", "densenet201", "densenet264",
          "resnet1202", "resnet101", "resnet152", "vit_base_patch16_224", "bert_base",
          "gpt2_small", "revnet164", "rev_vit_base_patch16_224", "rev_bert_base"}
# Not giants, yet each of their modes takes tens of seconds to train twice beside plain
# (DenseNet-121: 40-50 CPU-seconds a mode on 2 cores): marked slow as well, with all their modes.
# Their block code is exercised in the fast lane by the CIFAR models of the same family
# (ResNet-18 and ResNet-50 stay there: the ImageNet basic and bottleneck blocks).
LARGE = {"densenet121", "densenet169", "resnet34", "vit_small_patch16_224",
         "rev_vit_small_patch16_224", "resnet110", "revnet110"}  # (resnet56, revnet38: same blocks)
REQUIRED = ["densenet40", "densenet_bc_100", "densenet_bc_190", "densenet_bc_250", "densenet121",
            "densenet161", "densenet169", "densenet201", "densenet264", "resnet20", "resnet32",
            "resnet44", "resnet56", "resnet110", "resnet1202", "resnet18", "resnet34", "resnet50",
            "resnet101", "resnet152", "cifar_cnn", "vit_cifar", "vit_small_patch16_224",
            "vit_base_patch16_224", "bert_base", "gpt2_small", "revnet38", "revnet110",
            "revnet164", "rev_vit_cifar", "rev_vit_small_patch16_224", "rev_vit_base_patch16_224",
            "rev_bert_base"]


def names(slow_giants: bool = True) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if slow_giants and n in GIANTS | LARGE
            else n for n in zoo.list_models()]


def modes(giants: bool = True) -> list:
    """(name, mode) pairs: every mode of every model; a giant only with its recommended mode
    (``giants=False`` leaves giants out)."""
    params = []
    for n in zoo.list_models():
        if n in GIANTS and not giants:
            continue
        for mode in _modes_of(n)[:1] if n in GIANTS else _modes_of(n):
            marks = [pytest.mark.slow] if n in GIANTS | LARGE else []
            params.append(pytest.param(n, mode, marks=marks, id=f"{n}-{mode}"))
    return params


def _modes_of(name: str) -> tuple[str, ...]:
    with torch.device("meta"):
        return zoo.create_model(name).checkpoint_modes


def test_every_required_model_is_registered():
    assert sorted(set(REQUIRED) - set(zoo.list_models())) == []


def test_unknown_model_lists_close_names():
    with pytest.raises(zoo.models.UnknownModelError, match="densenet_bc_100"):
        zoo.create_model("densenet_bc100")


def test_register_refuses_duplicates():
    def resnet20(**kwargs):
        raise AssertionError("never built")

    with pytest.raises(ValueError, match="already registered"):
        zoo.register_model(resnet20)


def test_list_models_pattern():
    assert zoo.list_models("resnet*") and all(n.startswith("resnet") for n in zoo.list_models("resnet*"))


@pytest.mark.parametrize("name", names())
def test_interface_forward_and_every_parameter_gets_a_gradient(name):
    torch.manual_seed(0)
    model = zoo.create_model(name)
    assert isinstance(model, zoo.ZooModel)
    assert model.checkpoint_modes and model.grad_checkpointing is None
    x = model.example_input(2)
    features = model.forward_features(x)
    pooled = model.forward_head(features, pre_logits=True)
    assert pooled.shape[0] == 2 and pooled.shape[-1] == model.num_features
    out = model(x)
    assert out.shape[0] == 2 and out.shape[-1] == model.num_classes
    assert torch.isfinite(out).all()
    default_loss(out).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == [], f"parameters without gradient: {missing[:5]}"


@pytest.mark.parametrize("name", names())
def test_num_classes_and_efficient_flag(name):
    with torch.device("meta"):
        model = zoo.create_model(name, num_classes=7, efficient=True)
    assert model.num_classes == 7
    assert model.grad_checkpointing == model.checkpoint_modes[0]
    model.set_grad_checkpointing(False)
    assert model.grad_checkpointing is None
    with pytest.raises(ValueError, match="no checkpointing mode"):
        model.set_grad_checkpointing("no-such-mode")


@pytest.mark.parametrize("name,mode", modes())
def test_mode_trains_exactly_like_plain(name, mode):
    torch.manual_seed(0)
    plain = zoo.create_model(name)
    ckpt = zoo.create_model(name, efficient=mode)
    assert ckpt.grad_checkpointing == mode
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = plain.example_input(2)
    assert_same_training(plain, plain, ckpt, ckpt, x)


@pytest.mark.parametrize("name,mode", modes(giants=False))
def test_mode_lowers_peak_memory(name, mode):
    torch.manual_seed(0)
    model = zoo.create_model(name)
    x = model.example_input(4)

    plain = train_step_peak(model, x)
    model.set_grad_checkpointing(mode)
    assert train_step_peak(model, x) < plain


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n
                                  for n in zoo.list_models() if n not in GIANTS])
def test_chain_cut_at_every_block_trains_exactly_like_plain(name):
    """The planner may cut the chain anywhere: every element checkpointed as its own segment
    (none may start with an in-place op that overwrites its saved input) equals the plain model."""
    torch.manual_seed(0)
    plain, ckpt = zoo.create_model(name), zoo.create_model(name)
    n = len(ckpt.checkpoint_chain())
    ckpt.set_checkpoint_plan([(i, i + 1, True) for i in range(n)])
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2), steps=1)


@pytest.mark.parametrize("name", names())
def test_no_grad_forward_is_the_same_with_checkpointing(name):
    """Under no_grad a checkpointed model runs its plain forward: in train mode (batch statistics,
    dropout, BatchNorm running-stat updates) outputs and buffers equal the plain model's."""
    torch.manual_seed(0)
    plain = zoo.create_model(name)
    ckpt = zoo.create_model(name, efficient=True)
    ckpt.load_state_dict(plain.state_dict())
    x = plain.example_input(2)
    with torch.no_grad():
        torch.manual_seed(1)
        ref = plain(x)
        torch.manual_seed(1)
        out = ckpt(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for (name_, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"buffer {name_} differs")
