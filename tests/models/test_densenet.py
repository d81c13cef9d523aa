"""DenseNet family: published sizes, torchvision compatibility, and checkpoint modes that train
exactly like the plain model for less memory (Huang et al. 2017; Pleiss et al. 2017).

The generic suite (test_models.py) already runs every registered model through the interface
and mode-equivalence checks; here are the family's own promises: parameter counts, torchvision's
weights load strictly and give the same outputs, dropout and the planner's chain stay exact, the
``bottleneck`` mode recomputes no convolution, and its memory grows linearly with depth.
"""
from __future__ import annotations

import pytest
import torch
import torchvision

import zoo
from helpers import (GraphRecorder, assert_compiled_matches_eager_plain,
                     assert_published_parameter_count, assert_same_training,
                     needs_compiled_card_step, train_step_peak)
from zoo.memory import count_flops, cpu_peak_bytes, default_loss
from zoo.models.densenet import DenseLayer, DenseNet

# Millions of parameters, to the digits published: Huang et al. 2017, Table 2 (CIFAR), and
# torchvision's model cards (ImageNet). DenseNet-264 has no torchvision twin; 33.3M is the count
# usually quoted for it. DenseNet-40 is published as "1.0M" (it is 1.02M: within the published
# precision, 2% from the rounded figure), so counts are compared at the published precision.
PUBLISHED_PARAMS = {
    "densenet40": "1.0",
    "densenet_bc_100": "0.769",
    "densenet_bc_190": "25.6",
    "densenet_bc_250": "15.3",
    "densenet121": "7.98",
    "densenet161": "28.68",
    "densenet169": "14.15",
    "densenet201": "20.01",
    "densenet264": "33.3",
}
TORCHVISION = ["densenet121", "densenet161", "densenet169", "densenet201"]
MODES = DenseNet.checkpoint_modes


def tiny(stem: str = "cifar", bn_size: int | None = 4, drop_rate: float = 0.0,
         efficient: bool | str = False) -> DenseNet:
    """A small DenseNet with every kind of part (stem, two blocks, a transition, norm5)."""
    return DenseNet(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=bn_size,
                    drop_rate=drop_rate, num_classes=5, stem=stem, efficient=efficient)


# -- sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name):
    assert_published_parameter_count(name, PUBLISHED_PARAMS[name])


@pytest.mark.parametrize("name,features,classes", [("densenet40", 448, 10),
                                                    ("densenet_bc_100", 342, 10),
                                                    ("densenet121", 1024, 1000)])
def test_feature_shapes(name, features, classes):
    torch.manual_seed(0)
    model = zoo.create_model(name).eval()
    x = model.example_input(2)
    side = x.shape[-1] // (4 if model.stem == "cifar" else 32)
    with torch.no_grad():
        assert model.forward_features(x).shape == (2, features, side, side)
        assert model(x).shape == (2, classes)
    assert model.num_features == features and model.num_classes == classes


# -- torchvision ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TORCHVISION)
def test_state_dict_has_torchvisions_keys_and_shapes(name):
    with torch.device("meta"):
        ours = zoo.create_model(name).state_dict()
        theirs = getattr(torchvision.models, name)(weights=None).state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


@pytest.mark.parametrize("mode", [False, *(pytest.param(m, marks=pytest.mark.slow) for m in MODES)])
def test_torchvision_weights_load_strictly_and_give_the_same_outputs(mode):
    torch.manual_seed(0)
    theirs = torchvision.models.densenet121(weights=None)
    ours = zoo.create_model("densenet121", efficient=mode)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():  # eval: running statistics
        torch.testing.assert_close(ours.eval()(x), theirs.eval()(x))
    ours.train(), theirs.train()  # train: batch statistics, gradients and updated buffers
    out_ours, out_theirs = ours(x), theirs(x)
    torch.testing.assert_close(out_ours, out_theirs)
    default_loss(out_ours).backward()
    default_loss(out_theirs).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}.grad: {m}")
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    theirs.load_state_dict(ours.state_dict(), strict=True)  # and back


# -- checkpoint modes against the plain model, in train mode --------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [pytest.param("densenet40", marks=pytest.mark.slow),
                                  "densenet_bc_100"])
