"""Grouped matmuls (farskip_jax/model/grouped_matmul.py) against the padded buffer and numpy.

Blocked: fp32, forward and gradients to x and to the weights, <= 1e-6, on group layouts that
exercise every block case: empty groups, groups longer than a block, a block overhanging the next
group, rows past the last group, and a last block clamped to the end of the rows; with no batched
head (all rows in the loop), a head shorter than some groups (their tails in the loop), and the
default head.

tokamax: the kernel (Mosaic GPU) cannot run here, so `tokamax_ragged_dot` runs with tokamax's "xla"
implementation, which has the same API: that checks what is ours, the custom VJP (the dimension
numbers of both gradient kernels, the zeroed rows past the groups) and the cotangents' shard_map
types, against jax.lax.ragged_dot's own autodiff, on one device and inside an expert-parallel
shard_map whose weights do not vary over the data axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from farskip_jax.config import MeshConfig
from farskip_jax.model import dispatch
from farskip_jax.model.grouped_matmul import blocked_matmul, tokamax_ragged_dot
from farskip_jax.parallel import make_mesh

TOL = 1e-6
# (group sizes, rows R): sum(sizes) <= R; rows past sum(sizes) belong to no group.
LAYOUTS = {
    "empty_and_long": ([0, 9, 0, 3, 1, 0], 16),
    "past_last_group": ([2, 5, 4], 16),
    "one_group_many_blocks": ([13], 13),
    "all_empty_but_last": ([0, 0, 0, 7], 7),
}


def _setup(sizes: list[int], rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    g, d, f = len(sizes), 5, 6
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, d, f)) / np.sqrt(d), jnp.float32)
    valid = jnp.arange(rows) < starts[-1]
    return x, w, starts, valid


# (rows per loop block, rows per group in the batched head; None: the default head, longer than every
# group here)
BLOCK_HEAD = [(1, 0), (3, 0), (64, 0), (1, 2), (3, 1), (4, 5), (2, None), (64, None)]


def _block_head(block: int, head: int | None) -> tuple[int, ...]:
    return (block,) if head is None else (block, head)


@pytest.mark.parametrize(("block", "head"), BLOCK_HEAD)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocked_matmul_equals_numpy_and_zero_past_groups(layout, block, head):
    sizes, rows = LAYOUTS[layout]
    x, w, starts, valid = _setup(sizes, rows)
    y = np.asarray(jax.jit(lambda a, b, s: blocked_matmul(a, b, s, *_block_head(block, head)))(x, w, starts))
    group = np.repeat(np.arange(len(sizes)), sizes)
    want = np.einsum("rd,rdf->rf", np.asarray(x)[: len(group)], np.asarray(w)[group])
    np.testing.assert_allclose(y[: len(group)], want, rtol=TOL, atol=TOL)
    assert not y[~np.asarray(valid)].any()


@pytest.mark.parametrize(("block", "head"), [(2, 0), (4, 0), (2, 1), (4, 3), (2, None)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocked_ffn_equals_padded_forward_and_gradients(layout, block, head, monkeypatch):
    sizes, rows = LAYOUTS[layout]
    x, wg, starts, valid = _setup(sizes, rows, seed=1)
    _, wu, _, _ = _setup(sizes, rows, seed=2)
    rng = np.random.default_rng(3)
    wd = jnp.asarray(rng.standard_normal((len(sizes), wg.shape[2], x.shape[1])), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((rows, x.shape[1])), jnp.float32)
    # grouped_ffn uses the default block and head; small ones give groups of several blocks.
    blocked = lambda a, b, s: blocked_matmul(a, b, s, *_block_head(block, head))  # noqa: E731
    monkeypatch.setattr(dispatch, "blocked_matmul", blocked)

    def loss(matmul: str):
        def f(x, wg, wu, wd):
            y = dispatch.grouped_ffn(x, starts, wg, wu, wd, matmul, rows)
            # Rows past the last group are unspecified in the padded path: select them away.
            return jnp.sum(jnp.where(valid[:, None], y, 0) * cot), y
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))

    (lb, yb), gb = loss("blocked")(x, wg, wu, wd)
    (lp, yp), gp = loss("padded")(x, wg, wu, wd)
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(yb)[v], np.asarray(yp)[v], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lb, lp, rtol=TOL, atol=TOL)
    for name, a, b in zip(("x", "w_gate", "w_up", "w_down"), gb, gp, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL, err_msg=name)
    # Empty groups get exactly zero weight gradients.
    for i, size in enumerate(sizes):
        if size == 0:
            assert not any(np.asarray(gw)[i].any() for gw in gb[1:])


def test_auto_picks_blocked_on_cpu_only():
    class Dev:
        def __init__(self, platform: str):
            self.platform = platform

    assert dispatch.resolve_matmul("auto", Dev("cpu")) == "blocked"
    assert dispatch.resolve_matmul("auto", Dev("cuda")) == "tokamax"
    assert dispatch.resolve_matmul("auto", Dev("cuda"), "float32") == "ragged"  # the kernel takes no fp32
    assert dispatch.resolve_matmul("auto", Dev("rocm")) == "ragged"
    assert dispatch.resolve_matmul("blocked", Dev("cuda")) == "blocked"


def _ragged_loss(dot, sizes: jax.Array, cot: jax.Array, valid: jax.Array):
    def f(x, w):
        y = dot(x, w, sizes)
        return jnp.sum(jnp.where(valid[:, None], y, 0) * cot), y
    return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tokamax_vjp_equals_ragged_dot(layout):
    sizes, rows = LAYOUTS[layout]
    x, w, starts, valid = _setup(sizes, rows, seed=4)
    cot = jnp.asarray(np.random.default_rng(5).standard_normal((rows, w.shape[2])), jnp.float32)
    sizes_g = jnp.diff(starts)
    tok = lambda a, b, s: tokamax_ragged_dot(a, b, s, implementation="xla")  # noqa: E731
    (lt, yt), (dxt, dwt) = jax.jit(_ragged_loss(tok, sizes_g, cot, valid))(x, w)
    (lr, yr), (dxr, dwr) = jax.jit(_ragged_loss(jax.lax.ragged_dot, sizes_g, cot, valid))(x, w)
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(yt)[v], np.asarray(yr)[v], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lt, lr, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(dwt), np.asarray(dwr), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(dxt)[v], np.asarray(dxr)[v], rtol=TOL, atol=TOL)
    assert not np.asarray(dxt)[~v].any()  # rows past the groups get no gradient
    # the weight gradient is not the trivial one: a wrong contraction would not match ragged_dot's
    assert float(np.abs(np.asarray(dwt)).max()) > 1e-3


def test_tokamax_vjp_types_inside_the_expert_parallel_shard_map():
    """Weights split over `expert` and replicated over `data`, rows split over both (the EP layout):
    the weight gradient must come back typed like the weights, summed over `data`."""
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    rng = np.random.default_rng(6)
    local, rows, d, f = 2, 12, 5, 6
    x = jnp.asarray(rng.standard_normal((8 * rows, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4 * local, d, f)) / np.sqrt(d), jnp.float32)
    sizes = jnp.asarray(np.tile([5, 4], 8), jnp.int32)  # per shard: 9 of its 12 rows in groups

    def loss(dot):
        def body(x, w, s):
            y = dot(x, w, s)
            keep = (jnp.arange(rows) < jnp.sum(s))[:, None]
            return jax.lax.psum(jnp.sum(jnp.where(keep, y, 0) ** 2), ("data", "expert"))
        row_spec = P(("data", "expert"))
        smap = jax.shard_map(body, mesh=mesh, in_specs=(row_spec, P("expert"), row_spec),
                             out_specs=P())
        return jax.jit(jax.value_and_grad(lambda x, w: smap(x, w, sizes), argnums=(0, 1)))

    tok = lambda a, b, s: tokamax_ragged_dot(a, b, s, implementation="xla")  # noqa: E731
    (lt, (dxt, dwt)), (lr, (dxr, dwr)) = loss(tok)(x, w), loss(jax.lax.ragged_dot)(x, w)
    np.testing.assert_allclose(lt, lr, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dwt), np.asarray(dwr), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dxt), np.asarray(dxr), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul", ["tokamax", "ragged", "blocked"])
@pytest.mark.parametrize("layout", ["empty_and_long", "past_last_group"])
def test_rows_past_the_groups_are_never_read(matmul, layout):
    """The expert-parallel receive buffer's rows past the groups, and the backward Combine's
    cotangent rows there, are uninitialised on GPUs (`schedule.scratch_rows`): NaN in both gives
    the groups' outputs, dW and the groups' dx of clean inputs, bit for bit."""
    sizes, rows = LAYOUTS[layout]
    x, w, starts, valid = _setup(sizes, rows, seed=6)
    cot = jnp.asarray(np.random.default_rng(7).standard_normal((rows, w.shape[2])), jnp.float32)
    sizes_g = jnp.diff(starts)
    dot = {"tokamax": lambda a, b: tokamax_ragged_dot(a, b, sizes_g, implementation="xla"),
           "ragged": lambda a, b: jax.lax.ragged_dot(a, b, sizes_g),
           "blocked": lambda a, b: blocked_matmul(a, b, starts, block=3, head=1)}[matmul]

    def run(x_in, ct):
        y, vjp = jax.vjp(dot, x_in, w)
        return (y, *vjp(ct))

    past = ~valid[:, None]
    y0, dx0, dw0 = jax.jit(run)(x, cot)
    y1, dx1, dw1 = jax.jit(run)(jnp.where(past, jnp.nan, x), jnp.where(past, jnp.nan, cot))
    v = np.asarray(valid)
    assert (~v).any()  # the layout has rows past its groups
    np.testing.assert_array_equal(np.asarray(y1)[v], np.asarray(y0)[v])
    np.testing.assert_array_equal(np.asarray(dw1), np.asarray(dw0))
    np.testing.assert_array_equal(np.asarray(dx1)[v], np.asarray(dx0)[v])
