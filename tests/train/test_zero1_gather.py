"""ZeRO-1's weight all-gathers in the compute dtype (`train.zero1_gather: compute`, the default) on 8
host devices (mesh data=2 x expert=4, bf16 compute, fp32 masters; the trainer's step with the `lm`
loss, the teacher not being gathered): the same training, bit for bit,
as gathering the fp32 masters (`param`), with the gathered bytes halved except the router's.

Why bitwise: every weight but the router is cast to bf16 by the model before its first use, so a
bf16-rounded copy computes the same values; both settings hand the model that bf16 copy (`param`
casts after the gather) and take the gradient with respect to it. The test fails if a weight the
model reads in float32 is gathered narrow (tried: with `FLOAT32_READS = ()` the losses differ from
the first step on).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from hlo_count import instructions
from sharded_steps import build, random_batches, run_steps

from farskip_jax.config import load_config
from farskip_jax.model.moe import FLOAT32_READS
from farskip_jax.parallel.mesh import key_name
from farskip_jax.train.program import abstract_train_step
from farskip_jax.train.zero1 import batch_devices

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
STEPS, T = 3, 16
# Two layers (one dense, one MoE) and the student alone (`lm`): the gathers are the student's, and
# every kind of weight ZeRO-1 splits is in them.
OVERRIDES = {"mesh.data": 2, "mesh.expert": 4, "model.dtype": "bfloat16", "model.num_layers": 2,
             "train.mode": "lm", "train.warmup_steps": 0, "train.learning_rate": 1e-3}
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4}


def _gathered_bytes(hlo: str) -> dict[str, int]:
    """Bytes of all-gather results by element type (tuple results counted element by element)."""
    out: dict[str, int] = {}
    for _, shape, op, _ in instructions(hlo):
        if op not in ("all-gather", "all-gather-start"):
            continue
        for dtype, dims in re.findall(r"\b([a-z]+\d+)\[([\d,]*)\]", shape):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            out[dtype] = out.get(dtype, 0) + n * _BYTES[dtype]
    return out


def _run(gather: str) -> dict:
    cfg = load_config("tiny_farskip", {**OVERRIDES, "train.zero1_gather": gather})
    prog, models, state = build(cfg)
    batches = random_batches(cfg.model.vocab_size, batch_devices(prog.mesh), STEPS, 1, T)
    state, losses, _ = run_steps(prog, models, state, batches)
    return {"losses": losses, "params": jax.tree.map(np.asarray, state["params"]), "prog": prog}


@pytest.fixture(scope="module")
def runs():
    return {g: _run(g) for g in ("compute", "param")}


def test_compute_dtype_gathers_train_bitwise_like_master_gathers(runs):
    narrow, master = runs["compute"], runs["param"]
    print(f"losses, bf16 gathers {narrow['losses']}, fp32 gathers {master['losses']}")
    assert narrow["losses"] == master["losses"]
    assert narrow["losses"][-1] != narrow["losses"][0]  # the weights moved
    for a, b in zip(jax.tree.leaves(narrow["params"]), jax.tree.leaves(master["params"]), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def h200_hlo():
    """The same train step compiled deviceless for 8 H200 (XLA:CPU moves the widening convert
    in front of its all-gathers, so the bytes a GPU moves are read from the GPU's program)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="jax-cuda13-pjrt not installed")
    from farskip_jax.xla import aot

    mesh = aot.make_target_mesh("h200", {"data": 2, "expert": 4, "tensor": 1})
    out = {}
    for gather in ("compute", "param"):
        cfg = load_config("tiny_farskip", {**OVERRIDES, "train.zero1_gather": gather})
        step, args = abstract_train_step(cfg, mesh, 1, T)
        out[gather] = aot.compile_scheduled_hlo(step, *args, target="h200").hlo_text
    return out


def test_split_weights_are_gathered_in_bf16_except_the_router(runs, h200_hlo):
    sh = runs["compute"]["prog"].shardings
    dtypes = jax.tree_util.tree_leaves_with_path(sh.gather)
    split = [c.spec != g.spec for c, g in zip(jax.tree.leaves(sh.compute), jax.tree.leaves(sh.grads),
                                              strict=True)]
    names = lambda dtype: {key_name(p) for (p, d), s in zip(dtypes, split, strict=True) if s and d == dtype}
    narrowed, kept = names(np.dtype("bfloat16")), names(np.dtype("float32"))
    assert {"embed", "lm_head", "o_proj", "down_proj", "scale"} <= narrowed
    assert kept == {"router"} and "router" in FLOAT32_READS

    narrow, master = _gathered_bytes(h200_hlo["compute"]), _gathered_bytes(h200_hlo["param"])
    print(f"H200 all-gather bytes by dtype (async operands and results): bf16 gathers {narrow}, "
          f"fp32 gathers {master}")
    # The fp32 bytes that no longer move are moved again in bf16, at half the size, and what stays
    # fp32 are the routers' gathers.
    moved_off = master["f32"] - narrow.get("f32", 0)
    assert narrow["bf16"] - master.get("bf16", 0) == moved_off // 2 and moved_off % 4 == 0
    assert narrow.get("f32", 0) < 0.03 * master["f32"]
    f32_gathers = [rest for _, shape, op, rest in instructions(h200_hlo["compute"])
                   if op in ("all-gather", "all-gather-start") and "f32[" in shape]
    assert f32_gathers and all("router" in rest for rest in f32_gathers), f32_gathers
