"""zoo.reversible: ``rebuild=True`` is, bit for bit, the same network as ``rebuild=False``.

Each test trains a small reversible network (BatchNorm, dropout and stochastic depth inside the
coupled functions) a few SGD steps both ways from the same state and compares, with
``torch.equal``, the outputs, the input and parameter gradients, and every buffer (BatchNorm
``running_mean``/``running_var``/``num_batches_tracked``), in float32 and float64, under autocast,
``torch.no_grad``, DistributedDataParallel (2 gloo processes) and ``torch.compile``. Memory and
recompute are measured exactly (MemTracker, FlopCounterMode).
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import DDP_CONFIGS, run_gloo, train_step_peak
from zoo import _torch as zoo_torch
from zoo.checkpoint import is_recomputing
from zoo.memory import count_flops, cpu_peak_bytes, default_loss, train_step
from zoo.nn import convert_spectral_norm
from zoo.reversible import (Coupling, from_fixed, grid_for, join, reversible_sequence, split,
                            to_fixed)
from zoo.reversible.sources import source_of


class DropPath(nn.Module):
    """Stochastic depth on a residual branch: whole samples zeroed (random, so it must replay)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not self.p:
            return x
        keep = torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype) >= self.p
        return x * keep / (1 - self.p)


def branch(c: int, drop: float = 0.2) -> nn.Module:
    return nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1),
                         nn.Dropout(drop), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1), DropPath(drop))


