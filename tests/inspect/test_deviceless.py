"""Deviceless H200 compile of toy 8-way shard_map programs (needs jax-cuda13-plugin/-pjrt).

Runs in the pytest process next to conftest's 8 fake CPU devices: the CUDA topology API does not
need a GPU client, so both coexist (checked)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

import jax
import pytest
import toy_programs

from farskip_jax.inspect import cli, hlo
from farskip_jax.xla import aot, costs, links

pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return aot.make_target_mesh("h200", {"x": 8})


def _compile(mesh: jax.sharding.Mesh, mode: str, **kw: object) -> tuple[aot.CompiledArtifacts, hlo.Analysis]:
    fn, specs = toy_programs.build_step(mesh, mode)
    art = aot.compile_scheduled_hlo(fn, *specs, target="h200", **kw)
    return art, hlo.analyze(art.hlo_text, "h200", art.lhs_schedule_text)


def test_mesh_devices(mesh: jax.sharding.Mesh) -> None:
    assert mesh.devices.size == 8 and mesh.devices.flat[0].device_kind == "NVIDIA H200 141GB HBM3e"
    assert len(jax.devices()) == 8 and jax.devices()[0].platform == "cpu"  # conftest's CPU devices
    big = aot.make_target_mesh("h200", {"data": 4, "expert": 8})  # 4 hosts x 8 GPUs
    assert big.devices.size == 32 and aot.topology_string(32) == "1x4x8"


def test_overlap_vs_serial(mesh: jax.sharding.Mesh) -> None:
    art, a = _compile(mesh, "overlap")
    assert "is_scheduled=true" in art.hlo_text and art.compile_seconds < 30
    by = {c.kind: c for c in a.collectives}
    assert set(by) == {"all-to-all", "all-reduce"}
    for c in by.values():  # the independent matmul sits between start and done
        assert c.is_async and not c.flagged_sync and c.compute_between_us > 1.0
        assert any(b.opcode == "fusion" for b in c.ops_between)
        assert 0.3 < c.hidden_frac <= 1.0
    assert by["all-to-all"].role == "dispatch" and by["all-reduce"].role == "tp_psum_routed"
    assert by["all-to-all"].bytes == 512 * 1024 * 2

    _, s = _compile(mesh, "serial")
    by_s = {c.kind: c for c in s.collectives}
    assert set(by_s) == {"all-to-all", "all-reduce"}
    for c in by_s.values():  # nothing independent: XLA rewrites the pair to is_sync
        assert c.flagged_sync and not c.is_async and c.hidden_frac == 0.0
    assert s.totals["all"]["sim_hidden_frac"] == 0.0
    assert a.totals["all"]["sim_hidden_frac"] > 0.5
    assert a.totals["est_step_us"] < s.totals["est_step_us"]


def test_lhs_dump_per_compile(mesh: jax.sharding.Mesh) -> None:
    art, a = _compile(mesh, "serial", dump_lhs_schedule=True)
    assert art.lhs_schedule_text is not None and a.lhs_stats is not None
    tot = a.lhs_stats["total"]
    assert tot["total_cycles"] > 0 and tot["all_to_all_wasted_cycles"] > 0  # sync pair: XLA sees waste


def test_run_inspect_cli(mesh: jax.sharding.Mesh, tmp_path: Path) -> None:
    parser = cli.add_inspect_args(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "h200", "--mesh", "x=8", "--modes", "overlap,serial",
                              "--out", str(tmp_path)])
    reps = cli.run_inspect(args, toy_programs.build_step)
    cmp = json.loads((tmp_path / "compare.json").read_text())
    assert cmp["groups"]["all"]["overlap"]["sync"] == 0 and cmp["groups"]["all"]["serial"]["sync"] == 2
    assert cmp["speedup_est"] > 1.0
    trace = json.loads((tmp_path / "report_overlap.trace.json").read_text())
    assert any(e.get("tid") == 2 and e["ph"] == "X" for e in trace["traceEvents"])
    assert reps["overlap"]["meta"]["compiler_options"] == {"xla_gpu_enable_latency_hiding_scheduler": True,
                                                          "xla_gpu_autotune_level": 0}
    # scheduled HLO written by default, gzip-compressed; the memory section in every report
    with gzip.open(tmp_path / "scheduled_overlap.hlo.txt.gz", "rt") as f:
        assert "is_scheduled=true" in f.read(2000)
    assert reps["overlap"]["memory"]["peak_bytes_per_device"] > 0
    assert cmp["peak_bytes_per_device"]["serial"] > 0
    # the toy has one layer, so there is no pair of layers to draw
    assert not (tmp_path / "report_overlap.timeline.png").exists()

    args = parser.parse_args(["--target", "h200", "--mesh", "x=8", "--modes", "overlap", "--no-save-hlo",
                              "--out", str(tmp_path / "no_hlo")])
    cli.run_inspect(args, toy_programs.build_step)
    assert not list((tmp_path / "no_hlo").glob("scheduled_*"))


def _analyze_step(fn: object, specs: tuple, **options: object) -> hlo.Analysis:
    art = aot.compile_scheduled_hlo(fn, *specs, target="h200", compiler_options=options)
    return hlo.analyze(art.hlo_text, "h200")


def test_direction_data_parallel_gradient_all_reduces(mesh: jax.sharding.Mesh) -> None:
    """Known structure (toy_programs.dp_step): one forward all-reduce (the row count), the two
    weight gradients' all-reduces backward, merged by XLA into one all-reduce. jaxlib 0.10.2 left
    the merged one without an op_name; 0.12 joins its parts' names. The direction must come from
    data flow either way, so the check is repeated with the collectives' op_names stripped."""
    fn, specs = toy_programs.dp_step(mesh)
    grad_bytes = [4 * 256 * 512, 4 * 512 * 256]

    art = aot.compile_scheduled_hlo(fn, *specs, target="h200")
    nameless = "\n".join(re.sub(r'op_name="[^"]*"', 'op_name=""', ln) if " all-reduce" in ln else ln
                         for ln in art.hlo_text.splitlines())
    for text in (art.hlo_text, nameless):
        merged = hlo.analyze(text, "h200")
        assert [c.kind for c in merged.collectives] == ["all-reduce", "all-reduce"]
        (fwd,) = [c for c in merged.collectives if c.direction == "fwd"]
        (bwd,) = [c for c in merged.collectives if c.direction == "bwd"]
        assert fwd.bytes == 4 and "transpose(" not in fwd.op_name
        assert bwd.bytes == sum(grad_bytes)
    # the case the name alone gets wrong: no op_name at all, which a name rule calls forward
    assert bwd.op_name == "" and hlo.infer_role(bwd.op_name)[2] == "fwd"

    split = _analyze_step(fn, specs, xla_gpu_all_reduce_combine_threshold_bytes=0)
    got = sorted((c.direction, c.bytes) for c in split.collectives)
    assert got == [("bwd", grad_bytes[0]), ("bwd", grad_bytes[1]), ("fwd", 4)]
    assert {c.layer for c in split.collectives if c.direction == "bwd"} == {0, 1}


