"""A training run's state, and the first steps of :func:`zoo.train.loop.fit`: where the run lives
(:func:`locate_run`: the checkpoint to resume, config drift, the directory to write), what it
trains (:func:`build_run`: data, model, optimizer, schedule, restored state) and its directory
(:func:`run_directory`: lock, config, metrics), plus what a checkpoint holds
(:func:`checkpoint_state`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from .config import SAFE_ON_RESUME, ConfigError, TrainConfig, config_drift, to_yaml
from .data import build_datasets
from .run_dir import (RunDir, check_run_dir, fault_point, find_checkpoint, load_checkpoint,
                      saved_digest, saved_epoch, set_rng_state)
from .run_lock import RunLock
from .setup import (Distributed, agree, amp_dtype_for, build_model, build_optimizer,
                    lr_factor, plan_memory)

__all__ = ["Run", "EpochStats", "locate_run", "build_run", "run_directory", "checkpoint_state",
           "resume_seed"]


@dataclass
class Run:
    """Everything the steps share. ``epoch`` counts finished epochs; ``position`` is the progress
    inside epoch ``epoch`` when the run was resumed from a mid-epoch checkpoint."""

    cfg: TrainConfig
    env: Distributed
    device: torch.device
    say: Callable[[str], None]
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    amp_dtype: torch.dtype
    train_ds: Dataset
    test_ds: Dataset
    num_classes: int
    sampler: DistributedSampler
    dir: RunDir
    epoch: int = 0
    step: int = 0
    best_acc: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    position: dict[str, Any] | None = None

    @property
    def per_rank(self) -> int:
        return self.cfg.batch_size // self.env.world_size

    def autocast(self) -> Any:
        if not self.cfg.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


@dataclass
class EpochStats:
    """An epoch's training totals; ``lr`` is the rate its last step trained with (the
    optimizer already holds the next step's when the epoch ends)."""

    loss_sum: float
    correct: float
    seen: float
    elapsed: float
    lr: float


# ---- step 1: where the run lives ----

def locate_run(cfg: TrainConfig, env: Distributed, ckpt: dict | None = None
               ) -> tuple[TrainConfig, dict | None, bool]:
    """(cfg with ``out_dir`` set, the checkpoint to resume or None, whether the run continues in
    the directory it was resumed from). Refuses a changed config and a directory this run may
    not write into, before anything is built or written. ``ckpt``: ``cfg.resume``'s checkpoint
    when the caller has read it already (None: read here)."""
    here, ckpt = False, ckpt if cfg.resume else None
    if cfg.resume:
        path = find_checkpoint(cfg.resume)
        ckpt = ckpt if ckpt is not None else load_checkpoint(path)
        if ckpt["model_name"] != cfg.model:
            raise ConfigError(f"{cfg.resume!r} is a run of {ckpt['model_name']}, not {cfg.model}; "
                              f"resume it with --model {ckpt['model_name']} (or leave --model out)")
        cfg = _auto_batch_as_saved(cfg, ckpt["config"])
        drift = config_drift(ckpt["config"], cfg)
        if drift:
            changes = ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in drift.items())
            raise ConfigError(f"cannot resume {str(path)!r} with a changed {changes}: a resumed "
                              f"run may change only {', '.join(SAFE_ON_RESUME)}; drop those "
                              f"flags, or start a new run with another --out_dir")
        out_dir = Path(cfg.out_dir) if cfg.out_dir else path.parent
        here = out_dir.resolve() == path.parent.resolve()
    elif cfg.out_dir:
        out_dir = Path(cfg.out_dir)
    else:
        out_dir = Path("runs") / f"{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    if env.is_main:
        check_run_dir(out_dir, here, cfg.overwrite)
        RunLock(out_dir).refuse_if_held()
    return dataclasses.replace(cfg, out_dir=str(out_dir)), ckpt, here


def _auto_batch_as_saved(cfg: TrainConfig, saved: dict[str, Any]) -> TrainConfig:
    """``--batch_size auto`` on resume is the batch auto chose for this run (its config keeps
    the number): the same command with ``--resume`` appended continues the run, where a fresh
    search (another machine, another torch) could pick another batch and change the run."""
    if cfg.batch_size == "auto" and isinstance(saved.get("batch_size"), int):
        return dataclasses.replace(cfg, batch_size=saved["batch_size"])
    return cfg


# ---- step 2: what it trains ----

