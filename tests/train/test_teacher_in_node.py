"""`mesh.teacher_experts` on 8 host devices cut into 2 nodes x 4 (`mesh.expert_per_node: 4`): the
trainer's FCSD step with the frozen teacher's routed experts inside each node (node, and auto
where the exchange is node-aware) against the teacher's experts over the whole expert axis
(expert). The student is the same program either way; the teacher's all-to-alls no longer cross a
node, and its values do not change (tests/parallel/test_node_aware.py checks the teacher's logits
against one device)."""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np
import pytest
from sharded_steps import build, random_batches, run_steps

from farskip_jax.config import load_config
from farskip_jax.parallel import ExpertParallel, make_mesh
from farskip_jax.train.program import (
    abstract_params,
    abstract_train_step,
    build_program,
    teacher_config,
    teacher_copy_bytes,
    teacher_execution,
    teacher_routed_bytes,
    with_teacher_layout,
)
from farskip_jax.train.step import teacher_parallel
from farskip_jax.train.zero1 import batch_devices

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
T = 16
TWO_NODES = {"mesh.expert": 8, "mesh.expert_per_node": 4, "train.warmup_steps": 0,
             "train.learning_rate": 1e-3}
ACROSS = "[[0, 4], [1, 5], [2, 6], [3, 7]]"  # one rank of each node: the NIC-crossing stage
INSIDE = "[[0, 1, 2, 3], [4, 5, 6, 7]]"  # a node's ranks


def _cfg(teacher_experts: str, **extra):
    return load_config("tiny_farskip", {**TWO_NODES, "mesh.teacher_experts": teacher_experts, **extra})


def _all_to_alls(teacher_experts: str) -> Counter:
    """The lowered train step's all-to-alls by replica groups."""
    cfg = _cfg(teacher_experts)
    step, args = abstract_train_step(cfg, make_mesh(cfg.mesh), 2, T)
    return Counter(re.findall(r'"stablehlo\.all_to_all"\(.*?replica_groups = dense<(\[\[.*?\]\])>',
                              step.lower(*args).as_text()))


def _teacher_parallel(teacher_experts: str, **extra) -> ExpertParallel:
    cfg = _cfg(teacher_experts, **extra)
    return teacher_parallel(build_program(cfg, make_mesh(cfg.mesh)).parallel)


def test_the_teachers_exchanges_stay_inside_the_nodes():
    spread, inside = _all_to_alls("expert"), _all_to_alls("node")
    print(f"TEACHER_IN_NODE all-to-alls by group: teacher over the expert axis {dict(spread)}, inside "
          f"each node {dict(inside)}")
    assert _teacher_parallel("auto") == _teacher_parallel("node") != _teacher_parallel("expert")
    # The student's two-stage exchange is the same program. The teacher's forward had the NIC stage
    # and the in-node stage per Dispatch and per Combine; inside the nodes it runs one flat exchange
    # over a node's ranks in place of the two.
    teacher_across = spread[ACROSS] - inside[ACROSS]
    assert teacher_across > 0 and inside[ACROSS] == inside[INSIDE] - teacher_across
    assert inside[INSIDE] == spread[INSIDE] and set(inside) == {ACROSS, INSIDE}
    # on one node there is nothing to move: the flat exchange, the same layout either way
    flat = _teacher_parallel("node", **{"mesh.expert_per_node": 0})
    assert flat == _teacher_parallel("expert", **{"mesh.expert_per_node": 0}) and not flat.experts_in_node


def test_a_local_teacher_exchanges_nothing():
    """`mesh.teacher_experts: local`: the student's exchanges are the program's only all-to-alls,
    across nodes or on one."""
    spread, inside, local = _all_to_alls("expert"), _all_to_alls("node"), _all_to_alls("local")
    print(f"TEACHER_LOCAL all-to-alls by group: teacher over the expert axis {dict(spread)}, inside each "
          f"node {dict(inside)}, local {dict(local)}")
    teacher_across = spread[ACROSS] - inside[ACROSS]  # the teacher's exchanges, one per stage
    assert local[ACROSS] == inside[ACROSS] and local[INSIDE] == inside[INSIDE] - teacher_across
    teacher = _teacher_parallel("local")
    assert teacher.exchange_ranks == 1 and teacher.nodes == 8
    assert _teacher_parallel("local", **{"mesh.expert_per_node": 0}) == teacher


@pytest.mark.slow  # three trainer builds and steps on 8 host devices: ~100 s on the CI machine
def test_fcsd_steps_equal_with_the_teacher_inside_the_nodes():
    results = {}
    for te in ("expert", "node", "local"):
        prog, models, state = build(_cfg(te))
        w_gate = next(v for p, v in jax.tree_util.tree_leaves_with_path(models.teacher_params)
                      if "w_gate" in str(p))
        batches = random_batches(prog.cfg.model.vocab_size, 2 * batch_devices(prog.mesh), 2, 1, T)
        state, losses, _ = run_steps(prog, models, state, batches)
        results[te] = (losses, jax.tree.leaves(state["params"]), w_gate.addressable_shards[0].data.shape[0])
    l0, p0, rows0 = results["expert"]
    # each rank holds a node's share of the teacher's experts (2x at 2 nodes), or all of them (8x)
    for te, copies in (("node", 2), ("local", 8)):
        l1, p1, rows1 = results[te]
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(p0, p1, strict=True))
        print(f"TEACHER_{te.upper()} losses {l0} vs {l1}, max |param diff| after 2 steps {diff:.3g}")
        assert rows1 == copies * rows0
        assert l0[-1] > 0 and all(abs(a - b) <= 1e-6 * abs(a) + 1e-9 for a, b in zip(l0, l1, strict=True))
        assert diff <= 1e-5


@pytest.mark.parametrize(("name", "expert", "moved", "gib"), [
    ("dsv2lite_farskip", 32, True, 2.51),  # 4 nodes of 8: the copies fit
    ("qwen3_30b_a3b_farskip", 32, False, 5.06),  # over TEACHER_COPY_LIMIT
    ("deepseek_v3_farskip", 64, False, 133.22),  # far over any GPU
])
def test_auto_moves_the_teacher_where_its_copies_are_small(name, expert, moved, gib):
    cfg = load_config(name)
    _, t_abs = abstract_params(teacher_config(cfg), teacher_execution(cfg))
    mesh = jax.sharding.AbstractMesh((1, expert, 1), ("data", "expert", "tensor"))
    par = ExpertParallel(mesh, expert_per_node=8)
    assert teacher_copy_bytes(t_abs, par) / 2**30 == pytest.approx(gib, abs=0.01)
    assert with_teacher_layout(par, "auto", t_abs).teacher_experts == ("node" if moved else "expert")
    assert with_teacher_layout(par, "node", t_abs).teacher_experts == "node"
    assert with_teacher_layout(par, "expert", t_abs) is par
    local = teacher_copy_bytes(t_abs, par, "local")
    assert local == pytest.approx(teacher_routed_bytes(t_abs) * (1 - 1 / expert))
    assert with_teacher_layout(par, "local", t_abs).teacher_experts == "local"
    flat = ExpertParallel(mesh, expert_per_node=0)
    assert teacher_copy_bytes(t_abs, flat) == 0 and with_teacher_layout(flat, "node", t_abs) is flat
