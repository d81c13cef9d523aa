"""Peak memory and FLOPs of one DenseNet training step, plain against each checkpoint mode.

    python scripts/bench_densenet.py                 # exact CPU figures (MemTracker, FlopCounterMode)
    python scripts/bench_densenet.py --fake          # same bytes and FLOPs without running kernels

One step = forward, ``square().mean()`` loss, backward, in train mode, from fresh gradients; the
model's parameters count towards the peak (``track``), as they would on a GPU. Two workloads:

* DenseNet-BC-100 (k=12), batch 32 at 32x32: the Pleiss et al. 2017 setting. Goals: the
  ``bottleneck`` mode at <= 0.40x the plain peak for <= 2% extra FLOPs; ``layer`` at <= 0.20x.
* DenseNet-121, batch 8 at 224x224, beside timm's densenet121 with
  ``set_grad_checkpointing(True)`` measured in the same run. Goal: the ``bottleneck`` mode's peak
  and FLOPs each at most timm's.

Prints a Markdown table and whether each goal is met; ``--json_out`` writes the rows as JSON.
"""
from __future__ import annotations

import fire

from zoo.bench.peers import (add_rows, print_goals, print_table, timm_checkpointing, write_json,
                             zoo_modes)


def main(cifar_batch: int = 32, imagenet_batch: int = 8, imagenet_size: int = 224,
         fake: bool = False, json_out: str | None = None) -> list[dict]:
    """Measure both workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []
    cifar = zoo_modes("densenet_bc_100", cifar_batch, 32, fake)
    add_rows(rows, f"densenet_bc_100 batch {cifar_batch} 32px", cifar, cifar["plain"])
    imagenet = zoo_modes("densenet121", imagenet_batch, imagenet_size, fake)
    timm_results = timm_checkpointing("densenet121", imagenet_batch, imagenet_size, fake)
    workload = f"densenet121 batch {imagenet_batch} {imagenet_size}px"
    add_rows(rows, workload, imagenet, imagenet["plain"])
    add_rows(rows, workload, timm_results, imagenet["plain"])
    print_table(rows, "FakeTensorMode" if fake else "real tensors")

    plain, timm_cp = cifar["plain"], timm_results["timm set_grad_checkpointing"]
    print_goals([
        ("bc_100 bottleneck peak <= 0.40x plain", cifar["bottleneck"][0] / plain[0], 0.40),
        ("bc_100 bottleneck FLOPs <= 1.02x plain", cifar["bottleneck"][1] / plain[1], 1.02),
        ("bc_100 layer peak <= 0.20x plain", cifar["layer"][0] / plain[0], 0.20),
        ("densenet121 bottleneck peak <= timm's", imagenet["bottleneck"][0] / timm_cp[0], 1.0),
        ("densenet121 bottleneck FLOPs <= timm's", imagenet["bottleneck"][1] / timm_cp[1], 1.0),
    ])
    write_json(json_out, rows, fake=fake)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
