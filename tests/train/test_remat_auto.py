"""execution.remat=auto (farskip_jax/train/remat.py): the first policy, most kept first, whose compiled
train step fits the budget; the trainer runs exactly that program, and the inspector reports it."""

from __future__ import annotations

import argparse
import json
import logging
import math

import pytest
from remat_choices import choose_with_peaks

from farskip_jax.config import load_config
from farskip_jax.execution import ExecutionConfig
from farskip_jax.train import remat
from farskip_jax.train import trainer as trainer_mod

GIB = 2**30


def test_candidates_most_kept_first():
    assert remat.candidates("auto", expert_parallel=True) == (
        "none", "save_a2a_dots", "save_a2a", "save_dots", "full")
    # one device: no all-to-all, so save_a2a would keep what full keeps, save_a2a_dots what save_dots
    assert remat.candidates("auto", expert_parallel=False) == ("none", "save_dots", "full")
    assert remat.candidates("save_dots", expert_parallel=True) == ("save_dots",)
    # the worst-case re-run: never less recomputation than the bounded step's policy
    assert remat.candidates("none", True, at_least="save_a2a") == ("save_a2a", "save_dots", "full")
    assert remat.candidates("none", True, at_least="save_a2a_dots") == ("save_a2a_dots", "save_a2a",
                                                                        "save_dots", "full")
    assert remat.candidates("auto", False, at_least="save_a2a") == ("full",)
    assert remat.candidates("auto", False, at_least="save_a2a_dots") == ("save_dots", "full")


def test_budget():
    exe = ExecutionConfig(remat="auto")
    assert remat.budget_bytes(exe, None) is None  # CPU: nothing known, auto runs none
    assert remat.budget_bytes(exe, 100 * GIB) == int(0.8 * 100 * GIB)
    # never more than JAX's allocator may hand out (XLA_PYTHON_CLIENT_MEM_FRACTION)
    assert remat.budget_bytes(exe, 100 * GIB, allocator_limit=75 * GIB) == 75 * GIB
    assert remat.budget_bytes(ExecutionConfig(remat_hbm_fraction=0.5), 100 * GIB) == 50 * GIB
    assert remat.budget_bytes(ExecutionConfig(remat_budget_gib=3.0), None, 1) == 3 * GIB


def test_choose_compiles_until_one_fits(caplog):
    peaks = {"none": 10, "save_a2a_dots": 8, "save_a2a": 6, "save_dots": 5, "full": 4}
    compiled: list[str] = []

    def compile_peak(policy):
        compiled.append(policy)
        return f"exe-{policy}", peaks[policy]

    policies = remat.candidates("auto", True)
    choice = remat.choose(policies, compile_peak, budget=6)
    assert (choice.policy, choice.compiled, compiled) == ("save_a2a", "exe-save_a2a",
                                                          ["none", "save_a2a_dots", "save_a2a"])
    assert choice.peaks == {"none": 10, "save_a2a_dots": 8, "save_a2a": 6} and choice.fits

    compiled.clear()
    choice = remat.choose(policies, compile_peak, budget=None)  # nothing known: none, nothing compiled
    assert (choice.policy, choice.compiled, compiled) == ("none", None, [])

    compiled.clear()
    with caplog.at_level(logging.WARNING):
        choice = remat.choose(policies, compile_peak, budget=3)
    assert choice.policy == "full" and not choice.fits and compiled == list(policies)
    assert "no policy fits" in caplog.text

    # every process must agree: a host that does not fit makes all compile the next policy
    compiled.clear()
    choice = remat.choose(policies, compile_peak, budget=10, agree=lambda fits: False)
    assert choice.policy == "full" and compiled == list(policies)


