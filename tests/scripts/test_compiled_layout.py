"""``python scripts/benchmark.py compiled-layout``: a compiled conv net's peak on a card, in
PyTorch's default layout and in channels-last, beside the eager step's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cli
from helpers import needs_compiled_card_step

pytestmark = [pytest.mark.slow, needs_compiled_card_step]  # a benchmark command, end to end


def test_both_layouts_are_predicted_eager_and_compiled(tmp_path: Path) -> None:
    out = tmp_path / "layout.json"
    assert cli.main(["compiled-layout", "--card", "h100", "--model", "resnet20", "--batch", "8",
                     "--modes", "block", "--dtypes", "fp32", "--json_out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["card"] == "h100" and data["command"].startswith("python ")
    contiguous, channels_last = data["rows"]
    assert (contiguous["layout"], channels_last["layout"]) == ("contiguous", "channels_last")
    for row in data["rows"]:
        assert (row["mode"], row["dtype"], row["size"]) == ("block", "fp32", 32)
        assert row["ratio"] == row["compiled_peak"] / row["eager_peak"]
        assert 0.8 < row["ratio"] < 1.2, row
    # the eager card step's bytes do not depend on the layout; the compiled one's may
    assert channels_last["eager_peak"] == contiguous["eager_peak"]


def test_an_unknown_precision_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["compiled-layout", "--dtypes", "fp8"]) == 2
    assert capsys.readouterr().err == "error: --dtypes takes fp32, bf16, got fp8\n"
