"""The training loop for every image model of the zoo: one process, nn.DataParallel, or DDP.

:func:`fit` holds the whole loop, step included, in one place (nanoGPT's directness); the helpers
above it build what it needs. Under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK in the environment) it
runs DistributedDataParallel, gloo on CPU and nccl on GPU, with a DistributedSampler; only rank 0
prints and writes the run directory. ``batch_size`` is the global batch. One process uses the same
sampler with one replica, so a DDP run sees, step by step, the very images a single process sees.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from .config import ConfigError, TrainConfig, to_yaml
from .data import build_datasets
from .models import UnknownModelError, create_model
from .run_dir import RunDir, find_checkpoint, load_checkpoint, rng_state, set_rng_state

__all__ = ["Distributed", "setup_distributed", "build_model", "lr_factor", "peak_memory", "fit"]


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: TrainConfig) -> Distributed:
    """Join the process group that torchrun describes in the environment (none: one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Distributed()
    if cfg.data_parallel:
        raise ConfigError("--data_parallel and torchrun do not mix: under torchrun every process "
                          "already drives one device (DistributedDataParallel); drop --data_parallel")
    env = Distributed(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return env


def resolve_device(cfg: TrainConfig, env: Distributed) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", env.local_rank if env.enabled else torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(cfg.device)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {cfg.device!r}: {e}; use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {cfg.device!r} asked for, but CUDA is not available here; "
                              f"use --device cpu (or auto)")
        if env.enabled:
            device = torch.device("cuda", env.local_rank)
    return device


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """``zoo.create_model(cfg.model, ...)``, with every failure turned into a ConfigError."""
    try:
        model = create_model(cfg.model, num_classes=num_classes, efficient=cfg.efficient,
                             **cfg.model_kwargs)
    except UnknownModelError as e:
        raise ConfigError(f"{e}; family aliases: densenet, resnet, vit, cnn") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot build {cfg.model} with efficient={cfg.efficient!r} and "
                          f"model_kwargs={cfg.model_kwargs}: {e}") from e
    example = getattr(model, "example_input", None)
    if example is not None and example(1).dim() != 4:
        raise ConfigError(f"{cfg.model} is not an image model; train.py trains image classifiers")
    return model


