"""One run per run directory: a lock file held for the run's whole life.

The lock is an advisory ``flock`` on ``<run dir>/train.lock``; the file also names its holder
(pid, host, start time) so that a second run can say who is in the way. The kernel drops a
``flock`` when its process dies, however it dies (SIGKILL, power-off of a client on NFS aside),
so the lock of a dead run is taken over without anyone deleting files by hand.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .config import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock; fall back to exclusive creation
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "RunBusyError", "RunLock"]

LOCK_NAME = "train.lock"


class RunBusyError(ConfigError):
    """Another live run holds the run directory."""


class RunLock:
    """``acquire()`` or a one-line :class:`RunBusyError`; ``release()`` removes the file."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(5):  # retried only when the file was replaced under us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (0 if fcntl else os.O_EXCL), 0o666)
            except FileExistsError:
                raise RunBusyError(self._busy_message()) from None
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    raise RunBusyError(self._busy_message()) from None
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # the previous holder removed the file between open and flock
                    os.close(fd)
                    continue
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(holder) + "\n").encode())
            self._fd = fd
            return
        raise RunBusyError(f"could not take the lock {str(self.path)!r}: it keeps being replaced; "
                           f"is another run starting on this directory?")

    def refuse_if_held(self) -> None:
        """A :class:`RunBusyError` now if a live run holds the lock, taking nothing: a run checks
        before it builds its data and model, so that it is not refused only after them (and
        after a download). :meth:`acquire` still decides; this only tells early."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file (or none readable): nobody to name, acquire will tell
            return
        try:
            if fcntl is None:
                raise RunBusyError(self._busy_message())
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise RunBusyError(self._busy_message()) from None
        finally:
            os.close(fd)  # (closing drops the shared lock taken to look)

    def _busy_message(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
            who = f"pid {holder['pid']} on host {holder['host']} (since {holder['since']})"
        except (OSError, ValueError, KeyError, TypeError):
            who = "another process"
        return (f"run directory {str(self.path.parent)!r} is in use by {who}, lock file "
                f"{str(self.path)!r}; wait for that run to end, or train into another --out_dir")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # (closing drops the flock)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
