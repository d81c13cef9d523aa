"""zoo.checkpoint against the plain, uncheckpointed run: the checkpoint contract of DESIGN.md."""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.checkpoint import split_segments
from helpers import TensorsAlive, assert_same_training, buffers, grads, run_steps


def conv_bn_net(norm: type[nn.Module] = nn.BatchNorm2d, **norm_kwargs) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm(8, **norm_kwargs), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(8, 8, 3, padding=1), norm(8, **norm_kwargs), nn.ReLU())


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


# ---- 1. outputs and gradients ---------------------------------------------------------------
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_same_outputs_and_gradients(images, input_requires_grad):
    plain, ckpt = conv_bn_net(), conv_bn_net()
    x1 = images.clone().requires_grad_(input_requires_grad)
    x2 = images.clone().requires_grad_(input_requires_grad)
    torch.manual_seed(5)
    y1 = plain(x1)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings, also when no input requires grad
        y2 = zoo.checkpoint(ckpt, x2)
        y2.square().sum().backward()
    y1.square().sum().backward()
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    for g1, g2 in zip(grads(plain), grads(ckpt)):
        assert g2 is not None, "a parameter got no gradient through the checkpoint"
        torch.testing.assert_close(g2, g1)
    if input_requires_grad:
        torch.testing.assert_close(x2.grad, x1.grad)


def test_frozen_input_still_trains_parameters():
    """Reentrant checkpoint of a block whose input needs no grad trains nothing."""
    net = nn.Linear(4, 4)
    zoo.checkpoint(net, torch.randn(2, 4)).sum().backward()
    assert net.weight.grad is not None and net.weight.grad.abs().sum() > 0


# ---- 2. normalisation statistics --------------------------------------------------------------
class OwnForwardBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass with its own forward that updates its statistics its own way
    (ignoring ``momentum``): the guard must fall back to snapshotting its buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.5).add_(x.mean((0, 2, 3)), alpha=0.5)
                self.running_var.mul_(0.5).add_(x.var((0, 2, 3)), alpha=0.5)
                self.num_batches_tracked.add_(1)
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


NORMS = [
    (OwnForwardBatchNorm, {}),
    (nn.BatchNorm2d, {}),
    (nn.BatchNorm2d, {"momentum": None}),
    (nn.SyncBatchNorm, {}),
    (nn.InstanceNorm2d, {"track_running_stats": True, "affine": True}),
    (zoo.cp_BatchNorm2d, {}),
    (zoo.cp_BatchNorm2d, {"momentum": None}),
]


