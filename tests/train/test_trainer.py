"""Trainer behaviour on the tiny config: frozen teacher, KL decrease, exact resume after SIGKILL,
truncated checkpoints, non-finite guard, early stopping, EP=8 equivalence, teacher cache."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from farskip_jax.config import load_config
from farskip_jax.train import trainer as trainer_mod
from farskip_jax.train.early_stop import EarlyStopper
from farskip_jax.train.teacher_precompute import precompute_teacher

REPO = Path(__file__).resolve().parents[2]
STEPS = 24
# Every run below has the same shapes, so after the first compile the persistent cache serves them.
BASE = {"train.learning_rate": 3e-5, "train.warmup_steps": 4, "train.total_steps": STEPS,
        "train.checkpoint_every": 8, "train.eval_every": 12, "train.keep_checkpoints": 2}


@pytest.fixture(scope="module")
def cfg_for(tiny_data, overrides):
    """cfg_for(out, **extra) -> the tiny FarSkip FCSD config writing to `out`."""
    return lambda out, **extra: load_config("tiny_farskip", overrides(tiny_data, out, **{**BASE, **extra}))


def _train_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(cfg_for, tmp_path_factory):
    """One uninterrupted run, with the teacher and initial student kept for comparison."""
    out = tmp_path_factory.mktemp("ref")
    tr = trainer_mod.Trainer(cfg_for(out))
    teacher0 = jax.tree.map(np.array, tr.models.teacher_params)
    student0 = jax.tree.map(np.array, tr.state["params"])
    summary = tr.run()
    return {"out": out, "trainer": tr, "teacher0": teacher0, "student0": student0, "summary": summary}


def test_teacher_frozen_student_trained(reference):
    tr = reference["trainer"]
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), reference["teacher0"],
                        tr.models.teacher_params)
    assert all(jax.tree.leaves(same)), "teacher parameters changed"
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), reference["student0"],
                           tr.state["params"])
    assert sum(jax.tree.leaves(changed)) > len(jax.tree.leaves(changed)) // 2
    # Optimizer state covers the student only: two Adam moments per student parameter.
    n_student = len(jax.tree.leaves(tr.state["params"]))
    n_moments = sum(x.ndim > 0 for x in jax.tree.leaves(tr.state["opt_state"]))
    assert n_moments == 2 * n_student


def test_fcsd_lowers_kl(reference):
    losses = _train_losses(reference["out"])
    first, last = losses[1], np.mean([losses[s] for s in range(STEPS - 3, STEPS + 1)])
    print(f"KL: step 1 {first:.4g}, mean of last 4 steps {last:.4g}, factor {first / last:.2f}")
    assert last < first / 2, (first, last)
    s = reference["summary"]
    assert s["best_checkpoint"] is not None and s["steps"] == STEPS


def _kl_of_the_first_batch(reference, student_farskip: bool) -> float:
    """Mean KL(teacher || student) over the loss-masked tokens of the run's first batch, recomputed
    outside the trainer: both models rebuilt from the config (the teacher regular, the student with
    or without FarSkip) with the run's initial parameters, full logits, the KL in float64 numpy."""
    from flax import nnx

    from farskip_jax.model.transformer import build_model, with_farskip
    from farskip_jax.train import batches

    tr = reference["trainer"]
    cfg = tr.cfg
    host = batches.BatchStream(cfg, tr.program.batch_sharding, cfg.train.grad_accum_steps).next_host()
    temperature = cfg.train.kl_temperature

    def logits(farskip: bool, params) -> np.ndarray:
        graph, _ = nnx.split(build_model(with_farskip(cfg.model, enabled=farskip), exe=cfg.execution))
        model = nnx.merge(graph, jax.tree.map(jax.numpy.asarray, params))
        out = [model(host["input_ids"][a], host["positions"][a], host["segment_ids"][a]).logits
               for a in range(host["input_ids"].shape[0])]  # gradient-accumulation micro-batches
        return np.asarray(np.stack(out), np.float64) / temperature

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    log_p = log_softmax(logits(False, reference["teacher0"]))
    log_q = log_softmax(logits(student_farskip, reference["student0"]))
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    mask = host["loss_mask"].astype(np.float64)
    return float((kl * mask).sum() / mask.sum())


