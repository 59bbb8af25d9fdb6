"""Training checkpoints: an Orbax CheckpointManager holding "params", "opt_state" and "meta".

* "params" is the student's pure parameter dict (what the HF converter's --to-hf reads);
  "opt_state" the optax state; "meta" a JSON item with the step, RNG key, data-iterator state,
  early-stopping state and the run's config.
* Saves are asynchronous; Orbax writes into a temporary directory and renames it when complete,
  so a killed writer leaves no directory that looks finished.
* Retention: the last `keep` checkpoints plus the best one by the eval metric (Orbax
  preservation policies), so early stopping can always hand back the best model.
* Restore walks from the newest step down and skips (with a warning) any step it cannot read,
  e.g. a directory truncated by a crash or a full disk, instead of failing the resume.
* Bounded staging (`staging_gb`, the trainer's `train.checkpoint_staging_gb`): by default Orbax copies
  every array of a save off the devices into host memory inside `save()`, i.e. a whole state per host
  at once (~190 GB per node for DeepSeek-V2-Lite's FCSD state). With a bound, the copies move to the
  background thread in batches of at most `staging_gb` GB per process, each written before the next is
  copied. Those copies then happen while the next training steps run, and the steps donate (reuse) the
  state's device buffers, so the manager saves a device-side copy of the state made at `save()` (one
  jitted copy, dispatched asynchronously, freed when the save has written it): one state's worth of
  device memory for the duration of the save, in exchange for host memory bounded by `staging_gb`.
* After each save the process hands the host memory its writer threads freed back to the OS
  (`malloc_trim`): glibc keeps it in per-thread arenas otherwise, and a new save's threads do not
  reuse all of it, so the process grows across saves (measured for the converter's Orbax saves,
  BENCHMARKS 5).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

# orbax-checkpoint 0.12.8 (pinned) schedules an array's device-to-host copy by the ArrayHandler's
# callback: the default says "synchronous" for every array, and then `save_device_host_concurrent_gb`
# bounds nothing. The priority enum and the array metadata store (the default handler's, kept so the
# files stay as they were) are only importable from `_src` in this version.
from orbax.checkpoint._src.metadata.array_metadata_store import Store as _ArrayMetadataStore
from orbax.checkpoint._src.serialization.types import TransferPriority

from farskip_jax.errors import UserError, storage_refusal

log = logging.getLogger(__name__)


class _DropBoundedSaveNotice(logging.Filter):
    """Drops Orbax's warning that no array is copied to the host inside `save()` ("No prioritized
    params found for saving"): with a staging bound every copy is made in the background by design
    (`_InBackground`), so the warning would be printed twice per checkpoint and mean nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No prioritized params found for saving" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropBoundedSaveNotice())  # Orbax logs through absl's logger

ARRAY_ITEMS = ("params", "opt_state")  # beside them, "meta" (JSON)
BEST_METRIC = "eval_metric"  # higher is better


class _InBackground:
    """Orbax serialization callback: every jax.Array's device-to-host copy is made by the save's
    background thread, in batches bounded by the handler's `save_device_host_concurrent_gb`."""

    def key_priority(self, keypath: Any) -> TransferPriority:
        return TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

    def on_transfer_start(self, keypath: Any) -> None:
        pass

    def on_transfer_end(self, keypath: Any) -> None:
        pass

    def on_write_start(self, keypath: Any) -> None:
        pass

    def on_write_end(self, keypath: Any) -> None:
        pass


def _bounded_registry() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard type handlers, with jax.Array's copies scheduled in the background."""
    handlers = []
    for ty in ocp.type_handlers.supported_types():
        if ty is jax.Array:
            handlers.append((ty, ocp.type_handlers.ArrayHandler(array_metadata_store=_ArrayMetadataStore(),
                                                                callback=_InBackground())))
        else:
            handlers.append((ty, ocp.type_handlers.get_type_handler(ty)))
    return ocp.type_handlers.create_type_handler_registry(*handlers)


def _array_handler(staging_gb: float | None, pinned_host_transfer: bool | None
                   ) -> ocp.PyTreeCheckpointHandler:
    """The handler of one array item ("params", "opt_state"); both items are saved concurrently, so
    each gets half of the bound. The files are those of `ocp.args.StandardSave` either way."""
    if staging_gb is None:
        return ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=pinned_host_transfer)
    return ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=staging_gb / len(ARRAY_ITEMS),
                                       type_handler_registry=_bounded_registry(),
                                       enable_pinned_host_transfer=pinned_host_transfer)


def _find_malloc_trim() -> Any:
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_MALLOC_TRIM = _find_malloc_trim()


