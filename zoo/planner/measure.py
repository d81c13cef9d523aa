"""Measure one training step of a model without running it: peak bytes and FLOPs.

The step (forward, loss, backward) runs under ``FakeTensorMode`` with the model's parameters and
buffers swapped for fake copies, inside ``zoo.memory.cpu_peak_bytes`` (MemTracker) and
``FlopCounterMode``. MemTracker's figure is byte-identical to a real CPU step, so this is the
planner's independent check of its own predictions (tests, ``python -m zoo.bench planner``) and it
costs seconds even for batches this machine could not hold.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..memory import cpu_peak_bytes
from .fake import default_loss, fake_state

__all__ = ["measure_step"]


def measure_step(model: nn.Module, example_input: torch.Tensor,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None) -> tuple[int, int]:
    """(peak bytes, FLOPs) of one fake training step of ``model`` as it is configured now
    (checkpoint mode or plan included). ``model`` itself is left untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    loss_fn = loss_fn or default_loss
    fake = FakeTensorMode()
    state = fake_state(model, fake)
    x = fake.from_tensor(example_input.detach()).requires_grad_(example_input.requires_grad)
    tensors = list({id(t): t for t in state.values()}.values())

    def step() -> None:
        with _reparametrize_module(model, state):
            loss_fn(model(x)).backward()

    # two steps: FlopCounterMode's module hooks change what a checkpointed region holds under
    # FakeTensorMode, so the peak is taken without it
    with fake, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        peak = cpu_peak_bytes(step, tensors)
        counter = FlopCounterMode(display=False)
        with counter:
            step()
    return peak, int(counter.get_total_flops())
