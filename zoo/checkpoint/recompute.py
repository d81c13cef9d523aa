"""What a recompute must put back: the recompute flag, the normalisation guard, the state of
layers that advance their own (spectral norm), and the RNG and autocast state of the forward
(the parts of :mod:`zoo.checkpoint` that make a recompute exactly the forward it replays; used
by its region, its selective-recompute path and the reversible rebuild)."""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .. import _torch

# --------------------------------------------------------------------------------------------
# Recompute state: a per-thread depth (autograd runs backward on one thread per device, and
# nn.DataParallel runs one forward thread per replica).
# --------------------------------------------------------------------------------------------
class _ThreadState(threading.local):
    """Per-thread recompute state; ``forwards``: the region forwards running on the thread,
    innermost last (:func:`advancing`), there from the thread's first use on."""

    def __init__(self) -> None:
        self.forwards: list[ForwardState] = []


_local = _ThreadState()


def _depth() -> int:
    return getattr(_local, "depth", 0)


def is_recomputing() -> bool:
    """True only while a :func:`checkpoint` region is recomputed for backward, on this thread.

    Layers with side effects (running statistics, counters, logging) use it to act once per
    training step instead of once per forward *and* once per recompute. While ``torch.compile``
    traces it is False: a compiled graph never reruns a forward in Python (AOTAutograd recomputes
    inside the backward graph and applies buffer updates once, in the forward graph).
    """
    if torch.compiler.is_compiling():
        return False
    return _depth() > 0


# The dispatch modes of selective recompute (``save_ops``): the zoo's own keep and serve the named
# ops' outputs in the forward's order (``bookkeeping_outside``), torch's replay (the eager fallback
# of a compiled region) insists that every op it sees was recorded in the forward. Ops that exist
# only in a recompute (the guard's counter correction and snapshots below, cp_BatchNorm's) run
# outside them.
_SAC_REPLAY_MODE = _torch.CachedTorchDispatchMode


@contextlib.contextmanager
def state_bookkeeping() -> Iterator[None]:
    """Run recompute-only bookkeeping on module state outside selective recompute's modes.

    Selective recompute (``save_ops``) runs the forward and the recompute under dispatch modes
    that keep, then serve, the outputs of the named ops in order (torch's replay also fails on any
    op the forward did not run). Copies of running statistics made only while recomputing are not
    part of the region's computation, so they run with that mode lifted; any other mode
    (FakeTensorMode, MemTracker) stays active.
    """
    mode = _torch.get_current_dispatch_mode()
    if getattr(mode, "bookkeeping_outside", False) or (
            _SAC_REPLAY_MODE is not None and isinstance(mode, _SAC_REPLAY_MODE)):
        with _torch.pop_mode_temporarily():
            yield
    else:
        yield


# --------------------------------------------------------------------------------------------
# Normalisation guard: while any thread recomputes, a global module pre-hook keeps every
# normalisation layer entered by the recomputing thread from updating its running statistics a
# second time. PyTorch's own BatchNorm/SyncBatchNorm/InstanceNorm forwards take their update
# factor from ``momentum``: the recompute runs them with momentum 0, which writes
# ``1 * running + 0 * batch``, the old value bit for bit. BatchNorm's ``num_batches_tracked`` is
# set aside for the recompute (its forward skips a missing counter), so no kernel counts the
# batch and none has to take the count back; SyncBatchNorm insists on its counter, so there the
# increments are taken back afterwards (one tiny kernel per call). A subclass with its own forward
# may update its buffers some other way, so its buffers are snapshotted before its first call and
# copied back after instead. The undoing happens once, when the recompute ends (also when it
# ends early or raises): one pre-hook and no post-hook keeps the per-module cost of a recompute
# small, which matters on models made of many small layers.
# --------------------------------------------------------------------------------------------
_NormBase = _torch.NormBase
_MOMENTUM_FORWARDS = {_torch.BatchNormBase.forward, nn.SyncBatchNorm.forward,
                      _torch.InstanceNormBase.forward}
