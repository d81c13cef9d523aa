"""``rebuild=True``: keep the last block's integer outputs and, in backward, rebuild every
block's inputs from its outputs, recomputing ``G`` then ``F`` once each."""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..checkpoint.recompute import _cuda_devices, _ForwardContext, _RecomputeContext
from .coupling import LeadBlock, ReversibleBlock
from .grid import Grid, _add, _checked, _enter, from_fixed
from .sources import Source, remember, source_of

# torch.autograd.grad takes an output's gradient edge in place of the output from torch 2.5 on
# (older versions keep each recomputed output alive through its backward: a little more memory)
_EDGE_OUTPUTS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


class _Run:
    """What the rebuilding Function needs besides tensors: the blocks, the extra arguments, each
    block's trainable parameters (indices into the Function's parameter inputs), and the RNG /
    autocast state each ``f`` and ``g`` ran under in the forward."""

    def __init__(self, blocks: Sequence[ReversibleBlock], args: tuple, grid: Grid,
                 preserve_rng: bool, lead: LeadBlock | None = None):
        self.blocks, self.args, self.grid = list(blocks), args, grid
        self.preserve_rng, self.lead = preserve_rng, lead
        index: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        self.block_params: list[dict[int, list[str]]] = []  # parameter index -> its names
        for block in ([] if lead is None else [lead]) + self.blocks:
            names: dict[int, list[str]] = {}
            for name, p in block.named_parameters(remove_duplicate=False):
                if p.requires_grad:
                    if id(p) not in index:
                        index[id(p)] = len(self.params)
                        self.params.append(p)
                    names.setdefault(index[id(p)], []).append(name)
            self.block_params.append(names)
        self.lead_params = self.block_params.pop(0) if lead is not None else {}
        self.lead_contexts: tuple[_ForwardContext, _ForwardContext] | None = None
        self.contexts: list[tuple[_ForwardContext, _ForwardContext]] = []
        # what the lead's backward needs: its first output, and its inputs' sources (of the
        # sequence before it) or the inputs themselves; let go as soon as used
        self.lead_kept: list[Any] = []
        self.out: tuple[Source, Source] | None = None  # the outputs' sources, for _rebuilt


