"""Pictures of the benchmark JSONs (matplotlib, imported only here: a dev dependency).

* :func:`plot_peak_vs_batch`: peak memory against batch size, one line per variant;
* :func:`plot_tradeoff`: peak memory against step time (both as ratios to plain), one point per
  variant, and for a segments sweep one line per implementation through its segment counts;
* :func:`plot_max_batch`: the largest batch of each variant, grouped by memory budget;
* :func:`plot`: the ``plot`` subcommand, every picture of a folder of results.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["load_results", "plot_peak_vs_batch", "plot_tradeoff", "plot_max_batch", "plot_all",
           "plot"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load_results(paths: Iterable[str | Path]) -> list[dict]:
    """The payloads of ``variants``, ``max-batch`` and ``segments`` JSON files (others are
    skipped)."""
    out = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if isinstance(data, dict) and data.get("kind") in ("benchmark", "max_batch", "segments"):
            data["path"] = str(p)
            out.append(data)
    return out


def _where(payload: dict) -> str:
    """The machine in a title, and how the CPU got its figures."""
    m = payload["machine"]
    if m.get("gpu"):
        return m["gpu"]
    if payload["settings"].get("fake"):
        return "CPU, exact bytes (FakeTensorMode)"
    if payload["kind"] == "max_batch" and payload["settings"].get("card"):
        return f"CPU, predicted for {payload['settings']['card']}"
    if payload["kind"] == "max_batch":
        return f"CPU, {payload['settings'].get('allocator', 'cuda')} allocator"
    return f"CPU ({m['torch_threads']} threads)"


def plot_peak_vs_batch(payloads: list[dict], out: Path) -> list[Path]:
    """One PNG per (model, device): peak memory (GiB) against batch size, one line per variant."""
    plt = _plt()
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for p in payloads:
        if p["kind"] == "benchmark":
            groups[(p["model"], p["machine"]["device"].split(":")[0])].append(p)
    written = []
    for (model, device), group in sorted(groups.items()):
        points: dict[str, dict[int, float]] = defaultdict(dict)
        for p in group:
            for r in p["rows"]:
                points[r["variant"]][r["batch_size"]] = r["peak_bytes"] / 2**30
        if max(len(v) for v in points.values()) < 2:
            continue  # one batch size: no curve to draw
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for variant, by_batch in points.items():
            xs = sorted(by_batch)
            ax.plot(xs, [by_batch[b] for b in xs], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak memory of one training step (GiB)")
        ax.set_title(f"{model}: peak memory vs batch size, {_where(group[0])}")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out / f"{model}_{device}_peak_vs_batch.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_tradeoff(payloads: list[dict], out: Path) -> list[Path]:
    """One PNG per timed benchmark or segments sweep: x peak ratio, y time ratio (1 = plain)."""
    plt = _plt()
    written = []
    for p in payloads:
        rows = [r for r in p["rows"] if "time_ratio" in r]
        if p["kind"] not in ("benchmark", "segments") or not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if p["kind"] == "segments":
            for impl in ("torch", "zoo"):
                line = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["segments"])
                ax.plot([r["peak_ratio"] for r in line], [r["time_ratio"] for r in line],
                        marker="o", label=f"{impl}.checkpoint_sequential")
                for r in line:
                    ax.annotate(str(r["segments"]), (r["peak_ratio"], r["time_ratio"]),
                                textcoords="offset points", xytext=(4, 4), fontsize=8)
            ax.plot([1], [1], marker="s", color="black", linestyle="none", label="no checkpoint")
            title = f"{p['model']} batch {p['settings']['batch_size']}: segments (numbers)"
            name = f"{p['model']}_{p['machine']['device'].split(':')[0]}_segments.png"
        else:
            variants = list(dict.fromkeys(r["variant"] for r in rows))
            for j, batch in enumerate(sorted({r["batch_size"] for r in rows})):
                for r in (r for r in rows if r["batch_size"] == batch):
                    ax.plot(r["peak_ratio"], r["time_ratio"], marker="osD^v"[j % 5],
                            color=f"C{variants.index(r['variant'])}", linestyle="none",
                            markersize=8, label=f"{r['variant']} (batch {batch})")
            batches = "-".join(str(b) for b in sorted({r["batch_size"] for r in rows}))
            title = f"{p['model']} batch {batches}: memory vs time"
            name = f"{p['model']}_{p['machine']['device'].split(':')[0]}_b{batches}_tradeoff.png"
        ax.set_xlabel("peak memory, x plain")
        ax.set_ylabel("median step time, x plain")
        ax.set_title(f"{title}\n{_where(p)}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_max_batch(payloads: list[dict], out: Path) -> list[Path]:
    """One PNG per max-batch run: bars of the largest batch per variant, grouped by budget."""
    plt = _plt()
    written = []
    for p in payloads:
        if p["kind"] != "max_batch":
            continue
        budgets = list(dict.fromkeys(r["budget"] for r in p["rows"]))
        variants = list(dict.fromkeys(r["variant"] for r in p["rows"]))
        width = 0.8 / len(variants)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, v in enumerate(variants):
            heights = [next(r["largest_batch"] for r in p["rows"]
                            if r["budget"] == b and r["variant"] == v) for b in budgets]
            xs = [j + i * width for j in range(len(budgets))]
            bars = ax.bar(xs, heights, width, label=v)
            ax.bar_label(bars, fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(budgets))], budgets)
        ax.set_ylabel("largest batch")
        how = p["rows"][0]["method"].split(" (")[0]
        ax.set_title(f"{p['model']}: largest batch per budget ({how}), {_where(p)}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        card = "_card" if p["settings"].get("card") else ""  # beside the CPU's own prediction
        path = out / f"{p['model']}_{p['machine']['device'].split(':')[0]}{card}_max_batch.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_all(paths: Iterable[str | Path], out: str | Path) -> list[Path]:
    """Every picture the payloads in ``paths`` give, written to ``out``; the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payloads = load_results(paths)
    return (plot_peak_vs_batch(payloads, out) + plot_tradeoff(payloads, out)
            + plot_max_batch(payloads, out))


def plot(results: str = "docs/results", out: str = "docs/img",
         pattern: str = "benchmark_*.json") -> list[str]:
    """PNG pictures of the variants, max-batch and segments results.

    Per model and device: peak memory against batch size per variant (from ``variants`` at
    several batch sizes, e.g. ``--batch_size 16,32,64 --fake``); memory against time per variant
    and per segment count (timed ``variants`` and ``segments`` runs); the largest batch per
    variant and budget (``max-batch``). Prints the paths written.
    """
    paths = sorted(Path(results).glob(pattern))
    if not paths:
        raise ValueError(f"no {pattern} under {results}: run python scripts/benchmark.py variants "
                         f"(or max-batch, segments) first")
    written = plot_all(paths, out)
    for p in written:
        print(p)
    return [str(p) for p in written]