def test_fcsd_kl_is_the_teacher_to_farskip_student_kl(reference):
    """The first step's logged KL is the KL between the regular teacher and the FarSkip student on
    that batch: a trainer that trained a regular student (whose KL is only the bf16 rounding of the
    teacher's weights), or scaled the KL wrongly (normalizer, a factor), fails here, where
    `test_fcsd_lowers_kl` would pass. Tolerance 1e-4 relative: at init the tiny student's KL is
    ~2e-6; the trainer's fp32 KL sums non-negative terms (`losses._token_kl`), measured 6e-7 from
    this float64 recomputation with XLA's native and SSE4.2 CPU code (the earlier p * (log p -
    log q) form, whose ~1e-3 terms cancel, was 0.19% to 1.4% apart)."""
    rows = [json.loads(x) for x in (reference["out"] / "metrics.jsonl").read_text().splitlines()]
    logged = next(r["kl"] for r in rows if r["kind"] == "train" and r["step"] == 1)
    expected = _kl_of_the_first_batch(reference, student_farskip=True)
    regular = _kl_of_the_first_batch(reference, student_farskip=False)
    print(f"KL step 1: logged {logged:.9g}, recomputed {expected:.9g} (rel {logged / expected - 1:.2e}), "
          f"a regular student's {regular:.3g}")
    assert regular < expected / 10  # FarSkip is what the teacher disagrees with at the start
    assert logged == pytest.approx(expected, rel=1e-4)


LOSS_CURVES = Path(__file__).parent / "loss_curves"


def test_fcsd_loss_curve_matches_the_stored_one(reference):
    """The run's per-step loss against the curve stored in tests/train/loss_curves (the torchtitan
    practice for integration runs): any change of what the step computes (the recurrence, the
    routing, the KL, the optimizer, the data order) moves it. Tolerance: 1e-3 relative per step,
    room for float reordering across CPUs and XLA builds; the run itself is bitwise repeatable.
    Measured on jax 0.12: XLA's CPU code for AVX+FMA, AVX and SSE4.2 gives curves at most 6e-6
    apart, while a 20% higher learning rate moves it by 9%, temperature 1.1 by 8%, other data by
    17%. (With the cancelling KL form of before, the three instruction sets were 2-6% apart.)
    A deliberate change of the numbers rewrites the curve:
    FARSKIP_UPDATE_LOSS_CURVES=1 pytest tests/train/test_trainer.py -k loss_curve."""
    losses = _train_losses(reference["out"])
    path = LOSS_CURVES / "tiny_farskip_fcsd.json"
    if os.environ.get("FARSKIP_UPDATE_LOSS_CURVES") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({
            "what": "train loss per step of tests/train/test_trainer.py's reference run: "
                    "configs/tiny_farskip.yaml with BASE and tests/train/conftest.py's tiny data, CPU",
            "jax": jax.__version__,
            "loss": {str(s): v for s, v in sorted(losses.items())}}, indent=1) + "\n")
        pytest.skip(f"rewrote {path}")
    stored = {int(s): v for s, v in json.loads(path.read_text())["loss"].items()}
    assert sorted(losses) == sorted(stored), "logged steps differ from the stored curve's"
    steps = sorted(stored)
    np.testing.assert_allclose([losses[s] for s in steps], [stored[s] for s in steps], rtol=1e-3,
                               err_msg=f"the loss curve moved from {path}; if that is intended, rewrite it "
                                       "(see this test's docstring)")


def test_fresh_run_into_a_checkpointed_directory_refuses_at_start(reference, cfg_for):
    """Without --resume, an output directory that holds checkpoints is an error before any step, not
    a failed save onto an existing step at the end of the run."""
    from farskip_jax.errors import UserError

    tr = trainer_mod.Trainer(cfg_for(reference["out"]))
    with pytest.raises(UserError, match="already holds checkpoints.*--resume"):
        tr.run()
    assert tr.step == 0


