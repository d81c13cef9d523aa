"""One dispatch mode that counts a step's live bytes and FLOPs op by op, in constant time per op.

``MemTracker`` (torch.distributed._tools) is the project's exact CPU memory figure, but its
per-module statistics cost time in proportion to the model's modules at every op, and
``FlopCounterMode``'s module hooks keep tensors of a checkpoint's recompute alive longer than
the step does. :class:`StepCounter` keeps only what the planner needs: MemTracker's byte count
(a storage counts from the op that makes it until it is freed, kept by weak-reference
callbacks), its peak, and the FLOPs of ``torch.utils.flop_counter``'s formulas, with no module
hooks. tests/planner/test_planner_exact.py checks it against both, byte for byte and FLOP for
FLOP."""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from zoo import _torch
from zoo._torch import FakeTensor, TorchDispatchMode, in_kernel_invocation_manager, tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["StepCounter", "storage_key", "storage_bytes"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by every view of it)."""
    return _torch.storage_id(t)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage as MemTracker counts them (CUDA rounds up to 512 bytes)."""
    n = t.untyped_storage().nbytes()
    return math.ceil(n / 512) * 512 if t.device.type == "cuda" else n


_DEVICE = torch.ops.prim.device.default  # asked by the autograd engine: most of a step's calls
_DETACH = torch.ops.aten.detach.default  # autograd's, for each fake tensor it saves or unpacks
_TO_COPY = _torch.to_copy_op  # a dtype cast: autocast's of a parameter among them


def fake_detach(t: FakeTensor) -> FakeTensor:
    """``t.detach()`` for a fake tensor, made as ``FakeTensorMode`` makes it from its cache (a
    meta tensor of ``t``'s shape, strides and offset set onto ``t``'s storage), without
    hashing a cache key: a fifth of the time. Autograd detaches every fake tensor it saves or
    unpacks (``shallow_copy_and_detach`` of a Python tensor subclass dispatches ``detach``):
    a third of a pattern run's ops, a tenth of a DenseNet-BC-100 planning."""
    with in_kernel_invocation_manager(t.fake_mode):
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        meta.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return FakeTensor(t.fake_mode, meta, t.fake_device)


class StepCounter(TorchDispatchMode):
    """Live bytes (``current``), their ``peak`` and the ``flops`` of every op run under it.

    ``track(*objects)``: tensors, modules (parameters, buffers, gradients) and optimizers
    (states) that exist before the step count from the start. ``on_op``: called after each op
    (the profiler reads ``current`` there); ``on_copy``: called with the source and the result
    of each ``_to_copy`` (a cast: the profiler notes autocast's casts of parameters)."""

    supports_higher_order_operators = True  # a replayed compiled graph's RNG wrappers

    def __init__(self, on_op: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.flops = 0
        self.on_op = on_op
        self.on_copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._live: dict[int, tuple[int, Any, int]] = {}
        self._made = 0  # storages seen so far: each live one's serial number

    def track(self, *objects: Any) -> None:
        for obj in objects:
            for t in _tensors_of(obj):
                self._add(t)
        self.peak = max(self.peak, self.current)

    def _add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        nbytes = storage_bytes(t)
        self._made += 1
        self._live[key] = (nbytes, weakref.ref(st, lambda _, key=key: self._free(key)),
                           self._made)
        self.current += nbytes

    def bytes_of(self, t: torch.Tensor) -> int:
        """Bytes ``t``'s storage counts for here (as counted when it was made, if it was)."""
        entry = self._live.get(storage_key(t))
        return entry[0] if entry is not None else storage_bytes(t)

    @staticmethod
    def request_bytes(nbytes: int, device: torch.device) -> int:
        """Bytes a new storage of ``nbytes`` on ``device`` would count for here."""
        return -(-nbytes // 512) * 512 if device.type == "cuda" else nbytes

    def key(self, t: torch.Tensor) -> int:
        """An identity of ``t``'s storage that no other storage of the step shares, unlike its
        address (``storage_key``), which a storage made after this one is freed may reuse: the
        serial number of a storage the counter sees, its address negated for one it does not."""
        address = storage_key(t)
        entry = self._live.get(address)
        return -address if entry is None else entry[2]

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is _DEVICE:  # creates nothing, counts nothing: answered first (a fake
            # tensor's own field, without a second dispatch: 3 in 5 of a fake step's calls)
            t = args[0]
            return t.fake_device if type(t) is FakeTensor else func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if isinstance(func, _torch.HigherOrderOperator):  # run its dense kernel directly
            cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten(args)[0])
            key = _torch.DispatchKey.CUDA if cuda else _torch.DispatchKey.CPU
            out = func.dispatch(key, *args, **kwargs)
        elif func is _DETACH and type(args[0]) is FakeTensor and not args[0].is_conj() \
                and not args[0].is_neg():
            out = fake_detach(args[0])
        else:
            out = func(*args, **kwargs)
        packet = getattr(func, "_overloadpacket", None)  # None: a higher-order operator
        formula = flop_registry.get(packet) if packet is not None else None
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        if isinstance(out, torch.Tensor):  # most ops: no tree to walk
            self._add(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._add(t)
        if self.current > self.peak:
            self.peak = self.current
        if func is _TO_COPY and self.on_copy is not None:
            self.on_copy(args[0], out)
        if self.on_op is not None:
            self.on_op()
        return out


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            yield from _tensors_of(t)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for group in obj.param_groups:
            for p in group["params"]:
                yield from _tensors_of(p)
    else:
        for t in obj:
            yield from _tensors_of(t)
