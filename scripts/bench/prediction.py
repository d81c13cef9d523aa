"""``prediction``: every recorded H100 row, measured against what this machine predicts for it.

The rows come from what H100 runs wrote under docs/results/: the variants runs
(``benchmark_*_cuda_b*.json``: peak and median step), the largest-batch runs
(``benchmark_*_cuda_maxbatch.json``: the peak at the largest batch and at the first probes, the
device capped at the budget), the GPU suite's tables (``gpu_<part>_h100.md``: peak and median
step, taken later, with today's region) and the host-cost run (``host_cost_cuda.json``: the
step's time at small batches). Each row's step runs here once under ``FakeTensorMode`` with
:func:`zoo.memory.cards.peak.run_counted` (CUDA's attention and dropout, the caching allocator
replayed, cuBLAS workspaces) and the card's roofline plus the host's cost
(:mod:`zoo.memory.cards`). Nothing is tuned per row: the host's two constants are fitted once
over the host-cost rows (printed), the rest is the card's data sheet.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zoo.memory import format_bytes
from zoo.memory.cards import (H100_ACHIEVED, H100_HOST, Achieved, Card, HostCost,
                              device_parts, fit_achieved, fit_host, host_ops, step_time)
from zoo.memory.cards import card as named_card
from zoo.memory.cards.allocator import SimulatedOutOfMemory
from zoo.memory.cards.peak import run_counted

from .measure import training_step
from .prediction_before import file_before
from .prediction_check import check_before
from .report import comma_list, command_line, machine_info, write_json
from .variants import build_variant, create

__all__ = ["Recorded", "recorded_rows", "prediction"]

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
# host-cost rows' names for the variants build_variant makes (timm's own ResNet-50 is not one)
_GPU_PARTS = {"densenet_b64": ("densenet_bc_100", None), "resnet50": ("resnet50", 224),
              "bert": ("bert_base", 128)}
_HOST_NAMES = {"torchvision memory_efficient": "official", "torch checkpoint": "official",
               "timm set_grad_checkpointing": "timm"}


@dataclass(frozen=True)
class Recorded:
    """One recorded H100 row: where from, the workload, what the card measured."""

    source: str
    model: str
    size: int | None
    batch: int
    variant: str
    peak: float | None = None     # max_memory_allocated, bytes
    seconds: float | None = None  # median step
    limit: int | None = None      # the cap the device ran under (largest-batch runs)
    plain_seconds: float | None = None  # the plain row's median of the same run
    dtype: str = "fp32"           # every recorded H100 row ran in float32

    @property
    def key(self) -> tuple:
        return self.model, self.size, self.batch, self.variant, self.limit


def recorded_rows(results: Path = RESULTS) -> list[Recorded]:
    """Every recorded H100 row of the variants, largest-batch and host-cost JSON files."""
    rows: list[Recorded] = []
    for path in sorted(results.glob("benchmark_*_cuda_*.json")):
        data = json.loads(path.read_text())
        if "H100" not in data["machine"].get("gpu", ""):
            continue
        size = data["settings"].get("size")
        if data.get("kind") == "max_batch":
            rows += _max_batch_rows(path.name, data, size)
        elif "batch_sizes" in data["settings"]:
            plain = {r["batch_size"]: r["median_s"] for r in data["rows"]
                     if r["variant"] == "plain"}
            rows += [Recorded(path.name, data["model"] if "model" in data else _model(path),
                              size, r["batch_size"], r["variant"], r["peak_bytes"], r["median_s"],
                              plain_seconds=plain.get(r["batch_size"]))
                     for r in data["rows"]]
    for part, (model, size) in _GPU_PARTS.items():
        path = results / f"gpu_{part}_h100.md"
        if path.exists():
            rows += _gpu_md_rows(path, model, size)
    if (results / "gpu_max_batch_h100.md").exists():
        rows += _gpu_max_batch_rows(results / "gpu_max_batch_h100.md")
    host = json.loads((results / "host_cost_cuda.json").read_text())
    for w in host["workloads"]:
        plain = next(r["seconds"] for r in w["rows"] if r["variant"] == "plain")
        for r in w["rows"]:
            if r["group"] == "plain":
                rows.append(Recorded("host_cost_cuda.json", w["model"], None, w["batch_size"],
                                     _HOST_NAMES.get(r["variant"], r["variant"]),
                                     seconds=r["seconds"], plain_seconds=plain))
    return rows


def _gpu_md_rows(path: Path, model: str, size: int | None) -> list[Recorded]:
    """The rows of a ``gpu --part`` table (peaks to 3 significant digits, steps to the ms);
    compiled variants left out (their graphs do not replay under a dispatch mode)."""
    rows, plain = [], {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 9 or not cells[0].isdigit() or not cells[7].endswith(" ms") \
                or cells[1].startswith("compiled"):
            continue
        number, unit = cells[2].split()
        peak = float(number) * (2**30 if unit == "GiB" else 2**20)
        seconds = float(cells[7].split()[0]) / 1e3
        plain.setdefault(int(cells[0]), seconds if cells[1] == "plain" else None)
        rows.append(Recorded(path.name, model, size, int(cells[0]), cells[1], peak, seconds,
                             plain_seconds=plain[int(cells[0])]))
    return rows


def _gpu_max_batch_rows(path: Path) -> list[Recorded]:
    """The largest-batch rows of the GPU suite's table (model named in a bold line above)."""
    rows, model = [], None
    sizes = {m: size for m, size in _GPU_PARTS.values()}
    for line in path.read_text().splitlines():
        if line.startswith("**") and line.endswith("**"):
            model = line.strip("*")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if model and len(cells) >= 5 and cells[0].endswith(" GB") and cells[2].isdigit():
            number, unit = cells[4].split()
            rows.append(Recorded(path.name, model, sizes.get(model), int(cells[2]), cells[1],
                                 float(number) * (2**30 if unit == "GiB" else 2**20),
                                 limit=int(float(cells[0].split()[0]) * 1e9)))
    return rows


