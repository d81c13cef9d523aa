"""torch.utils.checkpoint's keywords, as :func:`zoo.checkpoint` understands them.

``zoo.checkpoint`` is a drop-in for ``torch.utils.checkpoint.checkpoint``: libraries hand it the
keywords they hand torch's (Hugging Face's ``gradient_checkpointing_kwargs``, FSDP's wrappers,
timm). What each one means for a zoo region:

* ``use_reentrant``: accepted and ignored. The zoo's region is always non-reentrant (saved-tensor
  hooks); the reentrant variant is the one that trains nothing when no input requires grad
  and runs a nested backward per region (which made nn.DataParallel several times slower, as
  reported in the PyTorch forum). No warning when it is omitted.
* ``preserve_rng_state=False``: no RNG stash and no replay (dropout in the region then draws new
  numbers on recompute, exactly as with torch's checkpoint), and no CUDA device is queried for
  the region. For a region that draws no random number it changes nothing but the region's
  cost: the zoo's DenseNet and ResNet regions (BatchNorm, ReLU, convolutions, pooling) and its
  transformer blocks without active dropout or stochastic depth pass it.
* ``context_fn``: a callable returning two context managers; the first is entered around the
  forward, the second around each recompute, inside the zoo's own contexts (RNG, autocast, the
  normalisation guard), which therefore still apply.
* ``determinism_check``: ``"default"`` compares each recomputed saved tensor's shape with the
  forward's; ``"none"`` skips that comparison. The number of saved tensors is always compared.
* ``debug=True`` (or ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)``): the
  non-determinism errors also list the ATen ops the forward and the recompute ran, in order.
* ``early_stop`` (and ``torch.utils.checkpoint.set_checkpoint_early_stop``, which takes
  precedence as in torch): ``False`` runs every recompute to the end of the region and makes a
  recompute that saves more tensors than the forward an error.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.utils import checkpoint as torch_checkpoint

from .. import _torch
from .._torch import TorchDispatchMode

DETERMINISM_CHECKS = ("default", "none")


class Both:
    """Enter several context managers as one (torch's context_fn returns exactly two)."""

    def __init__(self, *contexts: Any):
        self.contexts = contexts
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> Both:
        for c in self.contexts:
            self.stack.enter_context(c)
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self.stack.__exit__(*exc)


class OpLog(TorchDispatchMode):
    """Records the ATen ops run under it (``debug=True``): what the forward and recompute did."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Options:
    """What torch's keywords ask of one region. :data:`DEFAULT` when none is given."""

    __slots__ = ("preserve_rng", "contexts", "check_shapes", "early_stop", "logs")

    def __init__(self, preserve_rng: bool = True, contexts: tuple[Any, Any] | None = None,
                 check_shapes: bool = True, early_stop: bool = True,
                 logs: tuple[OpLog, OpLog] | None = None):
        self.preserve_rng, self.contexts = preserve_rng, contexts
        self.check_shapes, self.early_stop, self.logs = check_shapes, early_stop, logs

    def debug_report(self) -> str:
        """The op logs of ``debug=True`` as lines to append to an error ('' without debug)."""
        if self.logs is None:
            return ""
        forward, recompute = (", ".join(log.ops) or "(none)" for log in self.logs)
        return (f"\nOps the forward ran (debug=True): {forward}"
                f"\nOps the latest recompute ran: {recompute}")


DEFAULT = Options()
#: The Options of ``preserve_rng_state=False`` alone: a region that draws no random number (a zoo
#: model's BN-ReLU-conv regions) asks for it on every call, so it is shared too.
NO_RNG = Options(preserve_rng=False)


def options(preserve_rng_state: bool, context_fn: Callable[[], Any] | None,
            determinism_check: str, debug: bool, early_stop: bool | None) -> Options:
    """Check torch's keywords and resolve torch's global switches into one region's Options.

    Called once per checkpoint call; with no keyword and no global switch set it returns the
    shared :data:`DEFAULT` after a few comparisons, and with ``preserve_rng_state=False`` alone
    the shared :data:`NO_RNG` (the per-region cost stays that of the lean region).
    """
    global_stop = _torch.checkpoint_early_stop()
    global_debug = getattr(torch_checkpoint, "_checkpoint_debug_enabled", None)
    if (context_fn is None and determinism_check == "default" and debug is False
            and early_stop is None and global_stop is None and global_debug is None):
        if preserve_rng_state is True:
            return DEFAULT
        if preserve_rng_state is False:
            return NO_RNG
    if determinism_check not in DETERMINISM_CHECKS:
        raise ValueError(f"zoo.checkpoint: determinism_check must be one of "
                         f"{DETERMINISM_CHECKS}, got {determinism_check!r}")
    contexts = _user_contexts(context_fn)
    logs = None
    if (global_debug if global_debug is not None else debug):
        logs = (OpLog(), OpLog())
        contexts = logs if contexts is None else (Both(contexts[0], logs[0]),
                                                  Both(contexts[1], logs[1]))
    stop = global_stop if global_stop is not None else early_stop
    return Options(preserve_rng=bool(preserve_rng_state), contexts=contexts,
                   check_shapes=determinism_check == "default",
                   early_stop=True if stop is None else bool(stop), logs=logs)


def _user_contexts(context_fn: Callable[[], Any] | None) -> tuple[Any, Any] | None:
    """The (forward, recompute) context managers a user's context_fn returns, checked."""
    if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
        return None
    if not callable(context_fn):
        raise TypeError(f"zoo.checkpoint: context_fn must be a callable returning two context "
                        f"managers (forward, recompute), got {type(context_fn).__name__}")
    contexts = context_fn()
    if not isinstance(contexts, tuple) or len(contexts) != 2:
        raise TypeError("zoo.checkpoint: context_fn must return a tuple of two context managers "
                        f"(forward, recompute), got {type(contexts).__name__}")
    return contexts
