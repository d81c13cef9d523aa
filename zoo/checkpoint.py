"""The zoo's one checkpoint primitive: activation checkpointing that is exactly the plain model.

Activation (gradient) checkpointing keeps only a region's inputs during the forward pass and runs
the region a second time during backward to rebuild what backward needs (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174). Done naively the second run
is not the first one, and users pay for that (see shared/seeds/):

* reentrant ``torch.utils.checkpoint`` gives parameters no gradient when no input requires grad
  (a frozen model that "trains 3x faster");
* BatchNorm updates its running statistics once per forward *and once per recompute*, so
  ``num_batches_tracked`` counts twice and ``running_mean``/``running_var`` drift from the plain
  model's (pytorch/pytorch#96136, still open);
* dropout must see the same random numbers on recompute, on every device it draws from;
* reentrant checkpoint runs a nested backward per region, which made nn.DataParallel 5x slower.

:func:`checkpoint` works like PyTorch's non-reentrant checkpoint (saved-tensor hooks, so gradients
reach parameters through the ordinary graph, once, with no nested backward), in its own lean
implementation (``_Region`` below: about a third less extra time per region than torch's, which
matters on models made of many small layers), and adds:

* a recompute guard that keeps every normalisation layer from updating its running statistics a
  second time in the recomputed forward (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm with
  tracked statistics, ``momentum=None`` included), so the buffers end exactly as one plain
  forward leaves them;
* RNG stashing for the CPU, for every CUDA device holding an input or the region's parameters,
  and for the current CUDA device (torch only stashes the devices of the positional inputs);
* :func:`is_recomputing`, so layers can tell a recompute from a forward (``zoo.nn.cp_BatchNorm2d``
  uses it, together with a backward-pass check, to be exact under anyone's checkpoint);
* optional selective recompute (``save_ops``): the outputs of the named ops are kept and only the
  cheap rest is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Megatron-LM). This path runs on ``torch.utils.checkpoint`` with the
  guard and RNG contexts passed as its ``context_fn``;
* ``torch.compile`` support with no graph break (``fullgraph=True``): while Dynamo traces, each
  region becomes torch's ``tag_activation_checkpoint`` subgraph and AOTAutograd's partitioner
  does the recompute inside the backward graph, where the contract holds by construction
  (BatchNorm statistics are written once, by the forward graph; dropout masks are kept, not
  redrawn; ``save_ops`` become torch's selective-checkpoint policy). tests/test_compile.py
  checks it against the eager plain model;
* errors that name the cause and the fix: an input changed in place before the recompute, a
  region that saves different tensors when recomputed.

It is a drop-in for ``torch.utils.checkpoint.checkpoint``: it takes torch's keywords (their
meaning for a zoo region: :mod:`zoo.checkpoint_keywords`) and passes PyTorch's own
non-reentrant checkpoint tests (ported in tests/test_checkpoint_torch_*.py), except for the
deliberate differences listed in :func:`checkpoint`.

Under ``torch.no_grad()`` / ``inference_mode`` it simply calls ``fn``: nothing is saved and
nothing is recomputed, so there is nothing to pay.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _python_dispatch
from torch.utils import checkpoint as torch_checkpoint

from zoo import checkpoint_keywords as keywords

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing", "split_segments",
           "state_bookkeeping"]

# --------------------------------------------------------------------------------------------
# Recompute state: a per-thread depth (autograd runs backward on one thread per device, and
# nn.DataParallel runs one forward thread per replica).
# --------------------------------------------------------------------------------------------
_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


def is_recomputing() -> bool:
    """True only while a :func:`checkpoint` region is being recomputed for backward, on this thread.

    Layers with side effects (running statistics, counters, logging) use it to act once per
    training step instead of once per forward *and* once per recompute. While ``torch.compile``
    traces it is False: a compiled graph never reruns a forward in Python (AOTAutograd recomputes
    inside the backward graph and applies buffer updates once, in the forward graph).
    """
    if torch.compiler.is_compiling():
        return False
    return _depth() > 0


# The dispatch mode that replays a selective-checkpoint region (``save_ops``) during backward:
# it insists that every op it sees was recorded in the forward, so ops that exist only in a
# recompute (the guard's counter correction and snapshots below, cp_BatchNorm's) run outside it.
_SAC_REPLAY_MODE = getattr(torch_checkpoint, "_CachedTorchDispatchMode", None)


@contextlib.contextmanager
def state_bookkeeping() -> Iterator[None]:
    """Run recompute-only bookkeeping on module state outside selective checkpoint's replay.

    Selective recompute (``save_ops``) replays the forward under a dispatch mode that matches each
    op against the forward's record and fails on any op the forward did not run. Copies of running
    statistics made only while recomputing are not part of the region's computation, so they run
    with that mode lifted; any other mode (FakeTensorMode, MemTracker) stays active.
    """
    mode = _python_dispatch._get_current_dispatch_mode()
    if _SAC_REPLAY_MODE is not None and isinstance(mode, _SAC_REPLAY_MODE):
        with _python_dispatch._pop_mode_temporarily():
            yield
    else:
        yield


# --------------------------------------------------------------------------------------------
# Normalisation guard: while any thread recomputes, a global module pre-hook keeps every
# normalisation layer entered by the recomputing thread from updating its running statistics a
# second time. PyTorch's own BatchNorm/SyncBatchNorm/InstanceNorm forwards take their update
# factor from ``momentum``: the recompute runs them with momentum 0, which writes
# ``1 * running + 0 * batch``, the old value bit for bit, and the ``num_batches_tracked``
# increments are taken back afterwards (one tiny kernel per call). A subclass with its own forward
# may update its buffers some other way, so its buffers are snapshotted before its first call and
# copied back after instead. The undoing happens once, when the recompute ends (also when it
# ends early or raises): one pre-hook and no post-hook keeps the per-module cost of a recompute
# small, which matters on models made of many small layers.
# --------------------------------------------------------------------------------------------
_NormBase = nn.modules.batchnorm._NormBase
_MOMENTUM_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward,
                      nn.modules.instancenorm._InstanceNorm.forward}
_hooks_lock = threading.Lock()
_hooks_users = 0
_hook_handles: list[torch.utils.hooks.RemovableHandle] = []


class _Guarded:
    """A normalisation layer touched by a recompute: what to put back, and how many calls to undo."""

    __slots__ = ("module", "saved", "calls")

    def __init__(self, module: nn.Module, saved: Any):
        self.module, self.saved, self.calls = module, saved, 0


def _updates_stats(module: nn.Module) -> bool:
    """Whether a train-mode forward of ``module`` updates running statistics we must protect."""
    if not isinstance(module, _NormBase) or getattr(module, "recompute_safe", False):
        return False  # cp_BatchNorm*d handle recompute themselves
    return module.training and module.track_running_stats and module.running_mean is not None


def _guard_norm(module: nn.Module, args: Any) -> None:
    """Global forward pre-hook: freeze a normalisation layer's statistics during a recompute."""
    guarded = getattr(_local, "guarded", None)
    if guarded is None or not _updates_stats(module):
        return
    entry = guarded.get(id(module))
    if entry is None:
        if type(module).forward in _MOMENTUM_FORWARDS:
            entry = _Guarded(module, module.momentum)
            module.momentum = 0.0
        else:
            with torch.no_grad(), state_bookkeeping():
                entry = _Guarded(module, [b.clone() for b in module.buffers(recurse=False)])
        guarded[id(module)] = entry
    entry.calls += 1


