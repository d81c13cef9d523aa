"""``python scripts/benchmark.py card-plan``: plans for a card made here, predicted on the card."""
from __future__ import annotations

import pytest

import json
from pathlib import Path

from bench import cli

pytestmark = pytest.mark.slow  # a benchmark command's code, end to end: the whole suite's lane


def test_card_plan_rows_keep_the_budget_on_the_card(tmp_path: Path) -> None:
    out = tmp_path / "card_plan.json"
    assert cli.main(["card-plan", "--workloads", "resnet20:64", "--fractions", "0.6",
                     "--json_out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["card"] == "h100" and data["command"].startswith("python ")
    plain, *plans = data["rows"]
    assert plain["plan"] == "plain, predicted"  # no H100 record of resnet20 at batch 64
    assert [p["plan"] for p in plans] == ["for the CPU's kernels", "for the card",
                                         "for the card, cost='time'"]
    for p in plans[1:]:
        assert p["card_peak"] <= p["budget"] == int(0.6 * plain["card_peak"])
        assert abs(p["card_peak"] - p["predicted_peak"]) <= 0.03 * p["card_peak"]
        assert p["ratio"] > 1.0  # resnet20's planned chain is its plain chain, recomputed
    # the CPU's step has no cuBLAS workspaces: its plan fits there and not on the card
    cpu = plans[0]
    assert cpu["predicted_peak"] <= cpu["budget"] < cpu["card_peak"]
