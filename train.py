"""Train any image model of the zoo, on one device, on several GPUs, or under torchrun.

    python train.py --model densenet --efficient True --dataset shapes --image_size 16 --epochs 3
    python train.py --model densenet --efficient True --dataset cifar10 --data_dir data
    torchrun --nproc_per_node 2 train.py --model resnet --dataset cifar10

The loop is ``zoo.train.loop.fit``; this file only turns flags into a config and errors into
messages.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import fire

RECIPES = Path(__file__).resolve().parent / "configs"
EXIT_USAGE = 2  # bad input: flags, config files, run directories, checkpoints


def _debug_flag(flags: dict[str, Any]) -> bool:
    """--debug (not a config key: it changes how errors look, not what the run computes)."""
    value = flags.pop("debug", False)
    return value is True or str(value).lower() == "true"


def main(*args: Any, **flags: Any) -> None:
    """Train a zoo model. Every key of the config is a flag (--key value); a recipe file
    (--config configs/NAME.yaml; by default configs/<model>.yaml when it exists) sets many at once,
    and flags override it. --resume RUN_DIR continues a run where it stopped, in RUN_DIR.

    Keys: model (registry name or densenet, resnet, vit, cnn), efficient (True, False or a
    checkpoint mode), model_kwargs, dataset (shapes, synthetic, cifar10, cifar100), data_dir,
    image_size, train_size, test_size, workers, epochs, batch_size (global, or auto: the largest
    that fits memory_budget), memory_budget (per device, e.g. 10GB: zoo.plan checkpoints the model
    to fit), optimizer (sgd, adamw), lr, momentum, nesterov, weight_decay, schedule (step, cosine,
    constant), milestones, gamma, warmup_iters, warmup_lr, label_smoothing, seed, device (auto, cpu,
    cuda, cuda:N), amp, compile, data_parallel, out_dir, resume, overwrite (True: a new run may
    replace the run in out_dir). See zoo/train/config.py for what each means. --debug True shows
    tracebacks. Exit status: 0 done, 1 failed (divergence, disk), 2 bad input, 130/143 stopped by
    SIGINT/SIGTERM after saving.
    """
    debug = _debug_flag(flags)
    if flags.keys() & {"help", "h"}:
        print(f"usage: python train.py [--KEY VALUE ...]\n\n{main.__doc__}")
        return
    try:
        _train(args, flags)
    except Exception as e:  # (not SystemExit, KeyboardInterrupt)
        if debug:
            raise
        sys.exit(_report(e))
    except KeyboardInterrupt:
        if debug:
            raise
        print("train.py: interrupted: stopped at once, without saving; the run directory keeps the "
              "checkpoints it had (continue with --resume RUN_DIR)", file=sys.stderr)
        sys.exit(130)


def _train(args: tuple[Any, ...], flags: dict[str, Any]) -> None:
    import torch.distributed as dist

    from zoo.train.config import ConfigError, resolve_config
    from zoo.train.run_dir import load_checkpoint
    from zoo.train.loop import fit

    if args:
        raise ConfigError(f"unexpected argument(s) {' '.join(map(str, args))}: every option is "
                          f"--key value (e.g. --epochs 3); see python train.py --help")
    try:
        resume = flags.get("resume")
        saved = load_checkpoint(str(resume))["config"] if resume is not None else None
        cfg, sources = resolve_config(flags, RECIPES, saved)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone speaks
            print(f"config from: {' < '.join(sources)}", flush=True)
        fit(cfg)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _report(e: Exception) -> int:
    """Print ``e`` as one line on stderr; return the exit status."""
    from zoo.train.config import ConfigError
    from zoo.train.loop import RunStopped

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
    print(f"train.py: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    fire.Fire(main)
