"""PyTorch's own non-reentrant checkpoint tests, ported to zoo.checkpoint.

Each test names its original in pytorch/pytorch test/test_autograd.py (class TestAutograd); the
code is written anew for zoo (tiny sizes, pytest). Where zoo deliberately differs from torch the
test says so and pins zoo's behaviour instead.
"""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import zoo


def zoo_checkpoint(fn, *args, **kwargs):
    """zoo.checkpoint called exactly as torch's tests call torch's (use_reentrant=False)."""
    return zoo.checkpoint(fn, *args, use_reentrant=False, **kwargs)


class OpNames(TorchDispatchMode):
    """Records the names of the ATen ops run under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_checkpointing_without_reentrant(input_requires_grad):
    """test_checkpointing_without_reentrant: many checkpointed calls of one module, input passed
    as a keyword, joint loss; parameter gradients equal the plain module's."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 10))
    plain = copy.deepcopy(module)
    feats, plain_feats = [], []
    for _ in range(20):
        data = torch.rand(1, 10).requires_grad_(input_requires_grad)
        feats.append(zoo_checkpoint(lambda data: module(data), data=data))
        plain_feats.append(plain(data))
    torch.stack(feats).mean().backward()
    torch.stack(plain_feats).mean().backward()
    for p, q in zip(module.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


CUDA_BF16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA_BF16, reason="needs a CUDA device with bfloat16"))])
@pytest.mark.parametrize("enabled", [True, False])
def test_checkpointing_non_reentrant_autocast(device, enabled):
    """test_checkpointing_non_reentrant_autocast_cpu and _gpu: the recompute runs in the
    forward's autocast dtype (otherwise backward would fail on mismatched dtypes)."""
    dtypes = []

    def foo(x, y, z):
        x = torch.mm(x, y)
        dtypes.append(x.dtype)  # before the last saved tensor: the recompute gets here too
        y = torch.mm(x, z)
        return torch.mm(z, z)

    x, y, z = (torch.randn(3, 3, device=device, requires_grad=True) for _ in range(3))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=enabled):
        loss = zoo_checkpoint(foo, x, y, z).sum()
    loss.backward()
    assert dtypes == [torch.bfloat16 if enabled else torch.float32] * 2


def test_checkpointing_without_reentrant_custom_function_works():
    """test_checkpointing_without_reentrant_custom_function_works: a custom Function reading
    ctx.saved_tensors twice in one backward gets an error on the second read (recomputed tensors
    are freed as they are unpacked); the first read gives the right values."""
    errors = []

    class MyFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y, z):
            w = x * y * z
            out = w + w
            ctx.save_for_backward(x, y, z, w, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, y, z, w, out = ctx.saved_tensors
            try:
                ctx.saved_tensors
            except RuntimeError as e:
                errors.append(str(e))
            return x, y, z

    x, y, z = (torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0))

    def foo(x, y, z):
        return MyFunc.apply(x * y * z, y * y * z, z * z)

    zoo_checkpoint(foo, x, y, z).sum().backward()
    assert len(errors) == 1 and "already unpacked once" in errors[0]
    ref = [t.grad.clone() for t in (x, y, z)]
    for t in (x, y, z):
        t.grad = None
    foo(x, y, z).sum().backward()
    for t, g in zip((x, y, z), ref):
        torch.testing.assert_close(g, t.grad)


def test_checkpointing_without_reentrant_with_context_fn():
    """test_checkpointing_without_reentrant_with_context_fn: the user's first context wraps the
    forward, the second the recompute. Deliberate difference: torch's recompute also dispatches a
    detach of the saved output; the zoo's hands it to its slot as it is, so the recompute runs
    only the region's own op."""
    x = torch.tensor(1.0, requires_grad=True)
    mode = OpNames()
    zoo_checkpoint(lambda t: t.exp(), x, context_fn=lambda: (mode, contextlib.nullcontext()))
    assert mode.ops == ["exp.default"]

    mode.ops = []
    out = zoo_checkpoint(lambda t: t.exp(), x,
                         context_fn=lambda: (contextlib.nullcontext(), mode))
    out.backward()
    assert mode.ops == ["exp.default"]


