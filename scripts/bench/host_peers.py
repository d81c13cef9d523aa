"""What the host-cost benchmark compares (:mod:`.host_cost`), each as an :class:`Entry` whose step
is one training step on the chosen device.

* :func:`zoo_entries`: a zoo model plain and in each checkpoint mode, beside its peers: torch's
  checkpoint on the same blocks (torchvision's ``memory_efficient=True`` for DenseNet-B), timm's
  ``set_grad_checkpointing`` where timm has the architecture, Hugging Face BERT with its own
  gradient checkpointing for ``bert_base``. Twins of the same architecture start from the zoo
  model's weights; timm's and Hugging Face's own models get their own plain row.
* :func:`chain_entries`: :mod:`.region_chain`'s chain of tiny Linear + ReLU regions (batch 1),
  where a step is almost only the checkpoint's own work per region: plain, torch's non-reentrant
  checkpoint, the zoo's.
* :func:`outside_entries`: models from outside the zoo (timm ResNet-50, torchvision DenseNet-121,
  Hugging Face BERT) plain, under their library's own checkpointing (torch's checkpoint), and
  under ``zoo.set_grad_checkpointing``.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import zoo
from zoo.models.densenet import DenseNet

from zoo.memory import train_step

from . import variants
from .host_cost import Entry
from .region_chain import BATCH, REGIONS, WIDTH, chain_input, make_chain, with_checkpoint

__all__ = ["zoo_entries", "chain_entries", "outside_entries", "TIMM_TWINS"]

# zoo models whose architecture timm builds under the same name (timm's own weights, own plain row)
TIMM_TWINS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "densenet121",
              "densenet169", "densenet201", "vit_small_patch16_224", "vit_base_patch16_224")


def _entry(name: str, group: str, model: nn.Module, x: torch.Tensor, note: str,
           floor: bool = False) -> Entry:
    return Entry(name, group, model, train_step(model, x), note, floor)


def zoo_entries(name: str, batch_size: int, size: int | None = None, device: str = "meta",
                modes: Sequence[str] | None = None, peers: bool = True,
                seed: int = 0) -> list[Entry]:
    """``plain`` and ``zoo <mode>`` for each of ``modes`` (default: all the model's), then the
    peers. Built on the CPU from ``seed`` and moved to ``device``; on ``meta`` without peers,
    built there (no weights to draw: only ops and host time are measured)."""
    torch.manual_seed(seed)
    with torch.device("meta" if device == "meta" and not peers else "cpu"):
        model = zoo.create_model(name)
        x = model.example_input(batch_size, size)
    modes = list(model.checkpoint_modes if modes is None else modes)
    entries = [_entry("plain", "plain", copy.deepcopy(model).to(device), x.to(device),
                      "no checkpointing")]
    for mode in modes:
        twin = copy.deepcopy(model).to(device)
        twin.set_grad_checkpointing(mode)
        note = "zoo.checkpoint" + (", efficient=True" if mode == model.checkpoint_modes[0] else "")
        entries.append(_entry(f"zoo {mode}", "plain", twin, x.to(device), note, floor=True))
    if peers:
        entries += _peer_entries(name, model, x, size, device)
    return entries


def _peer_entries(name: str, model: zoo.models.ZooModel, x: torch.Tensor, size: int | None,
                  device: str) -> list[Entry]:
    official = variants.build_variant(copy.deepcopy(model), variants.OFFICIAL)
    tv = isinstance(model, DenseNet) and variants._is_densenet_b(model)
    entries = [_entry("torchvision memory_efficient" if tv else "torch checkpoint", "plain",
                      official.model.to(device), x.to(device), official.description)]
    if isinstance(model, DenseNet) and model.stem == "cifar" and tv:
        twin = variants.timm_densenet(model)
        entries.append(_entry("timm set_grad_checkpointing", "plain", twin.to(device),
                              x.to(device), "timm DenseNet, same weights"))
    elif name in TIMM_TWINS:
        entries += _timm_entries(name, x, size, device)
    elif name == "bert_base":
        entries += _hf_bert_entries(x, device)
    return entries


def _timm_entries(name: str, x: torch.Tensor, size: int | None, device: str) -> list[Entry]:
    import timm

    kwargs = {"img_size": x.shape[-1]} if name.startswith("vit") else {}
    plain = timm.create_model(name, pretrained=False, **kwargs)
    checkpointed = copy.deepcopy(plain)
    checkpointed.set_grad_checkpointing(True)
    return [_entry("timm plain", "timm plain", plain.to(device), x.to(device), "timm's model"),
            _entry("timm set_grad_checkpointing", "timm plain", checkpointed.to(device),
                   x.to(device), "timm's switch (torch's checkpoint)")]


def hf_bert(layers: int = 12, width: int = 768, heads: int = 12) -> nn.Module:
    """Hugging Face's ``BertModel`` in BERT-base's configuration (``layers`` etc. shrink it)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                        intermediate_size=4 * width)
    return BertModel(config)


