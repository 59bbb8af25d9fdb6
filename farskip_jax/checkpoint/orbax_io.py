"""Reading Orbax parameter checkpoints straight into their target shardings: the one home of the
sharded restore, for converted checkpoints (`convert.py` writes them) and trainer checkpoints.

Every restore passes `jax.ShapeDtypeStruct` targets carrying the wanted `NamedSharding` and dtype
(Orbax `ArrayRestoreArgs`), so TensorStore reads on each host only the chunks of the slices its
devices own, casts them while reading, and no array is ever gathered on one device or host.
Targets without a sharding restore as numpy arrays (the Orbax -> HF converter streams those).

Layout of a converted directory (detected by `farskip_checkpoint.json`, see `convert.py`):
OUT/farskip_checkpoint.json (marker: format, version, dtype, parameter paths and shapes),
OUT/model_config.json, OUT/config.json, and one standard Orbax checkpoint whose single item is
OUT/params/ (the parameter pure dict; written by `ParamsWriter`). Version-1 directories (one Orbax
PyTree per group under OUT/params/<group>/) still load.
A trainer checkpoint: RUN/checkpoints/STEP/{params,opt_state,meta}, "params" being the student's
parameter pure dict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from farskip_jax.checkpoint.common import deep_merge, model_shardings, nest_get, nest_set, raise_problems
from farskip_jax.checkpoint.hf_io import CheckpointError
from farskip_jax.checkpoint.hf_keys import param_specs
from farskip_jax.config import ModelConfig, from_dict, migrate_stored_config, override
from farskip_jax.errors import storage_refusal

MARKER = "farskip_checkpoint.json"
MODEL_CONFIG = "model_config.json"
FORMAT = "farskip-orbax-params"
VERSION = 2  # 1: one Orbax checkpoint per group under params/<group>/ (still read)
READ_VERSIONS = (1, 2)
PARAMS_ITEM = "params"
_PARTIAL = "_orbax_partial"  # partial-save session name inside the output's temp dir


def restore_tree(directory: str | Path, target: Any, partial: bool = False) -> Any:
    """An Orbax PyTree at `directory`, restored leaf by leaf into `target`'s ShapeDtypeStructs:
    with a sharding, a jax.Array placed there (each device reads its slice); without, numpy. Arrays
    are cast to the target dtype while reading. `partial`: restore only the leaves `target` names."""
    import orbax.checkpoint as ocp

    def args(t: jax.ShapeDtypeStruct) -> Any:
        if t.sharding is None:
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=t.dtype)
        return ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype)

    restore_args = jax.tree.map(args, target)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    return ckptr.restore(Path(directory).absolute(), args=ocp.args.PyTreeRestore(
        item=target, restore_args=restore_args, partial_restore=partial))


# --------------------------------------------------------------------------------------------
# Writing one standard Orbax checkpoint group by group


class ParamsWriter:
    """Builds `directory/params` as ONE standard Orbax PyTree checkpoint, added to one group at a
    time (`orbax.checkpoint.experimental.v1.partial`), so host memory holds one group, not the model.

    Every `add` writes its arrays into its own pending OCDBT directory; `finish` merges the pending
    manifests into one (data files stay where they were written: no copy) and lays the result out
    as a v1 checkpoint with the single checkpointable "params" (the same item name and layout as
    a trainer CheckpointManager step): `ocp.StandardCheckpointer().restore(directory / "params")`,
    `ocp.v1.load(directory)` and a Composite restore of item "params" all read it whole.
    Arrays whose path is in `per_row_chunks` are chunked along axis 0 (one routed expert per chunk).
    """

    def __init__(self, directory: Path, per_row_chunks: set[tuple] = frozenset(), compress: bool = False):
        from orbax.checkpoint.experimental import v1
        from orbax.checkpoint.experimental.v1 import options

        # Absolute: Orbax refuses a relative partial-save snapshot path (a relative --output failed).
        self.directory = Path(directory).absolute()
        self._session = self.directory / _PARTIAL
        self._v1 = v1
        storage = options.ArrayOptions.Saving.StorageOptions
        per_row = storage(shard_axes=(0,))

        def scoped(keypath, _value):
            return per_row if _keypath(keypath) in per_row_chunks else None

        self._ctx = v1.Context()
        self._ctx.array.saving.use_compression = compress
        self._ctx.array.saving.scoped_storage_options_creator = scoped
        # Orbax copies numpy leaves before a save by default (MemoryOptions.deepcopy_host_arrays,
        # against a caller changing them while an async save runs). `add` blocks until its save is
        # committed and the arrays are never changed, so the copy only cost one more group in
        # memory and its page faults (0.86 s for 400 MiB of fresh memory here, 0.14 s the copy).
        self._ctx.memory_options.deepcopy_host_arrays = False

    @staticmethod
    def committed_saves(directory: Path) -> list[Path]:
        """The `add` calls that completed in `directory` (a writer that was killed included): Orbax
        commits each partial save by one rename of its directory, so a save cut off never appears."""
        session = Path(directory) / f"{_PARTIAL}.partial_save"
        if not session.is_dir():
            return []
        return sorted(p for p in session.iterdir()
                      if ".pending_" in p.name and (p / "commit_success.txt").is_file())

    @staticmethod
    def committed_paths(directory: Path) -> set[tuple[str, ...]]:
        """Leaf paths (keys as strings) of every committed `add`. Read from each save's tree metadata
        file (`_METADATA`, key_metadata of each leaf): before `finish` a save's arrays are not yet
        in the checkpoint's OCDBT manifest, so Orbax's metadata API cannot open them."""
        paths: set[tuple[str, ...]] = set()
        for save in ParamsWriter.committed_saves(directory):
            tree = json.loads((save / "state" / "_METADATA").read_text())["tree_metadata"]
            paths.update(tuple(str(k["key"]) for k in leaf["key_metadata"]) for leaf in tree.values())
        return paths

    @staticmethod
    def drop_uncommitted(directory: Path) -> None:
        """Removes whatever an `add` cut off by a kill left in `directory` (Orbax temp dirs beside
        and inside the session), so the next `add` continues from the committed saves."""
        import shutil

        session = Path(directory) / f"{_PARTIAL}.partial_save"
        committed = set(ParamsWriter.committed_saves(directory))
        leftovers = [p for p in Path(directory).glob(f"{_PARTIAL}*") if p != session]
        leftovers += [p for p in session.iterdir() if p not in committed] if session.is_dir() else []
        for p in leftovers:
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def add(self, tree: dict) -> None:
        """Writes `tree` (numpy leaves at paths no earlier call wrote) and returns when it is on disk
        and committed. One call at a time: Orbax stages every partial save of a session in the same
        temporary directory (`<session>.orbax-checkpoint-tmp`), so two at once fail."""
        try:
            with self._ctx:
                self._v1.partial.save(self._session, tree)
        except ValueError as e:
            if storage_refusal(e) is None:
                raise
            raise CheckpointError(f"writing the Orbax checkpoint in {self.directory}: {e}") from e

    def finish(self) -> None:
        from orbax.checkpoint.experimental.v1._src.handlers import pytree_handler

        with self._ctx:
            self._v1.partial.finalize(self._session)
        (self._session / "state").rename(self.directory / PARAMS_ITEM)
        meta_file = self._session / "_CHECKPOINT_METADATA"
        meta = json.loads(meta_file.read_text())
        cls = pytree_handler.PyTreeHandler
        meta["item_handlers"] = {PARAMS_ITEM: f"{cls.__module__}.{cls.__qualname__}"}
        meta_file.write_text(json.dumps(meta))
        for f in self._session.iterdir():
            f.rename(self.directory / f.name)
        self._session.rmdir()


def _keypath(keypath: tuple) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keypath)


# --------------------------------------------------------------------------------------------
# Converted checkpoints


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def read_marker(path: str | Path) -> dict:
    f = Path(path) / MARKER
    if not f.is_file():
        raise CheckpointError(f"{path}: no {MARKER}; not a complete farskip Orbax checkpoint (an "
                              "interrupted conversion leaves none)")
    marker = json.loads(f.read_text())
    if marker.get("format") != FORMAT or marker.get("version") not in READ_VERSIONS:
        raise CheckpointError(f"{f}: format {marker.get('format')!r} version {marker.get('version')!r}; "
                              f"expected {FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}")
    return marker


def marker_params(marker: dict) -> list[dict]:
    """[{"path": [...], "shape": [...]}] of every parameter (version 1 lists them per group)."""
    if marker["version"] == 1:
        return [p for g in marker["groups"] for p in g["params"]]
    return marker["params"]


def load_model_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """The stored ModelConfig of a converted checkpoint, with dotted ModelConfig `overrides`.

    A model_config.json written before `ExecutionConfig` existed also holds the execution keys
    (`migrate_stored_config` moves them out); they are not used: how a loaded model runs is the
    caller's (`from_pretrained(..., exe=...)`), and conversion only ever wrote their defaults."""
    f = Path(path) / MODEL_CONFIG
    if not f.is_file():
        raise CheckpointError(f"{path}: no {MODEL_CONFIG}")
    stored = migrate_stored_config({"model": json.loads(f.read_text())})["model"]
    return override(from_dict(ModelConfig, stored, "model"), overrides, "model")


