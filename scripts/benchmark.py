"""Memory, time and the largest batch of a zoo model, plain against every way to checkpoint it.

    python scripts/benchmark.py --model densenet_bc_100 --batch_size 64 --device cpu
    python scripts/benchmark.py --model bert_base --batch_size 16,32,64 --fake      # bytes, FLOPs
    python scripts/benchmark.py --model densenet_bc_100 --find_max_batch --memory_budget 11GB,12GB
    python scripts/benchmark.py --model resnet110 --batch_size 64 --segments        # seed 000
    python scripts/benchmark.py --model densenet_bc_100 --batch_size 64,256 --device cuda

Variants (``--variants plain,official,layer`` picks some; ``zoo_layer`` or ``layer`` for
``zoo layer``): ``plain``; ``official``, torch.utils.checkpoint as
torchvision and timm use it (torchvision's memory_efficient DenseNet for DenseNet-B models);
``zoo <mode>`` for each of the model's checkpoint modes, the first being ``efficient=True``.

* default: per variant the peak memory (CUDA max_memory_allocated and reserved; CPU exact via
  MemTracker), FLOPs and recompute overhead, the median step time over interleaved rounds after
  warm-up (ratio to plain in the same run), samples/s, and BatchNorm statistics / gradient error
  against plain after one step. ``--fake``: memory and FLOPs only, under FakeTensorMode (no kernel
  runs, so large models and batches cost seconds).
* ``--find_max_batch --memory_budget 11GB,12GB``: the largest batch per variant and budget. On the
  CPU an exact prediction of the CUDA peak (FakeTensorMode, 512-byte allocator blocks; ``--allocator
  cpu`` for the CPU's own bytes); on CUDA a real, out-of-memory-safe search on the device capped at
  the budget, with the CPU prediction and its error beside it.
* ``--segments`` (or ``--segments 1,2,4``): torch's and the zoo's checkpoint_sequential over the
  model's chain against the number of segments.

Prints Markdown tables; writes JSON (machine, torch version, command, rows) to ``--out``
(default ``docs/results/benchmark_<model>_<device>_<what>.json``). Plot with scripts/plot.py.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import fire
import torch

from zoo.bench.report import benchmark_table, max_batch_table, segments_table, write_json
from zoo.bench.runs import parse_budgets, run_benchmark, run_max_batch, run_segments


def _ints(value: int | str | Sequence[int]) -> list[int]:
    """``64``, ``"16,32"`` or ``(16, 32)`` -> a list of positive ints."""
    items = str(value).split(",") if isinstance(value, (int, str)) else list(value)
    try:
        out = [int(str(v).strip()) for v in items]
    except ValueError:
        raise ValueError(f"expected a positive int or a comma-separated list of them, got "
                         f"{value!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"expected positive ints, got {value!r}")
    return out


def main(model: str, batch_size: int | str | tuple = 64, device: str = "cpu",
         size: int | None = None, variants: str | tuple | None = None, repeats: int = 5,
         warmup: int = 1, fake: bool = False, find_max_batch: bool = False,
         memory_budget: str | tuple = "11GB,12GB", allocator: str = "cuda",
         check_prediction: bool = True, segments: bool | int | str | tuple = False,
         out: str | None = None, seed: int = 0) -> dict:
    """Run one benchmark (see the module docstring), print its table, write its JSON."""
    dev = torch.device(device).type
    names = ([v.strip() for v in variants.split(",")] if isinstance(variants, str)
             else list(variants) if variants else None)
    if find_max_batch:
        payload = run_max_batch(model, parse_budgets(memory_budget), device, size, names,
                                allocator=allocator, check_prediction=check_prediction, seed=seed)
        table, what = max_batch_table(payload["rows"]), "maxbatch"
    elif segments is not False:
        counts = None if segments is True else _ints(segments)
        batch = _ints(batch_size)[0]
        payload = run_segments(model, batch, device, size, counts, repeats, warmup, fake, seed)
        table, what = segments_table(payload["rows"]), f"segments_b{batch}"
    else:
        batches = _ints(batch_size)
        payload = run_benchmark(model, batches, device, size, names, repeats, warmup, fake, seed)
        table, what = benchmark_table(payload["rows"]), "b" + "-".join(map(str, batches))
    machine = payload["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {machine['torch_threads']} threads"
    print(f"{model} on {where}, torch {machine['torch']}"
          f"{', FakeTensorMode' if fake else ''}\n\n{table}")
    path = out or f"docs/results/benchmark_{model}_{dev}{'_fake' if fake else ''}_{what}.json"
    print(f"\nwrote {write_json(path, payload)}")
    return payload


if __name__ == "__main__":
    try:
        fire.Fire(main, serialize=lambda payload: None)
    except ValueError as e:  # bad model name, budget, batch size, variant: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
