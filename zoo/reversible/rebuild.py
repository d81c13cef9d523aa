"""``rebuild=True``: keep the last block's integer outputs and, in backward, rebuild every
block's inputs from its outputs, recomputing ``G`` then ``F`` once each."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._torch import tensor_version as _version
from ..checkpoint.recompute import _cuda_devices, ForwardState, run_recording
from .coupling import LeadBlock, ReversibleBlock
from .grid import Grid, _add, _checked, _enter, from_fixed
from .lead import _lead_forward, _undo_lead
from .remake import _accumulate, _aliased, _check_own, _parts, _recorded, _root
from .run import _Run
from .sources import Source, remember


class _NoSecondOrder(torch.autograd.Function):
    """The rebuild's gradients when backward records a graph (``create_graph=True``): the
    identity, whose own backward refuses in one line (a second derivative through the rebuild
    would need a graph of the rebuild itself, which runs outside autograd)."""

    @staticmethod
    def forward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return tuple(None if g is None else g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> tuple[None, ...]:
        raise RuntimeError("reversible_sequence: a sequence with rebuild=True gives first-order "
                           "gradients only, and this backward differentiates them again "
                           "(create_graph=True); use rebuild=False (a model's efficient=False) "
                           "for higher-order gradients")


def _first_order(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """``backward`` run without recording a graph (as ``once_differentiable``); under
    ``create_graph=True`` its gradients come out of :class:`_NoSecondOrder`, so that
    differentiating them again is refused in one line, not with torch's generic message, nor
    silently without the rebuild's second-order terms."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *seeds: torch.Tensor) -> tuple[Any, ...]:
        with torch.no_grad():
            grads = backward(ctx, *seeds)
        if not torch.is_grad_enabled():
            return grads
        return _NoSecondOrder.apply(*(None if g is None else g.detach().requires_grad_()
                                      for g in grads))

    return wrapper


