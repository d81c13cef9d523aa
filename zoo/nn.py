"""Checkpoint-safe layers: BatchNorm that updates its running statistics once per step, and
spectral norm whose recompute repeats its forward's power iteration (:func:`convert_spectral_norm`).

``zoo.checkpoint`` already keeps plain ``nn.BatchNorm*d`` exact: while it recomputes, global
module hooks run each normalisation layer with momentum 0 and take back its ``num_batches_tracked``
increment. The ``cp_`` layers do the same inside their own forward, which adds one thing:
**they are exact under anyone's checkpoint**, not only the zoo's. They recognise a recompute by
``zoo.is_recomputing()`` *or* by running inside an autograd backward pass, which is where both
reentrant and non-reentrant ``torch.utils.checkpoint`` (and everything built on it: timm's
``set_grad_checkpointing``, torchvision's ``memory_efficient``, Hugging Face's
``gradient_checkpointing_enable``) recompute. A plain BatchNorm under those wrappers counts every
batch twice (pytorch/pytorch#96136). Under the zoo's checkpoint they cost the same as plain
BatchNorm (one in-place kernel per layer and recompute; see docs/benchmarks/checkpoint.md).

The idea and the name come from the multi-GPU checkpoint csrhddlam/pytorch-checkpoint on GitHub
(``cp_BatchNorm2d``); the state_dict is exactly ``nn.BatchNorm2d``'s, so checkpoints load either
way.

:func:`convert_batchnorm` gives every BatchNorm flavour in a model such a twin, timm's
``BatchNormAct2d`` and any other ``_BatchNorm`` subclass included (:func:`recompute_safe_class`).
"""
from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import nn

from . import _torch
from ._subclass import reduce_as_original
from .checkpoint import is_recomputing, state_bookkeeping
from .checkpoint.recompute import advancing

__all__ = ["cp_BatchNorm1d", "cp_BatchNorm2d", "cp_BatchNorm3d", "cp_SyncBatchNorm",
           "convert_batchnorm", "restore_batchnorm", "recompute_safe_class", "cp_SpectralNorm",
           "cp_SpectralNormPreHook", "convert_spectral_norm", "restore_spectral_norm",
           "has_unconverted_spectral_norm"]


def _recomputing_under_any_checkpoint() -> bool:
    """``zoo.is_recomputing()`` widened to anyone's checkpoint: True while a checkpointed region
    is being recomputed, by the zoo's checkpoint or torch's.

    A train-mode forward that runs inside an autograd backward pass is a recompute: that is where
    ``torch.utils.checkpoint`` (reentrant and not) replays the region. While ``torch.compile``
    traces, it is False and reads no autograd state (which would break the graph): the compiled
    forward applies the statistics update once, and AOTAutograd's recompute never replays it.
    """
    if torch.compiler.is_compiling():
        return False
    return is_recomputing() or _torch.current_graph_task_id() != -1


class _RecomputeSafeNorm:
    """Mixin for ``_BatchNorm`` subclasses: a recomputed forward leaves the statistics as they are.

    During a recompute the layer runs its ordinary train-mode forward (batch statistics, the same
    saved tensors as the first forward, which non-reentrant checkpoint verifies) with momentum 0:
    the update ``(1 - 0) * running + 0 * batch`` writes back exactly the old value. Where the
    forward skips a missing ``num_batches_tracked`` (torch's BatchNorm, timm's BatchNormAct2d) the
    counter is set aside for that call, so no kernel runs for it; SyncBatchNorm's forward insists
    on its counter, so there the increment is taken back afterwards (one tiny in-place kernel).
    """

    recompute_safe = True  # tells zoo.checkpoint's guard that this layer needs no snapshot

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats and _recomputing_under_any_checkpoint()):
            return super().forward(input)
        self._check_input_dim(input)  # fail before touching any state
        momentum, count = self.momentum, _torch.module_buffers(self).get("num_batches_tracked")
        set_aside = count is not None and _skips_missing_count(type(self))
        self.momentum = 0.0
        if set_aside:
            _torch.module_buffers(self)["num_batches_tracked"] = None
        try:
            return super().forward(input)
        finally:
            self.momentum = momentum
            if set_aside:
                _torch.module_buffers(self)["num_batches_tracked"] = count
            elif count is not None:
                with torch.no_grad(), state_bookkeeping():
                    count.sub_(1)


