"""How low multi-level schedules take the planner, and what they cost (``planner-levels``), exact
on the CPU (MemTracker bytes and FlopCounterMode FLOPs under FakeTensorMode: nothing runs).

    python scripts/benchmark.py planner-levels --models resnet110,densenet_bc_100,bert_base --batch 32

Per model: the plain peak; the least peak of one-level schedules (whole segments of blocks) and of
nested schedules, over plain blocks and with per-block modes; at each ``--budgets`` fraction of
the plain peak (and at Chen's sqrt(n) uniform segmentation's peak) the plan one level deep and
the multi-level plan, each applied and measured (peak and recompute FLOPs); with block modes as
``zoo.plan`` does it (predicted exactly, so nothing is measured and dropped). Prints Markdown and writes docs/results/bench_planner_levels_cpu.json.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

import zoo
from zoo.planner import (BudgetTooSmallError, least_peak, measure_step, predict_peak,
                         profile_block_modes, profile_chain, smallest_peak, solve_profile)
from zoo.planner.search.one_level import solve

from .planner_vs_uniform import SEQUENCE_LENGTHS
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["bench_model", "markdown", "planner_levels"]


def _measure(model: Any, x: torch.Tensor, segments: list, block_modes: Any) -> tuple[int, int]:
    model.set_checkpoint_plan(segments)
    model.set_checkpoint_block_modes(block_modes)
    try:
        return measure_step(model, x)
    finally:
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(None)


def _row(model: Any, x: torch.Tensor, p: Any, inner: list, budget: int, plain: tuple[int, int],
         label: str) -> dict[str, Any]:
    row: dict[str, Any] = {"budget": label, "budget_bytes": budget}
    found = solve(p, budget)
    if found is not None:
        peak, flops = _measure(model, x, p.block_segments(found[0]), None)
        row["one_level"] = {"peak": peak, "recompute": flops - plain[1]}
    for key, profiles in (("nested", []), ("nested_modes", inner)):
        try:  # with block modes, as zoo.plan does it
            plan = solve_profile(p, budget, block_profiles=profiles)
        except BudgetTooSmallError:
            continue
        peak, flops = _measure(model, x, plan.segments, plan.block_modes)
        row[key] = {"peak": peak, "predicted": plan.predicted_peak, "levels": plan.levels,
                    "block_modes": plan.block_modes is not None,
                    "recompute": flops - plain[1], "predicted_recompute": plan.recompute_flops}
    return row


def bench_model(name: str, batch: int, budgets: list[float]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = zoo.create_model(name)
    x = model.example_input(batch, SEQUENCE_LENGTHS.get(name))
    started = time.perf_counter()
    p = profile_chain(model, x)
    inner = profile_block_modes(model, x)
    plain = measure_step(model, x)
    assert plain[0] == predict_peak(p, [(0, p.n_units, False)])
    s0 = max(1, round(math.sqrt(p.n_units)))
    bounds = [round(i * p.n_units / s0) for i in range(s0 + 1)]
    sqrt_peak = predict_peak(p, [(a, b, True) for a, b in zip(bounds, bounds[1:])])
    rows = [_row(model, x, p, inner, sqrt_peak, plain, f"sqrt(n): {s0} segments")]
    rows += [_row(model, x, p, inner, int(f * plain[0]), plain, f"{f}x") for f in budgets]
    return {"model": name, "batch": batch, "units": p.n_units, "plain_peak": plain[0],
            "step_flops": plain[1], "least_one_level": smallest_peak(p),
            "least_nested": least_peak([p]), "least_nested_modes": least_peak([p, *inner]),
            "modes": [q.block_mode for q in inner], "rows": rows,
            "seconds": round(time.perf_counter() - started, 1)}


def _cell(r: dict | None, plain: dict) -> str:
    if r is None:
        return "refused"
    levels = f", {r['levels']} levels" if "levels" in r else ""
    levels += " (block modes)" if r.get("block_modes") else ""
    share = 100 * r["recompute"] / plain["step_flops"]
    return f"{r['peak'] / plain['plain_peak']:.3f}x, +{share:.1f}%{levels}"


def markdown(result: dict[str, Any]) -> str:
    plain = result["plain_peak"]
    lines = [f"**{result['model']}**, batch {result['batch']}, {result['units']} units, plain peak "
             f"{plain / 2**20:.1f} MiB; least peak: one level "
             f"{result['least_one_level'] / plain:.3f}x, "
             f"nested {result['least_nested'] / plain:.3f}x, nested with block modes "
             f"{result['least_nested_modes'] / plain:.3f}x (predicted)", "",
             "| budget | one level: peak, recompute | nested: peak, recompute, depth "
             "| nested + block modes |", "|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['budget']} ({row['budget_bytes'] / plain:.3f}x) | "
                     f"{_cell(row.get('one_level'), result)} | "
                     f"{_cell(row.get('nested'), result)} | "
                     f"{_cell(row.get('nested_modes'), result)} |")
    return "\n".join(lines)


def planner_levels(models: str | tuple = "resnet110,densenet_bc_100", batch: int = 32,
                   budgets: str | tuple = "0.3,0.2,0.171,0.145,0.14,0.13",
                   out: str = "docs/results/bench_planner_levels_cpu.json") -> list[dict]:
    """How low multi-level (nested) schedules take the planner, and at what recompute.

    Per model: the least peak one level deep, nested, and nested with per-block modes; at each
    ``--budgets`` fraction of the plain peak (and at sqrt(n) segments' peak) each plan applied
    and measured (peak, recompute FLOPs). Prints Markdown; writes ``--out``.
    """
    fractions = [float(f) for f in comma_list(budgets)]
    results = []
    for name in comma_list(models):
        results.append(bench_model(name, batch, fractions))
        print(markdown(results[-1]) + "\n", flush=True)
    write_json(out, {"machine": machine_info(torch.device("cpu"))["cpu"],
                     "torch": torch.__version__, "command": command_line(), "results": results})
    return results
