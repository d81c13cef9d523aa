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

import contextlib
import json
import platform
import sys
from collections.abc import Iterator

import fire
import torch
from torch import nn

import zoo
from zoo.memory import count_flops, cpu_peak_bytes
from zoo.models.resnet import ResNet

MiB = 2**20
Result = tuple[int, int]  # (peak bytes, FLOPs)


@contextlib.contextmanager
def _maybe_fake(fake: bool) -> Iterator[None]:
    """Under FakeTensorMode no kernel runs, yet MemTracker and FlopCounterMode see every tensor."""
    if not fake:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def measure(model: nn.Module, x: torch.Tensor) -> Result:
    """(peak bytes, FLOPs) of one training step of ``model`` on ``x``."""
    model.train()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    peak = cpu_peak_bytes(step, track=(model,))
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


def bench_zoo(name: str, batch_size: int, size: int, fake: bool,
              every: tuple[int, ...] = ()) -> dict[str, Result]:
    """Plain, every checkpoint mode, and the ``block`` mode with each ``checkpoint_every``."""
    torch.manual_seed(0)
    with _maybe_fake(fake):
        model = zoo.create_model(name)
        x = model.example_input(batch_size, size)
        results = {}
        for mode in (False, *model.checkpoint_modes):
            model.set_grad_checkpointing(mode)
            results[mode or "plain"] = measure(model, x)
        for n in every:
            segmented = zoo.create_model(name, efficient="block", checkpoint_every=n)
            segmented.load_state_dict(model.state_dict())
            results[f"block, checkpoint_every={n}"] = measure(segmented, x)
    return results


def bench_timm(name: str, batch_size: int, size: int, fake: bool) -> dict[str, Result]:
    """timm's ``name``, plain and with ``set_grad_checkpointing(True)``."""
    import timm

    torch.manual_seed(0)
    with _maybe_fake(fake):
        model = timm.create_model(name, pretrained=False)
        x = torch.randn(batch_size, 3, size, size)
        results = {"timm plain": measure(model, x)}
        model.set_grad_checkpointing(True)
        results["timm set_grad_checkpointing"] = measure(model, x)
    return results


def main(imagenet_batch: int = 8, imagenet_size: int = 224, cifar_batch: int = 64,
         fake: bool = False, json_out: str | None = None) -> list[dict]:
    """Measure the workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []

    def add(workload: str, results: dict[str, Result], base: Result) -> None:
        for variant, (peak, flops) in results.items():
            rows.append({"workload": workload, "variant": variant, "peak_bytes": peak,
                         "flops": flops, "peak_ratio": peak / base[0],
                         "flop_ratio": flops / base[1]})

    r50 = bench_zoo("resnet50", imagenet_batch, imagenet_size, fake, every=(2, 3))
    timm_r50 = bench_timm("resnet50", imagenet_batch, imagenet_size, fake)
    workload = f"resnet50 batch {imagenet_batch} {imagenet_size}px"
    add(workload, r50, r50["plain"])
    add(workload, timm_r50, r50["plain"])
    r110 = bench_zoo("resnet110", cifar_batch, 32, fake, every=(2, 3))
    add(f"resnet110 batch {cifar_batch} 32px", r110, r110["plain"])
    cnn = bench_zoo("cifar_cnn", cifar_batch, 32, fake)
    add(f"cifar_cnn batch {cifar_batch} 32px", cnn, cnn["plain"])

    print(f"torch {torch.__version__}, {platform.machine()}, CPU, "
          f"{'FakeTensorMode' if fake else 'real tensors'}; ratios against the zoo's plain model\n")
    print("| workload | variant | peak MiB | x plain | GFLOPs | x plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['peak_bytes'] / MiB:.1f} | "
              f"{r['peak_ratio']:.3f} | {r['flops'] / 1e9:.2f} | {r['flop_ratio']:.4f} |")

    recommended = ResNet.checkpoint_modes[0]
    ours, theirs = r50[recommended], timm_r50["timm set_grad_checkpointing"]
    goals = [(f"resnet50 {recommended} peak <= timm's", ours[0] / theirs[0]),
             (f"resnet50 {recommended} FLOPs <= timm's", ours[1] / theirs[1])]
    print()
    for text, value in goals:
        print(f"{'met   ' if value <= 1.0 else 'MISSED'} {text}: {value:.3f}x timm")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "fake": fake,
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
