"""How a run stops early on purpose: SIGINT/SIGTERM turned into a flag the loop checks at safe
points (Slurm and Kubernetes send SIGTERM before they kill), and the exception that tells
train.py what is on disk and which exit status to give (130/143 for signals, 1 for divergence).
"""
from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["RunStopped", "StopSignal"]


class RunStopped(Exception):
    """The run stopped before its last epoch on purpose (signal, divergence); the message says
    what is on disk, ``exit_code`` is what train.py exits with."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopSignal:
    """While entered, SIGINT and SIGTERM only set ``signum``: the loop stops at a safe point.
    A second Ctrl-C raises KeyboardInterrupt at once (the atomic writes keep files whole)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"
