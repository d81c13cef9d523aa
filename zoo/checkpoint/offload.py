"""Activation offload: a region's saved tensors wait in host memory between forward and backward.

Recomputation has a floor (a region's inputs and the largest layer's working set); below it the
field moves saved activations to host memory during the forward and brings them back before the
backward reads them: torch's ``torch.autograd.graph.save_on_cpu`` (every saved tensor, copied
synchronously), Hugging Face's and torchtune's activation offload, DeepSpeed's planned offload.
Done carelessly the copies race with the compute stream and give wrong gradients with no error
(huggingface/trl#7195, meta-pytorch/torchtune#1867 and #2683, NVIDIA/Megatron-LM#7398).
:func:`offload` is the zoo's one mechanism, built on saved-tensor hooks like the checkpoint
region, and exact: the backward reads the bytes the forward saved, so gradients, BatchNorm
statistics and random numbers are plain's, bit for bit.

What it does with each tensor autograd saves inside the region:

* keeps a module's parameters and buffers (and views of them) and tensors under ``min_bytes``
  as they are: they live on the device anyway, or cost more to move than they free; and tensor
  subclasses (DTensor, Float8 training's activations), whose storage need not hold their data;
* copies the tensor's whole storage once to (pinned) host memory, so a tensor saved twice and a
  view saved beside its base cost one copy, and rebuilds each view on the storage brought back;
* on CUDA, copies on a side stream that first waits for the compute stream, and marks the
  source with ``record_stream`` so the caching allocator does not hand its memory to a later
  kernel before the copy has read it; brings a region's tensors back on the side stream when the
  backward first reaches the region *after* it (prefetch) and makes the compute stream wait for
  that copy's event before the first read;
* raises, as plain autograd does, when a saved tensor (moved or kept) was modified in place
  after it was saved (with hooks, autograd no longer checks the version counter itself);
* frees the host copy with the graph (as plain frees saved tensors), the device copy once its
  node has used it.

Nesting: a ``zoo.checkpoint`` region inside an offload region checkpoints as usual (its saved
tensors go to its own slots; its inputs stay with it); an offload region inside a checkpoint
region is a no-op, because the checkpoint already keeps nothing of it. Without CUDA the region
is a no-op (nothing to free on a host) unless ``to_host=True``, which runs the same bookkeeping
through host copies of CPU tensors, so the CPU tests exercise it bit for bit.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _torch
from .region import _inside_region

_version = _torch.tensor_version

__all__ = ["offload", "Offload", "host_copies", "offloaded_bytes", "reset_offloaded_bytes",
           "simulated_host"]

_counter = threading.local()
_chain = threading.local()  # the last offload region of this thread's forward
_streams: dict[torch.device, Any] = {}  # the copies' side stream, per CUDA device


@contextlib.contextmanager
def host_copies() -> Iterator[None]:
    """Within it, offload regions move CPU tensors too, through host copies (``to_host=True``
    for every region, ``zoo.checkpoint(..., offload=True)`` included): the bookkeeping of an
    offloaded model tested bit for bit on a machine without CUDA."""
    before = getattr(_counter, "to_host", False)
    _counter.to_host = True
    try:
        yield
    finally:
        _counter.to_host = before


@contextlib.contextmanager
def simulated_host(note: Callable[[str, int, int], None] | None = None) -> Iterator[None]:
    """Within it, offload regions move the tensors of a simulated card: the fake CPU tensors a
    card's step runs on (``zoo.memory.cards``). The host copy is a ``meta`` tensor, which the
    card's allocator does not count, and bringing it back allocates the device's bytes again,
    so the card's predicted peak sees what the card would hold. ``note(kind, storage, bytes)``
    hears each copy as the side stream would run it: ``"out"`` when a storage is copied to the
    host, ``"back"`` when it is brought back (prefetched or on demand), ``"use"`` when the
    backward first needs it (``zoo.checkpoint.offload_cost.link_wait`` times them)."""
    before = getattr(_counter, "simulated", None)
    _counter.simulated = note or _no_note
    try:
        yield
    finally:
        _counter.simulated = before


def _no_note(kind: str, storage: int, nbytes: int) -> None:
    pass


def _simulated() -> Callable[[str, int, int], None] | None:
    return getattr(_counter, "simulated", None)


def offloaded_bytes() -> int:
    """Bytes this thread copied to host memory since the last :func:`reset_offloaded_bytes`."""
    return getattr(_counter, "bytes", 0)


def reset_offloaded_bytes() -> None:
    _counter.bytes = 0


class _Storage:
    """One storage's host copy, the events that order it, and its device copy once back."""

    __slots__ = ("host", "device", "nbytes", "copied", "back", "flat", "pending", "views",
                 "__weakref__")

    def __init__(self, source: torch.Tensor, stream: Any):
        self.device, self.nbytes = source.device, source.untyped_storage().nbytes()
        self.flat: torch.Tensor | None = None  # the bytes brought back, while views wait
        self.pending = self.views = 0  # views of this storage saved; of them not yet unpacked
        self.back: Any = None
        note = _simulated()
        if note is not None:  # bytes only: no copy of a fake tensor (and no ``set_`` of its
            # storage, which FakeTensorMode's cache of ops would keep alive)
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, device="meta")
            self.copied = None
            note("out", id(self), self.nbytes)
            _counter.bytes = offloaded_bytes() + self.nbytes
            return
        flat = torch.empty(0, dtype=torch.uint8, device=source.device).set_(
            source.untyped_storage())
        if stream is None:  # a host: a plain copy, in order
            self.host, self.copied = flat.clone(), None
        else:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # the allocator keeps the source until the copy read it
            self.copied = stream.record_event()
        _counter.bytes = offloaded_bytes() + self.nbytes

    def fetch(self, stream: Any) -> torch.Tensor:
        """Start bringing the bytes back (on ``stream`` after the copy out), as one flat byte
        tensor every saved view of the storage is made from: held here until the last of them
        is unpacked (:meth:`unpacked`), so they share one storage, as they did when saved."""
        if self.flat is not None:
            return self.flat
        if self.host.device.type == "meta":  # a simulated card: the bytes, allocated again
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            (_simulated() or _no_note)("back", id(self), self.nbytes)
        elif stream is None:
            flat = self.host.clone()
        else:
            flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the allocation's order
            stream.wait_event(self.copied)
            with torch.cuda.stream(stream):
                flat.copy_(self.host, non_blocking=True)
            flat.record_stream(stream)  # freed unread (a partial backward): not reused mid-copy
            self.back = stream.record_event()
        self.flat = flat
        return flat

    def unpacked(self) -> None:
        """One saved view of the storage was unpacked; after the last, the storage is held only
        by the views in use, and the count starts again: a second backward through a retained
        graph brings it back again, once for all its views."""
        self.pending -= 1
        if self.pending <= 0:
            self.flat, self.pending = None, self.views


