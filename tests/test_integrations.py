"""zoo.set_grad_checkpointing on torchvision, timm, zoo and users' models: exactly the plain model
(outputs, gradients, BatchNorm buffers over three train-mode steps, dropout on), a lower measured
peak, recomputed by zoo.checkpoint, and enable=False gives the plain model back."""
from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import timm
import torch
import torchvision
from torch import nn

import zoo
from helpers import assert_same_training
from zoo.memory import cpu_peak_bytes, default_loss, train_step


def step_peak(model: nn.Module, forward: Callable, x: torch.Tensor) -> int:
    """Exact CPU peak (MemTracker) of one train step, the model's parameters counted."""
    model.zero_grad(set_to_none=True)
    peak = cpu_peak_bytes(train_step(model, x, forward=forward), track=(model,))
    model.zero_grad(set_to_none=True)
    return peak


def forward_peak(model: nn.Module, forward: Callable, x: torch.Tensor) -> int:
    """Exact CPU peak (MemTracker) of one train-mode forward whose graph is kept for backward:
    the model's parameters and buffers plus the activations autograd holds (and the largest
    transient), which is what checkpointing lowers."""
    model.train()
    model.zero_grad(set_to_none=True)
    held = []
    peak = cpu_peak_bytes(lambda: held.append(forward(x)), track=(model,))
    del held
    return peak


def recomputes_with_zoo(forward: Callable, x: torch.Tensor) -> bool:
    """Whether some module runs while zoo.checkpoint recomputes during one backward."""
    seen = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: seen.append(zoo.is_recomputing()))
    try:
        default_loss(forward(x)).backward()
    finally:
        handle.remove()
    return any(seen)


def classes(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


def assert_exact_lighter_and_undone(plain: nn.Module, x: torch.Tensor,
                                    call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
                                    = lambda m, t: m(t), via: str | None = None,
                                    exact: bool = False, lighter: bool = True,
                                    peak: Callable = step_peak, **options) -> nn.Module:
    """Every check for one model (exact, lighter, undone); returns the checkpointed copy
    (switched off again). ``exact``: bit for bit; ``lighter``: the checkpointed model's ``peak`` (a training step's
    by default) must be below plain's."""
    ckpt = copy.deepcopy(plain)
    assert zoo.set_grad_checkpointing(ckpt, **options) is ckpt
    if via is not None:
        assert ckpt._zoo_grad_checkpointing["via"] == via
    fresh = copy.deepcopy(plain)
    assert_same_training(plain, lambda t: call(plain, t), ckpt, lambda t: call(ckpt, t), x,
                         steps=3, exact=exact)
    assert recomputes_with_zoo(lambda t: call(ckpt, t), x)
    if lighter:
        naive = peak(plain, lambda t: call(plain, t), x)
        light = peak(ckpt, lambda t: call(ckpt, t), x)
        assert light < naive, f"checkpointed peak {light} not below plain {naive}"
    zoo.set_grad_checkpointing(ckpt, enable=False)
    assert classes(ckpt) == classes(fresh)
    assert not any("forward" in vars(m) for m in ckpt.modules())
    assert list(ckpt.state_dict()) == list(fresh.state_dict())
    assert not recomputes_with_zoo(lambda t: call(ckpt, t), x)
    ckpt.load_state_dict(fresh.state_dict())
    close = dict(rtol=0, atol=0) if exact else {}
    for train in (True, False):
        fresh.train(train), ckpt.train(train)
        outs = []
        for model in (fresh, ckpt):
            torch.manual_seed(1)
            with torch.no_grad():
                outs.append(call(model, x))
        torch.testing.assert_close(outs[1], outs[0], **close)
    return ckpt


# --------------------------------------------------------------------------------------------
# torchvision: no hook of its own, so the repeated blocks are checkpointed.
# --------------------------------------------------------------------------------------------
def test_torchvision_resnet18():
    torch.manual_seed(0)
    assert_exact_lighter_and_undone(torchvision.models.resnet18(num_classes=5),
                                    torch.randn(2, 3, 64, 64), via="blocks")


def test_torchvision_densenet121_with_dropout():
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=5, drop_rate=0.2)
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 64, 64), via="blocks")


def test_torchvision_densenet_with_its_own_checkpoint_counts_batchnorm_once():
    # memory_efficient=True runs each layer's BatchNorm under torch's own checkpoint, which
    # counts every batch twice; the zoo's BatchNorms are exact under it
    torch.manual_seed(0)
    plain = torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2),
                                        num_init_features=16, num_classes=5)
    efficient = copy.deepcopy(plain)
    for m in efficient.modules():
        if hasattr(m, "memory_efficient"):
            m.memory_efficient = True
    assert zoo.set_grad_checkpointing(efficient)._zoo_grad_checkpointing["via"] == "blocks"
    assert_same_training(plain, plain, efficient, efficient, torch.randn(2, 3, 32, 32), steps=2)
    assert efficient.features.denseblock1.denselayer1.norm1.num_batches_tracked.item() == 2
    zoo.set_grad_checkpointing(efficient, enable=False)
    assert classes(efficient) == classes(plain)


