"""The training command: flags in, a run out, errors as one line and an exit status.

Both entry points run this module: ``python train.py`` in a checkout and ``zoo-train`` from an
installed package. They differ only in the name they speak under (usage line, message prefix).
The recipes are ``configs/`` of the checkout, or their copy inside the installed package
(``zoo/train/recipes/``, put there when the wheel is built).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_USAGE = 2  # bad input: flags, config files, run directories, checkpoints
HELP = """Train a zoo model. Every key of the config is a flag (--key value); a recipe file
    (--config FILE; by default the model's own recipe, configs/<model>.yaml, when it has one) sets
    many at once, and flags override it. --resume RUN_DIR continues a run where it stopped, in
    RUN_DIR.

    Keys: model (registry name or densenet, resnet, vit, cnn), efficient (True, False or a
    checkpoint mode), model_kwargs (the model's architecture arguments, e.g. '{depth: 2}'),
    dataset (shapes, synthetic, cifar10, cifar100), data_dir,
    image_size, train_size, test_size, workers, epochs, batch_size (global, or auto: the largest
    that fits memory_budget), memory_budget (per device, e.g. 10GB: zoo.plan checkpoints the model
    to fit), card (h100, a100, l4, rtx4090, h200: size memory_budget and batch_size auto for that
    CUDA card, predicted here), offload (True with card: the plan may keep saved tensors in host
    memory), optimizer (sgd, adamw), lr, momentum, nesterov, weight_decay, schedule (step,
    cosine, constant), milestones, gamma, warmup_iters, warmup_lr, label_smoothing, seed, device (auto,
    cpu, cuda, cuda:N), amp, compile, data_parallel, out_dir, resume, overwrite (True: a new run
    may replace the run in out_dir). See zoo/train/config.py for what each means. --debug True
    shows tracebacks. Exit status: 0 done, 1 failed (divergence, disk), 2 bad input, 130/143
    stopped by SIGINT/SIGTERM after saving.
    """


def recipes_dir() -> Path | None:
    """The folder of recipes (``<model>.yaml``): inside the installed package, else the
    checkout's ``configs/``; None when neither is there."""
    here = Path(__file__).resolve().parent
    for folder in (here / "recipes", here.parents[1] / "configs"):
        if folder.is_dir():
            return folder
    return None


def command(prog: str) -> Callable[..., None]:
    """The training command as Fire calls it (``main(*args, **flags)``), speaking as ``prog``:
    ``"train.py"`` for the script, ``"zoo-train"`` for the installed console command."""
    usage = f"python {prog}" if prog.endswith(".py") else prog

    def main(*args: Any, **flags: Any) -> None:
        debug = _debug_flag(flags)
        if flags.keys() & {"help", "h"}:
            print(f"usage: {usage} [--KEY VALUE ...]\n\n{HELP}")
            return
        try:
            _train(args, flags, usage)
        except Exception as e:  # (not SystemExit, KeyboardInterrupt)
            if debug:
                raise
            sys.exit(_report(e, prog))
        except KeyboardInterrupt:
            if debug:
                raise
            print(f"{prog}: interrupted: stopped at once, without saving; the run directory keeps "
                  f"the checkpoints it had (continue with --resume RUN_DIR)", file=sys.stderr)
            sys.exit(130)

    main.__doc__ = HELP
    return main


main = command("zoo-train")


def console() -> None:
    """The ``zoo-train`` console command."""
    import fire

    fire.Fire(main, name="zoo-train")


def _debug_flag(flags: dict[str, Any]) -> bool:
    """--debug (not a config key: it changes how errors look, not what the run computes)."""
    value = flags.pop("debug", False)
    return value is True or str(value).lower() == "true"


def _train(args: tuple[Any, ...], flags: dict[str, Any], usage: str) -> None:
    import torch.distributed as dist

    from .config import ConfigError, resolve_config, resume_target
    from .loop import fit
    from .run_dir import load_checkpoint

    if args:
        raise ConfigError(f"unexpected argument(s) {' '.join(map(str, args))}: every option is "
                          f"--key value (e.g. --epochs 3); see {usage} --help")
    try:
        resume = resume_target(flags)  # read once: its config here, its state in fit
        ckpt = load_checkpoint(str(resume)) if resume is not None else None
        cfg, sources = resolve_config(flags, recipes_dir(), ckpt and ckpt["config"])
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone speaks
            print(f"config from: {' < '.join(sources)}", flush=True)
        fit(cfg, checkpoint=ckpt)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _report(e: Exception, prog: str) -> int:
    """Print ``e`` as one line on stderr, prefixed with ``prog``; return the exit status."""
    from .config import ConfigError
    from .loop import RunStopped

    if isinstance(e, RunStopped):
        message, code = str(e), e.exit_code
    elif isinstance(e, ConfigError):
        message, code = f"error: {e}", EXIT_USAGE
    elif isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        message, code = (f"error: cannot write the run's files{where}: {e.strerror or e}; the run "
                         f"directory keeps its last complete checkpoint: make room (or fix "
                         f"permissions) and --resume it"), 1
    else:
        first = str(e).splitlines()[0] if str(e) else ""
        message, code = (f"error: {type(e).__name__}: {first}; this is a bug or an unusual "
                         f"setup: rerun with --debug True for the traceback"), 1
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)
    return code
