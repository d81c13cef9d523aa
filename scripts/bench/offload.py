"""Offload planned with recompute, on cards predicted here (``offload``).

    python scripts/benchmark.py offload --out docs/results/bench_offload.json

For DenseNet-BC-100 b64 and ResNet-56 b128 (32 px), ResNet-50 b256 (224 px) and BERT-base b64
(128 tokens), on each card (``zoo.memory.cards``) in fp32 and in bf16 autocast (CUDA's op lists),
every figure predicted by the card's step (``zoo.memory.predict_step``: the caching allocator's
peak, the roofline time at the H100 fit's fractions, what the compute stream waits for offload
copies on the card's host link): the step's lower bound (``cards.bound``), plain, recompute
alone at its least peak, offload at its least peak, torch's ``save_on_cpu`` (modelled below),
and at four budgets (offload's least, recompute's least, halfway to plain, plain) the plan with
offload beside recompute alone. Prints Markdown and writes JSON.

``save_on_cpu`` is not run: on the fake step's CPU tensors its copies are no-ops. Modelled: the
peak of the whole chain in one offload region (every saved activation leaves the device, none is
prefetched, as ``save_on_cpu`` fetches each at its use) and the plain step's device time plus
every copy out and back on the compute stream (it copies synchronously there; its parameters'
copies are left out, so the time is a floor). Two lower bounds: parameters, workspaces and the
largest working set of one op with the parameters' gradients, and the tighter one with the
gradients the autograd engine holds beside each backward op (``StepLowerBound.with_engine``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

import zoo
from zoo.checkpoint.offload_cost import copy_time
from zoo.memory.cards import card
from zoo.memory.cards.bound import step_lower_bound
from zoo.memory.cards.on_card import planning_on
from zoo.memory.cards.step import predict_step
from zoo.planner import BudgetTooSmallError
from zoo.planner.choose import Planner
from zoo.planner.offload_choice import plan_offload
from zoo.planner.plans import plan_applied

from .report import comma_list, command_line, machine_info, write_json

__all__ = ["WORKLOADS", "CARDS", "offload"]

WORKLOADS = {  # name: (zoo model, batch, image side or sequence length)
    "DenseNet-BC-100 b64": ("densenet_bc_100", 64, 32),
    "ResNet-56 b128": ("resnet56", 128, 32),
    "ResNet-50 b256": ("resnet50", 256, 224),
    "BERT-base b64 x 128": ("bert_base", 64, 128),
}
CARDS = ("h100", "a100", "l4", "rtx4090")


def _batch(model: torch.nn.Module, batch: int, side: int) -> torch.Tensor:
    torch.manual_seed(0)
    return model.example_input(batch, side)


def _priced(model: torch.nn.Module, x: torch.Tensor, plan: Any, on: str) -> dict[str, Any]:
    """The card's predicted step of ``model`` running ``plan`` (None: plain)."""
    with plan_applied(model, plan) if plan is not None else contextlib.nullcontext():
        step = predict_step(model, x, on)
    return {"peak": step.peak, "ms": 1e3 * step.time.step, "link_ms": 1e3 * step.time.link,
            "offloaded": step.offloaded_bytes, "device_ms": 1e3 * step.time.device,
            "host_ms": 1e3 * step.time.host}


def _save_on_cpu(model: torch.nn.Module, x: torch.Tensor, on: str, whole: Any) -> dict[str, Any]:
    """torch's save_on_cpu, modelled (module docstring): the step of the whole chain in one
    offload region, its copies on the compute stream instead of beside it."""
    one = dataclasses.replace(whole, segments=[(0, whole.profile.n_blocks, "offload")],
                              block_modes=None)
    got = _priced(model, x, one, on)
    copies = 2e3 * copy_time(got["offloaded"], card(on).host_link)
    return {"peak": got["peak"], "ms": max(got["device_ms"] + copies, got["host_ms"]),
            "offloaded": got["offloaded"]}


