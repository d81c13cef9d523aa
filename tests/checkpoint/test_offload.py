"""zoo.offload: saved tensors through host copies, bit for bit the plain model.

On the CPU ``to_host=True`` runs the whole bookkeeping (dedupe, views, in-place checks,
nesting, release) through host copies of CPU tensors; without it a CPU run is a no-op.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import zoo
from helpers import assert_same_training, run_gloo
from zoo.models.densenet import DenseNet
from zoo.checkpoint import host_copies, offloaded_bytes, reset_offloaded_bytes
from zoo.checkpoint.offload import Offload
from zoo.checkpoint.offload_cost import exposed_copy_time, link_wait


def conv_bn(width: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.Dropout(0.3), nn.Conv2d(width, 3, 3, padding=1), nn.BatchNorm2d(3))


def images() -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def host(fn, *args, **kwargs):
    return zoo.offload(fn, *args, to_host=True, min_bytes=0, **kwargs)


def test_conv_bn_dropout_trains_like_plain_bit_for_bit():
    plain, moved = conv_bn(), conv_bn()
    assert_same_training(plain, plain, moved, lambda x: host(moved, x), images(), steps=3,
                         exact=True)


def _grads_of(fn, x):
    x = x.clone().requires_grad_()
    out = fn(x)
    out.sum().backward()
    return out.detach(), x.grad


def test_views_and_a_tensor_saved_twice_copy_one_storage():
    def fn(x):
        y = x.exp()  # exp saves its output y
        v = y[:, 1:]  # a view of y, saved by mul beside y itself
        return (v * v).sum() + (y * y).sum()

    x = torch.randn(3, 5, dtype=torch.float64)
    want = _grads_of(fn, x)
    reset_offloaded_bytes()
    got = _grads_of(lambda t: host(fn, t), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # One storage, y's, copied once: exp saves its output y, mul saves both operands of y * y
    # and of v * v; no op saves x.
    assert offloaded_bytes() == 3 * 5 * 8


class _Pair(torch.autograd.Function):
    """a * b, noting the storages its backward reads."""

    storages: list[int] = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        _Pair.storages[:] = [a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()]
        return grad * b, grad * a


def test_views_of_one_storage_come_back_as_one_storage():
    def fn(x):
        y = x.exp()
        return _Pair.apply(y[1:], y[:-1]).sum()

    x = torch.randn(6, 3)
    want = _grads_of(fn, x)
    reset_offloaded_bytes()
    torch.testing.assert_close(_grads_of(lambda t: host(fn, t), x), want, rtol=0, atol=0)
    assert offloaded_bytes() == 6 * 3 * 4  # y's storage, once
    assert _Pair.storages[0] == _Pair.storages[1]


def test_offloaded_bytes_counts_each_storage_once():
    x = torch.randn(2, 64)  # 512 bytes
    w = torch.randn(64, 64, requires_grad=True)

    def fn(a):
        return torch.tanh(a @ w)  # mm saves a for w's gradient, w for a's; tanh its output

    reset_offloaded_bytes()
    host(fn, x).sum().backward()
    assert offloaded_bytes() == 2 * 64 * 4 + 2 * 64 * 4  # a, tanh's output
    reset_offloaded_bytes()
    y = x.exp().requires_grad_()  # a leaf that trains
    host(fn, y).sum().backward()
    # y and w are leaves that require grad: the caller holds them (a parameter swapped in by
    # torch.func.functional_call is one), so moving them would free nothing: they stay
    assert offloaded_bytes() == 2 * 64 * 4  # tanh's output only


def test_module_parameters_buffers_and_small_tensors_stay():
    lin = nn.Linear(64, 64)
    x = torch.randn(2, 64)
    reset_offloaded_bytes()
    zoo.offload(lin, x, to_host=True, min_bytes=0).sum().backward()
    assert offloaded_bytes() == 2 * 64 * 4  # the input only; weight.t() is a parameter's view
    reset_offloaded_bytes()
    zoo.offload(lin, x, to_host=True, min_bytes=4096).sum().backward()
    assert offloaded_bytes() == 0


@pytest.mark.parametrize("through_view", [False, True])
def test_in_place_after_save_raises_like_plain(through_view):
    def fn(x):
        y = x.exp()
        z = y * 2
        (y[1:] if through_view else y).add_(1)  # exp saved y: plain refuses the backward
        return z.sum()

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fn(x).backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        host(fn, x).backward()


def test_in_place_before_save_is_exact():
    def fn(x):
        y = x * 3
        y.relu_()  # relu_ saves its output after the change
        return (y.sigmoid() * y).sum()

    x = torch.randn(5, 7)
    torch.testing.assert_close(_grads_of(lambda t: host(fn, t), x), _grads_of(fn, x),
                               rtol=0, atol=0)


@pytest.mark.parametrize("moved", [False, True])
def test_saved_storage_freed_after_forward_only_when_offloaded(moved):
    seen = []

    def fn(x):
        y = x.exp()  # saved by exp (its output) and by sin (its input)
        seen.append(StorageWeakRef(y.untyped_storage()))
        return y.sin().sum()

    x = torch.randn(64, 64, requires_grad=True)
    out = host(fn, x) if moved else fn(x)
    assert seen[0].expired() == moved, "the graph must hold a host copy, not the tensor"
    out.backward()
    torch.testing.assert_close(x.grad, (x.exp().cos() * x.exp()), rtol=0, atol=0)


def test_cpu_default_is_a_no_op():
    plain, moved = conv_bn(), conv_bn()
    seen = []

    def fn(x):
        y = moved(x)
        seen.append(StorageWeakRef(y.untyped_storage()))
        return y.sin()  # sin saves its input: a tensor on the host already

    reset_offloaded_bytes()
    assert_same_training(plain, lambda x: plain(x).sin(), moved, lambda x: zoo.offload(fn, x),
                         images(), steps=1,
                         exact=True)
    assert offloaded_bytes() == 0
    out = zoo.offload(fn, images())
    assert not seen[-1].expired(), "without to_host a CPU tensor is saved as it is"
    del out


@pytest.mark.parametrize("order", ["checkpoint_inside", "offload_inside"])
def test_nesting_with_checkpoint_regions(order):
    plain, moved = conv_bn(), conv_bn()

    def inside(m, x):
        return zoo.checkpoint(lambda t: host(m, t), x)

    def around(m, x):
        return host(lambda t: m[3:](zoo.checkpoint(m[:3], t)), x)

    forward = around if order == "checkpoint_inside" else inside
    assert_same_training(plain, plain, moved, lambda x: forward(moved, x), images(), steps=3,
                         exact=True)


@pytest.mark.parametrize("efficient", [False, True])
@pytest.mark.parametrize("name", ["densenet", "resnet20"])
def test_zoo_model_offloaded_trains_like_plain(name, efficient):
    """The whole model offloaded; efficient=True: around the model's own checkpoint regions."""
    if name == "densenet":
        small = dict(growth_rate=4, block_config=(2, 2), num_init_features=8, stem="cifar")
        plain = DenseNet(num_classes=3, **small)
        moved = DenseNet(num_classes=3, efficient=efficient, **small)
    else:
        plain = zoo.create_model(name, num_classes=3)
        moved = zoo.create_model(name, num_classes=3, efficient=efficient)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    reset_offloaded_bytes()
    assert_same_training(plain, plain, moved, lambda t: host(moved, t), x, steps=3, exact=True)
    assert offloaded_bytes() > 0


