"""Peak memory and FLOPs of one transformer training step, plain against each checkpoint mode.

    python scripts/bench_transformers.py             # exact CPU figures (MemTracker, FlopCounterMode)

One step = forward, ``square().mean()`` loss, backward, in train mode (dropout active), from fresh
gradients; the model's parameters count towards the peak (``track``), as they would on a GPU.

* ViT-S/16, batch 8 at 224x224, real tensors, beside timm's vit_small_patch16_224 plain and with
  ``set_grad_checkpointing(True)`` in the same run. Goal: the recommended mode's peak and FLOPs
  each at most timm's checkpointed model's.
* BERT-base, batch 64, sequence 128 (seed 004's setting), under ``FakeTensorMode``: model and
  inputs are built inside the mode, so nothing is computed, yet MemTracker's bytes and
  FlopCounterMode's FLOPs are the ones of a real run. Goals: ``block`` >= 60% less peak than
  plain; ``selective`` >= 40% less at <= 5% extra FLOPs.
* GPT-2 small, batch 8, sequence 1024, under ``FakeTensorMode``: figures only.

On the CPU, SDPA with attention dropout (BERT, GPT-2) runs its math path, which stores the T x T
attention matrix and is counted by FlopCounterMode; without dropout (ViT) it runs a fused kernel
whose FLOPs FlopCounterMode does not count (the same for every variant, timm's included).

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
        model(x).float().square().mean().backward()

    peak = cpu_peak_bytes(step, track=(model,))
    flops = count_flops(step)
    model.zero_grad(set_to_none=True)
    return peak, flops


def bench_zoo(name: str, batch_size: int, size: int, fake: bool) -> dict[str, Result]:
    """Plain and every checkpoint mode of the zoo model ``name`` (``size``: image side or tokens)."""
    torch.manual_seed(0)
    with _maybe_fake(fake):
        model = zoo.create_model(name)
        x = model.example_input(batch_size, size)
        results = {}
        for mode in (False, *model.checkpoint_modes):
            model.set_grad_checkpointing(mode)
            results[mode or "plain"] = measure(model, x)
    return results


def bench_timm(name: str, batch_size: int, size: int) -> dict[str, Result]:
    """timm's ``name`` (real tensors: timm's constructor reads values, which FakeTensorMode
    cannot give), plain and with ``set_grad_checkpointing(True)``."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    x = torch.randn(batch_size, 3, size, size)
    results = {"timm plain": measure(model, x)}
    model.set_grad_checkpointing(True)
    results["timm set_grad_checkpointing"] = measure(model, x)
    return results


def main(vit_batch: int = 8, vit_size: int = 224, bert_batch: int = 64, bert_tokens: int = 128,
         gpt2_batch: int = 8, gpt2_tokens: int = 1024, json_out: str | None = None) -> list[dict]:
    """Measure the three workloads, print a table and the goals, optionally write JSON."""
    rows: list[dict] = []

    def add(workload: str, results: dict[str, Result], base: Result, fake: bool) -> None:
        for variant, (peak, flops) in results.items():
            rows.append({"workload": workload, "variant": variant, "fake": fake,
                         "peak_bytes": peak, "flops": flops, "peak_ratio": peak / base[0],
                         "flop_ratio": flops / base[1]})

    vit = bench_zoo("vit_small_patch16_224", vit_batch, vit_size, fake=False)
    timm_vit = bench_timm("vit_small_patch16_224", vit_batch, vit_size)
    workload = f"vit_small_patch16_224 batch {vit_batch} {vit_size}px"
    add(workload, vit, vit["plain"], False)
    add(workload, timm_vit, vit["plain"], False)
    bert = bench_zoo("bert_base", bert_batch, bert_tokens, fake=True)
    add(f"bert_base batch {bert_batch} seq {bert_tokens}", bert, bert["plain"], True)
    gpt2 = bench_zoo("gpt2_small", gpt2_batch, gpt2_tokens, fake=True)
    add(f"gpt2_small batch {gpt2_batch} seq {gpt2_tokens}", gpt2, gpt2["plain"], True)

    print(f"torch {torch.__version__}, {platform.machine()}, CPU; ViT on real tensors, BERT and "
          f"GPT-2 under FakeTensorMode; ratios against the zoo's plain model\n")
    print("| workload | variant | peak MiB | x plain | GFLOPs | x plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['peak_bytes'] / MiB:.1f} | "
              f"{r['peak_ratio']:.3f} | {r['flops'] / 1e9:.2f} | {r['flop_ratio']:.4f} |")

    recommended = zoo.models.vit.VisionTransformer.checkpoint_modes[0]
    timm_cp = timm_vit["timm set_grad_checkpointing"]
    goals = [
        (f"vit_small {recommended} peak <= timm's", vit[recommended][0] / timm_cp[0], 1.0),
        (f"vit_small {recommended} FLOPs <= timm's", vit[recommended][1] / timm_cp[1], 1.0),
        ("bert_base block peak <= 0.40x plain", bert["block"][0] / bert["plain"][0], 0.40),
        ("bert_base selective peak <= 0.60x plain", bert["selective"][0] / bert["plain"][0], 0.60),
        ("bert_base selective FLOPs <= 1.05x plain", bert["selective"][1] / bert["plain"][1], 1.05),
    ]
    print()
    for text, value, limit in goals:
        print(f"{'met   ' if value <= limit else 'MISSED'} {text}: {value:.4f}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "rows": rows},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