@pytest.mark.parametrize("norm,kwargs", NORMS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_norm_buffers_equal_plain_after_several_steps(images, norm, kwargs):
    plain, ckpt = conv_bn_net(norm, **kwargs), conv_bn_net(norm, **kwargs)
    assert_same_training(plain, lambda x: plain(x), ckpt, lambda x: zoo.checkpoint(ckpt, x), images)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_batchnorm_1d_2d_3d(dim):
    shape = {1: (6, 4, 5), 2: (6, 4, 5, 5), 3: (6, 4, 3, 3, 3)}[dim]
    bn = getattr(nn, f"BatchNorm{dim}d")
    torch.manual_seed(0)
    plain = nn.Sequential(bn(4), nn.ReLU(), bn(4, momentum=None))
    ckpt = copy.deepcopy(plain)
    assert_same_training(plain, plain, ckpt, lambda x: zoo.checkpoint(ckpt, x), torch.randn(shape))


def test_torch_checkpoint_double_counts_batchnorm_but_zoo_does_not(images):
    """The defect the zoo exists for (pytorch/pytorch#96136): measured, not assumed."""
    nets = {k: conv_bn_net() for k in ("plain", "torch", "zoo")}
    run_steps(nets["plain"], nets["plain"], images, steps=1)
    run_steps(nets["torch"], lambda x: torch_checkpoint.checkpoint(nets["torch"], x,
                                                                   use_reentrant=False),
              images, steps=1)
    run_steps(nets["zoo"], lambda x: zoo.checkpoint(nets["zoo"], x), images, steps=1)
    assert nets["plain"][1].num_batches_tracked.item() == 1
    assert nets["torch"][1].num_batches_tracked.item() == 2
    assert nets["zoo"][1].num_batches_tracked.item() == 1
    assert not torch.equal(buffers(nets["torch"])[0], buffers(nets["plain"])[0])


def test_functional_stats_are_restored_when_torch_stops_recompute_early(images):
    """torch stops a recompute once backward has what it needs; buffers must still be restored."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))  # BN is the last op recomputed
    ckpt = copy.deepcopy(plain)
    assert_same_training(plain, plain, ckpt, lambda x: zoo.checkpoint(ckpt, x), images)


# ---- 3. random numbers --------------------------------------------------------------------------
def test_dropout_replays_same_mask(images):
    drop = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 8))
    x = images.reshape(-1, 8).requires_grad_()
    torch.manual_seed(3)
    ref = drop(x)
    ref.sum().backward()
    ref_grad = [p.grad.clone() for p in drop.parameters()]
    drop.zero_grad()
    torch.manual_seed(3)
    out = zoo.checkpoint(drop, x)
    state_after_forward = torch.get_rng_state()
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    for g, r in zip((p.grad for p in drop.parameters()), ref_grad):
        torch.testing.assert_close(g, r)
    # the recompute replays the forward's numbers but does not consume the caller's stream
    assert torch.equal(torch.get_rng_state(), state_after_forward)


# ---- 5. calling conventions -------------------------------------------------------------------
def test_kwargs_non_tensor_args_and_tuple_outputs():
    lin = nn.Linear(4, 4)

    def fn(x, scale, *, bias: torch.Tensor, name: str):
        return lin(x) * scale + bias, name, {"n": 3}

    x, bias = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    y_ref, *_ = fn(x, 2.0, bias=bias, name="a")
    g_ref = torch.autograd.grad(y_ref.sum(), (x, bias, lin.weight))
    y, name, extra = zoo.checkpoint(fn, x, 2.0, bias=bias, name="a")
    assert name == "a" and extra == {"n": 3}
    for g, r in zip(torch.autograd.grad(y.sum(), (x, bias, lin.weight)), g_ref):
        torch.testing.assert_close(g, r)


def test_nested_checkpoints_match_plain(images):
    plain, ckpt = conv_bn_net(), conv_bn_net()

    def outer(x):
        return zoo.checkpoint(ckpt[4:], zoo.checkpoint(ckpt[:4], x))

    assert_same_training(plain, plain, ckpt, lambda x: zoo.checkpoint(outer, x), images)


def _autocast_seen(images: torch.Tensor, forward: bool, backward: bool) -> list[tuple]:
    """(recomputing, CPU autocast on) at each run of a region's fn, with the forward and the
    backward each inside a bfloat16 autocast context or not; checks the output's dtype."""
    seen = []

    def fn(x):
        seen.append((zoo.is_recomputing(), torch.is_autocast_enabled("cpu")))
        return lin(x)

    lin = nn.Linear(8, 8)
    x = images.reshape(-1, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward):
        y = zoo.checkpoint(fn, x)
        ref = lin(x)
    assert y.dtype == ref.dtype == (torch.bfloat16 if forward else torch.float32)
    torch.testing.assert_close(y, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward):
        y.float().sum().backward()
    assert not torch.is_autocast_enabled("cpu")
    return seen


def test_recompute_runs_under_forward_autocast_state(images):
    assert _autocast_seen(images, forward=True, backward=False) == [(False, True), (True, True)]


def test_recompute_outside_autocast_when_forward_ran_without(images):
    """A backward run inside an autocast context recomputes a region whose forward ran without
    autocast without it too (the forward recorded no autocast at all)."""
    assert _autocast_seen(images, forward=False, backward=True) == [(False, False),
                                                                    (True, False)]


def test_recompute_leaves_no_global_module_hook_behind(images):
    """The normalisation guard is a global forward pre-hook only while a recompute runs."""
    hooks = nn.modules.module._global_forward_pre_hooks
    before = dict(hooks)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    inside = []
    net.register_forward_pre_hook(lambda m, a: inside.append(len(hooks) - len(before)))
    zoo.checkpoint(net, images).sum().backward()
    assert inside == [0, 1] and dict(hooks) == before


def test_no_grad_and_inference_mode_run_once_without_recompute(images):
    calls = []

    def fn(x):
        calls.append(zoo.is_recomputing())
        return x * 2

    with torch.no_grad():
        assert torch.equal(zoo.checkpoint(fn, images), images * 2)
    with torch.inference_mode():
        assert torch.equal(zoo.checkpoint(fn, images), images * 2)
    assert calls == [False, False]
    assert not zoo.is_recomputing()


def test_is_recomputing_only_during_recompute():
    flags = []
    x = torch.randn(2, requires_grad=True)
    y = zoo.checkpoint(lambda t: (flags.append(zoo.is_recomputing()), t.sin())[1], x)
    assert flags == [False]
    y.sum().backward()
    assert flags == [False, True] and not zoo.is_recomputing()


def test_selective_recompute_keeps_named_ops_and_matches_plain():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 16))
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(1)
    ref = mlp(x)
    g_ref = torch.autograd.grad(ref.sum(), [x, *mlp.parameters()])
    torch.manual_seed(1)
    save = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}
    out = zoo.checkpoint(mlp, x, save_ops=save)
    flops_selective = zoo.memory.count_flops(
        lambda: zoo.checkpoint(mlp, x, save_ops=save).sum().backward())
    flops_full = zoo.memory.count_flops(lambda: zoo.checkpoint(mlp, x).sum().backward())
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    torch.testing.assert_close(out, ref)
    for g, r in zip(torch.autograd.grad(out.sum(), [x, *mlp.parameters()]), g_ref):
        torch.testing.assert_close(g, r)
    assert flops_selective < flops_full  # matmuls were kept, not recomputed


