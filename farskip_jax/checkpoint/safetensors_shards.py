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

Direct I/O: a shard is written past the page cache (O_DIRECT) where the file system takes it. On the
VM we measured, a buffered export spent two thirds of its CPU in the kernel, copying into the page
cache and faulting in fresh pages for it (BENCHMARKS.md 5); through O_DIRECT the disk reads the
bytes from our buffers. O_DIRECT wants offsets, lengths and buffer addresses in whole blocks (`ALIGN`), and
safetensors packs tensors with no padding, so each write is cut in three: its block-aligned middle
goes to the disk at once (straight from the caller's buffer when its address has the alignment of
its place in the file, as `staging` buffers do; otherwise copied through a small aligned buffer),
and its unaligned head and tail, each inside one block that a neighbouring tensor shares, are
gathered in memory until the block is whole. The last block is written padded and the file cut to
its size on close.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from farskip_jax.checkpoint import common
from farskip_jax.checkpoint.common import copy_into, pwrite_all
from farskip_jax.checkpoint.hf_io import CheckpointError, np_dtype
from farskip_jax.checkpoint.output_dir import SHARDS_DONE, pause_for_tests
from farskip_jax.errors import storage_refusal

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


def row_offsets(entries: list[Entry]) -> dict[str, tuple[int, int]]:
    """Per planned tensor: its byte offset in the shard file and the bytes of one of its rows (0 for a
    0-d tensor), so that rows [r, ...) of a tensor start at offset + r * row_bytes."""
    offsets = shard_header(entries)[1]
    return {key: (offsets[key], entry_bytes((key, shape[1:], dtype)) if shape else 0)
            for key, shape, dtype in entries}


# O_DIRECT's unit: offsets, lengths and buffer addresses are multiples of it. 4 KiB is the logical
# block of the disks we write to (and a multiple of the old 512-byte one); some file systems (Lustre)
# want whole pages, which are larger on some aarch64 kernels.
ALIGN = max(4096, mmap.PAGESIZE)

_thread = threading.local()


def _aligned(nbytes: int) -> np.ndarray:
    """`nbytes` of fresh page-aligned memory (an anonymous mapping)."""
    return np.frombuffer(mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN)), np.uint8)


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """This thread's page-aligned buffer `name`, at least `nbytes`: kept and reused, so its pages are
    faulted in once (fresh memory is slow on the VMs we measured, BENCHMARKS.md 5)."""
    buf = getattr(_thread, name, None)
    if buf is None or buf.nbytes < nbytes:
        buf = _aligned(nbytes)
        setattr(_thread, name, buf)
    return buf


