"""Training configuration: plain data (a dataclass), loaded from YAML recipes and command-line flags.

Precedence, lowest first (:func:`resolve_config`). A new run: the dataclass defaults < the
recipe file (``--config``, or else ``configs/<model>.yaml`` when the model has one) < flags.
Resuming (``--resume``, or ``resume`` in the ``--config`` file, :func:`resume_target`): the
defaults < the checkpoint's config (which holds its recipe: the model's recipe is not read
again) < the ``--config`` file, when one is given < flags; then every key that differs from the
checkpoint's, other than :data:`SAFE_ON_RESUME`, is refused (:func:`config_drift`).
An unknown key or a value of the wrong type is a :class:`ConfigError` naming the valid keys, in
files as on the command line (nanoGPT's rule: configs are plain data, unknown keys are errors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .. import _torch

__all__ = ["ConfigError", "TrainConfig", "MODEL_ALIASES", "SAFE_ON_RESUME", "resolve_model_name",
           "load_yaml", "merge", "config_keys", "to_yaml", "resolve_config", "config_drift",
           "resume_target"]

# Family aliases accepted by ``--model``: the family's flagship CIFAR model.
MODEL_ALIASES = {"densenet": "densenet_bc_100", "resnet": "resnet110", "vit": "vit_cifar",
                 "cnn": "cifar_cnn"}
# Keys a resumed run may change: they change where and how fast it runs, not what it computes
# (efficient, memory_budget, card, offload: how activations are kept, recomputed or offloaded,
# which gives the same gradients; the batch stays the saved one, --batch_size auto included;
# epochs: how far it goes, where the lr schedule keeps the past steps' rates, run_state).
SAFE_ON_RESUME = ("epochs", "device", "workers", "efficient", "memory_budget", "card", "offload",
                  "compile", "data_dir")
# Keys that say where the run lives, not what it is: never compared.
RUN_PLACE_KEYS = ("out_dir", "resume", "overwrite")


class ConfigError(ValueError):
    """Bad input to training (a flag, a config file, a dataset, a resume file). train.py prints the
    message, which says what was wrong and what to do, and exits with status 2 (no traceback)."""


@dataclass
class TrainConfig:
    """Everything a training run depends on. The defaults are the DenseNet-BC recipe (Huang et al.
    2017, as in gpleiss/efficient_densenet_pytorch's demo): SGD, Nesterov momentum 0.9, lr 0.1,
    weight decay 1e-4, batch 64, lr x0.1 at 50% and 75% of the epochs."""

    model: str = "densenet_bc_100"       # registry name or family alias (densenet, resnet, vit, cnn)
    efficient: bool | str = False        # checkpointing: True (recommended), False, or a mode name
    model_kwargs: dict = field(default_factory=dict)  # extra constructor arguments of the model
    dataset: str = "shapes"              # shapes, synthetic, cifar10, cifar100
    data_dir: str = "data"               # where CIFAR is looked for and downloaded to
    image_size: int | None = None        # resize images to this side (None: 32, the data's own)
    train_size: int | None = None        # use the first N training images (None: all)
    test_size: int | None = None         # use the first N test images (None: all)
    workers: int | None = None           # DataLoader worker processes; None: 0 on CPU, up to 8 on GPU
    epochs: int = 300
    batch_size: int | str = 64           # global batch, split over DDP processes; "auto": the
                                         # largest that fits memory_budget (zoo.plan)
    memory_budget: int | str | None = None  # bytes or "10GB" per device: zoo.plan checkpoints to fit
    card: str | None = None              # size memory_budget for this CUDA card, predicted here
                                         # (h100, a100, l4, rtx4090); training runs on --device
    offload: bool = False                # with --memory_budget and --card: the plan may keep saved
                                         # tensors in host memory where that is faster or must be
    optimizer: str = "sgd"               # sgd or adamw
    lr: float = 0.1
    momentum: float = 0.9                # SGD momentum (AdamW: beta1)
    nesterov: bool = True
    weight_decay: float = 1e-4
    schedule: str = "step"               # step, cosine or constant (stepped every iteration)
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # step: fractions of the run
    gamma: float = 0.1                   # step: lr factor at each milestone
    warmup_iters: int = 0                # iterations of warm-up before the schedule
    warmup_lr: float | None = None       # constant warm-up lr (He et al.); None: linear from 0
    label_smoothing: float = 0.0
    seed: int = 0
    device: str = "auto"                 # auto (cuda if available), cpu, cuda, cuda:1, ...
    amp: bool = False                    # autocast: bfloat16 (CPU, or GPUs with bf16), float16 + GradScaler
    compile: bool | str = False          # torch.compile: True (inductor) or a backend name
    data_parallel: bool = False          # nn.DataParallel over the visible GPUs
    out_dir: str | None = None           # run directory; None: runs/<model>-<dataset>-<time>
    resume: str | None = None            # a run directory or its last.pt/prev.pt/best.pt: continue it
    overwrite: bool = False              # a new run may replace the run files already in out_dir

    def validate(self) -> None:
        """Check values that have the right type but an impossible value."""
        if isinstance(self.batch_size, str) and self.batch_size != "auto":
            raise ConfigError(f"batch_size must be a number or 'auto', got {self.batch_size!r}")
        if self.batch_size == "auto" and self.memory_budget is None:
            raise ConfigError("--batch_size auto picks the largest batch that fits a memory budget: "
                              "give one, e.g. --memory_budget 10GB (or set a number: --batch_size 64)")
        if self.memory_budget is not None:
            from ..memory import parse_bytes
            try:
                parse_bytes(self.memory_budget)
            except ValueError as e:
                raise ConfigError(f"memory_budget: {e}") from None
        self._validate_card()
        self._validate_model_kwargs()
        positive = {"epochs": self.epochs} if self.batch_size == "auto" else {
            "epochs": self.epochs, "batch_size": self.batch_size}
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key} must be at least 1, got {value}")
        for key in ("train_size", "test_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be at least 1 (or null for the whole split), "
                                  f"got {value}")
        if self.image_size is not None and self.image_size < 8:
            raise ConfigError(f"image_size must be at least 8 (or null for 32), got {self.image_size}")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"workers must be >= 0, got {self.workers}")
        self._validate_numbers()
        if self.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.schedule not in ("step", "cosine", "constant"):
            raise ConfigError(f"schedule must be 'step', 'cosine' or 'constant', "
                              f"got {self.schedule!r}")
        if any(not 0 < m < 1 for m in self.milestones):
            raise ConfigError(f"milestones are fractions of the run in (0, 1), "
                              f"got {self.milestones}")
        if self.warmup_iters < 0:
            raise ConfigError(f"warmup_iters must be >= 0, got {self.warmup_iters}")
        if isinstance(self.compile, str):
            list_backends = _torch.dynamo().list_backends
            backends = list_backends(exclude_tags=())
            if self.compile not in backends:
                close = difflib.get_close_matches(self.compile, list_backends(), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(f"compile must be True, False or a torch.compile backend name "
                                  f"({', '.join(list_backends())}), got {self.compile!r}{hint}")
        self._validate_compile_with_budget()
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")

    def _validate_model_kwargs(self) -> None:
        """``model_kwargs`` may set a variant's architecture (``{depth: 2}``), not what train.py
        sets itself: the classes come from the dataset, checkpointing from ``--efficient``."""
        if "num_classes" in self.model_kwargs:
            raise ConfigError(f"model_kwargs cannot set num_classes "
                              f"({self.model_kwargs['num_classes']!r}): train.py sets it to the "
                              f"dataset's classes (10 for shapes and cifar10, 100 for cifar100); "
                              f"drop it from model_kwargs")
        if "efficient" in self.model_kwargs:
            raise ConfigError(f"model_kwargs cannot set efficient "
                              f"({self.model_kwargs['efficient']!r}): set it with --efficient "
                              f"(True, False or a mode name) and drop it from model_kwargs")

    def _validate_compile_with_budget(self) -> None:
        """``--compile`` with ``--memory_budget``: the plan must be one torch.compile keeps."""
        if not self.compile or self.memory_budget is None:
            return
        if self.offload:
            raise ConfigError("--offload keeps saved tensors in host memory, which a step "
                              "under torch.compile does not do (the graph keeps what it saves): "
                              "drop --compile or --offload")
        if _torch.COMPILED_RECOMPUTE_REPLAYS_UPDATES:
            raise ConfigError(f"--memory_budget with --compile plans the compiled step, which "
                              f"needs torch >= 2.9 (torch {torch.__version__}'s compiled regions "
                              f"keep each BatchNorm's output, above any plan); upgrade torch, "
                              f"or drop --compile")

    def _validate_card(self) -> None:
        """``--card``: a known card, with a memory budget to size for, that the card holds."""
        if self.offload and self.card is None:
            raise ConfigError("--offload True prices the copies on a card's host link: give "
                              "--card (e.g. --card h100) and --memory_budget")
        if self.card is None:
            return
        from ..memory import card, format_bytes, parse_bytes
        if self.memory_budget is None:
            raise ConfigError(f"--card {self.card} sizes the step for a memory budget on that card: "
                              f"give one, e.g. --memory_budget 10GB")
        try:
            target = card(self.card)
        except ValueError as e:
            raise ConfigError(f"card: {e}") from None
        if parse_bytes(self.memory_budget) > target.memory:
            raise ConfigError(f"memory_budget {self.memory_budget} is more than the "
                              f"{format_bytes(target.memory)} of a {target.name}; give a smaller one")

    def _validate_numbers(self) -> None:
        """Finite numbers in their ranges: ``--lr nan`` or ``--momentum 1.5`` never start a run."""
        floats = {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                  "gamma": self.gamma, "label_smoothing": self.label_smoothing,
                  "warmup_lr": self.warmup_lr, **{f"milestones[{i}]": m
                                                  for i, m in enumerate(self.milestones)}}
        for key, value in floats.items():
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value}")
        ranges = [("lr", self.lr, 0, None, "> 0"), ("momentum", self.momentum, 0, 1, "in [0, 1)"),
                  ("weight_decay", self.weight_decay, 0, None, ">= 0"),
                  ("gamma", self.gamma, 0, None, "> 0"),
                  ("label_smoothing", self.label_smoothing, 0, 1, "in [0, 1)"),
                  ("seed", self.seed, 0, 2**32, "in [0, 2**32)")]
        for key, value, low, high, text in ranges:
            strict_low = key in ("lr", "gamma")
            if (value <= low if strict_low else value < low) or (high is not None and value >= high):
                raise ConfigError(f"{key} must be {text}, got {value}")
        if self.warmup_lr is not None and self.warmup_lr <= 0:
            raise ConfigError(f"warmup_lr must be > 0 (or null: linear warm-up), "
                              f"got {self.warmup_lr}")


def config_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def resolve_model_name(name: str) -> str:
    """A family alias (``densenet``) -> its registry name (``densenet_bc_100``); others unchanged."""
    return MODEL_ALIASES.get(name, name)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """``value`` checked against the annotation ``tp``; ints are accepted for floats, and on the
    command line (where Fire parses ``--out_dir 7`` as an int, ``--efficient true`` as a string)
    numbers for strings and true/false strings for booleans."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            with contextlib.suppress(ConfigError):
                return _coerce(key, value, arm, from_cli)
        raise ConfigError(f"{key} must be {' or '.join(_type_name(a) for a in args)}, "
                          f"got {value!r} ({type(value).__name__})")
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r} ({type(value).__name__})")
        return [_coerce(f"{key}[{i}]", v, args[0], from_cli) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping such as {{depth: 2}} (on the command line "
                              f"--{key} '{{depth: 2}}'), got {value!r} ({type(value).__name__})")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):  # Fire leaves "nan", "inf" as strings
            with contextlib.suppress(ValueError):
                return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_cli and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def merge(base: TrainConfig, overrides: dict[str, Any], source: str,
          from_cli: bool = False) -> TrainConfig:
    """A copy of ``base`` with ``overrides`` applied, every key and value checked."""
    hints = typing.get_type_hints(TrainConfig)
    values = dataclasses.asdict(base)
    for raw_key, value in overrides.items():
        key = raw_key.replace("-", "_")
        if key not in hints:
            close = difflib.get_close_matches(key, hints, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown key {raw_key!r} in {source}{hint}; valid keys: "
                              f"{', '.join(config_keys())}")
        values[key] = _coerce(key, value, hints[key], from_cli)
    for key in ("efficient", "compile"):  # True/False however they were spelled
        if isinstance(values[key], str) and values[key].lower() in ("true", "false"):
            values[key] = values[key].lower() == "true"
    cfg = TrainConfig(**values)
    cfg.model = resolve_model_name(cfg.model)
    return cfg


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A recipe file as a dict; a missing, unreadable or non-mapping file is a ConfigError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}; "
                          f"the recipes are in configs/ (e.g. configs/densenet_bc_100.yaml)") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start}: "
                          f"{e.reason}); save it as UTF-8 YAML") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {what}; "
                          f"fix the file (keys and values, one 'key: value' a line)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of keys to values, "
                          f"got a {type(data).__name__}; valid keys: {', '.join(config_keys())}")
    return data


