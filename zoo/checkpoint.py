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

:func:`checkpoint` is built on PyTorch's non-reentrant machinery (saved-tensor hooks, so gradients
reach parameters through the ordinary graph, once, with no nested backward) and adds, through its
``context_fn``:

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
  Transformer Models", Megatron-LM).

Under ``torch.no_grad()`` / ``inference_mode`` it simply calls ``fn``: nothing is saved and
nothing is recomputed, so there is nothing to pay.
"""
from __future__ import annotations

import contextlib
import threading
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
    training step instead of once per forward *and* once per recompute.
    """
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
# Normalisation guard: while any thread recomputes, global module hooks keep every normalisation
# layer entered by the recomputing thread from updating its running statistics a second time.
# PyTorch's own BatchNorm/SyncBatchNorm/InstanceNorm forwards take their update factor from
# ``momentum``: the recompute runs with momentum 0, which writes ``1 * running + 0 * batch``, the
# old value bit for bit, and the ``num_batches_tracked`` increment is taken back (one tiny kernel
# per layer). A subclass with its own forward may update its buffers some other way, so its
# buffers are snapshotted before and copied back after instead. Both are undone in a post-hook
# that also runs when the forward raises (torch stops a recompute early once it has what
# backward needs).
# --------------------------------------------------------------------------------------------
_NormBase = nn.modules.batchnorm._NormBase
_MOMENTUM_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward,
                      nn.modules.instancenorm._InstanceNorm.forward}
_hooks_lock = threading.Lock()
_hooks_users = 0
_hook_handles: list[torch.utils.hooks.RemovableHandle] = []


def _updates_stats(module: nn.Module) -> bool:
    """Whether a train-mode forward of ``module`` updates running statistics we must protect."""
    if not isinstance(module, _NormBase) or getattr(module, "recompute_safe", False):
        return False  # cp_BatchNorm*d handle recompute themselves
    return module.training and module.track_running_stats and module.running_mean is not None


def _stashes() -> dict[int, list[Any]]:
    if not hasattr(_local, "stash"):
        _local.stash = {}
    return _local.stash


def _save_norm_stats(module: nn.Module, args: Any) -> None:
    if not is_recomputing() or not _updates_stats(module):
        return
    if type(module).forward in _MOMENTUM_FORWARDS:
        saved: Any = module.momentum
        module.momentum = 0.0
    else:
        with torch.no_grad(), state_bookkeeping():
            saved = [b.clone() for b in module.buffers(recurse=False)]
    _stashes().setdefault(id(module), []).append(saved)


def _restore_norm_stats(module: nn.Module, args: Any, output: Any) -> None:
    stack = _stashes().get(id(module))
    if not stack:
        return
    saved = stack.pop()
    if not stack:
        del _stashes()[id(module)]
    with torch.no_grad(), state_bookkeeping():
        if isinstance(saved, list):
            for live, old in zip(module.buffers(recurse=False), saved):
                live.copy_(old)
            return
        module.momentum = saved
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and \
                module.num_batches_tracked is not None:
            module.num_batches_tracked.sub_(1)


def _acquire_norm_guard() -> None:
    global _hooks_users
    with _hooks_lock:
        if _hooks_users == 0:
            _hook_handles.append(nn.modules.module.register_module_forward_pre_hook(_save_norm_stats))
            _hook_handles.append(
                nn.modules.module.register_module_forward_hook(_restore_norm_stats, always_call=True))
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


class _ForwardContext:
    """Entered around the region's first forward: records the RNG states it starts from."""

    def __init__(self, cuda_devices: list[int]):
        self.cuda_devices = cuda_devices
        self.cpu_state: torch.Tensor | None = None
        self.cuda_states: list[torch.Tensor] = []

    def __enter__(self) -> _ForwardContext:
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _RecomputeContext:
    """Entered around the recompute: same RNG as the forward, flag on, normalisation guard on."""

    def __init__(self, forward: _ForwardContext):
        self.forward = forward
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> _RecomputeContext:
        fwd = self.forward
        self.outer_depth = _depth()
        self.stack.enter_context(torch.random.fork_rng(devices=fwd.cuda_devices, device_type="cuda"))
        torch.set_rng_state(fwd.cpu_state)
        for device, state in zip(fwd.cuda_devices, fwd.cuda_states):
            torch.cuda.set_rng_state(state, device)
        _acquire_norm_guard()
        self.stack.callback(_release_norm_guard)
        _local.depth = self.outer_depth + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.depth = self.outer_depth
        self.stack.close()


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
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Inside a compiled graph AOTAutograd owns recompute; buffer mutations are applied once.
        sac = (lambda: torch_checkpoint.create_selective_checkpoint_contexts(list(save_ops))) \
            if save_ops else torch_checkpoint.noop_context_fn
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=sac, **kwargs)

    def context_fn() -> tuple[Any, Any]:
        forward = _ForwardContext(_cuda_devices(fn, (*args, *kwargs.values())))
        recompute = _RecomputeContext(forward)
        if not save_ops:
            return forward, recompute
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
