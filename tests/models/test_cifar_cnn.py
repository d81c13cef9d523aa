"""The CIFAR-10 CNN of Spell's checkpointing post: its architecture, and proof that its dropout
and BatchNorm can stay *inside* the checkpointed blocks (the post moved them out, and left the
first block unchecked).

With dropout active in train mode, every checkpoint mode gives the plain model's outputs and
gradients (same seed before each forward) and BatchNorm buffers, although dropout and BatchNorm
really do run twice, in the forward and in the recompute.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training, train_step_peak
from zoo.memory import default_loss
from zoo.models.cifar_cnn import CifarCNN

MODES = CifarCNN.checkpoint_modes


def test_layers_are_the_posts():
    """conv 3->32->64, pool, dropout 0.25; conv 64->64->64, pool, dropout 0.25; Linear(4096, 512),
    ReLU, dropout 0.5, Linear(512, 10). The post's model (no BatchNorm, biased convolutions) has
    896 + 18,496 + 36,928 + 36,928 + 2,097,664 + 5,130 = 2,196,042 parameters; with BatchNorm the
    four conv biases (224) give way to BatchNorm's 2 x 224."""
    post = zoo.create_model("cifar_cnn", batch_norm=False)
    convs = [m for m in post.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (3, 32, (3, 3), (1, 1)), (32, 64, (3, 3), (1, 1)), (64, 64, (3, 3), (1, 1)),
        (64, 64, (3, 3), (1, 1))]
    assert [m.p for m in post.modules() if isinstance(m, nn.Dropout)] == [0.25, 0.25, 0.5]
    assert [(m.in_features, m.out_features) for m in post.modules() if isinstance(m, nn.Linear)] \
        == [(4096, 512), (512, 10)]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in post.modules())
    assert sum(p.numel() for p in post.parameters()) == 2_196_042
    model = zoo.create_model("cifar_cnn")
    assert sum(isinstance(m, zoo.cp_BatchNorm2d) for m in model.modules()) == 4
    assert sum(p.numel() for p in model.parameters()) == 2_196_042 - 224 + 2 * 224
    for block in (model.cnn_block_1, model.cnn_block_2):  # dropout lives inside the block
        assert isinstance(block.dropout, nn.Dropout)
    x = model.example_input(2)
    assert model.forward_features(x).shape == (2, 64, 8, 8)
    assert model.forward_head(model.forward_features(x), pre_logits=True).shape == (2, 512)
    assert model(x).shape == (2, 10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_norm", [True, False])
def test_modes_train_exactly_like_plain_with_dropout_and_batchnorm_inside(mode, batch_norm):
    torch.manual_seed(0)
    plain = zoo.create_model("cifar_cnn", batch_norm=batch_norm)
    ckpt = zoo.create_model("cifar_cnn", batch_norm=batch_norm, efficient=mode)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, plain, ckpt, ckpt, plain.example_input(2))


def test_dropout_is_active_so_the_equality_above_means_something():
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn", efficient=True).train()
    x = model.example_input(2)
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    b = model(x)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_and_batchnorm_run_again_inside_the_checkpoint_yet_count_once(mode):
    """The recompute really replays the blocks' dropout and BatchNorm (they are inside the
    checkpointed regions), and still the first block gets its gradients although the images do
    not require grad (the post's "frozen first block"), and each BatchNorm counts one batch."""
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn", efficient=mode).train()
    calls: Counter = Counter()
    watched = {name: m for name, m in model.named_modules()
               if name.startswith("cnn_block_1.") and isinstance(m, (nn.Dropout, nn.BatchNorm2d))}
    # pre-hooks: a region's recompute stops right after its last op saves what backward needs,
    # before that module's forward returns, so a forward hook would miss the replayed dropout
    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: calls.update([name]))
             for name, m in watched.items()]
    x = model.example_input(2)
    assert not x.requires_grad
    default_loss(model(x)).backward()
    for h in hooks:
        h.remove()
    # forward and recompute; ``nested`` runs its pool and dropout once, outside its region
    assert calls["cnn_block_1.dropout"] == (1 if mode == "nested" else 2)
    assert calls["cnn_block_1.bn2"] == 2
    assert model.cnn_block_1.conv1.weight.grad.abs().sum() > 0
    assert all(int(m.num_batches_tracked) == 1 for m in model.modules()
               if isinstance(m, nn.BatchNorm2d))


@pytest.mark.parametrize("mode,runs", [("halves", {"conv1": 2, "conv2": 1}),
                                       ("block", {"conv1": 2, "conv2": 2}),
                                       ("bn_relu", {"conv1": 1, "conv2": 1}),
                                       ("nested", {"conv1": 3, "conv2": 2})])
def test_each_mode_reruns_exactly_the_convolutions_it_says(mode, runs):
    """``nested``: the outer region's recompute runs conv1 and conv2 (the inner region keeping
    nothing but its output), the inner region's recompute conv1 alone (it stops before conv2)."""
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn", efficient=mode)
    seen: Counter = Counter()
    hooks = [m.register_forward_hook(lambda m, a, o, name=name: seen.update([name]))
             for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    default_loss(model(model.example_input(2))).backward()
    for h in hooks:
        h.remove()
    assert seen == {f"cnn_block_{b}.{conv}": n for b in (1, 2) for conv, n in runs.items()}


def test_nested_mode_has_the_lowest_peak():
    """Only the ReLU output after conv2's BatchNorm is kept (the max pool saves it anyway): in
    the block's backward conv2's output is made again after the ReLU's and the pool's
    gradients are gone, so fewer full-size maps are alive at once than in any other mode."""
    x = torch.randn(8, 3, 32, 32)

    def peak(mode: str | bool) -> int:
        torch.manual_seed(0)
        model = zoo.create_model("cifar_cnn", efficient=mode)
        return train_step_peak(model, x)

    nested = peak("nested")
    assert all(nested < peak(mode) for mode in (False, "halves", "block", "bn_relu"))


@pytest.mark.parametrize("mode", MODES)
def test_modes_lower_peak_memory(mode):
    torch.manual_seed(0)
    model = zoo.create_model("cifar_cnn")
    x = model.example_input(8)
    plain = train_step_peak(model, x)
    model.set_grad_checkpointing(mode)
    assert train_step_peak(model, x) < plain


def test_planner_chain_trains_exactly_like_plain():
    torch.manual_seed(0)
    plain, planned = zoo.create_model("cifar_cnn"), zoo.create_model("cifar_cnn")
    assert planned.checkpoint_chain() == [planned.cnn_block_1, planned.cnn_block_2]
    planned.set_checkpoint_plan([(0, 2, True)])
    assert_same_training(plain, plain, planned, planned, plain.example_input(2))


def test_other_image_sizes_and_bad_arguments():
    model = zoo.create_model("cifar_cnn", image_size=16, num_classes=3)
    assert model(model.example_input(2)).shape == (2, 3)
    with pytest.raises(ValueError, match="built for 16px images"):
        model.example_input(2, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        CifarCNN(image_size=30)
    with pytest.raises(ValueError, match="drop_rate must be in"):
        CifarCNN(drop_rate=1.0)
    with pytest.raises(ValueError, match="unknown CifarCNN checkpoint mode"):
        model.cnn_block_1(torch.randn(1, 3, 16, 16), mode="layer")