def test_save_ops_as_a_function_spares_one_layer_at_no_extra_flop():
    """``save_ops=AllBut(ops, layer)``: the last linear's output is not kept (it only feeds the
    residual sum), the recompute stops before that layer, so the step's FLOPs are the plain
    step's, it keeps less than the named ops alone, and it trains exactly as plain."""
    from zoo.checkpoint.policies import MATMUL_OPS, AllBut
    from zoo.planner import measure_step

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc2(self.act(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self, save_ops=None) -> None:
            super().__init__()
            self.blocks, self.save_ops = nn.ModuleList([Residual() for _ in range(3)]), save_ops

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                ops = self.save_ops(b) if self.save_ops else None
                x = zoo.checkpoint(b, x, save_ops=ops) if ops is not None else b(x)
            return x

    torch.manual_seed(0)
    plain = Net()
    spared = copy.deepcopy(plain)
    spared.save_ops = lambda b: AllBut(MATMUL_OPS, b.fc2)
    kept = copy.deepcopy(plain)
    kept.save_ops = lambda b: MATMUL_OPS
    x = torch.randn(64, 32, requires_grad=True)
    (p_plain, f_plain), (p_spared, f_spared), (p_kept, f_kept) = (
        measure_step(m, x) for m in (plain, spared, kept))
    assert f_spared == f_kept == f_plain
    assert p_spared < p_kept < p_plain
    ref = plain(x)
    g_ref = torch.autograd.grad(ref.sum(), [x, *plain.parameters()])
    out = spared(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for g, r in zip(torch.autograd.grad(out.sum(), [x, *spared.parameters()]), g_ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, zoo.cp_BatchNorm2d])
def test_selective_recompute_with_batchnorm_in_the_region(images, norm):
    """save_ops serves kept outputs in the forward's order during the recompute; the statistics
    bookkeeping of a recompute (snapshots, cp_BatchNorm's counter) is neither kept nor served."""
    plain, ckpt = conv_bn_net(norm), conv_bn_net(norm)
    save = {torch.ops.aten.convolution.default}
    assert_same_training(plain, plain, ckpt, lambda x: zoo.checkpoint(ckpt, x, save_ops=save),
                         images, steps=3)
    assert int(ckpt[1].num_batches_tracked) == 3


def test_memory_is_lower_than_plain_and_than_torch_sequential():
    """Two stages, each run with checkpoint_sequential: torch keeps the first stage's last segment
    alive through the whole second stage; the zoo checkpoints it."""
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256),
                                          nn.GELU()) for _ in range(8)])
    x = torch.randn(512, 256)

    def peak(stage):
        chain.zero_grad(set_to_none=True)
        run = lambda t: stage(chain[4:], stage(chain[:4], t))  # noqa: E731
        return zoo.memory.cpu_peak_bytes(lambda: run(x).sum().backward(), track=(chain,))

    plain = peak(lambda blocks, t: blocks(t))
    ckpt = peak(lambda blocks, t: zoo.checkpoint_sequential(blocks, t, 2))
    torch_seq = peak(lambda blocks, t: torch_checkpoint.checkpoint_sequential(
        blocks, 2, t, use_reentrant=False))
    skip_last = peak(lambda blocks, t: zoo.checkpoint_sequential(blocks, t, 2, skip_last=True))
    assert ckpt < 0.6 * plain
    assert ckpt < 0.9 * torch_seq
    assert skip_last == torch_seq  # skip_last=True is torch's behaviour, byte for byte


