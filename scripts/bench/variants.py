"""The variants a benchmark compares, all built from the same weights.

* ``plain``: the zoo model without checkpointing (the baseline every ratio is taken against).
* ``official``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` the way torchvision
  and timm apply it, with their plain ``nn.BatchNorm2d`` (so BatchNorm statistics are updated
  twice per step, pytorch/pytorch#96136). For DenseNet-B models it *is* torchvision's
  ``DenseNet(memory_efficient=True)`` (the "Official" column of csrhddlam/pytorch-checkpoint:
  each layer's concat-BN-ReLU-conv1x1 checkpointed); for every other model each repeated block of the model's
  chain (ResNet bottlenecks, transformer layers, dense blocks and transitions) is checkpointed on
  its own, as timm's ``checkpoint_seq`` does, the stem and the head left alone.
* ``zoo <mode>``: the zoo model with ``set_grad_checkpointing(mode)``, for each of its
  ``checkpoint_modes`` (the first is what ``efficient=True`` picks).

Asked for by name only (not in the defaults, see :func:`extra_variant_names`):

* ``compiled plain`` and ``compiled zoo <mode>``: a copy of the model in that mode under
  ``torch.compile(fullgraph=True, dynamic=False)``: one graph for forward and backward.
* ``timm`` (DenseNet-B models): timm's ``DenseNet`` with the model's architecture and state and
  ``set_grad_checkpointing(True)``, which checkpoints each layer's concat-BN-ReLU-conv1x1 with
  torch's checkpoint, as torchvision's ``memory_efficient=True`` does.
* ``offload``: the model's whole chain in one ``zoo.offload`` region (its saved tensors in host
  memory between forward and backward, nothing recomputed): on a CUDA device, or predicted for a
  card (``zoo.memory.predict_step`` moves them off the card); on a CPU it changes nothing.
"""
from __future__ import annotations

import copy
import types
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.checkpoint import run_blocks
from zoo.models import ZooModel
from zoo.models.densenet import DenseBlock, DenseNet
from zoo.nn import restore_batchnorm

__all__ = ["PLAIN", "OFFICIAL", "COMPILED_PREFIX", "GRAPHED_PREFIX", "TIMM", "OFFLOAD", "Variant",
           "create", "variant_names", "extra_variant_names", "canonical_name", "build_variants",
           "build_variant", "compiled_variant", "timm_densenet"]

PLAIN = "plain"
OFFICIAL = "official"
ZOO_PREFIX = "zoo "
COMPILED_PREFIX = "compiled "
GRAPHED_PREFIX = "graphed "  # torch.compile(mode="reduce-overhead"): CUDA graph trees
TIMM = "timm"
OFFLOAD = "offload"


@dataclass
class Variant:
    """One compared way of training a model: ``model`` in the checkpoint ``mode`` it needs."""

    name: str
    model: nn.Module
    mode: bool | str  # what set_grad_checkpointing gets before each step (zoo models only)
    description: str
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None  # None: ``model`` itself

    def prepare(self) -> None:
        """Put ``model`` in this variant's checkpoint mode (variants may share one model)."""
        if self.forward is not None:  # a compiled copy: its mode is fixed, a change would
            return                    # invalidate the compiled graph
        if isinstance(self.model, ZooModel) and self.model.checkpoint_plan is None:
            self.model.set_grad_checkpointing(self.mode)


def create(model: str | Callable[..., ZooModel], **kwargs: Any) -> ZooModel:
    """``zoo.create_model(model, **kwargs)``, or ``model(**kwargs)`` for a constructor (a model
    built to measure that is not in the registry, e.g. a shrunk DenseNet-BC for a smoke run)."""
    return model(**kwargs) if callable(model) else zoo.create_model(model, **kwargs)


def variant_names(model: ZooModel) -> list[str]:
    """``plain``, ``official``, then ``zoo <mode>`` for each of the model's checkpoint modes."""
    return [PLAIN, OFFICIAL, *(ZOO_PREFIX + m for m in model.checkpoint_modes)]


def extra_variant_names(model: ZooModel) -> list[str]:
    """The variants built only when named: compiled ones, ``offload``, and ``timm`` for
    DenseNet-B models."""
    names = [prefix + name for prefix in (COMPILED_PREFIX, GRAPHED_PREFIX)
             for name in (PLAIN, *(ZOO_PREFIX + m for m in model.checkpoint_modes))]
    names.append(OFFLOAD)
    if isinstance(model, DenseNet) and _is_densenet_b(model):
        names.append(TIMM)
    return names


