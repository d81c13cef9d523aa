"""``rebuild=False``: the reversible network storing its activations, one autograd node per
stream update (the same integer forward as the rebuilt network)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _torch
from .coupling import ReversibleBlock
from .grid import Grid, _add, _checked, _enter


class _Enter(torch.autograd.Function):
    """A float tensor enters the grid: (stream, float view, magnitude); gradient straight
    through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, ...]:
        checks: list[torch.Tensor] = []
        k, view = _enter(x, grid, checks)
        ctx.mark_non_differentiable(k, *checks)
        return k, view, *checks

    @staticmethod
    def backward(ctx: Any, _k: None, grad: torch.Tensor, *_checks: None) -> tuple[Any, ...]:
        return grad, None


class _Add(torch.autograd.Function):
    """Stream update ``k + to_fixed(out)``: (stream, float view, magnitudes); the view's
    gradient goes straight through to the old view and to ``out``."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, view: torch.Tensor, out: torch.Tensor,
                grid: Grid) -> tuple[torch.Tensor, ...]:
        checks: list[torch.Tensor] = []
        k, view = _add(k, out, grid, checks)
        ctx.mark_non_differentiable(k, *checks)
        return k, view, *checks

    @staticmethod
    def backward(ctx: Any, _k: None, grad: torch.Tensor, *_checks: None) -> tuple[Any, ...]:
        return None, grad, grad, None


def _stored(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor,
            args: tuple, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    if _torch.COMPILED_STORED_REVERSIBLE_WRONG and torch.compiler.is_compiling():
        _compile_needs_other_torch()
    k1, v1, *checks = _Enter.apply(x1, grid)
    k2, v2, *more = _Enter.apply(x2, grid)
    checks += more
    for block in blocks:
        k1, v1, *more = _Add.apply(k1, v1, block.f(v2, *args), grid)
        checks += more
        k2, v2, *more = _Add.apply(k2, v2, block.g(v1, *args), grid)
        checks += more
    return _checked(v1, v2, grid, checks)[:2]


def stored_reversible_network_under_compile_is_wrong_on_torch_2_11() -> None:
    raise RuntimeError(
        f"zoo: a reversible network storing its activations (efficient=False) under "
        f"torch.compile needs torch other than 2.11 (this is torch {torch.__version__}, whose "
        "compiled backward gives it wrong gradients); use torch 2.10 or >= 2.12, or run it eagerly")


# Raised outside Dynamo's trace (a graph break), so the user sees the one line; with
# fullgraph=True Dynamo refuses the call and names this function.
_compile_needs_other_torch = _torch.dynamo().disable(
    stored_reversible_network_under_compile_is_wrong_on_torch_2_11)
