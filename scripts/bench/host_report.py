"""The host-cost command: measure (:mod:`.host_cost`) what :mod:`.host_peers` builds, print
Markdown tables, write JSON.

    python scripts/benchmark.py host-cost                      # the default workloads, timed on meta
    python scripts/benchmark.py host-cost --models densenet_bc_100:64 --nochain --nooutside
    python scripts/benchmark.py host-cost --device cuda        # on a GPU: ops and time on cuda

Every table names its machine and command; ratios are against the plain model of the same run.
"""
from __future__ import annotations

import platform
from collections.abc import Sequence
from typing import Any

import torch

from zoo.memory.host import COPY

from . import report
from .host_cost import measure
from .host_peers import OUTSIDE, chain_entries, outside_entries, zoo_entries
from .region_chain import REGIONS

__all__ = ["DEFAULT_MODELS", "run_host_cost", "workload_table", "op_table", "chain_table"]

DEFAULT_MODELS = ("densenet_bc_100:64", "resnet50:8", "resnet110:8", "bert_base:2",
                  "vit_small_patch16_224:2", "densenet121:2")


def _parse_workload(spec: str) -> tuple[str, int]:
    name, _, batch = spec.strip().partition(":")
    try:
        return name, int(batch or 2)
    except ValueError:
        raise ValueError(f"workload {spec!r}: expected MODEL or MODEL:BATCH, like "
                         "densenet_bc_100:64") from None


def run_host_cost(models: str | Sequence[str] = DEFAULT_MODELS, device: str = "meta",
                  repeats: int = 15, warmup: int = 2, peers: bool = True, chain: bool = True,
                  outside: bool = True, times: bool = True, json_out: str | None = None,
                  markdown_out: str | None = None) -> dict[str, Any]:
    """Host cost of a training step: aten ops, their floor, host time on meta, beside the peers.

    For each workload (``MODEL:BATCH``), the chain of 100 tiny regions and the models from
    outside the zoo: ops per step under a dispatch mode and dispatched, the floor (plain plus
    every region's recompute) and the extra ops per region beyond it, host time on ``device``
    (``meta`` by default; ``cuda`` on a GPU) against plain and against the timed floor, and the
    ops by name. Prints Markdown; ``--json_out`` writes JSON, ``--markdown_out`` the tables;
    ``--notimes`` counts only."""
    dev = torch.device(device)
    if dev.type not in ("meta", "cpu", "cuda"):
        raise ValueError(f"--device must be meta, cpu or cuda (cuda:N), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; use --device meta (host "
                         "time without kernels) or cpu")
    specs = report.comma_list(models) if models else []
    results: dict[str, Any] = {"command": report.command_line(),
                               "machine": report.machine_info(
                                   torch.device("cpu") if dev.type == "meta" else dev),
                               "timed_on": device, "repeats": repeats, "workloads": []}
    for spec in specs:
        name, batch = _parse_workload(spec)
        rows = measure(zoo_entries(name, batch, device=device, peers=peers), repeats, warmup,
                       times)
        results["workloads"].append({"model": name, "batch_size": batch, "rows": rows})
    if chain:
        results["chain"] = {"regions": REGIONS, "rows": measure(chain_entries(device=device),
                                                           repeats, warmup, times)}
    if outside:
        results["outside"] = [{"model": which, "rows": measure(
            outside_entries([which], device=device), repeats, warmup, times)}
            for which in OUTSIDE]
    text = markdown_report(results)
    print(text)
    if json_out:
        report.write_json(json_out, results)
    if markdown_out:
        with open(markdown_out, "w") as f:
            f.write(text)
    return results


# --------------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------------
def _x(value: float | None, spec: str = ".3f") -> str:
    return "" if value is None else f"{value:{spec}}x"


