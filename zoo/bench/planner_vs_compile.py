"""zoo.plan side by side with torch.compile's ``activation_memory_budget``
(``planner-vs-compile``), exact on the CPU, eager and compiled, and the planning time.

    python -m zoo.bench planner-vs-compile --models resnet20,vit_cifar --batch 32

Per model (its plain forward: no zoo checkpointing) and per budget fraction ``f``:

* torch: the step compiled with inductor's partitioner under ``activation_memory_budget=f``
  (:mod:`zoo.bench.compile_budget`: the partitioned graphs replayed op by op, peak bytes and
  FLOPs of the second step);
* zoo: the plan :class:`zoo.planner.Planner` gives for torch's measured peak as the budget
  (profiled once per model), applied and measured (one fake step: its peak and recompute, which
  equal the prediction), and the same planned model under ``torch.compile`` (measured as
  torch's rows are, partitioner at its default budget) with its peak and recompute.

Recompute is a step's FLOPs beyond a plain eager step's. Also the least peak of each: torch's
lowest over the fractions, zoo's :attr:`Planner.least_peak` (measured, eager and compiled).
:func:`planner_vs_compile` writes the JSON and prints Markdown.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zoo
from zoo.memory import format_bytes
from zoo.planner import Planner, default_loss, measure_step, spine_planner

from .compile_budget import default_solver, measure_compiled
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["FRACTIONS", "build", "compare", "plan_seconds", "markdown", "planner_vs_compile"]

FRACTIONS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
MODELS = ("resnet20", "resnet56", "cifar_cnn", "vit_cifar", "densenet40", "bert_base",
          "vit_small_patch16_224")


def build(name: str | Callable[[], nn.Module], batch: int, seed: int = 0, size: int = 32
          ) -> tuple[Callable[[], nn.Module], torch.Tensor]:
    """A builder of fresh, identically seeded instances of zoo model ``name`` (or
    ``torchvision:resnet18`` / ``timm:resnet50``, or a callable making a model), and a batch
    for it: images at the model's size (CIFAR models 32 px, ImageNet ones 224 px;
    ``torchvision:`` ones 112 px; a callable's ``size``), token ids of 128 for BERT."""
    def make() -> nn.Module:
        torch.manual_seed(seed)
        if callable(name):
            return name()
        if name.startswith("torchvision:"):
            import torchvision
            return getattr(torchvision.models, name.split(":")[1])(num_classes=10)
        if name.startswith("timm:"):
            import timm
            return timm.create_model(name.split(":")[1], pretrained=False)
        return zoo.create_model(name)

    torch.manual_seed(seed)
    model = make()
    if callable(name):
        x = torch.randn(batch, 3, size, size)
    elif name.startswith("torchvision:"):
        x = torch.randn(batch, 3, 112, 112)
    elif name.startswith("timm:"):
        x = torch.randn(batch, 3, 224, 224)
    else:
        x = model.example_input(batch, 128) if "bert" in name or "gpt" in name else \
            model.example_input(batch)
    return make, x


def _planner(model: nn.Module, x: torch.Tensor) -> Planner:
    return Planner(model, x) if hasattr(model, "checkpoint_chain") else spine_planner(model, x)


def _clear(model: nn.Module) -> None:
    if hasattr(model, "checkpoint_chain"):
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(None)
        model.set_grad_checkpointing(False)
    else:
        from zoo.planner.spine import clear_spine
        clear_spine(model)


def _zoo_row(make: Callable[[], nn.Module], planner: Planner, x: torch.Tensor, budget: int,
             plain_flops: int, compiled: bool) -> dict[str, Any]:
    """zoo's plan at ``budget``: predicted, measured eagerly, and (``compiled``) compiled."""
    plan = planner.plan(budget)
    model = make()
    plan.apply(model)
    peak, flops = measure_step(model, x)
    row = {"zoo_peak_bytes": peak, "zoo_recompute_flops": flops - plain_flops,
           "zoo_predicted_peak_bytes": plan.predicted_peak, "zoo_plan": _describe(plan)}
    if compiled:
        c = measure_compiled(model, x, 1.0, default_loss)
        row.update(zoo_compiled_peak_bytes=c["peak_bytes"],
                   zoo_compiled_recompute_flops=c["flops"] - plain_flops)
    return row


def _describe(plan: Any) -> str:
    if plan.mode is not None:
        return f"mode {plan.mode}"
    modes = sorted({m for m in plan.block_modes or [] if m})
    return (f"{len(plan.checkpointed_blocks)}/{plan.profile.n_blocks} blocks, {plan.levels} "
            f"levels" + (f", {'+'.join(modes)}" if modes else ""))


