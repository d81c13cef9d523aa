"""Op-level choices: a chain block checkpointed with a *save set*, the outputs of the named ops
kept and the rest recomputed (``zoo.checkpoint(..., save_ops=...)``: selective recompute,
Korthikanti et al. 2022), offered per block next to the model's own block modes.

``ops:matmul`` keeps the outputs of matrix products, convolutions and fused attention and
recomputes the cheap rest (normalisations, activations, dropout, residual sums, concatenations):
no FLOP runs twice. ``ops:matmul-last``, for blocks with two linear layers or more, keeps the
same but the last linear's output (it only feeds the residual sum), so the recompute stops
before that layer. torch.compile's memory budget makes this choice op by op over the whole
graph; here it is made block by block. The block is checkpointed through its own module
(``zoo.blocks.checkpoint_module``, state_dict unchanged); a chain block with none (an embedding
step) is not offered the choice."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ...blocks import checkpoint_module, is_checkpointed
from ...checkpoint.policies import MATMUL_OPS, AllBut

__all__ = ["SAVE_SETS", "SaveSet", "is_save_set", "targets", "save_set_applied",
           "apply_save_sets"]

@dataclasses.dataclass(frozen=True)
class SaveSet:
    """The ops whose outputs a block keeps (``ops``), and whether its last ``nn.Linear``'s
    output is left out of them (``spare_last``: offered only to blocks with two or more)."""

    ops: tuple
    spare_last: bool = False

    def offered(self, module: nn.Module) -> bool:
        """Sparing the last linear is free where its output only feeds a residual sum: not in
        a post-norm block (``pre_norm=False``), whose norm's backward needs it."""
        return not self.spare_last or (len(_linears(module)) >= 2
                                       and getattr(module, "pre_norm", True) is not False)

    def save_ops(self, module: nn.Module) -> tuple | AllBut:
        """What ``zoo.checkpoint(..., save_ops=)`` takes for ``module`` checkpointed with it."""
        return AllBut(self.ops, _linears(module)[-1]) if self.spare_last else self.ops


def _linears(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


SAVE_SETS: dict[str, SaveSet] = {
    "ops:matmul": SaveSet(MATMUL_OPS),
    "ops:matmul-last": SaveSet(MATMUL_OPS, spare_last=True),
}


def is_save_set(name: str | None) -> bool:
    return isinstance(name, str) and name in SAVE_SETS


def _target(block: Any, own: set[int]) -> nn.Module | None:
    fn = block
    while isinstance(fn, partial):
        fn = fn.func
    spine = getattr(fn, "module", None)
    if isinstance(spine, nn.Module):  # a spine step
        return spine if id(spine) in own else None
    if not isinstance(fn, nn.Module):  # a bound method (an embedding step): no module to wrap
        return None
    if id(fn) in own:
        return fn
    # a wrapper made for the chain (DenseNet's link): the one module of the model it runs
    kids = [c for c in fn.children() if id(c) in own]
    return kids[0] if len(kids) == 1 and not list(fn.parameters(recurse=False)) else None


def targets(model: nn.Module, chain: Sequence[Any],
            name: str | None = None) -> list[nn.Module | None]:
    """Per chain block, the model's module that a save set (``name``: that one) checkpoints
    (None: no choice)."""
    own = {id(m) for m in model.modules()} - {id(model)}
    found = [_target(b, own) for b in chain]
    in_place = [getattr(getattr(b, "module", b), "inplace", False) is True for b in chain]
    for i in range(len(found)):  # a checkpoint must not see its input or output changed in
        if in_place[i] or (i + 1 < len(found) and in_place[i + 1]):  # place (an in-place ReLU)
            found[i] = None
    seen: set[int] = set()
    for i, m in enumerate(found):  # a module that runs in two blocks is not offered
        if m is not None and id(m) in seen:
            found[i] = None
        elif m is not None:
            seen.add(id(m))
    if name is not None:
        found = [m if m is not None and SAVE_SETS[name].offered(m) else None for m in found]
    return found


@contextlib.contextmanager
def _put_back(modules: Sequence[nn.Module]) -> Iterator[None]:
    """``modules``' checkpoints (on or off, with their options) as they are now, put back after."""
    before = {m: dict(m._zoo_checkpoint_options) if is_checkpointed(m) else None for m in modules}
    try:
        yield
    finally:
        for m, options in before.items():
            checkpoint_module(m, options is not None, **(options or {}))


@contextlib.contextmanager
def save_set_applied(model: nn.Module, chain: Sequence[Any], name: str) -> Iterator[None]:
    """Every chain block with a target checkpointed with save set ``name`` for the duration."""
    found = [m for m in targets(model, chain, name) if m is not None]
    with _put_back(found):
        for m in found:
            checkpoint_module(m, True, save_ops=SAVE_SETS[name].save_ops(m))
        yield


@contextlib.contextmanager
def save_sets_removed(model: nn.Module, chain: Sequence[Any]) -> Iterator[None]:
    """The chain's save-set checkpoints taken off for the duration, put back after."""
    found = [m for m in targets(model, chain) if m is not None and is_checkpointed(m)
             and "save_ops" in m._zoo_checkpoint_options]
    with _put_back(found):
        for m in found:
            checkpoint_module(m, False)
        yield


def apply_save_sets(model: nn.Module, chain: Sequence[Any],
                    block_modes: Sequence[str | None] | None) -> list[str | None] | None:
    """Checkpoint the blocks whose entry of ``block_modes`` is a save set (and no other target
    with a save set); returns the entries the model's own ``set_checkpoint_block_modes``
    takes (save sets as None), or None when there are none."""
    modes = list(block_modes) if block_modes is not None else [None] * len(chain)
    for m, mode in zip(targets(model, chain), modes):
        if m is not None and is_save_set(mode) and SAVE_SETS[mode].offered(m):
            checkpoint_module(m, True, save_ops=SAVE_SETS[mode].save_ops(m))
        elif m is not None and is_checkpointed(m) and "save_ops" in m._zoo_checkpoint_options:
            checkpoint_module(m, False)
    rest = [None if is_save_set(mode) else mode for mode in modes]
    return rest if any(rest) else None
