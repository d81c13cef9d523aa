"""``prediction --before``: every row the GPU suite will measure, predicted before it runs.

For each part of the suite (:mod:`.suite`), each variant, each precision (float32 and bfloat16
autocast, as ``gpu`` runs them), eager and compiled: the predicted ``max_memory_allocated`` and
step time on a named card, with the model's constants frozen (``H100_HOST``, ``H100_ACHIEVED``:
fitted on the H100 rows, never on the card predicted) and the commits that made them and the
predictions. The file is committed before the card runs; the prediction page then shows the
card's measurements beside it, out of sample. A new card's constants are refitted only in a new
before-file. Compiled variants (``torch.compile``, and with ``mode="reduce-overhead"``: CUDA graph
trees) are predicted from the graphs inductor would receive
(:func:`zoo.memory.cards.compiled_step.predict_compiled_step`), each row with the kernels it
counts; one whose graphs cannot be captured is filed with the reason instead of figures.
"""
from __future__ import annotations

import datetime
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from zoo.memory import format_bytes, predict_step
from zoo.memory.cards import H100_ACHIEVED, H100_HOST, Card, card
from zoo.memory.cards.compiled_step import H100_LAUNCH, predict_compiled_step

from .max_batch import CardPredictor, search_largest_batch
from .region_chain import CHECKPOINTS, REGIONS, WIDTH, chain_input, make_chain
from .measure import one_line
from .report import command_line, machine_info, write_json
from .suite import AUTOCAST, DTYPES, PARTS, _label, workloads
from .variants import COMPILED_PREFIX, GRAPHED_PREFIX, build_variant, create

__all__ = ["before_rows", "file_before", "before_table"]

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 11 * 10**9  # the max_batch part's


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _step(model: torch.nn.Module, x: torch.Tensor, on: Card, dtype: str,
          run_as: str = "eager") -> dict[str, Any]:
    """The predicted figures of one row: ``run_as`` ``eager``, ``compiled`` (inductor) or
    ``reduce-overhead`` (CUDA graph trees); a compiled step whose graphs cannot be captured
    is the row's reason."""
    model.train()
    if run_as == "eager":
        s = predict_step(model, x, on, autocast=AUTOCAST[dtype])
        extra = {}
    else:
        try:
            s = predict_compiled_step(model, x, on, autocast=AUTOCAST[dtype],
                                      graphs=run_as == "reduce-overhead")
        except Exception as error:  # noqa: BLE001 - filed as the row's reason
            return {"why": f"not predicted: {one_line(error)}"}
        extra = {"predicted_kernels": list(s.kernels)}
    return {"predicted_peak_bytes": s.peak, "predicted_device_s": s.time.device,
            "predicted_host_s": s.time.host, "predicted_link_s": s.time.link,
            "predicted_s": s.time.step, **extra}


def _overhead_rows(part: str, on: Card, dtype: str) -> list[dict]:
    modes = ("eager", "compiled") if part == "overhead" else ("eager", "reduce-overhead")
    rows = []
    for checkpoint in CHECKPOINTS:
        x = chain_input("conv", requires_grad=True)
        chain = make_chain(REGIONS, WIDTH, checkpoint)
        for mode in modes:
            rows.append({"checkpoint": checkpoint, "run_as": mode, "batch_size": 1,
                         **_step(chain, x, on, dtype, mode)})
    return rows


def _benchmark_rows(part: str, on: Card, dtype: str) -> list[dict]:
    rows = []
    for w in workloads(False)[part]:
        torch.manual_seed(0)
        model = create(w.model, **w.kwargs)
        for batch in w.batches:
            x = model.example_input(batch, w.size)
            for name in w.names(model):
                row = {"model": _label(w.model), "size": w.size, "batch_size": batch,
                       "variant": name}
                v = build_variant(model, name)  # a compiled one: its model in its mode
                v.prepare()
                run_as = "reduce-overhead" if name.startswith(GRAPHED_PREFIX) else \
                    "compiled" if name.startswith(COMPILED_PREFIX) else "eager"
                rows.append(dict(row, **_step(v.model, x, on, dtype, run_as)))
    return rows