_COUNT_OPTIONAL = _torch.BatchNormBase.forward  # reads the counter only if present
_hooks_lock = threading.Lock()
_hooks_users = 0
# The guard goes straight into torch's table of global forward pre-hooks under an id reserved for
# it, instead of through register_module_forward_pre_hook and a handle: a recompute puts it in and
# takes it out, and the handle's bookkeeping cost more than the rest of that per region.
_global_pre_hooks = _torch.global_forward_pre_hooks
_GUARD_ID = torch.utils.hooks.RemovableHandle(_global_pre_hooks).id  # reserved, never removed


class _Guarded:
    """A normalisation layer touched by a recompute: what to put back, and how many calls to undo
    (``count``: the ``num_batches_tracked`` set aside for the recompute, if any)."""

    __slots__ = ("module", "saved", "calls", "count")

    def __init__(self, module: nn.Module, saved: Any, count: torch.Tensor | None = None):
        self.module, self.saved, self.calls, self.count = module, saved, 0, count


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
        forward = type(module).forward
        if forward in _MOMENTUM_FORWARDS:
            count = _torch.module_buffers(module).get("num_batches_tracked") \
                if forward is _COUNT_OPTIONAL else None
            entry = _Guarded(module, module.momentum, count)
            module.momentum = 0.0
            if count is not None:
                _torch.module_buffers(module)["num_batches_tracked"] = None
        else:
            with torch.no_grad(), state_bookkeeping():
                entry = _Guarded(module, [b.clone() for b in module.buffers(recurse=False)])
        guarded[id(module)] = entry
    entry.calls += 1


def _unguard_norms(guarded: dict[int, _Guarded]) -> None:
    """Put back what :func:`_guard_norm` changed, as if the recompute never ran the layers."""
    if not guarded:
        return
    with torch.no_grad(), state_bookkeeping():
        for entry in guarded.values():
            module = entry.module
            if isinstance(entry.saved, list):
                for live, old in zip(module.buffers(recurse=False), entry.saved):
                    live.copy_(old)
                continue
            module.momentum = entry.saved
            if entry.count is not None:
                _torch.module_buffers(module)["num_batches_tracked"] = entry.count
            elif isinstance(module, _torch.BatchNormBase) and \
                    module.num_batches_tracked is not None:
                module.num_batches_tracked.sub_(entry.calls)


def _acquire_norm_guard() -> None:
    global _hooks_users
    with _hooks_lock:
        if _hooks_users == 0:
            _global_pre_hooks[_GUARD_ID] = _guard_norm
        _hooks_users += 1


def _release_norm_guard() -> None:
    global _hooks_users
    with _hooks_lock:
        _hooks_users -= 1
        if _hooks_users == 0:
            _global_pre_hooks.pop(_GUARD_ID, None)


