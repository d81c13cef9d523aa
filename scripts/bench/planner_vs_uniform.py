"""Recompute overhead against memory budget (``planner``): the planner (``zoo.plan``) against
uniform ``checkpoint_sequential`` at every segment count and against blanket checkpointing.

    python scripts/benchmark.py planner                  # CPU, exact (MemTracker, FakeTensorMode)
    python scripts/benchmark.py planner --device cuda    # the same on a GPU's byte accounting

For each model (ResNet-110 and DenseNet-BC-100 at batch 64 on 32x32 images, BERT-base at batch 32,
sequence 128 by default; ``--batches``) the chain is profiled once under ``FakeTensorMode`` and:

* the planner's curve: at ``--points`` budgets from the smallest feasible peak to the plain peak,
  the recompute FLOPs of the cheapest schedule that fits (rotor's dynamic programme, Beaumont et
  al. 2019, one level), as a fraction of a plain step's FLOPs;
* uniform segmentation (Chen et al. 2016's sqrt(n) segments, ``zoo.checkpoint_sequential``):
  every segment count 1..n, with the last segment checkpointed (zoo's) or not (torch's); at each
  budget the cheapest one that fits;
* blanket checkpointing (``efficient=True``, the family's recommended mode), measured: one fake
  step under MemTracker and FlopCounterMode;
* the largest batch each reaches under 11 GiB and 12 GiB: plain and uniform from the profiles at
  the batch and 4x the batch extrapolated on a line; planner and blanket found by secant steps
  on real profiles / fake steps, so their batches are checked to fit.

Planner and uniform figures are the planner's predictions (tests/planner/test_planner.py checks them
against measured peaks within 5%); recompute FLOPs are exact. Writes
docs/results/bench_planner_<device>.json and docs/img/planner_<device>.png, prints Markdown.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.memory import parse_bytes
from zoo.planner import (ChainProfile, measure_step, predict_peak,
                         profile_chain, recompute_flops, smallest_peak, solve_profile,
                         uniform_segments)
from zoo.planner.batch import extrapolate, largest_feasible

from .report import comma_list, command_line, machine_info, write_json

__all__ = ["SEQUENCE_LENGTHS", "uniform_schedules", "bench_model", "markdown", "planner"]

MiB = 2**20
DEFAULT_BATCHES = {"resnet110": 64, "densenet_bc_100": 64, "bert_base": 32}
# the sequence length of the planner benchmarks' transformers (image models: their own size)
SEQUENCE_LENGTHS = {"bert_base": 128, "gpt2_small": 128}


def uniform_schedules(p: ChainProfile) -> list[dict[str, Any]]:
    """Every uniform segmentation: ``s`` balanced segments, the last checkpointed or not."""
    out = []
    for s in range(1, p.n_units + 1):
        for skip_last in (False, True):
            segs = uniform_segments(p, s)
            if skip_last:
                segs[-1] = (segs[-1][0], segs[-1][1], False)
            out.append({"segments": s, "skip_last": skip_last, "peak": predict_peak(p, segs),
                        "overhead": recompute_flops(p, segs) / p.step_flops})
    return out


def best_uniform(uniform: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    fitting = [u for u in uniform if u["peak"] <= budget]
    return min(fitting, key=lambda u: (u["overhead"], u["peak"])) if fitting else None


def max_batches(model: torch.nn.Module, name: str, device: str, batch: int, p: ChainProfile,
                budgets: dict[str, int], blanket_peaks: tuple[int, int]) -> dict[str, dict]:
    """Largest batch under each budget: plain, best uniform, planner, blanket (predicted: the
    figures at ``batch`` and ``4 * batch`` extrapolated on a line; a peak is a maximum of affine
    terms, and at small batches a constant one, such as the parameters' gradients, can hide the
    slope). Planner and blanket then follow secant steps on real profiles / fake steps from
    there, and report the largest batch checked to fit."""
    big = 4 * batch
    make = lambda b: model.example_input(b, SEQUENCE_LENGTHS.get(name)).to(device)  # noqa: E731
    pb = profile_chain(model, make(big))
    bh, bf = blanket_peaks
    out = {}
    for label, budget in budgets.items():
        def at(b: int) -> ChainProfile:
            return extrapolate(p, pb, b, batch, big)

        def plain(b: int) -> bool:
            q = at(b)
            return predict_peak(q, [(0, q.n_units, False)]) <= budget

        def uniform(b: int) -> bool:
            return any(u["peak"] <= budget for u in uniform_schedules(at(b)))

        def planner(b: int) -> bool:
            q = at(b)
            return smallest_peak(q) <= budget

        def blanket(b: int) -> bool:
            return bh + (b - batch) * (bf - bh) / (big - batch) <= budget

        row = {"plain": largest_feasible(plain), "uniform": largest_feasible(uniform)}

        def planner_peak(b: int) -> int:
            return smallest_peak(profile_chain(model, make(b)))

        def blanket_peak(b: int) -> int:
            model.set_grad_checkpointing(True)
            try:
                return measure_step(model, make(b))[0]
            finally:
                model.set_grad_checkpointing(False)

        row["planner"] = secant_largest(planner_peak, budget, largest_feasible(planner),
                                        [(batch, smallest_peak(p)), (big, smallest_peak(pb))])
        row["blanket"] = secant_largest(blanket_peak, budget, largest_feasible(blanket),
                                        [(batch, bh), (big, bf)])
        out[label] = row
    return out


def secant_largest(peak: Callable[[int], int], budget: int, guess: int,
                   points: list[tuple[int, int]], tries: int = 4) -> int:
    """The largest batch found whose ``peak(batch)`` (a profile or a fake step) fits ``budget``:
    start at ``guess``, then follow the line through the last two evaluated points."""
    points = sorted(points)
    best = max((b for b, m in points if m <= budget), default=0)
    for _ in range(tries):
        if guess in {b for b, _ in points} or guess < 1:
            break
        m = peak(guess)
        if m <= budget:
            best = max(best, guess)
        points = [points[-1], (guess, m)]
        (b0, m0), (b1, m1) = points
        slope = (m1 - m0) / (b1 - b0) if b1 != b0 else 0
        if slope <= 0:
            break
        guess = int(b1 + (budget - m1) / slope)
    return best


def bench_model(name: str, batch: int, device: str, points: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = zoo.create_model(name).to(device).train()
    x = model.example_input(batch, SEQUENCE_LENGTHS.get(name)).to(device)
    started = time.perf_counter()
    p = profile_chain(model, x)
    profile_s = time.perf_counter() - started
    plain = predict_peak(p, [(0, p.n_units, False)])
    low = smallest_peak(p)  # the one-level floor: the curve compares one-level schedules
    uniform = uniform_schedules(p)
    plain_measured, plain_flops = measure_step(model, x)
    model.set_grad_checkpointing(True)
    blanket_peak, blanket_flops = measure_step(model, x)
    blanket_big = measure_step(model, model.example_input(4 * batch, SEQUENCE_LENGTHS.get(name))
                               .to(device))[0]
    model.set_grad_checkpointing(False)
    blanket = {"mode": model.checkpoint_modes[0], "peak": blanket_peak,
               "overhead": (blanket_flops - plain_flops) / plain_flops}

    budgets = sorted({int(low + i * (plain - low) / (points - 1)) for i in range(points)}
                     | {u["peak"] for u in uniform if low <= u["peak"] <= plain}
                     | ({blanket_peak} if low <= blanket_peak <= plain else set()))
    curve = []
    for budget in budgets:
        plan = solve_profile(p, budget)
        uni = best_uniform(uniform, budget)
        curve.append({"budget": budget, "planner": plan.overhead,
                      "planner_peak": plan.predicted_peak,
                      "planner_segments": plan.segments,
                      "uniform": None if uni is None else uni["overhead"],
                      "uniform_choice": None if uni is None else
                      f"{uni['segments']}{' skip_last' if uni['skip_last'] else ''}",
                      "blanket": blanket["overhead"] if blanket_peak <= budget else None})
    s0 = max(1, round(math.sqrt(p.n_units)))
    sqrt_peak = next(u["peak"] for u in uniform if u["segments"] == s0 and not u["skip_last"])
    sqrt_uniform = best_uniform(uniform, sqrt_peak)
    sqrt_plan = solve_profile(p, sqrt_peak)
    no_worse = all(c["uniform"] is None or c["planner"] <= c["uniform"] + 1e-12 for c in curve)
    cheaper = 1 - sqrt_plan.overhead / sqrt_uniform["overhead"] if sqrt_uniform["overhead"] else 0.0
    largest = max_batches(model, name, device, batch, p, {"11GiB": parse_bytes("11GiB"),
                                                          "12GiB": parse_bytes("12GiB")},
                          (blanket_peak, blanket_big))
    return {"model": name, "batch": batch, "input": list(x.shape), "blocks": p.n_blocks,
            "units": p.n_units, "profile_seconds": round(profile_s, 1),
            "plain_peak": plain, "plain_peak_measured": plain_measured, "smallest_peak": low,
            "step_flops": p.step_flops, "blanket": blanket, "uniform": uniform, "curve": curve,
            "sqrt": {"segments": s0, "budget": sqrt_peak, "planner": sqrt_plan.overhead,
                     "uniform": sqrt_uniform["overhead"],
                     "uniform_choice": f"{sqrt_uniform['segments']}"
                                       f"{' skip_last' if sqrt_uniform['skip_last'] else ''}",
                     "planner_cheaper_by": cheaper},
            "goal": {"planner_never_worse": no_worse, "sqrt_cheaper_15pct": cheaper >= 0.15},
            "max_batch": largest}


def pct(v: float | None) -> str:
    return "-" if v is None else f"+{100 * v:.1f}%"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        b = r["blanket"]
        lines += [
            f"### {r['model']}, batch {r['batch']} (input {'x'.join(map(str, r['input']))}), "
            f"{r['units']} chain units",
            "",
            f"plain {r['plain_peak'] / MiB:.1f} MiB, smallest feasible "
            f"{r['smallest_peak'] / MiB:.1f} MiB; blanket `{b['mode']}`: "
            f"{b['peak'] / MiB:.1f} MiB at {pct(b['overhead'])}",
            "",
            "| budget (MiB) | planner | best uniform (segments) | blanket |",
            "|---:|---:|---:|---:|"]
        step = max(1, len(r["curve"]) // 12)
        rows = r["curve"][::step] + ([r["curve"][-1]] if (len(r["curve"]) - 1) % step else [])
        for c in rows:
            uni = "does not fit" if c["uniform"] is None else \
                f"{pct(c['uniform'])} ({c['uniform_choice']})"
            lines.append(f"| {c['budget'] / MiB:.1f} | {pct(c['planner'])} | {uni} | "
                         f"{pct(c['blanket']) if c['blanket'] is not None else 'does not fit'} |")
        s = r["sqrt"]
        lines += ["", f"At the budget where uniform needs sqrt(n) = {s['segments']} segments "
                      f"({s['budget'] / MiB:.1f} MiB): planner {pct(s['planner'])}, best uniform "
                      f"{pct(s['uniform'])} ({s['uniform_choice']}): planner "
                      f"{100 * s['planner_cheaper_by']:.0f}% cheaper. Planner never worse than "
                      f"uniform: {'yes' if r['goal']['planner_never_worse'] else 'NO'}.", "",
                  "| largest batch | plain (line) | best uniform (line) | planner | blanket |",
                  "|---|---:|---:|---:|---:|"]
        for label, m in r["max_batch"].items():
            lines.append(f"| {label} | {m['plain']} | {m['uniform']} | {m['planner']} | "
                         f"{m['blanket']} |")
        lines.append("")
    return "\n".join(lines)


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    """Recompute against budget per model: planner, best uniform, each segment count, blanket."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    for ax, r in zip(axes if len(results) > 1 else [axes], results):
        xs = [c["budget"] / MiB for c in r["curve"]]
        ax.step(xs, [100 * c["planner"] for c in r["curve"]], where="post", label="planner")
        ax.step(xs, [100 * c["uniform"] if c["uniform"] is not None else float("nan")
                     for c in r["curve"]], where="post", label="best uniform")
        ax.scatter([u["peak"] / MiB for u in r["uniform"] if not u["skip_last"]],
                   [100 * u["overhead"] for u in r["uniform"] if not u["skip_last"]], s=8,
                   color="gray", label="uniform, each segment count")
        b = r["blanket"]
        ax.scatter([b["peak"] / MiB], [100 * b["overhead"]], marker="x", color="red",
                   label=f"blanket ({b['mode']})")
        ax.set_xlim(min(min(xs), b["peak"] / MiB) * 0.95, r["plain_peak"] / MiB * 1.02)
        ax.set_title(f"{r['model']}, batch {r['batch']}")
        ax.set_xlabel("memory budget (MiB)")
        ax.set_ylabel("recompute overhead (% of step FLOPs)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def planner(models: str | tuple = "resnet110,densenet_bc_100,bert_base", device: str = "cpu",
            batches: dict | None = None, points: int = 24, out_dir: str = "docs") -> list[dict]:
    """The planner's recompute against budget, beside uniform segments and blanket.

    Per model (ResNet-110 and DenseNet-BC-100 at batch 64, BERT-base at batch 32, sequence 128;
    ``--batches '{resnet110: 32}'`` overrides): the planner's curve, uniform segmentation at
    every segment count, blanket checkpointing measured, and the largest batch each reaches
    under 11 and 12 GiB. Writes <out_dir>/results/bench_planner_<device>.json and
    <out_dir>/img/planner_<device>.png; prints Markdown.
    """
    sizes = {**DEFAULT_BATCHES, **(batches or {})}
    torch.set_num_threads(1)  # fake steps run Python, not kernels; threads only contend
    results = [bench_model(n, sizes.get(n, 32), device, points) for n in comma_list(models)]
    dev = torch.device(device)
    info = machine_info(dev)
    meta = {"device": info.get("gpu") or f"CPU ({info['cpu']})", "torch": torch.__version__,
            "python": info["python"], "command": command_line()}
    tag = dev.type
    out = Path(out_dir)
    write_json(out / "results" / f"bench_planner_{tag}.json", {"meta": meta, "results": results})
    plot_curves(results, out / "img" / f"planner_{tag}.png")
    print(markdown(results))
    return results
