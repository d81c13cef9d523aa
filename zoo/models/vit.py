"""Vision Transformers (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", arXiv:2010.11929)
with memory-efficient (checkpointed) training.

An image is cut into ``patch_size`` x ``patch_size`` patches, each linearly embedded; a class
token is prepended, learned position embeddings added, and a stack of pre-norm transformer
blocks (``zoo.models._transformer.Block``) runs on the tokens. The class token's final state,
LayerNorm'd, feeds a linear classifier.

Checkpoint modes (see ``_transformer``): ``"block"`` (recommended) recomputes each block in
backward, keeping only its input; ``"sublayer"`` checkpoints the attention and MLP halves apart;
``"selective"`` keeps the blocks' matmul outputs and recomputes attention and pointwise ops.
``"block"`` peaks at exactly timm's ``set_grad_checkpointing(True)`` for fewer FLOPs, because its
last block is not recomputed (figures, machine and command: docs/benchmarks/models.md).

ViT uses dropout where BERT and GPT-2 do (after each sublayer, on attention probabilities, after
the position embedding, before the head), not after the MLP's GELU as timm also does; with the
default rates (0) the two are the same model.

State dicts use timm's ``VisionTransformer`` names (``cls_token``, ``pos_embed``,
``patch_embed.proj``, ``blocks.N.attn.qkv`` ..., ``norm``, ``head``), so timm's
``vit_small_patch16_224`` / ``vit_base_patch16_224`` weights load with ``strict=True``.

Inputs of another size than the one the position embeddings were made for are accepted: the
embeddings are resampled (bicubic, as timm's ``dynamic_img_size``) to the patch grid.
"""
from __future__ import annotations

import torch
from timm.layers import PatchEmbed, resample_abs_pos_embed, trunc_normal_
from torch import nn

from ._base import CIFAR_MEAN, CIFAR_STD, check_size, classifier
from ._registry import build_model, register_model
from ._transformer import (Block, EmbeddedBlock, TransformerModel,
                           check_transformer_args)

__all__ = ["VisionTransformer"]


