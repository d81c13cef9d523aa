"""Attention's ``qkv_grad_in_place`` option: the backward writes the qkv gradient over the saved
qkv output head by head; outputs and every gradient bitwise those of the plain attention."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import assert_same_training
from zoo.models._transformer import Attention
from zoo.models.rev_vit import RevVisionTransformer
from zoo.planner import measure_step

_FLASH_BW = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _Calls(TorchDispatchMode):
    """The aten ops dispatched, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _pair(dtype=torch.float64, heads=4, **kw) -> tuple[Attention, Attention]:
    torch.manual_seed(0)
    plain = Attention(32, heads, **kw).to(dtype)
    in_place = copy.deepcopy(plain)
    in_place.qkv_grad_in_place = True
    return plain, in_place


def _backward_calls(attn: Attention, x: torch.Tensor, **kw) -> list:
    with _Calls() as calls:
        attn(x.requires_grad_(), **kw).sum().backward()
    attn.zero_grad(set_to_none=True)
    return calls.ops


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.float64, False),
                                             (torch.float32, True)])
@pytest.mark.parametrize("causal", [False, True])
def test_outputs_and_gradients_bitwise_the_plain_attention(dtype, autocast, causal):
    plain, in_place = _pair(dtype, causal=causal)
    x = torch.randn(6, 13, 32, dtype=dtype)
    assert _backward_calls(in_place, x.clone()).count(_FLASH_BW) == 4  # one call per head

    def forward(attn):
        def run(t):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                return attn(t)
        return run

    x.requires_grad_()
    assert_same_training(plain, forward(plain), in_place, forward(in_place), x, exact=True)
    x_grads = []  # the input's gradient too
    for attn in (plain, in_place):
        x.grad = None
        forward(attn)(x).float().square().sum().backward()
        x_grads.append(x.grad)
    assert torch.equal(*x_grads)


def test_retained_graph_backward_twice_gives_the_plain_gradients():
    """With ``retain_graph=True`` the saved qkv is read again: not overwritten."""
    plain, in_place = _pair()
    x = torch.randn(3, 9, 32, dtype=torch.float64)
    got = []
    for attn in (plain, in_place):
        y = attn(x).square().sum()
        y.backward(retain_graph=True)
        y.backward()
        got.append([p.grad for p in attn.parameters()])
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_plain_path_where_sdpa_is_not_the_flash_kernel_alone():
    """Attention dropout in training (SDPA's math path) or a mask: the plain ops, exactly."""
    plain, in_place = _pair(attn_drop=0.1)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.manual_seed(1)
    ops_plain = _backward_calls(plain, x.clone())
    torch.manual_seed(1)
    assert _backward_calls(in_place, x.clone()) == ops_plain
    assert _FLASH_BW not in ops_plain
    plain, in_place = _pair()
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert _backward_calls(in_place, x.clone(), attn_mask=mask) == \
        _backward_calls(plain, x.clone(), attn_mask=mask)


def test_rebuilt_reversible_vit_holds_less_at_its_attention_backward():
    """Exact bytes (fake step): in a rebuilding Rev-ViT whose peak is an attention backward, the
    plain kernel holds all heads' new q/k/v gradients beside the saved qkv output; in place,
    one head's (4 heads: three quarters of a qkv output less, the peak then moving elsewhere)."""
    torch.manual_seed(0)
    model = RevVisionTransformer(img_size=32, patch_size=2, embed_dim=64, depth=3, num_heads=4,
                                 mlp_ratio=2.0, num_classes=3, efficient=True)
    x = model.example_input(8)
    assert all(block.attn.qkv_grad_in_place for block in model.blocks)
    in_place = measure_step(model, x)[0]
    for block in model.blocks:
        block.attn.qkv_grad_in_place = False
    qkv = 8 * (16 * 16 + 1) * 3 * 64 * 4
    assert measure_step(model, x)[0] - in_place >= qkv // 2


def test_compiled_equals_compiled_plain_bitwise():
    plain, in_place = _pair(torch.float32)
    x = torch.randn(4, 9, 32)
    assert_same_training(plain, torch.compile(plain), in_place, torch.compile(in_place), x,
                         exact=True)
