"""The training step every measurement takes: forward and loss, backward, and the optimizer's step
when there is one.

The planner's fake steps, the benchmarks and the tests all measure this one step, so their
figures are of the same thing: ``loss = loss_fn(model(*batch))`` (under the step's autocast,
:mod:`.precision`), ``loss.backward()`` in train mode from fresh (``None``) gradients, then
``optimizer.step()`` when one is given (:mod:`.optimizer`: its state held from the step before).
The model's output is dropped before the backward, as the Hugging Face ``Trainer`` and
Lightning's ``training_step`` do (a loop that keeps it holds it through the backward); the loss
is held until ``optimizer.step()`` ends, as every loop that logs it does (the ``Trainer``'s
``tr_loss_step``): where the optimizer's step is the peak (AdamW's foreach temporaries, a small
batch), its bytes are in it (4 for a float32 loss). The batch is read by
:class:`~.inputs.Batch`: a tensor or a dataclass, a tuple of positional arguments or a dict of
keyword arguments, with tensors nested at any depth. The loss is the output's own ``loss`` when it
carries one (a Hugging Face model given ``labels``), else a mean of squares
(:func:`default_loss`), unless ``loss_fn`` says.

Gradient accumulation (``accumulate=k``) is the loop that steps the optimizer once per ``k``
micro-batches: ``loss = loss_fn(model(mb)) / k; loss.backward()`` for each, then
``optimizer.step()`` (:func:`accumulated_backward`). From the second micro-batch on every
gradient is held through the forward and the backward (autograd adds each new gradient into the
held one), so its peak is above a single step's.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from .inputs import Batch
from .optimizer import Optimizers, as_optimizers
from .precision import Precision, forward_precision, scale_loss, step_precision

__all__ = ["default_loss", "forward_loss", "backward", "train_step", "loss_source",
           "loss_used", "check_accumulate", "accumulated_backward"]

_LOSS_USED: ContextVar[str] = ContextVar("zoo_loss_used", default="mean of squares")


def _own_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def default_loss(output: Any) -> torch.Tensor:
    """The output's own ``loss`` when it carries one (a Hugging Face ``ModelOutput`` of a model
    given ``labels``); else ``square().mean()`` of the output in float32: of its first element
    for a tuple or list, of its first tensor for a ``ModelOutput`` (the last hidden state)."""
    own = _own_loss(output)
    if own is not None:
        return own
    out = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(out, torch.Tensor) and hasattr(out, "values"):  # Hugging Face ModelOutput
        out = next(v for v in out.values() if isinstance(v, torch.Tensor))
    return out.float().square().mean()


def loss_source(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> str:
    """Which loss a step of this ``output`` trains on, in words (for a plan's printout)."""
    if loss_fn is not None and loss_fn is not default_loss:
        return f"the given loss_fn ({getattr(loss_fn, '__name__', type(loss_fn).__name__)})"
    return "the output's own loss" if _own_loss(output) is not None else "mean of squares"


def forward_loss(model: Callable[..., Any], batch: Any,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """The step's loss as the user's loop holds it: ``loss_fn(model(*batch))`` under the step's
    autocast, unscaled (:func:`backward` scales it for fp16); the output is not kept."""
    with forward_precision():
        output = Batch.of(batch).call(model)
        loss = (loss_fn or default_loss)(output)
    source = loss_source(output, loss_fn)
    _check_scalar(loss, source)
    _LOSS_USED.set(source)
    return loss


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()``, from the loss times a ``GradScaler``'s scale for fp16
    (``scaler.scale(loss).backward()``: the scaled loss lives for the backward only)."""
    scale_loss(loss).backward()


def check_accumulate(accumulate: Any) -> int:
    """``accumulate`` (micro-batches per optimizer step: a whole number, 1 or more) as an int, or
    a one-line error."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral):
        raise TypeError(f"accumulate must be the number of micro-batches per optimizer step, a "
                        f"whole number such as 4, got {type(accumulate).__name__} "
                        f"{accumulate!r}")
    if accumulate < 1:
        raise ValueError(f"accumulate must be 1 or more micro-batches per optimizer step (1: "
                         f"no accumulation), got {accumulate}")
    return int(accumulate)


def accumulated_backward(model: Callable[..., Any], batches: Sequence[Any],
                         loss_fn: Callable[[Any], torch.Tensor] | None = None,
                         accumulate: int = 1, after: Callable[[], None] | None = None
                         ) -> torch.Tensor:
    """The forward and backward of one optimizer step that accumulates ``accumulate``
    micro-batches into the same gradients, as the user's loop runs them: for each of
    ``batches`` (the micro-batches, in order; fewer than ``accumulate`` where the caller
    extrapolates the rest), ``loss = forward_loss(...) / accumulate; backward(loss)``, so the
    loss before is held until the next one is made (Python rebinds ``loss`` then). Returns the
    last micro-batch's loss, which the caller holds through ``optimizer.step()``.
    ``accumulate=1`` is the single step: its loss undivided. ``after``: called after each
    micro-batch's backward."""
    for batch in batches:
        loss = forward_loss(model, batch, loss_fn)
        if accumulate != 1:
            loss = loss / accumulate
        backward(loss)
        if after is not None:
            after()
    return loss


def _check_scalar(loss: Any, source: str) -> None:
    """A step's backward starts from one number that requires grad: a loss that is not is said
    as the loss's fault in one line (torch's errors, "grad can be implicitly created only for
    scalar outputs", "element 0 of tensors does not require grad", would blame the batch)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        raise ValueError(f"the step's loss ({source}) does not require grad: it reaches no "
                         "parameter that trains; give the model trainable parameters, and "
                         "keep the graph in loss_fn (no .detach())")
    got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
           else type(loss).__name__)
    raise ValueError(f"the step's loss ({source}) is {got}, not one number; "
                     "reduce it to a scalar, e.g. loss_fn=lambda out: F.cross_entropy(out, y)")


def loss_used() -> str:
    """The loss the last step measured here trained on, in words (:func:`loss_source`)."""
    return _LOSS_USED.get()


def train_step(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               forward: Callable[..., Any] | None = None,
               optimizer: Optimizers = None,
               precision: Precision | None = None, accumulate: int = 1
               ) -> Callable[[], None]:
    """One training step of ``model`` on the batch ``x`` as a call, as a loop runs it:
    ``loss = forward_loss(...)``, its backward, then with ``optimizer`` (one, or a list or tuple)
    each one's ``step()`` in that order and each one's ``zero_grad()``, the loss held until the
    step ends as a training loop holds it. Gradients start reset to None: the model's without
    an optimizer, else the optimizers' parameters' only, so a trainable parameter none of them
    steps accumulates its gradient from call to call, as in the loop. ``accumulate``: that many
    micro-batches of ``x``'s shapes accumulated before the optimizers' step
    (:func:`accumulated_backward`: ``x`` and copies of it, made here, as a list of micro-batches
    holds them). ``model`` is put in train mode here, once (not in the step, whose host time is
    measured). ``forward``: what to call instead of ``model`` (a compiled or wrapped model whose
    parameters are ``model``'s); ``loss_fn``: :func:`default_loss` unless given;
    ``precision``: the autocast to run the forward in (default: the caller's when the step is
    made)."""
    forward = model if forward is None else forward  # no truth test: a compiled module has none
    batch = Batch.of(x)
    precision = Precision.ambient() if precision is None else precision
    accumulate = check_accumulate(accumulate)
    batches = [batch, *(batch.map(lambda t: t.detach().clone().requires_grad_(t.requires_grad))
                        for _ in range(accumulate - 1))]
    optimizers = as_optimizers(optimizer)
    model.train()

    def step() -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if not optimizers:
            model.zero_grad(set_to_none=True)
        with step_precision(precision):
            loss = accumulated_backward(forward, batches, loss_fn, accumulate)
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        del loss

    return step
