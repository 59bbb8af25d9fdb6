"""train.teacher_lockstep: the frozen teacher's forward runs layer by layer beside the student's
(one optimization barrier per layer, over what each model's next attention reads); the FCSD step's
values must not change, on one device and under EP=8 (8 host devices), the barriers must really be
in the compiled program, and they must not hold FarSkip's x, which carries the layer's Combine.
`auto` turns it on where the expert exchange spans nodes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import farskip_jax.model.transformer as transformer
from farskip_jax.config import MeshConfig, load_config
from farskip_jax.model.farskip import Ladder
from farskip_jax.parallel import ExpertParallel, make_mesh
from farskip_jax.train import setup
from farskip_jax.train.program import build_program, resolve_teacher_lockstep
from farskip_jax.train.zero1 import batch_devices

T = 16


def _batch(vocab: int, b: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, b, T), dtype=np.int32)
    return {"input_ids": ids, "targets": np.roll(ids, -1, axis=-1),
            "loss_mask": (rng.random((1, b, T)) < 0.7).astype(np.int32),
            "segment_ids": np.ones((1, b, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (1, b, T)).copy()}


def _step(lockstep: bool, expert: int) -> tuple[float, list[np.ndarray], str]:
    cfg = load_config("tiny_farskip", {"mesh.expert": expert, "train.teacher_lockstep": lockstep,
                                       "train.warmup_steps": 0, "train.learning_rate": 1e-3})
    mesh = make_mesh(cfg.mesh)
    prog = build_program(cfg, mesh)
    models = setup.build_models(cfg, prog)
    state = prog.init_state(models.student_params)
    batch = {k: jax.device_put(v, prog.batch_sharding)
             for k, v in _batch(cfg.model.vocab_size, 2 * batch_devices(mesh)).items()}
    args = (state, models.teacher_params, batch, np.float32(1.0), np.float32(0.0))
    hlo = prog.train_step.lower(*args).as_text()
    state, m = prog.train_step(*args)
    return float(m["loss"]), [np.asarray(x) for x in jax.tree.leaves(state["params"])], hlo


# The lockstep code is the same on one device; EP=8 is the case that has collectives to overlap.
# Both slow (the EP=8 case is ~40 s on the CI machine, over the default suite's budget with the
# production-path overlap test); tests/inspect/test_cli.py compiles the trainer's FCSD step, lockstep
# included, in the default suite.
@pytest.mark.parametrize("expert", [pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(8, marks=pytest.mark.slow)])
def test_lockstep_step_equals_sequential(expert):
    if jax.device_count() < expert:
        pytest.skip(f"needs {expert} (host) devices")
    (l0, p0, h0), (l1, p1, h1) = _step(False, expert), _step(True, expert)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(p0, p1, strict=True))
    print(f"LOCKSTEP expert={expert}: loss {l0:.6g} vs {l1:.6g}, max |param diff| after 1 step {diff:.3g}")
    assert l0 > 0 and abs(l0 - l1) <= 1e-6 and diff <= 1e-6
    # one barrier joining the two models per layer boundary (the model has 2+ layers)
    assert h1.count("optimization_barrier") > h0.count("optimization_barrier")


def _barrier_operands(states) -> tuple[list, list]:
    """(the barrier's operands, the function's inputs) in the jaxpr of `_join_attention_inputs`."""
    leaves, tree = jax.tree.flatten(states)
    join = transformer._join_attention_inputs
    closed = jax.make_jaxpr(lambda *v: join(jax.tree.unflatten(tree, v)))(*leaves)
    (barrier,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    return list(barrier.invars), list(closed.jaxpr.invars)


def test_lockstep_joins_the_next_attention_inputs_only():
    """FarSkip's x = y + R carries the layer's Combine: the barrier takes the stale y (or the Ladder)
    where a stream has one, x where it has none, and passes the other stream through."""
    a = np.ones((2, 3), np.float32)
    # student (FarSkip: x, y) beside teacher (regular: x, None)
    ops, ins = _barrier_operands([(a, 2 * a), (3 * a, None)])
    assert ops == [ins[1], ins[2]]
    # staleness two: both Ladder streams are joined, x is not
    ops, ins = _barrier_operands([(a, Ladder(2 * a, 3 * a)), (4 * a, None)])
    assert ops == [ins[1], ins[2], ins[3]]
    # batch-split chunks: a list of None carries no stale stream, so the chunks of x are joined
    ops, ins = _barrier_operands([([a, 2 * a], [None, None]), ([3 * a, 4 * a], [None, None])])
    assert ops == ins
    # values unchanged
    out = transformer._join_attention_inputs([(a, 2 * a), (3 * a, None)])
    np.testing.assert_array_equal(np.asarray(out[0][1]), 2 * a)
    np.testing.assert_array_equal(np.asarray(out[1][0]), 3 * a)
    assert out[0][0] is a and out[1][1] is None


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
def test_lockstep_auto_is_on_where_the_exchange_spans_nodes_or_the_teacher_is_local():
    mesh = make_mesh(MeshConfig(expert=8))
    assert resolve_teacher_lockstep("auto", None) is False
    assert resolve_teacher_lockstep("auto", ExpertParallel(mesh)) is False  # flat, one node
    # a teacher that exchanges nothing (`mesh.teacher_experts: local`) is all compute
    assert resolve_teacher_lockstep("auto", ExpertParallel(mesh, teacher_experts="local")) is True
    assert resolve_teacher_lockstep("auto", ExpertParallel(mesh, expert_per_node=8)) is False
    assert resolve_teacher_lockstep("auto", ExpertParallel(mesh, expert_per_node=4)) is True  # 2 nodes
    assert resolve_teacher_lockstep(True, None) is True
    assert resolve_teacher_lockstep(False, ExpertParallel(mesh, expert_per_node=4)) is False
    # and the trainer's program resolves it
    cfg = load_config("tiny_farskip", {"mesh.expert": 8, "mesh.expert_per_node": 4})
    assert build_program(cfg, mesh).spec.teacher_lockstep
    cfg = load_config("tiny_farskip", {"mesh.expert": 8})
    assert not build_program(cfg, mesh).spec.teacher_lockstep
    cfg = load_config("tiny_farskip", {"mesh.expert": 8, "mesh.teacher_experts": "local"})
    assert build_program(cfg, mesh).spec.teacher_lockstep
