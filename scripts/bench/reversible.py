"""Reversible vs checkpointed, exact on the CPU: what rebuilding activations buys against the
best checkpoint schedule of the non-reversible model of the same size.

For each pair (a checkpointed model, its reversible counterpart) at one batch size:

* the checkpointed model plain, planned by ``zoo.plan`` at the reversible model's rebuilt peak
  (the recompute checkpointing needs to match it), and at its **zoo.plan floor**: the least
  peak any schedule ``zoo.plan`` finds reaches (multi-level schedules, per-block modes, the
  model's own modes), planned at exactly that budget;
* the reversible model storing its activations (``efficient=False``) and rebuilding them
  (``efficient=True``): the same network, bit for bit.

Per row: the step's peak (``zoo.planner.measure_step``: under FakeTensorMode, parameters and
gradients included), its FLOPs and recompute (FlopCounterMode's formulas), the aten ops it
dispatches (``zoo.memory.host.count_ops`` over one real CPU step at batch 2: the host work a GPU
step waits for), and the largest batch within the budget as the CPU predicts it: exact fake steps
searched by ``bench.max_batch.search_largest_batch`` for the plain, stored and rebuilt models, the
planner's prediction (``zoo.planner.largest_batch``, the multi-level floor) for the checkpointed
one. The published anchors are printed beside them.

    python scripts/benchmark.py reversible                      # the three pairs, batch 32, 11 GB
    python scripts/benchmark.py reversible --pairs resnet20:revnet38 --batch 8 --budget 1GB

Prints Markdown and writes ``docs/results/bench_reversible_cpu.json``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import zoo
from bench.max_batch import PeakPredictor, search_largest_batch
from bench.report import command_line, comma_list, machine_info, write_json
from zoo.memory import format_bytes, host, parse_bytes, train_step
from zoo.planner import BudgetTooSmallError, measure_step
from zoo.planner import largest_batch as planned_largest_batch

__all__ = ["PAIRS", "ANCHORS", "count_ops", "pair_rows", "run_reversible",
           "reversible_table", "reversible"]

PAIRS = "resnet110:revnet110,vit_cifar:rev_vit_cifar," \
        "vit_small_patch16_224:rev_vit_small_patch16_224@224"
ANCHORS = {
    "revnet": "Gomez et al. 2017 (RevNet): activations independent of depth, ResNet-110's "
              "parameters (1.73M) and accuracy; inputs rebuilt in floating point (inexact)",
    "rev_vit": "Mangalam et al. 2022 (Rev-ViT): up to 15.5x less memory at ViT's FLOPs, "
               "parameters and accuracy; inputs rebuilt in floating point (inexact)",
}


def count_ops(model: nn.Module, x: torch.Tensor) -> int:
    """Aten ops one training step of ``model`` on ``x`` dispatches (run for real on the CPU),
    autograd's shallow copies included (``zoo.memory.host.count_ops``)."""
    ops = sum(host.count_ops(train_step(model, x)).values())
    model.zero_grad(set_to_none=True)
    return ops


def _figures(model: nn.Module, x: torch.Tensor, small: torch.Tensor) -> dict[str, Any]:
    peak, flops = measure_step(model, x)
    return {"peak_bytes": peak, "flops": flops, "ops": count_ops(model, small)}


def _parse_pair(spec: str) -> tuple[str, str, int | None]:
    names, _, size = spec.partition("@")
    checkpointed, _, reversible = names.partition(":")
    if not reversible:
        raise ValueError(f"a pair is 'checkpointed:reversible[@size]', got {spec!r}")
    return checkpointed, reversible, int(size) if size else None


def _largest(name: str, variant: str, size: int | None, budget: int) -> int:
    predict = PeakPredictor(name, size=size, allocator="cpu")
    return search_largest_batch(lambda b: predict(variant, b), budget)[0]


