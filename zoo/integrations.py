"""One call that checkpoints any model exactly: ``zoo.set_grad_checkpointing(model)``.

Each family already has a switch for checkpointing, and each recomputes with
``torch.utils.checkpoint``, so BatchNorm counts every batch twice (pytorch/pytorch#96136) and
nothing else of the zoo's contract holds. This module turns each family on *through its own
switch* with ``zoo.checkpoint`` in place of torch's: a zoo model's own modes; timm's
``set_grad_checkpointing(True)``, with the ``checkpoint``/``checkpoint_seq`` helpers its modules
imported replaced by dispatchers that send only this model's calls to ``zoo.checkpoint``; a
Hugging Face ``PreTrainedModel``'s ``_gradient_checkpointing_func`` (also inside a PEFT
``PeftModel``), kept through a later ``gradient_checkpointing_enable()``; anything else through
its repeated blocks (:func:`zoo.blocks.find_blocks`, :func:`zoo.blocks.checkpoint_module`).
Every model but a zoo model also gets recompute-safe BatchNorm and spectral norm
(:func:`zoo.nn.convert_batchnorm`, :func:`zoo.nn.convert_spectral_norm`). ``enable=False`` puts
back the plain model. What holds for each family: docs/outside-models.md."""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from . import _torch
from .blocks import checkpoint_module, find_blocks, is_checkpointed
from .checkpoint import checkpoint, run_blocks
from .checkpoint.casts import set_casts_once
from .models import ZooModel
from .nn import (convert_batchnorm, convert_spectral_norm, has_unconverted_spectral_norm,
                 recompute_safe_class, restore_batchnorm, restore_spectral_norm)

__all__ = ["set_grad_checkpointing"]

_STATE = "_zoo_grad_checkpointing"  # on the model: how this call switched it on
_ROUTED = "_zoo_routed"  # on each module of a timm model: its checkpoint calls go to zoo


