"""The ``variants``, ``max-batch``, ``segments``, ``plot`` and ``gpu`` subcommands of
``python scripts/benchmark.py`` and the bench pieces under them: end to end on the CPU, on the zoo's
CIFAR CNN (few ops, so MemTracker and FakeTensorMode stay fast) at tiny batches.

Not timed tests: they check that every figure is there and consistent (JSON fields, ratios against
plain, exact BatchNorm statistics for the zoo and not for torch's checkpoint), that the CPU's
max-batch answer is right against real measurements, that the segments sweep shows torch leaving
its last segment unchecked, that ``plot`` draws, and that ``gpu --smoke`` writes every part.
"""
from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

import zoo
from bench import cli
from bench.max_batch import PeakPredictor, search_largest_batch
from bench.measure import measure_or_report, one_line, training_step
from bench.report import benchmark_table
from bench.runs import parse_budgets, run_benchmark, run_max_batch, run_segments
from bench.variants import Variant, build_variant, canonical_name
from zoo.memory import cpu_peak_bytes
from zoo.models.densenet import DenseNet

pytestmark = pytest.mark.slow  # a benchmark command's code, end to end: the whole suite's lane

MODEL = "cifar_cnn"
EFFICIENT = "zoo halves"
VARIANTS = ("plain", "official", EFFICIENT)


def bench(*args: str) -> None:
    """``python scripts/benchmark.py ARGS`` in this process; it must succeed."""
    assert cli.main(list(args)) == 0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def benchmark_json(results: Path) -> Path:
    out = results / "benchmark_cifar_cnn_cpu_b2.json"
    # command-line spelling of the variants: zoo_halves (or halves) for "zoo halves"
    bench("variants", "--model", MODEL, "--batch_size", "2", "--variants",
          "plain,official,zoo_halves", "--repeats", "2", "--warmup", "0", "--out", str(out))
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
    # the zoo's checkpoint is the plain model; torch's updates BatchNorm twice
    # (pytorch/pytorch#96136)
    assert rows[EFFICIENT]["bn_stats_error"] == 0 and rows[EFFICIENT]["bn_count_error"] == 0
    assert rows["official"]["bn_count_error"] == 1
    assert rows[EFFICIENT]["grad_error"] < 1e-5


def test_cpu_max_batch_fits_and_next_does_not() -> None:
    """The search on predicted (FakeTensorMode) peaks agrees with real MemTracker peaks."""
    budget = 40 * 2**20
    predictor = PeakPredictor(MODEL, allocator="cpu")
    batch, seen = search_largest_batch(lambda b: predictor(EFFICIENT, b), budget, probes=(2, 4))
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