def _version_witness(tensor: torch.Tensor) -> Any:
    """Something that shows ``tensor``'s in-place version later without keeping its memory:
    an empty alias sharing its version counter, or (on a torch without the means) a weak
    reference, which sees changes only while the tensor is held elsewhere."""
    if _torch.preserve_version_counter is None:
        return weakref.ref(tensor)
    alias = tensor.detach()
    with _torch.preserve_version_counter(alias):
        alias.set_()
    return alias


class _Saved:
    """What autograd holds for one offloaded tensor: its storage's copy and how to view it."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride", "version", "source",
                 "__weakref__")

    def __init__(self, storage: _Storage, tensor: torch.Tensor):
        self.storage, self.dtype = storage, tensor.dtype
        self.offset, self.size, self.stride = (tensor.storage_offset(), tensor.shape,
                                               tensor.stride())
        self.version = _version(tensor)
        self.source = _version_witness(tensor)


class _Kept:
    """A saved tensor the region leaves where it is, with its version when saved: autograd
    checks no version of what passes through hooks, so :meth:`Offload.unpack` does."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, _version(tensor)


def _check_version(source: torch.Tensor | None, version: int) -> None:
    """Raise, as plain autograd does, if ``source`` changed in place since it was saved."""
    if source is not None and _version(source) != version:
        raise RuntimeError(
            "zoo.offload: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation (version {version} -> {_version(source)}); "
            "clone it before changing it in place.")


