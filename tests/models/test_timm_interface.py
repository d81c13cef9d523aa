"""zoo models speak timm's model interface, checked as timm's own tests check it.

Ported from timm's tests/test_models.py (pytorch-image-models), each test naming its original;
zoo's versions also check values against the plain model, not only shapes. Plus
``create_model(pretrained=True)`` through torch's hub cache, and create_model's argument errors.
"""
from __future__ import annotations

import os

import pytest
import torch
import torchvision

import zoo
from helpers import assert_same_training
from zoo.models._features import FeatureStages
from zoo.models._pretrained import weights_file
from zoo.memory import default_loss
from zoo.models.densenet import DenseNet

GIANTS = {"densenet_bc_190", "densenet_bc_250", "densenet161", "densenet201", "densenet264",
          "resnet1202", "resnet101", "resnet152", "vit_base_patch16_224", "bert_base",
          "gpt2_small", "revnet164", "rev_vit_base_patch16_224", "rev_bert_base"}
SMALL = [n for n in zoo.list_models() if n not in GIANTS]


# A deep RevNet in eval mode with BatchNorm's initial statistics (mean 0, variance 1) grows past
# the 16384 that float32's int32 streams hold, and says so with NaN (zoo.reversible's range
# check); float64's int64 streams hold it. Trained statistics keep the activations in range.
WIDE_GRID = {"revnet110"}


def _eval_model(name: str, **kwargs) -> torch.nn.Module:
    """``create_model(name, **kwargs)`` in eval mode, in float64 where float32's grid is short."""
    model = zoo.create_model(name, **kwargs).eval()
    return model.double() if name in WIDE_GRID else model


