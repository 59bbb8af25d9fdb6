"""The converters' block-wise I/O: rows of a tensor read, quantized and written a block at a time
give the bytes of the whole-tensor path, FP8 included (blocks of rows that are whole FP8 blocks)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from farskip_jax.checkpoint import common
from farskip_jax.checkpoint.common import row_ranges
from farskip_jax.checkpoint.convert import progress_bar
from farskip_jax.checkpoint.hf_io import SCALE_SUFFIX, TensorSource, fp8_scale_shape, quantize_fp8
from farskip_jax.checkpoint.output_dir import SHARDS_DONE
from farskip_jax.checkpoint.safetensors_shards import ShardSet
from farskip_jax.checkpoint.to_hf import TensorWriter

torch = pytest.importorskip("torch")

BLOCK = (8, 16)
KEY = "model.layers.0.mlp.down_proj.weight"


def _weight(shape: tuple[int, int]) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 0.05).astype(np.float32)


def _fp8_dir(tmp_path, w: np.ndarray):
    """An HF directory holding `w` quantized in the published layout (with edge blocks partial)."""
    from safetensors.torch import save_file

    q, scale = quantize_fp8(w, BLOCK)
    save_file({KEY: torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn),
               KEY + SCALE_SUFFIX: torch.from_numpy(scale)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}}))
    return TensorSource(tmp_path)


def test_row_ranges_cover_the_rows_aligned():
    assert row_ranges((10, 4), 4, max_bytes=40) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_ranges((10, 4), 4, max_bytes=40, align=4) == [(0, 4), (4, 8), (8, 10)]  # >= one block
    assert row_ranges((3,), 2, max_bytes=1) == [(0, 1), (1, 2), (2, 3)]
    assert row_ranges((), 4) == [(0, 1)]


def test_fp8_rows_read_in_blocks_equal_the_whole_tensor(tmp_path):
    source = _fp8_dir(tmp_path, _weight((61, 70)))
    whole = source.read(KEY)
    assert whole.dtype == np.float32 and whole.shape == (61, 70)
    ranges = row_ranges(whole.shape, 4, max_bytes=3 * 70 * 4, align=source.row_align(KEY))
    assert len(ranges) > 3 and all(r0 % BLOCK[0] == 0 for r0, _ in ranges)
    parts = np.concatenate([source.read_rows(KEY, r0, r1) for r0, r1 in ranges])
    assert parts.tobytes() == whole.tobytes()
    with pytest.raises(ValueError, match="not a multiple"):
        source.read_rows(KEY, 3, 9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_writer_in_blocks_writes_the_whole_tensor_bytes(tmp_path, monkeypatch, dtype):
    """TensorWriter with 1 KiB blocks: an FP8 weight quantized block by block gives quantize_fp8's
    bytes for the whole weight (its scales in another shard), and a transposed tensor cast to the
    export dtype in blocks gives the bytes of the whole cast."""
    monkeypatch.setattr(common, "BLOCK_BYTES", 1024)
    w = _weight((61, 70))
    q, scale = quantize_fp8(w, BLOCK)
    t = _weight((40, 30)).T  # HF layout of an [in, out] parameter: a transposed view
    entries = [[(KEY, w.shape, "float8_e4m3fn")],
               [(KEY + SCALE_SUFFIX, fp8_scale_shape(w.shape, BLOCK), "float32"), ("t", t.shape, dtype)]]
    names = ["a.safetensors", "b.safetensors"]
    with progress_bar(0, "", False) as bar:
        files = ShardSet(tmp_path, names, entries, set())
        writer = TensorWriter(files, dtype, BLOCK, {KEY}, bar)
        writer.write("t", t)
        writer.write(KEY, w)
    assert files.done == {0, 1} and sorted((tmp_path / SHARDS_DONE).read_text().split()) == names
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}}))
    source = TensorSource(tmp_path)
    got = {k: source._read_raw(k) for k in (KEY, KEY + SCALE_SUFFIX, "t")}
    assert got[KEY].view(np.uint8).tobytes() == q.view(np.uint8).tobytes()
    assert got[KEY + SCALE_SUFFIX].tobytes() == scale.tobytes()
    want = np.ascontiguousarray(t).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    assert got["t"].tobytes() == want.tobytes()


# --------------------------------------------------------------------------------------------
# Shard files written by position, through the page cache or past it (O_DIRECT)


def _tensors(n_tensors: int, seed: int) -> dict[str, np.ndarray]:
    """Tensors of odd byte sizes (most offsets and ends fall inside a 4 KiB block), some larger than
    a block, one 0-d and one empty."""
    rng = np.random.default_rng(seed)
    out = {"scalar": np.float32(rng.standard_normal()).reshape(()), "empty": np.zeros((0, 3), np.float32)}
    max_rows = 8 if n_tensors < 10 else 300  # a few tensors: a file smaller than one block
    for i in range(n_tensors):
        rows, cols = int(rng.integers(1, max_rows)), int(rng.integers(1, 40))
        dtype = [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn][i % 3]
        out[f"t{i}"] = rng.standard_normal((rows, cols)).astype(dtype)
    return out


def _write_shuffled(files, tensors: dict[str, np.ndarray], seed: int, threads: int = 3) -> None:
    """Each tensor in random row blocks, in random order, by `threads` threads; half of the blocks
    through the set's staging buffer (written from where they are), half from their own arrays."""
    import concurrent.futures
    import threading

    rng = np.random.default_rng(seed)
    jobs = []
    for key, t in tensors.items():
        cuts = sorted({0, len(t) if t.ndim else 1, *rng.integers(0, max(1, len(t) if t.ndim else 1), 3)})
        jobs += [(key, r0, r1) for r0, r1 in zip(cuts, cuts[1:], strict=False) if r1 > r0] or [(key, 0, 0)]
    rng.shuffle(jobs)
    left = {k: sum(1 for j in jobs if j[0] == k) for k in tensors}
    lock = threading.Lock()

    def one(i: int, key: str, r0: int, r1: int) -> None:
        t = tensors[key]
        part = t if not t.ndim else t[r0:r1]
        if i % 2:
            buf = files.staging(key, r0, part.shape, part.dtype)
            buf[...] = part
            part = buf
        files.file(key).write(key, part, r0)
        with lock:
            left[key] -= 1
            last = left[key] == 0
        if last:
            files.finished(key)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda a: one(*a), [(i, *j) for i, j in enumerate(jobs)]))


