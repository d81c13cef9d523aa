"""Results as Markdown tables (stdout) and JSON files that carry the machine and the command."""
from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from zoo.memory import format_bytes

__all__ = ["machine_info", "command_line", "comma_list", "int_list", "write_json",
           "benchmark_table", "max_batch_table", "segments_table"]


def machine_info(device: torch.device) -> dict[str, Any]:
    """What ran the benchmark: device name, CPU, threads, torch version."""
    info: dict[str, Any] = {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return info


def command_line() -> str:
    """The command that is running, as a user would type it (``python scripts/benchmark.py ...`` when
    it runs as the module)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "bench":
        return "python scripts/benchmark.py " + " ".join(shlex.quote(a) for a in argv[1:])
    return "python " + " ".join(shlex.quote(a) for a in argv)


def comma_list(value: Any) -> list[str]:
    """A comma-separated flag as Fire passes it (a string, a number, or already a tuple)."""
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value]
    return [v.strip() for v in str(value).split(",")]


def int_list(value: Any) -> list[int]:
    """``64``, ``"16,32"`` or ``(16, 32)`` -> a list of positive ints."""
    try:
        out = [int(v) for v in comma_list(value)]
    except ValueError:
        raise ValueError(f"expected a positive int or a comma-separated list of them, got "
                         f"{value!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"expected positive ints, got {value!r}")
    return out


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (with its machine and command) to ``path``, creating folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def _fmt(value: float | None, spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def _time_cells(r: dict) -> str:
    if "median_s" not in r:
        return "- | - | - |"
    lo, hi = r["time_iqr_ratio"]
    return (f"{r['median_s'] * 1e3:.0f} ms | {r['time_ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | "
            f"{r['images_per_s']:.1f} |")


def benchmark_table(rows: Sequence[dict]) -> str:
    """One row per variant: peak (and reserved on CUDA), FLOPs, time, throughput, exactness."""
    cuda = any("peak_reserved_bytes" in r for r in rows)
    head = ("| batch | variant | peak memory | x plain | " + ("reserved | " if cuda else "")
            + "GFLOPs | recompute | median step | x plain (IQR) | samples/s "
            "| BN stats err | BN count err | grad err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.get("status") == "failed":
            lines.append(f"| {r['batch_size']} | {r['variant']} | failed: {r['error']} |")
            continue
        reserved = f"{format_bytes(r['peak_reserved_bytes'])} | " if cuda else ""
        lines.append(
            f"| {r['batch_size']} | {r['variant']} | "
            f"{'-' if r['peak_bytes'] is None else format_bytes(r['peak_bytes'])} | "
            f"{_fmt(r['peak_ratio'], '.3f', '-')} | {reserved}"
            f"{_fmt(r['flops'] and r['flops'] / 1e9, '.1f', '-')} | "
            f"{_fmt(r['recompute_overhead'], '+.1%')} | {_time_cells(r)} "
            f"{_fmt(r.get('bn_stats_error'), '.3g')} | {_fmt(r.get('bn_count_error'), 'd')} | "
            f"{_fmt(r.get('grad_error'), '.2g', '-')} |")
    return "\n".join(lines)


def max_batch_table(rows: Sequence[dict]) -> str:
    """One row per (budget, variant): the largest batch, its peak, and x plain's batch."""
    has_check = any("predicted_peak_bytes" in r for r in rows)
    head = "| budget | variant | largest batch | x plain | peak at it | how |"
    has_speed = any("samples_per_s" in r for r in rows)
    if has_check:
        head += " predicted peak (CPU, FakeTensorMode) | prediction error |"
    if has_speed:
        head += " step on the card (predicted) | samples/s (predicted) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['budget']} | {r['variant']} | {r['largest_batch']} | "
                f"{_fmt(r.get('batch_ratio'), '.2f')} | "
                f"{format_bytes(r['peak_bytes']) if r['peak_bytes'] else '-'} | {r['method']} |")
        if has_check:
            err = r.get("prediction_error")
            predicted = r.get("predicted_peak_bytes")
            line += f" {format_bytes(predicted) if predicted else '-'} | {_fmt(err, '+.2%', '-')} |"
        if has_speed:
            step = r.get("step_s")
            line += (f" {f'{step * 1e3:.2f} ms' if step else '-'} |"
                     f" {_fmt(r.get('samples_per_s'), ',.0f', '-')} |")
        lines.append(line)
    return "\n".join(lines)


def segments_table(rows: Sequence[dict]) -> str:
    """One row per (implementation, segments): peak, FLOPs and time against no checkpointing."""
    head = ("| checkpoint_sequential | segments | peak memory | x none | recompute | median step "
            "| x none (IQR) | samples/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        impl = r["impl"] or "none"
        lines.append(f"| {impl} | {r['segments'] or '-'} | {format_bytes(r['peak_bytes'])} | "
                     f"{r['peak_ratio']:.3f} | {_fmt(r['recompute_overhead'], '+.1%')} | "
                     f"{_time_cells(r)}")
    return "\n".join(lines)
