"""The training loop for every image model of the zoo: one process, nn.DataParallel, or DDP.

:func:`fit` reads as the list of its named steps, each testable alone: :func:`locate_run` (which
checkpoint to resume, config drift, which directory to write), :func:`build_run` (data, model,
optimizer, restored state), :func:`run_directory` (lock, files) -- these three in
``zoo.train.run_state`` -- then :func:`train_epoch` (the step
loop, whole in one function as in nanoGPT), :func:`finish_epoch` (divergence check, evaluation),
:func:`save_epoch`. Under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK in the environment) it runs
DistributedDataParallel, gloo on CPU and nccl on GPU, with a DistributedSampler; only rank 0
prints and writes the run directory. ``batch_size`` is the global batch. One process uses the same
sampler with one replica, so a DDP run sees, step by step, the very images a single process sees.

SIGINT and SIGTERM set a flag; the loop stops at the next step boundary, saves a checkpoint that
records the position inside the epoch (so ``--resume`` continues from that very step) and raises
:class:`RunStopped` (exit 130 / 143). A non-finite training loss stops the run without saving.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from .config import ConfigError, TrainConfig, to_yaml
from .data import SeededDraws
from .run_dir import fault_point
from .run_state import (EpochStats, Run, build_run, checkpoint_state, locate_run,
                        run_directory)
from .stopping import RunStopped, StopSignal
from .setup import (Distributed, agree, all_sum, build_model, gather_floats, gather_rng,
                    lr_factor, peak_memory, ranks_identical, resolve_device,
                    setup_distributed)

__all__ = ["Distributed", "setup_distributed", "build_model", "lr_factor", "peak_memory", "fit",
           "RunStopped", "StopSignal", "Run", "locate_run", "build_run", "run_directory",
           "train_epoch", "finish_epoch", "evaluate", "save_epoch", "checkpoint_state"]

DDP_STOP_CHECK_EVERY = 10  # steps between the ranks' agreement on a stop request (one all_reduce)


# ---- step 4: one epoch of training ----

def _loader(ds: Dataset, batches: list[list[int]], cfg: TrainConfig, epoch: int,
            device: torch.device) -> DataLoader:
    # (The generator seeds the workers per epoch; augmentation draws come from SeededDraws.)
    workers = cfg.workers
    if workers is None:  # on CPU the model needs the cores; on GPU, feed it in parallel
        workers = 0 if device.type == "cpu" else min(8, (os.cpu_count() or 1) // 2)
    return DataLoader(ds, batch_sampler=batches, num_workers=workers,
                      pin_memory=device.type == "cuda", worker_init_fn=_leave_stops_to_main,
                      generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch))


def _leave_stops_to_main(_worker_id: int) -> None:
    """A DataLoader worker ignores SIGINT and SIGTERM: Ctrl-C, ``kill -- -PGID``, Slurm and
    systemd signal every process of the job, and a worker killed by one made the main process
    fail (``DataLoader worker ... is killed by signal``) before it could save the step. The main
    process stops at the step boundary and shuts its workers down itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _batches(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def _stop_requested(run: Run, stop: StopSignal, batch: int, last: bool) -> bool:
    """Whether to stop after this step; under DDP the ranks agree every few steps."""
    if not run.env.enabled:
        return stop.signum is not None
    if not last and (batch + 1) % DDP_STOP_CHECK_EVERY:
        return False
    asked = torch.tensor([float(stop.signum or 0)], device=run.device)
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    stop.signum = stop.signum or (int(asked.item()) or None)
    return stop.signum is not None


def train_epoch(run: Run, stop: StopSignal) -> EpochStats:
    """Train epoch ``run.epoch`` (from ``run.position`` if resumed inside it). On a stop request
    save a mid-epoch checkpoint at the step boundary and raise :class:`RunStopped`."""
    cfg, env, device, model = run.cfg, run.env, run.device, run.model
    pos, run.position = run.position or {}, None
    done = pos.get("batches_done", 0)
    run.sampler.set_epoch(run.epoch)
    batches = _batches(list(run.sampler), run.per_rank)
    keyed = [[(run.epoch, i) for i in b] for b in batches[done:]]  # (see SeededDraws)
    loader = _loader(SeededDraws(run.train_ds, cfg.seed), keyed, cfg, run.epoch, device)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = env.is_main  # the totals of a resumed epoch are carried by rank 0
    loss_sum = torch.tensor(pos.get("loss_sum", 0.0) if first else 0.0, dtype=torch.float64,
                            device=device)
    correct = torch.tensor(int(pos.get("correct", 0)) if first else 0, device=device)
    seen = carried = int(pos.get("seen", 0)) if first else 0  # (every rank's, before a stop)
    t0 = time.perf_counter() - pos.get("elapsed", 0.0)
    shown, lr = time.perf_counter(), run.optimizer.param_groups[0]["lr"]
    bar = tqdm(loader, desc=f"epoch {run.epoch + 1}/{cfg.epochs}", disable=not env.is_main,
               dynamic_ncols=True, file=sys.stderr, initial=done, total=len(batches))
    for batch, (x, y) in enumerate(bar, start=done):
        # ---- the step ----
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with run.autocast():
            logits = run.net(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
        run.optimizer.zero_grad(set_to_none=True)
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        lr = run.optimizer.param_groups[0]["lr"]  # this step's, before the schedule moves on
        run.scheduler.step()
        run.step += 1
        fault_point("step", run.step)
        # ---- bookkeeping ----
        loss_sum += loss.detach().double() * len(y)
        correct += (logits.detach().argmax(1) == y).sum()
        seen += len(y)
        last = batch + 1 == len(batches)  # (.item() syncs: once a second, and at the end)
        if env.is_main and (time.perf_counter() - shown > 1.0 or last):
            shown = time.perf_counter()
            mean = loss_sum.item() / max(seen, 1)
            if not env.enabled and not math.isfinite(mean):
                raise _diverged(run, mean)
            mem, _ = peak_memory(device)
            images = carried + (seen - carried) * env.world_size  # the others' as many as ours
            bar.set_postfix(loss=f"{mean:.3f}", acc=f"{correct.item() / max(seen, 1):.3f}",
                            img_s=f"{images / (time.perf_counter() - t0):.0f}",
                            mem=f"{mem / 2**20:.0f}MiB", refresh=False)
        if _stop_requested(run, stop, batch, last) and not last:
            bar.close()
            _save_mid_epoch(run, stop, batch + 1,
                            [loss_sum.item(), float(correct.item()), float(seen)],
                            time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return EpochStats(loss_sum.item(), float(correct.item()), float(seen),
                      time.perf_counter() - t0, lr)


def _save_mid_epoch(run: Run, stop: StopSignal, batches_done: int, sums: list[float],
                    elapsed: float) -> None:
    loss_sum, correct, seen = all_sum(sums, run.env, run.device)
    if not math.isfinite(loss_sum) or not _finite_weights(run.model):
        raise _diverged(run, loss_sum / max(seen, 1))
    position = {"batches_done": batches_done, "loss_sum": loss_sum, "correct": correct,
                "seen": seen, "elapsed": elapsed, "world_size": run.env.world_size}
    run.dir.save_epoch(checkpoint_state(run, gather_rng(run.env), position), False, None,
                       run.history)
    code = 128 + stop.signum if stop.signum else 130
    raise RunStopped(f"stopped by {stop.name} in epoch {run.epoch + 1} after step {run.step}: "
                     f"saved {run.dir.path / 'last.pt'} at that step; continue from there with "
                     f"--resume {run.dir.path}", code)


def _finite_weights(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _diverged(run: Run, value: float) -> RunStopped:
    kept = (f"{run.dir.path / 'last.pt'} still holds epoch {run.epoch}, the last good one"
            if run.epoch else "no checkpoint was written")
    return RunStopped(f"error: training diverged: the mean training loss is {value} in epoch "
                      f"{run.epoch + 1} (step {run.step}); the run stopped without saving it, "
                      f"{kept}. Start again with a lower --lr (now {run.cfg.lr:g}) or a warm-up "
                      f"(--warmup_iters)", 1)


# ---- step 5: the end of an epoch ----

@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, cfg: TrainConfig, env: Distributed,
             device: torch.device, autocast: Any) -> tuple[float, float]:
    """(mean loss, accuracy) on ``ds``; each rank takes every world_size-th image, no padding."""
    model.eval()
    shard = list(range(env.rank, len(ds), env.world_size))
    loader = _loader(ds, _batches(shard, max(1, cfg.batch_size // env.world_size)), cfg, 0, device)
    loss_sum = correct = count = 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    loss_sum, correct, count = all_sum([loss_sum, correct, count], env, device)
    return loss_sum / max(count, 1), correct / max(count, 1)


def finish_epoch(run: Run, stats: EpochStats) -> dict[str, Any]:
    """The epoch's metrics record: summed over ranks, checked finite (else :class:`RunStopped`,
    nothing saved), BatchNorm statistics made rank 0's, the test set evaluated."""
    env, device = run.env, run.device
    train_loss, train_correct, train_seen = all_sum(
        [stats.loss_sum, stats.correct, stats.seen], env, device)
    mean = train_loss / max(train_seen, 1)
    if not math.isfinite(mean) or not _finite_weights(run.model):
        raise _diverged(run, mean)
    mem, mem_kind = peak_memory(device)
    if env.enabled:
        for buf in run.model.buffers():  # BatchNorm statistics: rank 0's, as in the checkpoint
            dist.broadcast(buf, 0)
        mem = int(max(gather_floats(float(mem), env, device)))  # the largest rank's
    test_loss, test_acc = evaluate(run.model, run.test_ds, run.cfg, env, device, run.autocast)
    return {"epoch": run.epoch + 1, "step": run.step, "train_loss": mean,
            "train_acc": train_correct / max(train_seen, 1), "test_loss": test_loss,
            "test_acc": test_acc, "lr": stats.lr,
            "images_per_s": train_seen / stats.elapsed, "epoch_time_s": stats.elapsed,
            "peak_memory_bytes": mem, "peak_memory_kind": mem_kind}


# ---- step 6: saving ----

def save_epoch(run: Run, record: dict[str, Any]) -> None:
    """Count the epoch as done and save it: last.pt (old one -> prev.pt), best.pt when its test
    accuracy is the best so far, metrics.jsonl."""
    run.history.append(record)
    run.epoch += 1
    is_best = record["test_acc"] > run.best_acc
    run.best_acc = max(run.best_acc, record["test_acc"])
    run.dir.save_epoch(checkpoint_state(run, gather_rng(run.env), None), is_best, record,
                       run.history)


# ---- the whole run ----

def fit(cfg: TrainConfig, log: Callable[[str], None] = print,
        checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.dataset`` as ``cfg`` says; returns the run's summary.
    Raises ConfigError for bad input (nothing written) and RunStopped for an early stop.
    ``checkpoint``: what ``load_checkpoint(cfg.resume)`` returned, when the caller has read it
    already (train.py does, for its config): a large checkpoint is then read once, not twice."""
    env = setup_distributed(cfg)
    device = resolve_device(cfg, env)
    say = log if env.is_main else (lambda _msg: None)
    if cfg.batch_size != "auto" and cfg.batch_size % env.world_size:
        raise ConfigError(f"batch_size {cfg.batch_size} (the global batch) must be divisible by "
                          f"the {env.world_size} processes")
    if cfg.data_parallel and device.type != "cuda":
        raise ConfigError("--data_parallel splits batches over CUDA GPUs; none is in use here")
    # (rank 0 alone checks the run directory: every rank leaves with its refusal)
    cfg, ckpt, here = agree(env, lambda: locate_run(cfg, env, checkpoint))
    with StopSignal() as stop:
        run = build_run(cfg, env, device, say, ckpt)
        if stop.signum is not None:
            raise RunStopped(f"stopped by {stop.name} before the first step: nothing was saved, "
                             f"the run directory (if any) is unchanged", 128 + stop.signum)
        with run_directory(run, here, ckpt):
            _announce(run, resumed=ckpt is not None)
            started, epochs_done = time.perf_counter(), run.epoch
            while run.epoch < run.cfg.epochs:
                record = finish_epoch(run, train_epoch(run, stop))
                save_epoch(run, record)
                _say_epoch(run, record)
                if _stop_requested(run, stop, -1, True) and run.epoch < run.cfg.epochs:
                    raise RunStopped(f"stopped by {stop.name} after epoch {run.epoch}: "
                                     f"{run.dir.path / 'last.pt'} holds it; continue with "
                                     f"--resume {run.dir.path}", 128 + (stop.signum or 2))
            return _summarize(run, started, run.epoch - epochs_done)


def _announce(run: Run, resumed: bool) -> None:
    cfg, say = run.cfg, run.say
    params = sum(p.numel() for p in run.model.parameters())
    say(f"resolved config (saved to {run.dir.path / 'config.yaml'}):\n{to_yaml(cfg).rstrip()}")
    say(f"model {cfg.model}: {params / 1e6:.3f}M parameters, efficient={cfg.efficient!r}; "
        f"{len(run.train_ds)} training / {len(run.test_ds)} test images, {run.num_classes} "
        f"classes; device {run.device}"
        + (f", DDP over {run.env.world_size} processes" if run.env.enabled else "")
        + (f", DataParallel over {torch.cuda.device_count()} GPUs" if cfg.data_parallel else "")
        + (f"; resuming after epoch {run.epoch}" if resumed else "")
        + (f", step {run.step} (inside epoch {run.epoch + 1})" if run.position else ""))
    if run.epoch >= cfg.epochs:
        further = (f"pass --epochs N (more than {run.epoch}) to train it further"
                   if cfg.schedule == "constant" else f"its {cfg.schedule} lr schedule ends "
                   f"with them, so more --epochs would change the rates it trained with")
        say(f"nothing to do: the run already has {run.epoch} of {cfg.epochs} epochs; {further}")


def _say_epoch(run: Run, r: dict[str, Any]) -> None:
    kind = "peak CUDA memory" if r["peak_memory_kind"] == "cuda_max_allocated" \
        else "peak RSS (process)"
    run.say(f"epoch {r['epoch']}/{run.cfg.epochs}: train loss {r['train_loss']:.4f} acc "
            f"{r['train_acc']:.4f} | test loss {r['test_loss']:.4f} acc {r['test_acc']:.4f} | lr "
            f"{r['lr']:.4g} | {r['images_per_s']:.1f} images/s | {kind} "
            f"{r['peak_memory_bytes'] / 2**20:.0f} MiB | {r['epoch_time_s']:.1f}s")


def _summarize(run: Run, started: float, epochs_run: int) -> dict[str, Any]:
    in_sync = ranks_identical(run.model, run.env)
    last = run.history[-1] if run.history else None
    summary = {"model": run.cfg.model, "dataset": run.cfg.dataset, "epochs": run.cfg.epochs,
               "best_test_acc": run.best_acc, "final": last,
               "wall_time_s": time.perf_counter() - started, "run_dir": str(run.dir.path),
               "world_size": run.env.world_size, "ranks_identical": in_sync}
    run.say(f"done: {run.cfg.model} on {run.cfg.dataset}, {epochs_run} epochs in "
            f"{summary['wall_time_s']:.1f}s; best test accuracy {run.best_acc:.4f}"
            + (f", final {last['test_acc']:.4f}" if last else "")
            + (f"; weights identical on all {run.env.world_size} ranks: {in_sync}"
               if run.env.enabled else "")
            + f"; run directory {run.dir.path}")
    if not in_sync:
        run.say("WARNING: the ranks' weights differ; the checkpoint holds rank 0's")
    return summary
