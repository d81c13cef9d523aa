"""PNG pictures of scripts/benchmark.py's JSON results, for docs/BENCHMARKS.md.

    python scripts/plot.py                                   # docs/results/benchmark_*.json
    python scripts/plot.py --results /tmp/run --out /tmp/img

Writes, per model and device: peak memory vs batch size per variant (from benchmark runs at
several batch sizes, e.g. ``--batch_size 16,32,64 --fake``); memory vs time trade-off per variant
and per number of segments (timed runs, ``--segments`` sweeps); largest batch per variant and
budget (``--find_max_batch``).
"""
from __future__ import annotations

from pathlib import Path

import fire

from zoo.bench.plots import plot_all


def main(results: str = "docs/results", out: str = "docs/img",
         pattern: str = "benchmark_*.json") -> list[str]:
    """Plot every ``pattern`` file under ``results`` into ``out``; print what was written."""
    paths = sorted(Path(results).glob(pattern))
    if not paths:
        raise SystemExit(f"no {pattern} under {results}: run scripts/benchmark.py first")
    written = plot_all(paths, out)
    for p in written:
        print(p)
    return [str(p) for p in written]


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda paths: None)