# zoo.checkpoint takes torch.utils.checkpoint's keywords (use_reentrant=False, ...) and hands
# every other keyword to the function, so it is called exactly where torch's would be.
def _is_checkpoint(fn: Any, target: Callable) -> bool:
    """Whether ``fn`` is ``target`` or a ``functools.partial`` of it (HF passes partials)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn is target


# ---- timm: dispatchers in place of timm's checkpoint helpers, per timm module.
def _owner(fn: Any) -> nn.Module | None:
    """The module a checkpointed callable belongs to: itself, a bound method's object, or the
    module a closure captured (timm's DenseNet checkpoints ``closure`` over ``self``)."""
    if isinstance(fn, nn.Module):
        return fn
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            return value
    return None


def _routed(fn: Any) -> bool:
    owner = _owner(fn)
    return owner is not None and owner.__dict__.get(_ROUTED, False)


def _timm_checkpoint(timm_checkpoint: Callable, function: Callable, *args: Any,
                     use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """timm's ``checkpoint(function, *args, use_reentrant=None, **kwargs)``, zoo's when routed."""
    if not _routed(function):
        return timm_checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
    return checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def _timm_checkpoint_seq(timm_checkpoint_seq: Callable, functions: Any, x: Any, every: int = 1,
                         flatten: bool = False, skip_last: bool = False,
                         use_reentrant: bool | None = None) -> Any:
    """timm's ``checkpoint_seq``: segments of ``every`` functions, the last one plain when
    ``skip_last``; through zoo.checkpoint when the functions belong to a routed model."""
    if isinstance(functions, nn.Sequential):
        functions = functions.children()
    if flatten:
        functions = chain.from_iterable(functions)
    functions = tuple(functions)
    if not functions or not _routed(functions[0]):
        return timm_checkpoint_seq(functions, x, every=every, skip_last=skip_last,
                                   use_reentrant=use_reentrant)
    stop = len(functions) - 1 if skip_last else len(functions)
    end = 0
    for start in range(0, stop, every):
        end = min(start + every, stop)
        part = functions[start:end]
        x = checkpoint(part[0], x) if len(part) == 1 else checkpoint(run_blocks, part, x)
    return run_blocks(functions[end:], x) if skip_last else x


def _patch_timm_modules(model: nn.Module) -> None:
    """Put the dispatchers in place of timm's helpers in every timm module ``model`` uses."""
    from timm.models import _manipulate

    replacements = {
        _manipulate.checkpoint: functools.partial(_timm_checkpoint, _manipulate.checkpoint),
        _manipulate.checkpoint_seq: functools.partial(_timm_checkpoint_seq,
                                                      _manipulate.checkpoint_seq),
    }
    classes = {klass for m in model.modules() for klass in type(m).__mro__}
    for klass in classes:
        module = sys.modules.get(klass.__module__)
        if module is None or not klass.__module__.startswith("timm."):
            continue
        for name in ("checkpoint", "checkpoint_seq"):
            current = getattr(module, name, None)
            if current in replacements:
                setattr(module, name, replacements[current])


def _is_timm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("timm.") and \
        hasattr(model, "set_grad_checkpointing")


def _enable_timm(model: nn.Module) -> bool:
    """timm's own switch with zoo's checkpoint; False if the model refuses checkpointing."""
    try:
        model.set_grad_checkpointing(True)
    except (AssertionError, NotImplementedError):  # "gradient checkpointing not supported"
        return False
    _patch_timm_modules(model)
    for m in model.modules():
        m.__dict__[_ROUTED] = True
    return True


def _disable_timm(model: nn.Module) -> None:
    model.set_grad_checkpointing(False)
    for m in model.modules():
        m.__dict__.pop(_ROUTED, None)


# ---- Hugging Face: the _gradient_checkpointing_func hook, kept through later enable calls.
def _is_hf(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # not imported: cannot be one of its models
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


_CHECKPOINT_KEYWORDS = frozenset(
    name for name, p in inspect.signature(checkpoint).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)  # torch's (use_reentrant, ...) and zoo's


def _unless_checkpointed(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Hugging Face's checkpoint call of one layer, where zoo checkpoints layers chosen by
    name: ``zoo.checkpoint`` for any other layer, and a chosen one runs as it is, its own region
    its one checkpoint (wrapped in a second, each layer would run up to three times a step)."""
    owner = _owner(function)
    if owner is None or not is_checkpointed(owner):
        return checkpoint(function, *args, **kwargs)
    return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYWORDS})


class _KeepZooCheckpoint:
    """Stands in for a Hugging Face model's ``_set_gradient_checkpointing`` while zoo owns it: a
    later ``gradient_checkpointing_enable()`` hands it torch's checkpoint (with its keywords),
    which is swapped for zoo's (``func``). A plain object holding the model, so deepcopy and
    pickle keep it pointing at the right model."""

    def __init__(self, model: nn.Module, func: Callable = checkpoint):
        self.model = model
        self.func = func

    def __call__(self, enable: bool = True, gradient_checkpointing_func: Callable | None = None,
                 **kwargs: Any) -> None:
        func = gradient_checkpointing_func
        if enable and func is not None:
            if _is_checkpoint(func, torch_checkpoint.checkpoint):
                keywords = func.keywords if isinstance(func, functools.partial) else {}
                func = functools.partial(self.func, **keywords)
            elif not (_is_checkpoint(func, checkpoint) or _is_checkpoint(func, self.func)):
                warnings.warn(f"zoo.set_grad_checkpointing: {type(self.model).__name__} now "
                              f"checkpoints with {getattr(func, '__name__', func)!r} (e.g. "
                              "offload=True), not zoo.checkpoint; BatchNorm stays exact",
                              stacklevel=3)
        if func is not None:
            kwargs["gradient_checkpointing_func"] = func
        type(self.model)._set_gradient_checkpointing(self.model, enable=enable, **kwargs)


def _has_hf_switch(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model whose switch takes a checkpoint function."""
    if not (_is_hf(model) and getattr(model, "supports_gradient_checkpointing", False)):
        return False
    params = inspect.signature(type(model)._set_gradient_checkpointing).parameters
    return "gradient_checkpointing_func" in params  # not HF's format before 4.35


def _enable_hf(model: nn.Module) -> bool:
    """HF's own switch with zoo's checkpoint; False if the model has no such switch."""
    if not _has_hf_switch(model):
        return False
    type(model)._set_gradient_checkpointing(model, enable=True,
                                            gradient_checkpointing_func=checkpoint)
    model.__dict__["_set_gradient_checkpointing"] = _KeepZooCheckpoint(model)
    return True


def _hold_hf_switch(model: nn.Module) -> None:
    """Layers of a Hugging Face model checkpointed by name: a later
    ``gradient_checkpointing_enable()`` (the Trainer's) checkpoints the others with zoo's and
    leaves these to their own region."""
    if _has_hf_switch(model):
        model.__dict__["_set_gradient_checkpointing"] = _KeepZooCheckpoint(
            model, _unless_checkpointed)


def _disable_hf(model: nn.Module) -> None:
    model.__dict__.pop("_set_gradient_checkpointing", None)
    if getattr(model, "supports_gradient_checkpointing", False):
        type(model)._set_gradient_checkpointing(model, enable=False)


# ---- The one call.
def _peft_base(model: nn.Module) -> nn.Module | None:
    """The model a PEFT ``PeftModel`` wraps (LoRA's layers are injected into it in place), or
    None: a Hugging Face model then takes its own route and its state goes with it through
    ``merge_and_unload()``. Duck-typed: zoo does not import peft."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, getattr(peft, "PeftModel", ())):
        return None
    base = model.get_base_model()
    return base if isinstance(base, nn.Module) and base is not model else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside ``nn.DataParallel``/``DistributedDataParallel``, ``torch.compile`` and
    PEFT wrappers (in any order), so that it takes its family's route and keeps its state."""
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        inner = _torch.compiled_original(model)
        if inner is None and isinstance(model, wrappers):
            inner = model.module
        if inner is None:
            inner = _peft_base(model)
        if inner is None:
            return model
        model = inner


def _relative(given: nn.Module, model: nn.Module, modules: Any) -> Any:
    """``modules`` with dotted names taken from the wrapper (``peft_model.named_modules()``
    reads ``base_model.model.model.layers.0``) made relative to the model inside it."""
    if given is model or not isinstance(modules, (str, list, tuple, set)):
        return modules
    prefix = next((f"{n}." for n, m in given.named_modules() if m is model and n), None)
    if prefix is None:
        return modules
    wanted = [modules] if isinstance(modules, str) else list(modules)
    return [w[len(prefix):] if isinstance(w, str) and w.startswith(prefix) else w
            for w in wanted]


def _convert_batchnorm_names(model: nn.Module) -> list[str]:
    """Convert the model's BatchNorms; the names of those this call converted (to undo them)."""
    before = {n for n, m in model.named_modules() if recompute_safe_class(type(m)) is type(m)}
    convert_batchnorm(model)
    return [n for n, m in model.named_modules()
            if recompute_safe_class(type(m)) is type(m) and n not in before]


def _spectral_norm_names(model: nn.Module) -> list[str]:
    """The modules holding a spectral norm not yet converted (a parametrization itself, or the
    layer of an older hook): those that enabling converts (checkpointing a block converts its
    own: ``zoo.blocks.checkpoint_module``), and ``enable=False`` gives torch's class back."""
    return [n for n, m in model.named_modules() if has_unconverted_spectral_norm(m)]


def _disable(model: nn.Module) -> None:
    """Turn off whatever checkpointing zoo (or the model's own switch) turned on."""
    state = model.__dict__.pop(_STATE, {})
    via = state.get("via")
    if isinstance(model, ZooModel):
        model.set_grad_checkpointing(False)
        model.set_checkpoint_plan(None)
    elif via == "timm" or (via is None and _is_timm(model)):
        try:
            _disable_timm(model)
        except (AssertionError, NotImplementedError):
            pass
    elif _is_hf(model):  # by its hook, or by name with its switch held
        _disable_hf(model)
    for m in model.modules():
        if is_checkpointed(m):
            checkpoint_module(m, enable=False)
    for name in state.get("batchnorm", ()):
        restore_batchnorm(model.get_submodule(name), recurse=False)
    for name in state.get("spectral_norm", ()):
        restore_spectral_norm(model.get_submodule(name), recurse=False)
    set_casts_once(model, enable=False)


def set_grad_checkpointing(model: nn.Module, enable: bool | str = True,
                           modules: Iterable[type | str] | type | str | None = None,
                           casts_once: bool = False) -> nn.Module:
    """Checkpoint any model with ``zoo.checkpoint``, exactly (``enable=False``: turn it off).

    Args:
        model: a zoo model, a timm model, a Hugging Face ``PreTrainedModel`` or any other module
            (``nn.DataParallel``, ``DistributedDataParallel``, ``torch.compile`` and PEFT's
            ``PeftModel`` wrappers are looked through: the model inside takes its family's
            route and holds the state, so it goes with ``merge_and_unload()``).
        enable: True to checkpoint, False to give back the plain model (same classes, state_dict
            and outputs). A zoo model also takes one of its ``checkpoint_modes`` by name.
        modules: None for the family's own checkpointing (see the module docstring); otherwise
            module types, type names or dotted submodule names (of the model or of its
            wrapper) whose every call is checkpointed.
        casts_once: run the forward without autocast's cache of parameter casts, so that no
            checkpointed block holds its weights' low-precision copies to the forward's end
            (:func:`zoo.checkpoint.casts.set_casts_once`: the first forward under autocast checks
            that each parameter is cast once, where the cache changes nothing, and raises
            ``ValueError`` if one is cast twice). A zoo model always runs so.

    Returns ``model`` (a wrapper as given). Raises ValueError naming what was looked for when
    nothing matches, TypeError for an ``enable`` that is no bool or mode name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"zoo.set_grad_checkpointing expects an nn.Module, got "
                        f"{type(model).__name__}")
    if enable is not None and not isinstance(enable, (bool, str)):
        raise TypeError(f"zoo.set_grad_checkpointing: enable must be True, False or a zoo "
                        f"model's mode name, got {enable!r} ({type(enable).__name__})")
    if not isinstance(casts_once, bool):
        raise TypeError(f"zoo.set_grad_checkpointing: casts_once must be True or False, got "
                        f"{casts_once!r} ({type(casts_once).__name__})")
    given, model = model, _unwrap(model)
    modules = _relative(given, model, modules)
    _disable(model)
    if enable is False or enable is None:
        return given
    if isinstance(enable, str) and (modules is not None or not isinstance(model, ZooModel)):
        raise ValueError(f"enable={enable!r}: a mode name is for zoo models without modules=; "
                         "pass enable=True")
    state: dict[str, Any] = {"via": "blocks", "spectral_norm": _spectral_norm_names(model)}
    if modules is None and isinstance(model, ZooModel):
        model.set_grad_checkpointing(enable)
        state["via"] = "zoo"
    elif modules is None and _is_hf(model) and _enable_hf(model):
        state["via"] = "hf"
    elif modules is None and _is_timm(model) and _enable_timm(model):
        state["via"] = "timm"
    else:
        for _, block in find_blocks(model, modules):
            checkpoint_module(block)
        _hold_hf_switch(model)
    if state["via"] != "zoo":  # exact also in a checkpoint of the model's own (torchvision's
        state["batchnorm"] = _convert_batchnorm_names(model)  # memory_efficient DenseNet)
        convert_spectral_norm(model)
    if casts_once and state["via"] != "zoo":
        set_casts_once(model)
    model.__dict__[_STATE] = state
    return given
