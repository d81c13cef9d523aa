"""A training run on disk: config.yaml, metrics.jsonl, last.pt, prev.pt and best.pt.

The contract is docs/training.md's *Run directories*: one run per directory
(:mod:`zoo.train.run_lock`); every file written to a temporary file, fsynced and moved over the
old one with ``os.replace``, then its directory fsynced (atomic and durable: a crash, a power
cut too, leaves the old file or the new one); a SHA-256 of each checkpoint's contents verified
on load, the replaced ``last.pt`` kept as ``prev.pt``; and the metrics of every epoch inside
the checkpoint, so resuming rewrites ``metrics.jsonl`` without losing or repeating a line.

``ZOO_FAULT=<point>:<epoch>`` SIGKILLs the process at a named point of the save path
(:data:`FAULT_POINTS`), ``ZOO_FAULT=step:<n>:SIGTERM`` signals it after optimizer step n,
``ZOO_FAULT=lock::SIGSTOP`` pauses it just before it takes the run's lock: the fault-injection
tests stop the real training process there."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError
from .run_lock import LOCK_NAME, RunLock

__all__ = ["CHECKPOINT_FORMAT", "RUN_FILES", "FAULT_POINTS", "CorruptCheckpointError",
           "atomic_write", "atomic_save", "state_digest", "RunDir", "find_checkpoint",
           "load_checkpoint", "saved_digest", "saved_epoch", "check_run_dir", "rng_state",
           "set_rng_state"]

CHECKPOINT_FORMAT = "zoo-train-2"
CHECKPOINT_KEYS = ("format", "model_name", "model_args", "model", "optimizer", "scheduler",
                   "scaler", "epoch", "step", "best_acc", "rng", "config", "history", "position")
RUN_FILES = ("config.yaml", "metrics.jsonl", "last.pt", "prev.pt", "best.pt")
FAULT_POINTS = ("tmp_written", "renamed", "metrics_appended", "step", "lock")


class CorruptCheckpointError(ConfigError):
    """A checkpoint whose contents do not match the checksum saved with it."""


def fault_point(point: str, at: int) -> None:
    """Signal this process when ``ZOO_FAULT`` is ``<point>:<at>[:<SIGNAL>]`` (default SIGKILL):
    the fault-injection tests' way to die, or be asked to stop, at one named point of a run."""
    spec = os.environ.get("ZOO_FAULT")
    if not spec:
        return
    name, number, sig = (spec.split(":") + ["", ""])[:3]
    if name == point and (not number or int(number) == at):
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL", signal.SIGTERM))


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _atomic(path: Path, write: Callable[[Any], None],
            before_replace: Callable[[], None] | None = None) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, _file_mode())  # mkstemp makes 0600; honour the umask like open() does
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(folder: Path) -> None:
    """fsync ``folder`` itself: a rename is an entry in its directory, and until the directory
    reaches the disk a crash (power, kernel) may bring back the old entry, the new file's bytes
    fsynced but unnamed. POSIX only: Windows cannot open a directory (os.replace there is
    MoveFileEx, which its file systems journal). A file system that cannot sync a directory
    (EINVAL) has nothing to flush."""
    if os.name == "nt":
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``."""
    payload = data.encode() if isinstance(data, str) else data
    _atomic(Path(path), lambda f: f.write(payload))


def _torch_save(obj: Any, f: Any) -> None:
    """``torch.save`` through memory, so that a failed write (disk full) raises the OSError
    itself, not the RuntimeError torch's zip writer makes of it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    f.write(buffer.getbuffer())


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)``, atomically."""
    _atomic(Path(path), lambda f: _torch_save(obj, f))


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` canonically: type tags, lengths, sorted dict keys, tensors by dtype, shape and
    raw bytes, scalars by ``repr`` (exact for floats)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            _feed(h, key)
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for item in obj:
            _feed(h, item)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(f"cannot checksum a {type(obj).__name__} in a checkpoint")


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's contents, ``sha256`` key excluded."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "sha256"})
    return h.hexdigest()


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


def _go_back_hint(path: Path) -> str:
    prev = path.parent / "prev.pt"
    if path.name == "last.pt" and prev.is_file():
        return f"; go back one epoch with --resume {prev}"
    return "; resume from another checkpoint of the run (prev.pt, best.pt) or start a new run"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by :class:`RunDir`, its checksum verified; a ConfigError if not."""
    path = find_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # not a torch file, truncated, foreign pickle, flipped zip bytes
        reason = str(e).splitlines()[0] if str(e) else ""
        raise CorruptCheckpointError(
            f"{str(path)!r} is not a readable training checkpoint ({type(e).__name__}: "
            f"{reason[:160]}){_go_back_hint(path)}") from e
    if isinstance(ckpt, dict) and ckpt.get("format") == "zoo-train-1":
        raise ConfigError(f"{str(path)!r} was written by an older train.py (format zoo-train-1: "
                          f"no checksum, no metrics): it cannot be resumed, but its weights load "
                          f"with model.load_state_dict(torch.load(path)['model'])")
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        raise ConfigError(f"{str(path)!r} is not a train.py run checkpoint (no "
                          f"format={CHECKPOINT_FORMAT!r}); a bare state_dict can be loaded with "
                          f"model.load_state_dict, not resumed")
    missing = [k for k in CHECKPOINT_KEYS if k not in ckpt]
    if missing:
        raise ConfigError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}; it cannot be "
                          f"resumed")
    try:
        same = ckpt.get("sha256") == state_digest(ckpt)
    except TypeError:
        same = False
    if not same:
        raise CorruptCheckpointError(f"{str(path)!r} is corrupt: its contents do not match the "
                                     f"SHA-256 saved with it{_go_back_hint(path)}")
    return ckpt


