"""The user's optimizer in a measured step: its state held from the step before, its
``step()`` run after the backward.

A step's peak with an optimizer is that of a training step in the steady state: the optimizer's
state (AdamW: two copies of the parameters, SGD with momentum: one; fused and foreach variants
with the temporaries they allocate) exists before the forward, and ``optimizer.step()`` runs after
the backward, while the gradients are alive. :func:`mirror` makes the same optimizer (its class,
every hyperparameter of every group) over fake copies of the parameters, and
:func:`fill_state` gives it the state one step leaves, so a fake step counts both exactly
(``FakeStep.drop_untrained_state`` then drops what it gave a parameter no step trains).

A loop may step several optimizers (``torch.optim.Muon`` on the hidden weight matrices beside
``AdamW`` on the rest; a GAN's two): ``optimizer=`` then takes a list or tuple of them
(:func:`as_optimizers`), stepped in the given order after the backward, all their states held.
A parameter that requires grad but is in none of them keeps its gradient across steps
(``opt.zero_grad()`` clears only the optimizer's own), so from the second step on the loop holds
it through the forward and backward, as gradient accumulation does (:func:`unstepped`).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Union

import torch

from .. import _torch

__all__ = ["check_optimizer", "as_optimizers", "unstepped", "warn_unstepped", "mirror",
           "fill_state", "state_tensors", "state_bytes", "held_bytes", "Optimizers",
           "unstepped_said", "describe_optimizers"]

Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]
"""What ``optimizer=`` takes: one optimizer, a list or tuple of them, or None."""

_EXAMPLE = ("e.g. optimizer=[torch.optim.Muon(matrices), torch.optim.AdamW(others)] or "
            "optimizer=torch.optim.AdamW(model.parameters())")


def as_optimizers(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer`` as a tuple in stepping order (None: empty), or a one-line error: not an
    optimizer, an empty sequence, one optimizer given twice, two sharing a parameter."""
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if not isinstance(optimizer, (list, tuple)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over the model's parameters "
                        f"or a list or tuple of them, got {type(optimizer).__name__}; {_EXAMPLE}")
    if not optimizer:
        raise ValueError(f"optimizer is an empty {type(optimizer).__name__}: give the "
                         f"optimizers the loop steps, or optimizer=None for none; {_EXAMPLE}")
    for i, o in enumerate(optimizer):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer[{i}] must be a torch.optim.Optimizer, got "
                            f"{type(o).__name__}; {_EXAMPLE}")
    seen: dict[int, int] = {}
    for i, o in enumerate(optimizer):
        if id(o) in seen:
            raise ValueError(f"optimizer[{i}] is optimizer[{seen[id(o)]}] again: a loop steps "
                             f"each optimizer once; give each one once")
        seen[id(o)] = i
    owner: dict[int, int] = {}
    for i, o in enumerate(optimizer):
        for p in {id(p) for g in o.param_groups for p in g["params"]}:
            if p in owner:
                raise ValueError(f"optimizer[{owner[p]}] ({type(optimizer[owner[p]]).__name__})"
                                 f" and optimizer[{i}] ({type(o).__name__}) share a parameter,"
                                 f" which each would step; give each parameter to one optimizer")
            owner[p] = i
    return tuple(optimizer)


def check_optimizer(optimizer: Optimizers, model: torch.nn.Module
                    ) -> tuple[torch.optim.Optimizer, ...]:
    """The optimizers of ``optimizer`` (:func:`as_optimizers`), each checked to be one a step
    can model over parameters of ``model``, or a one-line error."""
    optimizers = as_optimizers(optimizer)
    for o in optimizers:
        _check_one(o, model)
    return optimizers


def _check_one(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """A one-line error unless ``optimizer`` steps parameters of ``model`` as a modelled step
    can (no closure, dense gradients)."""
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


def unstepped(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
              ) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` that require grad but that none of ``optimizers`` steps
    (none when there is no optimizer: then no loop's ``zero_grad`` is modelled)."""
    if not optimizers:
        return []
    stepped = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    return [p for p in model.parameters() if p.requires_grad and id(p) not in stepped]


def warn_unstepped(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                   stacklevel: int = 3) -> None:
    """One warning when some of ``model``'s trainable parameters are in none of
    ``optimizers``: their gradients are never cleared by the optimizers' ``zero_grad``, so the
    loop holds them all step from the second on (and the plan counts them)."""
    left = unstepped(model, optimizers)
    if left:
        nbytes = sum(p.numel() * p.element_size() for p in left)
        warnings.warn(f"{len(left)} parameter(s) ({nbytes:,} B) require grad but no optimizer "
                      f"steps them: their gradients accumulate across steps and are held all "
                      f"step (planned so); freeze them with p.requires_grad_(False) or add them "
                      f"to an optimizer", UserWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def unstepped_said() -> Iterator[None]:
    """:func:`warn_unstepped`'s warning silenced for the duration: for a caller that said it
    once and then plans many times (``largest_batch``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_UNSTEPPED, category=UserWarning)
        yield


_UNSTEPPED = r"\d+ parameter\(s\) \(.*\) require grad but no optimizer steps them"


def describe_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """The optimizers a step runs, in words (a plan's printout)."""
    if not optimizers:
        return "no optimizer"
    if len(optimizers) == 1:
        return f"optimizer {type(optimizers[0]).__name__}"
    names = ", ".join(type(o).__name__ for o in optimizers)
    return f"optimizers {names} (stepped in that order)"


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


def state_bytes(optimizer: Optimizers) -> int:
    """Bytes of the state ``optimizer`` (one or several: :func:`as_optimizers`) holds after a
    step (none for None), counted on mirrors over fake parameters: nothing is allocated, the
    optimizers are left as they are."""
    from .._torch import FakeTensorMode

    total = 0
    for opt in as_optimizers(optimizer):
        params = {id(p): p for g in opt.param_groups for p in g["params"]}
        mode = FakeTensorMode()
        fakes = {i: mode.from_tensor(p.detach()).requires_grad_(p.requires_grad)
                 for i, p in params.items()}
        with mode:
            fake = mirror(opt, fakes)
            fill_state(fake)
            total += held_bytes(fake)
    return total


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