def _model(path: Path) -> str:
    return path.name.removeprefix("benchmark_").split("_cuda_")[0]


def _max_batch_rows(source: str, data: dict, size: int | None) -> Iterator[Recorded]:
    seen = set()
    for r in data["rows"]:
        for batch, peak in r["probes"].items():
            probe = int(batch) in data["settings"]["probes"]  # the same under every budget
            key = (r["variant"], int(batch), None if probe else r["budget_bytes"])
            if peak is None or key in seen:
                continue
            seen.add(key)
            if probe or int(batch) == r["largest_batch"]:
                yield Recorded(source, data["model"], size, int(batch), r["variant"], peak,
                               limit=r["budget_bytes"])


class _Predictor:
    """Runs each workload's fake step once (cached): its counter (peak, records, regions)."""

    def __init__(self, workspace: int) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.workspace = workspace
        self.variants: dict[tuple, Any] = {}
        self.counters: dict[tuple, Any] = {}

    def __call__(self, row: Recorded) -> Any:
        if row.key not in self.counters:
            v, x = self._workload(row)
            with self.mode:
                try:
                    counter = run_counted(training_step(v, x), (v.model, x), row.limit,
                                          workspace=self.workspace)
                    counter.capped_out = False
                except SimulatedOutOfMemory:  # the replay's segments outgrew the cap where
                    v.model.zero_grad(set_to_none=True)  # the card's did not: uncapped
                    counter = run_counted(training_step(v, x), (v.model, x),
                                          workspace=self.workspace)
                    counter.capped_out = True
                v.model.zero_grad(set_to_none=True)
            self.counters[row.key] = counter
        return self.counters[row.key]

    def _workload(self, row: Recorded) -> tuple[Any, torch.Tensor]:
        key = (row.model, row.variant)
        with self.mode:
            if key not in self.variants:
                torch.manual_seed(0)
                self.variants[key] = build_variant(create(row.model), row.variant, reuse=True)
                if not hasattr(self.variants[key].model, "example_input"):
                    self.variants[(row.model, "input")] = create(row.model)
            v = self.variants[key]
            maker = v.model if hasattr(v.model, "example_input") \
                else self.variants[(row.model, "input")]
            return v, maker.example_input(row.batch, row.size)


