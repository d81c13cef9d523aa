"""The region-cost command: what one zoo.checkpoint region costs the host, counted call by call,
with the RNG state saved in every region and saved only where the region draws random numbers
(the zoo's models pass ``preserve_rng_state=False`` to their regions that draw none).

    python scripts/benchmark.py region-cost                # densenet_bc_100:64 and the chain
    python scripts/benchmark.py region-cost --models resnet110:8 --repeats 9

For each workload (``MODEL:BATCH`` in its recommended mode, or ``chain``: 100 tiny regions), per
region over plain:

* Python calls: ``call`` and ``c_call`` events of ``sys.setprofile`` in one training step;
* RNG calls: calls of ``torch.get_rng_state``/``set_rng_state`` and their ``torch.cuda`` twins
  (``zoo.memory.host.rng_state_calls``);
* ``torch.cuda`` calls a CUDA run would make: here CUDA is not initialised, so the region skips
  them; the step is run once more with ``torch.cuda.is_initialized`` answering True and counting
  stand-ins for ``current_device`` and the CUDA RNG state getter and setter (the CPU ones stay
  real), and every other ``torch.cuda`` function entered from outside ``torch.cuda`` is counted
  by ``sys.setprofile``. Counts only: what those calls cost on a GPU is not measured here.

and the step's ops and host time on ``meta`` beside plain in the same interleaved rounds
(:func:`bench.host_cost.measure`, ``zoo.memory.host.host_times``), and the part of a region that
saving the RNG state changes, timed alone (:func:`state_bookkeeping_times`). The "RNG saved"
variant is the same model and step with the regions' ``preserve_rng_state=False`` read as True
(:func:`rng_saved_per_region`): every region saving it, call for call. Calls are counted
in a CPU step (at batch ``count_batch``), where no op is a Python decomposition as on ``meta``.
"""
from __future__ import annotations

import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from zoo.checkpoint import checkpoint, keywords
from zoo.checkpoint.recompute import ForwardState, _RecomputeContext
from zoo.memory.host import host_times, recorded_regions, rng_state_calls

from . import report
from .host_cost import Entry, floor_of, measure
from .host_peers import chain_entries, zoo_entries

__all__ = ["region_cost", "rng_saved_per_region", "python_calls", "cuda_calls",
           "state_bookkeeping_times"]

SAVED = "RNG saved in every region"
NOW = "RNG saved where drawn"
CHAIN = "chain"  # the workload of 100 tiny regions


@contextmanager
def rng_saved_per_region() -> Iterator[None]:
    """Regions passed ``preserve_rng_state=False`` alone (the zoo models' regions that draw no
    random number) save and replay their RNG state as a region that draws does: the keywords'
    shared fast-path Options is swapped for the default one, so not one call is added."""
    no_rng = keywords.NO_RNG
    keywords.NO_RNG = keywords.DEFAULT
    try:
        yield
    finally:
        keywords.NO_RNG = no_rng


def python_calls(step: Callable[[], Any]) -> int:
    """Python function calls (``call`` and ``c_call`` profile events) of one ``step()``."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count[0]


@contextmanager
def _replaced(owner: Any, stand_ins: dict[str, Callable]) -> Iterator[None]:
    originals = {name: getattr(owner, name) for name in stand_ins}
    for name, fn in stand_ins.items():
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)


def _counting(counts: Counter, name: str, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)
    return call


def cuda_calls(step: Callable[[], Any]) -> Counter:
    """The ``torch.cuda`` calls one ``step()`` makes when CUDA is initialised, by name: CUDA is
    stood in for (module docstring), so the step's code takes its CUDA branches on this CPU."""
    counts: Counter = Counter()
    state = torch.zeros(16, dtype=torch.uint8)
    stand_ins = {"is_initialized": _counting(counts, "is_initialized", lambda: True),
                 "current_device": _counting(counts, "current_device", lambda: 0),
                 "get_rng_state": _counting(counts, "get_rng_state", lambda device=0: state),
                 "set_rng_state": _counting(counts, "set_rng_state", lambda s, device=0: None)}
    cuda_dir = torch.cuda.__file__.rsplit("/", 1)[0] + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:  # other torch.cuda functions
        if event == "call" and frame.f_code.co_filename.startswith(cuda_dir) and \
                not (frame.f_back and frame.f_back.f_code.co_filename.startswith(cuda_dir)):
            counts[frame.f_code.co_name] += 1

    with _replaced(torch.cuda, stand_ins):
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    return counts