def _unguard_norms(guarded: dict[int, _Guarded]) -> None:
    """Put back what :func:`_guard_norm` changed, as if the recompute never ran the layers."""
    with torch.no_grad(), state_bookkeeping():
        for entry in guarded.values():
            module = entry.module
            if isinstance(entry.saved, list):
                for live, old in zip(module.buffers(recurse=False), entry.saved):
                    live.copy_(old)
                continue
            module.momentum = entry.saved
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and \
                    module.num_batches_tracked is not None:
                module.num_batches_tracked.sub_(entry.calls)


def _acquire_norm_guard() -> None:
    global _hooks_users
    with _hooks_lock:
        if _hooks_users == 0:
            _hook_handles.append(nn.modules.module.register_module_forward_pre_hook(_guard_norm))
        _hooks_users += 1


def _release_norm_guard() -> None:
    global _hooks_users
    with _hooks_lock:
        _hooks_users -= 1
        if _hooks_users == 0:
            while _hook_handles:
                _hook_handles.pop().remove()


# --------------------------------------------------------------------------------------------
# RNG: which CUDA devices a region can draw from, and their states at the start of its forward.
# --------------------------------------------------------------------------------------------
def _cuda_devices(fn: Callable, tensors: Iterable[Any]) -> list[int]:
    if not torch.cuda.is_initialized():
        return []
    devices = {torch.cuda.current_device()}
    devices.update(t.device.index for t in tensors
                   if isinstance(t, torch.Tensor) and t.device.type == "cuda")
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        first = next(owner.parameters(), None)
        if first is not None and first.device.type == "cuda":
            devices.add(first.device.index)
    return sorted(devices)