# ---- checkpoint_sequential ----------------------------------------------------------------------
@pytest.mark.parametrize("segments", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("skip_last", [False, True])
def test_checkpoint_sequential_matches_plain(images, segments, skip_last):
    plain, ckpt = conv_bn_net(), conv_bn_net()
    blocks = list(ckpt)[:5]
    assert_same_training(
        plain, lambda x: plain[5:](plain[:5](x)), ckpt,
        lambda x: ckpt[5:](zoo.checkpoint_sequential(blocks, x, segments, skip_last)), images)


def test_checkpoint_sequential_segments_and_last_segment():
    blocks = [nn.Linear(2, 2) for _ in range(7)]
    assert [len(r) for r in split_segments(7, 3)] == [3, 2, 2]
    assert [len(r) for r in split_segments(7, None)] == [1] * 7
    recomputed = []

    def tag(i, block):
        def run(x):
            if zoo.is_recomputing():
                recomputed.append(i)
            return block(x)
        return run

    x = torch.randn(1, 2)
    zoo.checkpoint_sequential([tag(i, b) for i, b in enumerate(blocks)], x, 3).sum().backward()
    assert sorted(recomputed) == list(range(7))  # the last segment too
    recomputed.clear()
    zoo.checkpoint_sequential([tag(i, b) for i, b in enumerate(blocks)], x, 3,
                              skip_last=True).sum().backward()
    assert sorted(recomputed) == [0, 1, 2, 3, 4]


def in_place_net() -> nn.Sequential:
    """conv_bn_net with in-place activations and dropout, as torchvision writes them."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.3, inplace=True), nn.BatchNorm2d(8),
        nn.ReLU(inplace=True))


@pytest.mark.parametrize("segments", [None, 2, 3, 7])
def test_checkpoint_sequential_joins_an_in_place_block_to_the_one_before(images, segments):
    # alone, nn.ReLU(inplace=True)'s region would overwrite its own input, which no recompute
    # can undo (torch's checkpoint_sequential fails in backward with one segment per block)
    plain, ckpt = in_place_net(), in_place_net()
    assert_same_training(plain, plain, ckpt,
                         lambda x: zoo.checkpoint_sequential(ckpt, x, segments), images)
    seen = []
    for i, block in enumerate(ckpt):
        block.register_forward_pre_hook(
            lambda *_, i=i: seen.append(i) if zoo.is_recomputing() else None)
    zoo.checkpoint_sequential(ckpt, images, segments).sum().backward()
    assert sorted(seen) == list(range(7))  # every block recomputed: nothing stored instead


@pytest.mark.parametrize("segments", [0, 8, -1, 2.5, True])
def test_checkpoint_sequential_rejects_bad_segments(segments):
    with pytest.raises(ValueError, match="from 1 to 7"):
        zoo.checkpoint_sequential([nn.Identity()] * 7, torch.zeros(1), segments)


def test_checkpoint_sequential_under_no_grad_runs_plainly():
    seen = []
    blocks = [lambda x: (seen.append(zoo.is_recomputing()), x + 1)[1]] * 3
    with torch.no_grad():
        assert zoo.checkpoint_sequential(blocks, torch.zeros(1), 2).item() == 3
    assert seen == [False] * 3


# ---- the region's own machinery (saved-tensor slots, early stop, errors) -------------------------
def mlp_chain(ends_in_linear: bool) -> nn.Sequential:
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        tail = [nn.Linear(64, 64)] if ends_in_linear else []
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), *tail)

    return nn.Sequential(*[block() for _ in range(6)])


@pytest.mark.parametrize("ends_in_linear", [True, False])
def test_same_peak_and_flops_as_torch_non_reentrant(ends_in_linear):
    """The zoo's region keeps and recomputes exactly what torch's non-reentrant checkpoint does:
    recomputed activations are freed as backward consumes them, and a region whose last op saves
    nothing (a Linear at the end) is not run to its end again."""
    chain = mlp_chain(ends_in_linear)
    x = torch.randn(256, 64, requires_grad=True)

    def step(wrap):
        def run():
            chain.zero_grad(set_to_none=True)
            x.grad = None
            h = x
            for block in chain:
                h = wrap(block, h)
            h.sum().backward()
        return run

    torch_step = step(lambda b, h: torch_checkpoint.checkpoint(b, h, use_reentrant=False))
    zoo_step = step(zoo.checkpoint)
    assert zoo.memory.cpu_peak_bytes(zoo_step) == zoo.memory.cpu_peak_bytes(torch_step)
    plain_flops = zoo.memory.count_flops(step(lambda b, h: b(h)))
    zoo_flops = zoo.memory.count_flops(zoo_step)
    assert zoo_flops == zoo.memory.count_flops(torch_step)
    # Linear forward = 1/3 of its forward+backward: recomputing the first Linear only is +1/6 of
    # an ending-in-Linear block; without the early stop it would be +1/3.
    assert zoo_flops == plain_flops * (7 / 6 if ends_in_linear else 4 / 3)


def test_backward_twice_with_retain_graph_and_partial_backward(images):
    plain, ckpt = conv_bn_net(), conv_bn_net()
    plain.eval(), ckpt.eval()  # dropout off: the two backward passes must see the same graph

    def two_heads(net, x):
        y = net(x)
        return y[:, :4].sum(), y[:, 4:].square().sum()

    ref = two_heads(plain, images)
    got = two_heads(lambda x: zoo.checkpoint(ckpt, x), images)
    for r, g in zip(ref, got):  # grad of each head alone: one backward per head, graph retained
        g_ref = torch.autograd.grad(r, list(plain.parameters()), retain_graph=True)
        g_got = torch.autograd.grad(g, list(ckpt.parameters()), retain_graph=True)
        for a, b in zip(g_got, g_ref):
            torch.testing.assert_close(a, b)
    (ref[0] + ref[1]).backward()
    (got[0] + got[1]).backward()
    for a, b in zip(grads(ckpt), grads(plain)):
        torch.testing.assert_close(a, b)


def test_double_backward_gradient_penalty_matches_plain():
    """create_graph=True through a checkpoint (a WGAN-GP style penalty) gives plain's gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Softplus(), nn.Linear(8, 1))
    x = torch.randn(3, 4, requires_grad=True)

    def penalty_grads(forward):
        net.zero_grad(set_to_none=True)
        g, = torch.autograd.grad(forward(x).sum(), x, create_graph=True)
        g.square().sum().backward()
        return [p.grad for p in net.parameters()]

    ref = penalty_grads(net)
    got = penalty_grads(lambda t: zoo.checkpoint(net, t))
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def test_a_function_that_is_not_callable_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"^zoo.checkpoint: fn must be callable [^\n]*got Tensor"):
        zoo.checkpoint(torch.randn(2, requires_grad=True), nn.Linear(2, 2))  # order swapped


