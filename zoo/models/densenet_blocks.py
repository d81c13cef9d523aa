"""The building blocks of zoo/models/densenet.py (Huang et al. 2017, "Densely Connected
Convolutional Networks", arXiv:1608.06993): the dense layer, the dense block, the transition and
the planner's one-layer link, each able to run itself in any of the DenseNet checkpoint modes
(described in :mod:`zoo.models.densenet`)."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch
from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import NO_RNG  # the regions here draw no random number: dropout runs outside

__all__ = ["DenseLayer", "DenseBlock", "DenseLink", "Transition", "Features"]


class Features(list):
    """A dense block's feature maps so far (a list: concatenated only inside the checkpoints
    that read them), and in a checkpoint mode ``joined``: a stand-in for their concatenation
    that holds no memory, through which the gradient of every concatenation reaches the maps.

    Why: each map is read by every later layer, so autograd would sum its gradient from up to
    a block's depth of concatenation gradients. Under ``torch.compile`` inductor fuses that
    chain of additions into one kernel per map, run when the last term is there, and keeps
    every term alive until then: all of a block's concatenation gradients at once (in float32
    under bf16 autocast, where BatchNorm's backward computes them), the quadratic memory
    checkpointing DenseNets is meant to avoid. Through the stand-ins (:class:`_Join`,
    :class:`_Joined`) the gradient is one tensor per layer: the next stand-in's, sliced, plus
    the layer's own concatenation gradient, added once. The terms and their order are the ones
    autograd adds for the plain model, so gradients are the same bit for bit."""

    joined: torch.Tensor | None = None
    _element: torch.Tensor | None = None  # the element every stand-in of the block views

    @classmethod
    def of(cls, features: torch.Tensor | Sequence[torch.Tensor], mode: str | None) -> Features:
        """``features`` (a tensor or maps so far) as Features, with a stand-in when ``mode``
        checkpoints (kept if ``features`` has one already)."""
        maps = cls([features] if isinstance(features, torch.Tensor) else features)
        maps.joined = getattr(features, "joined", None)
        maps._element = getattr(features, "_element", None)
        if mode is not None and maps.joined is None:
            first = maps[0].detach()
            maps._element = first[(0,) * first.dim()] if first.numel() else first.new_empty(())
            maps.joined = _Join.apply(maps._element, *maps)
        return maps

    def add(self, new: torch.Tensor) -> None:
        """Append a layer's new maps, and join them to the stand-in if there is one."""
        self.append(new)
        if self.joined is not None:
            self.joined = _Join.apply(self._element, self.joined, new)


#: Under ``torch.compile`` a stand-in's gradient of fewer bytes per element than this is stored
#: by force (:class:`_Join`): bf16 and float16, where inductor's own rule stores float32.
FORCED_STORE_BELOW = 4