def test_checkpoint_offload_keyword_mixes_keep_recompute_and_offload_per_unit():
    plain = conv_bn(8)
    mixed = conv_bn(8)
    units = [mixed[:3], mixed[3:5], mixed[5:]]

    def forward(x):
        x = zoo.checkpoint(units[0], x, offload=True)
        x = zoo.checkpoint(units[1], x)  # recompute (its dropout replays the same mask)
        return units[2](x)  # keep

    reset_offloaded_bytes()
    with host_copies():
        assert_same_training(plain, plain, mixed, forward, images(), steps=3, exact=True)
    # Per step: conv1's input (4*3*8*8 floats: 3072 B), conv1's output saved by BN (4*8*8*8
    # floats: 8192 B), ReLU's output (ReLU saves its output: 8192 B); the weights stay, as do
    # BN's per-channel statistics (32 B each, under min_bytes).
    assert offloaded_bytes() == 3 * (3072 + 8192 + 8192)


def test_chain_of_offloaded_units_prefetches_the_one_before_and_matches_plain(monkeypatch):
    plain, moved = conv_bn(8), conv_bn(8)
    units = [moved[:2], moved[2:4], moved[4:]]
    prefetched = []
    original = Offload.prefetch_previous

    def noting(region):  # how many tensors of the region before were brought back ahead
        original(region)
        before = None if region.previous is None else region.previous()
        prefetched.append(0 if before is None else sum(
            ref() is not None and ref().storage.flat is not None for ref in before.saved))

    monkeypatch.setattr(Offload, "prefetch_previous", noting)

    def forward(x):
        for unit in units:
            with Offload(tuple(unit.parameters()) + tuple(unit.buffers()), 0, True):
                x = unit(x)
        return x

    assert_same_training(plain, plain, moved, forward, images(), steps=3, exact=True)
    # Per step the backward reaches the units last to first, and each brings the one before it
    # back ahead: the last unit the middle one's 2 (ReLU's output, dropout's mask), the middle
    # one the first one's 4 (conv's input, BN's input, mean and inverse std; min_bytes=0);
    # the first has none before it (the previous step's graph is gone).
    assert prefetched == [2, 4, 0] * 3


