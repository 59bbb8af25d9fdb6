"""Sort-based dispatch (farskip_jax/model/dispatch.py) on one device, against numpy.

Pieces: the capacity rule (highest router weight first, ties to the lower token index, per
sequence and expert), the stable sort with its group boundaries and inverse, the two grouped
GEMMs (ragged_dot and the padded buffer) against a per-row SwiGLU, and the whole routed layer and
model with execution.expert_matmul ragged vs padded (fp32, <= 1e-6). Also: no [assignments, experts]
intermediate (no one-hot) anywhere in the routed computation; the row placement pair
(place_rows / take_rows, custom VJPs over fresh zero buffers) against plain indexing, values and
gradients, dropped rows included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from farskip_jax.config import load_config
from farskip_jax.model import dispatch
from farskip_jax.model.moe import MoE, local_routed
from farskip_jax.model.transformer import build_model

RAGGED_VS_PADDED_TOL = 1e-6


def tiny_cfg(**overrides):
    return load_config("tiny", {f"model.{k}": v for k, v in overrides.items()}).model


def tiny_exe(**overrides):
    return load_config("tiny", {f"execution.{k}": v for k, v in overrides.items()}).execution


def random_routing(rng: np.random.Generator, n: int, k: int, e: int, levels: int | None = None):
    """Distinct experts per token; weights quantised to `levels` values to force ties."""
    experts = np.argsort(rng.random((n, e)), axis=1)[:, :k].astype(np.int32)
    weights = rng.random((n, k)).astype(np.float32)
    if levels:
        weights = np.floor(weights * levels) / levels
    return experts, weights


def numpy_capacity_keep(experts, weights, seq_len, capacity):
    """np.lexsort per sequence: expert, then weight descending, then token index."""
    n, k = experts.shape
    keep = np.zeros(n * k, bool)
    e, w = experts.reshape(-1), weights.reshape(-1)
    token = np.repeat(np.arange(n), k)
    for s in range(n // seq_len):
        idx = np.arange(s * seq_len * k, (s + 1) * seq_len * k)
        order = idx[np.lexsort((token[idx], -w[idx], e[idx]))]
        rank = np.zeros(len(order), int)
        for pos in range(1, len(order)):
            same = e[order[pos]] == e[order[pos - 1]]
            rank[pos] = rank[pos - 1] + 1 if same else 0
        keep[order[rank < capacity]] = True
    return keep.reshape(n, k)


@pytest.mark.parametrize("capacity", [1, 2, 5])
@pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "ties"])
def test_capacity_keep_matches_numpy(capacity, levels):
    rng = np.random.default_rng(capacity)
    s, t, k, e = 3, 12, 3, 6
    experts, weights = random_routing(rng, s * t, k, e, levels)
    keep = np.asarray(jax.jit(dispatch.capacity_keep, static_argnums=(2, 3))(experts, weights, t, capacity))
    expected = numpy_capacity_keep(experts, weights, t, capacity)
    np.testing.assert_array_equal(keep, expected)
    assert 0 < (~keep).sum() and keep.sum() > 0  # something dropped, something kept
    # per (sequence, expert): no dropped weight above a kept one
    for si in range(s):
        rows = slice(si * t, (si + 1) * t)
        for ex in range(e):
            sel = experts[rows] == ex
            kept_w, dropped_w = weights[rows][sel & keep[rows]], weights[rows][sel & ~keep[rows]]
            if kept_w.size and dropped_w.size:
                assert dropped_w.max() <= kept_w.min()


def test_expert_capacity_rule():
    cfg, exe = tiny_cfg(), tiny_exe(capacity_factor=1.25)  # 8 experts, top-2
    assert dispatch.expert_capacity(32, cfg, exe) == 10  # ceil(1.25 * 32 * 2 / 8)
    assert dispatch.expert_capacity(3, cfg, exe) == 1
    # an expert sees a token once
    assert dispatch.expert_capacity(32, cfg, tiny_exe(capacity_factor=100.0)) == 32
    assert dispatch.expert_capacity(32, cfg, tiny_exe(capacity_factor=0.0)) == 0  # dropless
    assert dispatch.rows_per_expert(64, 32, cfg, exe) == 20
    assert dispatch.rows_per_expert(64, 32, cfg, tiny_exe()) == 64


def test_sort_by_group_is_stable_with_inverse_and_counts():
    rng = np.random.default_rng(0)
    g = 5
    ids = rng.integers(0, g + 2, size=40).astype(np.int32)  # ids >= g: skipped rows
    srt = jax.jit(dispatch.sort_by_group, static_argnums=1)(ids, g)
    order, inv, starts = map(np.asarray, srt)
    np.testing.assert_array_equal(order, np.argsort(ids, kind="stable"))
    np.testing.assert_array_equal(order[inv], np.arange(len(ids)))
    counts = np.bincount(ids, minlength=g + 2)[:g]
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(counts)]))
    rows = np.arange(len(ids))
    groups = np.asarray(dispatch.group_of_rows(jnp.asarray(starts), jnp.asarray(rows)))
    np.testing.assert_array_equal(groups, np.minimum(ids[order], g))


def swiglu_rows(x, gate, up, down, group_of_row):
    out = np.zeros((x.shape[0], down.shape[-1]), np.float64)
    for r, grp in enumerate(group_of_row):
        gg, hh = x[r] @ gate[grp], x[r] @ up[grp]
        out[r] = (gg / (1 + np.exp(-gg)) * hh) @ down[grp]
    return out


def test_grouped_ffn_ragged_equals_padded_and_per_row():
    rng = np.random.default_rng(1)
    g, d, f = 4, 8, 6
    sizes = np.array([3, 0, 5, 2])  # an empty group
    r = sizes.sum() + 3  # 3 rows outside every group
    x = rng.standard_normal((r, d)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((g, d, f), (g, d, f), (g, f, d))]
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(sizes)]), jnp.int32)
    run = jax.jit(dispatch.grouped_ffn, static_argnums=(5, 6))
    ragged = np.asarray(run(x, starts, *w, "ragged", 5))
    padded = np.asarray(run(x, starts, *w, "padded", 5))
    inside = int(sizes.sum())
    ref = swiglu_rows(x[:inside], *w, np.repeat(np.arange(g), sizes))
    assert np.abs(ragged[:inside] - padded[:inside]).max() <= RAGGED_VS_PADDED_TOL
    assert np.abs(ragged[:inside] - ref).max() <= 1e-5 and np.abs(ref).max() > 0.1


@pytest.fixture(scope="module")
def moe_outputs():
    """local_routed of one tiny MoE layer for both matmuls, dropless and with a capacity."""
    x = jax.random.normal(jax.random.key(0), (4, 16, 32))
    outs = {}
    for cf in (0.0, 0.5):
        for matmul in ("ragged", "padded"):
            moe = MoE(tiny_cfg(), nnx.Rngs(0), exe=tiny_exe(capacity_factor=cf, expert_matmul=matmul))
            for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down, moe.router):
                w[...] = w[...] * 8.0  # std 0.16: outputs of order 1, so 1e-6 is a real bar
            graphdef, state = nnx.split(moe)

            @jax.jit
            def call(state, x, graphdef=graphdef):
                shared, routed, aux = nnx.merge(graphdef, state)(x, local_routed)
                return routed, aux["dropped_fraction"]

            outs[cf, matmul] = call(state, x)
    return outs


@pytest.mark.parametrize("cf", [0.0, 0.5], ids=["dropless", "capacity"])
def test_moe_ragged_equals_padded(moe_outputs, cf):
    (r_routed, r_dropped), (p_routed, p_dropped) = moe_outputs[cf, "ragged"], moe_outputs[cf, "padded"]
    err = float(jnp.max(jnp.abs(r_routed - p_routed)))
    print(f"DISPATCH moe ragged vs padded cf={cf} max_abs_err={err:.3e} dropped={float(r_dropped):.4f}")
    scale = float(jnp.max(jnp.abs(r_routed)))
    print(f"DISPATCH moe max |routed| = {scale:.3f}")
    assert err <= RAGGED_VS_PADDED_TOL and 0.3 < scale
    assert float(r_dropped) == float(p_dropped)
    assert (float(r_dropped) > 0.1) == (cf > 0)


def test_model_ragged_equals_padded():
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
    logits = {}
    for matmul in ("ragged", "padded"):
        model = build_model(tiny_cfg(), seed=0, exe=tiny_exe(expert_matmul=matmul))
        graphdef, state = nnx.split(model)
        logits[matmul] = jax.jit(lambda s, i, g=graphdef: nnx.merge(g, s)(i).logits)(state, ids)
    err = float(jnp.max(jnp.abs(logits["ragged"] - logits["padded"])))
    print(f"DISPATCH model ragged vs padded max_abs_err={err:.3e}")
    assert err <= RAGGED_VS_PADDED_TOL


@pytest.mark.parametrize("matmul", ["ragged", "padded"])
def test_no_one_hot_in_the_routed_computation(matmul):
    """No index-space intermediate with an assignments axis and an experts axis (a one-hot or a
    comparison matrix). Padded keeps [E, C] slot indices, C = N when dropless: its layout's cost."""
    n, k, e, d, f = 64, 2, 8, 16, 4
    experts, weights = random_routing(np.random.default_rng(2), n, k, e)
    w = [jnp.zeros(s) for s in ((e, d, f), (e, d, f), (e, f, d))]
    jaxpr = jax.make_jaxpr(lambda x: dispatch.routed_experts(x, experts, weights, *w, matmul, n))(
        jnp.zeros((n, d)))
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars}
    token_axes = {n * k} if matmul == "padded" else {n, n * k}
    bad = [s for s in shapes if e in s and (token_axes & set(s)) and set(s) <= {n, k, n * k, e}]
    assert not bad, bad


