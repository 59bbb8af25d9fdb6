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
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

log = logging.getLogger(__name__)
ITEMS = ("params", "opt_state", "meta")
BEST_METRIC = "eval_metric"  # higher is better


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` with the trainer's item names and retention policy."""

    def __init__(self, directory: str | Path, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        policy = cm.AnyPreservationPolicy([
            cm.preservation_policy.LatestN(n=keep),
            cm.preservation_policy.BestN(get_metric_fn=lambda m: m[BEST_METRIC], n=1,
                                         keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=async_save, create=True,
            best_fn=lambda m: m[BEST_METRIC], best_mode="max", keep_checkpoints_without_metrics=True,
            cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any],
             eval_metric: float | None = None) -> None:
        """Starts an (async) save; `eval_metric` (higher is better) marks candidates for "best"."""
        metrics = None if eval_metric is None else {BEST_METRIC: float(eval_metric)}
        self._mngr.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)), metrics=metrics, force=True)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

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
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        for s in candidates:
            try:
                out = self._mngr.restore(s, args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(abstract(params_like)),
                    opt_state=ocp.args.StandardRestore(abstract(opt_like)), meta=ocp.args.JsonRestore()))
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
        self._mngr.wait_until_finished()
        self._mngr.close()
