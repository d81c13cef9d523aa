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


# (model, architecture keywords that build nothing trainable, the start of the error)
NONSENSE = [
    ("vit_cifar", {"depth": 0}, "depth must be an int >= 1 (the number of transformer blocks)"),
    ("rev_vit_cifar", {"depth": 0}, "depth must be an int >= 1"),
    ("vit_cifar", {"num_heads": 0}, "num_heads must be an int >= 1 (attention heads), got 0"),
    ("vit_cifar", {"embed_dim": -8}, "embed_dim must be an int >= 1 (the width), got -8"),
    ("vit_cifar", {"patch_size": 0}, "patch_size must be an int >= 1"),
    ("vit_cifar", {"mlp_ratio": 0.0}, "mlp_ratio must give the MLP at least one hidden unit"),
    ("vit_cifar", {"drop_path_rate": 1.0}, "drop_path_rate must be a rate in [0, 1)"),
    ("bert_base", {"depth": -1}, "depth must be an int >= 1"),
    ("rev_bert_base", {"num_heads": 0}, "num_heads must be an int >= 1"),
    ("bert_base", {"max_positions": 0}, "max_positions must be an int >= 1"),
    ("gpt2_small", {"depth": 0}, "depth must be an int >= 1"),
    ("gpt2_small", {"context_length": 0}, "context_length must be an int >= 1"),
    ("densenet40", {"growth_rate": 0}, "growth_rate must be an int >= 1 (k, the channels each"),
    ("densenet121", {"num_init_features": 0}, "num_init_features must be an int >= 1"),
    ("densenet_bc_100", {"bn_size": 0}, "bn_size must be an int >= 1"),
    ("densenet40", {"drop_rate": 1.0}, "drop_rate must be a rate in [0, 1)"),
]


@pytest.mark.parametrize("name,kwargs,message", NONSENSE,
                         ids=[f"{n}-{next(iter(k))}" for n, k, _ in NONSENSE])
def test_sizes_that_build_nothing_trainable_are_refused_by_name(name, kwargs, message):
    """A zero depth, width, head count or growth built a model of no blocks or of empty layers
    that trained without a word (or failed later under another name): refused at construction,
    for library users and train.py alike."""
    with pytest.raises(ValueError) as err, torch.device("meta"):
        zoo.create_model(name, **kwargs)
    assert str(err.value).startswith(message), err.value


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


# -- architecture arguments: the variant's are defaults that create_model's keywords override ----
# Parameter counts of every registered variant as built before its arguments became overridable.
PARAMS = {
    "bert_base": 109483778, "cifar_cnn": 2196266, "densenet121": 7978856, "densenet161": 28681000,
    "densenet169": 14149480, "densenet201": 20013928, "densenet264": 33337704,
    "densenet40": 1019722, "densenet_bc_100": 769162, "densenet_bc_190": 25624430,
    "densenet_bc_250": 15324406, "gpt2_small": 124439808, "resnet101": 44549160,
    "resnet110": 1727962, "resnet1202": 19421274, "resnet152": 60192808, "resnet18": 11689512,
    "resnet20": 269722, "resnet32": 464154, "resnet34": 21797672, "resnet44": 658586,
    "resnet50": 25557032, "resnet56": 853018, "rev_bert_base": 109485314,
    "rev_vit_base_patch16_224": 86567656, "rev_vit_cifar": 3722250,
    "rev_vit_small_patch16_224": 22050664, "revnet110": 1729194, "revnet164": 1748778,
    "revnet38": 464890, "vit_base_patch16_224": 86567656, "vit_cifar": 3722250,
    "vit_small_patch16_224": 22050664}


