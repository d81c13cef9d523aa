"""zoo.plan side by side with torch.compile's ``activation_memory_budget``
(``planner-vs-compile``), exact on the CPU, eager and compiled, and the planning time.

    python scripts/benchmark.py planner-vs-compile --models resnet20,vit_cifar --batch 32

Per model (its plain forward: no zoo checkpointing) and per budget fraction ``f``:

* torch: the step compiled with inductor's partitioner under ``activation_memory_budget=f``
  (:mod:`zoo.memory.compiled`: the partitioned graphs replayed op by op, peak bytes and
  FLOPs of the second step);
* zoo: the plan :class:`zoo.planner.Planner` gives for torch's measured peak as the budget
  (profiled once per model), applied and measured (one fake step: its peak and recompute, which
  equal the prediction);
* zoo compiled: the plan a ``Planner(..., compiled=True)`` gives for the same budget (one-level
  schedules of plain blocks, which the partitioner keeps), measured eagerly and under
  ``torch.compile`` (as torch's rows are, partitioner at its default budget).

``--fake``: torch's compiled steps run on the ``meta`` device (no kernel; the same bytes and
FLOPs, :mod:`zoo.memory.compiled`), so a model as large as BERT-base at sequence 128 is
compared in minutes; zoo's side is measured on fake tensors either way.

Recompute is a step's FLOPs beyond a plain eager step's. Also the least peak of each: torch's
lowest over the fractions, zoo's :attr:`Planner.least_peak` (measured, eager and compiled), and
per model whether zoo's plans meet torch's (:func:`verdict`). :func:`planner_vs_compile` writes
the JSON and prints Markdown.
"""
from __future__ import annotations

import json
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

from zoo.memory.compiled import check_meta_like_cpu, default_solver, measure_compiled
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["FRACTIONS", "build", "compare", "verdict", "plan_seconds", "markdown",
           "planner_vs_compile"]

FRACTIONS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
MODELS = ("resnet20", "resnet56", "cifar_cnn", "vit_cifar", "densenet40", "bert_base",
          "vit_small_patch16_224")


def build(name: str | Callable[[], nn.Module], batch: int, seed: int = 0,
          size: int | None = None) -> tuple[Callable[[], nn.Module], torch.Tensor]:
    """A builder of fresh, identically seeded instances of zoo model ``name`` (or
    ``torchvision:resnet18`` / ``timm:resnet50``, or a callable making a model), and a batch
    for it: images at the model's size (CIFAR models 32 px, ImageNet ones 224 px; ``size`` px
    for ``torchvision:``, ``timm:`` and callables, 224 / 224 / 32 when not given), token ids of
    128 for BERT and GPT-2 (``size`` of them for a callable making a token model)."""
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
    if callable(name) and hasattr(model, "vocab_size"):
        x = model.example_input(batch, size or 32)
    elif callable(name) or name.startswith(("torchvision:", "timm:")):
        side = size or (32 if callable(name) else 224)
        x = torch.randn(batch, 3, side, side)
    else:
        x = model.example_input(batch, 128) if "bert" in name or "gpt" in name else \
            model.example_input(batch)
    return make, x


def _planner(model: nn.Module, x: torch.Tensor, compiled: bool = False) -> Planner:
    if hasattr(model, "checkpoint_chain"):
        return Planner(model, x, compiled=compiled)
    planner = spine_planner(model, x, compiled=compiled)
    if planner is None:
        raise ValueError(f"{type(model).__name__} has no spine covering its blocks: "
                         "planner-vs-compile takes zoo models and models with a spine")
    return planner


def _clear(model: nn.Module) -> None:
    if hasattr(model, "checkpoint_chain"):
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(None)
        model.set_grad_checkpointing(False)
    else:
        from zoo.planner.modules.spine import clear_spine
        clear_spine(model)