@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_torch_func_transforms_are_refused_in_one_line(transform):
    """torch.func's grad and vjp refuse saved-tensor hooks, torch's own checkpoint included; the
    region says so in one line and names the ways that work, the plain model's gradient
    among them."""
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)

    def loss(t):
        return zoo.checkpoint(lambda u: lin(u).tanh(), t).sum()

    call = {"grad": lambda: torch.func.grad(loss)(x),
            "vjp": lambda: torch.func.vjp(loss, x)}[transform]
    with pytest.raises(RuntimeError, match="torch.func's transforms") as e:
        call()
    assert "\n" not in str(e.value) and "set_grad_checkpointing(model, False)" in str(e.value)
    plain = torch.func.grad(lambda t: lin(t).tanh().sum())(x)
    t = x.clone().requires_grad_()
    assert torch.equal(torch.autograd.grad(loss(t), t)[0], plain)


def test_input_changed_in_place_after_the_region_is_an_error():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    y = zoo.checkpoint(lambda t: lin(t).relu(), x)
    x.mul_(2)  # the recompute would now see other values than the forward did
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_parameter_changed_before_backward_is_refused_as_in_the_plain_model(layer):
    # a GAN's classic slip: the discriminator stepped before the generator's backward through
    # it; the recompute would read the new weights and give other gradients, without a word.
    # A Linear saves a view of its weight (its transpose), a convolution the weight itself
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh()) if layer == "linear" else \
        nn.Sequential(nn.Conv2d(3, 3, 3), nn.Tanh())
    x = torch.randn(2, 4) if layer == "linear" else torch.randn(1, 3, 5, 5)
    x.requires_grad_()  # (the weight is saved for the input's gradient)
    for run in (net, lambda t: zoo.checkpoint(net, t)):
        y = run(x)
        with torch.no_grad():
            net[0].weight.mul_(0.5)
        with pytest.raises(RuntimeError, match="modified by an inplace|modified in place"):
            y.sum().backward()


