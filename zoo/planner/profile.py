"""Profile a model's chain of blocks for the planner: bytes, FLOPs, and when memory rises.

Two training steps (forward, loss, backward) run under ``FakeTensorMode``, so no kernel runs and
a model or batch too large for the machine costs next to nothing to profile, while
``MemTracker`` (the project's exact CPU memory figure) and ``FlopCounterMode`` see every tensor:

1. the chain stored plainly: for each block, the storages autograd saves for backward (through
   ``saved_tensors_hooks``, unique storages, parameters excluded, the ones shared with the block's
   input or output flagged), the bytes at each boundary, the forward FLOPs, and how far memory
   rises above its level at the block's start in forward and in backward;
2. every block checkpointed on its own (one ``zoo.checkpoint`` region each): how far the
   no-saving forward rises, and the FLOPs its recompute costs (torch stops a recompute once it has
   rebuilt the last saved tensor, so a block ending in a matmul does not rerun that matmul).

Outside the chain (stem, head, loss) nothing is modelled: the memory levels there are read off
the first run and enter the planner as constants. A block whose output shares its input's
storage (an in-place ReLU) is merged with the block before it into one *unit*: the planner never
cuts between them (cutting there saves nothing: both are the same memory).

The memory model is rotor's (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory", arXiv:1911.13214): these per-unit
figures are what :mod:`.solve` (one level) and :mod:`.nested` (checkpoints inside recomputes,
as ``ZooModel.set_checkpoint_plan`` runs them) need. A block running its own checkpoints
(``block_mode``) keeps their inputs in the regions, not as autograd saved tensors; the profiler
counts them too (``zoo.checkpoint.region.observers``).
"""
from __future__ import annotations

import contextlib
import math
from functools import partial
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint import region
from ..checkpoint import checkpoint, is_recomputing
from ..memory import mem_tracker
from .fake import default_loss, fake_state

__all__ = ["ChainProfile", "profile_chain", "default_loss"]

Segments = list[tuple[int, int, bool]]


@dataclass
class ChainProfile:
    """What the planner knows about one model on one input (all bytes as MemTracker counts them).

    Units are runs of chain blocks the planner keeps together (a block whose output aliases its
    input joins the block before it). Per unit ``u`` (blocks ``units[u]``) and per boundary
    ``k`` (the input of unit ``k``; ``k = n`` is the chain's output):

    * ``act[k]``: bytes of boundary ``k``'s storage (``act[0] = 0``: the chain's input is part of
      ``base``); ``dgrad[k]``: bytes of its gradient;
    * ``saved[u]``: bytes autograd saves for the unit's backward beyond its input and output
      storages; ``keeps_input[u]`` / ``keeps_output[u]``: whether it saves those too;
    * ``fwd_rise[u]`` / ``fwd_rise_ckpt[u]``: peak above the level at the unit's start during its
      forward, stored / checkpointed; ``bwd_rise[u]``: peak above the level when its output's
      gradient is ready, during its backward; ``grads[u]``: parameter gradients it allocates;
    * ``flops[u]``: forward FLOPs; ``recompute_flops[u]``: FLOPs of its recompute when it is the
      last unit of a checkpointed segment.

    Constants: ``base`` (memory when the chain starts: parameters, buffers, stem), ``pre_peak``
    and ``tail_peak`` (peaks before the chain and after its backward), ``head_rise`` (peak of the
    head, loss and head backward above the level at the chain's end), ``bwd_misc`` (what the
    head leaves during the chain's backward: its parameters' gradients), ``step_flops`` (a plain
    step's FLOPs), and the measured peaks of the two profiling runs. With ``block_mode`` every
    block runs in that intra-block checkpoint mode; ``inner_flops`` is what the blocks' own
    checkpoints recompute whatever the schedule (``recompute_flops`` counts beyond it), per unit
    ``unit_inner_flops``.
    """

    block_names: list[str]
    units: list[tuple[int, int]]
    act: list[int]
    dgrad: list[int]
    saved: list[int]
    keeps_input: list[bool]
    keeps_output: list[bool]
    fwd_rise: list[int]
    fwd_rise_ckpt: list[int]
    bwd_rise: list[int]
    grads: list[int]
    flops: list[int]
    recompute_flops: list[int]
    base: int = 0
    pre_peak: int = 0
    tail_peak: int = 0
    head_rise: int = 0
    bwd_misc: int = 0
    step_flops: int = 0
    measured_plain_peak: int = 0
    measured_ckpt_peak: int = 0
    block_mode: str | None = None
    inner_flops: int = 0
    unit_inner_flops: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def n_blocks(self) -> int:
        return len(self.block_names)

    def unit_segments(self, block_segments: Segments) -> Segments:
        """Block-level segments -> unit-level; every cut must fall between units."""
        starts = {a: u for u, (a, _) in enumerate(self.units)}
        starts[self.n_blocks] = self.n_units
        try:
            return [(starts[a], starts[b], ck) for a, b, ck in block_segments]
        except KeyError as e:
            raise ValueError(f"block {e.args[0]} is inside a unit {self.units}: its input and "
                             f"output share storage, so a segment cannot start there") from None

    def block_segments(self, unit_segments: Segments) -> Segments:
        """Unit-level segments -> the block-level plan ``set_checkpoint_plan`` takes."""
        bounds = [a for a, _ in self.units] + [self.n_blocks]
        return [(bounds[a], bounds[b], ck) for a, b, ck in unit_segments]