def test_a_wrapper_is_given_back_and_its_model_checkpointed():
    model = torchvision.models.resnet18(num_classes=5)
    wrapped = nn.DataParallel(model)  # on a machine without GPUs it runs the model itself
    assert zoo.set_grad_checkpointing(wrapped) is wrapped
    assert sum(zoo.blocks.is_checkpointed(m) for m in model.modules()) == 8
    assert zoo.set_grad_checkpointing(wrapped, enable=False) is wrapped
    assert not any(zoo.blocks.is_checkpointed(m) for m in model.modules())


def test_a_compiled_model_takes_its_familys_route_and_trains_as_the_plain_one():
    """torch.compile(model) given to zoo.set_grad_checkpointing: the model inside is checkpointed
    through its family's switch (timm's here, not the repeated-block rule) and keeps the state
    that enable=False reads, as for a DataParallel wrapper. Compiled, it trains as the plain model
    compiled alike, BatchNorm and dropout included (on torch 2.8, aot_eager's plain model is not
    eager's to the bit: the reference is compiled too)."""
    torch.manual_seed(0)
    plain = timm.create_model("efficientnet_b0", num_classes=5, drop_rate=0.1)
    inner = copy.deepcopy(plain)
    compiled = torch.compile(inner, backend="aot_eager")
    assert zoo.set_grad_checkpointing(compiled) is compiled
    assert inner._zoo_grad_checkpointing["via"] == "timm"
    assert "_zoo_grad_checkpointing" not in vars(compiled)
    assert_same_training(plain, torch.compile(plain, backend="aot_eager"), inner, compiled,
                         torch.randn(2, 3, 32, 32), steps=2, exact=True)
    zoo.set_grad_checkpointing(compiled, enable=False)
    assert classes(inner) == classes(plain)


@pytest.mark.parametrize("enable", [0, 1, torch.tensor(False), 0.0])
def test_an_enable_that_is_no_bool_is_one_line(enable):
    # a 0 from a config once switched checkpointing on
    with pytest.raises(TypeError, match=r"^zoo.set_grad_checkpointing: enable must be True, "
                                        r"False or a zoo model's mode name, got [^\n]*$"):
        zoo.set_grad_checkpointing(torchvision.models.resnet18(), enable)


@pytest.mark.parametrize("casts_once", ["no", 1, None])
def test_a_casts_once_that_is_no_bool_is_one_line(casts_once):
    """casts_once="no" from a config switched the cast check on; like enable=, only a bool."""
    model = torchvision.models.resnet18()
    with pytest.raises(TypeError, match=r"^zoo.set_grad_checkpointing: casts_once must be True "
                                        r"or False, got [^\n]*$"):
        zoo.set_grad_checkpointing(model, casts_once=casts_once)
    assert not any(zoo.blocks.is_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize("modules", [[], [int], 3, [nn.Sequential(nn.Linear(2, 2))],
                                     nn.Sequential(nn.Linear(2, 2))],
                         ids=["empty", "int-type", "int", "module-instance", "a-sequential"])
def test_modules_that_name_no_module_type_is_one_line(modules):
    """A module instance (``modules=[model.layer1]``) is named by its type, not its multi-line
    repr, and the error says to pass its dotted name."""
    with pytest.raises(TypeError, match=r"^modules= takes module types[^\n]*$") as error:
        zoo.set_grad_checkpointing(torchvision.models.resnet18(), modules=modules)
    if isinstance(modules, nn.Module) or isinstance(modules, list) and modules \
            and isinstance(modules[0], nn.Module):
        assert str(error.value).endswith("got a Sequential instance; pass its dotted name from "
                                         "model.named_modules() or its type")


# --------------------------------------------------------------------------------------------
# timm: its own set_grad_checkpointing, recomputed by zoo.checkpoint, BatchNorm converted.
# --------------------------------------------------------------------------------------------
def test_timm_resnet50():
    torch.manual_seed(0)
    model = timm.create_model("resnet50", num_classes=5, drop_rate=0.2)
    ckpt = assert_exact_lighter_and_undone(model, torch.randn(2, 3, 64, 64), via="timm")
    assert not ckpt.layer1[0].__dict__.get("_zoo_routed") and not ckpt.grad_checkpointing


def test_timm_efficientnet_b0_with_drop_path():
    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", num_classes=5, drop_rate=0.2,
                              drop_path_rate=0.2)
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 64, 64), via="timm")


