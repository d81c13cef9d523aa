"""Building blocks of a training run that do not train: the process group (torchrun), the device,
the model, the optimizer, the learning-rate schedule, the memory plan, the memory meter, and the
few collectives the loop needs across ranks.

``zoo.train.loop`` composes them into the loop; each is a plain function of the config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, TrainConfig
from ..models import UnknownModelError, create_model
from .run_dir import rng_state

__all__ = ["Distributed", "setup_distributed", "resolve_device", "build_model", "lr_factor",
           "plan_memory", "amp_dtype_for", "build_optimizer", "peak_memory", "all_sum",
           "gather_floats", "gather_rng", "ranks_identical", "agree"]

T = TypeVar("T")


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
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {cfg.device!r} asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); use cuda:0 .. "
                              f"cuda:{torch.cuda.device_count() - 1}")
        if env.enabled:
            device = torch.device("cuda", env.local_rank)
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError(f"device {cfg.device!r} asked for, but Apple's MPS is not available "
                              f"here (it needs macOS on Apple silicon); use --device cpu (or auto)")
    elif device.type != "cpu":
        raise ConfigError(f"device {cfg.device!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """``zoo.create_model(cfg.model, ...)``, with every failure turned into a ConfigError."""
    try:
        model = create_model(cfg.model, num_classes=num_classes, efficient=cfg.efficient,
                             **cfg.model_kwargs)
    except UnknownModelError as e:
        raise ConfigError(f"{e}; family aliases: densenet, resnet, vit, cnn") from e
    except (TypeError, ValueError) as e:
        named = any(key in str(e) for key in cfg.model_kwargs)
        fix = "; fix that value in model_kwargs or leave it out (the variant's own)" if named \
            else ""
        raise ConfigError(f"cannot build {cfg.model} with efficient={cfg.efficient!r} and "
                          f"model_kwargs={cfg.model_kwargs}: {e}{fix}") from e
    _check_image_side(cfg)
    example = getattr(model, "example_input", None)
    if example is not None and example(1).dim() != 4:
        raise ConfigError(f"{cfg.model} is not an image model; train.py trains image classifiers")
    return model


# model_kwargs keys that set the image side a model is built for (ViTs, cifar_cnn)
IMAGE_SIDE_KEYS = ("img_size", "image_size")


def _check_image_side(cfg: TrainConfig) -> None:
    """A model built for one image side (``model_kwargs: {img_size: 64}``) trained on images of
    another (``--image_size``, default 32): a ViT resamples its position embeddings and trains
    on the smaller images without a word, so the user's size was silently not used. Refused,
    naming both; the model's own default sizes are not the user's wish and are not checked."""
    side = cfg.image_size or 32
    for key in IMAGE_SIDE_KEYS:
        if key in cfg.model_kwargs and cfg.model_kwargs[key] != side:
            raise ConfigError(
                f"model_kwargs {key} {cfg.model_kwargs[key]!r} builds {cfg.model} for that "
                f"image side, but this run trains on {side} px images (--image_size, default "
                f"32); pass --image_size {cfg.model_kwargs[key]} as well, or drop {key} from "
                f"model_kwargs")


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
    """``--memory_budget``: checkpoint the model's chain so a whole training step fits
    (``zoo.plan`` with the run's optimizer, whose state and step count in the budget, and under
    ``--amp`` its autocast); with ``--batch_size auto`` first pick the largest batch that fits.
    Returns ``cfg`` with the batch resolved. ``--card``: every step is sized with that card's
    kernels and allocator (predicted here, ``zoo.memory.on_card``), and its predicted time is
    said; ``--offload``: the plan may keep segments' saved tensors in host memory (priced on
    that card; on a CPU run they stay, exactly the same step). ``--compile``: the plan is one
    ``torch.compile`` keeps (``zoo.plan(..., compiled=True)``)."""
    from ..memory import card, format_bytes, on_card, parse_bytes
    from ..planner import BudgetTooSmallError, largest_batch, plan
    from ..planner.offload_choice import largest_offload_batch

    budget = parse_bytes(cfg.memory_budget)
    optimizer = build_optimizer(cfg, model)  # the run's, made again after: no state yet
    device = next(model.parameters()).device

    def make_input(batch: int) -> torch.Tensor:  # zeros: planning draws no random numbers
        return torch.zeros(batch, 3, side, side, device=device)

    def cross_entropy(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))

    # --amp: the step's autocast, planned as it runs (on --card: CUDA's op lists, bf16)
    amp = torch.autocast(device.type, dtype=amp_dtype_for(device)) if cfg.amp \
        else contextlib.nullcontext()
    model.train()
    per_rank = cfg.batch_size // world_size if cfg.batch_size != "auto" else None
    compiled = bool(cfg.compile)
    with amp, on_card(cfg.card) if cfg.card else contextlib.nullcontext():
        if per_rank is None:
            per_rank, _ = largest_batch(model, make_input, budget, cross_entropy,
                                        optimizer=optimizer, compiled=compiled)
            if cfg.offload and per_rank >= 1:  # offload fits more: the floor it reaches
                per_rank = largest_offload_batch(model, make_input, budget, card(cfg.card),
                                                 per_rank, cross_entropy, optimizer)
        while True:
            try:
                result = plan(model, make_input(max(per_rank, 1)), budget, loss_fn=cross_entropy,
                              optimizer=optimizer, offload=cfg.offload, compiled=compiled)
                break
            except BudgetTooSmallError as e:
                if cfg.batch_size != "auto" or per_rank <= 1:
                    raise ConfigError(_too_small(cfg, budget, e, max(per_rank, 1))) from None
                # the whole step (optimizer, casts) holds a little more: down by at least
                # the share its least peak is over (a peak grows a little slower than the batch)
                per_rank = min(per_rank - 1, per_rank * budget // e.smallest)
        speed = _card_speed(cfg, model, make_input(per_rank), cross_entropy, optimizer) \
            if cfg.card else None
    if cfg.batch_size == "auto":
        cfg = dataclasses.replace(cfg, batch_size=per_rank * world_size)
        say(f"batch_size auto: {cfg.batch_size} ({per_rank} per device) is the largest batch "
            f"that fits memory_budget {format_bytes(budget)} with a planned schedule")
    where = f" on the {card(cfg.card).name} (predicted here)" if cfg.card else ""
    step = "the whole compiled step" if compiled else "the whole step"
    say(f"memory plan for memory_budget {format_bytes(budget)}{where}, {step} with "
        f"{type(optimizer).__name__}'s state and step:\n{result}")
    if speed:
        say(speed)
    return cfg


def amp_dtype_for(device: torch.device) -> torch.dtype:
    """``--amp``'s dtype: bfloat16 on the CPU and on GPUs that have it, else float16 (with a
    GradScaler)."""
    cuda = device.type == "cuda"
    return torch.float16 if cuda and not torch.cuda.is_bf16_supported() else torch.bfloat16


def _too_small(cfg: TrainConfig, budget: int, e: Exception, per_rank: int) -> str:
    """The one line for a ``--memory_budget`` no plan meets."""
    from ..memory import format_bytes
    if cfg.batch_size == "auto":
        return (f"not even a batch of 1 fits memory_budget {format_bytes(budget)} with "
                f"{cfg.model}; give a larger budget")
    kept = " that torch.compile keeps" if cfg.compile else ""
    return (f"memory_budget {format_bytes(budget)} is below the smallest peak any checkpoint "
            f"schedule{kept} of {cfg.model} reaches at batch {cfg.batch_size} with its "
            f"{cfg.optimizer} optimizer: {format_bytes(e.smallest)} ({e.smallest} bytes; plain "
            f"training needs {format_bytes(e.plain)}). Give --memory_budget {e.smallest} or "
            f"more, a smaller --batch_size, or --batch_size auto")


def _card_speed(cfg: TrainConfig, model: nn.Module, x: torch.Tensor,
                loss_fn: Callable[[torch.Tensor], torch.Tensor],
                optimizer: torch.optim.Optimizer) -> str:
    """The planned step's peak and time on ``--card``, predicted (``zoo.memory.predict_step``,
    the whole step: its optimizer, in ``--amp``'s autocast when called inside it), in words."""
    from ..memory import format_bytes, predict_step

    step = predict_step(model, x, cfg.card, loss_fn, optimizer=optimizer)
    eager = " run eagerly (compiled, inductor's kernels differ)" if cfg.compile else ""
    return (f"predicted on the {step.card.name}: a step of {x.shape[0]} per device{eager} peaks at "
            f"{format_bytes(step.peak)} and takes {1e3 * step.time.step:.1f} ms "
            f"({x.shape[0] / step.time.step:,.0f} samples/s per device)")


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