def release_freed_host_memory() -> None:
    """Returns the free memory of every malloc arena to the OS (what a finished save's writer threads
    freed: tensorstore's buffers, the host copies); a no-op without glibc."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def device_copy(tree: Any) -> Any:
    """A copy of `tree` in fresh device buffers on the same shardings, which steps that donate `tree`
    leave alone. One jitted program, dispatched asynchronously: one read and one write of the state on
    each device (on a GPU ~10-15 ms for 24 GB at HBM rates, estimated, not measured)."""
    # Explicit out_shardings: the copy's shardings are the state's, spelled the same (what the
    # checkpoint's _sharding file records), not whatever propagation picks.
    return jax.jit(_copy, out_shardings=jax.tree.map(lambda x: x.sharding, tree))(tree)


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` with the trainer's item names and retention policy.

    `staging_gb`: the most GB of the saved state copied into host memory at once per process (split
    evenly between the two array items, which Orbax saves concurrently); None: all of it in `save()`.
    `pinned_host_transfer`: Orbax's `enable_pinned_host_transfer` (None: on GPUs only); the benchmark
    turns it on for CPU runs, where the copy to `pinned_host` memory stands in for a GPU's
    device-to-host copy (CPU arrays otherwise reach host memory without one).
    """

    def __init__(self, directory: str | Path, keep: int, async_save: bool = True,
                 staging_gb: float | None = None, pinned_host_transfer: bool | None = None):
        if staging_gb is not None and staging_gb <= 0:
            raise ValueError(f"staging_gb must be None or > 0, got {staging_gb}")
        self.directory = Path(directory).absolute()
        self.staging_gb = staging_gb
        self._pending: int | None = None  # the step of the newest save started
        # Synchronous saves return after writing, before any step can donate the state: no copy needed.
        self._snapshot = async_save and staging_gb is not None
        policy = cm.AnyPreservationPolicy([
            cm.preservation_policy.LatestN(n=keep),
            cm.preservation_policy.BestN(get_metric_fn=lambda m: m[BEST_METRIC], n=1,
                                         keep_checkpoints_without_metrics=False),
        ])
        self._async = async_save
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=async_save, create=True,
            best_fn=lambda m: m[BEST_METRIC], best_mode="max", keep_checkpoints_without_metrics=True,
            cleanup_tmp_directories=True,
            # Runs in the save's background thread once the items are written.
            async_options=ocp.AsyncOptions(post_finalization_callback=release_freed_host_memory)
            if async_save else None)
        handlers = {name: _array_handler(staging_gb, pinned_host_transfer) for name in ARRAY_ITEMS}
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_handlers={**handlers, "meta": ocp.JsonCheckpointHandler()})

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any],
             eval_metric: float | None = None) -> None:
        """Starts an (async) save; `eval_metric` (higher is better) marks candidates for "best".

        With bounded staging the arrays are copied on the devices first (`device_copy`), so the caller
        may donate or change `params` and `opt_state` as soon as this returns.
        """
        metrics = None if eval_metric is None else {BEST_METRIC: float(eval_metric)}
        if self._snapshot:
            params, opt_state = device_copy((params, opt_state))
        # An async save's failure surfaces at the next save or wait.
        with self._storage_errors(self._pending if self._async else step):
            self._pending = step
            self._mngr.save(step, args=ocp.args.Composite(
                params=ocp.args.PyTreeSave(params), opt_state=ocp.args.PyTreeSave(opt_state),
                meta=ocp.args.JsonSave(meta)), metrics=metrics, force=True)
        if not self._async:
            release_freed_host_memory()

    def wait(self) -> None:
        with self._storage_errors(self._pending):
            self._mngr.wait_until_finished()

    @contextlib.contextmanager
    def _storage_errors(self, failed: int | None) -> Iterator[None]:
        """A save (of step `failed`) that the storage refused (a full disk, a quota:
        `storage_refusal`) ends the run with one line naming the checkpoint and the last complete one
        to resume from, not Orbax's traceback. The checkpoints already written stay as they were
        (each is committed by one rename)."""
        try:
            yield
        except (OSError, ValueError) as e:
            if (reason := storage_refusal(e)) is None:
                raise
            done = [s for s in self.steps() if s != failed]
            last = f"{self.directory / str(done[-1])}" if done else "none yet"
            name = self.directory / str(failed) if failed is not None else self.directory
            raise UserError(f"checkpoint {name}: the storage refused a write "
                            f"({reason}); the last complete checkpoint is {last}. Free space, then rerun "
                            "with --resume") from e

    def saving(self) -> bool:
        """Whether a save is still being written."""
        return self._mngr.is_saving_in_progress()

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def best_step(self) -> int | None:
        return self._mngr.best_step()

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def restore(self, params_like: Any, opt_like: Any, step: int | None = None
                ) -> tuple[int, Any, Any, dict[str, Any]] | None:
        """Restores `step` (default: the newest readable one) onto the shardings of the `*_like` trees.

        Returns (step, params, opt_state, meta), or None when no readable checkpoint exists.
        """
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)

        def pytree(like: Any) -> ocp.args.PyTreeRestore:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
            return ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(
                abstract))

        for s in candidates:
            try:
                out = self._mngr.restore(s, args=ocp.args.Composite(
                    params=pytree(params_like), opt_state=pytree(opt_like), meta=ocp.args.JsonRestore()))
                meta = out["meta"]
                if not isinstance(meta, dict) or meta.get("step") != s:
                    raise ValueError(f"meta item missing or for another step: {meta!r:.200}")
                return s, out["params"], out["opt_state"], meta
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped, not fatal
                log.warning("checkpoint %s/%s is unreadable (%s: %.300s); skipping it", self.directory, s,
                            type(e).__name__, e)
        return None

    def restore_meta(self, step: int) -> dict[str, Any]:
        return self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def close(self) -> None:
        self.wait()
        self._mngr.close()
