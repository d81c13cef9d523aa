"""The building blocks of zoo/models/densenet.py (Huang et al. 2017, "Densely Connected
Convolutional Networks", arXiv:1608.06993): the dense layer, the dense block, the transition and
the planner's one-layer link, each able to run itself in any of the DenseNet checkpoint modes
(described in :mod:`zoo.models.densenet`)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import NO_RNG  # the regions here draw no random number: dropout runs outside

__all__ = ["DenseLayer", "DenseBlock", "DenseLink", "Transition"]

Features = Sequence[torch.Tensor]  # the feature maps of a dense block so far, concatenated lazily

def _cat(features: Features) -> torch.Tensor:
    return features[0] if len(features) == 1 else torch.cat(list(features), 1)


class DenseLayer(nn.Module):
    """One dense layer: BN-ReLU-conv1x1(bn_size*k)-BN-ReLU-conv3x3(k) on the concatenation of
    all earlier feature maps (DenseNet-B), or BN-ReLU-conv3x3(k) without bottleneck (plain
    DenseNet). Returns only the ``growth_rate`` new feature maps.
    """

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int | None = 4,
                 drop_rate: float = 0.0) -> None:
        super().__init__()
        self.bottleneck = bn_size is not None
        width = bn_size * growth_rate if bn_size is not None else growth_rate
        self.norm1 = cp_BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        kernel = 1 if self.bottleneck else 3
        self.conv1 = nn.Conv2d(in_channels, width, kernel, padding=kernel // 2, bias=False)
        if self.bottleneck:
            self.norm2 = cp_BatchNorm2d(width)
            self.relu2 = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(width, growth_rate, 3, padding=1, bias=False)
        self.drop_rate = float(drop_rate)

    def first_half(self, *features: torch.Tensor) -> torch.Tensor:
        """concat-BN-ReLU-conv1: the bottleneck (1x1) convolution, or the 3x3 one without it."""
        return self.conv1(self.relu1(self.norm1(_cat(features))))

    def second_half(self, x: torch.Tensor) -> torch.Tensor:
        """BN-ReLU-conv2 on the bottleneck's output (DenseNet-B only)."""
        return self.conv2(self.relu2(self.norm2(x)))

    def new_features(self, *features: torch.Tensor) -> torch.Tensor:
        """The layer's maps before dropout, from the feature maps so far (concatenated here)."""
        x = self.first_half(*features)
        return self.second_half(x) if self.bottleneck else x

    def forward(self, features: torch.Tensor | Features, mode: str | None = None) -> torch.Tensor:
        """New feature maps from ``features`` (a tensor or the list of the block's maps so far).

        ``mode``: ``None`` runs plainly; ``"bottleneck"`` checkpoints each half (concat-BN-ReLU-
        conv1, BN-ReLU-conv2) on its own, so backward recomputes the BN-ReLUs and stops before
        each convolution: the convolutions' outputs are the only maps kept; ``"layer"``
        checkpoints the whole layer, recomputing conv1 too, so only the new maps are kept.
        Dropout stays outside the checkpoints: it keeps only its mask, and conv2 never reruns;
        the checkpoints then draw no random number, so they save no RNG state.
        """
        if isinstance(features, torch.Tensor):
            features = [features]
        if mode is None:
            x = self.new_features(*features)
        elif mode == "bottleneck":
            x = checkpoint(self.first_half, *features, **NO_RNG)
            if self.bottleneck:
                x = checkpoint(self.second_half, x, **NO_RNG)
        elif mode == "layer":
            x = checkpoint(self.new_features, *features, **NO_RNG)
        else:
            raise ValueError(f"unknown DenseNet checkpoint mode {mode!r}; expected None, "
                             f"'bottleneck' or 'layer'")
        if self.drop_rate > 0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x


class DenseBlock(nn.ModuleDict):
    """``num_layers`` dense layers (``denselayer1`` ...); each adds ``growth_rate`` channels."""

    def __init__(self, num_layers: int, in_channels: int, growth_rate: int, bn_size: int | None,
                 drop_rate: float = 0.0) -> None:
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_channels + i * growth_rate, growth_rate,
                                                    bn_size, drop_rate)

    def run(self, features: Features, mode: str | None = None) -> list[torch.Tensor]:
        """All feature maps after the block: ``features`` followed by each layer's new maps."""
        features = list(features)
        for layer in self.values():
            features.append(layer(features, mode))
        return features

    def forward(self, x: torch.Tensor | Features, mode: str | None = None) -> torch.Tensor:
        """The block's output as one tensor (input and every new map, concatenated)."""
        return _cat(self.run([x] if isinstance(x, torch.Tensor) else x, mode))


class DenseLink(nn.Module):
    """A dense layer as one link of the planner's chain (``DenseNet.checkpoint_chain``):
    ``x -> cat(x, layer(x))``, the concatenation so far in, the one with the new maps out.

    This is the naive DenseNet's memory (each layer's concatenation is a new tensor, kept for the
    layer's BatchNorm), but as a chain of one-tensor blocks, so the planner can choose per layer
    what to recompute (Chen et al. 2016 checkpoint DenseNets at this granularity). Built on the
    fly; holds no parameters of its own, so the state_dict is the model's.
    """

    def __init__(self, layer: DenseLayer, name: str) -> None:
        super().__init__()
        self.layer, self.name = layer, name

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """``mode``: the layer's checkpoint mode (the planner's per-layer option)."""
        return torch.cat([x, self.layer(x, mode)], 1)


class Transition(nn.Module):
    """Between dense blocks: BN-ReLU-conv1x1 (compression) then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm = cp_BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)

    def _compress(self, *features: torch.Tensor) -> torch.Tensor:
        return self.conv(self.relu(self.norm(_cat(features))))

    def forward(self, x: torch.Tensor | Features, mode: str | None = None) -> torch.Tensor:
        """``x``: the block's output or its list of feature maps; with a ``mode`` the
        concat-BN-ReLU is recomputed in backward (the convolution is not: backward stops before)."""
        features = [x] if isinstance(x, torch.Tensor) else list(x)
        if mode is None:
            return self.pool(self._compress(*features))
        return self.pool(checkpoint(self._compress, *features, **NO_RNG))
