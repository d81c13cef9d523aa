"""BERT (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", arXiv:1810.04805) as a sequence classifier, with memory-efficient training.

Token, position and segment (token type) embeddings are summed and LayerNorm'd, a stack of
post-norm transformer blocks (``zoo.models._transformer.Block``, exact GELU, LayerNorm eps 1e-12)
runs on them, and the first token's state goes through the pooler (linear + tanh) and a linear
classifier. Dropout 0.1 on the embeddings, on the attention probabilities, after every
sublayer and before the classifier, as in the paper; ``zoo.checkpoint`` replays it exactly.

Checkpointing is what made BERT-base fit at batch 64 in Spell's blog post "Training
larger-than-memory PyTorch models using gradient checkpointing" (-60% memory for +25% time).
Here ``"block"`` and ``"sublayer"`` recompute whole blocks / sublayers; ``"selective"``
(Megatron-style, Korthikanti et al. 2022) keeps the matmul outputs and recomputes only the
attention core and pointwise ops, for a large saving at almost no extra FLOPs (on the CPU,
attention with dropout stores the T x T attention matrix, which is exactly what it stops
storing). Figures beside that anchor, with the machine and the command:
docs/benchmarks/models.md.

Submodules: ``embeddings.{word,position,token_type}_embeddings``, ``embeddings.norm``,
``blocks.N.{attn.qkv, attn.proj, norm1, mlp.fc1, mlp.fc2, norm2}``, ``pooler``, ``head``: the
layout of Hugging Face's ``BertForSequenceClassification`` with query/key/value fused in ``qkv``.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..checkpoint.casts import casts_once
from ._base import check_size, classifier
from ._registry import build_model, register_model
from ._transformer import (Block, TransformerModel, check_transformer_args,
                           init_linear_and_embedding)

__all__ = ["BertEmbeddings", "Bert"]


class BertEmbeddings(nn.Module):
    """Token + learned position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, vocab_size: int, max_positions: int, type_vocab_size: int, dim: int,
                 drop: float, norm_eps: float = 1e-12) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, dim)
        self.position_embeddings = nn.Embedding(max_positions, dim)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.drop = nn.Dropout(drop)

    def forward(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> embeddings (B, T, dim); ``token_type_ids`` default to segment 0."""
        tokens = ids.shape[1]
        if tokens > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence of {tokens} tokens is longer than the "
                             f"{self.position_embeddings.num_embeddings} positions BERT was built "
                             f"for; truncate it or build with a larger max_positions")
        positions = torch.arange(tokens, device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.drop(self.norm(x))


class Bert(TransformerModel):
    """BERT encoder + pooler + classifier: token ids (B, T) -> logits (B, num_classes).

    Args:
        vocab_size: token embedding rows (BERT-base uncased: 30522).
        max_positions: position embedding rows (512).
        type_vocab_size: token type embedding rows (2).
        embed_dim: width.
        depth: number of blocks.
        num_heads: attention heads.
        mlp_ratio: MLP width as a multiple of ``embed_dim``.
        num_classes: classifier outputs (2 by default, e.g. sentiment).
        drop_rate: hidden dropout (embeddings, after each sublayer, before the classifier).
        attn_drop_rate: dropout on attention probabilities.
        efficient: checkpointing: ``False``, ``True`` (``"block"``) or a mode name.
    """

    # post-norm: the norms need the stream between the sublayers and the last linears' outputs,
    # which the pre-norm modes selective_mlp and selective_stream recompute
    checkpoint_modes = tuple(m for m in TransformerModel.checkpoint_modes
                             if m not in ("selective_mlp", "selective_stream"))

    def __init__(self, vocab_size: int = 30522, max_positions: int = 512,
                 type_vocab_size: int = 2, embed_dim: int = 768, depth: int = 12,
                 num_heads: int = 12, mlp_ratio: float = 4.0, num_classes: int = 2,
                 drop_rate: float = 0.1, attn_drop_rate: float = 0.1,
                 efficient: bool | str = False) -> None:
        super().__init__()
        for name, size, meaning in (("vocab_size", vocab_size, "token embedding rows"),
                                    ("max_positions", max_positions, "the longest sequence"),
                                    ("type_vocab_size", type_vocab_size, "token types")):
            check_size(size, name, meaning)
        check_transformer_args(embed_dim, depth, num_heads, mlp_ratio, drop_rate=drop_rate,
                               attn_drop_rate=attn_drop_rate)
        self.num_classes = num_classes
        self.num_features = embed_dim
        self.vocab_size, self.context_length = vocab_size, max_positions
        self.embeddings = BertEmbeddings(vocab_size, max_positions, type_vocab_size, embed_dim,
                                         drop_rate)
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, drop=drop_rate,
                  attn_drop=attn_drop_rate, norm_eps=1e-12, pre_norm=False)
            for _ in range(depth)])
        self.pooler = nn.Linear(embed_dim, embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = classifier(embed_dim, num_classes)
        self.apply(init_linear_and_embedding)  # N(0, 0.02), as the paper's released code
        self.set_grad_checkpointing(efficient)

    @staticmethod
    def _attention_mask(ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have the token ids' shape {tuple(ids.shape)} "
                             f"(1 or True for real tokens, 0 or False for padding), got "
                             f"{tuple(attention_mask.shape)}")
        # (B, 1, 1, T): every query, every head. The mask stays the caller's tensor (a view),
        # integer, float or boolean: each attention reads it as boolean itself, so that no
        # tensor made here is kept alive by a checkpointed block that a plain step would have
        # freed after the forward
        return attention_mask[:, None, None, :]

    def forward_features(self, x: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, dim).

        ``token_type_ids`` (B, T): segment of each token (default 0). ``attention_mask`` (B, T):
        1 for real tokens, 0 for padding (Hugging Face's convention); padding is never attended.
        """
        if x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"BERT takes token ids (B, T) as int64, got a {x.dtype} tensor")
        mask = self._attention_mask(x, attention_mask)
        if self.checkpoint_plan is not None:
            return self.run_chain(self._chain(token_type_ids, mask), x)
        return self.forward_blocks(self.embeddings(x, token_type_ids), mask)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Hidden states -> pooled first token (``pre_logits``, after dropout) or logits."""
        x = self.head_drop(torch.tanh(self.pooler(x[:, 0])))
        return x if pre_logits else self.head(x)

    @casts_once
    def forward(self, x: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_head(self.forward_features(x, token_type_ids, attention_mask))

    def _chain(self, token_type_ids: torch.Tensor | None,
               mask: torch.Tensor | None) -> list[nn.Module]:
        embed = self.embeddings if token_type_ids is None else partial(
            self.embeddings, token_type_ids=token_type_ids)
        blocks = list(self.blocks) if mask is None else [partial(b, attn_mask=mask)
                                                         for b in self.blocks]
        return [embed, *blocks]  # type: ignore[list-item]

    def checkpoint_chain(self) -> list[nn.Module]:
        """The embeddings, then every block."""
        return self._chain(None, None)

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random token ids (B, ``size``); ``size``: sequence length, 16 by default."""
        return torch.randint(0, self.vocab_size, (batch_size, size or 16),
                             device=self.pooler.weight.device)


@register_model
def bert_base(efficient: bool | str = False, **kwargs) -> Bert:
    """BERT-base (Devlin et al. 2019): vocabulary 30522, 512 positions, dim 768, 12 blocks, 12
    heads; 109.5M parameters in the encoder and pooler, plus the classifier (2 classes)."""
    return build_model(Bert, dict(vocab_size=30522, max_positions=512, embed_dim=768, depth=12,
                              num_heads=12), efficient=efficient, **kwargs)
