"""Selective recompute (``save_ops``) inside the zoo's own region: the outputs of the named ATen
ops are kept from the forward and handed back, in order, when the region is recomputed, so the
recompute runs only the cheap rest (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Megatron-LM).

:class:`Selective` wraps the region's function; the region (:mod:`zoo.checkpoint.region`) does
everything else as for any other region (saved-tensor slots, RNG and autocast replay, the
normalisation guard, early stop, torch's keywords). Its first call is the forward, run under
:class:`_Keep`, a dispatch mode that appends each named op's output to a list; each later call is
a recompute, run under :class:`_Serve`, which returns the next kept output instead of running the
op. Both let every other op through untouched: no detach is dispatched to keep or to serve a
tensor. When the forward ends, each kept tensor is swapped for ``.data`` (the same storage, no
autograd history; not an op), so that the region holding it makes no reference cycle through its
own graph. A served tensor is dropped from the list: it lives on only where the recompute's
graph needs it, as with torch's selective checkpoint, whose cache it replaces on this path.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from .. import _torch

TorchDispatchMode = _torch.TorchDispatchMode
_OpOverload = _torch.OpOverload
_Tensor = torch.Tensor
_task = _torch.current_graph_task_id
_USED = object()  # a kept output already handed to a recompute
_MUTATED = object()  # a kept output changed in place after it was kept


def save_set(save_ops: Collection[Any] | Callable[..., bool]) -> Any:
    """``save_ops`` checked: a frozenset of ATen op overloads, or a function
    ``keep(op, *args, **kwargs) -> bool`` (e.g. :class:`~zoo.checkpoint.policies.AllBut`) as is."""
    if callable(save_ops):  # no collection of ops is callable
        return save_ops
    if not isinstance(save_ops, Collection) or isinstance(save_ops, str):
        raise TypeError(f"zoo.checkpoint: save_ops must be a list or set of ATen op overloads "
                        f"(e.g. [torch.ops.aten.mm.default]) or a function keep(op, *args, "
                        f"**kwargs) -> bool, got {type(save_ops).__name__}")
    ops = save_ops if isinstance(save_ops, frozenset) else frozenset(save_ops)
    for op in ops:
        if not isinstance(op, _OpOverload):
            raise TypeError(f"zoo.checkpoint: save_ops must hold ATen op overloads such as "
                            f"torch.ops.aten.mm.default, got {op!r}; name the overload "
                            "(e.g. add '.default').")
    return ops


def _kept(ops: Any, func: Any, args: tuple, kwargs: dict | None) -> bool:
    """Whether the region keeps this op's output, by the user's function (the modes test a
    frozenset of names inline: a frame less per op)."""
    return bool(ops(func, *args, **(kwargs or {})))


_direct: dict[Any, Callable[..., Any]] = {}


def _runner(func: Any) -> Callable[..., Any]:
    """What runs ``func`` from a dispatch mode: its C++ entry point where calling the overload
    would only forward to it (one Python frame less per op, a few microseconds each), else the
    overload itself."""
    run = _direct.get(func)
    if run is None:
        op = getattr(func, "_op", None)
        run = op if op is not None and getattr(func, "_pyobj_dispatcher", None) is None else func
        _direct[func] = run
    return run


class _Keep(TorchDispatchMode):
    """The forward: runs every op, appends each named op's output (and its version) to ``kept``.

    ``state_bookkeeping`` lifts it (``bookkeeping_outside``), as it lifts :class:`_Serve`, so a
    layer's recompute-only bookkeeping is neither kept nor served.
    """

    bookkeeping_outside = True

    def __init__(self, ops: Any, kept: list) -> None:
        super().__init__()
        self.ops, self.kept = ops, kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        run = _direct.get(func) or _runner(func)
        out = run(*args, **kwargs) if kwargs else run(*args)
        ops = self.ops
        if func in ops if type(ops) is frozenset else _kept(ops, func, args, kwargs):
            self.kept.append((func, out, _version(out)))
        return out


class _Serve(TorchDispatchMode):
    """A recompute: runs every op except the named ones, whose kept outputs it returns in the
    forward's order. ``consume``: drop each one as it is served (a recompute for backward)."""

    bookkeeping_outside = True

    def __init__(self, ops: Any, owner: Selective, consume: bool) -> None:
        super().__init__()
        self.ops, self.owner, self.consume, self.next = ops, owner, consume, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        ops = self.ops
        if not (func in ops if type(ops) is frozenset else _kept(ops, func, args, kwargs)):
            run = _direct.get(func) or _runner(func)
            return run(*args, **kwargs) if kwargs else run(*args)
        index, kept = self.next, self.owner.kept
        self.next = index + 1
        entry = kept[index] if index < len(kept) else None
        if entry is None or entry is _USED or entry[0] is not func:
            self.owner.mismatch(func, index, entry)
        value = entry[1]
        if value is _MUTATED:
            raise RuntimeError(
                f"zoo.checkpoint: the output of {func} that a save_ops region keeps was changed "
                "in place later in the region's forward, so it cannot stand in for the op in "
                "the recompute. Leave that op out of save_ops, or make the change out of place.")
        if self.consume:
            kept[index] = _USED
            return value
        return _fresh(value)  # served again later: hand out an alias of it


