"""Expert-parallel dispatch/combine and tensor-parallel psums: the only collectives.

Both plug into the model through the `parallel=` argument (`routed_fn`, `reduce`); the layer
recurrence (`farskip_jax.model.farskip.residual_step`) decides what waits for what.

Expert parallelism (training): `shard_map` wraps only the routed experts. Each shard routes its
own tokens, packs them into per-expert capacity buffers, sends each expert group its buffer
(Dispatch all-to-all), runs its local experts as one grouped matmul, sends results back
(Combine all-to-all) and sums them with the router weights. Under FarSkip the Combine's result
feeds only `x' = y' + R`, which the next layer's attention does not read: XLA may run the
Combine under that attention. Shape legend as in model/moe.py, plus G expert-parallel groups,
L = E / G local experts.

Tensor parallelism (inference): the whole forward runs inside one `shard_map` over `tensor`;
attention heads, shared/dense MLP width and experts are split, partial sums meet in psums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ModelConfig
from farskip_jax.model.moe import (
    RoutedExperts,
    Routing,
    Slots,
    assign_slots,
    expert_capacity,
    grouped_ffn,
    pack,
    unpack,
)
from farskip_jax.parallel.mesh import BATCH_AXES, param_specs_tree


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts split over the mesh's `expert` axis, tokens over (data, expert)."""

    mesh: Mesh
    reduce: None = None

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
        groups = self.mesh.shape["expert"]
        if cfg.n_routed_experts % groups:
            raise ValueError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                             f"mesh.expert={groups}")
        tokens = P(BATCH_AXES)
        expert_spec = P("expert", None, None)

        def shard(x, weights, ids, w_gate, w_up, w_down):
            return _ep_routed(x, weights, ids, w_gate, w_up, w_down, cfg, groups)

        fn = jax.shard_map(shard, mesh=self.mesh, in_specs=(tokens, tokens, tokens, expert_spec, expert_spec,
                                                            expert_spec), out_specs=(tokens, P()))
        return fn(x_nd, routing.weights_nk, routing.experts_nk, experts.w_gate[...], experts.w_up[...],
                  experts.w_down[...])


def _ep_routed(x_nd, weights_nk, experts_nk, w_gate, w_up, w_down, cfg: ModelConfig, groups: int):
    """Per shard: pack -> Dispatch -> local grouped matmul -> Combine -> weighted sum."""
    e, d = cfg.n_routed_experts, x_nd.shape[-1]
    local = e // groups
    cap = expert_capacity(x_nd.shape[0], cfg)
    slots = assign_slots(experts_nk, e, cap)
    buf_ecd = pack(x_nd, experts_nk, slots, e, cap)
    with jax.named_scope("dispatch"):
        recv = jax.lax.all_to_all(buf_ecd.reshape(groups, local, cap, d), "expert", 0, 0)  # [G_src, L, C, D]
    with jax.named_scope("experts"):
        x_lnd = recv.transpose(1, 0, 2, 3).reshape(local, groups * cap, d)
        y_lnd = grouped_ffn(x_lnd, w_gate, w_up, w_down)
        back = y_lnd.reshape(local, groups, cap, d).transpose(1, 0, 2, 3)
    with jax.named_scope("combine"):
        y_ecd = jax.lax.all_to_all(back, "expert", 0, 0).reshape(e, cap, d)
    routed = unpack(y_ecd, experts_nk, slots, weights_nk)
    dropped = jax.lax.pmean(jnp.mean((~slots.keep_nk).astype(jnp.float32)), BATCH_AXES)
    return routed, dropped


@dataclass(frozen=True)
class TensorParallel:
    """Inside a shard_map over `tensor`: local heads/experts, psum of partial outputs."""

    axis: str = "tensor"

    def reduce(self, v: jax.Array, name: str) -> jax.Array:
        with jax.named_scope(name):
            return jax.lax.psum(v, self.axis)

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
        """This rank's experts only; the caller's reduce sums the ranks' partial outputs."""
        local = experts.w_gate.shape[0]
        rank = jax.lax.axis_index(self.axis)
        ids = routing.experts_nk - rank * local
        mine = (ids >= 0) & (ids < local)
        ids = jnp.where(mine, ids, local)  # a sentinel expert whose tokens are dropped
        cap = expert_capacity(x_nd.shape[0], cfg)
        slots = assign_slots(ids, local + 1, cap)
        slots = Slots(slots.slot_nk, slots.keep_nk & mine)
        with jax.named_scope("experts"):
            buf = pack(x_nd, ids, slots, local, cap)
            out = grouped_ffn(buf, experts.w_gate[...], experts.w_up[...], experts.w_down[...])
            routed = unpack(out, jnp.minimum(ids, local - 1), slots, routing.weights_nk)
        kept = jax.lax.psum(jnp.sum(slots.keep_nk.astype(jnp.float32)), self.axis)
        return routed, 1.0 - kept / routing.experts_nk.size


# --------------------------------------------------------------------------------------------
# Sharded forward functions over a model's (graphdef, state)


def ep_forward(graphdef: nnx.GraphDef, mesh: Mesh) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> ModelOutput` with expert parallelism."""
    par = ExpertParallel(mesh)

    def f(state, input_ids, positions=None, segment_ids=None):
        return nnx.merge(graphdef, state)(input_ids, positions, segment_ids, parallel=par)

    return f


def tp_forward(graphdef: nnx.GraphDef, state_like: Any, mesh: Mesh) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> (logits, hidden)`: the inference TP layout."""
    par = TensorParallel()
    specs = param_specs_tree(state_like, "tp")

    def body(state, input_ids, positions, segment_ids):
        out = nnx.merge(graphdef, state)(input_ids, positions, segment_ids, parallel=par)
        return out.logits, out.hidden

    def f(state, input_ids, positions=None, segment_ids=None):
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), P()),
                             check_vma=False)(state, input_ids, positions, segment_ids)

    return f


def place(state: Any, mesh: Mesh, layout: str) -> Any:
    """Puts every parameter of `state` on `mesh` with its layout's sharding."""
    specs = param_specs_tree(state, layout)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs,
                        is_leaf=lambda x: isinstance(x, P))