class Net(nn.Module):
    """stem -> reversible blocks on the two halves of the channels -> pooled head."""

    def __init__(self, depth: int = 3, width: int = 8, drop: float = 0.2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(Coupling(branch(width // 2, drop), branch(width // 2, drop))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 3)
        self.rebuild = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.stem(x).chunk(2, dim=1)
        y1, y2 = reversible_sequence(self.blocks, x1, x2, rebuild=self.rebuild)
        return self.head(torch.cat([y1, y2], dim=1).mean((2, 3)))


def twins(dtype: torch.dtype = torch.float32, **kw) -> tuple[Net, Net]:
    torch.manual_seed(0)
    stored = Net(**kw).to(dtype)
    rebuilt = copy.deepcopy(stored)
    rebuilt.rebuild = True
    return stored, rebuilt


def train(model: nn.Module, x: torch.Tensor, steps: int = 3, autocast: bool = False) -> list:
    """``steps`` SGD steps (reseeded before each); each step's output, input and parameter
    gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        xs = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(xs)
        default_loss(out).backward()
        history.append([out.detach(), xs.grad, *[p.grad.clone() for p in model.parameters()]])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return history


def assert_bitwise(a: list, b: list) -> None:
    for step, (ra, rb) in enumerate(zip(a, b)):
        for i, (ta, tb) in enumerate(zip(ra, rb)):
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), \
                f"step {step}, tensor {i}: max diff {(ta.double() - tb.double()).abs().max()}"


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(ta, tb), name


def images(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rebuilt_trains_bit_for_bit_like_stored(dtype):
    stored, rebuilt = twins(dtype)
    assert_bitwise(train(stored, images(dtype)), train(rebuilt, images(dtype)))
    assert_same_state(stored, rebuilt)
    bn = rebuilt.blocks[0].f[0]
    assert bn.num_batches_tracked.item() == 3  # once per step, not once more per rebuild


def test_under_autocast_bf16():
    stored, rebuilt = twins()
    assert_bitwise(train(stored, images(), autocast=True), train(rebuilt, images(), autocast=True))
    assert_same_state(stored, rebuilt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype):
    """A model in float16 or bfloat16 (its streams int32, its float views half): values beyond
    float16's integer range pass through float32 on the way back."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Coupling(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2)),
                                    nn.Linear(8, 8)) for _ in range(3)).to(dtype)
    x = (4 * torch.randn(4, 8)).to(dtype)
    results = []
    for rebuild in (False, True):
        torch.manual_seed(1)
        xs = x.clone().requires_grad_()
        y1, y2 = reversible_sequence(blocks, xs * 1, xs * 1, rebuild=rebuild)
        (y1.float() * y2.float()).sum().backward()
        results.append([y1.detach(), y2.detach(), xs.grad, *[p.grad for p in blocks.parameters()]])
        blocks.zero_grad(set_to_none=True)
    assert results[0][0].isfinite().all() and results[0][0].dtype == dtype
    assert_bitwise([results[0]], [results[1]])


def test_dropout_masks_are_replayed_on_the_rebuild():
    """Without the forward's random numbers the rebuild differs: the replay is what makes it
    exact (``preserve_rng_state=False`` is for blocks that draw none)."""
    stored, rebuilt = twins()

    def no_replay(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = rebuilt.stem(x).chunk(2, dim=1)
        y1, y2 = reversible_sequence(rebuilt.blocks, x1, x2, preserve_rng_state=False)
        return rebuilt.head(torch.cat([y1, y2], dim=1).mean((2, 3)))

    ref = train(stored, images(), steps=1)
    rebuilt.forward = no_replay
    got = train(rebuilt, images(), steps=1)
    assert torch.equal(got[0][0], ref[0][0])  # same forward
    assert not all(torch.equal(a, b) for a, b in zip(got[0][1:], ref[0][1:]))


def test_spectral_norm_in_f_and_g_is_rebuilt_from_the_forwards_u_and_v():
    """Spectral norm's power iteration advances its ``u`` and ``v`` in each forward: a rebuild
    that iterated again would subtract another F than the forward added (the inputs rebuilt
    wrong) and advance them twice. Converted (``zoo.nn.convert_spectral_norm``), each function
    records its state in the forward and is recomputed from it: bit for bit the stored network,
    ``u`` and ``v`` included."""
    def sn_branch(c: int) -> nn.Module:
        sn = nn.utils.parametrizations.spectral_norm
        return nn.Sequential(sn(nn.Conv2d(c, c, 3, padding=1)), nn.ReLU(),
                             sn(nn.Conv2d(c, c, 3, padding=1)))

    torch.manual_seed(0)
    stored = Net(drop=0.0)
    stored.blocks = nn.ModuleList(Coupling(sn_branch(4), sn_branch(4)) for _ in range(3))
    rebuilt = convert_spectral_norm(copy.deepcopy(stored))
    rebuilt.rebuild = True
    assert_bitwise(train(stored, images()), train(rebuilt, images()))
    assert_same_state(stored, rebuilt)


def test_no_grad_runs_the_plain_forward_and_keeps_nothing():
    stored, rebuilt = twins()
    x = images()
    with torch.no_grad():
        torch.manual_seed(3)
        ref = stored(x)
        torch.manual_seed(3)
        peak = cpu_peak_bytes(lambda: rebuilt(x))
        torch.manual_seed(3)
        out = rebuilt(x)
    assert out.grad_fn is None and torch.equal(out, ref)
    with torch.no_grad():
        torch.manual_seed(3)
        assert cpu_peak_bytes(lambda: stored(x)) == peak
    assert_same_state(stored, rebuilt)


def test_activation_memory_does_not_grow_with_depth():
    """Exact bytes of one step beyond the parameters, their gradients and the buffers: flat in
    the number of blocks when rebuilt, growing when stored."""
    def activations(depth: int, rebuild: bool) -> int:
        torch.manual_seed(0)
        net = Net(depth=depth, width=16, drop=0.0)
        net.rebuild = rebuild
        x = torch.randn(8, 3, 16, 16)
        state = 2 * sum(p.numel() * p.element_size() for p in net.parameters()) + \
            sum(b.numel() * b.element_size() for b in net.buffers())
        return train_step_peak(net, x) - state

    assert activations(8, True) == activations(2, True)
    assert activations(8, False) > 3 * activations(2, False) / 2
    assert activations(8, True) < activations(8, False) / 3


def test_recompute_is_one_forward_of_the_blocks():
    stored, rebuilt = twins()
    x = images()
    streams = stored.stem(x).chunk(2, dim=1)
    blocks_forward = count_flops(lambda: reversible_sequence(stored.blocks, *streams,
                                                             rebuild=False))
    extra = count_flops(train_step(rebuilt, x)) - count_flops(train_step(stored, x))
    assert extra == blocks_forward > 0


def test_streams_are_exact_integers_and_gradients_straight_through():
    """The forward adds on the fixed-point grid; the gradient is the float RevNet's (the
    quantisation counts as the identity), so it matches a float coupling to rounding."""
    stored, _ = twins(torch.float64)
    stored.eval()
    x = images(torch.float64)
    x1, x2 = stored.stem(x).chunk(2, dim=1)
    b = stored.blocks[0]
    y1, y2 = reversible_sequence([b], x1, x2, rebuild=False)
    grid = grid_for(torch.float64)
    assert (grid.stream, grid.frac_bits) == (torch.int64, 32)
    k1 = to_fixed(x1, grid) + to_fixed(b.f(from_fixed(to_fixed(x2, grid), grid)), grid)
    assert torch.equal(y1, k1.double() * 2.0 ** -32)
    params = list(b.parameters())
    grads = torch.autograd.grad((y1 * y2).sum(), params)
    f1 = x1 + b.f(x2)
    want = torch.autograd.grad((f1 * (x2 + b.g(f1))).sum(), params)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)


def test_out_of_range_values_make_the_outputs_nan():
    for rebuild in (False, True):
        stored, rebuilt = twins()
        net = rebuilt if rebuild else stored
        with torch.no_grad():
            net.stem.bias.fill_(grid_for(torch.float32).limit)
        out = net(images())
        assert out.isnan().all(), rebuild


class Tied(nn.Module):
    """Weight tying: one module as the first block's ``f`` and ``g`` and the second's ``g``."""

    def __init__(self, rebuild: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = branch(4)
        self.blocks = nn.ModuleList([Coupling(shared, shared), Coupling(branch(4), shared)])
        self.rebuild = rebuild

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :2].repeat(1, 2, 1, 1)  # 4 channels: the streams' width
        return torch.cat(reversible_sequence(self.blocks, x, x * 2, rebuild=self.rebuild), 1)


def test_a_module_shared_by_f_and_g_and_by_blocks_trains_alike():
    """The rebuild's recompute runs on aliases of a block's parameters and puts the real ones
    back, also where two names of the block reach one module: the module keeps its parameters
    (the optimizer's), and both settings train alike, bit for bit."""
    results = []
    for rebuild in (False, True):
        net = Tied(rebuild)
        params = list(net.parameters())
        results.append(train(net, images()))
        assert all(a is b for a, b in zip(net.parameters(), params))
        assert all(isinstance(p, nn.Parameter) for p in net.parameters())
    assert_bitwise(*results)


def test_a_weight_shared_with_the_head_differs_only_in_its_gradient_sums_order():
    """A module used by two functions of the sequence and by the head after it: each use's
    gradient is bit for bit the stored network's, and so is the parameter's gradient when the
    sequence uses it once; used twice, the rebuild hands autograd the sum of its two uses,
    which autograd adds to the head's, ``h + (g1 + f0)``, where the stored network's autograd
    adds each use as it comes, ``(h + g1) + f0``: float addition of three numbers depends on
    their grouping, so the two differ in the last bits (docs/api/reversible.md)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)

    def grads(f0: nn.Module, g1: nn.Module, head: nn.Module, rebuild: bool) -> list:
        torch.manual_seed(1)  # the same unshared weights each time
        blocks = [Coupling(f0, nn.Linear(8, 8)), Coupling(nn.Linear(8, 8), g1)]
        y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=rebuild)
        (head(y1 + y2) ** 2).mean().backward()
        return [m.weight.grad for m in (f0, g1, head)]

    shared = nn.Linear(8, 8)
    apart = [copy.deepcopy(shared) for _ in range(3)]  # one copy per use
    f0, g1, h = grads(*apart, rebuild=False)
    once = copy.deepcopy(shared)
    for rebuild in (False, True):
        for p in (*shared.parameters(), *once.parameters()):
            p.grad = None
        got = grads(shared, shared, shared, rebuild)[0]
        assert torch.equal(got, h + (g1 + f0) if rebuild else (h + g1) + f0)
        assert torch.equal(grads(once, copy.deepcopy(shared), once, rebuild)[0], h + f0)
    assert not torch.equal(h + (g1 + f0), (h + g1) + f0)  # the case this test is about


def test_a_parameter_hook_fires_once_per_backward():
    for rebuild in (False, True):
        stored, rebuilt = twins()
        net = rebuilt if rebuild else stored
        calls = []
        net.blocks[1].g[2].weight.register_hook(lambda g: calls.append(g))
        default_loss(net(images())).backward()
        assert len(calls) == 1, rebuild


def test_errors_are_one_line():
    stored, rebuilt = twins()
    x1 = torch.randn(2, 4, 8, 8)
    with pytest.raises(ValueError, match="one shape") as err:
        reversible_sequence(rebuilt.blocks, x1, x1[:, :2])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="requires grad") as err:
        reversible_sequence(rebuilt.blocks, x1, x1, torch.ones(1, requires_grad=True))
    assert "\n" not in str(err.value)
    out = rebuilt(images())
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice") as err:
        out.sum().backward()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_function_changing_the_shape_is_refused_in_one_line(rebuild):
    """``f`` and ``g`` return their input's shape (a residual branch): a broadcast output, which
    the stored network would add and the rebuild could not take off in backward, is refused in
    the forward alike with and without the rebuild."""
    x = torch.randn(4, 8, requires_grad=True)
    for f in (nn.Linear(8, 1), nn.Linear(8, 16)):
        blocks = [Coupling(f, nn.Linear(8, 8))]
        with pytest.raises(ValueError, match=r"shape \(4, (1|16)\) for .* \(4, 8\)") as err:
            reversible_sequence(blocks, x, x * 2, rebuild=rebuild)
        assert "\n" not in str(err.value)



def test_a_second_derivative_through_the_rebuild_is_refused_in_one_line():
    """The rebuild gives first-order gradients, the same under ``create_graph=True`` as the
    stored network's; differentiating them again (a gradient penalty) is refused in one line
    that says what to use instead, where the stored network computes it."""
    stored, rebuilt = twins()
    got = []
    for net in (stored, rebuilt):
        x = images().requires_grad_()
        torch.manual_seed(3)
        grad, = torch.autograd.grad(default_loss(net(x)), x, create_graph=True)
        got.append(grad.detach())
        if net is stored:
            grad.square().sum().backward()
            continue
        with pytest.raises(RuntimeError, match="first-order gradients only") as err:
            grad.square().sum().backward()
        assert "\n" not in str(err.value) and "rebuild=False" in str(err.value)
    assert torch.equal(*got)


class Scaled(nn.Module):
    """A residual function that multiplies by ``scale``: a tensor it does not own (another
    module's parameter), against the contract of a block."""

    def __init__(self, scale: torch.Tensor, width: int = 8) -> None:
        super().__init__()
        self.lin, self.__dict__["scale"] = nn.Linear(width, 8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_function_using_a_tensor_not_of_its_block_is_refused_in_one_line():
    """The rebuild gives gradients to the blocks' parameters and the streams only: a tensor
    requiring grad that ``f`` or ``g`` takes from elsewhere would get none, silently, where
    the stored network gives it one; the rebuild's backward refuses it in one line."""
    torch.manual_seed(0)
    outside = nn.Parameter(torch.ones(8))
    x = torch.randn(4, 8, requires_grad=True)
    for blocks in ([Coupling(Scaled(outside), nn.Linear(8, 8))],
                   [Coupling(nn.Linear(8, 8), Scaled(outside * 2))]):
        y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=False)
        (y1 * y2).sum().backward()
        assert outside.grad is not None  # the stored network's gradient
        y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=True)
        with pytest.raises(RuntimeError, match="not one of the block's parameters") as err:
            (y1 * y2).sum().backward()
        assert "\n" not in str(err.value)



def test_a_parameter_changed_between_forward_and_backward_is_refused_in_one_line():
    """The rebuild recomputes the blocks with their parameters as they are at backward: one
    changed in place since the forward (an optimizer step between them) would rebuild other
    inputs than the forward's and give wrong gradients silently; it is refused in one line, as
    the stored network's backward refuses it."""
    stored, rebuilt = twins()
    for net in (stored, rebuilt):
        out = net(images())
        with torch.no_grad():
            net.blocks[1].g[2].weight.mul_(1.5)
        with pytest.raises(RuntimeError, match="modified by an inplace|modified in place") as err:
            default_loss(out).backward()
    assert "\n" not in str(err.value) and "only after backward" in str(err.value)


# -- torch.compile --------------------------------------------------------------------------------
def test_compiled_rebuild_breaks_the_graph_once_and_trains_like_eager_stored():
    """The rebuilding Function runs eagerly (a graph break: its backward recomputes the forward
    and runs the autograd engine on it); the stem and head compile around it. Compared in
    float64 as every compiled path (compiled kernels round differently); BatchNorm buffers and
    the step count exactly."""
    stored, rebuilt = twins(torch.float64)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(copy.deepcopy(rebuilt))(images(torch.float64))
    assert explained.graph_break_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(rebuilt, backend="aot_eager")
    x = images(torch.float64)
    for ref, got in zip(train(stored, x), train(compiled, x)):
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a)
    for (name, a), b in zip(stored.state_dict().items(), rebuilt.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name)
    assert rebuilt.blocks[2].g[4].num_batches_tracked.item() == 3


_FULLGRAPH = """
import torch
from torch import nn
from zoo.reversible import Coupling, reversible_sequence
blocks = nn.ModuleList(Coupling(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2))
try:
    torch.compile(lambda x: reversible_sequence(blocks, x, x)[0], backend="eager",
                  fullgraph=True)(torch.randn(2, 4, requires_grad=True))
except Exception as err:
    print(err)
"""


def test_compiled_rebuild_with_fullgraph_says_why_it_breaks():
    """``fullgraph=True`` refuses the rebuild's graph break; Dynamo's message carries the
    reason: what breaks, and what to do instead. In a process of its own: after Dynamo refuses
    a call, the process's Python calls keep their arguments alive longer (torch 2.14), which
    test_a_recomputed_function_alone_holds_its_input would see."""
    res = subprocess.run([sys.executable, "-c", _FULLGRAPH], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1], timeout=600)
    assert re.search(r"rebuild=True .* without fullgraph=True", res.stdout), res.stderr[-2000:]


