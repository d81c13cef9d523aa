"""Op-level choices: a chain block checkpointed with a *save set*, the outputs of the named ops
kept and everything else inside recomputed (``zoo.checkpoint(..., save_ops=...)``: selective
recompute, Korthikanti et al. 2022). The planner offers it per block, next to the model's own
block modes, and picks it where it pays.

``ops:matmul`` keeps what is dear to recompute, the outputs of matrix products, convolutions
and fused attention, and recomputes the cheap rest (normalisations, activations, dropout with
the forward's random numbers, residual sums, concatenations): no FLOP runs twice and the
block keeps what a DenseNet layer's BatchNorm-ReLU, a transformer's LayerNorm and GELU or a
ResNet's BatchNorm would otherwise hold. ``torch.compile``'s memory budget makes this choice op
by op over the whole graph; here it is made block by block, the blocks chosen by the search.

The block is checkpointed through its own module (``zoo.blocks.checkpoint_module``: the
module's class swapped, state_dict unchanged): a chain block that is one of the model's modules,
or the one module it runs (a DenseNet link's layer). A chain block with none (an embedding
step) is not offered the choice.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..blocks import checkpoint_module, is_checkpointed

__all__ = ["SAVE_SETS", "is_save_set", "targets", "save_set_applied", "apply_save_sets"]

_aten = torch.ops.aten
_ATTENTION = [getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(_aten, name)]

SAVE_SETS: dict[str, tuple] = {
    "ops:matmul": (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                   _aten.convolution.default, *_ATTENTION),
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


def targets(model: nn.Module, chain: Sequence[Any]) -> list[nn.Module | None]:
    """Per chain block, the model's module that a save set checkpoints (None: no choice)."""
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
    found = [m for m in targets(model, chain) if m is not None]
    with _put_back(found):
        for m in found:
            checkpoint_module(m, True, save_ops=SAVE_SETS[name])
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
        if m is None:
            continue
        if is_save_set(mode):
            checkpoint_module(m, True, save_ops=SAVE_SETS[mode])
        elif is_checkpointed(m) and "save_ops" in m._zoo_checkpoint_options:
            checkpoint_module(m, False)
    rest = [None if is_save_set(mode) else mode for mode in modes]
    return rest if any(rest) else None
