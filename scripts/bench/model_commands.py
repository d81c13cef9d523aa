"""The subcommands about one zoo model: ``variants``, ``max-batch`` and ``segments``.

    python scripts/benchmark.py variants --model densenet_bc_100 --batch_size 64
    python scripts/benchmark.py variants --model bert_base --batch_size 16,32,64 --fake   # bytes, FLOPs
    python scripts/benchmark.py max-batch --model densenet_bc_100 --memory_budget 11GB,12GB
    python scripts/benchmark.py segments --model resnet110 --batch_size 64

Variants (``--variants plain,official,layer`` picks some; ``zoo_layer`` or ``layer`` for
``zoo layer``): ``plain``; ``official``, torch.utils.checkpoint as torchvision and timm use it
(torchvision's memory_efficient DenseNet for DenseNet-B models); ``zoo <mode>`` for each of the
model's checkpoint modes, the first being ``efficient=True``.

Each prints a Markdown table and writes JSON (machine, torch version, command, rows) to
``--out`` (default ``docs/results/benchmark_<model>_<device>_<what>.json``); ``plot`` draws them.
"""
from __future__ import annotations

from typing import Any

import torch

from .report import (benchmark_table, comma_list, int_list, max_batch_table, segments_table,
                     write_json)
from .runs import parse_budgets, run_benchmark, run_max_batch, run_segments

__all__ = ["variants", "max_batch", "segments"]


def _names(variants: Any) -> list[str] | None:
    return comma_list(variants) if variants else None


def _report(model: str, payload: dict, table: str, what: str, device: str, fake: bool,
            out: str | None) -> dict:
    """Print the machine line and ``table``; write the payload to ``out`` or the default path."""
    machine = payload["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {machine['torch_threads']} threads"
    print(f"{model} on {where}, torch {machine['torch']}"
          f"{', FakeTensorMode' if fake else ''}\n\n{table}")
    dev = torch.device(device).type
    path = out or f"docs/results/benchmark_{model}_{dev}{'_fake' if fake else ''}_{what}.json"
    print(f"\nwrote {write_json(path, payload)}")
    return payload


def variants(model: str, batch_size: int | str | tuple = 64, device: str = "cpu",
             size: int | None = None, variants: str | tuple | None = None, repeats: int = 5,
             warmup: int = 1, fake: bool = False, out: str | None = None, seed: int = 0) -> dict:
    """Memory, FLOPs, time and exactness of a zoo model, plain and each checkpoint.

    Per variant and batch size (``--batch_size 16,32``): the peak memory (CUDA
    max_memory_allocated and reserved; CPU exact via MemTracker), FLOPs and recompute overhead,
    the median step time over interleaved rounds after warm-up (ratio to plain in the same run),
    samples/s, and the BatchNorm statistics and gradient error against plain after one step.
    ``--fake``: memory and FLOPs only, under FakeTensorMode (no kernel runs: large models and
    batches cost seconds).
    """
    batches = int_list(batch_size)
    payload = run_benchmark(model, batches, device, size, _names(variants), repeats, warmup,
                            fake, seed)
    return _report(model, payload, benchmark_table(payload["rows"]),
                   "b" + "-".join(map(str, batches)), device, fake, out)


def max_batch(model: str, memory_budget: str | tuple = "11GB,12GB", device: str = "cpu",
              size: int | None = None, variants: str | tuple | None = None, allocator: str = "cuda",
              check_prediction: bool = True, out: str | None = None, seed: int = 0,
              card: str | None = None) -> dict:
    """The largest batch of each variant of a zoo model under memory budgets.

    On the CPU an exact prediction of the CUDA peak (FakeTensorMode, 512-byte allocator blocks;
    ``--allocator cpu`` for the CPU's own bytes); with ``--card h100`` (a, l4, rtx4090; the
    default for ``--device cuda`` on a machine without one) a prediction for that card (its
    kernels, its caching allocator capped at the budget) with its predicted samples/s; on CUDA a
    real, out-of-memory-safe search on the device capped at the budget, with the CPU prediction
    and its error beside it.
    """
    payload = run_max_batch(model, parse_budgets(memory_budget), device, size, _names(variants),
                            allocator=allocator, check_prediction=check_prediction, seed=seed,
                            card=card)
    what = "maxbatch" if payload["settings"].get("card") is None else \
        f"maxbatch_{card or 'h100'}"
    return _report(model, payload, max_batch_table(payload["rows"]), what,
                   "cpu" if "card" in payload["settings"] else device, False, out)


def segments(model: str, batch_size: int = 64, device: str = "cpu", size: int | None = None,
             segments: int | str | tuple | None = None, repeats: int = 5, warmup: int = 1,
             fake: bool = False, out: str | None = None, seed: int = 0) -> dict:
    """checkpoint_sequential, torch's and the zoo's, against the number of segments.

    ``--segments 1,2,4`` picks the counts (default 1, 2, 4, ... and one per block); peak, FLOPs
    and time against no checkpointing. torch never checkpoints its last segment; the zoo does.
    """
    counts = None if segments is None else int_list(segments)
    batch = int_list(batch_size)[0]
    payload = run_segments(model, batch, device, size, counts, repeats, warmup, fake, seed)
    return _report(model, payload, segments_table(payload["rows"]), f"segments_b{batch}", device,
                   fake, out)
