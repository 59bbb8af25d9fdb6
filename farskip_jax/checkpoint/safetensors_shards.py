"""safetensors shard files planned up front and written by position: the on-disk half of the
Orbax -> HF export (`to_hf`).

A shard's header (tensor names, dtypes, shapes, byte offsets) is fixed by the plan of tensors
before any data exists (`plan_shards`, `shard_header`), so each tensor, or any block of its rows,
is written at its offset as soon as it exists, by any thread, in any order (`ShardFile`); a shard
completes with its last planned tensor and is then synced and listed in the temp dir's
`SHARDS_DONE`, which is what a resumed export trusts (`ShardSet`, `shards_on_disk`). `ShardWriter`
writes one shard whose tensors arrive whole and in order (bench/convert_rss.py writes its synthetic
HF checkpoints with it).

Its own module because it is the safetensors file format and its crash-safety, with nothing of
the model, of Orbax or of the export's dtype and FP8 choices (those stay in `to_hf`, which decides
what the planned tensors are and feeds them in); it depends only on `common`, `hf_io` and
`output_dir`, and imports neither converter.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax.checkpoint.common import copy_into, pwrite_all
from farskip_jax.checkpoint.hf_io import CheckpointError, np_dtype
from farskip_jax.checkpoint.output_dir import SHARDS_DONE, pause_for_tests

ST_TAGS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3"}
Entry = tuple[str, tuple[int, ...], str]  # HF key, shape, dtype name


def entry_bytes(entry: Entry) -> int:
    return int(np.prod(entry[1])) * np_dtype(entry[2]).itemsize


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = entry_bytes(entry)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def shard_header(entries: list[Entry]) -> tuple[bytes, dict[str, int]]:
    """A safetensors file's first bytes (length + JSON header, padded so the data starts 8-byte
    aligned) for the planned tensors, and each tensor's byte offset in the file."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, dtype in entries:
        n = entry_bytes((key, shape, dtype))
        header[key] = {"dtype": ST_TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: start + header[k]["data_offsets"][0] for k, *_ in entries}


class ShardFile:
    """One safetensors file of planned tensors, written by position: its header is fixed by the plan,
    so every tensor (or any block of its rows) can be written as soon as it exists, by any thread,
    in any order; the bytes are the same whatever the order."""

    def __init__(self, path: Path, entries: list[Entry]):
        self.path = path
        self.entries = {k: (tuple(shape), np_dtype(dt)) for k, shape, dt in entries}
        head, self.offsets = shard_header(entries)
        self.size = len(head) + shard_bytes(entries)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pwrite_all(self.fd, np.frombuffer(head, np.uint8), 0)

    def write(self, key: str, data: np.ndarray, first_row: int = 0) -> None:
        """Writes `data`, rows [first_row, first_row + len(data)) of tensor `key` in its planned
        dtype (all of it for a 0-d tensor), C-contiguous."""
        shape, dtype = self.entries[key]
        fits = (data.shape == shape if not shape else data.ndim == len(shape)
                and data.shape[1:] == shape[1:] and first_row + len(data) <= shape[0])
        if not (fits and data.dtype == dtype and data.flags.c_contiguous):
            raise CheckpointError(f"{self.path.name}: got {key} rows {first_row}.. {data.shape} "
                                  f"{data.dtype}, planned {shape} {dtype}")
        row = int(np.prod(shape[1:])) * dtype.itemsize if shape else 0
        pwrite_all(self.fd, data, self.offsets[key] + first_row * row)

    def close(self) -> None:
        """fdatasync, then close: the file is complete on disk."""
        os.fdatasync(self.fd)
        os.close(self.fd)


class ShardWriter:
    """Writes one safetensors file whose tensors arrive whole, in the planned order."""

    def __init__(self, path: Path, entries: list[Entry]):
        self.file, self.entries, self.pos = ShardFile(path, entries), entries, 0

    def write(self, key: str, arr: np.ndarray) -> None:
        exp_key, exp_shape, exp_dtype = self.entries[self.pos]
        if key != exp_key or arr.shape != exp_shape or arr.dtype != np_dtype(exp_dtype):
            raise CheckpointError(f"{self.file.path.name}: got {key} {arr.shape} {arr.dtype}, planned "
                                  f"{exp_key} {exp_shape} {exp_dtype}")
        if not arr.flags.c_contiguous:
            buf = np.empty(arr.shape, arr.dtype)
            copy_into(buf, arr)  # transposes in tiles: several times faster than ascontiguousarray
            arr = buf
        self.file.write(key, arr)
        self.pos += 1

    @property
    def done(self) -> bool:
        return self.pos == len(self.entries)

    def close(self) -> None:
        self.file.close()


def shard_bytes(entries: list[Entry]) -> int:
    """Planned data bytes of a shard (its header comes on top)."""
    return sum(entry_bytes(e) for e in entries)


def shards_on_disk(tmp: Path, names: list[str], shards: list[list[Entry]]) -> set[int]:
    """The planned shards an interrupted export finished: those listed in SHARDS_DONE (each listed
    after its fdatasync) whose files are still there at their planned size. Several shards are
    written at once, so they may finish out of order; a shard not listed is written again whole."""
    listed = set((tmp / SHARDS_DONE).read_text().split()) if (tmp / SHARDS_DONE).is_file() else set()
    done = {i for i, n in enumerate(names)
            if n in listed and (tmp / n).is_file()
            and (tmp / n).stat().st_size == len(shard_header(shards[i])[0]) + shard_bytes(shards[i])}
    # The list names only what is kept.
    (tmp / SHARDS_DONE).write_text("".join(names[i] + "\n" for i in sorted(done)))
    return done


class ShardSet:
    """The export's shard files while tensors stream into them from several writer threads: each file
    is opened at its first tensor, and synced, closed and listed in SHARDS_DONE (synced too) when its
    last planned tensor is written, so a listed shard is complete whatever stops the export."""

    def __init__(self, tmp: Path, names: list[str], shards: list[list[Entry]], done: set[int]):
        self.tmp, self.names, self.shards = tmp, names, shards
        self.shard_of = {k: i for i, sh in enumerate(shards) for k, *_ in sh}
        self.left = {i: len(sh) for i, sh in enumerate(shards) if i not in done}
        self.done = set(done)
        self.files: dict[int, ShardFile] = {}
        self._lock = threading.Lock()
        self._first_listed = False

    def is_done(self, key: str) -> bool:
        return self.shard_of[key] in self.done

    def file(self, key: str) -> ShardFile:
        i = self.shard_of[key]
        with self._lock:
            if i not in self.files:
                self.files[i] = ShardFile(self.tmp / self.names[i], self.shards[i])
            return self.files[i]

    def finished(self, key: str) -> None:
        """`key` is written whole; its shard completes with its last tensor."""
        i = self.shard_of[key]
        self.file(key)  # a shard of empty tensors only is still written
        with self._lock:
            self.left[i] -= 1
            last = self.left[i] == 0
        if not last:
            return
        with self._lock:
            shard = self.files.pop(i)
        shard.close()
        with self._lock:
            with open(self.tmp / SHARDS_DONE, "a") as listing:
                listing.write(self.names[i] + "\n")
                listing.flush()
                os.fdatasync(listing.fileno())
            self.done.add(i)
            first, self._first_listed = not self._first_listed, True
        if first:
            pause_for_tests("shard")

    def close(self) -> None:
        """After an error: closes what is open (unsynced, unlisted: written again on resume)."""
        for f in self.files.values():
            os.close(f.fd)
        self.files.clear()
