"""Every GPU figure as one command (``gpu``), in parts of < 10 minutes each.

    python scripts/benchmark.py gpu                         # all parts, one process each
    python scripts/benchmark.py gpu --part densenet_b64     # one part
    python scripts/benchmark.py gpu --smoke                 # tiny sizes on the CPU: checks the machinery
    python scripts/benchmark.py gpu --dtype bf16            # one precision (default both)
    python scripts/benchmark.py gpu --resume                # skip the parts this card has done

Parts (:mod:`bench.suite`): overhead, overhead_graphs, densenet_b64, densenet_b256,
resnet50, bert, max_batch, each in float32 and in bfloat16 autocast. Each writes
``<out_dir>/gpu_<part>_<device>.json`` (machine, torch version, command, settings, rows, goals,
problems) and ``<out_dir>/gpu_<part>_<device>.md`` (its Markdown
table) and prints the table. Nothing beyond torch, torchvision, timm and the zoo is needed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import zoo
from zoo.memory import parse_bytes

from .report import comma_list, machine_info, write_json
from .suite import DTYPES, PARTS, device_tag, markdown, run_part
from .suite_check import problems

__all__ = ["gpu", "run_one", "done", "compile_ahead"]

SMOKE_BUDGET = "16MB"
# the order of a whole run on a GPU: the parts without compiled rows first (a minute or so each),
# so a lease that ends early has them; then the ones that compile (docs/benchmarks/gpu.md)
FIRST_UNCOMPILED = ("resnet50", "bert", "max_batch", "densenet_b64", "densenet_b256",
                    "overhead", "overhead_graphs")
COMPILING = FIRST_UNCOMPILED[3:]  # the parts with compiled rows


def run_one(part: str, settings: dict[str, Any], out_dir: str | Path) -> Path:
    """Run ``part``, print its Markdown, write its JSON and Markdown; the JSON's path. What
    the part fails to hold (:func:`~bench.suite_check.problems`: a failed row, an exactness
    error, a missing precision) is written in the JSON too, and raised after (ValueError)."""
    start = time.perf_counter()
    payload = run_part(part, **settings)
    payload["wall_s"] = time.perf_counter() - start
    payload["problems"] = problems(payload)
    text = markdown(payload)
    stem = Path(out_dir) / f"gpu_{part}_{device_tag(payload['machine'], settings['smoke'])}"
    path = write_json(stem.with_suffix(".json"), payload)
    stem.with_suffix(".md").write_text(text)
    print(f"{text}\n({payload['wall_s']:.0f} s) wrote {path} and {stem.with_suffix('.md')}\n",
          flush=True)
    if payload["problems"]:
        raise ValueError(f"part {part} does not hold: " + "; ".join(payload["problems"]))
    return path


def done(part: str, out_dir: str | Path, device: str, dtypes: tuple[str, ...]) -> bool:
    """Whether ``out_dir`` holds ``part`` measured on this device with this torch, in every
    precision of ``dtypes``, holding (no problems): what ``--resume`` skips, so a short lease
    keeps what it measured and the next one goes on from there."""
    tag = device_tag(machine_info(torch.device(device)), False)
    path = Path(out_dir) / f"gpu_{part}_{tag}.json"
    if not path.exists():
        return False
    d = json.loads(path.read_text())
    return not d.get("problems") and d["machine"].get("torch") == torch.__version__ \
        and set(dtypes) <= set(d["settings"].get("dtypes", ["fp32"]))


def _each_part_apart(flags: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    """Every part but ``skip`` in a process of its own (fresh CUDA memory and in-memory
    compile state; one part's crash does not stop the others); the parts that failed."""
    failed = []
    for part in FIRST_UNCOMPILED:
        if part not in skip:
            cmd, env = _command(part, _flags(flags))
            if subprocess.run(cmd, env=env).returncode:
                failed.append(part)
    return failed


def _flags(flags: dict[str, Any]) -> list[str]:
    return [f"--{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
            for k, v in flags.items() if v is not None]


def _command(part: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``part`` in a process of its own."""
    env = dict(os.environ)  # the children import this same zoo
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(zoo.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    script = str(Path(__file__).parents[1] / "benchmark.py")
    return [sys.executable, script, "gpu", "--part", part, *args], env


def compile_ahead(parts: tuple[str, ...], dtypes: tuple[str, ...], args: list[str],
                  workers: int) -> float:
    """Compile the compiled variants of ``parts`` before they are measured: each (part,
    precision) runs once with one timed round into a scratch folder, ``workers`` processes at
    a time, and only inductor's and Triton's on-disk caches are kept (one per user, read by
    every process after). The measured runs then trace their graphs again but take the
    kernels from the caches, so the compiles of a whole run overlap instead of queueing one
    after another. A job that fails is reported and left to the measured run. Returns the
    phase's wall seconds."""
    start, running = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as scratch:
        for part in parts:
            for dtype in dtypes:
                while len([p for p in running if p[2].poll() is None]) >= workers:
                    time.sleep(1)
                cmd, env = _command(part, [*args, f"--dtype={dtype}", "--repeats=1",
                                           "--warmup=0", f"--out_dir={scratch}"])
                log = open(Path(scratch) / f"{part}_{dtype}.log", "w")  # noqa: SIM115
                running.append((part, dtype, subprocess.Popen(cmd, env=env, stdout=log,
                                                              stderr=subprocess.STDOUT), log))
        for part, dtype, proc, log in running:
            if proc.wait():
                print(f"precompile: {part} ({dtype}) exited {proc.returncode}; its measured "
                      f"run will compile from scratch", flush=True)
            log.close()
    seconds = time.perf_counter() - start
    print(f"precompile: {len(running)} runs of {', '.join(parts)} in {seconds:.0f} s, "
          f"{workers} at a time", flush=True)
    return seconds


def _every_part_here(settings: dict[str, Any], out_dir: str) -> list[str]:
    paths, wrong = [], []
    for p in PARTS:
        try:
            paths.append(str(run_one(p, settings, out_dir)))
        except ValueError as e:
            wrong.append(str(e))
    if wrong:
        raise ValueError(" | ".join(wrong))
    return paths


def gpu(part: str = "all", smoke: bool = False, device: str | None = None,
        out_dir: str = "docs/results", repeats: int | None = None, warmup: int | None = None,
        budget: str | None = None, checkpoints: str | tuple | None = None,
        backend: str | None = None, dtype: str = "both", resume: bool = False,
        precompile: int = 0) -> list[str]:
    """Every GPU figure, one part at a time (--part), each part in < 10 minutes.

    ``--part`` runs one part (overhead, overhead_graphs, densenet_b64, densenet_b256, resnet50,
    bert, max_batch); ``all`` runs each in its own process. ``--smoke``: tiny models and sizes on
    the CPU, aot_eager compile (checks the machinery; its figures mean nothing). A part that
    holds a failed row, an exactness error or a missing precision's row is written and then
    fails the command. ``--dtype`` fp32, bf16 (autocast) or both (default). ``--device``
    (default cuda; cpu with --smoke), ``--repeats`` timed rounds (10; smoke 2), ``--warmup`` (2;
    smoke 1), ``--budget`` max_batch's memory budget (11GB), ``--checkpoints`` the overhead
    parts' subset of 'torch non-reentrant,torch reentrant,zoo.checkpoint', ``--backend`` the
    torch.compile backend (inductor; smoke aot_eager). ``--resume``: skip each part already
    written in ``--out_dir`` for this device and torch, in these precisions, holding
    (:func:`done`). ``--precompile N`` (a whole run): after the parts that compile nothing,
    compile every compiled variant of the parts still to run, N processes at a time, into the
    on-disk compile caches (:func:`compile_ahead`), then measure those parts.
    """
    if part != "all" and part not in PARTS:
        raise ValueError(f"unknown part {part!r}; expected all or one of {', '.join(PARTS)}")
    dtypes = DTYPES if dtype == "both" else (dtype,)
    if any(d not in DTYPES for d in dtypes):
        raise ValueError(f"unknown --dtype {dtype!r}; expected fp32, bf16 or both")
    device = device or ("cpu" if smoke else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; on a machine without a "
                         "GPU run --smoke (tiny sizes on the CPU) or --device cpu")
    settings = {"device": device, "smoke": smoke, "repeats": repeats or (2 if smoke else 10),
                "warmup": warmup if warmup is not None else (1 if smoke else 2),
                "budget": parse_bytes(budget or (SMOKE_BUDGET if smoke else "11GB")),
                "backend": backend or ("aot_eager" if smoke else "inductor"),
                "checkpoints": tuple(comma_list(checkpoints)) if checkpoints else None,
                "dtypes": dtypes}
    if part != "all":
        if resume and done(part, out_dir, device, dtypes):
            print(f"--resume: {part} already measured here, skipped", flush=True)
            return []
        return [str(run_one(part, settings, out_dir))]
    if smoke:  # seconds: in this process, every part run before the first problem is raised
        return _every_part_here(settings, out_dir)
    skip = tuple(p for p in PARTS if resume and done(p, out_dir, device, dtypes))
    if skip:
        print(f"--resume: {', '.join(skip)} already measured here, skipped", flush=True)
    flags = {"device": device, "out_dir": out_dir, "repeats": repeats, "warmup": warmup,
             "budget": budget, "checkpoints": checkpoints, "backend": backend, "dtype": dtype}
    failed = _each_part_apart(flags, skip + COMPILING)  # kept if a lease ends during compiles
    if precompile > 0:
        compile_ahead(tuple(p for p in COMPILING if p not in skip), dtypes,
                      _flags({"device": device, "backend": backend, "checkpoints": checkpoints}),
                      precompile)
    failed += _each_part_apart(flags, skip + tuple(p for p in PARTS if p not in COMPILING))
    if failed:
        print(f"error: part(s) {', '.join(failed)} failed (see above)", file=sys.stderr)
        sys.exit(1)
    return []