def _overrides() -> dict:
    """name -> (the family's class, the keyword overridden, every architecture argument of the
    variant with that one overridden); each override shrinks the model so the test stays cheap."""
    from zoo.models.bert import Bert
    from zoo.models.cifar_cnn import CifarCNN
    from zoo.models.densenet import DenseNet
    from zoo.models.gpt2 import GPT2
    from zoo.models.resnet import BasicBlock, Bottleneck, CifarResNet, ResNet
    from zoo.models.rev_bert import RevBert
    from zoo.models.rev_vit import RevVisionTransformer
    from zoo.models.revnet import RevNet
    from zoo.models.vit import VisionTransformer

    bc = dict(bn_size=4, compression=0.5, stem="cifar", num_classes=10)
    cifar_vit = dict(img_size=32, patch_size=4, embed_dim=256, depth=2, num_heads=4,
                     mlp_ratio=2.0, num_classes=10)
    bert = dict(vocab_size=30522, max_positions=512, embed_dim=96, depth=12, num_heads=12)
    table = {f"resnet{d}": (CifarResNet, "depth", dict(depth=20 if d != 20 else 32))
             for d in (20, 32, 44, 56, 110, 1202)}
    table.update({name: (ResNet, "layers", dict(block=block, layers=(1, 1, 1, 1))) for name, block
                  in [("resnet18", BasicBlock), ("resnet34", BasicBlock), ("resnet50", Bottleneck),
                      ("resnet101", Bottleneck), ("resnet152", Bottleneck)]})
    table["densenet121"] = (DenseNet, "growth_rate", dict(
        growth_rate=4, block_config=(6, 12, 24, 16), num_init_features=64))
    table.update({name: (DenseNet, "block_config", dict(growth_rate=k, block_config=(1, 2, 2, 1),
                                                        num_init_features=stem))
                  for name, k, stem in [("densenet161", 48, 96), ("densenet169", 32, 64),
                                        ("densenet201", 32, 64), ("densenet264", 32, 64)]})
    table.update({
        "densenet40": (DenseNet, "block_config", dict(
            growth_rate=12, block_config=(2, 2, 2), num_init_features=16, bn_size=None,
            compression=1.0, stem="cifar", num_classes=10)),
        "densenet_bc_100": (DenseNet, "growth_rate", dict(
            growth_rate=6, block_config=(16,) * 3, num_init_features=24, **bc)),
        "densenet_bc_190": (DenseNet, "block_config", dict(
            growth_rate=40, block_config=(1, 2, 1), num_init_features=80, **bc)),
        "densenet_bc_250": (DenseNet, "block_config", dict(
            growth_rate=24, block_config=(2, 2, 2), num_init_features=48, **bc)),
        "cifar_cnn": (CifarCNN, "batch_norm", dict(num_classes=10, image_size=32,
                                                   batch_norm=False)),
        "vit_cifar": (VisionTransformer, "depth", cifar_vit),
        "rev_vit_cifar": (RevVisionTransformer, "depth", cifar_vit),
        "bert_base": (Bert, "embed_dim", bert),
        "rev_bert_base": (RevBert, "embed_dim", bert),
        "gpt2_small": (GPT2, "embed_dim", dict(num_classes=50257, context_length=1024,
                                               embed_dim=96, depth=12, num_heads=12)),
        "revnet38": (RevNet, "channels", dict(units=(3, 3, 3), channels=(16, 16, 32, 64))),
        "revnet110": (RevNet, "units", dict(units=(1, 1, 1), channels=(32, 32, 64, 128))),
        "revnet164": (RevNet, "units", dict(units=(1, 1, 1), channels=(32, 128, 256, 512),
                                            bottleneck=True))})
    for name, heads in [("small", 6), ("base", 12)]:
        vit = dict(img_size=224, patch_size=16, embed_dim=96, depth=12, num_heads=heads)
        table[f"vit_{name}_patch16_224"] = (VisionTransformer, "embed_dim", vit)
        table[f"rev_vit_{name}_patch16_224"] = (RevVisionTransformer, "embed_dim", vit)
    return table


def test_every_model_keeps_its_parameter_count():
    counts = {}
    for name in zoo.list_models():
        with torch.device("meta"):
            counts[name] = sum(p.numel() for p in zoo.create_model(name).parameters())
    assert counts == PARAMS


def test_every_model_has_an_architecture_override_below():
    assert sorted(_overrides()) == zoo.list_models()


@pytest.mark.parametrize("name", zoo.list_models())
def test_an_architecture_argument_overrides_the_variants(name):
    """``create_model(name, key=value)`` is the family's class built with the variant's arguments
    and ``key=value`` (timm's ``dict(model_args, **kwargs)``): same tensors, same forward bit for
    bit under the same seed; the model keeps its registered name."""
    cls, key, args = _overrides()[name]
    torch.manual_seed(0)
    ours = zoo.create_model(name, **{key: args[key]})
    torch.manual_seed(0)
    theirs = cls(**args)
    assert ours.architecture == name
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in theirs.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) != PARAMS[name]
    x = ours.example_input(2)
    with torch.no_grad():
        torch.manual_seed(1)
        out = ours(x)
        torch.manual_seed(1)
        torch.testing.assert_close(theirs(x), out, rtol=0, atol=0)


@pytest.mark.parametrize("name", zoo.list_models())
def test_an_unknown_keyword_is_one_line_naming_the_model_and_the_keyword(name):
    with pytest.raises(TypeError, match="efficent") as err:
        zoo.create_model(name, efficent=True)
    assert "\n" not in str(err.value) and repr(name) in str(err.value)
    assert "did you mean 'efficient'" in str(err.value)
