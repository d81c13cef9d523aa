"""Find the repeated blocks of any ``nn.Module``: what to checkpoint when the model has no hook.

Deep networks are chains of blocks of one type (torchvision's ``BasicBlock``/``Bottleneck``,
``_DenseLayer``, ``EncoderBlock``, ``CNBlock``; a user's ``nn.ModuleList`` of layers), and those
blocks are the natural checkpoint regions (Chen et al. 2016 checkpoint "stages"; timm's
``set_grad_checkpointing`` does the same per stage/block). :func:`find_blocks` names them for
``zoo.set_grad_checkpointing`` and for the planner (``zoo.plan`` on any module), so both agree
on what a block is.

The rule, by default: count, per type, the modules that sit in a container (any module) holding
at least two children of that type; the type with the largest count is *the block type*
(composite types, those with submodules, are preferred to leaves such as ``nn.Conv2d``, which a
block holds several of, and a block class of its own to a generic container such as
``nn.Sequential`` or a subclass of it: mobilenet_v2's ``InvertedResidual``, not the
``Conv2dNormActivation`` inside it; ties go to the type met first). Every module of that type
that sits in a container holding at least two of them is a block, unless it is nested inside
another block. A Hugging Face model's blocks are its own checkpointing layers (every
``GradientCheckpointingLayer``: each encoder and decoder layer, as its
``gradient_checkpointing_enable`` takes them), where the rule would pick Whisper's two
attentions per decoder layer and miss its encoder. ``modules`` overrides the rule with types,
type names or dotted submodule names.

:func:`checkpoint_module` turns one module's every call into a ``zoo.checkpoint`` region and back.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ._subclass import reduce_as_original
from .checkpoint import checkpoint
from .nn import convert_spectral_norm

__all__ = ["find_blocks", "NoBlocksError", "checkpoint_module", "is_checkpointed"]


class NoBlocksError(ValueError):
    """A model has nothing that matches what was looked for."""


_GENERIC = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # and their subclasses


def _is_composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_type(model: nn.Module) -> type | None:
    """The type with the most members in containers holding two or more of it (composites before
    leaves, own classes before generic containers): torchvision's ResNet-18 gives its 8
    ``BasicBlock``, not its 4 stage ``Sequential``."""
    totals: Counter[type] = Counter()
    composite: dict[type, bool] = {}
    for parent in model.modules():
        counts = Counter(type(c) for c in parent.children() if _has_params(c))
        for child in parent.children():
            kind = type(child)
            if counts[kind] >= 2:
                totals[kind] += 1
                composite.setdefault(kind, _is_composite(child))
    if not totals:
        return None
    return max(totals, key=lambda kind: (composite[kind], not issubclass(kind, _GENERIC),
                                         totals[kind]))


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop blocks nested inside another block (checkpointing the outer one covers them)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def _matches(name: str, module: nn.Module, wanted: Iterable[type | str]) -> bool:
    for w in wanted:
        if isinstance(w, type) and isinstance(module, w):
            return True
        if isinstance(w, str) and (w == name or w == type(module).__name__):
            return True
    return False


def find_blocks(model: nn.Module, modules: Iterable[type | str] | type | str | None = None
                ) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` to checkpoint, as ``(dotted name, module)`` in forward order.

    Args:
        model: any module.
        modules: ``None`` for the repeated-block rule above; otherwise module types, type names
            (``"BasicBlock"``) or dotted submodule names (``"layer1.0"``) to take instead.

    Raises :class:`NoBlocksError` (a ValueError) naming what was looked for when nothing matches.
    """
    if modules is not None:
        wanted = _wanted(modules)
        found = [(n, m) for n, m in model.named_modules() if n and _matches(n, m, wanted)]
        if not found:
            names = ", ".join(w.__name__ if isinstance(w, type) else repr(w) for w in wanted)
            raise NoBlocksError(f"{type(model).__name__} has no submodule matching {names}; "
                                "pass module types, type names or dotted submodule names that "
                                "exist (see model.named_modules())")
        return _outermost(found)
    layers = _outermost([(n, m) for n, m in model.named_modules() if n and _is_hf_layer(m)])
    if layers:
        return layers
    kind = _block_type(model)
    if kind is None:
        raise NoBlocksError(f"{type(model).__name__} has no repeated blocks to checkpoint (looked "
                            "for a container holding two or more submodules of one type with "
                            "parameters); name the modules to checkpoint with modules=[...]")
    found = []
    for parent_name, parent in model.named_modules():
        siblings = [(n, c) for n, c in parent.named_children() if type(c) is kind]
        if len(siblings) >= 2:
            prefix = f"{parent_name}." if parent_name else ""
            found += [(prefix + n, c) for n, c in siblings]
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    found.sort(key=lambda item: order[id(item[1])])
    return _outermost(found)


def _is_transformers(value: Any, class_name: str) -> bool:
    """Whether ``value`` is an instance of the ``transformers`` class ``class_name``
    (duck-typed: zoo does not import transformers)."""
    return any(c.__name__ == class_name and c.__module__.startswith("transformers")
               for c in type(value).__mro__)


