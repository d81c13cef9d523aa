"""Compare checkpoint implementations on a chain of conv-BN-ReLU blocks.

    python scripts/bench_checkpoint.py                       # CPU, exact memory via MemTracker
    python scripts/bench_checkpoint.py --device cuda         # CUDA max_memory_allocated
    python scripts/bench_checkpoint.py --small               # 100 tiny blocks, 1 thread: the
                                                             # per-region cost of each checkpoint
    python scripts/bench_checkpoint.py --overhead            # the same 100 tiny regions, eager
                                                             # and compiled: time per region only

Modes, each checkpointing every block on its own: no checkpoint; torch.utils.checkpoint reentrant
and non-reentrant; zoo.checkpoint with plain nn.BatchNorm2d; zoo.checkpoint with cp_BatchNorm2d.
For each: peak memory, FLOPs (FlopCounterMode, forward + backward), median step time as a ratio to
no checkpoint (modes interleaved step by step in shuffled order, so machine noise hits all
alike), and the BatchNorm
statistics error against the plain run after the same steps.

``--overhead`` times the 100 tiny regions of ``--small`` only (zoo.bench.overhead): no checkpoint,
torch's non-reentrant and reentrant checkpoint and zoo.checkpoint, each eager and compiled
(``torch.compile`` of the whole chain, ``fullgraph=True``; on CUDA also
``mode="reduce-overhead"``, CUDA graphs), as ratios to eager no checkpoint and as extra
microseconds per region. A combination that fails is reported failed with its one-line reason.
"""
from __future__ import annotations

import copy
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import fire
import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

import zoo
from zoo.bench.overhead import make_chain, overhead_header, overhead_table, run_overhead
from zoo.bench.report import write_json
from zoo.memory import count_flops, cpu_peak_bytes, cuda_peak_bytes, format_bytes