def _with_rng_saved(step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with rng_saved_per_region():
            return step()
    return run


def _entries(name: str, batch: int, device: str) -> list[Entry]:
    """plain, the recommended mode with the RNG state saved in every region, and as the model
    calls it (saved only where a region draws random numbers);
    ``name`` ``chain``: 100 tiny regions (Linear + ReLU, batch 1), where a step is almost only
    the regions' own work, run through ``zoo.checkpoint(..., preserve_rng_state=False)``."""
    if name == CHAIN:
        plain, _, zoo = chain_entries(device=device)
        zoo.model.wrap = partial(checkpoint, preserve_rng_state=False)
        mode = "zoo"
    else:
        plain, zoo = zoo_entries(name, batch, device=device, peers=False)[:2]
        mode = zoo.name.removeprefix("zoo ")
    saved = Entry(f"{mode}, {SAVED}", "plain", zoo.model, _with_rng_saved(zoo.step),
                  "zoo.checkpoint, preserve_rng_state read as True")
    zoo.name, zoo.note = f"{mode}, {NOW}", "zoo.checkpoint as the model calls it"
    return [plain, saved, zoo]


def _counts(name: str, batch: int) -> dict[str, dict[str, Any]]:
    """Python, RNG and would-be CUDA calls of one CPU step of each entry (after a first step),
    and the Python calls of the floor (the plain step, then every region's rerun replayed)."""
    entries = _entries(name, batch, "cpu")
    out = {}
    for e in entries:
        e.step()
        out[e.name] = {"python_calls": python_calls(e.step),
                       "rng_calls": dict(rng_state_calls(e.step)),
                       "cuda_calls": dict(cuda_calls(e.step))}
    plain, zoo = entries[0], entries[-1]
    floor = floor_of(zoo.model, zoo.step).step(plain.step, zoo.model)
    floor()
    out["floor"] = {"python_calls": python_calls(floor)}
    return out


def state_bookkeeping_times(regions: int = 1000, repeats: int = 15,
                            warmup: int = 2) -> dict[str, float]:
    """Host microseconds per region of the forward's state record (``ForwardState``) and the
    recompute's context entered and left (``_RecomputeContext``), with and without RNG state:
    the part of a region that ``preserve_rng_state`` changes, timed alone on the CPU, medians
    of ``zoo.memory.host.host_times`` over steps of ``regions`` regions."""
    def step(preserve: bool) -> Callable[[], None]:
        def run() -> None:
            for _ in range(regions):
                with _RecomputeContext(ForwardState([], preserve)):
                    pass
        return run

    times = host_times({SAVED: step(True), NOW: step(False)}, repeats, warmup)
    return {name: statistics.median(t) / regions * 1e6 for name, t in times.items()}


def region_cost(models: str = "densenet_bc_100:64,chain", count_batch: int = 2,
                repeats: int = 15, warmup: int = 2,
                json_out: str | None = None) -> dict[str, Any]:
    """Per region: Python calls, RNG state calls, would-be torch.cuda calls; host time on meta.

    Calls are counted in a CPU step at batch ``count_batch`` (on ``meta`` a BatchNorm is a
    Python decomposition whose calls would swamp the region's own); ops and host time are those
    of ``MODEL:BATCH`` on ``meta``. ``chain``: 100 tiny regions, each Linear + ReLU (batch 1),
    where the host time per region over plain is almost only the region's own."""
    results: dict[str, Any] = {"command": report.command_line(),
                               "machine": report.machine_info(torch.device("cpu")),
                               "repeats": repeats, "count_batch": count_batch, "workloads": []}
    for spec in report.comma_list(models):
        name, _, size = spec.partition(":")
        batch = 1 if name == CHAIN else int(size or 2)
        entries = _entries(name, batch, "meta")
        regions = len(recorded_regions(entries[-1].step))
        counts = _counts(name, count_batch)
        rows = measure(entries, repeats, warmup)
        for row in rows:
            row.update(counts[row["variant"]])
        results["workloads"].append({"model": name, "batch_size": batch,
                                     "regions": regions, "rows": rows,
                                     "floor_python_calls": counts["floor"]["python_calls"]})
    results["bookkeeping_us"] = state_bookkeeping_times(repeats=repeats, warmup=warmup)
    print(markdown_report(results))
    if json_out:
        report.write_json(json_out, results)
    return results


def _per_region(value: int | float, plain: int | float, regions: int) -> str:
    return f"{(value - plain) / regions:.1f}"


def markdown_report(results: dict[str, Any]) -> str:
    """One table per workload: per-region counts over plain (Python calls also over the floor),
    ops and host time on meta with its ratio to plain."""
    m = results["machine"]
    parts = [f"Machine: {m['cpu']}, {m['cpu_count']} cores, no GPU, torch {m['torch']}; calls "
             f"counted in one CPU step at batch {results['count_batch']}; host time on `meta` "
             f"(CPU time), medians of {results['repeats']} interleaved steps.\n\n"
             f"    {results['command']}"]
    for w in results["workloads"]:
        rows, regions = w["rows"], w["regions"]
        plain = rows[0]
        lines = [f"### {w['model']}, batch {w['batch_size']}, {regions} regions", "",
                 "| variant | Python calls / region: over plain | over floor | RNG calls / region "
                 "| torch.cuda calls / region (CUDA run) | ops | host ms | x plain | host us / "
                 "region over plain |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            rng, cuda = sum(r["rng_calls"].values()), sum(r["cuda_calls"].values())
            cells = ("", "", "", "") if r is plain else (
                _per_region(r["python_calls"], plain["python_calls"], regions),
                _per_region(r["python_calls"], w["floor_python_calls"], regions),
                _per_region(rng, sum(plain["rng_calls"].values()), regions),
                _per_region(cuda, sum(plain["cuda_calls"].values()), regions))
            over = "" if r is plain else \
                f"{(r['seconds'] - plain['seconds']) / regions * 1e6:.1f}"
            lines.append(f"| {r['variant']} | {' | '.join(cells)} | {r['ops']} | "
                         f"{r['seconds'] * 1e3:.1f} | {r['time_ratio']:.3f}x | {over} |")
        by_name = "; ".join(f"{r['variant']}: " + (", ".join(
            f"{k} {v}" for k, v in sorted(r["cuda_calls"].items())) or "none") for r in rows)
        lines += ["", f"torch.cuda calls per step, by name: {by_name}."]
        parts.append("\n".join(lines))
    us = results["bookkeeping_us"]
    parts.append("The forward's state record and the recompute's context alone (CPU time per "
                 "region, 1000 regions a step): " + "; ".join(
                     f"{name} {value:.1f} us" for name, value in us.items()) + ".")
    return "\n\n".join(parts) + "\n"
