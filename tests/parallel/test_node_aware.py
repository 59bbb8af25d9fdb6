"""The node-aware (two-stage) expert-parallel exchange on 8 host devices (parallel/node_aware.py).

The expert axis is factored into nodes (`ExpertParallel(expert_per_node=...)`): EP=8 as 2 nodes x 4
and 4 nodes x 2, and DP=2 x EP=4 as 2 nodes x 2. Checked against one device:
- the routed experts alone (16 experts, top-2, hand-made routing), values and gradients with
  respect to the tokens, the router weights and the three expert stacks, through both exchanges
  (padded: plain all_to_alls; ragged: ragged_all_to_all emulated from its documented semantics, as
  XLA:CPU has none): random routing in the bounded program (no overflow: exact), every token to one
  rank's experts (the bounded program overflows on every shard, the worst-case program is exact);
- the whole model (3 layers: dense, a parallel-block MoE under FarSkip, a two-stream MoE): logits
  and parameter gradients, regular and FarSkip;
- the compiled program's collectives: per MoE layer one counts all_gather and four all-to-alls
  (two stages each way) forward, their four transposes backward, nothing else.
The one-rank model checkpoint of test_dropless_ep.py runs these meshes too (its CASES).
"""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from par_common import (
    FAST,
    count_ops,
    emulated_ragged_all_to_all,
    ids_and_weights,
    max_abs_err,
    record,
    run_fast,
    split,
    tiny,
    tiny_exe,
)

from farskip_jax.config import MeshConfig
from farskip_jax.model.moe import RoutedExperts, Routing, local_routed
from farskip_jax.parallel import (
    ExpertParallel,
    batch_sharding,
    expert_ranks_per_node,
    make_mesh,
    param_shardings,
    place,
    tile_per_node,
)
from farskip_jax.parallel import mesh as mesh_module
from farskip_jax.parallel.node_aware import expected_nodes_per_token, node_groups, stage_rows
from farskip_jax.train.program import parallel_for
from farskip_jax.xla import links
from farskip_jax.xla.hlo_parse import parse_hlo

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
TOL = 1e-5
E, K, N, T = 16, 2, 256, 32  # experts, top-k, tokens (8 sequences of 32), sequence length
# name -> (mesh, expert ranks per node)
MESHES = {"ep8_2x4": (MeshConfig(expert=8), 4), "ep8_4x2": (MeshConfig(expert=8), 2),
          "dp2xep4_2x2": (MeshConfig(data=2, expert=4), 2)}


def test_node_groups_factor_the_expert_axis():
    across, inside = node_groups(8, 4)
    assert across == ((0, 4), (1, 5), (2, 6), (3, 7))  # one rank per node, same local index
    assert inside == ((0, 1, 2, 3), (4, 5, 6, 7))  # a node's ranks
    with pytest.raises(ValueError, match="does not divide"):
        node_groups(8, 3)
    with pytest.raises(ValueError, match="does not divide"):
        ExpertParallel(make_mesh(MeshConfig(expert=8)), expert_per_node=3)
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    # 0, or a whole node's worth of ranks, is the flat exchange
    assert ExpertParallel(mesh).nodes == ExpertParallel(mesh, expert_per_node=4).nodes == 1
    assert ExpertParallel(mesh, expert_per_node=2).nodes == 2


def test_buffer_rows_of_the_ep32_step():
    """DSV2-Lite at EP32 (4 nodes x 8, top-6 of 64 experts), 8192 tokens per chunk and rank: a token
    reaches 3.35 nodes on average under uniform routing (2.5 of them remote, against 4.5 of its 6
    copies in the flat exchange), so the stage-1 bound (2x balanced) exceeds the worst case (every
    token on every node) and the stage-1 buffer can never overflow; the in-node stage sends and
    receives what the flat exchange's receive buffer holds (2 N K)."""
    from farskip_jax.config import load_config

    cfg = load_config("dsv2lite_farskip")
    q = expected_nodes_per_token(64, 4, 6)
    assert q == pytest.approx(4 * (1 - 12271512 / 74974368))
    assert 3 * q / 4 == pytest.approx(2.51, abs=0.01)
    n = 8192
    rows = stage_rows(cfg.model, cfg.execution, n, expert=32, expert_per_node=8, seq_len=4096)
    assert rows["send1"] == rows["recv1"] == rows["worst_recv1"] == 4 * n
    assert rows["send2"] == rows["recv2"] == 2 * n * 6
    assert rows["worst_recv2"] == 32 * n * 2


