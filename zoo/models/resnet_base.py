"""What zoo/models/resnet.py's ImageNet and CIFAR ResNets share (He et al. 2016, "Deep Residual
Learning for Image Recognition", arXiv:1512.03385): the constructor's checks and initialisation,
forward in every checkpoint mode (described in :mod:`zoo.models.resnet`), the head, the feature
levels and the planner's chain."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ._base import NO_RNG, ZooModel, chain_of
from ._features import FeatureStages, Level
from .resnet_blocks import MODES, _ResidualBlock, _segment

__all__: list[str] = []


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
            x = checkpoint(self._stem, self.conv1(x), 1, **NO_RNG)
        else:  # keep only the images: the stem conv has 3 input channels, ~1% of the FLOPs
            x = checkpoint(self._stem, x, **NO_RNG)
        blocks = self.blocks()
        if mode == "block":
            n = self.checkpoint_every
            for i in range(0, len(blocks), n):
                x = F.relu(checkpoint(_segment, blocks[i:i + n], x, **NO_RNG), inplace=True)
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
            x = F.relu(checkpoint(_segment, blocks[i:i + every], x, **NO_RNG), inplace=True)
        return x

    def _run_stem(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        """The stem's modules ``0..stop-1`` (conv, BN, ReLU), checkpointed as in forward."""
        modules = self._stem_modules()[:stop]
        mode = self.grad_checkpointing
        if mode is None:
            return self._run(modules, x)
        if mode == "bn_relu":
            return checkpoint(self._run, modules[1:], modules[0](x), **NO_RNG)
        return checkpoint(self._run, modules, x, **NO_RNG)

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

    def chain_draws_random_numbers(self) -> bool:
        """The stem and residual blocks draw no random number (dropout is in the head)."""
        return False

    def checkpoint_chain(self) -> list[nn.Module]:
        """The stem's modules (conv, BN-ReLU[, max-pool]) and then every residual block."""
        return chain_of([*self._stem_modules(), *self.blocks()])

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        raise NotImplementedError
