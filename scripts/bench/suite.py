"""The GPU figures (the ``gpu`` subcommand, :mod:`.gpu`), in parts of < 10 minutes.

Each part measures its variants side by side in one run and returns a payload (machine,
command, settings, rows, goals) that ``gpu`` writes as JSON and as a Markdown table:

* ``overhead``: 100 tiny checkpointed regions, none / torch non-reentrant / torch reentrant /
  zoo.checkpoint, eager and compiled (:mod:`.overhead`); ``overhead_graphs``: the same, eager and
  compiled with ``mode="reduce-overhead"`` (CUDA graphs; two parts, as each compiles the chain
  afresh);
* ``densenet_b64``, ``densenet_b256``: DenseNet-BC-100 plain, zoo ``efficient=True`` eager,
  compiled plain, compiled efficient, compiled efficient with ``mode="reduce-overhead"``
  (``graphed``: CUDA graph trees, the host's cost per step one launch), torchvision
  ``memory_efficient=True``, timm
  ``set_grad_checkpointing`` (Pleiss et al. 2017's setting; batch 256 as in
  csrhddlam/pytorch-checkpoint);
* ``resnet50``: batch 256 at 224 px, plain, timm-style per-block torch checkpoint, efficient;
* ``bert``: BERT-base, batch 64, sequence 128, plain, torch per block, full recompute (``block``),
  ``selective`` (Korthikanti et al. 2022: keep the matmuls, recompute the rest);
* ``offload`` rows in ``densenet_b64``, ``resnet50`` and ``bert``: the model's whole chain in
  one ``zoo.offload`` region (saved tensors in pinned host memory, copied on a side stream),
  checked bit for bit against plain like the zoo's variants: a stream race shows as a gradient
  error;
* ``max_batch``: the largest batch within one budget (11 GB), plain against ``efficient=True``,
  DenseNet-BC-100 and BERT-base (an out-of-memory-safe search on the device capped at the
  budget, with the CPU's FakeTensorMode prediction beside it).

Every part runs in float32 and in bfloat16 autocast (:func:`precision`), rows labelled
``dtype``. Times are medians of >= 10 interleaved steps after warm-up; a variant that fails is
a row with its one-line error, and ``gpu`` then fails (:mod:`.suite_check`). ``smoke=True``
runs every part with tiny models and sizes on the CPU (compiling with the ``aot_eager``
backend) in seconds: it checks the machinery, its figures mean nothing.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zoo.memory import format_bytes
from zoo.models import ZooModel
from zoo.models.densenet import DenseNet

from .measure import measure_or_report
from .overhead import overhead_header, overhead_table, run_overhead
from .region_chain import CHECKPOINTS, REGIONS
from .report import benchmark_table, command_line, machine_info, max_batch_table
from .runs import run_max_batch
from .variants import build_variants, create

__all__ = ["PARTS", "DTYPES", "Workload", "workloads", "precision", "run_part", "device_tag",
           "markdown"]

PARTS = ("overhead", "overhead_graphs", "densenet_b64", "densenet_b256", "resnet50", "bert",
         "max_batch")
DTYPES = ("fp32", "bf16")  # float32, and bfloat16 autocast
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}  # each one's autocast dtype (None: none)
EFFICIENT = "efficient"  # stands for "zoo <the model's first checkpoint mode>"


@dataclass
class Workload:
    """One model at some batch sizes, and the variants compared on it."""

    model: str | Callable[..., ZooModel]
    batches: tuple[int, ...]
    size: int | None
    variants: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def names(self, model: ZooModel) -> list[str]:
        eff = "zoo " + model.checkpoint_modes[0]
        return [v.replace(EFFICIENT, eff) for v in self.variants]


_DENSENET = ("plain", EFFICIENT, "compiled plain", f"compiled {EFFICIENT}",
             f"graphed {EFFICIENT}", "official", "timm")
_DENSENET_B64 = (*_DENSENET, "offload")  # the whole chain's saved tensors in host memory
_TINY_DENSENET = functools.partial(DenseNet, 4, (2, 2, 2), 8, bn_size=4, compression=0.5,
                                   stem="cifar", num_classes=10)
_TINY_BERT = {"embed_dim": 32, "depth": 2, "num_heads": 2, "vocab_size": 64, "max_positions": 32}


def workloads(smoke: bool) -> dict[str, list[Workload]]:
    """The workloads of each benchmark part; ``smoke``: tiny stand-ins of the same kinds."""
    if smoke:
        return {
            "densenet_b64": [Workload(_TINY_DENSENET, (2,), 32, _DENSENET_B64)],
            "densenet_b256": [Workload(_TINY_DENSENET, (3,), 32, _DENSENET)],
            "resnet50": [Workload("resnet20", (2,), 32, ("plain", "official", EFFICIENT,
                                                         "offload"))],
            "bert": [Workload("bert_base", (2,), 16, ("plain", "official", "zoo block",
                                                     "zoo selective", "offload"), _TINY_BERT)],
            "max_batch": [Workload(_TINY_DENSENET, (), 32, ("plain", EFFICIENT)),
                          Workload("bert_base", (), 16, ("plain", EFFICIENT), _TINY_BERT)],
        }
    return {
        "densenet_b64": [Workload("densenet_bc_100", (64,), 32, _DENSENET_B64)],
        "densenet_b256": [Workload("densenet_bc_100", (256,), 32, _DENSENET)],
        "resnet50": [Workload("resnet50", (256,), 224, ("plain", "official", EFFICIENT,
                                                        "offload"))],
        "bert": [Workload("bert_base", (64,), 128, ("plain", "official", "zoo block",
                                                   "zoo selective", "offload"))],
        "max_batch": [Workload("densenet_bc_100", (), 32, ("plain", EFFICIENT)),
                      Workload("bert_base", (), 128, ("plain", EFFICIENT))],
    }


def _label(model: str | Callable[..., ZooModel]) -> str:
    return model if isinstance(model, str) else "tiny DenseNet-BC (smoke)"


def _benchmark(w: Workload, dev: torch.device, repeats: int, warmup: int,
               backend: str) -> list[dict]:
    rows: list[dict] = []
    for batch in w.batches:
        torch.manual_seed(0)
        with torch.device(dev):
            model = create(w.model, **w.kwargs)
        variants = build_variants(model, w.names(model), compile_backend=backend)
        x = model.example_input(batch, w.size)
        state = sum(p.numel() * p.element_size() for p in model.parameters())
        for row in measure_or_report(variants, x, repeats, warmup):
            # activations: the peak less parameters, their gradients and the input batch
            row.update(model=_label(w.model), size=w.size, state_bytes=2 * state
                       + x.numel() * x.element_size())
            if row.get("peak_bytes") is not None:
                row["activation_bytes"] = row["peak_bytes"] - row["state_bytes"]
            rows.append(row)
        del model, variants, x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _max_batch(w: Workload, dev: torch.device, budget: int) -> list[dict]:
    with torch.device("meta"):  # the names only: no memory, no time
        names = w.names(create(w.model, **w.kwargs))
    payload = run_max_batch(w.model, [budget], str(dev), w.size, names, **w.kwargs)
    return [dict(row, model=_label(w.model)) for row in payload["rows"]]


def precision(dev: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The precision a part's steps run in: ``fp32`` as is, ``bf16`` under
    ``torch.autocast(<device>, dtype=torch.bfloat16)`` (mixed precision, the way people train:
    the parameters, gradients and optimizer stay float32), its cache of parameters' casts off:
    one context spans the part, and no variant's casts may outlive its step into another's
    peak (the card prediction runs the same way)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown precision {dtype!r}; expected one of {', '.join(DTYPES)}")
    return contextlib.nullcontext() if dtype == "fp32" else \
        torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False)


def run_part(part: str, device: str = "cuda", smoke: bool = False, repeats: int = 10,
             warmup: int = 2, budget: int = 11 * 10**9, backend: str = "inductor",
             checkpoints: tuple[str, ...] | None = None,
             dtypes: tuple[str, ...] = DTYPES) -> dict:
    """One part (see the module docstring) in each precision of ``dtypes`` (rows labelled
    ``dtype``; goal lines prefixed with it): a JSON-ready payload with its goals.
    ``checkpoints``: the overhead parts' checkpoints (default all; ``none`` is always timed)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; expected one of {', '.join(PARTS)}")
    dev = torch.device(device)
    settings = {"part": part, "smoke": smoke, "repeats": repeats, "warmup": warmup,
                "budget_bytes": budget, "backend": backend, "dtypes": list(dtypes)}
    rows, goal_rows = [], []
    for dtype in dtypes:
        with precision(dev, dtype):
            these = _part_rows(part, dev, smoke, repeats, warmup, budget, backend, checkpoints,
                               settings)
        rows += [dict(r, dtype=dtype) for r in these]
        goal_rows += [dict(g, goal=f"{dtype}: {g['goal']}", dtype=dtype)
                      for g in goals(part, these)]
    return {"kind": "gpu_suite", "part": part, "machine": machine_info(dev),
            "command": command_line(), "date": datetime.date.today().isoformat(),
            "settings": settings, "rows": rows, "goals": goal_rows}