# ------------------------------------------------------------------------------------------------
# One instrumented training step.
# ------------------------------------------------------------------------------------------------
def _storage_key(t: torch.Tensor) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage()).cdata


def _nbytes(nbytes: int, device: torch.device) -> int:
    """Bytes as MemTracker counts them (CUDA rounds every allocation up to 512 bytes)."""
    return math.ceil(nbytes / 512) * 512 if device.type == "cuda" else nbytes


def _storage_bytes(t: torch.Tensor) -> int:
    return _nbytes(t.untyped_storage().nbytes(), t.device)


def _grad_bytes(t: torch.Tensor) -> int:
    floating = t.is_floating_point() or t.is_complex()
    return _nbytes(t.numel() * t.element_size(), t.device) if floating else 0


class _Trace:
    """Memory level and FLOPs after every ATen op, by phase of the step.

    Phases: ``("pre",)`` before the chain, ``("F", j)`` forward of block ``j`` (``("G", j)``
    after it, until the next block starts), ``("head",)``
    from the chain's end until its output's gradient is ready, ``("B", j)`` from block ``j``'s
    output gradient on, ``("tail",)`` after the chain input's gradient.
    """

    def __init__(self, tracker: Any, counter: Any, param_keys: set[int]) -> None:
        self.tracker, self.counter, self.param_keys = tracker, counter, param_keys
        self.phase: tuple = ("pre",)
        self.peak: dict[tuple, int] = {}
        self.flops: dict[tuple, int] = {}
        self.rflops: dict[tuple, int] = {}
        self.grads: dict[tuple, int] = {}
        self.mark: dict[tuple, int] = {}
        self.saved: dict[int, dict[int, int]] = {}
        self.in_key: dict[int, int] = {}
        self.out_key: dict[int, int] = {}
        self.in_bytes: dict[int, int] = {}
        self.out_bytes: dict[int, int] = {}
        self.out_dgrad: dict[int, int] = {}
        self.alias: dict[int, bool] = {}
        self.n_blocks = 0
        self._last_flops = 0

    def memory(self) -> int:
        # MemTracker's live figures, read without the deepcopy ``get_tracker_snapshot`` makes
        # (this runs after every op)
        snap = getattr(self.tracker, "_curr_mem_snap", None)
        if snap is None:
            snap = self.tracker.get_tracker_snapshot("current")
        return sum(int(dev.get("Total", 0)) for dev in snap.values())

    def op_done(self) -> None:
        mem = self.memory()
        flops = int(self.counter.get_total_flops())
        delta, self._last_flops = flops - self._last_flops, flops
        ph = self.phase
        self.peak[ph] = max(self.peak.get(ph, mem), mem)
        self.flops[ph] = self.flops.get(ph, 0) + delta
        if is_recomputing():
            self.rflops[ph] = self.rflops.get(ph, 0) + delta

    def enter(self, phase: tuple) -> None:
        mem = self.memory()
        self.mark[phase] = mem
        self.peak[phase] = max(self.peak.get(phase, mem), mem)
        self.phase = phase

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase[0] == "F" and not is_recomputing():
            key = _storage_key(t)
            if key not in self.param_keys:
                self.saved.setdefault(self.phase[1], {})[key] = _storage_bytes(t)
        return t

    def region_inputs(self, args: tuple, kwargs: dict) -> None:
        """A block's own checkpoint keeps its inputs itself, out of autograd's sight: count them
        as saved by the block, as ``pack`` counts saved tensors."""
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                self.pack(t)

    def call_block(self, j: int, block: Callable, x: torch.Tensor) -> torch.Tensor:
        if is_recomputing():  # a recompute runs inside block j's backward phase: leave it be
            return block(x)
        self.in_key[j], self.in_bytes[j] = _storage_key(x), _storage_bytes(x)
        if j == 0 and x.requires_grad:
            x.register_hook(lambda g: self.enter(("tail",)))
        self.enter(("F", j))
        y = block(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"chain block {j} returned {type(y).__name__}; the planner needs "
                            "blocks that take and return one tensor")
        self.out_key[j], self.out_bytes[j] = _storage_key(y), _storage_bytes(y)
        self.out_dgrad[j] = _grad_bytes(y) if y.requires_grad else 0
        self.alias[j] = self.out_key[j] == self.in_key[j]
        if y.requires_grad:
            y.register_hook(lambda g, j=j: self.enter(("B", j)))
        self.enter(("head",) if j == self.n_blocks - 1 else ("G", j))
        return y


