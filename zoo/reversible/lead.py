"""A reversible sequence's lead unit (:class:`~.coupling.LeadBlock`, RevNet's downsampling):
its forward inside the rebuilding Function, and its backward, recomputed from inputs made again
from the streams of the sequence before (:mod:`.sources`) or kept."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._torch import tensor_version as _version
from ..checkpoint.recompute import ForwardState, _RecomputeContext, run_recording
from .remake import (_accumulate, _aliased, _anchor, _check_own, _parts, _recorded,
                     _RemakeView, _root, _StreamView)
from .run import _Run
from .sources import source_of


def _lead_forward(run: _Run, x1: torch.Tensor, x2: torch.Tensor, devices: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lead unit on the sequence's inputs: its outputs. Its backward keeps the makers of its
    inputs: their sources when they can be made again from the streams of the sequence before
    (:mod:`.sources`), else the inputs themselves; and its first output if no larger than an
    input (a downsampling unit: then it is undone one function at a time)."""
    contexts: dict[str, ForwardState] = {}

    def call(name: str, x: torch.Tensor) -> torch.Tensor:
        at = ForwardState(devices, run.preserve_rng)
        out = run_recording(at, getattr(run.lead, name), x)
        contexts[name] = at
        return out

    y1, y2 = _lead_steps(call, x1, x2)
    run.lead_contexts = tuple(contexts[n] for n in ("f", "shortcut1", "g", "shortcut2"))
    sources = [source_of(x1), source_of(x2)]
    if sources[0] is not None and sources[1] is not None:
        makers = [sources[0].make, sources[1].make]
    else:
        makers = [_kept(x1), _kept(x2)]
    run.lead_kept = [y1 if y1.numel() <= x1.numel() else None, *makers]
    return y1, y2


