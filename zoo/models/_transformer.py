"""The transformer block the zoo's ViT, BERT and GPT-2 share, and where each checkpoint mode cuts it.

A block is multi-head self-attention then a two-layer MLP, each with a residual connection
(Vaswani et al. 2017, "Attention Is All You Need", arXiv:1706.03762). It comes in two orders:

* pre-norm, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``: ViT (Dosovitskiy et al. 2021) and
  GPT-2 (Radford et al. 2019);
* post-norm, ``norm1(x + attn(x))`` then ``norm2(x + mlp(x))``: BERT (Devlin et al. 2019) and the
  original transformer.

Attention runs through ``F.scaled_dot_product_attention`` (SDPA): on a GPU a fused kernel that
never stores the (T x T) attention matrix; on the CPU with attention dropout, the math path,
which does.

Checkpoint modes (``TransformerModel.checkpoint_modes``): all give the plain model's outputs and
gradients exactly, dropout included (a block that draws random numbers has them replayed, one
that draws none saves no RNG state: :meth:`Block.draws_random_numbers`). Each mode's peak and
FLOPs beside timm's, with the machine and the command: docs/benchmarks/models.md.

* ``"block"`` (recommended): every block but the last is one checkpoint, only its input kept
  (the recompute stops once backward has what it needs: without dropout ``mlp.fc2`` never
  reruns). The last block runs plainly: backward needs it first, so recomputing it would cost
  FLOPs and save no peak (timm's ``set_grad_checkpointing`` reruns it).
* ``"sublayer"``: the attention and MLP halves checkpointed on their own: twice the kept
  inputs, half the recompute transient; lighter than ``"block"`` while gradients dominate the
  peak (small batches), heavier at large ones.
* ``"selective"``: Megatron-style selective recompute (Korthikanti et al. 2022,
  arXiv:2205.05198): each block one checkpoint that *keeps its matmuls' outputs* (``aten.mm`` /
  ``aten.addmm``) and recomputes the attention core and the pointwise ops: no matmul runs twice,
  about half the plain peak for about 1% more FLOPs.
* ``"selective_sublayer"``: each sublayer selective on its own, pre-norm without keeping its last
  linear's output (``attn.proj``, ``mlp.fc2`` only feed the residual sums, and the recompute
  stops before them), so no linear reruns without dropout after it (:func:`_selective_sublayers`).
* ``"selective_mlp"`` (pre-norm only): the attention sublayer checkpointed whole (its recompute
  reruns qkv and the core), the MLP as in ``"selective_sublayer"``: qkv's output (three widths
  per token) less to keep for the qkv linear's FLOPs; a per-block choice for the planner.
* ``"selective_stream"`` (pre-norm only): ``"selective_sublayer"`` without keeping the residual
  stream between the sublayers (``attn.proj`` reruns), one width per token less
  (:func:`_selective_stream`). In a ViT's plan the embedding runs inside the first block's region
  (:class:`EmbeddedBlock`), so the patch convolution reruns too, as torch.compile's memory budget
  chooses at half the activations.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from timm.layers import DropPath, Mlp
from torch import nn

from ..checkpoint import checkpoint
from ..checkpoint.policies import AllBut
from ._base import ZooModel, check_rate, check_size
from ._qkv_attention import qkv_attention

__all__ = ["Attention", "Block", "EmbeddedBlock", "TransformerModel", "Step",
           "SELECTIVE_SAVE_OPS", "run_blocks_in_mode", "init_linear_and_embedding",
           "check_transformer_args"]

# The matmuls of a block: nn.Linear dispatches to addmm (with bias) or mm (without). The attention
# core's matmuls are bmm (SDPA's math path) or a fused SDPA kernel: neither is kept.
# a tuple, which torch 2.8's Dynamo reads as a constant (it cannot trace a set of ops)
SELECTIVE_SAVE_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class Attention(nn.Module):
    """Multi-head self-attention: one fused ``qkv`` linear, SDPA, an output ``proj`` linear.

    Submodule names are timm's VisionTransformer ones (``qkv``, ``proj``).

    Args:
        dim: model width; ``num_heads`` must divide it.
        num_heads: attention heads.
        qkv_bias: bias in the qkv linear.
        attn_drop: dropout on the attention probabilities (inside SDPA, train mode only).
        proj_drop: dropout after the output projection (BERT's and GPT-2's hidden dropout).
        causal: mask future positions (GPT-2): SDPA's ``is_causal=True``.
        qkv_grad_in_place: backward writes the qkv gradient over the saved qkv output, head by
            head, where SDPA runs the CPU flash kernel (:mod:`zoo.models._qkv_attention`):
            the same gradients, one head's new gradients held instead of all heads'.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, causal: bool = False,
                 qkv_grad_in_place: bool = False) -> None:
        super().__init__()
        check_size(dim, "dim", "the width")
        check_size(num_heads, "num_heads", "attention heads")
        if dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide the width dim ({dim})")
        self.num_heads = num_heads
        self.attn_drop = float(attn_drop)
        self.causal = causal
        self.qkv_grad_in_place = qkv_grad_in_place
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: (B, T, dim); ``attn_mask``: optional mask broadcastable to (B, heads, T, T),
        True or nonzero where attention is allowed (any dtype; never additive)."""
        batch, tokens, dim = x.shape
        x = qkv_attention(self.qkv(x), self.num_heads, attn_mask,
                          self.attn_drop if self.training else 0.0,
                          self.causal and attn_mask is None, self.qkv_grad_in_place)
        x = x.transpose(1, 2).reshape(batch, tokens, dim)
        return self.proj_drop(self.proj(x))


class Block(nn.Module):
    """A transformer block: attention and MLP sublayers with residuals, pre- or post-norm.

    Submodule names are timm's (``norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1``,
    ``mlp.fc2``); the MLP is ``timm.layers.Mlp`` with dropout only after ``fc2`` (as in BERT and
    GPT-2; ViT uses no dropout).

    Args:
        dim, num_heads, qkv_bias, attn_drop, causal: as :class:`Attention`.
        mlp_ratio: hidden width of the MLP in multiples of ``dim``.
        drop: dropout after each sublayer's last linear (hidden dropout).
        drop_path: stochastic depth on each residual branch (pre-norm only; Huang et al. 2016).
        act_layer: the MLP's activation (GELU; GPT-2 uses its tanh approximation).
        norm_eps: LayerNorm epsilon (ViT 1e-6, GPT-2 1e-5, BERT 1e-12).
        pre_norm: True: ``x + f(norm(x))``; False: ``norm(x + f(x))``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 act_layer: Callable[[], nn.Module] = nn.GELU, norm_eps: float = 1e-6,
                 pre_norm: bool = True, causal: bool = False) -> None:
        super().__init__()
        if drop_path and not pre_norm:
            raise ValueError("drop_path (stochastic depth) needs pre_norm=True: a post-norm block "
                             "normalises the residual sum, so there is no branch to drop alone")
        _check_mlp_ratio(mlp_ratio, dim)
        for name, rate in (("drop", drop), ("attn_drop", attn_drop), ("drop_path", drop_path)):
            check_rate(rate, name)
        self.pre_norm = pre_norm
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop, drop, causal)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=(0.0, drop))
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def draws_random_numbers(self) -> bool:
        """Whether a forward may draw random numbers now: dropout or stochastic depth at a
        positive rate in train mode, or any submodule the block is not built of (an adapter:
        assumed to draw). A block that draws none is checkpointed without saving RNG state."""
        todo = [self]  # walked by hand: the region's host cost, not self.modules()'s generators
        while todo:
            module = todo.pop()
            kind = type(module)
            if kind is nn.Dropout or kind is DropPath or kind is Attention:
                rate = module.p if kind is nn.Dropout else \
                    module.drop_prob if kind is DropPath else module.attn_drop
                if module.training and rate > 0:
                    return True
            elif kind not in _DRAWS_NONE:
                return True
            todo += module._modules.values()
        return False

    def attention_sublayer(self, x: torch.Tensor,
                           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention half: ``x + attn(norm1(x))`` (pre-norm) or ``norm1(x + attn(x))``."""
        if self.pre_norm:
            return x + self.drop_path1(self.attn(self.norm1(x), attn_mask))
        return self.norm1(x + self.attn(x, attn_mask))

    def mlp_sublayer(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half: ``x + mlp(norm2(x))`` (pre-norm) or ``norm2(x + mlp(x))``."""
        if self.pre_norm:
            return x + self.drop_path2(self.mlp(self.norm2(x)))
        return self.norm2(x + self.mlp(x))

    def mlp_input(self, x: torch.Tensor) -> torch.Tensor:
        """A pre-norm MLP's first linear on the normalised stream: ``fc1(norm2(x))``."""
        return self.mlp.fc1(self.norm2(x))

    def mlp_output(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The rest of a pre-norm MLP sublayer: ``x + fc2(act(hidden))`` (with its dropouts);
        ``mlp_output(x, mlp_input(x))`` is ``mlp_sublayer(x)``."""
        return x + self.mlp_branch(hidden)

    def mlp_branch(self, hidden: torch.Tensor) -> torch.Tensor:
        """A pre-norm MLP's residual branch after ``fc1``: ``fc2(act(hidden))`` (dropouts,
        stochastic depth)."""
        m = self.mlp
        return self.drop_path2(m.drop2(m.fc2(m.norm(m.drop1(m.act(hidden))))))

    def attention_and_mlp_input(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm block up to ``fc1``: the residual stream between the sublayers and
        ``fc1``'s output."""
        x = self.attention_sublayer(x, attn_mask)
        return x, self.mlp_input(x)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp_sublayer(self.attention_sublayer(x, attn_mask))


# The modules a Block is made of that never draw a random number (GELU: exact or tanh).
_DRAWS_NONE = (Block, nn.Linear, nn.LayerNorm, nn.GELU, nn.Identity, Mlp)  # a tuple: torch 2.8's
# Dynamo cannot trace `in` on a frozenset of classes


def run_blocks_in_mode(blocks: Sequence[Block], x: torch.Tensor, mode: str | None,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``blocks`` in order under checkpoint ``mode`` (see the module docstring): ``None``
    (plain), ``"block"``, ``"sublayer"``, ``"selective"``, ``"selective_sublayer"``,
    ``"selective_mlp"`` or ``"selective_stream"``.

    In ``"block"`` mode the last block runs plainly: backward needs its activations first, so
    recomputing them would cost FLOPs and save no peak memory (as
    ``checkpoint_sequential(skip_last=True)``). ``"sublayer"`` checkpoints every sublayer: its
    recompute transient is half a block, less than the last block's plain activations.
    """
    if mode not in (None, *TransformerModel.checkpoint_modes):
        raise ValueError(f"unknown transformer checkpoint mode {mode!r}; expected None or one of "
                         f"{', '.join(TransformerModel.checkpoint_modes)}")
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        if mode is None or (i == last and mode == "block"):
            x = block(x, attn_mask)
        elif mode == "block":
            x = checkpoint(block, x, attn_mask, preserve_rng_state=block.draws_random_numbers())
        elif mode == "sublayer":
            rng = block.draws_random_numbers()
            x = checkpoint(block.attention_sublayer, x, attn_mask, preserve_rng_state=rng)
            x = checkpoint(block.mlp_sublayer, x, preserve_rng_state=rng)
        elif mode == "selective":
            x = checkpoint(block, x, attn_mask, save_ops=SELECTIVE_SAVE_OPS,
                           preserve_rng_state=block.draws_random_numbers())
        elif mode == "selective_mlp":
            x = _whole_attention_selective_mlp(block, x, attn_mask)
        elif mode == "selective_stream":
            x = _selective_stream(block, x, attn_mask)
        else:
            x = _selective_sublayers(block, x, attn_mask)
    return x


def _selective_sublayers(block: Block, x: torch.Tensor,
                         attn_mask: torch.Tensor | None) -> torch.Tensor:
    """``selective_sublayer``. Pre-norm: the attention sublayer keeps its matmuls' outputs but
    ``attn.proj``'s, and the MLP is two regions, ``norm2`` and ``fc1`` keeping ``fc1``'s output,
    then the rest, so backward rebuilds ``norm2``'s output only when ``fc1``'s backward needs it,
    not beside the activation's gradients (torch's partitioner recomputes as late; one width per
    token less at the peak, no FLOP more). Post-norm: the sublayers' last linear outputs feed
    the norms, whose backward needs them, so each sublayer keeps all its matmuls' outputs."""
    rng = block.draws_random_numbers()
    keep = {"save_ops": SELECTIVE_SAVE_OPS, "preserve_rng_state": rng}
    if not block.pre_norm:
        x = checkpoint(block.attention_sublayer, x, attn_mask, **keep)
        return checkpoint(block.mlp_sublayer, x, **keep)
    x = checkpoint(block.attention_sublayer, x, attn_mask,
                   save_ops=AllBut(SELECTIVE_SAVE_OPS, block.attn.proj), preserve_rng_state=rng)
    hidden = checkpoint(block.mlp_input, x, **keep)
    return checkpoint(block.mlp_output, x, hidden, preserve_rng_state=rng)


def _whole_attention_selective_mlp(block: Block, x: torch.Tensor,
                                   attn_mask: torch.Tensor | None) -> torch.Tensor:
    """``selective_mlp`` (pre-norm only): the attention sublayer one checkpoint keeping only
    its input; ``norm2`` and ``fc1`` a plain region (the next keeps ``fc1``'s output as its
    input, and the recompute stops before ``fc1``), so no op's output is kept out of the
    saved-tensor hooks' sight and the block may run inside an outer region too."""
    if not block.pre_norm:
        raise ValueError("selective_mlp is for pre-norm blocks: a post-norm block's norms need "
                         "their inputs; use selective_sublayer")
    rng = block.draws_random_numbers()
    x = checkpoint(block.attention_sublayer, x, attn_mask, preserve_rng_state=rng)
    hidden = checkpoint(block.mlp_input, x, preserve_rng_state=rng)
    return checkpoint(block.mlp_output, x, hidden, preserve_rng_state=rng)


def _selective_stream(block: Block, x: torch.Tensor, attn_mask: torch.Tensor | None,
                      embed: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """``selective_stream`` (pre-norm only): one selective region from the block's input to
    ``fc1``'s output, keeping qkv's and ``fc1``'s outputs, then the MLP branch as a region
    keeping ``fc1``'s output; the residual sum after them is outside both. Nothing keeps the
    residual stream between the sublayers: backward makes it again (``attn.proj`` reruns), as
    torch.compile's memory budget chooses for some blocks of a ViT. ``embed``: run first,
    inside the region (its matmuls' outputs kept, a convolution's not), so the block's input
    is not kept either (:class:`EmbeddedBlock`)."""
    if not block.pre_norm:
        raise ValueError("selective_stream is for pre-norm blocks: a post-norm block's norms "
                         "need their inputs, the stream itself; use selective_sublayer")
    front = block.attention_and_mlp_input if embed is None else \
        (lambda images, mask: block.attention_and_mlp_input(embed(images), mask))
    rng = block.draws_random_numbers()  # an embedding may draw (dropout): its region keeps them
    x, hidden = checkpoint(front, x, attn_mask,
                           save_ops=AllBut(SELECTIVE_SAVE_OPS, block.attn.proj),
                           preserve_rng_state=rng or embed is not None)
    return x + checkpoint(block.mlp_branch, hidden, preserve_rng_state=rng)


class Step(nn.Module):
    """Wraps a callable (e.g. a model's embedding method) as a module for ``checkpoint_chain``.

    The callable is held as a plain attribute, not a submodule, so the model's parameters stay
    registered once, where they live.
    """

    def __init__(self, fn: Callable[..., torch.Tensor], name: str) -> None:
        super().__init__()
        self.fn = fn
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return self.name


class EmbeddedBlock(nn.Module):
    """The embedding and the first block as one element of ``checkpoint_chain``: the plan then
    never keeps the embedding's output for its own sake, and in ``"selective_stream"`` the
    first block's selective region starts at the model's input, so backward makes the
    embedding's output again (the patch convolution reruns) instead of keeping it, as
    torch.compile's memory budget chooses for a ViT (:meth:`run`).

    The embedding callable and the block are held as plain attributes, so the model's
    parameters stay registered once, where they live.
    """

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], block: Block) -> None:
        super().__init__()
        self.__dict__["embed"], self.__dict__["block"] = embed, block
        self.name = "embed+block"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(x))

    def run(self, x: torch.Tensor, mode: str | None) -> torch.Tensor:
        """The embedding, then the block in ``mode`` (as :func:`run_blocks_in_mode`);
        ``"block"`` and ``"selective"`` checkpoint both as one region, ``"selective_stream"``
        puts the embedding inside the block's first region (nothing but the model's input kept
        for it)."""
        if mode is None:
            return self(x)
        if mode == "block":
            return checkpoint(self, x)
        if mode == "selective":
            return checkpoint(self, x, save_ops=SELECTIVE_SAVE_OPS)
        if mode == "selective_stream":
            return _selective_stream(self.block, x, None, self.embed)
        return run_blocks_in_mode([self.block], self.embed(x), mode)

    def extra_repr(self) -> str:
        return self.name


