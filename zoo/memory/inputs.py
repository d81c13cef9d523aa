"""A batch as the model takes it: one tensor, a tuple of positional arguments, or a dict of keyword
arguments (a Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels``), with any mix of
tensors and other values.

Every step :mod:`zoo.memory` measures and the planner profiles calls the model through
:meth:`Batch.call`, so a batch dict is planned as it is trained (an encoder's attention mask
changes the attention's memory). :meth:`Batch.size` finds the batch dimension rather than
assuming it, and :meth:`Batch.resized` makes the same batch at another size, for the largest-batch
search.
"""
from __future__ import annotations

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
        """``batch`` read as the model takes it: a tensor is the one positional argument, a
        tuple or list the positional arguments, a dict (any mapping, a Hugging Face
        ``BatchEncoding`` included) the keyword arguments; a :class:`Batch` is itself. Anything
        else, or a batch without a tensor, is a one-line TypeError naming ``name``."""
        if isinstance(batch, Batch):
            return batch
        if isinstance(batch, torch.Tensor):
            out = Batch((batch,))
        elif isinstance(batch, (tuple, list)):
            out = Batch(tuple(batch))
        elif isinstance(batch, Mapping) and all(isinstance(k, str) for k in batch):
            out = Batch((), dict(batch))
        else:
            raise TypeError(f"{name} must be a tensor, a tuple of the model's positional "
                            f"arguments or a dict of its keyword arguments, got "
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
        """The tensors passed directly (not inside nested containers), in order."""
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], Any]) -> Batch:
        """The same batch with ``fn`` applied to each tensor."""
        def one(v: Any) -> Any:
            return fn(v) if isinstance(v, torch.Tensor) else v
        return Batch(tuple(one(v) for v in self.args),
                     {k: one(v) for k, v in self.kwargs.items()})

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
        """Shapes and dtypes, for messages: ``(x: 8x3x32x32 float32)``."""
        def one(v: Any) -> str:
            if isinstance(v, torch.Tensor):
                return f"{'x'.join(map(str, v.shape)) or 'scalar'} {str(v.dtype).removeprefix('torch.')}"
            return type(v).__name__
        parts = [one(v) for v in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return "(" + ", ".join(parts) + ")"


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
