"""The zoo's one reversible coupling: a block's inputs rebuilt exactly from its outputs.

Blocks couple two streams, ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` (Gomez et al. 2017,
arXiv:1707.04585), held as fixed-point integers (:class:`Grid`) so that backward rebuilds each
block's inputs bit for bit (Maclaurin et al. 2015): ``rebuild=True`` trains exactly as the same
network storing its activations. Design (grid, range, gradients, what the rebuild keeps):
docs/api/reversible.md."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..checkpoint import checkpoint
from .coupling import Coupling, LeadBlock, ReversibleBlock
from .grid import Grid, from_fixed, grid_for, to_fixed
from .lead import _lead_steps
from .rebuild import _rebuilt
from .sources import join, split
from .stored import _stored

__all__ = ["Coupling", "ReversibleBlock", "LeadBlock", "Grid", "grid_for", "reversible_sequence",
           "to_fixed", "from_fixed", "join", "split"]


def reversible_sequence(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor,
                        *args: Any, rebuild: bool = True, preserve_rng_state: bool = True,
                        lead: LeadBlock | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run reversible ``blocks`` on the streams ``(x1, x2)`` and return ``(y1, y2)``.

    Each block computes ``y1 = x1 + F(x2), y2 = x2 + G(y1)`` on fixed-point streams
    (docs/api/reversible.md). ``rebuild=True`` keeps only the last block's integer outputs and
    rebuilds every block's inputs in backward (activation memory independent of the number of
    blocks); ``rebuild=False`` is the same network storing its activations. Both give the same
    results bit for bit, but for a weight used by two or more of the blocks' functions and by a
    module after the sequence (tied with the head): its gradient sums the same contributions
    grouped otherwise, so its last bits may differ (docs/api/reversible.md). ``args`` are
    passed to every ``f`` and ``g`` (an attention mask); they must not require grad.
    ``preserve_rng_state=False`` skips saving the RNG state before each ``f`` and ``g`` (only
    for blocks that draw no random numbers).

    ``lead``: a non-invertible unit run first, on floats (:class:`LeadBlock`: RevNet's
    downsampling unit). With ``rebuild=True`` its backward recomputes it from its inputs, one
    half at a time, keeping its first output; inputs that are the outputs of a rebuilt sequence
    before it (directly or as :func:`split` halves of their :func:`join`) are not kept but made
    again from that sequence's streams, which hold the same values.

    The outputs have the dtypes of the inputs (float views of the streams; an out-of-range
    value makes them NaN). Under ``torch.no_grad()`` nothing is kept either way.
    """
    blocks = list(blocks)
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError(f"reversible_sequence: the two streams must have one shape and dtype, "
                         f"got {tuple(x1.shape)} {x1.dtype} and {tuple(x2.shape)} {x2.dtype}; "
                         f"split one tensor in halves")
    grid = grid_for(x1.dtype)
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            raise ValueError("reversible_sequence: an extra argument requires grad, but only the "
                             "two streams and the blocks' parameters get gradients; detach it or "
                             "make it a parameter of a block")
    rebuilding = rebuild and torch.is_grad_enabled()
    if rebuilding and blocks:
        return _rebuilt(blocks, x1, x2, args, grid, preserve_rng_state, lead)
    if lead is not None and rebuilding:  # a lead alone: checkpointed
        x1, x2 = checkpoint(_run_lead, lead, x1, x2, preserve_rng_state=preserve_rng_state)
    elif lead is not None:
        x1, x2 = _run_lead(lead, x1, x2)
    return _stored(blocks, x1, x2, args, grid) if blocks else (x1, x2)


def _run_lead(lead: LeadBlock, x1: torch.Tensor, x2: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lead unit as the stored network runs it (the rebuild's forward runs the same)."""
    return _lead_steps(lambda name, x: getattr(lead, name)(x), x1, x2)