Runner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def per_block(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Runner:
    def run(chain: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for block in chain:
            x = wrap(block, x)
        return x
    return run


MODES: dict[str, tuple[Runner, bool]] = {  # name -> (runner, use cp_BatchNorm2d)
    "no checkpoint": (lambda chain, x: chain(x), False),
    "torch reentrant": (per_block(lambda b, x: torch_checkpoint.checkpoint(
        b, x, use_reentrant=True)), False),
    "torch non-reentrant": (per_block(lambda b, x: torch_checkpoint.checkpoint(
        b, x, use_reentrant=False)), False),
    "zoo.checkpoint": (per_block(zoo.checkpoint), False),
    "zoo.checkpoint + cp_BatchNorm2d": (per_block(zoo.checkpoint), True),
}


def markdown_table(rows: list[dict]) -> str:
    """The rows of :func:`main` (or of its JSON) as the Markdown table of docs/BENCHMARKS.md."""
    lines = ["| mode | peak memory | vs none | FLOPs vs none | median step | vs none (IQR) "
             "| BN running stats max error | num_batches_tracked |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["time_iqr_ratio"]
        lines.append(
            f"| {r['mode']} | {format_bytes(r['peak_bytes'])} | {r['peak_ratio']:.2f}x "
            f"| {r['flops_ratio']:.2f}x | {r['median_s'] * 1e3:.1f} ms | {r['time_ratio']:.2f}x "
            f"({lo:.2f}-{hi:.2f}) | {r['bn_stats_error']:.3g} "
            f"| {r['num_batches_tracked']} (plain: {rows[0]['num_batches_tracked']}) |")
    return "\n".join(lines)


def main(device: str = "cpu", blocks: int = 12, width: int = 32, batch_size: int = 32,
         size: int = 32, steps: int = 3, repeats: int = 15, warmup: int = 2,
         threads: int | None = None, small: bool = False, overhead: bool = False,
         regions: int = 100, compile: bool = True, backend: str = "inductor",
         json_out: str | None = None) -> list[dict]:
    """Run every mode and print a Markdown table (and JSON to ``json_out`` if given).

    ``small`` sets 100 blocks of width 8 on one 8x8 image and one CPU thread: the kernels take
    microseconds, so the step time is mostly the checkpoint's own per-region work (what a GPU
    run of a model with many small layers pays on the host). ``threads`` sets torch's CPU threads.
    ``overhead``: time ``regions`` such regions only, eager and (``compile``) compiled with
    ``backend`` (see zoo.bench.overhead).
    """
    if overhead:
        payload = run_overhead(device, regions, repeats, warmup, threads or 1, compile, backend)
        print(f"\n{overhead_header(payload)}\n\n{overhead_table(payload['rows'])}")
        if json_out:
            print(f"\nwrote {write_json(json_out, payload)}")
        return payload["rows"]
    if small:
        blocks, width, batch_size, size, threads = 100, 8, 1, 8, threads or 1
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    base = make_chain(blocks, width).to(dev)
    x = torch.randn(batch_size, width, size, size, device=dev, requires_grad=True)
    # reentrant checkpoint needs an input that requires grad to train anything (seed 001); give
    # every mode the same one so the comparison is fair.
    nets, steppers = {}, {}
    for name, (runner, cp_bn) in MODES.items():
        net = copy.deepcopy(base)
        if cp_bn:
            zoo.nn.convert_batchnorm(net)
        nets[name] = net
        steppers[name] = (lambda n, r: lambda: r(n, x).square().mean().backward())(net, runner)

    # BatchNorm statistics after `steps` identical training steps (same seed per step).
    for name, net in nets.items():
        for s in range(steps):
            torch.manual_seed(s)
            steppers[name]()
    ref = nets["no checkpoint"]
    rows = []
    for name, net in nets.items():
        pairs = [(m, r) for m, r in zip(net.modules(), ref.modules()) if isinstance(m, nn.BatchNorm2d)]
        err = max(max((m.running_mean - r.running_mean).abs().max().item(),
                      (m.running_var - r.running_var).abs().max().item()) for m, r in pairs)
        rows.append({"mode": name, "bn_stats_error": err,
                     "num_batches_tracked": int(pairs[0][0].num_batches_tracked)})

    for row in rows:
        net, step = nets[row["mode"]], steppers[row["mode"]]
        net.zero_grad(set_to_none=True)
        if cuda:
            row["peak_bytes"] = cuda_peak_bytes(step, dev)[0]
        else:
            row["peak_bytes"] = cpu_peak_bytes(step, track=(net,))
        net.zero_grad(set_to_none=True)
        row["flops"] = count_flops(step)

    # Interleaved timing: one step of each mode per round, in a shuffled order.
    times: dict[str, list[float]] = {r["mode"]: [] for r in rows}
    for i in range(warmup + repeats):
        order = list(steppers)
        random.Random(i).shuffle(order)  # no mode always runs right after another
        for name in order:
            step = steppers[name]
            nets[name].zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(dev)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    base_row = rows[0]
    base_time = statistics.median(times[base_row["mode"]])
    for row in rows:
        ts = times[row["mode"]]
        row["median_s"] = statistics.median(ts)
        row["time_ratio"] = row["median_s"] / base_time
        quartiles = statistics.quantiles(ts, n=4)[::2] if len(ts) > 1 else [ts[0], ts[0]]
        row["time_iqr_ratio"] = [q / base_time for q in quartiles]
        row["peak_ratio"] = row["peak_bytes"] / base_row["peak_bytes"]
        row["flops_ratio"] = row["flops"] / base_row["flops"]

    machine = (torch.cuda.get_device_name(dev) if cuda
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"\nChain of {blocks} conv-BN-ReLU-dropout-conv-BN-ReLU blocks, width {width}, batch "
          f"{batch_size}, {size}x{size}; device {machine}; torch {torch.__version__}; "
          f"{repeats} timed steps after {warmup} warm-up, modes interleaved in shuffled order\n")
    print(markdown_table(rows))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__,
                       "machine": machine, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    fire.Fire(main, serialize=lambda rows: None)
