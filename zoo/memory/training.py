"""The training step every measurement takes: forward, a mean-square loss, backward.

The planner's fake steps, the benchmarks and the tests all measure this one step, so their
figures are of the same thing: ``default_loss(model(x)).backward()`` in train mode from fresh
(``None``) gradients. No optimizer: its state is the same for every checkpoint mode and would
only hide the activations' share.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["default_loss", "train_step"]


def default_loss(output: Any) -> torch.Tensor:
    """``square().mean()`` of the output in float32: of its first element for a tuple or list,
    of its first tensor for a Hugging Face ``ModelOutput`` (the last hidden state)."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(out, torch.Tensor) and hasattr(out, "values"):  # Hugging Face ModelOutput
        out = next(v for v in out.values() if isinstance(v, torch.Tensor))
    return out.float().square().mean()


def train_step(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               forward: Callable[[Any], Any] | None = None) -> Callable[[], None]:
    """One training step of ``model`` on ``x`` as a call: gradients reset to None, then
    ``loss_fn(forward(x)).backward()``; ``model`` is put in train mode here, once (not in the
    step, whose host time is measured). ``forward``: what to call instead of ``model`` (a
    compiled or wrapped model whose parameters are ``model``'s); ``loss_fn``: ``default_loss``
    unless given."""
    loss_fn = default_loss if loss_fn is None else loss_fn
    forward = model if forward is None else forward  # no truth test: a compiled module has none

    model.train()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(forward(x)).backward()

    return step
