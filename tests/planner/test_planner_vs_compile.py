"""zoo.memory.compiled on a tiny conv-bn-relu model (the benchmark built on it, in
tests/scripts/test_planner_vs_compile_compare.py).

The compiled step (inductor's partitioner under ``activation_memory_budget``, graphs interpreted
op by op) must be the plain model's step: same FLOPs and gradients at budget 1.0, BatchNorm
statistics updated once; a small budget must trade memory for recompute.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import tiny_cnn as tiny
from zoo.memory import count_flops, cpu_peak_bytes, default_loss
from zoo.memory.compiled import compile_step, default_solver, measure_compiled

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


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
