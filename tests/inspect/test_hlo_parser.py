"""Parser/analysis checks on scheduled-HLO texts in tests/inspect/data (no compile needed).

async_pair.hlo / sync_pair.hlo are cut from real deviceless H200 compiles of 8-way shard_map
programs; nested_while.hlo is hand-written XLA syntax (while body, async-start wrapper, backward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farskip_jax.inspect import hlo, report
from farskip_jax.xla import costs, hlo_parse, links
from farskip_jax.xla import flags as xla_flags

DATA = Path(__file__).parent / "data"
H200 = costs.HARDWARE["h200"]


def _analyze(name: str, target: str = "h200") -> hlo.Analysis:
    return hlo.analyze((DATA / name).read_text(), target)


def test_sync_pair() -> None:
    a = _analyze("sync_pair.hlo")
    assert [c.kind for c in a.collectives] == ["all-to-all"]
    c = a.collectives[0]
    assert c.flagged_sync and not c.is_async and c.ops_between == []
    assert c.bytes == 512 * 1024 * 2 and c.group_size == 8
    # 8-GPU all-to-all over NVSwitch: 7/8 of the buffer at 450 GB/s, plus the latency floor
    assert c.transfer_us == pytest.approx(512 * 1024 * 2 * 7 / 8 / 450e9 * 1e6 + 5.0)
    assert c.hidden_frac == 0.0 and a.totals["all"]["sync"] == 1
    assert a.totals["all"]["sim_exposed_us"] == pytest.approx(c.transfer_us)


def test_async_pair_with_compute_between() -> None:
    a = _analyze("async_pair.hlo")
    (c,) = a.collectives
    assert c.is_async and not c.flagged_sync
    assert [b.name for b in c.ops_between] == ["gemm_fusion_dot.1"]
    # split-K gemm: out f32[4,512,1024], operands bf16 1 MiB + 2 MiB -> memory bound at 4.8 TB/s
    between_bytes = 4 * 512 * 1024 * 4 + 512 * 1024 * 2 + 1024 * 1024 * 2
    assert c.compute_between_us == pytest.approx(between_bytes / 4.8e12 * 1e6)
    assert c.hidden_frac == pytest.approx(c.compute_between_us / c.transfer_us)
    assert 0.3 < c.hidden_frac < 0.4
    assert (c.layer, c.role, c.direction) == (0, "dispatch", "fwd")
    assert [b.op_name.split("/")[-2] for b in c.ops_between] == ["attention"]


def test_nested_while_body_and_wrappers() -> None:
    a = _analyze("nested_while.hlo")
    mod = hlo_parse.parse_hlo((DATA / "nested_while.hlo").read_text())
    assert mod.entry == "main" and mod.is_scheduled and mod.num_partitions == 8
    init = mod.computations["main"].by_name["init_acc"]
    assert costs.instr_flops(mod, mod.computations["main"], init) == 2 * 1024 * 1024 * 4096
    by = {c.kind: c for c in a.collectives}
    assert set(by) == {"all-reduce", "all-to-all", "reduce-scatter"}
    assert all(c.computation == "body" and c.weight == 4 for c in a.collectives)
    ar = by["all-reduce"]
    assert ar.is_async and ar.direction == "bwd" and (ar.layer, ar.role) == (2, "tp_psum_routed")
    dot_us = 2 * 1024 * 1024 * 4096 / 989e12 * 1e6  # compute bound
    assert ar.compute_between_us == pytest.approx(dot_us)
    ring = 2 * 2 * 2**20 * 7 / 8 / 450e9 * 1e6 + 5.0
    assert ar.transfer_us == pytest.approx(ring)
    assert ar.hidden_frac == pytest.approx(dot_us / ring)
    assert by["all-to-all"].flagged_sync and not by["all-to-all"].is_async
    rs = by["reduce-scatter"]  # async-start/async-done wrapper, loop fusion between
    assert rs.is_async and rs.bytes == 128 * 1024 * 2 and [b.name for b in rs.ops_between] == ["loop_fusion"]
    t = a.totals
    # hlo.Phases: the psum and the all-to-all follow their JAX names (transpose(...) / jvp(...));
    # the reduce-scatter's name has neither mark, so data flow decides: it reads a backward GEMM.
    assert [(c.kind, c.direction) for c in a.collectives] == [
        ("all-reduce", "bwd"), ("all-to-all", "fwd"), ("reduce-scatter", "bwd")]
    assert t["by_direction"]["bwd"]["count"] == 8 and t["by_direction"]["fwd"]["count"] == 4
    assert t["by_kind"]["all-to-all"]["sync"] == 4 and t["by_kind"]["all-to-all"]["hidden_frac"] == 0.0
    # timeline: entry dot + 4 x (dot, all-reduce wait, sync all-to-all, loop fusion, rs wait)
    loop_us = 4 * 2**20 / 4.8e12 * 1e6
    per_iter = dot_us + (ring - dot_us) + by["all-to-all"].transfer_us + loop_us + (rs.transfer_us - loop_us)
    assert t["est_step_us"] == pytest.approx(dot_us + 4 * per_iter)


def test_direction_by_data_flow_through_tuples_loops_and_calls() -> None:
    """phases.hlo: every collective is nameless; which is backward follows from what it reads.

    ar_h: forward (its reducer region is named backward, which must not count); a2a_x: reads a loop
    carry element that stays forward while another element carries a gradient; ar_g: reads the
    gradient element; ar_y: forward in the first trip, a gradient from the second on (the body
    writes g into y), so backward; ar_x_out: the forward element after the loop; ar_call: a
    gradient passed into a called computation; ar_cse: reads a forward-named op whose operand is
    named backward (XLA's CSE merged a forward op with its backward twin): forward.
    """
    a = _analyze("phases.hlo")
    got = {c.name: c.direction for c in a.collectives}
    assert got == {"ar_h": "fwd", "a2a_x": "fwd", "ar_g": "bwd", "ar_y": "bwd", "ar_x_out": "fwd",
                   "ar_call": "bwd", "ar_cse": "fwd"}
    assert all(c.op_name == "" and c.model == "student" and not c.recompute for c in a.collectives)
    weights = {c.name: c.weight for c in a.collectives}
    assert weights["a2a_x"] == 3 and weights["ar_h"] == 1
    t = a.totals["by_direction"]
    assert t["fwd"]["count"] == 1 + 3 + 1 + 1 and t["bwd"]["count"] == 3 + 3 + 1
    assert hlo.name_phase("jit(f)/transpose(jvp(layer_0))/mul") is True
    assert hlo.name_phase("jit(f)/jvp(layer_0)/add") is False and hlo.name_phase("jit(f)/sub") is None


def test_model_of_teacher_scope() -> None:
    assert hlo.model_of("jit(step)/while/body/teacher/layer_3/shard_map/dispatch/all_to_all") == "teacher"
    assert hlo.model_of("jit(step)/jvp(teacher)/layer_3/combine") == "teacher"
    assert hlo.model_of("jit(step)/jvp(layer_3)/shard_map/dispatch/all_to_all") == "student"
    assert hlo.model_of("jit(step)/teachers/x") == "student"


def test_transfer_model_mi300x_full_mesh() -> None:
    hw = costs.HARDWARE["mi300x"]
    # all-to-all: 7 peer slices, each over its own 64 GB/s xGMI link
    assert links.transfer_time_us("all-to-all", 8e6, 8, hw) == pytest.approx(7e6 / (7 * 64e9) * 1e6 + 5)
    assert links.transfer_time_us("collective-permute", 8e6, 2, hw) == pytest.approx(8e6 / 64e9 * 1e6 + 5)
    # 32 GPUs over 4 nodes: the 24 of 32 slices bound for other nodes go over the 50 GB/s NIC
    assert links.transfer_time_us("all-to-all", 8e6, 32, H200) == pytest.approx(
        8e6 * 24 / 32 / 50e9 * 1e6 + 5)
    # a node-aware exchange's inter-node group (one rank on each of 4 nodes): 3 of 4 slices leave
    assert links.transfer_time_us("all-to-all", 8e6, 4, H200, same_node=1) == pytest.approx(
        8e6 * 3 / 4 / 50e9 * 1e6 + 5)
    assert links.link_bytes("ragged-all-to-all", 8e6, 4, H200, same_node=1) == (0.0, 6e6)
    assert links.link_bytes("all-to-all", 8e6, 8, H200) == (7e6, 0.0)


def test_same_node_members_of_sub_axis_groups() -> None:
    """Which members of a replica group share a node (8 partitions per node, row-major mesh ids):
    what tells a node-aware exchange's NIC stage from its NVLink stage (parallel/node_aware.py)."""
    def op(groups: str) -> hlo_parse.Instr:
        return hlo_parse.Instr("a2a", "bf16[8]{0}", "all-to-all", ["x"],
                         f"channel_id=1, replica_groups={groups}, dimensions={{0}}")

    view = "mesh['data'=1,'node'=4,'local'=8,'tensor'=1]"
    assert links.group_members(op(view + " {'node'}"), 32) == [0, 8, 16, 24]
    assert links.group_members(op(view + " {'local'}"), 32) == list(range(8))
    assert links.group_members(op(view + " {'node','local'}"), 32) == list(range(32))
    assert links.same_node_members(op(view + " {'node'}"), 32, 8) == 1
    assert links.same_node_members(op(view + " {'local'}"), 32, 8) == 8
    assert links.same_node_members(op("mesh['data'=1,'expert'=32,'tensor'=1] {'expert'}"), 32, 8) == 8
    assert links.same_node_members(op("mesh['data'=4,'expert'=8,'tensor'=1] {'data'}"), 32, 8) == 1
    assert links.group_members(op("[8,4]<=[4,8]T(1,0)"), 32) == [0, 8, 16, 24]
    assert links.group_members(op("[4,8]<=[32]"), 32) == list(range(8))
    assert links.group_members(op("{{0,8,16,24},{1,9,17,25}}"), 32) == [0, 8, 16, 24]
    assert links.group_members(op("{}"), 32) is None


def test_group_size_reads_every_replica_group_notation() -> None:
    """jaxlib 0.12 prints named mesh axes; 0.10 printed iota and explicit lists (all seen in real
    deviceless compiles: tests/inspect/data and a 0.12 EP compile over a (data=2, expert=4) mesh)."""
    def op(groups: str) -> hlo_parse.Instr:
        return hlo_parse.Instr("a2a", "bf16[8]{0}", "all-to-all", ["x"],
                         f"channel_id=1, replica_groups={groups}, dimensions={{0}}")

    assert links.group_size(op("mesh['data'=2,'expert'=4] {'expert'}"), 99) == 4
    assert links.group_size(op("mesh['data'=2,'expert'=4] {'data'}"), 99) == 2
    assert links.group_size(op("mesh['data'=2,'expert'=4] {'data','expert'}"), 99) == 8
    assert links.group_size(op("mesh['ep'=8] {'ep'}"), 99) == 8
    assert links.group_size(op("[2,4]<=[8]"), 99) == 4
    assert links.group_size(op("{{0,1,2,3,4,5,6,7}}"), 99) == 8
    assert links.group_size(op("{}"), 99) == 99  # no groups: all partitions


def test_infer_role() -> None:
    assert hlo.infer_role("jit(f)/transpose(jvp(x))/layer_12/combine/all_to_all") == (12, "combine", "bwd")
    assert hlo.infer_role("jit(f)/while/body/router/top_k") == (None, "router", "fwd")


def test_lhs_schedule_parser() -> None:
    text = ('hlo_module {\n  name: "m"\n  computations {\n    name: "body"\n    instructions {\n'
            '      id: 5\n    }\n    id: 7\n    root_id: 5\n  }\n}\ncomputation_schedules {\n'
            '  computation_id: 7\n  instructions {\n    id: 5\n  }\n  scheduler_statistics {\n'
            '    all_to_all_wasted_cycles: 118.5\n    total_cycles: 368.7\n  }\n}\n')
    s = hlo.parse_lhs_schedule(text)
    assert s["computations"]["body"]["all_to_all_wasted_cycles"] == 118.5
    assert s["total"]["total_cycles"] == pytest.approx(368.7)


def test_reports_and_compare(tmp_path: Path) -> None:
    a, b = _analyze("async_pair.hlo"), _analyze("sync_pair.hlo")
    paths = report.write_reports(a, tmp_path, "farskip")
    trace = json.loads(paths["trace"].read_text())
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in x} == {1, 2}  # compute and comm lanes
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in x)
    assert "| all-to-all |" in paths["md"].read_text()
    cmp = report.compare(report.build_report(a), report.build_report(b))
    assert cmp["groups"]["all-to-all"]["farskip"]["sync"] == 0
    assert cmp["groups"]["all-to-all"]["regular"]["sync"] == 1
    assert "farskip vs regular" in report.compare_markdown(cmp)