def _routing(kind: str, seed: int = 0) -> Routing:
    rng = np.random.default_rng(seed)
    if kind == "random":  # K distinct experts per token, weights uneven
        experts = np.stack([rng.choice(E, K, replace=False) for _ in range(N)])
    else:  # every token to experts 0 and 1: one rank's (and one node's) under every mesh here
        experts = np.tile(np.arange(K), (N, 1))
    weights = rng.uniform(0.2, 1.0, (N, K)).astype(np.float32)
    return Routing(jnp.asarray(weights), jnp.asarray(experts, jnp.int32), {}, T)


@pytest.fixture(scope="module")
def routed_setup():
    # the tests run 2x balanced (production's factor, with the exchange): below the worst case on
    # every mesh here, so one-rank routing overflows; random routing stays under it (checked)
    cfg = tiny(False, n_routed_experts=E, num_experts_per_tok=K)
    ex = RoutedExperts(cfg, nnx.Rngs(3))
    w = tuple(jnp.asarray(v[...]) for v in (ex.w_gate, ex.w_up, ex.w_down))
    x = jax.random.normal(jax.random.key(4), (N, cfg.hidden_size))
    ct = jax.random.normal(jax.random.key(5), (N, cfg.hidden_size))
    return cfg, w, x, ct


def _routed_loss(fn, cfg, exe, ct):
    """(x, router weights, w_gate, w_up, w_down) -> (sum(routed * ct), (routed, overflow))."""
    def loss(x, weights, experts_nk, wg, wu, wd):
        ex = types.SimpleNamespace(w_gate=wg, w_up=wu, w_down=wd)
        routed, aux = fn(x, Routing(weights, experts_nk, {}, T), ex, cfg, exe)
        return jnp.sum(routed * ct), (routed, aux["moe_overflow"])

    return jax.value_and_grad(loss, argnums=(0, 1, 3, 4, 5), has_aux=True)


@pytest.mark.parametrize("kind", ["random", "one_rank"])
@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_routed_experts_equal_one_device(routed_setup, monkeypatch, mesh_name, exchange, kind):
    cfg, w, x, ct = routed_setup
    exe = tiny_exe(moe_buffer_factor=2.0, ep_exchange=exchange)
    if exchange == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    r = _routing(kind)
    args = (x, r.weights_nk, r.experts_nk, *w)
    (_, (ref, _)), ref_grads = run_fast(_routed_loss(local_routed, cfg, exe, ct), *args)
    mesh_cfg, per_node = MESHES[mesh_name]
    mesh = make_mesh(mesh_cfg)
    for bounded in (True, False):
        par = ExpertParallel(mesh, bounded=bounded, expert_per_node=per_node)
        lowered = jax.jit(_routed_loss(par.routed_fn, cfg, exe, ct)).lower(*args)
        if exchange == "ragged":
            assert "ragged_all_to_all" not in lowered.as_text()  # the emulation ran, not the real op
        (_, (routed, overflow)), grads = lowered.compile(FAST)(*args)
        overflow = np.asarray(overflow)
        if bounded and kind == "one_rank":
            # every shard sees every count (one all_gather), so all agree and none moves a row
            assert (overflow == 1).all(), overflow
            assert np.isfinite(np.asarray(routed)).all()
            continue
        assert overflow.sum() == 0, overflow
        case = f"{mesh_name}/{exchange}/{kind}/{'bounded' if bounded else 'worst'}"
        err, err_g = max_abs_err(routed, ref), max_abs_err(grads, ref_grads)
        record("node_aware_routed", case, "routed", err)
        record("node_aware_routed", case, "grads", err_g)
        assert err <= TOL and err_g <= TOL
    # the gradients mean something: every argument gets one
    assert all(float(jnp.max(jnp.abs(g))) > 1e-4 for g in ref_grads)


def _model_cfg(farskip: bool):
    return tiny(farskip, num_layers=3, num_heads=8, n_routed_experts=16)


def _model_exe(exchange: str):
    return tiny_exe(capacity_factor=0.0, ep_exchange=exchange)


@pytest.fixture(scope="module")
def model_data():
    return ids_and_weights(_model_cfg(False), 8, 16)


