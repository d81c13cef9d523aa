"""DenseNets for CIFAR and ImageNet, with memory-efficient (checkpointed) training.

A DenseNet (Huang et al. 2017, "Densely Connected Convolutional Networks", arXiv:1608.06993)
feeds every layer of a dense block the concatenation of all earlier feature maps of the block.
Done naively, each layer stores its own copy of that concatenation *and* of its BatchNorm-ReLU
output for backward, so activation memory grows quadratically with depth. Pleiss et al. 2017
("Memory-Efficient Implementation of DenseNets", arXiv:1707.06990) keep only the layers' new
feature maps and recompute the cheap concat-BN-ReLU during backward: memory linear in depth.

Checkpoint modes (``DenseNet.checkpoint_modes``; all give exactly the plain model's outputs,
gradients and BatchNorm statistics, and the same state_dict; each mode's peak and FLOPs beside
timm's, with the machine and the command: docs/benchmarks/models.md):

* ``"bottleneck"`` (recommended): each half of a dense layer (concat-BN-ReLU-conv1x1 and
  BN-ReLU-conv3x3) is checkpointed on its own. Backward recomputes the concatenation, BatchNorms
  and ReLUs and stops before each convolution (zoo.checkpoint, like torch's non-reentrant one,
  stops as soon as it has rebuilt every tensor backward needs, and a convolution saves its input
  before it runs), so no convolution runs twice: +0% FLOPs. Kept per layer: the bottleneck's
  output and the new maps; the concatenation and the BN-ReLU outputs are never stored.
* ``"layer"``: each dense layer is checkpointed whole; its 1x1 bottleneck convolution runs again
  in backward, and only the layers' new maps are kept: a lower peak for about a sixth more
  FLOPs.

In both modes the transitions (concat-BN-ReLU-conv1x1), the ImageNet stem's BN-ReLU-max-pool and
the final concat-BN-ReLU are checkpointed too, again without recomputing a convolution, so a
block's concatenated output is never stored either. Dropout stays outside the checkpoints, so
they draw no random number and save no RNG state for their recompute. In both modes the maps'
gradients are summed once per layer, through a stand-in for their concatenation
(:class:`~zoo.models.densenet_blocks.Features`), not once per map and layer: the same sums in the
same order, so under ``torch.compile`` a block's concatenation gradients are not all kept at
once.
Without bottleneck (DenseNet-40) a layer is concat-BN-ReLU-conv3x3 and both modes checkpoint
exactly that, again at +0% FLOPs.

The ImageNet models' submodules are named as torchvision's (``features.conv0``, ``features.
denseblock1.denselayer1.norm1``, ``features.transition1.conv``, ``features.norm5``,
``classifier``), so torchvision's state_dicts load with ``strict=True``. The CIFAR models use the
same names with the CIFAR stem (one 3x3 convolution) and three dense blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import CIFAR_MEAN, CIFAR_STD, IMAGENET_MEAN, IMAGENET_STD, NO_RNG, ZooModel, \
    chain_of, check_rate, check_size, classifier
from ._features import FeatureStages, Level
from ._registry import build_model, register_model
from .densenet_blocks import DenseBlock, DenseLayer, DenseLink, Features, Transition, _cat

__all__ = ["DenseLayer", "DenseBlock", "DenseLink", "Transition", "DenseNet"]


class DenseNet(FeatureStages, ZooModel):
    """DenseNet(-BC) with the ImageNet stem (7x7/2 conv, BN-ReLU, 3x3/2 max-pool) or the CIFAR
    stem (one 3x3 conv), dense blocks separated by transitions, then BN-ReLU, global average
    pooling and a linear classifier (Huang et al. 2017).

    Args:
        growth_rate: ``k``, channels each dense layer adds.
        block_config: layers per dense block.
        num_init_features: channels of the stem's convolution.
        bn_size: bottleneck width in multiples of ``k`` (DenseNet-B); ``None``: no bottleneck.
        compression: transitions keep ``int(compression * channels)`` channels (DenseNet-C: 0.5).
        drop_rate: dropout after each dense layer (the paper uses 0.2 without data augmentation).
        num_classes: classifier outputs.
        stem: ``"imagenet"`` or ``"cifar"``.
        efficient: checkpointing: ``False``, ``True`` (``"bottleneck"``) or a mode name.
        in_chans: input channels (3 for RGB).
        global_pool: ``"avg"`` or ``""`` (no pooling: with ``num_classes=0``, feature maps out).
    """

    checkpoint_modes = ("bottleneck", "layer")
    classifier_name, first_conv, pool_types = "classifier", "features.conv0", ("avg", "")

    def __init__(self, growth_rate: int = 32, block_config: Sequence[int] = (6, 12, 24, 16),
                 num_init_features: int = 64, bn_size: int | None = 4, compression: float = 0.5,
                 drop_rate: float = 0.0, num_classes: int = 1000,
                 stem: Literal["imagenet", "cifar"] = "imagenet",
                 efficient: bool | str = False, in_chans: int = 3,
                 global_pool: str = "avg") -> None:
        super().__init__()
        if isinstance(in_chans, bool) or not isinstance(in_chans, int) or in_chans < 1:
            raise ValueError(f"in_chans must be a positive int (3 for RGB), got {in_chans!r}")
        if global_pool not in self.pool_types:
            raise ValueError(f"global_pool must be 'avg' or '' (no pooling), got {global_pool!r}")
        self.in_chans, self.global_pool = in_chans, global_pool
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' (7x7/2 conv + max-pool, 224px inputs) or "
                             f"'cifar' (3x3 conv, 32px inputs), got {stem!r}")
        if not 0 < compression <= 1:
            raise ValueError(f"compression must be in (0, 1] (DenseNet-C uses 0.5), got {compression}")
        check_size(growth_rate, "growth_rate", "k, the channels each dense layer adds")
        check_size(num_init_features, "num_init_features", "the stem's channels")
        if bn_size is not None:
            check_size(bn_size, "bn_size", "the bottleneck width in multiples of k; None: none")
        check_rate(drop_rate, "drop_rate")
        if not block_config or min(block_config) < 1:
            raise ValueError(f"block_config needs at least one block of at least one layer, "
                             f"got {tuple(block_config)}")
        self.stem = stem
        self.num_classes = num_classes
        if stem == "imagenet":
            layers = [("conv0", nn.Conv2d(in_chans, num_init_features, 7, stride=2, padding=3,
                                          bias=False)),
                      ("norm0", cp_BatchNorm2d(num_init_features)),
                      ("relu0", nn.ReLU(inplace=True)),
                      ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))]
        else:
            layers = [("conv0", nn.Conv2d(in_chans, num_init_features, 3, padding=1, bias=False))]
        self.features = nn.Sequential(OrderedDict(layers))
        channels = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(
                num_layers, channels, growth_rate, bn_size, drop_rate))
            channels += num_layers * growth_rate
            if i != len(block_config) - 1:
                out = int(channels * compression)
                self.features.add_module(f"transition{i + 1}", Transition(channels, out))
                channels = out
        self.features.add_module("norm5", cp_BatchNorm2d(channels))
        self.num_features = channels
        self.classifier = classifier(channels, num_classes)

        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        self.set_grad_checkpointing(efficient)

    # -- stages ----------------------------------------------------------------------------------
    def _stem_tail(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features
        return f.pool0(f.relu0(f.norm0(x)))

    def _final(self, joined: torch.Tensor | None, *features: torch.Tensor) -> torch.Tensor:
        return F.relu(self.features.norm5(_cat(features, joined)), inplace=True)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> BN-ReLU'd feature maps of the last block (before pooling)."""
        if self.checkpoint_plan is not None:
            return F.relu(self.run_chain(self.checkpoint_chain(), x), inplace=True)
        mode = self.grad_checkpointing
        f = self.features
        x = f.conv0(x)
        if self.stem == "imagenet":
            x = self._stem_tail(x) if mode is None else checkpoint(self._stem_tail, x, **NO_RNG)
        features = Features.of(x, None)
        for name, module in f.named_children():
            if isinstance(module, DenseBlock):
                features = module.run(features, mode)
            elif isinstance(module, Transition):
                features = Features.of(module(list(features), mode, features.joined), None)
        if mode is None:
            return self._final(None, *features)
        return checkpoint(self._final, features.joined, *features, **NO_RNG)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Global average pooling (unless ``global_pool=''``), then the classifier."""
        if self.global_pool:
            x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return x if pre_logits else self.classifier(x)

    # -- feature levels (timm's forward_intermediates) -------------------------------------------
    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm5 and ReLU: what forward_features applies to the last block's output."""
        if self.grad_checkpointing is None:
            return self._final(None, x)
        return checkpoint(self._final, None, x, **NO_RNG)

    def _stem_level(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features
        x = f.conv0(x)
        if self.stem == "cifar":
            return x
        mode = self.grad_checkpointing
        stem = lambda t: f.relu0(f.norm0(t))  # noqa: E731
        return stem(x) if mode is None else checkpoint(stem, x, **NO_RNG)

    def feature_levels(self) -> list[Level]:
        """The stem's output (BN-ReLU'd on ImageNet), then each dense block's concatenated
        output, the transition before it and the max-pool before the first one included."""
        f, mode = self.features, self.grad_checkpointing
        conv0 = f.conv0
        reduction = conv0.stride[0]
        levels = [Level(self._stem_level, conv0.out_channels, reduction,
                        "features.conv0" if self.stem == "cifar" else "features.relu0")]
        children = dict(f.named_children())
        blocks = [n for n, m in children.items() if isinstance(m, DenseBlock)]
        for i, name in enumerate(blocks):
            before = children.get(f"transition{i}") if i else children.get("pool0")
            if i or before is not None:
                reduction *= 2
            block = children[name]
            channels = block[f"denselayer{len(block)}"].conv1.in_channels + self._growth(block)

            def stage(x: torch.Tensor, block: DenseBlock = block, before=before) -> torch.Tensor:
                if isinstance(before, Transition):
                    x = before(x, mode)
                elif before is not None:
                    x = before(x)
                features = block.run(x, mode)
                return _cat(features, features.joined)
            levels.append(Level(stage, channels, reduction, f"features.{name}"))
        return levels

    @staticmethod
    def _growth(block: DenseBlock) -> int:
        last = block[f"denselayer{len(block)}"]
        return (last.conv2 if last.bottleneck else last.conv1).out_channels

    def checkpoint_chain(self) -> list[nn.Module]:
        """``features``' children (the stem's layers, transitions, ``norm5``) with each dense block
        unrolled into its layers as :class:`DenseLink` s, so a plan can cut between layers."""
        chain: list[nn.Module] = []
        for name, module in self.features.named_children():
            if isinstance(module, DenseBlock):
                chain += [DenseLink(layer, f"{name}.{key}") for key, layer in module.items()]
            else:
                chain.append(module)
        return chain_of(chain)

    def chain_draws_random_numbers(self) -> bool:
        """Only a dense layer's dropout draws (in train mode, at a positive rate). Asked once
        per planned forward: the dense blocks' layers are read, not every module."""
        return self.training and any(layer.drop_rate > 0 for block in self.features.children()
                                     if isinstance(block, DenseBlock) for layer in block.values())

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random images; ``size`` defaults to 32 (CIFAR) or 64 (ImageNet models: any side >= 32
        works; 64 keeps CPU tests small, pass 224 for the native resolution)."""
        if size is None:
            size = 32 if self.stem == "cifar" else 64
        device = self.features.conv0.weight.device
        return torch.randn(batch_size, self.in_chans, size, size, device=device)

    def data_cfg(self) -> dict:
        """ImageNet models: 224 px, torchvision's normalisation; CIFAR ones: 32 px."""
        if self.stem == "cifar":
            return dict(input_size=(self.in_chans, 32, 32), pool_size=(8, 8), mean=CIFAR_MEAN,
                        std=CIFAR_STD, interpolation="bilinear", crop_pct=1.0,
                        crop_mode="center")
        return dict(input_size=(self.in_chans, 224, 224), pool_size=(7, 7), mean=IMAGENET_MEAN,
                    std=IMAGENET_STD, interpolation="bilinear", crop_pct=0.875,
                    crop_mode="center")


# ------------------------------------------------------------------------------------------------
# CIFAR (Huang et al. 2017, Table 2): 3 dense blocks, CIFAR stem, 10 classes by default.
# ------------------------------------------------------------------------------------------------
def _cifar_bc(depth: int, growth_rate: int) -> dict:
    """DenseNet-BC's architecture arguments for CIFAR: (depth - 4) / 6 bottleneck layers a block,
    a stem of 2k channels, compression 0.5 (Huang et al. 2017, section 3)."""
    return dict(growth_rate=growth_rate, block_config=((depth - 4) // 6,) * 3,
                num_init_features=2 * growth_rate, bn_size=4, compression=0.5, stem="cifar",
                num_classes=10)


@register_model
def densenet40(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet (L=40, k=12) for CIFAR: 3 blocks of 12 BN-ReLU-conv3x3 layers, no bottleneck, no
    compression; 1.0M parameters (Huang et al. 2017, Table 2)."""
    return build_model(DenseNet, dict(growth_rate=12, block_config=(12, 12, 12),
                                      num_init_features=16, bn_size=None, compression=1.0,
                                      stem="cifar", num_classes=10), efficient=efficient, **kwargs)


@register_model
def densenet_bc_100(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-BC (L=100, k=12) for CIFAR: 0.8M parameters (Huang et al. 2017, Table 2)."""
    return build_model(DenseNet, _cifar_bc(100, 12), efficient=efficient, **kwargs)


@register_model
def densenet_bc_190(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-BC (L=190, k=40) for CIFAR: 25.6M parameters (Huang et al. 2017, Table 2)."""
    return build_model(DenseNet, _cifar_bc(190, 40), efficient=efficient, **kwargs)


@register_model
def densenet_bc_250(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-BC (L=250, k=24) for CIFAR: 15.3M parameters (Huang et al. 2017, Table 2)."""
    return build_model(DenseNet, _cifar_bc(250, 24), efficient=efficient, **kwargs)


# ------------------------------------------------------------------------------------------------
# ImageNet (Huang et al. 2017, Table 1): torchvision's layout, so its weights load strictly.
# ------------------------------------------------------------------------------------------------
@register_model
def densenet121(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-121 (k=32, blocks 6-12-24-16): 8.0M parameters; loads torchvision's weights."""
    return build_model(DenseNet, dict(growth_rate=32, block_config=(6, 12, 24, 16),
                                      num_init_features=64), efficient=efficient, **kwargs)


@register_model
def densenet161(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-161 (k=48, blocks 6-12-36-24, 96 stem channels): 28.7M parameters."""
    return build_model(DenseNet, dict(growth_rate=48, block_config=(6, 12, 36, 24),
                                      num_init_features=96), efficient=efficient, **kwargs)


@register_model
def densenet169(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-169 (k=32, blocks 6-12-32-32): 14.1M parameters; loads torchvision's weights."""
    return build_model(DenseNet, dict(growth_rate=32, block_config=(6, 12, 32, 32),
                                      num_init_features=64), efficient=efficient, **kwargs)


@register_model
def densenet201(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-201 (k=32, blocks 6-12-48-32): 20.0M parameters; loads torchvision's weights."""
    return build_model(DenseNet, dict(growth_rate=32, block_config=(6, 12, 48, 32),
                                      num_init_features=64), efficient=efficient, **kwargs)


@register_model
def densenet264(efficient: bool | str = False, **kwargs) -> DenseNet:
    """DenseNet-264 (k=32, blocks 6-12-64-48; Huang et al. 2017, Table 1): 33.3M parameters;
    no torchvision twin."""
    return build_model(DenseNet, dict(growth_rate=32, block_config=(6, 12, 64, 48),
                                      num_init_features=64), efficient=efficient, **kwargs)
