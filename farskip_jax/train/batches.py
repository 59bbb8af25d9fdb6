"""Training and evaluation batches: the grain pipelines of `cfg.data`, placed on the mesh.

`data.batch_size` is the global micro-batch B (all processes together); A = `train.grad_accum_steps`
micro-batches make one [A, B, T] step batch, sharded over (data, expert) on B.

Read shards: the records are split into R = `data.read_shards` strided shards (default: the mesh's
data x expert devices, `default_read_shards`), each an independent grain pipeline (shuffle, packing,
iterator state) giving B / R rows per micro-batch. The global micro-batch is shard 0's rows, then
shard 1's, and so on, and a process runs the R / P shards whose rows live on its devices (the mesh
is process-major on the batch axes, parallel/mesh.py). So the batches are a function of R alone: 2
processes x 4 devices and 1 process x 8 devices with the same R train on the same rows in the same
order, and a checkpoint's data state (one iterator state per shard) resumes under any process count
that divides R.
"""

from __future__ import annotations

import dataclasses
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
TRAINER_DATA_KEYS = ("eval_paths", "read_shards")


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


def default_read_shards(sharding: NamedSharding) -> int:
    """`data.read_shards` when unset: the devices the batch is split over (mesh data x expert).
    Fixed by the config's mesh, not by the process count, so 1 process x 8 devices and 2 x 4 read the
    same batches; any process count of the mesh divides it."""
    shape = sharding.mesh.shape
    return int(shape.get("data", 1) * shape.get("expert", 1))


class BatchStream:
    """Global [A, B, T] step batches; this process holds the iterators of its read shards (module
    docstring) and gives its rows of each batch, placed with `sharding` by `to_device`."""

    def __init__(self, cfg: Config, sharding: NamedSharding, accum: int, paths_key: str = "paths", *,
                 process_index: int | None = None, process_count: int | None = None):
        self.dcfg = data_config(cfg, paths_key)
        self.paths_key = paths_key
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.pinned_shards: int | None = cfg.data.get("read_shards")
        self.accum = accum
        self.sharding = sharding
        self._open(self.pinned_shards or default_read_shards(sharding))

    def _open(self, read_shards: int) -> None:
        """Builds this process's shard pipelines for `read_shards` shards."""
        b, p = self.dcfg.batch_size, self.process_count
        if not isinstance(read_shards, int) or read_shards < 1:
            raise UserError("data.read_shards must be an int >= 1 (or null: one per batch device), "
                            f"got {read_shards!r}")
        if read_shards % p:
            raise UserError(f"data.read_shards={read_shards} cannot be split over {p} processes; use a "
                            f"multiple of {p}, e.g. --set data.read_shards={p * max(1, read_shards // p)}")
        if b % read_shards:
            raise UserError(f"data.batch_size={b} (the global micro-batch) is not divisible by "
                            f"data.read_shards={read_shards}; each read shard gives batch_size / read_shards "
                            "rows")
        per_process = read_shards // p
        self.read_shards = read_shards
        first = self.process_index * per_process
        self.local_shards = list(range(first, first + per_process))
        shard_cfg = dataclasses.replace(self.dcfg, batch_size=b // read_shards)
        self.pipelines = {s: build_pipeline(shard_cfg, process_index=s, process_count=read_shards)
                          for s in self.local_shards}
        self.iterators = {s: iter(pl) for s, pl in self.pipelines.items()}

    def _micro_batch(self) -> dict[str, np.ndarray]:
        parts = [next(self.iterators[s]) for s in self.local_shards]
        return {k: np.concatenate([np.asarray(m[k]) for m in parts]) for k in parts[0]}

    def next_host(self) -> dict[str, np.ndarray]:
        mbs = [self._micro_batch() for _ in range(self.accum)]
        return {k: np.stack([m[k] for m in mbs]) for k in mbs[0]}

    def to_device(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return to_device(host, self.sharding)

    def get_state(self) -> dict[str, Any]:
        """This process's part of the data state: {"read_shards": R, "shards": {shard: iterator state}}
        (the trainer merges every process's part into the checkpoint)."""
        return {"read_shards": self.read_shards,
                "shards": {str(s): self.iterators[s].get_state() for s in self.local_shards}}

    def set_state(self, state: Any) -> None:
        """Restores the iterators of this process's shards from a (merged) data state."""
        if not (isinstance(state, dict) and "read_shards" in state):
            state = {"read_shards": 1, "shards": {"0": state}}  # written before read shards existed
        saved = int(state["read_shards"])
        if self.pinned_shards is not None and self.pinned_shards != saved:
            raise UserError(f"the checkpoint's data order has {saved} read shards but the config sets "
                            f"data.read_shards={self.pinned_shards}; resume with --set "
                            f"data.read_shards={saved} (changing it would reshuffle the data mid-run)")
        if saved != self.read_shards:
            try:
                self._open(saved)
            except UserError as e:
                raise UserError(f"cannot resume the checkpoint's data order on {self.process_count} "
                                f"process(es): {e}") from None
        missing = [s for s in self.local_shards if str(s) not in state["shards"]]
        if missing:
            raise UserError(f"the checkpoint's data state lacks read shard(s) {missing} of {saved}")
        for s in self.local_shards:
            self.iterators[s].set_state(state["shards"][str(s)])


def to_device(host: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """This process's rows of a batch, assembled into global arrays in `sharding`."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in host.items()}


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows (leading axis) of a batch-sharded global array, in order: the inverse of
    `to_device` (the whole array in a single-process run)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    by_start = {s.index[0].start or 0: s for s in x.addressable_shards}  # replicas share a start
    return np.concatenate([np.asarray(by_start[k].data) for k in sorted(by_start)])


def eval_batches(cfg: Config, sharding: NamedSharding) -> list[dict[str, np.ndarray]] | None:
    """The first `train.eval_batches` batches of `data.eval_paths` (the same ones every evaluation)."""
    if not cfg.data.get("eval_paths"):
        return None
    stream = BatchStream(cfg, sharding, 1, "eval_paths")
    return [{k: v[0] for k, v in stream.next_host().items()} for _ in range(cfg.train.eval_batches)]


@dataclasses.dataclass
class PrefetchedBatch:
    """One step's batch, made ahead: on the mesh, with what the loop needs from the host copy."""

    step: int
    batch: dict[str, jax.Array]
    host_shape: tuple[int, ...]  # [A, B_local, T] of input_ids
    real_tokens: float  # non-padding tokens of this process's rows
    data_state: dict[str, Any]  # the stream's state after this batch: what a checkpoint after it holds
    seconds: float  # host time spent making it (read, tokenize, pack, device_put)


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Makes the next step batches in a background thread while the device runs the current step.

    Why: the loop was serial (next batch, device_put, step, metrics), so every step's host work was
    device idle time. `make(step)` runs in the thread, in step order; `depth` batches wait ready.
    Each batch carries the stream's state after it, so a checkpoint records the batches the loop
    consumed, not the ones made ahead (a resumed run continues with the same batches). An error in
    the thread is raised by the `next()` that would have returned its batch."""

    def __init__(self, make: Any, first_step: int, depth: int = 1):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, first_step), daemon=True,
                                        name="farskip-prefetch")
        self._thread.start()

    def _run(self, make: Any, step: int) -> None:
        import queue

        while not self._stop.is_set():
            try:
                item: Any = make(step)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                item = _Failure(e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return
            step += 1

    def next(self) -> PrefetchedBatch:
        item = self._queue.get()
        if isinstance(item, _Failure):
            raise item.error
        return item

    def close(self) -> None:
        import queue

        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=30)