def test_place_and_take_rows_match_plain_indexing():
    """Values and gradients of the custom-VJP pair against JAX's own scatter/gather transposes.

    Slots are unique and unsorted; 3 of the 12 rows have slots past the end (dropped by
    place_rows: zero gradient; take_rows reads some row there, and callers never use it, so the
    comparison gives those rows a zero cotangent)."""
    rng = np.random.default_rng(7)
    rows, slots, d = 12, 16, 5
    slot_r = jnp.asarray(np.concatenate([rng.permutation(slots)[:9], slots + np.arange(3)]).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((slots, d)), jnp.float32)
    ct_place = jnp.asarray(rng.standard_normal((slots, d)), jnp.float32)
    ct_take = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32).at[9:].set(0.0)

    def plain_place(x):
        return jnp.zeros((slots, d), x.dtype).at[slot_r].set(x, mode="drop")

    def plain_take(y):
        return y[jnp.minimum(slot_r, slots - 1)]

    out, vjp = jax.vjp(lambda x: dispatch.place_rows(x, slot_r, slots), x)
    ref, ref_vjp = jax.vjp(plain_place, x)
    np.testing.assert_array_equal(out, ref)
    (grad,), (ref_grad,) = vjp(ct_place), ref_vjp(ct_place)
    np.testing.assert_array_equal(grad, ref_grad)
    assert float(jnp.abs(grad[9:]).max()) == 0.0 and float(jnp.abs(grad[:9]).min()) > 0.0

    out, vjp = jax.vjp(lambda y: dispatch.take_rows(y, slot_r), y)
    ref, ref_vjp = jax.vjp(plain_take, y)
    np.testing.assert_array_equal(out, ref)
    (grad,), (ref_grad,) = vjp(ct_take), ref_vjp(ct_take)
    np.testing.assert_array_equal(grad, ref_grad)
    assert int((jnp.abs(grad).sum(axis=1) > 0).sum()) == 9  # exactly the placed slots get gradient