class _Probe(torch.utils._python_dispatch.TorchDispatchMode):
    """Innermost dispatch mode: after each op, hand the memory level and FLOPs to the trace."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.trace.op_done()
        return out


def _traced_step(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[Any], torch.Tensor],
                 segments: Segments, block_mode: str | None = None) -> tuple[_Trace, int, int]:
    """One fake training step with the chain run by ``segments`` (each block in
    ``block_mode``): (trace, peak, step FLOPs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils.flop_counter import FlopCounterMode

    fake = FakeTensorMode()
    state = fake_state(model, fake)
    tensors = list({id(t): t for t in state.values()}.values())
    fx = fake.from_tensor(x.detach()).requires_grad_(x.requires_grad)
    tracker = mem_tracker()
    tracker.track_external(*tensors)
    counter = FlopCounterMode(display=False)
    trace = _Trace(tracker, counter, {_storage_key(t) for t in tensors})
    for p in tensors:
        if p.requires_grad and p.is_leaf:
            p.register_hook(lambda g: _note_grad(trace, g))

    def run_part(blocks: Sequence[Callable], a: int, b: int, h: torch.Tensor) -> torch.Tensor:
        for j in range(a, b):
            block = blocks[j] if block_mode is None else partial(
                model.run_chain_block, blocks[j], mode=block_mode)
            h = trace.call_block(j, block, h)
        return h

    def run_chain(blocks: Sequence[Callable], h: torch.Tensor) -> torch.Tensor:
        trace.n_blocks = len(blocks)
        for a, b, ck in segments:
            h = checkpoint(run_part, blocks, a, b, h) if ck else run_part(blocks, a, b, h)
        return h

    previous = model.checkpoint_plan
    model.set_checkpoint_plan(segments)
    model.run_chain = run_chain  # instance attribute: shadows ZooModel.run_chain for this step
    region.observers.append(trace.region_inputs)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake)
            stack.enter_context(tracker)
            stack.enter_context(counter)
            stack.enter_context(_Probe(trace))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t))
            import warnings
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            # the fake tensors stand in for the parameters until backward has recomputed too
            stack.enter_context(_reparametrize_module(model, state))
            loss = loss_fn(model(fx))
            loss.backward()
            del loss
        peak = sum(int(d["Total"]) for d in tracker.get_tracker_snapshot("peak").values())
    finally:
        region.observers.remove(trace.region_inputs)
        del model.run_chain
        model.set_checkpoint_plan(previous)
    if trace.n_blocks == 0:
        raise ValueError(f"{type(model).__name__}.forward never called run_chain with a plan "
                         "set: the planner cannot see its chain of blocks")
    return trace, peak, int(counter.get_total_flops())


def _note_grad(trace: _Trace, g: torch.Tensor) -> None:
    trace.grads[trace.phase] = trace.grads.get(trace.phase, 0) + _grad_bytes(g)


# ------------------------------------------------------------------------------------------------
# From two traces to a profile.
# ------------------------------------------------------------------------------------------------
def _block_name(block: Any) -> str:
    if isinstance(block, nn.Module):
        name = getattr(block, "name", None)
        return f"{type(block).__name__}({name})" if isinstance(name, str) else type(block).__name__
    func = getattr(block, "func", block)  # functools.partial
    owner = getattr(func, "__self__", None)
    return type(owner).__name__ if isinstance(owner, nn.Module) else getattr(
        func, "__name__", type(block).__name__)