@functools.cache
def _autocast_devices() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _autocast_state() -> tuple[Any, ...]:
    """This thread's autocast settings for the CPU and (where present) CUDA."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in _autocast_devices()) + (torch.is_autocast_cache_enabled(),)


class _ForwardContext:
    """Entered around the region's first forward: records the RNG and autocast state it runs in.

    ``preserve_rng=False`` (torch's ``preserve_rng_state=False``) records no RNG state, and the
    recompute then neither replays nor restores one.
    """

    def __init__(self, cuda_devices: list[int], preserve_rng: bool = True):
        self.cuda_devices = cuda_devices
        self.preserve_rng = preserve_rng
        self.cpu_state: torch.Tensor | None = None
        self.cuda_states: list[torch.Tensor] = []
        self.autocast: tuple[Any, ...] = ()

    def __enter__(self) -> _ForwardContext:
        if self.preserve_rng:
            self.cpu_state = torch.get_rng_state()
            self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = _autocast_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _RecomputeContext:
    """Entered around the recompute: the forward's RNG and autocast, flag on, normalisation guard.

    The RNG states of this thread are put back afterwards, so a recompute during backward leaves
    the random stream of the training loop where it was.
    """

    def __init__(self, forward: _ForwardContext):
        self.forward = forward
        self.autocasts: list[Any] = []

    def __enter__(self) -> _RecomputeContext:
        fwd = self.forward
        self.outer_depth = _depth()
        if fwd.cpu_state is not None:
            self.cpu_state = torch.get_rng_state()
            self.cuda_states = [torch.cuda.get_rng_state(d) for d in fwd.cuda_devices]
            torch.set_rng_state(fwd.cpu_state)
            for device, state in zip(fwd.cuda_devices, fwd.cuda_states):
                torch.cuda.set_rng_state(state, device)
        if _autocast_state() != fwd.autocast:  # backward runs outside the forward's autocast
            *devices, cache = fwd.autocast
            for device, enabled, dtype in devices:
                ctx = torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
                ctx.__enter__()
                self.autocasts.append(ctx)
        _acquire_norm_guard()
        self.outer_guarded = getattr(_local, "guarded", None)
        _local.guarded = {}
        _local.depth = self.outer_depth + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.depth = self.outer_depth
        guarded, _local.guarded = _local.guarded, self.outer_guarded
        _release_norm_guard()
        _unguard_norms(guarded)
        while self.autocasts:
            self.autocasts.pop().__exit__(None, None, None)
        if self.forward.cpu_state is not None:
            torch.set_rng_state(self.cpu_state)
            for device, state in zip(self.forward.cuda_devices, self.cuda_states):
                torch.cuda.set_rng_state(state, device)


_Both = keywords.Both


# --------------------------------------------------------------------------------------------
# The region: non-reentrant checkpointing through saved-tensor hooks, in as little Python as the
# contract allows. Autograd hands every tensor the region's forward saves to ``pack``, which
# keeps a small empty slot instead. The first ``unpack`` in a backward call (one autograd graph
# task, or one ``torch.utils.checkpoint.GraphExecGroup``) reruns the region once, filling the
# slots in the order the forward created them; each slot is emptied as its node consumes it, so
# a recomputed activation lives no longer than in the plain model, and whatever that backward
# call did not consume is dropped when it ends (a partial backward, e.g. ``autograd.grad`` of an
# intermediate, holds nothing afterwards; the next backward call recomputes). The rerun stops
# as soon as the last slot is filled (ops after the last saved tensor are not recomputed).
# The recompute's own graph keeps real tensors, so ``torch.autograd.grad`` inside the region
# works, also during the forward (the region is then recomputed up to where the forward is).
# A region nested in another hands its inputs to the outer one (``_SaveInputs``), which then
# recomputes them when the inner region needs them.
# torch.utils.checkpoint's non-reentrant path follows the same rules (its "Nestable Checkpoint"
# note) with more bookkeeping per region (per-task handle maps, metadata, device probing);
# scripts/bench_checkpoint.py --small measures the difference.
# --------------------------------------------------------------------------------------------
_engine = torch.autograd.Variable._execution_engine
_exec_group = getattr(torch._C, "_get_graph_exec_group", None)  # torch >= 2.9
_current_task = torch._C._current_graph_task_id


def _backward_call() -> Any:
    """The backward call running now: a GraphExecGroup, a graph task id, or -1 (none)."""
    if _exec_group is not None:
        group = _exec_group()
        if group is not None:
            return group
    return _current_task()


class _Slot:
    """Stands in the autograd graph for one tensor the region saved, until backward needs it."""

    __slots__ = ("value", "shape", "__weakref__")

    def __init__(self, shape: torch.Size):
        self.value: torch.Tensor | None = None
        self.shape = shape


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


_SAVED = object()  # stands in a nested region's arguments for an input the outer region keeps


def _inside_region() -> int:
    """How many zoo regions are running their forward or recompute on this thread."""
    return getattr(_local, "inside", 0)


class _Region:
    """One checkpointed call: its inputs, the forward's RNG/autocast state and its saved slots."""

    __slots__ = ("fn", "args", "kwargs", "versions", "forward", "opts", "slots", "filled",
                 "in_forward", "last", "stop_early", "call", "saver")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, forward: _ForwardContext,
                 opts: keywords.Options):
        self.fn, self.args, self.kwargs, self.forward, self.opts = fn, args, kwargs, forward, opts
        self.versions = [(t, t._version) for t in (*args, *kwargs.values())
                         if isinstance(t, torch.Tensor)]
        self.saver: Any = None
        if _inside_region():
            self.save_through_outer()
        self.slots: list[weakref.ref[_Slot]] = []
        self.filled = 0
        self.in_forward = True
        self.last: weakref.ref[torch.Tensor] | None = None
        self.stop_early = True  # a recompute during the forward stops where the forward is
        self.call: Any = None  # the backward call the slots' values were recomputed for

    def save_through_outer(self) -> None:
        """Hand the inputs that require grad to the enclosing region (see _SaveInputs)."""
        tensors = [t for t in (*self.args, *self.kwargs.values())
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        self.saver = _SaveInputs.apply(*tensors).grad_fn
        self.saver.metadata["versions"] = [t._version for t in tensors]

    def forget_saved_inputs(self) -> None:
        """After the forward: let go of the inputs the enclosing region keeps for us."""
        kept = lambda v: _SAVED if isinstance(v, torch.Tensor) and v.requires_grad else v  # noqa
        self.args = tuple(kept(a) for a in self.args)
        self.kwargs = {k: kept(v) for k, v in self.kwargs.items()}
        self.versions = [(t, v) for t, v in self.versions if not t.requires_grad]

    def inputs(self) -> tuple[list, dict]:
        """The arguments for a recompute: tensors as new leaves of the recompute's graph."""
        if self.saver is None:
            return ([_fresh_leaf(a) for a in self.args],
                    {k: _fresh_leaf(v) for k, v in self.kwargs.items()})
        tensors = self.saver.saved_tensors  # the outer region recomputes them if needed
        for tensor, version in zip(tensors, self.saver.metadata["versions"]):
            if tensor._version != version:
                self.changed_in_place(version, tensor._version)
        saved = iter(tensors)
        get = lambda v: next(saved).detach().requires_grad_() if v is _SAVED else v  # noqa
        return [get(a) for a in self.args], {k: get(v) for k, v in self.kwargs.items()}

    def run(self) -> Any:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        inside = _local.inside = _inside_region() + 1
        try:
            if self.opts.contexts is None:
                with hooks:
                    out = self.fn(*self.args, **self.kwargs)
            else:
                with hooks, self.opts.contexts[0]:
                    out = self.fn(*self.args, **self.kwargs)
        finally:
            _local.inside = inside - 1
        self.in_forward = False
        if self.saver is not None:
            self.forget_saved_inputs()
        # A region whose output is the last tensor it saved (it ends in ReLU, sigmoid, ...) has
        # nothing left to skip after the last slot: its recompute runs to the end instead of
        # being stopped by an exception, which costs more than the op it would skip.
        self.stop_early = self.opts.early_stop and (self.last is None or self.last() is not out)
        self.last = None
        return out

    def pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(tensor.shape)
        self.slots.append(weakref.ref(slot))
        self.last = weakref.ref(tensor)
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        call = _backward_call()
        if call != self.call or call == -1:
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
        slot.value = None
        if call == -1:  # read outside any backward (grad_fn._saved_*): keep nothing
            _empty_slots(self.slots)
        return value

    def recompute(self, call: Any) -> None:
        for tensor, version in self.versions:
            if tensor._version != version:
                self.changed_in_place(version, tensor._version)
        args, kwargs = self.inputs()
        total, self.filled, self.call = len(self.slots), 0, call
        contexts = self.opts.contexts
        inside = _local.inside = _inside_region() + 1
        try:
            with torch.enable_grad(), _RecomputeContext(self.forward), \
                    torch.autograd.graph.saved_tensors_hooks(self.fill, _same):
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
        if self.filled < total:
            self.fail("the recomputed region saved fewer tensors for backward than its forward "
                      f"did ({self.filled} < {total}), so it is not deterministic (does it branch "
                      "on random numbers, global state or tensor values?). Make the region "
                      "deterministic given its inputs, or leave it out of the checkpoint.")
        if isinstance(call, int) and call >= 0:  # drop the unused when this backward call ends
            _engine.queue_callback(functools.partial(_empty_slots, self.slots))

    def fill(self, tensor: torch.Tensor) -> torch.Tensor:
        index, total = self.filled, len(self.slots)
        self.filled = index + 1
        if index >= total:
            if self.in_forward or self.opts.early_stop:
                raise _StopRecompute  # what the forward saved is all rebuilt; the rest is unused
            self.fail("the recomputed region saved more tensors for backward than its forward "
                      f"did (more than {total}), so it is not deterministic given its inputs.")
        if tensor.requires_grad:
            tensor = tensor.detach()  # the recompute's graph must not hold its own outputs
        slot = self.slots[index]()
        if slot is not None:  # None: its node already ran and was freed
            if slot.shape != tensor.shape and self.opts.check_shapes:
                self.fail(f"saved tensor {index} of the region had shape {tuple(slot.shape)} in "
                          f"the forward but {tuple(tensor.shape)} in the recompute; the region "
                          "is not deterministic given its inputs.")
            slot.value = tensor
        if index + 1 == total and self.stop_early:
            raise _StopRecompute
        return tensor

    def changed_in_place(self, before: int, after: int) -> None:
        raise RuntimeError(
            "zoo.checkpoint: an input of a checkpointed region was modified in place after "
            f"the region started (version {before} -> {after}), so the recompute would see "
            "other values. Clone the input before changing it, or keep in-place ops on a "
            "region's input out of the region.")

    def fail(self, message: str) -> None:
        raise RuntimeError(f"zoo.checkpoint: {message}{self.opts.debug_report()}")


def _empty_slots(slots: list[weakref.ref[_Slot]]) -> None:
    """Drop what a backward call recomputed but did not use (called when that call ends).

    It gets the region's slot list, not the region: holding the region would keep its inputs
    alive until the end of the whole backward pass.
    """
    for ref in slots:
        slot = ref()
        if slot is not None:
            slot.value = None


def _fresh_leaf(value: Any) -> Any:
    """A tensor input as a new leaf of the recompute's own graph (same data, same requires_grad).

    An input that does not require grad is passed as itself: a custom Function that saved it
    gets back the very tensor object it saved, as without checkpointing.
    """
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_()
    return value


def _same(tensor: torch.Tensor) -> torch.Tensor:
    """Unpack hook of the recompute's own graph (``autograd.grad`` run inside the region)."""
    return tensor


def _traced_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                       save_ops: Collection[Any] | None,
                       context_fn: Callable[[], tuple[Any, Any]] | None = None) -> Any:
    """The region as ``torch.compile`` sees it: torch's checkpoint, which Dynamo turns into one
    ``tag_activation_checkpoint`` subgraph of the model's graph (no graph break).

    AOTAutograd's partitioner then decides what the backward recomputes: the region's outputs
    are tagged "recompute" (or, for ``save_ops``, "save" for the named ops, through torch's
    selective-checkpoint policy), random ops are never recomputed but their masks kept (so
    dropout's backward uses the forward's mask), and buffer mutations such as BatchNorm's
    running statistics are applied once, in the forward graph. That is the whole contract, so
    none of the eager region's guards (recompute flag, BatchNorm guard, RNG replay) is traced.
    ``context_fn`` must reach Dynamo as a function or ``functools.partial``, never a lambda; a
    user's own ``context_fn`` is handed to torch as it is (torch's compiled checkpoint takes one,
    so it cannot be combined with ``save_ops`` there). The other keywords concern the eager
    recompute only.
    """
    if context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn:
        if save_ops:
            raise ValueError("zoo.checkpoint: under torch.compile, save_ops and context_fn cannot "
                             "be combined (torch's compiled checkpoint takes one context_fn); "
                             "pass one of them, or run the region eagerly")
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn,
                                           **kwargs)
    if save_ops:
        policy = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   list(save_ops))
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=policy,
                                           **kwargs)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def checkpoint(fn: Callable[..., Any], *args: Any, save_ops: Collection[Any] | None = None,
               use_reentrant: bool | None = None, preserve_rng_state: bool = True,
               context_fn: Callable[[], tuple[Any, Any]] | None = None,
               determinism_check: str = "default", debug: bool = False,
               early_stop: bool | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute the rest during backward.

    Compared with ``fn(*args, **kwargs)`` it gives the same outputs, the same gradients for the
    inputs and for every parameter ``fn`` uses (also when no input requires grad), leaves
    normalisation running statistics exactly as one plain forward would, and replays the same
    random numbers on the CPU and on every CUDA device involved. It works with keyword and
    non-tensor arguments and outputs, nests, recomputes under the forward's autocast state, and
    allows ``torch.autograd.grad`` inside ``fn`` (gradient penalties) and partial backward calls.

    Args:
        fn: any callable: a module, a bound method, a closure.
        *args, **kwargs: passed to ``fn`` unchanged (any keyword not named here goes to ``fn``).
        save_ops: optional ATen ops (e.g. ``{torch.ops.aten.mm.default}``) whose outputs are kept
            instead of recomputed: selective recompute, Megatron-style. ``None`` recomputes all.
        use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop:
            ``torch.utils.checkpoint.checkpoint``'s keywords, so that zoo.checkpoint can be handed
            to any library that calls torch's; their meaning for a zoo region is in
            :mod:`zoo.checkpoint_keywords` (``use_reentrant`` is ignored: always non-reentrant).

    Under ``torch.no_grad()`` or ``inference_mode`` it is exactly ``fn(*args, **kwargs)``.

    Backward raises RuntimeError, saying why, when a tensor input was changed in place after the
    call (the recompute would read other values), when the recompute saves other tensors than
    the forward did (the region is not deterministic given its inputs), or when one backward call
    unpacks a saved tensor twice (a custom Function reading ``ctx.saved_tensors`` twice).

    Deliberate differences from torch's non-reentrant checkpoint (each pinned by a test in
    tests/test_checkpoint.py or tests/test_checkpoint_torch_*.py): BatchNorm statistics are
    updated once, not twice; the RNG is also replayed on the current CUDA device and on the
    region's parameters' device; ``use_reentrant=True`` still gives non-reentrant semantics and
    no call warns; recomputed tensors a backward call did not use are freed when that call ends
    (torch keeps them until the graph is freed).
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _traced_checkpoint(fn, args, kwargs, save_ops, context_fn)
    opts = keywords.options(preserve_rng_state, context_fn, determinism_check, debug, early_stop)

    if not save_ops:
        devices = _cuda_devices(fn, (*args, *kwargs.values())) if opts.preserve_rng else []
        with _ForwardContext(devices, opts.preserve_rng) as forward:
            return _Region(fn, args, kwargs, forward, opts).run()
    return _selective(fn, args, kwargs, save_ops, opts)