def _hf_enable(model: nn.Module) -> None:
    """Hugging Face's own switch (``activation_checkpointing_enable`` in newer versions)."""
    enable = getattr(model, "activation_checkpointing_enable", None) \
        or model.gradient_checkpointing_enable
    enable()


def _hf_bert_entries(ids: torch.Tensor, device: str) -> list[Entry]:
    plain = hf_bert()
    checkpointed = copy.deepcopy(plain)
    _hf_enable(checkpointed)
    return [_entry("HF plain", "HF plain", plain.to(device), ids.to(device),
                   "transformers BertModel"),
            _entry("HF gradient_checkpointing", "HF plain", checkpointed.to(device),
                   ids.to(device), "its own gradient checkpointing (torch's checkpoint)")]


# --------------------------------------------------------------------------------------------
# The chain of tiny regions.
# --------------------------------------------------------------------------------------------
def chain_entries(regions: int = REGIONS, width: int = WIDTH, batch_size: int = BATCH,
                  device: str = "meta", seed: int = 0) -> list[Entry]:
    """The chain of Linear + ReLU regions plain, under torch's non-reentrant checkpoint and under
    zoo.checkpoint."""
    plain = make_chain(regions, width, block="linear", seed=seed)
    x = chain_input("linear", batch_size, width, requires_grad=False)
    entries = [_entry("plain", "plain", plain.to(device), x.to(device), "no checkpointing")]
    for name, checkpoint in (("torch checkpoint", "torch non-reentrant"),
                             ("zoo", "zoo.checkpoint")):
        twin = with_checkpoint(plain, checkpoint)
        entries.append(_entry(name, "plain", twin, x.to(device),
                              f"{name}, one region per block", floor=name == "zoo"))
    return entries


# --------------------------------------------------------------------------------------------
# Models from outside the zoo.
# --------------------------------------------------------------------------------------------
def _outside_model(which: str, small: bool = False
                   ) -> tuple[nn.Module, torch.Tensor, Callable[[nn.Module], Any]]:
    """(plain model, input, its library's own switch) for ``which``; ``small``: a shrunk one of
    the same family (one block per stage, two dense or transformer layers, narrow)."""
    if which == "timm resnet50":
        from timm.models.resnet import Bottleneck, ResNet
        model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10) if small else ResNet(
            Bottleneck, [3, 4, 6, 3])
        return model, torch.randn(4, 3, 64, 64), lambda m: m.set_grad_checkpointing(True)
    if which == "torchvision densenet121":
        from torchvision.models import DenseNet

        def own(m: nn.Module) -> None:
            for layer in m.modules():
                if hasattr(layer, "memory_efficient"):
                    layer.memory_efficient = True
        model = DenseNet(8, (2, 2), 16, num_classes=10) if small else DenseNet(32, (6, 12, 24, 16))
        return model, torch.randn(2, 3, 64, 64), own
    if which == "HF bert":
        model = hf_bert(2, 32, 2) if small else hf_bert()
        return model, torch.randint(0, 1000, (2, 16)), _hf_enable
    raise ValueError(f"unknown outside model {which!r}; expected one of {OUTSIDE}")


OUTSIDE = ("timm resnet50", "torchvision densenet121", "HF bert")


def outside_entries(models: Sequence[str] = OUTSIDE, device: str = "meta", seed: int = 0,
                    small: bool = False) -> list[Entry]:
    """For each model: plain, its library's own checkpointing, zoo.set_grad_checkpointing."""
    entries = []
    for which in models:
        torch.manual_seed(seed)
        plain, x, own = _outside_model(which, small)
        mine, theirs = copy.deepcopy(plain), copy.deepcopy(plain)
        own(theirs)
        zoo.set_grad_checkpointing(mine)
        x = x.to(device)
        entries += [_entry(which, which, plain.to(device), x, "plain"),
                    _entry(f"{which}: own", which, theirs.to(device), x,
                           "the library's own switch (torch's checkpoint)"),
                    _entry(f"{which}: zoo", which, mine.to(device), x,
                           "zoo.set_grad_checkpointing", floor=True)]
    return entries
