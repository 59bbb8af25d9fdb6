"""Test-session setup: 8 fake CPU devices and a persistent compile cache, set before jax imports."""

import contextlib
import gc
import os
import resource
import signal
from collections.abc import Callable, Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

_cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402

# Tracing and lowering allocate millions of short-lived objects; with CPython's default thresholds
# (700, 10, 10) the collector runs every 700 net allocations and walks the whole heap as often as
# every 70,000. The objects alive now (jax's modules among them) are frozen out of it and the young
# generation may grow: ~6% less CPU time in a cold run of tests/model/test_generation.py +
# test_batch_split.py (user time 102.7 + 110.6 s against 112.3 + 116.1 s, interleaved).
gc.freeze()
gc.set_threshold(50_000, 50, 1_000)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test module's `SLOW_CASES` (parametrization ids, fixture parameters included, such as
    "regular-ep4") are marked `slow`: the way to keep one combination of a fixture's and a test's
    parameters out of the default suite, which `pytest.param(marks=...)` cannot express."""
    for item in items:
        slow_cases = getattr(item.module, "SLOW_CASES", ())
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.id in slow_cases:
            item.add_marker(pytest.mark.slow)


@contextlib.contextmanager
def _file_size_limit(nbytes: int) -> Iterator[None]:
    saved = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
    # The compile cache is read but not written meanwhile: a program compiled under the limit would
    # leave a truncated entry that every later run reads, warns about and compiles again.
    min_entry = jax.config.jax_persistent_cache_min_entry_size_bytes
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 2**62)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, saved[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, saved)
        signal.signal(signal.SIGXFSZ, handler)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_entry)


@pytest.fixture
def file_size_limit() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """`with file_size_limit(n):` files may not grow past n bytes in this process (the soft limit,
    restored after): writes past it fail with EFBIG, as they fail with ENOSPC on a full disk."""
    return _file_size_limit
