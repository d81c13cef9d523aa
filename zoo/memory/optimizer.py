"""The user's optimizer in a measured step: its state held from the step before, its
``step()`` run after the backward.

A step's peak with an optimizer is that of a training step in the steady state: the optimizer's
state (AdamW: two copies of the parameters, SGD with momentum: one; fused and foreach variants
with the temporaries they allocate) exists before the forward, and ``optimizer.step()`` runs after
the backward, while the gradients are alive. :func:`mirror` makes the same optimizer (its class,
every hyperparameter of every group) over fake copies of the parameters, and
:func:`fill_state` gives it the state one step leaves, so a fake step counts both exactly
(``FakeStep.drop_untrained_state`` then drops what it gave a parameter no step trains).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import _torch

__all__ = ["check_optimizer", "mirror", "fill_state", "state_tensors", "state_bytes",
           "held_bytes"]


def check_optimizer(optimizer: Any, model: torch.nn.Module) -> None:
    """A one-line error unless ``optimizer`` is a ``torch.optim.Optimizer`` over parameters of
    ``model`` (or None)."""
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters, "
                        f"got {type(optimizer).__name__}; e.g. "
                        f"optimizer=torch.optim.AdamW(model.parameters())")
    name = type(optimizer).__name__
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(f"{name}.step needs a closure that runs the forward again, a step "
                        f"planning does not model; plan with the optimizer you step without one "
                        f"(e.g. torch.optim.AdamW), or leave optimizer= out")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError("SparseAdam steps on sparse gradients, which planning does not model "
                        "(its fake step makes dense ones); plan with optimizer=torch.optim.Adam"
                        "(...) over the same parameters, whose state is as large, or leave "
                        "optimizer= out")
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"optimizer holds {foreign} tensor(s) that are not parameters of the "
                         f"model being planned; give the optimizer made over this model's "
                         f"parameters")


def mirror(optimizer: torch.optim.Optimizer, fake_of: dict[int, torch.Tensor]
           ) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyperparameters over the fake parameters
    ``fake_of`` (id of a real parameter -> its fake copy), with no state. A hyperparameter
    given as a one-number tensor (``lr=torch.tensor(0.01)``) is read as its number: a fake
    step has no values to read it from, and its bytes are the same."""
    groups = [{**{k: _number(v) for k, v in g.items() if k != "params"},
               "params": [fake_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: _number(v) for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return type(optimizer)(groups, **defaults)
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        name = type(optimizer).__name__
        raise TypeError(f"optimizer {name} cannot be made again over the planned copies of the "
                        f"parameters as {name}(param_groups, **defaults), as torch.optim's can "
                        f"({type(e).__name__}: {e}); give its __init__ torch's signature "
                        f"(params first), or plan with a torch.optim optimizer of the same "
                        f"state") from None


def _number(value: Any) -> Any:
    """``value``, or the number in it when it is a real one-number tensor (read outside any
    fake mode the caller is in)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return value
    with _torch.disable_current_modes():
        return value.item()


def fill_state(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the state one step leaves: a step on zero gradients, which are then
    dropped (the parameters' values do not matter to a measured step; fake ones have none)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the state ``optimizer`` holds after a step (none for None), counted on a mirror
    over fake parameters: nothing is allocated, ``optimizer`` is left as it is."""
    if optimizer is None:
        return 0
    from .._torch import FakeTensorMode

    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    mode = FakeTensorMode()
    fakes = {i: mode.from_tensor(p.detach()).requires_grad_(p.requires_grad)
             for i, p in params.items()}
    with mode:
        fake = mirror(optimizer, fakes)
        fill_state(fake)
        return held_bytes(fake)


def held_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state ``optimizer`` holds now (each of its tensors once)."""
    return sum(t.untyped_storage().nbytes() for t in state_tensors(optimizer))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state, once."""
    seen: dict[int, torch.Tensor] = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen.setdefault(id(v), v)
    return list(seen.values())
