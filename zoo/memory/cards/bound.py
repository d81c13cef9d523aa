"""The least peak any keep/recompute/offload plan of a training step can reach on a card.

Whatever a plan recomputes or moves to host memory, the card still holds the parameters (and
buffers), the gradients accumulated so far, its fixed workspaces (cuBLAS: one per thread that
runs a matmul, forward and backward, 32 MiB each on an H100) and, while one op runs, every
tensor that op reads or writes. So for each op of one fake step on the card:

    parameters + workspaces + (the op's own tensors' blocks + the gradients alive beside them)

and the step's lower bound is the largest of these (and of parameters + workspaces + all the
gradients, after the backward). A tighter one, :attr:`StepLowerBound.with_engine`, also counts
beside each backward op every other tensor the backward has made and still holds: the
gradients of activations the autograd engine keeps until every path has added to them (a skip
connection's, a concatenation's slices of one gradient), which are the same whatever the plan
keeps, recomputes or moves. A planner whose least peak sits near these has nothing left to
gain; the figures run through ``zoo.memory.cards.step.run_on_card``, the same fake step and
caching allocator as ``zoo.memory.predict_step``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import _torch
from ..tracker import storage_key
from .allocator import round_size
from .peak import _MATMULS, CudaCounter
from .step import run_on_card
from .timing import card

__all__ = ["StepLowerBound", "step_lower_bound"]


@dataclass(frozen=True)
class StepLowerBound:
    """The bound and its parts, bytes: ``parameters`` (and buffers), ``gradients`` (all, after
    the backward), ``workspaces``, ``largest_op`` (the op whose working set with the
    parameters' gradients alive beside it is largest: its name and those bytes) and
    ``largest_held`` (the backward op whose working set with everything else the backward holds
    beside it is largest)."""

    parameters: int
    gradients: int
    workspaces: int
    largest_op: tuple[str, int]
    largest_held: tuple[str, int] = ("", 0)

    @property
    def bytes(self) -> int:
        return self.parameters + self.workspaces + max(self.largest_op[1], self.gradients)

    @property
    def with_engine(self) -> int:
        """The tighter bound: the autograd engine's held gradients counted (module docstring)."""
        return max(self.bytes, self.parameters + self.workspaces + self.largest_held[1])


class _WorkingSets(CudaCounter):
    """The card's counter, noting for each op its tensors' blocks beside the live gradients."""

    def __init__(self, state: list[torch.Tensor], workspace: int) -> None:
        super().__init__(workspace=workspace)
        self.state = {storage_key(t): t for t in state}
        self.matmul = {False: False, True: False}
        self.largest: tuple[str, int] = ("", 0)
        self.held: tuple[str, int] = ("", 0)
        self.made: dict[int, int] = {}  # storages the backward made and still holds: bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if packet in _MATMULS:
            self.matmul[_torch.current_graph_task_id() != -1] = True
        if not getattr(func, "is_view", False):
            tensors = {storage_key(t): t for t in _torch.tree_leaves((args, kwargs, out))
                       if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            own = sum(round_size(t.untyped_storage().nbytes()) for key, t in tensors.items()
                      if key not in self.state)
            grads = sum(round_size(p.grad.untyped_storage().nbytes())
                        for p in self.state.values()
                        if p.grad is not None and storage_key(p.grad) not in tensors)
            if own + grads > self.largest[1]:
                self.largest = (str(packet), own + grads)
            if _torch.current_graph_task_id() != -1:
                self._note_backward(str(packet), tensors, own)
        return out

    def _note_backward(self, name: str, tensors: dict[int, torch.Tensor], own: int) -> None:
        """Note the op's outputs as the backward's, and its working set with the rest held."""
        for key, t in tensors.items():
            if key not in self.made and key not in self.state and key in self._live:
                self.made[key] = round_size(t.untyped_storage().nbytes())
        self.made = {k: b for k, b in self.made.items() if k in self._live}
        held = own + sum(b for k, b in self.made.items() if k not in tensors)
        if held > self.held[1]:
            self.held = (name, held)


def step_lower_bound(model: nn.Module, example_input: Any, on: str = "h100") -> StepLowerBound:
    """:class:`StepLowerBound` of one plain training step of ``model`` on card ``on``."""
    target = card(on)
    # run_on_card tracks the fake parameters and buffers first (one per unique tensor), then
    # the input: the first ``n`` tracked tensors are the state.
    n = len({id(t) for t in [*model.parameters(), *model.buffers()]})

    class _Bound(_WorkingSets):  # the fake state exists only inside run_on_card
        def track(self, *tracked: Any) -> None:
            self.state = {storage_key(t): t for t in tracked[:n]}
            super().track(*tracked)

    counter = _Bound([], target.workspace)
    run_on_card(model, example_input, target, counter=counter)
    params = sum(round_size(t.untyped_storage().nbytes()) for t in counter.state.values())
    # run_on_card drops the fake gradients after the step: one per parameter that trains
    grads = sum(round_size(t.untyped_storage().nbytes()) for t in counter.state.values()
                if t.requires_grad)
    workspaces = target.workspace * sum(counter.matmul.values())
    return StepLowerBound(params, grads, workspaces, counter.largest, counter.held)
