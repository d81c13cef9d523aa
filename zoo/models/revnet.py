"""RevNets for CIFAR (Gomez et al. 2017, "The Reversible Residual Network: Backpropagation
Without Storing Activations", arXiv:1707.04585): ResNets whose activations are rebuilt, exactly,
during backward instead of stored.

The activations are split into two halves along the channels, and each residual unit couples
them: ``y1 = x1 + F(x2), y2 = x2 + G(y1)``, where ``F`` and ``G`` are pre-activation residual
functions (BN-ReLU-conv3x3 twice, or the BN-ReLU-conv 1x1/3x3/1x1 bottleneck) on half the
channels. Such a unit is invertible, so backward rebuilds its input from its output
(``zoo.reversible``: exact, on fixed-point streams). The first unit of a stage that halves the
resolution or widens the channels is not invertible; as in the paper it is a coupling whose
shortcuts downsample (average pooling and zero channels, or a strided 1x1 projection in the
bottleneck nets); in the rebuild it leads its stage's reversible sequence (``lead=``), which
recomputes it in backward from its input, made again from the previous stage's integer streams
instead of kept. A 3x3 stem (conv-BN-ReLU) comes first; the last stage is followed by BN-ReLU,
global average pooling and a linear classifier.

The architectures are the paper's Table 1, from its released code (renmengye/revnet-public):
RevNet-38 (3-3-3 units, 32/32/64/112 channels), RevNet-110 (9-9-9, 32/32/64/128), RevNet-164
(9-9-9 bottleneck units, 32/128/256/512). Their parameter counts, 0.46M / 1.73M / 1.75M in the
paper, are pinned by tests: 0.46M / 1.73M / 1.75M here.

One checkpoint mode, ``"reversible"`` (``efficient=True``): the reversible units rebuild their
inputs in backward (each residual function's first BN-ReLU is made again in backward instead
of kept through it), the downsampling units are recomputed from the streams of the stage
before, the stem and the final BN-ReLU are checkpointed (the stem as two nested regions, so
that its backward holds three full-resolution maps, not four), and while they are recomputed
the ReLUs inside the residual functions write their gradient over the one they receive.
With it off (``efficient=False``) the model is the same network, same forward and same
state_dict, storing its activations; both train bit for bit alike. Its peak beside the stored
network and zoo.plan on ResNet-110, machine and command: docs/benchmarks/reversible.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint, is_recomputing
from ..nn import cp_BatchNorm2d
from ..reversible import Coupling, join, reversible_sequence, split
from ._features import Level
from ._registry import build_model, register_model
from .resnet import CifarResNet, _ResNetBase

__all__ = ["ResidualFn", "Downsample", "DownUnit", "RevStage", "RevNet"]

MODE = "reversible"


class _ReLUGradInPlace(torch.autograd.Function):
    """In-place ReLU whose backward writes its input's gradient over its output's (the same
    kernel as ReLU's backward, ``threshold_backward``, with its result in the incoming gradient's
    memory): one map less is live while it runs, the values are bit for bit ReLU's. Only where
    the output's one consumer is a convolution, whose backward makes a gradient no one else
    holds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        torch.relu_(x)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out, = ctx.saved_tensors
        return torch.ops.aten.threshold_backward.grad_input(grad, out, 0, grad_input=grad)


