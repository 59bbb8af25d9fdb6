"""Tensor parallelism (inference): the whole forward inside one `shard_map` over `tensor`.

Attention heads, shared/dense MLP width and experts are split; the partial sums meet in psums
(`TensorParallel.reduce`), whose order the layer recurrence fixes (`model/farskip.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model.dispatch import (
    buffer_config,
    drop_over_capacity,
    moe_buffer,
    resolve_matmul,
    routed_experts,
    rows_per_expert,
)
from farskip_jax.model.moe import RoutedExperts, Routing
from farskip_jax.model.swiglu_rows import resolve_swiglu


@dataclass(frozen=True)
class TensorParallel:
    """Inside a shard_map over `tensor`: local heads/experts, psum of partial outputs."""

    axis: str = "tensor"
    device: Any = None  # one of the mesh's devices: picks expert_matmul "auto" (None: jax.devices()[0])
    mode: str = "psum"  # ExecutionConfig.tp_reduce: psum, or reduce_scatter (+ all-gather)
    bounded: bool = True  # each rank's rows bounded by `moe_buffer` (as ExpertParallel.bounded)

    def worst_case(self) -> TensorParallel:
        return dataclasses.replace(self, bounded=False)

    def reduce(self, v: jax.Array, name: str) -> jax.Array:
        """The sum of the ranks' partial `v` [B, T, D], replicated; `name` scopes the collectives."""
        with jax.named_scope(name):
            if self.mode == "psum":
                return jax.lax.psum(v, self.axis)
            if self.mode != "reduce_scatter":
                raise ValueError(f"execution.tp_reduce={self.mode!r}: expected 'psum' or 'reduce_scatter'")
            # Half a psum's traffic each. Only the residual add reads the gathered sum, so XLA is
            # free to start the all-gather late, just before whatever next reads the sum.
            ranks = jax.lax.axis_size(self.axis)
            dim = 1 if v.shape[1] % ranks == 0 else v.ndim - 1  # tokens, else the model width
            with jax.named_scope("reduce_scatter"):
                part = jax.lax.psum_scatter(v, self.axis, scatter_dimension=dim, tiled=True)
            with jax.named_scope("all_gather"):
                return jax.lax.all_gather(part, self.axis, axis=dim, tiled=True)

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                  exe: ExecutionConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
        """This rank's experts only; the caller's reduce sums the ranks' partial outputs.

        Tokens and routing are replicated over the axis, so every rank drops the same assignments,
        the dropped fraction needs no collective, and every rank can count every rank's rows: the
        overflow flag (any rank's share over its `moe_buffer` bound) is the same on all of them."""
        local = experts.w_gate.shape[0]
        ranks = cfg.n_routed_experts // local
        rank = jax.lax.axis_index(self.axis)
        ids_nk, dropped = drop_over_capacity(routing.experts_nk, routing.weights_nk, routing.seq_len, cfg,
                                             exe)
        buffer = moe_buffer(cfg, buffer_config(exe, self.bounded), x_nd.shape[0], ranks, routing.seq_len)
        per_rank = jnp.zeros(ranks + 1, jnp.int32).at[jnp.minimum(ids_nk // local, ranks)].add(1)[:ranks]
        overflow = jnp.any(per_rank > buffer.rows).astype(jnp.int32)
        ids_nk = ids_nk - rank * local
        ids_nk = jnp.where((ids_nk >= 0) & (ids_nk < local), ids_nk, local)  # another rank's: skipped
        with jax.named_scope("experts"):
            device = self.device or jax.devices()[0]
            matmul = resolve_matmul(exe.expert_matmul, device, cfg.dtype)
            routed = routed_experts(x_nd, ids_nk, routing.weights_nk, experts.w_gate[...], experts.w_up[...],
                                    experts.w_down[...], matmul,
                                    rows_per_expert(x_nd.shape[0], routing.seq_len, cfg, exe),
                                    rows=buffer.rows if buffer.bounded else None,
                                    swiglu=resolve_swiglu(exe.expert_swiglu, device, matmul))
        return routed, {"dropped_fraction": dropped, "moe_overflow": overflow}