def test_cpu_prediction_in_autocast_is_the_bf16_step_cuda_runs() -> None:
    """Inside autocast (the GPU suite's bf16 max_batch part) the prediction beside a measured
    batch is the bf16 step with CUDA's op lists and no cast cache, not the float32 one."""
    predictor = PeakPredictor(MODEL)
    fp32 = predictor(EFFICIENT, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = predictor(EFFICIENT, 64)
    assert bf16 < fp32 and predictor(EFFICIENT, 64) == fp32  # cached apart


@pytest.fixture(scope="module")
def max_batch_payload(results: Path) -> dict:
    """Predicted largest batches under two budgets, as the CUDA allocator would count."""
    out = results / "benchmark_cifar_cnn_cpu_maxbatch.json"
    bench("max-batch", "--model", MODEL, "--memory_budget", f"{30 * 2**20},{40 * 2**20}",
          "--variants", f"plain,{EFFICIENT}", "--out", str(out))
    return json.loads(out.read_text())


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
    out = tmp_path / "segments.json"
    bench("segments", "--model", MODEL, "--batch_size", "1", "--segments", "1,2", "--repeats",
          "1", "--warmup", "0", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["kind"] == "segments" and data["settings"]["batch_size"] == 1
    rows = {(r["impl"], r["segments"]): r for r in data["rows"]}
    assert set(rows) == {(None, 0), ("torch", 1), ("torch", 2), ("zoo", 1), ("zoo", 2)}
    # one segment: torch checkpoints nothing (its last segment never is), the zoo the whole chain
    assert rows[("torch", 1)]["recompute_overhead"] == 0
    assert rows[("torch", 1)]["peak_ratio"] >= 0.99
    assert rows[("zoo", 1)]["recompute_overhead"] > 0
    # one block per segment: the zoo also recomputes the last block, torch does not
    assert rows[("zoo", 2)]["recompute_overhead"] > rows[("torch", 2)]["recompute_overhead"] > 0
    assert all("median_s" in r for r in rows.values())


def test_plot_writes_pngs(benchmark_json: Path, max_batch_payload: dict, tmp_path: Path,
                          capsys: pytest.CaptureFixture) -> None:
    shutil.copy(benchmark_json, tmp_path)
    (tmp_path / "benchmark_max.json").write_text(json.dumps(max_batch_payload))
    fake = run_benchmark(MODEL, [1, 2], fake=True, variants=["plain"])
    (tmp_path / "benchmark_fake.json").write_text(json.dumps(fake))
    (tmp_path / "other.json").write_text("{}")  # not a benchmark_*.json: left alone
    capsys.readouterr()
    bench("plot", "--results", str(tmp_path), "--out", str(tmp_path / "img"))
    written = [Path(line) for line in capsys.readouterr().out.split()]
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


def test_timm_twin_is_the_same_network() -> None:
    """The ``timm`` variant is timm's DenseNet with the zoo model's architecture and weights."""
    torch.manual_seed(0)
    model = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, stem="cifar",
                     num_classes=10).eval()
    twin = build_variant(model, "timm").model.eval()
    assert type(twin).__module__.startswith("timm")
    x = model.example_input(2)
    with torch.no_grad():
        assert torch.allclose(model(x), twin(x), atol=1e-6)
    assert canonical_name(model, "compiled_layer") == "compiled zoo layer"
    assert canonical_name(model, "compiled_zoo_layer") == "compiled zoo layer"


def test_failing_variant_is_a_row_not_a_crash() -> None:
    """measure_or_report: a variant whose step raises gets ``status: failed`` and a one-line
    error; the others are measured as without it."""
    torch.manual_seed(0)
    model = zoo.create_model(MODEL)
    plain, efficient = build_variant(model, "plain"), build_variant(model, EFFICIENT)
    broken = Variant("wrong input", model, False, "three channels cut to one",
                     forward=lambda x: model(x[:, :1]))
    rows = measure_or_report([plain, broken, efficient], model.example_input(2), repeats=2,
                             warmup=0)
    assert [r["variant"] for r in rows] == ["plain", "wrong input", EFFICIENT]
    assert rows[1]["status"] == "failed" and rows[1]["error"].startswith("RuntimeError: ")
    assert "\n" not in rows[1]["error"] and "peak_bytes" not in rows[1]
    assert rows[2]["status"] == "ok" and rows[2]["peak_bytes"] < rows[0]["peak_bytes"]
    assert rows[2]["bn_count_error"] == 0 and rows[0]["time_ratio"] == 1.0
    assert "| 2 | wrong input | failed: RuntimeError: " in benchmark_table(rows)


def test_a_failure_names_its_cause_and_logs_its_traceback(
        capsys: pytest.CaptureFixture) -> None:
    """A compile error's first line only introduces its cause ("backend='inductor' raised:"):
    the row's one line carries the cause too, and the whole traceback goes to stderr."""
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        try:
            raise NotImplementedError("no lowering for aten.fancy_op")
        except NotImplementedError as inner:
            frame = ("first_useful_frame" in  # a third argument in newer torch
                     inspect.signature(BackendCompilerFailed.__init__).parameters)
            raise BackendCompilerFailed(lambda *a: None, inner, *[None] * frame) from inner
    except BackendCompilerFailed as e:
        line = one_line(e)
    assert line.startswith("BackendCompilerFailed: ")
    assert "NotImplementedError: no lowering for aten.fancy_op" in line and "\n" not in line
    err = capsys.readouterr().err
    assert "Traceback" in err and "aten.fancy_op" in err
    assert one_line(ValueError("bad\nmore"), log=False) == "ValueError: bad"
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_gpu_smoke_writes_every_part(tmp_path: Path) -> None:
    """``gpu --smoke --dtype both``: every part of the GPU command runs on the CPU with tiny
    sizes, in float32 and bfloat16 autocast, and writes its JSON (machine, command, rows,
    goals) and Markdown; the command succeeds only with no failed row, no exactness error and
    every row in both precisions (bench.suite_check)."""
    threads = torch.get_num_threads()
    try:
        bench("gpu", "--smoke", "--dtype", "both", "--out_dir", str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    parts = ("overhead", "overhead_graphs", "densenet_b64", "densenet_b256", "resnet50", "bert",
             "max_batch")
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        f"gpu_{p}_smoke_cpu.json" for p in parts)
    data = {p: json.loads((tmp_path / f"gpu_{p}_smoke_cpu.json").read_text()) for p in parts}
    for part, d in data.items():
        assert d["part"] == part and d["settings"]["smoke"] and d["rows"] and d["goals"]
        assert d["machine"]["torch"] == torch.__version__ and d["command"].startswith("python ")
        assert all({"goal", "value", "limit", "met"} <= set(g) for g in d["goals"])
        md = (tmp_path / f"gpu_{part}_smoke_cpu.md").read_text()
        assert f"torch {torch.__version__}" in md and d["command"] in md
    for d in data.values():
        assert d["problems"] == [] and all(r.get("status", "ok") == "ok" for r in d["rows"])
        assert [r for r in d["rows"] if r["dtype"] == "fp32"] and \
            len([r for r in d["rows"] if r["dtype"] == "bf16"]) == len(d["rows"]) // 2
        assert "#### bf16 (bfloat16 autocast)" in (tmp_path / f"gpu_{d['part']}_smoke_cpu.md"
                                                   ).read_text()
    bf16 = {r["variant"]: r for r in data["densenet_b64"]["rows"] if r["dtype"] == "bf16"}
    dense = {r["variant"]: r for r in data["densenet_b64"]["rows"] if r["dtype"] == "fp32"}
    assert list(dense) == list(bf16) == ["plain", "zoo bottleneck", "compiled plain",
                                         "compiled zoo bottleneck", "graphed zoo bottleneck",
                                         "official", "timm", "offload"]
    assert bf16["plain"]["peak_bytes"] < dense["plain"]["peak_bytes"]
    assert dense["offload"]["grad_error"] == dense["offload"]["bn_stats_error"] == 0
    for name, r in dense.items():  # on the CPU a compiled step has no exact peak
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
        assert (r["peak_bytes"] is None) == name.startswith(("compiled", "graphed"))
        assert name.startswith(("compiled", "graphed")) or r["peak_bytes"] > 0
    assert dense["zoo bottleneck"]["bn_count_error"] == 0
    assert dense["official"]["bn_count_error"] == dense["timm"]["bn_count_error"] == 1
    assert dense["zoo bottleneck"]["peak_bytes"] < dense["timm"]["peak_bytes"]
    bert = {r["variant"]: r for r in data["bert"]["rows"]}
    assert bert["zoo block"]["activation_bytes"] < bert["plain"]["activation_bytes"]
    assert {r["variant"] for r in data["resnet50"]["rows"]} >= {"plain", "official"}
    biggest = [r for r in data["max_batch"]["rows"] if r["dtype"] == "fp32"]
    assert [r["variant"] for r in biggest] == ["plain", "zoo bottleneck", "plain", "zoo block"]
    assert all(r["largest_batch"] >= 1 and r["batch_ratio"] >= 1 for r in biggest)
    runs = {(r["checkpoint"], r["run_as"]) for r in data["overhead"]["rows"]}
    assert ("zoo.checkpoint", "compiled") in runs and ("none", "eager") in runs


def test_variant_failing_after_its_first_step_is_found_apart() -> None:
    """A variant that breaks only later (as a compiled one can on recompiling) is found by
    measuring each variant beside plain alone; the others keep their figures."""
    torch.manual_seed(0)
    model = zoo.create_model(MODEL)
    calls = []

    def second_call_breaks(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return model(x if len(calls) == 1 else x[:, :1])

    variants = [build_variant(model, "plain"),
                Variant("breaks later", model, False, "wrong input from its 2nd step on",
                        forward=second_call_breaks),
                build_variant(model, EFFICIENT)]
    rows = measure_or_report(variants, model.example_input(2), repeats=2, warmup=0)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert rows[1]["error"].startswith("RuntimeError: ") and "first_step_s" not in rows[1]
    assert rows[2]["measured_apart"] and rows[2]["peak_bytes"] < rows[0]["peak_bytes"]
    assert rows[0]["time_ratio"] == 1.0 and rows[2]["time_ratio"] > 0
