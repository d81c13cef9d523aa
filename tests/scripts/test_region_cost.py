"""The region-cost command's counters: real calls counted, per region, with the RNG state saved
in every region and only where a region draws random numbers (as the zoo's models call their
regions). Times are printed by the command, never tested."""
from __future__ import annotations

import json

import pytest
import torch

from bench.region_cost import cuda_calls, python_calls, region_cost, \
    rng_saved_per_region
from zoo.checkpoint import keywords
from zoo.memory import train_step
from zoo.memory.host import recorded_regions, rng_state_calls
from zoo.models.densenet import DenseNet


def tiny_step():
    torch.manual_seed(0)
    model = DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=4,
                     num_classes=5, stem="cifar", efficient=True)
    step = train_step(model, model.example_input(2))
    step()
    return step


def test_a_densenet_region_saving_rng_makes_four_cpu_and_seven_cuda_calls_else_none():
    step = tiny_step()
    regions = len(recorded_regions(step))
    assert regions == 2 * 4 + 1 + 1  # two halves per layer, the transition, the final BN-ReLU
    assert rng_state_calls(step) == {} and cuda_calls(step) == {}
    with rng_saved_per_region():
        saved_rng, saved_cuda = rng_state_calls(step), cuda_calls(step)
    # forward: read the CPU state; recompute: read it, set the forward's, put it back
    assert saved_rng == {"torch.get_rng_state": 2 * regions, "torch.set_rng_state": 2 * regions}
    # with CUDA initialised: is CUDA up (twice), which device, then the same on that device
    assert saved_cuda == {"is_initialized": 2 * regions, "current_device": regions,
                          "get_rng_state": 2 * regions, "set_rng_state": 2 * regions}
    assert keywords.NO_RNG is not keywords.DEFAULT and not keywords.NO_RNG.preserve_rng
    with rng_saved_per_region():
        before = python_calls(step)
    assert python_calls(step) < before


@pytest.mark.slow  # a few ResNet-20 steps, counted and timed
def test_command_prints_per_region_counts_and_writes_json(tmp_path, capsys):
    out = tmp_path / "region.json"
    results = region_cost("resnet20:2", repeats=1, warmup=0, json_out=str(out))
    text = capsys.readouterr().out
    assert results["command"] in text and "### resnet20, batch 2, 9 regions" in text
    rows = {r["variant"]: r for r in results["workloads"][0]["rows"]}
    every, drawn = "tapered, RNG saved in every region", "tapered, RNG saved where drawn"
    assert set(rows) == {"plain", every, drawn}
    assert rows[drawn]["rng_calls"] == {} and rows[drawn]["cuda_calls"] == {}
    assert sum(rows[every]["rng_calls"].values()) == 4 * 9
    assert json.loads(out.read_text())["workloads"][0]["regions"] == 9
    assert set(results["bookkeeping_us"]) == {"RNG saved in every region", "RNG saved where drawn"}
