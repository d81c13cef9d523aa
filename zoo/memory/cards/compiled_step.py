"""A compiled training step on a named CUDA card, predicted here: ``torch.compile``'s kernels.

The model is compiled whole (``fullgraph=True, dynamic=False``, as the GPU suite compiles it) on
fake copies of its state by inductor's own front end (decompositions, joint-graph passes, the
min-cut partitioner): the forward and backward graphs inductor would receive, the saved tensors
chosen as inductor's are. Attention and dropout are traced as CUDA's kernels
(:class:`.kernels.CudaKernels`, as in the eager card step), so SDPA stays one fused kernel and
never the CPU's math path with its T x T probabilities. :mod:`.inductor` then runs inductor's
post-grad passes, lowering and scheduler on each graph for the card (no kernel is generated),
and this module replays the scheduled kernels' storages through the caching allocator
(parameters, buffers, batch and the cuBLAS workspaces of the graphs that run a matmul held from
the start; each storage freed after the last kernel that reads it, as inductor's code frees it;
what the forward saves freed at its last use in the backward; gradients kept) and prices the
kernels with :mod:`.timing`'s roofline. The loss, ``out.float().square().mean()`` as every
measured step takes it, runs outside the compiled graph; its few bytes are its gradient, the
backward graph's input.

The host launches every kernel from inductor's generated Python (:data:`H100_LAUNCH` seconds
each) and runs the autograd engine's nodes outside the graph (one per parameter, the loss's and
the compiled backward's: ``per_engine_op`` of :data:`~.timing.H100_HOST`). ``graphs=True`` is
``mode="reduce-overhead"``: CUDA graph trees replay each graph with one launch, so the host pays
two launches and the engine's nodes, and the batch is copied into the graphs' static input
first (one more batch on the card).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ... import _torch
from ..fake import FakeStep
from ..inputs import check_model
from ..quiet import fake_logs_quiet
from ..training import default_loss
from .allocator import CachingAllocator
from .autocast import cuda_autocast
from .inductor import Schedule, schedule
from .kernels import CudaKernels
from .step import CardStep
from .timing import H100_ACHIEVED, H100_HOST, Achieved, Card, HostCost, StepTime, card, \
    op_seconds

__all__ = ["CompiledCardStep", "predict_compiled_step", "capture_graphs", "H100_LAUNCH"]

# Seconds the host spends per kernel inductor launches: fitted on the one compiled row of the
# H100 machine (docs/results/gpu_densenet_b64_h100.md: DenseNet-BC-100 b64 compiled plain,
# 33 ms a step, host-bound), less that step's autograd-engine nodes at H100_HOST's rate, over
# the 1,023 kernels inductor's scheduler makes of it for the H100 (589 forward, 434 backward).
# In-sample for that row.
H100_LAUNCH = 28.4e-6
_LOSS_OPS = 3  # float(), square(), mean() of the default loss, issued from Python
_LOSS_NODES = 3  # their backward nodes: MeanBackward, PowBackward, ToCopyBackward


@dataclasses.dataclass(frozen=True)
class CompiledCardStep(CardStep):
    """:class:`~.step.CardStep` of a compiled step, with the kernels launched per step
    (forward, backward) and whether CUDA graphs replay them."""

    kernels: tuple[int, int] = (0, 0)
    graphs: bool = False


def capture_graphs(model: nn.Module, example_input: Any,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   autocast: torch.dtype | None = None
                   ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, FakeStep]:
    """The forward and backward graphs ``torch.compile(model, fullgraph=True)`` gives inductor
    for one training step on ``example_input`` (in ``autocast`` as CUDA's op lists cast), traced
    on fake copies of the model's state (returned: the :class:`~zoo.memory.fake.FakeStep`) by
    inductor's own front end (decompositions, joint-graph passes, the min-cut partitioner),
    which hands them to a stand-in for its graph compiler. Dynamo's caches are reset before and
    after, so each call traces afresh (code this process compiled before compiles again at its
    next call)."""
    _torch.require_compiled_card_step()
    fake = FakeStep(check_model(model), example_input)
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(gm: torch.fx.GraphModule, _example: Any, **kwargs: Any) -> Callable[[list], Any]:
        graphs["backward" if kwargs.get("is_backward") else "forward"] = gm
        outputs = list(gm.graph.nodes)[-1].args[0]

        def run(args: list) -> list:  # outputs of the traced shapes; no op runs
            args.clear()
            return [_like(o.meta.get("val")) if isinstance(o, torch.fx.Node) else o
                    for o in outputs]
        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd boxes the args
        return run

    compile_fx = _torch.inductor().compile_fx.compile_fx
    cast = torch.autocast("cpu", dtype=autocast, cache_enabled=False) if autocast is not None \
        else torch.autocast("cpu", enabled=False)
    _torch.dynamo().reset()
    try:
        with fake_logs_quiet(model, fake.input), fake.mode, \
                cuda_autocast(autocast is not None), CudaKernels(), \
                _torch.reparametrize_module(model, fake.state):
            compiled = torch.compile(model, backend=lambda gm, ex: compile_fx(
                gm, ex, inner_compile=keep), fullgraph=True, dynamic=False)
            with cast:
                loss = (loss_fn or default_loss)(fake.input.call(compiled))
            loss.backward()
    finally:
        _torch.dynamo().reset()
    if set(graphs) != {"forward", "backward"}:
        raise RuntimeError(f"expected a compiled forward and backward, got {sorted(graphs)}")
    return graphs["forward"], graphs["backward"], fake


def _like(v: Any) -> Any:
    """A fresh fake tensor of ``v``'s shape, strides and dtype (``v`` itself if no tensor)."""
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)


