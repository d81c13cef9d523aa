"""The chain of checkpointed regions that every per-region benchmark measures: one builder, one
set of checkpoints to run each region through.

:func:`make_chain` builds ``regions`` blocks from one seed (the same weights whatever the
checkpoint), run one after another, each through the checkpoint named in :data:`CHECKPOINTS`.
Two kinds of block:

* ``conv``: conv3x3-BN-ReLU-dropout-conv3x3-BN-ReLU, the chain of the ``checkpoint`` and
  ``overhead`` commands (its BatchNorm and dropout are what their exactness columns check);
* ``linear``: Linear + ReLU, the chain of the ``host-cost`` command (no BatchNorm: on ``meta`` a
  BatchNorm is a Python decomposition that would outweigh a region's own work).

At width 8 and batch 1 (8x8 images for ``conv``) the kernels take microseconds, so a training
step is mostly each checkpoint's own work per region: the host time a GPU waits for when a model
has many small layers (DenseNet-BC-100 at 32x32 has ~100 such regions).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo

__all__ = ["REGIONS", "WIDTH", "BATCH", "SIZE", "CHECKPOINTS", "BLOCKS", "Chain", "make_chain",
           "with_checkpoint", "chain_input"]

# The tiny chain (module docstring): its regions, their width, the batch and the image size.
REGIONS, WIDTH, BATCH, SIZE = 100, 8, 1, 8

Wrap = Callable[[nn.Module, torch.Tensor], torch.Tensor]

CHECKPOINTS: dict[str, Wrap] = {
    "none": lambda block, x: block(x),
    "torch non-reentrant": lambda block, x: torch_checkpoint.checkpoint(
        block, x, use_reentrant=False),
    "torch reentrant": lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=True),
    "zoo.checkpoint": lambda block, x: zoo.checkpoint(block, x),
}


def _conv(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(), nn.Dropout(0.1),
                         nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU())


def _linear(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


BLOCKS: dict[str, Callable[[int], nn.Sequential]] = {"conv": _conv, "linear": _linear}


class Chain(nn.Module):
    """``blocks`` run one after another, each through the checkpoint named ``checkpoint``."""

    def __init__(self, blocks: nn.Sequential, checkpoint: str = "none") -> None:
        super().__init__()
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"unknown checkpoint {checkpoint!r}; expected one of "
                             f"{', '.join(CHECKPOINTS)}")
        self.blocks = blocks
        self.checkpoint = checkpoint
        self.wrap = CHECKPOINTS[checkpoint]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.wrap(block, x)
        return x


def make_chain(regions: int, width: int, checkpoint: str = "none", block: str = "conv",
               seed: int = 0) -> Chain:
    """``regions`` blocks of kind ``block`` (:data:`BLOCKS`) and ``width`` channels or features,
    drawn from ``seed``, each run through ``checkpoint`` (:data:`CHECKPOINTS`)."""
    torch.manual_seed(seed)
    return Chain(nn.Sequential(*[BLOCKS[block](width) for _ in range(regions)]), checkpoint)


def with_checkpoint(chain: Chain, checkpoint: str) -> Chain:
    """A copy of ``chain`` (its weights and buffers as they are now) run through ``checkpoint``."""
    return Chain(copy.deepcopy(chain.blocks), checkpoint)


def chain_input(block: str, batch_size: int = BATCH, width: int = WIDTH, size: int = SIZE,
                device: torch.device | str | None = None,
                requires_grad: bool = True) -> torch.Tensor:
    """A random batch for a chain of ``block``: ``size`` x ``size`` images for ``conv``, vectors
    for ``linear``. It requires grad unless told otherwise: torch's reentrant checkpoint trains
    nothing on an input that does not, so every checkpoint gets one that does."""
    shape = (batch_size, width, size, size) if block == "conv" else (batch_size, width)
    return torch.randn(shape, device=device, requires_grad=requires_grad)
