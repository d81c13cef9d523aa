"""The CIFAR-10 CNN of Spell's checkpointing post, checkpointed with its dropout and BatchNorm
left where they belong.

Spell's blog post "Training larger-than-memory PyTorch models using gradient checkpointing"
trains a small CIFAR-10 CNN with ``torch.utils.checkpoint``: two blocks of
conv3x3-ReLU-conv3x3-ReLU-max-pool (32 and 64, then 64 and 64 channels) each followed by dropout
0.25, then flatten, Linear(4096, 512)-ReLU, dropout 0.5 and Linear(512, 10). To checkpoint it the
post had to (1) move dropout, and BatchNorm "another example", *out* of the checkpointed blocks,
because a recompute would draw other random numbers and update the statistics twice, and (2)
leave the first block unchecked, because reentrant checkpoint gives it no gradient when the input
images do not require grad.

With ``zoo.checkpoint`` neither workaround is needed: the recompute replays the forward's random
numbers, BatchNorm statistics update once, and parameters get their gradients whatever the inputs.
So here each block is conv-BN-ReLU-conv-BN-ReLU-max-pool-dropout, *with* its dropout and
BatchNorm inside, and every block (the first one too) is checkpointed. ``batch_norm=False`` gives
the post's exact layers (biased convolutions, no BatchNorm).

Checkpoint modes (all give exactly the plain model's outputs, gradients and BatchNorm statistics
in train mode, dropout active, and the same state_dict; each mode's peak and FLOPs, with the
machine and the command: docs/benchmarks/models.md).

* ``"halves"`` (recommended): each block is checkpointed in two halves meeting at conv2's output
  (as the ResNets' mode of that name): conv1-BN-ReLU is rerun, conv2 is not (the recompute stops
  before it), then BN-ReLU-max-pool-dropout is rerun.
* ``"block"``: each block is checkpointed whole; only block inputs are kept, both convolutions run
  again: with two blocks, rebuilding a whole block at once costs almost what it saved.
* ``"bn_relu"``: every convolution's output is kept and none runs again; BN-ReLU, max-pool and
  dropout are recomputed: no extra FLOPs.
* ``"nested"`` (the lowest peak): conv1-BN-ReLU-conv2-BN is one region, with conv1-BN-ReLU-conv2
  a region inside it, and only the ReLU's output after it is kept (the max pool saves it
  anyway). The block's backward runs the pool's and the ReLU's backward first, then makes
  conv2's output again for BatchNorm (conv1 and conv2 rerun), then conv1's path for conv2 (conv1
  runs a third time): three full-size maps are alive at once where the other modes hold four,
  for the most extra FLOPs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import checkpoint
from ..nn import cp_BatchNorm2d
from ._base import CIFAR_MEAN, CIFAR_STD, ZooModel, classifier
from ._features import FeatureStages, Level
from ._registry import build_model, register_model

__all__ = ["ConvBlock", "CifarCNN"]


class ConvBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN-ReLU-max-pool(2)-dropout: one of the post's two conv blocks."""

    def __init__(self, in_channels: int, mid_channels: int, out_channels: int,
                 drop_rate: float = 0.25, batch_norm: bool = True) -> None:
        super().__init__()
        norm = cp_BatchNorm2d if batch_norm else (lambda channels: nn.Identity())
        self.conv1 = nn.Conv2d(in_channels, mid_channels, 3, padding=1, bias=not batch_norm)
        self.bn1 = norm(mid_channels)
        self.conv2 = nn.Conv2d(mid_channels, out_channels, 3, padding=1, bias=not batch_norm)
        self.bn2 = norm(out_channels)
        self.pool = nn.MaxPool2d(kernel_size=2)
        self.dropout = nn.Dropout(drop_rate)

    def _norm_relu_conv2(self, c1: torch.Tensor) -> torch.Tensor:
        return self.conv2(F.relu(self.bn1(c1)))

    def _conv1_to_conv2(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm_relu_conv2(self.conv1(x))

    def _tail(self, c2: torch.Tensor) -> torch.Tensor:
        """BN-ReLU-max-pool-dropout after the second convolution."""
        return self.dropout(self.pool(F.relu(self.bn2(c2))))

    def _front_nested(self, x: torch.Tensor) -> torch.Tensor:
        """conv1-BN-ReLU-conv2 in a region of its own, then BN2: the ``"nested"`` mode's region."""
        return self.bn2(checkpoint(self._conv1_to_conv2, x))

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return self._tail(self._conv1_to_conv2(x))

    def forward(self, x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """The block on ``x``; ``mode``: ``None`` (plain) or a mode (module docstring)."""
        if mode is None:
            return self._plain(x)
        if mode == "block":
            return checkpoint(self._plain, x)
        if mode == "halves":  # backward reruns conv1-BN-ReLU and stops before conv2 runs
            return checkpoint(self._tail, checkpoint(self._conv1_to_conv2, x))
        if mode == "nested":  # ReLU output kept; conv1 ... BN2 rebuilt, conv1 ... conv2 inside
            return self.dropout(self.pool(F.relu(checkpoint(self._front_nested, x))))
        if mode == "bn_relu":  # backward recomputes BN-ReLU and stops before conv2 runs
            c2 = checkpoint(self._norm_relu_conv2, self.conv1(x))
            return checkpoint(self._tail, c2)
        raise ValueError(f"unknown CifarCNN checkpoint mode {mode!r}; expected None, 'halves', "
                         f"'block', 'bn_relu' or 'nested'")


class CifarCNN(FeatureStages, ZooModel):
    """The CIFAR-10 CNN of Spell's checkpointing post: two conv blocks (3->32->64, 64->64->64,
    each halving the image), then Linear(64 * (size/4)^2, 512)-ReLU, dropout 0.5 and a linear
    classifier.

    The submodules keep the post's names (``cnn_block_1``, ``cnn_block_2``, ``linearize``,
    ``dropout_3``, ``out``); ``num_features`` is 512, the width of the classifier's input.

    Args:
        num_classes: classifier outputs.
        image_size: side of the square input images (32 for CIFAR); fixes the first Linear's size.
        drop_rate: dropout after each conv block (the post's 0.25); the head's is twice that.
        batch_norm: BatchNorm after each convolution (default); ``False`` is the post's model.
        efficient: checkpointing: ``False``, ``True`` (``"halves"``) or a mode name.
        in_chans: input channels (3 for RGB).
    """

    checkpoint_modes = ("halves", "block", "bn_relu", "nested")
    classifier_name, first_conv = "out", "cnn_block_1.conv1"

    def __init__(self, num_classes: int = 10, image_size: int = 32, drop_rate: float = 0.25,
                 batch_norm: bool = True, efficient: bool | str = False,
                 in_chans: int = 3) -> None:
        super().__init__()
        if isinstance(in_chans, bool) or not isinstance(in_chans, int) or in_chans < 1:
            raise ValueError(f"in_chans must be a positive int (3 for RGB), got {in_chans!r}")
        self.in_chans = in_chans
        if image_size < 4 or image_size % 4:
            raise ValueError(f"image_size must be a multiple of 4 (two 2x2 max-pools), "
                             f"got {image_size}")
        if not 0 <= drop_rate < 1:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        self.num_classes = num_classes
        self.image_size = image_size
        self.num_features = 512
        self.cnn_block_1 = ConvBlock(in_chans, 32, 64, drop_rate, batch_norm)
        self.cnn_block_2 = ConvBlock(64, 64, 64, drop_rate, batch_norm)
        self.linearize = nn.Sequential(nn.Linear(64 * (image_size // 4) ** 2, 512), nn.ReLU())
        self.dropout_3 = nn.Dropout(2 * drop_rate)
        self.out = classifier(512, num_classes)
        self.set_grad_checkpointing(efficient)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> the second block's feature maps (64 channels at a quarter of the side)."""
        if self.checkpoint_plan is not None:
            return self.run_chain(self.checkpoint_chain(), x)
        mode = self.grad_checkpointing
        return self.cnn_block_2(self.cnn_block_1(x, mode), mode)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.dropout_3(self.linearize(torch.flatten(x, 1)))
        return x if pre_logits else self.out(x)

    def checkpoint_chain(self) -> list[nn.Module]:
        """The two conv blocks."""
        return [self.cnn_block_1, self.cnn_block_2]

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """Random images of ``image_size`` (the head's Linear fixes it; ``size`` must match)."""
        if size is not None and size != self.image_size:
            raise ValueError(f"this CifarCNN was built for {self.image_size}px images (its first "
                             f"Linear layer fixes the size), got size={size}; build it with "
                             f"image_size={size}")
        side = self.image_size
        device = self.cnn_block_1.conv1.weight.device
        return torch.randn(batch_size, self.in_chans, side, side, device=device)

    def feature_levels(self) -> list[Level]:
        """Each conv block's output (64 channels; a half, then a quarter of the side)."""
        mode = self.grad_checkpointing
        return [Level(lambda x: self.cnn_block_1(x, mode), 64, 2, "cnn_block_1"),
                Level(lambda x: self.cnn_block_2(x, mode), 64, 4, "cnn_block_2")]

    def data_cfg(self) -> dict:
        """CIFAR-10's statistics at ``image_size`` (the head's Linear fixes it)."""
        side = self.image_size
        return dict(input_size=(self.in_chans, side, side), pool_size=(side // 4, side // 4),
                    mean=CIFAR_MEAN, std=CIFAR_STD, interpolation="bilinear", crop_pct=1.0,
                    crop_mode="center")


@register_model
def cifar_cnn(efficient: bool | str = False, **kwargs) -> CifarCNN:
    """The CIFAR-10 CNN of Spell's checkpointing post with BatchNorm, dropout kept inside the
    checkpointed blocks."""
    return build_model(CifarCNN, dict(num_classes=10, image_size=32), efficient=efficient, **kwargs)
