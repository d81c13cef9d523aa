"""``python scripts/benchmark.py reversible`` end to end on the CPU, on ResNet-20 against RevNet-38 at a
tiny batch: the JSON holds the machine, the command and the four rows, whose figures say what
the reversible model promises (its rebuilt step lighter than its stored one for one extra forward
of FLOPs, a larger batch in the budget). Not a timed test."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import cli
from bench.max_batch import PeakPredictor

pytestmark = [pytest.mark.usefixtures("one_thread"),  # small CPU steps: one thread is fastest
              pytest.mark.slow]  # two zoo.plan searches and four largest-batch searches: minutes


def test_reversible_against_the_checkpointed_floor(tmp_path: Path) -> None:
    out = tmp_path / "reversible.json"
    assert cli.main(["reversible", "--pairs", "resnet20:revnet38", "--batch", "4",
                     "--budget", "100MB", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ") and data["machine"]["torch"]
    plain, *planned, floor, stored, rebuilt = data["rows"]
    assert [r["model"] for r in data["rows"]] == ["resnet20"] * (2 + len(planned)) + \
        ["revnet38"] * 2
    for r in planned:  # at the rebuilt peak, when a schedule reaches it
        assert r["peak_bytes"] <= rebuilt["peak_bytes"] and r["variant"].startswith("zoo.plan")
    assert floor["peak_bytes"] < plain["peak_bytes"] and floor["variant"].startswith("zoo.plan")
    assert rebuilt["peak_bytes"] < stored["peak_bytes"]
    assert 0.3 < rebuilt["recompute"] < 0.34  # one more forward of the units, stem conv included
    assert rebuilt["ops"] > stored["ops"] > 0 and plain["ops"] > 0
    assert rebuilt["largest_batch"] > stored["largest_batch"] >= 1
    assert floor["largest_batch"] >= plain["largest_batch"]
    assert "Gomez" in rebuilt["anchor"]


def _largest_by_secants(peak: Callable[[int], int], budget: int) -> int:
    """The largest batch whose peak fits ``budget``, for a peak that is the largest of a few
    lines in the batch (a fake step's exact bytes): secants through the last two probes reach
    the line the answer lies on in a few probes, and two more check it on both sides."""
    probes = [64, 128]
    for _ in range(8):
        a, b = probes[-2:]
        n = b + int((budget - peak(b)) * (b - a) // (peak(b) - peak(a)))
        if n in probes:
            break
        probes.append(n)
    assert peak(n) <= budget < peak(n + 1)
    return n


@pytest.mark.parametrize("name, size, factor", [("revnet110", None, 10),
                                                ("rev_vit_small_patch16_224", 224, 4)])
def test_largest_batch_in_11gb_grows_by_the_target(name, size, factor):
    """The CPU prediction (exact peaks under FakeTensorMode, bench.max_batch) of the largest
    batch within 11 GB: rebuilt against stored."""
    predict = PeakPredictor(name, size=size, allocator="cpu")
    stored = _largest_by_secants(lambda b: predict("plain", b), int(11e9))
    rebuilt = _largest_by_secants(lambda b: predict("zoo reversible", b), int(11e9))
    assert rebuilt >= factor * stored
