"""The uniform interface every zoo model has (timm's, trimmed)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from ..checkpoint import in_place_groups, run_plan
from ..checkpoint.casts import casts_once
from ..checkpoint.sequential import OFFLOAD

# A checkpoint plan of a model's chain: (start, stop, checkpointed) segments covering it in order;
# ``checkpointed`` may be segments of the segment's own blocks: the segment is one checkpoint region
# whose recompute runs them (the planner's ``Plan`` is the search's result that yields these)
Segments = Sequence[tuple[int, int, Any]]

__all__ = ["ZooModel", "chain_of", "classifier", "take_indices", "NO_RNG", "check_size",
           "check_rate"]

# zoo.checkpoint's keyword for a region that draws no random number (BatchNorm, ReLU,
# convolutions, pooling, a transformer block without active dropout): it then saves no RNG state
# for its recompute, the same model without a CPU (and CUDA) RNG state copied and put back per
# region. Wrong on a region that does draw (dropout inside): its recompute would draw anew.
NO_RNG = {"preserve_rng_state": False}

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def check_size(value: object, name: str, meaning: str) -> None:
    """Refuse an architecture size (depth, width, heads, growth) that is not an int >= 1: a zero
    builds a model of no blocks or of empty layers that trains nothing, silently, and a negative
    one fails far from its cause. ``meaning`` says what the size counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({meaning}), got {value!r}")


