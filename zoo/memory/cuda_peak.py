"""Peak ``torch.cuda.max_memory_allocated`` of a training step, predicted without a GPU.

The step runs on fake CPU tensors (FakeTensorMode: shapes, no data) under
:class:`~zoo.memory.cuda_ops.CudaKernels`, so attention and dropout save what CUDA's kernels
save, and every storage the step makes or frees is replayed through
:class:`~zoo.memory.cuda_allocator.CachingAllocator`, so the count is in the caching
allocator's blocks (512-byte rounding, unsplit cached blocks counted whole). The model's
parameters, buffers and the input are allocated first, as they are on the card before the step.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .cuda_allocator import CachingAllocator
from .cuda_ops import CudaKernels
from .tracker import StepCounter

__all__ = ["CudaCounter", "predict_cuda_peak"]


class CudaCounter(StepCounter):
    """:class:`~zoo.memory.tracker.StepCounter` whose bytes are the caching allocator's blocks:
    ``current`` is ``memory_allocated``, ``peak`` its maximum; ``allocator`` is the replay
    (its ``reserved`` is ``memory_reserved``). Storages on the ``meta`` device (a fused
    attention's RNG seed and offset, which CUDA keeps on the host) count nothing."""

    def __init__(self, allocator: CachingAllocator | None = None,
                 on_op: Callable[[], None] | None = None) -> None:
        super().__init__(on_op)
        self.allocator = allocator or CachingAllocator()
        self._blocks: dict[int, Any] = {}

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live or t.device.type == "meta":
            return
        block = self.allocator.malloc(st.nbytes())
        self._made += 1
        self._blocks[key] = block
        self._live[key] = (0, weakref.ref(st, lambda _, key=key: self._free(key)), self._made)
        self.current = self.allocator.allocated
        self.peak = max(self.peak, self.allocator.peak)

    def _free(self, key: int) -> None:
        if self._live.pop(key, None) is not None:
            self.allocator.free(self._blocks.pop(key))
            self.current = self.allocator.allocated

    def reset_peak(self) -> None:
        self.allocator.reset_peak()
        self.peak = self.current


def predict_cuda_peak(step: Callable[[], Any], track: Any = (), limit: int | None = None,
                      warmup: int = 0) -> int:
    """Predicted ``max_memory_allocated`` of ``step()`` on a CUDA card: ``step`` runs here on
    fake CPU tensors (the caller's FakeTensorMode), ``track`` (modules, tensors, optimizers)
    is allocated before it, ``limit`` caps reserved memory as
    ``set_per_process_memory_fraction`` does (past it: ``SimulatedOutOfMemory``). ``warmup``
    steps run first on the same allocator, as a measurement after warm-up steps does."""
    counter = CudaCounter(CachingAllocator(limit))
    counter.track(*track) if isinstance(track, (list, tuple)) else counter.track(track)
    with CudaKernels(), counter:
        for _ in range(warmup):
            step()
        counter.reset_peak()
        step()
    return counter.peak
