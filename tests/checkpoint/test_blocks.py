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
