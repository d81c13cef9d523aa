"""The uniform interface every zoo model has (timm's, trimmed)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ZooModel"]


class ZooModel(nn.Module):
    """Base class of the zoo's models.

    Every model has ``num_classes`` (classifier outputs), ``num_features`` (width of the features
    the head consumes), ``forward_features`` (input -> features before pooling/head),
    ``forward_head`` (features -> logits, or pooled features with ``pre_logits=True``),
    ``set_grad_checkpointing`` (timm's interface: turn the family's checkpointing on or off) and
    ``example_input`` (a small valid input batch, for tests and benchmarks).

    Checkpointing never changes parameters or buffers: the state_dict is the same whatever the flags.
    """

    num_classes: int
    num_features: int

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        raise NotImplementedError

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """A random valid input batch on the model's device; ``size``: image side or sequence length."""
        raise NotImplementedError
