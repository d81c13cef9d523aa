"""A plan keeps its promise (``planner-promise``): every plan a model is offered, predicted
against measured, eager and compiled.

    python scripts/benchmark.py planner-promise --models resnet56,vit_cifar

Per model, budgets from the plain peak down to the least plan in ten steps, and 0.6, 0.5, 0.35
and 0.3 of the plain peak (``zoo.planner.sweep.budget_sweep``): the plan each budget picks,
its predicted peak, and one training step of it measured under ``FakeTensorMode``
(``zoo.memory.step.measure_step``: the bytes a real CPU step holds, counted without module
hooks). For the models in ``--compiled``, at the fractions ``--compiled_fractions``: the same
plan compiled (AOTAutograd's partitioner; its graphs replayed op by op under the same counter,
``zoo.memory.compiled``), whether it warns at its first compiled call (``Plan.compile_safe``),
and the plan ``compiled=True`` gives for the budget, compiled. Prints Markdown and writes JSON.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zoo.memory import format_bytes
from zoo.memory.compiled import check_meta_like_cpu, measure_compiled
from zoo.planner import BudgetTooSmallError, default_loss
from zoo.planner.sweep import budget_sweep, planner_for

from .planner_vs_compile import _describe, build
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["MODELS", "BATCHES", "sweep_model", "compiled_rows", "markdown", "planner_promise"]

MODELS = ("cifar_cnn", "resnet20", "resnet56", "resnet110", "densenet40", "densenet_bc_100",
          "vit_cifar", "bert_base", "gpt2_small", "revnet38", "rev_vit_cifar",
          "torchvision:resnet18", "timm:resnet18", "torchvision:resnet50", "timm:resnet50")
BATCHES = {"bert_base": 8, "gpt2_small": 8, "torchvision:resnet18": 8, "timm:resnet18": 8,
           "torchvision:resnet50": 8, "timm:resnet50": 8}  # the rest: 32 (tokens: 128)
FRACTIONS = (0.6, 0.5, 0.35, 0.3)


def sweep_model(make: Callable[[], nn.Module], x: torch.Tensor, steps: int) -> dict[str, Any]:
    """The model's sweep: its rows (each budget's plan, predicted and measured) and the time."""
    model = make()
    start = time.perf_counter()
    planner = planner_for(model, x)
    rows = budget_sweep(model, x, steps, fractions=FRACTIONS, planner=planner)
    return {"plain_peak_bytes": planner.plain_peak, "least_peak_bytes": planner.least_peak,
            "seconds": time.perf_counter() - start, "planner": planner,
            "rows": [{"budget": r.budget, "predicted": r.predicted, "measured": r.measured,
                      "recompute_flops": r.recompute_flops, "levels": r.levels,
                      "mode": r.mode, "plan": _describe(planner.plan(r.budget))}
                     for r in rows]}


def _compiled_peak(make: Callable[[], nn.Module], x: torch.Tensor, plan: Any) -> int:
    model = make()
    plan.apply(model)
    try:
        check_meta_like_cpu(model, x)
        fake = True
    except ValueError:  # SDPA: the meta device runs another kernel, so a real CPU step
        fake = False
    return measure_compiled(model, x, 1.0, default_loss, fake=fake)["peak_bytes"]


def compiled_rows(make: Callable[[], nn.Module], x: torch.Tensor, planner: Any,
                  fractions: tuple[float, ...]) -> list[dict[str, Any]]:
    """At each fraction of the plain peak: the eager plan compiled (and whether it warns), and
    the ``compiled=True`` plan compiled (None below its least peak)."""
    safe_planner = planner_for(make(), x, compiled=True)
    out = []
    for f in fractions:
        budget = int(f * planner.plain_peak)
        plan = planner.plan(budget)
        try:
            safe = safe_planner.plan(budget)
        except BudgetTooSmallError:
            safe = None
        out.append({"fraction": f, "budget": budget, "plan": _describe(plan),
                    "predicted": plan.predicted_peak, "warns": not plan.compile_safe,
                    "compiled": _compiled_peak(make, x, plan),
                    "safe_plan": None if safe is None else _describe(safe),
                    "safe_predicted": None if safe is None else safe.predicted_peak,
                    "safe_compiled": None if safe is None else _compiled_peak(make, x, safe)})
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def markdown(results: dict[str, Any]) -> str:
    """The eager table (every model, every budget) and the compiled one."""
    lines = [f"`{results['command']}`", "",
             "| model | batch | budget (x plain) | plan | predicted (B) | measured (B) | "
             "measured - predicted |", "|---|---:|---:|---|---:|---:|---:|"]
    for name, m in results["models"].items():
        for r in m["rows"]:
            lines.append(f"| {name} | {m['batch']} | {r['budget'] / m['plain_peak_bytes']:.3f} | "
                         f"{r['plan']} | {r['predicted']:,} | {r['measured']:,} | "
                         f"{r['measured'] - r['predicted']:+,} |")
    compiled = [(n, m) for n, m in results["models"].items() if m.get("compiled")]
    if compiled:
        lines += ["", "| model | budget (x plain) | plan (eager) | predicted | compiled | "
                  "warns at first compiled call | plan (compiled=True) | predicted | compiled |",
                  "|---|---:|---|---:|---:|---|---|---:|---:|"]
        for name, m in compiled:
            for c in m["compiled"]:
                lines.append(f"| {name} | {c['fraction']} | {c['plan']} | {_mib(c['predicted'])} "
                             f"| {_mib(c['compiled'])} | {'yes' if c['warns'] else 'no'} | "
                             f"{c['safe_plan'] or 'below its least peak'} | "
                             f"{_mib(c['safe_predicted'])} | {_mib(c['safe_compiled'])} |")
    return "\n".join(lines)


def planner_promise(models: Any = MODELS, steps: int = 10, compiled: Any = "resnet56,vit_cifar",
                    compiled_fractions: Any = "0.3,0.5", batch: int | None = None,
                    out: str = "docs/results/bench_planner_promise_cpu.json") -> dict[str, Any]:
    """Every plan predicted against measured, eager and compiled, budgets plain to least.

    ``batch``: for every model (default: :data:`BATCHES`, else 32)."""
    fractions = tuple(float(f) for f in comma_list(compiled_fractions)) if compiled else ()
    to_compile = set(comma_list(compiled)) if compiled else set()
    results: dict[str, Any] = {"command": command_line(),
                               "machine": machine_info(torch.device("cpu")), "models": {}}
    for name in comma_list(models):
        size = batch or BATCHES.get(name, 32)
        make, x = build(name, size)
        m = sweep_model(make, x, steps)
        planner = m.pop("planner")
        if name in to_compile:
            m["compiled"] = compiled_rows(make, x, planner, fractions)
        m["batch"] = size
        results["models"][name] = m
        worst = max(abs(r["measured"] - r["predicted"]) / r["predicted"] for r in m["rows"])
        print(f"{name}: {len(m['rows'])} budgets, worst |measured - predicted| "
              f"{100 * worst:.4f}%, {m['seconds']:.0f} s", flush=True)
    write_json(out, results)
    print(markdown(results))
    return results
