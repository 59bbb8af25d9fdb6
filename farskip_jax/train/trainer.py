"""The training loop: FCSD / SFT / LM steps, evaluation + early stopping, checkpoints, resume, guards.

Test hooks (environment variables, read once per run; they exist so tests can crash a real process):
  FARSKIP_TEST_KILL_AFTER_CHECKPOINT=N  SIGKILL this process right after the checkpoint of step N is on disk
  FARSKIP_TEST_KILL_PROCESS=I           ... only process I of a multi-process run (default: every process)
  FARSKIP_TEST_NAN_STEPS=3,4            poison the loss (NaN) at these 0-based steps
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.checkpoint.manager import CheckpointManager
from farskip_jax.config import Config, to_dict
from farskip_jax.distributed import allgather_json
from farskip_jax.errors import UserError
from farskip_jax.train import batches, remat, scheduled_step, setup
from farskip_jax.train.early_stop import EarlyStopper
from farskip_jax.train.metrics_log import MetricsLog
from farskip_jax.train.program import TrainProgram, build_program, teacher_copies
from farskip_jax.train.teacher_cache import TeacherCache
from farskip_jax.train.zero1 import batch_devices

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _InFlight:
    """A dispatched train step whose metrics the loop has not read yet."""

    item: batches.PrefetchedBatch
    scale: jax.Array  # its loss_scale, for a re-run
    metrics: dict[str, jax.Array]


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps; the message names the last good checkpoint."""