def _ddp_worker(rank: int, world: int) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    model = DDP(net)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))[rank * 4: rank * 4 + 4]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(2):
        host(model, x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


@pytest.mark.slow
def test_ddp_two_processes_match_single_process():
    ranks = run_gloo(_ddp_worker)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        net(x).square().mean().backward()
        want = torch.cat([p.grad.flatten() for p in net.parameters()])
        for rank in ranks:
            torch.testing.assert_close(rank[step], want)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_exposed_copy_time_hides_behind_enough_compute():
    assert exposed_copy_time(1000, 100.0, 10.0) == 0.0  # 100 B/s * 10 s covers 1000 B
    assert exposed_copy_time(1000, 100.0, 4.0) == pytest.approx(6.0)
    assert exposed_copy_time(0, 100.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="bandwidth"):
        exposed_copy_time(1, 0.0, 1.0)


def test_link_wait_queues_copies_on_one_stream_and_waits_only_at_a_use():
    # 1000 B on a 100 B/s link: 10 s a copy. Two copies out queued 1 s apart share the link
    # (the second ends at 20 s); the forward never waits for them.
    out = [("out", 1, 1000, 0.0), ("out", 2, 1000, 1.0)]
    assert link_wait(out, 100.0) == 0.0
    # Brought back at 30 s (after both copies out), used 4 s later: 6 s waited.
    back = [("back", 2, 1000, 29.0), ("use", 2, 1000, 4.0)]
    assert link_wait(out + back, 100.0) == pytest.approx(6.0)
    # Queued at 21 s, the copy back still starts after the copies out (at 21 s), ends at 31 s.
    early = [("back", 2, 1000, 20.0), ("use", 2, 1000, 0.0)]
    assert link_wait(out + early, 100.0) == pytest.approx(10.0)
    # A prefetch with enough compute before its use costs nothing; a storage never brought
    # back (kept on the device) waits for nothing.
    assert link_wait(out + [("back", 1, 1000, 0.0), ("use", 1, 1000, 40.0)], 100.0) == 0.0
    assert link_wait([("use", 9, 0, 1.0)], 100.0) == 0.0
    with pytest.raises(ValueError, match="'out', 'back' or 'use'"):
        link_wait([("in", 1, 1, 0.0)], 100.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_is_not_raced_by_a_kernel_that_reuses_the_buffer():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)).cuda()
    x = torch.randn(2048, 4096, device="cuda")

    def clobber(module, args, out):  # queue kernels that reuse freed memory right away
        for _ in range(8):
            torch.empty_like(out).fill_(float("nan"))
        return out

    def step(fn):
        lin.zero_grad(set_to_none=True)
        fn(x).float().square().mean().backward()
        return [p.grad.clone() for p in lin.parameters()]

    want = step(lin)
    handles = [m.register_forward_hook(clobber) for m in lin]
    got = step(lambda t: zoo.offload(lin, t, min_bytes=0))
    for h in handles:
        h.remove()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Wrapped(torch.Tensor):
    """A wrapper subclass (as Float8 training's and DTensor's activations are): no storage of its
    own; its data is the plain tensor ``inner``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inners, meta, size, stride):
        return _Wrapped(inners["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _Wrapped) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args),
                   **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        wrap = lambda t: _Wrapped(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return torch.utils._pytree.tree_map(wrap, out)


def test_tensor_subclass_without_a_storage_stays_saved_as_it_is():
    def fn(x):
        return (x * 2).exp().sum()  # exp saves its output: a _Wrapped

    x = torch.randn(4, 8, dtype=torch.float64)
    want = _grads_of(fn, _Wrapped(x))
    reset_offloaded_bytes()
    got = _grads_of(lambda t: host(fn, t), _Wrapped(x))
    torch.testing.assert_close(got[1].inner, want[1].inner, rtol=0, atol=0)
    assert offloaded_bytes() == 0


def test_a_storage_saved_through_temporary_views_is_copied_once():
    def fn(x):
        y = x * 2  # saves nothing of y
        rows = [torch.sin(y[i]) for i in range(4)]  # each saves a view of y, dropped at once
        return sum(r.sum() for r in rows) + torch.sin(y).sum()  # then y itself

    x = torch.randn(4, 8, dtype=torch.float64)
    want = _grads_of(fn, x)
    reset_offloaded_bytes()
    torch.testing.assert_close(_grads_of(lambda t: host(fn, t), x), want, rtol=0, atol=0)
    assert offloaded_bytes() == 4 * 8 * 8  # y's storage, once, though no view outlives its line


def test_a_plan_segment_keeps_its_blocks_buffers_on_the_device():
    """A plan's offloaded segment runs its blocks through a function (``run_blocks``), not as
    one module: their BatchNorm running statistics, which BN saves, stay all the same."""
    from zoo.checkpoint.sequential import run_plan

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), nn.ReLU())
              for _ in range(2)]
    x = torch.randn(4, 512)
    reset_offloaded_bytes()
    with host_copies():
        run_plan(blocks, [(0, 2, "offload")], x).sum().backward()
    # Per block: the linear's input, BN's input, ReLU's output (the next block's linear input,
    # the same storage): 5 of 4 * 512 floats, and BN's batch mean and inverse std (2 KiB each).
    assert offloaded_bytes() == 5 * 4 * 512 * 4 + 2 * 2 * 512 * 4


def test_views_of_one_storage_share_it_again_in_a_second_backward():
    """Through a retained graph, every backward brings the storage back once for its views."""
    def fn(x):
        y = x.exp()
        return _Pair.apply(y[1:], y[:-1]).sum()

    x = torch.randn(6, 3, requires_grad=True)
    out = host(fn, x)
    for _ in range(2):
        out.backward(retain_graph=True)
        assert _Pair.storages[0] == _Pair.storages[1]
    torch.testing.assert_close(x.grad, 2 * _grads_of(fn, x.detach())[1], rtol=0, atol=0)


def test_a_wrong_argument_is_one_clear_line():
    lin, x = nn.Linear(3, 3), torch.randn(2, 3)
    with pytest.raises(TypeError, match=r"zoo.offload: fn must be callable .* got Tensor; pass"):
        zoo.offload(x, lin)
    with pytest.raises(ValueError, match=r"zoo.offload: min_bytes must be .* got '1KB'"):
        zoo.offload(lin, x, min_bytes="1KB")
    with pytest.raises(ValueError, match=r"zoo.offload: min_bytes must be .* got -3"):
        zoo.offload(lin, x, min_bytes=-3)


@pytest.mark.parametrize("kept", ["small", "parameter", "cpu_default"])
def test_in_place_after_save_raises_also_for_what_stays(kept):
    """Saved tensors the region leaves where they are (under min_bytes, a module's parameter,
    any CPU tensor by default) go through the hooks too, where autograd checks no version."""
    lin = nn.Linear(4, 4)

    def fn(x):
        y = lin(x).exp()  # exp saves its output y (16 floats); the linear, the weight's view
        return y, (y * 2).sum()

    x = torch.randn(4, 4, requires_grad=True)
    run = dict(small=lambda t: host_big(fn, t), parameter=lambda t: host(fn, t),
               cpu_default=lambda t: zoo.offload(fn, t))[kept]
    y, loss = run(x)
    if kept == "parameter":
        with torch.no_grad():
            lin.weight.add_(1)  # an optimizer step before the backward
    else:
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def host_big(fn, *args):
    return zoo.offload(fn, *args, to_host=True, min_bytes=1 << 20)


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="a region on a CUDA machine moves")
def test_cpu_default_installs_no_hooks_so_torch_func_works():
    """Off CUDA the default region is plain code: torch.func refuses saved-tensor hooks."""
    def f(t):
        return (t.exp() * t.sin()).sum()

    x = torch.randn(8, 8)
    got = torch.func.grad(lambda t: zoo.offload(f, t))(x)
    torch.testing.assert_close(got, torch.func.grad(f)(x), rtol=0, atol=0)


def test_views_of_a_swapped_in_parameter_stay():
    """A parameter swapped in by ``torch.func.functional_call`` (as a card's predicted step
    swaps in fake ones) is a plain leaf that requires grad: it stays, and so do its views, such
    as the ``weight.t()`` a linear layer saves."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(8, 64, requires_grad=True)
    reset_offloaded_bytes()
    host(lambda t: torch.func.functional_call(net, params, (t,)), x).sum().backward()
    assert offloaded_bytes() == 8 * 64 * 4  # tanh's output; x and the weights are leaves