def test_dropped_fractions_logged(reference):
    """Both models' dropped fraction every step, in metrics.jsonl and TensorBoard (dropless: 0.0)."""
    rows = [json.loads(x) for x in (reference["out"] / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == STEPS
    assert all(r["student_dropped_fraction"] == 0.0 and r["teacher_dropped_fraction"] == 0.0
               for r in train_rows)
    events = b"".join(f.read_bytes() for f in (reference["out"] / "tb").rglob("events.out.tfevents*"))
    assert b"train/student_dropped_fraction" in events and b"train/teacher_dropped_fraction" in events


def test_exact_resume_after_sigkill(reference, cfg_for, tiny_data, overrides, tmp_path):
    out = tmp_path / "killed"
    over = overrides(tiny_data, out, **BASE)
    args = [sys.executable, str(REPO / "train.py"), "--config", "tiny_farskip"]
    for k, v in over.items():
        args += ["--set", f"{k}={json.dumps(v)}"]
    env = {**os.environ, "FARSKIP_TEST_KILL_AFTER_CHECKPOINT": "16",
           "JAX_COMPILATION_CACHE_DIR": str(REPO / ".jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert max(_train_losses(out)) == 16
    summary = trainer_mod.train(cfg_for(out), resume=True)
    assert summary["steps"] == STEPS
    ref, got = _train_losses(reference["out"]), _train_losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # bitwise: same floats, same data order


def test_truncated_checkpoint_skipped(reference, cfg_for, tmp_path, caplog):
    out = tmp_path / "trunc"
    shutil.copytree(reference["out"], out)
    ckpts = out / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    newest = ckpts / str(steps[-1])
    # A write cut short: every params file truncated to half its size.
    for f in (newest / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 16:
            with open(f, "r+b") as fh:
                fh.truncate(f.stat().st_size // 2)
    tr = trainer_mod.Trainer(cfg_for(out))
    with caplog.at_level(logging.WARNING):
        assert tr.resume()
    assert tr.step == steps[-2]
    assert any("unreadable" in r.message and str(steps[-1]) in r.message for r in caplog.records)


def test_checkpoints_written_while_later_steps_run_are_their_steps_bitwise(reference, cfg_for, tmp_path):
    """With a staging bound far below one array (train.checkpoint_staging_gb), every save copies the
    arrays off the devices in batches after save() returned, while the next steps run and donate the
    state: each checkpoint is still the state at its step, bit for bit, training is unchanged, and a run
    resumed from one of them continues with the same losses bit for bit."""
    out = tmp_path / "bounded"
    tr = trainer_mod.Trainer(cfg_for(out, **{"train.checkpoint_staging_gb": 1e-5,
                                             "train.keep_checkpoints": 10}))
    kept: dict[int, tuple[dict, Any]] = {}
    saving_at_dispatch: list[bool] = []
    save, step = tr.save, tr.train_step

    def save_and_keep(eval_metric: float | None = None) -> None:
        kept[tr.step] = jax.tree.map(np.array, (tr._pure_params(), tr.state["opt_state"]))
        save(eval_metric)

    def step_and_look(*args: Any) -> Any:
        saving_at_dispatch.append(tr.ckpt.saving())
        return step(*args)

    tr.save, tr.train_step = save_and_keep, step_and_look
    assert tr.run()["steps"] == STEPS
    assert _train_losses(out) == _train_losses(reference["out"])
    assert sorted(kept) == [8, 12, 16, 24] and tr.ckpt.steps() == sorted(kept)
    assert any(saving_at_dispatch), "no step ran while a save was being written: nothing tested"
    for s, (params, opt_state) in kept.items():
        got = tr.ckpt.restore(tr._pure_params(), tr.state["opt_state"], step=s)
        assert got is not None and got[0] == s
        for a, b in zip(jax.tree.leaves((got[1], got[2])), jax.tree.leaves((params, opt_state)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    tr.ckpt.close()
    # Resumed from one of those checkpoints (12: the newest once the later ones are gone), the run
    # goes on with the uninterrupted run's losses bit for bit.
    resumed = tmp_path / "bounded_resumed"
    shutil.copytree(out, resumed)
    for s in (16, 24):
        shutil.rmtree(resumed / "checkpoints" / str(s))
    tr2 = trainer_mod.Trainer(cfg_for(resumed, **{"train.checkpoint_staging_gb": 1e-5,
                                                  "train.keep_checkpoints": 10}))
    assert tr2.run(resume=True)["steps"] == STEPS
    got_losses = _train_losses(resumed)
    assert sorted(got_losses) == list(range(1, STEPS + 1))
    assert got_losses == _train_losses(reference["out"])


def test_nonfinite_guard(cfg_for, tmp_path, monkeypatch):
    # One run (one compile): a lone non-finite step (0-based 1) is skipped and training goes on with
    # finite losses; three in a row (3, 4, 5) stop the run with an error that says so.
    monkeypatch.setenv("FARSKIP_TEST_NAN_STEPS", "1,3,4,5")
    cfg = cfg_for(tmp_path / "nan", **{"train.total_steps": 8, "train.eval_every": 100, "train.log_every": 1,
                                       "train.max_nonfinite_in_row": 3})
    with pytest.raises(trainer_mod.NonFiniteError, match="3 non-finite steps in a row"):
        trainer_mod.train(cfg)
    lines = (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()
    rows = {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert [rows[s]["skipped"] for s in sorted(rows)] == [0, 1, 1, 2, 3, 4]
    assert np.isfinite(rows[3]["loss"]) and np.isfinite(rows[1]["loss"])  # the step after a skip trains


def test_metrics_read_one_step_late_and_an_overflow_found_late_reruns_in_order(reference, cfg_for, tmp_path,
                                                                                  monkeypatch):
    """The loop dispatches step i+1 before it reads step i's metrics (the device runs under the host's
    reading, counting and logging), except after a step whose state it needs (checkpoint, eval, end).
    An overflow of the bounded buffers, found one step late, still applies the batches in order: the
    step dispatched after it is void (its after_void) and both run again. Emulated on one device: the
    first run of steps 2 and 7 (0-based; 7 is a checkpoint step, so nothing follows it in flight) is
    made void through after_void and reports an overflow; the run must end bitwise where the
    reference run (no overflow) ended."""
    tr = trainer_mod.Trainer(cfg_for(tmp_path / "late"))
    real_step, events, index_of, metrics_of = tr.train_step, [], {}, {}
    after_voids: dict[int, list] = {}
    fake = {2, 7}

    def watched(state, teacher, batch, scale, after_void):
        i = index_of.setdefault(id(batch), len(index_of))
        first = i not in after_voids
        after_voids.setdefault(i, []).append(after_void)
        events.append(("dispatch", i))
        if first and i in fake:
            state, m = real_step(state, teacher, batch, scale, np.float32(1.0))
            m = {**m, "moe_overflow": np.float32(1.0)}
        else:
            state, m = real_step(state, teacher, batch, scale, after_void)
        metrics_of[id(m)] = (i, batch)  # the batch too: its id stays unique while the run lasts
        return state, m

    def logged_get(x):
        if isinstance(x, dict) and "void" in x:
            events.append(("read", metrics_of.get(id(x), ("re-run",))[0]))
        return real_get(x)

    real_get = jax.device_get
    tr.train_step = watched
    monkeypatch.setattr(trainer_mod.jax, "device_get", logged_get)
    summary = tr.run()
    monkeypatch.undo()
    pos = {e: k for k, e in reversed(list(enumerate(events)))}  # first occurrence of each event
    last_read = {i: k for k, (kind, i) in enumerate(events) if kind == "read"}
    needs_state = {7, 11, 15, STEPS - 1}  # checkpoint_every 8, eval_every 12, the end
    for i in range(STEPS - 1):
        if i in needs_state:
            assert last_read[i] < pos[("dispatch", i + 1)], (i, events)
        else:
            assert pos[("dispatch", i + 1)] < pos[("read", i)], (i, events)
    # Step 3 was dispatched on the void step 2's after_void, then again (after step 2's re-run) on 0.
    assert [float(v) for v in after_voids[3]] == [1.0, 0.0]
    assert events[pos[("read", 2)] + 1] == ("read", "re-run")
    assert len(after_voids[8]) == 1 and events[pos[("dispatch", 8)] - 1] == ("read", "re-run")
    assert sum(len(v) > 1 for v in after_voids.values()) == 1  # only step 3 ran twice through the loop
    assert tr.counts["moe_overflow_reruns"] == 2 and summary["steps"] == STEPS
    assert int(tr.state["step"]) == STEPS
    assert _train_losses(tmp_path / "late") == _train_losses(reference["out"])
    ref_params = reference["trainer"].state["params"]
    for a, b in zip(jax.tree.leaves(tr.state["params"]), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_early_stopping_plateau_and_drop():
    es = EarlyStopper(patience=3, drop_threshold=0.02)
    assert not any(es.update(s, v) for s, v in [(1, 0.5), (2, 0.6), (3, 0.6), (4, 0.595)])
    assert es.update(5, 0.599) and "patience" in es.reason and es.best_step == 2
    es = EarlyStopper(patience=20, drop_threshold=0.02)
    assert not es.update(1, 0.5)
    assert es.update(2, 0.48) and "dropped" in es.reason


def test_early_stopping_in_loop(cfg_for, tmp_path, monkeypatch):
    # A metric that never improves after the first evaluation: the run stops after `patience` more.
    monkeypatch.setattr(trainer_mod.Trainer, "evaluate", lambda self: {"metric": 1.0, "loss": 0.0})
    cfg = cfg_for(tmp_path / "es", **{"train.eval_every": 2, "train.patience": 2})
    s = trainer_mod.train(cfg)
    assert s["steps"] == 6 and "patience" in s["stop_reason"] and s["best_step"] == 2
    assert Path(s["best_checkpoint"]).is_dir()


# `slow` (CI time budget): the pieces are default tests elsewhere: EP forward and gradients equal one
# device (tests/parallel/test_exactness.py), the sharded update equals the replicated one
# (test_zero1.py), and EP training over two processes equals one process (test_multiprocess.py).
@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
def test_expert_parallel_matches_single_device(cfg_for, tmp_path, reference):
    cfg = cfg_for(tmp_path / "ep8", **{"mesh.expert": 8, "train.total_steps": 3, "train.eval_every": 100})
    trainer_mod.train(cfg)
    ep, ref = _train_losses(tmp_path / "ep8"), _train_losses(reference["out"])
    for s in (1, 2, 3):
        assert abs(ep[s] - ref[s]) <= 1e-5 * max(1.0, abs(ref[s])), (s, ep[s], ref[s])


# slow (CI time budget): the cached top-k teacher is an option (train.teacher_cache is unset in every
# bundled config); the default suite keeps its loss (tests/train/test_losses.py, top-k vs full) and
# its HLO (tests/train/test_chunked_hlo.py::test_teacher_topk_gathers_no_activations).
@pytest.mark.slow
def test_teacher_cache(cfg_for, tmp_path):
    cfg = cfg_for(tmp_path / "cached", **{"train.total_steps": 3, "train.eval_every": 100,
                                                  "train.teacher_topk": 16})
    gap = precompute_teacher(cfg, str(tmp_path / "cache"))
    print(f"teacher cache: full KL {gap['kl_full']:.4g}, top-16+tail KL {gap['kl_topk_tail']:.4g}, "
          f"rel diff {gap['rel_diff']:.3%}")
    assert gap["kl_topk_tail"] <= gap["kl_full"] * (1 + 1e-4) + 1e-9
    cfg = cfg_for(tmp_path / "cached", **{"train.total_steps": 3, "train.eval_every": 100,
                                                  "train.teacher_topk": 16,
                                                  "train.teacher_cache": str(tmp_path / "cache")})
    s = trainer_mod.train(cfg)
    assert s["steps"] == 3 and np.isfinite(s["final_loss"])


# slow: ~100 s on the CI machine (the EP=8 step and its worst-case program compiled), which with the
# production-path overlap test put the default suite over 15 minutes; the default suite keeps the
# model-level check that an overflowed bounded forward is void and the worst-case program equals one
# device and HF (tests/parallel/test_dropless_ep.py::test_bounded_overflows_and_worst_case_...).
@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
def test_moe_overflow_fallback_is_exact(cfg_for, tmp_path, reference):
    """EP=8 with the tightest bounded buffers (factor 1: what perfectly balanced routing sends), so
    that the tiny router's imbalance overflows them: every overflowed step leaves the state as it
    was (the step counter included) and is run again with the worst-case program, the re-runs are
    logged, and the losses equal the one-device run's."""
    cfg = cfg_for(tmp_path / "tight", **{"mesh.expert": 8, "train.total_steps": 3, "train.eval_every": 100,
                                        "execution.moe_buffer_factor": 1.0})
    tr = trainer_mod.Trainer(cfg)
    bounded_step, void_steps = tr.train_step, []

    def watched(state, teacher, batch, scale, after_void):
        before = jax.tree.map(np.array, state)  # copied: the step donates its state
        new_state, m = bounded_step(state, teacher, batch, scale, after_void)
        if float(m["void"]) > 0:  # overflowed, or dispatched after a step that did (run again too)
            void_steps.append((before, jax.tree.map(np.array, new_state), float(after_void) == 0))
        return new_state, m

    tr.train_step = watched
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "tight" / "metrics.jsonl").read_text().splitlines()]
    reruns = [r["moe_overflow_reruns"] for r in rows if r["kind"] == "train"]
    overflowed = sum(first for *_, first in void_steps)
    print(f"overflow fallback: {overflowed} of 3 steps re-run; logged {reruns}; "
          f"jit cache {bounded_step._cache_size()}")
    assert overflowed, "the factor-1 buffers never overflowed: the test checks nothing"
    assert reruns[-1] == overflowed
    assert tr.counts["moe_overflow_reruns"] >= overflowed  # eval batches re-run too
    assert bounded_step._cache_size() == 1  # after_void from a step's metrics or 0: one program
    for before, after, _ in void_steps:
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)
    ep, ref = _train_losses(tmp_path / "tight"), _train_losses(reference["out"])
    for s in (1, 2, 3):
        assert abs(ep[s] - ref[s]) <= 1e-5 * max(1.0, abs(ref[s])), (s, ep[s], ref[s])


def test_a_checkpoint_the_storage_refuses_ends_the_run_in_one_line(cfg_for, tmp_path, file_size_limit):
    """An async save refused by the storage (a 200 kB file size limit under the data files TensorStore
    writes, whose sizes vary from save to save; a full disk the same way): the run ends at the next
    save with a UserError (one `error:` line from train.py) naming that checkpoint and the last
    complete one, not Orbax's ValueError; the metrics log is closed whole."""
    import re

    from farskip_jax.errors import UserError

    out = tmp_path / "out"
    tr = trainer_mod.Trainer(cfg_for(out, **{"train.checkpoint_every": 2, "train.eval_every": 100}))
    with file_size_limit(200_000), pytest.raises(UserError) as refused:
        tr.run()
    m = re.fullmatch(r"checkpoint (.+)/(\d+): the storage refused a write \(.*File too large.*\); the last "
                     r"complete checkpoint is (none yet|.+/(\d+))\. Free space, then rerun with --resume",
                     str(refused.value), re.DOTALL)
    assert m and m[1] == str(out.absolute() / "checkpoints"), refused.value
    complete = tr.ckpt.steps()
    assert int(m[2]) not in complete and int(m[2]) % 2 == 0 and tr.step >= int(m[2])
    assert (m[3] == "none yet") == (not complete) and (not complete or int(m[4]) == complete[-1] < int(m[2]))
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