def test_xla_flags_user_wins() -> None:
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --foo=1"}
    added = xla_flags.apply_default_xla_flags("mi300x", env)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in added
    assert "--xla_gpu_enable_cub_radix_sort=false" in added
    assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1 ")
    assert xla_flags.apply_default_xla_flags("mi300x", env) == []  # idempotent
    assert xla_flags.flags_for("local") == []
    assert xla_flags.compiler_options_for("mi300x") == {"xla_gpu_enable_latency_hiding_scheduler": True,
                                                        "xla_gpu_enable_triton_gemm": False}
    with pytest.raises(ValueError):
        xla_flags.flags_for("tpu")
    # TP inference on a GPU also keeps FarSkip's psums apart; a CPU-only host gets nothing.
    env = {}
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=0" in xla_flags.apply_default_xla_flags(
        "h200", env, tp_inference=True)
    assert xla_flags.apply_default_xla_flags("local", {}, tp_inference=True) == []


def test_target_specs_match_the_roofline_table() -> None:
    """The spec XLA compiles with and the inspector's roofline agree on HBM bandwidth; memory sizes
    are what the GPUs report as usable (MI300X 191.7 GiB of its 192, H200 141 GB)."""
    from farskip_jax import targets

    for t in ("h200", "mi300x"):
        assert targets.memory_bandwidth(t) == costs.HARDWARE[t]["hbm_bw"]
    assert targets.memory_bandwidth("mi300x") == 5.3e12
    assert targets.device_memory_size("mi300x") == 205822885888
    assert targets.device_memory_size("h200") == 151397597184




