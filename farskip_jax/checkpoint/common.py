"""Helpers shared by the checkpoint readers and writers: nested parameter paths, problem lists, fast
layout copies, and the converters' block-wise positional I/O."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

import numpy as np

from farskip_jax.checkpoint.hf_io import CheckpointError
from farskip_jax.checkpoint.hf_keys import param_specs
from farskip_jax.config import ConfigError, ModelConfig

MAX_LISTED = 20


def nest_set(tree: dict, path: tuple, value: Any) -> None:
    """tree[path[0]][path[1]]... = value, creating the intermediate dicts."""
    node = tree
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def nest_get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def deep_merge(into: dict, other: dict) -> dict:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        else:
            into[k] = v
    return into


def raise_problems(what: str, problems: list[str]) -> None:
    """Raises one CheckpointError listing every problem found in `what` (the first MAX_LISTED)."""
    if problems:
        listed = "\n  - ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"{len(problems)} problem(s) in {what}:\n  - {listed}{more}")


def model_shardings(cfg: ModelConfig, mesh: Any) -> dict:
    """NamedShardings for every parameter of `cfg` as a pure dict, from the project's one table
    (`parallel.mesh`, EP layout): routed experts split on their leading axis over mesh axis
    'expert', everything else replicated."""
    import jax

    from farskip_jax.parallel.mesh import param_shardings

    ep = dict(mesh.shape).get("expert", 1)
    if cfg.n_routed_experts % ep:
        raise ConfigError(f"mesh axis expert={ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    abstract: dict = {}
    for s in param_specs(cfg):
        nest_set(abstract, s.path, jax.ShapeDtypeStruct(s.shape, np.float32))
    return param_shardings(abstract, mesh)


# --------------------------------------------------------------------------------------------
# Fast layout copies (the converters' CPU cost is almost all transposes)


def bits(a: np.ndarray) -> np.ndarray:
    """`a` viewed as unsigned ints of its width: numpy copies bfloat16 (an ml_dtypes type) through
    a slow generic loop (0.36 GB/s for a transposed assignment, 3.2 GB/s as uint16)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _as_2d(*arrays: np.ndarray) -> list[np.ndarray] | None:
    """The same-shape `arrays` as 2-D views (no copy), axes merged as (first, rest) or (all but
    last, last), whichever works for all; None if neither does."""
    a = arrays[0]
    for shape in ((a.shape[0], -1), (-1, a.shape[-1])) if a.ndim > 1 else ():
        views = []
        for x in arrays:
            v = x.view()
            try:
                v.shape = shape  # raises instead of copying
            except AttributeError:
                break
            views.append(v)
        else:
            return views
    return None


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src for a C-contiguous `dst` and a same-shape `src` of any strides (a transpose
    view, typically). A transposed copy in one numpy call runs at 0.3 GB/s when the source rows
    are 4 KiB apart (cache-set conflicts: 2048 bf16 columns); copied in tiles of 1024 x 8 it runs
    at 2-3 GB/s. Same dtypes copy bits (see `bits`)."""
    if src.dtype == dst.dtype:
        dst, src = bits(dst), bits(src)
    views = None if src.flags.c_contiguous else _as_2d(dst, src)
    if views is None or abs(views[1].strides[0]) >= abs(views[1].strides[1]):
        dst[...] = src
        return
    d2, s2 = views
    n, m = d2.shape
    for j in range(0, m, 8):
        for i in range(0, n, 1024):
            d2[i:i + 1024, j:j + 8] = s2[i:i + 1024, j:j + 8]


# --------------------------------------------------------------------------------------------
# The converters' bounded pipelines: blocks, positional writes, freed memory

# Rows of a large tensor are read, converted and written this many bytes at a time, so a reader or
# writer thread holds one block besides the group it works on, whatever the tensor's size.
BLOCK_BYTES = 64 * 2**20
# With direct I/O, bytes that are not in a writer's aligned staging buffer go to the disk through
# this much of another aligned buffer of the writer's at a time (safetensors_shards).
COPY_BYTES = 8 * 2**20


def row_ranges(shape: tuple[int, ...], itemsize: int, max_bytes: int | None = None,
               align: int = 1) -> list[tuple[int, int]]:
    """[start, stop) ranges of the first axis of `shape`, each at most `max_bytes` (default
    BLOCK_BYTES, read when called; at least one row, or `align` rows; starts are multiples of
    `align`); one range for a 0-d shape."""
    if not shape:
        return [(0, 1)]
    max_bytes = BLOCK_BYTES if max_bytes is None else max_bytes
    row = max(1, int(np.prod(shape[1:])) * itemsize)
    step = max(align, max_bytes // row // align * align)
    return [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Writes the bytes of a C-contiguous `data` at `offset` of `fd` (os.pwrite, which releases the
    GIL, so threads write at once). Loops: Linux writes at most 0x7ffff000 bytes per call."""
    view = memoryview(data.reshape(-1).view(np.uint8))
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def release_freed_memory() -> None:
    """Returns the memory that freed allocations left in glibc's heaps to the OS (malloc_trim).

    TensorStore builds a save's data file from 64 KiB pieces allocated in its own threads' heaps,
    and restores through read buffers; freed, glibc keeps much of them mapped (measured on the
    3-layer benchmark: without this, the RSS at the start of each save crept up by ~400 MiB over its
    11 saves). Called after each save or exported group. A no-op without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
