"""DeepSeek-V2 MoE: router, shared experts, routed experts behind capacity buffers.

Shape legend: N tokens (batch x sequence, flattened), D model width, F expert width, E experts
(local experts under expert/tensor parallelism), K experts per token, C capacity per expert.

The routed-expert computation is a function argument (`routed_fn`): the single-device path
packs tokens into per-expert buffers and runs a grouped matmul here; the expert-parallel path
(`farskip_jax.parallel`) wraps the same pack / grouped matmul / unpack pieces around its
all-to-alls. Nothing in this file names a mesh axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ModelConfig
from farskip_jax.model.layers import DTYPES, MLP, normal_init


class Routing(NamedTuple):
    weights_nk: jax.Array  # fp32 combine weights of the selected experts
    experts_nk: jax.Array  # int32 global expert ids
    aux: dict[str, jax.Array]  # balance losses, dropped fraction


def route(x_nd: jax.Array, router_de: jax.Array, cfg: ModelConfig, seq_len: int) -> Routing:
    """Softmax router, greedy or group-limited top-k, DeepSeek-V2 weight scaling, balance losses."""
    logits = jnp.dot(x_nd.astype(jnp.float32), router_de.astype(jnp.float32))
    scores = jax.nn.softmax(logits, axis=-1)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    masked = scores
    if cfg.routing == "group_limited_greedy":
        group_scores = scores.reshape(-1, cfg.n_group, e // cfg.n_group).max(axis=-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        rows = jnp.arange(scores.shape[0])[:, None]
        group_mask = jnp.zeros_like(group_scores).at[rows, top_groups].set(1.0)
        expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=-1)
        masked = jnp.where(expert_mask > 0, scores, 0.0)
    weights, experts = jax.lax.top_k(masked, k)
    if k > 1 and cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return Routing(weights, experts.astype(jnp.int32), balance_losses(scores, experts, cfg, seq_len))


def balance_losses(scores_ne: jax.Array, experts_nk: jax.Array, cfg: ModelConfig,
                   seq_len: int) -> dict[str, jax.Array]:
    """DeepSeek-V2's expert-level (sequence-wise when `seq_aux`) and device-level balance losses.

    f_i = E/(K*T) * (tokens choosing expert i), P_i = mean over tokens of s_i; L = alpha * sum f_i P_i.
    Device level groups the experts into `aux_device_groups` equal groups (mean f, summed P).
    """
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    t = seq_len if cfg.seq_aux else scores_ne.shape[0]
    counts = jax.nn.one_hot(experts_nk, e, dtype=jnp.float32).sum(axis=1)  # [N, E]
    f = counts.reshape(-1, t, e).sum(axis=1) * (e / (k * t))  # [S, E]
    p = scores_ne.reshape(-1, t, e).mean(axis=1)
    expert_loss = cfg.aux_loss_alpha * jnp.mean(jnp.sum(f * p, axis=-1))
    g = cfg.aux_device_groups
    f_dev = f.reshape(f.shape[0], g, e // g).mean(axis=-1)
    p_dev = p.reshape(p.shape[0], g, e // g).sum(axis=-1)
    device_loss = cfg.device_aux_loss_alpha * jnp.mean(jnp.sum(f_dev * p_dev, axis=-1))
    return {"expert_balance_loss": expert_loss, "device_balance_loss": device_loss}


# --------------------------------------------------------------------------------------------
# Token <-> per-expert buffer packing (shared by the single-device and expert-parallel paths)


def expert_capacity(num_tokens: int, cfg: ModelConfig) -> int:
    """Slots per expert; dropless (every token could pick the same expert) when factor <= 0."""
    if cfg.capacity_factor <= 0:
        return num_tokens
    c = math.ceil(cfg.capacity_factor * num_tokens * cfg.num_experts_per_tok / cfg.n_routed_experts)
    return max(1, min(c, num_tokens))


class Slots(NamedTuple):
    slot_nk: jax.Array  # position of each (token, choice) inside its expert's buffer
    keep_nk: jax.Array  # False where the expert's buffer was full (token dropped for that expert)


def assign_slots(experts_nk: jax.Array, num_experts: int, capacity: int) -> Slots:
    """First come, first served in token order: the same rule on every device and path."""
    n, k = experts_nk.shape
    onehot = jax.nn.one_hot(experts_nk.reshape(-1), num_experts, dtype=jnp.int32)  # [N*K, E]
    position = jnp.cumsum(onehot, axis=0) - 1
    slot = jnp.take_along_axis(position, experts_nk.reshape(-1, 1), axis=1).reshape(n, k)
    return Slots(slot, slot < capacity)


def pack(x_nd: jax.Array, experts_nk: jax.Array, slots: Slots, num_experts: int, capacity: int) -> jax.Array:
    """Scatters each token into its experts' buffers: [E, C, D]; overflow is dropped."""
    n, k = experts_nk.shape
    rows = jnp.broadcast_to(x_nd[:, None, :], (n, k, x_nd.shape[-1]))
    buf = jnp.zeros((num_experts, capacity, x_nd.shape[-1]), x_nd.dtype)
    return buf.at[experts_nk, slots.slot_nk].set(rows, mode="drop")