def _is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of a Hugging Face model's own checkpointing layers."""
    return _is_transformers(module, "GradientCheckpointingLayer")


def _wanted(modules: Any) -> list[type | str]:
    """``modules`` as a list of module types and names; anything else is a one-line TypeError."""
    wanted = [modules] if isinstance(modules, (type, str, nn.Module)) else modules
    try:
        wanted = list(wanted)
    except TypeError:
        wanted = [wanted]
    bad = [w for w in wanted if not (isinstance(w, str) or isinstance(w, type)
                                     and issubclass(w, nn.Module))]
    if bad or not wanted:
        got = "none" if not bad else f"{bad[0]!r} ({type(bad[0]).__name__})"
        if bad and isinstance(bad[0], nn.Module):  # its repr spans lines
            got = (f"a {type(bad[0]).__name__} instance; pass its dotted name from "
                   "model.named_modules() or its type")
        raise TypeError(f"modules= takes module types, type names or dotted submodule names "
                        f"(e.g. modules=[\"layer1.0\"] or modules=nn.TransformerEncoderLayer), "
                        f"got {got}")
    return wanted


# Checkpointing a module in place: its class is swapped for a cached subclass whose forward runs
# the original forward through zoo.checkpoint. A class swap (not an instance attribute) keeps
# deepcopy, state_dict, hooks and parameter identity intact, and every call of the module (a
# block called twice) is its own checkpointed region.
_CHECKPOINTED: dict[type, type] = {}


def _frozen(value: Any) -> Any:
    """A list or dict argument as a shallow copy: the caller may append to it after the call
    (torchvision's ``_DenseBlock`` appends each layer's output to the list it passed), and the
    recompute must see the arguments the forward saw."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]
                   ) -> tuple[tuple, dict[str, Any]]:
    """A Hugging Face layer's key/value cache kept out of its region in training: the layer
    writes the cache, so the recompute would write it again (GPT-2's keys doubled after the
    backward, the replay seeing other shapes). As Hugging Face's own checkpointing does
    (``GradientCheckpointingLayer``, whose models also pass GPT-2's cache positionally):
    ``use_cache=False``, and no cache unless the layer only reads it. The cache is found with
    ``isinstance`` against transformers' ``Cache``, imported by the layer already, which Dynamo
    traces (a walk of each argument's MRO breaks ``fullgraph=True``)."""
    read_only = getattr(module, "_can_checkpoint_with_cache", None)
    if read_only is None or not (module.training and torch.is_grad_enabled()):
        return args, kwargs
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if not read_only and cache is not None:
        args = tuple(None if isinstance(a, cache) else a for a in args)
        kwargs = {k: None if isinstance(v, cache) else v for k, v in kwargs.items()}
    return args, kwargs


def _new_checkpointed(cls: type, *args: Any) -> Any:
    """Unpickling a checkpointed module saved before :mod:`zoo._subclass` (which now pickles
    it): built from its original class, which pickles by name."""
    sub = _checkpointed_class(cls)
    return sub.__new__(sub, *args)


def _checkpointed_class(cls: type) -> type:
    if cls not in _CHECKPOINTED:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            plain = super(sub, self).forward  # the original class's forward, bound
            options = self.__dict__.get("_zoo_checkpoint_options")
            if options is None:  # made by its class, not checkpointed: a Sequential's slice
                return plain(*args, **kwargs)
            args = tuple(_frozen(a) for a in args)
            kwargs = {k: _frozen(v) for k, v in kwargs.items()}
            args, kwargs = _without_cache(self, args, kwargs)
            return checkpoint(plain, *args, **options, **kwargs)

        def __reduce_ex__(self: nn.Module, protocol: int) -> Any:  # noqa: N807
            return reduce_as_original(self, protocol, _checkpointed_class, cls)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "_zoo_checkpointed_from": cls,
                                          "__qualname__": cls.__qualname__,
                                          "__reduce_ex__": __reduce_ex__})
        _CHECKPOINTED[cls] = sub
    return _CHECKPOINTED[cls]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` has turned ``module``'s forward into a checkpoint."""
    return "_zoo_checkpointed_from" in type(module).__dict__


def checkpoint_module(module: nn.Module, enable: bool = True, **options: Any) -> nn.Module:
    """Run every call of ``module`` through ``zoo.checkpoint`` (``enable=False`` undoes it).

    ``options`` (e.g. ``save_ops``) are passed to ``zoo.checkpoint`` on each call. Parameters,
    buffers, hooks, the state_dict and the object itself stay the same. A Hugging Face layer
    trains without its key/value cache, as under Hugging Face's own checkpointing. Its spectral
    norms are converted, to be recomputed exactly (:func:`zoo.nn.convert_spectral_norm`; they
    stay converted after ``enable=False``, which changes nothing outside a region). Returns
    ``module``.
    """
    if is_checkpointed(module):
        module.__class__ = type(module).__dict__["_zoo_checkpointed_from"]
        module.__dict__.pop("_zoo_checkpoint_options", None)
    if enable:
        convert_spectral_norm(module)
        module._zoo_checkpoint_options = dict(options)
        module.__class__ = _checkpointed_class(type(module))
    return module
