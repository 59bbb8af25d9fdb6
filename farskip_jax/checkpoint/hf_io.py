"""Reading HF checkpoint directories tensor by tensor (safetensors, single or sharded; .bin).

Nothing here holds more than the tensors a caller asks for: safetensors files are memory-mapped
and read one tensor at a time. PyTorch `.bin` files are loaded with `torch.load(weights_only=True)`
(never full unpickling), one file at a time, which is the best that format allows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or does not match the config; names file and tensor."""


class TensorSource:
    """Maps every tensor name of an HF directory to its file and reads tensors on demand."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.key_to_file: dict[str, Path] = {}
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
            from safetensors import safe_open

            for f in files:
                with safe_open(str(f), framework="numpy") as h:
                    for key in h.keys():
                        self._add(key, f)
        elif (files := sorted(self.dir.glob("pytorch_model*.bin"))):
            for f in files:
                for key in self._torch_load(f):
                    self._add(key, f)
        else:
            raise CheckpointError(f"{self.dir}: no *.safetensors, model.safetensors.index.json or "
                                  "pytorch_model*.bin files")
        self._bin_cache: tuple[Path, dict] | None = None

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

    def shape(self, key: str) -> tuple[int, ...]:
        f = self.key_to_file[key]
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="numpy") as h:
                return tuple(h.get_slice(key).get_shape())
        return tuple(self._bin(f)[key].shape)

    def dtype_name(self, key: str) -> str:
        f = self.key_to_file[key]
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="numpy") as h:
                return str(h.get_slice(key).get_dtype())
        return str(self._bin(f)[key].dtype).replace("torch.", "")

    def read(self, key: str) -> np.ndarray:
        """One tensor as numpy (bfloat16 via ml_dtypes), bit-exact."""
        f = self.key_to_file[key]
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="numpy") as h:
                return h.get_tensor(key)
        return _torch_to_numpy(self._bin(f)[key])

    def _bin(self, f: Path) -> dict:
        if self._bin_cache is None or self._bin_cache[0] != f:
            self._bin_cache = (f, self._torch_load(f))
        return self._bin_cache[1]

    def files(self) -> Iterator[Path]:
        yield from sorted(set(self.key_to_file.values()))


def _torch_to_numpy(t) -> np.ndarray:
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