def to_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


def resolve_config(flags: dict[str, Any], recipes_dir: str | Path | None = None,
                   saved: dict[str, Any] | None = None) -> tuple[TrainConfig, list[str]]:
    """The run's config and where its values came from, lowest precedence first.

    ``flags``: command-line values (``config`` names a recipe file). Without ``--config`` and
    without ``saved``, the model's own recipe ``recipes_dir/<model>.yaml`` is used when it exists.
    ``saved``: the config of the run being resumed (it already includes its recipe).
    """
    flags = {k.replace("-", "_"): v for k, v in flags.items()}
    config_path = _config_path(flags.pop("config", None))
    cfg, sources = TrainConfig(), ["defaults"]
    if saved is not None:
        saved = {k: v for k, v in saved.items() if k not in RUN_PLACE_KEYS}
        cfg = merge(cfg, saved, "the resumed run's config")
        sources.append("the resumed run's config")
    elif config_path is None and recipes_dir is not None:
        model = resolve_model_name(str(flags.get("model", cfg.model)))
        recipe = Path(recipes_dir) / f"{model}.yaml"
        if recipe.is_file():
            config_path = recipe
    if config_path is not None:
        cfg = merge(cfg, load_yaml(config_path), f"config file {str(config_path)!r}")
        sources.append(str(config_path))
    if flags:
        cfg = merge(cfg, flags, "the command line", from_cli=True)
        sources.append("command line")
    cfg.validate()
    return cfg, sources


