"""The primitive itself: :func:`checkpoint`, which runs a region eagerly through the zoo's
saved-tensor region (:mod:`.region`) or, while ``torch.compile`` traces, as torch's checkpoint
subgraph (:mod:`.compiled`)."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from . import keywords
from .compiled import traced_checkpoint
from .offload import offload as offload_region
from .recompute import ForwardState, _cuda_devices
from .region import _inside_region, _Region, recorders
from .selective import Selective, save_set

__all__ = ["checkpoint"]


def checkpoint(fn: Callable[..., Any], *args: Any,
               save_ops: Collection[Any] | Callable[..., bool] | None = None,
               use_reentrant: bool | None = None, preserve_rng_state: bool = True,
               context_fn: Callable[[], tuple[Any, Any]] | None = None,
               determinism_check: str = "default", debug: bool = False,
               early_stop: bool | None = None, offload: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute the rest during backward.

    Compared with ``fn(*args, **kwargs)`` it gives the same outputs, the same gradients for the
    inputs and for every parameter ``fn`` uses (also when no input requires grad), leaves
    normalisation running statistics exactly as one plain forward would, and replays the same
    random numbers on the CPU and on every CUDA device involved. It works with keyword and
    non-tensor arguments and outputs, nests, recomputes under the forward's autocast state, and
    allows ``torch.autograd.grad`` inside ``fn`` (gradient penalties) and partial backward calls.

    Args:
        fn: any callable: a module, a bound method, a closure.
        *args: passed to ``fn`` unchanged.
        **kwargs: passed to ``fn`` unchanged (any keyword not named here goes to ``fn``).
        save_ops: optional ATen ops (e.g. ``{torch.ops.aten.mm.default}``) whose outputs are kept
            instead of recomputed: selective recompute, Megatron-style. ``None`` recomputes all.
            Or a function ``keep(op, *args, **kwargs) -> bool`` called on every op the region
            runs (in forward and in the recompute alike, so it must answer the same both
            times), for a choice finer than the op's name (the zoo planner's save sets). Under
            ``torch.compile`` a function is refused, and an ``AllBut`` keeps all its ops.
            The kept outputs serve one recompute, as with torch's selective checkpoint: a second
            backward through such a region (``retain_graph=True``, double backward) is an error
            that says so.
        offload: keep the region's saved tensors in host memory instead of recomputing them
            (:func:`zoo.offload`: exact, nothing recomputed; a no-op without CUDA), so a plan
            chooses per unit between keep, recompute and offload through this one call.

    ``use_reentrant``, ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` are ``torch.utils.checkpoint.checkpoint``'s keywords, so that zoo.checkpoint can
    be handed to any library that calls torch's; their meaning for a zoo region is in
    :mod:`zoo.checkpoint.keywords` (``use_reentrant`` is ignored: always non-reentrant).
    ``preserve_rng_state=False`` saves and replays no RNG state and queries no CUDA device: for a
    region that draws no random number the same result for less host work per region (the zoo's
    models pass it for such regions); a region that draws would draw anew on recompute.

    Under ``torch.no_grad()`` or ``inference_mode`` it is exactly ``fn(*args, **kwargs)``. Under
    ``torch.compile`` (``fullgraph=True`` works) the region is one checkpoint subgraph of the
    compiled graph, with the same contract (:func:`zoo.checkpoint.compiled.traced_checkpoint`,
    tests/checkpoint/test_compile.py). Under ``torch.func``'s ``grad`` or ``vjp`` it raises
    RuntimeError in one line: they refuse its saved-tensor hooks, as they refuse torch's.

    Backward raises RuntimeError, saying why, when a tensor input was changed in place after the
    call (the recompute would read other values), when the recompute saves other tensors than
    the forward did (the region is not deterministic given its inputs, or the forward ran with
    parameters swapped in by ``torch.func.functional_call`` that the recompute no longer sees),
    when a tensor saved inside the region was changed in place after it was saved (the plain
    backward refuses it too), or when one backward call unpacks a saved tensor twice (a custom
    Function reading ``ctx.saved_tensors`` twice). Under ``save_on_cpu`` or other saved-tensor
    hooks, the region hands its inputs that require grad to them, as torch's checkpoint does.

    Deliberate differences from torch's non-reentrant checkpoint (each pinned by a test in
    tests/checkpoint/test_checkpoint.py or tests/checkpoint/test_checkpoint_torch_*.py): BatchNorm
    statistics are
    updated once, not twice; the RNG is also replayed on the current CUDA device and on the
    region's parameters' device; ``use_reentrant=True`` still gives non-reentrant semantics and
    no call warns; recomputed tensors a backward call did not use are freed when that call ends
    (torch keeps them until the graph is freed); the recompute dispatches no detach of the tensors
    it rebuilds, and a module's parameters saved by the region are kept, not rebuilt; a region
    lets go of its inputs as soon as the backward call that recomputes it can need them no more
    (not when its last node has run; kept for ``retain_graph=True`` and partial backward calls).
    """
    if not torch.compiler.is_compiling() and not callable(fn):  # (2.8's Dynamo: no callable)
        raise TypeError(f"zoo.checkpoint: fn must be callable (a module or a function), got "
                        f"{type(fn).__name__}; pass the function first, then its inputs")
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if offload:
        return offload_region(fn, *args, **kwargs)
    if torch.compiler.is_compiling():
        return traced_checkpoint(fn, args, kwargs, save_ops, context_fn)
    if recorders and not _inside_region():
        for record in recorders:
            record(fn, args, kwargs, save_ops)
    opts = keywords.options(preserve_rng_state, context_fn, determinism_check, debug, early_stop)

    devices = _cuda_devices(fn, (*args, *kwargs.values())) \
        if opts.preserve_rng and torch.cuda.is_initialized() else []
    if save_ops:
        fn = Selective(fn, save_set(save_ops))
    forward = ForwardState(devices, opts.preserve_rng)
    try:
        return _Region(fn, args, kwargs, forward, opts).run()
    except RuntimeError as e:
        if _HOOKS_REFUSED not in str(e):
            raise
        raise RuntimeError(
            "zoo.checkpoint: torch.func's transforms (grad, vjp, jacrev, hessian) refuse the "
            "saved-tensor hooks a checkpoint is made of (as torch's own); take this "
            "gradient with torch.autograd (loss.backward(), torch.autograd.grad), or run the "
            "model without checkpointing for it (zoo.set_grad_checkpointing(model, False))"
        ) from None


# what torch.func's transforms say when a region installs its saved-tensor hooks under them
_HOOKS_REFUSED = "don't yet support saved tensor hooks"
