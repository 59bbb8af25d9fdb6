"""Toy 8-way shard_map programs for the inspector tests (stand-in for the model's build_step)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, D = 4096, 1024  # global rows (512 per device), model width


def _specs(mesh: Any, n_rows: int, n_w: int) -> tuple[Any, ...]:
    row = jax.ShapeDtypeStruct((ROWS, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return (row,) * n_rows + (w,) * n_w


def _overlap(x: Any, u: Any, a: Any, z: Any, w1: Any, w2: Any, w3: Any, w5: Any) -> Any:
    # each collective has an independent matmul the scheduler can put between start and done
    with jax.named_scope("layer_0/dispatch"):
        h = jax.lax.all_to_all(x @ w1, "x", 0, 0, tiled=True)
    with jax.named_scope("layer_0/attention"):
        v = u @ w2
    with jax.named_scope("layer_0/tp_psum_routed"):
        s = jax.lax.psum(a @ w3, "x")
    with jax.named_scope("layer_0/shared"):
        q = z @ w5
    return h + v, s + q


def _serial(x: Any, u: Any, a: Any, z: Any, w1: Any, w2: Any, w3: Any, w5: Any) -> Any:
    # every matmul depends on the previous collective: nothing can overlap either collective
    with jax.named_scope("layer_0/dispatch"):
        h = jax.lax.all_to_all(x @ w1, "x", 0, 0, tiled=True)
    with jax.named_scope("layer_0/experts"):
        v = h @ w2
    with jax.named_scope("layer_0/tp_psum_routed"):
        s = jax.lax.psum(v @ w3, "x")
    with jax.named_scope("layer_0/shared"):
        q = s @ w5
    return q + u, q + a + z


def build_step(mesh: Any, mode: str) -> tuple[Any, tuple[Any, ...]]:
    body = {"overlap": _overlap, "serial": _serial}[mode]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 4 + (P(),) * 4,
                               out_specs=(P("x"), P("x"))))
    return fn, _specs(mesh, 4, 4)


# ------------------------------------------------------------------------------------------------
# Train steps with a known forward/backward structure, for the direction classification.

DP_WIDTHS = (256, 512, 256)  # a 2-layer MLP: w0 [256, 512], w1 [512, 256], replicated
DP_ROWS = 2048  # global batch rows, 256 per device


def _dp_loss(params: dict[str, Any], x: Any, y: Any, mask: Any) -> Any:
    with jax.named_scope("layer_0/mlp"):
        h = jax.nn.relu(x @ params["w0"])
    with jax.named_scope("layer_1/mlp"):
        out = h @ params["w1"]
    # mean over the valid rows, as the trainer normalises by its token count
    return jnp.sum(jnp.square(out - y) * mask[:, None]) / jnp.sum(mask)


def dp_step(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
    """Data-parallel SGD step: batch rows split over 'x', weights replicated, returns the params.

    Known structure: the one forward collective is the all-reduce of the valid-row count (f32
    scalar), which the backward needs; the partitioner all-reduces each weight's gradient (f32
    [256, 512] and [512, 256]) in the backward. XLA's all-reduce combiner merges those two into one
    whose op_name is empty, the case a name-based rule calls forward.
    """

    def step(params: dict[str, Any], x: Any, y: Any, mask: Any) -> dict[str, Any]:
        g = jax.grad(_dp_loss)(params, x, y, mask)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g)

    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    a, b, c = DP_WIDTHS
    params = {"w0": jax.ShapeDtypeStruct((a, b), jnp.float32, sharding=rep),
              "w1": jax.ShapeDtypeStruct((b, c), jnp.float32, sharding=rep)}
    x = jax.ShapeDtypeStruct((DP_ROWS, a), jnp.float32, sharding=rows)
    y = jax.ShapeDtypeStruct((DP_ROWS, c), jnp.float32, sharding=rows)
    mask = jax.ShapeDtypeStruct((DP_ROWS,), jnp.float32, sharding=rows)
    return jax.jit(step), (params, x, y, mask)


def _ep_layer(mesh: Any, x: Any, wr: Any, w_in: Any, w_out: Any) -> Any:
    with jax.named_scope("layer_0"):
        with jax.named_scope("attention"):
            a = jnp.tanh(x @ wr)

        def moe(t: Any, w_in: Any, w_out: Any) -> Any:
            with jax.named_scope("dispatch"):
                t = jax.lax.all_to_all(t, "x", 0, 0, tiled=True)
            with jax.named_scope("experts"):
                t = jax.nn.relu(t @ w_in[0]) @ w_out[0]
            with jax.named_scope("combine"):
                return jax.lax.all_to_all(t, "x", 0, 0, tiled=True)

        return a + jax.shard_map(moe, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))(a, w_in, w_out)


def ep_step(mesh: Any, remat: bool = False) -> tuple[Any, tuple[Any, ...]]:
    """Expert-parallel SGD step: one MoE layer with Dispatch and Combine all-to-alls.

    Known structure: forward Dispatch and Combine; their transposes in the backward (Combine's
    first); the replicated router/attention weight's gradient all-reduce (backward); the loss
    mean's scalar all-reduce (forward). With ``remat`` the layer is rematerialised: the backward
    recomputes the forward Dispatch (the recomputed Combine is dead and removed).
    """
    layer = jax.checkpoint(_ep_layer, static_argnums=(0,)) if remat else _ep_layer

    def loss(p: dict[str, Any], x: Any) -> Any:
        return jnp.mean(jnp.square(layer(mesh, x, p["wr"], p["w_in"], p["w_out"]).astype(jnp.float32)))

    def step(p: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
        val, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), val

    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    params = {"wr": jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=rep),
              "w_in": jax.ShapeDtypeStruct((8, D, D), jnp.bfloat16, sharding=split),
              "w_out": jax.ShapeDtypeStruct((8, D, D), jnp.bfloat16, sharding=split)}
    x = jax.ShapeDtypeStruct((ROWS, D), jnp.bfloat16, sharding=split)
    return jax.jit(step), (params, x)


def ep_ragged_step(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
    """Expert-parallel step whose row exchanges are jax.lax.ragged_all_to_all, as the model's.

    JAX lowers ragged_all_to_all without an op_name, so the inspector reads which exchange each one
    is from its neighbours. Known structure: forward Dispatch (rows from the dispatch scope into the
    experts' matmul), forward Combine (from the experts back), then in the backward the Combine's
    transpose and the Dispatch's transpose.
    """
    rows, n = 64, 8  # rows per device, 8 rows sent to each peer

    def moe(x: Any, w: Any, offsets: Any, sizes: Any, out_offsets: Any) -> Any:
        # as in the model: the expert side receives into a worst-case buffer (every peer sending
        # all its rows here, 8 x), the token side gets back exactly its own rows
        with jax.named_scope("layer_0/dispatch"):
            send = x * 2.0
            got = jax.lax.ragged_all_to_all(send, jnp.zeros((8 * rows, 128), send.dtype), offsets, sizes,
                                            out_offsets, sizes, axis_name="x")
        with jax.named_scope("layer_0/experts"):
            h = jnp.tanh(got @ w[0])
        with jax.named_scope("layer_0/combine"):
            return jax.lax.ragged_all_to_all(h, jnp.zeros((rows, 128), h.dtype), offsets, sizes, out_offsets,
                                             sizes, axis_name="x")

    def loss(w: Any, x: Any, offsets: Any, sizes: Any, out_offsets: Any) -> Any:
        y = jax.shard_map(moe, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))(x, w, offsets, sizes,
                                                                                      out_offsets)
        return jnp.mean(jnp.square(y))

    def step(w: Any, x: Any, offsets: Any, sizes: Any, out_offsets: Any) -> tuple[Any, Any]:
        # the input's gradient too, so that the backward needs the Dispatch's transpose
        gw, gx = jax.grad(loss, argnums=(0, 1))(w, x, offsets, sizes, out_offsets)
        return w - 0.1 * gw, gx

    split = NamedSharding(mesh, P("x"))
    w = jax.ShapeDtypeStruct((8, 128, 128), jnp.float32, sharding=split)
    x = jax.ShapeDtypeStruct((8 * rows, 128), jnp.float32, sharding=split)
    idx = jax.ShapeDtypeStruct((8 * n,), jnp.int32, sharding=split)
    return jax.jit(step), (w, x, idx, idx, idx)


def ep_distill_step(mesh: Any) -> tuple[Any, tuple[Any, ...]]:
    """A distillation step shaped like FCSD: a frozen teacher's forward inside
    ``jax.named_scope("teacher")`` and the student's forward and backward, both expert parallel.

    Known structure: teacher Dispatch + Combine (forward only, no gradient); student Dispatch +
    Combine forward and their transposes backward; the student's replicated-weight gradient
    all-reduce.
    """

    def loss(p: dict[str, Any], t: dict[str, Any], x: Any) -> Any:
        with jax.named_scope("teacher"):
            target = _ep_layer(mesh, x, t["wr"], t["w_in"], t["w_out"])
        y = _ep_layer(mesh, x, p["wr"], p["w_in"], p["w_out"])
        return jnp.mean(jnp.square((y - jax.lax.stop_gradient(target)).astype(jnp.float32)))

    def step(p: dict[str, Any], t: dict[str, Any], x: Any) -> dict[str, Any]:
        g = jax.grad(loss)(p, t, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    params = {"wr": jax.ShapeDtypeStruct((D, D), jnp.bfloat16, sharding=rep),
              "w_in": jax.ShapeDtypeStruct((8, D, D), jnp.bfloat16, sharding=split),
              "w_out": jax.ShapeDtypeStruct((8, D, D), jnp.bfloat16, sharding=split)}
    x = jax.ShapeDtypeStruct((ROWS, D), jnp.bfloat16, sharding=split)
    return jax.jit(step), (params, dict(params), x)
