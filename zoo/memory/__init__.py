"""Measurement: peak memory (exact on CPU, allocator figures on CUDA), FLOPs, and step time.

Every figure of the project comes from here, so the planner, the benchmarks and the tests measure
the same way, on the same step (:func:`train_step`: forward and loss, backward, the optimizer's
step when there is one, on a batch as the model takes it, in the caller's autocast):

* CPU peak memory with ``torch.distributed._tools.mem_tracker.MemTracker`` (:func:`cpu_peak_bytes`,
  :func:`step_cost`): byte for byte, so two runs give the same figure, and under
  ``FakeTensorMode`` too, so a model too big for this machine is measured without being run.
* CUDA peak memory with ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
* FLOPs with ``torch.utils.flop_counter.FlopCounterMode`` over forward + backward: recompute shows
  up as extra forward FLOPs, exactly.
* Time as the median of several steps after warm-up, synchronised on CUDA: report it as a ratio
  to the plain model measured in the same run.
* BatchNorm state against the plain model's (:func:`bn_state`, :func:`bn_difference`).

Files: ``training.py`` (the step, its loss), ``inputs.py`` (the batch: a tensor, a tuple or a
dict), ``precision.py`` (autocast as the step replays it), ``optimizer.py`` (the optimizer's
state and step in a fake step), ``quiet.py`` (one line for a batch the model cannot run on), ``batchnorm.py``, ``host.py`` (dispatched ops, host
time on ``meta``), ``tracker.py`` (op-by-op bytes and FLOPs), ``fake_mode.py`` and ``fake.py``
(fake state), ``step.py`` (one fake step: ``measure_step``), ``compiled.py`` (compiled graphs
replayed). What a CUDA card that is not here would do: the ``cards`` package."""
from __future__ import annotations

import functools
import math
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .batchnorm import bn_count, bn_difference, bn_state
from .host import host_times
from .training import default_loss, train_step

__all__ = ["parse_bytes", "parse_budget", "format_bytes", "mem_tracker", "cpu_peak_bytes",
           "cuda_peak_bytes", "count_flops", "step_cost", "median_seconds", "default_loss",
           "train_step", "bn_state", "bn_difference", "bn_count"]

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9,
          "T": 1e12, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*")
_EXPECTED = "expected bytes or a number with a unit, like 512MB, 10GB, 12GiB"


def parse_bytes(value: int | float | str) -> int:
    """``10GB`` -> 10_000_000_000, ``12GiB`` -> 12 * 2**30, ``1.5e9`` or 1500 -> bytes.

    A size must be a finite positive whole number of bytes (``1.5`` is neither 1 nor 2 bytes, and
    ``1.5`` meant as gigabytes would plan for nothing); anything else is a one-line ValueError
    saying what was expected."""
    size = _parse_size(value, allow_fraction=False)
    if math.isinf(size):
        raise ValueError(f"a memory size must be finite, got {value!r}; {_EXPECTED}")
    return int(size)


def parse_budget(value: int | float | str, device: torch.device | str | None = None,
                 total: int | None = None) -> int | float:
    """A memory budget in bytes: what :func:`parse_bytes` reads, and also ``inf`` (``float("inf")``
    or ``"inf"``: no limit, so nothing needs checkpointing, returned as ``math.inf``) and, for a
    CUDA ``device``, a fraction of the device's total memory (``0.8`` or ``"80%"``); ``total``:
    the memory a fraction is of (a card that is not here), instead of ``device``'s.

    ``nan``, zero, negative and unreadable budgets raise a one-line ValueError.
    """
    size = _parse_size(value, allow_fraction=True)
    if isinstance(size, _Fraction) and total is not None:
        return int(size * total)
    if isinstance(size, _Fraction):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"memory budget {value!r} is a fraction of a GPU's memory, but the "
                             f"model's input is on {dev.type}; give bytes instead, like 2GB")
        total = torch.cuda.get_device_properties(dev).total_memory
        return int(size * total)
    return size if math.isinf(size) else int(size)


class _Fraction(float):
    """A budget given as a fraction of a device's memory (``0.8``, ``"80%"``)."""


