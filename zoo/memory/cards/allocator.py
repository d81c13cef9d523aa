"""The CUDA caching allocator's arithmetic, replayed on a machine without a GPU.

``torch.cuda.max_memory_allocated`` counts blocks, not the bytes a tensor asked for.
:class:`CachingAllocator` replays what c10/cuda/CUDACachingAllocator.cpp does with a sequence of
mallocs and frees at its default settings (one stream; no ``max_split_size_mb``, no
``roundup_power2_divisions``, no expandable segments): 512-byte rounding, the small and large
pools, best fit (lowest address among equals), segment sizes, splitting only what is worth a
block, merging free neighbours, and a cap (``set_per_process_memory_fraction``) that gives back
wholly free segments before failing. Its ``peak`` is then ``max_memory_allocated`` of the same
sequence. Not seen: cuDNN/cuBLAS workspaces unless given, the driver's own memory. What is
modelled and what is not: docs/benchmarks/prediction.md."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "round_size", "segment_size", "CachingAllocator",
           "SimulatedOutOfMemory"]

MIN_BLOCK = 512           # kMinBlockSize
SMALL_SIZE = 1 << 20      # kSmallSize: largest small-pool request
SMALL_BUFFER = 2 << 20    # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20   # kLargeBuffer: the segment of a request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20     # kRoundLarge


def round_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` takes at least: a multiple of 512, 512 at least."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes reserved (``cudaMalloc``) for a rounded request that no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


class SimulatedOutOfMemory(RuntimeError):
    """A reservation past the cap, with every wholly free segment given back already."""


@dataclass(eq=False)
class Block:
    """A piece of a segment: ``address`` (simulated), ``size``, free or not, its neighbours."""

    address: int
    size: int
    small: bool
    segment: int
    allocated: bool = False
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class CachingAllocator:
    """Replays the CUDA caching allocator (module docstring) over ``malloc``/``free`` calls.

    ``allocated``: bytes of the blocks in use (``memory_allocated``); ``peak``: its maximum
    (``max_memory_allocated``); ``reserved``: bytes of the segments (``memory_reserved``).
    ``limit``: the cap in bytes (None: none)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.allocated = 0
        self.peak = 0
        self.reserved = 0
        self._pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._blocks: dict[int, Block] = {}  # free blocks by address
        self._segments: dict[int, int] = {}  # segment base address -> size
        self._next_address = 0

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def malloc(self, nbytes: int) -> Block | None:
        """A block for ``nbytes`` (None for zero bytes, which CUDA does not allocate)."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size) or self._new_segment(small, size)
        left = block.size - size
        if left >= MIN_BLOCK if small else left > SMALL_SIZE:
            rest = Block(block.address + size, left, small, block.segment, prev=block,
                         next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)
        return block

    def free(self, block: Block | None) -> None:
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._insert(block)

    def _insert(self, block: Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.address, block.segment))
        self._blocks[block.address] = block

    def _remove(self, block: Block) -> None:
        pool = self._pools[block.small]
        del pool[bisect.bisect_left(pool, (block.size, block.address, block.segment))]
        del self._blocks[block.address]

    def _best_fit(self, small: bool, size: int) -> Block | None:
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        block = self._blocks[pool[i][1]]
        self._remove(block)
        return block

    def _new_segment(self, small: bool, size: int) -> Block:
        reserve = segment_size(size)
        if self.limit is not None and self.reserved + reserve > self.limit:
            self._release_cached()
            if self.reserved + reserve > self.limit:
                raise SimulatedOutOfMemory(
                    f"reserving {reserve} bytes past the cap of {self.limit} bytes "
                    f"({self.reserved} reserved, {self.allocated} allocated)")
        base = self._next_address
        self._next_address += reserve + ROUND_LARGE  # segments never touch
        self._segments[base] = reserve
        self.reserved += reserve
        return Block(base, reserve, small, base)

    def _release_cached(self) -> None:
        """Give back every segment that is one free block (``release_cached_blocks``)."""
        for block in [b for b in self._blocks.values()
                      if b.prev is None and b.next is None]:
            self._remove(block)
            self.reserved -= self._segments.pop(block.segment)