def test_context_fn_with_use_reentrant_true_is_accepted():
    """Deliberate difference from test_checkpointing_without_reentrant_with_context_fn's last
    case: torch rejects context_fn with use_reentrant=True; zoo ignores use_reentrant (its region
    is always non-reentrant), so the call works and the context still wraps the forward."""
    x = torch.tensor(1.0, requires_grad=True)
    mode = OpNames()
    out = zoo.checkpoint(lambda t: t.sin(), x, use_reentrant=True,
                         context_fn=lambda: (mode, contextlib.nullcontext()))
    out.backward()
    assert mode.ops == ["sin.default"]
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_checkpoint_does_not_warn_with_or_without_use_reentrant():
    """Deliberate difference from test_checkpoint_warns_if_use_reentrant_not_passed_explcitly and
    test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly: torch warns when
    use_reentrant is omitted; zoo has one (non-reentrant) behaviour and never warns."""
    a = torch.randn(3, requires_grad=True)
    blocks = [nn.Linear(3, 3) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zoo.checkpoint(lambda t: t * 2, a)
        zoo.checkpoint(lambda t: t * 2, a, use_reentrant=False)
        zoo.checkpoint_sequential(blocks, 3, a)  # torch's argument order
        zoo.checkpoint_sequential(blocks, 3, a, use_reentrant=False)


@pytest.mark.skipif(not hasattr(torch_checkpoint, "GraphExecGroup"),
                    reason="torch.utils.checkpoint.GraphExecGroup needs a newer torch")
@pytest.mark.parametrize("use_group", [True, False])
def test_checkpoint_graph_execution_group(use_group):
    """test_checkpoint_graph_execution_group: each backward call recomputes the region once
    (3 runs of fn for a forward and two autograd.grad calls), unless both calls run under one
    GraphExecGroup (2 runs)."""
    counter = [0]

    def fn(x):
        counter[0] += 1
        y = x.sin().cos()
        return y, y.sin().cos()

    x = torch.randn(3, 3, requires_grad=True)
    y, z = zoo_checkpoint(fn, x)
    with torch_checkpoint.GraphExecGroup() if use_group else contextlib.nullcontext():
        grad_y, = torch.autograd.grad(z, inputs=(y,), grad_outputs=(torch.ones(3, 3),))
        grad_x, = torch.autograd.grad(y, inputs=(x,), grad_outputs=(grad_y,))
    assert counter[0] == (2 if use_group else 3)
    x2 = x.detach().requires_grad_()
    y2 = x2.sin().cos()
    ref, = torch.autograd.grad(y2.sin().cos(), x2, torch.ones(3, 3))
    torch.testing.assert_close(grad_x, ref)


@pytest.mark.skipif(not hasattr(torch_checkpoint, "GraphExecGroup"),
                    reason="torch.utils.checkpoint.GraphExecGroup needs a newer torch")
def test_checkpoint_graph_execution_group_overlapping_calls_are_an_error():
    """test_checkpoint_graph_execution_group, second part: two backward calls under one group
    that need the same saved tensor (retain_graph=True) are an error."""
    x = torch.randn(3, 3, requires_grad=True)
    out = zoo_checkpoint(lambda t: t.sin().cos(), x)
    with torch_checkpoint.GraphExecGroup():
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="two backward calls that overlap"):
            out.sum().backward()


def save_3_tensors(x):
    return x.sin().exp().sin()


def save_2_tensors(x):
    return x.sin().exp()


def save_2_tensors_alt(x):
    return x.sin() * torch.tensor([1.0, 2.0])


def non_det(forward, recompute):
    """A function that runs `forward` the first time and `recompute` afterwards."""
    calls = [0]

    def fn(x):
        calls[0] += 1
        return forward(x) if calls[0] == 1 else recompute(x)
    return fn


