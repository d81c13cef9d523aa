"""Peak memory and FLOPs of one ResNet training step, plain against each checkpoint mode and timm.

    python scripts/bench_resnet.py          # exact CPU figures (MemTracker, FlopCounterMode)
    python scripts/bench_resnet.py --fake   # same bytes and FLOPs without running kernels

One step = forward, ``square().mean()`` loss, backward, in train mode, from fresh gradients; the
model's parameters count towards the peak (``track``), as they would on a GPU. Workloads:

* ResNet-50, batch 8 at 224x224, beside timm's resnet50 with ``set_grad_checkpointing(True)``
  measured in the same run. Goal: the recommended mode's peak *and* FLOPs each at most timm's.
* ResNet-110 (CIFAR), batch 64 at 32x32.
* seed 004's CIFAR CNN (``cifar_cnn``), batch 64 at 32x32.

Every checkpoint mode is measured, and the ``block`` mode also with ``checkpoint_every`` 2 and 3.
Prints a Markdown table and whether each goal is met; ``--json_out`` writes the rows as JSON.
"""
from __future__ import annotations

import fire

from zoo.bench.peers import (add_rows, print_goals, print_table, timm_checkpointing, write_json,
                             zoo_modes)
from zoo.models.resnet import ResNet


def main(imagenet_batch: int = 8, imagenet_size: int = 224, cifar_batch: int = 64,
         fake: bool = False, json_out: str | None = None) -> list[dict]:
    """Measure the workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []
    r50 = zoo_modes("resnet50", imagenet_batch, imagenet_size, fake, every=(2, 3))
    timm_r50 = timm_checkpointing("resnet50", imagenet_batch, imagenet_size, fake)
    workload = f"resnet50 batch {imagenet_batch} {imagenet_size}px"
    add_rows(rows, workload, r50, r50["plain"])
    add_rows(rows, workload, timm_r50, r50["plain"])
    r110 = zoo_modes("resnet110", cifar_batch, 32, fake, every=(2, 3))
    add_rows(rows, f"resnet110 batch {cifar_batch} 32px", r110, r110["plain"])
    cnn = zoo_modes("cifar_cnn", cifar_batch, 32, fake)
    add_rows(rows, f"cifar_cnn batch {cifar_batch} 32px", cnn, cnn["plain"])
    print_table(rows, "FakeTensorMode" if fake else "real tensors")

    recommended = ResNet.checkpoint_modes[0]
    ours, theirs = r50[recommended], timm_r50["timm set_grad_checkpointing"]
    print_goals([(f"resnet50 {recommended} peak <= timm's (x timm)", ours[0] / theirs[0], 1.0),
                 (f"resnet50 {recommended} FLOPs <= timm's (x timm)", ours[1] / theirs[1], 1.0)])
    write_json(json_out, rows, fake=fake)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
