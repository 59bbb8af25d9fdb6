"""ZeRO-1 on 8 host devices (mesh data=2 x expert=4): the same training as replicated optimizer
state, optimizer state really split over the batch devices, and the gradient sum compiled to a
reduce-scatter (XLA:CPU writes it as all-reduce + per-device slice)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hlo_count import count_ops, sliced_all_reduces
from sharded_steps import build, random_batches, run_steps

from farskip_jax.config import load_config
from farskip_jax.train.program import abstract_train_step
from farskip_jax.train.zero1 import batch_devices

# `slow` (CI time budget): two 3-step trainings on 8 host devices and their compiles, ~3 minutes of
# the default suite; the sharded update is also what every EP trainer test runs. `pytest -m slow`.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")]
STEPS, A, T = 3, 2, 16
OVERRIDES = {"mesh.data": 2, "mesh.expert": 4, "train.grad_accum_steps": A, "train.warmup_steps": 0,
             "train.learning_rate": 1e-3, "train.kl_chunk_tokens": 8}


def _layout(tree) -> list[tuple]:
    """(shape, spec, first addressable shard's shape) of every non-scalar leaf."""
    return [(x.shape, x.sharding.spec, x.addressable_shards[0].data.shape) for x in jax.tree.leaves(tree)
            if x.ndim]


def _run(zero1: bool) -> dict:
    cfg = load_config("tiny_farskip", {**OVERRIDES, "train.zero1": zero1})
    prog, models, state = build(cfg)
    opt0 = _layout(state["opt_state"])
    batches = random_batches(cfg.model.vocab_size, batch_devices(prog.mesh), STEPS, A, T)
    state, losses, batch = run_steps(prog, models, state, batches)
    scale = jax.ShapeDtypeStruct((), np.float32, sharding=prog.shardings.scalar)
    args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
            models.teacher_params, batch, scale, scale)
    lowered = prog.train_step.lower(*args)
    hlo = lowered.compile().as_text()
    leaves = jax.tree.leaves(state["params"])
    experts = sum(x.sharding.spec[:1] == ("expert",) for x in leaves)
    whole = sum(x.addressable_shards[0].data.shape == x.shape for x in leaves)
    return {"lowered": lowered.as_text(), "cfg": cfg, "replicated_params": whole,
            "expert_params": experts, "losses": losses,
            "params": jax.tree.map(np.asarray, state["params"]), "opt": _layout(state["opt_state"]),
            "opt0": opt0, "hlo": hlo, "prog": prog}


@pytest.fixture(scope="module")
def runs():
    return {z: _run(z) for z in (True, False)}


def test_zero1_trains_like_replicated(runs):
    on, off = runs[True], runs[False]
    loss_diff = max(abs(a - b) for a, b in zip(on["losses"], off["losses"], strict=True))
    pairs = zip(jax.tree.leaves(on["params"]), jax.tree.leaves(off["params"]), strict=True)
    param_diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    print(f"ZeRO-1 vs replicated after {STEPS} steps: max |loss diff| {loss_diff:.3g}, "
          f"max |param diff| {param_diff:.3g}; losses {on['losses']}")
    assert all(np.isfinite(on["losses"])) and on["losses"][0] > 0
    assert loss_diff <= 1e-6 and param_diff <= 1e-6
    # The parameters moved: the comparison is not between two untouched initialisations.
    assert on["losses"][-1] != on["losses"][0]


def test_opt_state_is_split_over_batch_devices(runs):
    on, off = runs[True], runs[False]
    n = 8
    split = rep = 0
    for tree in ("opt", "opt0"):  # after init and after the steps (the step keeps the layout)
        for shape, spec, shard in on[tree]:
            if spec and spec[0] == "expert":  # routed experts keep their EP layout
                assert shard[0] == shape[0] // 4, (shape, shard)
                continue
            assert spec != jax.sharding.PartitionSpec(), shape
            assert int(np.prod(shard)) * n == int(np.prod(shape)), (shape, shard)
            split += 1
    for shape, spec, shard in off["opt"]:
        if not (spec and spec[0] == "expert"):
            assert shard == shape
            rep += 1
    print(f"ZeRO-1: {split // 2} optimizer-state leaves split 8 ways; replicated run: {rep} whole")
    assert split // 2 == rep > 0
    # The fp32 master weights are kept split the same way between steps (each step all-gathers
    # them at its start); without ZeRO-1 every non-expert weight is whole on every device.
    sh = on["prog"].shardings
    unsplit = sum(g.spec == c.spec for g, c in zip(jax.tree.leaves(sh.grads), jax.tree.leaves(sh.compute),
                                                   strict=True)) - on["expert_params"]
    assert on["replicated_params"] == unsplit < 5  # leaves with no axis divisible by 8 stay whole
    assert off["replicated_params"] == len(jax.tree.leaves(off["params"])) - off["expert_params"] > 20


def test_gradients_reduce_scattered(runs):
    on = runs[True]
    counts = {z: {"reduce-scatter": count_ops(r["hlo"], "reduce-scatter"),
                  "sliced all-reduce": sliced_all_reduces(r["hlo"]),
                  "all-reduce": count_ops(r["hlo"], "all-reduce"),
                  "all-gather": count_ops(r["hlo"], "all-gather")} for z, r in runs.items()}
    print(f"compiled train step collectives: ZeRO-1 {counts[True]}, replicated {counts[False]}")
    split_leaves = sum(s.spec != p.spec for s, p in zip(jax.tree.leaves(on["prog"].shardings.grads),
                                                         jax.tree.leaves(on["prog"].shardings.compute),
                                                         strict=True))
    assert split_leaves > 20
    scattered = counts[True]["reduce-scatter"] + counts[True]["sliced all-reduce"]
    # Every split gradient is reduced to this device's slice.
    assert scattered >= split_leaves, (scattered, split_leaves)
    assert counts[False]["reduce-scatter"] + counts[False]["sliced all-reduce"] == 0
    # The split parameters are all-gathered for the forward: at least one all-gather per split leaf.
    assert counts[True]["all-gather"] - counts[False]["all-gather"] >= split_leaves


def test_abstract_train_step_is_the_trainer_step(runs):
    """What the HLO inspector compiles deviceless is the program the trainer ran above."""
    on = runs[True]
    step, (state, teacher, batch, scale, after_void) = abstract_train_step(on["cfg"], on["prog"].mesh, 1, T)
    assert batch["input_ids"].shape == (A, 8, T) and teacher is not None
    assert {x.dtype for x in jax.tree.leaves(teacher)} == {np.dtype("bfloat16")}
    assert any(x.sharding.spec[:1] == (("data", "expert"),) for x in jax.tree.leaves(state["opt_state"]))
    assert step.lower(state, teacher, batch, scale, after_void).as_text() == on["lowered"]
