"""zoo.plan side by side with torch.compile's ``activation_memory_budget``
(``planner-vs-compile``), exact on the CPU: MemTracker peak bytes and FlopCounterMode recompute
FLOPs of one training step.

    python -m zoo.bench planner-vs-compile --models resnet20,cifar_cnn --batch 32

Per model (its plain forward: no zoo checkpointing) and per budget fraction ``f``:

* torch: the step compiled with inductor's partitioner under ``activation_memory_budget=f``
  (``zoo.bench.compile_budget``: graphs interpreted op by op, the second step measured for real);
* zoo: ``zoo.plan`` of a fresh copy (same seed, not applied) given torch's measured peak as its
  budget: the peak of its plan (measured, under ``FakeTensorMode``) and its recompute there.

Recompute is the step's FLOPs minus a plain eager step's. Also the least peak each reaches: the
lowest torch peak over the fractions (``f = 0`` saves only the inputs) and zoo.plan's least
feasible peak (its ``BudgetTooSmallError``), measured by planning at it. Prints Markdown and
writes docs/results/bench_planner_vs_compile_cpu.json.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import zoo
from zoo.memory import format_bytes
from zoo.planner import BudgetTooSmallError, default_loss, measure_step

from .compile_budget import default_solver, measure_compiled
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["zoo_at", "zoo_least", "compare", "markdown", "planner_vs_compile"]

FRACTIONS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)


def _builder(model: str | Callable[[], nn.Module], seed: int) -> Callable[[], nn.Module]:
    """Fresh instances of one model with the same weights (seeded)."""
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return zoo.create_model(model) if isinstance(model, str) else model()
    return build


def zoo_at(model: nn.Module, x: torch.Tensor, budget: int) -> dict[str, Any]:
    """zoo.plan's peak and recompute under ``budget`` bytes (not applied), or its least peak."""
    try:
        p = zoo.plan(model, x, budget, apply=False)
    except BudgetTooSmallError as e:
        return {"fits": False, "peak_bytes": None, "recompute_flops": None,
                "least_peak_bytes": e.smallest, "plan": "-"}
    what = getattr(p, "mode", None) or (
        f"{len(p.checkpointed_blocks)}/{p.profile.n_blocks} blocks"
        + f", {p.levels} levels" + (", block modes" if p.block_modes else "")
        if hasattr(p, "profile")
        else f"{len(p.checkpointed)}/{len(p.blocks)} modules")
    return {"fits": True, "peak_bytes": p.predicted_peak, "recompute_flops": p.recompute_flops,
            "plan": what}


def zoo_least(model: nn.Module, x: torch.Tensor, tries: int = 4) -> dict[str, Any]:
    """The least peak zoo.plan reaches: the one its BudgetTooSmallError names, planned at (and,
    where that plan measures over it and is refused, the next least peak the error names)."""
    named = []
    found = zoo_at(model, x, 1)
    for _ in range(tries):
        named.append(found["least_peak_bytes"])
        found = zoo_at(model, x, named[-1])
        if found["fits"]:
            break
    return {**found, "named_least_bytes": named}


def compare(model: str | Callable[[], nn.Module], batch: int = 32,
            fractions: Sequence[float] = FRACTIONS, seed: int = 0, size: int = 32,
            solver: str | None = None) -> dict[str, Any]:
    """One model: per fraction a row (torch's peak and recompute, zoo's at that peak), the plain
    step, and the least peak of each side."""
    build = _builder(model, seed)
    torch.manual_seed(seed)
    x = torch.randn(batch, 3, size, size)
    plain_peak, plain_flops = measure_step(build(), x)
    rows = []
    for f in fractions:
        start = time.perf_counter()
        c = measure_compiled(build(), x, f, default_loss, solver)
        z = zoo_at(build(), x, c["peak_bytes"])
        rows.append({"fraction": f, "torch_peak_bytes": c["peak_bytes"],
                     "torch_recompute_flops": c["flops"] - plain_flops,
                     "zoo_peak_bytes": z["peak_bytes"], "zoo_recompute_flops": z["recompute_flops"],
                     "zoo_plan": z["plan"], "seconds": round(time.perf_counter() - start, 1)})
    least = min(rows, key=lambda r: (r["torch_peak_bytes"], r["torch_recompute_flops"]))
    return {"model": model if isinstance(model, str) else getattr(model, "__name__", "model"),
            "batch": batch, "solver": solver or default_solver(), "plain_peak_bytes": plain_peak,
            "plain_flops": plain_flops, "rows": rows,
            "torch_least": {k: least[k] for k in ("fraction", "torch_peak_bytes",
                                                  "torch_recompute_flops")},
            "zoo_least": zoo_least(build(), x)}


def _pct(flops: int | None, plain: int) -> str:
    return "-" if flops is None else f"+{100 * flops / plain:.1f}%"


def _mib(n: int | None) -> str:
    return "does not fit" if n is None else format_bytes(n)


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table for all models: per fraction torch's and zoo's peak and recompute."""
    out = ["| model (batch) | torch f | torch peak | torch recompute | zoo.plan peak at that "
           "budget | zoo recompute | zoo's plan |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        p = r["plain_flops"]
        name = f"{r['model']} ({r['batch']})"
        out.append(f"| {name} | plain | {format_bytes(r['plain_peak_bytes'])} | +0.0% | | | |")
        for row in r["rows"]:
            out.append(f"| {name} | {row['fraction']:g} | {_mib(row['torch_peak_bytes'])} | "
                       f"{_pct(row['torch_recompute_flops'], p)} | {_mib(row['zoo_peak_bytes'])}"
                       f" | {_pct(row['zoo_recompute_flops'], p)} | {row['zoo_plan']} |")
        t, z = r["torch_least"], r["zoo_least"]
        out.append(f"| {name} | **least** | {format_bytes(t['torch_peak_bytes'])} "
                   f"(f={t['fraction']:g}) | {_pct(t['torch_recompute_flops'], p)} | "
                   f"{_mib(z['peak_bytes'])} | {_pct(z['recompute_flops'], p)} | {z['plan']} |")
    return "\n".join(out)


def planner_vs_compile(models: str | tuple = "resnet20,resnet56,cifar_cnn,vit_cifar,densenet40",
                       batch: int = 32,
                       fractions: str | tuple = ",".join(f"{f:g}" for f in FRACTIONS),
                       solver: str | None = None, threads: int = 2,
                       out: str = "docs/results/bench_planner_vs_compile_cpu.json") -> list[dict]:
    """zoo.plan beside torch.compile's activation_memory_budget, exact peaks and FLOPs.

    Per model and budget fraction ``f``: torch's step compiled under
    ``activation_memory_budget=f`` (peak and recompute measured), and zoo.plan given torch's
    peak as its budget; also the least peak each side reaches. Prints Markdown; rewrites
    ``--out`` after each model.
    """
    torch.set_num_threads(threads)
    fs = [float(f) for f in comma_list(fractions)]
    results = []
    for name in comma_list(models):
        results.append(compare(name, batch, fs, solver=solver))
        write_json(out, {"machine": machine_info(torch.device("cpu")),
                         "command": command_line(), "results": results})
        print(markdown(results[-1:]), flush=True)
    return results
