"""zoo.checkpoint inside what users wrap around it: torch.func.functional_call, saved-tensor
hooks (save_on_cpu), attention with dropout, autocast with a GradScaler, and regions that
change their own saved tensors in place. Each case: the plain model bit for bit, or a one-line
error where a recompute cannot be the forward it replays."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import zoo


class _Blocks(nn.Module):
    """A model whose forward checkpoints its own blocks, as zoo's models and trainers do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = zoo.checkpoint(block, x)
        return x


@pytest.mark.parametrize("fast_weights", ["leaves", "computed"])
def test_functional_call_with_other_parameters_is_refused_in_one_line(fast_weights):
    """``torch.func.functional_call(model, params, x)`` swaps the parameters in only while the
    forward runs; the recompute, in backward, would read the module's own parameters and give
    gradients of another function without a word (torch's non-reentrant checkpoint does).
    The region notices the recompute saving a module's parameter where the forward saved
    another tensor, and says so. MAML's fast weights ("computed") are the classic case."""
    model = _Blocks()
    own = dict(model.named_parameters())
    if fast_weights == "leaves":
        params = {k: (v.detach() * 1.1).requires_grad_() for k, v in own.items()}
        leaves = list(params.values())
    else:
        leaves = list(own.values())
        params = {k: v - 0.1 * torch.ones_like(v) for k, v in own.items()}
    y = torch.func.functional_call(model, params, (torch.randn(3, 8),))
    with pytest.raises(RuntimeError, match=r"^zoo.checkpoint: [^\n]*functional_call") as e:
        torch.autograd.grad(y.pow(2).sum(), leaves)
    assert "\n" not in str(e.value)


def test_functional_call_with_the_modules_own_parameters_is_exact():
    """Handing the module its own parameters (a common trainer idiom) stays exact."""
    model = _Blocks()
    params = dict(model.named_parameters())
    x = torch.randn(3, 8)
    got = torch.autograd.grad(
        torch.func.functional_call(model, params, (x,)).pow(2).sum(), list(params.values()))
    plain = x
    for block in model.blocks:
        plain = block(plain)
    want = torch.autograd.grad(plain.pow(2).sum(), list(params.values()))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_functional_call_inside_the_region_is_exact_with_fast_weights():
    """The way the refusal names: ``functional_call`` inside the checkpointed function, so the
    recompute gets the same parameters as the forward (MAML's computed fast weights)."""
    model = _Blocks()
    own = list(model.parameters())
    x = torch.randn(3, 8)
    results = []
    for region in (lambda f, *a: f(*a), zoo.checkpoint):
        fast = {k: v - 0.1 * v.detach().sin() for k, v in model.named_parameters()}
        h = x
        for i, block in enumerate(model.blocks):
            mine = {k.split(".", 2)[2]: v for k, v in fast.items() if k.startswith(f"blocks.{i}.")}
            h = region(lambda p, t, b=block: torch.func.functional_call(b, p, (t,)), mine, h)
        results.append((h, torch.autograd.grad(h.pow(2).sum(), own)))
    (plain, plain_grads), (ours, our_grads) = results
    assert torch.equal(plain, ours)
    assert all(torch.equal(g, w) for g, w in zip(our_grads, plain_grads))


@pytest.mark.parametrize("after", ["output", "inside"])
def test_a_saved_tensor_changed_in_place_later_in_the_region_is_refused_as_in_plain(after):
    """``sigmoid_`` saves its result; a later in-place op in the region overwrites it. The plain
    model's backward refuses that ("modified by an inplace operation"); a region's recompute
    replays the overwrite, so without a check sigmoid's backward would read twice its output
    and give wrong gradients without a word (torch's non-reentrant checkpoint does)."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def fn(t):
        y = lin(t).sigmoid_().mul_(2)
        return y if after == "output" else y.exp()

    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fn(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"^zoo.checkpoint: [^\n]*modified in place") as e:
        zoo.checkpoint(fn, x).sum().backward()
    assert "\n" not in str(e.value)


def _hooked_step(region, hooks):
    """One step of three checkpointed blocks under ``hooks``; what the hooks were handed."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Dropout(0.2)) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)
    handed = []
    with hooks(handed):
        h = torch.tanh(x)
        inputs = []
        for block in blocks:
            inputs.append(h)
            h = region(block, h)
    h.pow(2).sum().backward()
    grads = [x.grad] + [p.grad for b in blocks for p in b.parameters()]
    return h, grads, handed, inputs