def unpack(y_ecd: jax.Array, experts_nk: jax.Array, slots: Slots, weights_nk: jax.Array) -> jax.Array:
    """Gathers each token's expert outputs and sums them with the router weights: [N, D]."""
    capacity = y_ecd.shape[1]
    rows = y_ecd[experts_nk, jnp.minimum(slots.slot_nk, capacity - 1)]  # [N, K, D]
    w = jnp.where(slots.keep_nk, weights_nk, 0.0).astype(rows.dtype)
    return jnp.einsum("nkd,nk->nd", rows, w)


def grouped_ffn(x_ecd: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU per expert as a batched (padded) einsum over the capacity buffer.

    A padded einsum rather than jax.lax.ragged_dot: it has static shapes, runs on CPU, CUDA and
    ROCm alike, and ragged_dot's GPU lowering pads to the worst case anyway (ECOSYSTEM.md 1.3).
    """
    dt = x_ecd.dtype
    g = jnp.einsum("ecd,edf->ecf", x_ecd, w_gate.astype(dt))
    u = jnp.einsum("ecd,edf->ecf", x_ecd, w_up.astype(dt))
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, w_down.astype(dt))


class RoutedExperts(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w_gate = normal_init(rngs, (e, d, f), pd)
        self.w_up = normal_init(rngs, (e, d, f), pd)
        self.w_down = normal_init(rngs, (e, f, d), pd)


RoutedFn = Callable[[jax.Array, Routing, RoutedExperts, ModelConfig], tuple[jax.Array, jax.Array]]


def local_routed(x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                 cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """All experts on this device: pack, grouped matmul, unpack. Returns (routed [N, D], dropped)."""
    e = cfg.n_routed_experts
    cap = expert_capacity(x_nd.shape[0], cfg)
    slots = assign_slots(routing.experts_nk, e, cap)
    with jax.named_scope("experts"):
        buf = pack(x_nd, routing.experts_nk, slots, e, cap)
        out = grouped_ffn(buf, experts.w_gate[...], experts.w_up[...], experts.w_down[...])
        routed = unpack(out, routing.experts_nk, slots, routing.weights_nk)
    return routed, jnp.mean((~slots.keep_nk).astype(jnp.float32))


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.router = normal_init(rngs, (cfg.hidden_size, cfg.n_routed_experts), DTYPES[cfg.param_dtype])
        self.experts = RoutedExperts(cfg, rngs)
        self.shared = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg, rngs)
                       if cfg.n_shared_experts > 0 else None)
        self.cfg = cfg

    def __call__(self, x_btd: jax.Array, routed_fn: RoutedFn = local_routed
                 ) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
        """Returns (shared output or None, routed output, aux metrics); both outputs [B, T, D]."""
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(b * t, d)
        with jax.named_scope("router"):
            routing = route(x_nd, self.router[...], self.cfg, seq_len=t)
        routed, dropped = routed_fn(x_nd, routing, self.experts, self.cfg)
        shared = None
        if self.shared is not None:
            with jax.named_scope("shared"):
                shared = self.shared(x_btd)
        return shared, routed.reshape(b, t, d), {**routing.aux, "dropped_fraction": dropped}