@pytest.mark.parametrize("n_tensors", [3, 40, 400])  # a file under one block; headers under / over one
def test_shard_files_are_the_same_bytes_direct_or_buffered(tmp_path, n_tensors):
    """Row blocks written in random order by 3 threads, through O_DIRECT (where this file system
    takes it) and through the page cache: byte-equal files of the planned size that safetensors
    reads back as the tensors."""
    import os

    from safetensors.torch import load_file

    from farskip_jax.checkpoint.safetensors_shards import ALIGN, ShardFile

    tensors = _tensors(n_tensors, seed=n_tensors)
    entries = [[(k, t.shape, str(t.dtype)) for k, t in tensors.items()]]
    got = {}
    for direct in (True, False):
        d = tmp_path / ("direct" if direct else "buffered")
        d.mkdir()
        files = ShardSet(d, ["model.safetensors"], entries, set(), direct=direct)
        _write_shuffled(files, tensors, seed=n_tensors)
        assert files.done == {0}
        got[direct] = (d / "model.safetensors").read_bytes()
    probe = ShardFile(tmp_path / "probe.safetensors", entries[0], direct=True)
    os.close(probe.fd)
    if not probe.direct:
        pytest.skip(f"{tmp_path}: no O_DIRECT on this file system (the direct path fell back to buffered)")
    size = probe.size
    assert size % ALIGN and (n_tensors < 10) == (size < ALIGN)
    assert len(got[True]) == size and got[True] == got[False]
    loaded = load_file(str(tmp_path / "direct" / "model.safetensors"))
    for k, t in tensors.items():
        assert tuple(loaded[k].shape) == t.shape, k
        assert loaded[k].reshape(-1).view(torch.uint8).numpy().tobytes() == t.tobytes(), k


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_shard_file_falls_back_to_buffered_where_direct_io_is_refused(tmp_path, monkeypatch, refused_at):
    """A file system that refuses O_DIRECT (EINVAL at open, or at the first write on a descriptor that
    took it) gets the buffered path and the same bytes; any other open error is raised, naming the
    file."""
    import errno
    import fcntl
    import os

    from farskip_jax.checkpoint import safetensors_shards
    from farskip_jax.checkpoint.safetensors_shards import ShardFile

    tensors = _tensors(40, seed=1)
    entries = [(k, t.shape, str(t.dtype)) for k, t in tensors.items()]
    ref = tmp_path / "ref"
    ref.mkdir()
    _write_shuffled(ShardSet(ref, ["model.safetensors"], [entries], set(), direct=False), tensors, seed=1)
    real_open, real_pwrite = os.open, os.pwrite
    refused = []

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    def refusing_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    if refused_at == "open":
        monkeypatch.setattr(safetensors_shards.os, "open", refusing_open)
    else:
        probe = ShardFile(tmp_path / "probe.safetensors", entries, direct=True)
        os.close(probe.fd)
        (tmp_path / "probe.safetensors").unlink()
        if not probe.direct:
            pytest.skip(f"{tmp_path}: no O_DIRECT on this file system")
        monkeypatch.setattr(safetensors_shards.os, "pwrite", refusing_pwrite)
    files = ShardSet(tmp_path, ["model.safetensors"], [entries], set(), direct=True)
    _write_shuffled(files, tensors, seed=1)
    monkeypatch.setattr(safetensors_shards.os, "open", real_open)
    monkeypatch.setattr(safetensors_shards.os, "pwrite", real_pwrite)
    assert refused and files.done == {0}
    assert (tmp_path / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()

    def failing_open(path, flags, *args):
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(safetensors_shards.os, "open", failing_open)
    from farskip_jax.checkpoint.hf_io import CheckpointError

    with pytest.raises(CheckpointError, match=r"writing .*x\.safetensors: Permission denied"):
        ShardFile(tmp_path / "x.safetensors", entries, direct=True)


@pytest.mark.parametrize("direct", [True, False])
def test_a_refused_shard_write_names_the_file(tmp_path, direct, file_size_limit):
    """A write the storage refuses (a file size limit, as a full disk) is a CheckpointError naming the
    shard, direct or buffered, not an OSError without a file name."""
    from farskip_jax.checkpoint.hf_io import CheckpointError

    t = np.arange(8192, dtype=np.float32).reshape(64, 128)  # 32 KiB
    files = ShardSet(tmp_path, ["model.safetensors"], [[("t", t.shape, "float32")]], set(), direct=direct)
    with file_size_limit(16384), pytest.raises(CheckpointError,
                                               match=r"writing .*model\.safetensors: File too large"):
        files.file("t").write("t", t)
        files.finished("t")
    files.close()