class ResidualFn(nn.Module):
    """A pre-activation residual function (He et al. 2016, "Identity Mappings in Deep Residual
    Networks"): [BN-ReLU-]conv3x3(stride)-BN-ReLU-conv3x3, or with ``bottleneck`` [BN-ReLU-]
    conv1x1(stride)-BN-ReLU-conv3x3-BN-ReLU-conv1x1 with a quarter of ``out_channels`` inside.
    ``preact=False`` drops the first BN-ReLU (the stem's follows right before)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1,
                 bottleneck: bool = False, preact: bool = True) -> None:
        super().__init__()
        mid = out_channels // 4 if bottleneck else out_channels
        if preact:
            self.bn1 = cp_BatchNorm2d(in_channels)
        if bottleneck:
            shapes = [(in_channels, mid, 1, stride), (mid, mid, 3, 1), (mid, out_channels, 1, 1)]
        else:
            shapes = [(in_channels, mid, 3, stride), (mid, out_channels, 3, 1)]
        for i, (cin, cout, k, s) in enumerate(shapes, start=1):
            if i > 1:
                self.add_module(f"bn{i}", cp_BatchNorm2d(cin))
            self.add_module(f"conv{i}", nn.Conv2d(cin, cout, k, stride=s, padding=k // 2,
                                                  bias=False))
        self.depth = len(shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.pre(x) if hasattr(self, "bn1") else x)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """The first BN-ReLU (with ``preact``)."""
        return F.relu(self.bn1(x), inplace=True)

    def rest(self, x: torch.Tensor) -> torch.Tensor:
        """What follows the first BN-ReLU."""
        for i in range(1, self.depth + 1):
            bn = getattr(self, f"bn{i}", None) if i > 1 else None
            if bn is not None:
                x = _relu_before_conv(bn(x))
            x = getattr(self, f"conv{i}")(x)
        return x

    def parts(self) -> tuple[Any, Any]:
        """``(pre, rest)`` with ``preact`` (what a reversible rebuild makes again instead of
        keeping: the first BN-ReLU's output), else ``(None, rest)``."""
        return (self.pre if hasattr(self, "bn1") else None, self.rest)


def _relu_before_conv(x: torch.Tensor) -> torch.Tensor:
    """ReLU in place on a map a convolution reads next; while a rebuild or a checkpoint
    recomputes (eager) its backward overwrites the convolution's input gradient
    (:class:`_ReLUGradInPlace`), so the BN's input, the ReLU's output and one gradient are live
    at once instead of two gradients."""
    if is_recomputing() and torch.is_grad_enabled():
        return _ReLUGradInPlace.apply(x)
    return F.relu(x, inplace=True)


class Downsample(nn.Module):
    """The basic RevNet's parameter-free shortcut: average pooling by ``stride`` and zero
    channels added on both sides up to ``out_channels`` (the paper's code)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.stride, self.pad = stride, (out_channels - in_channels) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride)
        return F.pad(x, (0, 0, 0, 0, self.pad, self.pad)) if self.pad else x


class DownUnit(nn.Module):
    """The first unit of a stage that changes resolution or width: ``y1 = F(x2) + D1(x1)``,
    ``y2 = G(y1) + D2(x2)`` with downsampling shortcuts ``D`` (not invertible: in the rebuild
    it is the ``lead`` of its stage's reversible sequence, a ``zoo.reversible.LeadBlock``).
    ``shortcut1``/``shortcut2`` are strided 1x1 projections in bottleneck nets and
    parameter-free :class:`Downsample` otherwise."""

    def __init__(self, in_half: int, out_half: int, stride: int, bottleneck: bool,
                 preact: bool) -> None:
        super().__init__()
        self.f = ResidualFn(in_half, out_half, stride, bottleneck, preact)
        self.g = ResidualFn(out_half, out_half, 1, bottleneck)
        for i in (1, 2):
            shortcut = nn.Conv2d(in_half, out_half, 1, stride=stride, bias=False) if bottleneck \
                else Downsample(in_half, out_half, stride)
            self.add_module(f"shortcut{i}", shortcut)

    def f_parts(self) -> tuple[Any, Any]:
        """``f`` as ``(head, tail)`` (:meth:`ResidualFn.parts`)."""
        return self.f.parts()

    def g_parts(self) -> tuple[Any, Any]:
        """``g`` as ``(head, tail)`` (:meth:`ResidualFn.parts`)."""
        return self.g.parts()

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = self.f(x2) + self.shortcut1(x1)
        return y1, self.g(y1) + self.shortcut2(x2)


class RevStage(nn.Sequential):
    """A stage: an optional :class:`DownUnit` and reversible units (``zoo.reversible.Coupling``
    of two :class:`ResidualFn`). Runs on the halves of its input's channels and returns them
    concatenated (``zoo.reversible.split``/``join``: a rebuilt stage's output then hands the
    next stage's downsampling unit its integer streams to make its input again from).
    ``mode``: ``None`` (stored) or ``"reversible"``; by default the model's."""

    mode: str | None = None

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        mode = self.mode if mode is None else mode
        if mode not in (None, MODE):
            raise ValueError(f"unknown RevNet checkpoint mode {mode!r}; expected None or {MODE!r}")
        units = list(self)
        lead = units.pop(0) if isinstance(units[0], DownUnit) else None
        x1, x2 = split(x)
        x1, x2 = reversible_sequence(units, x1, x2, rebuild=mode is not None,
                                     preserve_rng_state=False, lead=lead)
        return join(x1, x2)


class RevNet(_ResNetBase):
    """CIFAR RevNet: conv3x3-BN-ReLU stem, three stages of reversible units (stride 2 at the start
    of stages 2 and 3), BN-ReLU, global pooling, linear classifier.

    Args:
        units: reversible units per stage (each unit holds two residual functions).
        channels: the stem's channels, then each stage's (both halves together).
        bottleneck: bottleneck residual functions (RevNet-164).
        num_classes: classifier outputs.
        efficient: ``False`` (store activations), ``True`` or ``"reversible"`` (rebuild them).
        in_chans: input channels (3 for RGB).
        drop_rate: dropout on the pooled features before the classifier.
        global_pool: ``"avg"`` or ``""`` (no pooling: with ``num_classes=0``, feature maps out).
    """

    checkpoint_modes = (MODE,)
    planner_hand_modes = (MODE,)  # the rebuild keeps its streams: measured whole by zoo.plan
    example_input = CifarResNet.example_input  # random 32x32 images
    data_cfg = CifarResNet.data_cfg  # CIFAR's size and statistics

    def __init__(self, units: Sequence[int] = (9, 9, 9),
                 channels: Sequence[int] = (32, 32, 64, 128), bottleneck: bool = False,
                 num_classes: int = 10, efficient: bool | str = False, in_chans: int = 3,
                 drop_rate: float = 0.0, global_pool: str = "avg") -> None:
        super().__init__()
        self._head_options(in_chans, drop_rate, global_pool)
        if len(units) != 3 or min(units) < 1 or len(channels) != 4 or min(channels) < 2 \
                or any(c % 2 for c in channels):
            raise ValueError(f"a CIFAR RevNet has 3 stages of at least one unit and 4 even "
                             f"channel counts (stem, stages), got units={tuple(units)}, "
                             f"channels={tuple(channels)}")
        self.num_classes, self.channels = num_classes, tuple(channels)
        self.conv1 = nn.Conv2d(in_chans, channels[0], 3, padding=1, bias=False)
        self.bn1 = cp_BatchNorm2d(channels[0])
        self.relu = nn.ReLU(inplace=True)
        for i, n in enumerate(units):
            cin, cout, stride = channels[i] // 2, channels[i + 1] // 2, 1 if i == 0 else 2
            first: nn.Module
            if stride == 1 and cin == cout:
                first = Coupling(ResidualFn(cin, cout, 1, bottleneck, preact=i > 0),
                                 ResidualFn(cout, cout, 1, bottleneck))
            else:
                first = DownUnit(cin, cout, stride, bottleneck, preact=i > 0)
            rest = [Coupling(ResidualFn(cout, cout, 1, bottleneck),
                             ResidualFn(cout, cout, 1, bottleneck)) for _ in range(1, n)]
            self.add_module(f"layer{i + 1}", RevStage(first, *rest))
        self.final_bn = cp_BatchNorm2d(channels[-1])
        self.num_features = channels[-1]
        self.fc = nn.Linear(channels[-1], num_classes) if num_classes else nn.Identity()
        self._init(1, efficient)

    def _stage_names(self) -> list[str]:
        return ["layer1", "layer2", "layer3"]

    def _stem_modules(self) -> list[nn.Module]:
        return [self.conv1, self.bn1, self.relu]

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """As every zoo model's: ``True`` or ``"reversible"`` rebuilds, ``False`` stores."""
        super().set_grad_checkpointing(enable)
        for name in self._stage_names():
            getattr(self, name).mode = self.grad_checkpointing

    def _checkpointed(self, fn: Any, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, x) if self.grad_checkpointing else fn(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> the final BN-ReLU'd feature maps (before pooling)."""
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        x = self.stem(x)
        for name in self._stage_names():
            x = getattr(self, name)(x)
        return self.final_norm(x)

    def stem(self, x: torch.Tensor) -> torch.Tensor:
        """The stem (conv-BN-ReLU). In the reversible mode two nested regions: the outer keeps
        the images and its recompute makes the ReLU's output through an inner conv-BN region
        that keeps the images too, so the ReLU's backward never meets the conv's output and
        BatchNorm's backward never meets the ReLU's (three full-resolution maps live at a time,
        not four), for one more stem conv (3 input channels) and BN forward."""
        return checkpoint(self._stem_outer, x) if self.grad_checkpointing else self._stem(x)

    def _stem_outer(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(checkpoint(self._stem_norm, x))

    def _stem_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn1(self.conv1(x))

    def _final(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.final_bn(x))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final BN-ReLU (checkpointed in the reversible mode)."""
        return self._checkpointed(self._final, x)

    def feature_levels(self) -> list[Level]:
        """The stem's output, then each stage's (before the final BN-ReLU)."""
        levels = [Level(self.stem, self.conv1.out_channels, 1, "relu")]
        for i, name in enumerate(self._stage_names()):
            levels.append(Level(getattr(self, name), self.channels[i + 1], 2 ** i, name))
        return levels

    def checkpoint_chain(self) -> list[nn.Module]:
        """The stem's modules, each stage (its reversible units run as one), the final BN-ReLU."""
        return [self.conv1, nn.Sequential(self.bn1, self.relu), *(
            getattr(self, name) for name in self._stage_names()),
            nn.Sequential(self.final_bn, self.relu)]

    def blocks(self) -> list[nn.Module]:
        return [u for name in self._stage_names() for u in getattr(self, name)]


@register_model
def revnet38(efficient: bool | str = False, **kwargs: Any) -> RevNet:
    """RevNet-38 (Gomez et al. 2017, Table 1): 3-3-3 units, 32/32/64/112 channels; 0.46M
    parameters, the size of ResNet-32."""
    return build_model(RevNet, dict(units=(3, 3, 3), channels=(32, 32, 64, 112)),
                       efficient=efficient, **kwargs)


@register_model
def revnet110(efficient: bool | str = False, **kwargs: Any) -> RevNet:
    """RevNet-110 (Gomez et al. 2017, Table 1): 9-9-9 units, 32/32/64/128 channels; 1.73M
    parameters, the size of ResNet-110."""
    return build_model(RevNet, dict(units=(9, 9, 9), channels=(32, 32, 64, 128)),
                       efficient=efficient, **kwargs)


@register_model
def revnet164(efficient: bool | str = False, **kwargs: Any) -> RevNet:
    """RevNet-164 (Gomez et al. 2017, Table 1): 9-9-9 bottleneck units, 32/128/256/512
    channels; 1.75M parameters, the size of ResNet-164."""
    return build_model(RevNet, dict(units=(9, 9, 9), channels=(32, 128, 256, 512),
                                    bottleneck=True), efficient=efficient, **kwargs)