def test_nested_region_input_changed_in_place_is_an_error():
    """The same for a region nested in another, whose input the outer region keeps: the outer
    recompute replays the in-place change, and the inner recompute sees and refuses it."""
    lin = nn.Linear(4, 4)

    def outer(t):
        h = t * 2
        y = zoo.checkpoint(lambda u: lin(u).relu(), h)
        h.mul_(3)
        return y * h.sin()

    out = zoo.checkpoint(outer, torch.randn(2, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_region_that_saves_something_else_on_recompute_is_an_error():
    lin = nn.Linear(4, 4)
    calls = []

    def changes_shape(t):
        calls.append(1)
        return lin(t if len(calls) == 1 else t[:1]).relu()

    y = zoo.checkpoint(changes_shape, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="not deterministic"):
        y.sum().backward()


def test_threads_recompute_independently(images):
    """nn.DataParallel runs replicas on threads: recomputes on concurrent threads stay apart
    (recompute flag, normalisation guard, saved slots). Dropout is off because the CPU random
    generator is one for the whole process, so threads would interleave their draws."""
    import threading

    nets = [conv_bn_net() for _ in range(4)]
    plains = [conv_bn_net() for _ in range(4)]
    for net in nets + plains:
        net[3].p = 0.0
    errors = []

    def train(i):
        try:
            assert_same_training(plains[i], plains[i], nets[i],
                                 lambda x: zoo.checkpoint_sequential(nets[i], x), images, steps=3)
        except Exception as e:  # reported below, on the main thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


# ---- CUDA: run where a GPU is present ----------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_dropout_replayed_even_when_inputs_are_on_cpu():
    """torch stashes RNG only for the devices of the inputs; a region that moves a CPU input to
    the GPU and draws there must still replay the same mask (the zoo stashes the current device)."""
    drop = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.5), nn.Linear(256, 64)).cuda()
    x = torch.randn(32, 64)
    fn = lambda t: drop(t.cuda())  # noqa: E731
    torch.manual_seed(0)
    ref = fn(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in drop.parameters()]
    drop.zero_grad()
    torch.manual_seed(0)
    out = zoo.checkpoint(fn, x)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    for p, g in zip(drop.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)


