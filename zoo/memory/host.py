"""Host work of a training step: the aten ops it dispatches and its time on ``meta``.

On a GPU a step of many small layers is host-bound, so every op a checkpointed region adds
beyond its recompute is time the user pays. :class:`OpCounter` counts the aten ops a step
dispatches (a ``TorchDispatchMode``; exact, so tests may pin it), with the shallow copies
autograd makes of saved tensors (``aten.detach``) counted apart; :func:`recorded_regions` lists
the checkpoint regions a step opens and :func:`rng_state_calls` counts the RNG state reads and
writes it makes (what a region that preserves RNG state pays per call). :func:`host_times` times steps
on the ``meta`` device, where no kernel runs: the process's CPU time, interleaved rounds, read as
ratios to the plain model of the same run (``python scripts/benchmark.py host-cost``)."""
from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from zoo import _torch
from zoo._torch import TorchDispatchMode
from zoo.checkpoint import region

__all__ = ["OpCounter", "COPY", "count_ops", "Region", "recording", "recorded_regions",
           "rng_state_calls", "host_times"]


_BELOW_AUTOGRAD = _torch.DispatchKey.ADInplaceOrView
_is_excluded = _torch.dispatch_tls_is_dispatch_key_excluded
COPY = "shallow copy (aten.detach.default)"


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it, by name (``aten.detach.default``), and in all.

    Autograd makes shallow copies of tensors (a saved output, a saved tensor handed back by a
    saved-tensor hook) in C++, without the dispatcher; only while a dispatch mode is active are
    they routed through it, as ``aten.detach``. They reach the mode without having passed the
    autograd keys, which is how they are told apart: counted under :data:`COPY` and in
    ``copies``, so ``total - copies`` is what the dispatcher runs when no mode is watching.

    ``exclude``: ops counted apart in ``excluded`` (a selective region's kept ops: their names,
    or the region's ``keep(op, *args, **kwargs)`` function).
    """

    def __init__(self, exclude: Collection[Any] | Callable[..., bool] = ()) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.total = self.copies = self.excluded = 0
        names = () if callable(exclude) else frozenset(exclude)
        self.keep = exclude if callable(exclude) else lambda op, *_, **__: op in names

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.total += 1
        if func is torch.ops.aten.detach.default and not _is_excluded(_BELOW_AUTOGRAD):
            self.copies += 1
            self.ops[COPY] += 1
        else:
            self.ops[str(func)] += 1
        if self.keep(func, *args, **(kwargs or {})):
            self.excluded += 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Callable[[], Any]) -> Counter[str]:
    """The aten ops ``step()`` dispatches, by name."""
    with OpCounter() as counter:
        step()
    return counter.ops


# A checkpoint region as it was opened: (fn, args, kwargs, save_ops).
Region = tuple[Callable, tuple, dict, Any]


@contextmanager
def recording(record: Callable[..., None]) -> Iterator[None]:
    """``record(fn, args, kwargs, save_ops)`` called for every zoo.checkpoint region opened (not
    nested in another) while inside."""
    region.recorders.append(record)
    try:
        yield
    finally:
        region.recorders.remove(record)


def recorded_regions(step: Callable[[], Any]) -> list[Region]:
    """(fn, args, kwargs, save_ops) of every zoo.checkpoint region ``step()`` opens (nested
    regions are part of their outer one)."""
    regions: list[Region] = []
    with recording(lambda *r: regions.append(r)):
        step()
    return regions


_RNG_STATE = ((torch, "torch"), (torch.cuda, "torch.cuda"))


def rng_state_calls(step: Callable[[], Any]) -> Counter[str]:
    """The RNG state reads and writes ``step()`` makes, by name (``torch.get_rng_state``,
    ``torch.cuda.set_rng_state``, ...): torch's own functions, each wrapped by a counter that
    calls it while the step runs. A region that preserves RNG state makes four on the CPU per
    step: its forward reads the state, its recompute reads it, sets the forward's, puts it back."""
    counts: Counter[str] = Counter()
    originals = [(owner, f"{prefix}.{name}", name, getattr(owner, name))
                 for owner, prefix in _RNG_STATE for name in ("get_rng_state", "set_rng_state")]

    def counting(key: str, function: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return function(*args, **kwargs)
        return call

    for owner, key, name, function in originals:
        setattr(owner, name, counting(key, function))
    try:
        step()
    finally:
        for owner, _, name, function in originals:
            setattr(owner, name, function)
    return counts


def host_times(steps: dict[str, Callable[[], Any]], repeats: int = 15, warmup: int = 2,
               cuda: bool = False, seed: int = 0,
               clock: Callable[[], float] | None = None) -> dict[str, list[float]]:
    """Seconds per step of each of ``steps``: ``warmup`` rounds, then ``repeats`` rounds that run
    every step once in a shuffled order (so drift on a shared machine hits all alike).

    Off the GPU a step's host cost is the CPU time of this process (``time.process_time``), so
    time spent waiting while other processes run on a shared machine is not counted; on CUDA it
    is the wall time to a synchronised end (the GPU's work counts there). ``clock``: another
    clock (``time.perf_counter`` for a step's wall time on the CPU, its kernels included).
    """
    rng = random.Random(seed)
    clock = clock or (time.perf_counter if cuda else time.process_time)
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(warmup + repeats):
        rng.shuffle(names)
        for name in names:
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            steps[name]()
            if cuda:
                torch.cuda.synchronize()
            if round_ >= warmup:
                times[name].append(clock() - start)
    return times