def _peek(path: str | Path) -> dict[str, Any]:
    """A checkpoint file's dict read without loading its tensors (they are memory-mapped, never
    touched), unverified; empty when the file is missing or unreadable."""
    for mmap in (True, False):  # (a file system that cannot map it: read it whole)
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception:  # (missing, or junk)
            continue
        return ckpt if isinstance(ckpt, dict) else {}
    return {}


def saved_digest(path: str | Path) -> str | None:
    """The SHA-256 a checkpoint file was saved with (None: missing or unreadable), cheaply."""
    return _peek(path).get("sha256")


def saved_epoch(path: str | Path) -> int | None:
    """The epoch a checkpoint file holds (None: missing or unreadable), cheaply."""
    epoch = _peek(path).get("epoch")
    return epoch if isinstance(epoch, int) else None


def check_run_dir(path: str | Path, resuming_here: bool, overwrite: bool) -> None:
    """Refuse, without changing anything, a run directory this run may not write into: a path
    that is a file, or (for a new run) a directory holding files, unless ``overwrite``."""
    path = Path(path)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            raise ConfigError(f"out_dir {str(path)!r} cannot be a run directory: {str(part)!r} is "
                              f"a file; choose another --out_dir")
        if part.exists():
            break
    if resuming_here or overwrite or not path.is_dir():
        return
    held = sorted(p.name for p in path.iterdir() if p.name != LOCK_NAME
                  and not (p.name.startswith(".") and p.name.endswith(".tmp")))
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{str(path)!r} already holds files ({shown}) and a new run never "
                          f"writes into another run's: continue it with --resume {path}, choose "
                          f"another --out_dir, or pass --overwrite True to replace it")


class RunDir:
    """The run's folder, locked while open. Only rank 0 writes (``enabled=False`` elsewhere makes
    every method a no-op). Use as a context manager: ``open`` on entry, ``close`` on exit."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        self.lock = RunLock(self.path)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def open(self, resuming_here: bool, overwrite: bool) -> None:
        """Create and lock the folder, check that this run may write into it, clear what a dead
        run left (temporary files) and, with ``overwrite``, the previous run's files."""
        if not self.enabled:
            return
        check_run_dir(self.path, resuming_here, overwrite)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock.acquire()
        except OSError as e:  # permissions, a read-only file system, a path too long, ...
            raise ConfigError(f"cannot write into run directory {str(self.path)!r} "
                              f"({e.strerror or e}); choose a writable --out_dir") from None
        try:
            check_run_dir(self.path, resuming_here, overwrite)  # again, now that we hold the lock
            for p in self.path.glob(".*.tmp"):
                p.unlink()
            if overwrite and not resuming_here:
                for name in RUN_FILES:
                    (self.path / name).unlink(missing_ok=True)
        except BaseException:
            self.lock.release()
            raise

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def write_config(self, text: str) -> None:
        if self.enabled:
            atomic_write(self.path / "config.yaml", text)

    def write_metrics(self, history: list[dict[str, Any]]) -> None:
        """metrics.jsonl := one line per record of ``history`` (resume: the checkpoint's)."""
        if self.enabled:
            atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in history))

    def save_epoch(self, state: dict[str, Any], is_best: bool, record: dict[str, Any] | None,
                   history: list[dict[str, Any]]) -> None:
        """Save ``state`` as last.pt (the old last.pt becomes prev.pt), copy it to best.pt when
        ``is_best``, then write metrics.jsonl with ``record`` last (None: a mid-epoch save)."""
        if not self.enabled:
            return
        epoch = state["epoch"]
        state = {"format": CHECKPOINT_FORMAT, **state}
        state["sha256"] = state_digest(state)
        last = self.path / "last.pt"

        def keep_previous() -> None:
            fault_point("tmp_written", epoch)
            if last.exists():
                _atomic(self.path / "prev.pt", lambda f: _copy_into(last, f))

        _atomic(last, lambda f: _torch_save(state, f), keep_previous)
        fault_point("renamed", epoch)
        if is_best:
            self.copy_to_best(last)
        if record is not None:
            self.write_metrics(history)
            fault_point("metrics_appended", epoch)

    def copy_to_best(self, checkpoint: Path) -> None:
        """best.pt := a copy of ``checkpoint`` (atomically)."""
        if self.enabled:
            _atomic(self.path / "best.pt", lambda f: _copy_into(checkpoint, f))


def _copy_into(src: Path, f: Any) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f)