def lr_factor(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate at optimizer step ``it`` as a factor of ``cfg.lr`` (for LambdaLR, stepped
    every iteration): warm-up (constant ``warmup_lr`` as He et al. 2016 for ResNet-110, or linear
    from 0), then ``step`` (``gamma`` at each milestone fraction), ``cosine`` (to 0) or ``constant``."""
    milestones = [round(m * total_steps) for m in cfg.milestones]

    def factor(it: int) -> float:
        if it < cfg.warmup_iters:
            return cfg.warmup_lr / cfg.lr if cfg.warmup_lr is not None else (it + 1) / cfg.warmup_iters
        if cfg.schedule == "step":
            return cfg.gamma ** sum(it >= m for m in milestones)
        if cfg.schedule == "cosine":
            span = max(1, total_steps - cfg.warmup_iters)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (it - cfg.warmup_iters) / span)))
        return 1.0

    return factor


def plan_memory(cfg: TrainConfig, model: nn.Module, world_size: int, side: int,
                say: Callable[[str], None]) -> TrainConfig:
    """``--memory_budget``: checkpoint the model's chain so a training step fits (``zoo.plan``);
    with ``--batch_size auto`` first pick the largest batch that fits. Returns ``cfg`` with the
    batch resolved. The optimizer's state (SGD momentum: one copy of the parameters, AdamW two)
    is taken off the budget first: the planner counts parameters, gradients and activations."""
    from .memory import format_bytes, parse_bytes
    from .planner import BudgetTooSmallError, largest_batch, plan, solve_profile

    budget = parse_bytes(cfg.memory_budget)
    copies = 2 if cfg.optimizer == "adamw" else int(cfg.momentum > 0)
    state = copies * sum(p.numel() * p.element_size() for p in model.parameters())
    room = budget - state
    if room <= 0:
        raise ConfigError(f"memory_budget {format_bytes(budget)} does not even hold the optimizer's "
                          f"state ({format_bytes(state)}); give a larger budget")
    device = next(model.parameters()).device

    def make_input(batch: int) -> torch.Tensor:  # zeros: planning draws no random numbers
        return torch.zeros(batch, 3, side, side, device=device)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))

    amp = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.amp and device.type == "cpu" \
        else contextlib.nullcontext()  # (CUDA AMP: planned in float32, a safe over-estimate)
    model.train()
    with amp:
        if cfg.batch_size == "auto":
            per_rank, profile = largest_batch(model, make_input, room, loss_fn)
            if per_rank == 0:
                raise ConfigError(f"not even a batch of 1 fits memory_budget "
                                  f"{format_bytes(budget)} with {cfg.model}; give a larger budget")
            cfg = dataclasses.replace(cfg, batch_size=per_rank * world_size)
            say(f"batch_size auto: {cfg.batch_size} ({per_rank} per device) is the largest batch "
                f"that fits memory_budget {format_bytes(budget)} with a planned schedule")
            result = solve_profile(profile, room)
            model.set_checkpoint_plan(result.segments)
        else:
            try:
                result = plan(model, make_input(cfg.batch_size // world_size), room,
                              loss_fn=loss_fn)
            except BudgetTooSmallError as e:
                least = e.smallest + state
                raise ConfigError(
                    f"memory_budget {format_bytes(budget)} is below the smallest peak any "
                    f"checkpoint schedule of {cfg.model} reaches at batch {cfg.batch_size}: "
                    f"{format_bytes(least)} ({least} bytes, of which {format_bytes(state)} "
                    f"optimizer state; plain training needs {format_bytes(e.plain + state)}). "
                    f"Give --memory_budget {least} or more, a smaller --batch_size, or "
                    f"--batch_size auto") from None
    say(f"memory plan for memory_budget {format_bytes(budget)} ({format_bytes(state)} optimizer "
        f"state, {format_bytes(room)} for the step):\n{result}")
    return cfg


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.momentum, 0.999),
                             weight_decay=cfg.weight_decay)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): CUDA max_memory_allocated since the last reset, or on CPU the
    process's peak resident set size since it started (getrusage: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "cpu_peak_rss"


def _loader(ds: Dataset, batch: int, sampler: Any, cfg: TrainConfig, epoch: int,
            device: torch.device) -> DataLoader:
    # The generator seeds the workers' RNGs (augmentation) per epoch, so a resumed run repeats them.
    workers = cfg.workers
    if workers is None:  # on CPU the model needs the cores; on GPU, feed it in parallel
        workers = 0 if device.type == "cpu" else min(8, (os.cpu_count() or 1) // 2)
    return DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == "cuda",
                      generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))


def _all_sum(values: list[float], env: Distributed, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if env.enabled:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, cfg: TrainConfig, env: Distributed,
             device: torch.device, autocast: Any) -> tuple[float, float]:
    """(mean loss, accuracy) on ``ds``; each rank takes every world_size-th image, no padding."""
    model.eval()
    shard = range(env.rank, len(ds), env.world_size)
    loader = _loader(ds, max(1, cfg.batch_size // env.world_size), list(shard), cfg, 0, device)
    loss_sum = correct = count = 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    loss_sum, correct, count = _all_sum([loss_sum, correct, count], env, device)
    return loss_sum / max(count, 1), correct / max(count, 1)


def _weights_checksum(model: nn.Module) -> torch.Tensor:
    flat = torch.cat([t.detach().double().flatten() for t in model.state_dict().values()
                      if t.is_floating_point()])
    return torch.stack([flat.sum(), flat.square().sum(),
                        (flat * torch.arange(len(flat), dtype=flat.dtype, device=flat.device)).sum()])


def _ranks_identical(model: nn.Module, env: Distributed) -> bool:
    """Whether every rank ends with the same weights and buffers (a check DDP should never fail)."""
    if not env.enabled:
        return True
    mine = _weights_checksum(model)
    every = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every)


def fit(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` as ``cfg`` says; returns the run's summary."""
    env = setup_distributed(cfg)
    device = resolve_device(cfg, env)
    say = log if env.is_main else (lambda _msg: None)
    if cfg.batch_size != "auto" and cfg.batch_size % env.world_size:
        raise ConfigError(f"batch_size {cfg.batch_size} (the global batch) must be divisible by the "
                          f"{env.world_size} processes")
    if cfg.data_parallel and device.type != "cuda":
        raise ConfigError("--data_parallel splits batches over CUDA GPUs; none is in use here")
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    if ckpt is not None and ckpt["model_name"] != cfg.model:
        raise ConfigError(f"{cfg.resume!r} is a run of {ckpt['model_name']}, not {cfg.model}; "
                          f"resume it with --model {ckpt['model_name']} (or leave --model out)")
    if cfg.out_dir:
        out_dir = Path(cfg.out_dir)
    elif cfg.resume:  # continue writing into the resumed run's directory
        out_dir = find_checkpoint(cfg.resume).parent
    else:
        out_dir = Path("runs") / f"{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = dataclasses.replace(cfg, out_dir=str(out_dir))
    if ckpt is None and (out_dir / "last.pt").exists():
        raise ConfigError(f"{str(out_dir)!r} already holds a run (last.pt): continue it with "
                          f"--resume {out_dir}, or choose another --out_dir")

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if env.is_main:  # rank 0 downloads, the others wait and then read the files
        train_ds, test_ds, num_classes = build_datasets(cfg.dataset, cfg.data_dir, cfg.train_size,
                                                        cfg.test_size, image_size=cfg.image_size)
    if env.enabled:
        dist.barrier()
    if not env.is_main:
        train_ds, test_ds, num_classes = build_datasets(cfg.dataset, cfg.data_dir, cfg.train_size,
                                                        cfg.test_size, image_size=cfg.image_size)
    model = build_model(cfg, num_classes).to(device)
    if ckpt is not None:
        try:
            model.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            raise ConfigError(f"the weights in {cfg.resume!r} do not fit {cfg.model} with "
                              f"{num_classes} classes ({str(e).splitlines()[0]}); was it trained "
                              f"on another dataset or with other model_kwargs?") from e
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

    per_rank = cfg.batch_size // env.world_size
    sampler = DistributedSampler(train_ds, num_replicas=env.world_size, rank=env.rank,
                                 shuffle=True, seed=cfg.seed)
    steps_per_epoch = math.ceil(len(sampler) / per_rank)
    optimizer = build_optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, cfg.epochs * steps_per_epoch))
    amp_dtype = (torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported()
                 else torch.float16)
    scaler = torch.amp.GradScaler("cuda", enabled=cfg.amp and amp_dtype == torch.float16)

    def autocast() -> Any:
        if not cfg.amp:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=amp_dtype)

    start_epoch, step, best_acc = 0, 0, -1.0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"] and scaler.is_enabled():  # (empty when saved without float16 AMP)
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step, best_acc = ckpt["epoch"], ckpt["step"], ckpt["best_acc"]
        rngs = ckpt["rng"]
        set_rng_state(rngs[env.rank] if len(rngs) == env.world_size else rngs[0])

    net: nn.Module = model
    if env.enabled:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    elif cfg.data_parallel:
        net = nn.DataParallel(model)
    if cfg.compile:
        net = torch.compile(net)

    run = RunDir(out_dir, enabled=env.is_main)
    run.write_config(to_yaml(cfg))
    run.keep_metrics_until(start_epoch)
    params = sum(p.numel() for p in model.parameters())
    say(f"resolved config (saved to {out_dir / 'config.yaml'}):\n{to_yaml(cfg).rstrip()}")
    say(f"model {cfg.model}: {params / 1e6:.3f}M parameters, efficient={cfg.efficient!r}; "
        f"{len(train_ds)} training / {len(test_ds)} test images, {num_classes} classes; device "
        f"{device}" + (f", DDP over {env.world_size} processes" if env.enabled else "")
        + (f", DataParallel over {torch.cuda.device_count()} GPUs" if cfg.data_parallel else "")
        + (f"; resuming after epoch {start_epoch}" if ckpt is not None else ""))

    if start_epoch >= cfg.epochs:
        say(f"nothing to do: the run already has {start_epoch} of {cfg.epochs} epochs; pass "
            f"--epochs N (more than {start_epoch}) to train it further")
    history, started = [], time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        loader = _loader(train_ds, per_rank, sampler, cfg, epoch, device)
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen, t0 = 0, time.perf_counter()
        shown = t0 - 1.0
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not env.is_main,
                   dynamic_ncols=True, file=sys.stderr)
        for x, y in bar:
            # ---- the step ----
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                logits = net(x)
                loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            # ---- bookkeeping ----
            loss_sum += loss.detach().double() * len(y)
            correct += (logits.detach().argmax(1) == y).sum()
            seen += len(y)
            if env.is_main and time.perf_counter() - shown > 1.0:  # (.item() syncs: once a second)
                shown = time.perf_counter()
                mem, _ = peak_memory(device)
                bar.set_postfix(loss=f"{loss_sum.item() / seen:.3f}",
                                acc=f"{correct.item() / seen:.3f}",
                                img_s=f"{seen * env.world_size / (time.perf_counter() - t0):.0f}",
                                mem=f"{mem / 2**20:.0f}MiB", refresh=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        train_loss, train_correct, train_seen = _all_sum(
            [loss_sum.item(), float(correct.item()), float(seen)], env, device)
        mem, mem_kind = peak_memory(device)
        if env.enabled:
            for buf in model.buffers():  # BatchNorm statistics: rank 0's, as in the checkpoint
                dist.broadcast(buf, 0)
            mem = int(max(_gather_floats(float(mem), env, device)))  # the largest rank's
        test_loss, test_acc = evaluate(model, test_ds, cfg, env, device, autocast)
        record = {"epoch": epoch + 1, "step": step, "train_loss": train_loss / train_seen,
                  "train_acc": train_correct / train_seen, "test_loss": test_loss,
                  "test_acc": test_acc, "lr": optimizer.param_groups[0]["lr"],
                  "images_per_s": train_seen / elapsed, "epoch_time_s": elapsed,
                  "peak_memory_bytes": mem, "peak_memory_kind": mem_kind}
        history.append(record)
        is_best = test_acc > best_acc
        best_acc = max(best_acc, test_acc)
        rngs = _gather_rng(env)
        run.save_checkpoint({
            "model_name": cfg.model, "model_args": {"num_classes": num_classes,
                                                    "efficient": cfg.efficient, **cfg.model_kwargs},
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "epoch": epoch + 1, "step": step, "best_acc": best_acc, "rng": rngs,
            "config": dataclasses.asdict(cfg), "metrics": record}, is_best)
        run.log_metrics(record)
        mem_label = "peak CUDA memory" if mem_kind == "cuda_max_allocated" else "peak RSS (process)"
        say(f"epoch {epoch + 1}/{cfg.epochs}: train loss {record['train_loss']:.4f} acc "
            f"{record['train_acc']:.4f} | test loss {test_loss:.4f} acc {test_acc:.4f} | lr "
            f"{record['lr']:.4g} | {record['images_per_s']:.1f} images/s | {mem_label} "
            f"{mem / 2**20:.0f} MiB | {elapsed:.1f}s")

    in_sync = _ranks_identical(model, env)
    summary = {"model": cfg.model, "dataset": cfg.dataset, "epochs": cfg.epochs,
               "best_test_acc": best_acc, "final": history[-1] if history else None,
               "wall_time_s": time.perf_counter() - started, "run_dir": str(out_dir),
               "world_size": env.world_size, "ranks_identical": in_sync}
    say(f"done: {cfg.model} on {cfg.dataset}, {len(history)} epochs in "
        f"{summary['wall_time_s']:.1f}s; best test accuracy {best_acc:.4f}"
        + (f", final {history[-1]['test_acc']:.4f}" if history else "")
        + (f"; weights identical on all {env.world_size} ranks: {in_sync}" if env.enabled else "")
        + f"; run directory {out_dir}")
    if not in_sync:
        say("WARNING: the ranks' weights differ; the checkpoint holds rank 0's")
    return summary


def _gather_floats(value: float, env: Distributed, device: torch.device) -> list[float]:
    every = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(env.world_size)]
    dist.all_gather(every, torch.tensor(value, dtype=torch.float64, device=device))
    return [t.item() for t in every]


def _gather_rng(env: Distributed) -> list[dict[str, Any]]:
    """Every rank's RNG states (rank order), so a resumed DDP run replays each rank's dropout."""
    mine = rng_state()
    if not env.enabled:
        return [mine]
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, mine)
    return every