def _part_rows(part: str, dev: torch.device, smoke: bool, repeats: int, warmup: int,
               budget: int, backend: str, checkpoints: tuple[str, ...] | None,
               settings: dict) -> list[dict]:
    """The rows of one part in the precision the caller set."""
    device = str(dev)
    if part.startswith("overhead"):
        if part == "overhead":
            modes = ["eager", "compiled"]
        else:  # CUDA graphs need CUDA: elsewhere this part times the eager runs only
            modes = ["eager", "reduce-overhead"] if dev.type == "cuda" else ["eager"]
        chosen = ["none", *(c for c in checkpoints or CHECKPOINTS if c != "none")]
        unknown = [c for c in chosen if c not in CHECKPOINTS]
        if unknown:
            raise ValueError(f"unknown checkpoint(s) {', '.join(unknown)}; expected some of "
                             f"{', '.join(CHECKPOINTS)}")
        payload = run_overhead(device, 4 if smoke else REGIONS, repeats, warmup,
                               threads=1 if dev.type == "cpu" else None, backend=backend,
                               checkpoints=chosen, modes=modes)
        settings.update(payload["settings"])
        rows = payload["rows"]
    elif part == "max_batch":
        rows = [r for w in workloads(smoke)[part] for r in _max_batch(w, dev, budget)]
    else:
        rows = [r for w in workloads(smoke)[part]
                for r in _benchmark(w, dev, repeats, warmup, backend)]
    return rows