def test_choose_compares_a_schedule_held_back_by_memory(caplog):
    """A policy that fits but whose schedule XLA left largely synchronous (H200 EP32 `none`) is
    compared with the next policy that fits, by estimated step; below the threshold nothing more
    is compiled."""
    peaks = {"none": 9, "save_a2a_dots": 13, "save_a2a": 12, "save_dots": 5, "full": 4}
    policies = remat.candidates("auto", True)

    def run(schedules):
        with caplog.at_level(logging.INFO):
            return choose_with_peaks(policies, peaks, schedule=lambda policy: schedules.get(policy))

    sched = remat.Schedule
    # none fits but 31% of its collective time is synchronous; save_a2a(_dots) does not fit; save_dots
    # is faster
    choice, compiled = run({"none": sched(0.31, 1433e3), "save_dots": sched(0.0, 1392e3)})
    assert (choice.policy, choice.compiled) == ("save_dots", "save_dots")
    assert compiled == ["none", "save_a2a_dots", "save_a2a", "save_dots"]
    assert ("none est. 1433.0 ms (31% of collective time synchronous, 0% exposed) against save_dots "
            "est. 1392.0 ms" in caplog.text)
    # ... unless the held-back schedule is still the faster one: then it runs, all peaks recorded
    choice, compiled = run({"none": sched(0.31, 1300e3), "save_dots": sched(0.0, 1392e3)})
    assert (choice.policy, choice.compiled) == ("none", "none")
    assert compiled == list(choice.peaks) == ["none", "save_a2a_dots", "save_a2a", "save_dots"]
    assert choice.fits
    assert choice.estimates == {"none": 1300e3, "save_dots": 1392e3}
    assert "est. none 1300.0 ms; est. save_dots 1392.0 ms" in choice.describe()
    # under the threshold (or no schedule known: CPU) the first fit runs, nothing more compiled
    for schedules in ({"none": sched(remat.MAX_SYNC_SHARE, 1433e3)}, {}):
        choice, compiled = run(schedules)
        assert (choice.policy, compiled) == ("none", ["none"])
    # all asynchronous but 39% of the collective time exposed (8 H200 `none`, K29): compared too
    choice, compiled = run({"none": sched(0.0, 571.1e3, 0.386), "save_dots": sched(0.0, 555.9e3, 0.109)})
    assert (choice.policy, compiled) == ("save_dots", ["none", "save_a2a_dots", "save_a2a", "save_dots"])
    assert "none est. 571.1 ms (0% of collective time synchronous, 39% exposed)" in caplog.text
    choice, compiled = run({"none": sched(0.0, 571.1e3, remat.MAX_EXPOSED_SHARE)})  # at the threshold
    assert (choice.policy, compiled) == ("none", ["none"])
    # held back and nothing after it fits: it runs
    peaks.update(save_dots=11, full=11)
    choice, compiled = run({"none": sched(0.5, 1433e3)})
    assert (choice.policy, compiled) == ("none", list(policies)) and choice.fits


_GEMM = ('custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config='
         '{"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
         '"rhs_contracting_dimensions":["0"]}}}')


def _module(exchange_async: bool) -> str:
    """An all-to-all of 4 MiB in groups of 8 and a 4096 x 1024 x 1024 GEMM (scheduled HLO text):
    the GEMM under the exchange, or the exchange run synchronously before it."""
    exchange = ([
        "  %a2a-start = ((bf16[2048,1024]{1,0}), bf16[2048,1024]{1,0}) async-start(%x), calls=%a2a",
        f"  %mm = (bf16[2048,1024]{{1,0}}, s8[0]{{0}}) {_GEMM}",
        "  %a2a-done = bf16[2048,1024]{1,0} async-done(%a2a-start)",
    ] if exchange_async else [
        "  %a2a-done = bf16[2048,1024]{1,0} all-to-all(%x), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
        f"  %mm = (bf16[2048,1024]{{1,0}}, s8[0]{{0}}) {_GEMM}",
    ])
    return "\n".join([
        "HloModule jit_step, is_scheduled=true, num_partitions=8", "",
        "%a2a (p: bf16[2048,1024]) -> bf16[2048,1024] {",
        "  %p = bf16[2048,1024]{1,0} parameter(0)",
        "  ROOT %all-to-all.1 = bf16[2048,1024]{1,0} all-to-all(%p), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
        "}", "",
        "ENTRY %main (x: bf16[2048,1024], w: bf16[1024,1024]) -> bf16[2048,1024] {",
        "  %x = bf16[2048,1024]{1,0} parameter(0)",
        "  %w = bf16[1024,1024]{1,0} parameter(1)",
        *exchange,
        "  %g = bf16[2048,1024]{1,0} get-tuple-element(%mm), index=0",
        "  ROOT %add.1 = bf16[2048,1024]{1,0} add(%g, %a2a-done)",
        "}", "",
    ])


def test_schedule_of_reads_synchronous_transfer_and_the_estimated_step():
    """`remat.schedule_of` is the inspector's analysis of the HLO: a synchronous exchange is all of
    the transfer time, all exposed, and adds its time to the estimated step; one with the GEMM under
    it is asynchronous and less exposed."""
    sync, hidden = (remat.schedule_of(_module(a), "h200") for a in (False, True))
    assert (sync.sync_share, hidden.sync_share) == (1.0, 0.0)
    assert sync.exposed_share == 1.0 > hidden.exposed_share  # the GEMM covers part of the exchange
    assert sync.est_step_us > hidden.est_step_us > 0


