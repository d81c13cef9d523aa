"""Spectral norm under zoo.checkpoint: its power iteration advances the layer's ``u`` and ``v``
in every train-mode forward, so a recompute that ran it again would compute another sigma than
the forward did (other gradients) and advance ``u`` and ``v`` twice per step. Converted layers
(``zoo.nn.convert_spectral_norm``, done by ``zoo.set_grad_checkpointing`` and by
``checkpoint_module``, so by ``zoo.plan``'s plans) recompute with the
``u`` and ``v`` their forward started from: gradients, ``u`` and ``v`` bit for bit the plain
model's, also where a layer runs twice before the backward (a GAN's discriminator on the real and
the fake batch), in nested regions, with the older hook-based ``torch.nn.utils.spectral_norm``
and compiled."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import zoo
from zoo.blocks import checkpoint_module
from zoo.planner import BudgetTooSmallError
from zoo.planner.step_sweep import real_whole_peak, trains_like_plain
from zoo.nn import convert_spectral_norm, restore_spectral_norm


def discriminator(old_style: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.utils.spectral_norm if old_style else parametrizations.spectral_norm
    return nn.Sequential(*[nn.Sequential(norm(nn.Linear(16, 16)), nn.LeakyReLU(0.2))
                           for _ in range(3)], norm(nn.Linear(16, 1)))


def checkpointed(model: nn.Module, nested: bool = False) -> nn.Module:
    """Each block and the head a zoo.checkpoint region (nested: the first two blocks also inside
    one)."""
    convert_spectral_norm(model)
    for layer in model:
        checkpoint_module(layer)
    if nested:
        model[0] = checkpoint_module(nn.Sequential(model[0], model[1]))
        model[1] = nn.Identity()
    return model


def gan_steps(model: nn.Module, twice: bool, call: nn.Module | None = None,
              steps: int = 3) -> list[torch.Tensor]:
    """SGD steps of a discriminator loss; ``twice``: on a real and a fake batch, both forwards
    before the one backward; ``call``: the forward to run (a compiled ``model``). Returns the
    gradients of the last step."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    call = model if call is None else call
    for _ in range(steps):
        real, fake = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = call(real).mean()
        if twice:
            loss = loss - call(fake).mean()
        loss.backward()
        opt.step()
    return [p.grad.clone() for p in model.parameters()]


def assert_same(plain: nn.Module, ckpt: nn.Module, twice: bool) -> None:
    grads = gan_steps(plain, twice), gan_steps(ckpt, twice)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    for (name, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), name  # weights and every u and v


@pytest.mark.parametrize("old_style", [False, True], ids=["parametrization", "hook"])
@pytest.mark.parametrize("twice", [False, True], ids=["once", "real-and-fake"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_spectral_norm_recomputes_with_the_forwards_u_and_v(old_style, twice, nested):
    plain = discriminator(old_style)
    assert_same(plain, checkpointed(copy.deepcopy(plain), nested), twice)


def test_set_grad_checkpointing_converts_spectral_norm_and_enable_false_restores_it():
    plain = discriminator()
    model = zoo.set_grad_checkpointing(copy.deepcopy(plain), modules=nn.Sequential)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "cp_SpectralNorm" in kinds
    assert_same(plain, model, twice=True)
    zoo.set_grad_checkpointing(model, enable=False)
    assert {type(m) for m in model.modules()} == {type(m) for m in plain.modules()}
    assert model.state_dict().keys() == plain.state_dict().keys()


def test_converting_keeps_state_and_restoring_gives_the_original_classes():
    for old_style in (False, True):
        model = discriminator(old_style)
        state = copy.deepcopy(model.state_dict())
        convert_spectral_norm(model)
        twins = [x for m in model.modules() for x in (m, *m._forward_pre_hooks.values())
                 if type(x).__name__.startswith("cp_SpectralNorm")]
        assert len(twins) == 4
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        restore_spectral_norm(model)
        assert model.state_dict().keys() == state.keys()
        assert all(type(h).__name__ == "SpectralNorm" for m in model.modules()
                   for h in m._forward_pre_hooks.values()) or not old_style
        assert not any(type(m).__name__.startswith("cp_") for m in model.modules())


def test_a_compiled_checkpointed_spectral_norm_trains_as_eager_plain():
    """The power iteration writes the layer's buffers inside the region, which Dynamo refuses
    inside any checkpoint: each region runs eagerly inside torch's checkpoint (Dynamo's
    fallback), and its recompute starts from the state its forward recorded: bit for bit the
    eager plain model, a layer run twice before the backward included."""
    plain = discriminator()
    model = checkpointed(copy.deepcopy(plain))
    compiled = torch.compile(model, backend="aot_eager")
    grads = gan_steps(plain, True), gan_steps(model, True, compiled)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    torch._dynamo.reset()


class CallsOneRegionTwice(nn.Module):
    """A forward checkpointing the same module itself, on two batches: one function for both."""

    def __init__(self) -> None:
        super().__init__()
        self.block = discriminator()

    def forward(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return zoo.checkpoint(self.block, real).mean() - zoo.checkpoint(self.block, fake).mean()


def test_a_compiled_region_run_twice_with_one_function_before_its_recompute_warns():
    """Dynamo's eager fallback finds a forward's record by the function torch's checkpoint keeps
    for the recompute; one function for two forwards cannot say which record is whose."""
    model = CallsOneRegionTwice()
    convert_spectral_norm(model)
    loss = torch.compile(model, backend="aot_eager")(torch.randn(4, 16), torch.randn(4, 16))
    with pytest.warns(UserWarning, match="twice with one function before its recompute"):
        loss.backward()
    torch._dynamo.reset()


def test_a_plan_of_a_spectral_normed_model_is_exact_and_trains_as_plain():
    """zoo.plan checkpoints blocks through ``checkpoint_module``, which converts their spectral
    norms: each plan's predicted peak is its real step's, and it trains as the plain model."""
    sn = parametrizations.spectral_norm
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(sn(nn.Linear(64, 64)), nn.LeakyReLU(0.2))
                            for _ in range(6)], sn(nn.Linear(64, 1)))
    x = torch.randn(16, 64)
    with pytest.raises(BudgetTooSmallError) as e:
        zoo.plan(plain, x, 1, optimizer=torch.optim.AdamW(plain.parameters()), apply=False)
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters())
    plan = zoo.plan(model, x, (e.value.smallest + e.value.plain) // 2, optimizer=opt)
    assert plan.checkpointed
    make_opt = lambda m: torch.optim.AdamW(m.parameters())  # noqa: E731
    assert trains_like_plain(copy.deepcopy(plain), copy.deepcopy(model), x, make_opt, "fp32")
    assert real_whole_peak(model, x, opt, "fp32") == plan.predicted_peak <= plan.budget