def _replay(graph: Schedule, allocator: CachingAllocator, live: dict[str, Any]
            ) -> dict[str, Any]:
    """Run ``graph``'s allocations: each storage allocated at the first kernel writing it (a
    fused kernel writes in place of a storage of the same bytes it reads for the last time, as
    inductor's ``inplace_buffers`` does), freed after the last kernel reading it unless a graph
    output; ``live``: blocks of the graph's inputs that the graph may free (the rest are held by
    the caller). Returns the outputs' blocks."""
    outputs = {o for o in graph.outputs if o is not None}
    last = {b: i for i, k in enumerate(graph.kernels) for b in k.reads}
    blocks = dict(live)
    for i, k in enumerate(graph.kernels):
        dying = [] if k.extern else [b for b in k.reads if last[b] == i and b in blocks
                                     and b not in outputs]
        for b in (b for b in k.writes if b not in blocks):
            same = next((d for d in dying if graph.nbytes[d] == graph.nbytes[b]), None)
            if same is not None:  # inductor writes in place of an input read here last
                dying.remove(same)
                blocks[b] = blocks.pop(same)
            else:
                blocks[b] = allocator.malloc(graph.nbytes[b])
        done = [b for b in k.reads if last[b] == i] + [b for b in k.writes if b not in last]
        for b in done:
            if b not in outputs and b in blocks:
                allocator.free(blocks.pop(b))
    for b in [b for b in blocks if b not in outputs]:
        allocator.free(blocks.pop(b))
    return blocks


def _renamed(graph: Schedule, alias: dict[str, str]) -> Schedule:
    """``graph`` reading each input named in ``alias`` under the name it maps to (two saved
    tensors of the forward that share one storage)."""
    kernels = [dataclasses.replace(k, reads=tuple(dict.fromkeys(alias.get(b, b)
                                                                for b in k.reads)))
               for k in graph.kernels]
    return dataclasses.replace(graph, kernels=kernels)


def _peak(forward: Schedule, backward: Schedule, saved_names: list[str], fake: FakeStep,
          on: Card, graphs: bool) -> int:
    """The step's ``max_memory_allocated``: the graphs' kernels replayed after the state, the
    batch and the workspaces (module docstring). ``saved_names``: the forward graph's outputs
    by the names the backward's inputs take."""
    allocator = CachingAllocator()
    for t in fake.tensors + fake.input.tensors():
        allocator.malloc(t.untyped_storage().nbytes())
    for graph in (forward, backward):
        if any(k.matmul for k in graph.kernels):
            allocator.malloc(on.workspace)
    if graphs:  # the batch copied into the graphs' static input
        for t in fake.input.tensors():
            allocator.malloc(t.untyped_storage().nbytes())
    saved = _replay(forward, allocator, {})
    storage = dict(zip(saved_names, forward.outputs))
    live: dict[str, Any] = {}
    alias: dict[str, str] = {}
    first: dict[str, str] = {}
    for name in backward.inputs:
        source = storage.get(name)
        if source in first:
            alias[name] = first[source]
        elif source in saved:
            first[source], live[name] = name, saved.pop(source)
        elif name.startswith("tangents"):  # the loss's gradient of an output
            live[name] = allocator.malloc(backward.nbytes[name])
    for block in saved.values():  # the model's output, dropped once the loss is made
        allocator.free(block)
    _replay(_renamed(backward, alias), allocator, live)
    return allocator.peak


def predict_compiled_step(model: nn.Module, example_input: Any, on: str | Card = "h100",
                          loss_fn: Callable[[Any], torch.Tensor] | None = None,
                          autocast: torch.dtype | None = None, graphs: bool = False,
                          host: HostCost = H100_HOST, achieved: Achieved = H100_ACHIEVED,
                          launch: float = H100_LAUNCH) -> CompiledCardStep:
    """Peak and time of one training step of ``torch.compile(model, fullgraph=True)`` (in the
    checkpoint mode ``model`` is set to) on ``example_input``, on card ``on``, predicted from
    the kernels inductor schedules for the card (module docstring). ``graphs``: with
    ``mode="reduce-overhead"`` (CUDA graph trees). ``autocast``, ``host``, ``achieved``: as
    :func:`~.step.predict_step` takes them; ``launch``: the host's seconds per kernel. The
    step has no optimizer, as the GPU suite's compiled rows measure it; the host's count of
    loss ops is the default loss's (a model's own loss is traced into the graph)."""
    target = card(on)
    fw_gm, bw_gm, fake = capture_graphs(model, example_input, loss_fn, autocast)
    saved_names = [a.name if isinstance(a, torch.fx.Node) else "" for a in
                   list(fw_gm.graph.nodes)[-1].args[0]]
    forward, backward = schedule(fw_gm, target, False), schedule(bw_gm, target, True)
    peak = _peak(forward, backward, saved_names, fake, target, graphs)
    device = sum(op_seconds(k.record, target, achieved)
                 for g in (forward, backward) for k in g.kernels if k.launches)
    trainable = sum(t.requires_grad for t in fake.tensors + fake.input.tensors())
    engine = trainable + _LOSS_NODES + 1
    kernels = (forward.launched(), backward.launched())
    host_s = (2 if graphs else sum(kernels)) * launch + engine * host.per_engine_op \
        + _LOSS_OPS * host.per_op
    return CompiledCardStep(target, peak, StepTime(device, host_s), 0, kernels, graphs)