def test_memo_key_and_record(tmp_path, caplog):
    """A run's remembered choice: the key moves with what the compiled peaks depend on (config,
    argument shapes, budget), not with the schedule; a record is found only under its own key."""
    import jax.numpy as jnp

    cfg = load_config("tiny_farskip")
    args = ({"w": jnp.zeros((4, 8), jnp.float32)}, jnp.zeros((2, 16), jnp.int32))
    key = remat.memo_key(cfg, args, 10 * GIB)
    assert key == remat.memo_key(load_config("tiny_farskip"), args, 10 * GIB)
    schedule = {"train.total_steps": 7, "train.learning_rate": 0.5}
    assert key == remat.memo_key(load_config("tiny_farskip", schedule), args, 10 * GIB)
    assert key != remat.memo_key(cfg, args, 9 * GIB)
    assert key != remat.memo_key(cfg, (args[0], jnp.zeros((4, 16), jnp.int32)), 10 * GIB)
    assert key != remat.memo_key(load_config("tiny_farskip", {"execution.batch_split": 2}), args, 10 * GIB)
    assert key != remat.memo_key(load_config("tiny_farskip", {"train.grad_accum_steps": 2}), args, 10 * GIB)

    memo = tmp_path / remat.MEMO_NAME
    assert remat.remembered(memo, "bounded", key) is None  # no file yet
    choice = remat.Choice("save_dots", None, 10 * GIB, {"save_dots": 5 * GIB})
    remat.remember(memo, "bounded", key, choice, rejected={"none": 12 * GIB})
    record = remat.remembered(memo, "bounded", key)
    assert record["policy"] == "save_dots" and record["peaks"] == {"none": 12 * GIB, "save_dots": 5 * GIB}
    assert remat.remembered(memo, "worst_case", key) is None
    assert remat.remembered(memo, "bounded", "another key") is None
    policies = remat.candidates("auto", True)
    assert remat._resume_from(policies, record) == policies.index("save_dots")
    assert remat._resume_from(remat.candidates("auto", True, at_least="full"), record) == 0
    memo.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert remat.remembered(memo, "bounded", key) is None
    assert "searching from the start" in caplog.text
    # the candidates searched are part of the key: a record is a place in their order
    policies = remat.candidates("auto", True)
    assert remat.memo_key(cfg, args, 10 * GIB, policies) != remat.memo_key(
        cfg, args, 10 * GIB, remat.candidates("auto", True, local_teacher=True))


def test_a_run_resumed_at_the_last_policy_runs_that_policys_program(tmp_path):
    """A record that leaves one candidate to try: it is taken without a compile, and `settle`
    hands back that candidate's own program (not the one built first, `none`)."""
    import jax
    import jax.numpy as jnp

    from farskip_jax.parallel import make_mesh
    from farskip_jax.train.program import build_program

    cfg = load_config("tiny_farskip", {"execution.remat": "auto", "execution.remat_budget_gib": 1.0})
    program = build_program(cfg, make_mesh(cfg.mesh, jax.devices()[:1]))
    assert program.student_exe.remat == "none"
    args = (program.abstract_state(), program.abstract_teacher(), jnp.zeros((1, 2, 16), jnp.int32))
    memo = tmp_path / remat.MEMO_NAME
    key = remat.memo_key(cfg, args, GIB, remat.candidates("auto", False))
    remat.remember(memo, "bounded", key, remat.Choice("full", None, GIB, {"full": GIB // 2}),
                   rejected={"none": 2 * GIB, "save_dots": 2 * GIB})
    (prog, compiled), choice = remat.settle(cfg, program, args, memo=memo)
    assert (choice.policy, compiled, prog.student_exe.remat) == ("full", None, "full")


def _losses(out) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_trainer_runs_the_executable_it_checked(tiny_data, overrides, tmp_path):
    """A budget `none` fits: one compile, whose executable the loop then runs (no second compile
    of the jitted step), and the run trains."""
    cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / "fits", **{
        "train.total_steps": 2, "train.eval_every": 100, "train.checkpoint_every": 100,
        "execution.remat": "auto", "execution.remat_budget_gib": 1.0}))
    tr = trainer_mod.Trainer(cfg)
    summary = tr.run()
    assert list(tr.remat_choice.peaks) == ["none"] and summary["remat"] == "none"
    assert summary["batch_split"] == 1
    assert summary["expert_per_node"] == 0  # mesh.expert_per_node: auto on one machine: flat
    assert summary["teacher_experts"] == "expert"  # ... and so nothing to copy per node
    assert summary["teacher_lockstep"] is False  # ... and the teacher runs apart (auto)
    assert tr.train_step is tr.remat_choice.compiled[1]
    assert tr.program.train_step._cache_size() == 0  # the jitted step itself never compiled
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in _losses(tmp_path / "fits"))