def _like(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x.to(next(model.parameters()).dtype)


def _is_cnn(name: str) -> bool:
    with torch.device("meta"):
        return isinstance(zoo.create_model(name), FeatureStages)


CNNS = [n for n in SMALL if _is_cnn(n)]


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message, message
    return message


# -- pretrained_cfg and timm's data-config resolution ------------------------------------------
CFG_KEYS = ("architecture", "input_size", "fixed_input_size", "interpolation", "crop_pct",
            "crop_mode", "mean", "std", "num_classes", "pool_size", "first_conv", "classifier")
IMAGE_KEYS = ("mean", "std", "interpolation", "crop_pct", "crop_mode")


@pytest.mark.parametrize("name", zoo.list_models())
def test_timms_data_config_resolution_reads_every_models_own_settings(name):
    """timm's ``resolve_data_config`` and ``resolve_model_data_config`` take every setting from
    the model's ``pretrained_cfg`` (none from timm's defaults), and the evaluation transform
    they describe makes an input the model takes. A language model's input is token ids: its
    ``input_size`` is the longest sequence and the image settings are timm's "none"."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config, resolve_model_data_config

    with torch.device("meta"):
        model = zoo.create_model(name).eval()
    cfg = model.pretrained_cfg
    assert set(CFG_KEYS) <= set(cfg) and cfg["architecture"] == name
    resolved = resolve_model_data_config(model)
    assert resolved == resolve_data_config(model=model)
    assert resolved["input_size"] == cfg["input_size"]
    if len(cfg["input_size"]) == 1:  # token ids (B, T)
        assert all(cfg[k] is None for k in (*IMAGE_KEYS, "pool_size"))
        ids = torch.zeros(1, *cfg["input_size"], dtype=torch.long, device="meta")
        assert model(ids).shape[0] == 1
        return
    assert {k: resolved[k] for k in IMAGE_KEYS} == {k: cfg[k] for k in IMAGE_KEYS}
    assert len(cfg["mean"]) == len(cfg["std"]) == cfg["input_size"][0]
    channels, height, width = cfg["input_size"]
    image = Image.new("RGB", (width + 13, height + 7))
    x = create_transform(**resolved)(image)
    assert x.shape == cfg["input_size"]
    with torch.no_grad():
        assert model(x[None].to("meta")).shape == (1, model.num_classes)


# -- classifier and pooling (timm: test_model_default_cfgs, test_model_backward) ------------------
@pytest.mark.parametrize("name", SMALL)
def test_default_cfg_names_and_pre_logits_match_reset_classifier_zero(name):
    """timm's test_model_default_cfgs: cfg's classifier/first_conv name real weights;
    ``forward_head(pre_logits=True)`` has width ``head_hidden_size`` and equals ``forward`` after
    ``reset_classifier(0)`` (values too, in eval mode)."""
    torch.manual_seed(0)
    model = _eval_model(name)
    cfg, state = model.pretrained_cfg, model.state_dict()
    assert model.default_cfg == cfg and cfg["num_classes"] == model.num_classes
    assert cfg["classifier"] + ".weight" in state
    assert model.get_classifier() is model.get_submodule(cfg["classifier"])
    if cfg["first_conv"] is not None:
        assert cfg["first_conv"] + ".weight" in state
    x = _like(model, model.example_input(2))
    with torch.no_grad():
        pre = model.forward_head(model.forward_features(x), pre_logits=True)
        assert pre.shape == (2, model.head_hidden_size)
        model.reset_classifier(0)
        assert model.num_classes == 0 and isinstance(model.get_classifier(), torch.nn.Identity)
        torch.testing.assert_close(model(x), pre, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in CNNS if n != "cifar_cnn"])
def test_no_global_pool_gives_feature_maps_of_pool_size(name):
    """timm's test_model_default_cfgs: ``reset_classifier(0, '')`` and ``create_model(...,
    num_classes=0, global_pool='')`` return the unpooled maps, ``pool_size`` at ``input_size``."""
    torch.manual_seed(0)
    model = _eval_model(name)
    cfg = model.pretrained_cfg
    x = _like(model, torch.randn(1, *cfg["input_size"]))
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape[1:] == (model.num_features, *cfg["pool_size"])
        model.reset_classifier(0, "")
        torch.testing.assert_close(model(x), features, rtol=0, atol=0)
        built = _eval_model(name, num_classes=0, global_pool="")
        assert built(x).shape == features.shape
    with pytest.raises(ValueError, match="num_classes=0") as err:
        model.reset_classifier(5, "")
    _one_line(err)
    with pytest.raises(ValueError, match="global_pool") as err:
        model.reset_classifier(0, "max")
    _one_line(err)


@pytest.mark.parametrize("name", SMALL)
def test_num_classes_zero_trains_and_returns_pooled_features(name):
    """timm's test_model_backward (its encoder-only branch): ``num_classes=0`` builds no
    zero-wide Linear; the output is pooled features of width ``num_features`` and every
    parameter gets a gradient."""
    torch.manual_seed(0)
    if name == "gpt2_small":
        with pytest.raises(ValueError, match="vocabulary") as err:
            zoo.create_model(name, num_classes=0)
        _one_line(err)
        return
    model = zoo.create_model(name, num_classes=0)
    assert model.num_classes == 0 and isinstance(model.get_classifier(), torch.nn.Identity)
    assert not any(p.numel() == 0 for p in model.parameters())
    out = model(model.example_input(2))
    assert out.shape == (2, model.num_features)
    default_loss(out).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", SMALL)
def test_reset_classifier_gives_a_new_head_and_keeps_the_state_dict_names(name):
    torch.manual_seed(0)
    model = zoo.create_model(name)
    keys = list(model.state_dict())
    if name == "gpt2_small":
        with pytest.raises(ValueError, match="tied") as err:
            model.reset_classifier(7)
        _one_line(err)
        return
    model.reset_classifier(7)
    assert model.num_classes == 7 and model.get_classifier().out_features == 7
    assert list(model.state_dict()) == keys
    assert model(model.example_input(2)).shape == (2, 7)
    with pytest.raises(ValueError, match="num_classes must be an int >= 0") as err:
        model.reset_classifier(-1)
    _one_line(err)


# -- feature levels (timm: test_model_forward_intermediates) --------------------------------------
@pytest.mark.parametrize("name", CNNS)
def test_forward_intermediates_match_feature_info_and_forward_features(name):
    """timm's test_model_forward_intermediates: one map per feature_info level with its channels
    and reduction; the returned output equals forward_features, also with checkpointing on."""
    torch.manual_seed(0)
    model = _eval_model(name)
    info = model.feature_info
    assert len(info) >= 2 and all(set(d) == {"num_chs", "reduction", "module"} for d in info)
    names = dict(model.named_modules())
    assert all(d["module"] in names for d in info)
    x = _like(model, model.example_input(1))
    with torch.no_grad():
        output, intermediates = model.forward_intermediates(x)
        assert len(intermediates) == len(info)
        for level, t in zip(info, intermediates):
            assert t.shape == (1, level["num_chs"], x.shape[-2] // level["reduction"],
                               x.shape[-1] // level["reduction"])
        torch.testing.assert_close(output, model.forward_features(x), rtol=0, atol=0)
        model.set_grad_checkpointing()
        again, _ = model.forward_intermediates(x)
    torch.testing.assert_close(again, output, rtol=0, atol=0)


def _tiny_densenets() -> list[DenseNet]:
    return [DenseNet(4, (2, 2, 2), 8, num_classes=3, stem="cifar"),
            DenseNet(4, (1, 2), 8, bn_size=None, num_classes=3, stem="imagenet")]


def _intermediates_loss(model: torch.nn.Module):
    def forward(x: torch.Tensor) -> torch.Tensor:
        out, maps = model.forward_intermediates(x)
        return out.mean() + sum(m.square().mean() for m in maps)
    return forward


@pytest.mark.parametrize("which", ["resnet20", "resnet18", "cifar_cnn", "densenet_cifar",
                                   "densenet_imagenet"])
def test_forward_intermediates_train_exactly_in_every_checkpoint_mode(which):
    """Train mode, two SGD steps on a loss over every level: outputs, gradients and BatchNorm
    buffers equal the plain model's in each checkpoint mode (the levels run in the active mode)."""
    torch.manual_seed(0)
    if which.startswith("densenet"):
        build = lambda: _tiny_densenets()[which == "densenet_imagenet"]  # noqa: E731
    else:
        build = lambda: zoo.create_model(which, num_classes=3)  # noqa: E731
    start = build()
    x = start.example_input(2, 32)
    for mode in start.checkpoint_modes:
        plain, ckpt = build(), build()
        plain.load_state_dict(start.state_dict())
        ckpt.set_grad_checkpointing(mode)
        assert_same_training(plain, _intermediates_loss(plain), ckpt, _intermediates_loss(ckpt),
                             x.clone())


