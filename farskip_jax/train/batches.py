"""Training and evaluation batches: the grain pipeline of `cfg.data`, placed on the mesh.

`data.batch_size` is the per-process micro-batch; A = `train.grad_accum_steps` micro-batches make
one [A, B, T] step batch, sharded over (data, expert) on B.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from farskip_jax.config import Config
from farskip_jax.data import ChatTemplate, DataConfig, build_pipeline
from farskip_jax.errors import UserError

# cfg.data keys the trainer owns; the rest are DataConfig fields.
TRAINER_DATA_KEYS = ("eval_paths",)


def data_config(cfg: Config, paths_key: str = "paths") -> DataConfig:
    """The DataConfig of `cfg.data` reading `cfg.data[paths_key]`."""
    d = {k: v for k, v in cfg.data.items() if k not in TRAINER_DATA_KEYS}
    if paths_key != "paths":
        d["paths"] = cfg.data[paths_key]
    if "paths" not in d or "tokenizer" not in d:
        raise UserError("config section data needs 'paths' and 'tokenizer': --set data.paths=[train.jsonl] "
                        "--set data.tokenizer=tokenizer.json")
    if isinstance(d.get("template"), dict):
        d["template"] = ChatTemplate(**d["template"])
    try:
        return DataConfig(**d)
    except (TypeError, ValueError) as e:
        raise UserError(f"data: {e}") from e


def check_data_files(cfg: Config) -> None:
    """Fails fast, before any model is built, when a data file or the tokenizer is missing."""
    for key in ("paths", "eval_paths"):
        patterns = cfg.data.get(key) or []
        if isinstance(patterns, str):
            patterns = [patterns]
        for pattern in patterns:
            found = glob.glob(pattern) if glob.has_magic(pattern) else [pattern] * Path(pattern).is_file()
            if not found:
                raise UserError(f"data.{key}: no file matches {pattern!r}; set --set data.{key}=[FILE.jsonl]")
    tok = cfg.data.get("tokenizer")
    if tok is not None and not Path(tok).is_file():
        raise UserError(f"data.tokenizer: {tok!r} does not exist; set --set "
                        "data.tokenizer=PATH/tokenizer.json")


class BatchStream:
    """Global [A, B, T] step batches from this process's grain iterator, placed with `sharding`."""

    def __init__(self, cfg: Config, sharding: NamedSharding, accum: int, paths_key: str = "paths"):
        self.pipeline = build_pipeline(data_config(cfg, paths_key), process_index=jax.process_index(),
                                       process_count=jax.process_count())
        self.iterator = iter(self.pipeline)
        self.accum = accum
        self.sharding = sharding

    def next_host(self) -> dict[str, np.ndarray]:
        mbs = [next(self.iterator) for _ in range(self.accum)]
        return {k: np.stack([np.asarray(m[k]) for m in mbs]) for k in mbs[0]}

    def to_device(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return to_device(host, self.sharding)

    def get_state(self) -> Any:
        return self.iterator.get_state()

    def set_state(self, state: Any) -> None:
        self.iterator.set_state(state)


def to_device(host: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """This process's rows of a batch, assembled into global arrays in `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host.items()}


def eval_batches(cfg: Config, sharding: NamedSharding) -> list[dict[str, np.ndarray]] | None:
    """The first `train.eval_batches` batches of `data.eval_paths` (the same ones every evaluation)."""
    if not cfg.data.get("eval_paths"):
        return None
    stream = BatchStream(cfg, sharding, 1, "eval_paths")
    return [{k: v[0] for k, v in stream.next_host().items()} for _ in range(cfg.train.eval_batches)]
