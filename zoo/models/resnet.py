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
from ._base import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD, ZooModel, chain_of, \
    classifier
from ._features import FeatureStages, Level
from ._registry import register_model
from .resnet_blocks import (MODES, BasicBlock, Bottleneck, ZeroPadShortcut, _conv1x1, _conv3x3,
                            _ResidualBlock, _segment)

__all__ = ["ZeroPadShortcut", "BasicBlock", "Bottleneck", "ResNet", "CifarResNet"]

CIFAR_MODES = ("tapered", *MODES)  # the CIFAR nets' recommended mode first (module docstring)


class _ResNetBase(FeatureStages, ZooModel):
    """What both ResNets share: stem conv -> stem tail (BN-ReLU[-pool]) -> stages -> pool -> fc."""

    checkpoint_modes = MODES
    checkpoint_every: int = 1
    classifier_name, first_conv, pool_types = "fc", "conv1", ("avg", "")
    drop_rate: float = 0.0
    conv1: nn.Conv2d
    fc: nn.Linear

    def _stage_names(self) -> list[str]:
        raise NotImplementedError

    def _stem_modules(self) -> list[nn.Module]:
        raise NotImplementedError

    def _head_options(self, in_chans: int, drop_rate: float, global_pool: str) -> None:
        """timm's constructor options: input channels, dropout before the classifier, pooling."""
        if isinstance(in_chans, bool) or not isinstance(in_chans, int) or in_chans < 1:
            raise ValueError(f"in_chans must be a positive int (3 for RGB), got {in_chans!r}")
        if not 0 <= drop_rate < 1:
            raise ValueError(f"drop_rate (dropout before the classifier) must be in [0, 1), "
                             f"got {drop_rate!r}")
        if global_pool not in self.pool_types:
            raise ValueError(f"global_pool must be 'avg' or '' (no pooling), got {global_pool!r}")
        self.in_chans, self.drop_rate, self.global_pool = in_chans, float(drop_rate), global_pool

    def _init(self, checkpoint_every: int, efficient: bool | str) -> None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
                or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be a positive int (blocks per checkpointed "
                             f"region in 'block' mode), got {checkpoint_every!r}")
        self.checkpoint_every = checkpoint_every
        for m in self.modules():  # torchvision's (He et al. 2015) initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self.set_grad_checkpointing(efficient)

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """As ZooModel's; ``checkpoint_every > 1`` needs the ``block`` mode (the others split
        each block at its convolutions, which a multi-block region cannot do)."""
        previous = self.grad_checkpointing
        super().set_grad_checkpointing(enable)
        if self.checkpoint_every != 1 and self.grad_checkpointing not in (None, "block"):
            mode, self.grad_checkpointing = self.grad_checkpointing, previous
            raise ValueError(f"checkpoint_every={self.checkpoint_every} groups whole blocks and "
                             f"works with the 'block' mode only, not {mode!r}: pass "
                             f"efficient='block' or leave checkpoint_every at 1")

    def blocks(self) -> list[_ResidualBlock]:
        """Every residual block, stage after stage."""
        return [b for name in self._stage_names() for b in getattr(self, name)]

    def _stem(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The stem's modules from ``start`` on: conv, BN, ReLU (, max-pool)."""
        for m in self._stem_modules()[start:]:
            x = m(x)
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> the last stage's feature maps (before pooling)."""
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        mode = self.grad_checkpointing
        if mode is None:
            x = self._stem(x)
        elif mode == "bn_relu":  # keep the stem conv's output: no convolution runs twice
            x = checkpoint(self._stem, self.conv1(x), 1)
        else:  # keep only the images: the stem conv has 3 input channels, ~1% of the FLOPs
            x = checkpoint(self._stem, x)
        blocks = self.blocks()
        if mode == "block":
            n = self.checkpoint_every
            for i in range(0, len(blocks), n):
                x = F.relu(checkpoint(_segment, blocks[i:i + n], x), inplace=True)
            return x
        for block in blocks:
            x = block(x, mode)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Global average pooling (unless ``global_pool=''``), dropout, the classifier."""
        if self.global_pool:
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        if self.drop_rate:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x if pre_logits else self.fc(x)

    # -- feature levels (timm's forward_intermediates) -------------------------------------------
    def _stage_mode(self, index: int) -> tuple[str | None, int]:
        """The checkpoint mode and blocks per region of stage ``index`` for the active mode."""
        mode = self.grad_checkpointing
        if mode == "tapered":
            return (("block", 2), ("bn_relu", 1))[index] if index < 2 else (None, 1)
        return mode, (self.checkpoint_every if mode == "block" else 1)

    def _run_stage(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``index``'s blocks in the active mode (``block`` regions end at the stage)."""
        blocks = list(getattr(self, self._stage_names()[index]))
        mode, every = self._stage_mode(index)
        if mode != "block":
            for block in blocks:
                x = block(x, mode)
            return x
        for i in range(0, len(blocks), every):
            x = F.relu(checkpoint(_segment, blocks[i:i + every], x), inplace=True)
        return x

    def _run_stem(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        """The stem's modules ``0..stop-1`` (conv, BN, ReLU), checkpointed as in forward."""
        modules = self._stem_modules()[:stop]
        mode = self.grad_checkpointing
        if mode is None:
            return self._run(modules, x)
        if mode == "bn_relu":
            return checkpoint(self._run, modules[1:], modules[0](x))
        return checkpoint(self._run, modules, x)

    @staticmethod
    def _run(modules: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        for m in modules:
            x = m(x)
        return x

    def feature_levels(self) -> list[Level]:
        """The stem's BN-ReLU output, then each stage's output (a max-pool before stage 1 on
        ImageNet): channels and reductions as timm's ResNet reports them."""
        names = self._stage_names()
        stem_chs = self.conv1.out_channels
        reduction = self.conv1.stride[0]
        levels = [Level(lambda x: self._run_stem(x, 3), stem_chs, reduction, "relu")]
        pool = self._stem_modules()[3:]
        for i, name in enumerate(names):
            first = getattr(self, name)[0]
            pooled = 2 if pool and not i else 1
            reduction *= first.conv1.stride[0] * first.conv2.stride[0] * pooled
            channels = getattr(self, name)[-1]._norms[-1].num_features

            def stage(x: torch.Tensor, i: int = i) -> torch.Tensor:
                return self._run_stage(i, pool[0](x) if pool and i == 0 else x)
            levels.append(Level(stage, channels, reduction, name))
        return levels

    def checkpoint_chain(self) -> list[nn.Module]:
        """The stem's modules (conv, BN-ReLU[, max-pool]) and then every residual block."""
        return chain_of([*self._stem_modules(), *self.blocks()])

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        raise NotImplementedError


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
        return self._tapered(checkpoint(self._stem, x))

    def _tapered(self, x: torch.Tensor) -> torch.Tensor:
        """The ``tapered`` mode (module docstring): stage 1 in regions of two whole blocks, stage
        2 with only BN-ReLUs recomputed, stage 3 plain. The stages have equal FLOPs and halving
        activation sizes, so recomputing where the bytes are buys the most per FLOP."""
        first, second, *rest = [list(getattr(self, name)) for name in self._stage_names()]
        for i in range(0, len(first), 2):
            x = F.relu(checkpoint(_segment, first[i:i + 2], x), inplace=True)
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
    return CifarResNet(depth=20, efficient=efficient, **kwargs)


@register_model
def resnet32(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-32 for CIFAR (n=5): 0.46M parameters (He et al. 2016, Table 6)."""
    return CifarResNet(depth=32, efficient=efficient, **kwargs)


@register_model
def resnet44(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-44 for CIFAR (n=7): 0.66M parameters (He et al. 2016, Table 6)."""
    return CifarResNet(depth=44, efficient=efficient, **kwargs)


@register_model
def resnet56(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-56 for CIFAR (n=9): 0.85M parameters (He et al. 2016, Table 6)."""
    return CifarResNet(depth=56, efficient=efficient, **kwargs)


@register_model
def resnet110(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-110 for CIFAR (n=18): 1.7M parameters (He et al. 2016, Table 6)."""
    return CifarResNet(depth=110, efficient=efficient, **kwargs)


@register_model
def resnet1202(efficient: bool | str = False, **kwargs: Any) -> CifarResNet:
    """ResNet-1202 for CIFAR (n=200): 19.4M parameters (He et al. 2016, Table 6)."""
    return CifarResNet(depth=1202, efficient=efficient, **kwargs)


# ------------------------------------------------------------------------------------------------
# ImageNet (He et al. 2016, Table 1): torchvision's layout, so its weights load strictly.
# ------------------------------------------------------------------------------------------------
@register_model
def resnet18(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-18 (BasicBlock, 2-2-2-2): 11.7M parameters; loads torchvision's weights."""
    return ResNet(BasicBlock, (2, 2, 2, 2), efficient=efficient, **kwargs)


@register_model
def resnet34(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-34 (BasicBlock, 3-4-6-3): 21.8M parameters; loads torchvision's weights."""
    return ResNet(BasicBlock, (3, 4, 6, 3), efficient=efficient, **kwargs)


@register_model
def resnet50(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-50 (Bottleneck, 3-4-6-3): 25.6M parameters; loads torchvision's weights."""
    return ResNet(Bottleneck, (3, 4, 6, 3), efficient=efficient, **kwargs)


@register_model
def resnet101(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-101 (Bottleneck, 3-4-23-3): 44.5M parameters; loads torchvision's weights."""
    return ResNet(Bottleneck, (3, 4, 23, 3), efficient=efficient, **kwargs)


@register_model
def resnet152(efficient: bool | str = False, **kwargs: Any) -> ResNet:
    """ResNet-152 (Bottleneck, 3-8-36-3): 60.2M parameters; loads torchvision's weights."""
    return ResNet(Bottleneck, (3, 8, 36, 3), efficient=efficient, **kwargs)
