"""A card's measured GPU-suite rows beside the predictions filed before it ran: matched per part,
precision, model, batch and variant, errors and ratios to plain out of sample; the committed
H200 before-file holds every part in both precisions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.prediction_before import _step
from bench.prediction_check import check_before
from bench.suite import PARTS
from zoo.memory.cards import card

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _row(variant: str, dtype: str, seconds: float, peak: int) -> dict:
    return {"model": "densenet_bc_100", "batch_size": 64, "variant": variant, "dtype": dtype,
            "status": "ok", "median_s": seconds, "peak_bytes": peak}


def test_measured_rows_meet_their_filed_predictions(tmp_path: Path):
    before = {"code_commit": "abc", "rows": [
        {"part": "densenet_b64", "dtype": d, "model": "densenet_bc_100", "batch_size": 64,
         "variant": v, "predicted_s": s, "predicted_peak_bytes": b}
        for d in ("fp32", "bf16") for v, s, b in (("plain", 0.040, 2 << 30),
                                                  ("zoo bottleneck", 0.060, 1 << 29))]}
    (tmp_path / "prediction_before_h200.json").write_text(json.dumps(before))
    measured = {"part": "densenet_b64", "rows": [_row("plain", "bf16", 0.050, 2 << 30),
                                                 _row("zoo bottleneck", "bf16", 0.100, 1 << 30)]}
    (tmp_path / "gpu_densenet_b64_h200.json").write_text(json.dumps(measured))
    out = check_before("h200", tmp_path)
    zoo = next(r for r in out["rows"] if r["variant"] == "zoo bottleneck")
    assert [r["dtype"] for r in out["rows"]] == ["bf16", "bf16"]
    assert zoo["ratio_measured"] == pytest.approx(2.0) and zoo["ratio_predicted"] == 1.5
    assert "| bf16 | before (out of sample) | densenet_b64 |" in out["table"]
    assert "| -50.0% |" in out["table"] and "| -0.50 |" in out["table"]


def test_no_measured_row_yet_says_so_and_no_before_file_is_one_line(tmp_path: Path):
    (tmp_path / "prediction_before_h200.json").write_text(
        json.dumps({"code_commit": "0123456789abcdef", "rows": [{}]}))
    assert check_before("h200", tmp_path)["table"].startswith("No measured row of the h200")
    with pytest.raises(ValueError, match="prediction --card l4 --before"):
        check_before("l4", tmp_path)


def test_the_h200_before_file_holds_every_part_in_both_precisions():
    data = json.loads((RESULTS / "prediction_before_h200.json").read_text())
    parts = {(r["part"], r["dtype"]) for r in data["rows"]}
    assert parts == {(p, d) for p in PARTS for d in ("fp32", "bf16")}
    assert data["card"]["name"].startswith("NVIDIA H200") and data["out_of_sample"]
    assert len(data["code_commit"]) == len(data["constants_commit"]) == 40
    assert all(r["predicted_s"] > 0 and r["predicted_peak_bytes"] > 0 for r in data["rows"]
               if "largest_batch" not in r)
    compiled = [r for r in data["rows"] if r.get("run_as", "eager") != "eager"
                or r.get("variant", "").startswith(("compiled", "graphed"))]
    assert {r.get("variant") for r in compiled} >= {
        "compiled plain", "compiled zoo bottleneck", "graphed zoo bottleneck"}
    assert all(sum(r["predicted_kernels"]) > 0 for r in compiled)


def test_a_compiled_row_that_cannot_be_captured_is_filed_with_its_reason():
    frozen = nn.Linear(4, 4).requires_grad_(False)  # no backward graph to capture
    row = _step(frozen, torch.randn(2, 4), card("h200"), "fp32", "compiled")
    assert list(row) == ["why"] and row["why"].startswith("not predicted: ")
    assert "\n" not in row["why"]
