"""Sharded execution equals the single-device model (fp32, dropless): logits and parameter grads.

Meshes: EP=8, DP=2 x EP=4 (training layout: tokens over data x expert, routed experts over
expert) and TP=8 (inference layout: heads, shared/dense MLP width and experts over tensor).
The `_ragged` EP meshes run the GPU exchange (ep_exchange="ragged": ragged all-to-alls with
compact Combine outputs and their own transposes) with ragged_all_to_all emulated from its
documented semantics (XLA:CPU has none); random routing makes every sender's slice start at a
different row, so the offsets the counts exchange carries are exercised in both directions.
Model: tiny with 8 heads and 16 routed experts (4 groups, top-2 groups) so that TP=8 splits
heads and experts evenly; 3 layers = dense, first MoE (a parallel block under FarSkip), MoE
with two streams: every connectivity case the recurrence has. Loss: mean(logits * W), W fixed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from par_common import (
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
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place, tp_forward

TOL = 1e-5
B, T = 8, 16
MESHES = {"ep8": MeshConfig(expert=8), "dp2xep4": MeshConfig(data=2, expert=4), "tp8": MeshConfig(tensor=8),
          "ep8_ragged": MeshConfig(expert=8), "dp2xep4_ragged": MeshConfig(data=2, expert=4)}


def _cfg(farskip: bool):
    """The model; it runs as configs/tiny.yaml says (`split`'s default: dropless, tiny buffers)."""
    return tiny(farskip, num_layers=3, num_heads=8, n_routed_experts=16)


@pytest.fixture(scope="module")
def data():
    return ids_and_weights(_cfg(False), B, T)


@pytest.fixture(scope="module", params=[False, True], ids=["regular", "farskip"])
def reference(request, data):
    """Single-device logits and gradients; the same parameters for both connectivities."""
    graphdef, state = split(_cfg(request.param))
    ids, w = data

    def loss(s, ids, w):
        logits = nnx.merge(graphdef, s)(ids).logits
        return jnp.mean(logits * w), logits

    (_, logits), grads = run_fast(jax.value_and_grad(loss, has_aux=True), state, ids, w)
    return request.param, graphdef, state, logits, grads


# `slow` (CI time budget): regular connectivity keeps EP=8 with the production (ragged) exchange and
# the data x expert mesh with the padded one; FarSkip the data x expert mesh with the ragged one.
SLOW_CASES = {"regular-ep8", "regular-dp2xep4_ragged", "farskip-dp2xep4"}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_equals_single_device(reference, data, mesh_name, monkeypatch):
    farskip, graphdef, state, ref_logits, ref_grads = reference
    ids, w = data
    if mesh_name.endswith("_ragged"):
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
        graphdef, _ = split(_cfg(farskip), exe=tiny_exe(ep_exchange="ragged"))
    mesh = make_mesh(MESHES[mesh_name])
    if mesh_name == "tp8":
        fwd = tp_forward(graphdef, state, mesh)
        sharded = place(state, mesh, "tp")

        def loss(s, ids, w):
            logits = fwd(s, ids)[0]
            return jnp.mean(logits * w), logits
    else:
        par = ExpertParallel(mesh)
        sharded = place(state, mesh, "ep")
        ids = jax.device_put(ids, batch_sharding(mesh))

        def loss(s, ids, w):
            logits = nnx.merge(graphdef, s)(ids, parallel=par).logits
            return jnp.mean(logits * w), logits

    (_, logits), grads = run_fast(jax.value_and_grad(loss, has_aux=True), sharded, ids, w)
    case = f"{'farskip' if farskip else 'regular'}/{mesh_name}"
    err_logits, err_grads = max_abs_err(logits, ref_logits), max_abs_err(grads, ref_grads)
    record("exactness", case, "logits", err_logits)
    record("exactness", case, "grads", err_grads)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert err_logits <= TOL and err_grads <= TOL
    # The gradients are not trivially zero: the comparison means something.
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads)) > 1e-4
