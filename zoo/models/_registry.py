"""The model registry: a dict of entry points, torchvision-style, small enough to read at once."""
from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["register_model", "list_models", "create_model", "build_model", "UnknownModelError",
           "UnknownArgumentError"]

_MODELS: dict[str, Callable[..., nn.Module]] = {}


class UnknownModelError(ValueError):
    """A model name that is not registered; the message lists the closest registered names."""


class UnknownArgumentError(TypeError):
    """A keyword the model's class does not take (a typo such as ``efficent``): one line naming
    the model, the keyword and the closest argument the class takes (all of them if none is)."""


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register ``fn`` under its own name; a second model with the same name is an error."""
    name = fn.__name__
    if name in _MODELS:
        raise ValueError(f"a model named {name!r} is already registered "
                         f"(by {_MODELS[name].__module__}); pick another name")
    _MODELS[name] = fn
    return fn


def _keywords(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` into the base classes'
    constructors (a reversible model passes its arguments on to the plain one)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def build_model(cls: Callable[..., nn.Module], model_args: dict[str, Any],
                **kwargs: Any) -> nn.Module:
    """``cls(**dict(model_args, **kwargs))``: a variant's architecture arguments ``model_args``
    are defaults that the caller's keywords override, as in timm's entry points (so
    ``create_model("resnet20", depth=32)`` is ``CifarResNet(depth=32)``). An override changes that
    argument alone: values the variant derived from it (DenseNet-BC's stem of 2k) stay as set.
    A keyword ``cls`` does not take is an :class:`UnknownArgumentError` before anything is built."""
    known = _keywords(cls)
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}"
            raise UnknownArgumentError(f"{cls.__name__} takes no argument {key!r}: {hint}")
    return cls(**dict(model_args, **kwargs))


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching the shell-style ``pattern`` (``"resnet*"``), sorted."""
    return sorted(n for n in _MODELS if fnmatch.fnmatchcase(n, pattern))


def _check_arguments(name: object, num_classes: object) -> None:
    """One-line errors for a name that is not a string and a class count that is not an int >= 0
    (``0``: no classifier, the model returns pooled features, as in timm)."""
    if not isinstance(name, str):
        raise TypeError(f"model name must be a string such as 'resnet50', got "
                        f"{type(name).__name__} {name!r}; zoo.list_models() lists the names")
    if num_classes is None:
        return
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise TypeError(f"num_classes must be an int >= 0 (0: pooled features, no classifier), "
                        f"got {type(num_classes).__name__} {num_classes!r}")
    if num_classes < 0:
        raise ValueError(f"num_classes must be an int >= 0 (0: pooled features, no classifier), "
                         f"got {num_classes}")


def create_model(name: str, num_classes: int | None = None, efficient: bool | str = False,
                 pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Build a registered model.

    Args:
        name: a name from :func:`list_models`.
        num_classes: classifier outputs; ``None`` keeps the model's default (10 for CIFAR models,
            1000 for ImageNet ones, 2 for ``bert_base``, the vocabulary for ``gpt2_small``).
        efficient: turn on the family's recommended checkpointing (same results, less memory).
        pretrained: load torchvision's ImageNet weights (ImageNet DenseNets and ResNets) from
            torch's hub cache; offline without the file: an error naming it and where it goes.
        **kwargs: architecture or checkpointing options of the family's model class; they
            override the variant's own (``depth=2``), as in timm; the name stays ``architecture``.
    """
    _check_arguments(name, num_classes)
    if name not in _MODELS:
        close = difflib.get_close_matches(name, _MODELS, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "no registered name is close"
        raise UnknownModelError(f"unknown model {name!r}: {hint} "
                                f"(zoo.list_models() lists all {len(_MODELS)})")
    if not isinstance(pretrained, bool):
        raise TypeError(f"pretrained must be True or False, got {pretrained!r}")
    if pretrained:
        from ._pretrained import load_pretrained, weights_file

        weights_file(name)  # a model without weights is refused before it is built
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    try:
        model = _MODELS[name](efficient=efficient, **kwargs)
    except UnknownArgumentError as err:
        raise UnknownArgumentError(f"create_model({name!r}): {err}") from None
    model.architecture = name  # timm's pretrained_cfg["architecture"]
    return load_pretrained(model, name, kwargs) if pretrained else model
