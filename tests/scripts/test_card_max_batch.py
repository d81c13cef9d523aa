"""``max-batch`` for a named CUDA card, predicted on a machine without one: the batch found fits
under the card's capped caching allocator and the next one does not (exact, by the same
predictor as ``zoo.memory.predict_step``), and each batch comes with its predicted
samples/s on the card. The zoo's CIFAR CNN at a budget of a few batches keeps it quick."""
from __future__ import annotations

import pytest
import torch

import zoo
from bench import cli
from bench.max_batch import CardPredictor
from bench.plots import plot_max_batch
from bench.runs import run_max_batch
from bench.variants import build_variant
from zoo.memory import predict_step
from zoo.memory.cards.allocator import SimulatedOutOfMemory

pytestmark = pytest.mark.slow  # a benchmark command's code, end to end: the whole suite's lane

MODEL = "cifar_cnn"
EFFICIENT = "zoo halves"
BUDGET = 110 * 10**6  # two cuBLAS workspaces (64 MiB) and the model leave room for ~10 images


def card_step(variant: str, batch: int) -> object:
    """One step of a fresh ``variant`` at ``batch`` on an H100 capped at BUDGET."""
    torch.manual_seed(0)
    model = zoo.create_model(MODEL)
    v = build_variant(model, variant)
    v.prepare()
    return predict_step(v.model.train(), model.example_input(batch), "h100", limit=BUDGET)


@pytest.fixture(scope="module")
def payload() -> dict:
    return run_max_batch(MODEL, [BUDGET], card="h100",
                         variants=["plain", EFFICIENT, "offload"], probes=(2, 4))


def test_card_largest_batch_fits_and_the_next_does_not(payload: dict) -> None:
    assert payload["settings"]["card"] == "NVIDIA H100 SXM5 80GB"
    for r in payload["rows"]:
        b = r["largest_batch"]
        assert b >= 1 and r["probes"][str(b + 1)] is None and r["next_peak_bytes"] is None
        fits = card_step(r["variant"], b)
        assert fits.peak == r["peak_bytes"] <= BUDGET
        with pytest.raises(SimulatedOutOfMemory):
            card_step(r["variant"], b + 1)
        assert r["step_s"] == fits.time.step
        assert r["samples_per_s"] == pytest.approx(b / fits.time.step)


def test_checkpointing_fits_at_least_plain_batch(payload: dict) -> None:
    plain, efficient, _ = payload["rows"]
    assert efficient["largest_batch"] >= plain["largest_batch"]
    assert efficient["batch_ratio"] == efficient["largest_batch"] / plain["largest_batch"]


def test_command_prints_samples_per_second(capsys: pytest.CaptureFixture, tmp_path) -> None:
    out = tmp_path / "card.json"
    assert cli.main(["max-batch", "--model", MODEL, "--memory_budget", str(BUDGET), "--variants",
                     "plain", "--card", "h100", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "samples/s (predicted)" in printed and "NVIDIA H100 SXM5 80GB, card model" in printed
    assert out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="--device cuda measures where a GPU is")
def test_device_cuda_without_a_gpu_predicts_an_h100() -> None:
    data = run_max_batch(MODEL, [BUDGET], device="cuda", variants=["plain"], probes=(2, 4))
    assert data["settings"]["card"] == "NVIDIA H100 SXM5 80GB"
    assert data["machine"]["device"] == "cpu" and "gpu" not in data["machine"]


def test_clear_errors_for_the_card() -> None:
    with pytest.raises(ValueError, match="exceeds the NVIDIA L4's 24 GB"):
        CardPredictor(MODEL, 30 * 10**9, "l4")
    with pytest.raises(ValueError, match="unknown card 'h101'"):
        CardPredictor(MODEL, BUDGET, "h101")


def test_card_plot_does_not_overwrite_the_cpu_prediction(payload: dict, tmp_path) -> None:
    cpu = {**payload, "settings": {k: v for k, v in payload["settings"].items() if k != "card"}}
    written = plot_max_batch([cpu, payload], tmp_path)
    assert [p.name for p in written] == ["cifar_cnn_cpu_max_batch.png",
                                         "cifar_cnn_cpu_card_max_batch.png"]


def test_offload_fits_more_on_the_card_and_is_refused_without_one(payload: dict) -> None:
    rows = {r["variant"]: r for r in payload["rows"]}
    assert rows["offload"]["largest_batch"] > rows["plain"]["largest_batch"]
    with pytest.raises(ValueError, match="--card h100"):
        run_max_batch(MODEL, [BUDGET], variants=["plain", "offload"], probes=(2, 4))
