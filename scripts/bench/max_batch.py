"""The largest batch each variant trains within a memory budget.

Two ways to the same answer:

* :class:`PeakPredictor` (any machine, no GPU): the exact peak of one training step under
  ``FakeTensorMode``, where tensors have shapes but no data, so MemTracker counts every byte a
  real step would allocate while nothing is allocated or computed. A laptop answers "what fits on
  a 12 GB card". With ``allocator="cuda"`` every allocation is rounded up to the CUDA caching
  allocator's 512-byte blocks (MemTracker does this only for CUDA tensors, and fake CUDA tensors
  cannot run backward without a GPU, so the rounding is applied to the fake CPU tensors).
  What it cannot see: cuDNN/cuBLAS workspaces and kernels that differ between CPU and CUDA (on the
  CPU, attention with dropout stores its T x T matrix; CUDA's fused kernels do not).
* :func:`cuda_peak` (a real GPU): one real step, ``torch.cuda.set_per_process_memory_fraction``
  capping the device at the budget; an out-of-memory error means "does not fit", the memory is
  freed and the search goes on.
* :class:`CardPredictor` (any machine, no GPU, a named card of ``zoo.memory.cards``): one step
  under ``zoo.memory.predict_step``, the card's kernels (fused attention, what CUDA's
  kernels save) and caching allocator capped at the budget; a batch fits when the step raises no
  ``SimulatedOutOfMemory``, and its predicted step time on the card gives samples/s.

:func:`search_largest_batch` searches either (``zoo.planner.largest_batch``, the planner's, predicts
it from a plan's profile instead): a linear guess from two probes, galloping from the guess, then
bisection, so the answer ``b`` fits and ``b + 1`` was probed and does not.
"""
from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zoo.memory import cpu_peak_bytes
from zoo.memory.cards.step import CardStep, predict_step
from zoo.memory.cards import Card, card
from zoo.memory.cards.allocator import SimulatedOutOfMemory
from zoo.memory.cards.autocast import cuda_autocast
from zoo.memory.precision import Precision

from .measure import training_step
from .variants import build_variant, create

__all__ = ["CUDA_BLOCK", "cuda_allocator_rounding", "PeakPredictor", "CardPredictor",
           "cuda_peak", "search_largest_batch"]

CUDA_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, every block a multiple of it


@contextlib.contextmanager
def cuda_allocator_rounding() -> Iterator[None]:
    """While active, MemTracker rounds every storage up to a multiple of 512 bytes, as the CUDA
    caching allocator does, whatever the device of the (fake) tensors."""
    from torch.distributed._tools import mem_tracker

    info = mem_tracker._WeakRefInfo
    original = info._calculate_mem_consumed

    def rounded(self: Any) -> int:
        return math.ceil(self.size * self.element_size / CUDA_BLOCK) * CUDA_BLOCK

    info._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        info._calculate_mem_consumed = original


class PeakPredictor:
    """Exact peak bytes of one training step of ``model_name``'s variants at any batch size,
    computed under ``FakeTensorMode`` (nothing is allocated; results are cached).

    Args:
        model_name: a name from ``zoo.list_models()`` (or a model constructor).
        size: image side or sequence length (the model's ``example_input`` default if None).
        allocator: ``"cuda"`` rounds allocations to 512-byte blocks (predicts
            ``torch.cuda.max_memory_allocated``); ``"cpu"`` gives MemTracker's CPU bytes.
        model_kwargs: passed to ``zoo.create_model`` (or to the constructor).
    """

    def __init__(self, model_name: str | Callable[..., Any], size: int | None = None,
                 allocator: str = "cuda",
                 **model_kwargs: Any) -> None:
        if allocator not in ("cuda", "cpu"):
            raise ValueError(f"allocator must be 'cuda' (512-byte blocks) or 'cpu', "
                             f"got {allocator!r}")
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.model_name, self.size, self.allocator = model_name, size, allocator
        self.model_kwargs = model_kwargs
        self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._variants: dict[str, Any] = {}
        self.cache: dict[tuple[str, int], int] = {}

    def _variant(self, name: str) -> Any:
        if name not in self._variants:
            with self._mode:
                torch.manual_seed(0)
                model = create(self.model_name, **self.model_kwargs)
                self._variants[name] = build_variant(model, name, reuse=True)
        return self._variants[name]

    def __call__(self, variant: str, batch_size: int) -> int:
        """Predicted peak bytes of one step of ``variant`` at ``batch_size``; inside
        ``torch.autocast`` (the GPU suite's bf16 parts), the step in that precision as CUDA's
        autocast runs it (``zoo.memory.cards.autocast``), its cache of casts off."""
        dtype = Precision.ambient().dtype  # the caller's autocast: CUDA's op lists at it
        key = (variant, int(batch_size), dtype)
        if key not in self.cache:
            v = self._variant(variant)
            rounding = cuda_allocator_rounding() if self.allocator == "cuda" \
                else contextlib.nullcontext()
            cast = contextlib.nullcontext() if dtype is None else \
                torch.autocast("cpu", dtype=dtype, cache_enabled=False)
            with self._mode, rounding, cuda_autocast(dtype is not None), cast:
                x = v.model.example_input(int(batch_size), self.size) \
                    if hasattr(v.model, "example_input") else self._input(batch_size)
                self.cache[key] = cpu_peak_bytes(training_step(v, x), track=(v.model, x))
                v.model.zero_grad(set_to_none=True)
        return self.cache[key]

    def _input(self, batch_size: int) -> torch.Tensor:
        """The zoo model's example input, for variants whose model is not a zoo model."""
        if "input_model" not in self._variants:
            with self._mode:
                self._variants["input_model"] = create(self.model_name, **self.model_kwargs)
        return self._variants["input_model"].example_input(int(batch_size), self.size)