@pytest.fixture(scope="module", params=[False, True], ids=["regular", "farskip"])
def model_reference(request, model_data):
    graphdef, state = split(_model_cfg(request.param), exe=_model_exe("padded"))
    ids, w = model_data

    def loss(s, ids, w):
        logits = nnx.merge(graphdef, s)(ids).logits
        return jnp.mean(logits * w), logits

    (_, logits), grads = run_fast(jax.value_and_grad(loss, has_aux=True), state, ids, w)
    return request.param, state, logits, grads


MODEL_CASES = ["ep8_2x4-padded", "ep8_4x2-ragged", "dp2xep4_2x2-ragged"]
# `slow` (CI time budget): the whole model with regular connectivity keeps the data x expert mesh,
# with FarSkip the two EP8 factorings; the routed experts under random routing keep each mesh once
# and both exchanges (under one-rank routing every mesh and exchange stays in the default suite).
SLOW_CASES = {"regular-ep8_2x4-padded", "regular-ep8_4x2-ragged", "farskip-dp2xep4_2x2-ragged",
              "ep8_4x2-padded-random", "dp2xep4_2x2-padded-random", "ep8_2x4-ragged-random"}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_equals_one_device(model_reference, model_data, monkeypatch, case):
    farskip, state, ref_logits, ref_grads = model_reference
    mesh_name, exchange = case.split("-")
    if exchange == "ragged":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    graphdef, _ = split(_model_cfg(farskip), exe=_model_exe(exchange))
    mesh_cfg, per_node = MESHES[mesh_name]
    mesh = make_mesh(mesh_cfg)
    par = ExpertParallel(mesh, expert_per_node=per_node)
    ids, w = model_data

    def loss(s, ids, w):
        out = nnx.merge(graphdef, s)(ids, parallel=par)
        return jnp.mean(out.logits * w), (out.logits, out.aux["moe_overflow"])

    args = (place(state, mesh, "ep"), jax.device_put(ids, batch_sharding(mesh)), w)
    (_, (logits, overflow)), grads = run_fast(jax.value_and_grad(loss, has_aux=True), *args)
    assert int(overflow) == 0
    name = f"{'farskip' if farskip else 'regular'}/{case}"
    err_logits, err_grads = max_abs_err(logits, ref_logits), max_abs_err(grads, ref_grads)
    record("node_aware_model", name, "logits", err_logits)
    record("node_aware_model", name, "grads", err_grads)
    assert err_logits <= TOL and err_grads <= TOL


def _teacher_logits(state, ids, teacher: ExpertParallel, exchange: str):
    """The regular model's logits on `teacher`'s layout (its routed experts tiled `teacher.nodes`
    times and placed over the mesh): (logits, overflow flag, the compiled program, the placed
    w_gate stack)."""
    graphdef, _ = split(_model_cfg(False), exe=_model_exe(exchange))
    mesh = teacher.mesh
    placed = place(tile_per_node(state, teacher.nodes), mesh, "ep")
    w_gate = next(v for p, v in jax.tree_util.tree_leaves_with_path(placed) if "w_gate" in str(p))

    def logits(s, ids):
        out = nnx.merge(graphdef, s)(ids, parallel=teacher)
        return out.logits, out.aux["moe_overflow"]

    args = (placed, jax.device_put(ids, batch_sharding(mesh)))
    compiled = jax.jit(logits).lower(*args).compile(FAST)
    out, overflow = compiled(*args)
    return out, int(overflow), compiled, w_gate


