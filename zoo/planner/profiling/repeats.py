"""Repeated units of a chain, profiled once: the runs after the first cover each kind of unit
three times, and the other units copy those figures.

A unit's figures depend only on the unit and on how its neighbours hold its input, so in a run
of identical units (ResNet-110: 51 of 56 units; BERT: twelve) the first and the next two stand
for all. :func:`repeats` finds such runs from a plain step's trace; :func:`expand` turns the
kept units' profile back into the whole chain's."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .chain_profile import ChainProfile

__all__ = ["runs", "repeats", "joined", "expand", "kept_blocks", "whole_block"]

PER_UNIT = ("saved", "keeps_input", "keeps_output", "fwd_rise", "fwd_rise_ckpt", "bwd_rise",
            "grads", "flops", "recompute_flops", "unit_inner_flops", "fwd_rise_stop",
            "bwd_rise_alone", "bwd_rise_region", "bwd_rise_recomputed",
            "bwd_rise_recomputed_alone", "opaque", "unit_step_flops")


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, v.requires_grad)
    return v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__qualname__


def signature(block: Callable) -> tuple | None:
    """What makes two chain blocks the same computation (None: cannot tell, never repeated)."""
    parts: list[Any] = []
    fn: Any = block
    while isinstance(fn, partial):
        parts.append(tuple(_value(a) for a in fn.args))
        parts.append(tuple(sorted((k, _value(v)) for k, v in fn.keywords.items())))
        fn = fn.func
    module = getattr(fn, "module", None)
    if not isinstance(module, nn.Module):
        module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return None
    params = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in module.parameters())
    buffers = tuple((tuple(b.shape), b.dtype) for b in module.buffers())
    return (type(module).__qualname__, getattr(fn, "__name__", ""), repr(module), params,
            buffers, module.training, *parts)


def runs(chain: Sequence[Callable], units: Sequence[tuple[int, int]],
         meta: dict[int, tuple]) -> list[tuple[int, int]]:
    """The chain's units as runs ``(first, stop)`` of consecutive identical units that keep
    their input's shape (a unit of no such run is a run of one)."""
    sigs = []
    for a, b in units:
        blocks = [signature(chain[j]) for j in range(a, b)]
        shape_kept = meta[a][0] == meta[b - 1][1]
        sigs.append((tuple(blocks), meta[a][0]) if shape_kept and None not in blocks else None)
    out, start = [], 0
    for u in range(1, len(units) + 1):
        if u < len(units) and sigs[u] is not None and sigs[u] == sigs[start]:
            continue
        out.append((start, u))
        start = u
    return out


def repeats(chain: Sequence[Callable], units: Sequence[tuple[int, int]],
            meta: dict[int, tuple]) -> list[int]:
    """For each unit, the unit whose figures it takes (itself when it is profiled): in a run of
    consecutive identical units that keep their input's shape, the first three stand for it."""
    rep = list(range(len(units)))
    for start, stop in runs(chain, units, meta):
        for k in range(start, stop):
            rep[k] = start + min(k - start, 2)
    return rep


def joined(chain: Sequence[Callable], units: Sequence[tuple[int, int]],
           meta: dict[int, tuple], most: int) -> list[tuple[int, int]]:
    """``units`` joined into at most ``most`` units (when the chain's runs allow it), each the
    same number ``g`` of consecutive units of one run (its last one shorter), ``g`` the least
    that does it: a ResNet-1202's 602 units as 100 of six blocks, three per stage shorter. The
    joined units of a run are identical again, so they are profiled once too."""
    spans = runs(chain, units, meta)
    width = 1
    while width < len(units) and sum(-(-(b - a) // width) for a, b in spans) > most:
        width += 1
    out = []
    for a, b in spans:
        for k in range(a, b, width):
            out.append((units[k][0], units[min(k + width, b) - 1][1]))
    return out


def kept_blocks(units: Sequence[tuple[int, int]], rep: Sequence[int]
                ) -> tuple[list[int], list[tuple[int, int]]]:
    """The blocks the runs after the first profile (positions in the chain) and the kept units
    as positions in that shorter chain."""
    order: list[int] = []
    sub_units = []
    for u, (a, b) in enumerate(units):
        if rep[u] == u:
            sub_units.append((len(order), len(order) + b - a))
            order += range(a, b)
    return order, sub_units


def expand(sub: ChainProfile, rep: Sequence[int], units: list[tuple[int, int]],
           names: list[str]) -> ChainProfile:
    """The whole chain's profile from the kept units' ``sub`` (constants read on the shorter
    chain; what the skipped units would add after the chain's backward and to a step's FLOPs
    added back)."""
    index = {u: i for i, u in enumerate(u for u in range(len(units)) if rep[u] == u)}
    src = [index[rep[u]] for u in range(len(units))]
    fields: dict[str, Any] = {}
    for name in PER_UNIT:
        values = getattr(sub, name)
        fields[name] = [values[i] for i in src] if values else []
    fields["act"] = [0, *(sub.act[i + 1] for i in src)]
    fields["dgrad"] = [0, *(sub.dgrad[i + 1] for i in src)]
    skipped = [u for u in range(len(units)) if rep[u] != u]
    extra_grads = sum(fields["grads"][u] for u in skipped)
    extra_flops = sum(fields["unit_step_flops"][u] for u in skipped) if sub.unit_step_flops \
        else 0
    return dataclasses.replace(
        sub, block_names=names, units=units, **fields,
        tail_peak=sub.tail_peak + extra_grads if sub.tail_peak else 0,
        step_flops=sub.step_flops + extra_flops,
        inner_flops=sum(fields["unit_inner_flops"]), measured_plain_peak=0)


def whole_block(regions: dict[int, list[set[int]]], in_key: dict[int, int],
                units: Sequence[tuple[int, int]]) -> bool:
    """Whether a block mode checkpoints each unit whole and nothing else (one region per unit,
    keeping only the unit's input): then it is what a one-unit checkpointed segment does.
    A region's inputs are those that need a gradient, so one over the model's own input (a
    ViT's images, through its embedding: the chain's first unit) names none."""
    some = False
    for a, b in units:
        kept = [r for j in range(a, b) for r in regions.get(j, [])]
        if not kept:
            continue
        over_images = a == 0 and len(kept) == 1 and not kept[0]
        if not over_images and (len(kept) != 1 or kept[0] != {in_key[a]}):
            return False
        some = True
    return some