@cuda
def test_cuda_batchnorm_and_autocast_match_plain():
    plain, ckpt = conv_bn_net().cuda(), conv_bn_net().cuda()
    x = torch.randn(4, 3, 8, 8, device="cuda")

    def amp(net):
        def run(t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return net(t)
        return run

    def amp_ckpt(t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return zoo.checkpoint(ckpt, t)

    assert_same_training(plain, amp(plain), ckpt, amp_ckpt, x)


# ---- torch's keywords and backward calls (the drop-in; more in test_checkpoint_torch_*.py) ------
def test_partial_backward_keeps_no_recomputed_tensor():
    """autograd.grad of an intermediate recomputes the region; the recomputed tensors that call
    did not use are freed when it ends (torch keeps them while the graph lives), and the next
    backward call recomputes, with the plain gradient."""
    calls, mode = [0], TensorsAlive()

    def fn(x):
        calls[0] += 1
        y = x.sin().cos()
        return y, y.sin().cos()

    x = torch.randn(3, 3, requires_grad=True)
    y, z = zoo.checkpoint(fn, x, context_fn=lambda: (contextlib.nullcontext(), mode))
    grad_y, = torch.autograd.grad(z, y, torch.ones(3, 3))
    assert calls[0] == 2 and mode.refs and mode.alive() == 0
    grad_x, = torch.autograd.grad(y, x, grad_y)
    assert calls[0] == 3 and mode.alive() == 0
    x2 = x.detach().requires_grad_()
    y2 = x2.sin().cos()
    ref, = torch.autograd.grad(y2.sin().cos(), x2, torch.ones(3, 3))
    torch.testing.assert_close(grad_x, ref)


def test_context_fn_composes_with_batchnorm_guard_and_rng(images):
    """A user's context_fn wraps forward and recompute while the zoo's BatchNorm guard and RNG
    replay still apply: buffers and gradients as in the plain run."""
    entered = []

    @contextlib.contextmanager
    def tag(name):
        entered.append((name, zoo.is_recomputing()))
        yield

    plain, ckpt = conv_bn_net(), conv_bn_net()
    assert_same_training(plain, plain, ckpt, lambda x: zoo.checkpoint(
        ckpt, x, use_reentrant=False, context_fn=lambda: (tag("forward"), tag("recompute"))),
        images, steps=2)
    assert entered == [("forward", False), ("recompute", True)] * 2


def test_torch_keywords_reach_every_segment_and_others_reach_fn():
    """checkpoint_sequential passes torch's keywords to each segment; a keyword torch does not
    have goes to fn as before."""
    seen = []
    blocks = [nn.Linear(4, 4) for _ in range(4)]
    x = torch.randn(2, 4, requires_grad=True)
    zoo.checkpoint_sequential(blocks, x, 2, context_fn=lambda: (
        seen.append("segment") or contextlib.nullcontext(), contextlib.nullcontext()))
    assert seen == ["segment"] * 2
    out = zoo.checkpoint(lambda t, scale: t * scale, x, scale=3.0, use_reentrant=False)
    torch.testing.assert_close(out, x * 3.0)


def _eight_blocks() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(8)])
    return chain, torch.randn(256, 128, requires_grad=True)


