"""One training step of each variant: peak memory, FLOPs, median time, BatchNorm error.

A step is ``zoo.memory.train_step``'s: forward, ``out.float().square().mean()`` as the loss,
backward, in train mode, from fresh (``None``) gradients: the same step in every benchmark.

* Peak memory counts the model's parameters and buffers, its gradients, the input batch and every
  activation: on CUDA ``max_memory_allocated`` (and ``max_memory_reserved``) after
  ``reset_peak_memory_stats`` with only the measured model on the device; on the CPU the exact
  figure of MemTracker, which is what the CUDA allocator would hold up to its 512-byte rounding.
* FLOPs with FlopCounterMode; recompute shows up as the extra over plain.
* Time: every variant takes one step per round, in a shuffled order, after warm-up; the median
  over rounds, and its ratio to plain's median in the same run (machines are shared and noisy).
* BatchNorm: one step of each variant from the same buffers and seed, then the largest absolute
  difference of running_mean / running_var and of num_batches_tracked against plain's
  (``zoo.memory.bn_difference``), and the largest gradient difference (0: the plain model).
"""
from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zoo.memory import (bn_difference, bn_state, count_flops, cpu_peak_bytes, cuda_peak_bytes,
                        train_step)
from zoo.memory.host import host_times

from .variants import PLAIN, Variant

__all__ = ["training_step", "measure_memory", "measure_flops", "measure_times", "median_iqr",
           "measure_exactness", "measure_variants", "first_steps", "measure_or_report", "one_line"]


def training_step(variant: Variant, x: torch.Tensor) -> Callable[[], None]:
    """One training step of ``variant`` on ``x`` in its checkpoint mode (``zoo.memory.train_step``,
    gradients reset to None first)."""
    run = train_step(variant.model, x, forward=variant.forward)

    def step() -> None:
        variant.prepare()
        run()

    return step


