"""Reading HF checkpoint directories tensor by tensor (safetensors, single or sharded; .bin).

FP8 block-quantized checkpoints (DeepSeek-V3 / R1 as published: config.json `quantization_config`
{quant_method fp8, fmt e4m3, weight_block_size [128, 128]}, each quantized weight float8_e4m3fn
with one float32 `<name>_scale_inv` per block) are dequantized as each tensor is read: the weight
in float32 times its block's scale, the blocks at the right and bottom edges partial. The scale
tensors are not listed as tensors of their own (`keys`). A quantized weight without its scale, a
scale without its weight, or a scale of the wrong shape is refused, naming the tensor.

Nothing here holds more than the tensors a caller asks for: a safetensors file's header is parsed
once and each tensor (or a range of its rows, `read_rows`) is read with one seek + read of its byte
range (no mmap, so pages of other tensors never count towards the process RSS; bfloat16 works, which
safetensors' numpy API lacks). PyTorch `.bin` files are loaded with `torch.load(weights_only=True)`
(never full unpickling), one file at a time, which is the best that format allows.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from farskip_jax.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, malformed or does not match the config; names file and tensor.

    A UserError, so the CLIs print it as one line; a ValueError for callers that catch those."""


# safetensors dtype tags -> numpy dtype names (bfloat16 comes from ml_dtypes).
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn"}
SCALE_SUFFIX = "_scale_inv"  # FP8: `<weight name>_scale_inv` holds the weight's per-block scales


def np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    if name in ("bfloat16", "float8_e4m3fn"):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def fp8_block_size(hf: dict) -> tuple[int, int] | None:
    """config.json's FP8 block size, None without quantization; other schemes refused."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method, fmt, block = quant.get("quant_method"), quant.get("fmt", "e4m3"), quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"config.json quantization_config {quant}: only block-quantized FP8 "
                              "(quant_method fp8, fmt e4m3, weight_block_size [rows, cols]) is read")
    return block[0], block[1]


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """float32 `q * scale` with one scale per `block` (partial blocks at the edges)."""
    rows, cols = q.shape
    want = fp8_scale_shape(q.shape, block)
    if scale_inv.shape != want:
        raise CheckpointError(f"tensor {name}{SCALE_SUFFIX}: shape {list(scale_inv.shape)} does not match "
                              f"{name} {list(q.shape)} in blocks of {list(block)} (expected {list(want)})")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return q.astype(np.float32) * scale[:rows, :cols]


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# What the published FP8 checkpoints keep unquantized (in bf16): embeddings, LM head, every norm, the
# router (DeepSeek/Qwen3 `mlp.gate`, Llama-4 `router`) and its correction bias. Every other 2-D
# `.weight` (the attention projections, the dense, shared and routed experts' MLPs) is quantized.
FP8_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "router", "e_score_correction_bias")


def fp8_quantizes(hf_key: str, shape: tuple[int, ...]) -> bool:
    """Whether the published FP8 layout stores this tensor block-quantized."""
    return len(shape) == 2 and hf_key.endswith(".weight") and not any(k in hf_key for k in FP8_KEEP)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn q, float32 scale_inv per block) with q * scale ~ w, the inverse of `dequantize_fp8`.

    A block's scale is amax / 448 (DeepSeek's quantization), except for a block that already is
    exactly some fp8 q times a float32 scale s (a published FP8 weight dequantized in float32):
    then s itself is found and kept, so that FP8 -> float32 -> FP8 gives the published bytes back.
    amax / 448 alone cannot: float32(float32(448 s) / 448) != s for ~11% of float32 scales. s is
    found exactly from any element whose q is a power of two (w = q s then holds without rounding,
    and q is the same under either scale: an ulp of the scale moves w / s by ~1e-7 of q, and fp8's
    spacing is 1/8 to 1/16 of q); the block keeps s only if q * s reproduces every element."""
    import ml_dtypes

    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    rows, cols = w.shape
    nb0, nb1 = fp8_scale_shape(w.shape, block)
    padded = np.zeros((nb0 * block[0], nb1 * block[1]), np.float32)
    padded[:rows, :cols] = w
    tiles = padded.reshape(nb0, block[0], nb1, block[1]).transpose(0, 2, 1, 3).reshape(nb0, nb1, -1)
    amax = np.max(np.abs(tiles), axis=-1)
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = (tiles / scale[..., None]).astype(fp8)
    qf = q.astype(np.float32)
    bits = q.view(np.uint8)
    # normal fp8 values with a zero mantissa: +-2^e, so w / q is w's scale exactly
    pow2 = ((bits & 0x07) == 0) & ((bits & 0x78) != 0)
    pick = np.argmax(np.where(pow2, np.abs(qf), 0.0), axis=-1)[..., None]
    found = pow2.any(axis=-1)
    exact = np.where(found, (np.take_along_axis(tiles, pick, -1)
                             / np.take_along_axis(np.where(pow2, qf, 1.0), pick, -1))[..., 0], scale)
    exact = exact.astype(np.float32)
    keeps = found & np.all(qf * exact[..., None] == tiles, axis=-1) & (exact > 0)
    scale = np.where(keeps, exact, scale).astype(np.float32)
    q = (tiles / scale[..., None]).astype(fp8)
    q = q.reshape(nb0, nb1, block[0], block[1]).transpose(0, 2, 1, 3).reshape(padded.shape)
    return np.ascontiguousarray(q[:rows, :cols]), scale


