"""BERT-base's encoder with reversible layers (the Reformer's layers, Kitaev et al. 2020,
"Reformer: The Efficient Transformer", arXiv:2001.04451, on BERT, Devlin et al. 2019).

BERT's embeddings, pooler and classifier (:class:`zoo.models.bert.Bert`) around blocks that are
reversible couplings of two token streams, ``y1 = x1 + attn(norm1(x2))``,
``y2 = x2 + mlp(norm2(y1))`` (:class:`zoo.models.rev_vit.RevBlock`: BERT's modules and names,
normalised before each sublayer, as a reversible layer must be). Both streams start as the
embeddings and are averaged after the last block; a final LayerNorm (``norm``, 1,536 parameters,
which a stack of pre-normalised sublayers needs and post-norm BERT does not) precedes the
pooler: 109.5M parameters with 2 classes, as ``bert_base``. Dropout as BERT's (0.1 on the
embeddings, attention probabilities and after every sublayer), replayed exactly by the rebuild.
``efficient=True`` (the ``"reversible"`` mode) trains bit for bit as ``efficient=False``.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ._registry import build_model, register_model
from .bert import Bert
from .rev_vit import ReversibleTower, ReversibleTransformer, fuse

__all__ = ["RevBert"]


class RevBert(ReversibleTransformer, Bert):
    """:class:`zoo.models.bert.Bert` with reversible blocks and a final LayerNorm; the same
    arguments (``efficient``: ``False``, ``True`` or ``"reversible"``)."""

    def __init__(self, *args: Any, efficient: bool | str = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.make_reversible()
        self.norm = nn.LayerNorm(self.num_features, eps=1e-12)
        self.set_grad_checkpointing(efficient)

    def forward_blocks(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                       mode: str | None = None) -> torch.Tensor:
        """The blocks on embeddings ``x``, streams fused and normalised."""
        args = () if attn_mask is None else (attn_mask,)
        mode = self.grad_checkpointing if mode is None else mode
        return self.norm(fuse(self.blocks, x, mode, *args))

    def _chain(self, token_type_ids: torch.Tensor | None,
               mask: torch.Tensor | None) -> list[nn.Module]:
        embed = self.embeddings if token_type_ids is None else partial(
            self.embeddings, token_type_ids=token_type_ids)
        return [embed, ReversibleTower(lambda x, mode: self.forward_blocks(x, mask, mode))]


@register_model
def rev_bert_base(efficient: bool | str = False, **kwargs: Any) -> RevBert:
    """BERT-base with reversible layers: vocabulary 30522, 512 positions, dim 768, 12 blocks, 12
    heads; 109.5M parameters with 2 classes, as ``bert_base``."""
    return build_model(RevBert, dict(vocab_size=30522, max_positions=512, embed_dim=768, depth=12,
                                 num_heads=12), efficient=efficient, **kwargs)
