"""The MoE block (DeepSeek-V2/V3, Qwen3-MoE without shared experts, Llama-4 with expert-input scaling):
router, shared experts, routed experts.

Shape legend: N tokens (batch x sequence, flattened), D model width, F expert width, E experts
(local experts under expert/tensor parallelism), K experts per token.

The routed-expert computation is a function argument (`routed_fn`): the single-device path sorts
the (token, choice) assignments by expert and runs a grouped matmul (model/dispatch.py); the
expert- and tensor-parallel paths (`farskip_jax.parallel`) use the same dispatch pieces around
their collectives. A `routed_fn` bound to an object with a `routed_with_shared` method (see
`SharedScheduler`) is handed the shared experts too, to place them where they hide its
communication (expert parallelism: under the Dispatch). Nothing in this file names a mesh axis.
A `routed_fn` gets the `ExecutionConfig` beside the `ModelConfig` (capacity, buffers, GEMM kernel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.xla_metadata import set_xla_metadata

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model.dispatch import drop_over_capacity, resolve_matmul, routed_experts, rows_per_expert
from farskip_jax.model.layers import DTYPES, MLP, normal_init
from farskip_jax.model.swiglu_rows import resolve_swiglu
from farskip_jax.platforms import target_device
from farskip_jax.xla.costs import EXACT_ROWS_ATTR


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    weights_nk: jax.Array  # fp32 combine weights of the selected experts
    experts_nk: jax.Array  # int32 global expert ids
    aux: dict[str, jax.Array]  # balance losses
    # Tokens per sequence (static): capacity is per (sequence, expert), see dispatch.py.
    seq_len: int = dataclasses.field(metadata={"static": True})


def route(x_nd: jax.Array, router_de: jax.Array, cfg: ModelConfig, seq_len: int,
          bias_e: jax.Array | None = None) -> Routing:
    """The router in fp32: scores (softmax, or sigmoid for DeepSeek-V3; Llama-4's `sigmoid_topk` chooses
    on the logits and weights by their sigmoid), experts chosen by greedy or
    group-limited top-k on the scores plus `bias_e` (DeepSeek-V3's correction bias; choice only),
    combine weights gathered from the unbiased scores, renormalised (`norm_topk_prob`, from
    top-`router_norm_min_k` up) and/or scaled by `routed_scaling_factor` (after renormalising only
    when `scale_normalized_weights`), and the balance losses."""
    logits = jnp.dot(x_nd.astype(jnp.float32), router_de.astype(jnp.float32))
    if cfg.router_score == "sigmoid_topk":  # Llama-4: top-k of the logits, sigmoid of the kept ones
        top_logits, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)
        weights = jax.nn.sigmoid(top_logits) * cfg.routed_scaling_factor
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        aux = balance_losses(probs, experts, cfg, seq_len)
        return Routing(weights, experts.astype(jnp.int32), aux, seq_len)
    if cfg.router_score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    # The bias only steers the choice: balanced outside gradient descent, it never gets a gradient.
    choice = scores if bias_e is None else scores + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    if cfg.routing == "group_limited_greedy":
        grouped = choice.reshape(-1, cfg.n_group, e // cfg.n_group)
        if cfg.group_score == "top2_sum":
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        else:
            group_scores = grouped.max(axis=-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        rows = jnp.arange(scores.shape[0])[:, None]
        group_mask = jnp.zeros_like(group_scores).at[rows, top_groups].set(1.0)
        expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=-1)
        # -inf, not 0: biased sigmoid scores may be negative.
        choice = jnp.where(expert_mask > 0, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    renorm = cfg.norm_topk_prob and k >= cfg.router_norm_min_k
    if renorm:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if not renorm or cfg.scale_normalized_weights:
        weights = weights * cfg.routed_scaling_factor
    # DeepSeek-V3's sequence-wise balance loss reads each token's sigmoid scores normalised to sum 1.
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True) if cfg.router_score == "sigmoid" else scores
    return Routing(weights, experts.astype(jnp.int32), balance_losses(probs, experts, cfg, seq_len), seq_len)


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


class RoutedExperts(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w_gate = normal_init(rngs, (e, d, f), pd)
        self.w_up = normal_init(rngs, (e, d, f), pd)
        self.w_down = normal_init(rngs, (e, f, d), pd)


# (routed [N, D], aux): aux holds "dropped_fraction" (capacity drops) and "moe_overflow" (int32, > 0
# when a bounded buffer overflowed and the routed output is void; dispatch.moe_buffer).
RoutedFn = Callable[[jax.Array, Routing, RoutedExperts, ModelConfig, ExecutionConfig],
                    tuple[jax.Array, dict[str, jax.Array]]]
SharedFn = Callable[[jax.Array], jax.Array]  # shared experts: [N, D] -> [N, D]


class SharedScheduler(Protocol):
    """Owner of a `routed_fn` that also runs the shared experts, wherever they hide its collectives."""

    def routed_with_shared(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                           exe: ExecutionConfig, shared_fn: SharedFn | None
                           ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
        """(routed [N, D], aux as a RoutedFn's, shared_fn(x_nd) or None)."""
        ...


def local_routed(x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                 exe: ExecutionConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """All experts on this device: sort, grouped matmul, un-sort. Returns (routed [N, D], aux). The
    sorted rows are exactly the N*K assignments, so nothing can overflow."""
    ids_nk, dropped = drop_over_capacity(routing.experts_nk, routing.weights_nk, routing.seq_len, cfg, exe)
    # every static row of its grouped GEMMs holds an assignment: the inspector prices them in full
    with jax.named_scope("experts"), set_xla_metadata(**{EXACT_ROWS_ATTR: 1}):
        matmul = resolve_matmul(exe.expert_matmul, target_device(), cfg.dtype)
        routed = routed_experts(x_nd, ids_nk, routing.weights_nk, experts.w_gate[...], experts.w_up[...],
                                experts.w_down[...], matmul,
                                rows_per_expert(x_nd.shape[0], routing.seq_len, cfg, exe),
                                swiglu=resolve_swiglu(exe.expert_swiglu, target_device(), matmul))
    return routed, {"dropped_fraction": dropped, "moe_overflow": jnp.zeros((), jnp.int32)}


def scaled_assignments(x_nd: jax.Array, routing: Routing, cfg: ModelConfig
                       ) -> tuple[jax.Array, Routing, ModelConfig]:
    """Llama-4's expert(x * w) as plain top-1 routing: each (token, choice) becomes a row x * w of its
    own [N*K, D] with one expert and weight 1, so every routed path (one device, expert and tensor
    parallel) runs it unchanged; the caller sums each token's K outputs. A sequence's rows stay
    contiguous (T*K of them), so capacity stays per sequence: ceil(cf * T*K / E) rows per expert, as
    for the unexpanded tokens (ties among the rows of an expert are dropped in token order, since
    the weights are all 1)."""
    n, k = routing.experts_nk.shape
    rows = (x_nd[:, None, :] * routing.weights_nk[..., None].astype(x_nd.dtype)).reshape(n * k, -1)
    ones = jnp.ones((n * k, 1), routing.weights_nk.dtype)
    flat = Routing(ones, routing.experts_nk.reshape(n * k, 1), routing.aux, routing.seq_len * k)
    return rows, flat, dataclasses.replace(cfg, num_experts_per_tok=1)


# The Params the model reads in float32 whatever `model.dtype` (routing scores are computed in
# float32, `route`). Every other Param is cast to `model.dtype` before its first use, so a copy
# rounded to that dtype computes exactly the same thing: ZeRO-1 all-gathers those in it
# (`farskip_jax.train.zero1.gather_dtypes`; tests/train/test_zero1_gather.py checks the equality).
FLOAT32_READS = ("router", "router_bias")


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, exe: ExecutionConfig = ExecutionConfig()):
        self.router = normal_init(rngs, (cfg.hidden_size, cfg.n_routed_experts), DTYPES[cfg.param_dtype])
        if cfg.router_bias:
            # An nnx.Param so that every Param-filtered path (trainer state, checkpoints, converters)
            # carries it; `route` stops its gradient and the optimizer's decay mask skips 1-D leaves,
            # so training leaves it unchanged.
            self.router_bias = nnx.Param(jnp.zeros((cfg.n_routed_experts,), DTYPES[cfg.param_dtype]))
        self.experts = RoutedExperts(cfg, rngs)
        self.shared = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg, rngs)
                       if cfg.n_shared_experts > 0 else None)
        self.cfg, self.exe = cfg, exe

    def __call__(self, x_btd: jax.Array, routed_fn: RoutedFn = local_routed
                 ) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
        """Returns (shared output or None, routed output, aux metrics); both outputs [B, T, D]."""
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(b * t, d)
        with jax.named_scope("router"):
            bias = self.router_bias[...] if self.cfg.router_bias else None
            routing = route(x_nd, self.router[...], self.cfg, seq_len=t, bias_e=bias)
        shared_fn = None
        if self.shared is not None:
            mlp = self.shared

            def shared_fn(h_nd: jax.Array) -> jax.Array:
                with jax.named_scope("shared"):
                    return mlp(h_nd.reshape(b, t, d)).reshape(b * t, d)

        routed_in, routed_routing, routed_cfg = x_nd, routing, self.cfg
        if self.cfg.expert_input_scaling:
            routed_in, routed_routing, routed_cfg = scaled_assignments(x_nd, routing, self.cfg)
            if shared_fn is not None:  # the shared expert reads the unscaled tokens
                unscaled_shared = shared_fn
                shared_fn = lambda _rows: unscaled_shared(x_nd)  # noqa: E731
        scheduler = getattr(routed_fn, "__self__", None)
        if shared_fn is not None and hasattr(scheduler, "routed_with_shared"):
            routed, routed_aux, shared = scheduler.routed_with_shared(routed_in, routed_routing, self.experts,
                                                                      routed_cfg, self.exe, shared_fn)
        else:
            routed, routed_aux = routed_fn(routed_in, routed_routing, self.experts, routed_cfg, self.exe)
            shared = None if shared_fn is None else shared_fn(x_nd)
        if self.cfg.expert_input_scaling:  # the K assignments of a token back together
            routed = jnp.sum(routed.reshape(b * t, self.cfg.num_experts_per_tok, d).astype(jnp.float32),
                             axis=1).astype(routed.dtype)
        if shared is not None:
            shared = shared.reshape(b, t, d)
        return shared, routed.reshape(b, t, d), {**routing.aux, **routed_aux}
