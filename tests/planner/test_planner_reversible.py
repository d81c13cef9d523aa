"""``zoo.plan`` on the reversible models (RevNet, Rev-ViT, reversible BERT) built with
``efficient=True``: the plan chooses the reversible part's mode as it chooses every other
checkpoint, whatever mode the model was built in. A plan of segments runs the reversible part
storing its activations (what its chain was profiled as, so ``plain_peak`` is the stored
network's and a plan checkpointing nothing recomputes nothing); the rebuild is the hand mode
``"reversible"``, taken where it is the cheapest plan that fits.

Each plan applied trains bit for bit as the plain model (``efficient=False``, no plan) in train
mode, dropout included, and one real training step of it peaks at the bytes it predicts.
"""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_training
from zoo import plan
from zoo.blocks import NoBlocksError
from zoo.models.rev_bert import RevBert
from zoo.models.rev_vit import RevVisionTransformer
from zoo.models.revnet import RevNet
from zoo.planner.sweep import real_peak

pytestmark = pytest.mark.usefixtures("one_thread")


def rev_vit(efficient: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = RevVisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=2,
                                 num_classes=3, drop_rate=0.1, attn_drop_rate=0.1,
                                 drop_path_rate=0.3, efficient=efficient)
    return model, model.example_input(4)


def rev_bert(efficient: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = RevBert(vocab_size=50, max_positions=16, embed_dim=32, depth=2, num_heads=2,
                    num_classes=3, efficient=efficient)
    return model, torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))


def revnet(efficient: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = RevNet((2, 1, 2), (8, 8, 16, 24), num_classes=3, efficient=efficient)
    return model, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("build", [rev_vit, rev_bert, revnet])
def test_a_plan_chooses_the_reversible_mode_and_keeps_its_promise(build):
    plain, x = build(efficient=False)
    stored_peak = real_peak(plain, x)
    model, _ = build(efficient=True)
    rebuilt_peak = real_peak(model, x)
    assert rebuilt_peak < stored_peak
    free = plan(model, x, "inf")
    assert free.plain_peak == stored_peak and free.recompute_flops == 0 and free.mode is None
    assert model.grad_checkpointing is None  # the plan's segments replace the built mode
    for budget in ("inf", stored_peak - 1, rebuilt_peak):
        chosen = plan(model, x, budget)
        assert chosen.predicted_peak <= float(budget)
        assert real_peak(model, x) == chosen.predicted_peak, (budget, chosen.mode)
        assert_same_training(plain, plain, model, model, x, exact=True)


def test_blocks_the_step_never_calls_are_refused_in_one_line():
    """A reversible tower runs its blocks' ``f`` and ``g``, never their ``forward``: named as the
    modules to checkpoint (``modules=["RevBlock"]``) they would be wrapped to no effect while the
    plan printed them as its blocks."""
    model, x = rev_vit(efficient=False)
    with pytest.raises(NoBlocksError, match=r"calls none of the 3 modules .*\(RevBlock\)") as e:
        plan(model, x, "inf", modules=["RevBlock"], apply=False)
    assert "\n" not in str(e.value)
    assert plan(model, x, "inf", modules=["Attention"], apply=False).blocks  # called: planned
