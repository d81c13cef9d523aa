"""Measure fake steps as a named CUDA card would run them: ``with on_card("h100"): ...``.

Every fake step :mod:`zoo.memory` and the planner measure inside the block counts the card's
bytes instead of the CPU's: the ops CUDA's kernels would run (:class:`~.kernels.CudaKernels`:
fused attention, one-byte dropout masks) and the caching allocator's blocks
(:class:`~.peak.CudaCounter`, a cuBLAS workspace of the card's size included). This is how
``zoo.plan(..., device="h100")`` and ``train.py --card h100`` size a step for a card on a
machine without one; outside the block nothing changes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from ...checkpoint.offload import simulated_host
from ..precision import Precision, current_precision, step_precision
from .autocast import cuda_autocast
from .timing import Card, card
from .allocator import CachingAllocator
from .kernels import CudaKernels
from .peak import CudaCounter, regions_counted
from ..fake import FakeStep
from ..tracker import StepCounter

__all__ = ["on_card", "planning_on", "current_card", "step_counter", "held_from_start",
           "workspaces_as_used"]

_CARD: ContextVar[Card | None] = ContextVar("zoo_card", default=None)
BOTH_THREADS = (False, True)  # the forward's thread and the autograd engine's


@contextlib.contextmanager
def on_card(name: str | Card) -> Iterator[Card]:
    """Fake steps measured inside count as on card ``name`` (a key of
    :data:`~.timing.CARDS` or a :class:`~.timing.Card`); yields the card."""
    token = _CARD.set(card(name))
    try:
        yield _CARD.get()
    finally:
        _CARD.reset(token)


@contextlib.contextmanager
def planning_on(name: str | Card) -> Iterator[Card]:
    """Plan or measure steps for card ``name`` in the caller's precision: inside
    ``torch.autocast`` (on the CPU or CUDA), CUDA's op lists at that dtype, run by the CPU's
    autocast on the fake step's CPU tensors (``zoo.plan(..., device=...)`` plans inside it);
    yields the card."""
    ambient = Precision.ambient()
    with step_precision(ambient.on_cpu()), on_card(name) as target, \
            cuda_autocast(ambient.dtype is not None):
        yield target


def current_card() -> Card | None:
    """The card of the enclosing :func:`on_card` block, or None."""
    return _CARD.get()


def step_counter(threads: tuple[bool, ...] = BOTH_THREADS
                 ) -> tuple[StepCounter, contextlib.AbstractContextManager]:
    """A counter for one fake step, and the modes to enter between the fake mode and the
    counter: the CPU's :class:`~zoo.memory.tracker.StepCounter` and nothing outside :func:`on_card`;
    inside, the card's :class:`~.peak.CudaCounter` (the cuBLAS workspaces of ``threads`` held
    from the start: :meth:`~.peak.CudaCounter.hold_workspaces`) and the card's kernels."""
    on = _CARD.get()
    if on is None:
        return StepCounter(), contextlib.nullcontext()
    counter = CudaCounter(CachingAllocator(), on.workspace)
    counter.hold_workspaces(threads)
    return counter, _card_kernels(counter)


def workspaces_as_used(run: Callable[[tuple[bool, ...]], StepCounter]) -> StepCounter:
    """The counter of ``run(threads)``, one fake step with the cuBLAS workspaces of ``threads``
    held from its start, as a step after the first finds them: both first, then, where the
    step ran no matmul on a thread (a card's ``matmul_threads`` says), again with only the
    threads that did, since no such workspace is ever made there. The CPU's counter has
    none."""
    counter = run(BOTH_THREADS)
    used = getattr(counter, "matmul_threads", None)
    if used is None or used == set(BOTH_THREADS):
        return counter
    return run(tuple(sorted(used)))


def held_from_start(fake: FakeStep, micro_batches: int = 1) -> list:
    """The tensors a fake step counts from its start: the model's parameters and buffers (and an
    optimizer's state), and on a card the batch too, which a training loop has moved there
    (``torch.cuda.max_memory_allocated`` counts it; this CPU's step does not allocate it); for
    a step accumulating ``micro_batches``, all of them (``FakeStep.micro_batches``: the list
    the loop runs over, moved there as a batch is)."""
    if _CARD.get() is None:
        return fake.tensors
    return fake.tensors + [t for b in fake.micro_batches(micro_batches) for t in b.tensors()]


@contextlib.contextmanager
def _card_kernels(counter: CudaCounter) -> Iterator[None]:
    """The card's kernels, and CUDA's autocast op lists for a step measured in autocast."""
    with cuda_autocast(current_precision().dtype is not None), CudaKernels(), \
            regions_counted(counter), simulated_host():
        yield