def check_marker_params(path: Path, marker: dict, cfg: ModelConfig) -> None:
    saved = {tuple(p["path"]): tuple(p["shape"]) for p in marker_params(marker)}
    problems = []
    for s in param_specs(cfg):
        if s.path not in saved:
            problems.append(f"{path}: parameter {s.name} is not in the checkpoint")
        elif saved[s.path] != s.shape:
            problems.append(f"{path}: parameter {s.name} has shape {list(saved[s.path])}, the config "
                            f"needs {list(s.shape)}")
    names = {s.path for s in param_specs(cfg)}
    problems += [f"{path}: checkpoint parameter {'/'.join(map(str, p))} is not in the config"
                 for p in saved if p not in names]
    raise_problems(f"Orbax checkpoint {path}", problems)


def params_target(params: list[dict], dtype: Any, sharding_fn: Callable[[tuple], Any] | None) -> dict:
    """ShapeDtypeStructs for marker `params` entries: with a sharding from `sharding_fn`, or none
    (restored as numpy) when it is None."""
    target: dict = {}
    for p in params:
        pth = tuple(p["path"])
        sharding = sharding_fn(pth) if sharding_fn is not None else None
        nest_set(target, pth, jax.ShapeDtypeStruct(tuple(p["shape"]), dtype, sharding=sharding))
    return target