def build_run(cfg: TrainConfig, env: Distributed, device: torch.device,
              say: Callable[[str], None], ckpt: dict | None) -> Run:
    """Data, model (checked on one image), optimizer, schedule; the checkpoint's state restored."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    with torch.device("meta"):  # a bad mode or model keyword is told before any download
        build_model(cfg, num_classes=10)
    torch.manual_seed(cfg.seed)
    data = lambda: build_datasets(cfg.dataset, cfg.data_dir, cfg.train_size,  # noqa: E731
                                  cfg.test_size, image_size=cfg.image_size)
    # rank 0 downloads, the others wait and then read the files (all fail if one does)
    loaded = agree(env, data if env.is_main else lambda: None)
    if env.enabled:
        loaded = agree(env, (lambda: loaded) if env.is_main else data)
    train_ds, test_ds, num_classes = loaded
    model = build_model(cfg, num_classes).to(device)
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            raise ConfigError(f"the weights in {cfg.resume!r} do not fit {cfg.model} with "
                              f"{num_classes} classes ({str(e).splitlines()[0]})") from e
    side = cfg.image_size or 32
    try:  # fail early and clearly when the model cannot take these images
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, 3, side, side, device=device))
    except (RuntimeError, ValueError, AssertionError) as e:
        raise ConfigError(f"{cfg.model} cannot take 3x{side}x{side} images ({e}); set "
                          f"--image_size to the size it was built for (ImageNet ViTs: 224)") from e
    if cfg.memory_budget is not None:
        cfg = plan_memory(cfg, model, env.world_size, side, say)
    torch.manual_seed(cfg.seed + env.rank)  # each rank its own dropout masks

    sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=cfg.seed)
    steps_per_epoch = math.ceil(len(sampler) / (cfg.batch_size // env.world_size))
    optimizer = build_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lr_factor(cfg, cfg.epochs * steps_per_epoch))
    amp_dtype = amp_dtype_for(device)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp and amp_dtype == torch.float16)
    net: nn.Module = model
    if env.enabled:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    elif cfg.data_parallel:
        net = nn.DataParallel(model)
    if cfg.compile:  # True: the default backend (inductor); a string names another
        net = torch.compile(net, backend="inductor" if cfg.compile is True else cfg.compile)
    run = Run(cfg, env, device, say, model, net, optimizer, scheduler, scaler, amp_dtype,
              train_ds, test_ds, num_classes, sampler, RunDir(cfg.out_dir, enabled=env.is_main))
    if ckpt is not None:
        _restore(run, ckpt)
    return run


def _restore(run: Run, ckpt: dict[str, Any]) -> None:
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    if ckpt["scaler"] and run.scaler.is_enabled():  # (empty when saved without float16 AMP)
        run.scaler.load_state_dict(ckpt["scaler"])
    run.epoch, run.step, run.best_acc = ckpt["epoch"], ckpt["step"], ckpt["best_acc"]
    run.history, run.position = list(ckpt["history"]), ckpt["position"]
    if run.position is not None and run.position["world_size"] != run.env.world_size:
        raise ConfigError(f"{run.cfg.resume!r} was saved inside an epoch by "
                          f"{run.position['world_size']} processes; resume it with as many")
    _restore_rng(run, ckpt["rng"])
    _check_lr_kept(run, ckpt)


def _restore_rng(run: Run, rngs: list[dict[str, Any]]) -> None:
    """Each rank's random numbers (dropout, stochastic depth) on resume. The checkpoint holds
    one RNG state per rank that saved it. Resumed by as many processes, rank r takes state r:
    the run continues bit for bit. Resumed by another number (only at an epoch boundary), the
    saved states cannot be shared out (giving every rank rank 0's made them all draw the same
    masks): every rank r then seeds torch (CPU and CUDA), numpy and Python's ``random`` with
    :func:`resume_seed` of (``seed``, the step resumed, r), a distinct stream per rank that the
    same resume draws again."""
    if len(rngs) == run.env.world_size:
        set_rng_state(rngs[run.env.rank])
        return
    seed = resume_seed(run.cfg.seed, run.step, run.env.rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resume_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank`` in a run resumed at optimizer step ``step`` by another number
    of processes than saved it: numpy's SeedSequence hash of the three, 32 bits (what numpy's
    global generator takes), so that nearby seeds, steps and ranks give unrelated streams."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def _check_lr_kept(run: Run, ckpt: dict[str, Any]) -> None:
    """``--epochs`` on resume: the schedule is laid out over the run's steps, so other epochs
    move a step schedule's milestones and the whole cosine curve. Refused unless every step the
    run has trained or set keeps its rate: then the resumed run is the straight run of the new
    length, bit for bit (a constant schedule, or milestones still ahead in both)."""
    cfg, saved = run.cfg, ckpt["config"]["epochs"]
    if saved == cfg.epochs:
        return
    per_epoch = math.ceil(len(run.sampler) / run.per_rank)
    old = lr_factor(dataclasses.replace(cfg, epochs=saved), saved * per_epoch)
    new = lr_factor(cfg, cfg.epochs * per_epoch)
    moved = next((it for it in range(run.step + 1) if old(it) != new(it)), None)
    if moved is not None:
        raise ConfigError(
            f"cannot resume {str(cfg.resume)!r} with --epochs {cfg.epochs}: its {cfg.schedule} "
            f"lr schedule is laid out over the run's {_epochs(saved)}, and over {cfg.epochs} it "
            f"would change the learning rate the run gave step {moved + 1} ({cfg.lr * old(moved):g}"
            f" -> {cfg.lr * new(moved):g}), so it would not be a straight {cfg.epochs}-epoch run; "
            f"keep --epochs {saved}, or start a new run with another --out_dir")


def _epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


# ---- step 3: the run directory ----

@contextlib.contextmanager
def run_directory(run: Run, here: bool, ckpt: dict | None = None) -> Iterator[RunDir]:
    """Open (lock) the run directory on rank 0 for the ``with`` block: config.yaml written,
    metrics.jsonl rewritten from the checkpoint's history. Every rank fails if rank 0 does.
    ``ckpt``: the checkpoint restored, which must still be on disk once the lock is held."""
    agree(run.env, lambda: _open_run_dir(run, here, ckpt) if run.env.is_main else None)
    try:
        yield run.dir
    finally:
        run.dir.close()


def _open_run_dir(run: Run, here: bool, ckpt: dict | None) -> None:
    """Rank 0's part of :func:`run_directory`; the lock is let go again if it fails."""
    try:
        fault_point("lock", run.epoch)
        run.dir.open(here, run.cfg.overwrite)
        if here and ckpt is not None:
            _check_still_the_one_restored(run, ckpt)
        run.dir.write_config(to_yaml(run.cfg))
        run.dir.write_metrics(run.history)
        if _resumed_the_best_epoch(run):  # (a crash may have come before best.pt was copied)
            run.dir.copy_to_best(find_checkpoint(run.cfg.resume))
    except BaseException:
        run.dir.close()
        raise