def test_checkpoint_detects_non_determinism():
    """test_checkpoint_detects_non_determinism: fewer saved tensors on recompute is an error;
    more is an error only with early stop off; the same number with other shapes is an error."""
    a = torch.randn(1, requires_grad=True)
    with pytest.raises(RuntimeError, match="fewer tensors"):
        zoo_checkpoint(non_det(save_3_tensors, save_2_tensors), a).backward()
    with torch_checkpoint.set_checkpoint_early_stop(False):
        out = zoo_checkpoint(non_det(save_2_tensors, save_3_tensors), a)
    with pytest.raises(RuntimeError, match="more tensors"):
        out.backward()
    with pytest.raises(RuntimeError, match="more tensors"):
        zoo_checkpoint(non_det(save_2_tensors, save_3_tensors), a, early_stop=False).backward()
    # with early stop (the default) the extra saved tensor is never reached: correct, no error
    zoo_checkpoint(non_det(save_2_tensors, save_3_tensors), a).backward()
    with pytest.raises(RuntimeError, match="had shape"):
        zoo_checkpoint(non_det(save_2_tensors, save_2_tensors_alt), a).backward()


def test_checkpoint_detects_non_determinism_debug_lists_ops():
    """test_checkpoint_detects_non_determinism, debug part: debug=True (or torch's global
    set_checkpoint_debug_enabled(True)) adds the forward's and the recompute's ops to the error;
    the global switch set to False wins over debug=True."""
    a = torch.randn(1, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"forward ran \(debug=True\): aten.sin.default, "
                                           r"aten.exp.default\n.*recompute ran: .*aten.sin"):
        zoo_checkpoint(non_det(save_2_tensors, save_2_tensors_alt), a, debug=True).backward()
    with torch_checkpoint.set_checkpoint_debug_enabled(True):
        out = zoo_checkpoint(non_det(save_2_tensors, save_2_tensors_alt), a)
    with pytest.raises(RuntimeError, match="debug=True"):
        out.backward()
    with torch_checkpoint.set_checkpoint_debug_enabled(False):
        out = zoo_checkpoint(non_det(save_2_tensors, save_2_tensors_alt), a, debug=True)
    with pytest.raises(RuntimeError, match="had shape") as error:
        out.backward()
    assert "debug=True" not in str(error.value)


def test_determinism_check_values():
    """determinism_check accepts torch's two values; anything else is a one-line ValueError."""
    a = torch.randn(2, requires_grad=True)
    for check in ("default", "none"):
        zoo_checkpoint(save_3_tensors, a, determinism_check=check).sum().backward()
    with pytest.raises(ValueError, match="determinism_check must be one of"):
        zoo_checkpoint(save_3_tensors, a, determinism_check="strict")


def test_access_saved_tensor_twice_without_recomputation_works():
    """test_access_saved_tensor_twice_without_recomputation_works: reading a saved tensor
    outside backward recomputes every time and keeps nothing; backward then frees it."""
    count = [0]

    def foo(a):
        count[0] += 1
        b = a * a
        return torch.exp(a * b)

    a = torch.randn(5, requires_grad=True)
    d = zoo_checkpoint(foo, a)
    assert count[0] == 1
    torch.testing.assert_close(d.grad_fn._saved_result, d.detach())
    assert count[0] == 2
    d.grad_fn._saved_result
    assert count[0] == 3
    d.sum().backward()
    assert count[0] == 4
    with pytest.raises(RuntimeError, match="already been freed"):
        d.grad_fn._saved_result


def test_checkpointing_without_reentrant_detached_tensor():
    """test_checkpointing_without_reentrant_detached_tensor: a region whose output needs no grad
    (its body runs under no_grad) works, repeatedly."""
    lin, lin2 = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)

    def no_grad_module(x):
        with torch.no_grad():
            return lin2(lin(x))

    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        out = zoo_checkpoint(no_grad_module, a)
        assert not out.requires_grad
        out += a
        out.sum().backward()
    torch.testing.assert_close(a.grad, torch.full((2, 2), 3.0))