def _kept(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A lead unit's input kept for its backward (made contiguous there, as in the forward);
    an error, as autograd gives for its own saved tensors, if it was changed in place since."""
    kept, version = x.detach(), _version(x)  # a detached tensor shares x's version counter

    def make() -> torch.Tensor:
        if _version(kept) != version:
            raise RuntimeError("reversible_sequence: an input of a lead unit was changed in place "
                               "after the unit ran, and its backward needs it as it was; make "
                               "that change out of place")
        return kept.contiguous()

    return make


def _lead_steps(call: Callable[[str, torch.Tensor], torch.Tensor], x1: torch.Tensor,
                x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A lead unit's forward, the stored network's and the rebuild's alike: each input made
    contiguous (as it is made again in backward) only while its functions run, ``x2``'s first:
    ``F(x2)``, ``D2(x2)``, ``D1(x1)``, then ``y1 = F(x2) + D1(x1)``, ``y2 = G(y1) + D2(x2)``.
    ``call(name, x)`` runs the lead's function ``name`` on ``x``."""
    x2 = x2.contiguous()
    f, d2 = call("f", x2), call("shortcut2", x2)
    del x2
    y1 = f + call("shortcut1", x1.contiguous())
    del f
    return y1, call("g", y1) + d2


def _undo_lead(run: _Run, a1: torch.Tensor, a2: torch.Tensor,
               grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    """The lead unit backwards, one function at a time, each recomputed just before its
    gradients are taken and let go after: ``G`` on the kept ``y1``, then ``F``, ``D2`` and
    ``D1`` on the inputs, made again (from their sources, or kept) when their backward needs
    them. Returns the inputs' gradients; ``x2``'s sums its two uses, as autograd does."""
    y1, make1, make2 = run.lead_kept
    run.lead_kept = []
    lead, (at_f, at_d1, at_g, at_d2) = run.lead, run.lead_contexts
    aliases = {j: run.params[j].detach().requires_grad_() for j in run.lead_params}
    if y1 is None:
        with _aliased(lead, run.lead_params, aliases):
            return _undo_lead_whole(run, make1, make2, a1, a2, grads, aliases)
    with _aliased(lead, run.lead_params, aliases):
        got_y1 = _grad_of((lead, "g"), functools.partial(torch.Tensor.detach, y1), a2,
                          grads, aliases, at_g)
        del y1
        if got_y1 is not None:
            a1.add_(got_y1)
        del got_y1
        got_x2 = _grad_of((lead, "f"), make2, a1, grads, aliases, at_f)
        more = _grad_of((lead, "shortcut2"), make2, a2, grads, aliases, at_d2)
        if more is not None:
            got_x2 = more if got_x2 is None else got_x2 + more
        del more
        got_x1 = _grad_of((lead, "shortcut1"), make1, a1, grads, aliases, at_d1)
    return got_x1, got_x2


def _undo_lead_whole(run: _Run, make1: Callable[[], torch.Tensor],
                     make2: Callable[[], torch.Tensor], a1: torch.Tensor, a2: torch.Tensor,
                     grads: list[torch.Tensor | None], aliases: dict[int, torch.Tensor]
                     ) -> tuple[torch.Tensor | None, ...]:
    """The lead unit backwards in one recompute (when its first output is larger than its
    inputs, so not kept): the gradients of ``y1``, ``G(y1)`` and ``D2(x2)`` taken at once, as
    autograd takes them (``y2``'s sum is not recomputed: its gradient goes to both terms)."""
    lead, (at_f, at_d1, at_g, at_d2) = run.lead, run.lead_contexts
    with torch.enable_grad():
        anchor = _anchor(a1.device)
        v1, v2 = _StreamView.apply(anchor, make1), _StreamView.apply(anchor, make2)
        edges = [torch.autograd.graph.get_gradient_edge(v) for v in (v1, v2)]
        with _RemakeView([(v1, make1), (v2, make2)]):
            with _RecomputeContext(at_f):
                f = _owned(lead.f(v2), lead, "f", aliases)
            with _RecomputeContext(at_d2):
                roots = [_root(_owned(lead.shortcut2(v2), lead, "shortcut2", aliases))]
            with _RecomputeContext(at_d1):
                y1 = f + _owned(lead.shortcut1(v1), lead, "shortcut1", aliases)
            del f, v1, v2
            with _RecomputeContext(at_g):
                roots = [_root(y1), _root(_owned(lead.g(y1), lead, "g", aliases)), *roots]
    seeds = [a.to(y1.dtype) if a.dtype != y1.dtype else a for a in (a1, a2, a2)]
    del y1
    got = torch.autograd.grad(roots, [*edges, *aliases.values()], seeds, allow_unused=True)
    del roots, seeds
    _accumulate(grads, aliases, got[2:])
    return got[0], got[1]


def _owned(out: torch.Tensor, lead: Any, name: str, aliases: dict[int, torch.Tensor]
           ) -> torch.Tensor:
    """``out``, the recomputed output of the lead's function ``name``, once its graph is known
    to reach no tensor requiring grad but the lead's parameters (:func:`~.remake._check_own`:
    the one recompute takes gradients for those and the inputs only, so another would get none,
    silently). ``g``'s walk also passes ``f``'s and ``shortcut1``'s graphs, checked before."""
    _check_own(out, lead, name, aliases)
    return out


def _grad_of(fn: tuple[Any, str], make: Callable[[], torch.Tensor], seed: torch.Tensor,
             grads: list[torch.Tensor | None], aliases: dict[int, torch.Tensor],
             at: ForwardState) -> torch.Tensor | None:
    """The lead's function ``fn`` (the lead and a name; ``f`` and ``g`` as head and tail,
    :func:`~.remake._parts`) recomputed on the tensor ``make`` makes (made again when its
    backward needs it, not kept), then its gradients for ``seed``: the parameters' are added
    to ``grads``, the input's is returned."""
    lead, name = fn
    parts = _parts(lead, name) if name in ("f", "g") else (None, getattr(lead, name))
    out, edge, _ = _recorded(parts, make, at, (), seed.device)
    if out.requires_grad:
        _check_own(out, lead, name, aliases)
    target = _root(out)
    if seed.dtype != out.dtype:
        seed = seed.to(out.dtype)
    del out
    got = torch.autograd.grad(target, [edge, *aliases.values()], seed, allow_unused=True)
    del target, seed
    _accumulate(grads, aliases, got[1:])
    return got[0]