def _fresh(out: Any) -> Any:
    """A new tensor object on the same storage (autograd writes its history onto what a dispatch
    mode returns, so a tensor served twice must not be the same object)."""
    if isinstance(out, _Tensor):
        return out.data
    if isinstance(out, (tuple, list)):
        return type(out)(_fresh(o) for o in out)
    return out


def _version(out: Any) -> Any:
    if isinstance(out, _Tensor):
        return _torch.tensor_version(out)
    if isinstance(out, (tuple, list)):
        return tuple(_version(o) for o in out)
    return None


class Selective:
    """The function of a ``save_ops`` region: ``fn`` with its named ops kept and served."""

    __slots__ = ("fn", "ops", "kept", "running", "done")

    def __init__(self, fn: Callable[..., Any], ops: Any):
        self.fn, self.ops = fn, ops
        self.kept: list | None = []
        self.running = self.done = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.done and not self.running:
            return self.forward(args, kwargs)
        # a recompute: for backward (consumes the kept outputs), or while the forward still runs
        # (torch.autograd.grad inside the region) or outside any backward (reading a grad_fn's
        # saved tensor), when a later recompute needs them again
        consume = self.done and _task() != -1
        if self.kept is None:
            raise RuntimeError(
                "zoo.checkpoint: a region with save_ops was recomputed a second time (a second "
                "backward through it, e.g. retain_graph=True, or a second backward call reaching "
                "it); its kept outputs are handed to one recompute only. Run one backward per "
                "forward through such a region, or leave save_ops out.")
        try:
            with _Serve(self.ops, self, consume):
                return self.fn(*args, **kwargs)
        finally:
            if consume:
                self.kept = None  # what that recompute did not reach is never needed

    def forward(self, args: tuple, kwargs: dict) -> Any:
        self.running = True
        kept = self.kept
        try:
            with _Keep(self.ops, kept):
                out = self.fn(*args, **kwargs)
        except BaseException:
            self.kept = None
            raise
        finally:
            self.running = False
        self.done = True
        for i, (func, value, version) in enumerate(kept):
            kept[i] = (func, _fresh(value) if _version(value) == version else _MUTATED)
        return out

    def mismatch(self, func: Any, index: int, entry: Any) -> None:
        if entry is _USED:
            raise RuntimeError("zoo.checkpoint: a kept output of a save_ops region was served "
                               "twice in one recompute; the region is not deterministic.")
        ran = "nothing" if entry is None else str(entry[0])
        raise RuntimeError(
            f"zoo.checkpoint: the recompute of a save_ops region ran {func} where its forward ran "
            f"{ran} (kept output {index}), so the region is not deterministic given its inputs "
            "(does it branch on random numbers, global state or tensor values?). Make it "
            "deterministic, or leave it out of the checkpoint.")
