"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Callable, Iterator

import pytest


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    saved = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, saved[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, saved)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture
def file_size_limit() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """`with file_size_limit(n):` files may not grow past n bytes in this process (the soft limit,
    restored after): writes past it fail with EFBIG, as they fail with ENOSPC on a full disk."""
    return _file_size_limit