def test_in_place_update_of_a_donated_buffer_moves_only_its_updates() -> None:
    """A decode step writes one token per row into a 512 MiB cache: the scatter of an entry
    parameter (a donated buffer) costs its updates and indices, read and written; the same scatter
    of a computed buffer is still charged the whole buffer in and out."""
    mod = hlo_parse.parse_hlo((DATA / "in_place.hlo").read_text())
    main = mod.computations[mod.entry]
    small = 64 * 512 * 4 + 64 * 2 * 4
    assert costs.instr_bytes(main, main.by_name["written"], mod) == 2 * small
    assert costs.instr_bytes(main, main.by_name["rewritten"], mod) == 2 * 64 * 4096 * 512 * 4 + small


def test_an_uninitialised_buffer_costs_nothing_and_is_updated_in_place() -> None:
    """`schedule.scratch_rows` on a GPU: XLA's AllocateBuffer runs no kernel, and writing the first
    row of another array into it moves that row only; the same
    update of a zero-filled buffer is charged the fill and the whole buffer in and out."""
    mod = hlo_parse.parse_hlo((DATA / "allocated.hlo").read_text())
    main = mod.computations[mod.entry]
    an = costs.CostModel(mod, H200)
    row, buffer = 2048 * 2, 98304 * 2048 * 2
    assert costs.is_allocation(main.by_name["empty"]) and not costs.is_allocation(main.by_name["zeros"])
    assert an.op_time_us(main, main.by_name["empty"]) == 0.0
    assert an.op_time_us(main, main.by_name["zeros"]) > 0.0
    assert costs.instr_bytes(main, main.by_name["first"], mod) == 2 * row
    assert costs.instr_bytes(main, main.by_name["first_of_zeros"], mod) == 2 * buffer + row


