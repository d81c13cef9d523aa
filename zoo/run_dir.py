"""A training run on disk: config.yaml, metrics.jsonl, last.pt and best.pt, every write atomic.

Each file is written to a temporary file in the same folder and moved over the old one with
``os.replace`` (atomic on POSIX and Windows), so a crash leaves either the old file or the new one,
never half of one: a run killed mid-epoch loses at most that epoch. The checkpoint holds what
``--resume`` needs to continue bitwise: model name and constructor arguments, weights, optimizer,
scheduler and grad-scaler states, the epoch, every rank's RNG states and the resolved config.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError

__all__ = ["CHECKPOINT_FORMAT", "atomic_write", "atomic_save", "RunDir", "find_checkpoint",
           "load_checkpoint", "rng_state", "set_rng_state"]

CHECKPOINT_FORMAT = "zoo-train-1"
CHECKPOINT_KEYS = ("format", "model_name", "model_args", "model", "optimizer", "scheduler",
                   "scaler", "epoch", "step", "best_acc", "rng", "config")


def _atomic(path: Path, write: Any) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    payload = data.encode() if isinstance(data, str) else data
    _atomic(Path(path), lambda f: f.write(payload))


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically."""
    _atomic(Path(path), lambda f: torch.save(obj, f))


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, numpy, Python), in types that
    ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/last.pt``; a ConfigError when neither exists."""
    path = Path(path)
    if path.is_dir():
        path = path / "last.pt"
    if not path.is_file():
        raise ConfigError(f"nothing to resume at {str(path)!r}: expected a run directory holding "
                          f"last.pt, or a checkpoint file written by train.py")
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A training checkpoint written by :class:`RunDir`, checked to be one; ConfigError if not."""
    path = find_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # not a torch file, truncated, foreign pickle
        raise ConfigError(f"{str(path)!r} is not a readable training checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); pass a run directory or the "
                          f"last.pt/best.pt that train.py wrote") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{str(path)!r} is not a train.py run checkpoint (no "
                          f"format={CHECKPOINT_FORMAT!r}); a bare state_dict can be loaded with "
                          f"model.load_state_dict, not resumed")
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise ConfigError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}; it cannot be resumed")
    return ckpt


class RunDir:
    """The run's folder. Only rank 0 writes (``enabled=False`` elsewhere makes every method a no-op)."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def write_config(self, text: str) -> None:
        if self.enabled:
            atomic_write(self.path / "config.yaml", text)

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def keep_metrics_until(self, epoch: int) -> None:
        """Drop metric lines after ``epoch`` (epochs a crash lost after logging, before saving)."""
        if self.enabled and self.metrics_path.exists():
            kept = [r for r in self.read_metrics() if r.get("epoch", 0) <= epoch]
            atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))

    def log_metrics(self, record: dict[str, Any]) -> None:
        """Add one epoch's record (the file is rewritten whole, atomically: it is small)."""
        if self.enabled:
            lines = self.metrics_path.read_text() if self.metrics_path.exists() else ""
            atomic_write(self.metrics_path, lines + json.dumps(record) + "\n")

    def save_checkpoint(self, state: dict[str, Any], is_best: bool) -> None:
        """last.pt, and best.pt as its copy when ``is_best``."""
        if not self.enabled:
            return
        state = {"format": CHECKPOINT_FORMAT, **state}
        atomic_save(state, self.path / "last.pt")
        if is_best:
            def copy(f: Any) -> None:
                with open(self.path / "last.pt", "rb") as src:
                    shutil.copyfileobj(src, f)
            _atomic(self.path / "best.pt", copy)