# BatchNorm forwards that read num_batches_tracked only when it is there (timm's named, not
# imported: importing zoo must not import timm).
_COUNT_OPTIONAL = {"torch.nn.modules.batchnorm._BatchNorm.forward",
                   "timm.layers.norm_act.BatchNormAct2d.forward"}


@functools.cache
def _skips_missing_count(cls: type) -> bool:
    """Whether the BatchNorm forward under the mixin in ``cls`` skips a missing counter."""
    return _forward_name(super(_RecomputeSafeNorm, cls)) in _COUNT_OPTIONAL


class cp_BatchNorm1d(_RecomputeSafeNorm, nn.BatchNorm1d):
    """Drop-in ``nn.BatchNorm1d`` whose statistics update once per step under any checkpoint."""


class cp_BatchNorm2d(_RecomputeSafeNorm, nn.BatchNorm2d):
    """Drop-in ``nn.BatchNorm2d`` whose statistics update once per step under any checkpoint."""


class cp_BatchNorm3d(_RecomputeSafeNorm, nn.BatchNorm3d):
    """Drop-in ``nn.BatchNorm3d`` whose statistics update once per step under any checkpoint."""


class cp_SyncBatchNorm(_RecomputeSafeNorm, nn.SyncBatchNorm):
    """Drop-in ``nn.SyncBatchNorm`` whose statistics update once per step under any checkpoint."""


class _SnapshotNorm:
    """Mixin for ``_BatchNorm`` subclasses whose forward updates the statistics its own way.

    Such a forward may not take its update factor from ``momentum`` (timm's ``SplitBatchNorm2d``,
    a user's BatchNorm with a hand-written update), so the momentum-0 trick cannot be trusted:
    during a recompute the layer's own buffers are copied before its forward and written back
    after, which leaves them exactly as the first forward did whatever the forward does. The
    write-back goes through ``.data``, which does not bump the buffers' version counters: the
    recomputed graph saved ``running_mean``/``running_var`` (BatchNorm's backward takes them,
    and reads them only in eval mode), and reentrant ``torch.utils.checkpoint`` runs backward
    through that graph, where a bumped version is an error.
    """

    recompute_safe = True  # tells zoo.checkpoint's guard that this layer needs no snapshot

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and _recomputing_under_any_checkpoint()):
            return super().forward(*args, **kwargs)
        with torch.no_grad(), state_bookkeeping():
            saved = [b.clone() for b in self.buffers(recurse=False)]
        try:
            return super().forward(*args, **kwargs)
        finally:
            with torch.no_grad(), state_bookkeeping():
                for live, old in zip(self.buffers(recurse=False), saved):
                    live.data.copy_(old)


# Forwards that take the running-statistics update factor from ``momentum`` and count
# ``num_batches_tracked`` once per call, so that the momentum-0 trick is exact for them. timm's are
# named rather than imported: importing zoo must not import timm.
_MOMENTUM_FORWARDS = {
    "torch.nn.modules.batchnorm._BatchNorm.forward",
    "torch.nn.modules.batchnorm.SyncBatchNorm.forward",
    "timm.layers.norm_act.BatchNormAct2d.forward",
    "timm.layers.norm_act.SyncBatchNormAct.forward",
}
_TWINS: dict[type, type] = {
    nn.BatchNorm1d: cp_BatchNorm1d,
    nn.BatchNorm2d: cp_BatchNorm2d,
    nn.BatchNorm3d: cp_BatchNorm3d,
    nn.SyncBatchNorm: cp_SyncBatchNorm,
}
_ORIGINALS: dict[type, type] = {twin: cls for cls, twin in _TWINS.items()}


