"""``bench.planner_vs_compile.compare`` (``python scripts/benchmark.py planner-vs-compile``) on
small models: torch's compiled step under ``activation_memory_budget`` beside zoo's plans, every
field the benchmark prints, the fake run equal to the CPU run, and ``--fake`` refused where the
meta device's ops are not the CPU's."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from helpers import needs_plans_for_compile, tiny_cnn
from zoo.memory.compiled import check_meta_like_cpu
from zoo.models.vit import VisionTransformer

from bench.planner_vs_compile import compare, markdown

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


@needs_plans_for_compile
def test_compare_reports_both_sides() -> None:
    result = compare(tiny_cnn, batch=4, fractions=(1.0, 0.3), size=16)
    first, second = result["rows"]
    assert first["torch_recompute_flops"] == 0
    assert second["torch_recompute_flops"] > 0
    for row in result["rows"]:
        assert set(row) >= {"fraction", "torch_peak_bytes", "torch_recompute_flops",
                            "zoo_peak_bytes", "zoo_recompute_flops", "zoo_plan"}
        if row["zoo_peak_bytes"] is not None:  # zoo's plan meets torch's peak as its budget
            assert row["zoo_peak_bytes"] <= row["torch_peak_bytes"]
    assert result["zoo_least"]["peak_bytes"] <= result["plain_peak_bytes"]
    for row in [*result["rows"], result["zoo_least"]]:  # the compile-safe plan, compiled
        if row["zoo_c_peak_bytes"] is not None:
            assert row["zoo_compiled_peak_bytes"] > 0  # measured; kept or not: the verdict
            assert row["zoo_compiled_recompute_flops"] is not None
    verdict = result["verdict"]
    assert verdict["least_below_torch"] == (result["zoo_least"]["peak_bytes"]
                                            < result["torch_least"]["torch_peak_bytes"])
    assert verdict["compiled_keeps_plan"] == (verdict["compiled_not_kept"] == [])
    assert verdict["every_fraction"] == (verdict["missed_fractions"] == [])
    assert "| tiny_cnn (4) | 0.3 |" in markdown([result])


def small_bert() -> nn.Module:
    """BERT at a width where activations outweigh the parameters (post-norm, dropout on)."""
    torch.manual_seed(0)
    return zoo.create_model("bert_base", vocab_size=512, max_positions=64, embed_dim=64,
                            depth=2, num_heads=4)


@pytest.mark.slow
@needs_plans_for_compile
def test_fake_compare_is_the_cpu_compare() -> None:
    """``compare(..., fake=True)`` (torch's compiled steps, and zoo's compile-safe plans compiled,
    on the meta device: no kernel) gives every figure the CPU run gives, to the byte and FLOP, on
    a small BERT whose regions hold dropout, at a budget where torch recomputes."""
    runs = [compare(small_bert, batch=4, fractions=(0.5,), fake=fake, size=32)
            for fake in (True, False)]
    for run in runs:
        run.pop("plan_seconds")
    assert runs[0].pop("fake") is True and runs[1].pop("fake") is False
    assert runs[0] == runs[1]
    assert all(row["torch_recompute_flops"] > 0 for row in runs[0]["rows"])
    assert runs[0]["rows"][0]["torch_peak_bytes"] < runs[0]["plain_peak_bytes"]
    assert runs[0]["zoo_least"]["zoo_compiled_peak_bytes"] is not None  # compiled, dropout in it


def test_fake_refuses_a_model_whose_meta_ops_are_not_the_cpus() -> None:
    """A ViT without attention dropout runs SDPA's fused CPU kernel on the CPU and its math path
    on the meta device, so ``--fake`` would not give the CPU's figures: refused in one line; a
    BERT (attention dropout: the math path on both) and a CNN are measured."""
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4,
                            num_classes=10)
    with pytest.raises(ValueError, match="--fake cannot measure VisionTransformer.*flash"):
        compare(lambda: vit, batch=2, fractions=(1.0,), fake=True, compiled=False)
    check_meta_like_cpu(small_bert(), torch.randint(0, 512, (2, 16)))
    check_meta_like_cpu(zoo.create_model("resnet20"), torch.randn(2, 3, 32, 32))