def test_timeline_window_ignores_hoisted_ops_and_the_teacher() -> None:
    """The drawn window covers where layers k, k+1 really run: not a weight cast or iota XLA hoisted
    to the start of the program, nor the teacher's layers interleaved with the student's."""
    from farskip_jax.inspect.plot import layer_window

    def op(ts: float, dur: float, layer: int, scope: str = "") -> dict:
        return {"name": "f", "lane": "compute", "ts": ts, "dur": dur,
                "args": {"layer": layer, "direction": "fwd", "op_name": f"jit(step)/{scope}layer_{layer}/x"}}

    events = [op(0.0, 0.001, 2), op(0.5, 0.4, 2)]  # a hoisted iota and a hoisted weight cast of layer 2
    events += [op(10.0 + 10 * i, 10.0, i) for i in range(5)]  # layers 0..4 at 10, 20, ..., 50
    events += [op(35.0, 2.0, 2, "teacher/"), op(36.0, 2.0, 0, "teacher/")]
    start, end, (k, k1) = layer_window(events, "fwd")
    assert (k, k1) == (2, 3)
    assert 30.0 <= start < 31.0 and 49.0 < end <= 50.0


def test_loop_slices_are_priced_by_the_block_they_move() -> None:
    """A loop that takes one 8 MiB block of a 64 MiB buffer per trip and writes one block into another
    (loop_slices.hlo, 8 trips) moves the blocks, not the buffers: the old pricing charged result +
    all operands, i.e. 72 MiB for the take and 136 MiB for the put, every trip. Outside the loop a
    dynamic-update-slice of a computed buffer is still charged in full."""
    text = (DATA / "loop_slices.hlo").read_text()
    mod = hlo_parse.parse_hlo(text)
    an = costs.CostModel(mod, H200)
    assert an.loop_computations == {"body", "cond"}
    body, main = mod.computations["body"], mod.computations[mod.entry]
    mib = 2**20
    cost = {i.name: costs.instr_bytes(body, i, mod, in_loop=True) for i in body.instrs
            if i.opcode not in ("parameter", "get-tuple-element", "constant", "tuple")}
    assert cost["take"] == 8 * mib + 4 + 8 * mib  # read the block (and the index), write it
    assert cost["put"] == 4 + 8 * mib + 8 * mib  # read the update (and the index), write it in place
    assert cost["row"] == 2 * mib + 12 and cost["put_row"] == 2 * mib + 12 and cost["next"] == 12
    # the same ops priced as outside a loop (whole buffers in and out), as before
    assert costs.instr_bytes(body, body.by_name["put"], mod) == 64 * mib + 64 * mib + 8 * mib + 4
    assert costs.instr_bytes(main, main.by_name["entry_put"], mod) == 136 * mib + 4
    # a slice reads only what it returns, wherever it runs
    assert costs.instr_bytes(main, main.by_name["acc_block"], mod) == 16 * mib + 12
    trip = sum(cost.values()) + (4 + 4 + 1)  # the body, then the condition's compare
    entry = (16 * mib + 12) + 192 * mib + (136 * mib + 4)
    a = hlo.analyze(text, "h200")
    assert a.totals["est_step_us"] == pytest.approx((8 * trip + entry) / H200["hbm_bw"] * 1e6)