def test_direction_expert_parallel_dispatch_combine(mesh: jax.sharding.Mesh) -> None:
    """Known structure (toy_programs.ep_step): Dispatch and Combine forward, their transposes
    backward, the replicated weight's gradient all-reduce backward, the loss scalar forward."""
    fn, specs = toy_programs.ep_step(mesh)
    a = _analyze_step(fn, specs)
    a2a = [(c.role, c.direction) for c in sorted(a.collectives, key=lambda c: c.start_index)
           if c.kind == "all-to-all"]
    assert a2a == [("dispatch", "fwd"), ("combine", "fwd"), ("combine", "bwd"), ("dispatch", "bwd")]
    ar = sorted((c.bytes, c.direction) for c in a.collectives if c.kind == "all-reduce")
    assert ar == [(4.0, "fwd"), (2.0 * 1024 * 1024, "bwd")]  # loss sum f32; d(wr) bf16 [1024, 1024]
    loss_ar = next(c for c in a.collectives if c.bytes == 4)
    first_bwd = min(c.start_index for c in a.collectives if c.direction == "bwd")
    print(f"loss all-reduce scheduled at {loss_ar.start_index}, first backward collective at {first_bwd}")

    rem = _analyze_step(*toy_programs.ep_step(mesh, remat=True))
    a2a = sorted((c.role, c.direction, c.recompute) for c in rem.collectives if c.kind == "all-to-all")
    # jax.checkpoint recomputes the forward Dispatch inside the backward (the recomputed Combine is
    # dead code); it runs in the backward, so it counts there, marked as a recompute.
    assert a2a == [("combine", "bwd", False), ("combine", "fwd", False), ("dispatch", "bwd", False),
                   ("dispatch", "bwd", True), ("dispatch", "fwd", False)]
    assert rem.totals["by_direction"]["fwd"]["count"] == 3  # 2 all-to-alls + the loss all-reduce


def test_nameless_ragged_exchanges_get_their_roles(mesh: jax.sharding.Mesh) -> None:
    """ragged_all_to_all has no op_name in the HLO; the inspector names each exchange from its
    neighbours (toy_programs.ep_ragged_step: Dispatch, Combine, then their transposes)."""
    a = _analyze_step(*toy_programs.ep_ragged_step(mesh))
    rag = sorted((c for c in a.collectives if c.kind == "ragged-all-to-all"), key=lambda c: c.start_index)
    assert all(c.op_name == "" and c.inferred for c in rag)
    assert [(c.layer, c.role, c.direction) for c in rag] == [
        (0, "dispatch", "fwd"), (0, "combine", "fwd"), (0, "combine", "bwd"), (0, "dispatch", "bwd")]
    # Each moves a device's own 64 rows (f32, 128 wide), not the 8x worst-case receive buffer.
    own_rows = 64 * 128 * 4
    assert [c.bytes for c in rag] == [own_rows] * 4
    assert rag[0].transfer_us == pytest.approx(links.transfer_time_us("ragged-all-to-all", own_rows, 8,
                                                                     costs.HARDWARE["h200"]))


def test_teacher_collectives_reported_apart(mesh: jax.sharding.Mesh, tmp_path: Path) -> None:
    """toy_programs.ep_distill_step: the teacher's two forward all-to-alls are counted under
    'teacher', the student's four (forward and backward) and its gradient all-reduce under 'student'."""
    from farskip_jax.inspect import report

    a = _analyze_step(*toy_programs.ep_distill_step(mesh))
    got = sorted((c.model, c.role, c.direction) for c in a.collectives if c.kind == "all-to-all")
    assert got == [("student", "combine", "bwd"), ("student", "combine", "fwd"),
                   ("student", "dispatch", "bwd"), ("student", "dispatch", "fwd"),
                   ("teacher", "combine", "fwd"), ("teacher", "dispatch", "fwd")]
    by_model = a.totals["by_model"]
    assert by_model["teacher"]["count"] == 2 and by_model["student"]["count"] == 5  # + the d(wr) all-reduce
    assert a.totals["by_model_kind"]["teacher/all-to-all"]["count"] == 2
    md = report.markdown(report.build_report(a))
    assert "| teacher | 2 |" in md and "teacher 0/dispatch" in md
