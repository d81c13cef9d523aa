"""Nested checkpoint regions for ``zoo.plan`` on any ``nn.Module``.

With every block checkpointed, a step still keeps one input per block until backward reaches it.
Checkpointing a container of blocks too (a ResNet stage, a slice of ViT's ``blocks``) keeps only
the container's input through the forward: Chen et al. 2016's two-level sqrt(n) schedule.
Regions are ``"layer1"`` (a module, wrapped with ``zoo.blocks.checkpoint_module``) or
``"blocks[0:4]"`` (children of a plain ``nn.Sequential``, run as one checkpoint by
:class:`SegmentedSequential`): the two forms safe for any model."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn

from ...blocks import checkpoint_module, is_checkpointed
from ...checkpoint import checkpoint

__all__ = ["SegmentedSequential", "outer_candidates", "set_nested", "clear_nested",
           "restore_nested", "nest"]


def _run(modules: tuple[nn.Module, ...], x: Any) -> Any:
    for m in modules:
        x = m(x)
    return x


class SegmentedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose children ``start:stop`` run as one ``zoo.checkpoint`` per
    segment in ``_zoo_checkpoint_options["segments"]`` (sorted, disjoint); the state_dict is
    the Sequential's. ``zoo.blocks.is_checkpointed`` is true of it and
    ``checkpoint_module(m, False)`` gives back the plain Sequential, so
    ``zoo.set_grad_checkpointing(model, False)`` undoes a nested plan too."""

    _zoo_checkpointed_from = nn.Sequential

    def forward(self, input: Any) -> Any:  # noqa: A002 (nn.Sequential's name)
        options = self.__dict__.get("_zoo_checkpoint_options")
        if options is None:  # a slice of a segmented one (made by its class): runs plainly
            return _run(tuple(self), input)
        mods, done = tuple(self), 0
        for start, stop in options["segments"]:
            input = _run(mods[done:start], input)
            input = checkpoint(_run, mods[start:stop], input)
            done = stop
        return _run(mods[done:], input)


def _parse(region: str) -> tuple[str, tuple[int, int] | None]:
    """``"blocks[0:4]"`` -> ("blocks", (0, 4)); ``"layer1"`` -> ("layer1", None)."""
    if not region.endswith("]"):
        return region, None
    name, span = region[:-1].split("[")
    start, stop = span.split(":")
    return name, (int(start), int(stop))


def set_nested(model: nn.Module, regions: list[str]) -> None:
    """Checkpoint exactly ``regions`` as outer regions (after :func:`clear_nested`)."""
    modules = dict(model.named_modules())
    segments: dict[str, list[tuple[int, int]]] = {}
    for region in regions:
        name, span = _parse(region)
        if span is None:
            checkpoint_module(modules[name], True)
        else:
            segments.setdefault(name, []).append(span)
    for name, spans in segments.items():
        if type(modules[name]) is not nn.Sequential:
            raise ValueError(f"{name} is a {type(modules[name]).__name__}, not a plain "
                             "nn.Sequential: only those are checkpointed in slices")
        modules[name].__class__ = SegmentedSequential
        modules[name]._zoo_checkpoint_options = {"segments": sorted(spans)}


def clear_nested(model: nn.Module, blocks: list[str]) -> list[tuple[nn.Module, Any]]:
    """Undo every outer region: segmented Sequentials become plain, and checkpointed modules
    that contain a block run plainly. Returns what was undone, for :func:`restore_nested`."""
    undone: list[tuple[nn.Module, Any]] = []
    for name, m in model.named_modules():
        if isinstance(m, SegmentedSequential):
            undone.append((m, m._zoo_checkpoint_options["segments"]))
            checkpoint_module(m, False)
        elif is_checkpointed(m) and any(b.startswith(f"{name}.") or not name for b in blocks):
            undone.append((m, dict(m._zoo_checkpoint_options)))
            checkpoint_module(m, False)
    return undone


def restore_nested(undone: list[tuple[nn.Module, Any]]) -> None:
    """Put back what :func:`clear_nested` undid."""
    for m, state in undone:
        if isinstance(state, list):
            m.__class__, m._zoo_checkpoint_options = SegmentedSequential, {"segments": state}
        else:
            checkpoint_module(m, True, **state)


def _callable_container(model: nn.Module, name: str) -> str:
    """``name`` or its nearest ancestor that has a forward of its own (a ModuleList's loop is
    in its parent's forward); "" for the model itself."""
    while name and isinstance(model.get_submodule(name), (nn.ModuleList, nn.ModuleDict)):
        name = name.rpartition(".")[0]
    return name


def _slicings(name: str, n: int, whole: bool = True) -> list[list[str]]:
    """Ways to checkpoint a plain Sequential of ``n`` children: whole, and in contiguous
    slices of about sqrt(n) and n/2 children (the two-level schedule's best is near sqrt)."""
    options = [[name]] if whole else []
    for size in sorted({math.ceil(math.sqrt(n)), math.ceil(n / 2)}):
        if 1 < size < n:
            options.append([f"{name}[{i}:{min(i + size, n)}]" for i in range(0, n, size)])
    return options


def outer_candidates(model: nn.Module, blocks: list[str]) -> list[list[list[str]]]:
    """Per container holding two or more blocks, its ways to be an outer region, each a list of
    region names: a plain ``nn.Sequential`` whole or in slices (the model itself in slices
    only), any other module whole (a ModuleList's blocks are looped by its parent: that parent
    whole, unless it is the model)."""
    counts: dict[str, int] = {}
    for b in blocks:
        parent = _callable_container(model, b.rpartition(".")[0])
        counts[parent] = counts.get(parent, 0) + 1
    candidates = []
    for name, count in counts.items():
        module = model.get_submodule(name)
        if count < 2:
            continue
        if type(module) is nn.Sequential:
            candidates.append(_slicings(name, len(module), whole=bool(name)))
        elif name:
            candidates.append([[name]])
    return [ways for ways in candidates if ways]


Measure = Callable[[list[str]], tuple[int, int]]


def nest(candidates: list[list[list[str]]], measure: Measure, start: tuple[int, int],
         budget: int | float) -> tuple[list[str], tuple[int, int]]:
    """Outer regions added greedily until the step fits ``budget``: each round measures every
    way of every container left (``measure(regions) -> (peak, FLOPs)``) and takes the cheapest
    in FLOPs that fits, else the one with the lowest peak; it stops when nothing lowers the
    peak. Returns the regions and their (peak, FLOPs): the nested floor when nothing fits."""
    chosen, best, left = [], start, list(candidates)
    while left and best[0] > budget:
        trials = [(measure(chosen + way), i, way) for i, ways in enumerate(left) for way in ways]
        fitting = [t for t in trials if t[0][0] <= budget]
        if fitting:
            pick = min(fitting, key=lambda t: (t[0][1], t[0][0]))
        else:
            pick = min(trials, key=lambda t: t[0])
        if pick[0][0] >= best[0]:
            break
        chosen, best = chosen + pick[2], pick[0]
        del left[pick[1]]
    return chosen, best
