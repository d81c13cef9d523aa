"""BatchNorm state after a step, compared with the plain model's: a recompute must not update
the running statistics or the batch counter a second time.

:func:`bn_state` takes the state; :func:`bn_difference` compares two; :func:`bn_count` reads
how many batches it has counted. The benchmarks' BatchNorm columns all come from these.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["STATS", "bn_state", "bn_difference", "bn_count"]

STATS = ("running_mean", "running_var", "num_batches_tracked")


def bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every normalisation layer's running statistics and batch counter, by name in
    ``model.state_dict()`` (empty: no such layer)."""
    return {k: t.detach().clone() for k, t in model.state_dict().items()
            if k.rsplit(".", 1)[-1] in STATS}


def bn_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
                  ) -> dict[str, float | int | None]:
    """The largest absolute difference of ``state`` from ``reference`` (two :func:`bn_state`
    results, matched by name): ``bn_stats_error`` over running means and variances,
    ``bn_count_error`` over batch counters; None where ``reference`` has none."""
    shared = [k for k in reference if k in state]
    stats = [(state[k] - reference[k]).abs().max().item() for k in shared
             if not k.endswith("num_batches_tracked")]
    counts = [int((state[k] - reference[k]).abs().max()) for k in shared
              if k.endswith("num_batches_tracked")]
    return {"bn_stats_error": max(stats) if stats else None,
            "bn_count_error": max(counts) if counts else None}


def bn_count(state: dict[str, torch.Tensor]) -> int:
    """The largest batch counter in ``state`` (a :func:`bn_state` result; 0: none)."""
    return max((int(t) for k, t in state.items() if k.endswith("num_batches_tracked")),
               default=0)