def test_cifar_models_train_exactly_like_plain(name, mode):
    torch.manual_seed(0)
    plain = zoo.create_model(name)
    ckpt = zoo.create_model(name, efficient=mode)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stem,bn_size", [("cifar", 4), ("cifar", None), ("imagenet", 4)])
def test_dropout_stays_exact_under_every_mode(stem, bn_size, mode):
    """Dropout after each dense layer draws the same numbers whether or not the layer is
    checkpointed, so outputs, gradients and BatchNorm buffers still match the plain model."""
    torch.manual_seed(0)
    plain = tiny(stem, bn_size, drop_rate=0.3)
    ckpt = tiny(stem, bn_size, drop_rate=0.3, efficient=mode)
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2, 32))


def test_planner_chain_trains_exactly_like_plain():
    torch.manual_seed(0)
    plain, planned = tiny("imagenet"), tiny("imagenet")
    chain = planned.checkpoint_chain()
    assert [type(m).__name__ for m in chain] == [
        "Conv2d", "Sequential", "MaxPool2d", "DenseLink", "DenseLink", "Transition", "DenseLink",
        "DenseLink", "DenseLink", "cp_BatchNorm2d"]  # the stem's in-place ReLU rides with its BN
    assert [type(m).__name__ for m in chain[1]] == ["cp_BatchNorm2d", "ReLU"]
    planned.set_checkpoint_plan([(0, 3, False), (3, 5, True), (5, 6, False), (6, 9, True),
                                 (9, 10, False)])
    assert_same_training(plain, plain, planned, planned, plain.example_input(2, 32))


@pytest.mark.parametrize("mode", MODES)
def test_modes_lower_peak_memory(mode):
    torch.manual_seed(0)
    model = zoo.create_model("densenet_bc_100")
    x = model.example_input(2)
    plain = train_step_peak(model, x)
    model.set_grad_checkpointing(mode)
    assert train_step_peak(model, x) < 0.5 * plain


def test_bottleneck_mode_recomputes_no_convolution_and_layer_mode_only_conv1():
    """``bottleneck`` recomputes only concat/BN/ReLU (0 extra FLOPs); ``layer`` reruns each
    layer's 1x1 convolution and nothing more."""
    torch.manual_seed(0)
    model = tiny()
    x = model.example_input(2)

    def flops(mode: str | bool) -> int:
        model.set_grad_checkpointing(mode)
        return count_flops(lambda: default_loss(model(x)).backward())

    plain = flops(False)
    assert flops("bottleneck") == plain
    conv1s = [m.conv1 for m in model.modules() if isinstance(m, DenseLayer)]
    shapes = []
    hooks = [c.register_forward_hook(lambda m, args, out: shapes.append(args[0].shape))
             for c in conv1s]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    conv1_forward = sum(count_flops(lambda: c(torch.zeros(s))) for c, s in zip(conv1s, shapes))
    assert conv1_forward > 0
    assert flops("layer") == plain + conv1_forward


def test_efficient_memory_grows_linearly_with_depth():
    """What one dense block keeps for backward: linear in its depth with the ``bottleneck`` mode
    (the concatenations are recomputed), quadratic without (each layer keeps its own)."""
    x = torch.randn(2, 3, 16, 16)

    def kept(layers: int, mode: str | bool) -> int:
        torch.manual_seed(0)
        model = DenseNet(growth_rate=8, block_config=(layers,), num_init_features=16,
                         stem="cifar", efficient=mode)
        return cpu_peak_bytes(lambda: model(x))  # forward only: the saved activations

    for mode, low, high in [("bottleneck", 1.7, 2.3), (False, 2.6, 4.0)]:
        m4, m8, m16 = (kept(n, mode) for n in (4, 8, 16))
        growth = (m16 - m8) / (m8 - m4)  # 2 for linear growth, up to 4 for quadratic
        assert low <= growth <= high, f"mode {mode}: memory growth ratio {growth:.2f}"


