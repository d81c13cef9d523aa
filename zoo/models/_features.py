"""Feature maps at several depths, timm's way: ``feature_info`` and ``forward_intermediates``.

Detection and segmentation heads (FPN, U-Net) read a backbone's maps at several reductions; timm
standardised how a model offers them, and the zoo's CNNs follow it so they drop into such code.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ._base import take_indices

__all__ = ["Level", "FeatureStages"]


@dataclass(frozen=True)
class Level:
    """One feature level: the stage that produces it from the previous level (the input for the
    first), its channels, its reduction of the input's side, and the module whose output it is."""

    stage: Callable[[torch.Tensor], torch.Tensor]
    num_chs: int
    reduction: int
    module: str


class FeatureStages:
    """Mixin for CNNs that list their feature levels in ``feature_levels()``: gives timm's
    ``feature_info`` and ``forward_intermediates``. The stages run in the model's active
    checkpoint mode, so extracting features for training stays as light as ``forward``."""

    def feature_levels(self) -> list[Level]:
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """What ``forward_features`` applies after the last level (identity unless overridden)."""
        return x

    @property
    def feature_info(self) -> list[dict]:
        """timm's feature_info: per level ``num_chs``, ``reduction`` and ``module``."""
        return [dict(num_chs=lv.num_chs, reduction=lv.reduction, module=lv.module)
                for lv in self.feature_levels()]

    def forward_intermediates(self, x: torch.Tensor, indices: int | Sequence[int] | None = None,
                              norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False
                              ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's ``forward_intermediates``: the feature maps of the levels ``indices`` picks
        (``None``: all; an int: the last n; a sequence: those), with ``forward_features``' output
        unless ``intermediates_only``. ``norm`` applies the final norm to the last level's map;
        ``stop_early`` stops after the deepest level asked for (the returned output is then that
        level's map). Only ``output_fmt="NCHW"`` exists for CNNs."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt must be 'NCHW' for {type(self).__name__} (a CNN), "
                             f"got {output_fmt!r}")
        levels = self.feature_levels()
        take = take_indices(len(levels), indices)
        stop = take[-1] if stop_early or intermediates_only else len(levels) - 1
        intermediates = []
        for i, level in enumerate(levels[:stop + 1]):
            x = level.stage(x)
            if i in take:
                last = i == len(levels) - 1
                intermediates.append(self.final_norm(x) if norm and last else x)
        if intermediates_only:
            return intermediates
        return (self.final_norm(x) if stop == len(levels) - 1 else x), intermediates
