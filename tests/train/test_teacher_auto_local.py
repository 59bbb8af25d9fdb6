"""`mesh.teacher_experts: auto` on an FCSD step with a known memory budget: `execution.remat`'s
search (train/remat.py) compiles each policy first with all of the teacher's routed experts on
every device (`local`), and the trainer runs that program, with the teacher laid out anew, where
it fits; otherwise the teacher stays where auto's rule puts it."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest
from remat_choices import choose_with_peaks

from farskip_jax.config import load_config
from farskip_jax.parallel import make_mesh
from farskip_jax.train import remat
from farskip_jax.train import trainer as trainer_mod
from farskip_jax.train.program import build_program, searches_teacher_layout, teacher_copy_bytes

GIB = 2**30
EP8 = {"mesh.expert": 8}


def test_the_search_tries_each_policy_with_the_local_teacher_first():
    assert remat.candidates("auto", True, local_teacher=True) == (
        "none+local_teacher", "none", "save_a2a_dots+local_teacher", "save_a2a_dots",
        "save_a2a+local_teacher", "save_a2a", "save_dots+local_teacher", "save_dots",
        "full+local_teacher", "full")
    assert remat.candidates("save_dots", True, local_teacher=True) == ("save_dots+local_teacher", "save_dots")
    cfg = load_config("tiny_farskip", {"execution.remat": "auto"})
    local = remat.with_remat(cfg, "save_dots+local_teacher")
    assert (local.execution.remat, local.mesh.teacher_experts) == ("save_dots", "local")
    spread = remat.with_remat(cfg, "save_dots")
    assert (spread.execution.remat, spread.mesh.teacher_experts) == ("save_dots", "auto")
    assert remat.policy_of("none+local_teacher") == "none" and remat.has_local_teacher("none+local_teacher")


def test_a_fitting_local_teacher_is_compared_with_the_split_one(caplog):
    """With a schedule known (GPU targets), a local-teacher candidate that fits is compared with the
    next that fits, the same policy with the teacher split, and the faster runs (64 MI300X as
    data=8 x expert=8: est. 539.1 against 533.3 ms, BENCHMARKS K24); without one (CPU) the first fit
    runs, nothing more compiled."""
    cands = remat.candidates("auto", True, local_teacher=True)
    peaks = {c: 10 if c.startswith("none") else 5 for c in cands}
    sched = remat.Schedule

    def run(schedules):
        with caplog.at_level(logging.INFO):
            return choose_with_peaks(cands, peaks, schedule=(lambda c: schedules[c]) if schedules else None)

    slower = {"none+local_teacher": sched(0.1, 539.1e3), "none": sched(0.1, 533.3e3)}
    choice, compiled = run(slower)
    assert (choice.policy, compiled) == ("none", ["none+local_teacher", "none"])
    assert choice.estimates == {"none+local_teacher": 539.1e3, "none": 533.3e3}
    faster = {"none+local_teacher": sched(0.1, 498.2e3), "none": sched(0.1, 505.2e3)}
    choice, compiled = run(faster)
    assert (choice.policy, compiled) == ("none+local_teacher", ["none+local_teacher", "none"])
    choice, compiled = run({})
    assert (choice.policy, compiled) == ("none+local_teacher", ["none+local_teacher"])
    # the local teacher does not fit under none: the split one is a plain fit, as before
    peaks["none+local_teacher"] = 11
    choice, compiled = run(faster)
    assert (choice.policy, compiled) == ("none", ["none+local_teacher", "none"])


def test_which_steps_search_the_teachers_layout():
    fcsd = load_config("tiny_farskip", EP8)
    assert searches_teacher_layout(fcsd, expert_parallel=True)
    assert not searches_teacher_layout(fcsd, expert_parallel=False)  # one device: nothing to place
    for other in ({"mesh.teacher_experts": "local"}, {"mesh.teacher_experts": "expert"},
                  {"train.mode": "lm"}, {"train.teacher_cache": "/some/cache"}):
        assert not searches_teacher_layout(load_config("tiny_farskip", {**EP8, **other}), True), other


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
def test_a_local_teacher_whose_arguments_exceed_the_budget_is_not_compiled(caplog):
    """The arguments of the local-teacher program (no compile) hold the teacher's routed experts on
    every device: more than the spread program's by exactly `teacher_copy_bytes`; a budget between
    the two drops the local candidates before anything compiles."""
    cfg = load_config("tiny_farskip", EP8)
    mesh = make_mesh(cfg.mesh)
    spread_prog = build_program(cfg, mesh)
    local_prog = build_program(remat.with_remat(cfg, "none+local_teacher"), mesh)
    assert local_prog.parallel.teacher_experts == "local" and spread_prog.parallel.teacher_experts == "expert"

    def arguments(candidate: str):
        prog = local_prog if remat.has_local_teacher(candidate) else spread_prog
        return prog.abstract_state(), prog.abstract_teacher()

    spread, local = remat.bytes_per_device(arguments("none")), remat.bytes_per_device(
        arguments("none+local_teacher"))
    extra = teacher_copy_bytes(spread_prog.abstract_teacher(), local_prog.parallel, "local")
    assert extra > 0 and local - spread == extra
    cands = remat.candidates("auto", True, local_teacher=True)
    assert remat.within_budget(cands, arguments, local) == cands
    with caplog.at_level(logging.INFO):
        assert remat.within_budget(cands, arguments, local - 1) == remat.candidates("auto", True)
    assert "not compiled" in caplog.text


def _losses(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


# `slow` (CI time: 53 s, three compiles of the EP8 FCSD step on 8 host devices, 2 steps each). The
# default suite keeps the search's choices above, a local teacher's step exchanging nothing
# (tests/train/test_teacher_in_node.py) and `inspect`'s auto picking the local teacher
# (tests/inspect/test_cli.py::test_clean_environment_h200_fcsd).
@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
def test_the_trainer_puts_the_teacher_on_every_device_where_it_fits(tiny_data, overrides, tmp_path):
    """EP8, `execution.remat: none` with a budget (`remat_budget_gib`). A large budget: the local
    teacher's program is compiled first and runs, the teacher's parameters laid out anew, the
    lockstep on, the same losses bitwise as a run that sets `mesh.teacher_experts: local` itself.
    A budget one byte under that program's peak: both are compiled and the spread teacher runs,
    its losses within 1e-6 of the local one's."""
    base = {**EP8, "train.total_steps": 2, "train.eval_every": 100, "train.checkpoint_every": 100,
            "train.warmup_steps": 0, "train.learning_rate": 1e-3, "execution.remat": "none"}

    def run(name, **extra):
        tr = trainer_mod.Trainer(load_config("tiny_farskip", overrides(tiny_data, tmp_path / name,
                                                                       **{**base, **extra})))
        return tr, tr.run()

    fits, summary = run("fits", **{"execution.remat_budget_gib": 1000.0})
    local_peak = fits.remat_choice.peaks["none+local_teacher"]
    assert list(fits.remat_choice.peaks) == ["none+local_teacher"]
    assert (summary["remat"], summary["teacher_experts"], summary["teacher_lockstep"]) == ("none", "local",
                                                                                           True)
    assert fits.train_step is fits.remat_choice.compiled[1]  # the executable it checked
    tight, summary = run("tight", **{"execution.remat_budget_gib": (local_peak - 1) / GIB})
    peaks = tight.remat_choice.peaks
    assert list(peaks) == ["none+local_teacher", "none"] and peaks["none"] < local_peak, peaks
    assert (summary["teacher_experts"], summary["teacher_lockstep"]) == ("expert", False)
    copies = [sum(x.nbytes for x in jax.tree.leaves(tr.models.teacher_params)) for tr in (fits, tight)]
    assert copies[0] > copies[1]  # bytes of all shards: 8 copies of the routed experts against one
    _, summary = run("pinned", **{"mesh.teacher_experts": "local"})
    assert summary["teacher_experts"] == "local"
    assert _losses(tmp_path / "fits") == _losses(tmp_path / "pinned")
    spread, local = _losses(tmp_path / "tight"), _losses(tmp_path / "fits")
    print(f"TEACHER_AUTO_LOCAL losses spread {spread}, local {local}; peaks {peaks}")
    np.testing.assert_allclose(local, spread, rtol=1e-6)
    memo = json.loads((tmp_path / "fits" / remat.MEMO_NAME).read_text())
    assert memo["bounded"]["policy"] == "none+local_teacher"
