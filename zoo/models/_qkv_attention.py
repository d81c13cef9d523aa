"""Self-attention on a fused qkv tensor whose backward writes the q/k/v gradients over it.

A fused attention kernel's backward (SDPA's flash kernel, Dao et al. 2022, "FlashAttention",
arXiv:2205.14135) holds, at once, the saved q, k, v and output, the output's gradient and the
new q/k/v gradients: two tensors of three widths per token. Once a head's gradients are made,
its q, k and v are read no more, and nothing but the attention reads the qkv linear's output.
So :class:`_QKVAttention` runs the backward one head at a time, with the same kernel on that
head's slices, and copies each head's gradients into that head's slice of the saved qkv
tensor, which then is the qkv gradient: the new memory is one head's gradients, not all heads'.

The CPU flash kernel computes every (batch, head) pair on its own, so the per-head results are
bitwise those of one call over all heads (pinned by the tests against the plain path). Used
only where plain SDPA dispatches that kernel (CPU, no mask, no dropout, eager, the graph not
kept for another backward); everywhere else the plain path runs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from .. import _torch
from .._torch import is_fake

__all__ = ["qkv_attention"]

_aten = torch.ops.aten
_FORWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # the kernel's
_keep_graph = _torch.get_current_graph_task_keep_graph


def _split(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, 3C) -> (3, B, heads, T, C / heads): q, k, v as views of ``qkv`` (the plain
    path's layout)."""
    batch, tokens, width = qkv.shape
    return qkv.reshape(batch, tokens, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)


def _flash_on_cpu(q: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float) -> bool:
    """Whether plain SDPA on these inputs runs the CPU flash kernel that the in-place backward
    calls per head (and nothing casts them first)."""
    if _FORWARD is None or _BACKWARD is None or _keep_graph is None:
        return False
    if q.device.type != "cpu" or attn_mask is not None or dropout_p or not q.requires_grad:
        return False
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if torch.is_autocast_enabled("cpu") and q.dtype != torch.get_autocast_dtype("cpu"):
        return False
    if q.dtype not in _DTYPES or q.stride(-1) != 1 or not q.numel() or \
            not torch.backends.cuda.flash_sdp_enabled():  # the switch covers the CPU kernel too
        return False
    # SDPA's own choice; a fake tensor's (zoo.plan's fake step) answers math, so its rule above
    return is_fake(q) or _torch.fused_sdp_choice(q, q, q, dropout_p=0.0) == _FLASH


class _QKVAttention(torch.autograd.Function):
    """SDPA's CPU flash kernel on ``q, k, v``, views of ``qkv``; backward head by head, each
    head's gradients written over its own q/k/v slice of the saved ``qkv``, which then is the
    qkv gradient (``q, k, v`` get none: the views add nothing more)."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool) -> torch.Tensor:
        out, lse = _FORWARD(q, k, v, 0.0, causal)
        ctx.save_for_backward(qkv, out, lse)
        ctx.heads, ctx.causal = q.shape[1], causal
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qkv, out, lse = ctx.saved_tensors
        split = _split(qkv, ctx.heads)
        if _keep_graph():  # the saved qkv is read again: the plain kernel, new gradients
            grads = _BACKWARD(grad_out, *split.unbind(0), out, lse, 0.0, ctx.causal)
            return torch.stack(grads).permute(1, 3, 0, 2, 4).reshape(qkv.shape), None, None, \
                None, None
        for head, *rest in zip(split.split(1, 2), grad_out.split(1, 1), out.split(1, 1),
                               lse.split(1, 1)):
            into = head.unbind(0)  # this head's q, k and v
            grads = _BACKWARD(rest[0], *into, *rest[1:], 0.0, ctx.causal)
            for slot, grad in zip(into, grads):
                slot.copy_(grad)
            del grads
        return qkv, None, None, None, None


def qkv_attention(qkv: torch.Tensor, heads: int, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, causal: bool = False,
                  grad_in_place: bool = False) -> torch.Tensor:
    """Scaled dot-product attention of the fused ``qkv`` (B, T, 3C) in ``heads`` heads: the
    (B, heads, T, C / heads) output of ``F.scaled_dot_product_attention``. With
    ``grad_in_place``, where plain SDPA runs the CPU flash kernel, backward writes the qkv
    gradient over ``qkv`` head by head (bitwise the plain gradients; ``qkv`` must feed nothing
    else). ``attn_mask`` attends where it is True or nonzero, whatever its dtype (Hugging Face's
    1/0 mask, integer or float; never an additive mask): read here, inside the block, so that a
    checkpointed block keeps the caller's tensor and no boolean copy of it."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask != 0
    q, k, v = _split(qkv, heads).unbind(0)
    if grad_in_place and qkv.is_contiguous() and _flash_on_cpu(q, attn_mask, dropout_p):
        return _QKVAttention.apply(qkv, q, k, v, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=causal)