# whether a prediction was filed before its measurement (out of sample) or after it
_AFTER_PEAK = "after (nothing fitted)"
_AFTER_TIME = "after (fitted on)"


def _pct(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.1f}%"


def _memory_table(rows: list[Recorded], predict: _Predictor) -> tuple[str, list[dict]]:
    lines = ["| source | precision | filed | model | batch | variant | cap | measured | "
             "predicted | error |", "|---|---|---|---|---:|---|---|---:|---:|---:|"]
    out = []
    for r in (r for r in rows if r.peak is not None):
        c = predict(r)
        cap = f"{r.limit / 1e9:.0f} GB" + (" (replay past it)" if c.capped_out else "") \
            if r.limit else "-"
        lines.append(f"| {r.source} | {r.dtype} | {_AFTER_PEAK} | {r.model} | {r.batch} | "
                     f"{r.variant} | {cap} | "
                     f"{format_bytes(r.peak)} | {format_bytes(c.peak)} | "
                     f"{_pct(c.peak, r.peak)} |")
        out.append({**r.__dict__, "predicted_peak": c.peak, "error": c.peak / r.peak - 1,
                    "replay_past_cap": c.capped_out})
    return "\n".join(lines), out


def _host_fit(rows: list[Recorded], predict: _Predictor) -> HostCost:
    host_rows = [r for r in rows if r.source == "host_cost_cuda.json"]
    fit = [(*host_ops(predict(r).records), predict(r).regions, r.seconds) for r in host_rows]
    return fit_host(fit, f"{len(fit)} host-cost rows") if fit else H100_HOST


def _achieved_fit(rows: list[Recorded], predict: _Predictor, on: Card, host: HostCost
                  ) -> Achieved:
    """Fractions fitted over the rows whose roofline puts the device behind the host."""
    fit = []
    for r in rows:
        if r.seconds is None or r.source == "host_cost_cuda.json":
            continue
        c = predict(r)
        t = step_time(c.records, c.regions, on, host)
        if t.device >= t.host:
            fit.append((device_parts(c.records, on), r.seconds))
    return fit_achieved(fit, f"{len(fit)} device-bound rows") if fit else H100_ACHIEVED


def _time_table(rows: list[Recorded], predict: _Predictor, on: Card, host: HostCost,
                achieved: Achieved) -> tuple[str, list[dict]]:
    lines = ["| source | precision | filed | model | batch | variant | ops | regions | measured "
             "| roofline | error | device | host | predicted | error | x plain measured "
             "| x plain predicted | difference |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
             "|---:|"]
    out, plain_pred = [], {}
    timed = [r for r in rows if r.seconds is not None]
    for r in sorted(timed, key=lambda r: r.variant != "plain"):
        c = predict(r)
        pure = step_time(c.records, c.regions, on, host).step
        t = step_time(c.records, c.regions, on, host, achieved)
        if r.variant == "plain":
            plain_pred[(r.source, r.model, r.batch)] = t.step
        base = plain_pred.get((r.source, r.model, r.batch))
        ratio_m = r.seconds / r.plain_seconds if r.plain_seconds else None
        ratio_p = t.step / base if base else None
        ratio_cells = (f"{ratio_m:.2f} | {ratio_p:.2f} | {ratio_p - ratio_m:+.2f}"
                       if ratio_m and ratio_p else "- | - | -")
        lines.append(f"| {r.source} | {r.dtype} | {_AFTER_TIME} | {r.model} | {r.batch} | "
                     f"{r.variant} | {'/'.join(map(str, host_ops(c.records)))} | "
                     f"{c.regions} | {r.seconds * 1e3:.1f} ms | {pure * 1e3:.1f} ms | "
                     f"{_pct(pure, r.seconds)} | {t.device * 1e3:.1f} ms | "
                     f"{t.host * 1e3:.1f} ms | {t.step * 1e3:.1f} ms | "
                     f"{_pct(t.step, r.seconds)} | {ratio_cells} |")
        out.append({**r.__dict__, "ops": host_ops(c.records), "regions": c.regions,
                    "roofline_s": pure, "device_s": t.device, "host_s": t.host,
                    "predicted_s": t.step, "roofline_error": pure / r.seconds - 1,
                    "error": t.step / r.seconds - 1, "ratio_measured": ratio_m,
                    "ratio_predicted": ratio_p})
    return "\n".join(lines), out


