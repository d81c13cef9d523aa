"""Train any image model of the zoo, on one device, on several GPUs, or under torchrun.

    python train.py --model densenet --efficient True --dataset shapes --epochs 3
    python train.py --model densenet --efficient True --dataset cifar10 --data_dir data
    torchrun --nproc_per_node 2 train.py --model resnet --dataset cifar10

The loop is ``zoo.training.fit``; this file only turns flags into a config and errors into messages.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import fire

RECIPES = Path(__file__).resolve().parent / "configs"


def main(**flags: Any) -> None:
    """Train a zoo model. Every key of the config is a flag (--key value); a recipe file
    (--config configs/NAME.yaml; by default configs/<model>.yaml when it exists) sets many at once,
    and flags override it. --resume RUN_DIR continues a run where it stopped.

    Keys: model (registry name or densenet, resnet, vit, cnn), efficient (True, False or a
    checkpoint mode), model_kwargs, dataset (shapes, synthetic, cifar10, cifar100), data_dir,
    image_size, train_size, test_size, workers, epochs, batch_size (global, or auto: the largest
    that fits memory_budget), memory_budget (per device, e.g. 10GB: zoo.plan checkpoints the model
    to fit), optimizer (sgd, adamw), lr, momentum, nesterov, weight_decay, schedule (step, cosine,
    constant), milestones, gamma, warmup_iters, warmup_lr, label_smoothing, seed, device (auto, cpu,
    cuda, cuda:N), amp, compile, data_parallel, out_dir, resume. See zoo/config.py for what each means.
    """
    if flags.keys() & {"help", "h"}:
        print(f"usage: python train.py [--KEY VALUE ...]\n\n{main.__doc__}")
        return
    import torch.distributed as dist

    from zoo.config import ConfigError, resolve_config
    from zoo.run_dir import load_checkpoint
    from zoo.training import fit

    try:
        resume = flags.get("resume")
        saved = load_checkpoint(str(resume))["config"] if resume is not None else None
        cfg, sources = resolve_config(flags, RECIPES, saved)
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone speaks
            print(f"config from: {' < '.join(sources)}", flush=True)
        fit(cfg)
    except ConfigError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("train.py: interrupted; the last finished epoch is in last.pt of the run directory, "
              "continue with --resume RUN_DIR", file=sys.stderr)
        sys.exit(130)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    fire.Fire(main)
