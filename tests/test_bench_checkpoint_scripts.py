"""scripts/bench_checkpoint.py and scripts/bench_primitive.py end to end on the CPU (tiny runs).

Not timed tests: they check the figures each script reports are there and say what the
benchmarks claim (same bytes and FLOPs as torch's non-reentrant checkpoint, exact BatchNorm
statistics for the zoo and a double count for torch), and that swapping the primitive is undone.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import zoo

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_checkpoint_tiny_chain(tmp_path: Path, keep_threads) -> None:
    out = tmp_path / "tiny.json"
    _script("bench_checkpoint").main(blocks=4, width=8, batch_size=2, size=8, threads=1, steps=2,
                                     repeats=2, warmup=0, json_out=str(out))
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


def test_bench_primitive_swaps_and_restores(tmp_path: Path, keep_threads) -> None:
    out = tmp_path / "primitive.json"
    rows = _script("bench_primitive").main(model="resnet20", batch_size=2, repeats=2, warmup=0,
                                           json_out=str(out))
    assert [r["variant"] for r in rows] == ["plain", "torch non-reentrant", "zoo.checkpoint"]
    assert rows[0]["ratio"] == 1.0 and all(r["median_s"] > 0 for r in rows)
    # cp_BatchNorm2d keeps the zoo's ResNet exact under torch's checkpoint too
    assert [r["num_batches_tracked_after_one_step"] for r in rows] == [1, 1, 1]
    assert json.loads(out.read_text())["rows"] == rows
    assert sys.modules["zoo.models.resnet"].checkpoint is zoo.checkpoint
