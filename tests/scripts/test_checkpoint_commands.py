"""The ``checkpoint``, ``overhead`` and ``primitive`` subcommands end to end on the CPU (tiny runs).

Not timed tests: they check the figures each subcommand reports are there and say what the
benchmarks claim (same bytes and FLOPs as torch's non-reentrant checkpoint, exact BatchNorm
statistics for the zoo and a double count for torch), and that swapping the primitive is undone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import zoo
from bench import cli

pytestmark = pytest.mark.slow  # a benchmark command's code, end to end: the whole suite's lane


def bench(*args: object) -> None:
    """``python scripts/benchmark.py ARGS`` in this process; it must succeed."""
    assert cli.main([str(a) for a in args]) == 0


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_checkpoint_on_a_tiny_chain(tmp_path: Path, keep_threads) -> None:
    out = tmp_path / "tiny.json"
    bench("checkpoint", "--blocks", 4, "--width", 8, "--batch_size", 2, "--size", 8, "--threads",
          1, "--steps", 2, "--repeats", 2, "--warmup", 0, "--json_out", out)
    assert torch.get_num_threads() == 1
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    plain, torch_nr, ours = rows["no checkpoint"], rows["torch non-reentrant"], rows["zoo.checkpoint"]
    assert ours["peak_bytes"] == torch_nr["peak_bytes"] < plain["peak_bytes"]
    assert ours["flops"] == torch_nr["flops"] > plain["flops"]
    assert plain["num_batches_tracked"] == ours["num_batches_tracked"] == 2
    assert torch_nr["num_batches_tracked"] == 4 and torch_nr["bn_stats_error"] > 0
    assert ours["bn_stats_error"] == 0
    assert all(r["median_s"] > 0 and r["time_iqr_ratio"][0] <= r["time_iqr_ratio"][1]
               for r in rows.values())


def test_primitive_swaps_and_restores(tmp_path: Path, keep_threads) -> None:
    out = tmp_path / "primitive.json"
    bench("primitive", "--model", "resnet20", "--batch_size", 2, "--repeats", 2, "--warmup", 0,
          "--json_out", out)
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["command"].startswith("python ") and data["machine"]["torch"] == torch.__version__
    assert [r["variant"] for r in rows] == ["plain", "torch non-reentrant", "zoo.checkpoint"]
    assert rows[0]["ratio"] == 1.0 and all(r["median_s"] > 0 for r in rows)
    # cp_BatchNorm2d keeps the zoo's ResNet exact under torch's checkpoint too
    assert [r["num_batches_tracked_after_one_step"] for r in rows] == [1, 1, 1]
    assert rows[0]["iqr_ratio"][0] <= 1.0 <= rows[0]["iqr_ratio"][1]
    assert sys.modules["zoo.models.resnet"].checkpoint is zoo.checkpoint


def test_overhead_reports_every_combination(tmp_path: Path, keep_threads) -> None:
    """``overhead``: every checkpoint eager and compiled; a combination that cannot compile
    today is a failed row with a one-line reason, not a crash; BatchNorm counted once where
    exact."""
    out = tmp_path / "overhead.json"
    bench("overhead", "--regions", 3, "--repeats", 2, "--warmup", 0, "--backend", "aot_eager",
          "--json_out", out)
    data = json.loads(out.read_text())
    assert data["kind"] == "overhead" and data["settings"]["regions"] == 3
    rows = data["rows"]
    got = {(r["checkpoint"], r["run_as"]): r for r in rows}
    assert set(got) == {(c, m) for c in ("none", "torch non-reentrant", "torch reentrant",
                                         "zoo.checkpoint") for m in ("eager", "compiled")}
    eager_none = got[("none", "eager")]
    assert eager_none["ratio_to_eager_none"] == 1.0 and eager_none["extra_us_per_region"] == 0
    # eager: the zoo counts BatchNorm once, torch's checkpoint twice (pytorch/pytorch#96136)
    assert got[("zoo.checkpoint", "eager")]["bn_count_after_one_step"] == 1
    assert got[("torch non-reentrant", "eager")]["bn_count_after_one_step"] == 2
    assert got[("none", "compiled")]["status"] == "ok", got[("none", "compiled")]  # torch.compile itself works here
    for r in rows:
        if r["status"] == "failed":
            assert r["run_as"] == "compiled" and "\n" not in r["error"] and r["error"]
            assert "median_s" not in r
        else:
            assert r["error"] is None and len(r["times_s"]) == 2
            none = got[("none", r["run_as"])]["median_s"]
            assert r["extra_us_per_region"] == pytest.approx((r["median_s"] - none) / 3 * 1e6)