def test_forward_intermediates_indices_norm_and_stop_early():
    """timm's semantics: an int takes the last n levels, negatives count from the end, ``norm``
    applies the final norm to the last level, ``stop_early``/``intermediates_only`` stop there."""
    torch.manual_seed(0)
    model = _tiny_densenets()[0].eval()
    x = model.example_input(1)
    with torch.no_grad():
        output, every = model.forward_intermediates(x)
        _, last_two = model.forward_intermediates(x, indices=2)
        _, picked = model.forward_intermediates(x, indices=[0, -1], norm=True)
        early, (first,) = model.forward_intermediates(x, indices=[1], stop_early=True)
        only = model.forward_intermediates(x, indices=(1, 2), intermediates_only=True)
    for a, b in zip(last_two + [picked[0], first] + only, every[-2:] + [every[0], every[1]]
                    + every[1:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(picked[1], output, rtol=0, atol=0)  # norm5-ReLU'd = features
    torch.testing.assert_close(early, every[1], rtol=0, atol=0)
    for bad in (0, 5, [4], [-5]):
        with pytest.raises(ValueError, match="feature") as err:
            model.forward_intermediates(x, indices=bad)
        _one_line(err)
    with pytest.raises(ValueError, match="NCHW") as err:
        model.forward_intermediates(x, output_fmt="NHWC")
    _one_line(err)


# -- in_chans and drop_rate on every CNN ----------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet20", "resnet18", "densenet40", "densenet121",
                                  "cifar_cnn"])
def test_in_chans(name):
    torch.manual_seed(0)
    model = zoo.create_model(name, in_chans=1, num_classes=3)
    x = model.example_input(2)
    assert x.shape[1] == 1 and model.pretrained_cfg["input_size"][0] == 1
    assert model(x).shape == (2, 3)
    with pytest.raises(ValueError, match="in_chans") as err:
        zoo.create_model(name, in_chans=0)
    _one_line(err)


def test_resnet_drop_rate_is_dropout_before_the_classifier_and_stays_exact():
    """timm's ResNet ``drop_rate``: dropout on the pooled features (train mode only); with it
    the recommended mode still trains exactly like the plain model."""
    torch.manual_seed(0)
    plain = zoo.create_model("resnet20", drop_rate=0.5, num_classes=3)
    x = plain.example_input(2)
    features = plain.forward_features(x)
    dropped = plain.forward_head(features, pre_logits=True)
    assert (dropped == 0).any()
    plain.eval()
    torch.testing.assert_close(plain.forward_head(features, pre_logits=True),
                               torch.flatten(features.mean((2, 3), keepdim=True), 1))
    ckpt = zoo.create_model("resnet20", drop_rate=0.5, num_classes=3, efficient=True)
    assert_same_training(plain, plain, ckpt, ckpt, x)
    with pytest.raises(ValueError, match="drop_rate") as err:
        zoo.create_model("resnet18", drop_rate=1.5)
    _one_line(err)