def _selective(fn: Callable[..., Any], args: tuple, kwargs: dict, save_ops: Collection[Any],
               opts: keywords.Options) -> Any:
    """Selective recompute (``save_ops``) on torch's checkpoint, with the zoo's contexts."""
    def context_fn() -> tuple[Any, Any]:
        devices = _cuda_devices(fn, (*args, *kwargs.values())) if opts.preserve_rng else []
        forward = _ForwardContext(devices, opts.preserve_rng)
        recompute = _RecomputeContext(forward)
        sac_forward, sac_recompute = torch_checkpoint.create_selective_checkpoint_contexts(
            list(save_ops))
        user = opts.contexts or ()
        return (_Both(forward, sac_forward, *user[:1]),
                _Both(recompute, sac_recompute, *user[1:]))

    call = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
    with keywords.early_stop_context(opts):
        return torch_checkpoint.checkpoint(call, *args, use_reentrant=False,
                                           preserve_rng_state=False, context_fn=context_fn,
                                           **keywords.torch_call_keywords(opts))


def split_segments(n: int, segments: int | None) -> list[range]:
    """Split ``n`` blocks into contiguous, balanced segments (sizes differ by at most one).

    ``segments=None`` gives one segment per block. Raises ValueError outside ``1..n``.
    """
    if n < 1:
        raise ValueError("checkpoint_sequential needs at least one block, got an empty sequence")
    if segments is None:
        segments = n
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
        raise ValueError(f"segments must be an int from 1 to {n} (the number of blocks) or None "
                         f"for one segment per block, got {segments!r}")
    base, extra = divmod(n, segments)
    bounds, start = [], 0
    for i in range(segments):
        stop = start + base + (1 if i < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def run_blocks(blocks: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    """Apply ``blocks`` in order: the plain body of a checkpointed segment."""
    for block in blocks:
        x = block(x)
    return x


def checkpoint_sequential(blocks: Sequence[Callable[[Any], Any]] | nn.Sequential, x: Any,
                          segments: int | None = None, skip_last: bool = False, *,
                          use_reentrant: bool | None = None, preserve_rng_state: bool = True,
                          context_fn: Callable[[], tuple[Any, Any]] | None = None,
                          determinism_check: str = "default", debug: bool = False,
                          early_stop: bool | None = None) -> Any:
    """Run a chain of one-input blocks, checkpointing each segment with :func:`checkpoint`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential`` the last segment is checkpointed too
    (the reason seed 000 saw "almost no memory improvement" with few segments) unless
    ``skip_last=True``, which keeps its activations because backward needs them first anyway.
    This is a deliberate difference from torch's (tests/test_checkpoint_torch_utils.py pins it).

    Args:
        blocks: an ``nn.Sequential`` or any sequence of callables, applied in order.
        x: the input of the first block.
        segments: ``None`` checkpoints every block on its own; an int splits the blocks into that
            many balanced contiguous segments, each checkpointed as one region.
        skip_last: run the last segment without checkpointing.
        use_reentrant, preserve_rng_state, context_fn, determinism_check, debug, early_stop:
            torch's keywords, passed to every segment's :func:`checkpoint`.

    torch's argument order, ``checkpoint_sequential(functions, segments, input)``, is accepted
    too: a tensor given as ``segments`` after an int ``x`` is taken as the input.
    """
    if isinstance(segments, torch.Tensor) and isinstance(x, int) and not isinstance(x, bool):
        x, segments = segments, x  # torch's order: (functions, segments, input)
    if not isinstance(skip_last, bool):
        raise TypeError(f"checkpoint_sequential: skip_last must be True or False, got "
                        f"{type(skip_last).__name__} (blocks take one input; pass only one)")
    blocks = list(blocks)
    ranges = split_segments(len(blocks), segments)
    if not torch.is_grad_enabled():
        return run_blocks(blocks, x)
    given = {"use_reentrant": use_reentrant, "preserve_rng_state": preserve_rng_state,
             "context_fn": context_fn, "determinism_check": determinism_check, "debug": debug,
             "early_stop": early_stop}
    for i, r in enumerate(ranges):
        part = blocks[r.start:r.stop]
        if skip_last and i == len(ranges) - 1:
            x = run_blocks(part, x)
        elif len(part) == 1:
            x = checkpoint(part[0], x, **given)
        else:
            x = checkpoint(run_blocks, part, x, **given)
    return x
