"""The zoo's one reversible coupling: a block's inputs rebuilt exactly from its outputs.

A reversible block splits the activations into two streams and couples them additively
(Gomez et al. 2017, "The Reversible Residual Network: Backpropagation Without Storing
Activations", arXiv:1707.04585; the reversible ViT of Mangalam et al., CVPR 2022, and the
Reformer's layers use the same coupling)::

    y1 = x1 + F(x2)            x2 = y2 - G(y1)
    y2 = x2 + G(y1)            x1 = y1 - F(x2)

so backward can rebuild each block's inputs from its outputs instead of storing them, and the
activations a sequence of blocks keeps do not grow with its depth. Done in floating point the
inversion is not exact: ``(x1 + F(x2)) - F(x2) != x1`` after rounding, the rebuilt inputs drift
from the real ones block after block, and so do the gradients (which is why the public
implementations need gradient clipping at depth).

Here the streams are **fixed-point integers** (as Maclaurin et al. 2015 and Momentum ResNets,
Sander et al. 2021, make reversal exact): a stream is an integer tensor ``k`` holding the value
``k * 2**-frac_bits`` (:class:`Grid`). ``F`` and ``G`` run in floating point on the stream's float
view ``from_fixed(k)``; their outputs are put on the grid by ``to_fixed`` (multiply by
``2**frac_bits``, truncate toward zero) and added as integers. Integer addition is exact and
invertible, so ``x1 = y1 - to_fixed(F(x2))`` gives back ``x1`` bit for bit as long as ``F``
recomputes the same output, which it does: it runs on the same float view, replaying the
forward's random numbers and autocast state, with BatchNorm's running statistics left alone
(zoo.checkpoint's recompute guard, :mod:`zoo.checkpoint.recompute`).

Range and resolution (:func:`grid_for`): a stream is as wide as the float it stands for.

* float32 (and bfloat16/float16) streams are ``int32`` with 16 fractional bits: a step of
  ``2**-16`` (1.5e-5, absolute) and values below ``2**14`` (16384) in magnitude. The same 4
  bytes per value as float32, which is what keeps the reversible models' memory low (64-bit
  streams would cost 1.2x more activation memory on RevNet-110); an output of ``F`` or ``G`` is
  rounded to 1.5e-5, finer than bfloat16 or float16 for values above 4e-3 and 2e-2.
* float64 streams are ``int64`` with 32 fractional bits: a step of ``2**-32`` (2.3e-10) and
  values below ``2**30``.

The float view rounds the integer to the float dtype once (float32 holds it exactly below 256).
An input, a stream value or an ``F``/``G`` output that is not finite or reaches the limit makes
both outputs of the sequence NaN: below the limit no addition can overflow, and a diverging run
is seen (a non-finite loss) instead of wrapping around.

Gradients are straight-through: ``to_fixed`` and ``from_fixed`` count as the identity, so the
gradient is the usual RevNet gradient of ``y1 = x1 + F(x2), y2 = x2 + G(y1)``. The network with
``rebuild=False`` is *the same network*: the same integer forward, built from autograd
Functions and storing ``F``'s and ``G``'s activations as any network does; ``rebuild=True``
keeps only the last block's integer outputs and, in backward, rebuilds each block's inputs from
its outputs, recomputing ``G`` and then ``F`` once each. Both give the same outputs, parameter
and input gradients, BatchNorm buffers and dropout masks, bit for bit, in float32, float64 and
under autocast (tests/test_reversible.py): the gradient sums the rebuild forms (``a + b`` of
two contributions) are the ones autograd forms for the stored network, and float addition of
two numbers does not depend on their order.

Contract for a block (:class:`Coupling`, or any module with methods ``f`` and ``g``): ``f`` and
``g`` are deterministic given their input, the random numbers and the autocast state, use only
the block's own parameters (those of ``block.parameters()``), and return a tensor of their
input's shape. Extra arguments (an attention mask) are passed to both and must not require
grad.

How it runs: ``rebuild=True`` is one autograd Function per sequence whose backward calls
``torch.autograd.grad`` on each recomputed ``F`` and ``G`` (a nested backward: the rebuild needs
each block's input-gradient before it can rebuild the block below). The parameters enter that
Function as inputs and their gradients leave it as outputs, so they reach the outer graph once
per step (DistributedDataParallel's hooks fire once; a hook on a parameter fires once: the
recompute runs on detached aliases of the parameters). Under ``torch.no_grad()`` both settings
run the plain forward and keep nothing. Under ``torch.compile`` the rebuilding Function is left
to eager mode (a graph break: Dynamo cannot trace a backward that recomputes a forward and runs
the autograd engine on it), and the rest of the model compiles; ``rebuild=False`` traces fully.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .checkpoint.recompute import _cuda_devices, _ForwardContext, _RecomputeContext

# torch.autograd.grad takes an output's gradient edge in place of the output from torch 2.5 on
# (older versions keep each recomputed output alive through its backward: a little more memory)
_EDGE_OUTPUTS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)

__all__ = ["Coupling", "ReversibleBlock", "Grid", "grid_for", "reversible_sequence", "to_fixed",
           "from_fixed"]


@dataclass(frozen=True)
class Grid:
    """A fixed-point stream format: ``stream`` integers counting steps of ``2**-frac_bits``,
    with float views of dtype ``view``. ``limit`` is the largest magnitude a stream value or an
    ``F``/``G`` output may reach: below it no addition can overflow."""

    stream: torch.dtype
    frac_bits: int
    view: torch.dtype

    @property
    def scale(self) -> float:
        return 2.0 ** self.frac_bits

    @property
    def step(self) -> float:
        return 2.0 ** -self.frac_bits

    @property
    def limit(self) -> float:
        return 2.0 ** (torch.iinfo(self.stream).bits - 2 - self.frac_bits)


def grid_for(dtype: torch.dtype) -> Grid:
    """The grid of streams whose float views are ``dtype``: 64-bit integers with 32 fractional
    bits for float64, 32-bit integers with 16 fractional bits for float32 and narrower."""
    if not dtype.is_floating_point:
        raise TypeError(f"reversible streams are floating-point tensors, got {dtype}")
    if dtype == torch.float64:
        return Grid(torch.int64, 32, dtype)
    return Grid(torch.int32, 16, dtype)


class ReversibleBlock(Protocol):
    """What :func:`reversible_sequence` runs: an ``nn.Module`` with ``f`` and ``g``."""

    def f(self, x: torch.Tensor, *args: Any) -> torch.Tensor: ...

    def g(self, x: torch.Tensor, *args: Any) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class Coupling(nn.Module):
    """A reversible block made of two modules: ``f`` and ``g`` are its submodules (so the
    state_dict names are ``f.*`` and ``g.*``); extra arguments are not passed on."""

    def __init__(self, f: nn.Module, g: nn.Module) -> None:
        super().__init__()
        self.f, self.g = f, g


# ------------------------------------------------------------------------------------------------
# The fixed-point grid
# ------------------------------------------------------------------------------------------------
def to_fixed(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``x`` on the grid: ``trunc(x * 2**frac_bits)`` as stream integers (half floats widened
    first, so that the scaling cannot overflow)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    return (x * grid.scale).to(grid.stream)


def from_fixed(k: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The float view of stream ``k``: ``k * 2**-frac_bits``, rounded once to the view dtype
    (through float32 for float16, whose range the integers exceed)."""
    if grid.view == torch.float16:
        return k.float().mul_(grid.step).half()
    return k.to(grid.view).mul_(grid.step)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """max |x| (NaN if x holds a NaN): what the range check of the sequence's outputs reads."""
    return torch.linalg.vector_norm(x, float("inf"))


