"""Expert-parallel dispatch/combine and tensor-parallel psums: the only collectives.

Both plug into the model through the `parallel=` argument (`routed_fn`, `reduce`); the layer
recurrence (`farskip_jax.model.farskip.residual_step`) decides what waits for what.

Expert parallelism (training): `shard_map` wraps only the routed experts. Each shard sorts its
own (token, choice) assignments by expert (model/dispatch.py), which also groups them by
destination rank, sends the per-(destination, local expert) counts (a tiny all-to-all), then the
rows (Dispatch), runs its local experts as one grouped matmul over rows regrouped by local
expert, sends the results back (Combine) and sums them with the router weights. Under FarSkip
the Combine's result feeds only `x' = y' + R`, which the next layer's attention does not read:
XLA may run the Combine under that attention. Shape legend as in model/dispatch.py, plus
G expert-parallel ranks, L = E / G local experts, B receive rows reserved per source rank.

The row exchange is `jax.lax.ragged_all_to_all` (only the routed rows move) or, where that does
not exist (XLA:CPU), a plain all_to_all of per-destination buffers of B rows. Both write source
s's rows at [s*B, s*B + its count) of the receive buffer, so everything after the exchange is
shared. All of it is dropless: B is the worst case (see `_ep_routed`).

Tensor parallelism (inference): the whole forward runs inside one `shard_map` over `tensor`;
attention heads, shared/dense MLP width and experts are split, partial sums meet in psums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ModelConfig
from farskip_jax.model.dispatch import (
    A2A_COMBINE,
    A2A_COUNTS,
    A2A_DISPATCH,
    device_family,
    drop_over_capacity,
    grouped_ffn,
    resolve_matmul,
    routed_experts,
    rows_per_expert,
    sort_by_group,
    weighted_sum,
)
from farskip_jax.model.moe import RoutedExperts, Routing
from farskip_jax.parallel.mesh import BATCH_AXES, param_specs_tree


def resolve_exchange(mode: str, mesh: Mesh) -> str:
    """ep_exchange "auto": ragged on GPU meshes (deviceless GPU devices say "gpu" too), padded elsewhere."""
    if mode == "auto":
        return "padded" if device_family(mesh.devices.flat[0]) == "cpu" else "ragged"
    if mode not in ("ragged", "padded"):
        raise ValueError(f"ep_exchange={mode!r}: expected 'auto', 'ragged' or 'padded'")
    return mode


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
        exchange = resolve_exchange(cfg.ep_exchange, self.mesh)
        matmul = resolve_matmul(cfg.expert_matmul, self.mesh.devices.flat[0])

        def shard(x, weights, ids, w_gate, w_up, w_down):
            return _ep_routed(x, weights, ids, (w_gate, w_up, w_down), cfg, groups, routing.seq_len, exchange,
                              matmul)

        fn = jax.shard_map(shard, mesh=self.mesh, in_specs=(tokens, tokens, tokens, expert_spec, expert_spec,
                                                            expert_spec), out_specs=(tokens, P()))
        return fn(x_nd, routing.weights_nk, routing.experts_nk, experts.w_gate[...], experts.w_up[...],
                  experts.w_down[...])


class _Regroup(NamedTuple):
    dst_r: jax.Array  # [G*B] receive row -> expert-sorted row (clipped for rows nobody sent)
    src_r: jax.Array  # [G*B] expert-sorted row -> receive row
    starts_l: jax.Array  # [L + 1] local expert boundaries in expert-sorted rows


def _regroup(recv_counts_gl: jax.Array, per_src: int) -> _Regroup:
    """Maps the receive layout (source-major, local experts ascending inside each source, since
    senders sort by global expert id) to local-expert-major rows, from the exchanged counts only."""
    groups, local = recv_counts_gl.shape
    rows = groups * per_src
    end_gl = jnp.cumsum(recv_counts_gl, axis=1)  # inside source s: expert l's rows end here
    start_gl = end_gl - recv_counts_gl
    starts_l = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(recv_counts_gl.sum(0))]).astype(jnp.int32)
    earlier_gl = jnp.cumsum(recv_counts_gl, axis=0) - recv_counts_gl  # expert l's rows from sources < s
    slot_q = jnp.arange(per_src, dtype=jnp.int32)
    expert_gq = jax.vmap(lambda ends: jnp.searchsorted(ends, slot_q, side="right",
                                                       method="scan_unrolled"))(end_gl)
    sent_gq = expert_gq < local
    expert_gq = jnp.minimum(expert_gq, local - 1)
    shift_gl = starts_l[:-1][None, :] + earlier_gl - start_gl
    dst_gq = jnp.take_along_axis(shift_gl, expert_gq, axis=1) + slot_q
    dst_r = jnp.where(sent_gq, dst_gq, rows).reshape(rows)
    src_r = jnp.zeros(rows, jnp.int32).at[dst_r].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
    return _Regroup(jnp.minimum(dst_r, rows - 1), src_r, starts_l)


def _exchange(rows: jax.Array, per_src: int, input_offsets_g: jax.Array, send_sizes_g: jax.Array,
              recv_sizes_g: jax.Array, exchange: str) -> jax.Array:
    """Sends rows[input_offsets[g] : + send_sizes[g]] to rank g, which stores them at
    [me*B, me*B + size) of its [G*B, D] receive buffer. Padded: `rows` is already [G*B, D] with
    input_offsets[g] = g*B, and the whole buffer travels."""
    groups = send_sizes_g.shape[0]
    if exchange == "ragged":
        me = jax.lax.axis_index("expert")
        # The result takes the `output` buffer's type. A plain zeros is mesh-invariant: the result
        # would be too, and the backward pass would psum the receive buffer's cotangent over the
        # mesh (a 768 MiB all-reduce per exchange at DSV2-Lite EP=8). Tokens vary over BATCH_AXES.
        out = jax.lax.pcast(jnp.zeros((groups * per_src, rows.shape[-1]), rows.dtype), BATCH_AXES,
                            to="varying")
        output_offsets_g = jnp.full((groups,), me * per_src, jnp.int32)
        return jax.lax.ragged_all_to_all(rows, out, input_offsets_g, send_sizes_g, output_offsets_g,
                                         recv_sizes_g, axis_name="expert")
    return jax.lax.all_to_all(rows.reshape(groups, per_src, -1), "expert", 0, 0).reshape(groups * per_src, -1)


def _ep_routed(x_nd, weights_nk, experts_nk, w_gld: tuple[jax.Array, ...], cfg: ModelConfig, groups: int,
               seq_len: int, exchange: str, matmul: str):
    """Per shard: sort -> counts -> Dispatch -> regroup, grouped matmul -> Combine -> weighted sum."""
    n, k = experts_nk.shape
    e = cfg.n_routed_experts
    local = e // groups
    ids_nk, dropped = drop_over_capacity(experts_nk, weights_nk, seq_len, cfg)
    per_expert = rows_per_expert(n, seq_len, cfg)  # rows this shard can send one expert
    # B, receive rows reserved per source: a token's K experts are distinct, so at most min(K, L)
    # of its rows go to one rank; with a capacity each local expert takes at most `per_expert`.
    # Receive buffer G*B rows = G * N_shard * min(K, L) dropless (8x N*K for DSV2-Lite at EP=8).
    per_src = min(n * min(k, local), local * per_expert)
    ids_a = ids_nk.reshape(-1)
    srt = sort_by_group(ids_a, e)  # global ids: sorted by destination rank, then local expert
    counts_gl = jnp.diff(srt.starts_g).reshape(groups, local)
    send_sizes_g = counts_gl.sum(axis=1)
    send_start_g = srt.starts_g[:-1:local]
    with jax.named_scope("dispatch"):
        # Tagged for remat="save_a2a" (model/transformer.py): the backward pass reuses what the
        # all-to-alls received instead of running them again.
        recv_counts_gl = checkpoint_name(jax.lax.all_to_all(counts_gl, "expert", 0, 0), A2A_COUNTS)
        recv_sizes_g = recv_counts_gl.sum(axis=1)
        if exchange == "ragged":
            rows = x_nd[srt.order_a // k]
            offsets_g = send_start_g
        else:  # per-destination buffers: slot q of rank g holds sorted row send_start[g] + q
            slot_gq = send_start_g[:, None] + jnp.arange(per_src, dtype=jnp.int32)
            token_gq = srt.order_a[jnp.minimum(slot_gq, n * k - 1)] // k
            filled_gq = slot_gq < (send_start_g + send_sizes_g)[:, None]
            rows = jnp.where(filled_gq[..., None], x_nd[token_gq], 0).reshape(groups * per_src, -1)
            offsets_g = jnp.arange(groups, dtype=jnp.int32) * per_src
        recv_rd = _exchange(rows, per_src, offsets_g, send_sizes_g, recv_sizes_g, exchange)
        recv_rd = checkpoint_name(recv_rd, A2A_DISPATCH)
    with jax.named_scope("experts"):
        rg = _regroup(recv_counts_gl, per_src)
        y_rd = grouped_ffn(recv_rd[rg.src_r], rg.starts_l, *w_gld, matmul, groups * per_expert)
        back_rd = y_rd[rg.dst_r]
    with jax.named_scope("combine"):
        back_offsets_g = jnp.arange(groups, dtype=jnp.int32) * per_src
        out_rd = _exchange(back_rd, per_src, back_offsets_g, recv_sizes_g, send_sizes_g, exchange)
        out_rd = checkpoint_name(out_rd, A2A_COMBINE)
    # Assignment a (sorted row inv[a], to rank g) comes back at g*B + inv[a] - send_start[g].
    valid_a = ids_a < e
    rank_a = jnp.minimum(ids_a // local, groups - 1)
    back_a = jnp.where(valid_a, rank_a * per_src + srt.inv_a - send_start_g[rank_a], 0)
    routed = weighted_sum(out_rd[back_a].reshape(n, k, -1), valid_a.reshape(n, k), weights_nk)
    if cfg.capacity_factor > 0:  # equal tokens per shard: the mean of means is the global mean
        dropped = jax.lax.pmean(dropped, BATCH_AXES)
    return routed, dropped


@dataclass(frozen=True)
class TensorParallel:
    """Inside a shard_map over `tensor`: local heads/experts, psum of partial outputs."""

    axis: str = "tensor"
    device: Any = None  # one of the mesh's devices: picks expert_matmul "auto" (None: jax.devices()[0])

    def reduce(self, v: jax.Array, name: str) -> jax.Array:
        with jax.named_scope(name):
            return jax.lax.psum(v, self.axis)

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
        """This rank's experts only; the caller's reduce sums the ranks' partial outputs.

        Tokens and routing are replicated over the axis, so every rank drops the same assignments
        and the dropped fraction needs no collective."""
        local = experts.w_gate.shape[0]
        rank = jax.lax.axis_index(self.axis)
        ids_nk, dropped = drop_over_capacity(routing.experts_nk, routing.weights_nk, routing.seq_len, cfg)
        ids_nk = ids_nk - rank * local
        ids_nk = jnp.where((ids_nk >= 0) & (ids_nk < local), ids_nk, local)  # another rank's: skipped
        with jax.named_scope("experts"):
            routed = routed_experts(x_nd, ids_nk, routing.weights_nk, experts.w_gate[...], experts.w_up[...],
                                    experts.w_down[...],
                                    resolve_matmul(cfg.expert_matmul, self.device or jax.devices()[0]),
                                    rows_per_expert(x_nd.shape[0], routing.seq_len, cfg))
        return routed, dropped


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
    par = TensorParallel(device=mesh.devices.flat[0])
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
