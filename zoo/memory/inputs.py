"""A batch as the model takes it: one tensor, a tuple of positional arguments, or a dict of keyword
arguments (a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``), with any mix of
tensors and other values, nested in tuples, lists, dicts and dataclasses (torchvision's detection
models take a list of images and a list of target dicts).

Every step :mod:`zoo.memory` measures and the planner profiles calls the model through
:meth:`Batch.call`, so a batch dict is planned as it is trained (an encoder's attention mask
changes the attention's memory). :meth:`Batch.size` finds the batch dimension rather than
assuming it, and :meth:`Batch.resized` makes the same batch at another size, for the largest-batch
search.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Batch", "check_model"]


@dataclass(frozen=True)
class Batch:
    """Positional ``args`` and keyword ``kwargs`` of one call of a model."""

    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(batch: Any, name: str = "batch") -> Batch:
        """``batch`` read as the model takes it: a tensor or a dataclass instance is the one
        positional argument, a tuple or list the positional arguments, a dict (any mapping, a
        Hugging Face ``BatchEncoding`` included) the keyword arguments; a :class:`Batch` is
        itself. Anything else, or a batch without a tensor, is a one-line TypeError naming
        ``name``."""
        if isinstance(batch, Batch):
            return batch
        if isinstance(batch, torch.Tensor):
            out = Batch((batch,))
        elif isinstance(batch, (tuple, list)):
            out = Batch(tuple(batch))
        elif isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
            out = Batch((), dict(batch))
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            out = Batch((batch,))
        else:
            raise TypeError(f"{name} must be a tensor, a dataclass, a tuple of the model's "
                            f"positional arguments or a dict of its keyword arguments, got "
                            f"{type(batch).__name__}; pass the batch as the model takes it")
        if not out.tensors():
            raise TypeError(f"{name} holds no tensor ({type(batch).__name__} of "
                            f"{len(out.args) + len(out.kwargs)} values); pass the batch as the "
                            f"model takes it, with its tensors")
        return out

    def call(self, model: Callable[..., Any]) -> Any:
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, those nested in its containers too, in order."""
        found: list[torch.Tensor] = []
        _rebuilt((self.args, self.kwargs), lambda t: found.append(t) or t)
        return found

    def map(self, fn: Callable[[torch.Tensor], Any]) -> Batch:
        """The same batch with ``fn`` applied to each tensor, nested ones too (:func:`_rebuilt`)."""
        args, kwargs = _rebuilt((self.args, self.kwargs), fn)
        return Batch(args, kwargs)

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def size(self) -> int:
        """The batch size: the first dimension most of the batch's tensors share (every tensor
        of a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``), ties to the
        first tensor's. A batch whose tensors are all scalars is a one-line ValueError."""
        firsts = [t.shape[0] for t in self.tensors() if t.dim() > 0]
        if not firsts:
            raise ValueError("the batch's tensors are all scalars: no batch dimension to size; "
                             "pass tensors whose first dimension is the batch")
        counts = Counter(firsts)
        top = max(counts.values())
        return next(n for n in firsts if counts[n] == top)

    def resized(self, n: int) -> Batch:
        """The batch at size ``n``: each tensor whose first dimension is :meth:`size` repeats
        its first sample along it (the values do not matter to a step's memory); the others
        are kept."""
        b = self.size()

        def resize(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or t.shape[0] != b:
                return t
            return t[:1].expand(n, *t.shape[1:]).contiguous().requires_grad_(t.requires_grad)
        return self.map(resize)

    def describe(self) -> str:
        """Shapes and dtypes, for messages: ``(x: 8x3x32x32 float32)``; nested containers
        shown as they nest (a long list by its first values and its length)."""
        parts = [_described(v) for v in self.args]
        parts += [f"{k}={_described(v)}" for k, v in self.kwargs.items()]
        return "(" + ", ".join(parts) + ")"


def _described(v: Any) -> str:
    """One value of a batch in a few words (:meth:`Batch.describe`)."""
    if isinstance(v, torch.Tensor):
        return f"{'x'.join(map(str, v.shape)) or 'scalar'} {str(v.dtype).removeprefix('torch.')}"
    if isinstance(v, (tuple, list)):
        items = [_described(x) for x in v[:3]] + ([f"... {len(v)} in all"] if len(v) > 3 else [])
        return ("[{}]" if isinstance(v, list) else "({})").format(", ".join(items))
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {_described(x)}" for k, x in v.items()) + "}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = [f"{f.name}={_described(getattr(v, f.name))}" for f in dataclasses.fields(v)]
        return f"{type(v).__name__}({', '.join(fields)})"
    return type(v).__name__


def _rebuilt(v: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``v`` with ``fn`` applied to each tensor in it: tensors inside tuples (named ones kept),
    lists, mappings and dataclass instances are found and their containers rebuilt alike (a
    dataclass is copied and its fields set, so frozen ones and fields outside ``__init__`` are
    kept); any other value is kept as it is."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, tuple):
        items = [_rebuilt(x, fn) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    if isinstance(v, list):
        return type(v)(_rebuilt(x, fn) for x in v)
    if isinstance(v, Mapping):
        items = {k: _rebuilt(x, fn) for k, x in v.items()}
        try:
            return type(v)(items)
        except TypeError:  # a mapping type that is not built from a dict
            return items
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        out = copy.copy(v)
        for f in dataclasses.fields(v):
            object.__setattr__(out, f.name, _rebuilt(getattr(v, f.name), fn))
        return out
    return v


def check_model(model: Any, name: str = "model") -> nn.Module:
    """``model`` itself when it is an ``nn.Module``; otherwise a one-line TypeError saying what
    was given (a tensor where the model belongs: the arguments swapped; a model's name: use
    ``zoo.create_model``)."""
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, str):
        raise TypeError(f"{name} must be an nn.Module, got the string {model!r}; build it first, "
                        f"e.g. zoo.create_model({model!r})")
    hint = "; the arguments look swapped: the model comes first, then the batch" \
        if isinstance(model, (torch.Tensor, tuple, dict)) else ""
    raise TypeError(f"{name} must be an nn.Module, got {type(model).__name__}{hint}")
