"""Exact peak bytes and FLOPs of one training step: a zoo model's checkpoint modes against timm's.

Shared by the family benchmarks (:mod:`bench.families`, :mod:`bench.outside`). Each figure is
``zoo.memory.step_cost`` of one training step: MemTracker's peak (the model's state counted, as
on a GPU) and FlopCounterMode's FLOPs, exact and repeatable on the CPU; under ``FakeTensorMode``
(``fake=True``) no kernel runs, yet both see every tensor and every op.
"""
from __future__ import annotations

import platform
from collections.abc import Sequence

import torch
from torch import nn

from zoo.memory import step_cost
from zoo.models import create_model
from . import report
from .runs import fake_mode

__all__ = ["Result", "zoo_modes", "timm_checkpointing", "add_rows",
           "print_table", "print_goals", "write_json"]

Result = tuple[int, int]  # (peak bytes, FLOPs) of one training step
MiB = 2**20


def zoo_modes(name: str, batch_size: int, size: int, fake: bool,
              every: Sequence[int] = ()) -> dict[str, Result]:
    """Plain and every checkpoint mode of the zoo model ``name`` (``size``: image side or
    tokens); ``every``: also the ``block`` mode with each ``checkpoint_every`` (ResNets)."""
    torch.manual_seed(0)
    with fake_mode(fake):
        model = create_model(name)
        x = model.example_input(batch_size, size)
        results = {}
        for mode in (False, *model.checkpoint_modes):
            model.set_grad_checkpointing(mode)
            results[mode or "plain"] = step_cost(model, x)
        for n in every:
            segmented = create_model(name, efficient="block", checkpoint_every=n)
            segmented.load_state_dict(model.state_dict())
            results[f"block, checkpoint_every={n}"] = step_cost(segmented, x)
    return results


def timm_checkpointing(name: str, batch_size: int, size: int, fake: bool) -> dict[str, Result]:
    """timm's ``name``, plain and with ``set_grad_checkpointing(True)``, on random images (a
    ViT built for ``size``). (Some timm constructors read tensor values, which FakeTensorMode
    cannot give: pass ``fake=False`` for those.)"""
    import timm

    torch.manual_seed(0)
    kwargs = {"img_size": size} if name.startswith("vit") else {}
    with fake_mode(fake):
        model = timm.create_model(name, pretrained=False, **kwargs)
        x = torch.randn(batch_size, 3, size, size)
        results = {"timm plain": step_cost(model, x)}
        model.set_grad_checkpointing(True)
        results["timm set_grad_checkpointing"] = step_cost(model, x)
    return results


def add_rows(rows: list[dict], workload: str, results: dict[str, Result], base: Result,
             **extra: object) -> None:
    """Append one row per variant, with its ratios to ``base`` (the zoo's plain model)."""
    for variant, (peak, flops) in results.items():
        rows.append({"workload": workload, "variant": variant, **extra, "peak_bytes": peak,
                     "flops": flops, "peak_ratio": peak / base[0], "flop_ratio": flops / base[1]})


def print_table(rows: Sequence[dict], what: str) -> None:
    """The rows as a Markdown table, after a line naming the machine."""
    print(f"torch {torch.__version__}, {platform.machine()}, CPU; {what}; ratios against the "
          f"zoo's plain model\n")
    print("| workload | variant | peak MiB | x plain | GFLOPs | x plain |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['peak_bytes'] / MiB:.1f} | "
              f"{r['peak_ratio']:.3f} | {r['flops'] / 1e9:.2f} | {r['flop_ratio']:.4f} |")


def print_goals(goals: Sequence[tuple[str, float, float]]) -> None:
    """``(text, value, limit)`` -> "met" when value <= limit, else "MISSED"."""
    print()
    for text, value, limit in goals:
        print(f"{'met   ' if value <= limit else 'MISSED'} {text}: {value:.4f}")


def write_json(path: str | None, rows: Sequence[dict], **meta: object) -> None:
    """Rows with the command and torch version that produced them (nothing if ``path`` is None)."""
    if path:
        report.write_json(path, {"command": report.command_line(), "torch": torch.__version__,
                                 **meta, "rows": list(rows)})