# --------------------------------------------------------------------------------------------
# Layers with state of their own that a train-mode forward advances: spectral norm's power
# iteration rewrites its ``u`` and ``v`` and computes sigma from them, so a recompute that ran it
# again would compute another sigma than the forward did, and advance them twice per step. Such
# a layer, made recompute-safe by ``zoo.nn.convert_spectral_norm``, calls :func:`advancing`
# before it changes that state; every region forward running on this thread (a stack: nested
# regions) records it then, once, as it was when the region began. The region's recompute puts
# the records in and the live state back afterwards, so the layer repeats its forward's
# iteration bit for bit, wherever else it ran in between (a GAN's discriminator on the real and
# the fake batch before one backward).
# --------------------------------------------------------------------------------------------
def run_recording(at: ForwardState, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` as a forward whose recompute will run under
    ``_RecomputeContext(at)`` (a reversible block's functions, a compiled region's eager
    fallback): the layers in it that advance their own state record it in ``at``
    (:func:`advancing`). A region's forward does the same inline (no Python call per region)."""
    _local.forwards.append(at)
    try:
        return fn(*args, **kwargs)
    finally:
        _local.forwards.pop()


def advancing(owner: object, state: tuple[torch.Tensor, ...]) -> None:
    """``owner`` is about to change ``state`` in place: each region forward running that has not
    yet recorded ``owner``'s state records a copy of it (the state its recompute starts from)."""
    if torch.compiler.is_compiling():
        return  # a compiled region never reruns its forward in Python
    for forward in _local.forwards:
        states = forward.states
        if states is None:
            states = forward.states = {}
        if id(owner) not in states:
            with torch.no_grad(), state_bookkeeping():
                states[id(owner)] = (state, tuple(t.clone() for t in state))


def _swap_states(states: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]
                 ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Put the recorded states in; the live ones, to put back (:func:`_put_back`)."""
    with torch.no_grad(), state_bookkeeping():
        live = [(state, tuple(t.clone() for t in state)) for state, _ in states.values()]
        for state, recorded in states.values():
            for t, r in zip(state, recorded):
                t.copy_(r)
    return live


def _put_back(live: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]) -> None:
    with torch.no_grad(), state_bookkeeping():
        for state, values in live:
            for t, v in zip(state, values):
                t.copy_(v)


# --------------------------------------------------------------------------------------------
# RNG: which CUDA devices a region can draw from, and their states at the start of its forward.
# --------------------------------------------------------------------------------------------
def _cuda_devices(fn: Callable, tensors: Iterable[Any]) -> list[int]:
    """The CUDA devices whose RNG a region replays: the current one, its tensor arguments' and its
    module's parameters' (asked only of a region that preserves RNG state, CUDA initialised)."""
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


_any_autocast = _torch.is_any_autocast_enabled


def _autocast_state() -> tuple[Any, ...] | None:
    """This thread's autocast settings for the CPU and (where present) CUDA; ``None`` when no
    autocast is enabled on any device (one call instead of three per device, on most regions)."""
    if _any_autocast is not None and not _any_autocast():
        return None
    return _autocast_settings()


def autocast_cache_on() -> bool:
    """Whether autocast is on for some device with its cache of parameter casts (a zoo model
    then runs its forward without the cache: :mod:`zoo.checkpoint.casts`)."""
    state = _autocast_state()
    return state is not None and state[-1] and any(on for _, on, _ in state[:-1])


def _autocast_settings() -> tuple[Any, ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in _autocast_devices()) + (torch.is_autocast_cache_enabled(),)


def _autocast_off() -> tuple[Any, ...]:
    """Autocast settings with autocast disabled on every device (a forward that ran without)."""
    return tuple((d, False, dtype) for d, _, dtype in _autocast_settings()[:-1]) + (True,)


class ForwardState:
    """The RNG and autocast state a region's forward runs in, recorded when made (just before
    the forward), for :class:`_RecomputeContext` to put back.

    ``preserve_rng=False`` (torch's ``preserve_rng_state=False``, which the zoo's models pass
    for their regions that draw no random number) records no RNG state and is given no CUDA
    device, and the recompute then neither replays nor restores one: no RNG state is read or
    written for the region at all.
    """

    __slots__ = ("cuda_devices", "preserve_rng", "cpu_state", "cuda_states", "autocast",
                 "states")

    def __init__(self, cuda_devices: list[int], preserve_rng: bool = True):
        self.cuda_devices = cuda_devices
        self.preserve_rng = preserve_rng
        self.states: dict[int, Any] | None = None  # layers' own state (:func:`advancing`)
        self.cpu_state: torch.Tensor | None = None
        self.cuda_states: list[torch.Tensor] = []
        if preserve_rng:
            self.cpu_state = torch.get_rng_state()
            self.cuda_states = [torch.cuda.get_rng_state(d) for d in cuda_devices]
        self.autocast: tuple[Any, ...] | None = _autocast_state()


class _RecomputeContext:
    """Entered around the recompute: the forward's RNG and autocast, flag on, normalisation guard.

    The RNG states of this thread are put back afterwards, so a recompute during backward leaves
    the random stream of the training loop where it was (a forward that saved none, for a
    region that draws no random number, has none read, set or put back).
    """

    def __init__(self, forward: ForwardState):
        self.forward = forward
        self.autocasts: list[Any] = []
        self.live: list[Any] | None = None  # layers' live state, put back on exit

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
            *devices, cache = fwd.autocast or _autocast_off()
            for device, enabled, dtype in devices:
                ctx = torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache)
                ctx.__enter__()
                self.autocasts.append(ctx)
        if fwd.states:
            self.live = _swap_states(fwd.states)
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
        if self.live is not None:
            _put_back(self.live)
        while self.autocasts:
            self.autocasts.pop().__exit__(None, None, None)
        if self.forward.cpu_state is not None:
            torch.set_rng_state(self.cpu_state)
            for device, state in zip(self.forward.cuda_devices, self.cuda_states):
                torch.cuda.set_rng_state(state, device)

