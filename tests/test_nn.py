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