def _summary(name: str, errors: list[float], limit: float) -> str:
    if not errors:
        return f"- {name}: no rows"
    worst = max(errors, key=abs)
    inside = sum(abs(e) <= limit for e in errors)
    return (f"- {name}: {inside} of {len(errors)} within +-{limit:g}; worst {worst:+.3f}, "
            f"median |error| {sorted(map(abs, errors))[len(errors) // 2]:.3f}")


def prediction(card_name: str = "h100", models: str = "", memory: bool = True,
               timing: bool = True, fit: bool = True,
               json_out: str = "docs/results/prediction_h100.json", card: str = "",
               before: bool = False) -> dict:
    """Recorded H100 rows against their prediction on this machine (no GPU): peaks and steps.

    ``card_name``: a card of zoo.memory.cards.CARDS (the rows were measured on an H100).
    ``models``: comma-separated model names to keep (default: every recorded row).
    ``fit``: fit the host's per-op and per-region cost on the host-cost rows and the achieved
    fractions of the card's peaks on the device-bound rows here (else the constants
    ``zoo.memory.cards.H100_HOST`` and ``H100_ACHIEVED``, which are what this fit printed).
    ``--card NAME --before``: instead, every row the GPU suite will measure predicted on card
    NAME with those constants frozen, written to docs/results/prediction_before_NAME.json
    (:mod:`.prediction_before`), to commit before the card runs."""
    if before:
        return file_before(card or card_name, None if json_out.endswith("_h100.json")
                           else json_out)
    if (card or card_name).lower() != "h100":  # out of sample: the before-file's card
        checked = check_before(card or card_name, RESULTS)
        print(checked["table"], flush=True)
        return checked
    start = time.perf_counter()
    on = named_card(card or card_name)
    rows = recorded_rows()
    if models:
        keep = set(comma_list(models))
        rows = [r for r in rows if r.model in keep]
    predict = _Predictor(on.workspace)
    payload: dict[str, Any] = {"command": command_line(), "machine": machine_info(
        torch.device("cpu")), "card": on.__dict__}
    text = [f"Card: {on.name}; predicted on this machine without a GPU "
            f"(torch {torch.__version__})."]
    if memory:
        table, payload["memory"] = _memory_table(rows, predict)
        errors = [m["error"] for m in payload["memory"] if m.get("error") is not None]
        text += ["", "**Peak memory** (`max_memory_allocated`)", "", table, "",
                 _summary("peak", errors, 0.03)]
    if timing:
        host = _host_fit(rows, predict) if fit else H100_HOST
        achieved = _achieved_fit(rows, predict, on, host) if fit else H100_ACHIEVED
        payload["host"], payload["achieved"] = host.__dict__, achieved.__dict__
        table, payload["time"] = _time_table(rows, predict, on, host, achieved)
        errors = [t["error"] for t in payload["time"]]
        pure = [t["roofline_error"] for t in payload["time"]]
        ratios = [t["ratio_predicted"] - t["ratio_measured"] for t in payload["time"]
                  if t["ratio_predicted"] and t["ratio_measured"] and t["variant"] != "plain"]
        text += ["", f"**Step time**. Host: {host.per_op * 1e6:.2f} us per op issued from "
                 f"Python (ops: the first figure) + {host.per_engine_op * 1e6:.2f} us per op the "
                 f"autograd engine issues (the second) + {host.per_region * 1e6:.0f} us per "
                 f"region (fitted on {host.source}). "
                 f"`roofline`: the data sheet's peaks. `device`: the peaks times the achieved "
                 f"fractions matmul {achieved.matmul:.3f}, conv {achieved.conv:.3f}, memory "
                 f"{achieved.memory:.3f} (fitted on {achieved.source}).", "",
                 table, "", _summary("step, roofline", pure, 0.15),
                 _summary("step, achieved fractions", errors, 0.15),
                 _summary("ratio to plain (difference)", ratios, 0.10)]
    payload["wall_s"] = time.perf_counter() - start
    print("\n".join(text), flush=True)
    if json_out:
        write_json(json_out, payload)
    return payload
