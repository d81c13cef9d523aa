"""A planning or a card prediction that speaks to the user in one line: torch's fake-tensor log kept quiet, and a batch
the model cannot run on said as what it is.

Planning and ``predict_step`` run the model under ``FakeTensorMode``. When an op fails there (a batch of the wrong
shape for the model), torch's fake-tensor module logs the whole failure with its traceback
before raising (``failed while attempting to run meta for aten.mm.default``): about twenty lines
the user did not ask for, about an op they did not call. :func:`fake_logs_quiet` holds that log
back for the duration and turns the failure into one line naming the batch.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch import nn

from .. import _torch
from .inputs import Batch

__all__ = ["fake_logs_quiet", "logger_off", "BatchError"]

_FAKE_LOG = "torch._subclasses.fake_tensor"


class BatchError(ValueError):
    """The model does not run on the batch it was planned with."""


@contextlib.contextmanager
def logger_off(name: str) -> Iterator[None]:
    """torch's logger ``name`` off for the duration, as it was after."""
    log = logging.getLogger(name)
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


@contextlib.contextmanager
def fake_logs_quiet(model: nn.Module, batch: Batch) -> Iterator[None]:
    """The fake-tensor log off for the duration (module docstring); a ``RuntimeError`` raised by
    the model's step (torch's own class, not a subclass such as an out-of-memory error) becomes a one-line :class:`BatchError` (a ``ValueError``) naming the
    model, the batch's shapes and torch's own first line."""
    try:
        with logger_off(_FAKE_LOG):
            yield
    except _torch.ValueReadOnFake as e:  # .item(), a tensor in an `if`: values a fake has not
        raise BatchError(f"{type(model).__name__}'s step reads a tensor's value ({e}: .item(), "
                         f"a tensor as a Python bool or number), which planning cannot: its "
                         f"tensors are fake, shapes without values; keep value reads out of "
                         f"the forward and loss_fn") from None
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, _torch.DevicesMixedOnFake) or _TWO_DEVICES in first:
            raise BatchError(f"{type(model).__name__} and its batch {batch.describe()} are not "
                             f"on one device: {first}; move the batch to the model's device, "
                             f"as training will") from None
        if type(e) is not RuntimeError:  # an out-of-memory error and its kind are not the batch's
            raise
        raise BatchError(f"{type(model).__name__} does not run on the batch {batch.describe()}: "
                         f"{first}; pass a batch the model takes, as training will") from None


# how a torch older than FakeTensorDeviceMismatchError says an op's tensors are on two devices
_TWO_DEVICES = "found two different devices"