@pytest.mark.parametrize("packed", [True, False], ids=["ragged_blocks", "padded_blocks"])
def test_permute_rows_matches_take_rows_through_the_expert_regrouping(packed):
    """The expert-parallel path's regrouping (receive layout -> expert-sorted rows -> back) with
    `permute_rows`: values and gradients bitwise equal to `take_rows`' (a scatter in the backward),
    for random counts from 4 sources to 3 local experts, in ragged (packed) and padded (fixed
    slots of 9 rows) receive blocks, with random cotangents on every row (those of rows nobody
    sent or past the received ones must be dropped by both)."""
    from farskip_jax.parallel.expert import _regroup

    rng = np.random.default_rng(3)
    groups, local, slot_rows, d = 4, 3, 9, 5
    counts_gl = rng.integers(0, 4, size=(groups, local)).astype(np.int32)  # at most 9 per source
    rows = groups * slot_rows
    if packed:
        block_start_g = np.concatenate([[0], np.cumsum(counts_gl.sum(1))[:-1]]).astype(np.int32)
    else:
        block_start_g = (np.arange(groups) * slot_rows).astype(np.int32)
    rg = _regroup(jnp.asarray(counts_gl), jnp.asarray(block_start_g), rows)
    received = int(counts_gl.sum())
    assert 0 < received < rows
    recv = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    for x, fwd, inv in ((recv, rg.src_r, rg.dst_r), (recv, rg.dst_r, rg.src_r)):
        out, vjp = jax.vjp(lambda y, fwd=fwd, inv=inv: dispatch.permute_rows(y, fwd, inv), x)
        ref, ref_vjp = jax.vjp(lambda y, fwd=fwd: dispatch.take_rows(y, fwd), x)
        np.testing.assert_array_equal(out, ref)
        (grad,), (ref_grad,) = vjp(ct), ref_vjp(ct)
        np.testing.assert_array_equal(grad, ref_grad)
        assert int((jnp.abs(grad).sum(axis=1) > 0).sum()) == received  # only the received rows
