"""scripts/benchmark.py and zoo.bench: end to end on the CPU, on seed 004's CIFAR CNN (few ops,
so MemTracker and FakeTensorMode stay fast) at tiny batches.

Not timed tests: they check that every figure is there and consistent (JSON fields, ratios against
plain, exact BatchNorm statistics for the zoo and not for torch's checkpoint), that the CPU's
max-batch answer is right against real measurements, that the segments sweep shows seed 000's
effect, and that plot.py draws.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import zoo
from zoo.bench.max_batch import PeakPredictor, largest_batch
from zoo.bench.measure import training_step
from zoo.bench.plots import plot_all
from zoo.bench.runs import parse_budgets, run_benchmark, run_max_batch, run_segments
from zoo.bench.variants import build_variant
from zoo.memory import cpu_peak_bytes
from zoo.models.densenet import DenseNet

ROOT = Path(__file__).resolve().parents[1]
MODEL = "cifar_cnn"
EFFICIENT = "zoo halves"
VARIANTS = ("plain", "official", EFFICIENT)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def benchmark_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("results") / "benchmark_cifar_cnn_cpu_b2.json"
    # command-line spelling of the variants: zoo_halves (or halves) for "zoo halves"
    _script("benchmark").main(model=MODEL, batch_size=2, variants="plain,official,zoo_halves",
                              repeats=2, warmup=0, out=str(out))
    return out


def test_benchmark_writes_json_with_every_figure(benchmark_json: Path) -> None:
    data = json.loads(benchmark_json.read_text())
    assert data["kind"] == "benchmark" and data["model"] == MODEL
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["cpu_count"] >= 1
    assert data["command"].startswith("python ")  # here pytest's command line
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == list(VARIANTS)
    for r in rows.values():
        for key in ("peak_bytes", "peak_ratio", "flops", "recompute_overhead", "median_s",
                    "time_ratio", "images_per_s", "bn_stats_error", "bn_count_error",
                    "grad_error", "batch_size", "description"):
            assert key in r, key
        assert len(r["times_s"]) == 2 and r["images_per_s"] > 0
    assert rows["plain"]["peak_ratio"] == 1.0 and rows["plain"]["time_ratio"] == 1.0
    assert rows[EFFICIENT]["peak_bytes"] < rows["plain"]["peak_bytes"]
    # the zoo's checkpoint is the plain model; torch's updates BatchNorm twice (#96136)
    assert rows[EFFICIENT]["bn_stats_error"] == 0 and rows[EFFICIENT]["bn_count_error"] == 0
    assert rows["official"]["bn_count_error"] == 1
    assert rows[EFFICIENT]["grad_error"] < 1e-5


def test_cpu_max_batch_fits_and_next_does_not() -> None:
    """The search on predicted (FakeTensorMode) peaks agrees with real MemTracker peaks."""
    budget = 40 * 2**20
    predictor = PeakPredictor(MODEL, allocator="cpu")
    batch, seen = largest_batch(lambda b: predictor(EFFICIENT, b), budget, probes=(2, 4))
    assert batch >= 2 and seen[batch] <= budget < seen[batch + 1]
    torch.manual_seed(0)
    model = zoo.create_model(MODEL)
    variant = build_variant(model, EFFICIENT)
    real = []
    for b in (batch, batch + 1):
        x = model.example_input(b)
        real.append(cpu_peak_bytes(training_step(variant, x), track=(model, x)))
    assert real[0] <= budget < real[1]
    assert real == [seen[batch], seen[batch + 1]]  # the prediction is exact, byte for byte


@pytest.fixture(scope="module")
def max_batch_payload() -> dict:
    """Predicted largest batches under two budgets, as the CUDA allocator would count."""
    return run_max_batch(MODEL, [30 * 2**20, 40 * 2**20], variants=["plain", EFFICIENT],
                         allocator="cuda", probes=(2, 4))


def test_max_batch_payload_and_cuda_rounding(max_batch_payload: dict) -> None:
    rows = max_batch_payload["rows"]
    assert [(r["budget"], r["variant"]) for r in rows] == [
        ("31.5 MB", "plain"), ("31.5 MB", EFFICIENT), ("41.9 MB", "plain"), ("41.9 MB", EFFICIENT)]
    for r in rows:
        assert r["largest_batch"] >= 1
        assert r["peak_bytes"] <= r["budget_bytes"] < r["next_peak_bytes"]
        assert r["peak_bytes"] % 512 == 0  # 512-byte CUDA allocator blocks
    assert rows[1]["largest_batch"] >= rows[0]["largest_batch"] and rows[1]["batch_ratio"] >= 1


def test_segments_sweep_shows_torch_skipping_the_last_segment(tmp_path: Path) -> None:
    data = run_segments(MODEL, 1, segments=[1, 2], repeats=1, warmup=0)
    rows = {(r["impl"], r["segments"]): r for r in data["rows"]}
    assert set(rows) == {(None, 0), ("torch", 1), ("torch", 2), ("zoo", 1), ("zoo", 2)}
    # one segment: torch checkpoints nothing (its last segment never is), the zoo the whole chain
    assert rows[("torch", 1)]["recompute_overhead"] == 0
    assert rows[("torch", 1)]["peak_ratio"] >= 0.99
    assert rows[("zoo", 1)]["recompute_overhead"] > 0
    # one block per segment: the zoo also recomputes the last block, torch does not
    assert rows[("zoo", 2)]["recompute_overhead"] > rows[("torch", 2)]["recompute_overhead"] > 0
    assert all("median_s" in r for r in rows.values())


def test_plot_writes_pngs(benchmark_json: Path, max_batch_payload: dict, tmp_path: Path) -> None:
    (tmp_path / "benchmark_max.json").write_text(json.dumps(max_batch_payload))
    fake = run_benchmark(MODEL, [1, 2], fake=True, variants=["plain"])
    (tmp_path / "benchmark_fake.json").write_text(json.dumps(fake))
    paths = [benchmark_json, tmp_path / "benchmark_max.json", tmp_path / "benchmark_fake.json"]
    written = plot_all(paths, tmp_path / "img")
    names = {p.name for p in written}
    assert {"cifar_cnn_cpu_max_batch.png", "cifar_cnn_cpu_peak_vs_batch.png",
            "cifar_cnn_cpu_b2_tradeoff.png"} <= names
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


@pytest.mark.parametrize("name", ["tiny DenseNet-BC", "cifar_cnn"])
def test_official_variant_is_the_same_network(name: str) -> None:
    """The official column runs the same function with the same weights: torchvision's
    memory-efficient DenseNet for DenseNet-B, torch's checkpoint over the chain otherwise."""
    torch.manual_seed(0)
    if name == "cifar_cnn":
        model = zoo.create_model(name).eval()
    else:  # DenseNet-BC-100's layout, shrunk: CIFAR stem, bottlenecks, compression
        model = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, stem="cifar",
                         num_classes=10).eval()
    official = build_variant(model, "official")
    if name != "cifar_cnn":
        assert type(official.model).__module__.startswith("torchvision")
    x = model.example_input(2)
    with torch.no_grad():
        assert torch.equal(model(x), official.model.eval()(x))