class CardPredictor:
    """One training step of ``model_name``'s variants on card ``on`` at any batch size under a
    memory ``budget`` (reserved bytes, as ``set_per_process_memory_fraction`` caps them): its
    :class:`~zoo.memory.cards.step.CardStep` (peak and time), or None where the card's caching
    allocator would run out of memory. Results are cached.

    The models are real CPU models (``predict_step`` makes fake copies of their state), one per
    variant that needs its own (``official`` is a twin), built with ``torch.manual_seed(seed)``.
    ``autocast``: steps under CUDA's autocast at this dtype (None: float32).
    """

    def __init__(self, model_name: str | Callable[..., Any], budget: int, on: str | Card = "h100",
                 size: int | None = None, seed: int = 0, autocast: torch.dtype | None = None,
                 **model_kwargs: Any) -> None:
        self.card, self.autocast = card(on), autocast
        if budget > self.card.memory:
            raise ValueError(f"a budget of {budget / 1e9:.1f} GB exceeds the "
                             f"{self.card.name}'s {self.card.memory / 1e9:.0f} GB; give a "
                             f"smaller --memory_budget or another --card")
        self.model_name, self.budget, self.size = model_name, budget, size
        self.seed, self.model_kwargs = seed, model_kwargs
        self._base: Any = None
        self._variants: dict[str, Any] = {}
        self.cache: dict[tuple[str, int], CardStep | None] = {}

    def _variant(self, name: str) -> Any:
        if self._base is None:
            torch.manual_seed(self.seed)
            self._base = create(self.model_name, **self.model_kwargs)
        if name not in self._variants:
            self._variants[name] = build_variant(self._base, name)
        return self._variants[name]

    def __call__(self, variant: str, batch_size: int) -> CardStep | None:
        """The predicted step of ``variant`` at ``batch_size``, None if it does not fit."""
        key = (variant, int(batch_size))
        if key not in self.cache:
            v = self._variant(variant)
            if v.forward is not None:
                raise ValueError(f"variant {variant!r} is compiled; the card prediction runs "
                                 f"eager variants only")
            v.prepare()
            x = self._base.example_input(int(batch_size), self.size)
            try:
                self.cache[key] = predict_step(v.model.train(), x, self.card, limit=self.budget,
                                               autocast=self.autocast)
            except SimulatedOutOfMemory:
                self.cache[key] = None
        return self.cache[key]

    def peak(self, variant: str, batch_size: int) -> float:
        """Predicted peak bytes, ``inf`` where the card runs out of memory (for the search)."""
        step = self(variant, batch_size)
        return math.inf if step is None else float(step.peak)


def cuda_peak(step_at: Callable[[int], Callable[[], None]], budget: int,
              device: torch.device) -> Callable[[int], float]:
    """A peak function for :func:`search_largest_batch` on a real CUDA device capped at ``budget``.

    ``step_at(b)`` returns a training step at batch ``b``. The device is capped with
    ``set_per_process_memory_fraction`` so that allocating past the budget raises out-of-memory;
    the returned function gives ``max_memory_allocated`` of the step, or ``inf`` on out-of-memory
    (after freeing the failed step's memory).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    if budget > total:
        raise ValueError(f"a budget of {budget / 1e9:.1f} GB exceeds the device's "
                         f"{total / 1e9:.1f} GB")

    def peak(batch_size: int) -> float:
        torch.cuda.set_per_process_memory_fraction(budget / total, index)
        step = None
        try:
            step = step_at(batch_size)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            return float(torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            return math.inf
        finally:
            del step
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, index)

    return peak


def search_largest_batch(peak: Callable[[int], float], budget: int,
                         probes: tuple[int, int] = (8, 16), max_batch: int = 1 << 20
                         ) -> tuple[int, dict[int, float]]:
    """The largest batch ``b`` with ``peak(b) <= budget`` (0 if not even 1 fits), and every probe.

    Assumes the peak grows with the batch. Two probes give a linear guess; from the guess the
    search gallops (steps doubling from ~1% of the guess) until it holds a batch that fits and one
    that does not, then bisects, so ``b + 1`` is always probed and over the budget (unless ``b``
    is ``max_batch``).
    """
    seen: dict[int, float] = {}
    lo, hi = 0, max_batch + 1  # lo fits (0 trivially), hi does not (max_batch + 1 by definition)

    def probe(b: int) -> bool:
        nonlocal lo, hi
        b = max(1, min(b, max_batch))
        if b not in seen:
            seen[b] = peak(b)
        if seen[b] <= budget:
            lo = max(lo, b)
            return True
        hi = min(hi, b)
        return False

    a, b = probes
    if probe(a) and probe(b) and hi > max_batch:
        slope = (seen[b] - seen[a]) / (b - a)
        guess = b + int((budget - seen[b]) / slope) if slope > 0 else max_batch
        guess = max(lo + 1, min(guess, max_batch))
        step = max(1, guess // 100)
        if probe(guess):
            while hi > lo + 1 and lo < max_batch and probe(lo + step):
                step *= 2
        else:
            while hi > lo + 1 and not probe(max(lo + 1, hi - step)):
                step *= 2
    while hi > lo + 1:
        probe((lo + hi) // 2)
    return lo, seen
