"""Per-region overhead of a checkpoint: a chain of many tiny checkpointed regions, eager and
compiled.

The chain is :mod:`.region_chain`'s (``conv`` blocks of width 8 on one 8x8 image, the
``checkpoint --small`` chain). Compared, each on its own copy of it:

* checkpoint: each of :data:`.region_chain.CHECKPOINTS` (none, torch.utils.checkpoint
  non-reentrant, torch reentrant, zoo.checkpoint);
* run as: ``eager``; ``compiled`` (``torch.compile`` of the whole chain, ``fullgraph=True``,
  static shapes); on CUDA also ``reduce-overhead`` (the same with CUDA graphs, which replay the
  whole step's kernels without host work per region).

A combination that fails (to compile, say) is reported as failed with a one-line reason and
left out of the timing, so the same command gives its figures once it works. Times: every
combination takes one step per round, in a shuffled order, after warm-up (the first, compiling
step is extra); medians and interquartile ranges as ratios to eager ``none`` in the same run, and
the extra microseconds per region, ``(t - t_none) / regions``, against ``none`` run the same way
(so a compiled checkpoint is charged only for what it adds to the compiled plain chain).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zoo import _torch

from zoo.memory import bn_count, bn_state, train_step
from zoo.memory.host import host_times

from .measure import median_iqr, one_line
from .region_chain import (BATCH, CHECKPOINTS, REGIONS, SIZE, WIDTH, Chain, chain_input,
                           make_chain, with_checkpoint)

__all__ = ["run_modes", "Combo", "build_combos", "time_combos", "overhead_rows",
           "overhead_table", "overhead_header", "run_overhead", "overhead"]


def run_modes(device: torch.device, compile: bool = True) -> list[str]:
    """``eager``, then ``compiled`` (if ``compile``), then ``reduce-overhead`` on CUDA."""
    modes = ["eager"]
    if compile:
        modes.append("compiled")
        if device.type == "cuda":
            modes.append("reduce-overhead")
    return modes


@dataclass
class Combo:
    """One checkpoint run one way, on its own copy of the chain."""

    checkpoint: str
    run_as: str
    chain: Chain
    x: torch.Tensor
    train: Callable[[], None]  # zoo.memory.train_step of the chain, run as ``run_as``
    error: str | None = None
    first_step_s: float | None = None
    bn_count_after_one_step: int | None = None
    times: list[float] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.checkpoint} ({self.run_as})"

    def step(self) -> None:
        """One training step (``zoo.memory.train_step``), the input's gradient fresh too."""
        if self.run_as == "reduce-overhead" and hasattr(torch.compiler,
                                                        "cudagraph_mark_step_begin"):
            torch.compiler.cudagraph_mark_step_begin()  # a new step: last step's outputs are free
        self.x.grad = None
        self.train()


