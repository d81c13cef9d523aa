"""The kernels inductor makes of a compiled step's graphs on a card: inductor's own scheduler.

``torch.compile`` hands inductor two graphs per step, AOTAutograd's forward and backward, split
by the min-cut partitioner after inductor's joint-graph passes (what the forward saves is
decided there). Inductor then runs its post-grad passes, lowers each graph to its IR and
schedules it: which values are stored, which ops fuse into one kernel, in which order the
kernels run. On CUDA those choices read the card (its SM count decides how a reduction is
split across kernels; Triton must be able to target it), so a CPU scheduler's kernels are not a
card's. :func:`schedule` runs inductor's own passes, lowering and scheduler on a graph moved to
fake CUDA tensors, with CUDA device 0 answering as the card (:func:`zoo._torch.cuda_device_as`:
its SM count, compute capability and per-SM limits), and stops before code generation: no
kernel is written or compiled, and no GPU is needed.

What is read from the scheduled nodes, in their order: one kernel per node that launches (a
fused Triton kernel, a foreach kernel, an extern call: cuDNN's convolutions, cuBLAS's matmuls,
attention, aten fallbacks), none for a node that only names a buffer (``cat``'s output that its
inputs' kernels write into, one output of a multi-output extern call); the storages each kernel
reads and writes (a buffer written and read inside one fused kernel only is never stored, as
inductor's code generation removes it) and their bytes; the bytes each kernel moves, as
inductor counts them; an extern kernel's FLOPs (``torch.utils.flop_counter``'s formulas on the
graph node it came from).

Left out: code generation's own choices (a fused kernel writing in place of a buffer it reads
last is modelled by the allocator replay, :mod:`.compiled_step`; split reductions' and
persistent reductions' configurations; Triton templates, which only ``max-autotune`` picks), and
the joint-graph passes that only run for CUDA inputs (the step is traced on fake CPU tensors,
then moved: padding a matmul's odd sizes). How close this lands is what the GPU suite's compiled
rows check against the filed predictions (docs/benchmarks/prediction.md).
"""
from __future__ import annotations

import dataclasses
import operator
import types
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from ... import _torch
from ..._torch import tree_map_only
from ..quiet import logger_off
from .peak import OpRecord
from .timing import Card

__all__ = ["Kernel", "Schedule", "schedule", "to_cuda", "card_properties"]

_aten = torch.ops.aten
MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}  # cuBLAS: a workspace each thread
# Per compute capability: resident threads per SM and shared memory per block (opt-in), bytes
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
_PER_SM = {(8, 0): (2048, 166912), (8, 6): (1536, 101376), (8, 9): (1536, 101376),
           (9, 0): (2048, 232448)}


# inductor's advice on autotuning ("Not enough SMs to use max_autotune_gemm mode"), which a
# prediction does not do: not for the user
_AUTOTUNE_LOG = "torch._inductor.utils"


def card_properties(on: Card) -> types.SimpleNamespace:
    """``torch.cuda.get_device_properties``'s fields for card ``on``, as inductor reads them."""
    if on.sms <= 0 or on.capability not in _PER_SM:
        raise ValueError(f"card {on.name!r} has no SM count or a compute capability this model "
                         f"knows ({on.capability}); give Card(..., sms=N) with one of "
                         f"{sorted(_PER_SM)}")
    threads, shared = _PER_SM[on.capability]
    return types.SimpleNamespace(
        name=on.name, major=on.capability[0], minor=on.capability[1],
        multi_processor_count=on.sms, max_threads_per_multi_processor=threads,
        regs_per_multiprocessor=65536, max_threads_per_block=1024, warp_size=32,
        shared_memory_per_block_optin=shared, total_memory=on.memory)


