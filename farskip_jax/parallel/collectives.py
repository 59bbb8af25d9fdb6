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
shared. All of it is dropless: B is the worst case (see `_ep_routed`). The ragged Combine sends
each row back to the place its source sorted it to (the counts exchange carries those offsets),
so a source receives its own N*K rows, not a worst-case buffer; Dispatch and Combine are each
other's transpose, and the backward pass runs them as such (`_ragged_move`).

Tensor parallelism (inference): the whole forward runs inside one `shard_map` over `tensor`;
attention heads, shared/dense MLP width and experts are split, partial sums meet in psums.
"""

from __future__ import annotations

import functools
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


class _Plan(NamedTuple):
    """One ragged exchange over `expert`, and what its transpose needs; every field is [G] int32.

    This rank sends x[in_off[g] : in_off[g] + send[g]] to rank g, where it lands at out_off[g] of
    g's output; it receives recv[s] rows from source s at back_in[s] of its own output, taken
    from back_out[s] of s's operand. The Dispatch and the Combine are each other's transpose.
    """

    in_off: jax.Array
    send: jax.Array
    out_off: jax.Array
    recv: jax.Array
    back_in: jax.Array
    back_out: jax.Array

    def transposed(self) -> _Plan:
        return _Plan(self.back_in, self.recv, self.back_out, self.send, self.in_off, self.out_off)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_move(out_rows: int, x: jax.Array, plan: _Plan) -> jax.Array:
    """`plan`'s exchange of the rows of x into a zero [out_rows, D] buffer (ragged_all_to_all).

    Why a custom VJP: JAX's transpose of ragged_all_to_all learns the peers' offsets with two
    extra all_to_alls per exchange (a sync point each in the backward, in XLA's one collective
    slot) and masks the output cotangent with a cumsum; `plan` already holds both sides' offsets
    (the counts exchange carried them), so the transpose is the transposed plan's exchange.
    """
    # The result takes the `output` buffer's type. A plain zeros is mesh-invariant: the result
    # would be too, and the backward pass would psum the receive buffer's cotangent over the
    # mesh (a 768 MiB all-reduce per exchange at DSV2-Lite EP=8). Tokens vary over BATCH_AXES.
    out = jax.lax.pcast(jnp.zeros((out_rows, x.shape[-1]), x.dtype), BATCH_AXES, to="varying")
    return jax.lax.ragged_all_to_all(x, out, plan.in_off, plan.send, plan.out_off, plan.recv,
                                     axis_name="expert")


def _ragged_move_fwd(out_rows: int, x: jax.Array, plan: _Plan) -> tuple[jax.Array, tuple[_Plan, jax.Array]]:
    # The zero-size slice carries x's row count (a residual must be an array) at no cost.
    return _ragged_move(out_rows, x, plan), (plan, x[:, :0])


def _ragged_move_bwd(out_rows: int, res: tuple[_Plan, jax.Array], ct: jax.Array) -> tuple[jax.Array, None]:
    del out_rows
    plan, x_rows = res
    # Rows of x that were not sent get a zero cotangent: nothing lands there in the transpose.
    return _ragged_move(x_rows.shape[0], ct, plan.transposed()), None


_ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


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
    recv_start_gq = jnp.arange(groups, dtype=jnp.int32) * per_src  # source s's rows start at s*B here
    with jax.named_scope("dispatch"):
        # One tiny all_to_all carries the counts and where each slice starts in its sender's
        # sorted rows: the Combine sends every row back to exactly that place, so a source's
        # Combine output holds only its own N*K rows, not the worst-case receive buffer.
        # Tagged for remat="save_a2a" (model/transformer.py): the backward pass reuses what the
        # all-to-alls received instead of running them again.
        meta_gm = jnp.concatenate([counts_gl, send_start_g[:, None]], axis=1)
        recv_meta_gm = checkpoint_name(jax.lax.all_to_all(meta_gm, "expert", 0, 0), A2A_COUNTS)
        recv_counts_gl, src_start_g = recv_meta_gm[:, :local], recv_meta_gm[:, local]
        recv_sizes_g = recv_counts_gl.sum(axis=1)
        if exchange == "ragged":
            me = jax.lax.axis_index("expert")
            plan = _Plan(in_off=send_start_g, send=send_sizes_g,
                         out_off=jnp.full((groups,), me * per_src, jnp.int32), recv=recv_sizes_g,
                         back_in=recv_start_gq, back_out=src_start_g)
            recv_rd = _ragged_move(groups * per_src, x_nd[srt.order_a // k], plan)
        else:  # per-destination buffers: slot q of rank g holds sorted row send_start[g] + q
            slot_gq = send_start_g[:, None] + jnp.arange(per_src, dtype=jnp.int32)
            token_gq = srt.order_a[jnp.minimum(slot_gq, n * k - 1)] // k
            filled_gq = slot_gq < (send_start_g + send_sizes_g)[:, None]
            rows = jnp.where(filled_gq[..., None], x_nd[token_gq], 0)
            recv_rd = jax.lax.all_to_all(rows, "expert", 0, 0).reshape(groups * per_src, -1)
        recv_rd = checkpoint_name(recv_rd, A2A_DISPATCH)
    with jax.named_scope("experts"):
        rg = _regroup(recv_counts_gl, per_src)
        y_rd = grouped_ffn(recv_rd[rg.src_r], rg.starts_l, *w_gld, matmul, groups * per_expert)
        back_rd = y_rd[rg.dst_r]
    valid_a = ids_a < e
    with jax.named_scope("combine"):
        if exchange == "ragged":
            # Rows come back in this rank's sorted order: [N*K, D]; dropped ones stay zero.
            out_rd = checkpoint_name(_ragged_move(n * k, back_rd, plan.transposed()), A2A_COMBINE)
            back_a = srt.inv_a
        else:  # the whole [G*B, D] buffer travels; assignment a (sorted row inv[a], to rank g)
            # comes back at g*B + inv[a] - send_start[g]
            out_rd = jax.lax.all_to_all(back_rd.reshape(groups, per_src, -1), "expert", 0, 0)
            out_rd = checkpoint_name(out_rd.reshape(groups * per_src, -1), A2A_COMBINE)
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
    mode: str = "psum"  # ModelConfig.tp_reduce: psum, or reduce_scatter (+ all-gather)

    def reduce(self, v: jax.Array, name: str) -> jax.Array:
        """The sum of the ranks' partial `v` [B, T, D], replicated; `name` scopes the collectives."""
        with jax.named_scope(name):
            if self.mode == "psum":
                return jax.lax.psum(v, self.axis)
            if self.mode != "reduce_scatter":
                raise ValueError(f"model.tp_reduce={self.mode!r}: expected 'psum' or 'reduce_scatter'")
            # Half a psum's traffic each. Only the residual add reads the gathered sum, so XLA is
            # free to start the all-gather late, just before whatever next reads the sum.
            ranks = jax.lax.axis_size(self.axis)
            dim = 1 if v.shape[1] % ranks == 0 else v.ndim - 1  # tokens, else the model width
            with jax.named_scope("reduce_scatter"):
                part = jax.lax.psum_scatter(v, self.axis, scatter_dimension=dim, tiled=True)
            with jax.named_scope("all_gather"):
                return jax.lax.all_gather(part, self.axis, axis=dim, tiled=True)

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
    """`f(state, input_ids, positions, segment_ids) -> (logits, hidden)`: the inference TP layout
    (with the model's `tp_reduce`; `tp_microbatches` is read by the model itself)."""
    specs = param_specs_tree(state_like, "tp")

    def body(state, input_ids, positions, segment_ids):
        model = nnx.merge(graphdef, state)
        par = TensorParallel(device=mesh.devices.flat[0], mode=model.cfg.tp_reduce)
        out = model(input_ids, positions, segment_ids, parallel=par)
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