def _max_batch_rows(on: Card, dtype: str) -> list[dict]:
    rows = []
    for w in workloads(False)["max_batch"]:
        with torch.device("meta"):
            names = w.names(create(w.model, **w.kwargs))
        predictor = CardPredictor(w.model, BUDGET, on, w.size, autocast=AUTOCAST[dtype],
                                  **w.kwargs)
        for name in names:
            b, seen = search_largest_batch(lambda n, v=name: predictor.peak(v, n), BUDGET)
            step = predictor(name, b) if b else None
            rows.append({"model": _label(w.model), "variant": name, "budget_bytes": BUDGET,
                         "largest_batch": b, "predicted_peak_bytes": seen.get(b),
                         "predicted_s": step.time.step if step else None})
    return rows


def before_rows(on: Card, dtypes: tuple[str, ...] = DTYPES) -> list[dict]:
    """Every row of every part of the GPU suite on card ``on``, predicted (module docstring)."""
    rows = []
    for part in PARTS:
        for dtype in dtypes:
            if part.startswith("overhead"):
                these = _overhead_rows(part, on, dtype)
            elif part == "max_batch":
                these = _max_batch_rows(on, dtype)
            else:
                these = _benchmark_rows(part, on, dtype)
            rows += [{"part": part, "dtype": dtype, **r} for r in these]
            print(f"{part} {dtype}: {len(these)} rows", flush=True)
    return rows


def file_before(card_name: str, json_out: str | None = None) -> dict:
    """Predict every GPU-suite row on ``card_name`` and write the before-file
    (``docs/results/prediction_before_<card>.json`` unless ``json_out``)."""
    start = time.perf_counter()
    on = card(card_name)
    timing = "zoo/memory/cards/timing.py"
    payload: dict[str, Any] = {
        "kind": "prediction_before", "card": on.__dict__, "command": command_line(),
        "machine": machine_info(torch.device("cpu")), "date": datetime.date.today().isoformat(),
        "code_commit": _git("rev-parse", "HEAD"),
        "code_dirty": bool(_git("status", "--porcelain", "--", "zoo", "scripts")),
        "constants": {"host": H100_HOST.__dict__, "achieved": H100_ACHIEVED.__dict__,
                      "launch": H100_LAUNCH},
        "constants_commit": _git("log", "-1", "--format=%H", "-G",
                                 r"H100_(HOST|ACHIEVED|LAUNCH) = ", "--", timing,
                                 "zoo/memory/cards/compiled_step.py", "zoo/memory/cards.py"),
        "out_of_sample": True,
    }
    payload["rows"] = before_rows(on)
    payload["wall_s"] = time.perf_counter() - start
    path = json_out or f"docs/results/prediction_before_{card_name.lower()}.json"
    write_json(path, payload)
    print(f"{before_table(payload, Path(path).name)}\n\nwrote {path}: {len(payload['rows'])} "
          f"rows in {payload['wall_s']:.0f} s")
    return payload


def before_table(payload: dict, source: str) -> str:
    """The filed rows of the benchmark and largest-batch parts as the prediction page shows
    them (the overhead chains stay in the JSON)."""
    lines = ["| source | precision | filed | part | variant | batch | predicted peak | "
             "predicted step (device / host; + the wait on offload copies) |",
             "|---|---|---|---|---|---:|---:|---:|"]
    for r in payload["rows"]:
        if r["part"].startswith("overhead"):
            continue
        batch = r.get("batch_size", r.get("largest_batch"))
        part = r["part"] + (f" ({r['model']}, largest batch in 11 GB)"
                            if r["part"] == "max_batch" else "")
        head = f"| {source} | {r['dtype']} | before | {part} | {r['variant']} | {batch} |"
        if "why" in r:
            lines.append(f"{head} not predicted | not predicted |")
            continue
        step = f"{r['predicted_s'] * 1e3:.1f} ms"
        if "predicted_device_s" in r:
            link = r.get("predicted_link_s") or 0.0
            wait = f" + {link * 1e3:.1f}" if link else ""
            step += (f" ({r['predicted_device_s'] * 1e3:.1f}{wait} / "
                     f"{r['predicted_host_s'] * 1e3:.1f})")
        lines.append(f"{head} {format_bytes(r['predicted_peak_bytes'])} | {step} |")
    return "\n".join(lines)