def _staged_step(chain: nn.Sequential, x: torch.Tensor, stage_wrap: Callable,
                 block_wrap: Callable) -> Callable[[], None]:
    """A step of the first four blocks, each run by ``block_wrap``, as one stage run by
    ``stage_wrap``, then the other four plainly."""
    def run():
        chain.zero_grad(set_to_none=True)
        x.grad = None

        def stage(t):
            for block in chain[:4]:
                t = block_wrap(block, t)
            return t
        chain[4:](stage_wrap(stage, x)).sum().backward()
    return run


def test_nested_regions_inputs_are_kept_by_the_outer_region():
    """A region nested in another hands its inputs to the outer region (torch's nestable
    checkpoint, rule 2): they are not held through the step, so the peak of a checkpointed stage
    of checkpointed blocks followed by plain layers is torch's nested peak, byte for byte."""
    chain, x = _eight_blocks()

    def step(wrap):
        return _staged_step(chain, x, wrap, wrap)

    plain = step(lambda f, t: f(t))
    plain()
    ref = [p.grad.clone() for p in chain.parameters()]
    zoo_step = step(zoo.checkpoint)
    zoo_step()
    for p, g in zip(chain.parameters(), ref):
        torch.testing.assert_close(p.grad, g)
    torch_step = step(lambda f, t: torch_checkpoint.checkpoint(f, t, use_reentrant=False))
    zoo_peak = zoo.memory.cpu_peak_bytes(zoo_step, track=(chain,))
    assert zoo_peak == zoo.memory.cpu_peak_bytes(torch_step, track=(chain,))
    assert zoo_peak < zoo.memory.cpu_peak_bytes(plain, track=(chain,))


def _torch_region(fn, *args):
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)


@pytest.mark.parametrize("outer, middle, inner", [
    ("zoo", "torch", "zoo"), ("torch", "zoo", "torch"), ("torch", "torch", "zoo"),
    ("zoo", "zoo", "torch"), ("torch", "zoo", "zoo"), ("zoo", "torch", "plain")])
def test_zoo_and_torch_regions_nest_in_each_other_exactly(outer, middle, inner):
    """Three levels of zoo's and torch's non-reentrant checkpoints in any order: the plain
    gradients, bit for bit. A zoo region inside torch's hands its inputs to it as it does to an
    enclosing zoo region, in torch's forward and in its recompute alike (were it only in the
    forward, torch's recompute would save one tensor fewer and fail)."""
    wrap = {"zoo": zoo.checkpoint, "torch": _torch_region, "plain": lambda f, *a: f(*a)}
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def step(outer, middle, inner):
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        body = lambda a: (a @ w).sin() * a  # noqa: E731
        mid = lambda b: wrap[inner](body, b * 2).cos()  # noqa: E731
        out = wrap[outer](lambda a: wrap[middle](mid, a), x)
        return [out.detach(), *torch.autograd.grad(out.sum(), (x, w))]

    for got, expected in zip(step(outer, middle, inner), step("plain", "plain", "plain")):
        assert torch.equal(got, expected)


def test_zoo_regions_inside_torchs_are_kept_by_it():
    """Checkpointed zoo blocks inside a stage checkpointed by torch: the stage keeps their
    inputs (recomputed when needed), so the peak is that of torch's blocks in torch's stage."""
    chain, x = _eight_blocks()

    def step(block_wrap):
        return _staged_step(chain, x, _torch_region, block_wrap)

    mixed = zoo.memory.cpu_peak_bytes(step(zoo.checkpoint), track=(chain,))
    assert mixed == zoo.memory.cpu_peak_bytes(step(_torch_region), track=(chain,))


def test_selective_recompute_takes_torch_keywords():
    """save_ops regions take torch's keywords like any other region (the user's contexts wrap
    forward and recompute) and gradients stay the plain ones."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    net(x).square().sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    mode = TensorsAlive()
    out = zoo.checkpoint(net, x, save_ops={torch.ops.aten.mm.default}, use_reentrant=False,
                         context_fn=lambda: (contextlib.nullcontext(), mode),
                         determinism_check="none", early_stop=False, preserve_rng_state=True)
    out.square().sum().backward()
    assert mode.refs  # the recompute ran under the user's context
    for p, g in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, g)
