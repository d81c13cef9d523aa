"""ResNets for CIFAR and ImageNet, with memory-efficient (checkpointed) training.

A ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition", arXiv:1512.03385) is a
chain of residual blocks ``relu(F(x) + shortcut(x))``: BasicBlock (two 3x3 convolutions) or
Bottleneck (1x1, 3x3, 1x1). Plain training keeps, per block, the input of every convolution and
every BatchNorm; most of it is cheap to rebuild.

Checkpoint modes (``checkpoint_modes``, the recommended first; all give exactly the plain model's
outputs, gradients and BatchNorm statistics, and the same state_dict). Each mode's peak and FLOPs
beside timm's checkpointing, with the machine and the command: docs/benchmarks/models.md.

* ``"tapered"`` (recommended for the CIFAR ResNets, which have no other first choice): the three
  stages cost the same FLOPs but stage 1's maps are 2x stage 2's and 4x stage 3's, so recompute
  is spent where the bytes are: stage 1 is checkpointed in regions of two whole blocks (only
  every other block's input kept), stage 2 in ``bn_relu`` (no convolution reruns), stage 3 runs
  plainly. It keeps less than ``halves`` for fewer extra FLOPs.
* ``"halves"`` (recommended for the ImageNet ResNets): each block is checkpointed in two halves
  that meet at conv2's output, so per block only its input and conv2's output are kept. Backward
  reruns conv1 (and, in a Bottleneck, conv3 and the downsample convolution) but never conv2, the
  3x3 convolution that holds most of a Bottleneck's FLOPs: zoo.checkpoint (like torch's
  non-reentrant one) stops once it has rebuilt every tensor backward needs, and a convolution
  saves its input before it runs. A BasicBlock has two equal 3x3 convolutions, so there it keeps
  about half the activations for a sixth more FLOPs, and parameters and gradients weigh more at
  a small batch: hence ``tapered`` for the CIFAR nets.
* ``"block"``: each block's residual branch and shortcut are checkpointed whole (timm's
  granularity): only block inputs are kept and the whole forward runs again in backward (about
  +33% FLOPs). ``checkpoint_every=n`` checkpoints ``n`` consecutive blocks as one region, so only
  every n-th block's output is kept (Chen et al. 2016's segments; timm's
  ``checkpoint_seq(every=n)``): with n=2 the lowest peak for the CIFAR nets; on ResNet-50 two
  blocks rebuilt at once outweigh what they save.
* ``"bn_relu"``: only BatchNorms, ReLUs and shortcuts are recomputed; every convolution's output
  is kept and none runs again: no extra FLOPs, the least saving.

The stem's BN-ReLU(-max-pool) is checkpointed too: with its convolution in ``halves`` and
``block`` (3 input channels: ~1% of the FLOPs, and its 112x112 output is not kept), without it
in ``bn_relu``. Each block's final ReLU runs outside the checkpoint: it saves its output, which
is the next block's input and kept anyway, so recomputing it would only hold a second copy.

The ImageNet models' submodules are named as torchvision's (``conv1``, ``bn1``, ``layer1.0.
conv1``, ``layer2.0.downsample.0``, ``fc``), so torchvision's state_dicts load with ``strict=True``
(torchvision's v1.5 layout: the stride is on the 3x3 convolution). The CIFAR models follow the
paper's Section 4.2: a 3x3 stem of 16 channels, three stages of 16/32/64 channels with ``n``
BasicBlocks each (depth ``6n + 2``), global average pooling and a linear classifier; shortcuts
are option A (identity, subsampled and zero-padded where the shape changes: no parameters).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD, NO_RNG, classifier
from ._registry import build_model, register_model
from .resnet_base import _ResNetBase
from .resnet_blocks import MODES, BasicBlock, Bottleneck, ZeroPadShortcut, _conv1x1, _conv3x3, \
    _segment

__all__ = ["ZeroPadShortcut", "BasicBlock", "Bottleneck", "ResNet", "CifarResNet"]

CIFAR_MODES = ("tapered", *MODES)  # the CIFAR nets' recommended mode first (module docstring)


class ResNet(_ResNetBase):
    """ImageNet ResNet (He et al. 2016, Table 1) in torchvision's layout: 7x7/2 conv, BN-ReLU,
    3x3/2 max-pool, four stages of 64/128/256/512-plane blocks, global pooling, linear classifier.

    Args:
        block: ``BasicBlock`` (ResNet-18/34) or ``Bottleneck`` (ResNet-50/101/152).
        layers: blocks per stage.
        num_classes: classifier outputs.
        checkpoint_every: with the ``block`` mode, blocks per checkpointed region.
        efficient: checkpointing: ``False``, ``True`` (``"halves"``) or a mode name.
        in_chans: input channels (3 for RGB).
        drop_rate: dropout on the pooled features before the classifier (timm's ResNet).
        global_pool: ``"avg"`` or ``""`` (no pooling: with ``num_classes=0``, feature maps out).
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: Sequence[int],
                 num_classes: int = 1000, checkpoint_every: int = 1,
                 efficient: bool | str = False, in_chans: int = 3, drop_rate: float = 0.0,
                 global_pool: str = "avg") -> None:
        super().__init__()
        self._head_options(in_chans, drop_rate, global_pool)
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"layers must give 4 stages of at least one block each, "
                             f"got {tuple(layers)}")
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(in_chans, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = cp_BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        channels = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            downsample = None
            if stride != 1 or channels != planes * block.expansion:
                downsample = nn.Sequential(_conv1x1(channels, planes * block.expansion, stride),
                                           cp_BatchNorm2d(planes * block.expansion))
            stage = [block(channels, planes, stride, downsample)]
            channels = planes * block.expansion
            stage += [block(channels, planes) for _ in range(1, n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.num_features = channels
        self.fc = classifier(channels, num_classes)
        self._init(checkpoint_every, efficient)

    def _stage_names(self) -> list[str]:
        return ["layer1", "layer2", "layer3", "layer4"]

    def _stem_modules(self) -> list[nn.Module]:
        return [self.conv1, self.bn1, self.relu, self.maxpool]

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random images, 64 px by default (small for CPU tests; 224 is the native size)."""
        side = size or 64
        return torch.randn(batch_size, self.in_chans, side, side, device=self.conv1.weight.device)

    def data_cfg(self) -> dict:
        """ImageNet: 224 px, torchvision's normalisation and evaluation crop."""
        return dict(input_size=(self.in_chans, 224, 224), pool_size=(7, 7), mean=IMAGENET_MEAN,
                    std=IMAGENET_STD, interpolation="bilinear", crop_pct=0.875,
                    crop_mode="center")


class CifarResNet(_ResNetBase):
    """CIFAR ResNet of depth ``6n + 2`` (He et al. 2016, Sec. 4.2): 3x3 conv (16), BN-ReLU,
    three stages of ``n`` BasicBlocks with 16/32/64 channels (stride 2 at the start of stages 2
    and 3), option A shortcuts, global pooling, linear classifier.

    Args:
        depth: ``6n + 2``: 20, 32, 44, 56, 110, 1202 in the paper.
        num_classes: classifier outputs.
        checkpoint_every: with the ``block`` mode, blocks per checkpointed region.
        efficient: checkpointing: ``False``, ``True`` (``"tapered"``) or a mode name.
        in_chans: as :class:`ResNet`'s.
        drop_rate: as :class:`ResNet`'s.
        global_pool: as :class:`ResNet`'s.
    """

    checkpoint_modes = CIFAR_MODES

    def __init__(self, depth: int = 20, num_classes: int = 10, checkpoint_every: int = 1,
                 efficient: bool | str = False, in_chans: int = 3, drop_rate: float = 0.0,
                 global_pool: str = "avg") -> None:
        super().__init__()
        self._head_options(in_chans, drop_rate, global_pool)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet has depth 6n + 2 (20, 32, 44, 56, 110, 1202), "
                             f"got {depth!r}")
        n = (depth - 2) // 6
        self.depth = depth
        self.num_classes = num_classes
        self.conv1 = _conv3x3(in_chans, 16)
        self.bn1 = cp_BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        channels = 16
        for i, planes in enumerate((16, 32, 64)):
            stride = 1 if i == 0 else 2
            shortcut = ZeroPadShortcut(channels, planes, stride) if stride != 1 else None
            stage = [BasicBlock(channels, planes, stride, shortcut)]
            stage += [BasicBlock(planes, planes) for _ in range(1, n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*stage))
            channels = planes
        self.num_features = channels
        self.fc = classifier(channels, num_classes)
        self._init(checkpoint_every, efficient)

    def _stage_names(self) -> list[str]:
        return ["layer1", "layer2", "layer3"]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> the last stage's feature maps (``tapered`` here, other modes in the base)."""
        if self.grad_checkpointing != "tapered" or self.checkpoint_plan is not None:
            return super().forward_features(x)
        return self._tapered(checkpoint(self._stem, x, **NO_RNG))

    def _tapered(self, x: torch.Tensor) -> torch.Tensor:
        """The ``tapered`` mode (module docstring): stage 1 in regions of two whole blocks, stage
        2 with only BN-ReLUs recomputed, stage 3 plain. The stages have equal FLOPs and halving
        activation sizes, so recomputing where the bytes are buys the most per FLOP."""
        first, second, *rest = [list(getattr(self, name)) for name in self._stage_names()]
        for i in range(0, len(first), 2):
            x = F.relu(checkpoint(_segment, first[i:i + 2], x, **NO_RNG), inplace=True)
        for block in second:
            x = block(x, "bn_relu")
        for block in (b for stage in rest for b in stage):
            x = block(x)
        return x

    def _stem_modules(self) -> list[nn.Module]:
        return [self.conv1, self.bn1, self.relu]

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random 32x32 images (CIFAR's size) unless ``size`` says otherwise."""
        side = size or 32
        return torch.randn(batch_size, self.in_chans, side, side, device=self.conv1.weight.device)

    def data_cfg(self) -> dict:
        """CIFAR: 32 px, CIFAR-10's channel statistics, no crop."""
        return dict(input_size=(self.in_chans, 32, 32), pool_size=(8, 8), mean=CIFAR_MEAN,
                    std=CIFAR_STD, interpolation="bilinear", crop_pct=1.0,
                    crop_mode="center")


# ------------------------------------------------------------------------------------------------
# CIFAR (He et al. 2016, Table 6): depth 6n + 2, 10 classes by default.
# ------------------------------------------------------------------------------------------------
@register_model
def resnet20(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-20 for CIFAR (n=3): 0.27M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=20), efficient=efficient, **kwargs)


@register_model
def resnet32(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-32 for CIFAR (n=5): 0.46M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=32), efficient=efficient, **kwargs)


@register_model
def resnet44(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-44 for CIFAR (n=7): 0.66M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=44), efficient=efficient, **kwargs)