def canonical_name(model: ZooModel, name: str) -> str:
    """Accept command-line spellings: ``zoo_layer`` or a bare mode ``layer`` -> ``zoo layer``;
    ``compiled_plain``, ``compiled_layer`` or ``compiled_zoo_layer`` -> ``compiled zoo layer``."""
    name = name.strip()
    if name.startswith(("compiled_", COMPILED_PREFIX)):
        return COMPILED_PREFIX + canonical_name(model, name[len(COMPILED_PREFIX):])
    if name.startswith(("graphed_", GRAPHED_PREFIX)):
        return GRAPHED_PREFIX + canonical_name(model, name[len(GRAPHED_PREFIX):])
    if name.startswith("zoo_"):
        name = ZOO_PREFIX + name[4:]
    return ZOO_PREFIX + name if name in model.checkpoint_modes else name


def _check_names(model: ZooModel, names: Sequence[str]) -> None:
    names = [canonical_name(model, n) for n in names]
    known = variant_names(model) + extra_variant_names(model)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(map(repr, unknown))} for "
                         f"{type(model).__name__}; expected some of {', '.join(known)}")


def build_variants(model: ZooModel, names: Sequence[str] | None = None,
                   compile_backend: str = "inductor") -> list[Variant]:
    """The variants ``names`` (default: all) of ``model``, which must not be checkpointed.

    The zoo variants share ``model`` itself (``prepare`` switches the mode); ``official`` is a
    second model loaded with ``model``'s state_dict, so every variant starts from the same weights
    and BatchNorm buffers.
    """
    names = [canonical_name(model, n) for n in names] if names is not None \
        else variant_names(model)
    _check_names(model, names)
    return [build_variant(model, name, compile_backend=compile_backend) for name in names]


def build_variant(model: ZooModel, name: str, reuse: bool = False,
                  compile_backend: str = "inductor") -> Variant:
    """One variant of ``model`` (see the module docstring). ``official`` builds a second model
    with the same state, or with ``reuse=True`` turns ``model`` itself into it (under
    ``FakeTensorMode``, where models cannot be deep-copied). Compiled variants compile with
    ``compile_backend`` on their first call."""
    name = canonical_name(model, name)
    _check_names(model, [name])
    if name.startswith(COMPILED_PREFIX):
        return compiled_variant(model, name[len(COMPILED_PREFIX):], compile_backend)
    if name.startswith(GRAPHED_PREFIX):
        return compiled_variant(model, name[len(GRAPHED_PREFIX):], compile_backend,
                                graphs=True)
    if name == TIMM:
        return Variant(TIMM, timm_densenet(model), False, "timm DenseNet, set_grad_checkpointing"
                       "(True) (torch's checkpoint per layer's bottleneck), same weights")
    if name == PLAIN:
        return Variant(PLAIN, model, False, "no checkpointing")
    if name == OFFLOAD:
        twin = model if reuse else copy.deepcopy(model)
        twin.set_checkpoint_plan([(0, len(twin.checkpoint_chain()), "offload")])
        return Variant(OFFLOAD, twin, False, "zoo.offload of the whole chain: saved tensors in "
                       "host memory, prefetched back (a CUDA card's, not a CPU's)")
    if name.startswith(ZOO_PREFIX):
        mode = name[len(ZOO_PREFIX):]
        note = " (efficient=True)" if mode == model.checkpoint_modes[0] else ""
        return Variant(name, model, mode, f"zoo.checkpoint, mode {mode!r}{note}")
    if isinstance(model, DenseNet) and _is_densenet_b(model):
        twin = torchvision_densenet(model)
        return Variant(OFFICIAL, twin, False,
                       "torchvision DenseNet(memory_efficient=True), same weights")
    twin = model if reuse else copy.deepcopy(model)
    _to_plain_batchnorm(twin)
    blocks = checkpoint_blocks(twin)
    twin.set_checkpoint_plan(_plan(len(twin.checkpoint_chain()), blocks))
    twin.run_chain = types.MethodType(_torch_run_chain, twin)  # torch's checkpoint, not the zoo's
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in twin.modules())
    return Variant(OFFICIAL, twin, False, f"torch.utils.checkpoint(use_reentrant=False) on each of "
                   f"{len(blocks)} repeated chain blocks (timm's checkpoint_seq)"
                   + (", torch's BatchNorm" if has_bn else ""))


def compiled_variant(model: ZooModel, name: str, backend: str = "inductor",
                     graphs: bool = False) -> Variant:
    """A copy of ``model`` in the mode of the variant ``name`` (``plain`` or ``zoo <mode>``),
    compiled whole: ``torch.compile(fullgraph=True, dynamic=False)``, so a graph break is an
    error (reported by the benchmark as the variant's failure) rather than a silent eager run.
    ``graphs``: with ``mode="reduce-overhead"`` (inductor's CUDA graph trees: the host launches
    one graph per step; on a CPU, or with another backend, it compiles as without)."""
    twin = copy.deepcopy(model)
    mode = False if name == PLAIN else name[len(ZOO_PREFIX):]
    twin.set_grad_checkpointing(mode)
    how = {"mode": "reduce-overhead"} if graphs and backend == "inductor" \
        else {"backend": backend}
    forward = torch.compile(twin, fullgraph=True, dynamic=False, **how)
    prefix = GRAPHED_PREFIX if graphs else COMPILED_PREFIX
    what = ", ".join(f"{k}={v!r}" for k, v in how.items())
    return Variant(prefix + name, twin, mode, f"torch.compile(fullgraph=True, {what}) of the "
                   f"model, {'no checkpointing' if not mode else repr(mode)}", forward=forward)


