"""The state one rebuilding sequence carries from its forward to its backward (:class:`_Run`),
shared by the rebuild (:mod:`.rebuild`) and its lead unit (:mod:`.lead`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._torch import tensor_version as _version
from ..checkpoint.recompute import ForwardState
from .coupling import LeadBlock, ReversibleBlock
from .grid import Grid
from .sources import Source


class _Run:
    """What the rebuilding Function needs besides tensors: the blocks, the extra arguments, each
    block's trainable parameters (indices into the Function's parameter inputs), the versions
    of every parameter and tensor argument, and the RNG / autocast state each ``f`` and ``g``
    ran under in the forward."""

    def __init__(self, blocks: Sequence[ReversibleBlock], args: tuple, grid: Grid,
                 preserve_rng: bool, lead: LeadBlock | None = None):
        self.blocks, self.args, self.grid = list(blocks), args, grid
        self.preserve_rng, self.lead = preserve_rng, lead
        index: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        frozen: list[nn.Parameter] = []
        self.block_params: list[dict[int, list[str]]] = []  # parameter index -> its names
        for block in ([] if lead is None else [lead]) + self.blocks:
            names: dict[int, list[str]] = {}
            for name, p in block.named_parameters(remove_duplicate=False):
                if p.requires_grad:
                    if id(p) not in index:
                        index[id(p)] = len(self.params)
                        self.params.append(p)
                    names.setdefault(index[id(p)], []).append(name)
                else:
                    frozen.append(p)
            self.block_params.append(names)
        self.lead_params = self.block_params.pop(0) if lead is not None else {}
        # the versions of the parameters and the tensor arguments: backward recomputes with
        # them, so they must not change before it
        self.used = [*self.params, *frozen, *(a for a in args if isinstance(a, torch.Tensor))]
        self.versions = [_version(t) for t in self.used]
        self.lead_contexts: tuple[ForwardState, ...] | None = None  # f, shortcut1, g, shortcut2
        self.contexts: list[tuple[ForwardState, ForwardState]] = []
        # what the lead's backward needs: its first output, and its inputs' sources (of the
        # sequence before it) or the inputs themselves; let go as soon as used
        self.lead_kept: list[Any] = []
        self.out: tuple[Source, Source] | None = None  # the outputs' sources, for _rebuilt
        self.streams: list[torch.Tensor] | None = None  # the last block's, forward to backward