def test_timm_vit_with_dropout():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8, depth=3,
                              embed_dim=48, num_heads=3, num_classes=5, drop_rate=0.1,
                              proj_drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 64, 64), via="timm")


def test_timm_model_that_refuses_checkpointing_gets_its_blocks_checkpointed():
    """timm's CSPNets assert 'gradient checkpointing not supported': the block rule instead."""
    torch.manual_seed(0)
    model = timm.create_model("cs3darknet_s", num_classes=5)
    with pytest.raises(AssertionError):
        copy.deepcopy(model).set_grad_checkpointing(True)
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 32, 32), via="blocks")


def test_timm_routing_leaves_other_timm_models_to_timm():
    """The dispatchers send only marked models to zoo; another resnet keeps torch's checkpoint."""
    torch.manual_seed(0)
    ours = zoo.set_grad_checkpointing(timm.create_model("resnet10t", num_classes=3))
    theirs = timm.create_model("resnet10t", num_classes=3)
    theirs.set_grad_checkpointing(True)
    x = torch.randn(2, 3, 32, 32)
    assert recomputes_with_zoo(ours, x)
    assert not recomputes_with_zoo(theirs, x)
    assert type(theirs.bn1) is nn.BatchNorm2d


# --------------------------------------------------------------------------------------------
# zoo models and users' networks.
# --------------------------------------------------------------------------------------------
def test_zoo_model_uses_its_own_modes():
    torch.manual_seed(0)
    model = zoo.create_model("resnet20", num_classes=5)
    ckpt = copy.deepcopy(model)
    zoo.set_grad_checkpointing(ckpt)
    assert ckpt.grad_checkpointing == ckpt.checkpoint_modes[0]
    zoo.set_grad_checkpointing(ckpt, ckpt.checkpoint_modes[-1])
    assert ckpt.grad_checkpointing == ckpt.checkpoint_modes[-1]
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 16, 16), via="zoo")


class Shared(nn.Module):
    """A user's network: four blocks in a ModuleList, the second one called twice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Dropout(0.2)) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i in (0, 1, 1, 2, 3):
            x = self.blocks[i](x) + x
        return self.head(x.mean((2, 3)))


def test_user_network_with_a_block_called_twice():
    torch.manual_seed(0)
    model = Shared()
    assert [n for n, _ in zoo.blocks.find_blocks(model)] == [f"blocks.{i}" for i in range(4)]
    assert_exact_lighter_and_undone(model, torch.randn(2, 3, 16, 16), via="blocks")


def test_modules_by_type_name_and_dotted_name():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5)
    zoo.set_grad_checkpointing(model, modules="BasicBlock")
    assert sum(zoo.blocks.is_checkpointed(m) for m in model.modules()) == 8
    zoo.set_grad_checkpointing(model, modules=["layer1", "layer4.1"])
    assert [n for n, m in model.named_modules() if zoo.blocks.is_checkpointed(m)] == [
        "layer1", "layer4.1"]
    assert_exact_lighter_and_undone(torchvision.models.resnet18(num_classes=5),
                                    torch.randn(2, 3, 64, 64),
                                    modules=[torchvision.models.resnet.BasicBlock])


def test_nothing_to_checkpoint_is_a_value_error_naming_what_was_looked_for():
    with pytest.raises(ValueError, match="no repeated blocks"):
        zoo.set_grad_checkpointing(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
    with pytest.raises(ValueError, match="no submodule matching 'Attention'"):
        zoo.set_grad_checkpointing(torchvision.models.resnet18(), modules="Attention")
    with pytest.raises(ValueError, match="mode name is for zoo models"):
        zoo.set_grad_checkpointing(torchvision.models.resnet18(), "block")


def test_checkpointed_models_save_and_deepcopy_as_checkpointed():
    """torch.save(model) and deepcopy keep the checkpointing (class swaps pickle by original)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    for model in (zoo.set_grad_checkpointing(torchvision.models.resnet18(num_classes=5)),
                  zoo.set_grad_checkpointing(timm.create_model("efficientnet_b0", num_classes=5))):
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        for other in (loaded, copy.deepcopy(model)):
            assert classes(other) == classes(model)
            assert recomputes_with_zoo(other, x)
            zoo.set_grad_checkpointing(other, enable=False)
            assert not recomputes_with_zoo(other, x)


def test_checkpointed_blocks_compile_in_one_graph():
    """torch.compile(fullgraph=True) of a network checkpointed by zoo.set_grad_checkpointing:
    outputs, gradients and BatchNorm buffers as the eager plain network's."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3)])
    ckpt = zoo.set_grad_checkpointing(copy.deepcopy(plain))
    compiled = torch.compile(ckpt, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 8, 8)
    assert_same_training(plain, plain, ckpt, compiled, x, steps=2)