# -- official: torch's checkpoint on the repeated blocks of the chain ---------------------------
def checkpoint_blocks(model: ZooModel) -> list[int]:
    """Indices of the chain's repeated blocks: those whose type occurs more than once (ResNet
    bottlenecks, transformer layers, dense blocks, transitions), the ones timm checkpoints."""
    chain = model.checkpoint_chain()
    counts = Counter(type(b) for b in chain)
    return [i for i, b in enumerate(chain) if counts[type(b)] > 1]


def _plan(n: int, checkpointed: Sequence[int]) -> list[tuple[int, int, bool]]:
    return [(i, i + 1, i in set(checkpointed)) for i in range(n)]


def _torch_run_chain(self: ZooModel, blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``ZooModel.run_chain`` with ``torch.utils.checkpoint`` in place of ``zoo.checkpoint``."""
    for start, stop, checkpointed in self.checkpoint_plan:
        part = blocks[start:stop]
        x = (torch_checkpoint.checkpoint(run_blocks, part, x, use_reentrant=False)
             if checkpointed else run_blocks(part, x))
    return x


def _to_plain_batchnorm(module: nn.Module) -> None:
    """Turn the zoo's recompute-safe BatchNorm layers back into their plain classes (same state):
    what torchvision and timm models have, and what torch's checkpoint updates twice."""
    restore_batchnorm(module)


# -- official for DenseNet-B: torchvision's memory_efficient DenseNet ----------------------------
def _is_densenet_b(model: DenseNet) -> bool:
    return all(layer.bottleneck for b in model.features.children() if isinstance(b, DenseBlock)
               for layer in b.values())


def _densenet_shape(model: DenseNet) -> tuple[list[DenseBlock], nn.Module, int, nn.Conv2d]:
    """What a twin of ``model`` is built from: its dense blocks, first layer, growth rate, stem."""
    blocks = [b for b in model.features.children() if isinstance(b, DenseBlock)]
    first = blocks[0]["denselayer1"]
    return blocks, first, first.conv2.out_channels, model.features.conv0


def torchvision_densenet(model: DenseNet) -> nn.Module:
    """torchvision's ``DenseNet(memory_efficient=True)`` with ``model``'s architecture and state
    (the CIFAR stem, one 3x3 convolution, replaces torchvision's ImageNet stem)."""
    from torchvision.models.densenet import DenseNet as TorchvisionDenseNet

    blocks, first, growth, conv0 = _densenet_shape(model)
    with torch.device(conv0.weight.device):  # built in place: .to() cannot move fake tensors
        twin = TorchvisionDenseNet(
            growth_rate=growth, block_config=tuple(len(b) for b in blocks),
            num_init_features=conv0.out_channels, bn_size=first.conv1.out_channels // growth,
            drop_rate=first.drop_rate, num_classes=model.num_classes, memory_efficient=True)
        if model.stem == "cifar":
            twin.features.conv0 = nn.Conv2d(3, conv0.out_channels, 3, padding=1, bias=False)
            for name in ("norm0", "relu0", "pool0"):
                setattr(twin.features, name, nn.Identity())
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin.train(model.training)


def timm_densenet(model: DenseNet) -> nn.Module:
    """timm's ``DenseNet`` with ``model``'s architecture and state, ``set_grad_checkpointing(True)``
    (the CIFAR stem, one 3x3 convolution, replaces timm's ImageNet stem)."""
    from timm.models.densenet import DenseNet as TimmDenseNet

    blocks, first, growth, conv0 = _densenet_shape(model)
    if conv0.out_channels != 2 * growth:  # timm's stem width is always twice the growth rate
        raise ValueError(f"timm's DenseNet has 2 x growth = {2 * growth} stem channels, this model "
                         f"{conv0.out_channels}: no timm twin")
    # dropout inside the layers only when the model has it (older timm may lack the keyword)
    drop = {"proj_drop_rate": first.drop_rate} if first.drop_rate else {}
    with torch.device(conv0.weight.device):
        twin = TimmDenseNet(growth_rate=growth, block_config=tuple(len(b) for b in blocks),
                            num_classes=model.num_classes,
                            bn_size=first.conv1.out_channels // growth, **drop)
        if model.stem == "cifar":
            twin.features.conv0 = nn.Conv2d(3, conv0.out_channels, 3, padding=1, bias=False)
            twin.features.norm0 = nn.Identity()
            twin.features.pool0 = nn.Identity()
    twin.load_state_dict(model.state_dict(), strict=True)
    twin.set_grad_checkpointing(True)
    return twin.train(model.training)
