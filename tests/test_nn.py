"""cp_BatchNorm*d and convert_batchnorm: exact statistics under anyone's checkpoint."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from helpers import assert_same_training, run_steps


def small_resnet_block(bn: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), bn(6), nn.ReLU(),
                         nn.Conv2d(6, 6, 3, padding=1), bn(6, momentum=None), nn.ReLU())


@pytest.mark.parametrize("reentrant", [False, True])
def test_cp_batchnorm_is_exact_under_torch_checkpoint(reentrant):
    """Other people's checkpoint wrappers double-count plain BatchNorm; cp_BatchNorm2d does not."""
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    plain, ckpt = small_resnet_block(zoo.cp_BatchNorm2d), small_resnet_block(zoo.cp_BatchNorm2d)
    assert_same_training(
        plain, plain, ckpt,
        lambda t: torch_checkpoint.checkpoint(ckpt, t, use_reentrant=reentrant), x, steps=3)
    assert ckpt[1].num_batches_tracked.item() == 3


def test_convert_batchnorm_keeps_state_identity_and_state_dict():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(2)),
                        nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LayerNorm(2))
    run_steps(net[:2], net[:2], torch.randn(5, 3), steps=1)
    params = [id(p) for p in net.parameters()]
    before = copy.deepcopy(net.state_dict())
    assert zoo.nn.convert_batchnorm(net) is net
    assert [type(m).__name__ for m in (net[1], net[2][0], net[3], net[4], net[5])] == [
        "cp_BatchNorm1d", "cp_BatchNorm2d", "cp_BatchNorm3d", "cp_SyncBatchNorm", "LayerNorm"]
    assert isinstance(net[2][0], nn.BatchNorm2d)  # still a drop-in
    assert [id(p) for p in net.parameters()] == params  # an existing optimizer stays valid
    after = net.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_convert_batchnorm_fixes_timm_set_grad_checkpointing():
    """timm's set_grad_checkpointing recomputes whole blocks with torch's checkpoint."""
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(0)
    plain = timm.create_model("resnet10t", num_classes=5)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    broken = copy.deepcopy(ckpt)
    run_steps(broken, broken, x, steps=1)
    assert any(m.num_batches_tracked.item() == 2 for m in broken.modules()
               if isinstance(m, nn.BatchNorm2d)), "timm no longer double counts: update the docs"
    zoo.nn.convert_batchnorm(ckpt)
    assert_same_training(plain, plain, ckpt, ckpt, x)


def test_cp_batchnorm_eval_and_plain_forward_unchanged():
    bn = zoo.cp_BatchNorm2d(3)
    ref = nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(bn(x), ref(x))
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    bn.eval(), ref.eval()
    torch.testing.assert_close(bn(x), ref(x))


def test_cp_batchnorm_rejects_bad_input_without_touching_state():
    bn = zoo.cp_BatchNorm2d(3)
    y = zoo.checkpoint(lambda t: bn(t) * 1.0, torch.randn(2, 3, 4, 4, requires_grad=True))
    y.sum().backward()
    assert bn.num_batches_tracked.item() == 1
    with pytest.raises(ValueError, match="expected 4D input"):
        bn(torch.randn(2, 3))
    assert bn.num_batches_tracked.item() == 1


# --------------------------------------------------------------------------------------------
# Every BatchNorm flavour: timm's own set_grad_checkpointing, which recomputes
# with torch's checkpoint, double counts each flavour until convert_batchnorm gives it its twin.
# --------------------------------------------------------------------------------------------
def _bn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _timm_pair(name: str, convert=None, **kwargs):
    """(plain, checkpointed) timm models with equal weights; ``convert`` is applied to both."""
    torch.manual_seed(0)
    plain = timm.create_model(name, pretrained=False, num_classes=5, **kwargs)
    if convert is not None:
        plain = convert(plain)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    return plain, ckpt


