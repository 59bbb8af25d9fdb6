"""Optimistic dropless buffers (`execution.moe_buffer_factor`) on 8 host devices.

The expert-parallel exchange sizes its receive buffers to factor x the rows balanced routing sends
(`dispatch.moe_buffer`), detects an overflow from the all-gathered row counts, and then moves
nothing and says so; callers (trainer, eval, teacher top-k, generation) run the worst-case program
instead. Checked here on the routed experts alone, with routing chosen by hand, against a dense
NumPy reference (every token through each of its experts' SwiGLU, weighted):
- balanced routing at the tightest factor (1.0) never overflows and is exact, both exchanges, on
  EP=8 and DP=2 x EP=4;
- routing every token to one rank overflows the bounded program (every shard reports it, the output
  stays finite), and the worst-case program is exact;
- the buffer sizes of the DSV2-Lite FCSD step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from par_common import FAST, emulated_ragged_all_to_all, tiny, tiny_exe

from farskip_jax.config import MeshConfig, load_config
from farskip_jax.model.dispatch import moe_buffer
from farskip_jax.model.moe import RoutedExperts, Routing
from farskip_jax.parallel import ExpertParallel, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")
E, K, N, T = 16, 2, 256, 32  # experts, top-k, tokens (8 sequences of 32), sequence length


def _routing(kind: str) -> Routing:
    rng = np.random.default_rng(0)
    if kind == "balanced":  # token i -> experts (i K + j) mod E: every expert gets N K / E rows
        experts = (np.arange(N)[:, None] * K + np.arange(K)[None, :]) % E
    else:  # every token to experts 0 and 1: one rank's under EP=8 and DP=2 x EP=4
        experts = np.tile(np.arange(K), (N, 1))
    weights = rng.uniform(0.2, 1.0, (N, K)).astype(np.float32)
    return Routing(jnp.asarray(weights), jnp.asarray(experts, jnp.int32), {}, T)


def _reference(x: np.ndarray, r: Routing, ex: RoutedExperts) -> np.ndarray:
    wg, wu, wd = (np.asarray(w[...], np.float64) for w in (ex.w_gate, ex.w_up, ex.w_down))
    out = np.zeros(x.shape, np.float64)
    for k in range(K):
        e = np.asarray(r.experts_nk[:, k])
        g = np.einsum("nd,ndf->nf", x, wg[e])
        h = g / (1 + np.exp(-g)) * np.einsum("nd,ndf->nf", x, wu[e])
        out += np.asarray(r.weights_nk[:, k], np.float64)[:, None] * np.einsum("nf,nfd->nd", h, wd[e])
    return out


@pytest.fixture(scope="module")
def setup():
    cfg = tiny(False, n_routed_experts=E, num_experts_per_tok=K)
    experts = RoutedExperts(cfg, nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (N, cfg.hidden_size))
    return cfg, tiny_exe(moe_buffer_factor=1.0), experts, x


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.parametrize("mesh_shape", [{"expert": 8}, {"data": 2, "expert": 4}], ids=["ep8", "dp2xep4"])
@pytest.mark.parametrize("kind", ["balanced", "one_rank"])
def test_bounded_exchange(setup, monkeypatch, exchange, mesh_shape, kind):
    cfg, exe, experts, x = setup
    exe = dataclasses.replace(exe, ep_exchange=exchange)
    if exchange == "ragged":  # XLA:CPU has no ragged-all-to-all: its documented semantics
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    mesh = make_mesh(MeshConfig(**mesh_shape))
    routing = _routing(kind)
    ref = _reference(np.asarray(x, np.float64), routing, experts)
    outs = {}
    for bounded in (True, False):
        par = ExpertParallel(mesh, bounded=bounded)
        fn = jax.jit(lambda x, r, par=par: par.routed_fn(x, r, experts, cfg, exe))
        routed, aux = fn.lower(x, routing).compile(FAST)(x, routing)
        outs[bounded] = (np.asarray(routed), np.asarray(aux["moe_overflow"]))
    routed_b, overflow_b = outs[True]
    routed_w, overflow_w = outs[False]
    assert overflow_w.sum() == 0
    np.testing.assert_allclose(routed_w, ref, atol=1e-4, rtol=1e-4)
    if kind == "balanced":
        assert overflow_b.sum() == 0, overflow_b
        np.testing.assert_array_equal(routed_b, routed_w)
    else:
        # every shard sees every pair's counts (all-gathered), so all of them agree that the exchange
        # overflowed and none moves a row: no rank computes on a partial buffer
        assert (overflow_b == 1).all(), overflow_b
        assert np.isfinite(routed_b).all()


def test_buffer_rows_of_the_dsv2lite_step():
    """EP=8, one stream: 16384 tokens per rank, top-6 of 64 experts (8 per rank)."""
    cfg = load_config("dsv2lite_farskip")
    model, exe = cfg.model, cfg.execution
    tokens = 4 * 4096 // exe.batch_split
    buf = moe_buffer(model, exe, tokens, ranks=8, seq_len=4096, sources=8)
    assert buf.worst == 8 * tokens * 6  # every source sends all of its rows to one rank
    assert buf.balanced == 8 * tokens * 6 / 8
    assert buf.rows == 8 * int(np.ceil(exe.moe_buffer_factor * buf.balanced / 8)) < buf.worst
    worst = dataclasses.replace(exe, moe_buffer_factor=0.0)
    assert moe_buffer(model, worst, tokens, 8, 4096, 8).rows == buf.worst
    big = dataclasses.replace(exe, moe_buffer_factor=100.0)
    assert moe_buffer(model, big, tokens, 8, 4096, 8).rows == buf.worst
