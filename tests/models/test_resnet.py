"""ResNet family: published sizes, torchvision compatibility, and checkpoint modes that train
exactly like the plain model for less memory (He et al. 2016).

The generic suite (test_models.py) runs every registered model through the interface and the
mode-equivalence checks; here are the family's own promises: parameter counts (option A CIFAR
shortcuts have no parameters), torchvision's weights load strictly and give the same outputs and
gradients in every mode, ``checkpoint_every`` and the planner's chain stay exact, and each mode
reruns exactly the convolutions its docstring says (``halves`` never conv2, ``bn_relu`` none).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torchvision

import zoo
from helpers import (assert_published_parameter_count, assert_same_training,
                     train_step_peak)
from zoo.memory import default_loss
from zoo.models.resnet import Bottleneck, CifarResNet, ResNet, ZeroPadShortcut

# Millions of parameters to the published digits: He et al. 2016, Table 6 (CIFAR, option A
# shortcuts) and torchvision's model cards (ImageNet).
PUBLISHED_PARAMS = {
    "resnet20": "0.27", "resnet32": "0.46", "resnet44": "0.66", "resnet56": "0.85",
    "resnet110": "1.7", "resnet1202": "19.4",
    "resnet18": "11.69", "resnet34": "21.80", "resnet50": "25.56", "resnet101": "44.55",
    "resnet152": "60.19",
}
TORCHVISION = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
MODES = ResNet.checkpoint_modes


def tiny_bottleneck(**kwargs) -> ResNet:
    """One Bottleneck per stage: every kind of part (stem, downsample, stride-2 3x3) at low cost."""
    return ResNet(Bottleneck, (1, 1, 1, 1), num_classes=5, **kwargs)


# -- sizes and shapes -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    assert_published_parameter_count(name, PUBLISHED_PARAMS[name])


@pytest.mark.parametrize("name,depth,blocks_per_stage", [
    ("resnet20", 20, 3), ("resnet110", 110, 18), ("resnet1202", 1202, 200)])
def test_cifar_depth_is_6n_plus_2(name, depth, blocks_per_stage):
    with torch.device("meta"):
        model = zoo.create_model(name)
    assert [len(model.layer1), len(model.layer2), len(model.layer3)] == [blocks_per_stage] * 3
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) + 1 == depth  # weighted layers: the convolutions and the classifier


@pytest.mark.parametrize("name,features,classes,reduction", [("resnet20", 64, 10, 4),
                                                              ("resnet18", 512, 1000, 32),
                                                              ("resnet50", 2048, 1000, 32)])
def test_feature_shapes(name, features, classes, reduction):
    torch.manual_seed(0)
    model = zoo.create_model(name).eval()
    x = model.example_input(2)
    side = x.shape[-1] // reduction
    with torch.no_grad():
        assert model.forward_features(x).shape == (2, features, side, side)
        assert model(x).shape == (2, classes)
    assert model.num_features == features and model.num_classes == classes


def test_option_a_shortcut_subsamples_and_zero_pads_without_parameters():
    shortcut = ZeroPadShortcut(16, 32, stride=2)
    x = torch.randn(2, 16, 8, 8)
    y = shortcut(x)
    assert y.shape == (2, 32, 4, 4)
    torch.testing.assert_close(y[:, :16], x[:, :, ::2, ::2])
    assert not y[:, 16:].any()
    model = zoo.create_model("resnet20")
    assert isinstance(model.layer2[0].downsample, ZeroPadShortcut)
    assert not any("downsample" in k for k in model.state_dict())


# -- torchvision ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TORCHVISION)
def test_state_dict_has_torchvisions_keys_and_shapes(name):
    with torch.device("meta"):
        ours = zoo.create_model(name).state_dict()
        theirs = getattr(torchvision.models, name)(weights=None).state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


@pytest.mark.parametrize("mode", [False, *MODES])
@pytest.mark.parametrize("name", ["resnet18", pytest.param("resnet50", marks=pytest.mark.slow)])
def test_torchvision_weights_load_strictly_and_give_the_same_outputs(name, mode):
    torch.manual_seed(0)
    theirs = getattr(torchvision.models, name)(weights=None)
    ours = zoo.create_model(name, efficient=mode)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():  # eval: running statistics
        torch.testing.assert_close(ours.eval()(x), theirs.eval()(x))
    ours.train(), theirs.train()  # train: batch statistics, gradients and updated buffers
    out_ours, out_theirs = ours(x), theirs(x)
    torch.testing.assert_close(out_ours, out_theirs)
    default_loss(out_ours).backward()
    default_loss(out_theirs).backward()
    for (key, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{key}.grad: {m}")
    for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{key}: {m}")
    theirs.load_state_dict(ours.state_dict(), strict=True)  # and back


# -- checkpoint modes against the plain model, in train mode --------------------------------------
VARIANTS = [(mode, 1) for mode in MODES] + [("block", 2), ("block", 4)]


@pytest.mark.parametrize("mode,every", VARIANTS)
@pytest.mark.parametrize("name,size", [("resnet20", 32),
                                       pytest.param("resnet18", 64, marks=pytest.mark.slow)])
def test_modes_train_exactly_like_plain_and_lower_the_peak(name, size, mode, every):
    """Outputs, gradients, parameters and BatchNorm buffers after two SGD steps; state_dict keys;
    peak memory of a training step. ``checkpoint_every=4`` spans stage boundaries."""
    torch.manual_seed(0)
    plain = zoo.create_model(name)
    ckpt = zoo.create_model(name, efficient=mode, checkpoint_every=every)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = plain.example_input(2, size)
    assert_same_training(plain, plain, ckpt, ckpt, x)
    assert train_step_peak(ckpt, x) < train_step_peak(plain, x)


@pytest.mark.parametrize("mode", MODES)
def test_bottleneck_modes_train_exactly_like_plain(mode):
    torch.manual_seed(0)
    plain, ckpt = tiny_bottleneck(), tiny_bottleneck(efficient=mode)
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2, 32))


def test_planner_chain_trains_exactly_like_plain():
    torch.manual_seed(0)
    plain, planned = tiny_bottleneck(), tiny_bottleneck()
    chain = planned.checkpoint_chain()
    assert [type(m).__name__ for m in chain] == [
        "Conv2d", "Sequential", "MaxPool2d", *["Bottleneck"] * 4]  # BN-ReLU(inplace) joined
    planned.set_checkpoint_plan([(0, 3, True), (3, 5, True), (5, 6, False), (6, 7, True)])
    assert_same_training(plain, plain, planned, planned, plain.example_input(2, 32))


def _conv_runs(model: torch.nn.Module, x: torch.Tensor) -> Counter:
    """How many times each convolution ran to completion during one training step."""
    runs: Counter = Counter()
    hooks = [m.register_forward_hook(lambda m, a, o, name=name: runs.update([name]))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    default_loss(model(x)).backward()
    for h in hooks:
        h.remove()
    return runs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["cifar", "bottleneck"])
def test_each_mode_reruns_exactly_the_convolutions_it_says(kind, mode):
    """``bn_relu`` reruns none; ``halves`` reruns the stem conv, conv1, conv3 and the downsample
    conv but never conv2 (backward stops before it); ``block`` reruns every convolution."""
    torch.manual_seed(0)
    if kind == "cifar":
        model = CifarResNet(depth=8, efficient=mode)
    else:
        model = tiny_bottleneck(efficient=mode)
    runs = _conv_runs(model, model.example_input(2, 32))
    assert set(runs) == {n for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)}
    rerun = {name for name, count in runs.items() if count == 2}
    assert set(runs.values()) <= {1, 2}
    if mode == "bn_relu":
        expected: set[str] = set()
    elif mode == "block":
        expected = set(runs)
    else:
        expected = {n for n in runs if not n.endswith("conv2")}
    assert rerun == expected


# -- errors ---------------------------------------------------------------------------------------
def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="depth 6n \\+ 2"):
        CifarResNet(depth=21)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
        CifarResNet(depth=8, checkpoint_every=0)
    with pytest.raises(ValueError, match="works with the 'block' mode only"):
        CifarResNet(depth=8, efficient=True, checkpoint_every=2)
    model = CifarResNet(depth=8, efficient="block", checkpoint_every=2)
    with pytest.raises(ValueError, match="works with the 'block' mode only"):
        model.set_grad_checkpointing("halves")
    assert model.grad_checkpointing == "block"  # a refused mode leaves the model as it was
    with pytest.raises(ValueError, match="no checkpointing mode"):
        CifarResNet(depth=8, efficient="layer")
    block = model.layer1[0]
    with pytest.raises(ValueError, match="unknown ResNet checkpoint mode"):
        block(torch.randn(1, 16, 4, 4, requires_grad=True), mode="whole")


# -- the CIFAR nets' recommended mode -------------------------------------------------------------
@pytest.mark.slow  # ResNet-110 measured in three modes
def test_resnet110_efficient_keeps_at_most_half_the_plain_peak_for_fewer_flops_than_halves():
    """``efficient=True`` (``tapered``) at batch 16: exact peak <= 0.5x the plain step's, and it
    recomputes fewer FLOPs than ``halves`` (FlopCounterMode)."""
    from zoo.memory import step_cost

    torch.manual_seed(0)
    model = zoo.create_model("resnet110")
    x = model.example_input(16)
    plain = step_cost(model, x)
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing == "tapered"
    tapered = step_cost(model, x)
    model.set_grad_checkpointing("halves")
    halves = step_cost(model, x)
    assert tapered[0] <= 0.5 * plain[0], f"{tapered[0] / plain[0]:.3f}x the plain peak"
    assert plain[1] < tapered[1] < halves[1]


def test_tapered_reruns_stage_one_only():
    """``tapered`` reruns the stem conv and stage 1's convolutions (whole blocks), none after."""
    torch.manual_seed(0)
    model = CifarResNet(depth=14, efficient="tapered")
    runs = _conv_runs(model, model.example_input(2))
    rerun = {name for name, count in runs.items() if count == 2}
    assert rerun == {n for n in runs if n == "conv1" or n.startswith("layer1.")}
    assert set(runs.values()) == {1, 2}