# -- the goals the GPU figures are held to -------------------------------------------------------
def _goal(text: str, value: float | None, limit: float, at_least: bool = False) -> dict:
    met = None if value is None else (value >= limit if at_least else value <= limit)
    return {"goal": text, "value": value, "limit": limit, "met": met}


def _find(rows: list[dict], prefix: str, batch: int | None = None) -> dict | None:
    for r in rows:
        if r["variant"].startswith(prefix) and r.get("status", "ok") == "ok" and (
                batch is None or r.get("batch_size") == batch):
            return r
    return None


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


def _best_efficient(rows: list[dict], plain: dict | None, b: int) -> list[dict]:
    """Efficient DenseNet in the best of its modes (eager, compiled, CUDA graphs) against eager
    plain: time <= 1.30x at a peak <= 0.30x."""
    modes = [r for r in (_find(rows, p, b) for p in ("zoo ", "compiled zoo", "graphed zoo"))
             if r and _ratio(r, plain, "median_s")]
    best = min(modes, key=lambda r: r["median_s"], default=None)
    name = f" ({best['variant']})" if best else ""
    return [_goal(f"b{b} efficient, best of its modes{name}: time <= 1.30x plain",
                  _ratio(best, plain, "median_s"), 1.30),
            _goal(f"b{b} efficient, best of its modes{name}: peak <= 0.30x plain",
                  _ratio(best, plain, "peak_bytes"), 0.30)]


def goals(part: str, rows: list[dict]) -> list[dict]:
    """The goal lines for ``part`` (a ratio to plain or a peer against its limit): value, limit
    and met (None: a variant failed)."""
    out: list[dict] = []
    batches = sorted({r["batch_size"] for r in rows if "batch_size" in r})
    if part.startswith("densenet"):
        for b in batches:
            plain, eff = _find(rows, "plain", b), _find(rows, "zoo ", b)
            out += [_goal(f"b{b} efficient eager time <= 1.30x plain",
                          _ratio(eff, plain, "median_s"), 1.30),
                    _goal(f"b{b} efficient eager peak <= 0.30x plain",
                          _ratio(eff, plain, "peak_bytes"), 0.30),
                    _goal(f"b{b} compiled efficient time <= 1.10x compiled plain",
                          _ratio(_find(rows, "compiled zoo", b), _find(rows, "compiled plain", b),
                                 "median_s"), 1.10),
                    *_best_efficient(rows, plain, b)]
            for peer in ("official", "timm"):
                other = _find(rows, peer, b)
                out += [_goal(f"b{b} efficient time < {peer}'s (x {peer})",
                              _ratio(eff, other, "median_s"), 1.0),
                        _goal(f"b{b} efficient peak <= {peer}'s (x {peer})",
                              _ratio(eff, other, "peak_bytes"), 1.0)]
    elif part == "resnet50":
        plain, eff = _find(rows, "plain"), _find(rows, "zoo ")
        out += [_goal("efficient time <= 1.15x plain", _ratio(eff, plain, "median_s"), 1.15),
                _goal("efficient peak <= 0.40x plain", _ratio(eff, plain, "peak_bytes"), 0.40)]
    elif part == "bert":
        plain = _find(rows, "plain")
        for mode, time_limit, saved in (("block", 1.20, 0.60), ("selective", 1.05, 0.40)):
            row = _find(rows, f"zoo {mode}")
            act = _ratio(row, plain, "activation_bytes")
            out += [_goal(f"{mode} time <= {time_limit:.2f}x plain",
                          _ratio(row, plain, "median_s"), time_limit),
                    _goal(f"{mode} activation memory >= {saved:.0%} less than plain",
                          None if act is None else 1 - act, saved, at_least=True)]
    elif part == "max_batch":
        for r in rows:
            if r["variant"] != "plain":
                out.append(_goal(f"{r['model']} {r['variant']}: largest batch >= 5x plain's in "
                                 f"{r['budget']}", r.get("batch_ratio"), 5.0, at_least=True))
    elif part.startswith("overhead"):
        for run_as in sorted({r["run_as"] for r in rows}):
            same = {r["checkpoint"]: r for r in rows if r["run_as"] == run_as}
            out.append(_goal(f"{run_as}: zoo.checkpoint extra us/region <= torch "
                             "non-reentrant's (x torch)",
                             _ratio(same.get("zoo.checkpoint"), same.get("torch non-reentrant"),
                                    "extra_us_per_region"), 1.0))
    return out


