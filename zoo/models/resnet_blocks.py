"""The residual blocks of zoo/models/resnet.py (He et al. 2016, "Deep Residual Learning for Image
Recognition", arXiv:1512.03385): BasicBlock, Bottleneck and the option-A shortcut, each able to
run itself in any of the ResNet checkpoint modes (described in :mod:`zoo.models.resnet`)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import NO_RNG  # the regions here draw no random number: no dropout in a block

__all__ = ["ZeroPadShortcut", "BasicBlock", "Bottleneck", "MODES"]

MODES = ("halves", "block", "bn_relu")

class ZeroPadShortcut(nn.Module):
    """Option A shortcut (He et al. 2016, Sec. 3.3): the identity, subsampled by ``stride`` and
    zero-padded to ``out_channels``. No parameters, so it leaves the state_dict alone."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.extra = out_channels - in_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra)) if self.extra else x


class _ResidualBlock(nn.Module):
    """``relu(bn_n(conv_n(... relu(bn_1(conv_1(x))))) + shortcut(x))`` in every checkpoint mode.

    Subclasses create ``conv1``, ``bn1``, ``conv2``, ``bn2`` (, ``conv3``, ``bn3``) and
    ``downsample`` (``None``, torchvision's ``Sequential(conv1x1, BatchNorm)`` or a
    parameter-free shortcut), and list them in ``_convs`` and ``_norms``.
    """

    downsample: nn.Module | None
    _convs: list[nn.Conv2d]
    _norms: list[nn.BatchNorm2d]

    def _branch(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Convolutions ``start..stop-1`` (0-based) of the residual branch, BN-ReLU before each
        but the first: ``x`` is the block's input (start 0) or conv_start-1's output."""
        for k in range(start, stop):
            if k > 0:
                x = F.relu(self._norms[k - 1](x), inplace=True)
            x = self._convs[k](x)
        return x

    def _tail(self, c: torch.Tensor, x: torch.Tensor, start: int) -> torch.Tensor:
        """From ``c`` (conv_start's input: see ``_branch``) to the sum before the final ReLU."""
        c = self._branch(c, start, len(self._convs))
        return self._norms[-1](c) + (x if self.downsample is None else self.downsample(x))

    def _last_norm_add(self, c: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """``bn_n(c)`` plus the shortcut, whose convolution (if any) already gave ``d``."""
        ds = self.downsample
        if isinstance(ds, nn.Sequential):
            return self._norms[-1](c) + ds[1](d)
        return self._norms[-1](c) + (d if ds is None else ds(d))

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """Residual branch plus shortcut: the block's output before its final ReLU."""
        return self._tail(x, x, 0)

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """The block on ``x``; ``mode`` is ``None`` (plain) or a checkpoint mode (module doc).
        ``"pre_relu"`` is the plain block without its final ReLU (the end of a ``block``-mode
        region, called through the module so that its hooks, FSDP2's among them, still run)."""
        if mode == "pre_relu":
            return self.residual(x)
        if mode is None:
            out = self.residual(x)
        elif mode == "block":
            out = checkpoint(self.residual, x, **NO_RNG)
        elif mode == "halves":
            # backward reruns conv1, stops before conv2
            c2 = checkpoint(self._branch, x, 0, 2, **NO_RNG)
            out = checkpoint(self._tail, c2, x, 2, **NO_RNG)
        elif mode == "bn_relu":  # convolutions outside, BN-ReLU(-conv input) inside checkpoints
            c = self._convs[0](x)
            for k in range(1, len(self._convs)):
                c = checkpoint(self._branch, c, k, k + 1, **NO_RNG)
            ds = self.downsample
            d = ds[0](x) if isinstance(ds, nn.Sequential) else x
            out = checkpoint(self._last_norm_add, c, d, **NO_RNG)
        else:
            raise ValueError(f"unknown ResNet checkpoint mode {mode!r}; expected None or one of "
                             f"{', '.join(MODES)}")
        return F.relu(out, inplace=True)


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


class BasicBlock(_ResidualBlock):
    """Two 3x3 conv-BN layers and a shortcut (He et al. 2016, Fig. 5 left); torchvision's names."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, planes, stride)
        self.bn1 = cp_BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)  # torchvision has it; the forward uses F.relu
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = cp_BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    @property
    def _convs(self) -> list[nn.Conv2d]:
        return [self.conv1, self.conv2]

    @property
    def _norms(self) -> list[nn.BatchNorm2d]:
        return [self.bn1, self.bn2]


class Bottleneck(_ResidualBlock):
    """1x1 (reduce), 3x3 (stride here, torchvision's v1.5), 1x1 (expand x4) conv-BN layers and a
    shortcut (He et al. 2016, Fig. 5 right); torchvision's names."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(in_channels, planes)
        self.bn1 = cp_BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = cp_BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = cp_BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    @property
    def _convs(self) -> list[nn.Conv2d]:
        return [self.conv1, self.conv2, self.conv3]

    @property
    def _norms(self) -> list[nn.BatchNorm2d]:
        return [self.bn1, self.bn2, self.bn3]


def _segment(blocks: Sequence[_ResidualBlock], x: torch.Tensor) -> torch.Tensor:
    """Blocks in order, the last one stopping before its final ReLU (``block`` mode's region)."""
    for block in blocks[:-1]:
        x = block(x)
    return blocks[-1](x, "pre_relu")