def test_kernel_custom_calls_are_priced_by_their_flops_and_bytes() -> None:
    """kernels.hlo: a hipBLASLt GEMM in a dynamic_slice_fusion (jaxlib 0.12: a slice of its operand,
    a 76 MiB workspace in its result), the grouped-matmul weight gradient (ragged contracting dim),
    and tokamax's mosaic_gpu_v2 kernels (a ragged_dot, a causal flash attention, its dk/dv VJP)."""
    text = (DATA / "kernels.hlo").read_text()
    mod = hlo_parse.parse_hlo(text)
    main = mod.computations[mod.entry]
    flops = {i.name: costs.dot_flops_by_kind(mod, main, i) for i in main.instrs}
    assert flops["dynamic_slice_fusion"] == {"gemm": 2 * 1024 * 512 * 256}
    # each of the 8192 rows meets one group: 2 M K N, not G x that (the dense-dot formula's 8x)
    assert flops["dw"] == {"grouped_gemm": 2 * 8192 * 2048 * 1408}
    assert flops["tk_gemm"] == {"grouped_gemm": 2 * 1024 * 512 * 256}
    causal_pairs = 2 * 4 * 1024 * 1025 / 2
    assert flops["tk_attn"] == {"attention_kernel": pytest.approx(causal_pairs * 2 * (128 + 128))}
    full = 2 * 2 * 4 * 1024 * 1024 * 128  # one q.k (or p.v) over every pair, non-causal
    assert flops["tk_dkv"] == {"attention_kernel": 2 * full + 2 * full}
    assert [costs.kernel_kind(main.by_name[n]) for n in ("dw", "tk_gemm", "tk_attn")] == [
        "grouped_gemm", "grouped_gemm", "attention_kernel"]
    mib = 2**20
    # the GEMM reads half of x (its slice) and w, writes its f32 result; the workspace is scratch
    assert costs.instr_bytes(main, main.by_name["dynamic_slice_fusion"], mod) == mib + mib / 4 + mib
    an = costs.CostModel(mod, H200, grouped_fill=0.125)
    dw_bytes = 8192 * 2048 * 2 + 8192 * 1408 * 2 + 64 + 8 * 2048 * 1408 * 2
    assert costs.instr_bytes(main, main.by_name["dw"], mod) == dw_bytes
    # max(compute, memory), grouped GEMMs at the rows their groups fill
    assert an.op_time_us(main, main.by_name["dw"]) == pytest.approx(
        0.125 * max(2 * 8192 * 2048 * 1408 / H200["peak_flops"], dw_bytes / H200["hbm_bw"]) * 1e6)
    attn_bytes = 4 * 2 * 1024 * 4 * 128 * 2 + 2 * 2 * 4 * 1024 * 4
    assert an.op_time_us(main, main.by_name["tk_attn"]) == pytest.approx(
        max(causal_pairs * 512 / H200["peak_flops"], attn_bytes / H200["hbm_bw"]) * 1e6)
    dots = hlo.analyze(text, "h200", grouped_fill=0.125).totals["dot_flops"]
    grouped = 2 * 8192 * 2048 * 1408 + 2 * 1024 * 512 * 256
    assert dots["by_kind"]["grouped_gemm"] == grouped
    assert dots["static"] == pytest.approx(2 * 1024 * 512 * 256 + grouped + causal_pairs * 512 + 4 * full)
    assert dots["priced"] == pytest.approx(dots["static"] - 0.875 * grouped)