def _row(name: str, on: str, dtype: str) -> dict[str, Any]:
    model_name, batch, side = WORKLOADS[name]
    torch.manual_seed(0)
    model = zoo.create_model(model_name)
    x = _batch(model, batch, side)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" \
        else contextlib.nullcontext()
    with amp:
        bound = step_lower_bound(model, x, on)
        plain = _priced(model, x, None, on)
        with planning_on(on) as target:
            planner = Planner(model, x)
            least = planner.choices[0]
            recompute = {**_priced(model, x, least, on), "planned_peak": planner.least_peak}
            floor = plan_offload(planner, model, x, planner.least_peak, target, None, None)
            lowest = plan_offload(planner, model, x, floor.smallest_peak, target, None, None)
            budgets = [lowest.smallest_peak, planner.least_peak,
                       (planner.least_peak + plain["peak"]) // 2, plain["peak"]]
            sweep = [_budget_row(planner, model, x, b, target, on) for b in budgets]
        saved = _save_on_cpu(model, x, on, least)
    return {"workload": name, "card": on, "precision": dtype, "bound": bound.bytes,
            "bound_with_engine": bound.with_engine,
            "plain": plain, "recompute": recompute, "save_on_cpu": saved,
            "offload": {"peak": lowest.predicted_peak, "ms": 1e3 * lowest.predicted_time,
                        "offloaded": lowest.offloaded_bytes},
            "sweep": sweep}


def _budget_row(planner: Planner, model: torch.nn.Module, x: torch.Tensor, budget: int,
                target: Any, on: str) -> dict[str, Any]:
    """At ``budget``: recompute alone's plan and the plan with offload, both priced."""
    try:
        alone = _priced(model, x, planner.plan(budget), on)
    except BudgetTooSmallError:
        alone = None
    chosen = plan_offload(planner, model, x, budget, target, None, None)
    return {"budget": budget, "alone": alone,
            "with_offload": {"peak": chosen.predicted_peak, "ms": 1e3 * chosen.predicted_time,
                             "offloaded": chosen.offloaded_bytes}}


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | card | precision | lower bound (MB): op, with engine | plain (MB, ms) "
             "| recompute least (MB, ms) | offload least (MB, ms, MB moved) | offload least / "
             "bounds | save_on_cpu, modelled (MB, ms) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, c, o, s = r["plain"], r["recompute"], r["offload"], r["save_on_cpu"]
        lines.append(
            f"| {r['workload']} | {r['card']} | {r['precision']} | {_mb(r['bound'])}, "
            f"{_mb(r['bound_with_engine'])} | {_mb(p['peak'])}, {p['ms']:.1f} | "
            f"{_mb(c['peak'])}, {c['ms']:.1f} | "
            f"{_mb(o['peak'])}, {o['ms']:.1f}, {_mb(o['offloaded'])} | "
            f"{o['peak'] / r['bound']:.3f}, {o['peak'] / r['bound_with_engine']:.3f} | "
            f"{_mb(s['peak'])}, {s['ms']:.1f} |")
    lines += ["", "| workload | card | precision | budget (MB) | recompute alone (ms) | "
              "with offload (ms, MB moved) | with offload / alone |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        for b in r["sweep"]:
            alone, w = b["alone"], b["with_offload"]
            ratio = f"{w['ms'] / alone['ms']:.3f}" if alone else "only offload fits"
            alone_ms = "does not fit" if alone is None else f"{alone['ms']:.1f}" + (
                "" if alone["peak"] <= b["budget"] else " (over budget)")
            lines.append(f"| {r['workload']} | {r['card']} | {r['precision']} | "
                         f"{_mb(b['budget'])} | {alone_ms} | "
                         f"{w['ms']:.1f}, {_mb(w['offloaded'])} | {ratio} |")
    return "\n".join(lines)


def offload(workloads: Any = ",".join(WORKLOADS), cards: Any = ",".join(CARDS),
            dtypes: Any = "fp32,bf16", out: str = "") -> list[dict[str, Any]]:
    """Offload planned with recompute against recompute alone and save_on_cpu, per card."""
    torch.set_num_threads(1)
    start, rows = time.perf_counter(), []
    for name in comma_list(workloads):
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; expected some of {', '.join(WORKLOADS)}")
        for on in comma_list(cards):
            for dtype in comma_list(dtypes):
                rows.append(_row(name, on, dtype))
                print(f"{name} {on} {dtype}: {time.perf_counter() - start:.0f} s", flush=True)
    print(markdown(rows))
    worst = max(r["offload"]["peak"] / r["bound"] for r in rows)
    engine = max(r["offload"]["peak"] / r["bound_with_engine"] for r in rows)
    slower = sum(b["alone"] is not None and b["with_offload"]["ms"] > b["alone"]["ms"]
                 for r in rows for b in r["sweep"])
    print(f"\n{len(rows)} rows; offload's least peak at most {worst:.3f}x the lower bound "
          f"({engine:.3f}x with the engine's held gradients); "
          f"{slower} budgets where the plan with offload is slower than recompute alone; "
          f"{time.perf_counter() - start:.0f} s")
    if out:
        write_json(out, {"command": command_line(), "machine": machine_info(torch.device("cpu")),
                         "wall_s": time.perf_counter() - start, "rows": rows})
    return rows