def _check_still_the_one_restored(run: Run, ckpt: dict[str, Any]) -> None:
    """The run read its checkpoint before it held the lock; another run on the directory may
    have saved into it in between (it ended just before this one took the lock). Training on
    from the older state would write over that run's epochs: refuse, so the same command,
    run again, resumes from the newer one."""
    path = find_checkpoint(run.cfg.resume)
    if saved_digest(path) != ckpt["sha256"]:
        raise ConfigError(f"{str(path)!r} changed while this run was starting: another run "
                          f"saved into {str(run.dir.path)!r} after this one read it (at epoch "
                          f"{ckpt['epoch']}, step {ckpt['step']}); run the same command again "
                          f"to resume from the newer checkpoint")


def _resumed_the_best_epoch(run: Run) -> bool:
    """Whether the epoch resumed was the best and best.pt lacks it: a crash came between its
    save as last.pt and the copy. A run gone back (prev.pt) to an epoch that was the best when
    saved keeps the later, better best.pt it has: copying would lose those weights."""
    if not run.cfg.resume or run.position is not None or not run.history:
        return False
    first_best = next(r["epoch"] for r in run.history if r["test_acc"] == run.best_acc)
    held = saved_epoch(run.dir.path / "best.pt")
    return first_best == run.epoch and (held is None or held < run.epoch)


def checkpoint_state(run: Run, rngs: list[dict[str, Any]],
                     position: dict[str, Any] | None) -> dict[str, Any]:
    """What --resume needs to continue bitwise (the file format: see zoo.train.run_dir)."""
    cfg = run.cfg
    return {"model_name": cfg.model,
            "model_args": {"num_classes": run.num_classes, "efficient": cfg.efficient,
                           **cfg.model_kwargs},
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "epoch": run.epoch, "step": run.step, "best_acc": run.best_acc, "rng": rngs,
            "config": dataclasses.asdict(cfg), "history": list(run.history),
            "position": position}
