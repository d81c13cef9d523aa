"""Checkpoint-safe layers: BatchNorm that updates its running statistics once per step.

``zoo.checkpoint`` already keeps plain ``nn.BatchNorm*d`` exact: while it recomputes, global
module hooks run each normalisation layer with momentum 0 and take back its ``num_batches_tracked``
increment. The ``cp_`` layers do the same inside their own forward, which adds one thing:
**they are exact under anyone's checkpoint**, not only the zoo's. They recognise a recompute by
``zoo.is_recomputing()`` *or* by running inside an autograd backward pass, which is where both
reentrant and non-reentrant ``torch.utils.checkpoint`` (and everything built on it: timm's
``set_grad_checkpointing``, torchvision's ``memory_efficient``, Hugging Face's
``gradient_checkpointing_enable``) recompute. A plain BatchNorm under those wrappers counts every
batch twice (pytorch/pytorch#96136). Under the zoo's checkpoint they cost the same as plain
BatchNorm (one in-place kernel per layer and recompute; see docs/BENCHMARKS.md).

The idea and the name come from the multi-GPU checkpoint of seed 003 (``cp_BatchNorm2d``); the
state_dict is exactly ``nn.BatchNorm2d``'s, so checkpoints load either way.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checkpoint import is_recomputing, state_bookkeeping

__all__ = ["cp_BatchNorm1d", "cp_BatchNorm2d", "cp_BatchNorm3d", "cp_SyncBatchNorm",
           "convert_batchnorm", "in_recompute"]


def in_recompute() -> bool:
    """True while a checkpointed region is being recomputed, by the zoo's checkpoint or torch's.

    A train-mode forward that runs inside an autograd backward pass is a recompute: that is where
    ``torch.utils.checkpoint`` (reentrant and not) replays the region. While ``torch.compile``
    traces, it is False and reads no autograd state (which would break the graph): the compiled
    forward applies the statistics update once, and AOTAutograd's recompute never replays it.
    """
    if torch.compiler.is_compiling():
        return False
    return is_recomputing() or torch._C._current_graph_task_id() != -1


class _RecomputeSafeNorm:
    """Mixin for ``_BatchNorm`` subclasses: a recomputed forward leaves the statistics as they are.

    During a recompute the layer runs its ordinary train-mode forward (batch statistics, the same
    saved tensors as the first forward, which non-reentrant checkpoint verifies) with momentum 0:
    the update ``(1 - 0) * running + 0 * batch`` writes back exactly the old value; the
    ``num_batches_tracked`` increment is taken back afterwards. Two tiny in-place kernels, no copies.
    """

    recompute_safe = True  # tells zoo.checkpoint's guard that this layer needs no snapshot

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats and in_recompute()):
            return super().forward(input)
        self._check_input_dim(input)  # fail before touching any state
        momentum = self.momentum
        self.momentum = 0.0
        try:
            return super().forward(input)
        finally:
            self.momentum = momentum
            if self.num_batches_tracked is not None:
                with torch.no_grad(), state_bookkeeping():
                    self.num_batches_tracked.sub_(1)


class cp_BatchNorm1d(_RecomputeSafeNorm, nn.BatchNorm1d):
    """Drop-in ``nn.BatchNorm1d`` whose statistics update once per step under any checkpoint."""


class cp_BatchNorm2d(_RecomputeSafeNorm, nn.BatchNorm2d):
    """Drop-in ``nn.BatchNorm2d`` whose statistics update once per step under any checkpoint."""


class cp_BatchNorm3d(_RecomputeSafeNorm, nn.BatchNorm3d):
    """Drop-in ``nn.BatchNorm3d`` whose statistics update once per step under any checkpoint."""


class cp_SyncBatchNorm(_RecomputeSafeNorm, nn.SyncBatchNorm):
    """Drop-in ``nn.SyncBatchNorm`` whose statistics update once per step under any checkpoint."""


_SWAPS: dict[type, type] = {
    nn.BatchNorm1d: cp_BatchNorm1d,
    nn.BatchNorm2d: cp_BatchNorm2d,
    nn.BatchNorm3d: cp_BatchNorm3d,
    nn.SyncBatchNorm: cp_SyncBatchNorm,
}


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` in ``module`` into its ``cp_`` twin.

    The swap is in place and changes only the class: parameters, buffers, hooks and object identity
    are kept, so an optimizer built before the call still holds the right tensors and the
    state_dict is unchanged. Subclasses of BatchNorm other than these four are left alone (their
    forward may differ). Returns ``module`` (converted itself if it is a BatchNorm).
    """
    for m in module.modules():
        swap: Any = _SWAPS.get(type(m))
        if swap is not None:
            m.__class__ = swap
    return module