def staging(offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array of `shape` and `dtype` in this thread's staging buffer, placed so that its address has
    the alignment of file offset `offset`: filled and passed to `ShardFile.write` at that offset, its
    block-aligned middle goes to the disk without a copy. Valid until this thread's next call."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    start = offset % ALIGN
    buf = _thread_buffer("staging", start + max(n, common.BLOCK_BYTES))
    return buf[start:start + n].view(dtype).reshape(shape)


class ShardFile:
    """One safetensors file of planned tensors, written by position: its header is fixed by the plan,
    so every tensor (or any block of its rows) can be written as soon as it exists, by any thread,
    in any order; the bytes are the same whatever the order. `direct`: through O_DIRECT where the
    file system takes it (see the module's docstring), else through the page cache."""

    def __init__(self, path: Path, entries: list[Entry], direct: bool = False):
        with _writing(path):
            self._open(path, entries, direct)

    def _open(self, path: Path, entries: list[Entry], direct: bool) -> None:
        self.path = path
        self.entries = {k: (tuple(shape), np_dtype(dt)) for k, shape, dt in entries}
        head = shard_header(entries)[0]
        self._row_at = row_offsets(entries)
        self.size = len(head) + shard_bytes(entries)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:  # e.g. a file system without direct I/O
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        # The blocks that unaligned heads and tails of writes share, while not yet whole:
        # block index -> (its bytes, how many of them are written).
        self._blocks: dict[int, tuple[np.ndarray, int]] = {}
        self._lock = threading.Lock()
        self._write_at(np.frombuffer(head, np.uint8), 0)

    def write(self, key: str, data: np.ndarray, first_row: int = 0) -> None:
        """Writes `data`, rows [first_row, first_row + len(data)) of tensor `key` in its planned
        dtype (all of it for a 0-d tensor), C-contiguous."""
        shape, dtype = self.entries[key]
        fits = (data.shape == shape if not shape else data.ndim == len(shape)
                and data.shape[1:] == shape[1:] and first_row + len(data) <= shape[0])
        if not (fits and data.dtype == dtype and data.flags.c_contiguous):
            raise CheckpointError(f"{self.path.name}: got {key} rows {first_row}.. {data.shape} "
                                  f"{data.dtype}, planned {shape} {dtype}")
        with _writing(self.path):
            self._write_at(data.reshape(-1).view(np.uint8), self.offset(key, first_row))

    def offset(self, key: str, first_row: int = 0) -> int:
        """The file offset of row `first_row` of tensor `key`."""
        offset, row_bytes = self._row_at[key]
        return offset + first_row * row_bytes

    def _write_at(self, data: np.ndarray, offset: int) -> None:
        if not self.direct:
            pwrite_all(self.fd, data, offset)
            return
        end = offset + data.nbytes
        lo = min(end, -(-offset // ALIGN) * ALIGN)  # the whole blocks [lo, hi)
        hi = max(lo, end // ALIGN * ALIGN)
        if lo > offset:
            self._add_to_block(offset, data[:lo - offset])
        if hi > lo:
            middle = data[lo - offset:hi - offset]
            if middle.ctypes.data % ALIGN == 0:
                self._pwrite_direct(middle, lo)
            else:
                step = common.COPY_BYTES
                copy = _thread_buffer("copy", step)
                for start in range(0, middle.nbytes, step):
                    piece = middle[start:start + step]
                    copy[:piece.nbytes] = piece
                    self._pwrite_direct(copy[:piece.nbytes], lo + start)
        if end > hi:
            self._add_to_block(hi, data[hi - offset:])

    def _pwrite_direct(self, data: np.ndarray, offset: int) -> None:
        """Whole blocks at a block offset. A file system that took O_DIRECT at open but refuses the
        write (EINVAL: an alignment it wants larger) gets the rest of the file through the page
        cache: the same descriptor number, reopened without O_DIRECT; the blocks stay as they are."""
        try:
            pwrite_all(self.fd, data, offset)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        with self._lock:
            if os.O_DIRECT & fcntl.fcntl(self.fd, fcntl.F_GETFL):
                buffered = os.open(self.path, os.O_WRONLY)
                os.dup2(buffered, self.fd)  # atomic for the other writer threads
                os.close(buffered)
        pwrite_all(self.fd, data, offset)

    def _add_to_block(self, offset: int, piece: np.ndarray) -> None:
        """Bytes at `offset` inside one block: gathered until the block is whole, then written."""
        i, at = divmod(offset, ALIGN)
        whole = min(ALIGN, self.size - i * ALIGN)  # the file's last block is shorter
        with self._lock:
            block, filled = self._blocks.pop(i, None) or (_aligned(ALIGN), 0)
            block[at:at + piece.nbytes] = piece
            filled += piece.nbytes
            if filled < whole:
                self._blocks[i] = (block, filled)
                return
        self._pwrite_direct(block, i * ALIGN)  # the last block padded: cut to size on close

    def close(self) -> None:
        """fdatasync, then close: the file is complete on disk."""
        if self._blocks:
            raise CheckpointError(f"internal error: {self.path.name}: blocks {sorted(self._blocks)[:3]} "
                                  "not whole at close")
        with _writing(self.path):
            if self.direct and self.size % ALIGN:
                os.ftruncate(self.fd, self.size)
            os.fdatasync(self.fd)
        os.close(self.fd)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write the storage refuses (a full disk, a quota, a file size limit, an I/O error:
    `storage_refusal`) or a file we may not write is the user's to fix: one line naming the file (the
    export's temp dir keeps the shards already finished for --resume). Other OS errors are bugs."""
    try:
        yield
    except OSError as e:
        if storage_refusal(e) is None and e.errno not in (errno.EACCES, errno.EPERM):
            raise
        raise CheckpointError(f"writing {path}: {e.strerror}") from e


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

    def __init__(self, tmp: Path, names: list[str], shards: list[list[Entry]], done: set[int],
                 direct: bool = True):
        self.tmp, self.names, self.shards, self.direct = tmp, names, shards, direct
        self._row_at = {key: at for shard in shards for key, at in row_offsets(shard).items()}
        self.shard_of = {k: i for i, sh in enumerate(shards) for k, *_ in sh}
        self.left = {i: len(sh) for i, sh in enumerate(shards) if i not in done}
        self.done = set(done)
        self.files: dict[int, ShardFile] = {}
        self._lock = threading.Lock()
        self._first_listed = False

    def is_done(self, key: str) -> bool:
        return self.shard_of[key] in self.done

    def staging(self, key: str, first_row: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer for rows of `key` from `first_row` on, to fill and pass to `file(key).write`:
        with direct I/O, written from where it is (module `staging`)."""
        offset, row_bytes = self._row_at[key]
        return staging(offset + first_row * row_bytes, shape, dtype)

    def file(self, key: str) -> ShardFile:
        i = self.shard_of[key]
        with self._lock:
            if i not in self.files:
                self.files[i] = ShardFile(self.tmp / self.names[i], self.shards[i], self.direct)
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
        with self._lock, _writing(self.tmp / SHARDS_DONE):
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
