"""A compiled convolution net's peak on a card against its memory layout (``compiled-layout``).

    python scripts/benchmark.py compiled-layout --card h200 --model resnet50 --batch 4 \
        --size 224 --modes plain,halves --dtypes fp32,bf16

On CUDA inductor lays a convolution net out channels-last inside its graphs (its layout
optimisation). A model and batch left in PyTorch's default layout then pay for it in the
backward: each convolution's weight gradient is written channels-last and copied to the
parameter's strides only by a kernel at the end of the backward, so the deep stages' weight
gradients are held twice at the backward's peak. Put in ``torch.channels_last``, the model needs
no copy. Per checkpoint mode, precision and layout, the eager step (``zoo.memory.predict_step``)
and the compiled one (``zoo.memory.predict_compiled_step``: inductor's own scheduler run for the
card) are predicted on the card, their peaks side by side. Prints Markdown and writes
docs/results/compiled_layout_<model>_b<batch>_<card>.json.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

import zoo
from zoo.memory import format_bytes, predict_compiled_step, predict_step

from .suite import AUTOCAST as DTYPES
from .report import comma_list, command_line, machine_info, write_json

__all__ = ["compiled_layout", "layout_rows", "markdown"]

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def layout_rows(name: str, batch: int, size: int | None, mode: str, dtype: str,
                on: str) -> list[dict[str, Any]]:
    """One row per layout: the eager and the compiled step of ``name`` in checkpoint ``mode``
    (``plain``: none) at ``batch`` (images ``size`` px, the model's default where None),
    predicted on card ``on``."""
    torch.manual_seed(0)
    base = zoo.create_model(name).train()
    if mode != "plain":
        base.set_grad_checkpointing(mode)
    x = base.example_input(batch, size)
    rows = []
    for layout, fmt in LAYOUTS.items():
        model = copy.deepcopy(base).to(memory_format=fmt)
        batch_in = x.to(memory_format=fmt)
        eager = predict_step(model, batch_in, on, autocast=DTYPES[dtype])
        compiled = predict_compiled_step(model, batch_in, on, autocast=DTYPES[dtype])
        rows.append({"model": name, "batch": batch, "size": x.shape[-1], "mode": mode,
                     "dtype": dtype, "layout": layout, "eager_peak": eager.peak,
                     "compiled_peak": compiled.peak, "ratio": compiled.peak / eager.peak})
    return rows


def markdown(rows: list[dict[str, Any]], on: str) -> str:
    head = (f"| model | batch | px | mode | precision | layout | eager peak on the {on} | "
            f"compiled peak on the {on} | compiled / eager |\n"
            f"|---|---:|---:|---|---|---|---:|---:|---:|")
    return "\n".join([head] + [
        f"| {r['model']} | {r['batch']} | {r['size']} | {r['mode']} | {r['dtype']} | "
        f"{r['layout']} | {format_bytes(r['eager_peak'])} | "
        f"{format_bytes(r['compiled_peak'])} | {r['ratio']:.3f}x |" for r in rows])


def compiled_layout(card: str = "h200", model: str = "resnet50", batch: int = 4,
                    size: int | None = None, modes: str = "plain,halves",
                    dtypes: str = "fp32,bf16",
                    json_out: str | None = None) -> list[dict[str, Any]]:
    """A compiled conv net's peak on a card, contiguous against channels-last (module docstring)."""
    unknown = [d for d in comma_list(dtypes) if d not in DTYPES]
    if unknown:
        raise ValueError(f"--dtypes takes {', '.join(DTYPES)}, got {', '.join(unknown)}")
    rows = [row for mode in comma_list(modes) for dtype in comma_list(dtypes)
            for row in layout_rows(model, batch, size, mode, dtype, card)]
    print(markdown(rows, card))
    write_json(json_out or f"docs/results/compiled_layout_{model}_b{batch}_{card}.json",
               {"command": command_line(), "machine": machine_info(torch.device("cpu")),
                "card": card, "rows": rows})
    return rows
