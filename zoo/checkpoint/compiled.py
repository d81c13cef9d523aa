"""``zoo.checkpoint`` under ``torch.compile``: while Dynamo traces, each region becomes torch's
``tag_activation_checkpoint`` subgraph and AOTAutograd's partitioner does the recompute inside the
backward graph, where the contract holds by construction (BatchNorm statistics are written once,
by the forward graph; dropout masks are kept, not redrawn; ``save_ops`` become torch's
selective-checkpoint policy). Needs torch >= 2.8 (``zoo._torch.COMPILED_REGIONS_SINCE``); an
older torch gets a one-line error when a region is compiled. torch 2.8's partitioner replays a
region's BatchNorm update in backward where it recomputes its source (its own compiled checkpoint
updates the statistics twice, pytorch/pytorch#96136's bug under the compiler): there, a region
saves what every in-place op writes instead (:func:`_save_updates`).
"""
from __future__ import annotations

import functools
import operator
import warnings
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils import checkpoint as torch_checkpoint

from .. import _torch
from .policies import AllBut
from .recompute import ForwardState, _RecomputeContext, run_recording

__all__ = ["traced_checkpoint"]


def traced_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
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
    if _torch.VERSION < _torch.COMPILED_REGIONS_SINCE:  # one line, naming the torch it needs
        return _compile_needs_newer_torch()
    if _tracing_region:  # nested: the outer region's recompute rebuilds this one's outputs
        return _tagged_region(fn, args, kwargs, save_ops, context_fn)
    _tracing_region = True
    try:
        out = _tagged_region(fn, args, kwargs, save_ops, context_fn)
    finally:
        _tracing_region = False
    # Traced, the views region carries the policy that refuses a backend without AOTAutograd;
    # run eagerly (Dynamo's fallback), the plain one.
    views_policy = _KEEP_BASES_TRACED if torch.compiler.is_compiling() else _KEEP_BASES
    return torch_checkpoint.checkpoint(_kept_outputs, out, use_reentrant=False,
                                       context_fn=views_policy)


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
    # (a BatchNorm's batch statistics before a ReLU, a max pool's int64 indices), which puts
    # compiled peaks above eager's (tests/checkpoint/test_compile.py compares them). Only a
    # layer norm's (2 floats a row) are taken.
    getitems = [u for u in node.users if u.target is operator.getitem]
    if getitems and getattr(node.target, "overloadpacket", None) is not _LAYER_NORM:
        return
    policy = _torch.CheckpointPolicy
    recompute = (policy.PREFER_RECOMPUTE, policy.MUST_RECOMPUTE)
    for kept in (node, *getitems):
        if kept.meta.get("recompute") in recompute:
            kept.meta["recompute"] = policy.MUST_SAVE


def _traced_views_contexts() -> tuple[Any, Any]:
    """The views region's contexts where Dynamo traced the region: :func:`_keep_bases`'s while
    AOTAutograd traces the graph. Called while nothing traces (no compile, no fake mode), the
    backend runs Dynamo's graph itself (``backend="eager"``, any backend without AOTAutograd):
    the region's checkpoint then runs eagerly on the traced ops, whose recompute draws
    dropout's mask anew (the compiled checkpoint does not preserve the RNG state) and updates
    BatchNorm's statistics again, for torch's own checkpoint as for the zoo's (measured on
    torch 2.14 and 2.15: a dropout region's gradients off by 0.14, a BatchNorm step refused by
    autograd), so the step is refused in one line."""
    if not _torch.tracing():
        raise RuntimeError(
            "zoo: zoo.checkpoint under torch.compile needs a backend that runs AOTAutograd "
            "(inductor, aot_eager, cudagraphs); this one runs Dynamo's graph eagerly, where a "
            "checkpoint's recompute redraws dropout and updates BatchNorm twice; to debug "
            "without inductor, compile with backend=\"aot_eager\"")
    return _torch.create_selective_checkpoint_contexts(_keep_bases)


_LAYER_NORM = torch.ops.aten.native_layer_norm
_KEEP_BASES = None if _torch.create_selective_checkpoint_contexts is None else \
    functools.partial(_torch.create_selective_checkpoint_contexts, _keep_bases)
_KEEP_BASES_TRACED = functools.partial(_traced_views_contexts)


def _own_context_fn(context_fn: Any) -> bool:
    """Whether a compiled region's ``context_fn`` is the zoo's own (the outputs' region, or the
    policy of torch 2.8's regions). Dynamo hands the region a copy of the ``functools.partial``
    it traced, so the partial is known by its function and arguments, not by identity."""
    if not isinstance(context_fn, functools.partial):
        return False
    if context_fn.func is _traced_views_contexts:
        return True
    if not context_fn.args:
        return False
    policy = context_fn.args[0]
    return policy is _keep_bases or (isinstance(policy, functools.partial)
                                     and policy.func is _save_updates)