def check_rate(value: object, name: str) -> None:
    """Refuse a dropout or stochastic-depth rate outside [0, 1): 1 drops everything (the model
    learns nothing), a negative rate was silently no dropout at all."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a rate in [0, 1) (0: none), got {value!r}")


def classifier(num_features: int, num_classes: int) -> nn.Module:
    """A linear classifier, or ``nn.Identity`` for ``num_classes=0`` (timm: pooled features)."""
    return nn.Linear(num_features, num_classes) if num_classes else nn.Identity()


def take_indices(n: int, indices: int | Sequence[int] | None) -> list[int]:
    """timm's ``feature_take_indices``: ``None`` all ``n`` levels, an int the last ``indices``,
    a sequence those levels (negative counts from the end); sorted, each within ``0..n-1``."""
    if indices is None:
        return list(range(n))
    if isinstance(indices, int) and not isinstance(indices, bool):
        if not 0 < indices <= n:
            raise ValueError(f"indices={indices} asks for the last {indices} of {n} feature "
                             f"levels; expected 1..{n}")
        return list(range(n - indices, n))
    taken = sorted({i + n if isinstance(i, int) and i < 0 else i for i in indices})
    if not taken or any(not isinstance(i, int) or not 0 <= i < n for i in taken):
        raise ValueError(f"indices {list(indices)} out of range: this model has {n} feature "
                         f"levels (0..{n - 1}, or -{n}..-1)")
    return taken


def chain_of(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """``modules`` as a chain the planner may cut anywhere: an in-place module (``inplace=True``,
    e.g. the stem's ``nn.ReLU(inplace=True)``) is joined to the module before it
    (:func:`zoo.checkpoint.in_place_groups` says why). The joined pair is a transient
    ``nn.Sequential`` of the same modules: no parameter, buffer or state_dict key changes.
    """
    modules = list(modules)
    return [modules[g.start] if len(g) == 1 else nn.Sequential(*modules[g.start:g.stop])
            for g in in_place_groups(modules)]


class ZooModel(nn.Module):
    """Base class of the zoo's models.

    Every model has ``num_classes`` (classifier outputs), ``num_features`` (width of the features
    the head consumes), ``forward_features`` (input -> features before pooling/head),
    ``forward_head`` (features -> logits, or pooled features with ``pre_logits=True``),
    ``set_grad_checkpointing`` (timm's interface) and ``example_input`` (a small valid batch).

    Checkpointing modes: ``checkpoint_modes`` names the family's choices, the recommended one
    first. ``efficient=True`` / ``set_grad_checkpointing(True)`` picks the recommended mode, a mode
    name picks that one, ``False`` turns checkpointing off. The active mode is
    ``self.grad_checkpointing`` (``None`` when off). Modes never change parameters or buffers: the
    state_dict is the same whatever the flags.
    """

    num_classes: int
    num_features: int
    checkpoint_modes: ClassVar[tuple[str, ...]] = ()
    grad_checkpointing: str | None = None
    checkpoint_plan: Segments | None = None
    checkpoint_block_modes: Sequence[str | None] | None = None

    # -- timm's model interface ------------------------------------------------------------------
    classifier_name: ClassVar[str] = "head"  # the classifier's attribute (timm's cfg 'classifier')
    first_conv: ClassVar[str | None] = None  # the first layer's name (timm's cfg 'first_conv')
    pool_types: ClassVar[tuple[str, ...]] = ()  # global_pool values reset_classifier accepts
    global_pool: str = ""
    in_chans: int = 3

    @property
    def head_hidden_size(self) -> int:
        """Width of ``forward_head(x, pre_logits=True)`` (timm's name)."""
        return self.num_features

    def get_classifier(self) -> nn.Module:
        """The final classifier (``nn.Identity`` after ``reset_classifier(0)``)."""
        return getattr(self, self.classifier_name)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new, freshly initialised classifier for ``num_classes`` outputs; ``0`` removes it,
        so ``forward`` returns pooled features of width ``num_features`` (timm's semantics).
        ``global_pool``: ``None`` keeps the pooling; on the CNNs ``"avg"`` or ``""`` (no pooling:
        ``forward`` returns the feature maps, only with ``num_classes=0``)."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0 removes the classifier), "
                             f"got {num_classes!r}")
        pool = self.global_pool if global_pool is None else global_pool
        if pool != self.global_pool and pool not in self.pool_types:
            raise ValueError(f"{type(self).__name__} has no global_pool {global_pool!r}; expected "
                             f"None or one of {list(self.pool_types) or [self.global_pool]}")
        if pool == "" and self.pool_types and num_classes:
            raise ValueError("global_pool='' (no pooling) leaves feature maps, which a linear "
                             "classifier cannot take: pass num_classes=0 with it")
        old = self.get_classifier()
        new = classifier(self.num_features, num_classes)
        ref = next(iter(old.parameters()), None)
        ref = next(self.parameters()) if ref is None else ref
        setattr(self, self.classifier_name, new.to(device=ref.device, dtype=ref.dtype))
        self.num_classes, self.global_pool = num_classes, pool

    def data_cfg(self) -> dict:
        """The family's data settings for ``pretrained_cfg``, under timm's keys: ``input_size``,
        ``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``, ``pool_size``,
        ``fixed_input_size``. A key left out takes timm's value for "none" (``None``)."""
        return {}

    @property
    def pretrained_cfg(self) -> dict:
        """timm's ``pretrained_cfg``, every data and head key present: input size,
        normalisation, resize and crop, pooled size, classifier and first layer names,
        ``num_classes``, ``architecture`` (the registered name, for models built by
        ``zoo.create_model``); ``weights``: the torchvision weights ``pretrained=True`` loads,
        if any. timm's ``resolve_data_config`` reads it as it reads timm's own."""
        cfg = {"architecture": getattr(self, "architecture", None),
               "num_classes": self.num_classes, "classifier": self.classifier_name,
               "first_conv": self.first_conv, "weights": getattr(self, "weights_name", None),
               **dict.fromkeys(("input_size", "mean", "std", "interpolation", "crop_pct",
                                "crop_mode", "pool_size")), "fixed_input_size": False}
        return {**cfg, **self.data_cfg()}

    @property
    def default_cfg(self) -> dict:
        """timm's older name for :attr:`pretrained_cfg`."""
        return self.pretrained_cfg

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        raise NotImplementedError

    @casts_once
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def set_grad_checkpointing(self, enable: bool | str = True) -> None:
        """Turn checkpointing on (``True``: the recommended mode; or a mode name) or off (``False``)."""
        if enable is False or enable is None:
            self.grad_checkpointing = None
        elif enable is True:
            self.grad_checkpointing = self.checkpoint_modes[0]
        elif enable in self.checkpoint_modes:
            self.grad_checkpointing = enable
        else:
            raise ValueError(f"{type(self).__name__} has no checkpointing mode {enable!r}; "
                             f"expected True, False or one of {', '.join(self.checkpoint_modes)}")

    def checkpoint_chain(self) -> Sequence[nn.Module]:
        """The chain of blocks that ``forward_features`` runs one after another (each block's only
        input is the previous block's output), for the memory planner (``zoo.plan``)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose a chain of blocks")

    def set_checkpoint_plan(self, plan: Segments | None) -> None:
        """Checkpoint the chain by segments: ``[(start, stop, checkpointed), ...]`` covering
        ``range(len(self.checkpoint_chain()))`` in order. ``checkpointed`` is a bool, or a plan of
        the same form covering ``start..stop`` (block indices of the whole chain): the segment is
        then one checkpoint region whose recompute runs that inner plan, which may checkpoint
        again (multi-level: recompute inside recompute, rotor's persistent schedules). While a
        plan is set it replaces the checkpoint mode for the chain; ``None`` removes it."""
        if plan is not None:
            plan = _checked_plan(plan, 0, len(self.checkpoint_chain()), top=True)
        self.checkpoint_plan = plan

    def run_chain(self, blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
        """Run ``blocks`` (the model's chain) on ``x`` following ``checkpoint_plan`` (and
        ``checkpoint_block_modes``, when set: each block in its own intra-block mode)."""
        modes = self.checkpoint_block_modes
        if modes is not None and len(modes) == len(blocks):
            blocks = [b if m is None else partial(self.run_chain_block, b, mode=m)
                      for b, m in zip(blocks, modes)]
        return run_plan(blocks, self.checkpoint_plan, x,
                        preserve_rng_state=self.chain_draws_random_numbers())

    def chain_draws_random_numbers(self) -> bool:
        """Whether a block of :meth:`checkpoint_chain` may draw random numbers now (dropout in
        train mode): a plan's regions then save and replay the RNG state; a model whose chain
        draws none says False, and its plan's regions save none (the same model, less host work
        per region). True unless a model knows better."""
        return True

    def set_checkpoint_block_modes(self, modes: Sequence[str | None] | None) -> None:
        """Run each block of a checkpoint plan's chain in an intra-block checkpoint mode
        (``None`` for plainly), one entry per block of ``checkpoint_chain()``: the planner's
        per-block options, at every level of a nested plan (a checkpointed segment's recompute
        then checkpoints again inside each block). ``None`` removes them."""
        if modes is not None:
            modes = list(modes)
            n = len(self.checkpoint_chain())
            unknown = {m for m in modes if m is not None and m not in self.checkpoint_modes}
            if len(modes) != n or unknown:
                raise ValueError(f"block modes must be {n} entries of None or "
                                 f"{', '.join(self.checkpoint_modes)}; got {modes}")
        self.checkpoint_block_modes = modes

    def run_chain_block(self, block: Callable[..., Any], x: torch.Tensor,
                        mode: str | None = None) -> torch.Tensor:
        """One block of ``checkpoint_chain()`` in checkpoint ``mode`` (one of
        ``checkpoint_modes``, applied inside that block only). Blocks whose ``forward`` takes a
        ``mode`` get it (ResNet blocks, the CIFAR CNN's, DenseNet's layers and transitions);
        the others (stems, norms) run plainly."""
        target = block.forward if isinstance(block, nn.Module) else block
        if mode is not None and "mode" in inspect.signature(target).parameters:
            return block(x, mode=mode)
        return block(x)

    def example_input(self, batch_size: int = 2, size: int | None = None) -> torch.Tensor:
        """A random valid input batch on the model's device; ``size``: image side or sequence length."""
        raise NotImplementedError


def _checked_plan(plan: Segments, start: int, stop: int, top: bool = False) -> list:
    """``plan`` as lists of ``(int, int, bool | inner plan)``, or a one-line ValueError: its
    segments must cover ``start..stop`` in order, an inner plan its own segment."""
    out, pos = [], start
    for a, b, ck in plan:
        a, b = int(a), int(b)
        if a != pos or b <= a:
            raise ValueError(f"a plan's segments must cover {start}..{stop} in order without gaps, "
                             f"got {list(plan)}")
        if isinstance(ck, (list, tuple)):
            ck = _checked_plan(ck, a, b)
        out.append((a, b, ck if isinstance(ck, list) or ck == OFFLOAD else bool(ck)))
        pos = b
    if pos != stop:
        where = "the chain has" if top else "its segment ends at"
        raise ValueError(f"the plan covers blocks {start}..{pos}, {where} {stop}")
    return out
