"""Reversible Vision Transformers (Mangalam et al. 2022, "Reversible Vision Transformers", CVPR):
ViTs whose blocks rebuild their inputs, exactly, during backward instead of storing them.

Each transformer block becomes a reversible coupling of two token streams (the Reformer's and
Rev-ViT's layout): ``y1 = x1 + F(x2), y2 = x2 + G(y1)`` with ``F`` the attention sublayer's
branch, ``drop_path(attn(norm1(x)))``, and ``G`` the MLP sublayer's, ``drop_path(mlp(norm2(x)))``
(:class:`RevBlock`). Both streams start as the embedded tokens (patches, class token, positions)
and are averaged after the last block (Rev-ViT's two-stream fusion), then LayerNorm'd; the class
token feeds the classifier. ``zoo.reversible`` runs the blocks on fixed-point streams, so the
rebuild is exact: ``efficient=True`` (the ``"reversible"`` mode) trains bit for bit as
``efficient=False``, the same network storing its activations, dropout and stochastic depth
included.

Every module is ViT's (:class:`zoo.models.vit.VisionTransformer`: timm's names, initialisation
and sizes), so Rev-ViT-S/B have ViT-S/B's parameter counts (22.1M / 86.6M) and FLOPs; only the
blocks' wiring differs, so ViT weights load but do not compute the same function. Its peak
beside the stored network and zoo.plan on ViT, machine and command: docs/benchmarks/reversible.md.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..reversible import reversible_sequence
from ._base import ZooModel
from ._registry import build_model, register_model
from ._transformer import Block, Step
from .vit import VisionTransformer

__all__ = ["RevBlock", "ReversibleTower", "ReversibleTransformer", "RevVisionTransformer",
           "MODE", "fuse"]

MODE = "reversible"


class RevBlock(Block):
    """A transformer block as a reversible coupling (``zoo.reversible``): ``f`` is the attention
    branch, ``g`` the MLP branch, each normalised first. The same modules and names as
    :class:`zoo.models._transformer.Block`."""

    def f(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop_path1(self.attn(self.norm1(x), attn_mask))

    def g(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop_path2(self.mlp(self.norm2(x)))

    def f_parts(self) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
        """``f`` as its norm and the rest (the rebuild makes the norm's output again)."""
        return self.norm1, self._f_tail

    def g_parts(self) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
        """``g`` as its norm and the rest (the rebuild makes the norm's output again)."""
        return self.norm2, self._g_tail

    def _f_tail(self, h: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop_path1(self.attn(h, attn_mask))

    def _g_tail(self, h: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.drop_path2(self.mlp(h))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor,  # type: ignore[override]
                attn_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block alone on two streams, storing its activations."""
        args = () if attn_mask is None else (attn_mask,)
        return reversible_sequence([self], x1, x2, *args, rebuild=False)


class ReversibleTower(nn.Module):
    """A model's reversible blocks as one element of its ``checkpoint_chain``: ``run(x, mode)``
    runs them on tokens ``x`` (``mode`` ``None``: the model's own). Holds no module."""

    def __init__(self, run: Callable[[torch.Tensor, str | None], torch.Tensor]) -> None:
        super().__init__()
        self.run = run

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        return self.run(x, mode)


def fuse(blocks: nn.Sequential, x: torch.Tensor, mode: str | None, *args: Any) -> torch.Tensor:
    """Run reversible ``blocks`` on two copies of the tokens ``x`` and average the two streams
    (``mode``: ``"reversible"`` rebuilds the activations in backward, ``None`` stores them)."""
    if mode not in (None, MODE):
        raise ValueError(f"unknown reversible checkpoint mode {mode!r}; expected None or {MODE!r}")
    y1, y2 = reversible_sequence(blocks, x, x, *args, rebuild=mode is not None)
    return (y1 + y2) * 0.5


class ReversibleTransformer:
    """Mixin of the reversible transformers: one checkpoint mode, ``"reversible"``, and
    ``make_reversible`` to turn the built model's blocks into :class:`RevBlock` couplings."""

    checkpoint_modes = (MODE,)
    planner_hand_modes = (MODE,)  # the rebuild keeps its streams: measured whole by zoo.plan
    run_chain_block = ZooModel.run_chain_block  # the tower takes the block mode itself
    blocks: nn.Sequential

    def make_reversible(self) -> None:
        for block in self.blocks:
            block.__class__ = RevBlock  # adds f and g; modules, names and weights unchanged
            block.attn.qkv_grad_in_place = True  # qkv feeds the attention alone: its memory
            # takes the qkv gradient (where SDPA runs the CPU flash kernel)


class RevVisionTransformer(ReversibleTransformer, VisionTransformer):
    """Rev-ViT: :class:`zoo.models.vit.VisionTransformer` with :class:`RevBlock` blocks on two
    streams. Same arguments as ViT; ``efficient``: ``False`` (store), ``True`` or
    ``"reversible"`` (rebuild)."""

    def __init__(self, *args: Any, efficient: bool | str = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.make_reversible()
        self.set_grad_checkpointing(efficient)

    def forward_blocks(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """The blocks on tokens ``x``, streams fused (``mode`` None: the active mode)."""
        return fuse(self.blocks, x, self.grad_checkpointing if mode is None else mode)

    def checkpoint_chain(self) -> list[nn.Module]:
        """The embedding, the reversible blocks (one element), the final norm."""
        return [Step(self.embed, "embed"), ReversibleTower(self.forward_blocks), self.norm]


@register_model
def rev_vit_cifar(efficient: bool | str = False, **kwargs: Any) -> RevVisionTransformer:
    """Rev-ViT the size of ``vit_cifar`` (ViT-Lite-7/4: patch 4, dim 256, depth 7, 4 heads, MLP
    ratio 2): 3.72M parameters at 10 classes."""
    model_args = dict(img_size=32, patch_size=4, embed_dim=256, depth=7, num_heads=4,
                      mlp_ratio=2.0, num_classes=10)
    return build_model(RevVisionTransformer, model_args, efficient=efficient, **kwargs)


@register_model
def rev_vit_small_patch16_224(efficient: bool | str = False,
                              **kwargs: Any) -> RevVisionTransformer:
    """Rev-ViT-S (Mangalam et al. 2022, Table 1): ViT-S/16's dim 384, depth 12, 6 heads; 22.1M
    parameters at 1000 classes."""
    model_args = dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return build_model(RevVisionTransformer, model_args, efficient=efficient, **kwargs)


@register_model
def rev_vit_base_patch16_224(efficient: bool | str = False,
                             **kwargs: Any) -> RevVisionTransformer:
    """Rev-ViT-B (Mangalam et al. 2022, Table 1): ViT-B/16's dim 768, depth 12, 12 heads; 86.6M
    parameters at 1000 classes."""
    model_args = dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return build_model(RevVisionTransformer, model_args, efficient=efficient, **kwargs)
