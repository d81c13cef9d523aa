"""The precision a user trains in, as the steps zoo measures replay it: fp32, or autocast.

A step measured or planned inside ``with torch.autocast(...)`` is the step of PyTorch's automatic
mixed precision recipe (https://pytorch.org/docs/stable/notes/amp_examples.html): the forward and
the loss under autocast, the backward and ``optimizer.step()`` after the autocast block. The two
differ in memory: autocast keeps a cast copy of each parameter it casts until its outermost
block exits, so a backward run inside the block (and a checkpoint's recompute there) would keep
every cast made since, and a forward's casts are freed only when its block ends.

:func:`step_precision` reads the autocast state a measurement is called in, switches it off for
the measurement (with the nesting count autocast keeps, so the measurement's own autocast block is
outermost and clears its casts when it exits, as the user's does) and puts it back after;
:func:`forward_precision` is the autocast block each measured forward runs in. fp16 is trained with
a ``GradScaler``: its ``scale(loss)`` (one more scalar, the loss times the scale) is part of the
step too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["Precision", "step_precision", "forward_precision", "current_precision", "scale_loss"]

_DEVICE_TYPES = ("cuda", "cpu")  # where autocast is asked; the first enabled one is the step's


@dataclass(frozen=True)
class Precision:
    """``device_type`` and ``dtype`` of the autocast a step's forward runs under; both None for
    fp32 (no autocast)."""

    device_type: str | None = None
    dtype: torch.dtype | None = None

    @staticmethod
    def ambient() -> Precision:
        """The autocast state of the calling code (the first device type enabled)."""
        for device_type in _DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                return Precision(device_type, torch.get_autocast_dtype(device_type))
        return Precision()

    @property
    def name(self) -> str:
        """``fp32``, or e.g. ``bf16 autocast (cuda)``."""
        if self.dtype is None:
            return "fp32"
        short = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))
        return f"{short} autocast ({self.device_type})"

    @property
    def scaled(self) -> bool:
        """Whether the step scales its loss (fp16: a ``GradScaler``)."""
        return self.dtype == torch.float16

    def on_cpu(self) -> Precision:
        """The same dtype under CPU autocast: what a card's fake step (its tensors on the CPU)
        runs, CUDA's op lists put in by ``zoo.memory.cards.autocast``."""
        return Precision("cpu", self.dtype) if self.dtype is not None else self

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


_CURRENT: ContextVar[Precision | None] = ContextVar("zoo_step_precision", default=None)


def current_precision() -> Precision:
    """The precision of the measurement under way (fp32 outside one)."""
    return _CURRENT.get() or Precision()


@contextlib.contextmanager
def step_precision(precision: Precision | None = None) -> Iterator[Precision]:
    """Measure steps in ``precision`` (default: the caller's autocast state) for the duration;
    yields it. The caller's autocast is off meanwhile and put back as it was after (module
    docstring). Nested calls keep the outer measurement's precision."""
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    chosen = Precision.ambient() if precision is None else precision
    enabled = [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]
    for d in enabled:
        torch.set_autocast_enabled(d, False)
    nesting = 0
    while enabled and torch.autocast_decrement_nesting() > 0:
        nesting += 1
    if enabled:
        nesting += 1  # the decrement that reached 0
    token = _CURRENT.set(chosen)
    try:
        yield chosen
    finally:
        _CURRENT.reset(token)
        for _ in range(nesting):
            torch.autocast_increment_nesting()
        for d in enabled:
            torch.set_autocast_enabled(d, True)


def forward_precision() -> contextlib.AbstractContextManager:
    """The autocast block a measured step's forward and loss run in."""
    return current_precision().autocast()


def scale_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss the backward starts from: ``loss`` times a scale for fp16 (a ``GradScaler``'s
    ``scale(loss)``: the scale is a float32 scalar on the loss's device), else ``loss``."""
    if not current_precision().scaled:
        return loss
    return loss * torch.full((), 2.0 ** 16, dtype=torch.float32, device=loss.device)