def _compiled(chain: Chain, run_as: str, backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if run_as == "eager":
        return chain
    kwargs: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": backend}
    if run_as == "reduce-overhead":
        kwargs["mode"] = "reduce-overhead"
    return torch.compile(chain, **kwargs)


def build_combos(base: Chain, modes: Sequence[str], x: torch.Tensor,
                 checkpoints: Sequence[str] = tuple(CHECKPOINTS), backend: str = "inductor",
                 sync: Callable[[], None] = lambda: None) -> list[Combo]:
    """Every (checkpoint, run-as) combination on its own deep copy of ``base``, each taking its
    first step (where a compiled one compiles): the time it took, the largest BatchNorm
    ``num_batches_tracked`` it left (1 = statistics updated once, as without checkpoint), or the
    one-line error that stopped it."""
    combos = []
    for run_as in modes:
        for name in checkpoints:
            chain = with_checkpoint(base, name)
            forward = _compiled(chain, run_as, backend)
            combo = Combo(name, run_as, chain, x, train_step(chain, x, forward=forward))
            torch.manual_seed(0)
            sync()
            start = time.perf_counter()
            try:
                combo.step()
                sync()
            except Exception as e:  # noqa: BLE001 - reported, not raised: see module docstring
                combo.error = one_line(e)
            else:
                combo.first_step_s = time.perf_counter() - start
                combo.bn_count_after_one_step = bn_count(bn_state(chain))
            combos.append(combo)
    return combos


def time_combos(combos: Sequence[Combo], x: torch.Tensor, repeats: int, warmup: int,
                sync: Callable[[], None] = lambda: None, seed: int = 0) -> None:
    """Fill each working combination's ``times``: one step each per round, shuffled order
    (``zoo.memory.host.host_times`` on the wall clock, synchronised on CUDA); a combination
    whose step raises gets the error and no times."""
    working = [c for c in combos if c.error is None]
    steps_taken = {c.name: 1 for c in working}  # its first step: build_combos'

    def guarded(combo: Combo) -> Callable[[], None]:
        def step() -> None:
            if combo.error is not None:
                return
            steps_taken[combo.name] += 1
            try:
                combo.step()
                sync()
            except Exception as e:  # noqa: BLE001 - a later step broke: reported, not raised
                combo.error = f"step {steps_taken[combo.name]}: {one_line(e)}"
        return step

    times = host_times({c.name: guarded(c) for c in working}, repeats, warmup,
                       cuda=x.device.type == "cuda", seed=seed, clock=time.perf_counter)
    for combo in working:
        combo.times = [] if combo.error is not None else times[combo.name]


def overhead_rows(combos: Sequence[Combo], regions: int) -> list[dict[str, Any]]:
    """One JSON-ready row per combination, ratios against eager ``none`` and the extra time per
    region against ``none`` run the same way (None where that ``none`` failed)."""
    medians = {(c.checkpoint, c.run_as): statistics.median(c.times) for c in combos if c.times}
    base = medians.get(("none", "eager"))
    rows = []
    for c in combos:
        row: dict[str, Any] = {"checkpoint": c.checkpoint, "run_as": c.run_as,
                               "status": "failed" if c.error else "ok", "error": c.error,
                               "first_step_s": c.first_step_s,
                               "bn_count_after_one_step": c.bn_count_after_one_step}
        if c.times:
            median, q1, q3 = median_iqr(c.times)
            none = medians.get(("none", c.run_as))
            row.update(times_s=c.times, median_s=median, iqr_s=[q1, q3],
                       ratio_to_eager_none=median / base if base else None,
                       iqr_ratio_to_eager_none=[q1 / base, q3 / base] if base else None,
                       extra_us_per_region=(median - none) / regions * 1e6 if none else None)
        rows.append(row)
    return rows


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as the Markdown table of docs/benchmarks/checkpoint.md."""
    lines = ["| checkpoint | run as | median step | x eager none (IQR) | extra us/region vs none "
             "run the same way | BN count after 1 step | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['checkpoint']} | {r['run_as']} | - | - | - | - "
                         f"| failed: {r['error']} |")
            continue
        ratio = r["ratio_to_eager_none"]
        cell = "-" if ratio is None else "{:.2f}x ({:.2f}-{:.2f})".format(
            ratio, *r["iqr_ratio_to_eager_none"])
        extra = r["extra_us_per_region"]
        lines.append(f"| {r['checkpoint']} | {r['run_as']} | {r['median_s'] * 1e3:.2f} ms "
                     f"| {cell} | {'-' if extra is None else f'{extra:+.1f}'} "
                     f"| {r['bn_count_after_one_step']} | ok |")
    return "\n".join(lines)


def overhead_header(payload: dict[str, Any]) -> str:
    """One line naming the workload, the machine and the repeats of ``payload``."""
    s, m = payload["settings"], payload["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['torch_threads']} thread(s)"
    return (f"{s['regions']} checkpointed regions (conv-BN-ReLU-dropout-conv-BN-ReLU, width "
            f"{s['width']}, batch {s['batch_size']}, {s['size']}x{s['size']}); {where}; torch "
            f"{m['torch']}; compile backend {s['backend']}; {s['repeats']} timed rounds after "
            f"{s['warmup']} warm-up, interleaved in shuffled order")


def run_overhead(device: str = "cpu", regions: int = REGIONS, repeats: int = 31, warmup: int = 3,
                 threads: int | None = 1, compile: bool = True, backend: str = "inductor",
                 width: int = WIDTH, batch_size: int = BATCH, size: int = SIZE,
                 checkpoints: Sequence[str] = tuple(CHECKPOINTS),
                 modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole benchmark (module docstring); a JSON-ready payload with machine and command.
    ``modes``: the ways to run (default :func:`run_modes`; ``eager`` is the ratios' base)."""
    from .report import command_line, machine_info

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    base = make_chain(regions, width).to(dev)
    x = chain_input("conv", batch_size, width, size, dev)
    modes = list(modes or run_modes(dev, compile))
    if any(m != "eager" for m in modes):  # the chain's forward is one code object for every
        _torch.dynamo().reset()  # run of it: earlier compiles (other precisions) count
        # towards Dynamo's recompile limit, past which fullgraph=True fails
    if "eager" not in modes:
        modes.insert(0, "eager")
    combos = build_combos(base, modes, x, checkpoints, backend, sync)
    time_combos(combos, x, repeats, warmup, sync)
    settings = {"regions": regions, "width": width, "batch_size": batch_size, "size": size,
                "repeats": repeats, "warmup": warmup, "backend": backend, "modes": modes}
    return {"kind": "overhead", "machine": machine_info(dev), "command": command_line(),
            "settings": settings, "rows": overhead_rows(combos, regions)}


def overhead(device: str = "cpu", regions: int = REGIONS, repeats: int = 15, warmup: int = 2,
             threads: int | None = 1, compile: bool = True, backend: str = "inductor",
             json_out: str | None = None) -> list[dict[str, Any]]:
    """Each checkpoint's cost per region, eager and compiled (100 tiny regions).

    No checkpoint, torch's non-reentrant and reentrant checkpoint and zoo.checkpoint, each eager
    and compiled (``torch.compile`` of the whole chain, ``fullgraph=True``; on CUDA also
    ``mode="reduce-overhead"``, CUDA graphs), as ratios to eager no checkpoint and as extra
    microseconds per region. A combination that fails is a row with its one-line reason.
    ``--backend aot_eager`` compiles without inductor; ``--json_out`` writes the payload.
    """
    from .report import write_json

    payload = run_overhead(device, regions, repeats, warmup, threads or 1, compile, backend)
    print(f"\n{overhead_header(payload)}\n\n{overhead_table(payload['rows'])}")
    if json_out:
        print(f"\nwrote {write_json(json_out, payload)}")
    return payload["rows"]