@contextlib.contextmanager
def _aliased(module: nn.Module, names: dict[int, list[str]],
             aliases: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module`` with its parameters replaced by ``aliases`` (detached, same storage), so
    that gradients computed for a recompute never touch the real parameters or their hooks."""
    swapped = []
    for j, alias in aliases.items():
        for name in names[j]:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            swapped.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = alias
    try:
        yield
    finally:
        for owner, attr, param in swapped:
            owner._parameters[attr] = param


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
                with _ForwardContext(devices, run.preserve_rng) as at:
                    views[j] = None  # this stream's old view, already used
                    views[j] = _add(streams[j], fn(views[1 - j], *run.args), grid, checks,
                                    inplace=True)[1]
                contexts.append(at)
            run.contexts.append((contexts[0], contexts[1]))
        ctx.save_for_backward(k1, k2)
        ctx.run = run
        y1, y2, bad = _checked(views[0], views[1], grid, checks)
        run.out = (Source(k1, grid, bad), Source(k2, grid, bad))
        return y1, y2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, a1: torch.Tensor, a2: torch.Tensor) -> tuple[Any, ...]:
        run, grid = ctx.run, ctx.run.grid
        for source in run.out or ():
            source.k = None  # the streams are rebuilt in place from here on
        try:
            k1, k2 = ctx.saved_tensors
        except RuntimeError as e:
            if "inplace" not in str(e):
                raise
            raise RuntimeError("reversible_sequence: backward ran twice through a sequence with "
                               "rebuild=True (retain_graph=True); its streams are rebuilt in "
                               "place, so run the forward again, or use rebuild=False") from None
        grads: list[torch.Tensor | None] = [None] * len(run.params)
        for i in reversed(range(len(run.blocks))):
            block, (at_f, at_g) = run.blocks[i], run.contexts[i]
            named = run.block_params[i]
            aliases = {j: run.params[j].detach().requires_grad_() for j in named}
            with _aliased(block, named, aliases):
                # G on y1 (k1): x2 = y2 - G(y1), then G's gradients; a1 is ours (_Fresh)
                _undo(_parts(block, "g"), k1, k2, a2, a1, grads, aliases, grid, at_g, run.args)
                # F on x2 (k2): x1 = y1 - F(x2), then F's gradients
                _undo(_parts(block, "f"), k2, k1, a1, a2, grads, aliases, grid, at_f,
                      run.args)
        if run.lead is not None:
            a1, a2 = _undo_lead(run, a1, a2, grads)
        return (None, a1, a2, *grads)


def _lead_forward(run: _Run, x1: torch.Tensor, x2: torch.Tensor, devices: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lead unit on the sequence's inputs: its outputs. Its backward keeps the makers of its
    inputs: their sources when they can be made again from the streams of the sequence before
    (:mod:`.sources`), else the inputs themselves; and its first output if no larger than an
    input (a downsampling unit: then it is undone one function at a time)."""
    contexts: dict[str, _ForwardContext] = {}

    def call(name: str, x: torch.Tensor) -> torch.Tensor:
        with _ForwardContext(devices, run.preserve_rng) as at:
            out = getattr(run.lead, name)(x)
        contexts[name] = at
        return out

    y1, y2 = _lead_steps(call, x1, x2)
    run.lead_contexts = tuple(contexts[n] for n in ("f", "shortcut1", "g", "shortcut2"))
    sources = [source_of(x1), source_of(x2)]
    if sources[0] is not None and sources[1] is not None:
        makers = [sources[0].make, sources[1].make]
    else:
        makers = [functools.partial(torch.Tensor.contiguous, x.detach()) for x in (x1, x2)]
    run.lead_kept = [y1 if y1.numel() <= x1.numel() else None, *makers]
    return y1, y2


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
        got_y1 = _grad_of(lead.g, functools.partial(torch.Tensor.detach, y1), a2, grads,
                          aliases, at_g)
        del y1
        if got_y1 is not None:
            a1.add_(got_y1)
        del got_y1
        got_x2 = _grad_of(lead.f, make2, a1, grads, aliases, at_f)
        more = _grad_of(lead.shortcut2, make2, a2, grads, aliases, at_d2)
        if more is not None:
            got_x2 = more if got_x2 is None else got_x2 + more
        del more
        got_x1 = _grad_of(lead.shortcut1, make1, a1, grads, aliases, at_d1)
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
                f = lead.f(v2)
            with _RecomputeContext(at_d2):
                roots = [_root(lead.shortcut2(v2))]
            with _RecomputeContext(at_d1):
                y1 = f + lead.shortcut1(v1)
            del f, v1, v2
            with _RecomputeContext(at_g):
                roots = [_root(y1), _root(lead.g(y1)), *roots]
    seeds = [a.to(y1.dtype) if a.dtype != y1.dtype else a for a in (a1, a2, a2)]
    del y1
    got = torch.autograd.grad(roots, [*edges, *aliases.values()], seeds, allow_unused=True)
    del roots, seeds
    _accumulate(grads, aliases, got[2:])
    return got[0], got[1]


def _root(out: torch.Tensor) -> torch.Tensor | torch.autograd.graph.GradientEdge:
    """Where ``torch.autograd.grad`` starts from ``out``: its gradient edge (``out`` itself can
    then be let go), or ``out`` before torch 2.5."""
    return torch.autograd.graph.get_gradient_edge(out) if _EDGE_OUTPUTS else out


def _grad_of(fn: Callable[[torch.Tensor], torch.Tensor], make: Callable[[], torch.Tensor],
             seed: torch.Tensor, grads: list[torch.Tensor | None],
             aliases: dict[int, torch.Tensor], at: _ForwardContext) -> torch.Tensor | None:
    """``fn`` recomputed on the tensor ``make`` makes (made again when its backward needs it,
    not kept), then its gradients for ``seed``: the parameters' are added to ``grads``, the
    input's is returned."""
    with torch.enable_grad():
        view = _StreamView.apply(_anchor(seed.device), make)
        edge = torch.autograd.graph.get_gradient_edge(view)
        with _RemakeView([(view, make)]), _RecomputeContext(at):
            out = fn(view)
    del view
    target: torch.Tensor | torch.autograd.graph.GradientEdge = out
    if _EDGE_OUTPUTS:
        target = torch.autograd.graph.get_gradient_edge(out)
    if seed.dtype != out.dtype:
        seed = seed.to(out.dtype)
    del out
    got = torch.autograd.grad(target, [edge, *aliases.values()], seed, allow_unused=True)
    del target, seed
    _accumulate(grads, aliases, got[1:])
    return got[0]


def _undo(fn: Any, k_in: torch.Tensor, k_out: torch.Tensor, seed: torch.Tensor,
          into: torch.Tensor, grads: list[torch.Tensor | None], aliases: dict[int, torch.Tensor],
          grid: Grid, at: _ForwardContext, args: tuple) -> None:
    """One half of a block backwards: recompute ``fn`` on stream ``k_in``, take its output off
    ``k_out`` (in place: the streams are the rebuild's own), then its gradients for ``seed``
    (the output's gradient): the input's is added to ``into`` in place, the parameters' to
    ``grads``.

    What stays alive is what the gradients need and no more: ``fn``'s output is put on the grid
    (in its own memory when its graph did not save it) and let go before its backward (its
    graph is reached by its gradient edge), and ``fn``'s input, a float view of ``k_in``, is
    not kept in its graph but made again from ``k_in`` when the backward needs it (``k_in`` does
    not change meanwhile)."""
    out, edge, owned = _recompute(fn, k_in, grid, at, args)
    _take_off(k_out, out, grid, owned)
    if not out.requires_grad:
        return
    target: torch.Tensor | torch.autograd.graph.GradientEdge = out
    if _EDGE_OUTPUTS:
        target = torch.autograd.graph.get_gradient_edge(out)
    if seed.dtype != out.dtype:  # autograd casts a gradient to its output's dtype
        seed = seed.to(out.dtype)
    del out
    got = torch.autograd.grad(target, [edge, *aliases.values()], seed, allow_unused=True)
    del target, seed
    if got[0] is not None:
        into.add_(got[0])
    _accumulate(grads, aliases, got[1:])


class _StreamView(torch.autograd.Function):
    """The float view of a stream as the first node of a recompute's graph: the gradient
    arriving here is the input gradient (read at this node's edge; the node itself never runs).
    Unlike a leaf, it holds no tensor, so the view can be let go."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, make: Callable[[], torch.Tensor]
                ) -> torch.Tensor:
        return make()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class _Held:
    """A tensor a recompute's graph saved, as the graph holds it: the tensor, or once the
    tensor is known to be made again (:meth:`_RemakeView.adopt`), where to find it."""

    __slots__ = ("t", "recipe", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t: torch.Tensor | None = t
        self.recipe: tuple | None = None


class _RemakeView(torch.autograd.graph.saved_tensors_hooks):
    """While a recompute records its graph: a saved tensor that lives in one of its inputs
    (``views``: each with the call that makes it, a stream's float view or a kept tensor) or in
    a tensor :meth:`adopt` names is not kept but made again when backward unpacks it (one copy
    at a time, shared by every node that saved it), bit for bit the same values. The others are
    held as they are (``_Held``, watched weakly: the graph holds them until released)."""

    def __init__(self, views: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]) -> None:
        storages = [weakref.ref(view.untyped_storage()) for view, _ in views]
        makers = [make for _, make in views]
        made: list[Callable[[], torch.Tensor | None]] = [lambda: None] * len(views)
        held: list[weakref.ref[_Held]] = []
        self._lists = (storages, makers, made, held)  # the hooks must not hold self (a cycle)

        def pack(t: torch.Tensor) -> Any:
            st = t.untyped_storage()
            for i, storage in enumerate(storages):
                if st is storage():
                    return i, t.size(), t.stride(), t.storage_offset()
            h = _Held(t)
            held.append(weakref.ref(h))
            return h

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Held):
                if packed.t is not None:
                    return packed.t
                packed = packed.recipe
            i, *layout = packed
            again = made[i]()
            if again is None:
                again = makers[i]()
                made[i] = weakref.ref(again)
            return again.as_strided(*layout)

        super().__init__(pack, unpack)

    def adopt(self, t: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
        """From now on ``t`` (and what the graph saved of it already) is made again by
        ``make`` when needed instead of kept."""
        storages, makers, made, held = self._lists
        st = t.untyped_storage()
        if any(st is storage() for storage in storages):
            return
        storages.append(weakref.ref(st))
        makers.append(make)
        made.append(lambda: None)
        for ref in held:
            h = ref()
            if h is not None and h.t is not None and h.t.untyped_storage() is st:
                h.recipe = (len(makers) - 1, h.t.size(), h.t.stride(), h.t.storage_offset())
                h.t = None

    def keeps(self, st: torch.UntypedStorage) -> bool:
        """Whether the graph holds a tensor living in ``st`` as it is."""
        return any(h is not None and h.t is not None and h.t.untyped_storage() is st
                   for h in (ref() for ref in self._lists[3]))


def _parts(block: ReversibleBlock, name: str) -> tuple[Any, Any]:
    """``block``'s function ``name`` (``"f"`` or ``"g"``) as ``(head, tail)``: the block's
    ``f_parts``/``g_parts`` if it has them (a cheap normalisation first, which the rebuild makes
    again when its backward needs it instead of keeping its output), else ``(None, fn)``."""
    split = getattr(block, f"{name}_parts", None)
    parts = split() if split is not None else None
    return parts if parts is not None else (None, getattr(block, name))


def _remade(head: Any, make: Callable[[], torch.Tensor], at: _ForwardContext) -> torch.Tensor:
    """``head`` again on the input ``make`` makes, as the recompute ran it."""
    with torch.no_grad(), _RecomputeContext(at):
        return head(make())


def _recompute(fn: tuple[Any, Any], k: torch.Tensor, grid: Grid, at: _ForwardContext,
               args: tuple) -> tuple[torch.Tensor, torch.autograd.graph.GradientEdge, bool]:
    """``fn`` (head and tail, :func:`_parts`) on the float view of ``k``, under the forward's
    RNG and autocast state and the recompute guard (BatchNorm statistics are not updated a
    second time): its output, the edge where its input's gradient arrives, and whether the
    output's memory is the rebuild's own (no view of another tensor, nor saved by the graph)."""
    head, tail = fn
    with torch.enable_grad():
        # a non-leaf input, as in the stored network: module hooks that watch their inputs'
        # gradients (torch's ModTracker, under MemTracker) cannot watch a leaf during a nested
        # torch.autograd.grad
        make = functools.partial(from_fixed, k, grid)
        view = _StreamView.apply(_anchor(k.device), make)
        edge = torch.autograd.graph.get_gradient_edge(view)
        remake = _RemakeView([(view, make)])
        with remake, _RecomputeContext(at):
            x = view
            if head is not None:
                x = head(view)
                remake.adopt(x, functools.partial(_remade, head, make, at))
            del view
            out = tail(x, *args)
            del x
    st = out.untyped_storage()
    return out, edge, out._base is None and not remake.keeps(st)


def _take_off(k: torch.Tensor, out: torch.Tensor, grid: Grid, owned: bool) -> None:
    """``k -= to_fixed(out)``, bit for bit; an ``owned`` output is scaled in place (one
    temporary the size of ``k`` instead of two)."""
    if out.dtype in (torch.float16, torch.bfloat16):
        scaled = out.float().mul_(grid.scale)
    elif owned:
        scaled = out.detach().mul_(grid.scale)
    else:
        scaled = out * grid.scale
    k.sub_(scaled.to(grid.stream))


def _anchor(device: torch.device) -> torch.Tensor:
    """An empty tensor requiring grad: what makes :class:`_StreamView`'s output part of a graph."""
    return torch.empty(0, device=device, requires_grad=True)


def _accumulate(grads: list[torch.Tensor | None], aliases: dict[int, torch.Tensor],
                got: Sequence[torch.Tensor | None]) -> None:
    """Add a recompute's parameter gradients, in the order autograd would (G before F, later
    blocks first), to the sums returned for the parameters."""
    for j, grad in zip(aliases, got):
        if grad is not None:
            grads[j] = grad if grads[j] is None else grads[j] + grad


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


@torch.compiler.disable
def _rebuilt(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor, args: tuple,
             grid: Grid, preserve_rng: bool, lead: LeadBlock | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    run = _Run(blocks, args, grid, preserve_rng, lead)
    y1, y2 = _Fresh.apply(*_Rebuild.apply(run, x1, x2, *run.params))
    if run.out is not None:  # the outputs can be made again from the streams (.sources)
        remember(y1, run.out[0])
        remember(y2, run.out[1])
    return y1, y2