# -- pretrained=True through torch's hub cache ---------------------------------------------------
def _old_densenet_keys(state: dict) -> dict:
    """torchvision's DenseNet files name 'norm1' 'norm.1' (pre-0.3 layout): write them that way."""
    import re

    pattern = re.compile(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.")
    return {pattern.sub(r"\1.\2.", k): v for k, v in state.items()}


def _cache_torchvision_weights(name: str, tmp_path, monkeypatch) -> torch.nn.Module:
    """torchvision's ``name`` (random weights, eval mode), its state_dict saved where
    ``pretrained=True`` looks for the published file, in a hub cache under ``tmp_path``."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("ZOO_OFFLINE", "1")
    torch.manual_seed(0)
    theirs = getattr(torchvision.models, name)(weights=None).eval()
    url, path = weights_file(name)
    assert path == os.path.join(str(tmp_path), "hub", "checkpoints", os.path.basename(url))
    os.makedirs(os.path.dirname(path))
    state = theirs.state_dict()
    torch.save(_old_densenet_keys(state) if name.startswith("densenet") else state, path)
    return theirs


@pytest.mark.parametrize("name", ["resnet18", "densenet121"])
def test_pretrained_loads_torchvisions_file_from_the_hub_cache(name, tmp_path, monkeypatch):
    theirs = _cache_torchvision_weights(name, tmp_path, monkeypatch)
    state = theirs.state_dict()
    ours = zoo.create_model(name, pretrained=True, efficient=True).eval()
    assert ours.pretrained_cfg["weights"].endswith("IMAGENET1K_V1") or "V2" in \
        ours.pretrained_cfg["weights"]
    for (key, a), b in zip(ours.state_dict().items(), state.values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    headless = zoo.create_model(name, pretrained=True, num_classes=0).eval()
    with torch.no_grad():
        torch.testing.assert_close(headless(x), ours.forward_head(ours.forward_features(x),
                                                                  pre_logits=True))


@pytest.mark.parametrize("name,override,expected", [
    ("resnet18", dict(layers=(1, 1, 1, 1)),
     "0 missing from the weights, 48 not in the model (first: layer1.1.conv1.weight)"),
    ("densenet121", dict(growth_rate=16),
     "denselayer1.conv1.weight is (128, 64, 1, 1) in the weights, (64, 64, 1, 1) here"),
])
def test_pretrained_with_an_architecture_override_is_one_line(name, override, expected,
                                                               tmp_path, monkeypatch):
    """Arguments that change the network's tensors cannot take the published weights (timm fails
    there too): one line naming the arguments and the first tensor that does not fit."""
    _cache_torchvision_weights(name, tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="do not fit the model built with") as err:
        zoo.create_model(name, pretrained=True, num_classes=10, **override)
    message = _one_line(err)
    assert f"{name!r}" in message and expected in message
    assert ", ".join(f"{k}={v!r}" for k, v in override.items()) in message


def test_pretrained_with_an_override_that_keeps_the_tensors_loads(tmp_path, monkeypatch):
    """``drop_rate`` and ``checkpoint_every`` change no tensor: the weights load, as in timm."""
    theirs = _cache_torchvision_weights("resnet18", tmp_path, monkeypatch)
    ours = zoo.create_model("resnet18", pretrained=True, drop_rate=0.2, checkpoint_every=2)
    for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def test_pretrained_without_a_cached_file_offline_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("ZOO_OFFLINE", "1")
    url, path = weights_file("resnet50")
    with pytest.raises(FileNotFoundError) as err:
        zoo.create_model("resnet50", pretrained=True)
    message = _one_line(err)
    assert url in message and path in message


@pytest.mark.parametrize("name", ["resnet20", "densenet_bc_100", "densenet264", "cifar_cnn",
                                  "vit_cifar", "bert_base"])
def test_pretrained_for_a_model_without_weights_is_one_line(name):
    with pytest.raises(ValueError, match="no pretrained weights") as err:
        zoo.create_model(name, pretrained=True)
    _one_line(err)


# -- create_model's arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("name", [None, 3, b"resnet20", ["resnet20"]])
def test_create_model_name_that_is_not_a_string(name):
    with pytest.raises(TypeError, match="model name must be a string") as err:
        zoo.create_model(name)
    _one_line(err)


@pytest.mark.parametrize("num_classes,error", [("10", TypeError), (2.5, TypeError),
                                               (True, TypeError), (-1, ValueError)])
def test_create_model_bad_num_classes(num_classes, error):
    with pytest.raises(error, match="num_classes must be an int >= 0") as err:
        zoo.create_model("resnet20", num_classes=num_classes)
    _one_line(err)
    with pytest.raises(TypeError, match="pretrained must be True or False") as err:
        zoo.create_model("resnet18", pretrained="yes")
    _one_line(err)