def _assert_double_counted(plain: nn.Module, ckpt: nn.Module, x: torch.Tensor) -> None:
    """The unconverted model's statistics drift from the plain model's: the test can fail."""
    ref, broken = copy.deepcopy(plain), copy.deepcopy(ckpt)
    run_steps(ref, ref, x, steps=3)
    run_steps(broken, broken, x, steps=3)
    assert any(not torch.equal(a.num_batches_tracked, b.num_batches_tracked)
               for a, b in zip(_bn_layers(ref), _bn_layers(broken))), \
        "timm no longer double counts: this test cannot fail, update it"


TIMM_FLAVOURS = [  # (model, BatchNorm class names it holds, image side)
    ("resnet10t", {"BatchNorm2d"}, 32),
    ("densenet121", {"BatchNormAct2d"}, 32),
    ("efficientnet_b0", {"BatchNormAct2d"}, 32),
    ("mobilenetv3_large_100", {"BatchNormAct2d"}, 32),
    ("regnety_002", {"BatchNormAct2d"}, 32),
    ("rexnet_100", {"BatchNorm2d", "BatchNormAct2d"}, 32),  # timm's CSPNets refuse checkpointing
]


@pytest.mark.parametrize("name,flavours,side", TIMM_FLAVOURS, ids=[f[0] for f in TIMM_FLAVOURS])
def test_convert_batchnorm_every_timm_flavour_is_exact(name, flavours, side):
    """After three steps under timm's set_grad_checkpointing(True), BN buffers equal plain's."""
    plain, ckpt = _timm_pair(name)
    assert {type(m).__name__ for m in _bn_layers(ckpt)} == flavours
    x = torch.randn(2, 3, side, side)
    _assert_double_counted(plain, ckpt, x)
    params, keys = [id(p) for p in ckpt.parameters()], list(ckpt.state_dict())
    zoo.nn.convert_batchnorm(ckpt)
    assert {type(m).__name__ for m in _bn_layers(ckpt)} == {f"cp_{f}" for f in flavours}
    assert [id(p) for p in ckpt.parameters()] == params and list(ckpt.state_dict()) == keys
    assert_same_training(plain, plain, ckpt, ckpt, x, steps=3)


def test_convert_batchnorm_timm_sync_and_split_batchnorm():
    """timm's SyncBatchNormAct (momentum forward) and SplitBatchNorm2d (its own forward, so the
    twin snapshots its buffers) in one model, single process."""
    from timm.layers import convert_splitbn_model, convert_sync_batchnorm

    def sync_then_split(model: nn.Module) -> nn.Module:
        model = convert_sync_batchnorm(model)
        block = model.layer1[0]  # inside a checkpointed stage
        block.bn1 = convert_splitbn_model(nn.Sequential(block.bn1), num_splits=2)[0]
        return model

    plain, ckpt = _timm_pair("resnet10t", convert=sync_then_split)
    x = torch.randn(4, 3, 64, 64)
    names = {type(m).__name__ for m in _bn_layers(ckpt)}
    assert names == {"SyncBatchNorm", "SplitBatchNorm2d", "BatchNorm2d"}, names
    _assert_double_counted(plain, ckpt, x)
    zoo.nn.convert_batchnorm(ckpt)
    assert {type(m).__name__ for m in _bn_layers(ckpt)} == {
        "cp_SyncBatchNorm", "cp_SplitBatchNorm2d", "cp_BatchNorm2d"}
    assert_same_training(plain, plain, ckpt, ckpt, x, steps=3)


def test_convert_batchnorm_timm_sync_batchnorm_act_keeps_act_and_drop():
    from timm.layers import convert_sync_batchnorm

    plain, ckpt = _timm_pair("efficientnet_b0", convert=convert_sync_batchnorm)
    assert {type(m).__name__ for m in _bn_layers(ckpt)} == {"SyncBatchNormAct"}
    acts = [(type(m.act), type(m.drop)) for m in _bn_layers(ckpt)]
    zoo.nn.convert_batchnorm(ckpt)
    assert {type(m).__name__ for m in _bn_layers(ckpt)} == {"cp_SyncBatchNormAct"}
    assert [(type(m.act), type(m.drop)) for m in _bn_layers(ckpt)] == acts
    assert_same_training(plain, plain, ckpt, ckpt, torch.randn(2, 3, 32, 32), steps=3)