# `slow` for EP8 as 2 x 4 (CI time budget): the data x expert mesh cut into nodes is the harder case
@pytest.mark.parametrize("mesh_name", [pytest.param("ep8_2x4", marks=pytest.mark.slow), "dp2xep4_2x2"])
def test_teacher_in_node_equals_one_device(model_reference, model_data, mesh_name):
    """The frozen FCSD teacher on `for_teacher()`'s layout (`mesh.teacher_experts: node`): its routed
    experts copied on every node (`tile_per_node`) and split over that node's ranks. Its logits are
    one device's, each rank holds a node's share of the experts, and none of its all-to-alls
    crosses a node."""
    farskip, state, ref_logits, _ = model_reference
    if farskip:
        pytest.skip("the teacher has regular connectivity")
    mesh_cfg, per_node = MESHES[mesh_name]
    mesh = make_mesh(mesh_cfg)
    par = ExpertParallel(mesh, expert_per_node=per_node, teacher_experts="node")
    teacher = par.for_teacher()
    assert par.nodes == teacher.nodes == 2 and teacher.experts_in_node and teacher.for_teacher() is teacher
    assert teacher.exchange_ranks == per_node and par.exchange_ranks == mesh_cfg.expert
    assert par.worst_case().for_teacher().bounded is False
    out, overflow, compiled, w_gate = _teacher_logits(state, model_data[0], teacher, "padded")
    assert w_gate.shape[0] == 2 * E and w_gate.addressable_shards[0].data.shape[0] == E // per_node
    assert overflow == 0
    err = max_abs_err(out, ref_logits)
    record("node_aware_model", f"teacher_in_node/{mesh_name}", "logits", err)
    assert err <= TOL
    groups = [links.group_members(ins, 8) for comp in parse_hlo(compiled.as_text()).computations.values()
              for ins in comp.instrs if ins.opcode in ("all-to-all", "all-to-all-start")]
    node_of_rank0 = {int(d.id) for d in np.asarray(mesh.devices).reshape(-1)[:per_node]}
    assert any(0 in g for g in groups) and all(set(g) <= node_of_rank0 for g in groups if 0 in g), groups


@pytest.mark.parametrize("mesh_name", ["ep8", "dp2xep4_2x2"])
def test_teacher_local_equals_one_device(model_reference, model_data, mesh_name):
    """`mesh.teacher_experts: local`: every rank holds all of the frozen teacher's routed experts
    (`tile_per_node` once per expert rank) and runs the one-device path on its own tokens. Its
    logits are one device's, and its compiled forward exchanges nothing."""
    farskip, state, ref_logits, _ = model_reference
    if farskip:
        pytest.skip("the teacher has regular connectivity")
    mesh_cfg, per_node = (MeshConfig(expert=8), 0) if mesh_name == "ep8" else MESHES[mesh_name]
    par = ExpertParallel(make_mesh(mesh_cfg), expert_per_node=per_node, teacher_experts="local")
    teacher = par.for_teacher()
    assert teacher.exchange_ranks == 1 and teacher.nodes == mesh_cfg.expert
    out, overflow, compiled, w_gate = _teacher_logits(state, model_data[0], teacher, "ragged")
    assert w_gate.shape[0] == mesh_cfg.expert * E and w_gate.addressable_shards[0].data.shape[0] == E
    assert overflow == 0
    err = max_abs_err(out, ref_logits)
    record("node_aware_model", f"teacher_local/{mesh_name}", "logits", err)
    assert err <= TOL
    # no Dispatch or Combine (the all-gathers XLA's partitioner makes of the router's [tokens, x]
    # scores are there in every layout)
    ops = {ins.opcode for comp in parse_hlo(compiled.as_text()).computations.values() for ins in comp.instrs}
    assert not {op for op in ops if "all-to-all" in op}, ops