def _new_twin(cls: type, *args: Any) -> Any:
    """Unpickling a generated twin saved before :mod:`zoo._subclass` (which now pickles it):
    build it from its original class, which pickles by name."""
    twin = recompute_safe_class(cls)
    return twin.__new__(twin, *args)


def _reduce_twin(self: nn.Module, protocol: int) -> Any:
    """Pickle (``torch.save(model)``) a generated twin as its original class plus the swap."""
    return reduce_as_original(self, protocol, recompute_safe_class, _ORIGINALS[type(self)])


def _forward_name(cls: type) -> str:
    forward = cls.forward
    return f"{forward.__module__}.{forward.__qualname__}"


def recompute_safe_class(cls: type) -> type | None:
    """The recompute-safe twin of BatchNorm class ``cls``, or None if ``cls`` is none.

    torch's four classes map to the ``cp_`` layers above; any other ``_BatchNorm`` subclass gets a
    subclass made once and cached, named ``cp_<name>``: with the momentum-0 trick when its forward
    is known to take the update factor from ``momentum`` (timm's ``BatchNormAct2d`` and
    ``SyncBatchNormAct``, subclasses that keep torch's forward), with a buffer snapshot otherwise.
    The twin adds no parameter or buffer, so the state_dict is the original's.
    """
    if cls in _TWINS or cls in _ORIGINALS:
        return _TWINS.get(cls, cls)
    if not issubclass(cls, nn.modules.batchnorm._BatchNorm) or \
            getattr(cls, "recompute_safe", False):
        return None
    mixin = _RecomputeSafeNorm if _forward_name(cls) in _MOMENTUM_FORWARDS else _SnapshotNorm
    twin = type(f"cp_{cls.__name__}", (mixin, cls), {
        "__module__": __name__, "__qualname__": f"cp_{cls.__qualname__}",
        "__doc__": f"``{cls.__qualname__}`` whose statistics update once per step under any "
                   "checkpoint (made by zoo.nn.convert_batchnorm).",
        "__reduce_ex__": _reduce_twin})
    _TWINS[cls], _ORIGINALS[twin] = twin, cls
    return twin


def _tracks_statistics(module: nn.Module) -> bool:
    """Whether a train-mode forward of this BatchNorm can update running statistics at all."""
    return bool(module.track_running_stats) and module.running_mean is not None


def convert_batchnorm(module: nn.Module) -> nn.Module:
    """Make every BatchNorm in ``module`` update its running statistics once per step under any
    checkpoint, by giving it its recompute-safe twin class (:func:`recompute_safe_class`).

    Every flavour is converted, keeping its behaviour: ``nn.BatchNorm1d/2d/3d`` and
    ``nn.SyncBatchNorm`` become ``cp_BatchNorm*``/``cp_SyncBatchNorm``; timm's ``BatchNormAct2d``
    and ``SyncBatchNormAct`` keep their activation, drop and forward (their twin subclasses them);
    any other ``_BatchNorm`` subclass gets a twin too. Layers that never update running statistics
    (``track_running_stats=False``, no running buffers, frozen BatchNorms that are not
    ``_BatchNorm``) are left alone. The swap is in place and changes only the class: parameters,
    buffers, hooks and object identity are kept, so an optimizer built before the call still
    holds the right tensors and the state_dict is unchanged. Returns ``module`` (converted itself
    if it is a BatchNorm).
    """
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and _tracks_statistics(m):
            twin = recompute_safe_class(type(m))
            if twin is not None:
                m.__class__ = twin
    return module


def restore_batchnorm(module: nn.Module, recurse: bool = True) -> nn.Module:
    """Undo :func:`convert_batchnorm`: every twin gets its original class back (``module``
    alone with ``recurse=False``); returns ``module``."""
    for m in (module.modules() if recurse else [module]):
        original = _ORIGINALS.get(type(m))
        if original is not None:
            m.__class__ = original
    return module