def test_grouped_gemms_with_exact_rows_are_priced_in_full() -> None:
    """A grouped GEMM traced under `EXACT_ROWS_ATTR` (the one-device routed experts: every static row
    an assignment, e.g. an FCSD teacher with `mesh.teacher_experts: local`) is charged in full
    beside the bounded buffers' grouped GEMMs, which stay at the module's fill."""
    text = (DATA / "kernels.hlo").read_text()
    exact = text.replace('%tk_gemm = bf16[1024,256]{1,0} custom-call(%t, %tw, %tg), ',
                         '%tk_gemm = bf16[1024,256]{1,0} custom-call(%t, %tw, %tg), '
                         f'frontend_attributes={{{costs.EXACT_ROWS_ATTR}="1"}}, ')
    assert exact != text
    main_of = lambda m: m.computations[m.entry]  # noqa: E731
    mod, mod_exact = hlo_parse.parse_hlo(text), hlo_parse.parse_hlo(exact)
    an, an_exact = costs.CostModel(mod, H200, 0.125), costs.CostModel(mod_exact, H200, 0.125)
    for name, scale in (("tk_gemm", 8.0), ("dw", 1.0)):
        t = an.op_time_us(main_of(mod), main_of(mod).by_name[name])
        assert t > 0 and an_exact.op_time_us(main_of(mod_exact), main_of(mod_exact).by_name[name]) == (
            pytest.approx(scale * t))
    tk, dw = 2 * 1024 * 512 * 256, 2 * 8192 * 2048 * 1408
    dots, dots_exact = an.dot_flops(), an_exact.dot_flops()
    assert dots_exact["static"] == dots["static"] and dots_exact["by_kind"] == dots["by_kind"]
    assert dots["priced"] == pytest.approx(dots["static"] - 0.875 * (dw + tk))
    assert dots_exact["priced"] == pytest.approx(dots["static"] - 0.875 * dw)