# slow (CI time budget, ~60 s: five compiles of the tiny step); the default suite keeps the choice
# itself (test_choose_compiles_until_one_fits) and the trainer's use of the checked executable.
@pytest.mark.slow
def test_trainer_runs_the_policy_that_fits(tiny_data, overrides, tmp_path, caplog):
    """One device, 2 steps. A budget no policy meets: every candidate is compiled, the one holding
    least (full) runs, with a warning. Then a budget of exactly save_dots's peak: none is rejected
    and save_dots runs, the very program an explicit `execution.remat=save_dots` run trains with
    (the same losses, bitwise). Resumed for 2 more steps, that run starts at save_dots (none is not
    compiled again)."""
    base = {"train.total_steps": 2, "train.eval_every": 100, "train.checkpoint_every": 100,
            "train.warmup_steps": 0}

    def run(name, resume=False, **extra):
        cfg = load_config("tiny_farskip", overrides(tiny_data, tmp_path / name, **{**base, **extra}))
        tr = trainer_mod.Trainer(cfg)
        summary = tr.run(resume=resume)
        return tr, summary

    with caplog.at_level(logging.WARNING):
        tight, summary = run("tight", **{"execution.remat": "auto", "execution.remat_budget_gib": 1e-9})
    assert "no policy fits" in caplog.text
    peaks = tight.remat_choice.peaks
    assert list(peaks) == ["none", "save_dots", "full"] and summary["remat"] == "full"
    assert peaks["none"] > peaks["save_dots"] > peaks["full"], peaks
    fit, summary = run("fit", **{"execution.remat": "auto",
                                 "execution.remat_budget_gib": peaks["save_dots"] / GIB})
    assert list(fit.remat_choice.peaks) == ["none", "save_dots"] and summary["remat"] == "save_dots"
    assert fit.program.student_exe.remat == "save_dots"
    _, summary = run("pinned", **{"execution.remat": "save_dots"})
    assert _losses(tmp_path / "fit") == _losses(tmp_path / "pinned")
    memo = json.loads((tmp_path / "fit" / remat.MEMO_NAME).read_text())
    assert memo["bounded"]["policy"] == "save_dots"
    assert list(memo["bounded"]["peaks"]) == ["none", "save_dots"]
    resumed, summary = run("fit", resume=True, **{"execution.remat": "auto", "train.total_steps": 4,
                                                  "train.checkpoint_every": 2,
                                                  "execution.remat_budget_gib": peaks["save_dots"] / GIB})
    assert list(resumed.remat_choice.peaks) == ["save_dots"] and summary["remat"] == "save_dots"


@pytest.mark.slow
def test_inspector_reports_the_policy_auto_runs(tmp_path):
    """Deviceless H200, the tiny FCSD step on one device, a budget of 1 byte: the inspector compiles
    each policy as the trainer would, reports the last (full) and names the peaks it saw."""
    from farskip_jax.inspect import steps
    from farskip_jax.inspect.cli import run_inspect

    cfg = load_config("tiny_farskip", {"execution.remat": "auto", "execution.remat_budget_gib": 1e-9})
    args = argparse.Namespace(target="h200", mesh={"data": 1, "expert": 1, "tensor": 1}, modes="farskip",
                              out=tmp_path, lhs_dump=False, compiler_option=[], no_default_options=False,
                              save_hlo=False, timeline=False)
    reports = run_inspect(args, steps.build_fcsd_step(cfg, seqs_per_device=2, seq_len=32))
    auto = reports["farskip"]["meta"]["remat_auto"]
    assert auto["policy"] == "full" and list(auto["peaks"]) == ["none", "save_dots", "full"]
    assert auto["peaks"]["none"] > auto["peaks"]["full"]
    assert "execution.remat=auto: full" in (tmp_path / "report_farskip.md").read_text()
