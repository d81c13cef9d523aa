"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners") as a causal
language model, with memory-efficient training.

Token and learned position embeddings, dropout, a stack of pre-norm transformer blocks
(``zoo.models._transformer.Block``: causal SDPA with ``is_causal=True``, GELU with the tanh
approximation, LayerNorm eps 1e-5), a final LayerNorm and a linear head that shares its weight
with the token embedding (tied input/output embeddings). Dropout 0.1 on the embeddings, the
attention probabilities and after every sublayer, as GPT-2's released configuration;
``zoo.checkpoint`` replays it exactly.

``num_classes`` is the vocabulary size: the model predicts the next token at every position,
token ids (B, T) -> logits (B, T, vocab). Checkpoint modes as in ``_transformer``.

Submodules: ``wte``, ``wpe``, ``blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``,
``norm``, ``head`` (``head.weight`` *is* ``wte.weight``). Hugging Face's ``gpt2`` weights map
one to one (``h.N.ln_1`` -> ``blocks.N.norm1``, ``attn.c_attn`` -> ``attn.qkv``, ...; its Conv1D
weights are transposed).
"""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from ._base import check_size
from ._registry import build_model, register_model
from ._transformer import (Block, Step, TransformerModel, check_transformer_args,
                           init_linear_and_embedding)

__all__ = ["GPT2"]


class GPT2(TransformerModel):
    """Causal transformer language model with tied embeddings.

    Args:
        num_classes: vocabulary size (50257 for GPT-2's byte-level BPE).
        context_length: the longest sequence (learned positions).
        embed_dim: width.
        depth: number of blocks.
        num_heads: attention heads.
        mlp_ratio: MLP width as a multiple of ``embed_dim``.
        drop_rate: dropout on the embeddings and after every sublayer.
        attn_drop_rate: dropout on attention probabilities.
        efficient: checkpointing: ``False``, ``True`` (``"block"``) or a mode name.
    """

    def __init__(self, num_classes: int = 50257, context_length: int = 1024,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12,
                 mlp_ratio: float = 4.0, drop_rate: float = 0.1, attn_drop_rate: float = 0.1,
                 efficient: bool | str = False) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"GPT-2's num_classes is its vocabulary size (50257), an int >= 1; "
                             f"got {num_classes!r}")
        check_size(context_length, "context_length", "the longest sequence, in tokens")
        check_transformer_args(embed_dim, depth, num_heads, mlp_ratio, drop_rate=drop_rate,
                               attn_drop_rate=attn_drop_rate)
        self.num_classes = num_classes
        self.num_features = embed_dim
        self.context_length = context_length
        self.wte = nn.Embedding(num_classes, embed_dim)
        self.wpe = nn.Embedding(context_length, embed_dim)
        self.drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, drop=drop_rate,
                  attn_drop=attn_drop_rate, act_layer=partial(nn.GELU, approximate="tanh"),
                  norm_eps=1e-5, pre_norm=True, causal=True)
            for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=1e-5)
        self.head = nn.Linear(embed_dim, num_classes, bias=False)
        self.apply(init_linear_and_embedding)
        for block in self.blocks:  # GPT-2: residual projections scaled by 1/sqrt(2 * depth)
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * depth))
        self.head.weight = self.wte.weight  # tied input/output embeddings
        self.set_grad_checkpointing(efficient)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Refused: GPT-2's output layer is its input embedding (tied), sized by the vocabulary."""
        raise ValueError("GPT-2's classifier is its token embedding (tied weights, one output per "
                         "vocabulary entry) and cannot be reset; build the model with "
                         "num_classes=<vocabulary size> instead")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> token + position embeddings after dropout (B, T, dim)."""
        if ids.dtype not in (torch.int32, torch.int64) or ids.ndim != 2:
            raise TypeError(f"GPT-2 takes token ids (B, T) as int64, got a {ids.dtype} tensor "
                            f"of shape {tuple(ids.shape)}")
        if ids.shape[1] > self.context_length:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than the context of "
                             f"{self.context_length}; truncate it or build with a larger "
                             f"context_length")
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.wte(ids) + self.wpe(positions))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> final LayerNorm'd hidden states (B, T, dim)."""
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        return self.norm(self.forward_blocks(self.embed(x)))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Hidden states -> themselves (``pre_logits``) or next-token logits (B, T, vocab)."""
        return x if pre_logits else self.head(x)

    def checkpoint_chain(self) -> list[nn.Module]:
        """The embedding, every block, the final norm."""
        return [Step(self.embed, "embed"), *self.blocks, self.norm]

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random token ids (B, ``size``); ``size``: sequence length, 16 by default."""
        return torch.randint(0, self.num_classes, (batch_size, size or 16),
                             device=self.wte.weight.device)


@register_model
def gpt2_small(efficient: bool | str = False, **kwargs) -> GPT2:
    """GPT-2 small (Radford et al. 2019): vocabulary 50257, context 1024, dim 768, 12 blocks, 12
    heads, tied embeddings; 124.4M parameters."""
    return build_model(GPT2, dict(num_classes=50257, context_length=1024, embed_dim=768, depth=12,
                              num_heads=12), efficient=efficient, **kwargs)