def _model_and_inputs(name: str, batch: int, size: int | None
                      ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (seeded), its input at ``batch`` and a batch of 2 for counting ops."""
    torch.manual_seed(0)
    model = zoo.create_model(name)
    return model, model.example_input(batch, size), model.example_input(2, size)


def _plan_row(name: str, model: nn.Module, x: torch.Tensor, small: torch.Tensor, budget: int,
              label: str) -> dict:
    """``model`` planned by zoo.plan at ``budget`` and measured (peak, FLOPs, ops)."""
    plan = zoo.plan(model, x, budget)
    what = plan.mode or f"{len(plan.checkpointed_blocks)} of {plan.profile.n_blocks} blocks, " \
        f"{plan.levels} level(s)"
    return {"model": name, "variant": f"zoo.plan {label} ({what})", **_figures(model, x, small)}


def _checkpointed_rows(name: str, batch: int, size: int | None, budget: int,
                       rebuilt_peak: int) -> list[dict]:
    """Plain; zoo.plan at the reversible model's rebuilt peak (when one fits there); zoo.plan at
    its floor, the least peak any schedule reaches."""
    model, x, small = _model_and_inputs(name, batch, size)
    plain = {"model": name, "variant": "plain", **_figures(model, x, small),
             "largest_batch": _largest(name, "plain", size, budget)}
    try:
        zoo.plan(model, x, 1, apply=False)
        raise AssertionError("a one-byte budget cannot fit")
    except BudgetTooSmallError as e:
        floor_budget = e.smallest
    rows = [plain]
    if floor_budget <= rebuilt_peak < plain["peak_bytes"]:
        rows.append({**_plan_row(name, model, x, small, rebuilt_peak, "at the rebuilt peak"),
                     "largest_batch": None})
    fresh = zoo.create_model(name)
    rows.append({**_plan_row(name, model, x, small, floor_budget, "floor"),
                 "largest_batch": planned_largest_batch(
                     fresh, lambda b: fresh.example_input(b, size), budget)[0]})
    return rows


def _reversible_rows(name: str, batch: int, size: int | None, budget: int) -> list[dict]:
    model, x, small = _model_and_inputs(name, batch, size)
    stored = {"model": name, "variant": "stored (efficient=False)", **_figures(model, x, small),
              "largest_batch": _largest(name, "plain", size, budget)}
    model.set_grad_checkpointing(True)
    rebuilt = {"model": name, "variant": "rebuilt (efficient=True)", **_figures(model, x, small),
               "largest_batch": _largest(name, "zoo reversible", size, budget)}
    return [stored, rebuilt]


def _ratios(rows: list[dict], batch: int, size: int | None) -> None:
    """Each row against the first (plain or stored) in place: peak, recompute, ops, batch."""
    base = rows[0]
    for r in rows:
        largest = r["largest_batch"]
        r.update(batch=batch, size=size, peak_ratio=r["peak_bytes"] / base["peak_bytes"],
                 recompute=r["flops"] / base["flops"] - 1, ops_ratio=r["ops"] / base["ops"],
                 batch_ratio=None if largest is None else largest / base["largest_batch"])


def pair_rows(pair: str, batch: int = 32, budget: int = int(11e9),
              log: Callable[[str], None] = print) -> list[dict]:
    """The rows of one pair ``'checkpointed:reversible[@size]'``: the checkpointed model's, then
    the reversible model's; ratios against the first row of each model (plain, stored)."""
    checkpointed, reversible, size = _parse_pair(pair)
    start = time.perf_counter()
    rev = _reversible_rows(reversible, batch, size, budget)
    log(f"{reversible}: measured in {time.perf_counter() - start:.0f}s")
    start = time.perf_counter()
    ckpt = _checkpointed_rows(checkpointed, batch, size, budget, rev[-1]["peak_bytes"])
    log(f"{checkpointed}: measured in {time.perf_counter() - start:.0f}s")
    anchor = ANCHORS["rev_vit" if reversible.startswith("rev_vit") else "revnet"]
    for part in (ckpt, rev):
        _ratios(part, batch, size)
        for r in part:
            r["anchor"] = anchor
    return ckpt + rev


def reversible_table(rows: list[dict], budget: str) -> str:
    """One row per (model, variant): peak, x own plain, FLOPs, recompute, ops, largest batch."""
    head = (f"| model | variant | peak | x plain/stored | GFLOPs | recompute | aten ops | x ops "
            f"| largest batch in {budget} | x plain/stored |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        size = f" @{r['size']}" if r["size"] else ""
        lines.append(
            f"| {r['model']}{size} | {r['variant']} | {format_bytes(r['peak_bytes'])} | "
            f"{r['peak_ratio']:.3f} | {r['flops'] / 1e9:.1f} | {r['recompute']:+.1%} | "
            f"{r['ops']} | {r['ops_ratio']:.2f} | {r['largest_batch'] or '-'} | "
            f"{'-' if r['batch_ratio'] is None else format(r['batch_ratio'], '.2f')} |")
    anchors = sorted({r["anchor"] for r in rows})
    return "\n".join(lines + [""] + [f"Published: {a}." for a in anchors])


def run_reversible(pairs: str | tuple = PAIRS, batch: int = 32, budget: str = "11GB",
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every pair's rows, with the machine and the command: the JSON payload."""
    limit = parse_bytes(budget)
    rows = [r for pair in comma_list(pairs) for r in pair_rows(pair, batch, limit, log)]
    return {"machine": machine_info(torch.device("cpu")), "command": command_line(),
            "batch": batch, "budget": budget, "budget_bytes": limit, "rows": rows}


def reversible(pairs: str | tuple = PAIRS, batch: int = 32, budget: str = "11GB",
               out: str | None = "docs/results/bench_reversible_cpu.json") -> list[dict]:
    """Reversible vs checkpointed: peak, FLOPs, aten ops, largest batch, exact on the CPU.

    ``pairs``: ``checkpointed:reversible[@image size]``, comma-separated. Per pair: the
    checkpointed model plain and at its zoo.plan floor, the reversible model stored and rebuilt,
    at ``batch``; the largest batch within ``budget``. Prints Markdown; writes ``out`` (JSON).
    """
    payload = run_reversible(pairs, batch, budget)
    print(f"reversible vs checkpointed, batch {batch}, CPU (exact bytes, FLOPs and ops), "
          f"torch {torch.__version__}")
    print(reversible_table(payload["rows"], budget))
    if out:
        print(f"wrote {write_json(out, payload)}")
    return payload["rows"]