# -- Markdown ------------------------------------------------------------------------------------
def device_tag(machine: dict[str, Any], smoke: bool) -> str:
    """``h100`` for "NVIDIA H100 80GB HBM3", ``cpu`` without a GPU; ``smoke_`` in front when
    the figures are a smoke run's (file names of docs/results)."""
    gpu = machine.get("gpu")
    match = re.search(r"\b([A-Z]+\d{2,4}[A-Za-z]*)\b", gpu or "")
    tag = match.group(1).lower() if match else ("cuda" if gpu else "cpu")
    return f"smoke_{tag}" if smoke else tag


def _goal_lines(goal_rows: list[dict]) -> str:
    lines = []
    for g in goal_rows:
        state = ("n/a (a variant failed or was not run)" if g["met"] is None
                 else "met" if g["met"] else "MISSED")
        value = "-" if g["value"] is None else f"{g['value']:.3f}"
        lines.append(f"- {g['goal']}: {value} (limit {g['limit']:g}) **{state}**")
    return "\n".join(lines)


def markdown(payload: dict) -> str:
    """A part as docs/benchmarks/gpu.md shows it: device, torch, command, then per precision
    (a ``####`` heading: float32, bfloat16 autocast) its table and goal lines."""
    m, part = payload["machine"], payload["part"]
    where = m.get("gpu") or f"CPU ({m['cpu']}, {m['torch_threads']} threads)"
    smoke = " (smoke: tiny sizes, figures meaningless)" if payload["settings"]["smoke"] else ""
    cuda = f", CUDA {m['cuda']}" if m.get("cuda") else ""
    head = f"### {part}{smoke}\n{where}, torch {m['torch']}{cuda}\n`{payload['command']}`\n"
    sections = []
    for dtype in dict.fromkeys(r.get("dtype", "fp32") for r in payload["rows"]):
        rows = [r for r in payload["rows"] if r.get("dtype", "fp32") == dtype]
        goal_rows = [g for g in payload["goals"] if g.get("dtype", "fp32") == dtype]
        sections.append(f"#### {_PRECISION.get(dtype, dtype)}\n\n{_table(payload, rows)}\n\n"
                        f"{_goal_lines(goal_rows)}\n")
    return f"{head}\n" + "\n".join(sections)


_PRECISION = {"fp32": "fp32 (float32)", "bf16": "bf16 (bfloat16 autocast)"}


def _table(payload: dict, rows: list[dict]) -> str:
    part = payload["part"]
    if part.startswith("overhead"):
        return f"{overhead_header(payload)}\n\n{overhead_table(rows)}"
    if part == "max_batch":
        models = list(dict.fromkeys(r["model"] for r in rows))
        return "\n\n".join(f"**{name}**\n\n" + max_batch_table(
            [r for r in rows if r["model"] == name]) for name in models)
    table = benchmark_table(rows)
    acts = [f"{r['variant']} {format_bytes(r['activation_bytes'])}" for r in rows
            if "activation_bytes" in r]
    compiles = [f"{r['variant']} b{r['batch_size']} {r['first_step_s']:.0f} s" for r in rows
                if r["variant"].startswith(("compiled", "graphed")) and "first_step_s" in r]
    if compiles:
        table += "\n\nFirst step, compiling included: " + "; ".join(compiles)
    if part == "bert" and acts:
        table += "\n\nActivation memory (peak less parameters, gradients, input): " + \
                 "; ".join(acts)
    return table