def test_static_dot_flops_weight_loop_bodies_by_their_trips() -> None:
    """nested_while.hlo: the entry's dot once, the body's dot on each of its 4 trips."""
    text = (DATA / "nested_while.hlo").read_text()
    mod = hlo_parse.parse_hlo(text)
    an = costs.CostModel(mod, H200)
    body = sum(costs.instr_flops(mod, mod.computations["body"], i) for i in mod.computations["body"].instrs)
    entry = sum(costs.instr_flops(mod, mod.computations["main"], i) for i in mod.computations["main"].instrs)
    assert body > 0 and an.dot_flops()["static"] == entry + 4 * body


def test_accounting_and_four_way_tables() -> None:
    """report.accounting: useful vs static dot FLOPs, the roofline of the useful work, est. MFU;
    report.four_way: the gains against the paper's baseline and against the best other row."""
    a = _analyze("nested_while.hlo")
    static = a.totals["dot_flops"]["static"]
    useful = {"per_device": static / 4, "assumptions": ["test"]}
    rep = report.build_report(a, useful=useful)
    acc = rep["accounting"]
    assert acc["static_over_useful"] == pytest.approx(4.0)
    assert acc["useful_roofline_us"] == pytest.approx(static / 4 / H200["peak_flops"] * 1e6)
    step = a.totals["est_step_us"]
    assert acc["est_mfu"] == pytest.approx(static / 4 / (step * 1e-6 * H200["peak_flops"]))
    assert "est. MFU" in report.markdown(rep) and "4.00x the useful" in report.markdown(rep)
    assert report.build_report(a)["accounting"]["est_mfu"] is None  # no config: no useful side

    def fake(step_us: float) -> dict:
        return {"target": "h200", "totals": {"est_step_us": step_us, "by_kind": {}},
                "accounting": {"useful_flops_per_device": 1e12, "peak_flops": 1e15}}

    four = report.four_way({"regular_bs1": fake(100.0), "regular_bs2": fake(80.0), "farskip_bs1": fake(90.0),
                            "farskip_bs2": fake(64.0)})
    rows = four["rows"]
    assert rows["regular_bs1"]["gain_vs_baseline"] == 1.0
    assert rows["farskip_bs2"]["gain_vs_baseline"] == pytest.approx(100 / 64)
    assert rows["farskip_bs2"]["gain_vs_best_other"] == pytest.approx(80 / 64)  # the fastest row
    assert rows["regular_bs2"]["gain_vs_best_other"] == pytest.approx(64 / 80)  # slower than the best
    assert rows["farskip_bs2"]["est_mfu"] == pytest.approx(1e12 / (64e-6 * 1e15))
    md = report.four_way_markdown(four)
    assert "| FarSkip + batch split 2 | farskip_bs2 | 0.06 | 1.562x | 1.250x |" in md


