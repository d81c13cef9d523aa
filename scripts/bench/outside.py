"""Outside models (``outside``): peak memory, FLOPs and BatchNorm counting of one training step,
plain, with their family's own checkpointing (torch's checkpoint underneath), and with
zoo.set_grad_checkpointing.

    python scripts/benchmark.py outside     # exact CPU figures (MemTracker, FlopCounterMode)

One step = ``zoo.memory.train_step``'s (forward, ``square().mean()`` loss, backward, in train
mode, from fresh gradients); the parameters count towards the peak. "BN counts" is the largest ``num_batches_tracked`` after one
step from a fresh copy: 1 is exact, 2 is the double update of pytorch/pytorch#96136.

* torchvision resnet50 (no switch of its own) and densenet121 (``memory_efficient=True``),
* timm resnet50, efficientnet_b0, vit_small_patch16_224 (``set_grad_checkpointing(True)``),
* Hugging Face BERT-base from its default config (``gradient_checkpointing_enable()``),
  when transformers is installed.
"""
from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
from torch import nn

import zoo
from zoo.memory import bn_count, bn_state, step_cost, train_step

from .peers import add_rows, print_table, write_json

__all__ = ["LastHidden", "bn_counts", "measure", "own_and_zoo", "outside"]


class LastHidden(nn.Module):
    """A Hugging Face encoder as a tensor -> tensor module (its last hidden state)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).last_hidden_state


def bn_counts(model: nn.Module, x: torch.Tensor) -> int:
    """Largest num_batches_tracked after one training step of a fresh copy (0: no BatchNorm)."""
    model = copy.deepcopy(model)
    train_step(model, x)()
    return bn_count(bn_state(model))


def measure(rows: list[dict], workload: str, variants: dict[str, nn.Module],
            x: torch.Tensor) -> None:
    """One row per variant: peak, FLOPs (ratios to plain) and BatchNorm counts per step."""
    counts = [bn_counts(model, x) for model in variants.values()]  # before any step is taken
    results = {name: step_cost(model, x) for name, model in variants.items()}
    first = len(rows)
    add_rows(rows, workload, results, results["plain"])
    for row, count in zip(rows[first:], counts):
        row["bn_counts"] = count


def own_and_zoo(build: Callable[[], nn.Module], own: Callable[[nn.Module], object] | None,
                wrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> dict[str, nn.Module]:
    """plain / the family's own checkpointing / zoo.set_grad_checkpointing, equal weights."""
    torch.manual_seed(0)
    plain = build()
    variants = {"plain": wrap(plain)}
    if own is not None:
        theirs = copy.deepcopy(plain)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            own(theirs)
        variants["own switch (torch's checkpoint)"] = wrap(theirs)
    variants["zoo.set_grad_checkpointing"] = wrap(zoo.set_grad_checkpointing(copy.deepcopy(plain)))
    return variants


def outside(batch_size: int = 4, size: int = 160, tokens: int = 128,
            json_out: str | None = None) -> list[dict]:
    """torchvision, timm, Hugging Face models: their own checkpointing and the zoo's.

    Per model: plain, the family's own switch (torch's checkpoint underneath) and
    zoo.set_grad_checkpointing: peak, FLOPs (ratios to plain) and the BatchNorm count one step
    leaves (1 exact, 2 counted twice). Images batch 4 at 160x160 by default, BERT batch 4 x 128
    tokens: small enough for a shared CPU. Prints Markdown tables; ``--json_out`` writes JSON.
    """
    import timm
    import torchvision

    rows: list[dict] = []
    images = torch.randn(batch_size, 3, size, size)
    shape = f"batch {batch_size} {size}px"
    measure(rows, f"torchvision resnet50 {shape}",
            own_and_zoo(torchvision.models.resnet50, None), images)
    torch.manual_seed(0)
    plain = torchvision.models.densenet121()
    efficient = torchvision.models.densenet121(memory_efficient=True)
    efficient.load_state_dict(plain.state_dict())
    measure(rows, f"torchvision densenet121 {shape}",
            {"plain": plain, "own switch (torch's checkpoint)": efficient,
             "zoo.set_grad_checkpointing": zoo.set_grad_checkpointing(copy.deepcopy(plain))},
            images)
    for name in ("resnet50", "efficientnet_b0", "vit_small_patch16_224"):
        kwargs = {"img_size": size} if name.startswith("vit") else {}
        measure(rows, f"timm {name} {shape}",
                own_and_zoo(lambda: timm.create_model(name, **kwargs),
                            lambda m: m.set_grad_checkpointing(True)), images)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: BERT skipped")
    else:
        ids = torch.randint(0, 30522, (batch_size, tokens))
        measure(rows, f"HF BERT-base batch {batch_size} x {tokens} tokens",
                own_and_zoo(lambda: transformers.BertModel(transformers.BertConfig()),
                            lambda m: m.gradient_checkpointing_enable(), wrap=LastHidden), ids)
    print_table(rows, "outside models, real tensors")
    print("\n| workload | variant | BN counts per step |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['bn_counts']} |")
    write_json(json_out, rows)
    return rows
