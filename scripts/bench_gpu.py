"""Every GPU figure (the checkpoint's overhead, the models, the largest batch), one command:

    PYTHONPATH=. python scripts/bench_gpu.py                     # all parts, one process each
    PYTHONPATH=. python scripts/bench_gpu.py --part densenet_b64 # one part (each < 10 minutes)
    PYTHONPATH=. python scripts/bench_gpu.py --smoke             # tiny sizes on the CPU

Parts (zoo.bench.suite): overhead, overhead_graphs, densenet_b64, densenet_b256, resnet50, bert,
max_batch. Each writes ``<out_dir>/gpu_<part>_<device>.json`` (machine, torch version, command,
settings, rows, goals) and ``<out_dir>/gpu_<part>_<device>.md`` (the Markdown table for
docs/BENCHMARKS.md) and prints the table. Only argparse and the zoo (no fire): the GPU machine
has torch, torchvision and timm, nothing to install.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from zoo.bench.report import write_json
from zoo.bench.suite import PARTS, device_tag, markdown, run_part
from zoo.memory import parse_bytes

SMOKE_BUDGET = "16MB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="all", choices=("all", *PARTS),
                   help="one part, or all (each in its own process)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny models and sizes on the CPU, aot_eager compile: checks the machinery")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--out_dir", default="docs/results")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 3; smoke 1)")
    p.add_argument("--budget", default=None, help="max_batch's memory budget (default 11GB)")
    p.add_argument("--checkpoints", default=None, help="overhead parts: a comma-separated "
                   "subset of 'torch non-reentrant,torch reentrant,zoo.checkpoint' (each compiles "
                   "the 100-region chain afresh; default all)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; "
                   "smoke aot_eager)")
    return p.parse_args(argv)


def _check(args: argparse.Namespace) -> None:
    """Fill the defaults; a wrong setting is one line and exit 2."""
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.repeats = args.repeats or (2 if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.budget = parse_bytes(args.budget or (SMOKE_BUDGET if args.smoke else "11GB"))
    args.backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; on a machine without a "
                         "GPU run --smoke (tiny sizes on the CPU) or --device cpu")


def run_one(args: argparse.Namespace, part: str) -> Path:
    """Run ``part``, print its Markdown, write its JSON and Markdown; the JSON's path."""
    start = time.perf_counter()
    checkpoints = tuple(c.strip() for c in args.checkpoints.split(",")) if args.checkpoints \
        else None
    payload = run_part(part, args.device, args.smoke, args.repeats, args.warmup, args.budget,
                       args.backend, checkpoints)
    payload["wall_s"] = time.perf_counter() - start
    text = markdown(payload)
    stem = Path(args.out_dir) / f"gpu_{part}_{device_tag(payload['machine'], args.smoke)}"
    path = write_json(stem.with_suffix(".json"), payload)
    stem.with_suffix(".md").write_text(text)
    print(f"{text}\n({payload['wall_s']:.0f} s) wrote {path} and {stem.with_suffix('.md')}\n",
          flush=True)
    return path


def _without_part(argv: list[str]) -> list[str]:
    """``argv`` less its ``--part X`` / ``--part=X``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--part":
            skip = True
        elif not a.startswith("--part="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    _check(args)
    if args.part != "all":
        return [run_one(args, args.part)]
    if args.smoke:  # seconds: in this process
        return [run_one(args, part) for part in PARTS]
    rest = _without_part(sys.argv[1:])
    failed = []
    for part in PARTS:  # a process per part: fresh CUDA memory and compile caches, and one
        # part's crash does not stop the others
        if subprocess.run([sys.executable, __file__, *rest, "--part", part]).returncode:
            failed.append(part)
    if failed:
        print(f"error: part(s) {', '.join(failed)} failed (see above)", file=sys.stderr)
        sys.exit(1)
    return []


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a wrong setting: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
