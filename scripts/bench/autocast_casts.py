"""``autocast``: checkpointed training steps in bf16 autocast, zoo's beside timm's and HF's.

Autocast keeps each parameter's bf16 copy in its cache until the autocast block exits. timm's
checkpoint (``torch.utils.checkpoint``) runs each block under that cache, so the copies of every
checkpointed block's weights, which the block saves for nothing (its recompute casts again), stay
alive until the forward ends; a zoo model casts each parameter without the cache
(``zoo.checkpoint.casts.casts_once``), each copy alive while an op or a saved tensor needs it. The
forward's end is the step's peak where gradients are already held: the second micro-batch of
gradient accumulation. A model outside the zoo gets the same with
``zoo.set_grad_checkpointing(model, casts_once=True)`` (:mod:`zoo.checkpoint.casts`), measured here
on timm's ViT-S and Hugging Face's BERT-base beside their own checkpointing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import zoo
from zoo.memory.step import peak_bytes

from .peers import write_json

__all__ = ["autocast"]

MiB = 2**20


def _step(model: nn.Module, x: torch.Tensor, accumulate: bool) -> Callable[[], None]:
    """One training step in bf16 autocast (the forward and a mean-of-squares loss under it;
    token ids for a Hugging Face model, its last hidden state the output); ``accumulate``: onto
    the gradients already held, else onto none."""
    def step() -> None:
        if not accumulate:
            model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _output(model, x).float().square().mean()  # the output freed once cast
        loss.backward()
    return step


def _output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) if x.is_floating_point() else model(input_ids=x).last_hidden_state


def _peak(model: nn.Module, x: torch.Tensor, accumulate: bool) -> int:
    """Peak bytes of the step after one like it (gradients made), the model counted."""
    model.zero_grad(set_to_none=True)
    step = _step(model, x, accumulate)
    step()
    try:
        return peak_bytes(step, [model])
    finally:
        model.zero_grad(set_to_none=True)


def autocast(batch: int = 8, tokens: int = 128, json_out: str | None = None) -> list[dict]:
    """Checkpointed steps in bf16 autocast: zoo's ViT-S beside timm's, then outside models.

    ViT-S/16, zoo's and timm's peaks, plain and checkpointed; then timm's ViT-S and HF's
    BERT-base (``tokens`` per sequence) through their own checkpointing and
    ``zoo.set_grad_checkpointing``, with and without ``casts_once`` (module doc).

    The same weights in both, real tensors on this CPU, exact bytes
    (:func:`zoo.memory.step.peak_bytes`: without MemTracker's module hooks), each step measured
    after one like it: with its gradients made fresh and accumulating onto the last step's.
    """
    import timm

    torch.manual_seed(0)
    ours = {"plain": zoo.create_model("vit_small_patch16_224")}
    ours["block"] = zoo.create_model("vit_small_patch16_224", efficient="block")
    ours["block"].load_state_dict(ours["plain"].state_dict())
    peer = timm.create_model("vit_small_patch16_224", pretrained=False)
    peer.load_state_dict(ours["plain"].state_dict())
    x = torch.randn(batch, 3, 224, 224)
    rows = []
    for accumulate in (False, True):
        grads = "accumulating" if accumulate else "fresh"
        for checkpointed, variant in ((False, "plain"), (True, "block")):
            peer.set_grad_checkpointing(checkpointed)
            theirs = _peak(peer, x, accumulate)
            zoos = _peak(ours[variant], x, accumulate)
            rows.append({"workload": f"vit_small_patch16_224 batch {batch} 224px bf16",
                         "gradients": grads, "variant": variant, "zoo_peak_bytes": zoos,
                         "timm_peak_bytes": theirs, "ratio": zoos / theirs})
    _print(rows)
    own = _own_models(peer, x, tokens)
    write_json(json_out, rows + own)
    return rows + own


def _own_models(vit: nn.Module, images: torch.Tensor, tokens: int) -> list[dict]:
    """timm's ViT-S and HF's BERT-base, each checkpointed three ways: its own switch (torch's
    checkpoint), ``zoo.set_grad_checkpointing``, and that with ``casts_once=True``."""
    import transformers

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig())
    ids = torch.randint(0, bert.config.vocab_size, (images.shape[0], tokens))
    hf_switch = getattr(bert, "activation_checkpointing_enable", None) or \
        bert.gradient_checkpointing_enable  # its name before transformers 5
    own = {"timm": lambda: vit.set_grad_checkpointing(True),
           "HF": lambda: hf_switch({"use_reentrant": False})}
    rows = []
    for family, model, x, workload in (
            ("timm", vit, images, f"timm vit_small_patch16_224 batch {images.shape[0]} 224px"),
            ("HF", bert, ids, f"HF BERT-base batch {ids.shape[0]} x {tokens} tokens")):
        for accumulate in (False, True):
            zoo.set_grad_checkpointing(model, enable=False)
            own[family]()
            peaks = [_peak(model, x, accumulate)]
            for casts_once in (False, True):
                zoo.set_grad_checkpointing(model, casts_once=casts_once)
                peaks.append(_peak(model, x, accumulate))
            rows.append({"workload": f"{workload} bf16", "variant": f"{family}'s own switch",
                         "gradients": "accumulating" if accumulate else "fresh",
                         "own_peak_bytes": peaks[0], "zoo_peak_bytes": peaks[1],
                         "casts_once_peak_bytes": peaks[2], "ratio": peaks[2] / peaks[0]})
    _print_own(rows)
    return rows


def _print(rows: list[dict]) -> None:
    print(f"torch {torch.__version__}, CPU, real tensors; zoo's peak against timm's "
          f"(timm's checkpointed variant: set_grad_checkpointing(True))\n")
    print("| workload | gradients | variant | zoo peak MiB | timm peak MiB | zoo / timm |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['gradients']} | {r['variant']} | "
              f"{r['zoo_peak_bytes'] / MiB:.1f} | {r['timm_peak_bytes'] / MiB:.1f} | "
              f"{r['ratio']:.3f} |")


def _print_own(rows: list[dict]) -> None:
    print("\nmodels outside the zoo, checkpointed: their own switch (torch.utils.checkpoint), "
          "zoo.set_grad_checkpointing, and that with casts_once=True\n")
    print("| workload | gradients | own switch MiB | zoo MiB | zoo casts_once MiB | "
          "casts_once / own |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['gradients']} | {r['own_peak_bytes'] / MiB:.1f} | "
              f"{r['zoo_peak_bytes'] / MiB:.1f} | {r['casts_once_peak_bytes'] / MiB:.1f} | "
              f"{r['ratio']:.3f} |")
