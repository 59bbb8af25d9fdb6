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
