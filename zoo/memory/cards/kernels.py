"""The ops a CUDA build would run, on a step whose (fake) tensors live on the CPU.

A fake step can only run backward on the CPU (the autograd engine asks the CUDA driver about a
``cuda`` device: "hasPrimaryContext expects a valid device index" without a GPU), where two
functions save other tensors than on CUDA: ``F.scaled_dot_product_attention`` (CUDA's flash and
memory-efficient kernels, as torch's sdp_utils.cpp selects them, save q, k, v, the output and a
log-sum-exp, never the CPU math path's B x H x L x L probabilities) and ``F.dropout`` (CUDA's
fused ``native_dropout`` keeps a one-byte mask). :class:`CudaKernels` calls those CUDA ops in
their place, on fake tensors through their meta functions, so shapes and saved tensors are the
CUDA kernels' exactly. BatchNorm and convolution need nothing (docs/benchmarks/prediction.md).
A compiled step's capture traces the same substitutes (:mod:`.compiled_step`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FLASH", "EFFICIENT", "MATH", "sdpa_backend", "CudaKernels"]

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
_HALF = (torch.float16, torch.bfloat16)
_aten = torch.ops.aten


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 enable_gqa: bool = False, enabled: tuple[bool, bool] | None = None) -> str:
    """The kernel a CUDA build (sm80 or newer) picks for SDPA on tensors of these shapes in
    ``dtype`` (the tensors' own if None): ``"flash"``, ``"efficient"`` or ``"math"``.
    ``enabled``: whether the flash and the memory-efficient kernels are enabled (None: as
    ``torch.backends.cuda`` says now; Dynamo cannot trace that query, so a traced call passes
    what was read before tracing)."""
    dtype = dtype or q.dtype
    flash_on, efficient_on = enabled if enabled is not None else _enabled()
    head, head_v = q.shape[-1], v.shape[-1]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or enable_gqa:
        return MATH
    if dtype in _HALF and attn_mask is None and head == head_v and head <= 256 \
            and head % 8 == 0 and flash_on:
        return FLASH
    align = 8 if dtype in _HALF else 4
    if dtype in (*_HALF, torch.float32) and head % align == 0 and head_v % align == 0 \
            and efficient_on:
        return EFFICIENT
    return MATH


def _enabled() -> tuple[bool, bool]:
    """Whether CUDA's flash and memory-efficient SDPA kernels are enabled
    (``torch.backends.cuda.sdp_kernel``'s switches)."""
    return torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()


def _sdpa(enabled: tuple[bool, bool], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor | None:
    """SDPA through the CUDA kernel :func:`sdpa_backend` picks (``enabled``: as it takes
    them); None for the math path."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    backend = sdpa_backend(q, k, v, attn_mask, dtype, enable_gqa, enabled)
    if backend == MATH:
        return None
    if dtype != q.dtype:  # autocast casts SDPA's inputs to the lower precision
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast("cpu", enabled=False):
        if backend == FLASH:
            return _aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes a bias
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(
                attn_mask.logical_not(), float("-inf"))
        if attn_mask is not None:
            attn_mask = attn_mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2],
                                                     k.shape[2])
        need_lse = q.requires_grad or k.requires_grad or v.requires_grad
        return _aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, need_lse and torch.is_grad_enabled(), dropout_p, is_causal,
            scale=scale)[0]


class CudaKernels:
    """While active (a context manager), ``F.scaled_dot_product_attention`` and ``F.dropout``
    run the ops CUDA would run (module docstring), on whatever device the tensors are: a fake
    CPU step then saves what a CUDA step saves. The two functions are replaced in
    ``torch.nn.functional`` for the duration (process-wide; a ``TorchFunctionMode`` would not
    do: the autograd engine runs backward, and so a checkpoint's recompute, without the
    modes of the forward)."""

    def __enter__(self) -> CudaKernels:
        self._saved = F.scaled_dot_product_attention, F.dropout
        sdpa, dropout = self._saved
        enabled = _enabled()  # read here: a compiled capture traces the substitutes

        def cuda_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = _sdpa(enabled, *args, **kwargs)
            return sdpa(*args, **kwargs) if out is None else out

        def cuda_dropout(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = _dropout(*args, **kwargs)
            return dropout(*args, **kwargs) if out is None else out

        F.scaled_dot_product_attention, F.dropout = cuda_sdpa, cuda_dropout
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention, F.dropout = self._saved


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor | None:
    """``native_dropout`` as CUDA's fused kernel runs it; None where dropout is the identity
    or ``F.dropout`` raises (left to it)."""
    if not training or not 0 < p < 1 or not input.numel() or inplace:
        return None
    return _aten.native_dropout(input, p, True)[0]
