"""The region behind :func:`zoo.checkpoint`: non-reentrant checkpointing through saved-tensor
hooks, one recompute per backward call, in as little Python per region as the contract allows."""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch
from . import keywords
from .backward_call import _CAN_LET_GO, _backward_call, _last_recompute
from .recompute import ForwardState, _local, _RecomputeContext

# --------------------------------------------------------------------------------------------
# The region's rules. Non-reentrant checkpointing through saved-tensor hooks, in as little Python
# as the contract allows; the code that enforces each rule cites it ("Rule 3").
#
# Rule 1. Packing: autograd hands every tensor the region's forward saves to ``pack``, which keeps
#   a small empty slot instead (a module's parameter, or a view of one, is kept as it is, with its
#   version: it lives on anyway, and is never recomputed; changed in place before backward, as
#   by an optimizer step, it is refused as autograd refuses it in the plain model).
# Rule 2. One recompute per backward call: the first ``unpack`` in a backward call (one autograd
#   graph task, or one ``torch.utils.checkpoint.GraphExecGroup``) reruns the region once, filling
#   the slots in the order the forward created them.
# Rule 3. A recomputed tensor lives no longer than in the plain model: each slot is emptied as its
#   node consumes it, and whatever that backward call did not consume is dropped when it ends (a
#   partial backward, e.g. ``autograd.grad`` of an intermediate, holds nothing afterwards; the next
#   backward call recomputes).
# Rule 4. Early stop: the rerun stops as soon as the last slot is filled (ops after the last saved
#   tensor are not recomputed).
# Rule 5. No op of its own: what a region adds to the host's work is Python only. The recompute
#   runs on the forward's own inputs (no detached copies) and each recomputed tensor goes to its
#   slot as it is; the recompute's own graph keeps only indices into a list that lives while the
#   recompute runs, so ``torch.autograd.grad`` inside the region works, also during the forward
#   (the region is then recomputed up to where the forward is), and no graph holds a recomputed
#   tensor afterwards.
# Rule 6. Letting go early: once a backward call has recomputed the region, and that call will
#   run every node still holding one of its slots without keeping the graph, no later call can
#   ask for a recompute; the region then lets go of its inputs (and ``fn``) at once instead of
#   when its last node has run, as a compiled backward frees a saved input after its last use.
# Rule 7. Nesting: a region nested in another hands its inputs to the outer one (``_SaveInputs``),
#   which then recomputes them when the inner region needs them. The outer one may be
#   torch's own checkpoint: its forward and its recompute must see the same saved tensors. A
#   region made under a user's saved-tensor hooks (``save_on_cpu``) hands them its inputs the
#   same way, as torch's checkpoint does, so that they move what the region keeps.
# Rule 8. Determinism: the recompute must save as many tensors as the forward, of the same shapes
#   (``determinism_check="none"`` skips the shapes), no input may change in place between the
#   forward and the recompute, and the recompute may save no module parameter where the forward
#   saved another tensor (parameters swapped in for the forward only: functional_call), and a
#   saved tensor that requires grad may not change in place after it is saved (autograd's own
#   version check, which saved-tensor hooks bypass); otherwise backward raises, naming the cause.
#
# torch.utils.checkpoint's non-reentrant path follows the same rules (its "Nestable Checkpoint"
# note) with more bookkeeping per region (per-task handle maps, metadata, device probing);
# python scripts/benchmark.py checkpoint --small measures the difference.
# --------------------------------------------------------------------------------------------
_engine = _torch.execution_engine
_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor  # an activation's class: never a Parameter (saves the metaclass check)
_next_node = _torch.get_sequence_nr or (lambda: 0)
_version = _torch.tensor_version
# Rule 7: whether saved-tensor hooks not the zoo's own are in force, which get a region's inputs:
# torch's checkpoint (a region made in its forward or recompute is nested in it) or a user's
# (``save_on_cpu`` moves them, as it moves torch's checkpoint's).
_outer_hooks = _torch.foreign_saved_tensors_hooks


class _Slot:
    """Stands in the autograd graph for one tensor the region saved, until backward needs it.

    ``node``: the sequence number of the autograd node that saved it (the node made last on this
    thread when the tensor was packed: an op's node exists before its saved tensors are packed).
    """

    __slots__ = ("value", "shape", "node", "version", "__weakref__")

    def __init__(self, shape: torch.Size, node: int):
        self.value: torch.Tensor | None = None
        self.shape = shape
        self.node = node
        self.version = 0  # the recomputed tensor's version when it was saved (Rule 8)


