"""The planner's time plan against its FLOP plan at the same budgets (``planner-time``).

    python scripts/benchmark.py planner-time --device cuda --models resnet110,densenet_bc_100 --batch 128
    python scripts/benchmark.py planner-time --smoke      # CPU, resnet20 batch 4: checks it runs

Per model and budget (``--budgets``: fractions of the plain peak, between the least peak and
plain): ``zoo.plan(..., cost="flops")`` and ``zoo.plan(..., cost="time")`` (each block's forward
timed on ``--device``), each applied to its own copy of the model, then one real training step
of plain, the FLOP plan and the time plan, interleaved in shuffled rounds (``bench.measure``):
median step time and its ratio to plain's in the same run, the peak (``max_memory_allocated`` on
CUDA, MemTracker on the CPU) and the recomputed FLOPs. Prints Markdown and writes
docs/results/bench_planner_time_<device>.json.
"""
from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

import zoo
from zoo.planner import BudgetTooSmallError

from .measure import measure_flops, measure_memory, measure_times
from .planner_vs_uniform import SEQUENCE_LENGTHS
from .report import comma_list, command_line, machine_info, write_json
from .variants import Variant

__all__ = ["bench_model", "markdown", "planner_time"]


def bench_model(name: str, batch: int, device: str, fractions: list[float],
                repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = zoo.create_model(name).to(device)
    x = base.example_input(batch, SEQUENCE_LENGTHS.get(name)).to(device)
    roomy = zoo.plan(base, x, float("inf"), apply=False, modes=False, block_modes=False)
    plain = Variant("plain", base, False, "no checkpointing")
    rows = []
    for f in fractions:
        budget = int(roomy.smallest_peak + f * (roomy.plain_peak - roomy.smallest_peak))
        variants, plans = [plain], {}
        for cost in ("flops", "time"):
            model = copy.deepcopy(base)
            try:
                plans[cost] = zoo.plan(model, x, budget, cost=cost, modes=False,
                                       block_modes=False)
            except BudgetTooSmallError as e:
                print(f"{name} f={f} cost={cost}: {e}")
                continue
            variants.append(Variant(cost, model, False, f"zoo.plan cost={cost}"))
        times = measure_times(variants, x, repeats)
        flops = {v.name: measure_flops(v, x) for v in variants}
        row: dict[str, Any] = {"model": name, "batch": batch, "fraction": f, "budget": budget,
                               "plain_peak": roomy.plain_peak}
        for v in variants:
            median = statistics.median(times[v.name])
            row[v.name] = {"median_s": median,
                           "ratio": median / statistics.median(times["plain"]),
                           "peak": measure_memory(v, x)["peak_bytes"],
                           "recompute_flops": flops[v.name] - flops["plain"],
                           "levels": plans[v.name].levels if v.name in plans else 0}
        rows.append(row)
        print(markdown([row]), flush=True)
    return rows


def _cell(r: dict | None) -> str:
    if r is None:
        return "refused"
    return (f"{r['ratio']:.3f}x ({1e3 * r['median_s']:.1f} ms), {r['peak'] / 2**20:.1f} MiB, "
            f"+{r['recompute_flops'] / 1e9:.2f} GFLOP, {r['levels']} levels")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model (batch) | budget | plain | FLOP plan | time plan |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['batch']}) | {r['budget'] / 2**20:.1f} MiB "
                     f"(f={r['fraction']}) | {1e3 * r['plain']['median_s']:.1f} ms | "
                     f"{_cell(r.get('flops'))} | {_cell(r.get('time'))} |")
    return "\n".join(lines)


def planner_time(models: str | tuple = "resnet110,densenet_bc_100", batch: int = 128,
                 device: str = "cuda", budgets: str | tuple = "0.0,0.2,0.5", repeats: int = 20,
                 smoke: bool = False, out: str | None = None) -> list[dict]:
    """The planner's time plan against its FLOP plan at the same budgets, timed.

    Per model and budget (``--budgets``: fractions between the least peak and plain): each plan
    applied to its own copy, then plain and both plans timed interleaved; median step time and
    ratio to plain, the peak and the recomputed FLOPs. ``--smoke``: resnet20 batch 4 on the CPU
    (checks it runs, writes nothing). Writes ``--out`` (default
    docs/results/bench_planner_time_<device>.json).
    """
    if smoke:
        models, batch, device, budgets, repeats = "resnet20", 4, "cpu", "0.5", 2
    rows = []
    for name in comma_list(models):
        rows += bench_model(name, batch, device, [float(f) for f in comma_list(budgets)], repeats)
    print("\n" + markdown(rows))
    if not smoke:
        dev = torch.device(device)
        write_json(out or f"docs/results/bench_planner_time_{dev.type}.json",
                   {"machine": machine_info(dev), "torch": torch.__version__,
                    "command": command_line(), "rows": rows})
    return rows