def _enter(x: torch.Tensor, grid: Grid, checks: list[torch.Tensor]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor onto the grid: (stream, float view); its magnitude joins ``checks``."""
    checks.append(_magnitude(x))
    k = to_fixed(x, grid)
    return k, from_fixed(k, grid)


def _add(k: torch.Tensor, out: torch.Tensor, grid: Grid, checks: list[torch.Tensor],
         inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream ``k`` plus ``out`` on the grid (into ``k`` itself if ``inplace``): (stream, float
    view); the magnitudes of ``out`` and of the new view join ``checks`` (every addition then
    has both terms below the limit)."""
    checks.append(_magnitude(out))
    fixed = to_fixed(out, grid)
    k = k.add_(fixed) if inplace else k + fixed
    del fixed
    view = from_fixed(k, grid)
    checks.append(_magnitude(view))
    return k, view


def _checked(v1: torch.Tensor, v2: torch.Tensor, grid: Grid,
             checks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs, NaN if an input, a stream or an F/G output reached the limit or was not
    finite (adding 0 changes no value: a float view is never -0)."""
    worst = torch.stack(checks).amax()
    bad = torch.where(worst < grid.limit, 0.0, float("nan"))
    return v1 + bad, v2 + bad


# ------------------------------------------------------------------------------------------------
# rebuild=False: the network storing its activations, one autograd node per stream update
# ------------------------------------------------------------------------------------------------
class _Enter(torch.autograd.Function):
    """A float tensor enters the grid: (stream, float view, magnitude); gradient straight
    through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, ...]:
        checks: list[torch.Tensor] = []
        k, view = _enter(x, grid, checks)
        ctx.mark_non_differentiable(k, *checks)
        return k, view, *checks

    @staticmethod
    def backward(ctx: Any, _k: None, grad: torch.Tensor, *_checks: None) -> tuple[Any, ...]:
        return grad, None


class _Add(torch.autograd.Function):
    """Stream update ``k + to_fixed(out)``: (stream, float view, magnitudes); the view's
    gradient goes straight through to the old view and to ``out``."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, view: torch.Tensor, out: torch.Tensor,
                grid: Grid) -> tuple[torch.Tensor, ...]:
        checks: list[torch.Tensor] = []
        k, view = _add(k, out, grid, checks)
        ctx.mark_non_differentiable(k, *checks)
        return k, view, *checks

    @staticmethod
    def backward(ctx: Any, _k: None, grad: torch.Tensor, *_checks: None) -> tuple[Any, ...]:
        return None, grad, grad, None


def _stored(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor,
            args: tuple, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    k1, v1, *checks = _Enter.apply(x1, grid)
    k2, v2, *more = _Enter.apply(x2, grid)
    checks += more
    for block in blocks:
        k1, v1, *more = _Add.apply(k1, v1, block.f(v2, *args), grid)
        checks += more
        k2, v2, *more = _Add.apply(k2, v2, block.g(v1, *args), grid)
        checks += more
    return _checked(v1, v2, grid, checks)


# ------------------------------------------------------------------------------------------------
# rebuild=True: keep the last integer outputs, rebuild every block's inputs in backward
# ------------------------------------------------------------------------------------------------
class _Run:
    """What the rebuilding Function needs besides tensors: the blocks, the extra arguments, each
    block's trainable parameters (indices into the Function's parameter inputs), and the RNG /
    autocast state each ``f`` and ``g`` ran under in the forward."""

    def __init__(self, blocks: Sequence[ReversibleBlock], args: tuple, grid: Grid,
                 preserve_rng: bool):
        self.blocks, self.args, self.grid = list(blocks), args, grid
        self.preserve_rng = preserve_rng
        index: dict[int, int] = {}
        self.params: list[nn.Parameter] = []
        self.block_params: list[dict[int, list[str]]] = []  # parameter index -> its names
        for block in self.blocks:
            names: dict[int, list[str]] = {}
            for name, p in block.named_parameters(remove_duplicate=False):
                if p.requires_grad:
                    if id(p) not in index:
                        index[id(p)] = len(self.params)
                        self.params.append(p)
                    names.setdefault(index[id(p)], []).append(name)
            self.block_params.append(names)
        self.contexts: list[tuple[_ForwardContext, _ForwardContext]] = []


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
        return _checked(views[0], views[1], grid, checks)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, a1: torch.Tensor, a2: torch.Tensor) -> tuple[Any, ...]:
        run, grid = ctx.run, ctx.run.grid
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
                _undo(block.g, k1, k2, a2, a1, grads, aliases, grid, at_g, run.args)
                # F on x2 (k2): x1 = y1 - F(x2), then F's gradients
                _undo(block.f, k2, k1, a1, a2, grads, aliases, grid, at_f, run.args)
        return (None, a1, a2, *grads)


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
    def forward(ctx: Any, anchor: torch.Tensor, k: torch.Tensor, grid: Grid) -> torch.Tensor:
        return from_fixed(k, grid)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        return None, None, None


class _RemakeView(torch.autograd.graph.saved_tensors_hooks):
    """While a recompute records its graph: a saved tensor that lives in the stream's float
    view is not kept but made again from the stream when backward unpacks it (one copy at a
    time, shared by every node that saved it), bit for bit the same values. ``saved`` lists
    the storages of the others (weakly: every saved tensor holds the pack hook until released).
    """

    def __init__(self, view: torch.Tensor, k: torch.Tensor, grid: Grid) -> None:
        storage, made = weakref.ref(view.untyped_storage()), [lambda: None]
        saved = self.saved = [storage]  # the hooks must not hold self (a cycle holding k)

        def pack(t: torch.Tensor) -> Any:
            st = t.untyped_storage()
            if st is not storage():
                saved.append(weakref.ref(st))
                return t
            return t.size(), t.stride(), t.storage_offset()

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            again = made[0]()
            if again is None:
                again = from_fixed(k, grid)
                made[0] = weakref.ref(again)
            return again.as_strided(*packed)

        super().__init__(pack, unpack)


def _recompute(fn: Any, k: torch.Tensor, grid: Grid, at: _ForwardContext, args: tuple
               ) -> tuple[torch.Tensor, torch.autograd.graph.GradientEdge, bool]:
    """``fn`` on the float view of ``k``, under the forward's RNG and autocast state and the
    recompute guard (BatchNorm statistics are not updated a second time): its output, the edge
    where its input's gradient arrives, and whether the output's memory is the rebuild's own
    (no view of another tensor, nor saved by the graph)."""
    with torch.enable_grad():
        # a non-leaf input, as in the stored network: module hooks that watch their inputs'
        # gradients (torch's ModTracker, under MemTracker) cannot watch a leaf during a nested
        # torch.autograd.grad
        view = _StreamView.apply(_anchor(k.device), k, grid)
        edge = torch.autograd.graph.get_gradient_edge(view)
        remake = _RemakeView(view, k, grid)
        with remake, _RecomputeContext(at):
            out = fn(view, *args)
    st = out.untyped_storage()
    return out, edge, out._base is None and all(r() is not st for r in remake.saved)


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
             grid: Grid, preserve_rng: bool) -> tuple[torch.Tensor, torch.Tensor]:
    run = _Run(blocks, args, grid, preserve_rng)
    return _Fresh.apply(*_Rebuild.apply(run, x1, x2, *run.params))


def reversible_sequence(blocks: Sequence[ReversibleBlock], x1: torch.Tensor, x2: torch.Tensor,
                        *args: Any, rebuild: bool = True,
                        preserve_rng_state: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Run reversible ``blocks`` on the streams ``(x1, x2)`` and return ``(y1, y2)``.

    Each block computes ``y1 = x1 + F(x2), y2 = x2 + G(y1)`` on fixed-point streams (module
    docstring). ``rebuild=True`` keeps only the last block's integer outputs and rebuilds every
    block's inputs in backward (activation memory independent of the number of blocks);
    ``rebuild=False`` is the same network storing its activations. Both give the same results
    bit for bit. ``args`` are passed to every ``f`` and ``g`` (an attention mask); they must not
    require grad. ``preserve_rng_state=False`` skips saving the RNG state before each ``f`` and
    ``g`` (only for blocks that draw no random numbers).

    The outputs have the dtypes of the inputs (float views of the streams; an out-of-range
    value makes them NaN). Under ``torch.no_grad()`` nothing is kept either way.
    """
    blocks = list(blocks)
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError(f"reversible_sequence: the two streams must have one shape and dtype, "
                         f"got {tuple(x1.shape)} {x1.dtype} and {tuple(x2.shape)} {x2.dtype}; "
                         f"split one tensor in halves")
    grid = grid_for(x1.dtype)
    for a in args:
        if isinstance(a, torch.Tensor) and a.requires_grad:
            raise ValueError("reversible_sequence: an extra argument requires grad, but only the "
                             "two streams and the blocks' parameters get gradients; detach it or "
                             "make it a parameter of a block")
    if not blocks:
        return x1, x2
    if not rebuild or not torch.is_grad_enabled():
        return _stored(blocks, x1, x2, args, grid)
    return _rebuilt(blocks, x1, x2, args, grid, preserve_rng_state)
