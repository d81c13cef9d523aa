"""A zoo model under autocast casts each parameter once and holds no cast past its use.

Autocast caches each parameter's low-precision copy until its block exits; a zoo model runs
without that cache (``zoo.checkpoint.casts.casts_once``). These tests pin both halves of why that
is safe and worth it: every model trains bit for bit as with the cache (each parameter is cast
once per forward either way), and nothing is left for the autocast block's exit to free, where a
checkpointed region with the cache would hold its weights' copies until then.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch import nn

import zoo
from helpers import assert_same_training, freed_at_autocast_exit
from test_models import names


def _forward(model: nn.Module, cached: bool) -> Callable[..., torch.Tensor]:
    """``model``'s forward with autocast's cache (unwrapped) or as the model runs it (without;
    a model whose forward is not wrapped fails here)."""
    return type(model).forward.__wrapped__ if cached else type(model).forward


def _bf16(model: nn.Module, cached: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model``'s forward (:func:`_forward`) under bf16 autocast."""
    forward = _forward(model, cached)

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(model, x)
    return run


@pytest.mark.parametrize("name", names())
def test_every_model_trains_in_bf16_as_with_the_cache_bit_for_bit(name):
    """Checkpointed (its recommended mode): stored stem and head, regions in forward and
    recompute, each casting without the cache."""
    torch.manual_seed(0)
    cached, model = zoo.create_model(name, efficient=True), zoo.create_model(name, efficient=True)
    x = cached.example_input(2)
    assert_same_training(cached, _bf16(cached, True), model, _bf16(model, False), x, steps=1,
                         exact=True)


def test_the_cache_changes_the_gradient_of_a_parameter_used_twice():
    """Why only a model that uses each parameter once may drop the cache: a weight used twice
    shares one cached copy, whose gradient sums both uses in bf16; two copies sum in float32."""
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 64), torch.randn(8, 64)

    def grad(cache: bool) -> torch.Tensor:
        linear.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            loss = linear(torch.tanh(linear(x))).float().square().sum()
        loss.backward()
        return linear.weight.grad.clone()
    assert not torch.equal(grad(True), grad(False))


@pytest.mark.parametrize("name", ["gpt2_small", "resnet20"])
def test_the_autocast_block_exit_frees_nothing_a_zoo_model_cast(name):
    """With the cache, the exit frees every cast no saved tensor holds: a plain model's unsaved
    ones (biases), a checkpointed model's weights in its regions too (their copies saved for
    nothing: recomputed in backward); a zoo model has no cast left for the exit to free."""
    kwargs = {"depth": 2, "embed_dim": 64, "num_heads": 2, "num_classes": 100} \
        if name == "gpt2_small" else {}
    freed = {}
    for efficient in (False, True):
        torch.manual_seed(0)
        model = zoo.create_model(name, efficient=efficient, **kwargs)
        x = model.example_input(2)
        for cached in (True, False):
            freed[efficient, cached] = freed_at_autocast_exit(
                model, partial(_forward(model, cached), model, x))
    assert freed[False, False] == freed[True, False] == 0
    assert freed[True, True] > freed[False, True] > 0
