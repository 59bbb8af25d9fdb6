"""Cached teacher: top-k log-probs per token, precomputed once so distillation runs without the teacher.

Layout of a cache directory (one subdirectory per data-parallel process, since each reads its own shard):
  meta.json                         k, temperature, steps, grad_accum_steps, config name
  p{process}/train_{step:08d}.npz   logp [A, B, T, k] float32, ids [A, B, T, k] int32, input_ids [A, B, T]
  p{process}/eval_{i:04d}.npz       the same for the i-th eval batch (no A axis)
Entries are keyed by training step: the data order is deterministic (grain, fixed seeds), and every
entry stores its input_ids so a cache built for other data or another config fails loudly instead of
silently distilling against the wrong targets.
Size: tokens x k x 8 bytes (k=64: 0.5 KB per token), so this is for modest token budgets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from farskip_jax.errors import UserError


class TeacherCacheError(UserError, RuntimeError):
    """A missing or mismatched cache; the message names the file and how to rebuild it (a UserError,
    so train.py prints it as one line)."""


def _proc_dir(root: Path) -> Path:
    return root / f"p{jax.process_index()}"


def write_meta(root: str | Path, meta: dict[str, Any]) -> None:
    root = Path(root)
    _proc_dir(root).mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (root / "meta.json").write_text(json.dumps(meta, indent=1))


def write_entry(root: str | Path, name: str, logp: np.ndarray, ids: np.ndarray,
                input_ids: np.ndarray) -> None:
    path = _proc_dir(Path(root)) / f"{name}.npz"
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, logp=logp.astype(np.float32), ids=ids.astype(np.int32), input_ids=input_ids)
    tmp.replace(path)  # atomic: a killed precompute never leaves a half-written entry


class TeacherCache:
    def __init__(self, root: str | Path, k: int, temperature: float):
        self.root = Path(root)
        meta_file = self.root / "meta.json"
        if not meta_file.exists():
            raise TeacherCacheError(f"{self.root}: no meta.json; build it with train.py --precompute-teacher")
        self.meta = json.loads(meta_file.read_text())
        if self.meta["k"] != k or abs(self.meta["temperature"] - temperature) > 1e-9:
            raise TeacherCacheError(f"{self.root} holds top-{self.meta['k']} at temperature "
                                    f"{self.meta['temperature']}; the config asks for top-{k} at "
                                    f"{temperature}")

    def load(self, name: str, input_ids: np.ndarray) -> dict[str, np.ndarray]:
        path = _proc_dir(self.root) / f"{name}.npz"
        if not path.exists():
            raise TeacherCacheError(f"{path} missing (cache built for {self.meta.get('steps')} steps)")
        with np.load(path) as z:
            if z["input_ids"].shape != input_ids.shape or not np.array_equal(z["input_ids"], input_ids):
                raise TeacherCacheError(f"{path}: cached tokens differ from the batch being trained on; the "
                                        "cache was built for other data, seeds or batch settings")
            return {"teacher_topk_logp": z["logp"], "teacher_topk_ids": z["ids"]}