def test_compiled_stored_network_is_one_graph():
    stored, _ = twins(torch.float64)
    torch._dynamo.reset()
    if zoo_torch.COMPILED_STORED_REVERSIBLE_WRONG:  # torch 2.11: refused in one line
        with pytest.raises(RuntimeError, match=r"^zoo: a reversible network storing its "
                                               r"activations [^\n]* torch other than 2\.11 "):
            torch.compile(stored, backend="aot_eager")(images(torch.float64))
        return
    compiled = torch.compile(copy.deepcopy(stored), backend="aot_eager", fullgraph=True)
    x = images(torch.float64)
    for ref, got in zip(train(stored, x), train(compiled, x)):
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a)


# -- DistributedDataParallel ----------------------------------------------------------------------
def _ddp_worker(rank: int, world: int) -> list:
    """Each DistributedDataParallel setting, stored then rebuilt, on this rank's half batch."""
    x = images()[rank * 2:rank * 2 + 2]
    return [train(DDP(net, **cfg), x, steps=2) for cfg in DDP_CONFIGS for net in twins()]


def test_ddp_two_processes_rebuilt_equals_stored():
    for rank in run_gloo(_ddp_worker):
        for i in range(0, len(rank), 2):
            assert_bitwise(rank[i], rank[i + 1])


