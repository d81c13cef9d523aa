"""The planner's ``FakeTensorMode``: torch's, with a cache key made in a quarter of the time.

Half of a ``FakeTensorMode`` cache hit is making its key (each fake tensor read into a
``TensorMetadata`` record and flattened field by field). :class:`PlannerFakeMode` keys a call
whose arguments are plain (strided fake tensors of this mode with concrete sizes, numbers,
strings, dtypes, devices, and containers of them) by a tuple per tensor of the fields that record
is made of, less those derived from others, so two calls share a key only when torch's keys
are equal; any other call gets torch's own key. Its keys carry a marker of their own, so they
never meet torch's in the shared cache. Timings: docs/benchmarks/planner-vs-compile.md."""
from __future__ import annotations

from typing import Any

import torch
from zoo._torch import FakeTensor, FakeTensorMode
from zoo._torch import DispatchCacheKey as _DispatchCacheKey  # None: torch's keys throughout

__all__ = ["PlannerFakeMode"]

_MARK = ("zoo.memory.fake_mode",)  # first of every key made here
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


class _Unusual(Exception):
    """An argument the short key does not describe: torch's key is made instead."""


_BATCH_NORMS = {torch.ops.aten.native_batch_norm.default}
_REDUCED = (torch.bfloat16, torch.float16)
#: Matrix products whose meta functions let mixed dtypes through, where every real kernel
#: (CPU, CUDA) refuses them: a float64 batch into a float32 Linear.
_SAME_DTYPE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.mv.default, torch.ops.aten.addmv.default}


class PlannerFakeMode(FakeTensorMode):
    """``FakeTensorMode`` whose cache keys for plain arguments are made directly (module
    docstring), and whose BatchNorm on a bf16 or fp16 input with float32 parameters (autocast
    runs the convolution before it in bf16 and keeps BatchNorm's parameters float32) returns its
    saved mean and inverse deviation in float32, as the CPU and CUDA kernels do: torch's meta
    function makes them the input's dtype (half the bytes). A real tensor the step reads
    beside the model's and the batch's (a loss closing over its targets, a tensor learning
    rate) is taken as a fake copy of itself, as it already exists (``allow_non_fake_inputs``).
    A matrix product of tensors of two dtypes is refused, as the kernels refuse it (torch's
    meta functions of ``mm`` and ``addmm`` do not check). Everything else is torch's."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _SAME_DTYPE and len({a.dtype for a in args if isinstance(a, torch.Tensor)}) > 1:
            raise RuntimeError(f"{func} of tensors of different dtypes "
                               f"({', '.join(str(a.dtype) for a in args[:3])}), which its "
                               "kernels refuse")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _BATCH_NORMS and args[0].dtype in _REDUCED and args[1] is not None \
                and args[1].dtype == torch.float32 and out[1].dtype != torch.float32:
            like = torch.ops.aten.empty_like.default
            stats = [super(PlannerFakeMode, self).__torch_dispatch__(
                like, types, (t,), {"dtype": torch.float32}) for t in out[1:3]]
            out = (out[0], *stats, *out[3:])
        return out

    def _cache_key(self, *call: Any) -> Any:
        """torch's ``_cache_key(state, func, args, kwargs)``, short where the arguments are
        plain (``call``: torch's arguments, whatever comes before ``args, kwargs``)."""
        *before, args, kwargs = call
        if _DispatchCacheKey is None:
            return super()._cache_key(*call)
        try:
            flat = (_plain(self, args), _plain(self, kwargs) if kwargs else ())
        except _Unusual:
            return super()._cache_key(*call)
        prefix = super()._cache_key(*before, (), {})  # the op and torch's global state
        return _DispatchCacheKey((*_MARK, *prefix.key, *flat))


def _plain(mode: FakeTensorMode, arg: Any) -> Any:
    """``arg`` as a hashable value from which torch's key part for it follows; raises
    :class:`_Unusual` where that is not sure (symbolic sizes, sparse or foreign tensors,
    constants, objects of other kinds)."""
    if type(arg) is FakeTensor:
        if arg.fake_mode is not mode or arg.constant is not None \
                or arg.layout is not torch.strided or arg._has_symbolic_sizes_strides:
            raise _Unusual
        return (FakeTensor, arg.dtype, arg.shape, arg.stride(), arg.fake_device,
                arg.storage_offset(), arg.untyped_storage().nbytes(), arg.requires_grad,
                arg.is_conj(), arg.is_neg(), arg.is_inference())
    if type(arg) in (list, tuple, torch.Size):
        return (type(arg), *(_plain(mode, a) for a in arg))
    if type(arg) is dict:
        return (dict, *((_plain(mode, k), _plain(mode, v)) for k, v in arg.items()))
    if type(arg) in _PLAIN:
        return (type(arg), arg)
    raise _Unusual
