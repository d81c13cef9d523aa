"""A compiled training step on a named CUDA card, predicted here: ``torch.compile``'s kernels.

The model is compiled whole (``fullgraph=True, dynamic=False``, as the GPU suite compiles it) on
fake copies of its state, with AOTAutograd's min-cut partitioner and inductor's decompositions:
the forward and backward graphs inductor would receive, the saved tensors chosen as inductor's
would be. No kernel is generated; :mod:`.inductor` models which values inductor stores and which
kernels it launches, and this module replays those buffers through the caching allocator
(parameters, buffers, batch and the cuBLAS workspaces of the graphs that run a matmul held from
the start; each buffer freed after the last kernel that reads it, as inductor's code frees it;
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
from ..compiled import partitioned
from ..fake import FakeStep
from ..inputs import check_model
from ..quiet import fake_logs_quiet
from ..training import default_loss
from .allocator import CachingAllocator
from .autocast import cuda_autocast
from .inductor import Graph, Kernel, kernel_record, kernels, nbytes, value
from .step import CardStep
from .timing import H100_ACHIEVED, H100_HOST, Achieved, Card, HostCost, StepTime, card, \
    op_seconds

__all__ = ["CompiledCardStep", "predict_compiled_step", "capture_graphs", "H100_LAUNCH"]

# Seconds the host spends per kernel inductor launches: fitted on the one compiled row of the
# H100 machine (docs/results/gpu_densenet_b64_h100.md: DenseNet-BC-100 b64 compiled plain,
# 33 ms a step, host-bound), less that step's autograd-engine nodes at H100_HOST's rate, over
# the 597 kernels this model counts in it (248 forward, 349 backward). In-sample for that row.
H100_LAUNCH = 48.6e-6
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}  # cuBLAS: a workspace on the thread that runs them
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
                   autocast: torch.dtype | None = None) -> tuple[Graph, Graph, FakeStep]:
    """The forward and backward graphs ``torch.compile(model, fullgraph=True)`` gives inductor
    for one training step on ``example_input`` (in ``autocast`` as CUDA's op lists cast), traced
    on fake copies of the model's state (returned: the :class:`~zoo.memory.fake.FakeStep`).
    Dynamo's caches are reset before and after, so each call traces afresh (code this process
    compiled before compiles again at its next call)."""
    fake = FakeStep(check_model(model), example_input)
    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(kind: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, _example: Any) -> Callable[[list], Any]:
            graphs[kind] = gm
            outputs = list(gm.graph.nodes)[-1].args[0]

            def run(args: list) -> list:  # outputs of the traced shapes; no op runs
                args.clear()
                return [_like(value(o)) if isinstance(o, torch.fx.Node) else o for o in outputs]
            run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd boxes the args
            return run
        return compiler

    backend = partitioned(keep("forward"), keep("backward"), _torch.inductor_decompositions()())
    cast = torch.autocast("cpu", dtype=autocast, cache_enabled=False) if autocast is not None \
        else torch.autocast("cpu", enabled=False)
    _torch.dynamo().reset()
    try:
        with fake_logs_quiet(model, fake.input), fake.mode, \
                cuda_autocast(autocast is not None), _torch.reparametrize_module(model, fake.state):
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            with cast:
                loss = (loss_fn or default_loss)(fake.input.call(compiled))
            loss.backward()
    finally:
        _torch.dynamo().reset()
    if set(graphs) != {"forward", "backward"}:
        raise RuntimeError(f"expected a compiled forward and backward, got {sorted(graphs)}")
    return Graph(graphs["forward"]), Graph(graphs["backward"]), fake


def _like(v: Any) -> Any:
    """A fresh fake tensor of ``v``'s shape, strides and dtype (``v`` itself if no tensor)."""
    if not isinstance(v, torch.Tensor):
        return v
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)