def _abstract(state, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


# slow (CI time): the default suite checks the node-aware exchange's compiled collectives in
# tests/inspect/test_node_aware_overlap.py and tests/train/test_teacher_in_node.py (groups of the
# lowered step), and the per-policy counts of the flat one in tests/parallel/test_dropless_ep.py.
@pytest.mark.slow
def test_collectives_per_layer():
    """EP=8 as 2 nodes x 4, a 3-layer model (2 MoE layers), padded exchange: the compiled program's
    all-to-alls by group (node: the 2 ranks with one local index; local: a node's 4 ranks) and the
    counts all_gather over all 8, forward and forward + backward, remat none, save_a2a and full (the
    forward-only program does not depend on the policy: compiled once)."""
    mesh = make_mesh(MeshConfig(expert=8))
    par = ExpertParallel(mesh, expert_per_node=4)
    counts = {}
    for remat in ("none", "save_a2a", "full"):
        graphdef, state = split(tiny(True, num_layers=3), exe=tiny_exe(remat=remat))
        args = (_abstract(state, param_shardings(state, mesh, "ep")),
                jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=batch_sharding(mesh)))

        def loss(s, i, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, s)(i, parallel=par).logits ** 2)

        programs = ((("fwd", loss),) if remat == "none" else ()) + (("fwd+bwd", jax.grad(loss)),)
        for name, fn in programs:
            text = jax.jit(fn).lower(*args).compile(FAST).as_text()
            groups = [links.group_members(ins, 8) for comp in parse_hlo(text).computations.values()
                      for ins in comp.instrs if ins.opcode in ("all-to-all", "all-to-all-start")]
            counts[remat, name, "node"] = groups.count([0, 4])  # the group holding rank 0
            counts[remat, name, "local"] = groups.count([0, 1, 2, 3])
            counts[remat, name, "all-to-all"] = count_ops(text, "all-to-all")
            # the counts exchange: every rank's [2 Nn + E] int32 counts over (node, local)
            counts[remat, name, "counts"] = len(re.findall(
                r"\n\s*(?:ROOT )?%\S+ = s32\[8,\d+\]\S* all-gather(?:-start)?\(", text))
    print(f"NODE_AWARE_COLLECTIVES {counts}")
    # forward, per MoE layer: Dispatch and Combine, one exchange per stage each
    assert counts["none", "fwd", "node"] == counts["none", "fwd", "local"] == 2 * 2
    assert counts["none", "fwd", "all-to-all"] == 2 * 4
    for remat in ("none", "save_a2a", "full"):
        assert counts["none", "fwd", "counts"] == counts[remat, "fwd+bwd", "counts"] == 2
    for remat in ("none", "save_a2a"):
        # backward: the four transposes, and no other collective than the forward's counts (save_a2a
        # keeps what the backward reads: stage 1's weights, stage 2's rows both ways)
        assert counts[remat, "fwd+bwd", "node"] == counts[remat, "fwd+bwd", "local"] == 2 * 4
        assert counts[remat, "fwd+bwd", "all-to-all"] == 2 * 8
    # full: the forward's exchanges run again before their transposes, but for the stage-1 Combine,
    # whose result the backward pass does not read
    assert counts["full", "fwd+bwd", "all-to-all"] == 2 * (4 + 3 + 4)


# mesh.expert_per_node: auto. Nodes given per device of mesh.devices.flat: (mesh, nodes, expected).
AUTO_CASES = {
    "one node": (MeshConfig(expert=8), [0] * 8, 0),
    "2 nodes x 4": (MeshConfig(expert=8), [0] * 4 + [1] * 4, 4),
    "4 nodes x 2": (MeshConfig(expert=8), [0, 0, 1, 1, 2, 2, 3, 3], 2),
    # one process per GPU: the nodes are host names
    "hosts": (MeshConfig(expert=8), ["gpu-a"] * 4 + ["gpu-b"] * 4, 4),
    # data across nodes, each expert group inside one: the flat exchange stays on the node
    "data across nodes": (MeshConfig(data=2, expert=4), [0] * 4 + [1] * 4, 0),
    "data x 2 nodes per group": (MeshConfig(data=2, expert=4), [0, 0, 1, 1, 2, 2, 3, 3], 2),
    # groups that span nodes other than in whole consecutive blocks: no node-aware exchange
    "interleaved": (MeshConfig(expert=8), [0, 1] * 4, None),
    "uneven": (MeshConfig(expert=8), [0, 0, 0, 1, 1, 1, 2, 2], None),
    "node twice in a group": (MeshConfig(expert=8), [0, 0, 1, 1, 0, 0, 1, 1], None),
    "groups cut differently": (MeshConfig(data=2, expert=4), [0, 0, 1, 1, 2, 3, 4, 5], None),
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_expert_ranks_per_node_from_the_devices_nodes(case):
    cfg, nodes, expected = AUTO_CASES[case]
    assert expert_ranks_per_node(make_mesh(cfg), nodes) == expected


def test_auto_resolves_to_the_flat_exchange_where_nodes_do_not_fit(monkeypatch, caplog):
    mesh = make_mesh(MeshConfig(expert=8))
    # one process: every device of this machine is on node 0
    assert expert_ranks_per_node(mesh) == 0
    assert parallel_for(mesh, "auto").nodes == 1
    assert parallel_for(mesh, 4).nodes == 2  # an explicit setting is kept
    monkeypatch.setattr(mesh_module, "device_nodes", lambda devices: [i % 2 for i in range(len(devices))])
    with caplog.at_level("WARNING"):
        assert parallel_for(mesh, "auto").nodes == 1
    assert "not in whole blocks" in caplog.text
    monkeypatch.setattr(mesh_module, "device_nodes", lambda devices: [i // 2 for i in range(len(devices))])
    par = parallel_for(mesh, "auto")
    assert (par.nodes, par.expert_per_node) == (4, 2)