def test_checkpointing_without_reentrant_saved_object_identity():
    """test_checkpointing_without_reentrant_saved_object_identity: a saved input that does not
    require grad comes back in backward as the very same tensor object."""
    seen = []

    class Test(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(y)
            return x

        @staticmethod
        def backward(ctx, x):
            seen.append(ctx.saved_tensors[0])
            return x, None

    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=False)
    Test.apply(a, b).backward()
    zoo_checkpoint(Test.apply, a, b).backward()
    assert seen[0] is b and seen[1] is b


def test_checkpointing_without_reentrant_correct_grad():
    """test_checkpointing_without_reentrant_correct_grad: backward() and autograd.grad() through
    a region give the plain gradient."""
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    ref, a.grad = a.grad, None
    zoo_checkpoint(torch.exp, a).sum().backward()
    got_backward = a.grad
    got_grad, = torch.autograd.grad(zoo_checkpoint(torch.exp, a).sum(), (a,))
    torch.testing.assert_close(got_backward, ref)
    torch.testing.assert_close(got_grad, ref)


def test_checkpointing_without_reentrant_dataparallel():
    """test_checkpointing_without_reentrant_dataparallel: a region around nn.DataParallel gives
    the plain input gradient (on however many devices there are)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(2, 2, bias=False).to(device)
    a = torch.randn(2, 2, device=device, requires_grad=True)
    copy.deepcopy(model)(a).sum().backward()
    ref, a.grad = a.grad, None
    zoo_checkpoint(nn.DataParallel(copy.deepcopy(model)), a).sum().backward()
    torch.testing.assert_close(a.grad, ref)


def test_checkpointing_without_reentrant_parameter_used_in_an_out():
    """test_checkpointing_without_reentrant_parameter_used_in_an_out: a tensor used inside and
    outside the region gets its gradient hook called once."""
    w = torch.randn(10, 10, requires_grad=True)
    count = [0]
    w.register_hook(lambda grad: count.__setitem__(0, count[0] + 1))
    x = torch.rand(10, 10, requires_grad=True)
    zoo_checkpoint(lambda t: w * t, w * x).sum().backward()
    assert count[0] == 1


def test_checkpointing_without_reentrant_arbitrary_input_output():
    """test_checkpointing_without_reentrant_arbitrary_input_output: dict in, dict out."""
    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(5, 5, bias=False)

        def forward(self, dict_input):
            return {"result": self.layer(dict_input["tensor"])}

    plain = MyModel()
    ckpt = copy.deepcopy(plain)
    inp = {"tensor": torch.randn(5, 5)}
    out_plain = plain(inp)["result"].sum()
    out_ckpt = zoo_checkpoint(ckpt, inp)["result"].sum()
    torch.testing.assert_close(out_ckpt, out_plain)
    out_plain.backward()
    out_ckpt.backward()
    torch.testing.assert_close(ckpt.layer.weight.grad, plain.layer.weight.grad)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_without_reentrant_memory_savings(use_reentrant):
    """test_checkpointing_without_reentrant_memory_savings, on the CPU with exact bytes (the
    original measures CUDA memory): eight checkpointed three-Linear layers peak lower than the
    plain ones, whatever use_reentrant says."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64),
                                         nn.Linear(64, 64)) for _ in range(8))
    for p in layers.parameters():
        p.grad = torch.ones_like(p)  # preallocated: what grows is activations
    x = torch.randn(100, 64, requires_grad=True)

    def step(wrap):
        def run():
            h = x.clone()
            for layer in layers:
                h = wrap(layer, h)
            h.sum().backward()
        return run

    plain = zoo.memory.cpu_peak_bytes(step(lambda layer, h: layer(h)), track=(layers,))
    ckpt = zoo.memory.cpu_peak_bytes(
        step(lambda layer, h: zoo.checkpoint(layer, h, use_reentrant=use_reentrant)),
        track=(layers,))
    assert ckpt < plain
