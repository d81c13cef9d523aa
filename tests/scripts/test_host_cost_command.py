"""``python scripts/benchmark.py host-cost`` end to end at its smallest: one small zoo model with its
peer, ops and floor only (times are the benchmark's to print, not a test's to check)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_host_cost_writes_every_variant_with_its_floor(tmp_path: Path) -> None:
    out, md = tmp_path / "h.json", tmp_path / "h.md"
    assert cli.main(["host-cost", "--models", "cifar_cnn:2", "--nochain", "--nooutside",
                     "--notimes", "--json_out", str(out), "--markdown_out", str(md)]) == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ") and data["machine"]["torch"] == torch.__version__
    (workload,) = data["workloads"]
    rows = {r["variant"]: r for r in workload["rows"]}
    assert {"plain", "zoo halves", "zoo block", "zoo bn_relu", "torch checkpoint"} <= set(rows)
    for name, row in rows.items():
        assert row["ops"] >= row["dispatched"] > 0
        if name.startswith("zoo "):  # nothing beyond the recompute; a region nested in
            # another hands its inputs to the outer one through one no-op Function (one op)
            nested = 2 if name == "zoo nested" else 0
            assert row["dispatched"] == row["floor_dispatched"] + nested and row["regions"] > 0
    assert "| zoo halves |" in md.read_text()
