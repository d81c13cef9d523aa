"""The kernels inductor would make of a compiled step's graphs, modelled on the graphs alone.

``torch.compile`` hands inductor two graphs per step, AOTAutograd's forward and backward, split
by the min-cut partitioner (what the forward saves for the backward is decided there, before any
kernel exists). Inductor then fuses: an op whose output only feeds the next pointwise op is
computed inside the consumer's kernel and never stored. What this module keeps of inductor's
rules (torch/_inductor/graph.py, ir.py and scheduler.py of the installed torch read as the
reference):

* **Stored buffers** (:class:`Graph`): the output of an extern kernel (convolutions, matmuls,
  fused attention: libraries inductor calls), of a reduction, of ``cat``; a graph output (what
  the forward saves, the gradients); an extern kernel's input; a pointwise value read by more
  than one op whose inlined function reads more than ``realize_reads_threshold`` (4) buffers or
  runs more than ``realize_opcount_threshold`` (30) ops; and any pointwise value reading more
  than ``realize_acc_reads_threshold`` (8). Every other value is inlined where it is read.
  A ``copy_`` into a graph input (BatchNorm's running statistics) is a store of the kernel
  before it, no kernel of its own. Views are their base's buffer.
* **Kernels** (:func:`kernels`): one per extern op, one per stored pointwise or reduction value;
  the scheduler's vertical and horizontal fusion joins a kernel to an earlier one (among the
  last :data:`WINDOW`, none of those between writing what it reads) when they share a buffer
  and a loop: pointwise over the same elements, a pointwise epilogue over a reduction's output
  (BatchNorm's inverse deviation), a reduction over what a pointwise kernel makes or beside
  another over the same elements. A pointwise pass over a reduction's whole input stays a
  kernel of its own (a Triton reduction over tens of thousands of elements per channel is not
  held in registers), as inductor splits BatchNorm into a reduction and a normalizing kernel
  on CUDA. A buffer only its own kernel reads, and no graph output, is then never stored;
  a fused kernel writes in place of a buffer of the same size it reads for the last time.
* Each kernel's bytes: the buffers it reads from before it and the buffers it writes; an
  extern kernel's FLOPs are ``torch.utils.flop_counter``'s.

Not modelled: inductor's choice to recompute a cheap value in two kernels rather than store it
past these thresholds, template (Triton) matmuls and convolutions instead of cuBLAS and cuDNN,
split reductions, buffer reuse beyond what the caching allocator reuses, and the padding of
strides. How close this lands is what the GPU suite's compiled rows check against the filed
predictions (docs/benchmarks/prediction.md).
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator

import torch
from torch.utils.flop_counter import flop_registry

from ..._torch import tree_map_only
from .peak import OpRecord

__all__ = ["Graph", "Kernel", "kernels", "kernel_record"]

_aten = torch.ops.aten
EXTERN = {_aten.convolution, _aten.convolution_backward, _aten.mm, _aten.addmm, _aten.bmm,
          _aten.baddbmm, _aten._scaled_dot_product_efficient_attention,
          _aten._scaled_dot_product_flash_attention,
          _aten._scaled_dot_product_efficient_attention_backward,
          _aten._scaled_dot_product_flash_attention_backward,
          _aten._scaled_dot_product_cudnn_attention,
          _aten._scaled_dot_product_cudnn_attention_backward, _aten._efficient_attention_forward,
          _aten._efficient_attention_backward, _aten._flash_attention_forward,
          _aten._flash_attention_backward}
REDUCTIONS = {_aten.sum, _aten.mean, _aten.var_mean, _aten.var, _aten.std, _aten.amax,
              _aten.amin, _aten.max, _aten.min, _aten.argmax, _aten.argmin, _aten.prod,
              _aten.any, _aten.all, _aten.logsumexp}
READS, OPCOUNT, ACC_READS = 4, 30, 8  # inductor's realize thresholds (module docstring)


def _packet(node: torch.fx.Node) -> object:
    return getattr(node.target, "_overloadpacket", None)


def value(node: torch.fx.Node) -> object:
    """The fake value the tracer recorded for ``node`` (a tensor, a tuple of them, or None)."""
    return node.meta.get("val")


def nbytes(node: torch.fx.Node) -> int:
    """Bytes of ``node``'s tensor value: 0 when it has none or its size is symbolic (the CPU
    generator's state a dropout in a checkpointed region saves; a card keeps a seed and an
    offset on the host)."""
    v = value(node)
    n = v.numel() if isinstance(v, torch.Tensor) else 0
    return n * v.element_size() if isinstance(n, int) and n else 0


class Graph:
    """One AOTAutograd graph: each node's ``kind`` (``input``, ``output``, ``view``, ``item``:
    one output of a multi-output op, ``extern``, ``reduction``, ``cat``, ``mutation``,
    ``pointwise``), each node's ``base`` (the node whose buffer a view reads), ``outputs`` (the
    bases of the graph's outputs) and ``stored``: the values inductor writes to memory
    (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.base: dict[torch.fx.Node, torch.fx.Node] = {}
        self.kind: dict[torch.fx.Node, str] = {}
        for n in self.nodes:
            self.kind[n] = kind = self._kind(n)
            self.base[n] = self.base[n.args[0]] if kind == "view" else n
        self.outputs = {self.base[a] for a in self.nodes[-1].args[0]
                        if isinstance(a, torch.fx.Node)}
        self.users: dict[torch.fx.Node, set[torch.fx.Node]] = {n: set() for n in self.nodes}
        for n in self.nodes:
            for a in n.all_input_nodes:
                self.users[self.base[a]].add(n)
        self.reads: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        self.stored = self._stored()

    def _kind(self, n: torch.fx.Node) -> str:
        if n.op in ("placeholder", "output"):
            return {"placeholder": "input"}.get(n.op, n.op)
        if n.target is operator.getitem:
            return "item" if _packet(n.args[0]) in EXTERN | REDUCTIONS else "view"
        packet = _packet(n)
        if getattr(n.target, "is_view", False) or packet in (_aten._unsafe_view, _aten.alias):
            return "view"
        if packet is _aten.copy_ and self.base[n.args[0]].op == "placeholder":
            return "mutation"
        return "extern" if packet in EXTERN else "reduction" if packet in REDUCTIONS else \
            "cat" if packet is _aten.cat else "pointwise"

    def multi(self, n: torch.fx.Node) -> bool:
        """Whether ``n`` returns several tensors (each an ``item`` node)."""
        return isinstance(value(n), (tuple, list))

    def _stored(self) -> set[torch.fx.Node]:
        stored: set[torch.fx.Node] = set()
        ops: dict[torch.fx.Node, int] = {}
        for n in self.nodes:
            kind = self.kind[n]
            if kind in ("input", "item") or (kind in ("extern", "reduction", "cat")
                                             and not self.multi(n)):
                stored.add(n)
            if kind != "pointwise":
                continue
            reads, count = set(), 1
            for a in map(self.base.get, n.all_input_nodes):
                if a in stored:
                    reads.add(a)
                else:
                    reads |= self.reads.get(a, set())
                    count += ops.get(a, 0)
            self.reads[n], ops[n] = reads, count
            shared = len(self.users[n]) > 1 and (len(reads) > READS or count > OPCOUNT)
            if n in self.outputs or shared or len(reads) > ACC_READS or \
                    any(self.kind[u] == "extern" for u in self.users[n]):
                stored.add(n)
        return stored

    def read_by(self, n: torch.fx.Node) -> set[torch.fx.Node]:
        """The stored buffers a kernel computing ``n`` reads (through the values it inlines)."""
        if self.kind[n] == "extern":
            return {self.base[a] for a in n.all_input_nodes}
        out: set[torch.fx.Node] = set()
        for a in map(self.base.get, n.all_input_nodes):
            out |= {a} if a in self.stored else self.reads.get(a, set())
        return out


@dataclasses.dataclass
class Kernel:
    """One kernel: ``extern`` or not, the graph nodes it computes, the buffers it ``writes``
    and ``reads`` (stored before it), and ``extra`` bytes it stores into graph inputs."""

    extern: bool
    nodes: list[torch.fx.Node]
    writes: list[torch.fx.Node]
    reads: set[torch.fx.Node]
    extra: int = 0

    def loops(self, graph: Graph) -> tuple[set[int], set[int]]:
        """The elements the kernel's loops run over, as inductor's scheduler groups them:
        ``points``, each pointwise node's elements and each reduction's outputs (a pointwise
        node on a reduction's result is its epilogue), and ``totals``, each reduction's input
        elements (a reduction over what a pointwise node makes reads it in the same loop)."""
        points, totals = set(), set()
        for n in self.nodes:
            v = value(n)
            v = v[0] if isinstance(v, (tuple, list)) else v
            numel = v.numel() if isinstance(v, torch.Tensor) else 0
            numel = numel if isinstance(numel, int) else 0
            points.add(numel)
            if graph.kind[n] == "reduction":
                totals.add(max((nbytes(a) // value(a).element_size()
                                for a in n.all_input_nodes if nbytes(a)), default=0))
        return points, totals

    def joins(self, prev: Kernel, graph: Graph) -> bool:
        """Whether the scheduler fuses this kernel into ``prev``: neither extern, a buffer
        shared (read by both, or written by ``prev`` and read here), and a loop in common: a
        pointwise kernel over elements ``prev`` loops over pointwise or as a reduction's
        output; a reduction over elements ``prev`` makes pointwise or reduces too."""
        if self.extern or prev.extern or not self.reads & (set(prev.writes) | prev.reads):
            return False
        points, totals = self.loops(graph)
        before, reduced = prev.loops(graph)
        return bool(totals & (before | reduced)) if totals else bool(points & before)


def _unfused(graph: Graph) -> Iterator[Kernel]:
    for n in graph.nodes:
        kind = graph.kind[n]
        if kind not in ("extern", "reduction", "cat", "pointwise") or \
                (n not in graph.stored and not graph.multi(n)):
            continue
        writes = [u for u in n.users if graph.kind[u] == "item"] if graph.multi(n) else [n]
        yield Kernel(kind == "extern", [n], writes, graph.read_by(n))


def _add_mutations(graph: Graph, out: list[Kernel]) -> None:
    """Each store into a graph input (``mutation``) counted in the kernel of the nearest node
    before it: inductor writes the new value there."""
    owner = {n: k for k in out for n in k.nodes}
    last: Kernel | None = None
    for n in graph.nodes:
        last = owner.get(n, last)
        if graph.kind[n] == "mutation" and last is not None:
            last.extra += nbytes(n)


WINDOW = 8  # kernels back a fused kernel may move to, past those it does not depend on


def _fuses_into(k: Kernel, out: list[Kernel], graph: Graph) -> Kernel | None:
    """The latest of the last :data:`WINDOW` kernels that ``k`` joins and may move back to:
    none of the kernels after it writes a buffer ``k`` reads (the scheduler fuses nodes that are
    not neighbours in the graph's order when no dependency lies between them)."""
    for back in range(len(out) - 1, max(len(out) - WINDOW, 0) - 1, -1):
        if k.joins(out[back], graph):
            return out[back]
        if k.reads & set(out[back].writes):
            return None
    return None


def kernels(graph: Graph) -> list[Kernel]:
    """The graph's kernels in order, fused as the module docstring says."""
    out: list[Kernel] = []
    for k in _unfused(graph):
        into = _fuses_into(k, out, graph)
        if into is not None:
            into.nodes += k.nodes
            into.writes += k.writes
            into.reads |= k.reads
        else:
            out.append(k)
    _add_mutations(graph, out)
    for k in out:
        mine = set(k.writes)
        k.reads -= mine
        k.writes = [b for b in k.writes if b in graph.outputs or
                    any(b in other.reads for other in out if other is not k)]
    return out


def kernel_record(graph: Graph, k: Kernel, backward: bool) -> OpRecord:
    """``k`` as :mod:`.timing` prices an op: an extern kernel's op, FLOPs and bytes; a fused
    kernel as memory traffic (its reads and writes) under a pointwise op's name."""
    moved = sum(map(nbytes, k.reads)) + sum(map(nbytes, k.writes)) + k.extra
    first = next((value(a) for a in k.nodes[0].all_input_nodes
                  if isinstance(value(a), torch.Tensor)), value(k.nodes[0]))
    dtype = first.dtype if isinstance(first, torch.Tensor) else None
    if not k.extern:
        return OpRecord(_aten.add, 0, moved, dtype, backward)
    n = k.nodes[0]
    args, kwargs = tree_map_only(torch.fx.Node, value, (n.args, n.kwargs))
    formula = flop_registry.get(_packet(n))
    flops = int(formula(*args, **kwargs, out_val=value(n))) if formula is not None else 0
    return OpRecord(_packet(n), flops, moved, dtype, backward)