_torch.quiet_context_fn_warning(_own_context_fn)


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
        if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:
            return _context_fn_needs_torch_2_9()
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn,
                                           **kwargs)
    if isinstance(save_ops, AllBut):  # Dynamo traces a list of ops, not a function: the
        save_ops = save_ops.ops  # spared layer's output is kept, as the partitioner decides
    if callable(save_ops):
        raise ValueError("zoo.checkpoint: under torch.compile, save_ops must be a collection of "
                         "ATen ops (or an AllBut), not a function; pass the ops instead")
    if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:
        if isinstance(save_ops, (set, frozenset)):
            return _save_ops_set_needs_torch_2_9()
        policy = functools.partial(_save_updates, tuple(save_ops or ()))
        context_fn = functools.partial(_torch.create_selective_checkpoint_contexts, policy)
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn,
                                           **kwargs)
    if save_ops:
        policy = functools.partial(_torch.create_selective_checkpoint_contexts,
                                   list(save_ops))
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=policy,
                                           **kwargs)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _save_updates(save_ops: Collection[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The region's policy on torch 2.8 (``_torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES``): an op
    that writes into an input (BatchNorm with its running statistics, ``num_batches_tracked``'s
    ``add_``) and the ``save_ops`` are saved, every other op recomputed.

    torch 2.8's partitioner copies a region's buffer updates into the backward graph too, from
    the recomputed value where the source is recomputed: the statistics move twice per step.
    Saved, the source is the forward's value, so the backward's copy writes what is already
    there. It costs the memory of those ops' outputs (a BatchNorm's normalised tensor); from
    torch 2.9 the update is not replayed and nothing is saved. Only while AOTAutograd traces
    (a proxy mode is active): run eagerly, as Dynamo's fallback for a region with a graph
    break, the zoo's recompute guard keeps the statistics, and torch's eager selective
    checkpoint would refuse a saved output a later op writes into (dropout's ``bernoulli_``
    mask, scaled in place by ``div_``).
    """
    policy = _torch.CheckpointPolicy
    if op in save_ops:
        return policy.MUST_SAVE
    if _torch.mutates_an_input(op) and _torch.proxy_mode() is not None:
        return policy.MUST_SAVE
    return policy.PREFER_RECOMPUTE


def _compiled_body(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The body of a region under ``torch.compile`` (:func:`traced_checkpoint`).

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
        return _fallback_forward(fn, *args, **kwargs)
    now = ForwardState([], preserve_rng=False)  # the autocast torch restored
    now.states = _fallback_states(fn)
    with _RecomputeContext(now):
        return _without_dynamo(fn, *args, **kwargs)


# The state layers advance (spectral norm: ``recompute.advancing``) recorded by the fallback's
# forwards, for their recomputes: by the call's ``fn``, the object torch's checkpoint keeps from
# the forward for its recompute (a module's bound forward, new per call); an ``fn`` that two
# forwards share before a recompute is ambiguous (``None``) and its recompute warns.
_fallback_records: dict[int, tuple[weakref.ref, dict[int, Any] | None]] = {}


def _fallback_forward(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The fallback's forward: ``fn`` without Dynamo, recording the state of the layers that
    advance their own (:func:`zoo.checkpoint.recompute.advancing`) for its recompute."""
    forward = ForwardState([], preserve_rng=False)
    out = run_recording(forward, _without_dynamo, fn, *args, **kwargs)
    if forward.states:
        key = id(fn)
        try:
            gone = functools.partial(_fallback_records.pop, key, None)
            ref = weakref.ref(fn, lambda _: gone())
        except TypeError:  # fn takes no weak reference: nothing to find it by
            return out
        states = None if key in _fallback_records else forward.states
        _fallback_records[key] = (ref, states)
    return out


def _fallback_states(fn: Callable[..., Any]) -> dict[int, Any] | None:
    """The states the fallback's forward of ``fn`` recorded, taken (None: none recorded)."""
    ref, states = _fallback_records.pop(id(fn), (None, None))
    if ref is not None and states is None:
        warnings.warn("zoo.checkpoint: under torch.compile a region ran eagerly (a graph break) "
                      "twice with one function before its recompute, so the state its layers "
                      "advance (spectral norm's u and v) is recomputed from where it is now, "
                      "not from where each forward began; checkpoint the module with "
                      "zoo.blocks.checkpoint_module (a new bound forward per call) instead of "
                      "passing it to zoo.checkpoint", stacklevel=2)
    return states


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def zoo_checkpoint_under_compile_needs_newer_torch() -> None:
    _torch.compiled_checkpoint_policy()  # raises: this torch's compiled checkpoint is not tested


def zoo_checkpoint_save_ops_set_under_compile_needs_torch_2_9() -> None:
    raise TypeError(
        f"zoo: save_ops as a set under torch.compile needs torch >= 2.9 (this is torch "
        f"{torch.__version__}, whose Dynamo cannot trace a set of ops); pass a list or tuple")


def zoo_checkpoint_context_fn_under_compile_needs_torch_2_9() -> None:
    raise RuntimeError(
        f"zoo: zoo.checkpoint(..., context_fn=...) under torch.compile needs torch >= 2.9 (this "
        f"is torch {torch.__version__}, whose partitioner updates BatchNorm's statistics a second "
        "time where a policy recomputes them); upgrade torch, or pass save_ops instead")


_without_dynamo = _torch.dynamo().disable(_call)
# Raised outside Dynamo's trace, so the user sees the one line (Dynamo would wrap an exception
# raised while it traces); with fullgraph=True Dynamo refuses the call and names this function.
_compile_needs_newer_torch = _torch.dynamo().disable(
    zoo_checkpoint_under_compile_needs_newer_torch)
_save_ops_set_needs_torch_2_9 = _torch.dynamo().disable(
    zoo_checkpoint_save_ops_set_under_compile_needs_torch_2_9)
_context_fn_needs_torch_2_9 = _torch.dynamo().disable(
    zoo_checkpoint_context_fn_under_compile_needs_torch_2_9)
_torch.skip_code(_compiled_body.__code__)