# ---- across ranks (no-ops in one process) ----

def agree(env: Distributed, step: Callable[[], T]) -> T:
    """``step()`` on every rank, and every rank fails if one does: a rank that failed raises
    its own error, the others the first failing rank's, so that they print the same line and
    exit with the same status. Some steps run on rank 0 alone (the run directory's checks, the
    download): a rank 0 that left with its error used to leave the others waiting at the next
    collective for good. One ``all_gather_object`` (the barrier after a rank-0-only step)."""
    error: BaseException | None = None
    try:
        result = step()
    except Exception as e:  # (not KeyboardInterrupt: a stop is every rank's own)
        error = e
    if not env.enabled:
        if error is not None:
            raise error
        return result
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, _picklable(error))
    first = next((e for e in every if e is not None), None)
    if first is not None:
        raise error if error is not None else first
    return result


def _picklable(error: BaseException | None) -> BaseException | None:
    """``error`` itself when it pickles (ConfigError, OSError do), else a RuntimeError that
    says it in words."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def all_sum(values: list[float], env: Distributed, device: torch.device) -> list[float]:
    """``values`` summed over the ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if env.enabled:
        dist.all_reduce(t)
    return t.tolist()


def weights_checksum(model: nn.Module) -> torch.Tensor:
    """Three sums over every floating-point tensor of the state_dict: cheap to all_gather."""
    flat = torch.cat([t.detach().double().flatten() for t in model.state_dict().values()
                      if t.is_floating_point()])
    return torch.stack([flat.sum(), flat.square().sum(),
                        (flat * torch.arange(len(flat), dtype=flat.dtype, device=flat.device)).sum()])


def ranks_identical(model: nn.Module, env: Distributed) -> bool:
    """Whether every rank ends with the same weights and buffers (a check DDP should never fail)."""
    if not env.enabled:
        return True
    mine = weights_checksum(model)
    every = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], other) for other in every)


def gather_floats(value: float, env: Distributed, device: torch.device) -> list[float]:
    """Every rank's ``value``, in rank order."""
    every = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(env.world_size)]
    dist.all_gather(every, torch.tensor(value, dtype=torch.float64, device=device))
    return [t.item() for t in every]


def gather_rng(env: Distributed) -> list[dict[str, Any]]:
    """Every rank's RNG states (rank order), so a resumed DDP run replays each rank's dropout."""
    mine = rng_state()
    if not env.enabled:
        return [mine]
    every: list[Any] = [None] * env.world_size
    dist.all_gather_object(every, mine)
    return every
