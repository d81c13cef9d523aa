"""Fixtures shared by test files."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n 2`` (pytest-xdist) each worker, and each process a test starts, runs
    torch on one thread: two workers of two threads each on two cores oversubscribe them, and
    small steps then run many times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n``, the tests marked slow start first (in their order), the quick ones after:
    longest first keeps the workers' last tests short, so both end together."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Small CPU steps run ~100x faster on one thread than on two oversubscribed ones; a module
    that measures many small steps asks for it (``pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