def profile_chain(model: nn.Module, example_input: torch.Tensor,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  block_mode: str | None = None) -> ChainProfile:
    """Profile ``model``'s chain (``checkpoint_chain``) on ``example_input`` for the planner.

    Runs two training steps under ``FakeTensorMode`` (nothing is computed, nothing is changed in
    ``model``: parameters, buffers and its checkpoint plan are left as they were).
    ``block_mode``: every block runs in that intra-block checkpoint mode
    (``model.run_chain_block``), stored or inside a checkpointed segment.
    """
    loss_fn = loss_fn or default_loss
    chain = list(model.checkpoint_chain())
    n = len(chain)
    if n == 0:
        raise ValueError(f"{type(model).__name__}.checkpoint_chain() is empty")
    plain, plain_peak, step_flops = _traced_step(model, example_input, loss_fn, [(0, n, False)],
                                                 block_mode)
    if plain.n_blocks != n:
        raise ValueError(f"run_chain ran {plain.n_blocks} blocks, checkpoint_chain() has {n}")
    # a block starts a unit unless its input aliases the previous output, or that output needs no
    # gradient (a frozen stem: such blocks save nothing, so they join the first block that does)
    starts = [j for j in range(n) if j == 0 or not plain.alias[j] and plain.out_dgrad[j - 1]]
    units = [(a, b) for a, b in zip(starts, starts[1:] + [n])]
    ckpt, ckpt_peak, _ = _traced_step(model, example_input, loss_fn,
                                      [(a, b, True) for a, b in units], block_mode)

    def first(trace: _Trace, kinds: str, blocks: range, default: int = 0) -> int:
        vals = [trace.peak[(k, j)] for j in blocks for k in kinds if (k, j) in trace.peak]
        return max(vals, default=default)

    prof = ChainProfile([_block_name(b) for b in chain], units, [0], [0], [], [], [], [], [], [],
                        [], [], [])
    for u, (a, b) in enumerate(units):
        blocks = range(a, b)
        in_key, out_key = plain.in_key[a], plain.out_key[b - 1]
        saved: dict[int, int] = {}
        for j in blocks:
            saved.update(plain.saved.get(j, {}))
        prof.keeps_input.append(in_key in saved)
        prof.keeps_output.append(out_key in saved)
        prof.saved.append(sum(v for k, v in saved.items() if k not in (in_key, out_key)))
        prof.act.append(plain.out_bytes[b - 1])
        prof.dgrad.append(plain.out_dgrad[b - 1])
        prof.fwd_rise.append(first(plain, "FG", blocks) - plain.mark[("F", a)])
        prof.fwd_rise_ckpt.append(first(ckpt, "FG", blocks) - ckpt.mark[("F", a)])
        start = plain.mark.get(("B", b - 1))
        prof.bwd_rise.append(0 if start is None else first(plain, "B", blocks, start) - start)
        prof.grads.append(sum(plain.grads.get(("B", j), 0) for j in blocks))
        prof.flops.append(sum(plain.flops.get(("F", j), 0) for j in blocks))
        # beyond what the blocks' own checkpoints (``block_mode``) recompute in a stored run
        prof.recompute_flops.append(sum(ckpt.rflops.get(("B", j), 0)
                                        - plain.rflops.get(("B", j), 0) for j in blocks))
        prof.unit_inner_flops.append(sum(plain.rflops.get(("B", j), 0) for j in blocks))
    prof.act[0] = 0  # the chain's input lives in ``base`` for the whole step
    prof.dgrad[0] = 0
    prof.base = plain.mark[("F", 0)]
    prof.pre_peak = plain.peak.get(("pre",), 0)
    prof.tail_peak = plain.peak.get(("tail",), 0)
    prof.head_rise = plain.peak[("head",)] - plain.mark[("head",)]
    prof.inner_flops = sum(plain.rflops.values())
    prof.step_flops = step_flops - prof.inner_flops
    prof.measured_plain_peak = plain_peak
    prof.measured_ckpt_peak = ckpt_peak
    prof.block_mode = block_mode
    last = units[-1][1] - 1
    if ("B", last) in plain.mark:
        held = _plain_held(prof)
        prof.bwd_misc = plain.mark[("B", last)] - prof.base - held - prof.dgrad[-1]
    else:
        prof.notes.append("the chain's output gets no gradient: nothing to plan")
    return prof


def _plain_held(p: ChainProfile) -> int:
    """Bytes the chain holds at the end of a plain forward (saved tensors and kept boundaries)."""
    n = p.n_units
    kept = {k for k in range(1, n + 1)
            if p.keeps_output[k - 1] or (k < n and p.keeps_input[k])}
    return sum(p.saved) + sum(p.act[k] for k in kept)
