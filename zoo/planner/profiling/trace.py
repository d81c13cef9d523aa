"""One instrumented fake training step of a model's chain, phase by phase: what the profiler reads.

The step runs under ``FakeTensorMode`` inside a :class:`~zoo.memory.tracker.StepCounter` (live
bytes after every op and FLOPs; under ``zoo.memory.on_card``, the card's). The chain's blocks
run in an ``order`` (the chain, or a subset whose skipped blocks keep the shape), grouped by
``segments`` stored or checkpointed as a plan runs them. Hooks mark each block's forward start
``("F", i)`` and end ``("G", i)``, its output's gradient ready ``("B", i)``, a checkpointed
segment's recompute done ``("BR", i)``, the head ``("head",)`` and what follows the chain's
backward ``("tail",)``; a saved-tensor hook records what each block saves."""
from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ..._torch import reparametrize_module
from ...checkpoint import checkpoint, is_recomputing, region
from ...memory.fake import FakeStep
from ...memory.precision import step_precision
from ...memory.training import backward, forward_loss
from ...memory.cards.on_card import held_from_start, step_counter
from ...memory.tracker import StepCounter

__all__ = ["Trace", "traced_step", "grad_bytes"]


def grad_bytes(t: torch.Tensor, counter: StepCounter | None = None) -> int:
    """Bytes of a gradient of ``t`` (none for integer tensors), as ``counter`` would count a
    new one (the CPU's by default)."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    return (counter or StepCounter).request_bytes(t.numel() * t.element_size(), t.device)


class Trace:
    """Memory level, FLOPs and saved tensors of one step, by phase (module docstring).

    Per phase: ``mark`` (level when it began), ``peak``, ``flops``, ``rflops`` (FLOPs run while
    recomputing), ``grads`` (parameter gradients created). Per position ``i``: ``saved[i]``
    (storage -> bytes autograd saved in its forward, parameters excluded), ``at_last_pack[i]``
    (the forward's peak when it saved its last tensor), ``after[i]`` (the level once it has
    returned and the chain has let go of its input), its input's and output's storage and
    bytes, ``out_dgrad[i]`` (bytes of its output's gradient), ``alias[i]`` (its output is its
    input's storage: an in-place block) and ``cached[i]`` (bytes of the casts of parameters
    autocast made in its forward and still holds at its end, unsaved: the cache keeps a
    cast until the autocast block exits, ``torch.autocast(cache_enabled=True)``)."""

    def __init__(self, counter: StepCounter, param_keys: set[int]) -> None:
        self.counter, self.param_keys = counter, param_keys
        self.phase: tuple = ("pre",)
        self.peak: dict[tuple, int] = {}
        self.flops: dict[tuple, int] = {}
        self.rflops: dict[tuple, int] = {}
        self.grads: dict[tuple, int] = {}
        self.mark: dict[tuple, int] = {}
        self.saved: dict[int, dict[int, int]] = {}
        self.at_last_pack: dict[int, int] = {}
        self.after: dict[int, int] = {}
        self.in_key: dict[int, int] = {}
        self.out_key: dict[int, int] = {}
        self.in_bytes: dict[int, int] = {}
        self.out_bytes: dict[int, int] = {}
        self.out_dgrad: dict[int, int] = {}
        self.alias: dict[int, bool] = {}
        self.meta: dict[int, tuple] = {}  # position -> (input's, output's shape and dtype)
        self.regions: dict[int, list[set[int]]] = {}  # position -> its own regions' inputs
        self.cached: dict[int, int] = {}
        self._casts: dict[int, list[tuple[weakref.ref, int, int]]] = {}  # (cast, key, bytes)
        self.length = 0
        self.stopped = False  # the step ended after its forward
        self._last_flops = 0

    def op_done(self) -> None:
        mem, flops = self.counter.current, self.counter.flops
        delta, self._last_flops = flops - self._last_flops, flops
        ph = self.phase
        if mem > self.peak.get(ph, -1):
            self.peak[ph] = mem
        self.flops[ph] = self.flops.get(ph, 0) + delta
        if delta and is_recomputing():
            self.rflops[ph] = self.rflops.get(ph, 0) + delta

    def enter(self, phase: tuple, quiet: bool = False) -> None:
        """Start ``phase`` at the current level (``quiet``: its peak counts only its own ops)."""
        mem = self.counter.current
        self.mark[phase] = mem
        if not quiet:
            self.peak[phase] = max(self.peak.get(phase, mem), mem)
        self.phase = phase

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase[0] == "F" and not is_recomputing():
            i = self.phase[1]
            self.at_last_pack[i] = self.peak.get(self.phase, self.counter.current)
            key = self.counter.key(t)
            if key not in self.param_keys:
                self.saved.setdefault(i, {})[key] = self.counter.bytes_of(t)
        return t

    def note_copy(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """A cast ran: note it when it casts a parameter in a block's first forward."""
        if self.phase[0] == "F" and not is_recomputing() \
                and self.counter.key(source) in self.param_keys:
            self._casts.setdefault(self.phase[1], []).append(
                (weakref.ref(out), self.counter.key(out), self.counter.bytes_of(out)))

    def _cached_at_end(self, i: int) -> int:
        """Bytes of block ``i``'s parameter casts alive at its end that it did not save."""
        saved = self.saved.get(i, {})
        return sum(b for ref, key, b in self._casts.pop(i, ())
                   if ref() is not None and key not in saved)

    def region_inputs(self, args: tuple, kwargs: dict) -> None:
        """A block's own checkpoint keeps its inputs itself, out of autograd's sight: count them
        as saved by the block, as ``pack`` counts saved tensors (and note which they are)."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        for t in tensors:
            self.pack(t)
        if self.phase[0] == "F" and not is_recomputing():
            self.regions.setdefault(self.phase[1], []).append(
                {self.counter.key(t) for t in tensors if t.requires_grad})

    def note_grad(self, g: torch.Tensor) -> None:
        self.grads[self.phase] = self.grads.get(self.phase, 0) + grad_bytes(g, self.counter)

    def block_done(self, i: int) -> None:
        """Block ``i`` has returned and the chain holds its output instead of its input: note
        the level (in its first forward only)."""
        if not is_recomputing():
            self.after[i] = self.counter.current

    def call_block(self, i: int, block: Callable, x: torch.Tensor) -> torch.Tensor:
        if is_recomputing():  # a recompute runs inside the segment's backward phase
            return block(x)
        self.in_key[i], self.in_bytes[i] = self.counter.key(x), self.counter.bytes_of(x)
        if i == 0 and x.requires_grad:
            x.register_hook(lambda g: self.enter(("tail",)))
        self.enter(("F", i))
        y = block(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"chain block {i} returned {type(y).__name__}; the planner needs "
                            "blocks that take and return one tensor")
        self.out_key[i], self.out_bytes[i] = self.counter.key(y), self.counter.bytes_of(y)
        self.out_dgrad[i] = grad_bytes(y, self.counter) if y.requires_grad else 0
        self.meta[i] = ((tuple(x.shape), x.dtype), (tuple(y.shape), y.dtype))
        self.alias[i] = self.out_key[i] == self.in_key[i]
        self.cached[i] = self._cached_at_end(i)
        if y.requires_grad:
            y.register_hook(lambda g, i=i: self.enter(("B", i)))
        self.enter(("head",) if i == self.length - 1 else ("G", i))
        return y


Segments = Sequence[tuple[int, int, Any]]  # (start, stop, False | True | inner segments)


class _TracedChain:
    """The chain as a traced step runs it, set as the model's ``run_chain`` for that step: the
    blocks ``order`` (default: all) by ``segments`` (positions in ``order``), each block in
    ``block_mode``, every block called through ``trace``."""

    def __init__(self, model: nn.Module, trace: Trace, segments: Segments,
                 block_mode: str | None, order: Sequence[int] | None) -> None:
        self.model, self.trace, self.segments = model, trace, segments
        self.block_mode, self.order = block_mode, order

    def __call__(self, blocks: Sequence[Callable], h: torch.Tensor) -> torch.Tensor:
        blocks = list(blocks) if self.order is None else [blocks[j] for j in self.order]
        self.trace.length = len(blocks)
        return self.run(blocks, self.segments, h)

    def run(self, blocks: Sequence[Callable], plan: Segments, h: torch.Tensor) -> torch.Tensor:
        for a, b, ck in plan:
            h = checkpoint(self.segment(blocks, a, b, ck), h) if ck is not False else \
                self.run_blocks(blocks, a, b, h)
        return h

    def run_blocks(self, blocks: Sequence[Callable], a: int, b: int,
                   h: torch.Tensor) -> torch.Tensor:
        for i in range(a, b):
            block = blocks[i] if self.block_mode is None else partial(
                self.model.run_chain_block, blocks[i], mode=self.block_mode)
            h = self.trace.call_block(i, block, h)
            self.trace.block_done(i)
        return h

    def segment(self, blocks: Sequence[Callable], a: int, b: int, inner: Any) -> Callable:
        """A checkpointed segment's body; its second call is the region's recompute (a region is
        made afresh each time the code around it runs), after which its backward goes on."""
        calls = [0]

        def body(h: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            try:
                return self.run(blocks, inner, h) if isinstance(inner, list) else \
                    self.run_blocks(blocks, a, b, h)
            finally:
                if calls[0] == 2:
                    self.trace.enter(("BR", b - 1), quiet=True)
        return body


def _enter_step(stack: contextlib.ExitStack, model: nn.Module, fake: FakeStep, trace: Trace,
                kernels: Any, saves: bool) -> None:
    """Enter what a traced step runs under: the fake state standing in for the model's (until
    backward has recomputed too), the step's precision, the counter and its kernels, the hook
    that records saved tensors (``saves``), and warnings of no use to the planner held back."""
    stack.enter_context(fake.mode)
    stack.enter_context(step_precision())
    stack.enter_context(kernels)
    stack.enter_context(trace.counter)
    if saves:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(trace.pack, _same))
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*saved_tensors_hooks.*selective",
                            category=FutureWarning)
    stack.enter_context(reparametrize_module(model, fake.state))


def traced_step(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[Any], torch.Tensor],
                segments: Segments, block_mode: str | None = None,
                order: Sequence[int] | None = None, fake: FakeStep | None = None,
                stop: Callable[[Trace], bool] | None = None, saves: bool = True
                ) -> tuple[Trace, int, int]:
    """One fake training step of ``model`` whose chain runs the blocks ``order`` (default: all)
    by ``segments`` (positions in ``order``; a segment is stored, checkpointed, or checkpointed
    with an inner plan its recompute runs), each block in ``block_mode``: (trace, peak bytes,
    FLOPs). Nothing in ``model`` is changed. ``fake``: the fake state to run on (made for
    this step when not given). ``stop``: asked after the forward; when it says the forward's
    trace is all that is needed, the step ends there (``trace.stopped``: no backward ran).
    ``saves=False``: no saved-tensor hook (``trace.saved`` and ``at_last_pack`` stay empty; a
    block's own regions are still seen): autograd then passes each saved tensor as it is,
    where a hook makes it detach every one that is not an op's output first (a dispatched op,
    a tenth of a fake step's time), for a step whose marks, peaks and FLOPs are all it needs."""
    fake = fake or FakeStep(model, x)
    fake.clear()
    counter, kernels = step_counter()  # the CPU's, or a card's under zoo.memory.on_card
    counter.track(held_from_start(fake))
    trace = Trace(counter, {counter.key(t) for t in fake.tensors})
    counter.on_op, counter.on_copy = trace.op_done, trace.note_copy
    handles = [p.register_hook(trace.note_grad) for p in fake.tensors
               if p.requires_grad and p.is_leaf]
    previous = model.checkpoint_plan
    model.set_checkpoint_plan([(0, len(model.checkpoint_chain()), False)])
    # an instance attribute: shadows ZooModel.run_chain for this step
    model.run_chain = _TracedChain(model, trace, segments, block_mode, order)
    region.observers.append(trace.region_inputs)
    try:
        with contextlib.ExitStack() as stack:
            _enter_step(stack, model, fake, trace, kernels, saves)
            loss = forward_loss(model, fake.input, loss_fn)
            trace.stopped = stop is not None and stop(trace)
            if not trace.stopped:
                backward(loss)
            del loss
    finally:
        region.observers.remove(trace.region_inputs)
        del model.run_chain
        model.set_checkpoint_plan(previous)
        for h in handles:
            h.remove()
        fake.clear()
    if trace.length == 0:
        raise ValueError(f"{type(model).__name__}.forward never called run_chain with a plan "
                         "set: the planner cannot see its chain of blocks")
    return trace, counter.peak, counter.flops


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