class HandWrittenBN(nn.BatchNorm1d):
    """A user's BatchNorm that updates its statistics itself (not through ``momentum``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.lerp_(x.mean(0), 0.5)
                self.num_batches_tracked += 1
            return (x - x.mean(0)) / (x.var(0, unbiased=False) + self.eps).sqrt()
        return (x - self.running_mean) / (self.running_var + self.eps).sqrt()


@pytest.mark.parametrize("reentrant", [False, True])
def test_convert_batchnorm_any_subclass_under_torch_checkpoint(reentrant):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), HandWrittenBN(4), nn.Linear(4, 2))
    ckpt = copy.deepcopy(plain)
    x = torch.randn(6, 3, requires_grad=True)
    forward = lambda t: torch_checkpoint.checkpoint(ckpt, t, use_reentrant=reentrant)  # noqa: E731
    broken = copy.deepcopy(plain)
    run_steps(broken, lambda t: torch_checkpoint.checkpoint(broken, t, use_reentrant=reentrant),
              x, steps=1)
    assert broken[1].num_batches_tracked.item() == 2  # without conversion: counted twice
    zoo.nn.convert_batchnorm(ckpt)
    assert type(ckpt[1]).__name__ == "cp_HandWrittenBN" and isinstance(ckpt[1], HandWrittenBN)
    assert_same_training(plain, plain, ckpt, forward, x, steps=3)


class ScaledBN(nn.BatchNorm2d):
    """A user's BatchNorm with its own forward around torch's (whose backward saves the running
    statistics, so a recompute must not bump their version)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2 + 1


@pytest.mark.parametrize("reentrant", [False, True])
def test_convert_batchnorm_subclass_wrapping_torch_forward_under_torch_checkpoint(reentrant):
    plain = small_resnet_block(ScaledBN)
    ckpt = copy.deepcopy(plain)
    zoo.nn.convert_batchnorm(ckpt)
    assert type(ckpt[1]).__name__ == "cp_ScaledBN"
    forward = lambda t: torch_checkpoint.checkpoint(ckpt, t, use_reentrant=reentrant)  # noqa: E731
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    assert_same_training(plain, plain, ckpt, forward, x, steps=3, exact=True)
    assert ckpt[1].num_batches_tracked.item() == 3


def test_convert_batchnorm_leaves_layers_without_statistics_alone():
    from timm.layers import FrozenBatchNormAct2d

    net = nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False), FrozenBatchNormAct2d(3),
                        nn.InstanceNorm2d(3), nn.BatchNorm2d(3))
    kinds = [type(m) for m in net]
    zoo.nn.convert_batchnorm(net)
    assert [type(m) for m in net][:3] == kinds[:3]
    assert type(net[3]) is zoo.cp_BatchNorm2d


def test_converted_timm_model_pickles_deepcopies_and_restores():
    """torch.save(model) of a converted model loads as converted; restore_batchnorm undoes it."""
    import io

    torch.manual_seed(0)
    model = zoo.nn.convert_batchnorm(timm.create_model("efficientnet_b0", num_classes=3))
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    for other in (loaded, copy.deepcopy(model)):
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]
        torch.testing.assert_close(other(x), model(x))
    out = model(x)
    zoo.nn.restore_batchnorm(model)
    assert {type(m).__name__ for m in _bn_layers(model)} == {"BatchNormAct2d"}
    torch.testing.assert_close(model(x), out)


def test_in_recompute_is_a_deprecated_alias_outside_the_api():
    """zoo.is_recomputing is the one public name; the old zoo.nn.in_recompute still answers (it
    was in zoo.nn's API), with a DeprecationWarning, and is no longer listed in ``__all__``."""
    with pytest.warns(DeprecationWarning, match="zoo.is_recomputing"):
        old = zoo.nn.in_recompute
    assert old is zoo.nn._recomputing_under_any_checkpoint and not old()
    assert "in_recompute" not in zoo.nn.__all__
    with pytest.raises(AttributeError):
        zoo.nn.no_such_name  # noqa: B018