def _two_blocks_of_eight() -> tuple[DenseNet, torch.Tensor]:
    """A checkpointed DenseNet-BC of two blocks of 8 layers and a CIFAR batch of 16."""
    torch.manual_seed(0)
    model = DenseNet(growth_rate=12, block_config=(8, 8), num_init_features=24, stem="cifar",
                     efficient=True)
    return model, torch.randn(16, 3, 32, 32)


@needs_compiled_card_step
@pytest.mark.slow
def test_compiled_backward_sums_the_maps_gradients_layer_by_layer(monkeypatch):
    """Under torch.compile (inductor's schedule for an H100, bf16 autocast) the checkpointed
    DenseNet peaks lower than the same model with each map's gradient summed by autograd from
    every later layer (no stand-ins): inductor then fuses each map's sum into one kernel and
    keeps the block's concatenation gradients alive until it runs."""
    from zoo.memory import predict_compiled_step
    from zoo.models import densenet_blocks

    model, x = _two_blocks_of_eight()
    joined = predict_compiled_step(model, x, "h100", autocast=torch.bfloat16).peak
    of = densenet_blocks.Features.of.__func__
    monkeypatch.setattr(densenet_blocks.Features, "of",
                        classmethod(lambda cls, features, mode: of(cls, features, None)))
    fanned_in = predict_compiled_step(model, x, "h100", autocast=torch.bfloat16).peak
    one_map = 16 * 12 * 32 * 32 * 4  # one layer's new maps' gradient in float32
    assert fanned_in - joined > 8 * one_map


@needs_compiled_card_step
@pytest.mark.slow
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_step_peaks_where_the_eager_step_does(autocast):
    """Inductor's schedule of the checkpointed DenseNet (an H100, the card model) stores each
    stand-in's gradient, in its own dtype, as soon as its layer's BatchNorm backward has its
    statistics, so the compiled step peaks within 1% of the eager one in float32 and bf16.
    Inlined into the previous layer's gradient sum instead, it kept a layer's recomputed maps
    alive through that layer's recompute (12% above the eager peak in float32, 7% in bf16);
    cut by one narrow per part, a float32 intermediate of BatchNorm's backward (3% in bf16)."""
    from zoo.memory import predict_compiled_step, predict_step

    model, x = _two_blocks_of_eight()
    compiled = predict_compiled_step(model, x, "h100", autocast=autocast).peak
    eager = predict_step(model, x, "h100", autocast=autocast).peak
    slack = eager // 100
    assert compiled <= eager + slack, f"compiled {compiled:,} B against eager {eager:,} B"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_forced_store_of_the_stand_ins_gradient_trains_like_plain(backend, monkeypatch):
    """Under bf16 autocast the compiled DenseNet forces each stand-in's gradient to be stored
    (inductor's ``inductor_force_stride_order`` in the gradient's own strides). Forced here in
    float64, where any difference shows, the compiled model trains as eager plain: bit for bit
    under ``aot_eager``, whose backward graph holds the store, and to float64 round-off under
    inductor, which keeps a convolution net channels-last inside on a CPU."""
    from zoo.models import densenet_blocks

    monkeypatch.setattr(densenet_blocks, "FORCED_STORE_BELOW", 16)
    torch.manual_seed(0)
    plain = tiny().double()
    ckpt = tiny(efficient="bottleneck").double()
    recorder = GraphRecorder()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert_compiled_matches_eager_plain(plain, ckpt, x, recorder if backend == "aot_eager"
                                        else backend, steps=2, exact=backend == "aot_eager")
    if backend == "aot_eager":
        store = torch.ops.prims.inductor_force_stride_order.default
        stand_ins = (1 + 2) + (1 + 3)  # per block: its input maps', then one per layer
        assert recorder.count("backward", store) == stand_ins


# -- errors ---------------------------------------------------------------------------------------
def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="stem must be 'imagenet'"):
        DenseNet(stem="tiny")
    with pytest.raises(ValueError, match="compression must be in"):
        DenseNet(compression=0)
    with pytest.raises(ValueError, match="no checkpointing mode"):
        tiny(efficient="segments")
    layer = tiny().features.denseblock1.denselayer1
    with pytest.raises(ValueError, match="unknown DenseNet checkpoint mode"):
        layer(torch.randn(1, 8, 4, 4, requires_grad=True), mode="whole")