def resume_target(flags: dict[str, Any]) -> Any:
    """The run to resume: ``--resume``, else the ``resume`` key of the ``--config`` file. Either
    way its checkpoint's config goes below the file and the flags (read from the file only
    after them, it would be left out, and every key the run set refused as drift)."""
    value = flags.get("resume")
    if value is None:
        path = _config_path(flags.get("config"))
        value = load_yaml(path).get("resume") if path is not None else None
    if value is None or isinstance(value, (str, Path)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # (Fire reads --resume 7 as a number)
    raise ConfigError(f"--resume names a run directory or a checkpoint file (--resume runs/a, "
                      f"--resume runs/a/prev.pt), got {value!r}")


def _config_path(value: Any) -> str | Path | None:
    """``--config``'s value as a path: Fire gives ``True`` for a bare ``--config`` and a number
    for ``--config 7``; a flag without its file is bad input, not a crash in ``Path``."""
    if value is None or isinstance(value, (str, Path)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"--config names a recipe file (--config configs/densenet_bc_100.yaml), "
                      f"got {value!r}")


def config_drift(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, new value)} for every key, other than :data:`SAFE_ON_RESUME` and where
    the run lives, on which a resumed run's ``cfg`` differs from the ``saved`` config."""
    kept = {k: v for k, v in saved.items() if k not in RUN_PLACE_KEYS}
    old = dataclasses.asdict(merge(TrainConfig(), kept, "the resumed run's config"))
    new = dataclasses.asdict(cfg)
    return {k: (old[k], new[k]) for k in old
            if k not in SAFE_ON_RESUME + RUN_PLACE_KEYS and old[k] != new[k]}
