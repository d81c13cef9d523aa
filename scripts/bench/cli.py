"""``python scripts/benchmark.py SUBCOMMAND [--flags]``: every benchmark of the zoo behind one command.

Each subcommand is a plain function of zoo/bench/ (arguments with defaults; it prints Markdown
and writes JSON) registered in :data:`SUBCOMMANDS`, one line each; Fire turns its arguments into
flags (``python scripts/benchmark.py variants --help`` lists them). ``python scripts/benchmark.py`` alone, or
with ``--help``, lists the subcommands with the first line of each function's docstring.
``python scripts/benchmark.py SUBCOMMAND`` is the same command.

Without Fire installed (a bare GPU machine with torch, torchvision and timm only), flags are read
as Fire reads them: ``--name value``, ``--name=value``, ``--flag`` / ``--noflag`` for booleans,
values as Python literals where they parse (``64``, ``0.5``, ``True``) and strings otherwise.
"""
from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import (chain, families, gpu, model_commands, outside, overhead, planner_levels,
               planner_modes, planner_promise, planner_time, planner_vs_compile, planner_vs_uniform, plots,
               primitive, reversible)
from . import (autocast_casts, card_plan, compiled_layout, host_report, offload, planner_step,
               prediction, region_cost)

__all__ = ["SUBCOMMANDS", "usage", "main"]

SUBCOMMANDS: dict[str, Callable[..., Any]] = {
    "variants": model_commands.variants,
    "max-batch": model_commands.max_batch,
    "segments": model_commands.segments,
    "plot": plots.plot,
    "checkpoint": chain.checkpoint,
    "overhead": overhead.overhead,
    "primitive": primitive.primitive,
    "densenet": families.densenet,
    "resnet": families.resnet,
    "transformers": families.transformers,
    "autocast": autocast_casts.autocast,
    "outside": outside.outside,
    "planner": planner_vs_uniform.planner,
    "planner-modes": planner_modes.planner_modes,
    "planner-levels": planner_levels.planner_levels,
    "planner-time": planner_time.planner_time,
    "planner-vs-compile": planner_vs_compile.planner_vs_compile,
    "planner-promise": planner_promise.planner_promise,
    "planner-step": planner_step.planner_step,
    "gpu": gpu.gpu,
    "host-cost": host_report.run_host_cost,
    "region-cost": region_cost.region_cost,
    "reversible": reversible.reversible,
    "prediction": prediction.prediction,
    "card-plan": card_plan.card_plan,
    "compiled-layout": compiled_layout.compiled_layout,
    "offload": offload.offload,
}


def _summary(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.splitlines()[0] if doc else ""


def usage(prog: str = "python scripts/benchmark.py") -> str:
    """The subcommands, one line each."""
    width = max(map(len, SUBCOMMANDS)) + 2
    lines = [f"usage: {prog} SUBCOMMAND [--flags]", "",
             "Benchmarks of the zoo: memory, FLOPs and time, checkpointed or not, beside torch's,",
             "timm's and torch.compile's. Results print as Markdown and are written as JSON.", "",
             "subcommands:"]
    lines += [f"  {name:<{width}}{_summary(fn)}" for name, fn in SUBCOMMANDS.items()]
    lines += ["", f"{prog} SUBCOMMAND --help lists a subcommand's flags."]
    return "\n".join(lines)


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_flags(fn: Callable[..., Any], args: Sequence[str]) -> dict[str, Any]:
    """``args`` as keyword arguments of ``fn``, read as Fire reads flags (see the module
    docstring); a flag ``fn`` does not take is a ValueError naming the ones it does."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        negated = key.startswith("no") and key not in params and key[2:] in params
        if not arg.startswith("--") or (key not in params and not negated):
            raise ValueError(f"unexpected argument {arg!r}; the flags are "
                             f"{', '.join('--' + p for p in params)}")
        if negated:  # --noflag
            kwargs[key[2:]] = False
        elif eq:
            kwargs[key] = _literal(value)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            kwargs[key] = _literal(args[i + 1])
            i += 1
        else:
            kwargs[key] = True
        i += 1
    return kwargs


def _run(fn: Callable[..., Any], args: Sequence[str], name: str) -> None:
    try:
        import fire
    except ImportError:
        if "--help" in args or "-h" in args:
            print(f"usage: {name} [--flags]\n\n{inspect.getdoc(fn)}\n\nflags: "
                  f"{inspect.signature(fn)}")
            return
        fn(**parse_flags(fn, args))
        return
    fire.Fire(fn, command=list(args), name=name.rsplit(" ", 1)[-1],
              serialize=lambda result: None)


def main(argv: Sequence[str] | None = None, prog: str = "python scripts/benchmark.py") -> int:
    """Run the subcommand named first in ``argv`` (default ``sys.argv[1:]``); the exit status.
    A wrong value is one line on stderr and status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(prog))
        return 0
    name = args[0]
    fn = SUBCOMMANDS.get(name) or SUBCOMMANDS.get(name.replace("_", "-"))
    if fn is None:
        print(f"error: unknown subcommand {name!r}; expected one of {', '.join(SUBCOMMANDS)} "
              f"({prog} --help says what each does)", file=sys.stderr)
        return 2
    try:
        _run(fn, args[1:], f"{prog} {name}")
    except ValueError as e:  # bad model name, budget, batch size, variant: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
