"""Selective recompute (``save_ops``) in the zoo's own region: the named ops' outputs are kept
from the forward and served to the recompute, which runs only the rest; exact against the plain
model, no heavier than torch's selective checkpoint, with errors that say what went wrong."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.memory.host import COPY, OpCounter

MM = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 16),
                         nn.Tanh())


def test_recompute_runs_no_named_op_and_no_op_of_its_own():
    """The backward of a selective region dispatches the plain backward plus the recompute of
    what is not kept: no matmul is rerun, and no detach is dispatched to keep or serve one."""
    net, x = mlp(), torch.randn(4, 16, requires_grad=True)
    with OpCounter() as plain:
        net(x).sum().backward()
    net.zero_grad(set_to_none=True)
    x.grad = None
    with OpCounter() as mine:
        zoo.checkpoint(net, x, save_ops=MM).sum().backward()
    extra = mine.ops - plain.ops
    extra.pop(COPY, None)  # autograd's C++ copies of saved tensors, not dispatched
    assert "aten.addmm.default" not in extra and "aten.detach.default" not in extra
    # rerun: t, gelu, empty_like, bernoulli_, div_, mul, t, tanh (up to the last saved tensor)
    assert sum(extra.values()) == 8, dict(extra)


def test_gradients_and_dropout_match_plain_and_double_backward_is_a_clear_error():
    """First-order gradients (also with create_graph=True) are the plain model's bit for bit;
    a second backward through the region would need the kept outputs a second time, which only
    one recompute gets (as with torch's selective checkpoint), and says so."""
    net, x = mlp(), torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(1)
    ref = net(x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x, create_graph=True)
    torch.manual_seed(1)
    out = zoo.checkpoint(net, x, save_ops=MM)
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="recomputed a second time"):
        torch.autograd.grad(g.sum(), [x, *net.parameters()])


def test_grad_inside_the_region_during_its_forward():
    """``torch.autograd.grad`` inside the region recomputes it while the forward still runs: the
    kept outputs are served then and again in the backward's recompute."""
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(lin1(x))
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return lin2(h * g)

    x = torch.randn(3, 8, requires_grad=True)
    ref = fn(x)
    grads_ref = torch.autograd.grad(ref.sum(), [x, *lin1.parameters(), *lin2.parameters()])
    out = zoo.checkpoint(fn, x, save_ops=MM)
    grads = torch.autograd.grad(out.sum(), [x, *lin1.parameters(), *lin2.parameters()])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_peak_no_higher_than_torch_selective_checkpoint():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256),
                                        nn.LayerNorm(256)) for _ in range(4)])
    x = torch.randn(256, 256, requires_grad=True)
    policy = lambda: torch_checkpoint.create_selective_checkpoint_contexts(list(MM))  # noqa

    def peak(wrap) -> int:
        def step() -> None:
            h = x
            for block in net:
                h = wrap(block, h)
            h.sum().backward()
        return zoo.memory.cpu_peak_bytes(step, track=(net,))

    mine = peak(lambda b, h: zoo.checkpoint(b, h, save_ops=MM))
    theirs = peak(lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False,
                                                           context_fn=policy))
    assert mine <= theirs, (mine, theirs)


def test_forward_without_backward_leaves_nothing_alive():
    """The kept outputs hold no autograd history: a kept matmul output whose graph is dropped
    unused is freed at once (no reference cycle through the region's own graph)."""
    net, x = mlp(), torch.randn(4, 16, requires_grad=True)
    kept: list[weakref.ref] = []
    net[0].register_forward_hook(lambda m, i, o: kept.append(weakref.ref(o)))
    out = zoo.checkpoint(net, x, save_ops=MM)
    del out
    assert len(kept) == 1 and kept[0]() is None


def test_second_backward_is_a_clear_error():
    net, x = mlp(), torch.randn(4, 16, requires_grad=True)
    out = zoo.checkpoint(net, x, save_ops=MM)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recomputed a second time"):
        out.sum().backward()


def test_kept_output_changed_in_place_is_a_clear_error():
    lin = nn.Linear(8, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        h.mul_(2)  # the kept addmm output, changed afterwards
        return torch.tanh(h)

    out = zoo.checkpoint(fn, torch.randn(3, 8, requires_grad=True), save_ops=MM)
    with pytest.raises(RuntimeError, match="changed in place"):
        out.sum().backward()


def test_recompute_that_runs_other_named_ops_is_a_clear_error():
    lin, calls = nn.Linear(8, 8), []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)  # the forward adds the bias in the matmul, the recompute after it
        h = lin(x) if len(calls) == 1 else x @ lin.weight.t() + lin.bias
        return torch.tanh(h)

    out = zoo.checkpoint(fn, torch.randn(3, 8, requires_grad=True), save_ops=MM)
    with pytest.raises(RuntimeError, match="not deterministic"):
        out.sum().backward()


def test_op_packet_is_refused():
    with pytest.raises(TypeError, match="op overloads"):
        zoo.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True),
                       save_ops={torch.ops.aten.mm})


@pytest.mark.parametrize("save_ops", [3, "mm"])
def test_save_ops_that_is_no_collection_of_ops_is_refused_in_one_line(save_ops):
    with pytest.raises(TypeError, match=r"^zoo.checkpoint: save_ops must be a list or set [^\n]*$"):
        zoo.checkpoint(nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True), save_ops=save_ops)