class Offload:
    """Saved-tensor hooks that move a region's saved tensors to host memory (see the module).

    Use as a context manager around a forward, or through :func:`offload`. ``keep``: tensors
    whose storages stay on the device (a module's parameters and buffers).
    """

    def __init__(self, keep: tuple[torch.Tensor, ...] = (), min_bytes: int = 1024,
                 to_host: bool = False):
        self.min_bytes, self.to_host = min_bytes, to_host
        self.kept = {_torch.storage_id(t) for t in keep}
        self.storages: dict[tuple[int, int], tuple[weakref.ref, _Storage]] = {}
        self.saved: list[weakref.ref[_Saved]] = []
        self.previous: weakref.ref[Offload] | None = None
        self.fetched = False
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> Offload:
        self.previous = getattr(_chain, "last", None)  # a weak reference
        _chain.last = weakref.ref(self)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.hooks.__exit__(*exc)
        self.storages.clear()  # dedupe within the forward only

    @staticmethod
    def stream(device: torch.device) -> Any:
        """The side stream the copies of ``device`` run on (one per device); None off CUDA."""
        if device.type != "cuda":
            return None
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device)
        return _streams[device]

    def moves(self, tensor: torch.Tensor) -> bool:
        base = tensor if tensor._base is None else tensor._base  # a view: what it views
        if isinstance(base, torch.nn.Parameter) or base.requires_grad and base.is_leaf:
            return False  # a parameter, or one swapped in by a call (functional_call), or views
        if tensor.layout is not torch.strided or tensor.is_nested:
            return False
        if type(tensor) not in (torch.Tensor, _torch.FakeTensor):  # a subclass's storage (a
            return False  # wrapper's has no bytes) need not hold its data: saved as it is
        on_host = self.to_host or _simulated() is not None  # CPU tensors move only then
        if tensor.device.type not in ("cpu", "cuda") or tensor.device.type == "cpu" and not on_host:
            return False
        storage = tensor.untyped_storage()
        return storage.nbytes() >= self.min_bytes and _torch.storage_id(tensor) not in self.kept

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self.moves(tensor):
            return tensor if tensor.is_inference() else _Kept(tensor)
        key = (_torch.storage_id(tensor), _version(tensor))
        hit = self.storages.get(key)
        if hit is not None and hit[0]() is not None:
            copy = hit[1]  # the same storage, still alive and unchanged since: one copy
        else:  # (the storage's own object: a view saved and dropped at once leaves it alive)
            copy = _Storage(tensor, self.stream(tensor.device))
            self.storages[key] = (weakref.ref(tensor.untyped_storage()), copy)
        copy.pending, copy.views = copy.pending + 1, copy.views + 1
        saved = _Saved(copy, tensor)
        self.saved.append(weakref.ref(saved))
        return saved

    def unpack(self, saved: Any) -> torch.Tensor:
        if saved.__class__ is _Kept:
            _check_version(saved.tensor, saved.version)
            return saved.tensor
        if saved.__class__ is not _Saved:
            return saved
        source = saved.source if isinstance(saved.source, torch.Tensor) else saved.source()
        _check_version(source, saved.version)
        if not self.fetched:
            self.prefetch_previous()
        stream = self.stream(saved.storage.device)
        flat = saved.storage.fetch(stream)
        if saved.storage.host.device.type == "meta":
            (_simulated() or _no_note)("use", id(saved.storage), saved.storage.nbytes)
        saved.storage.unpacked()
        if stream is not None:
            torch.cuda.current_stream(flat.device).wait_event(saved.storage.back)
        return flat.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)

    def prefetch_previous(self) -> None:
        """The backward reached this region: start bringing the one before it back."""
        self.fetched = True
        previous = None if self.previous is None else self.previous()
        if previous is None or previous.fetched:
            return
        for ref in previous.saved:
            saved = ref()
            if saved is not None:
                saved.storage.fetch(previous.stream(saved.storage.device))


def _check_arguments(fn: Any, min_bytes: Any) -> None:
    """One line for a call written wrong: ``fn`` not callable (inputs first), or ``min_bytes``
    not a whole number of bytes."""
    if not callable(fn):
        raise TypeError(f"zoo.offload: fn must be callable (a module or a function), got "
                        f"{type(fn).__name__}; pass the function first, then its inputs")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"zoo.offload: min_bytes must be a whole number of bytes >= 0 (the "
                         f"smallest storage worth moving), got {min_bytes!r}")


def _module_state(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The parameters and buffers of the modules a region runs, which stay on the device
    anyway: ``fn`` itself, the module ``fn`` is a method of, and modules among its arguments,
    alone or in a list (a plan's offloaded segment is ``run_blocks(blocks, x)``)."""
    found = [fn, getattr(fn, "__self__", None)]
    for arg in args:
        found.extend(arg if isinstance(arg, (list, tuple)) else (arg,))
    modules = [m for m in found if isinstance(m, torch.nn.Module)]
    return tuple(t for m in modules for t in (*m.parameters(), *m.buffers()))


def offload(fn: Callable[..., Any], *args: Any, min_bytes: int = 1024, to_host: bool | None = None,
            **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` with its saved tensors moved to host memory until backward.

    Exactly ``fn(*args, **kwargs)`` for outputs, gradients, normalisation statistics and random
    numbers (nothing is recomputed). A no-op under ``torch.no_grad()``, inside a checkpoint
    region, while ``torch.compile`` traces (the compiled graph keeps what it saves), and for
    CPU tensors unless ``to_host=True`` or inside :func:`host_copies` (the bookkeeping, run
    through host copies: for tests). ``zoo.checkpoint(fn, ..., offload=True)`` calls it, so a
    plan's unit says "offload" where it says "checkpoint". The parameters and buffers of
    ``fn`` when it is a module (or a module's method), and of modules passed to it, stay where
    they are, as do tensors under ``min_bytes``.
    :func:`offloaded_bytes` counts the bytes copied.
    """
    if not torch.compiler.is_compiling():  # out of the trace, as zoo.checkpoint does
        _check_arguments(fn, min_bytes)
    if not torch.is_grad_enabled() or _inside_region() or torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    if to_host is None:
        to_host = getattr(_counter, "to_host", False)
    if not to_host and _simulated() is None and not torch.cuda.is_initialized():
        return fn(*args, **kwargs)  # nothing can move: plain code, no hooks (torch.func runs)
    with Offload(_module_state(fn, args), min_bytes, to_host):
        return fn(*args, **kwargs)
