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
    """Entered around the region's first forward: records the RNG and autocast state it runs in."""

    def __init__(self, cuda_devices: list[int]):
        self.cuda_devices = cuda_devices
        self.cpu_state: torch.Tensor | None = None
        self.cuda_states: list[torch.Tensor] = []
        self.autocast: tuple[Any, ...] = ()

    def __enter__(self) -> _ForwardContext:
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
        torch.set_rng_state(self.cpu_state)
        for device, state in zip(self.forward.cuda_devices, self.cuda_states):
            torch.cuda.set_rng_state(state, device)


class _Both:
    """Enter several context managers as one (torch's context_fn returns exactly two)."""

    def __init__(self, *contexts: Any):
        self.contexts = contexts
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> _Both:
        for c in self.contexts:
            self.stack.enter_context(c)
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self.stack.__exit__(*exc)


# --------------------------------------------------------------------------------------------
# The region: non-reentrant checkpointing through saved-tensor hooks, in as little Python as the
# contract allows. Autograd hands every tensor the region's forward saves to ``pack``, which
# keeps a small empty slot instead; the first ``unpack`` in a backward reruns the region once,
# filling the slots in the order the forward created them, and each slot is emptied as its node
# consumes it, so a recomputed activation lives no longer than in the plain model. The rerun stops
# as soon as the last slot is filled (ops after the last saved tensor are not recomputed).
# torch.utils.checkpoint's non-reentrant path works the same way but spends about 1.5x as much
# time per region on bookkeeping that only its other features need (per-backward handle maps,
# metadata for its determinism check, device probing); scripts/bench_checkpoint.py --small
# measures the difference.
# --------------------------------------------------------------------------------------------
class _Slot:
    """Stands in the autograd graph for one tensor the region saved, until backward needs it."""

    __slots__ = ("value", "shape", "__weakref__")

    def __init__(self, shape: torch.Size):
        self.value: torch.Tensor | None = None
        self.shape = shape


class _StopRecompute(Exception):
    """Ends a recompute early: every saved tensor still needed has been rebuilt."""


class _Region:
    """One checkpointed call: its inputs, the forward's RNG/autocast state and its saved slots."""

    __slots__ = ("fn", "args", "kwargs", "versions", "forward", "slots", "filled", "in_forward",
                 "last", "stop_early")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, forward: _ForwardContext):
        self.fn, self.args, self.kwargs, self.forward = fn, args, kwargs, forward
        self.versions = [(t, t._version) for t in (*args, *kwargs.values())
                         if isinstance(t, torch.Tensor)]
        self.slots: list[weakref.ref[_Slot]] = []
        self.filled = 0
        self.in_forward = True
        self.last: weakref.ref[torch.Tensor] | None = None
        self.stop_early = True

    def run(self) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = self.fn(*self.args, **self.kwargs)
        self.in_forward = False
        # A region whose output is the last tensor it saved (it ends in ReLU, sigmoid, ...) has
        # nothing left to skip after the last slot: its recompute runs to the end instead of
        # being stopped by an exception, which costs more than the op it would skip.
        self.stop_early = self.last is None or self.last() is not out
        self.last = None
        return out

    def pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(tensor.shape)
        self.slots.append(weakref.ref(slot))
        self.last = weakref.ref(tensor)
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            self.recompute()
            if slot.value is None:
                raise RuntimeError(
                    "zoo.checkpoint: the recomputed region saved fewer tensors for backward than "
                    "its forward did, so it is not deterministic (does it branch on random "
                    "numbers, global state or tensor values?). Make the region deterministic "
                    "given its inputs, or leave it out of the checkpoint.")
        value, slot.value = slot.value, None
        return value

    def recompute(self) -> None:
        if self.in_forward:
            raise RuntimeError(
                "zoo.checkpoint: backward was called inside a checkpointed region's own forward "
                "(e.g. torch.autograd.grad in fn). Compute that gradient outside the checkpoint.")
        for tensor, version in self.versions:
            if tensor._version != version:
                raise RuntimeError(
                    "zoo.checkpoint: an input of a checkpointed region was modified in place after "
                    f"the region started (version {version} -> {tensor._version}), so the "
                    "recompute would see other values. Clone the input before changing it, or "
                    "keep in-place ops on a region's input out of the region.")
        args = [_fresh_leaf(a) for a in self.args]
        kwargs = {k: _fresh_leaf(v) for k, v in self.kwargs.items()}
        self.filled = 0
        try:
            with torch.enable_grad(), _RecomputeContext(self.forward), \
                    torch.autograd.graph.saved_tensors_hooks(self.fill, _recomputed_graph_used):
                self.fn(*args, **kwargs)
        except _StopRecompute:
            pass

    def fill(self, tensor: torch.Tensor) -> None:
        index, total = self.filled, len(self.slots)
        self.filled = index + 1
        if index >= total:
            raise RuntimeError(
                "zoo.checkpoint: the recomputed region saved more tensors for backward than its "
                "forward did, so it is not deterministic given its inputs.")
        if tensor.requires_grad:
            tensor = tensor.detach()  # the recompute's own graph is never used; let it go
        slot = self.slots[index]()
        if slot is not None:  # None: its node already ran and was freed
            if slot.shape != tensor.shape:
                raise RuntimeError(
                    f"zoo.checkpoint: saved tensor {index} of the region had shape "
                    f"{tuple(slot.shape)} in the forward but {tuple(tensor.shape)} in the "
                    "recompute; the region is not deterministic given its inputs.")
            slot.value = tensor
        if index + 1 == total and self.stop_early:
            raise _StopRecompute
        # The recompute's graph keeps nothing: holding the tensor here would tie it to itself.
        return None


