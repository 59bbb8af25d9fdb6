"""Token dropping under expert parallelism with adversarial routing.

Capacity is per source shard and per expert (`expert_capacity` of the shard's token count),
slots are first come, first served in token order (`assign_slots`). The expected drops are
counted here independently, in numpy, from the routing alone.

Model level: every router kernel is zero, so all scores tie and every token picks experts 0 and
1 (lax.top_k keeps the lower index on ties): the whole batch goes to two experts. A forward +
backward EP step runs and its `dropped_fraction` equals the numpy count.
MoE level: inputs share a direction u and the router's columns 5 and 6 are multiples of u (a
"huge column"), so every token picks (5, 6). Dropped tokens get exactly zero routed output,
kept ones the expert SwiGLU of their token (computed here token by token), and the shared
expert is applied to every token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from par_common import FAST, record, run_fast, tiny

from farskip_jax.config import MeshConfig
from farskip_jax.model.moe import expert_capacity, route
from farskip_jax.model.transformer import build_model
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place

B, T = 8, 16
CAPACITY_FACTOR = 0.5


def fcfs_keep(experts_nk: np.ndarray, shards: int, capacity: int) -> np.ndarray:
    """Per shard, in token order then choice order: keep while the expert has a free slot."""
    n, k = experts_nk.shape
    keep = np.zeros((n, k), bool)
    per = n // shards
    for s in range(shards):
        used: dict[int, int] = {}
        for i in range(s * per, (s + 1) * per):
            for j in range(k):
                e = int(experts_nk[i, j])
                keep[i, j] = used.get(e, 0) < capacity
                used[e] = used.get(e, 0) + 1
    return keep


def capacity(tokens_per_shard: int, cfg) -> int:
    """The capacity rule written out (cross-checks `expert_capacity`)."""
    c = math.ceil(cfg.capacity_factor * tokens_per_shard * cfg.num_experts_per_tok / cfg.n_routed_experts)
    return max(1, min(c, tokens_per_shard))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(expert=8))


def test_step_reports_independent_drop_count(mesh):
    cfg = tiny(True, num_layers=3, capacity_factor=CAPACITY_FACTOR)
    model = build_model(cfg)
    for i, layer in enumerate(model.layers):
        if cfg.is_moe_layer(i):
            layer.moe.router[...] = jnp.zeros_like(layer.moe.router[...])
    graphdef, state = nnx.split(model, nnx.Param)
    par = ExpertParallel(mesh)
    ids = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)

    def loss(s, ids):
        out = nnx.merge(graphdef, s)(ids, parallel=par)
        return jnp.mean(out.logits ** 2), out.aux

    (value, aux), grads = run_fast(jax.value_and_grad(loss, has_aux=True), place(state, mesh, "ep"),
                                   jax.device_put(ids, batch_sharding(mesh)))
    shards = mesh.shape["data"] * mesh.shape["expert"]
    experts = np.tile(np.arange(cfg.num_experts_per_tok), (B * T, 1))  # the tie-broken choice
    assert capacity(B * T // shards, cfg) == expert_capacity(B * T // shards, cfg) == 2
    keep = fcfs_keep(experts, shards, capacity(B * T // shards, cfg))
    expected = 1.0 - keep.mean()  # the same in every MoE layer
    measured = float(aux["dropped_fraction"])
    record("drops", "step/farskip/ep8", "dropped_fraction", abs(measured - expected))
    print(f"PARALLEL_DROPS expected={expected:.6f} measured={measured:.6f}")
    assert expected > 0.5  # the case is adversarial
    assert measured == pytest.approx(expected, abs=1e-6)
    assert np.isfinite(float(value))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_dropped_tokens_get_zero_routed_output(mesh):
    cfg = tiny(True, num_layers=2, capacity_factor=CAPACITY_FACTOR)
    model = build_model(cfg, seed=1)
    moe = model.layers[1].moe
    d = cfg.hidden_size
    u = jnp.ones((d,)) / math.sqrt(d)
    x = 3.0 * u + 0.1 * jax.random.normal(jax.random.key(4), (B, T, d))
    router = jnp.zeros((d, cfg.n_routed_experts)).at[:, 5].set(4.0 * u).at[:, 6].set(3.0 * u)
    moe.router[...] = router
    graphdef, state = nnx.split(moe, nnx.Param)
    par = ExpertParallel(mesh)

    def call(s, x):
        m = nnx.merge(graphdef, s)
        shared, routed, aux = m(x, par.routed_fn)
        return shared, routed, aux["dropped_fraction"], m.shared(x)

    x_sharded = jax.device_put(x, batch_sharding(mesh))
    shared, routed, dropped, shared_ref = run_fast(call, place(state, mesh, "ep"), x_sharded)

    x_nd = np.asarray(x).reshape(B * T, d)
    routing = jax.jit(lambda x: route(x, router, cfg, T)).lower(x_nd).compile(FAST)(x_nd)
    experts, weights = np.asarray(routing.experts_nk), np.asarray(routing.weights_nk)
    assert (experts == np.array([5, 6])).all()  # every token to the same two experts
    shards = mesh.shape["expert"]
    keep = fcfs_keep(experts, shards, capacity(B * T // shards, cfg))
    assert float(dropped) == pytest.approx(1.0 - keep.mean(), abs=1e-6)

    routed_nd = np.asarray(routed).reshape(B * T, d)
    gate, up, down = (np.asarray(moe.experts.w_gate[...]), np.asarray(moe.experts.w_up[...]),
                      np.asarray(moe.experts.w_down[...]))
    expected = np.zeros_like(routed_nd)
    for n in range(B * T):
        for j in range(cfg.num_experts_per_tok):
            if keep[n, j]:
                e = experts[n, j]
                g, h = x_nd[n] @ gate[e], x_nd[n] @ up[e]
                expected[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * h) @ down[e])
    all_dropped = ~keep.any(axis=1)
    assert all_dropped.sum() > B * T // 2 and keep.all(axis=1).sum() > 0
    assert (routed_nd[all_dropped] == 0).all()  # exactly zero, not just small
    assert (np.abs(routed_nd[~all_dropped]).max(axis=-1) > 0).all()
    err = float(np.abs(routed_nd - expected).max())
    record("drops", "moe/ep8", "routed_vs_per_token_reference", err)
    assert err <= 1e-5
    shared_nd = np.asarray(shared).reshape(B * T, d)
    assert np.abs(shared_nd[all_dropped]).sum(axis=-1).min() > 0  # shared expert still applied
    np.testing.assert_allclose(np.asarray(shared), np.asarray(shared_ref), atol=1e-6)
