"""zoo.memory.compiled and bench.planner_vs_compile on a tiny conv-bn-relu model.

The compiled step (inductor's partitioner under ``activation_memory_budget``, graphs interpreted
op by op) must be the plain model's step: same FLOPs and gradients at budget 1.0, BatchNorm
statistics updated once; a small budget must trade memory for recompute; the comparison must
report every field the benchmark prints.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from zoo.memory.compiled import (check_meta_like_cpu, compile_step, default_solver,
                                     measure_compiled)
from bench.planner_vs_compile import compare, markdown
from zoo.memory import count_flops, cpu_peak_bytes
from zoo.models.vit import VisionTransformer
from zoo.planner import default_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny() -> nn.Sequential:
    """conv-bn-relu twice, pooled into a linear head: activations outweigh the parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def eager_step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    default_loss(model(x)).backward()


def test_budget_one_is_the_plain_step() -> None:
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    plain, model = tiny().double().train(), tiny().double()
    step = compile_step(model, x, 1.0, default_loss)  # one step: compiles
    eager_step(plain, x)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(plain.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, a, msg=name)  # running stats updated once
    assert count_flops(step) == count_flops(lambda: eager_step(plain, x))
    eager = cpu_peak_bytes(lambda: eager_step(plain, x), track=(plain,))
    compiled = cpu_peak_bytes(step, track=(model,))
    # the running statistics are written in place, as eager and inductor write them
    assert compiled == eager
    assert step.counts == {"forward": 3, "backward": 3, "graphs": 1}


def test_small_budget_trades_memory_for_recompute() -> None:
    x = torch.randn(4, 3, 16, 16)
    full = measure_compiled(tiny(), x, 1.0, default_loss)
    small = measure_compiled(tiny(), x, 0.3, default_loss)
    assert small["peak_bytes"] < full["peak_bytes"]
    assert small["flops"] > full["flops"]
    assert full["solver"] == default_solver() == "dp"


def test_budget_outside_zero_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        compile_step(tiny(), torch.randn(1, 3, 8, 8), 1.5, default_loss)


def test_compare_reports_both_sides() -> None:
    result = compare(tiny, batch=4, fractions=(1.0, 0.3), size=16)
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
    assert "| tiny (4) | 0.3 |" in markdown([result])


def small_bert() -> nn.Module:
    """BERT at a width where activations outweigh the parameters (post-norm, dropout on)."""
    torch.manual_seed(0)
    return zoo.create_model("bert_base", vocab_size=512, max_positions=64, embed_dim=64,
                            depth=2, num_heads=4)


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


def test_inductor_keeps_no_running_statistics_for_the_backward() -> None:
    """What the replay does to a BatchNorm step is what inductor's own graphs do: with
    inductor's decompositions, the new running statistics copied into the buffers are not among
    what the forward graph hands to the backward (its BatchNorm backward does not read them in
    training), so a measurement that keeps them holds bytes an inductor step does not."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def forward(gm: torch.fx.GraphModule, _example: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _example: gm,
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table(),
                           keep_inference_input_mutations=True)
    model = tiny().train()
    torch._dynamo.reset()
    step = torch.compile(lambda inp: default_loss(model(inp)), backend=backend, fullgraph=True)
    step(torch.randn(2, 3, 8, 8)).backward()
    (gm,) = graphs
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default
              and n.args[0].op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    saved = set(output.args[0][1:])  # the loss, then what the backward takes
    assert len(copies) == 6  # mean, variance and batch count of each BatchNorm
    assert not saved & {n.args[1] for n in copies}


@pytest.mark.parametrize("read_view_later", [False, True])
def test_input_updates_move_to_where_they_are_made_unless_read_later(read_view_later) -> None:
    """The replay writes an input's new value as soon as it is made, as inductor does, but not
    while the old value (or a view of it) is still to be read: the step computes the same."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from zoo.memory.compiled import _mutations_in_place

    aten = torch.ops.aten

    def step(p: torch.Tensor) -> torch.Tensor:
        old = aten.view.default(p, [-1])
        new = aten.add.Tensor(p, 1)
        out = aten.mul.Tensor(old if read_view_later else new, 2)
        aten.copy_.default(p, new)
        return out

    gm = make_fx(step)(torch.zeros(2, 2))
    _mutations_in_place(gm)
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    moved = order.index(aten.copy_.default) == order.index(aten.add.Tensor) + 1
    assert moved is not read_view_later
    p, q = torch.arange(4.0).view(2, 2), torch.arange(4.0).view(2, 2)
    torch.testing.assert_close(gm(p), step(q))
    torch.testing.assert_close(p, q)
