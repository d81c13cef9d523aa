"""Fake copies of a model's state for a training step under ``FakeTensorMode``.

``step.py`` and the planner's profiler both run the training step (:mod:`.training`) on these;
this file imports nothing of the package but its fake mode, the batch and the optimizer's
mirror, which keeps the package free of import circles.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .fake_mode import PlannerFakeMode
from .inputs import Batch
from .optimizer import Optimizers, as_optimizers, fill_state, mirror, state_tensors, unstepped

__all__ = ["fake_state", "FakeStep", "collector_paused"]


def fake_state(model: nn.Module, fake: Any, copies: dict[int, torch.Tensor] | None = None
               ) -> dict[str, torch.Tensor]:
    """Fake copies of ``model``'s parameters and buffers by name, for ``_reparametrize_module``;
    tied tensors (GPT-2's head and embedding) get one shared copy under every name, a module
    reached by several names (one block called in a loop) is named once. ``copies``:
    filled with id of each real tensor -> its fake copy."""
    copies = {} if copies is None else copies
    state: dict[str, torch.Tensor] = {}
    owners: set[tuple[int, str]] = set()
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        prefix, _, attr = name.rpartition(".")
        owner = (id(model.get_submodule(prefix)), attr)
        if owner in owners:  # one module under two names (a block called in a loop): swapping
            continue  # it in twice would put the fake back in for good on the way out
        owners.add(owner)
        if id(t) not in copies:
            copy = fake.from_tensor(t.detach())
            copies[id(t)] = copy.requires_grad_(t.requires_grad) if t.is_leaf else copy
        state[name] = copies[id(t)]
    return state


class FakeStep:
    """Fake copies of a model's parameters and buffers and of a batch, made once for the many
    fake steps of a planning (making them costs a few hundred microseconds per tensor): the
    ``mode`` they belong to (a ``PlannerFakeMode``: ``FakeTensorMode`` with quicker cache
    keys), ``state`` by name, the unique ``tensors``, the ``input`` (a
    :class:`~.inputs.Batch`), and with ``optimizer`` (one or several, :mod:`.optimizer`) their
    ``optimizers`` over the fake parameters, holding the state one step leaves (its tensors are
    among ``tensors``; :meth:`drop_untrained_state` keeps it to the parameters a step trains),
    stepped by :meth:`step_optimizers`. :meth:`micro_batches` gives an accumulating step further
    batches of the input's shapes. :meth:`clear` drops the gradients a step left on them, but
    those of trainable parameters no optimizer steps, which a loop's ``zero_grad`` leaves and
    so holds from the step's start (:meth:`drop_untrained_state` finds which get one)."""

    def __init__(self, model: nn.Module, example_input: Any,
                 optimizer: Optimizers = None) -> None:
        self.mode = PlannerFakeMode()
        copies: dict[int, torch.Tensor] = {}
        self.state = fake_state(model, self.mode, copies)
        self.tensors = list({id(t): t for t in self.state.values()}.values())
        self._own = list(self.tensors)  # the model's, without the optimizer's state
        self.input = Batch.of(example_input).map(
            lambda x: self.mode.from_tensor(x.detach()).requires_grad_(x.requires_grad))
        self.optimizers: tuple[torch.optim.Optimizer, ...] = ()
        self._filled: set[torch.Tensor] = set()  # parameters whose state the filling step made
        self.drops = 0  # how many times drop_untrained_state dropped some
        self._more: list[Batch] = []  # micro-batches after the first (micro_batches)
        optimizers = as_optimizers(optimizer)
        self._unstepped = [copies[id(p)] for p in unstepped(model, optimizers)]
        self._held: list[torch.Tensor] = []  # those of them a step gives a gradient
        for opt in optimizers:
            with self.mode:
                fake_opt = mirror(opt, copies)
                made = set(fake_opt.state)  # Adagrad's, made by its constructor
                fill_state(fake_opt)
            self._filled |= set(fake_opt.state) - made
            self.optimizers += (fake_opt,)
        self.tensors += self._state_tensors()

    def _state_tensors(self) -> list[torch.Tensor]:
        return [t for opt in self.optimizers for t in state_tensors(opt)]

    def step_optimizers(self) -> None:
        """After a step's backward: each optimizer's ``step()`` in the loop's order, then each
        one's ``zero_grad()``, as a loop runs them (:meth:`drop_untrained_state` first)."""
        if not self.optimizers:
            return
        self.drop_untrained_state()
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def micro_batches(self, k: int) -> list[Batch]:
        """``k`` micro-batches for a step that accumulates them: :attr:`input` and ``k - 1``
        fake batches of its shapes, dtypes and devices, each with storages of its own, as a
        loop over a list of micro-batches has them (a model's view of one, as a classifier's
        of its labels, is then one more storage each; values, which fake tensors lack, decide
        no byte)."""
        while len(self._more) < k - 1:
            with self.mode:
                self._more.append(self.input.map(
                    lambda t: torch.empty_like(t).requires_grad_(t.requires_grad)))
        return [self.input, *self._more[:k - 1]]

    def drop_untrained_state(self) -> None:
        """Called with a step's gradients made, before its optimizer's step: drops the state the
        filling step gave a parameter this step gives no gradient (a module the forward never
        calls: a real optimizer skips a parameter without one, so never makes its state; AdamW
        would otherwise count two copies of it). It also notes which trainable parameters no
        optimizer steps got a gradient, which :meth:`clear` then gives them from the start.
        When either changes, :attr:`drops` counts it: the step just run held state no real step
        holds, or lacked gradients the loop holds, so it is to be measured again."""
        held = {id(p) for p in self._held}
        grown = [p for p in self._unstepped if p.grad is not None and id(p) not in held]
        self._held += grown
        untrained = [p for p in self._filled if p.grad is None]
        if untrained:
            for p in untrained:
                for opt in self.optimizers:
                    opt.state.pop(p, None)
            self._filled -= set(untrained)
            self.tensors = self._own + self._state_tensors()
        if untrained or grown:
            self.drops += 1

    def clear(self) -> None:
        """Gradients as a loop's step starts them: none, but a gradient (of zeros: values
        decide no byte) on each trainable parameter no optimizer steps that a step reaches."""
        for t in self.tensors:
            t.grad = None
        for batch in (self.input, *self._more):
            for t in batch.tensors():
                t.grad = None
        if self._held:
            with self.mode:
                for p in self._held:
                    p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the duration (as it was after).

    A planning's fake steps make millions of short-lived objects, so the collector would run
    thousands of times, scanning the model's fake state each time: about 7% of a planning's
    time (DenseNet-BC-100, ResNet-110). What it would find is closures and bookkeeping, about
    ten megabytes, left to its next run: no fake tensor's storage lives in a reference cycle,
    so no byte the steps count depends on when the collector runs
    (tests/planner/test_planner_trace.py plans with it running every ten allocations too).
    Pausing it is process-wide: another thread's cycles wait for the planning's end as well."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