def _zoo_row(make: Callable[[], nn.Module], planner: Planner, x: torch.Tensor, budget: int,
             plain_flops: int) -> dict[str, Any]:
    """zoo's plan at ``budget``: predicted and measured (one fake step)."""
    plan = planner.plan(budget)
    model = make()
    plan.apply(model)
    peak, flops = measure_step(model, x)
    return {"zoo_peak_bytes": peak, "zoo_recompute_flops": flops - plain_flops,
            "zoo_predicted_peak_bytes": plan.predicted_peak, "zoo_plan": _describe(plan)}


def _compiled_row(make: Callable[[], nn.Module], planner: Planner, x: torch.Tensor,
                  budget: int, plain_flops: int, fake: bool = False) -> dict[str, Any]:
    """The compile-safe plan (``compiled=True``) at ``budget``, measured eagerly and compiled;
    Nones below its least peak."""
    keys = ("zoo_c_plan", "zoo_c_peak_bytes", "zoo_c_recompute_flops",
            "zoo_compiled_peak_bytes", "zoo_compiled_recompute_flops")
    if budget < planner.least_peak:
        return {**dict.fromkeys(keys), "zoo_c_plan": "below its least peak"}
    plan = planner.plan(budget)
    model = make()
    plan.apply(model)
    peak, flops = measure_step(model, x)
    c = measure_compiled(model, x, 1.0, default_loss, fake=fake)
    return dict(zip(keys, (_describe(plan), peak, flops - plain_flops, c["peak_bytes"],
                           c["flops"] - plain_flops)))


def _describe(plan: Any) -> str:
    if plan.mode is not None:
        return f"mode {plan.mode}"
    modes = sorted({m for m in plan.block_modes or [] if m})
    return (f"{len(plan.checkpointed_blocks)}/{plan.profile.n_blocks} blocks, {plan.levels} "
            f"levels" + (f", {'+'.join(modes)}" if modes else ""))


