"""How long a region keeps its inputs: until the backward call that recomputes it has no more use
for them, when no later call can need the recompute again; as long as before otherwise (a kept
graph, a partial backward, nested regions, torch's reentrant checkpoint around the region)."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.checkpoint import region
from zoo.memory.step import measure_step

pytestmark = pytest.mark.skipif(not region._CAN_LET_GO,
                                reason="this torch cannot say what a backward call will run")


def exp_sin(a: torch.Tensor) -> torch.Tensor:
    return a.exp().sin()  # exp saves its output, sin its input: ``a`` itself is never saved


def region_input(fn=exp_sin, **kwargs):
    """A region whose input is held by nothing but the region, a weak reference to the input,
    and ``alive``: whether the input lived when the region's last node began its backward."""
    leaf = torch.randn(5, requires_grad=True)
    a = leaf * 2  # a multiplication by a number saves neither operand
    ref = weakref.ref(a)
    out = zoo.checkpoint(fn, a, **kwargs)
    del a
    alive: list[bool] = []
    last = out.grad_fn.next_functions[0][0]  # exp's node, after sin's (which recomputes)
    last.register_prehook(lambda grads: alive.append(ref() is not None))
    return leaf, out, ref, alive


def test_inputs_are_let_go_once_the_recompute_has_run():
    leaf, out, ref, alive = region_input()
    out.sum().backward()
    assert alive == [False] and ref() is None
    x = leaf.detach().requires_grad_()
    exp_sin(x * 2).sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)


def test_a_graph_kept_for_another_backward_keeps_the_inputs():
    """retain_graph=True: the second backward recomputes from the inputs, as before."""
    leaf, out, ref, alive = region_input()
    out.sum().backward(retain_graph=True)
    assert alive == [True] and ref() is not None
    first = leaf.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(leaf.grad, 2 * first)


def test_a_double_backward_keeps_the_inputs():
    leaf, out, ref, alive = region_input()
    g, = torch.autograd.grad(out.sum(), leaf, create_graph=True)
    assert alive == [True]
    g.sum().backward()
    x = leaf.detach().requires_grad_()
    gx, = torch.autograd.grad(exp_sin(x * 2).sum(), x, create_graph=True)
    gx.sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)


def test_a_backward_of_part_of_the_region_keeps_the_inputs():
    """autograd.grad down to an intermediate leaves exp's node unrun: the next call recomputes."""
    def two_steps(a):
        h = a.exp()
        return h, h.sin()

    leaf = torch.randn(5, requires_grad=True)
    a = leaf * 2
    ref = weakref.ref(a)
    h, out = zoo.checkpoint(two_steps, a)
    del a
    g_h, = torch.autograd.grad(out.sum(), h)
    assert ref() is not None
    h.backward(g_h)
    assert ref() is None  # this call ran the rest: let go
    x = leaf.detach().requires_grad_()
    exp_sin(x * 2).sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)


def test_an_output_left_out_of_the_loss_keeps_the_inputs():
    """A node the first backward does not reach keeps its slot, so the inputs stay for it."""
    def two_heads(a):
        return a.exp(), a.sin()

    leaf = torch.randn(5, requires_grad=True)
    a = leaf + 1  # an addition saves nothing and can run twice
    ref = weakref.ref(a)
    exp, sin = zoo.checkpoint(two_heads, a)
    del a
    exp.sum().backward()
    assert ref() is not None
    sin.sum().backward()
    assert ref() is None
    x = leaf.detach().requires_grad_()
    (x + 1).exp().sum().backward()
    (x + 1).sin().sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)


def test_nested_regions_match_plain_and_the_outer_one_lets_go():
    def inner(a):
        return a.exp().sin()

    def outer(a):
        return zoo.checkpoint(inner, a.cos()).tanh()

    leaf = torch.randn(5, requires_grad=True)
    a = leaf * 2
    ref = weakref.ref(a)
    out = zoo.checkpoint(outer, a)
    del a
    out.sum().backward()
    x = leaf.detach().requires_grad_()
    outer_plain = (x * 2).cos().exp().sin().tanh()
    outer_plain.sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)
    assert ref() is None


def test_regions_inside_torchs_reentrant_checkpoint_match_plain():
    """torch's reentrant checkpoint reruns the zoo regions and runs their backward as a nested
    backward call of its own."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    x = torch.randn(4, 6, requires_grad=True)

    def body(h):
        return zoo.checkpoint(net[2], zoo.checkpoint(net[1], zoo.checkpoint(net[0], h)))

    out = torch_checkpoint.checkpoint(body, x, use_reentrant=True)
    out.square().sum().backward()
    got = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad(set_to_none=True)
    x.grad = None
    net(x).square().sum().backward()
    for g, r in zip(got, [*(p.grad for p in net.parameters()), x.grad]):
        torch.testing.assert_close(g, r)


def test_a_recompute_after_letting_go_is_a_one_line_error():
    """A backward interrupted after the region let go cannot be run again: it says so."""
    def two_steps(a):
        h = a.exp()
        return h, h.sin()

    leaf = torch.randn(5, requires_grad=True)
    h, out = zoo.checkpoint(two_steps, leaf * 2)

    def stop(grads):
        raise ValueError("stop")

    handle = h.grad_fn.register_prehook(stop)  # exp's node: it runs after sin's recompute
    with pytest.raises(ValueError, match="stop"):
        out.sum().backward()
    handle.remove()
    with pytest.raises(RuntimeError, match="let go of its inputs") as err:
        h.sum().backward()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["bottleneck", "layer"])
def test_densenet_frees_a_new_map_once_the_next_layer_is_rebuilt(mode, monkeypatch):
    """DenseNet-40 (no bottleneck layer: both modes checkpoint concat-BN-ReLU): at the peak (the
    first block's last layer's backward) the region of that layer no longer holds the previous
    layer's new maps, so the peak falls by exactly one growth map (torch.compile with a memory
    budget frees it there too)."""
    model = zoo.create_model("densenet40", efficient=mode).train()
    x = model.example_input(2)
    peak, flops = measure_step(model, x)
    monkeypatch.setattr(region, "_CAN_LET_GO", False)
    kept, kept_flops = measure_step(model, x)
    growth_map = x.shape[0] * 12 * x.shape[2] * x.shape[3] * 4  # k=12 channels, float32
    assert kept - peak == growth_map and flops == kept_flops