def restore_group(path: Path, group: dict, dtype: Any, sharding_fn: Callable[[tuple], Any] | None) -> dict:
    """One group of a version-1 directory (its own Orbax checkpoint under params/<group>/)."""
    return restore_tree(path / group["dir"], params_target(group["params"], dtype, sharding_fn))


def sharding_fn(shardings: Any, cfg: ModelConfig) -> Callable[[tuple], Any]:
    """path -> sharding from None (this process's first device), a Mesh (EP layout), a pure dict of
    shardings like the parameter tree, or a callable."""
    from jax.sharding import Mesh

    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return lambda path: one
    if isinstance(shardings, Mesh):
        shardings = model_shardings(cfg, shardings)
    if callable(shardings):
        return shardings
    return lambda path: nest_get(shardings, path)


def restore_params(path: str | Path, cfg: ModelConfig, shardings: Any = None, dtype: Any = None) -> dict:
    """The parameter pure dict of a converted checkpoint, restored straight into `shardings`
    (see `sharding_fn`) and cast to `dtype` (default `cfg.param_dtype`) while reading."""
    from farskip_jax.model.layers import DTYPES

    path = Path(path)
    marker = read_marker(path)
    check_marker_params(path, marker, cfg)
    fn = sharding_fn(shardings, cfg)
    dtype = DTYPES[cfg.param_dtype] if dtype is None else dtype
    if marker["version"] == 1:
        out: dict = {}
        for group in marker["groups"]:
            deep_merge(out, restore_group(path, group, dtype, fn))
        return out
    # One restore of the whole tree: TensorStore reads on each host only its devices' slices.
    return restore_tree(path / PARAMS_ITEM, params_target(marker["params"], dtype, fn))


# --------------------------------------------------------------------------------------------
# Trainer checkpoints


def is_trainer_step(path: Path) -> bool:
    return (path / "params").is_dir() and (path / "meta").is_dir()


def trainer_step_dir(path: str | Path) -> Path | None:
    """`path` if it is a trainer checkpoint step, else the newest step under it (a run's
    checkpoints/ directory), else None."""
    p = Path(path)
    if (p / "params").is_dir():
        return p
    if not p.is_dir():
        return None
    steps = sorted(int(q.name) for q in p.iterdir() if q.name.isdigit() and (q / "params").is_dir())
    return p / str(steps[-1]) if steps else None


def saved_tree_metadata(directory: str | Path) -> Any:
    """The nested metadata (shapes, dtypes) of the Orbax PyTree saved at `directory`. The path is made
    absolute: Orbax reads no item metadata through a relative one (it then names no leaf at all)."""
    import orbax.checkpoint as ocp

    # The handler, not a Checkpointer: a Checkpointer also looks for step metadata in the item's
    # directory, where a trainer checkpoint has none, and logs a warning about it.
    meta = ocp.PyTreeCheckpointHandler().metadata(Path(directory).absolute())
    return getattr(meta, "tree", meta)


def restore_trainer_params(step_dir: Path, target: dict) -> dict:
    """The "params" item of a trainer checkpoint step into `target` (a pure dict of ShapeDtypeStructs
    with shardings and dtypes), with every missing or mis-shaped parameter named."""
    tree = saved_tree_metadata(step_dir / "params")
    problems = []
    for keys, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        path = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
        try:
            saved = nest_get(tree, path)
        except (KeyError, TypeError):
            problems.append(f"{step_dir / 'params'}: parameter {'/'.join(path)} is missing")
            continue
        if tuple(saved.shape) != tuple(leaf.shape):
            problems.append(f"{step_dir / 'params'}: parameter {'/'.join(path)} has shape "
                            f"{list(saved.shape)}, the config needs {list(leaf.shape)}")
    raise_problems(f"training checkpoint {step_dir}", problems)
    return restore_tree(step_dir / "params", target)
