"""PyTorch's TestCheckpoint (test/test_utils.py), ported to zoo.checkpoint and
zoo.checkpoint_sequential, called as torch's are (torch's argument order, use_reentrant=False).

Each test names its original; the code is zoo's own. Deliberate differences are pinned: zoo's
checkpoint_sequential checkpoints the last segment too (skip_last=True gives torch's), and
zoo's region never needs an input that requires grad.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

import zoo
from helpers import TensorsAlive


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                         nn.Linear(20, 5), nn.ReLU())


def check_sequential(model: nn.Module, to_compare: list, chunks: int, x: torch.Tensor) -> None:
    """TestCheckpoint._check_checkpoint_sequential: outputs, input and parameter gradients of
    checkpoint_sequential over each of ``to_compare`` equal the plain model's."""
    out = model(x)
    model.zero_grad()
    out.sum().backward()
    ref_out, ref_x = out.detach(), x.grad.clone()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for blocks in to_compare:
        detached = x.detach().requires_grad_()
        out = zoo.checkpoint_sequential(blocks, chunks, detached, use_reentrant=False)
        model.zero_grad()
        out.sum().backward()
        torch.testing.assert_close(out.detach(), ref_out)
        torch.testing.assert_close(detached.grad, ref_x)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref[n])


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = 0

    def forward(self, x):
        self.counter += 1
        return x * torch.tensor(2.0)


def test_checkpoint_trigger():
    """test_checkpoint_trigger, deliberate difference: torch runs the blocks of its last segment
    once (never checkpointed); zoo recomputes every segment, the last included (torch's
    checkpoint_sequential never checkpoints its last segment), and
    skip_last=True gives torch's counts."""
    for skip_last, last_runs in ((False, 2), (True, 1)):
        modules = [Counted() for _ in range(10)]
        x = torch.randn(3, 4, requires_grad=True)
        out = zoo.checkpoint_sequential(modules, 2, x, use_reentrant=False)
        if skip_last:
            for m in modules:
                m.counter = 0
            out = zoo.checkpoint_sequential(modules, x, 2, skip_last=True)
        assert [m.counter for m in modules] == [1] * 10
        out.sum().backward()
        assert [m.counter for m in modules] == [2] * 5 + [last_runs] * 5


def test_checkpoint_valid():
    """test_checkpoint_valid (its non-reentrant half): autograd.grad with create_graph=True
    through checkpoint_sequential gives the plain gradients."""
    model = mlp()
    x = torch.randn(1, 100, requires_grad=True)
    out = model(x)
    ref = torch.autograd.grad([out], [x], [torch.ones(1, 5)], create_graph=True)
    got_out = zoo.checkpoint_sequential(list(model.children()), 2, x, use_reentrant=False)
    torch.testing.assert_close(got_out, out)
    got = torch.autograd.grad([got_out], [x], [torch.ones(1, 5)], create_graph=True)
    torch.testing.assert_close(got, ref)


def test_checkpoint():
    """test_checkpoint: checkpoint_sequential of an nn.Sequential and of its list of children."""
    model = mlp()
    check_sequential(model, [list(model.children()), model], 2,
                     torch.randn(1, 100, requires_grad=True))


def test_checkpoint_module_list():
    """test_checkpoint_module_list: the same through an nn.ModuleList."""
    class ModuleListNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.module_list = nn.ModuleList(mlp().children())

        def forward(self, x):
            for layer in self.module_list:
                x = layer(x)
            return x

    model = ModuleListNet()
    check_sequential(model, [list(model.module_list.children()), model.module_list], 2,
                     torch.randn(1, 100, requires_grad=True))


def test_checkpoint_sequential_deprecated_multiple_args():
    """test_checkpoint_sequential_deprecated_multiple_args: one input only (a TypeError)."""
    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    a, b = torch.randn(1, 100, requires_grad=True), torch.randn(1, 100, requires_grad=True)
    with pytest.raises(TypeError):
        zoo.checkpoint_sequential(nn.Sequential(Two()), 1, a, b)


def test_checkpoint_sequential_deprecated_no_args():
    """test_checkpoint_sequential_deprecated_no_args: blocks take one input (a TypeError)."""
    class Noop(nn.Module):
        def forward(self):
            pass

    with pytest.raises(TypeError):
        zoo.checkpoint_sequential(nn.Sequential(Noop()), 1)


