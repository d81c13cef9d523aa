"""A ``save_ops`` choice finer than an op's name: keep the outputs of some ops, but not those a
given layer computes (selective recompute, Korthikanti et al. 2022, with one layer spared).

A transformer MLP's last linear output only feeds the residual sum, and an attention
sublayer's output projection likewise: a region that keeps every matmul output but theirs
loses no FLOP (its recompute stops before that layer, once backward has every saved tensor
back) and keeps one width less per token.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

__all__ = ["AllBut", "MATMUL_OPS"]

_aten = torch.ops.aten
#: The ops that dominate a step's FLOPs: matrix products, convolutions and fused attention
#: (whichever kernels this torch has).
MATMUL_OPS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
              _aten.convolution.default, *[getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name)])


class AllBut:
    """``zoo.checkpoint(..., save_ops=AllBut(ops, layer))``: keep the outputs of ``ops``
    except those computed from ``layer``'s weight. The weight is found by its storage when each
    op runs, so a weight swapped in later counts (the planner's fake copies). A class, not a
    closure, so a model holding one still deep-copies and pickles."""

    def __init__(self, ops: Collection[Any], layer: nn.Module) -> None:
        # a tuple, which torch 2.8's Dynamo reads as a constant (it cannot trace a set of ops)
        self.ops, self.layer = ops if isinstance(ops, tuple) else tuple(ops), layer

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        if op not in self.ops:
            return False
        weight = self.layer.weight.untyped_storage()._cdata
        return not any(isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == weight
                       for a in args)