# -- a lead unit and stages joined: RevNet's downsampling between two reversible stages --------
class Branch(nn.Module):
    """BN-ReLU, conv(stride), BN-ReLU, conv; ``parts()`` names the first BN-ReLU as the head the
    rebuild makes again (``split_head=False``: it does not)."""

    def __init__(self, c: int, stride: int = 1, split_head: bool = True) -> None:
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, c, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.split_head = split_head

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn1(x))

    def rest(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn2(self.conv1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.pre(x))

    def parts(self) -> tuple | None:
        return (self.pre, self.rest) if self.split_head else None


class Down(nn.Module):
    """A lead unit: ``y1 = f(x2) + pool(x1)``, ``y2 = g(y1) + pool(x2)`` at half resolution."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.f, self.g = Branch(c, stride=2), Branch(c)

    def shortcut1(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool2d(x, 2)

    shortcut2 = shortcut1


class Staged(nn.Module):
    """stem -> reversible stage -> join/split -> lead unit + reversible stage -> head."""

    def __init__(self, width: int = 16, split_heads: bool = True, sources: bool = True) -> None:
        super().__init__()
        c = width // 2
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.stage1 = nn.ModuleList(Coupling(Branch(c, split_head=split_heads),
                                             Branch(c, split_head=split_heads)) for _ in range(2))
        self.down = Down(c)
        self.stage2 = nn.ModuleList([Coupling(Branch(c), Branch(c))])
        self.head = nn.Linear(width, 3)
        self.rebuild, self.sources = False, sources

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.stem(x).chunk(2, dim=1)
        h = join(*reversible_sequence(self.stage1, x1, x2, rebuild=self.rebuild))
        x1, x2 = split(h) if self.sources else h.chunk(2, dim=1)
        y1, y2 = reversible_sequence(self.stage2, x1, x2, rebuild=self.rebuild, lead=self.down)
        return self.head(join(y1, y2).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_lead_unit_between_stages_rebuilds_bit_for_bit(dtype):
    torch.manual_seed(0)
    stored = Staged(width=8).to(dtype)
    rebuilt = copy.deepcopy(stored)
    rebuilt.rebuild = True
    assert_bitwise(train(stored, images(dtype)), train(rebuilt, images(dtype)))
    assert_same_state(stored, rebuilt)
    assert rebuilt.down.f.bn1.num_batches_tracked.item() == 3


def test_spectral_norm_in_a_lead_unit_and_its_stages_is_rebuilt_exactly():
    """As in a sequence's blocks (above), in a lead unit's functions and the stages around it:
    every convolution of the staged network spectral-normed, the rebuilt one converted."""
    torch.manual_seed(0)
    stored = Staged(width=8)
    for conv in [m for m in stored.modules() if isinstance(m, nn.Conv2d)][1:]:  # all but stem
        nn.utils.parametrizations.spectral_norm(conv)
    rebuilt = convert_spectral_norm(copy.deepcopy(stored))
    rebuilt.rebuild = True
    assert_bitwise(train(stored, images()), train(rebuilt, images()))
    assert_same_state(stored, rebuilt)


def test_a_lead_unit_keeps_no_float_copy_and_heads_are_made_again():
    """Exact bytes: the lead's inputs are made again from the first stage's streams, not kept
    as floats beside them (what the forward leaves for backward is two halves lighter), and the
    first BN-ReLU of each branch is made again in backward, not kept through it (the step's
    peak is lower)."""
    x = torch.randn(8, 3, 16, 16)

    def net(**kw: bool) -> Staged:
        torch.manual_seed(0)
        model = Staged(**kw)
        model.rebuild = True
        return model

    def kept(model: Staged) -> int:  # the forward's output held while 16 MiB are allocated
        hold: list = []
        return cpu_peak_bytes(lambda: (hold.append(model(x)), torch.empty(2 ** 22)), (model,))

    halves = x.numel() // 3 * 16 * 4  # both halves of the first stage's output, float32
    assert kept(net(sources=False)) - kept(net()) == halves

    def peak(model: Staged) -> int:
        return train_step_peak(model, x)

    assert peak(net()) < peak(net(split_heads=False))


def test_a_lead_input_is_made_again_only_before_the_stage_below_rebuilds():
    stored, rebuilt = twins()
    x1, x2 = rebuilt.stem(images()).chunk(2, dim=1)
    h = join(*reversible_sequence(rebuilt.blocks, x1, x2))
    a, b = split(h)
    source = source_of(a)
    assert source is not None and torch.equal(source.make(), a)
    assert source_of(split(h.detach())[0]) is None  # a plain tensor has no source
    (a * b).sum().backward()
    with pytest.raises(RuntimeError, match="out of order") as err:
        source.make()
    assert "\n" not in str(err.value)


def test_a_stage_output_changed_in_place_is_not_made_again_from_the_streams():
    """A rebuilt sequence's output, or a split half of its join, changed in place after it was
    made is no longer what its streams make: it has no source, so a lead unit keeps it."""
    from zoo.reversible.sources import Source, join, remember, source_of, split
    from zoo.reversible.grid import grid_for, to_fixed

    grid = grid_for(torch.float32)
    y1, y2 = torch.randn(2, 4), torch.randn(2, 4)
    for y in (y1, y2):
        remember(y, Source(to_fixed(y, grid), grid, torch.zeros(())))
    assert source_of(y1) is not None
    x = join(y1, y2)
    a, b = split(x)
    assert source_of(a) is not None and source_of(b) is not None
    a.mul_(2)  # the halves are views of one tensor and share its version counter
    assert source_of(a) is None and source_of(b) is None
    x2 = join(y1, y2)
    x2.add_(1)
    assert all(source_of(h) is None for h in split(x2))


def test_a_kept_lead_input_changed_in_place_after_the_unit_ran_is_an_error():
    """A lead unit whose inputs have no source keeps them; changed in place before its
    backward, they would be recomputed from the new values: an error in one line instead."""
    torch.manual_seed(0)
    model = Staged(width=8, sources=False)
    model.rebuild = True
    x1, x2 = model.stem(images()).chunk(2, dim=1)
    h = join(*reversible_sequence(model.stage1, x1, x2, rebuild=True))
    a, b = h.chunk(2, dim=1)
    y1, y2 = reversible_sequence(model.stage2, a, b, rebuild=True, lead=model.down)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RuntimeError, match="changed in place") as err:
        (y1.sum() + y2.sum()).backward()
    assert "\n" not in str(err.value)


class Widen(nn.Module):
    """A lead unit whose first output is larger than its inputs (4 -> 8 features, shortcuts pad
    with zeros), so the rebuild recomputes it whole; ``f`` scales by ``scale``, a tensor it
    does not own."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.f, self.g = Scaled(scale, width=4), nn.Linear(8, 8)

    def shortcut1(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x, (2, 2))

    shortcut2 = shortcut1


class ScaledMap(nn.Module):
    """Multiplies a map's channels by ``scale``, a tensor it does not own."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["scale"] = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale[:, None, None]


@pytest.mark.parametrize("whole", [True, False], ids=["recomputed-whole", "undone-by-parts"])
def test_a_lead_unit_using_a_tensor_not_of_its_own_is_refused_in_one_line(whole):
    """A lead unit's backward gives gradients to its own parameters and its inputs only, on
    both of its paths (recomputed whole when its first output is larger than its inputs, else
    one function at a time): a tensor requiring grad that its ``f`` takes from elsewhere would
    get none, silently, where the stored network gives it one; it is refused in one line."""
    torch.manual_seed(0)
    outside = nn.Parameter(torch.ones(8))
    if whole:
        lead, x = Widen(outside), torch.randn(4, 4, requires_grad=True)
        blocks = [Coupling(nn.Linear(8, 8), nn.Linear(8, 8))]
    else:
        lead, x = Down(4), torch.randn(2, 4, 8, 8, requires_grad=True)
        lead.f = nn.Sequential(Branch(4, stride=2), ScaledMap(outside[:4]))
        blocks = [Coupling(Branch(4), Branch(4))]
    y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=False, lead=lead)
    (y1 * y2).sum().backward()
    assert outside.grad is not None  # the stored network's gradient
    y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=True, lead=lead)
    with pytest.raises(RuntimeError, match="not one of the block's parameters") as err:
        (y1 * y2).sum().backward()
    assert "\n" not in str(err.value)


class LetsGo(nn.Module):
    """A residual function that notes, while it is recomputed, whether its input is still held
    by anyone once its first layer has used it (a weak reference outlives the tensor)."""

    def __init__(self, width: int, alive: list[bool]) -> None:
        super().__init__()
        self.lin, self.alive = nn.Linear(width, width), alive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(x)

    def parts(self) -> tuple[None, object]:
        return None, self.rest

    def rest(self, x: torch.Tensor) -> torch.Tensor:
        ref = weakref.ref(x)
        y = self.lin(x)
        del x
        if is_recomputing():
            self.alive.append(ref() is not None)
        return torch.tanh(y)


@pytest.mark.skipif(sys.version_info < (3, 11),
                    reason="older CPython keeps a call's arguments on the caller's stack")
def test_a_recomputed_function_alone_holds_its_input():
    """While the rebuild recomputes F or G, the float view of the stream it runs on is held by
    the function alone (the graph makes it again when backward needs it), so it is let go as
    soon as the function is done with it."""
    torch.manual_seed(0)
    alive: list[bool] = []
    blocks = [Coupling(LetsGo(8, alive), LetsGo(8, alive)) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    y1, y2 = reversible_sequence(blocks, x, x * 2, rebuild=True)
    (y1 * y2).sum().backward()
    assert alive == [False] * 6