class _Join(torch.autograd.Function):
    """Maps (or a stand-in and new maps) -> the stand-in for their concatenation along the
    channels: ``element`` (one element of the block's first map: no value of a stand-in is
    ever read, and a view allocates nothing) expanded to its shape; backward splits the
    concatenation's gradient between the parts (:class:`Features`).

    Under ``torch.compile`` the parts are cut by one ``narrow`` each, not one ``split``: the
    gradient then has as many readers as parts, and inductor stores a value read more than once
    from more than four buffers (``StorageBox.mark_reuse``), so in float32 the gradient is
    written as soon as its layer's BatchNorm backward has its statistics. Behind one ``split``
    it stays an expression inlined into each reader: the new maps' part computed at once, for
    their convolution's backward, the stand-in's part inside the previous layer's gradient sum,
    which then keeps what the expression reads alive through the previous layer's recompute
    (this layer's recomputed concatenation, ReLU and convolution input gradient). In bf16 or
    float16 the rule stores a float32 intermediate of the BatchNorm backward instead, and the
    gradient, a cast of it read from three buffers, stays inlined, so its store is forced
    (:func:`zoo._torch.stored_when_compiled`). Card model, DenseNet-BC-100, batch 64, H200, the
    compiled ``bottleneck`` step's peak: 654.7 (one split) -> 571.5 MiB in float32 (eager
    560.3), 388.9 -> 351.3 (narrows) -> 321.7 MiB in bf16 (eager 318.7). Forced in float32 too,
    the card's peak is the same, but inductor's CPU backend peaked higher (the step's resident
    memory, DenseNet-BC-100 b16: 141 against 131 MiB, medians of 8 runs), so float32 keeps the
    rule. An identity ``as_strided`` would force the store too, but it carries eager's strides
    while inductor keeps a convolution net channels-last inside: its gradients came out
    wrong."""

    @staticmethod
    def forward(ctx: Any, element: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [p.shape[1] for p in parts]
        first = parts[0]
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))
        return element.to(dtype).expand(first.shape[0], sum(ctx.sizes), *first.shape[2:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.compiler.is_compiling():  # stored once (above); eager's is stored already
            if grad.dtype.itemsize < FORCED_STORE_BELOW:
                grad = _torch.stored_when_compiled(grad)
            starts = itertools.accumulate(ctx.sizes[:-1], initial=0)
            return (None, *(grad.narrow(1, a, b) for a, b in zip(starts, ctx.sizes)))
        return (None, *grad.split(ctx.sizes, 1))


class _Joined(torch.autograd.Function):
    """The maps' concatenation, whose gradient goes to the stand-in ``joined``, not to the
    maps (:class:`Features`)."""

    @staticmethod
    def forward(ctx: Any, joined: torch.Tensor, *features: torch.Tensor) -> torch.Tensor:
        ctx.count = len(features)
        return _concat(features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(None,) * ctx.count)


def _cat(features: Sequence[torch.Tensor], joined: torch.Tensor | None = None) -> torch.Tensor:
    """The maps concatenated; with the stand-in ``joined``, their gradient goes through it."""
    if joined is not None:
        return _Joined.apply(joined, *features)
    return _concat(features)


def _concat(features: Sequence[torch.Tensor]) -> torch.Tensor:
    """One map as it is, several concatenated along the channels."""
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

    def first_half(self, joined: torch.Tensor | None, *features: torch.Tensor) -> torch.Tensor:
        """concat-BN-ReLU-conv1: the bottleneck (1x1) convolution, or the 3x3 one without it;
        ``joined``: the maps' stand-in (:class:`Features`) or None."""
        return self.conv1(self.relu1(self.norm1(_cat(features, joined))))

    def second_half(self, x: torch.Tensor) -> torch.Tensor:
        """BN-ReLU-conv2 on the bottleneck's output (DenseNet-B only)."""
        return self.conv2(self.relu2(self.norm2(x)))

    def new_features(self, joined: torch.Tensor | None, *features: torch.Tensor
                     ) -> torch.Tensor:
        """The layer's maps before dropout, from the feature maps so far (concatenated here)."""
        x = self.first_half(joined, *features)
        return self.second_half(x) if self.bottleneck else x

    def forward(self, features: torch.Tensor | Sequence[torch.Tensor], mode: str | None = None,
                joined: torch.Tensor | None = None) -> torch.Tensor:
        """New feature maps from ``features`` (a tensor or the list of the block's maps so far;
        ``joined``: their stand-in, :class:`Features`, or None).

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
            x = self.new_features(joined, *features)
        elif mode == "bottleneck":
            x = checkpoint(self.first_half, joined, *features, **NO_RNG)
            if self.bottleneck:
                x = checkpoint(self.second_half, x, **NO_RNG)
        elif mode == "layer":
            x = checkpoint(self.new_features, joined, *features, **NO_RNG)
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

    def run(self, features: torch.Tensor | Sequence[torch.Tensor], mode: str | None = None
            ) -> Features:
        """All feature maps after the block: ``features`` followed by each layer's new maps
        (with their stand-in in a checkpoint mode: :class:`Features`)."""
        features = Features.of(features, mode)
        for layer in self.values():
            features.add(layer(list(features), mode, features.joined))
        return features

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor], mode: str | None = None
                ) -> torch.Tensor:
        """The block's output as one tensor (input and every new map, concatenated)."""
        features = self.run(x, mode)
        return _cat(features, features.joined)


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

    def _compress(self, joined: torch.Tensor | None, *features: torch.Tensor) -> torch.Tensor:
        return self.conv(self.relu(self.norm(_cat(features, joined))))

    def forward(self, x: torch.Tensor | Sequence[torch.Tensor], mode: str | None = None,
                joined: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: the block's output or its feature maps (``joined``: their stand-in,
        :class:`Features`, or None); with a ``mode`` the concat-BN-ReLU is recomputed in
        backward (the convolution is not: backward stops before)."""
        features = [x] if isinstance(x, torch.Tensor) else list(x)
        if mode is None:
            return self.pool(self._compress(joined, *features))
        return self.pool(checkpoint(self._compress, joined, *features, **NO_RNG))