def _recording(handed):
    def pack(t):
        handed.append(t)
        return ("boxed", t.clone())
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box[1])


@pytest.mark.parametrize("hooks", ["own", "save_on_cpu"])
def test_outer_saved_tensor_hooks_get_the_regions_inputs_and_the_step_is_exact(hooks):
    """``with save_on_cpu(): for block in blocks: x = checkpoint(block, x)`` is how people move
    what a checkpointed model keeps (the regions' inputs) to host memory. torch's checkpoint
    hands its inputs to the enclosing hooks; the zoo's region does too, else on a GPU they would
    stay in its memory. Same outputs and gradients as the plain step under the same hooks."""
    make = _recording if hooks == "own" else \
        lambda handed: torch.autograd.graph.save_on_cpu()
    plain = _hooked_step(lambda f, t: f(t), make)
    ours = _hooked_step(zoo.checkpoint, make)
    assert torch.equal(plain[0], ours[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], ours[1]))
    if hooks == "own":
        handed, inputs = ours[2], ours[3]
        for t in inputs:  # every region's input went through the user's pack hook
            assert any(h is t for h in handed)


class _PythonDropPath(nn.Module):
    """Stochastic depth drawn with Python's ``random``, as some training scripts write it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if random.random() < 0.5 else x + self.lin(x).relu()


def test_python_random_branch_that_changes_on_recompute_is_refused_in_one_line():
    """A region replays torch's generators, not Python's ``random`` or NumPy's (saving
    ``random.getstate()`` costs about as much as a whole small region's forward): the recompute
    draws anew. Where its branch saves other tensors than the forward's, backward raises in one
    line instead of giving another function's gradients."""
    seed = next(s for s in range(100) if (lambda r: (r.random() < 0.5) != (r.random() < 0.5))(
        random.Random(s)) and random.Random(s).random() >= 0.5)  # forward: the block; then skip
    layer = _PythonDropPath()
    random.seed(seed)
    y = zoo.checkpoint(layer, torch.randn(2, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"^zoo.checkpoint: [^\n]*not deterministic") as e:
        y.sum().backward()
    assert "\n" not in str(e.value)


def _step(model: nn.Module, region, x: torch.Tensor, amp: bool = False):
    """Two SGD steps (GradScaler and clip_grad_norm_ under ``amp``); what a step leaves."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    torch.manual_seed(1)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = region(model, x)
        opt.zero_grad()
        scaler.scale(y.float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    return [y, norm, torch.get_rng_state(), *model.parameters(), *model.buffers()]


class _Attention(nn.Module):
    """SDPA with dropout_p, then a TransformerEncoderLayer (MultiheadAttention with dropout)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 6, 3, 4, 4).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return self.layer(y.transpose(1, 2).reshape(2, 6, 16))


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.body(x))


@pytest.mark.parametrize("build, amp", [(_Attention, False), (_Norm, True)],
                         ids=["sdpa-and-multihead-dropout", "bf16-autocast-gradscaler-clip"])
def test_user_layers_train_as_the_plain_model(build, amp):
    """Attention dropout (SDPA's ``dropout_p``, ``nn.MultiheadAttention``) draws the same masks
    on recompute; a bf16 autocast step with GradScaler and clip_grad_norm_ is the plain step."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    plain = _step(build().train(), lambda f, t: f(t), x, amp)
    torch.manual_seed(0)
    ours = _step(build().train(), zoo.checkpoint, x, amp)
    assert all(torch.equal(a, b) for a, b in zip(plain, ours))