def workload_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per variant: ops (under a dispatch mode, and dispatched without one), the floor,
    the extra ops per region beyond it, host time and its ratio to plain and to the floor."""
    lines = ["| variant | ops | x plain | dispatched | x plain | floor | regions | extra ops / "
             "region | host ms | x plain | x floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        extra = (f"{r['extra_per_region']:.2f} / {r['extra_dispatched_per_region']:.2f}"
                 if "floor" in r else "")
        seconds = f"{r['seconds'] * 1e3:.1f}" if "seconds" in r else ""
        lines.append(
            f"| {r['variant']} | {r['ops']} | {_x(r['ops_ratio'])} | {r['dispatched']} | "
            f"{_x(r['dispatched_ratio'])} | {r.get('floor', '')} | {r.get('regions', '')} | "
            f"{extra} | {seconds} | {_x(r.get('time_ratio'))} | {_x(r.get('time_vs_floor'))} |")
    return "\n".join(lines)


def op_table(rows: Sequence[dict[str, Any]], top: int = 12) -> str:
    """Ops by name: the ``top`` names whose count differs most from plain in any variant."""
    plain = {r["group"]: r["by_op"] for r in rows if r["variant"] == r["group"]}
    change: dict[str, int] = {}
    for r in rows:
        base = plain[r["group"]]
        for op in set(base) | set(r["by_op"]):
            diff = abs(r["by_op"].get(op, 0) - base.get(op, 0))
            change[op] = max(change.get(op, 0), diff)
    names = sorted((n for n in change if change[n]), key=lambda n: -change[n])[:top]
    header = "| op | " + " | ".join(r["variant"] for r in rows) + " |"
    lines = [header, "|---|" + "---:|" * len(rows)]
    for name in names:
        label = name.replace("aten.", "").replace(".default", "")
        lines.append(f"| {label} | " + " | ".join(str(r["by_op"].get(name, 0)) for r in rows)
                     + " |")
    return "\n".join(lines)


def chain_table(rows: Sequence[dict[str, Any]], regions: int) -> str:
    """Per region of the chain: ops rerun, ops beyond them, host microseconds beyond plain and
    beyond the floor (the plain step with every region's rerun replayed on its own), for torch's
    checkpoint and the zoo's (both rerun the same ops, so they share the zoo's floor)."""
    by_name = {r["variant"]: r for r in rows}
    plain, zoo_row = by_name["plain"], by_name["zoo"]
    floor, floor_dispatched = zoo_row["floor"], zoo_row["floor_dispatched"]
    rerun = (floor - plain["ops"]) / regions
    lines = ["| checkpoint | ops rerun / region | extra ops / region | extra dispatched / region "
             "| host us / region over plain | over floor |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("torch checkpoint", "zoo"):
        r = by_name[name]
        over_plain = over_floor = ""
        if "seconds" in r:
            over_plain = f"{(r['seconds'] - plain['seconds']) / regions * 1e6:.1f}"
            over_floor = f"{(r['seconds'] - zoo_row['floor_seconds']) / regions * 1e6:.1f}"
        lines.append(f"| {name} | {rerun:.2f} | {(r['ops'] - floor) / regions:.2f} | "
                     f"{(r['dispatched'] - floor_dispatched) / regions:.2f} | {over_plain} | "
                     f"{over_floor} |")
    return "\n".join(lines)


def markdown_report(results: dict[str, Any]) -> str:
    """Every table of a run, each under a heading, after the machine and the command."""
    m = results["machine"]
    parts = [f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m.get('gpu', 'no GPU')}, torch "
             f"{m['torch']}, {platform.system()}; host time on `{results['timed_on']}` "
             f"({'wall' if results['timed_on'].startswith('cuda') else 'CPU'} time), medians of "
             f"{results['repeats']} interleaved steps.\n\n    {results['command']}\n",
             f"`ops`: aten ops under a dispatch mode; `dispatched`: the same less the "
             f"{COPY!r} entries, autograd's C++ copies of saved tensors that reach the dispatcher "
             "only while a mode watches. `floor`: plain ops plus each region's forward ops up to "
             "its last saved tensor. `extra ops / region`: (ops - floor) / regions, then the same "
             "for dispatched ops. `x floor`: host time over the floor's, timed as the plain step "
             "followed by every region's rerun replayed on its own."]
    for w in results["workloads"]:
        parts.append(f"### {w['model']}, batch {w['batch_size']}\n\n{workload_table(w['rows'])}"
                     f"\n\nOps by name:\n\n{op_table(w['rows'])}")
    if "chain" in results:
        rows = results["chain"]["rows"]
        parts.append(f"### {results['chain']['regions']} tiny regions (Linear + ReLU, batch 1)"
                     f"\n\n{workload_table(rows)}\n\n"
                     f"{chain_table(rows, results['chain']['regions'])}")
    for o in results.get("outside", ()):
        parts.append(f"### {o['model']}\n\n{workload_table(o['rows'])}")
    return "\n\n".join(parts) + "\n"