class _Rebuild(torch.autograd.Function):
    """The whole sequence as one node: forward keeps only the last block's integer outputs;
    backward rebuilds each block's inputs and recomputes ``G`` then ``F``, once each."""

    @staticmethod
    def forward(ctx: Any, run: _Run, x1: torch.Tensor, x2: torch.Tensor,
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        devices = _cuda_devices(run.blocks[0], (x1, x2)) if run.preserve_rng else []
        grid, checks = run.grid, []
        if run.lead is not None:
            x1, x2 = _lead_forward(run, x1, x2, devices)
        (k1, _), (k2, v2) = _enter(x1, grid, checks), _enter(x2, grid, checks)
        streams = (k1, k2)
        views: list[torch.Tensor | None] = [None, v2]  # the float views alive: the one in use
        del _, v2
        for block in run.blocks:
            contexts = []
            for j, fn in ((0, block.f), (1, block.g)):  # y1 = x1 + F(x2), y2 = x2 + G(y1)
                at = ForwardState(devices, run.preserve_rng)
                views[j] = None  # this stream's old view, already used
                views[j] = _add(streams[j], run_recording(at, fn, views[1 - j], *run.args),
                                grid, checks, inplace=True)[1]
                contexts.append(at)
            run.contexts.append((contexts[0], contexts[1]))
        run.streams = [k1, k2]  # not saved by ctx: backward lets go of k1 before it ends
        ctx.run = run
        y1, y2, bad = _checked(views[0], views[1], grid, checks)
        run.out = (Source(k1, grid, bad), Source(k2, grid, bad))
        return y1, y2

    @staticmethod
    @_first_order
    def backward(ctx: Any, a1: torch.Tensor, a2: torch.Tensor) -> tuple[Any, ...]:
        run, grid = ctx.run, ctx.run.grid
        for source in run.out or ():
            source.k = None  # the streams are rebuilt in place from here on
        if run.streams is None:
            raise RuntimeError("reversible_sequence: backward ran twice through a sequence with "
                               "rebuild=True (retain_graph=True); its streams are rebuilt in "
                               "place, so run the forward again, or use rebuild=False")
        _check_unchanged(run)
        k1, k2 = run.streams
        run.streams = None
        grads: list[torch.Tensor | None] = [None] * len(run.params)
        for i in reversed(range(len(run.blocks))):
            block, (at_f, at_g) = run.blocks[i], run.contexts[i]
            named = run.block_params[i]
            aliases = {j: run.params[j].detach().requires_grad_() for j in named}
            with _aliased(block, named, aliases):
                # G on y1 (k1): x2 = y2 - G(y1), then G's gradients; a1 is ours (_Fresh)
                _undo((block, "g"), k1, k2, a2, a1, grads, aliases, grid, at_g, run.args)
                # F on x2 (k2): x1 = y1 - F(x2), then F's gradients
                if i == 0:  # x1 = y1 - F(x2) is needed no more: the gradients do not read it
                    k1 = None
                _undo((block, "f"), k2, k1, a1, a2, grads, aliases, grid, at_f, run.args)
        if run.lead is not None:
            a1, a2 = _undo_lead(run, a1, a2, grads)
        return (None, a1, a2, *grads)


def _check_unchanged(run: _Run) -> None:
    """Refuse, in one line, a backward after a parameter of the blocks or a tensor argument was
    changed in place since the forward (an optimizer step between them): the recompute would
    run with the new values and rebuild other inputs than the forward's, silently (the stored
    network's backward refuses it too, where autograd saved the tensor)."""
    if any(_version(t) != v for t, v in zip(run.used, run.versions)):
        raise RuntimeError("reversible_sequence: a parameter of a block or an extra argument "
                           "was modified in place between the forward and this backward (an "
                           "optimizer step, a weight update), and the rebuild recomputes the "
                           "blocks with it; change them only after backward")


def _undo(fn: tuple[Any, str], k_in: torch.Tensor, k_out: torch.Tensor | None,
          seed: torch.Tensor, into: torch.Tensor, grads: list[torch.Tensor | None],
          aliases: dict[int, torch.Tensor], grid: Grid, at: ForwardState, args: tuple) -> None:
    """One half of a block backwards: recompute ``fn`` (a block and ``"f"`` or ``"g"``, which
    may use no tensor requiring grad but the block's parameters: :func:`_check_own`) on stream
    ``k_in``, take its output off ``k_out`` (in place: the streams are the rebuild's own; not
    when ``None``), then its gradients for ``seed`` (the output's gradient): the input's is
    added to ``into`` in place, the parameters' to ``grads``.

    What stays alive is what the gradients need and no more: ``fn``'s output is put on the grid
    (in its own memory when its graph did not save it) and let go before its backward (its
    graph is reached by its gradient edge), and ``fn``'s input, a float view of ``k_in``, is
    not kept in its graph but made again from ``k_in`` when the backward needs it (``k_in`` does
    not change meanwhile)."""
    out, edge, owned = _recompute(_parts(*fn), k_in, grid, at, args)
    if k_out is not None:
        _take_off(k_out, out, grid, owned)
    if not out.requires_grad:
        return
    _check_own(out, *fn, aliases)
    target = _root(out)
    if seed.dtype != out.dtype:  # autograd casts a gradient to its output's dtype
        seed = seed.to(out.dtype)
    del out
    got = torch.autograd.grad(target, [edge, *aliases.values()], seed, allow_unused=True)
    del target, seed
    if got[0] is not None:
        into.add_(got[0])
    _accumulate(grads, aliases, got[1:])


def _recompute(fn: tuple[Any, Any], k: torch.Tensor, grid: Grid, at: ForwardState,
               args: tuple) -> tuple[torch.Tensor, torch.autograd.graph.GradientEdge, bool]:
    """``fn`` (head and tail, :func:`_parts`) on the float view of ``k``, under the forward's
    RNG and autocast state and the recompute guard (BatchNorm statistics are not updated a
    second time): its output, the edge where its input's gradient arrives, and whether the
    output's memory is the rebuild's own (no view of another tensor, nor saved by the graph)."""
    out, edge, remake = _recorded(fn, functools.partial(from_fixed, k, grid), at, args,
                                  k.device)
    st = out.untyped_storage()
    return out, edge, out._base is None and not remake.keeps(st)


def _take_off(k: torch.Tensor, out: torch.Tensor, grid: Grid, owned: bool) -> None:
    """``k -= to_fixed(out)``, bit for bit, with one temporary the size of ``k`` at most: the
    scaled output (``out`` itself when ``owned``) is cast to the stream's integers in its own
    memory (``copy_`` into an integer view of it: the same element size, element by element,
    the values of ``.to``)."""
    if out.dtype in (torch.float16, torch.bfloat16):
        scaled = out.float().mul_(grid.scale)
    elif owned:
        scaled = out.detach().mul_(grid.scale)
    else:
        scaled = out * grid.scale
    if scaled.element_size() == k.element_size():
        fixed = scaled.view(grid.stream).copy_(scaled)
    else:
        fixed = scaled.to(grid.stream)
    del scaled
    k.sub_(fixed)


class _Fresh(torch.autograd.Function):
    """The identity, whose backward hands on copies of the incoming gradients: the rebuild then
    owns the gradients it receives and sums into them in place (the engine holds a node's
    incoming gradients while the node runs, so working copies would double them)."""

    @staticmethod
    def forward(ctx: Any, y1: torch.Tensor, y2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y1.detach(), y2.detach()  # not views: the outputs may be changed in place

    @staticmethod
    def backward(ctx: Any, a1: torch.Tensor, a2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a1.clone(), a2.clone()


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` left to eager mode under torch.compile (a graph break), with the reason Dynamo
    shows when ``fullgraph=True`` refuses the break (torch >= 2.8 takes one)."""
    reason = ("zoo.reversible: a sequence with rebuild=True (a model's efficient=True) runs "
              "eagerly, a graph break; compile it without fullgraph=True, or use rebuild=False")
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # a torch without the keyword
        return torch.compiler.disable(fn)


@_eager
def _rebuilt(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor, args: tuple,
             grid: Grid, preserve_rng: bool, lead: LeadBlock | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    run = _Run(blocks, args, grid, preserve_rng, lead)
    y1, y2 = _Fresh.apply(*_Rebuild.apply(run, x1, x2, *run.params))
    if run.out is not None:  # the outputs can be made again from the streams (.sources)
        remember(y1, run.out[0])
        remember(y2, run.out[1])
    return y1, y2