class VisionTransformer(TransformerModel):
    """ViT with a class token and learned absolute position embeddings (timm's default layout).

    Args:
        img_size: the image side the position embeddings are made for.
        patch_size: side of each square patch.
        embed_dim: width.
        depth: number of blocks.
        num_heads: attention heads.
        mlp_ratio: MLP width as a multiple of ``embed_dim``.
        num_classes: classifier outputs.
        drop_rate: dropout after the position embedding and in every block (hidden dropout).
        attn_drop_rate: dropout on attention probabilities.
        drop_path_rate: stochastic depth, rising linearly over the blocks to this rate.
        efficient: checkpointing: ``False``, ``True`` (``"block"``) or a mode name.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 num_classes: int = 1000, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, efficient: bool | str = False) -> None:
        super().__init__()
        check_size(img_size, "img_size", "the image side, in pixels")
        check_size(patch_size, "patch_size", "the patch side, in pixels")
        check_transformer_args(embed_dim, depth, num_heads, mlp_ratio, drop_rate=drop_rate,
                               attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate)
        if img_size % patch_size:
            raise ValueError(f"img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
        self.num_classes = num_classes
        self.num_features = embed_dim
        self.img_size, self.patch_size = img_size, patch_size
        self.patch_embed = PatchEmbed(img_size, patch_size, 3, embed_dim, strict_img_size=False)
        grid = img_size // patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, drop=drop_rate,
                  attn_drop=attn_drop_rate, drop_path=rates[i], norm_eps=1e-6, pre_norm=True)
            for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = classifier(embed_dim, num_classes)

        # timm's initialisation (init_weights_vit_timm)
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.set_grad_checkpointing(efficient)

    first_conv = "patch_embed.proj"

    def data_cfg(self) -> dict:
        """timm's ViT settings at ``img_size``: bicubic resize, centre crop, and mean = std = 0.5
        with a 0.9 crop (its ImageNet ViTs'), or CIFAR-10's statistics and no crop for a model
        made for 32 px. No pooled size (the head reads the class token); other image sides that
        are multiples of the patch work too (the position embeddings are resampled)."""
        side = self.img_size
        if side <= 32:
            mean, std, crop = CIFAR_MEAN, CIFAR_STD, 1.0
        else:
            mean, std, crop = (0.5,) * 3, (0.5,) * 3, 0.9
        return dict(input_size=(3, side, side), mean=mean, std=std, interpolation="bicubic",
                    crop_pct=crop, crop_mode="center")

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) -> tokens (B, 1 + H/p * W/p, dim): patches, class token, positions."""
        if images.ndim != 4 or images.shape[-1] % self.patch_size or images.shape[-2] % self.patch_size:
            raise ValueError(f"expected images (B, 3, H, W) with H and W multiples of the patch "
                             f"size {self.patch_size}, got shape {tuple(images.shape)}")
        grid = (images.shape[-2] // self.patch_size, images.shape[-1] // self.patch_size)
        x = self.patch_embed(images)
        pos_embed = self.pos_embed
        side = self.img_size // self.patch_size
        if grid != (side, side):
            pos_embed = resample_abs_pos_embed(pos_embed, list(grid), [side, side],
                                               num_prefix_tokens=1)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> final LayerNorm'd tokens (B, 1 + patches, dim), the class token first."""
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        return self.norm(self.forward_blocks(self.embed(x)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens -> the class token's features (``pre_logits``) or logits."""
        x = self.head_drop(x[:, 0])
        return x if pre_logits else self.head(x)

    def checkpoint_chain(self) -> list[nn.Module]:
        """The embedding (patches, class token, positions) with the first block
        (:class:`EmbeddedBlock`: in ``selective_stream`` the block's region starts at the
        images), every other block, the final norm. The constructor refuses ``depth`` 0, so
        there is always a first block."""
        return [EmbeddedBlock(self.embed, self.blocks[0]), *self.blocks[1:], self.norm]

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random images. ``size`` defaults to ``img_size`` for models made for 32 px and to 160
        for the 224 px ones (position embeddings are resampled): at 128 px a batch of 4 has fewer
        activations than the parameters' gradients, so no checkpointing can lower the step's
        peak; at 160 it can, with half the tokens of 224 for CPU tests. Pass 224
        for the native resolution."""
        if size is None:
            size = self.img_size if self.img_size <= 32 else 160
        return torch.randn(batch_size, 3, size, size, device=self.norm.weight.device)


@register_model
def vit_cifar(efficient: bool | str = False, **kwargs) -> VisionTransformer:
    """ViT-Lite-7/4 for 32x32 CIFAR (Hassani et al. 2021, "Escaping the Big Data Paradigm with
    Compact Transformers", arXiv:2104.05704): patch 4 (64 patches + class token), dim 256, depth
    7, 4 heads, MLP ratio 2; 3.72M parameters at 10 classes, 91.4% on CIFAR-10 in that paper.
    Chosen as the published small ViT trained from scratch on CIFAR with the plain ViT layout."""
    model_args = dict(img_size=32, patch_size=4, embed_dim=256, depth=7, num_heads=4,
                      mlp_ratio=2.0, num_classes=10)
    return build_model(VisionTransformer, model_args, efficient=efficient, **kwargs)


@register_model
def vit_small_patch16_224(efficient: bool | str = False, **kwargs) -> VisionTransformer:
    """ViT-S/16 (DeiT-S, Touvron et al. 2021; timm's vit_small_patch16_224): dim 384, depth 12,
    6 heads; 22.1M parameters at 1000 classes. Loads timm's weights strictly."""
    model_args = dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return build_model(VisionTransformer, model_args, efficient=efficient, **kwargs)


@register_model
def vit_base_patch16_224(efficient: bool | str = False, **kwargs) -> VisionTransformer:
    """ViT-B/16 (Dosovitskiy et al. 2021, Table 1): dim 768, depth 12, 12 heads; 86.6M parameters
    at 1000 classes. Loads timm's vit_base_patch16_224 weights strictly."""
    model_args = dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return build_model(VisionTransformer, model_args, efficient=efficient, **kwargs)