def _replay(graph: Graph, ks: list[Kernel], allocator: CachingAllocator,
            live: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, Any]:
    """Run ``ks``'s allocations: each written buffer allocated at its kernel (a fused kernel
    writes in place of a buffer of the same bytes it reads for the last time, as inductor's
    ``inplace_buffers`` does), freed after the last kernel reading it unless a graph output;
    ``live``: blocks of the graph's inputs that the graph may free (the rest are held by the
    caller). Returns the outputs' blocks."""
    last = {b: i for i, k in enumerate(ks) for b in k.reads}
    blocks = dict(live)
    for i, k in enumerate(ks):
        dying = [] if k.extern else [b for b in k.reads if last[b] == i and b in blocks
                                     and b not in graph.outputs]
        for b in k.writes:
            same = next((d for d in dying if nbytes(d) == nbytes(b)), None)
            if same is not None:  # inductor writes in place of an input read here last
                dying.remove(same)
                blocks[b] = blocks.pop(same)
            else:
                blocks[b] = allocator.malloc(nbytes(b))
        for b in k.reads:
            if last[b] == i and b not in graph.outputs and b in blocks:
                allocator.free(blocks.pop(b))
    for b in [b for b in blocks if b not in graph.outputs]:
        allocator.free(blocks.pop(b))
    return blocks


def _peak(forward: Graph, backward: Graph, fk: list[Kernel], bk: list[Kernel], fake: FakeStep,
          on: Card, graphs: bool) -> int:
    """The step's ``max_memory_allocated``: the graphs' kernels ``fk`` and ``bk`` replayed
    after the state, the batch and the workspaces (module docstring)."""
    allocator = CachingAllocator()
    for t in fake.tensors + fake.input.tensors():
        allocator.malloc(t.untyped_storage().nbytes())
    for ks in (fk, bk):
        if any(k.extern and k.nodes[0].target in _MATMULS for k in ks):
            allocator.malloc(on.workspace)
    if graphs:  # the batch copied into the graphs' static input
        for t in fake.input.tensors():
            allocator.malloc(t.untyped_storage().nbytes())
    saved = _replay(forward, fk, allocator, {})
    by_name = {n.name: forward.base[n] for n in forward.nodes}
    live = {}
    for n in backward.nodes:
        if n.op != "placeholder":
            continue
        source = by_name.get(n.name)
        if source in saved:
            live[n] = saved.pop(source)
        elif n.name.startswith("tangents"):  # the loss's gradient of an output
            live[n] = allocator.malloc(nbytes(n))
    for block in saved.values():  # the model's output, dropped once the loss is made
        allocator.free(block)
    _replay(backward, bk, allocator, live)
    return allocator.peak


def predict_compiled_step(model: nn.Module, example_input: Any, on: str | Card = "h100",
                          loss_fn: Callable[[Any], torch.Tensor] | None = None,
                          autocast: torch.dtype | None = None, graphs: bool = False,
                          host: HostCost = H100_HOST, achieved: Achieved = H100_ACHIEVED,
                          launch: float = H100_LAUNCH) -> CompiledCardStep:
    """Peak and time of one training step of ``torch.compile(model, fullgraph=True)`` (in the
    checkpoint mode ``model`` is set to) on ``example_input``, on card ``on``, predicted from
    the graphs inductor would receive (module docstring). ``graphs``: with
    ``mode="reduce-overhead"`` (CUDA graph trees). ``autocast``, ``host``, ``achieved``: as
    :func:`~.step.predict_step` takes them; ``launch``: the host's seconds per kernel. The
    step has no optimizer, as the GPU suite's compiled rows measure it; the host's count of
    loss ops is the default loss's (a model's own loss is traced into the graph)."""
    target = card(on)
    forward, backward, fake = capture_graphs(model, example_input, loss_fn, autocast)
    fk, bk = kernels(forward), kernels(backward)
    peak = _peak(forward, backward, fk, bk, fake, target, graphs)
    device = sum(op_seconds(kernel_record(g, k, g is backward), target, achieved)
                 for g, ks in ((forward, fk), (backward, bk)) for k in ks)
    trainable = sum(t.requires_grad for t in fake.tensors + fake.input.tensors())
    engine = trainable + _LOSS_NODES + 1
    launched = 2 if graphs else len(fk) + len(bk)
    host_s = launched * launch + engine * host.per_engine_op + _LOSS_OPS * host.per_op
    return CompiledCardStep(target, peak, StepTime(device, host_s), 0,
                            (len(fk), len(bk)), graphs)

