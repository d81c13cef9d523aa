"""RNG state per checkpointed region: saved only where a region draws random numbers.

A zoo model's region that draws no random number (a DenseNet's or ResNet's BatchNorm-ReLU-conv
regions, a transformer block without active dropout or stochastic depth) passes
``preserve_rng_state=False``: its step then reads and writes no RNG state at all, and still
trains bit for bit like the plain model. A region that does draw (dropout inside it) keeps saving
and replaying its random numbers. The RNG state calls are counted for real: the torch functions
are wrapped by counters that call them (``zoo.memory.host.rng_state_calls``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training
from zoo.checkpoint import keywords
from zoo.memory import train_step
from zoo.memory.host import recorded_regions, rng_state_calls
from zoo.models._transformer import TransformerModel
from zoo.models.bert import Bert
from zoo.models.densenet import DenseNet
from zoo.models.gpt2 import GPT2
from zoo.models.resnet import ResNet
from zoo.models.vit import VisionTransformer

def rng_calls_per_step(model: nn.Module, x: torch.Tensor) -> int:
    """RNG state reads and writes of one training step (after a first one, outside the count);
    it leaves gradients in ``model``."""
    step = train_step(model, x)
    step()
    return sum(rng_state_calls(step).values())


def tiny_densenet(efficient: bool | str = False, drop_rate: float = 0.0) -> DenseNet:
    return DenseNet(growth_rate=4, block_config=(2, 3), num_init_features=8, bn_size=4,
                    drop_rate=drop_rate, num_classes=5, stem="imagenet", efficient=efficient)


def tiny_resnet(efficient: bool | str = False) -> ResNet:
    from zoo.models.resnet_blocks import Bottleneck
    return ResNet(Bottleneck, [1, 2, 1, 1], num_classes=5, efficient=efficient, drop_rate=0.2)


def tiny_transformer(family: str, efficient: bool | str = False,
                     drop: float = 0.0) -> TransformerModel:
    common = dict(embed_dim=32, depth=3, num_heads=4, drop_rate=drop, attn_drop_rate=drop,
                  efficient=efficient)
    if family == "vit":
        return VisionTransformer(img_size=32, patch_size=8, num_classes=5, drop_path_rate=drop,
                                 **common)
    if family == "bert":
        return Bert(vocab_size=100, max_positions=32, num_classes=3, **common)
    return GPT2(num_classes=100, context_length=32, **common)


NO_DROPOUT = (
    [(tiny_densenet, m) for m in DenseNet.checkpoint_modes]
    + [(tiny_resnet, m) for m in ("halves", "block", "bn_relu")]
    + [(lambda efficient, f=f: tiny_transformer(f, efficient), m)
       for f, cls in (("vit", VisionTransformer), ("bert", Bert), ("gpt2", GPT2))
       for m in cls.checkpoint_modes])


@pytest.mark.parametrize("build, mode", NO_DROPOUT,
                         ids=[f"{b(False).__class__.__name__}-{m}" for b, m in NO_DROPOUT])
def test_regions_that_draw_nothing_touch_no_rng_state_and_train_bit_for_bit(build, mode):
    torch.manual_seed(0)
    plain, ckpt = build(False), build(mode)
    x = plain.example_input(2)
    assert_same_training(plain, plain, ckpt, ckpt, x, exact=True)
    assert rng_calls_per_step(ckpt, x) == 0
    # the random stream after a step is where the plain step leaves it
    torch.manual_seed(1)
    train_step(plain, x)()
    after_plain = torch.get_rng_state()
    torch.manual_seed(1)
    train_step(ckpt, x)()
    assert torch.equal(torch.get_rng_state(), after_plain)


@pytest.mark.parametrize("name, regions", [
    pytest.param("densenet_bc_100", 99, marks=pytest.mark.slow),
    pytest.param("resnet110", 46, marks=pytest.mark.slow), ("vit_cifar", 6)])
def test_registered_efficient_models_read_no_rng_state(name, regions):
    """The recommended modes of the registered models, at their default (no dropout)."""
    model = zoo.create_model(name, efficient=True)
    x = model.example_input(2)
    opened = len(recorded_regions(train_step(model, x)))
    assert opened == regions  # the zero below counts something
    assert rng_calls_per_step(model, x) == 0


@pytest.mark.parametrize("build, regions", [
    (lambda mode: zoo.create_model("cifar_cnn", efficient=mode), 4),
    (lambda mode: tiny_transformer("vit", mode, drop=0.1), 2),
    (lambda mode: tiny_densenet(mode, drop_rate=0.2), 0)], ids=["cifar_cnn", "vit", "densenet"])
def test_regions_that_draw_keep_saving_and_replaying_their_random_numbers(build, regions):
    """cifar_cnn's dropout and a ViT's dropout and stochastic depth run inside the regions
    (``regions``: those that save RNG state): each reads the CPU state in its forward, and
    reads, sets and puts it back in its recompute (4 calls); DenseNet's dropout runs outside its
    regions, which draw nothing."""
    torch.manual_seed(0)
    plain, ckpt = build(False), build(True)
    x = plain.example_input(2)
    assert_same_training(plain, plain, ckpt, ckpt, x, exact=True)
    assert rng_calls_per_step(ckpt, x) == 4 * regions


def _planned(model: nn.Module) -> nn.Module:
    """``model`` with a nested plan over its chain: every other pair of blocks one region, the
    last segment a region whose recompute checkpoints its blocks again."""
    n = len(model.checkpoint_chain())
    plan = [(a, min(a + 2, n - 2), a % 4 == 0) for a in range(0, n - 2, 2)]
    model.set_checkpoint_plan(plan + [(n - 2, n, [(n - 2, n - 1, True), (n - 1, n, True)])])
    return model


@pytest.mark.parametrize("build, regions", [
    (lambda: tiny_densenet(), 0), (lambda: tiny_resnet(), 0),
    (lambda: tiny_densenet(drop_rate=0.2), None)], ids=["densenet", "resnet", "densenet-dropout"])
def test_a_plans_regions_save_rng_state_only_where_the_chain_draws(build, regions):
    """A plan over the chain (the planner's, or a user's) of a model whose chain draws no random
    number saves none in any region, nested ones included; a DenseNet with dropout in its layers
    saves and replays it. Both train bit for bit like the plain model."""
    torch.manual_seed(0)
    plain, planned = build(), _planned(build())
    planned.load_state_dict(plain.state_dict())
    x = plain.example_input(2)
    assert_same_training(plain, plain, planned, planned, x, exact=True)
    calls = rng_calls_per_step(planned, x)
    assert calls == 0 if regions == 0 else calls > 0


def test_a_block_draws_random_numbers_only_with_a_positive_rate_in_train_mode():
    block = tiny_transformer("vit").blocks[1]
    assert not block.train().draws_random_numbers()
    for part in ("attn.attn_drop", "attn.proj_drop.p", "mlp.drop2.p"):
        block = tiny_transformer("vit").blocks[1]
        owner, _, attr = part.rpartition(".")
        setattr(block.get_submodule(owner), attr, 0.1)
        assert block.train().draws_random_numbers(), part
        assert not block.eval().draws_random_numbers(), part
    with_depth = tiny_transformer("vit", drop=0.1).blocks[1]
    with_depth.attn.attn_drop = with_depth.attn.proj_drop.p = with_depth.mlp.drop2.p = 0.0
    assert with_depth.train().draws_random_numbers()  # its DropPath still draws
    unknown = tiny_transformer("vit").blocks[1]
    unknown.mlp.act = nn.SiLU()  # not what a block is built of: assumed to draw
    assert unknown.train().draws_random_numbers()


def test_preserve_rng_state_false_alone_shares_one_options_object():
    """No Options built per region for the keyword the zoo's models pass."""
    fast = keywords.options(False, None, "default", False, None)
    assert fast is keywords.NO_RNG and not fast.preserve_rng
    assert keywords.options(True, None, "default", False, None) is keywords.DEFAULT
    other = keywords.options(False, None, "none", False, None)
    assert other is not keywords.NO_RNG and not other.preserve_rng and not other.check_shapes
