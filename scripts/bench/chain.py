"""Checkpoint implementations side by side on a chain of conv-BN-ReLU blocks (``checkpoint``).

    python scripts/benchmark.py checkpoint                  # CPU, exact memory via MemTracker
    python scripts/benchmark.py checkpoint --device cuda    # CUDA max_memory_allocated
    python scripts/benchmark.py checkpoint --small          # 100 tiny blocks, 1 thread: per-region cost

Modes, each checkpointing every block on its own: no checkpoint; torch.utils.checkpoint reentrant
and non-reentrant; zoo.checkpoint with plain nn.BatchNorm2d; zoo.checkpoint with cp_BatchNorm2d.
For each: peak memory, FLOPs (FlopCounterMode, forward + backward), median step time as a ratio
to no checkpoint (modes interleaved step by step in shuffled order, so machine noise hits all
alike), and the BatchNorm statistics error against the plain run after the same steps.
"""
from __future__ import annotations

import torch

import zoo
from zoo.memory import (bn_count, bn_difference, bn_state, count_flops, cpu_peak_bytes,
                        cuda_peak_bytes, format_bytes)

from .measure import measure_times, median_iqr, training_step
from .region_chain import BATCH, REGIONS, SIZE, WIDTH, Chain, chain_input, make_chain, \
    with_checkpoint
from .report import command_line, machine_info, write_json
from .variants import Variant

__all__ = ["MODES", "chain_variants", "markdown_table", "checkpoint"]

MODES: dict[str, tuple[str, bool]] = {  # name -> (region_chain.CHECKPOINTS key, cp_BatchNorm2d)
    "no checkpoint": ("none", False),
    "torch reentrant": ("torch reentrant", False),
    "torch non-reentrant": ("torch non-reentrant", False),
    "zoo.checkpoint": ("zoo.checkpoint", False),
    "zoo.checkpoint + cp_BatchNorm2d": ("zoo.checkpoint", True),
}


def chain_variants(base: Chain) -> list[Variant]:
    """One variant per mode of :data:`MODES`, each on its own copy of ``base``."""
    out = []
    for name, (checkpoint, cp_bn) in MODES.items():
        net = with_checkpoint(base, checkpoint)
        if cp_bn:
            zoo.nn.convert_batchnorm(net)
        out.append(Variant(name, net, False, name))
    return out


def _bn_rows(variants: list[Variant], x: torch.Tensor, steps: int) -> list[dict]:
    """BatchNorm statistics after ``steps`` identical training steps (same seed per step)."""
    for v in variants:
        for s in range(steps):
            torch.manual_seed(s)
            training_step(v, x)()
    ref = bn_state(variants[0].model)
    rows = []
    for v in variants:
        state = bn_state(v.model)
        rows.append({"mode": v.name, "bn_stats_error": bn_difference(state, ref)["bn_stats_error"],
                     "num_batches_tracked": bn_count(state)})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows of :func:`checkpoint` (or of its JSON) as a Markdown table."""
    lines = ["| mode | peak memory | vs none | FLOPs vs none | median step | vs none (IQR) "
             "| BN running stats max error | num_batches_tracked |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["time_iqr_ratio"]
        lines.append(
            f"| {r['mode']} | {format_bytes(r['peak_bytes'])} | {r['peak_ratio']:.2f}x "
            f"| {r['flops_ratio']:.2f}x | {r['median_s'] * 1e3:.1f} ms | {r['time_ratio']:.2f}x "
            f"({lo:.2f}-{hi:.2f}) | {r['bn_stats_error']:.3g} "
            f"| {r['num_batches_tracked']} (plain: {rows[0]['num_batches_tracked']}) |")
    return "\n".join(lines)


def checkpoint(device: str = "cpu", blocks: int = 12, width: int = 32, batch_size: int = 32,
               size: int = 32, steps: int = 3, repeats: int = 15, warmup: int = 2,
               threads: int | None = None, small: bool = False,
               json_out: str | None = None) -> list[dict]:
    """torch's checkpoints against zoo.checkpoint on a chain of conv-BN-ReLU blocks.

    ``--small`` sets 100 blocks of width 8 on one 8x8 image and one CPU thread: the kernels take
    microseconds, so the step time is mostly the checkpoint's own per-region work (what a GPU
    run of a model with many small layers pays on the host). ``--threads`` sets torch's CPU
    threads. Prints a Markdown table; ``--json_out`` writes the rows as JSON.
    """
    if small:
        blocks, width, batch_size, size, threads = REGIONS, WIDTH, BATCH, SIZE, threads or 1
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    x = chain_input("conv", batch_size, width, size, dev)  # every mode the same one
    variants = chain_variants(make_chain(blocks, width).to(dev))
    rows = _bn_rows(variants, x, steps)
    for row, v in zip(rows, variants):
        step = training_step(v, x)
        row["peak_bytes"] = (cuda_peak_bytes(step, dev)[0] if dev.type == "cuda"
                             else cpu_peak_bytes(step, track=(v.model,)))
        row["flops"] = count_flops(step)
        v.model.zero_grad(set_to_none=True)
    times = measure_times(variants, x, repeats, warmup)
    base = rows[0]
    base_time = median_iqr(times[base["mode"]])[0]
    for row in rows:
        median, q1, q3 = median_iqr(times[row["mode"]])
        row.update(median_s=median, time_ratio=median / base_time,
                   time_iqr_ratio=[q1 / base_time, q3 / base_time],
                   peak_ratio=row["peak_bytes"] / base["peak_bytes"],
                   flops_ratio=row["flops"] / base["flops"])
    info = machine_info(dev)
    where = info.get("gpu") or f"{info['cpu']}, {info['torch_threads']} threads"
    print(f"\nChain of {blocks} conv-BN-ReLU-dropout-conv-BN-ReLU blocks, width {width}, batch "
          f"{batch_size}, {size}x{size}; device {where}; torch {torch.__version__}; "
          f"{repeats} timed steps after {warmup} warm-up, modes interleaved in shuffled order\n")
    print(markdown_table(rows))
    if json_out:
        write_json(json_out, {"command": command_line(), "torch": torch.__version__,
                              "machine": where, "rows": rows})
    return rows