def test_clear_errors() -> None:
    with pytest.raises(ValueError, match="cannot read '11 gigs'"):
        parse_budgets("11 gigs")
    assert parse_budgets("11GB,12GB") == [11 * 10**9, 12 * 10**9]
    with pytest.raises(ValueError, match="unknown variant"):
        build_variant(zoo.create_model(MODEL), "zoo nothing")
    with pytest.raises(zoo.models.UnknownModelError, match="densenet40"):
        run_max_batch("densenet41", [10**9])
    with pytest.raises(ValueError, match="chain model|segments must be"):
        run_segments(MODEL, 1, segments=[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_max_batch_is_a_real_out_of_memory_safe_search() -> None:
    """On a device capped at the budget: the batch found ran, the next one ran out of memory (or
    exceeded the budget), the device is usable afterwards, and the CPU prediction is beside it."""
    budget = 200 * 2**20
    data = run_max_batch(MODEL, [budget], device="cuda", variants=["plain", EFFICIENT],
                         probes=(2, 4), max_batch=4096)
    for r in data["rows"]:
        assert 1 <= r["largest_batch"] < 4096 and r["peak_bytes"] <= budget
        nxt = r["probes"][str(r["largest_batch"] + 1)]
        assert nxt is None or nxt > budget  # None: out of memory
        assert abs(r["prediction_error"]) < 0.5
    assert data["rows"][1]["largest_batch"] >= data["rows"][0]["largest_batch"]
    torch.ones(2**20, device="cuda").sum().item()  # the cap is lifted, the device still works
    assert torch.cuda.memory_allocated() < budget