def test_partitioned_kernels_without_tokamax_payload_are_priced() -> None:
    """kernels_partitioned.hlo: the kernels as a real DSV2-Lite FCSD program carries them (jaxlib
    0.12, tokamax 0.0.17): custom_partitioning and our ragged_dot VJP drop tokamax's metadata
    payload, and each per-device attention kernel sees one sequence ([T, H, D]). Kinds come from
    the jax name path; a forward kernel (also one rematerialised in the backward program) reads q,
    k, v only, its VJP also the output cotangent and the residuals."""
    text = (DATA / "kernels_partitioned.hlo").read_text()
    mod = hlo_parse.parse_hlo(text)
    main = mod.computations[mod.entry]
    flops = {i.name: costs.dot_flops_by_kind(mod, main, i) for i in main.instrs}
    pairs = 16 * 1024 * 1025 / 2  # causal, heads x T (T + 1) / 2
    qk, pv = 2 * pairs * 192, 2 * pairs * 128
    assert flops["fwd"] == flops["remat"] == {"attention_kernel": pytest.approx(qk + pv)}
    assert flops["dkv"] == {"attention_kernel": pytest.approx(2 * qk + 2 * pv)}
    assert flops["up"] == {"grouped_gemm": 2 * 12288 * 2048 * 1408}
    assert flops["dw"] == {"grouped_gemm": 2 * 12288 * 2048 * 1408}
    dots = hlo.analyze(text, "h200").totals["dot_flops"]["by_kind"]
    assert dots["attention_kernel"] == pytest.approx(4 * qk + 4 * pv)


def _record(name: str, kind: str, direction: str, start: int, mib: float, transfer: float, exposed: float,
            role: str | None = None, weight: int = 1) -> dict:
    return {"name": name, "kind": kind, "direction": direction, "start_index": start, "bytes": mib * 2**20,
            "transfer_us": transfer, "sim_exposed_us": exposed, "role": role, "weight": weight}


def test_weight_sync_groups_zero1_traffic_and_names_what_cannot_hide() -> None:
    """The weights' gathers (forward) and the gradients' reductions (backward), >= 1 MiB, are
    summed apart, a weight gather that XLA combined with a Dispatch's row counts included; the
    row-count gathers alone, the exchanges themselves and the metric sums are not theirs; the most
    exposed gather and the last reduction are named."""
    recs = [_record("ag.emb", "all-gather", "fwd", 1, 400, 800, 790),
            _record("ag.attn+counts", "all-gather", "fwd", 2, 40, 90, 10, role="dispatch"),
            _record("ag.counts", "all-gather", "fwd", 3, 0.01, 5, 5, role="dispatch"),
            _record("a2a", "ragged-all-to-all", "fwd", 4, 12, 30, 20, role="dispatch"),
            _record("rs.layers", "reduce-scatter", "bwd", 5, 30, 400, 100, weight=2),
            _record("rs.head", "reduce-scatter", "bwd", 6, 50, 800, 700),
            _record("ar.loss", "all-reduce", "bwd", 7, 0.0, 5, 5)]
    ws = report.weight_sync(recs)
    assert ws["gathers"] == {"count": 2, "transfer_us": 890, "exposed_us": 800}
    assert ws["reductions"] == {"count": 3, "transfer_us": 1600, "exposed_us": 900}
    assert ws["most_exposed_gather"]["name"] == "ag.emb"
    assert ws["last_reduction"] == {"name": "rs.head", "transfer_us": 800, "exposed_us": 700}
    text = report.weight_sync_markdown(ws)[0]
    assert "2 weight all-gathers, 0.89 ms of transfer, 0.80 ms exposed" in text and "rs.head: 0.70 ms" in text
    assert report.weight_sync([r for r in recs if r["kind"] == "ragged-all-to-all"]) is None
