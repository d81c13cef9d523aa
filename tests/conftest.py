"""Fixtures shared by test files."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Small CPU steps run ~100x faster on one thread than on two oversubscribed ones; a module
    that measures many small steps asks for it (``pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