class _Kept:
    """A parameter (or a view of one) the region saved, kept as it is (Rule 1), with its
    version when saved: a view shares its parameter's version counter."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, _version(tensor)

    def unpack(self) -> torch.Tensor:
        if _version(self.tensor) != self.version:
            raise RuntimeError(
                "zoo.checkpoint: a parameter saved for backward by a checkpointed region was "
                f"modified in place before backward (version {self.version} -> "
                f"{_version(self.tensor)}), as by an optimizer step or a weight update between "
                "forward and backward; the plain model's backward refuses it too. Change "
                "parameters only after backward.")
        return self.tensor


class _StopRecompute(Exception):
    """Ends a recompute early: every saved tensor still needed has been rebuilt."""


class _SaveInputs(torch.autograd.Function):
    """Saves a nested region's inputs as saved tensors of the enclosing region's forward.

    A region created inside another region's forward (or recompute) hands the inputs that
    require grad to this no-op Function, so they go through the outer region's saved-tensor
    hooks: the outer region owns them and recomputes them when the inner one needs them, instead
    of the inner region holding them for the whole step (torch's "Nestable Checkpoint" rule 2).
    Its node is never reached by backward; it only keeps the saved tensors.
    """

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return tensors[0].new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:
        return (None,) * len(ctx.needs_input_grad)


# A recompute that saves a module's parameter where the forward saved another tensor: the
# parameters were swapped in for the forward only (as by torch.func.functional_call), and the
# recompute, in backward, would compute with the module's own. torch.utils.checkpoint gives such
# a region's gradients without a word.
_SWAPPED = (
    "the recompute read a module's own parameter where the forward saved another tensor: the "
    "parameters were swapped in for the forward only (torch.func.functional_call, "
    "torch.nn.utils.stateless), so the recompute would compute with other weights. Call "
    "functional_call inside the checkpointed function (zoo.checkpoint(lambda p, t: "
    "functional_call(block, p, t), params, x)), or checkpoint nothing for such calls.")

# A tensor the region saved, then changed in place: the plain model's backward refuses it
# (autograd's version check); the recompute replays the change, so the region must refuse it too.
# torch.utils.checkpoint instead hands backward the changed tensor (wrong gradients, no word).
_OVERWRITTEN = (
    "zoo.checkpoint: a tensor saved for backward inside a checkpointed region was modified in "
    "place after it was saved (as 'sigmoid_().mul_(2)' overwrites what sigmoid_ saved), so its "
    "gradient would be wrong; the plain model's backward refuses it too ('modified by an "
    "inplace operation'). Use the out-of-place op (mul instead of mul_).")

_SAVED = object()  # stands in a nested region's arguments for an input the outer region keeps

# Called with (args, kwargs) of every region that keeps its own inputs (one not nested in another
# region): the planner's profiler counts them as kept, as autograd's saved tensors are.
observers: list[Callable[[tuple, dict], None]] = []

# Called with (fn, args, kwargs, save_ops) of every region not nested in another, before its
# forward: the host-cost benchmark (zoo.memory.host) replays each region on its own to count
# the ops its recompute must redo.
recorders: list[Callable[[Callable, tuple, dict, Any], None]] = []


def observing(pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """Mark ``pack``, a saved-tensor hook, as one that only watches what is saved (a
    measurement's: the host-cost floor counts a region's saved tensors with one): regions made
    under it keep their inputs as at top level, where other hooks get them (Rule 7)."""
    pack.zoo_observes = True  # type: ignore[attr-defined]
    return pack


def _inside_region() -> int:
    """How many zoo regions are running their forward or recompute on this thread."""
    return getattr(_local, "inside", 0)


class _Region:
    """One checkpointed call: its inputs, the forward's RNG/autocast state and its saved slots."""

    __slots__ = ("fn", "args", "kwargs", "versions", "forward", "opts", "slots", "filled",
                 "in_forward", "last", "stop_at_last_slot", "call", "saver", "saved_versions",
                 "live", "first")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, forward: ForwardState,
                 opts: keywords.Options):
        self.fn, self.args, self.kwargs, self.forward, self.opts = fn, args, kwargs, forward, opts
        self.versions = [(t, _version(t)) for t in (*args, *kwargs.values())
                         if isinstance(t, torch.Tensor)]
        self.saver: torch.Tensor | None = None  # a nested region's: see save_through_outer
        self.saved_versions: list[int] = []
        self.first = _next_node()  # the sequence number of the region's first autograd node
        if _inside_region() or _outer_hooks():
            self.save_through_outer()
        elif observers:
            for observe in observers:
                observe(args, kwargs)
        self.slots: list[weakref.ref[_Slot] | None] = []  # None: a parameter, kept as it is
        self.filled = 0
        self.in_forward = True
        self.last: weakref.ref[torch.Tensor] | None = None
        self.stop_at_last_slot = True  # a recompute during the forward stops where the forward is
        self.call: Any = None  # the backward call the slots' values were recomputed for

    def save_through_outer(self) -> None:
        """Rule 7: hand the inputs that require grad to the enclosing region, or to the saved-tensor
        hooks in force (_SaveInputs)."""
        tensors = [t for t in (*self.args, *self.kwargs.values())
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        # The no-op's output, not its node: in torch 2.11 a Python handle of a node does not
        # keep the node (and so its saved tensors) alive; the output does, on every torch.
        self.saver = _SaveInputs.apply(*tensors)
        self.saved_versions = [_version(t) for t in tensors]

    def forget_saved_inputs(self) -> None:
        """After the forward: let go of the inputs the enclosing region keeps for us."""
        kept = lambda v: _SAVED if isinstance(v, torch.Tensor) and v.requires_grad else v  # noqa
        self.args = tuple(kept(a) for a in self.args)
        self.kwargs = {k: kept(v) for k, v in self.kwargs.items()}
        self.versions = [(t, v) for t, v in self.versions if not t.requires_grad]

    def inputs(self) -> tuple[Any, dict]:
        """The arguments for a recompute: the forward's own (a nested region's from the enclosing
        region, which recomputes them if needed).

        They are passed as they are, not as new leaves: the recompute's graph then hangs off the
        forward's, which costs nothing (backward never runs through it; its saved tensors go to
        the slots) and spares a detach per input.
        """
        if self.saver is None:
            return self.args, self.kwargs
        tensors = self.saver.grad_fn.saved_tensors
        for tensor, version in zip(tensors, self.saved_versions):
            if _version(tensor) != version:
                self.changed_in_place(version, _version(tensor))
        saved = iter(tensors)
        get = lambda v: next(saved) if v is _SAVED else v  # noqa: E731
        return [get(a) for a in self.args], {k: get(v) for k, v in self.kwargs.items()}

    def run(self) -> Any:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        inside = _local.inside = _inside_region() + 1
        forwards = _local.forwards
        forwards.append(self.forward)  # layers advancing their own state record it there
        try:
            if self.opts.contexts is None:
                with hooks:
                    out = self.fn(*self.args, **self.kwargs)
            else:
                with hooks, self.opts.contexts[0]:
                    out = self.fn(*self.args, **self.kwargs)
        finally:
            _local.inside = inside - 1
            forwards.pop()
        self.in_forward = False
        if self.saver is not None:
            self.forget_saved_inputs()
        # A region whose output is the last tensor it saved (it ends in ReLU, sigmoid, ...) has
        # nothing left to skip after the last slot: its recompute runs to the end instead of
        # being stopped by an exception, which costs more than the op it would skip.
        self.stop_at_last_slot = self.opts.early_stop and (
            self.last is None or self.last() is not out)
        self.last = None
        return out

    def pack(self, tensor: torch.Tensor) -> _Slot | _Kept:
        if tensor.__class__ is not _Tensor and isinstance(tensor, _Parameter) or \
                tensor._base.__class__ is _Parameter:
            # Rule 1: a module's parameter (or a view of one: a Linear's transposed weight)
            # lives on anyway: it is kept as it is, never recomputed, and its place in the
            # recompute's order stays empty.
            self.slots.append(None)
            self.last = None
            return _Kept(tensor)
        slot = _Slot(tensor.shape, _next_node() - 1)
        self.slots.append(weakref.ref(slot))
        self.last = weakref.ref(tensor)
        return slot

    def unpack(self, slot: _Slot | _Kept) -> torch.Tensor:
        if slot.__class__ is not _Slot:
            return slot.unpack()  # kept as it is (see pack)
        call = _backward_call()
        if call != self.call or call == -1:  # Rule 2: once per backward call
            self.recompute(call)
        value = slot.value
        if value is None:
            overlap = "" if isinstance(call, int) else (
                " Performing two backward calls that overlap is not allowed under one "
                "torch.utils.checkpoint.GraphExecGroup.")
            raise RuntimeError(
                "zoo.checkpoint: a tensor saved by a checkpointed region was already unpacked "
                "once in this backward call (recomputed tensors are freed as they are used)."
                f"{overlap} If a custom autograd.Function reads ctx.saved_tensors twice in its "
                "backward, read it once and keep the tuple.")
        slot.value = None  # Rule 3: emptied as its node consumes it
        if _version(value) != slot.version and value.requires_grad:  # Rule 8
            raise RuntimeError(_OVERWRITTEN)
        if call == -1:  # read outside any backward (grad_fn._saved_*): keep nothing
            _empty_slots(self.slots)
        return value

    def recompute(self, call: Any) -> None:
        if self.fn is None:
            raise RuntimeError(
                "zoo.checkpoint: a checkpointed region let go of its inputs after a backward call "
                "that was to run all of its nodes, but another backward call needs its recompute "
                "(was that backward interrupted?); run the forward again, or pass "
                "retain_graph=True to a backward that must be repeated.")
        for tensor, version in self.versions:  # Rule 8: inputs unchanged since the forward
            if _version(tensor) != version:
                self.changed_in_place(version, _version(tensor))
        args, kwargs = self.inputs()
        total, self.filled, self.call = len(self.slots), 0, call
        contexts = self.opts.contexts
        inside = _local.inside = _inside_region() + 1
        live = self.live = []
        try:
            with torch.enable_grad(), _RecomputeContext(self.forward), \
                    torch.autograd.graph.saved_tensors_hooks(self.fill, live.__getitem__):
                if contexts is None:
                    self.fn(*args, **kwargs)
                else:
                    if self.opts.logs is not None:
                        self.opts.logs[1].ops.clear()
                    with contexts[1]:
                        self.fn(*args, **kwargs)
        except _StopRecompute:
            pass
        finally:
            _local.inside = inside - 1
            live.clear()
        if self.filled < total:  # Rule 8
            self.fail("the recomputed region saved fewer tensors for backward than its forward "
                      f"did ({self.filled} < {total}), so it is not deterministic (does it branch "
                      "on random numbers, global state or tensor values?). Make the region "
                      "deterministic given its inputs, or leave it out of the checkpoint.")
        if isinstance(call, int) and call >= 0:  # Rule 3: drop the unused when the call ends
            _engine.queue_callback(functools.partial(_empty_slots, self.slots))
            if _CAN_LET_GO and self.saver is None and not self.in_forward and \
                    _last_recompute(self.slots, self.first):
                self.let_go()

    def let_go(self) -> None:
        """Rule 6: drop the inputs, ``fn`` and the forward's state: no recompute can follow.

        A saved input then lives as long as the plain model would keep it, not until the
        region's last node has run (in a DenseNet, a layer's new maps are freed once the next
        layer's concatenation is rebuilt). A region nested in another never gets here (its
        inputs belong to the enclosing region), nor does one whose recompute served a graph
        kept for another backward (``retain_graph=True``, double backward), a backward call
        that leaves some of its nodes unrun (``torch.autograd.grad`` of a part, an output not in
        the loss), or a ``GraphExecGroup``.
        """
        self.fn = self.args = self.kwargs = self.forward = None
        self.versions = []

    def fill(self, tensor: torch.Tensor) -> int:
        """Pack hook of the recompute: hand the tensor to its slot (Rule 5).

        The slot takes the tensor as it is, its recompute graph attached; the recompute's graph
        keeps only an index into ``live``, a list emptied when the recompute ends (it serves
        ``autograd.grad`` inside the region while it runs). So no graph holds a recomputed
        tensor: each is freed as soon as its node has used it, and no detach is needed.
        """
        index, total = self.filled, len(self.slots)
        self.filled = index + 1
        if index >= total:
            if self.in_forward or self.opts.early_stop:  # Rule 4; else Rule 8
                raise _StopRecompute  # what the forward saved is all rebuilt; the rest is unused
            self.fail("the recomputed region saved more tensors for backward than its forward "
                      f"did (more than {total}), so it is not deterministic given its inputs.")
        ref = self.slots[index]
        slot = None if ref is None else ref()  # None: kept as it is, or its node already ran
        if slot is not None:
            if slot.shape != tensor.shape and self.opts.check_shapes:  # Rule 8
                self.fail(f"saved tensor {index} of the region had shape {tuple(slot.shape)} in "
                          f"the forward but {tuple(tensor.shape)} in the recompute; the region "
                          "is not deterministic given its inputs.")
            if tensor._base.__class__ is _Parameter or tensor.__class__ is not _Tensor and \
                    isinstance(tensor, _Parameter):  # Rule 8: the forward saved no parameter
                self.fail(_SWAPPED)
            slot.value = tensor
            slot.version = _version(tensor)
        if index + 1 == total and self.stop_at_last_slot:  # Rule 4
            raise _StopRecompute
        self.live.append(tensor)
        return index

    def changed_in_place(self, before: int, after: int) -> None:
        raise RuntimeError(
            "zoo.checkpoint: an input of a checkpointed region was modified in place after "
            f"the region started (version {before} -> {after}), so the recompute would see "
            "other values. Clone the input before changing it, or keep in-place ops on a "
            "region's input out of the region.")

    def fail(self, message: str) -> None:
        raise RuntimeError(f"zoo.checkpoint: {message}{self.opts.debug_report()}")


def _empty_slots(slots: list[weakref.ref[_Slot] | None]) -> None:
    """Drop what a backward call recomputed but did not use (called when that call ends).

    It gets the region's slot list, not the region: holding the region would keep its inputs
    alive until the end of the whole backward pass.
    """
    for ref in slots:
        slot = None if ref is None else ref()
        if slot is not None:
            slot.value = None
