"""The planner against each model's own checkpoint modes, and how low it reaches
(``planner-modes``), exact on the CPU (MemTracker bytes and FlopCounterMode FLOPs under
FakeTensorMode: nothing runs).

    python scripts/benchmark.py planner-modes --models resnet110,densenet_bc_100 --batch 32

Per model, at ``--batch``: the plain step's peak; per hand mode its peak and recompute, and the
plan's recompute at exactly that peak, chain schedules only (whole blocks) and with every
candidate (hand modes, and the chain with every block in each mode: two levels); the least
feasible peak of each search; the plan at the lowest budget applied and measured. Prints Markdown
and writes docs/results/bench_planner_modes_cpu.json.
"""
from __future__ import annotations

import time
from typing import Any

import torch

import zoo
from zoo.planner import (BudgetTooSmallError, measure_step, predict_peak, profile_block_modes,
                         profile_chain, profile_modes, smallest_peak, solve_profile,
                         least_peak)

from .report import comma_list, command_line, machine_info, write_json

__all__ = ["bench_model", "markdown", "planner_modes"]


def _cost(profile: Any, budget: int, **kw: Any) -> tuple[int | None, Any]:
    try:
        plan = solve_profile(profile, budget, **kw)
    except BudgetTooSmallError:
        return None, None
    return plan.recompute_flops, plan


def bench_model(name: str, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = zoo.create_model(name)
    x = model.example_input(batch)
    start = time.perf_counter()
    p = profile_chain(model, x)
    modes = profile_modes(model, x, p.step_flops)
    inner = profile_block_modes(model, x)
    seconds = time.perf_counter() - start
    plain = predict_peak(p, [(0, p.n_units, False)])
    rows = []
    for m in modes:
        chain_only, _ = _cost(p, m.peak)
        after, plan = _cost(p, m.peak, modes=modes, block_profiles=inner)
        rows.append(dict(mode=m.mode, peak=m.peak, ratio=m.peak / plain,
                         mode_recompute=m.recompute_flops, chain_recompute=chain_only,
                         plan_recompute=after,
                         plan_choice=plan.mode or ("block modes" if plan.block_modes
                                                   else "chain")))
    floors = {"chain, one level": (smallest_peak(p), []),
              **{f"chain with {q.block_mode} per block": (least_peak([p, q]), [q])
                 for q in inner}}
    measured = {}
    for what, (least, qs) in floors.items():  # the plan at each search's floor, measured
        plan = solve_profile(p, least, block_profiles=qs)
        plan.apply(model)
        peak, flops = measure_step(model, x)
        model.set_checkpoint_plan(None)
        model.set_checkpoint_block_modes(None)
        measured[what] = dict(predicted=least, ratio=least / plain, measured=peak,
                              measured_ratio=peak / plain, recompute=plan.recompute_flops,
                              measured_recompute=flops - p.step_flops)
    for m in modes:
        measured[f"mode {m.mode}"] = dict(predicted=m.peak, ratio=m.peak / plain,
                                          measured=m.peak, measured_ratio=m.peak / plain,
                                          recompute=m.recompute_flops,
                                          measured_recompute=m.recompute_flops)
    return dict(model=name, batch=batch, plain_peak=plain, step_flops=p.step_flops, rows=rows,
                floors=measured, profile_seconds=seconds)


def _f(flops: int | None, step: int) -> str:
    return "refused" if flops is None else f"+{100 * flops / step:.1f}%"


def markdown(results: list[dict[str, Any]]) -> str:
    out = []
    for r in results:
        s = r["step_flops"]
        out += [f"**{r['model']}**, batch {r['batch']}, plain peak "
                f"{r['plain_peak'] / 2**20:.1f} MiB", "",
                "| budget = peak of mode | peak / plain | mode's recompute | plan, whole blocks "
                "only | plan, all candidates | plan takes |", "|---|---:|---:|---:|---:|---|"]
        out += [f"| {w['mode']} | {w['ratio']:.3f}x | {_f(w['mode_recompute'], s)} | "
                f"{_f(w['chain_recompute'], s)} | {_f(w['plan_recompute'], s)} | "
                f"{w['plan_choice'] or 'chain schedule'} |" for w in r["rows"]]
        out += ["", "| search | least peak, predicted | the plan there, measured | recompute, "
                "predicted / measured |", "|---|---:|---:|---:|"]
        out += [f"| {k} | {v['ratio']:.3f}x | {v['measured_ratio']:.3f}x | "
                f"{_f(v['recompute'], s)} / {_f(v['measured_recompute'], s)} |"
                for k, v in r["floors"].items()]
        out += [""]
    return "\n".join(out)


def planner_modes(models: str | tuple = "resnet110,densenet_bc_100,vit_cifar,cifar_cnn",
                  batch: int = 32, out: str = "docs/results/bench_planner_modes_cpu.json"
                  ) -> list[dict]:
    """The planner at the peak of each of a model's own checkpoint modes.

    Per model and hand mode: its peak and recompute, and the plan's recompute at that peak, over
    whole blocks only and with every candidate (hand modes, per-block modes); the least peak of
    each search, planned there and measured. Prints Markdown; writes ``--out`` after each model.
    """
    torch.set_num_threads(1)
    machine = f"{machine_info(torch.device('cpu'))['cpu']} CPU, torch {torch.__version__}"
    print(f"machine: {machine}\n", flush=True)
    results = []
    for name in comma_list(models):  # each model written as soon as it is done (minutes each)
        results.append(bench_model(name, batch))
        write_json(out, dict(machine=machine, command=command_line(), results=results))
        print(markdown(results[-1:]), flush=True)
    return results