def compare(name: str | Callable[[], nn.Module], batch: int = 32,
            fractions: Sequence[float] = FRACTIONS, seed: int = 0, size: int = 32,
            solver: str | None = None, compiled: bool = True, fake: bool = False
            ) -> dict[str, Any]:
    """One model: the plain step, per fraction torch's row and zoo's at torch's peak (None
    below zoo's least peak), and the least peak of each (zoo's eager and compiled).
    ``fake``: torch's compiled steps on the ``meta`` device (same bytes and FLOPs)."""
    make, x = build(name, batch, seed, size)
    if fake:
        check_meta_like_cpu(make().train(), x)
    plain_peak, plain_flops = measure_step(make(), x)
    start = time.perf_counter()
    planner = _planner(make(), x)
    seconds = time.perf_counter() - start
    compile_planner = _planner(make(), x, compiled=True) if compiled else None
    rows = []
    for f in fractions:
        c = measure_compiled(make(), x, f, default_loss, solver, fake=fake)
        row = {"fraction": f, "torch_peak_bytes": c["peak_bytes"],
               "torch_recompute_flops": c["flops"] - plain_flops}
        if c["peak_bytes"] < planner.least_peak:
            row.update(zoo_peak_bytes=None, zoo_recompute_flops=None,
                       zoo_plan="below its least peak")
        else:
            row.update(_zoo_row(make, planner, x, c["peak_bytes"], plain_flops))
        if compile_planner is not None:
            row.update(_compiled_row(make, compile_planner, x, c["peak_bytes"], plain_flops,
                                     fake))
        rows.append(row)
    least = min(rows, key=lambda r: (r["torch_peak_bytes"], r["torch_recompute_flops"]))
    zoo_least = _zoo_row(make, planner, x, planner.least_peak, plain_flops)
    if compile_planner is not None:
        zoo_least.update(_compiled_row(make, compile_planner, x, compile_planner.least_peak,
                                       plain_flops, fake))
    zoo_least.update(peak_bytes=zoo_least["zoo_peak_bytes"],
                     recompute_flops=zoo_least["zoo_recompute_flops"], plan=zoo_least["zoo_plan"])
    label = name if isinstance(name, str) else getattr(name, "__name__", "model")
    result = {"model": label, "batch": batch, "solver": solver or default_solver(), "fake": fake,
              "plain_peak_bytes": plain_peak, "plain_flops": plain_flops, "rows": rows,
              "plan_seconds": round(seconds, 2),
              "torch_least": {k: least[k] for k in ("fraction", "torch_peak_bytes",
                                                    "torch_recompute_flops")},
              "zoo_least": zoo_least}
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Whether zoo meets torch on one model: at every fraction a plan measured no higher than
    torch's peak recomputing no more (``every_fraction``; the fractions that fail listed), zoo's
    least peak below torch's (``least_below_torch``), and the compile-safe plans compiled no
    higher nor dearer than measured eagerly (``compiled_keeps_plan``; None when not run)."""
    def meets(row: dict[str, Any]) -> bool:
        return row["zoo_peak_bytes"] is not None and \
            row["zoo_peak_bytes"] <= row["torch_peak_bytes"] and \
            row["zoo_recompute_flops"] <= row["torch_recompute_flops"]

    def keeps(row: dict[str, Any]) -> bool:
        return row.get("zoo_compiled_peak_bytes") is None or (
            row["zoo_compiled_peak_bytes"] <= row["zoo_c_peak_bytes"]
            and row["zoo_compiled_recompute_flops"] <= row["zoo_c_recompute_flops"])

    rows = [*result["rows"], result["zoo_least"]]
    missed = [r["fraction"] for r in result["rows"] if not meets(r)]
    ran = any("zoo_compiled_peak_bytes" in r for r in rows)
    return {"every_fraction": not missed, "missed_fractions": missed,
            "least_below_torch": result["zoo_least"]["peak_bytes"]
            < result["torch_least"]["torch_peak_bytes"],
            "compiled_keeps_plan": all(keeps(r) for r in rows) if ran else None,
            "compiled_not_kept": [r.get("fraction", "least") for r in rows if not keeps(r)]}


def plan_seconds(name: str, batch: int = 32, repeats: int = 3) -> dict[str, Any]:
    """Wall seconds to plan ``name`` (profile, search: ``Planner``), median of ``repeats``;
    the process's CPU seconds beside them (on a shared machine, what the planning itself took),
    and the chain's units and the least plan's levels of nesting."""
    make, x = build(name, batch)  # ImageNet size for torchvision and timm models
    times, cpu = [], []
    for _ in range(repeats):
        model = make()
        start, start_cpu = time.perf_counter(), time.process_time()
        planner = _planner(model, x)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    least = planner.choices[0]
    return {"model": name, "batch": batch, "median_seconds": round(statistics.median(times), 2),
            "seconds": [round(t, 2) for t in times],
            "median_cpu_seconds": round(statistics.median(cpu), 2),
            "units": planner.profile.n_units, "blocks": planner.profile.n_blocks,
            "least_peak_bytes": least.predicted_peak,
            "least_levels": least.levels if least.mode is None else least.mode}


def _pct(flops: int | None, plain: int) -> str:
    return "-" if flops is None else f"+{100 * flops / plain:.1f}%"


def _mib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _least_row(r: dict[str, Any]) -> dict[str, Any]:
    return {**r["zoo_least"], "fraction": "least",
            "torch_peak_bytes": r["torch_least"]["torch_peak_bytes"],
            "torch_recompute_flops": r["torch_least"]["torch_recompute_flops"]}


def _f(row: dict[str, Any]) -> str:
    f = row["fraction"]
    return f if isinstance(f, str) else f"{f:g}"


def markdown(results: Sequence[dict[str, Any]]) -> str:
    """Two tables: per model and fraction, torch's peak and recompute beside zoo's plan at that
    budget measured eagerly; then zoo's compile-safe plan there, eager and compiled."""
    out = ["| model (batch) | torch f | torch peak | torch recompute | zoo peak | zoo recompute "
           "| zoo's plan |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        p, name = r["plain_flops"], f"{r['model']} ({r['batch']})"
        out.append(f"| {name} | plain | {format_bytes(r['plain_peak_bytes'])} | +0.0% | | | |")
        for row in [*r["rows"], _least_row(r)]:
            out.append(
                f"| {name} | {_f(row)} | {_mib(row['torch_peak_bytes'])} | "
                f"{_pct(row['torch_recompute_flops'], p)} | {_mib(row.get('zoo_peak_bytes'))} | "
                f"{_pct(row.get('zoo_recompute_flops'), p)} | "
                f"{row.get('zoo_plan') or 'below its least peak'} |")
    if not any("zoo_c_plan" in row for r in results for row in r["rows"]):
        return "\n".join(out)
    out += ["", "| model (batch) | torch f | torch peak | torch recompute | eager peak | "
            "eager recompute | compiled peak | compiled recompute | zoo's compiled=True plan |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        p, name = r["plain_flops"], f"{r['model']} ({r['batch']})"
        for row in [*r["rows"], _least_row(r)]:
            out.append(
                f"| {name} | {_f(row)} | {_mib(row['torch_peak_bytes'])} | "
                f"{_pct(row['torch_recompute_flops'], p)} | {_mib(row.get('zoo_c_peak_bytes'))}"
                f" | {_pct(row.get('zoo_c_recompute_flops'), p)} | "
                f"{_mib(row.get('zoo_compiled_peak_bytes'))} | "
                f"{_pct(row.get('zoo_compiled_recompute_flops'), p)} | "
                f"{row.get('zoo_c_plan') or 'below its least peak'} |")
    return "\n".join(out)


def planner_vs_compile(models: str | tuple = ",".join(MODELS), batch: int = 32,
                       fractions: str | tuple = ",".join(f"{f:g}" for f in FRACTIONS),
                       solver: str | None = None, threads: int = 2, compiled: bool = True,
                       timing: str | tuple = "", repeats: int = 3, resume: bool = False,
                       out: str = "docs/results/bench_planner_vs_compile_cpu.json",
                       size: int = 32, fake: bool = False) -> list[dict]:
    """zoo.plan beside torch.compile's activation_memory_budget, eager and compiled.

    Per model and budget fraction ``f``: torch's step compiled under
    ``activation_memory_budget=f`` (peak and recompute measured), zoo.plan given torch's peak
    as its budget (measured eagerly) and, with ``--compiled``, zoo's compile-safe plan there
    (eager and compiled); the least peak each side reaches; and for the models in ``--timing``
    the planning time (median of ``--repeats``, timed first). Prints Markdown; rewrites ``--out``
    after each model (``--resume``: keeps the models and timings already in it and runs the rest).
    ``--size``: the images' side in px for ``torchvision:`` and ``timm:`` models in ``--models``.
    ``--fake``: torch's compiled steps run on the ``meta`` device, no kernel (same bytes and
    FLOPs); for models too large to step for real on this CPU.
    """
    torch.set_num_threads(threads)
    fs = [float(f) for f in comma_list(fractions)]
    results: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"machine": machine_info(torch.device("cpu")),
                               "command": command_line(), "results": results, "timing": []}
    if resume and Path(out).exists():
        old = json.loads(Path(out).read_text())
        results += old.get("results", [])
        payload["timing"] += old.get("timing", [])
    timed = {t["model"] for t in payload["timing"]}
    for name in comma_list(timing) if timing else []:  # first: the quick part
        if name not in timed:
            payload["timing"].append(plan_seconds(name, batch, repeats))
            write_json(Path(out), payload)
            print(payload["timing"][-1], flush=True)
    done = {r["model"] for r in results}
    for name in comma_list(models):
        if name not in done:
            results.append(compare(name, batch, fs, size=size, solver=solver,
                                   compiled=compiled, fake=fake))
            write_json(Path(out), payload)
            print(markdown(results[-1:]), "\n", results[-1]["verdict"], flush=True)
    return results