def _to_jsonable(x: Any) -> Any:
    if isinstance(x, bytes):
        return {"__bytes__": x.decode("latin-1")}
    if isinstance(x, dict):
        return {str(k): _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _from_jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__bytes__"}:
            return x["__bytes__"].encode("latin-1")
        return {k: _from_jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_jsonable(v) for v in x]
    return x


def _env_steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        tc = cfg.train
        self.out = Path(tc.output_dir)
        # Every check of the user's input runs before the model is built or loaded.
        self.mesh = setup.training_mesh(cfg)
        batches.check_data_files(cfg)
        check_init_checkpoint(cfg)
        self.program = build_program(cfg, self.mesh)
        self.parallel, self.spec = self.program.parallel, self.program.spec
        if self.parallel is not None and self.parallel.nodes > 1:
            log.info("expert exchange: node-aware, %d nodes of %d expert ranks (mesh.expert_per_node=%s)",
                     self.parallel.nodes, self.parallel.expert_per_node, cfg.mesh.expert_per_node)
        if self.spec.cached_teacher and tc.hidden_l2_weight > 0:
            raise UserError("train.hidden_l2_weight needs the teacher's hidden states; it cannot be used "
                            "with train.teacher_cache (set one of them to 0 / null)")
        self.cache = TeacherCache(tc.teacher_cache, tc.teacher_topk, tc.kl_temperature) \
            if self.spec.cached_teacher else None
        self.data = batches.BatchStream(cfg, self.program.batch_sharding, tc.grad_accum_steps)
        self.eval_data = batches.eval_batches(cfg, self.program.eval_batch_sharding)
        self.models = setup.build_models(cfg, self.program)
        self.state = self.program.init_state(self.models.student_params)
        self.train_step = self.program.train_step
        self.eval_step = self.program.eval_step()
        self._worst_eval_step = None  # built when an eval batch first overflows
        self.ckpt = CheckpointManager(self.out / "checkpoints", tc.keep_checkpoints,
                                      staging_gb=tc.checkpoint_staging_gb)
        self.stopper = EarlyStopper(tc.patience, tc.drop_threshold)
        self.gen_eval = None
        if tc.gen_eval.path is not None:
            if jax.process_count() > 1:
                raise UserError("train.gen_eval runs in single-process jobs only (its generator would move "
                                "the parameters between hosts); in a multi-process job set "
                                "train.gen_eval.path=null and score checkpoints with `python -m farskip_jax "
                                "generate` on one node")
            from farskip_jax.train.gen_eval import GenerationEval

            dcfg = batches.data_config(cfg)
            self.gen_eval = GenerationEval(tc.gen_eval, self.program.student_cfg, self.program.student_graph,
                                           self.state["params"], dcfg.tokenizer, dcfg.template)
            if tc.eval_metric in ("exact_match", "pass_at_1") and tc.eval_metric != self.gen_eval.metric:
                raise UserError(f"train.eval_metric={tc.eval_metric} but {tc.gen_eval.path} holds "
                                f"{self.gen_eval.metric} records ('answer': exact_match, 'tests': pass_at_1)")
        self.pgle_target = scheduled_step.profile_target(cfg)  # compiled with the first batch
        # execution.remat (auto: chosen by memory) is settled with the first batch, the worst-case
        # re-run's when a step first overflows (train/remat.py)
        self.remat_choice: remat.Choice | None = None
        self._worst_step: Any = None
        self.rng = jax.random.key_data(jax.random.key(tc.seed))
        self.step = 0
        self.loss_ema: float | None = None
        # moe_overflow_reruns: steps (and eval batches) whose bounded routed-expert buffers overflowed
        # and were run again with the worst-case program (execution.moe_buffer_factor)
        self.counts = {"nonfinite_skipped": 0, "spikes": 0, "nonfinite_in_row": 0, "moe_overflow_reruns": 0}
        self._consumed_data_state: dict[str, Any] | None = None  # set by the loop (`_data_state`)
        # host time per step: making the batch (in the prefetch thread), the loop waiting for it, the
        # loop's own work (dispatch, bookkeeping, logs) and the loop blocked on the device's metrics
        self.host_times = {"batch_s": 0.0, "wait_s": 0.0, "loop_s": 0.0, "read_s": 0.0, "steps": 0}

    def _make_batch(self, step: int) -> batches.PrefetchedBatch:
        """Step `step`'s batch on the mesh (runs in the prefetch thread)."""
        t0 = time.perf_counter()
        host = self._with_cache(self.data.next_host(), f"train_{step:08d}")
        real = float(np.sum(host["segment_ids"] > 0)) * jax.process_count()
        batch = self.data.to_device(host)
        state = copy.deepcopy(self.data.get_state())  # a snapshot: the stream moves on in this thread
        return batches.PrefetchedBatch(step, batch, host["input_ids"].shape, real, state,
                                       time.perf_counter() - t0)

    # ---- state <-> checkpoint -------------------------------------------------------------

    def _pure_params(self) -> dict:
        return nnx.to_pure_dict(self.state["params"])

    def _data_state(self) -> dict[str, Any]:
        """Every read shard's iterator state after the last batch the loop consumed, from all processes
        (process 0 writes the meta item). While the loop runs, the stream itself is ahead (batches are
        made in advance): the consumed batch's recorded state is the one that resumes exactly."""
        state = self._consumed_data_state if self._consumed_data_state is not None else self.data.get_state()
        parts = allgather_json(_to_jsonable(state))
        return {"read_shards": parts[0]["read_shards"],
                "shards": {k: v for part in parts for k, v in part["shards"].items()}}

    def _meta(self) -> dict[str, Any]:
        return {"step": self.step, "rng": np.asarray(self.rng).tolist(),
                "data_state": self._data_state(), "early_stop": self.stopper.state(),
                "loss_ema": self.loss_ema, "counts": dict(self.counts), "config": to_dict(self.cfg)}

    def save(self, eval_metric: float | None = None) -> None:
        self.ckpt.save(self.step, self._pure_params(), self.state["opt_state"], self._meta(), eval_metric)

    def resume(self) -> bool:
        """Restores the newest readable checkpoint; False when there is none (fresh start)."""
        got = self.ckpt.restore(self._pure_params(), self.state["opt_state"])
        if got is None:
            log.warning("--resume: no readable checkpoint under %s; starting from scratch",
                        self.ckpt.directory)
            return False
        step, pure, opt_state, meta = got
        params = self.state["params"]
        nnx.replace_by_pure_dict(params, pure)
        put = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), self.state["step"].sharding)
        self.state = {"params": params, "opt_state": opt_state, "step": put(step),
                      "skipped": put(meta["counts"]["nonfinite_skipped"])}
        self.step = step
        self.rng = np.asarray(meta["rng"], np.uint32)
        self.data.set_state(_from_jsonable(meta["data_state"]))
        self.stopper.load(meta["early_stop"])
        self.loss_ema = meta["loss_ema"]
        self.counts = dict(meta["counts"])
        log.info("resumed from %s/%d", self.ckpt.directory, step)
        return True

    # ---- batches --------------------------------------------------------------------------

    def _with_cache(self, host: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
        if self.cache is None:
            return host
        return {**host, **self.cache.load(name, host["input_ids"])}

    def evaluate(self) -> dict[str, float] | None:
        """Teacher-forced metrics on `data.eval_paths` and/or generation metrics (`train.gen_eval`);
        "metric" is `train.eval_metric`'s value (None: nothing to evaluate)."""
        res = self._teacher_forced_eval() or {}
        if self.gen_eval is not None:
            res.update(self.gen_eval(self.state["params"]))
        if not res:
            return None
        metric = self.cfg.train.eval_metric
        if (metric == "neg_loss" and "loss" not in res) or (metric != "neg_loss" and metric not in res):
            raise UserError(f"train.eval_metric={metric} needs data.eval_paths (teacher-forced metrics)")
        res["metric"] = -res["loss"] if metric == "neg_loss" else res[metric]
        return res

    def _teacher_forced_eval(self) -> dict[str, float] | None:
        if self.eval_data is None:
            return None
        sums: dict[str, float] = {}
        for i, host in enumerate(self.eval_data):
            host = self._with_cache(host, f"eval_{i:04d}")
            batch = batches.to_device(host, self.program.eval_batch_sharding)
            out = jax.device_get(self.eval_step(self.state["params"], self.models.teacher_params, batch))
            if out.get("moe_overflow", 0) > 0:
                self.counts["moe_overflow_reruns"] += 1
                if self._worst_eval_step is None:
                    self._worst_eval_step = self.program.eval_step(bounded=False)
                out = jax.device_get(self._worst_eval_step(self.state["params"], self.models.teacher_params,
                                                           batch))
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        n = max(sums["num_tokens"], 1.0)
        res = {"next_token_acc": sums["correct"] / n, "tokens": sums["num_tokens"]}
        if "agree" in sums:
            res["teacher_agreement"] = sums["agree"] / n
        if self.spec.mode == "fcsd":
            res["kl"] = sums["kl_sum"] / n
            res["loss"] = res["kl"]
        else:
            res["ce"] = sums["ce_sum"] / n
            res["loss"] = res["ce"]
        return res

    # ---- loop -----------------------------------------------------------------------------

    def _record(self, m: dict[str, Any]) -> tuple[float, bool]:
        """Host-side bookkeeping of one step's metrics: the non-finite counter and spike detection."""
        loss, ok = float(m["loss"]), bool(m["ok"])
        tc = self.cfg.train
        if not ok:
            self.counts["nonfinite_skipped"] += 1
            self.counts["nonfinite_in_row"] += 1
            log.warning("step %d: non-finite loss/gradient (loss=%s, grad_norm=%s); update skipped",
                        self.step, loss, float(m["grad_norm"]))
            return loss, False
        self.counts["nonfinite_in_row"] = 0
        if self.loss_ema is not None and loss > tc.spike_factor * self.loss_ema:
            self.counts["spikes"] += 1
            log.warning("step %d: loss spike %.4g > %.1f x running mean %.4g", self.step, loss,
                        tc.spike_factor, self.loss_ema)
        self.loss_ema = loss if self.loss_ema is None else 0.98 * self.loss_ema + 0.02 * loss
        return loss, True

    def _step_values(self, m: dict[str, Any], loss: float) -> dict[str, float]:
        n = max(float(m["num_tokens"]), 1.0)
        vals = {"loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(m["lr"]), "tokens": n}
        if self.spec.mode == "fcsd":
            vals["kl"] = float(m["kl_sum"]) / n
            if self.spec.hidden_l2_weight > 0:
                vals["hidden_l2"] = float(m["l2_sum"]) / n
            if self.cache is not None:
                vals["teacher_topk_mass"] = float(m["teacher_topk_mass_sum"]) / n
        else:
            vals["ce"] = float(m["ce_sum"]) / n
        if self.spec.aux_loss:
            vals["aux"] = float(m["aux"])
        # Routed assignments over capacity (0.0 when dropless; the teacher always is).
        vals["student_dropped_fraction"] = float(m["student_dropped_fraction"])
        vals["teacher_dropped_fraction"] = float(m["teacher_dropped_fraction"])
        return vals

    def _host_gap(self) -> dict[str, float]:
        """Mean host milliseconds per step so far. batch: making it (in the prefetch thread); wait: the
        loop waiting for it; loop: the loop's own work (dispatching the step, reading its metrics into
        counters, logs and the progress bar), which the device spends running the next step except at
        checkpoints and evaluations (a serial loop left it idle for all of batch + loop); read: the
        loop blocked on a step's metrics, i.e. the device busy."""
        n = max(self.host_times["steps"], 1)
        return {f"host_{k}_ms": 1e3 * self.host_times[f"{k}_s"] / n
                for k in ("batch", "wait", "loop", "read")}

    def _evaluates(self, step: int) -> bool:
        """Whether the loop evaluates after `step` steps (and then checkpoints, with the metric)."""
        return step % self.cfg.train.eval_every == 0 or step == self.cfg.train.total_steps

    def _checkpoints(self, step: int) -> bool:
        """Whether the loop checkpoints after `step` steps whatever the evaluation says."""
        return step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.total_steps

    def _dispatch(self, prefetch: batches.Prefetcher, index: int, after_void: jax.Array,
                  nan_steps: set[int]) -> _InFlight:
        """Runs step `index` (0-based) on the next prefetched batch without waiting for it."""
        t_wait = time.perf_counter()
        item = prefetch.next()
        t_host = time.perf_counter()
        self.host_times["wait_s"] += t_host - t_wait
        self.host_times["batch_s"] += item.seconds
        self.host_times["steps"] += 1
        scale = jnp.float32(jnp.nan if index in nan_steps else 1.0)
        if self.remat_choice is None:
            self._choose_remat((self.state, self.models.teacher_params, item.batch, scale, after_void))
            t_host = time.perf_counter()  # compiles are not per-step host work
        if self.pgle_target is not None:
            self.train_step = scheduled_step.scheduled_train_step(
                self.train_step, (self.state, self.models.teacher_params, item.batch, scale, after_void),
                self.pgle_target, self.out / "pgle", self.cfg,
                item.host_shape[1] * jax.process_count() // batch_devices(self.mesh))
            self.pgle_target = None
            t_host = time.perf_counter()  # the profile compile is not per-step host work
        self.state, metrics = self.train_step(self.state, self.models.teacher_params, item.batch, scale,
                                              after_void)
        if self.host_times["steps"] > 1:  # the first call compiles: not per-step host work
            self.host_times["loop_s"] += time.perf_counter() - t_host
        return _InFlight(item, scale, metrics)

    def _choose_remat(self, args: tuple) -> None:
        """Settles execution.remat before the first step (`remat.settle`): under auto the program
        becomes the one that fits, compiled once there."""
        (program, compiled), self.remat_choice = remat.settle(self.cfg, self.program, args,
                                                              memo=self.out / remat.MEMO_NAME)
        if teacher_copies(program.parallel) != teacher_copies(self.program.parallel):
            self._lay_out_teacher(program)
        self.program = program
        if compiled is not None:
            # the synthetic PGLE compile wants the jitted step (it compiles it twice itself)
            self.train_step = compiled if self.pgle_target is None else self.program.train_step
        if self.cfg.execution.remat == "auto":
            log.info("execution.remat=auto: %s", self.remat_choice.describe())

    def _lay_out_teacher(self, program: TrainProgram) -> None:
        """`execution.remat: auto`'s search placed the FCSD teacher's routed experts otherwise than
        the program built first (all of them on every device, `mesh.teacher_experts: auto`): the
        teacher's parameters move into that layout, and what was built for the first one follows."""
        teacher = setup.retile_teacher(self.models.teacher_params, teacher_copies(self.program.parallel),
                                       teacher_copies(program.parallel), program.teacher_shardings)
        self.models = dataclasses.replace(self.models, teacher_params=teacher)  # the old layout's freed
        self.parallel, self.spec = program.parallel, program.spec
        self.eval_step = program.eval_step()
        log.info("mesh.teacher_experts=auto: the FCSD teacher's routed experts are on every device (the "
                 "step fits: %s); train.teacher_lockstep=%s", self.remat_choice.describe(),
                 self.spec.teacher_lockstep)

    def _worst_case_step(self, args: tuple) -> Any:
        """The worst-case re-run of an overflowed step (compiled at the first overflow): the bounded
        step's policy if it fits, else the first policy recomputing more that does (`remat`)."""
        if self._worst_step is None:
            (prog, compiled), choice = remat.settle(self.cfg, self.program, args, worst_case=True,
                                                    memo=self.out / remat.MEMO_NAME)
            self._worst_step = compiled if compiled is not None else prog.worst_case_train_step
            if remat.policy_of(choice.policy) != self.program.student_exe.remat:
                log.warning("the worst-case re-run recomputes as execution.remat=%s: %s does not fit "
                            "with worst-case buffers (%s)", remat.policy_of(choice.policy),
                            self.program.student_exe.remat,
                            choice.describe())
        return self._worst_step

    def _rerun_overflowed(self, in_flight: _InFlight, nxt: _InFlight | None,
                          zero: jax.Array) -> dict[str, Any]:
        """The bounded buffers overflowed somewhere in step `in_flight`: that step changed nothing, so
        the same batch runs again with the worst-case buffers and the step stays exactly dropless. The
        step dispatched after it (`nxt`) was void too (its after_void), so it runs again as well.
        Returns the re-run's metrics, read."""
        self.counts["moe_overflow_reruns"] += 1
        log.info("step %d: a routed-expert buffer overflowed (execution.moe_buffer_factor=%g); "
                 "re-running it with the worst-case buffers (%d re-runs so far)", self.step,
                 self.cfg.execution.moe_buffer_factor, self.counts["moe_overflow_reruns"])
        teacher = self.models.teacher_params
        rerun = (self.state, teacher, in_flight.item.batch, in_flight.scale, zero)
        self.state, metrics = self._worst_case_step(rerun)(*rerun)
        metrics = jax.device_get(metrics)
        if nxt is not None:
            self.state, nxt.metrics = self.train_step(self.state, teacher, nxt.item.batch, nxt.scale, zero)
        return metrics

    def _raise_if_nonfinite_in_row(self) -> None:
        tc = self.cfg.train
        if self.counts["nonfinite_in_row"] < tc.max_nonfinite_in_row:
            return
        self.ckpt.wait()
        last = self.ckpt.latest_step()
        where = f"{self.ckpt.directory}/{last}" if last is not None else "none saved yet"
        raise NonFiniteError(
            f"{self.counts['nonfinite_in_row']} non-finite steps in a row "
            f"(train.max_nonfinite_in_row={tc.max_nonfinite_in_row}) at step {self.step}; the "
            f"updates were skipped, the last good checkpoint is {where}. Lower "
            "train.learning_rate or check the data.")

    def _evaluate_and_save(self, mlog: MetricsLog, kill_after: set[int]) -> dict[str, float] | None:
        """After step self.step: the evaluation and checkpoint it is due (a checkpoint follows every
        evaluation, with its metric, and an early stop). Returns the evaluation's values, if any."""
        metric, result = None, None
        if self._evaluates(self.step):
            result = self.evaluate()
            if result is not None:
                metric = result["metric"]
                mlog.write("eval", self.step, result)
                if self.stopper.update(self.step, metric):
                    self.stop_reason = self.stopper.reason
        if self._checkpoints(self.step) or metric is not None or self.stop_reason:
            self.save(metric)
            if self.step in kill_after:
                self.ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    def run(self, resume: bool = False) -> dict[str, Any]:
        from tqdm.auto import tqdm

        tc = self.cfg.train
        if resume:
            self.resume()
        elif self.ckpt.steps():
            # Otherwise the first save onto an existing step fails, possibly hours into the run.
            raise UserError(f"{self.ckpt.directory} already holds checkpoints (steps {self.ckpt.steps()}); "
                            "pass --resume to continue from the newest, or set train.output_dir to a new "
                            "directory")
        kill_after = _env_steps("FARSKIP_TEST_KILL_AFTER_CHECKPOINT")
        if os.environ.get("FARSKIP_TEST_KILL_PROCESS", str(jax.process_index())) != str(jax.process_index()):
            kill_after = set()
        nan_steps = _env_steps("FARSKIP_TEST_NAN_STEPS")
        mlog = MetricsLog(self.out, self.step)
        if jax.process_index() == 0:
            (self.out / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=1))
        bar = tqdm(total=tc.total_steps, initial=self.step, disable=jax.process_index() != 0,
                   dynamic_ncols=True, desc=f"{self.cfg.name}:{tc.mode}")
        t0, tokens_seen, last_eval = time.perf_counter(), 0.0, None
        real_tokens, loss = 0.0, float("nan")
        self.stop_reason = None
        self._consumed_data_state = self.data.get_state()  # before the prefetch thread moves the stream
        prefetch = batches.Prefetcher(self._make_batch, self.step)
        # after_void of a first step and of every re-run (see make_train_step)
        zero = jax.device_put(np.float32(0.0), self.program.shardings.scalar)
        in_flight: _InFlight | None = None  # dispatched, its metrics not read yet (step self.step)
        try:
            while in_flight is not None or self.step < tc.total_steps:
                # Step i+1 is dispatched before step i's metrics are read, so the device runs it while
                # the host reads, logs and counts. Not after a step whose state the host needs as it is
                # (a checkpoint, an evaluation, the end, a test's kill): the device idles there.
                nxt, index = None, self.step + (in_flight is not None)
                needs_state = in_flight is not None and (self._evaluates(index) or self._checkpoints(index)
                                                         or index in kill_after)
                if index < tc.total_steps and not needs_state:
                    after_void = zero if in_flight is None else in_flight.metrics["void"]
                    nxt = self._dispatch(prefetch, index, after_void, nan_steps)
                if in_flight is None:
                    in_flight = nxt
                    continue
                t_read = time.perf_counter()
                m = jax.device_get(in_flight.metrics)
                self.host_times["read_s"] += time.perf_counter() - t_read
                if m["moe_overflow"] > 0:
                    m = self._rerun_overflowed(in_flight, nxt, zero)
                t_host = time.perf_counter()
                loss, ok = self._record(m)
                self.step += 1
                real_tokens += in_flight.item.real_tokens
                self._consumed_data_state = in_flight.item.data_state
                tokens_seen += float(m["num_tokens"])
                vals = self._step_values(m, loss)
                if self.step % tc.log_every == 0 or self.step == tc.total_steps:
                    mlog.write("train", self.step, {**vals, "skipped": self.counts["nonfinite_skipped"],
                                                    "moe_overflow_reruns":
                                                        self.counts["moe_overflow_reruns"],
                                                    **self._host_gap()})
                elapsed = time.perf_counter() - t0
                bar.set_postfix(loss=f"{loss:.4g}", tok_s=f"{real_tokens / max(elapsed, 1e-9):.0f}",
                                lr=f"{vals['lr']:.2e}", refresh=False)
                bar.update(1)
                self.host_times["loop_s"] += time.perf_counter() - t_host
                in_flight = nxt
                self._raise_if_nonfinite_in_row()
                last_eval = self._evaluate_and_save(mlog, kill_after) or last_eval
                if self.stop_reason:
                    log.warning("early stop: %s", self.stop_reason)
                    break
        finally:
            prefetch.close()
            bar.close()
            mlog.close()  # first: a save that failed raises again in the wait
            self.ckpt.wait()
        summary = self._summary(loss, last_eval, real_tokens, tokens_seen, time.perf_counter() - t0)
        self.ckpt.close()
        if jax.process_index() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _summary(self, loss: float, last_eval: dict[str, float] | None, real_tokens: float,
                 tokens_seen: float, elapsed: float) -> dict[str, Any]:
        """What a finished run writes to summary.json (and `train` returns)."""
        return {
            "steps": self.step, "stop_reason": self.stop_reason or "total_steps reached",
            "final_loss": loss, "last_eval": last_eval, "best_eval_metric": self.stopper.best,
            # Among equal metrics Orbax may keep a later step than the stopper's first best: report the
            # checkpoint that is actually kept.
            "best_step": self.stopper.best_step, "best_checkpoint": (
                str(self.ckpt.directory / str(self.ckpt.best_step()))
                if self.ckpt.best_step() is not None else None),
            "checkpoints": self.ckpt.steps(), "tokens_per_s": real_tokens / max(elapsed, 1e-9),
            "loss_tokens": tokens_seen, "wall_s": elapsed, **self.counts, **self._host_gap(),
            "remat": self.program.student_exe.remat,
            "expert_per_node": self.parallel.expert_per_node if self.parallel is not None else 0,
            "teacher_experts": self.parallel.teacher_experts if self.parallel is not None else "expert",
            "teacher_lockstep": self.program.spec.teacher_lockstep,
            "batch_split": self.program.student_exe.batch_split,
        }


def train(cfg: Config, resume: bool = False) -> dict[str, Any]:
    return Trainer(cfg).run(resume=resume)


def check_init_checkpoint(cfg: Config) -> None:
    path = cfg.train.init_checkpoint
    if path is not None and not Path(path).exists():
        raise UserError(f"train.init_checkpoint: {path!r} does not exist; set --set "
                        "train.init_checkpoint=DIR (HF dir, convert_torch_ckpt.py output or training "
                        "checkpoint) or =null for random init")