def _fresh_leaf(value: Any) -> Any:
    """A tensor input as a new leaf of the recompute's own graph (same data, same requires_grad)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _recomputed_graph_used(_: None) -> torch.Tensor:
    raise RuntimeError("zoo.checkpoint: backward through a region's recompute is not supported "
                       "(was torch.autograd.grad called inside the checkpointed function?)")


def _traced_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                       save_ops: Collection[Any] | None) -> Any:
    """The region as ``torch.compile`` sees it: torch's checkpoint, which Dynamo turns into one
    ``tag_activation_checkpoint`` subgraph of the model's graph (no graph break).

    AOTAutograd's partitioner then decides what the backward recomputes: the region's outputs
    are tagged "recompute" (or, for ``save_ops``, "save" for the named ops, through torch's
    selective-checkpoint policy), random ops are never recomputed but their masks kept (so
    dropout's backward uses the forward's mask), and buffer mutations such as BatchNorm's
    running statistics are applied once, in the forward graph. That is the whole contract, so
    none of the eager region's guards (recompute flag, BatchNorm guard, RNG replay) is traced.
    ``context_fn`` must reach Dynamo as a function or ``functools.partial``, never a lambda.
    """
    if save_ops:
        policy = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   list(save_ops))
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=policy,
                                           **kwargs)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def checkpoint(fn: Callable[..., Any], *args: Any, save_ops: Collection[Any] | None = None,
               **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute the rest during backward.

    Compared with ``fn(*args, **kwargs)`` it gives the same outputs, the same gradients for the
    inputs and for every parameter ``fn`` uses (also when no input requires grad), leaves
    normalisation running statistics exactly as one plain forward would, and replays the same
    random numbers on the CPU and on every CUDA device involved. It works with keyword and
    non-tensor arguments and outputs, nests, and recomputes under the forward's autocast state.

    Args:
        fn: any callable: a module, a bound method, a closure.
        *args, **kwargs: passed to ``fn`` unchanged.
        save_ops: optional ATen ops (e.g. ``{torch.ops.aten.mm.default}``) whose outputs are kept
            instead of recomputed: selective recompute, Megatron-style. ``None`` recomputes all.

    Under ``torch.no_grad()`` or ``inference_mode`` it is exactly ``fn(*args, **kwargs)``.

    Backward raises RuntimeError, saying why, when a tensor input was changed in place after the
    call (the recompute would read other values) or when the recompute saves other tensors than
    the forward did (the region is not deterministic given its inputs).
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _traced_checkpoint(fn, args, kwargs, save_ops)

    if not save_ops:
        with _ForwardContext(_cuda_devices(fn, (*args, *kwargs.values()))) as forward:
            return _Region(fn, args, kwargs, forward).run()

    def context_fn() -> tuple[Any, Any]:
        forward = _ForwardContext(_cuda_devices(fn, (*args, *kwargs.values())))
        recompute = _RecomputeContext(forward)
        sac_forward, sac_recompute = torch_checkpoint.create_selective_checkpoint_contexts(
            list(save_ops))
        return _Both(forward, sac_forward), _Both(recompute, sac_recompute)

    call = (lambda *a: fn(*a, **kwargs)) if kwargs else fn
    return torch_checkpoint.checkpoint(call, *args, use_reentrant=False, preserve_rng_state=False,
                                       context_fn=context_fn)


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
                          segments: int | None = None, skip_last: bool = False) -> Any:
    """Run a chain of one-input blocks, checkpointing each segment with :func:`checkpoint`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential`` the last segment is checkpointed too
    (the reason seed 000 saw "almost no memory improvement" with few segments) unless
    ``skip_last=True``, which keeps its activations because backward needs them first anyway.

    Args:
        blocks: an ``nn.Sequential`` or any sequence of callables, applied in order.
        x: the input of the first block.
        segments: ``None`` checkpoints every block on its own; an int splits the blocks into that
            many balanced contiguous segments, each checkpointed as one region.
        skip_last: run the last segment without checkpointing.
    """
    blocks = list(blocks)
    ranges = split_segments(len(blocks), segments)
    if not torch.is_grad_enabled():
        return run_blocks(blocks, x)
    for i, r in enumerate(ranges):
        part = blocks[r.start:r.stop]
        if skip_last and i == len(ranges) - 1:
            x = run_blocks(part, x)
        elif len(part) == 1:
            x = checkpoint(part[0], x)
        else:
            x = checkpoint(run_blocks, part, x)
    return x
