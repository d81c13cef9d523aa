"""The zoo's one checkpoint primitive: activation checkpointing that is exactly the plain model.

Activation (gradient) checkpointing keeps only a region's inputs during the forward pass and runs
the region a second time during backward to rebuild what backward needs (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174). Done naively the second run
is not the first one, and users pay for that (see shared/seeds/):

* reentrant ``torch.utils.checkpoint`` gives parameters no gradient when no input requires grad
  (a frozen model that "trains 3x faster");
* BatchNorm updates its running statistics once per forward *and once per recompute*, so
  ``num_batches_tracked`` counts twice and ``running_mean``/``running_var`` drift from the plain
  model's (pytorch/pytorch#96136, still open);
* dropout must see the same random numbers on recompute, on every device it draws from;
* reentrant checkpoint runs a nested backward per region, which made nn.DataParallel 5x slower.

:func:`checkpoint` works like PyTorch's non-reentrant checkpoint (saved-tensor hooks, so gradients
reach parameters through the ordinary graph, once, with no nested backward), in its own lean
implementation (``_Region`` below: about a third less extra time per region than torch's, which
matters on models made of many small layers), and adds:

* a recompute guard that keeps every normalisation layer from updating its running statistics a
  second time in the recomputed forward (BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm with
  tracked statistics, ``momentum=None`` included), so the buffers end exactly as one plain
  forward leaves them;
* RNG stashing for the CPU, for every CUDA device holding an input or the region's parameters,
  and for the current CUDA device (torch only stashes the devices of the positional inputs);
* :func:`is_recomputing`, so layers can tell a recompute from a forward (``zoo.nn.cp_BatchNorm2d``
  uses it, together with a backward-pass check, to be exact under anyone's checkpoint);
* optional selective recompute (``save_ops``): the outputs of the named ops are kept and only the
  cheap rest is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", Megatron-LM), in the same region (:mod:`zoo.checkpoint.selective`), with
  no op dispatched beyond what the recompute reruns;
* ``torch.compile`` support with no graph break (``fullgraph=True``): while Dynamo traces, each
  region becomes torch's ``tag_activation_checkpoint`` subgraph and AOTAutograd's partitioner
  does the recompute inside the backward graph, where the contract holds by construction
  (BatchNorm statistics are written once, by the forward graph; dropout masks are kept, not
  redrawn; ``save_ops`` become torch's selective-checkpoint policy).
  tests/checkpoint/test_compile.py
  checks it against the eager plain model;
* errors that name the cause and the fix: an input changed in place before the recompute, a
  region that saves different tensors when recomputed.

It is a drop-in for ``torch.utils.checkpoint.checkpoint``: it takes torch's keywords (their
meaning for a zoo region: :mod:`zoo.checkpoint.keywords`) and passes PyTorch's own
non-reentrant checkpoint tests (ported in tests/checkpoint/test_checkpoint_torch_*.py), except for
the deliberate differences listed in :func:`checkpoint`.

Under ``torch.no_grad()`` / ``inference_mode`` it simply calls ``fn``: nothing is saved and
nothing is recomputed, so there is nothing to pay.

Files: this one holds the public calls; :mod:`zoo.checkpoint.region` the saved-tensor region;
:mod:`zoo.checkpoint.recompute` the recompute flag, normalisation guard and RNG/autocast contexts;
:mod:`zoo.checkpoint.selective` what ``save_ops`` keeps and serves; :mod:`zoo.checkpoint.keywords`
torch's keywords.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .. import _torch
from . import keywords
from .policies import AllBut

from .recompute import (_ForwardContext, _RecomputeContext, _cuda_devices, is_recomputing,
                        state_bookkeeping)
from .region import _inside_region, _Region, recorders
from .selective import Selective, save_set

__all__ = ["checkpoint", "checkpoint_sequential", "is_recomputing", "split_segments",
           "state_bookkeeping"]


def _traced_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                       save_ops: Collection[Any] | Callable[..., bool] | None,
                       context_fn: Callable[[], tuple[Any, Any]] | None = None) -> Any:
    """The region as ``torch.compile`` sees it: torch's checkpoint, which Dynamo turns into one
    ``tag_activation_checkpoint`` subgraph of the model's graph (no graph break).

    AOTAutograd's partitioner then decides what the backward recomputes: the region's ops are
    tagged "recompute" (or, for ``save_ops``, "save" for the named ops, through torch's
    selective-checkpoint policy), random ops are never recomputed but their masks kept (so
    dropout's backward uses the forward's mask), and buffer mutations such as BatchNorm's
    running statistics are applied once, in the forward graph. That is the whole contract, so
    none of the eager region's guards (recompute flag, BatchNorm guard, RNG replay) is traced.
    ``context_fn`` must reach Dynamo as a function or ``functools.partial``, never a lambda; a
    user's own ``context_fn`` is handed to torch as it is (torch's compiled checkpoint takes one,
    so it cannot be combined with ``save_ops`` there). The other keywords concern the eager
    recompute only.

    When Dynamo cannot trace the region as one subgraph (a graph break inside it: an unsupported
    call, Dynamo's ``graph_break()``, a ``momentum=None`` BatchNorm), it runs this call of
    torch's checkpoint eagerly instead, whose recompute would update BatchNorm a second time
    (pytorch/pytorch#96136). So the region's body is :func:`_compiled_body`, which is traced as
    ``fn`` itself, and which Dynamo's eager fallback runs as the zoo's eager region would: ``fn``
    without Dynamo, forward and recompute alike, the recompute under the zoo's recompute flag
    and normalisation guard.
    """
    global _tracing_region
    _torch.compiled_checkpoint_policy()  # torch < 2.5: one line, naming the torch it needs
    if _tracing_region:  # nested: the outer region's recompute rebuilds this one's outputs
        return _tagged_region(fn, args, kwargs, save_ops, context_fn)
    _tracing_region = True
    try:
        out = _tagged_region(fn, args, kwargs, save_ops, context_fn)
    finally:
        _tracing_region = False
    return torch_checkpoint.checkpoint(_kept_outputs, out, use_reentrant=False,
                                       context_fn=_KEEP_BASES)


_tracing_region = False  # True while Dynamo traces a region's body (regions nest)


def _kept_outputs(out: Any) -> Any:
    """Views of a region's output tensors, traced as a region of their own after it.

    AOTAutograd's partitioner recomputes every op tagged for recompute that backward needs,
    the region's last ops too: a tensor the ops after the region save for their backward (the
    next BatchNorm's input) would be recomputed, and the region's chain up to it, where the
    eager region leaves it as it is, alive in the next op's saved tensors. An op whose output
    feeds a later region is saved instead (torch's ``cleanup_recompute_tags``: the boundary
    between two regions is stored), so the outputs pass through this region of views: they are
    kept if anything outside needs them, and what reads them recomputes a view, which is free.
    An output that is itself a view, or one output of several (a layer norm's), is kept through
    the op it comes from (:func:`_keep_bases`, this region's policy).
    """
    return _torch.tree_map_only(torch.Tensor, lambda t: t.view_as(t), out)


def _keep_bases(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The views region's policy, called by AOTAutograd's tracer after each of its ops: the op
    that made the region's output is kept, also where that output is a view of it or one output
    of several (layer norm's normalised tensor beside its mean and rstd).

    torch's boundary rule keeps the region's last op; when that op is a view or a ``getitem``,
    the partitioner recomputes it from its base whatever its tag, and so the whole region, early,
    in backward. Tagging the base (the op before the views, or the multi-output op) to be saved
    keeps what eager keeps: a view shares its base's storage; a multi-output op keeps its small
    side outputs (statistics) too. Read from the graph being traced, whose last node is ``op``'s
    where torch calls the policy after the op (2.15 does); otherwise (eager, a torch that calls
    it before) nothing is tagged and the boundary rule acts alone.
    """
    policy = _torch.CheckpointPolicy.PREFER_RECOMPUTE
    views = _torch.default_view_ops()
    if views is None:
        return policy
    mode = _torch.proxy_mode()
    graph = getattr(getattr(mode, "tracer", None), "graph", None)
    # reversed(graph.nodes) is an iterable, not an iterator, in torch 2.11: iter() serves both
    node = next(iter(reversed(graph.nodes)), None) if graph is not None else None
    if node is None or node.target is not op:
        return policy
    for arg in node.args:
        if isinstance(arg, torch.fx.Node):
            _keep_base(arg, views)
    return policy


def _keep_base(node: torch.fx.Node, views: Collection[Any]) -> None:
    """Tag the op whose output ``node`` views (or is one output of) MUST_SAVE, if a region's;
    ``views`` are the ops the partitioner treats as views."""
    while node.op == "call_function":
        target = getattr(node.target, "overloadpacket", node.target)
        if target not in views and target is not operator.getitem:
            break
        node = node.args[0]
    if node.op != "call_function":
        return
    # A multi-output op is saved with all its outputs (none may stay tagged recompute): kept,
    # its side outputs are held even where nothing after the region needs its output in backward
    # (a BatchNorm's batch statistics before a ReLU, a max pool's int64 indices): with every
    # multi-output op kept, compiled peaks rose 128 B over eager on a conv-BN chain and 460,288 B
    # on torchvision resnet18's least plan. Only a layer norm's (2 floats a row) are taken.
    getitems = [u for u in node.users if u.target is operator.getitem]
    if getitems and getattr(node.target, "overloadpacket", None) is not _LAYER_NORM:
        return
    policy = _torch.CheckpointPolicy
    recompute = (policy.PREFER_RECOMPUTE, policy.MUST_RECOMPUTE)
    for kept in (node, *getitems):
        if kept.meta.get("recompute") in recompute:
            kept.meta["recompute"] = policy.MUST_SAVE


_LAYER_NORM = torch.ops.aten.native_layer_norm
_KEEP_BASES = None if _torch.create_selective_checkpoint_contexts is None else \
    functools.partial(_torch.create_selective_checkpoint_contexts, _keep_bases)


def _tagged_region(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                   save_ops: Collection[Any] | Callable[..., bool] | None,
                   context_fn: Callable[[], tuple[Any, Any]] | None) -> Any:
    """The region's body as one ``tag_activation_checkpoint`` subgraph (its ops tagged)."""
    fn = functools.partial(_compiled_body, fn)
    if context_fn is not None and context_fn is not torch_checkpoint.noop_context_fn:
        if save_ops:
            raise ValueError("zoo.checkpoint: under torch.compile, save_ops and context_fn cannot "
                             "be combined (torch's compiled checkpoint takes one context_fn); "
                             "pass one of them, or run the region eagerly")
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn,
                                           **kwargs)
    if isinstance(save_ops, AllBut):  # Dynamo traces a list of ops, not a function: the
        save_ops = save_ops.ops  # spared layer's output is kept, as the partitioner decides
    if callable(save_ops):
        raise ValueError("zoo.checkpoint: under torch.compile, save_ops must be a collection of "
                         "ATen ops (or an AllBut), not a function; pass the ops instead")
    if save_ops:
        policy = functools.partial(_torch.create_selective_checkpoint_contexts,
                                   list(save_ops))
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=policy,
                                           **kwargs)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _compiled_body(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The body of a region under ``torch.compile`` (:func:`_traced_checkpoint`).

    Traced by Dynamo, it is ``fn``. Run eagerly, it is Dynamo's fallback for a region it could
    not trace as one subgraph, inside torch's eager checkpoint: ``fn`` runs without Dynamo (so
    its forward and recompute run the same eager ops, and no compiled frame replays a buffer
    update), and a run inside a backward pass, torch's recompute, runs under the zoo's recompute
    flag and normalisation guard (torch's checkpoint itself replays the RNG and autocast state).
    Dynamo never compiles this function's own frame (``skip_code`` below), only inlines it.
    """
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    if _torch.current_graph_task_id() == -1:
        return _without_dynamo(fn, *args, **kwargs)
    now = _ForwardContext([], preserve_rng=False).__enter__()  # the autocast torch restored
    with _RecomputeContext(now):
        return _without_dynamo(fn, *args, **kwargs)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


_without_dynamo = _torch.dynamo().disable(_call)
_torch.skip_code(_compiled_body.__code__)


def checkpoint(fn: Callable[..., Any], *args: Any,
               save_ops: Collection[Any] | Callable[..., bool] | None = None,
               use_reentrant: bool | None = None, preserve_rng_state: bool = True,
               context_fn: Callable[[], tuple[Any, Any]] | None = None,
               determinism_check: str = "default", debug: bool = False,
               early_stop: bool | None = None, **kwargs: Any) -> Any:
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

    ``use_reentrant``, ``preserve_rng_state``, ``context_fn``, ``determinism_check``, ``debug`` and
    ``early_stop`` are ``torch.utils.checkpoint.checkpoint``'s keywords, so that zoo.checkpoint can
    be handed to any library that calls torch's; their meaning for a zoo region is in
    :mod:`zoo.checkpoint.keywords` (``use_reentrant`` is ignored: always non-reentrant).

    Under ``torch.no_grad()`` or ``inference_mode`` it is exactly ``fn(*args, **kwargs)``. Under
    ``torch.compile`` (``fullgraph=True`` works) the region is one checkpoint subgraph of the
    compiled graph, with the same contract (:func:`_traced_checkpoint`,
    tests/checkpoint/test_compile.py).

    Backward raises RuntimeError, saying why, when a tensor input was changed in place after the
    call (the recompute would read other values), when the recompute saves other tensors than
    the forward did (the region is not deterministic given its inputs), or when one backward call
    unpacks a saved tensor twice (a custom Function reading ``ctx.saved_tensors`` twice).

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
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if torch.compiler.is_compiling():
        return _traced_checkpoint(fn, args, kwargs, save_ops, context_fn)
    if recorders and not _inside_region():
        for record in recorders:
            record(fn, args, kwargs, save_ops)
    opts = keywords.options(preserve_rng_state, context_fn, determinism_check, debug, early_stop)

    devices = _cuda_devices(fn, (*args, *kwargs.values())) \
        if opts.preserve_rng and torch.cuda.is_initialized() else []
    if save_ops:
        fn = Selective(fn, save_set(save_ops))
    with _ForwardContext(devices, opts.preserve_rng) as forward:
        return _Region(fn, args, kwargs, forward, opts).run()


def split_segments(n: int, segments: int | None) -> list[range]:
    """Split ``n`` blocks into contiguous, balanced segments (sizes differ by at most one).

    ``segments=None`` gives one segment per block. Raises ValueError outside ``1..n``.
    """
    if n < 1:
        raise ValueError("checkpoint_sequential needs at least one block, got an empty sequence")
    if segments is None:
        segments = n
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n:
        raise ValueError(f"segments must be an int from 1 to {n} (the number of blocks) or None "
                         f"for one segment per block, got {segments!r}")
    base, extra = divmod(n, segments)
    bounds, start = [], 0
    for i in range(segments):
        stop = start + base + (1 if i < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return bounds


def run_blocks(blocks: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    """Apply ``blocks`` in order: the plain body of a checkpointed segment."""
    for block in blocks:
        x = block(x)
    return x


def run_plan(blocks: Sequence[Callable[[Any], Any]], plan: Sequence[tuple[int, int, Any]],
             x: Any, offset: int = 0) -> Any:
    """Run ``blocks`` by a block-level ``plan`` of ``(start, stop, checkpointed)`` segments
    (block indices start at ``offset``): stored segments plainly, checkpointed ones as one
    region each, nested plans (a list in place of the flag) inside their region, recursively."""
    for a, b, ck in plan:
        part = blocks[a - offset:b - offset]
        if isinstance(ck, list):
            x = checkpoint(run_plan, part, ck, x, a)
        else:
            x = checkpoint(run_blocks, part, x) if ck else run_blocks(part, x)
    return x


def checkpoint_sequential(blocks: Sequence[Callable[[Any], Any]] | nn.Sequential, x: Any,
                          segments: int | None = None, skip_last: bool = False, *,
                          use_reentrant: bool | None = None, preserve_rng_state: bool = True,
                          context_fn: Callable[[], tuple[Any, Any]] | None = None,
                          determinism_check: str = "default", debug: bool = False,
                          early_stop: bool | None = None) -> Any:
    """Run a chain of one-input blocks, checkpointing each segment with :func:`checkpoint`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential`` the last segment is checkpointed too
    (the reason seed 000 saw "almost no memory improvement" with few segments) unless
    ``skip_last=True``, which keeps its activations because backward needs them first anyway.
    This is a deliberate difference from torch's (tests/checkpoint/test_checkpoint_torch_utils.py
    pins it).

    Args:
        blocks: an ``nn.Sequential`` or any sequence of callables, applied in order.
        x: the input of the first block.
        segments: ``None`` checkpoints every block on its own; an int splits the blocks into that
            many balanced contiguous segments, each checkpointed as one region.
        skip_last: run the last segment without checkpointing.

    torch's keywords (``use_reentrant``, ``preserve_rng_state``, ``context_fn``,
    ``determinism_check``, ``debug``, ``early_stop``) are passed to every segment's
    :func:`checkpoint`.

    torch's argument order, ``checkpoint_sequential(functions, segments, input)``, is accepted
    too: a tensor given as ``segments`` after an int ``x`` is taken as the input.
    """
    if isinstance(segments, torch.Tensor) and isinstance(x, int) and not isinstance(x, bool):
        x, segments = segments, x  # torch's order: (functions, segments, input)
    if not isinstance(skip_last, bool):
        raise TypeError(f"checkpoint_sequential: skip_last must be True or False, got "
                        f"{type(skip_last).__name__} (blocks take one input; pass only one)")
    blocks = list(blocks)
    ranges = split_segments(len(blocks), segments)
    if not torch.is_grad_enabled():
        return run_blocks(blocks, x)
    given = {"use_reentrant": use_reentrant, "preserve_rng_state": preserve_rng_state,
             "context_fn": context_fn, "determinism_check": determinism_check, "debug": debug,
             "early_stop": early_stop}
    for i, r in enumerate(ranges):
        part = blocks[r.start:r.stop]
        if skip_last and i == len(ranges) - 1:
            x = run_blocks(part, x)
        elif len(part) == 1:
            x = checkpoint(part[0], x, **given)
        else:
            x = checkpoint(run_blocks, part, x, **given)
    return x
