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

import contextlib
import json
import platform
import sys
from collections.abc import Callable, Iterator

import fire
import torch
from torch import nn

import zoo
from zoo.memory import count_flops, cpu_peak_bytes

MiB = 2**20


@contextlib.contextmanager
def _maybe_fake(fake: bool) -> Iterator[None]:
    """Under FakeTensorMode no kernel runs, yet MemTracker and FlopCounterMode see every tensor."""
    if not fake:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def training_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    return step


def measure(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(peak bytes, FLOPs) of one training step of ``model`` on ``x``."""
    model.train()
    step = training_step(model, x)
    peak = cpu_peak_bytes(step, track=(model,))
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


def bench_zoo(name: str, batch_size: int, size: int, fake: bool) -> dict[str, tuple[int, int]]:
    """Plain and every checkpoint mode of the zoo model ``name``."""
    torch.manual_seed(0)
    with _maybe_fake(fake):
        model = zoo.create_model(name)
        x = model.example_input(batch_size, size)
        results = {}
        for mode in (False, *model.checkpoint_modes):
            model.set_grad_checkpointing(mode)
            results[mode or "plain"] = measure(model, x)
    return results


def bench_timm(name: str, batch_size: int, size: int, fake: bool) -> dict[str, tuple[int, int]]:
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


def main(cifar_batch: int = 32, imagenet_batch: int = 8, imagenet_size: int = 224,
         fake: bool = False, json_out: str | None = None) -> list[dict]:
    """Measure both workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []

    def add(workload: str, results: dict[str, tuple[int, int]], base: tuple[int, int]) -> None:
        for variant, (peak, flops) in results.items():
            rows.append({"workload": workload, "variant": variant, "peak_bytes": peak,
                         "flops": flops, "peak_ratio": peak / base[0], "flop_ratio": flops / base[1]})

    cifar = bench_zoo("densenet_bc_100", cifar_batch, 32, fake)
    add(f"densenet_bc_100 batch {cifar_batch} 32px", cifar, cifar["plain"])
    imagenet = bench_zoo("densenet121", imagenet_batch, imagenet_size, fake)
    timm_results = bench_timm("densenet121", imagenet_batch, imagenet_size, fake)
    workload = f"densenet121 batch {imagenet_batch} {imagenet_size}px"
    add(workload, imagenet, imagenet["plain"])
    add(workload, timm_results, imagenet["plain"])

    print(f"torch {torch.__version__}, {platform.machine()}, CPU, "
          f"{'FakeTensorMode' if fake else 'real tensors'}; ratios against the zoo's plain model\n")
    print("| workload | variant | peak MiB | x plain | GFLOPs | x plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['peak_bytes'] / MiB:.1f} | "
              f"{r['peak_ratio']:.3f} | {r['flops'] / 1e9:.2f} | {r['flop_ratio']:.4f} |")

    def ratio(a: tuple[int, int], b: tuple[int, int], i: int) -> float:
        return a[i] / b[i]

    timm_cp = timm_results["timm set_grad_checkpointing"]
    goals = [
        ("bc_100 bottleneck peak <= 0.40x plain", ratio(cifar["bottleneck"], cifar["plain"], 0), 0.40),
        ("bc_100 bottleneck FLOPs <= 1.02x plain", ratio(cifar["bottleneck"], cifar["plain"], 1), 1.02),
        ("bc_100 layer peak <= 0.20x plain", ratio(cifar["layer"], cifar["plain"], 0), 0.20),
        ("densenet121 bottleneck peak <= timm's", ratio(imagenet["bottleneck"], timm_cp, 0), 1.0),
        ("densenet121 bottleneck FLOPs <= timm's", ratio(imagenet["bottleneck"], timm_cp, 1), 1.0),
    ]
    print()
    for text, value, limit in goals:
        print(f"{'met   ' if value <= limit else 'MISSED'} {text}: {value:.3f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "fake": fake,
                       "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
