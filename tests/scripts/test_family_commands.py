"""The ``densenet``, ``resnet``, ``transformers``, ``autocast`` and ``outside`` subcommands end to
end on the CPU at their smallest sizes: every workload and variant is a row with exact bytes and
FLOPs, the zoo's plain model and timm's are the same network (same FLOPs), checkpointing lowers
the peak, a zoo model's bf16 step peaks no higher than timm's, and outside models count BatchNorm
once under zoo.set_grad_checkpointing.

The models are the benchmarks' own (DenseNet-121, ResNet-50, ViT-S/16, BERT-base, ...), so even
at batch 2 on small images MemTracker's bookkeeping takes tens of seconds: marked slow."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def bench(out: Path, *args: object) -> list[dict]:
    """``python scripts/benchmark.py ARGS --json_out OUT`` in this process; the rows it wrote."""
    assert cli.main([str(a) for a in (*args, "--json_out", out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"].startswith("python ") and data["torch"] == torch.__version__
    return data["rows"]


def _by(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["workload"].split()[0], r["variant"]): r for r in rows}


def test_densenet(tmp_path: Path) -> None:
    rows = _by(bench(tmp_path / "d.json", "densenet", "--cifar_batch", 2, "--imagenet_batch", 2,
                     "--imagenet_size", 64, "--fake"))
    assert {v for w, v in rows if w == "densenet_bc_100"} == {"plain", "bottleneck", "layer"}
    assert rows[("densenet121", "timm plain")]["flops"] == rows[("densenet121", "plain")]["flops"]
    assert rows[("densenet_bc_100", "bottleneck")]["flop_ratio"] <= 1.02
    assert rows[("densenet_bc_100", "layer")]["peak_ratio"] < 0.5
    assert all(r["peak_bytes"] > 0 and r["flops"] > 0 for r in rows.values())


def test_resnet(tmp_path: Path) -> None:
    rows = _by(bench(tmp_path / "r.json", "resnet", "--cifar_batch", 2, "--imagenet_batch", 2,
                     "--imagenet_size", 64, "--fake"))
    assert ("resnet110", "block, checkpoint_every=2") in rows and ("cifar_cnn", "halves") in rows
    assert rows[("resnet50", "timm plain")]["flops"] == rows[("resnet50", "plain")]["flops"]
    assert rows[("resnet50", "halves")]["peak_ratio"] < 1.0
    assert rows[("resnet110", "halves")]["peak_ratio"] < 1.0
    assert all(r["flop_ratio"] >= 1.0 for r in rows.values())


def test_transformers(tmp_path: Path) -> None:
    rows = _by(bench(tmp_path / "t.json", "transformers", "--vit_batch", 1, "--vit_size", 32,
                     "--bert_batch", 1, "--bert_tokens", 8, "--gpt2_batch", 1, "--gpt2_tokens", 8))
    assert {w for w, _ in rows} == {"vit_small_patch16_224", "bert_base", "gpt2_small"}
    assert {"plain", "block", "selective"} <= {v for w, v in rows if w == "bert_base"}
    assert ("vit_small_patch16_224", "timm set_grad_checkpointing") in rows
    assert all(r["peak_bytes"] > 0 and r["flop_ratio"] >= 1.0 for r in rows.values())


def test_autocast(tmp_path: Path) -> None:
    rows = bench(tmp_path / "a.json", "autocast", "--batch", 1, "--tokens", 8)
    zoo_timm = {(r["gradients"], r["variant"]): r for r in rows if "timm_peak_bytes" in r}
    assert set(zoo_timm) == {(g, v) for g in ("fresh", "accumulating") for v in ("plain", "block")}
    assert all(r["zoo_peak_bytes"] <= r["timm_peak_bytes"] for r in zoo_timm.values())
    # held gradients put the peak at the forward's end, where timm's regions hold their casts
    assert zoo_timm["accumulating", "block"]["ratio"] < 0.9
    own = {(r["workload"].split()[0], r["gradients"]): r for r in rows if "own_peak_bytes" in r}
    assert set(own) == {(f, g) for f in ("timm", "HF") for g in ("fresh", "accumulating")}
    for r in own.values():  # zoo's route holds the casts as torch's does, until casts_once
        assert r["casts_once_peak_bytes"] <= r["zoo_peak_bytes"] == r["own_peak_bytes"]
    assert own["timm", "accumulating"]["ratio"] < 0.9 and own["HF", "accumulating"]["ratio"] < 0.95


def test_outside(tmp_path: Path) -> None:
    rows = bench(tmp_path / "o.json", "outside", "--batch_size", 2, "--size", 64,
                 "--tokens", 8)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    assert [w.split()[0] + " " + w.split()[1] for w in workloads] == [
        "torchvision resnet50", "torchvision densenet121", "timm resnet50",
        "timm efficientnet_b0", "timm vit_small_patch16_224", "HF BERT-base"]
    for w in workloads:
        got = {r["variant"]: r for r in rows if r["workload"] == w}
        assert got["zoo.set_grad_checkpointing"]["peak_ratio"] <= 1.0
        assert got["zoo.set_grad_checkpointing"]["bn_counts"] == got["plain"]["bn_counts"] <= 1
    theirs = {r["workload"].split()[1]: r["bn_counts"] for r in rows
              if r["variant"].startswith("own switch")}
    assert theirs["resnet50"] == theirs["efficientnet_b0"] == 2  # torch's checkpoint: twice
