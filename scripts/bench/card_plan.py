"""A plan for a CUDA card made without one (``card-plan``).

    python scripts/benchmark.py card-plan --card h100 --workloads bert_base:64,densenet_bc_100:64

Per workload (``model:batch``, at the size the recorded H100 runs used) and budget
(``--fractions`` of the plain peak the H100 measured for it in docs/results/, the GPU suite's
record where there is one), three plans made on this machine:
``zoo.plan`` as the CPU's kernels see the step (the CPU's attention and dropout, its allocator),
``zoo.plan(..., device=card)`` (the card's kernels and caching allocator) and
``zoo.plan(..., cost="time", device=card)`` (blocks priced by their predicted time on the card).
Each plan's step is then predicted on the card (``zoo.memory.predict_step``): its peak against
the budget, its time against plain's. The recorded H100 plain row stands beside them. Prints
Markdown and writes docs/results/card_plan_<card>.json.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

import zoo
from zoo.memory import format_bytes, predict_step
from zoo.planner import BudgetTooSmallError

from .planner_vs_uniform import SEQUENCE_LENGTHS
from .prediction import recorded_rows
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["card_plan", "plan_rows", "markdown"]

PLANS = {"for the CPU's kernels": {}, "for the card": {"device": True},
         "for the card, cost='time'": {"device": True, "cost": "time"}}


def plan_rows(name: str, batch: int, on: str, fractions: list[float]) -> list[dict[str, Any]]:
    """Rows of one workload: the recorded plain row, plain predicted, then each plan per budget."""
    torch.manual_seed(0)
    base = zoo.create_model(name).train()
    size = SEQUENCE_LENGTHS.get(name)
    x = base.example_input(batch, size)
    found = sorted((r for r in recorded_rows() if (r.model, r.batch, r.variant, r.limit)
                    == (name, batch, "plain", None) and r.size in (size, None)),
                   key=lambda r: not r.source.startswith("gpu_"))  # the GPU suite's first
    recorded = found[0] if found else None
    plain = predict_step(base, x, on)
    rows = [{"model": name, "batch": batch, "plan": "plain, measured on the H100",
             "card_peak": recorded.peak, "card_seconds": recorded.seconds,
             "source": recorded.source} if recorded else None,
            {"model": name, "batch": batch, "plan": "plain, predicted",
             "card_peak": plain.peak, "card_seconds": plain.time.step}]
    anchor = recorded.peak if recorded else plain.peak
    for f in fractions:
        budget = int(f * anchor)
        for label, options in PLANS.items():
            model = copy.deepcopy(base)
            kwargs = {"cost": options.get("cost", "flops")}
            if options.get("device"):
                kwargs["device"] = on
            row = {"model": name, "batch": batch, "plan": label, "fraction": f, "budget": budget}
            try:
                result = zoo.plan(model, x, budget, **kwargs)
            except BudgetTooSmallError as e:
                rows.append({**row, "error": f"smallest peak {format_bytes(e.smallest)}"})
                continue
            step = predict_step(model, x, on)
            rows.append({**row, "predicted_peak": result.predicted_peak, "card_peak": step.peak,
                         "card_seconds": step.time.step,
                         "ratio": step.time.step / plain.time.step})
    return [r for r in rows if r is not None]


def _cell(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [format_bytes(row["budget"]), "-", row["error"], "-", "-", "-"]
    budget = row.get("budget")
    fits = "-" if budget is None else ("yes" if row["card_peak"] <= budget else "**no**")
    return [format_bytes(budget) if budget else "-",
            format_bytes(row["predicted_peak"]) if "predicted_peak" in row else "-",
            format_bytes(row["card_peak"]), fits,
            f"{1e3 * row['card_seconds']:.1f} ms" if row.get("card_seconds") else "-",
            f"{row['ratio']:.2f}" if "ratio" in row else "-"]


def markdown(rows: list[dict[str, Any]], on: str) -> str:
    head = (f"| model | batch | plan | budget | plan's predicted peak | peak on the {on} | fits "
            f"| step on the {on} | time / plain |\n|---|---:|---|---:|---:|---:|---|---:|---:|")
    return "\n".join([head] + [f"| {r['model']} | {r['batch']} | {r['plan']} | "
                               + " | ".join(_cell(r)) + " |" for r in rows])


def card_plan(card: str = "h100", workloads: str = "bert_base:64,densenet_bc_100:64",
              fractions: str = "0.3,0.6", json_out: str | None = None) -> list[dict[str, Any]]:
    """Plans for card ``card`` made here, each predicted on the card (module docstring)."""
    fs = [float(f) for f in comma_list(fractions)]
    rows: list[dict[str, Any]] = []
    for workload in comma_list(workloads):
        name, batch = workload.split(":")
        rows += plan_rows(name, int(batch), card, fs)
    print(markdown(rows, card))
    write_json(json_out or f"docs/results/card_plan_{card}.json",
               {"command": command_line(), "machine": machine_info(torch.device("cpu")),
                "card": card, "rows": rows})
    return rows
