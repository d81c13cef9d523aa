"""The zoo's one reversible coupling: a block's inputs rebuilt exactly from its outputs.

A reversible block splits the activations into two streams and couples them additively
(Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing
Activations", arXiv:1707.04585; the reversible ViT of Mangalam et al., CVPR 2022, and the
Reformer's layers use the same coupling)::

    y1 = x1 + F(x2)            x2 = y2 - G(y1)
    y2 = x2 + G(y1)            x1 = y1 - F(x2)

so backward can rebuild each block's inputs from its outputs instead of storing them, and the
activations a sequence of blocks keeps do not grow with its depth. Done in floating point the
inversion is not exact: ``(x1 + F(x2)) - F(x2) != x1`` after rounding, the rebuilt inputs drift
from the real ones block after block, and so do the gradients (which is why the public
implementations need gradient clipping at depth).

Here the streams are **fixed-point integers** (as Maclaurin et al. 2015 and Momentum ResNets,
Sander et al. 2021, make reversal exact): a stream is an integer tensor ``k`` holding the value
``k * 2**-frac_bits`` (:class:`Grid`). ``F`` and ``G`` run in floating point on the stream's float
view ``from_fixed(k)``; their outputs are put on the grid by ``to_fixed`` (multiply by
``2**frac_bits``, truncate toward zero) and added as integers. Integer addition is exact and
invertible, so ``x1 = y1 - to_fixed(F(x2))`` gives back ``x1`` bit for bit as long as ``F``
recomputes the same output, which it does: it runs on the same float view, replaying the
forward's random numbers and autocast state, with BatchNorm's running statistics left alone
(zoo.checkpoint's recompute guard, :mod:`zoo.checkpoint.recompute`).

Range and resolution (:func:`grid_for`): a stream is as wide as the float it stands for.

* float32 (and bfloat16/float16) streams are ``int32`` with 16 fractional bits: a step of
  ``2**-16`` (1.5e-5, absolute) and values below ``2**14`` (16384) in magnitude. The same 4
  bytes per value as float32, which is what keeps the reversible models' memory low (64-bit
  streams would cost 1.2x more activation memory on RevNet-110); an output of ``F`` or ``G`` is
  rounded to 1.5e-5, finer than bfloat16 or float16 for values above 4e-3 and 2e-2.
* float64 streams are ``int64`` with 32 fractional bits: a step of ``2**-32`` (2.3e-10) and
  values below ``2**30``.

The float view rounds the integer to the float dtype once (float32 holds it exactly below 256).
An input, a stream value or an ``F``/``G`` output that is not finite or reaches the limit makes
both outputs of the sequence NaN: below the limit no addition can overflow, and a diverging run
is seen (a non-finite loss) instead of wrapping around.

Gradients are straight-through: ``to_fixed`` and ``from_fixed`` count as the identity, so the
gradient is the usual RevNet gradient of ``y1 = x1 + F(x2), y2 = x2 + G(y1)``. The network with
``rebuild=False`` is *the same network*: the same integer forward, built from autograd
Functions and storing ``F``'s and ``G``'s activations as any network does; ``rebuild=True``
keeps only the last block's integer outputs and, in backward, rebuilds each block's inputs from
its outputs, recomputing ``G`` and then ``F`` once each. Both give the same outputs, parameter
and input gradients, BatchNorm buffers and dropout masks, bit for bit, in float32, float64 and
under autocast (tests/test_reversible.py): the gradient sums the rebuild forms (``a + b`` of
two contributions) are the ones autograd forms for the stored network, and float addition of
two numbers does not depend on their order.

Contract for a block (:class:`Coupling`, or any module with methods ``f`` and ``g``): ``f`` and
``g`` are deterministic given their input, the random numbers and the autocast state, use only
the block's own parameters (those of ``block.parameters()``), and return a tensor of their
input's shape. Extra arguments (an attention mask) are passed to both and must not require
grad.

How it runs: ``rebuild=True`` is one autograd Function per sequence whose backward calls
``torch.autograd.grad`` on each recomputed ``F`` and ``G`` (a nested backward: the rebuild needs
each block's input-gradient before it can rebuild the block below). The parameters enter that
Function as inputs and their gradients leave it as outputs, so they reach the outer graph once
per step (DistributedDataParallel's hooks fire once; a hook on a parameter fires once: the
recompute runs on detached aliases of the parameters). Under ``torch.no_grad()`` both settings
run the plain forward and keep nothing. Under ``torch.compile`` the rebuilding Function is left
to eager mode (a graph break: Dynamo cannot trace a backward that recomputes a forward and runs
the autograd engine on it), and the rest of the model compiles; ``rebuild=False`` traces fully.

What the rebuild keeps besides the streams, and no more: a block may name a cheap head of ``F``
and ``G`` (``f_parts``/``g_parts``: a normalisation), whose output is made again when backward
needs it instead of kept through the recompute's backward; a non-invertible ``lead`` unit
(:class:`LeadBlock`) keeps its first output and makes its inputs again from the streams of the
rebuilt sequence before it (:func:`join`/:func:`split` carry them across a model's stage
boundary), recomputing its four functions one at a time (its ``f_parts``/``g_parts`` heads made
again too). A recomputed function is the only holder of its input while it runs (it can let it
go once used), a stream takes a function's output off in place, and the first block's ``x1``,
which no gradient reads, is not rebuilt: its stream is let go before the block's ``F``."""
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

    Each block computes ``y1 = x1 + F(x2), y2 = x2 + G(y1)`` on fixed-point streams (module
    docstring). ``rebuild=True`` keeps only the last block's integer outputs and rebuilds every
    block's inputs in backward (activation memory independent of the number of blocks);
    ``rebuild=False`` is the same network storing its activations. Both give the same results
    bit for bit. ``args`` are passed to every ``f`` and ``g`` (an attention mask); they must not
    require grad. ``preserve_rng_state=False`` skips saving the RNG state before each ``f`` and
    ``g`` (only for blocks that draw no random numbers).

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
