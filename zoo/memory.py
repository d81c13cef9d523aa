"""Measurement: peak memory (exact on CPU, allocator figures on CUDA), FLOPs, and step time.

The project's figures all come from here, so every script measures the same way:

* CPU peak memory with ``torch.distributed._tools.mem_tracker.MemTracker``: it accounts every
  storage allocated while it is active plus the modules and optimizers given to it, byte for
  byte, so two runs give the same figure (and it works under ``FakeTensorMode``, so a model too
  big for this machine is measured without being run).
* CUDA peak memory with ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
* FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` over forward + backward: recompute shows
  up as extra forward FLOPs, exactly.
* Time as the median of several steps after warm-up, synchronised on CUDA. Times are noisy on a
  shared machine: report them as ratios to the plain model measured in the same run.
"""
from __future__ import annotations

import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["parse_bytes", "format_bytes", "cpu_peak_bytes", "cuda_peak_bytes", "count_flops",
           "median_seconds"]

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``10GB`` -> 10_000_000_000, ``12GiB`` -> 12 * 2**30, ``1.5e9`` or 1500 -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size: expected a number of bytes or a "
                         "number with a unit, like 512MB, 10GB, 12GiB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """Bytes as MiB below 1 GiB, else GiB, e.g. ``788.0 MiB``, ``5.37 GiB``."""
    return f"{n / 2**20:.1f} MiB" if abs(n) < 2**30 else f"{n / 2**30:.2f} GiB"


def cpu_peak_bytes(step: Callable[[], Any], track: Iterable[Any] = ()) -> int:
    """Exact peak bytes on the CPU while ``step()`` runs, counting ``track``'s state from the start.

    ``track`` holds modules and optimizers whose parameters, buffers, gradients and states exist
    before the step (they count towards the peak, as they would on a GPU).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*track)
    with tracker, warnings.catch_warnings():
        # temporary modules (e.g. a slice of an nn.Sequential) may be gone before their backward
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def cuda_peak_bytes(step: Callable[[], Any], device: torch.device | None = None) -> tuple[int, int]:
    """(max allocated, max reserved) bytes on a CUDA device while ``step()`` runs."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def count_flops(step: Callable[[], Any]) -> int:
    """Total FLOPs of ``step()`` as counted by FlopCounterMode (matmuls and convolutions)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


def median_seconds(step: Callable[[], Any], repeats: int = 5, warmup: int = 2,
                   cuda: bool = False) -> tuple[float, list[float]]:
    """Median wall time of ``step()`` over ``repeats`` runs after ``warmup`` runs, and all times."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times