# --------------------------------------------------------------------------------------------
# Spectral norm (Miyato et al. 2018, "Spectral Normalization for Generative Adversarial
# Networks", arXiv:1802.05957): each train-mode forward runs a power iteration that rewrites the
# layer's ``u`` and ``v`` and divides the weight by the sigma they give. Under any checkpoint
# (torch's too) the recompute iterates again: another sigma than the forward's, so other
# gradients, and ``u``/``v`` advanced twice per step. The twins below tell zoo.checkpoint's
# region before they iterate (``zoo.checkpoint.recompute.advancing``): the region records the
# state its forward began from and recomputes from it, bit for bit the plain model's.
# --------------------------------------------------------------------------------------------
class cp_SpectralNorm(_torch.SpectralNormParametrization):
    """torch's spectral-norm parametrization
    (``torch.nn.utils.parametrizations.spectral_norm``) whose power iteration is recomputed from
    the ``u`` and ``v`` its forward began from (made by :func:`convert_spectral_norm`)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.training and weight.ndim > 1:
            advancing(self, (self._u, self._v))
        return super().forward(weight)


class cp_SpectralNormPreHook(_torch.SpectralNormPreHook):
    """The forward pre-hook of the older ``torch.nn.utils.spectral_norm``, recomputed from the
    ``u`` and ``v`` its forward began from (made by :func:`convert_spectral_norm`)."""

    def __call__(self, module: nn.Module, inputs: Any) -> None:
        if module.training:
            advancing(self, (getattr(module, self.name + "_u"), getattr(module, self.name + "_v")))
        super().__call__(module, inputs)


_SN_TWINS: dict[type, type] = {_torch.SpectralNormParametrization: cp_SpectralNorm,
                               _torch.SpectralNormPreHook: cp_SpectralNormPreHook}
_SN_ORIGINALS: dict[type, type] = {twin: cls for cls, twin in _SN_TWINS.items()}


def _spectral_norms(module: nn.Module, recurse: bool = True) -> list[Any]:
    """The spectral-norm objects in ``module``: parametrizations and forward pre-hooks."""
    found: list[Any] = []
    for m in (module.modules() if recurse else [module]):
        found.append(m)
        found.extend(_torch.module_forward_pre_hooks(m).values())
    return [x for x in found if type(x) in _SN_TWINS or type(x) in _SN_ORIGINALS]


def has_unconverted_spectral_norm(module: nn.Module) -> bool:
    """Whether ``module`` itself (a parametrization, or a layer with the older hook) holds a
    spectral norm :func:`convert_spectral_norm` would convert."""
    return any(type(x) in _SN_TWINS for x in _spectral_norms(module, recurse=False))


def convert_spectral_norm(module: nn.Module) -> nn.Module:
    """Make every spectral norm in ``module`` exact under ``zoo.checkpoint``: torch's
    parametrization and the older hook-based ``torch.nn.utils.spectral_norm`` get their twin
    classes (:class:`cp_SpectralNorm`, :class:`cp_SpectralNormPreHook`), in place: state_dict,
    parameters and identity kept. Exact under zoo's checkpoint only (torch's checkpoint does not
    record the state). Returns ``module``; ``zoo.set_grad_checkpointing`` and
    ``zoo.blocks.checkpoint_module`` (so every ``zoo.plan``) call it."""
    for x in _spectral_norms(module):
        x.__class__ = _SN_TWINS.get(type(x), type(x))
    return module


def restore_spectral_norm(module: nn.Module, recurse: bool = True) -> nn.Module:
    """Undo :func:`convert_spectral_norm`: every twin gets torch's class back (``module``'s own
    alone with ``recurse=False``); returns ``module``."""
    for x in _spectral_norms(module, recurse):
        x.__class__ = _SN_ORIGINALS.get(type(x), type(x))
    return module


def __getattr__(name: str) -> Any:
    # ``in_recompute`` was listed in this module's API; it is kept, deprecated, for code that
    # imported it. The one public question is ``zoo.is_recomputing()``.
    if name == "in_recompute":
        warnings.warn("zoo.nn.in_recompute is deprecated: use zoo.is_recomputing() (the zoo's "
                      "checkpoint only); it will be removed", DeprecationWarning, stacklevel=2)
        return _recomputing_under_any_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
