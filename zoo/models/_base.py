"""The uniform interface every zoo model has (timm's, trimmed)."""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

__all__ = ["ZooModel"]


class ZooModel(nn.Module):
    """Base class of the zoo's models.

    Every model has ``num_classes`` (classifier outputs), ``num_features`` (width of the features
    the head consumes), ``forward_features`` (input -> features before pooling/head),
    ``forward_head`` (features -> logits, or pooled features with ``pre_logits=True``),
    ``set_grad_checkpointing`` (timm's interface) and ``example_input`` (a small valid batch).

    Checkpointing modes: ``checkpoint_modes`` names the family's choices, the recommended one
    first. ``efficient=True`` / ``set_grad_checkpointing(True)`` picks the recommended mode, a mode
    name picks that one, ``False`` turns checkpointing off. The active mode is
    ``self.grad_checkpointing`` (``None`` when off). Modes never change parameters or buffers: the
    state_dict is the same whatever the flags.
    """

    num_classes: int
    num_features: int
    checkpoint_modes: ClassVar[tuple[str, ...]] = ()
    grad_checkpointing: str | None = None

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """Turn checkpointing on (``True``: the recommended mode; or a mode name) or off (``False``)."""
        if enable is False or enable is None:
            self.grad_checkpointing = None
        elif enable is True:
            self.grad_checkpointing = self.checkpoint_modes[0]
        elif enable in self.checkpoint_modes:
            self.grad_checkpointing = enable
        else:
            raise ValueError(f"{type(self).__name__} has no checkpointing mode {enable!r}; "
                             f"expected True, False or one of {', '.join(self.checkpoint_modes)}")

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """A random valid input batch on the model's device; ``size``: image side or sequence length."""
        raise NotImplementedError