def to_cuda(gm: torch.fx.GraphModule) -> list[Any]:
    """Move traced graph ``gm`` to CUDA device 0 in place: every node's fake value a fake CUDA
    tensor of the same shape, strides and dtype, every device argument CUDA's (the step was
    traced on the CPU: a tensor the model itself puts on the CPU moves too). Returns the
    graph's example inputs (fake CUDA tensors, and what else its placeholders hold). A random
    number generator's state that a checkpointed region's random ops save for their replay in
    backward is CUDA's on the card: 16 bytes (Philox's seed and offset) in host memory."""
    mode = _torch.FakeTensorMode(allow_non_fake_inputs=True)
    cuda = torch.device("cuda", 0)

    def moved(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda)

    def host_state(_t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty(16, dtype=torch.uint8)

    states = _rng_states(gm)
    for n in gm.graph.nodes:
        if "val" in n.meta:
            move = host_state if n in states else moved
            n.meta["val"] = tree_map_only(torch.Tensor, move, n.meta["val"])
        n.args, n.kwargs = tree_map_only(torch.device, lambda _: cuda, (n.args, n.kwargs))
    gm.recompile()
    return [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]


def _rng_states(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` that hold a generator state saved for a replay of random ops: the
    state ``run_and_save_rng_state`` returns first, and what ``run_with_rng_state`` reads."""
    prims = _torch.rng_prims()
    states = set()
    for n in gm.graph.nodes:
        if n.target is prims.run_with_rng_state and isinstance(n.args[0], torch.fx.Node):
            states.add(n.args[0])
        elif n.target is operator.getitem and n.args[1] == 0 and \
                getattr(n.args[0], "target", None) is prims.run_and_save_rng_state:
            states.add(n)
    return states


@dataclasses.dataclass
class Kernel:
    """One scheduled node: whether it ``launches`` a kernel, ``extern`` or not, the storages
    it ``writes`` (allocates) and ``reads``, its cost ``record`` (:mod:`.timing` prices it),
    and whether it calls cuBLAS (``matmul``)."""

    launches: bool
    extern: bool
    writes: list[str]
    reads: tuple[str, ...]  # in inductor's order: the replay is the same in every process
    record: OpRecord
    matmul: bool = False


@dataclasses.dataclass
class Schedule:
    """A graph as inductor schedules it: its ``kernels`` in order, each storage's ``nbytes``,
    the graph's ``inputs`` (placeholder names, in order) and, per graph output, the storage it
    lies in (``outputs``; None for no tensor)."""

    kernels: list[Kernel]
    nbytes: dict[str, int]
    inputs: list[str]
    outputs: list[str | None]

    def launched(self) -> int:
        """Kernels launched when the graph runs once."""
        return sum(k.launches for k in self.kernels)


def _storage(node: Any, ir: Any) -> str | None:
    """The name of the buffer whose memory IR node ``node`` lies in (through boxes, views,
    ``cat``'s slices and mutation layouts; ``ir``: inductor's IR module); None for none."""
    while node is not None:
        layout = getattr(node, "layout", None)
        if isinstance(layout, ir.NonOwningLayout):
            node = layout.view
        elif isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
            node = layout.target
        elif isinstance(node, (ir.MutableBox, ir.BaseView)):
            node = node.data
        else:
            return node.get_name() if isinstance(node, ir.Buffer) else None
    return None


def _layout(buffer: Any, ir: Any) -> Any:
    """``buffer``'s layout; None for a multi-output call's (its outputs own the bytes)."""
    layout = getattr(buffer, "layout", None) or buffer.get_layout()
    return layout if isinstance(layout, ir.Layout) else None


def _origin(node: Any) -> torch.fx.Node | None:
    """The graph node an extern kernel computes (the one with a FLOP formula if any)."""
    origins = sorted(getattr(node.node, "origins", ()) or (), key=lambda n: n.name)
    packets = [(getattr(o.target, "_overloadpacket", None), o) for o in origins]
    return next((o for p, o in packets if p in flop_registry), None) or \
        next((o for p, o in packets if p is not None), None)


def _record(node: Any, dtype: torch.dtype | None, backward: bool) -> tuple[OpRecord, bool]:
    """``node`` as :mod:`.timing` prices an op, and whether it calls cuBLAS: its bytes as
    inductor counts a kernel's (``get_read_write_buffers_sizes``: a slice read or written
    counts its elements, not its buffer's; a value kept inside a fused kernel counts none; a
    multi-output call counts its outputs), an extern call's FLOPs by its graph node's formula,
    a Triton kernel under a pointwise op's name."""
    moved = int(node.get_read_write_buffers_sizes())
    if not node.is_extern():
        return OpRecord(_aten.add, 0, moved, dtype, backward), False
    origin = _origin(node)
    packet = getattr(getattr(origin, "target", None), "_overloadpacket", _aten.add)
    flops = 0
    if origin is not None and packet in flop_registry:
        args, kwargs = tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"),
                                     (origin.args, origin.kwargs))
        flops = int(flop_registry[packet](*args, **kwargs, out_val=origin.meta.get("val")))
    return OpRecord(packet, flops, moved, dtype, backward), packet in MATMULS


def _kernels(scheduler: Any, graph: Any, ind: _torch.Inductor, backward: bool,
             nbytes: dict[str, int], dtypes: dict[str, torch.dtype], alias: dict[str, str]
             ) -> list[Kernel]:
    """The scheduled nodes as :class:`Kernel`s, their buffers named by the storage they lie
    in (``alias``)."""
    out: list[Kernel] = []
    for node in scheduler.nodes:
        names = [b.get_name() for b in node.get_outputs()]
        stored = list(dict.fromkeys(alias[b] for b in names if nbytes.get(alias[b])))
        names_read = (alias.get(d.name, d.name) for d in node.read_writes.reads)
        reads = tuple(dict.fromkeys(b for b in names_read if b not in stored))
        dtype = next((dtypes[b] for b in (*stored, *sorted(reads)) if b in dtypes), None)
        one_of_many = node.is_extern() and isinstance(node.node, ind.ir.MultiOutput)
        if one_of_many:  # an output of the call before: that kernel's FLOPs and bytes
            record, matmul = OpRecord(_aten.add, 0, 0, dtype, backward), False
        else:
            record, matmul = _record(node, dtype, backward)
        launches = not one_of_many and not isinstance(node, ind.scheduler.NopKernelSchedulerNode)
        writes = [b for b in stored if b not in graph.graph_inputs]  # inputs: stored into
        out.append(Kernel(launches, node.is_extern(), writes, reads, record, matmul))
    return out


def _stored_only(kernels: list[Kernel], outputs: list[str | None]) -> None:
    """Drop the writes no other kernel reads and no graph output holds: values that live in
    one fused kernel's registers (inductor's code generation removes their buffers)."""
    read = {b for k in kernels for b in k.reads} | set(outputs)
    for k in kernels:
        if not k.extern:
            k.writes = [b for b in k.writes if b in read]


def schedule(gm: torch.fx.GraphModule, on: Card, backward: bool) -> Schedule:
    """Graph ``gm`` (AOTAutograd's forward, or its ``backward``) as inductor schedules it on
    card ``on`` (module docstring). ``gm`` is moved to fake CUDA tensors and passed through
    inductor's post-grad passes in place."""
    ind = _torch.inductor()
    example = to_cuda(gm)
    with _torch.cuda_device_as(card_properties(on), 10 * on.capability[0] + on.capability[1]), \
            ind.debug.DebugContext(), logger_off(_AUTOTUNE_LOG):
        ind.post_grad.view_to_reshape(gm)
        with torch.no_grad():
            mode = ind.compile_fx.fake_tensor_prop(gm, example)
        ind.compile_fx.record_original_output_strides(gm)
        with ind.V.set_fake_mode(mode):
            ind.post_grad.post_grad_passes(gm, False)
        graph = ind.graph.GraphLowering(gm, example_inputs=example, is_inference=False,
                                        is_backward=backward)
        with ind.V.set_fake_mode(mode), ind.V.set_graph_handler(graph):
            graph.run(*example)
            scheduler = ind.scheduler.Scheduler(graph.operations)
            inputs = {n: b for n, b in graph.graph_inputs.items() if isinstance(b, ind.ir.IRNode)}
            nodes = {**inputs, **{b.get_name(): b for b in graph.buffers}}
            alias = {n: _storage(b, ind.ir) or n for n, b in nodes.items()}
            layouts = {n: _layout(nodes[n], ind.ir) for n in set(alias.values()) if n in nodes}
            layouts = {n: layout for n, layout in layouts.items() if layout is not None
                       and layout.device.type == "cuda"}  # the card holds its own buffers
            nbytes = {n: int(layout.storage_size()) * layout.dtype.itemsize
                      for n, layout in layouts.items()}
            dtypes = {n: layout.dtype for n, layout in layouts.items()}
            kernels = _kernels(scheduler, graph, ind, backward, nbytes, dtypes, alias)
            outputs = [_storage(o, ind.ir) for o in graph.graph_outputs]
            outputs = [alias.get(o, o) if o is not None else None for o in outputs]
    _stored_only(kernels, outputs)
    return Schedule(kernels, nbytes, list(graph.graph_inputs), outputs)