def test_checkpoint_rng_cpu():
    """test_checkpoint_rng_cpu: dropout inside the region replays the forward's mask, so the
    input gradient equals the plain run's, whatever ran before."""
    for _ in range(3):
        inp = torch.randn(2000).requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = torch.get_rng_state()
        zoo.checkpoint(phase2, phase1(inp), use_reentrant=False).sum().backward()
        got, inp.grad = inp.grad, None
        torch.set_rng_state(state)
        phase2(phase1(inp)).sum().backward()
        torch.testing.assert_close(got, inp.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_rng_cuda():
    """test_checkpoint_rng_cuda: the same on a CUDA device."""
    for _ in range(3):
        inp = torch.randn(2000, device="cuda").requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = torch.cuda.get_rng_state()
        zoo.checkpoint(phase2, phase1(inp), use_reentrant=False).sum().backward()
        got, inp.grad = inp.grad, None
        torch.cuda.set_rng_state(state)
        phase2(phase1(inp)).sum().backward()
        torch.testing.assert_close(got, inp.grad)


def test_checkpoint_not_preserve_rng_state_and_without_reentrant():
    """test_checkpoint_not_preserve_rng_state_and_without_reentrant, on the CPU and with the
    meaning checked: preserve_rng_state=False runs, replays nothing (the recompute draws a new
    dropout mask) and, like torch, leaves the random stream advanced by the recompute."""
    torch.manual_seed(0)
    inp = torch.randn(2000).requires_grad_()
    out = zoo.checkpoint(nn.Dropout(), inp, use_reentrant=False, preserve_rng_state=False)
    after_forward = torch.get_rng_state()
    out.sum().backward()
    assert not torch.equal(torch.get_rng_state(), after_forward)
    assert not torch.equal(inp.grad != 0, out != 0)  # the gradient's mask is not the output's

    torch.manual_seed(0)
    inp.grad = None
    out = zoo.checkpoint(nn.Dropout(), inp, use_reentrant=False)
    after_forward = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)
    assert torch.equal(inp.grad != 0, out != 0)


def test_checkpoint_non_tensor():
    """test_checkpoint_non_tensor: None among the inputs."""
    x = torch.randn(1, 100, requires_grad=True)
    out = zoo.checkpoint(lambda a, b: a if b is None else a + b, x, None, use_reentrant=False)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(1, 100))


def foo(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_checkpoint_non_tensor_inputs_outputs():
    """test_checkpoint_non_tensor_inputs_outputs: non-tensor inputs and outputs, three partial
    backward calls, then the freed-graph error of a fourth, and the plain gradients."""
    t1, t2 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True)
    t3, scale = torch.rand(10), 7
    res = zoo.checkpoint(foo, t1, t2, scale, t3, use_reentrant=False)
    assert (res[0], res[2], res[3], res[5]) == (scale, None, True, "bar")
    torch.testing.assert_close(res[1], (t1 + t2 * t3) * scale)
    torch.testing.assert_close(res[4], (t1 * t2 + t3) * scale)
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    got = t1.grad.clone(), t2.grad.clone()
    t1.grad = t2.grad = None
    res = foo(t1, t2, scale, t3)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    torch.testing.assert_close(got, (t1.grad, t2.grad))


def test_checkpoint_no_tensors():
    """test_checkpoint_no_tensors: a region with no tensor at all just runs."""
    assert zoo.checkpoint(foo, 0.5, 0.25, 3, 2.0, use_reentrant=False) == \
        (3, (0.5 + 0.25 * 2.0) * 3, None, True, (0.5 * 0.25 + 2.0) * 3, "bar", 0.5)


def test_checkpoint_partial_grad():
    """test_checkpoint_partial_grad, deliberate difference: torch's reentrant checkpoint raises
    when the output does not require grad through the inputs that do; zoo's region just works
    (an output that needs no grad, an input that needs none, a parameter gradient still reached)."""
    x, x2 = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = zoo.checkpoint(lambda a, b: (a, b), x, x2, use_reentrant=True)
    out[0].sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(1, 4))

    lin = nn.Linear(4, 4)
    out = zoo.checkpoint(lambda a, b: lin(a), torch.randn(1, 4),
                         torch.randn(1, 4, requires_grad=True), use_reentrant=True)
    out.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("retain_graph", [False, True])
def test_checkpointing_without_reentrant_early_free(retain_graph):
    """test_checkpointing_without_reentrant_early_free, on the CPU: the original watches CUDA
    memory at each step of a chain's backward; here the recompute's tensors are watched through
    weak references (context_fn's recompute context). Each backward step frees one recomputed
    tensor, with and without retain_graph=True (recomputed tensors are never retained)."""
    alive, counts = TensorsAlive(), []

    def fn(x):
        for _ in range(3):
            x = x ** 2
            x.register_hook(lambda grad: counts.append(alive.alive()))
        return (x ** 2).sum()

    x = torch.rand(10, requires_grad=True)
    out = zoo.checkpoint(fn, x, use_reentrant=False,
                         context_fn=lambda: (torch.enable_grad(), alive))
    out.backward(retain_graph=retain_graph)
    assert len(counts) == 3
    assert counts[0] > counts[1] > counts[2]
    assert alive.alive() == 0