def read_safetensors_header(f: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict without `__metadata__`)."""
    with open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{f}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise CheckpointError(f"{f}: corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return 8 + n, header


class TensorSource:
    """Maps every tensor name of an HF directory to its file and reads tensors on demand."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.key_to_file: dict[str, Path] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map'")
            for key, fname in weight_map.items():
                f = self.dir / fname
                if not f.exists():
                    raise CheckpointError(f"{index}: tensor {key!r} is in {fname}, which does not exist")
                self.key_to_file[key] = f
        elif (files := sorted(self.dir.glob("*.safetensors"))):
            for f in files:
                for key in self._header(f)[1]:
                    self._add(key, f)
        elif (files := sorted(self.dir.glob("pytorch_model*.bin"))):
            for f in files:
                for key in self._torch_load(f):
                    self._add(key, f)
        else:
            raise CheckpointError(f"{self.dir}: no *.safetensors, model.safetensors.index.json or "
                                  "pytorch_model*.bin files")
        self._bin_cache: tuple[Path, dict] | None = None
        self._stored: dict[str, str] = {}  # our key -> the name in the file, where they differ
        cfg_file = self.dir / "config.json"
        self.fp8_block = fp8_block_size(json.loads(cfg_file.read_text())) if cfg_file.is_file() else None
        self.scales: dict[str, str] = {}  # FP8: quantized weight -> its scale tensor
        self._scale_files: dict[str, Path] = {}
        self._pair_fp8_scales()

    def _pair_fp8_scales(self) -> None:
        """Moves the `_scale_inv` tensors out of the tensor list, each to its weight; refuses strays."""
        scale_keys = [k for k in self.key_to_file if k.endswith(SCALE_SUFFIX)]
        if not scale_keys and self.fp8_block is None:
            return
        for key in scale_keys:
            weight = key[: -len(SCALE_SUFFIX)]
            if weight not in self.key_to_file:
                raise CheckpointError(f"{self.key_to_file[key]}: scale tensor {key!r} has no weight "
                                      f"{weight!r}")
            self.scales[weight] = key
        if self.scales and self.fp8_block is None:
            raise CheckpointError(f"{self.dir}: {len(self.scales)} *{SCALE_SUFFIX} tensors (e.g. "
                                  f"{next(iter(self.scales.values()))!r}) but config.json has no FP8 "
                                  "quantization_config (weight_block_size)")
        self._scale_files = {k: self.key_to_file.pop(k) for k in scale_keys}
        for key in self.key_to_file:
            if self._raw_dtype(key) == "float8_e4m3fn" and key not in self.scales:
                raise CheckpointError(f"{self.key_to_file[key]}: tensor {key!r} is float8_e4m3fn but has no "
                                      f"{key + SCALE_SUFFIX!r}")

    def quantized(self) -> list[str]:
        """The FP8 weights, dequantized by `read`."""
        return sorted(k for k in self.scales if k in self.key_to_file)

    def _header(self, f: Path) -> tuple[int, dict]:
        # Parsed once per file: a DSV2-Lite shard lists thousands of tensors.
        if f not in self._headers:
            self._headers[f] = read_safetensors_header(f)
        return self._headers[f]

    def _st_entry(self, key: str) -> tuple[Path, int, dict]:
        f = self.key_to_file[key] if key in self.key_to_file else self._scale_files[key]
        start, header = self._header(f)
        stored = self._stored.get(key, key)
        if stored not in header:
            raise CheckpointError(f"{f}: tensor {stored!r} is listed in the index but not in the file")
        return f, start, header[stored]

    def _add(self, key: str, f: Path) -> None:
        if key in self.key_to_file:
            raise CheckpointError(f"tensor {key!r} appears in both {self.key_to_file[key].name} and {f.name}")
        self.key_to_file[key] = f

    @staticmethod
    def _torch_load(f: Path) -> dict:
        import torch

        try:
            return torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the file name
            raise CheckpointError(f"{f}: cannot load with torch.load(weights_only=True): {e}") from e

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def skip_mtp_layers(self, num_layers: int) -> str | None:
        """Forgets the tensors of DeepSeek-V3's multi-token-prediction layers (config.json
        `num_nextn_predict_layers`, tensors `model.layers.{num_layers + i}.*`), which are not part of
        the model (HF does not build them either). Returns a message saying what was skipped, or None."""
        cfg_file = self.dir / "config.json"
        hf = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        n = int(hf.get("num_nextn_predict_layers") or 0)
        if n <= 0:
            return None
        prefixes = tuple(f"model.layers.{num_layers + i}." for i in range(n))
        skipped = [k for k in self.key_to_file if k.startswith(prefixes)]
        for k in skipped:
            del self.key_to_file[k]
        if not skipped:
            return None
        return (f"{self.dir}: skipped {len(skipped)} tensors of the {n} multi-token-prediction layer(s) "
                f"(model.layers.{num_layers}..{num_layers + n - 1}, num_nextn_predict_layers={n}): they are "
                "not part of the model")

    def skip_vision(self) -> str | None:
        """A Llama4ForConditionalGeneration checkpoint read as its language model: the tensors under
        `language_model.` (or transformers 5's `model.language_model.`) take Llama4ForCausalLM's names
        (`model.*`, `lm_head.weight`), and the vision tower's and projector's are forgotten. Returns a
        message saying how many were skipped, or None for a text-only checkpoint."""
        renames = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                   ("model.language_model.", "model."))
        vision = ("vision_model.", "multi_modal_projector.", "model.vision_model.",
                  "model.multi_modal_projector.")
        if not any(k.startswith(tuple(old for old, _ in renames)) for k in self.key_to_file):
            return None
        skipped = [k for k in self.key_to_file if k.startswith(vision)]
        key_to_file: dict[str, Path] = {}
        for key, f in self.key_to_file.items():
            if key.startswith(vision):
                continue
            ours = next((new + key[len(old):] for old, new in renames if key.startswith(old)), key)
            if ours in key_to_file:
                raise CheckpointError(f"tensor {key!r} and another tensor both name {ours!r}")
            key_to_file[ours] = f
            if ours != key:
                self._stored[ours] = self._stored.get(key, key)
        self.key_to_file = key_to_file
        return (f"{self.dir}: read as a text model (language_model.* tensors); skipped {len(skipped)} "
                "tensors "
                "of the vision tower and projector (vision_model.*, multi_modal_projector.*): they are not "
                "part of the model")

    def shape(self, key: str) -> tuple[int, ...]:
        f = self.key_to_file[key]
        if f.suffix == ".safetensors":
            return tuple(self._st_entry(key)[2]["shape"])
        return tuple(self._bin(f)[self._stored.get(key, key)].shape)

    def dtype_name(self, key: str) -> str:
        """numpy-style name: float32, bfloat16, float16, int64, ... (float32 for an FP8 weight,
        which `read` dequantizes)."""
        return "float32" if key in self.scales else self._raw_dtype(key)

    def _raw_dtype(self, key: str) -> str:
        f = self.key_to_file[key]
        if f.suffix == ".safetensors":
            tag = self._st_entry(key)[2]["dtype"]
            return ST_DTYPES.get(tag, tag)
        return str(self._bin(f)[self._stored.get(key, key)].dtype).replace("torch.", "")

    def read(self, key: str) -> np.ndarray:
        """One tensor as numpy (bfloat16 via ml_dtypes), bit-exact; an FP8 weight dequantized to
        float32 with its block scales."""
        return self.read_rows(key, 0, None)

    def row_align(self, key: str) -> int:
        """What `read_rows` ranges of `key` must start at multiples of: an FP8 weight's block rows."""
        return self.fp8_block[0] if key in self.scales and self.fp8_block else 1

    def read_rows(self, key: str, start: int, stop: int | None) -> np.ndarray:
        """Rows [start, stop) (first axis; None: to the end) of one tensor, like `read(key)[start:stop]`
        without reading the rest: one seek + read of their byte range. An FP8 weight's range must
        start on a block boundary (`row_align`); its rows are dequantized with their scale rows."""
        if key in self.scales:
            assert self.fp8_block is not None
            b0 = self.fp8_block[0]
            if start % b0:
                raise ValueError(f"{key}: FP8 rows from {start}, not a multiple of the block's {b0} rows")
            want = fp8_scale_shape(self.shape(key), self.fp8_block)
            if self._raw_shape(self.scales[key]) != want:
                raise CheckpointError(f"tensor {key}{SCALE_SUFFIX}: shape "
                                      f"{list(self._raw_shape(self.scales[key]))} does not match {key} "
                                      f"{list(self.shape(key))} in blocks of {list(self.fp8_block)} "
                                      f"(expected {list(want)})")
            q = self._read_raw(key, start, stop)
            scale = self._read_raw(self.scales[key], start // b0, -(-(start + q.shape[0]) // b0))
            return dequantize_fp8(q, scale, self.fp8_block, key)
        return self._read_raw(key, start, stop)

    def _raw_shape(self, key: str) -> tuple[int, ...]:
        f = self.key_to_file[key] if key in self.key_to_file else self._scale_files[key]
        if f.suffix == ".safetensors":
            return tuple(self._st_entry(key)[2]["shape"])
        return tuple(self._bin(f)[self._stored.get(key, key)].shape)

    def _read_raw(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        f = self.key_to_file[key] if key in self.key_to_file else self._scale_files[key]
        if f.suffix == ".safetensors":
            f, data_start, entry = self._st_entry(key)
            dtype = np_dtype(ST_DTYPES.get(entry["dtype"], entry["dtype"]))
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            total = (end - begin) // dtype.itemsize
            if total != int(np.prod(shape)):
                raise CheckpointError(f"{f}: tensor {key!r}: byte range does not match its shape "
                                      f"{list(shape)}")
            if not shape:
                start, stop = 0, None
            rows = shape[0] if shape else 1
            stop = rows if stop is None else min(stop, rows)
            row = int(np.prod(shape[1:])) if shape else 1
            count = (stop - start) * row
            with open(f, "rb") as fh:
                fh.seek(data_start + begin + start * row * dtype.itemsize)
                arr = np.fromfile(fh, dtype=dtype, count=count)
            if arr.size != count:
                raise CheckpointError(f"{f}: tensor {key!r} is truncated")
            return arr.reshape((stop - start, *shape[1:]) if shape else ())
        t = self._bin(f)[self._stored.get(key, key)]
        return _torch_to_numpy(t[start:stop] if t.dim() and (start or stop is not None) else t)

    def _bin(self, f: Path) -> dict:
        # One local reference: readers in several threads may swap the one-file cache meanwhile.
        cache = self._bin_cache
        if cache is None or cache[0] != f:
            cache = (f, self._torch_load(f))
            self._bin_cache = cache
        return cache[1]

    def files(self) -> Iterator[Path]:
        yield from sorted(set(self.key_to_file.values()))


def _torch_to_numpy(t) -> np.ndarray:
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