@register_model
def resnet56(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-56 for CIFAR (n=9): 0.85M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=56), efficient=efficient, **kwargs)


@register_model
def resnet110(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-110 for CIFAR (n=18): 1.7M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=110), efficient=efficient, **kwargs)


@register_model
def resnet1202(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-1202 for CIFAR (n=200): 19.4M parameters (He et al. 2016, Table 6)."""
    return build_model(CifarResNet, dict(depth=1202), efficient=efficient, **kwargs)


# ------------------------------------------------------------------------------------------------
# ImageNet (He et al. 2016, Table 1): torchvision's layout, so its weights load strictly.
# ------------------------------------------------------------------------------------------------
@register_model
def resnet18(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-18 (BasicBlock, 2-2-2-2): 11.7M parameters; loads torchvision's weights."""
    return build_model(ResNet, dict(block=BasicBlock, layers=(2, 2, 2, 2)), efficient=efficient,
                       **kwargs)


@register_model
def resnet34(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-34 (BasicBlock, 3-4-6-3): 21.8M parameters; loads torchvision's weights."""
    return build_model(ResNet, dict(block=BasicBlock, layers=(3, 4, 6, 3)), efficient=efficient,
                       **kwargs)


@register_model
def resnet50(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-50 (Bottleneck, 3-4-6-3): 25.6M parameters; loads torchvision's weights."""
    return build_model(ResNet, dict(block=Bottleneck, layers=(3, 4, 6, 3)), efficient=efficient,
                       **kwargs)


@register_model
def resnet101(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-101 (Bottleneck, 3-4-23-3): 44.5M parameters; loads torchvision's weights."""
    return build_model(ResNet, dict(block=Bottleneck, layers=(3, 4, 23, 3)), efficient=efficient,
                       **kwargs)


@register_model
def resnet152(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-152 (Bottleneck, 3-8-36-3): 60.2M parameters; loads torchvision's weights."""
    return build_model(ResNet, dict(block=Bottleneck, layers=(3, 8, 36, 3)), efficient=efficient,
                       **kwargs)