class TransformerModel(ZooModel):
    """Base of the zoo's transformers: ``self.blocks`` (an ``nn.Sequential`` of :class:`Block`)
    run under the active checkpoint mode, or under a planner's ``checkpoint_plan``."""

    checkpoint_modes: ClassVar[tuple[str, ...]] = ("block", "sublayer", "selective",
                                                    "selective_sublayer", "selective_mlp",
                                                    "selective_stream")
    blocks: nn.Sequential
    global_pool = "token"  # the head reads the first token (ViT's class token, BERT's [CLS])
    context_length: int  # the longest token sequence (language models)

    def data_cfg(self) -> dict:
        """A language model's: token ids, not images. ``input_size`` is the longest sequence,
        ``(context_length,)`` (a sequence has no channels or pixels); the image settings (mean,
        std, interpolation, crop, pooled size) keep timm's "none", ``None``."""
        return {"input_size": (self.context_length,)}

    def forward_blocks(self, x: torch.Tensor,
                       attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Every block on ``x`` (B, T, dim), checkpointed as ``self.grad_checkpointing`` says."""
        return run_blocks_in_mode(self.blocks, x, self.grad_checkpointing, attn_mask)

    def run_chain_block(self, block: Callable[..., Any], x: torch.Tensor,
                        mode: str | None = None) -> torch.Tensor:
        """One chain block in ``mode``, inside that block only (the planner's per-block option):
        a :class:`Block` (or a ``partial`` of one holding ``attn_mask``) is checkpointed whole
        (``"block"``), by sublayer or selectively; embeddings and norms run plainly."""
        fn, kw = (block.func, block.keywords) if isinstance(block, partial) else (block, {})
        if isinstance(fn, EmbeddedBlock):
            return fn.run(x, mode)
        if mode is None or not isinstance(fn, Block):
            return block(x)
        if mode == "block":
            return checkpoint(fn, x, kw.get("attn_mask"),
                              preserve_rng_state=fn.draws_random_numbers())
        return run_blocks_in_mode([fn], x, mode, kw.get("attn_mask"))


def check_transformer_args(embed_dim: int, depth: int, num_heads: int, mlp_ratio: float,
                           **rates: float) -> None:
    """A transformer's sizes, checked before anything is built: ``depth`` 0 made a model of no
    blocks (embeddings straight into the head) that trained without a word; a bad width, head
    count or ratio failed inside a layer under another name. ``rates``: its dropout rates."""
    check_size(embed_dim, "embed_dim", "the width")
    check_size(depth, "depth", "the number of transformer blocks")
    check_size(num_heads, "num_heads", "attention heads")
    if embed_dim % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})")
    _check_mlp_ratio(mlp_ratio, embed_dim)
    for name, rate in rates.items():
        check_rate(rate, name)


def _check_mlp_ratio(mlp_ratio: float, dim: int) -> None:
    """The MLP's hidden width, ``int(dim * mlp_ratio)``, must be at least 1 (0: an MLP of no
    units, whose output is its last bias alone)."""
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) \
            or int(dim * mlp_ratio) < 1:
        raise ValueError(f"mlp_ratio must give the MLP at least one hidden unit "
                         f"(int(width * mlp_ratio) >= 1; 4.0 is usual), got {mlp_ratio!r}")


def init_linear_and_embedding(module: nn.Module, std: float = 0.02) -> None:
    """BERT / GPT-2 initialisation: N(0, std) weights for linears and embeddings, zero biases,
    LayerNorm to identity. Use with ``model.apply``."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
