"""What a rebuild's recompute is made of: the recomputed function's input as a graph node that
holds no tensor (:class:`_StreamView`), saved tensors made again instead of kept
(:class:`_RemakeView`), parameters swapped for detached aliases (:func:`_aliased`), and the
sums of their gradients (:func:`_accumulate`)."""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import _torch
from ..checkpoint.recompute import ForwardState, _RecomputeContext

# torch.autograd.grad takes an output's gradient edge in place of the output from torch 2.5 on
# (older versions keep each recomputed output alive through its backward: a little more memory)
_EDGE_OUTPUTS = _torch.VERSION >= (2, 5)


@contextlib.contextmanager
def _aliased(module: nn.Module, names: dict[int, list[str]],
             aliases: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module`` with its parameters replaced by ``aliases`` (detached, same storage), so
    that gradients computed for a recompute never touch the real parameters or their hooks.
    Put back in reverse order: a module reached by two names (shared by ``f`` and ``g``) is
    swapped twice, and must end with its own parameter, not the first swap's alias."""
    swapped = []
    for j, alias in aliases.items():
        for name in names[j]:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            swapped.append((owner, attr, _torch.module_parameters(owner)[attr]))
            _torch.module_parameters(owner)[attr] = alias
    try:
        yield
    finally:
        for owner, attr, param in reversed(swapped):
            _torch.module_parameters(owner)[attr] = param


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


# block -> the names of its functions whose recompute reached no tensor but its own parameters
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_own(out: torch.Tensor, block: Any, name: str,
               aliases: dict[int, torch.Tensor]) -> None:
    """Refuse, in one line, a function ``name`` of ``block`` whose recompute reaches a tensor
    requiring grad that is not one of the block's parameters (another module's parameter, a
    tensor captured from outside): the rebuild gives gradients to the block's parameters and
    streams only, so that tensor would get none, silently, where the stored network gives it
    one. Walks the recompute's graph (down to the input's :class:`_StreamView`) once per
    block and function."""
    done = _CHECKED.setdefault(block, set())
    if name in done:
        return
    own = {id(a) for a in aliases.values()}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node.name() == "_StreamViewBackward":
            continue
        seen.add(node)
        if getattr(node, "variable", None) is not None and id(node.variable) not in own:
            raise RuntimeError(f"reversible_sequence: {name} of a {type(block).__name__} uses "
                               f"a tensor that requires grad but is not one of the block's "
                               f"parameters, and the rebuild would give it no gradient; make "
                               f"it a parameter of the block, detach it, or use rebuild=False")
        todo.extend(next_node for next_node, _ in node.next_functions)
    done.add(name)


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


def _root(out: torch.Tensor) -> torch.Tensor | torch.autograd.graph.GradientEdge:
    """Where ``torch.autograd.grad`` starts from ``out``: its gradient edge (``out`` itself can
    then be let go), or ``out`` before torch 2.5."""
    return torch.autograd.graph.get_gradient_edge(out) if _EDGE_OUTPUTS else out


def _parts(block: Any, name: str) -> tuple[Any, Any]:
    """``block``'s function ``name`` (``"f"`` or ``"g"``) as ``(head, tail)``: the block's
    ``f_parts``/``g_parts`` if it has them (a cheap normalisation first, which the rebuild makes
    again when its backward needs it instead of keeping its output), else ``(None, fn)``."""
    split = getattr(block, f"{name}_parts", None)
    parts = split() if split is not None else None
    return parts if parts is not None else (None, getattr(block, name))


def _remade(head: Any, make: Callable[[], torch.Tensor], at: ForwardState) -> torch.Tensor:
    """``head`` again on the input ``make`` makes, as the recompute ran it."""
    with torch.no_grad(), _RecomputeContext(at):
        return head(make())


def _recorded(fn: tuple[Any, Any], make: Callable[[], torch.Tensor], at: ForwardState,
              args: tuple, device: torch.device
              ) -> tuple[torch.Tensor, torch.autograd.graph.GradientEdge, _RemakeView]:
    """``fn`` (head and tail, :func:`_parts`) recomputed with its graph on the tensor ``make``
    makes, under the forward's RNG and autocast state and the recompute guard (BatchNorm
    statistics are not updated a second time): its output, the edge where its input's gradient
    arrives, and the saved-tensor hooks that make the input and the head's output again when
    backward needs them. Neither is held here while ``fn`` runs, so each is let go once used."""
    with torch.enable_grad():
        # a non-leaf input, as in the stored network: module hooks that watch their inputs'
        # gradients (torch's ModTracker, under MemTracker) cannot watch a leaf during a nested
        # torch.autograd.grad
        view = _StreamView.apply(_anchor(device), make)
        edge = torch.autograd.graph.get_gradient_edge(view)
        remake = _RemakeView([(view, make)])
        head, tail = fn
        with remake, _RecomputeContext(at):
            box = [view]
            del view
            if head is not None:
                box.append(head(box.pop()))
                remake.adopt(box[0], functools.partial(_remade, head, make, at))
            out = _consumed(tail, box, args)
    return out, edge, remake


def _consumed(fn: Any, box: list[torch.Tensor], args: tuple) -> torch.Tensor:
    """``fn(box.pop(), *args)`` holding no reference to the input but ``fn``'s own, so ``fn``
    can let it go once used (CPython 3.11+ hands a call's arguments to the new frame; a
    ``*args`` call keeps them in a tuple until it returns)."""
    return fn(box.pop(), *args) if args else fn(box.pop())
