"""Peak ``torch.cuda.max_memory_allocated`` of a training step, predicted without a GPU.

The step runs on fake CPU tensors under :class:`~zoo.memory.cards.kernels.CudaKernels`
(attention and dropout save what CUDA's kernels save), and every storage it makes or frees is
replayed through :class:`~zoo.memory.cards.allocator.CachingAllocator`, after the parameters,
buffers and input.
:class:`CudaCounter` also allocates the two cuBLAS workspaces where the step first runs a matmul
on each thread (forward and the autograd engine's; aten/src/ATen/cuda/CublasHandlePool.cpp: 32
MiB each on compute capability 9.x and newer, 8 MiB + 128 KiB before), and records every op
(:class:`OpRecord`: FLOPs, bytes read and written) for :mod:`.timing`."""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ... import _torch
from ..._torch import tree_flatten
from .allocator import CachingAllocator, round_size
from ..precision import current_precision
from .autocast import cuda_autocast
from .kernels import CudaKernels
from ..tracker import StepCounter, storage_key

__all__ = ["HOPPER_WORKSPACE", "OLDER_WORKSPACE", "OpRecord", "CudaCounter",
           "predict_cuda_peak", "run_counted", "regions_counted"]

HOPPER_WORKSPACE = 32 << 20  # cuBLAS workspace, compute capability 9.x and newer
OLDER_WORKSPACE = (4096 << 10) * 2 + (16 << 10) * 8  # ":4096:2:16:8" before
_aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
_BELOW_AUTOGRAD = _torch.DispatchKey.ADInplaceOrView
_excluded = _torch.dispatch_tls_is_dispatch_key_excluded
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}
# allocate or point a tensor at memory: no kernel runs on the card, no byte moves
_NO_KERNEL = {_aten.empty, _aten.empty_strided, _aten.set_}
# fused attention: the RNG seed and offset it returns live on the host (64-bit, 1 or 2)
_HOST_RNG = {_aten._scaled_dot_product_efficient_attention,
             _aten._scaled_dot_product_flash_attention, _aten._efficient_attention_forward,
             _aten._flash_attention_forward}


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op of a step: its overload packet, FLOPs (``flop_counter``'s formulas),
    bytes of its tensor arguments and outputs (0 for a view or an allocation: no kernel), dtype
    of its first tensor, whether it ran in the backward, and whether it is a shallow copy
    autograd makes of a saved tensor (routed through the dispatcher only while a mode watches:
    no host cost on the card, as ``zoo.memory.host.OpCounter`` tells them apart)."""

    op: Any
    flops: int
    bytes: int
    dtype: torch.dtype | None
    backward: bool
    copy: bool = False
    recompute: bool = False  # run in the backward by a saved tensor's unpack hook


class CudaCounter(StepCounter):
    """:class:`~zoo.memory.tracker.StepCounter` whose bytes are the caching allocator's blocks:
    ``current`` is ``memory_allocated``, ``peak`` its maximum; ``allocator`` is the replay
    (its ``reserved`` is ``memory_reserved``). A fused attention's RNG seed and offset, which
    CUDA keeps on the host, count nothing, nor do storages on the ``meta`` device.
    ``workspace``: bytes of a cuBLAS workspace (module docstring; 0: none). ``records``: an
    :class:`OpRecord` per op."""

    def __init__(self, allocator: CachingAllocator | None = None,
                 workspace: int = HOPPER_WORKSPACE,
                 on_op: Callable[[], None] | None = None) -> None:
        super().__init__(on_op)
        self.allocator = allocator or CachingAllocator()
        self.workspace = workspace
        self.records: list[OpRecord] = []
        self.regions = 0  # saved-tensor hooks entered in the forward: checkpointed regions
        self.unpacking = 0  # unpack hooks running now (a recompute runs inside one)
        self._blocks: dict[int, Any] = {}
        self._workspaces: dict[bool, Any] = {}
        self.matmul_threads: set[bool] = set()
        self._host_rng = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _DEVICE:
            return super().__torch_dispatch__(func, types, args, kwargs)
        backward = _torch.current_graph_task_id() != -1
        packet = getattr(func, "_overloadpacket", None)
        if packet in _MATMULS:
            self.matmul_threads.add(backward)
        if packet in _MATMULS and backward not in self._workspaces and self.workspace:
            self._workspaces[backward] = self.allocator.malloc(self.workspace)
            self.current = self.allocator.allocated
            self.peak = max(self.peak, self.allocator.peak)
        flops = self.flops
        copy = func is _aten.detach.default and not _excluded(_BELOW_AUTOGRAD)
        self._host_rng = packet in _HOST_RNG
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._host_rng = False
        tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                   if isinstance(t, torch.Tensor)]
        moved = 0 if getattr(func, "is_view", False) or packet in _NO_KERNEL else \
            sum(t.numel() * t.element_size() for t in tensors)
        self.records.append(OpRecord(packet, self.flops - flops, moved,
                                     tensors[0].dtype if tensors else None, backward, copy,
                                     backward and self.unpacking > 0))
        return out

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live or t.device.type == "meta" or \
                (self._host_rng and t.numel() <= 2 and t.dtype in (torch.int64, torch.uint64)):
            return
        block = self.allocator.malloc(st.nbytes())
        self._made += 1
        self._blocks[key] = block
        self._live[key] = (0, weakref.ref(st, lambda _, key=key: self._free(key)), self._made)
        self.current = self.allocator.allocated
        self.peak = max(self.peak, self.allocator.peak)

    def hold_workspaces(self, threads: tuple[bool, ...] = (False, True)) -> None:
        """Allocate the cuBLAS workspaces of ``threads`` (False: the forward's, True: the
        autograd engine's) now, as a step after the first finds them: a step's figures then
        carry them from the start, not inside the block that runs the first matmul (which a
        planner would take for that block's own bytes). ``matmul_threads`` says afterwards which
        threads did run a matmul."""
        for backward in threads:
            if backward not in self._workspaces and self.workspace:
                self._workspaces[backward] = self.allocator.malloc(self.workspace)
        self.current = self.allocator.allocated
        self.peak = max(self.peak, self.allocator.peak)

    def bytes_of(self, t: torch.Tensor) -> int:
        """Bytes of the allocator's block that holds ``t``'s storage (a request's rounding,
        and a cached block too small to split counted whole)."""
        block = self._blocks.get(storage_key(t))
        return block.size if block is not None else self.request_bytes(
            t.untyped_storage().nbytes(), t.device)

    @staticmethod
    def request_bytes(nbytes: int, device: torch.device) -> int:
        return round_size(nbytes) if nbytes > 0 else 0

    def _free(self, key: int) -> None:
        if self._live.pop(key, None) is not None:
            self.allocator.free(self._blocks.pop(key))
            self.current = self.allocator.allocated

    def reset_peak(self) -> None:
        self.allocator.reset_peak()
        self.peak = self.current


def predict_cuda_peak(step: Callable[[], Any], track: Any = (), limit: int | None = None,
                      warmup: int = 0, workspace: int = HOPPER_WORKSPACE) -> int:
    """Predicted ``max_memory_allocated`` of ``step()`` on a CUDA card: ``step`` runs here on
    fake CPU tensors (the caller's FakeTensorMode), ``track`` (modules, tensors, optimizers)
    is allocated before it, ``limit`` caps reserved memory as
    ``set_per_process_memory_fraction`` does (past it: ``SimulatedOutOfMemory``). ``warmup``
    steps run first on the same allocator, as a measurement after warm-up steps does.
    ``workspace``: a cuBLAS workspace's bytes on the card (:class:`CudaCounter`)."""
    return run_counted(step, track, limit, warmup, workspace).peak


def run_counted(step: Callable[[], Any], track: Any = (), limit: int | None = None,
                warmup: int = 0, workspace: int = HOPPER_WORKSPACE,
                counter: CudaCounter | None = None,
                autocast: torch.dtype | None = None) -> CudaCounter:
    """:func:`predict_cuda_peak`'s run, the counter itself returned (its ``peak``, its
    ``records`` of the last step). ``counter``: a fresh one to count in (``step`` may then read
    its records as it runs); ``limit`` and ``workspace`` are then its own. ``autocast``: the
    step runs under ``torch.autocast`` at this dtype as CUDA's autocast runs it
    (:class:`~.autocast.CudaAutocast`), its cache of parameters' casts off, as the GPU suite
    measures; None: as it is (float32)."""
    counter = counter or CudaCounter(CachingAllocator(limit), workspace)
    counter.track(*track) if isinstance(track, (list, tuple)) else counter.track(track)
    precision = contextlib.ExitStack()  # a step in autocast follows CUDA's op lists
    precision.enter_context(cuda_autocast(autocast is not None
                                          or current_precision().dtype is not None))
    if autocast is not None:
        precision.enter_context(torch.autocast("cpu", dtype=autocast, cache_enabled=False))
    with precision, CudaKernels(), counter, regions_counted(counter):
        for _ in range(warmup):
            step()
        counter.reset_peak()
        counter.records.clear()
        counter.regions = 0
        step()
    return counter


@contextlib.contextmanager
def regions_counted(counter: CudaCounter) -> Iterator[None]:
    """Counts into ``counter.regions`` every ``saved_tensors_hooks`` entered in a forward:
    each checkpointed region enters one (the zoo's and ``torch.utils.checkpoint``'s
    non-reentrant one alike); its recompute enters more, in the backward, not counted. Keeps
    ``counter.unpacking`` above 0 while an unpack hook runs: what runs then is a recompute."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    enter = hooks.__enter__

    def counted(self: Any) -> Any:
        if _torch.current_graph_task_id() == -1:
            counter.regions += 1
        if not getattr(self, "_zoo_watched", False):
            unpack = self.unpack_hook

            def unpacking(packed: Any) -> Any:
                counter.unpacking += 1
                try:
                    return unpack(packed)
                finally:
                    counter.unpacking -= 1

            self.unpack_hook, self._zoo_watched = unpacking, True
        return enter(self)

    hooks.__enter__ = counted
    try:
        yield
    finally:
        hooks.__enter__ = enter