def _models(variants: Sequence[Variant]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for v in variants:
        seen.setdefault(id(v.model), v.model)
    return list(seen.values())


def measure_memory(variant: Variant, x: torch.Tensor, others: Sequence[nn.Module] = ()) -> dict:
    """Peak bytes of one step. On CUDA the ``others`` models are moved to the CPU meanwhile, so
    the peak holds only this variant's model, as it would in a run of its own."""
    step = training_step(variant, x)
    if x.device.type != "cuda" and variant.forward is not None:
        return {"peak_bytes": None}  # MemTracker's dispatch mode keeps torch.compile out
    if x.device.type != "cuda":
        peak = cpu_peak_bytes(step, track=(variant.model, x))
        variant.model.zero_grad(set_to_none=True)
        return {"peak_bytes": peak}
    away = [m for m in others if m is not variant.model]
    for m in away:
        m.to("cpu")
    torch.cuda.empty_cache()
    try:
        allocated, reserved = cuda_peak_bytes(step, x.device)
    finally:
        variant.model.zero_grad(set_to_none=True)
        for m in away:
            m.to(x.device)
    return {"peak_bytes": allocated, "peak_reserved_bytes": reserved}


def measure_flops(variant: Variant, x: torch.Tensor) -> int:
    """FLOPs of one step (forward, recompute and backward)."""
    flops = count_flops(training_step(variant, x))
    variant.model.zero_grad(set_to_none=True)
    return flops


def measure_times(variants: Sequence[Variant], x: torch.Tensor, repeats: int = 5,
                  warmup: int = 1, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per step of each variant, rounds interleaved in a shuffled order."""
    steps = {v.name: training_step(v, x) for v in variants}
    return host_times(steps, repeats, warmup, cuda=x.device.type == "cuda", seed=seed,
                      clock=time.perf_counter)


def median_iqr(times: Sequence[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of ``times`` (one time: all three equal it)."""
    median = statistics.median(times)
    if len(times) < 2:
        return median, median, median
    q1, _, q3 = statistics.quantiles(times, n=4)
    return median, q1, q3


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def measure_exactness(variants: Sequence[Variant], x: torch.Tensor,
                      seed: int = 0) -> dict[str, dict]:
    """BatchNorm statistics and gradient error against plain after one step from the same state.

    Every model's state is put back afterwards. Returns ``{name: {"bn_stats_error": float | None,
    "bn_count_error": int | None, "grad_error": float}}``; None where the model has no BatchNorm.
    """
    states = {id(m): _state(m) for m in _models(variants)}
    after: dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    for v in variants:
        torch.manual_seed(seed)
        training_step(v, x)()
        buffers = bn_state(v.model)
        grads = {k: p.grad.detach().clone() for k, p in v.model.named_parameters()
                 if p.grad is not None}
        after[v.name] = (buffers, grads)
        v.model.zero_grad(set_to_none=True)
        v.model.load_state_dict(states[id(v.model)])
    ref_buffers, ref_grads = after[PLAIN] if PLAIN in after else after[variants[0].name]
    out = {}
    for name, (buffers, grads) in after.items():
        shared = [k for k in ref_grads if k in grads]
        out[name] = {
            **bn_difference(buffers, ref_buffers),
            "grad_error": max(((grads[k] - ref_grads[k]).abs().max().item() for k in shared),
                              default=0.0),
        }
    return out


def measure_variants(variants: Sequence[Variant], x: torch.Tensor, repeats: int = 5,
                     warmup: int = 1, timed: bool = True, exact: bool = True,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Every measurement of every variant on the batch ``x``; one row per variant, ratios against
    the first variant (plain). ``timed=False`` / ``exact=False`` skip the time and BatchNorm
    measurements (required under FakeTensorMode, where nothing is computed)."""
    rows: list[dict[str, Any]] = [{"variant": v.name, "description": v.description,
                                   "batch_size": int(x.shape[0])} for v in variants]
    models = _models(variants)
    if exact:
        errors = measure_exactness(variants, x, seed)
        for row in rows:
            row.update(errors[row["variant"]])
    for row, v in zip(rows, variants):
        row.update(measure_memory(v, x, models))
        # a compiled step runs outside FlopCounterMode's view (and would recompile under it)
        row["flops"] = measure_flops(v, x) if v.forward is None else None
    if timed:
        times = measure_times(variants, x, repeats, warmup, seed)
        for row in rows:
            ts = times[row["variant"]]
            row["times_s"] = ts
            row["median_s"] = statistics.median(ts)
            row["images_per_s"] = row["batch_size"] / row["median_s"]
    base = rows[0]
    for row in rows:
        row["peak_ratio"] = (None if row["peak_bytes"] is None
                             else row["peak_bytes"] / base["peak_bytes"])
        row["flops_ratio"] = (row["flops"] / base["flops"] if base["flops"]
                              and row["flops"] is not None else None)
        row["recompute_overhead"] = row["flops_ratio"] - 1 if row["flops_ratio"] else None
        if timed:
            row["time_ratio"] = row["median_s"] / base["median_s"]
            _, q1, q3 = median_iqr(row["times_s"])
            row["time_iqr_ratio"] = [q1 / base["median_s"], q3 / base["median_s"]]
    return rows


def one_line(error: BaseException, log: bool = True) -> str:
    """An exception as one line for a table cell: its type and the first line of its message,
    joined to the next one where the first only introduces it (a compile error's first line is
    "backend='inductor' raised:", the cause is on the second). With ``log``, the whole
    traceback goes to stderr too, so the run's log keeps what the cell cannot."""
    if log:
        traceback.print_exception(error, file=sys.stderr)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0] if not lines[0].endswith(":") or len(lines) < 2 else " ".join(lines[:2])
    return f"{type(error).__name__}: {text[:300]}"


def first_steps(variants: Sequence[Variant], x: torch.Tensor) -> dict[str, dict[str, Any]]:
    """One step of each variant from its current state (put back afterwards): the seconds it
    took (a compiled variant compiles in it) or, where it raised, the error as one line.

    Returns ``{name: {"first_step_s": float} or {"error": str}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        state = _state(v.model)
        cuda = x.device.type == "cuda"
        start = time.perf_counter()
        try:
            training_step(v, x)()
            if cuda:
                torch.cuda.synchronize(x.device)
            out[v.name] = {"first_step_s": time.perf_counter() - start}
        except Exception as e:  # noqa: BLE001 - reported as the variant's result, not raised
            out[v.name] = {"error": one_line(e)}
            if cuda:
                torch.cuda.empty_cache()
        v.model.zero_grad(set_to_none=True)
        v.model.load_state_dict(state)
    return out


def measure_or_report(variants: Sequence[Variant], x: torch.Tensor, repeats: int = 5,
                      warmup: int = 1, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`measure_variants` on the variants whose first step works; a variant that fails
    (a compiled one that cannot compile today, say) gets a row with ``status: failed`` and its
    one-line ``error``, so one failure neither stops the run nor hides the others' figures.
    Rows keep the variants' order; the first variant (plain) must work."""
    first = first_steps(variants, x)
    working = [v for v in variants if "error" not in first[v.name]]
    if not working or working[0] is not variants[0]:
        raise RuntimeError(f"the baseline {variants[0].name!r} fails: "
                           f"{first[variants[0].name]['error']}")
    try:
        measured = {r["variant"]: r for r in measure_variants(working, x, repeats, warmup,
                                                              seed=seed)}
    except Exception:  # noqa: BLE001 - one variant broke after its first step: find it
        measured = _measure_apart(working, x, repeats, warmup, seed, first)
    rows = []
    for v in variants:
        row = measured.get(v.name) or {"variant": v.name, "description": v.description,
                                       "batch_size": int(x.shape[0])}
        row.update(first[v.name], status="failed" if "error" in first[v.name] else "ok")
        rows.append(row)
    return rows


def _measure_apart(variants: Sequence[Variant], x: torch.Tensor, repeats: int, warmup: int,
                   seed: int, first: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each variant measured beside the first (plain) alone, after a joint run raised: the one
    that raises gets its error in ``first``; the others' rows say ``measured_apart``."""
    measured: dict[str, dict[str, Any]] = {}
    for v in variants[1:]:
        try:
            base, row = measure_variants([variants[0], v], x, repeats, warmup, seed=seed)
        except Exception as e:  # noqa: BLE001 - reported as the variant's result
            first[v.name] = {"error": one_line(e)}
            continue
        measured.setdefault(base["variant"], base)
        measured[v.name] = dict(row, measured_apart=True)
    if variants[0].name not in measured:  # every other variant failed: plain alone
        measured[variants[0].name] = measure_variants(variants[:1], x, repeats, warmup,
                                                      seed=seed)[0]
    return measured