def _parse_size(value: int | float | str, allow_fraction: bool) -> float:
    what = "memory budget" if allow_fraction else "memory size"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"cannot read {value!r} as a {what}: {_EXPECTED}")
    if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
        value = math.inf
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).upper() if match else None
        if match is None or (unit not in _UNITS and unit != "%"):
            raise ValueError(f"cannot read {value!r} as a {what}: {_EXPECTED}")
        number = float(match.group(1))
        if unit == "%":
            if not allow_fraction or not 0 < number <= 100:
                raise ValueError(f"{what} {value!r}: a percentage must be in (0, 100] and is "
                                 f"allowed for a budget on a GPU only; {_EXPECTED}")
            return _Fraction(number / 100)
        number *= _UNITS[unit]
    else:
        number = float(value)
        if math.isnan(number):
            raise ValueError(f"{what} is nan (not a number); {_EXPECTED}")
        if allow_fraction and isinstance(value, float) and 0 < number < 1:
            return _Fraction(number)
    if math.isnan(number) or number < 1:
        raise ValueError(f"a {what} must be positive, got {value!r}; {_EXPECTED}")
    if not math.isinf(number) and number != int(number):
        raise ValueError(f"a {what} of {value!r} is not a whole number of bytes; {_EXPECTED}"
                         + (" (or a fraction of a GPU's memory below 1, like 0.8 or 80%)"
                            if allow_fraction else ""))
    return number


def format_bytes(n: float) -> str:
    """Bytes in a unit that shows them: ``512 B``, ``4.0 KiB``, ``788.0 MiB``, ``5.37 GiB``."""
    if abs(n) < 2**10:
        return f"{n:.0f} B"
    if abs(n) < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) < 2**30 else f"{n / 2**30:.2f} GiB"


class _NoHook:
    """Stands in MemTracker's table for the gradient hooks a frozen parameter cannot have."""

    @staticmethod
    def remove() -> None:
        return None


def mem_tracker() -> Any:
    """A ``MemTracker`` that also measures models with frozen parameters (fine-tuning).

    MemTracker registers a gradient hook on every parameter of every module it enters, and torch
    refuses a hook on a tensor that does not require grad. A frozen parameter never gets a
    gradient, so there is nothing for such a hook to count: it is marked as hooked already (an
    entry whose ``remove`` does nothing), and its bytes are counted as a parameter's all the same.
    """
    return _frozen_aware_tracker()()


@functools.cache
def _frozen_aware_tracker() -> type:
    from zoo._torch import mem_tracker
    MemTracker = mem_tracker()

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, *args: Any, **kw: Any) -> Any:
            handles = getattr(self, "_param_to_grad_hook_handles", None)
            if handles is not None:
                for param in module.parameters():
                    if not param.requires_grad and handles.get(param, None) is None:
                        handles[param] = (_NoHook, _NoHook)
            return super()._track_module_params_and_buffers(module, *args, **kw)

    return FrozenAwareMemTracker


def cpu_peak_bytes(step: Callable[[], Any], track: Iterable[Any] = ()) -> int:
    """Exact peak bytes on the CPU while ``step()`` runs, counting ``track``'s state from the start.

    ``track`` holds modules and optimizers whose parameters, buffers, gradients and states exist
    before the step (they count towards the peak, as they would on a GPU). Frozen parameters are
    counted as parameters, and get no gradient (:func:`mem_tracker`).
    """
    tracker = mem_tracker()
    tracker.track_external(*track)
    formatting = warnings.formatwarning  # MemTracker's module tracker replaces it to warn
    with tracker, warnings.catch_warnings():
        # temporary modules (e.g. a slice of an nn.Sequential) may be gone before their backward
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        # a planned spine calls its modules from its first one: the per-module hierarchy is
        # then not a tree, which the total this reads does not depend on
        warnings.filterwarnings("ignore", message="The module hierarchy tracking",
                                category=UserWarning)
        step()
    warnings.formatwarning = formatting
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


def step_cost(model: torch.nn.Module, x: Any,
              loss_fn: Callable[[Any], torch.Tensor] | None = None) -> tuple[int, int]:
    """(exact peak bytes, FLOPs) of one :func:`train_step` of ``model`` on ``x`` on the CPU, or
    under ``FakeTensorMode`` for a model and input made in it; the model's state counts towards
    the peak, as it would on a GPU. Its gradients are reset to None after."""
    step = train_step(model, x, loss_fn)
    peak = cpu_peak_bytes(step, track=(model,))
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


def median_seconds(step: Callable[[], Any], repeats: int = 5, warmup: int = 2,
                   cuda: bool = False) -> tuple[float, list[float]]:
    """Median wall time of ``step()`` over ``repeats`` runs after ``warmup`` runs, and all times
    (:func:`~.host.host_times` of the one step, on the wall clock)."""
    times = host_times({"step": step}, repeats, warmup, cuda=cuda, clock=time.perf_counter)["step"]
    return statistics.median(times), times


# A step on a named CUDA card, predicted without one (zoo.memory.cards: the card model)
from .cards.step import CardStep, predict_step  # noqa: E402
from .cards.compiled_step import CompiledCardStep, predict_compiled_step  # noqa: E402
from .cards.on_card import on_card  # noqa: E402
from .cards import CARDS, Card, card  # noqa: E402

__all__ += ["CardStep", "predict_step", "CompiledCardStep", "predict_compiled_step", "CARDS",
            "Card", "card", "on_card"]