def compare(name: str | Callable[[], nn.Module], batch: int = 32,
            fractions: Sequence[float] = FRACTIONS, seed: int = 0, size: int = 32,
            solver: str | None = None, compiled: bool = True) -> dict[str, Any]:
    """One model: the plain step, per fraction torch's row and zoo's at torch's peak (None
    below zoo's least peak), and the least peak of each (zoo's eager and compiled)."""
    make, x = build(name, batch, seed, size)
    plain_peak, plain_flops = measure_step(make(), x)
    start = time.perf_counter()
    planner = _planner(make(), x)
    seconds = time.perf_counter() - start
    rows = []
    for f in fractions:
        c = measure_compiled(make(), x, f, default_loss, solver)
        row = {"fraction": f, "torch_peak_bytes": c["peak_bytes"],
               "torch_recompute_flops": c["flops"] - plain_flops}
        row.update(dict.fromkeys(("zoo_peak_bytes", "zoo_recompute_flops"))) \
            if c["peak_bytes"] < planner.least_peak else \
            row.update(_zoo_row(make, planner, x, c["peak_bytes"], plain_flops, compiled))
        row.setdefault("zoo_plan", "below its least peak")
        rows.append(row)
    least = min(rows, key=lambda r: (r["torch_peak_bytes"], r["torch_recompute_flops"]))
    zoo_least = _zoo_row(make, planner, x, planner.least_peak, plain_flops, compiled)
    zoo_least.update(peak_bytes=zoo_least["zoo_peak_bytes"],
                     recompute_flops=zoo_least["zoo_recompute_flops"], plan=zoo_least["zoo_plan"])
    label = name if isinstance(name, str) else getattr(name, "__name__", "model")
    return {"model": label, "batch": batch, "solver": solver or default_solver(),
            "plain_peak_bytes": plain_peak, "plain_flops": plain_flops, "rows": rows,
            "plan_seconds": round(seconds, 2),
            "torch_least": {k: least[k] for k in ("fraction", "torch_peak_bytes",
                                                  "torch_recompute_flops")},
            "zoo_least": zoo_least}


def plan_seconds(name: str, batch: int = 32, repeats: int = 3) -> dict[str, Any]:
    """Wall seconds to plan ``name`` (profile, search: ``Planner``), median of ``repeats``."""
    make, x = build(name, batch)
    times = []
    for _ in range(repeats):
        model = make()
        start = time.perf_counter()
        _planner(model, x)
        times.append(time.perf_counter() - start)
    return {"model": name, "batch": batch, "median_seconds": round(statistics.median(times), 2),
            "seconds": [round(t, 2) for t in times]}


def _pct(flops: int | None, plain: int) -> str:
    return "-" if flops is None else f"+{100 * flops / plain:.1f}%"


def _mib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """One table: per model and fraction, torch's peak and recompute, zoo's at that budget
    (eager and compiled)."""
    out = ["| model (batch) | torch f | torch peak | torch recompute | zoo peak | zoo recompute "
           "| zoo compiled peak | zoo compiled recompute | zoo's plan |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        p, name = r["plain_flops"], f"{r['model']} ({r['batch']})"
        out.append(f"| {name} | plain | {format_bytes(r['plain_peak_bytes'])} | +0.0% | | | | | |")
        for row in [*r["rows"], {**r["zoo_least"], "fraction": "least",
                                 "torch_peak_bytes": r["torch_least"]["torch_peak_bytes"],
                                 "torch_recompute_flops":
                                     r["torch_least"]["torch_recompute_flops"]}]:
            f = row["fraction"]
            out.append(
                f"| {name} | {f if isinstance(f, str) else f'{f:g}'} | "
                f"{_mib(row['torch_peak_bytes'])} | {_pct(row['torch_recompute_flops'], p)} | "
                f"{_mib(row.get('zoo_peak_bytes'))} | {_pct(row.get('zoo_recompute_flops'), p)}"
                f" | {_mib(row.get('zoo_compiled_peak_bytes'))} | "
                f"{_pct(row.get('zoo_compiled_recompute_flops'), p)} | "
                f"{row.get('zoo_plan', 'below its least peak')} |")
    return "\n".join(out)


def planner_vs_compile(models: str | tuple = ",".join(MODELS), batch: int = 32,
                       fractions: str | tuple = ",".join(f"{f:g}" for f in FRACTIONS),
                       solver: str | None = None, threads: int = 2, compiled: bool = True,
                       timing: str | tuple = "", repeats: int = 3,
                       out: str = "docs/results/bench_planner_vs_compile_cpu.json"
                       ) -> list[dict]:
    """zoo.plan beside torch.compile's activation_memory_budget, eager and compiled.

    Per model and budget fraction ``f``: torch's step compiled under
    ``activation_memory_budget=f`` (peak and recompute measured), zoo.plan given torch's peak
    as its budget (measured eagerly and, with ``--compiled``, compiled); the least peak each
    side reaches; and for the models in ``--timing`` the planning time (median of
    ``--repeats``). Prints Markdown; rewrites ``--out`` after each model.
    """
    torch.set_num_threads(threads)
    fs = [float(f) for f in comma_list(fractions)]
    results: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"machine": machine_info(torch.device("cpu")),
                               "command": command_line(), "results": results, "timing": []}
    for name in comma_list(models):
        results.append(compare(name, batch, fs, solver=solver, compiled=compiled))
        write_json(Path(out), payload)
        print(markdown(results[-1:]), flush=True)
    for name in comma_list(timing) if timing else []:
        payload["timing"].append(plan_seconds(name, batch, repeats))
        write_json(Path(out), payload)
        print(payload["timing"][-1], flush=True)
    return results
