"""Expert-parallel dispatch/combine and tensor-parallel psums: the only collectives.

Both plug into the model through the `parallel=` argument (`routed_fn`, `reduce`); the layer
recurrence (`farskip_jax.model.farskip.residual_step`) decides what waits for what.

Expert parallelism (training): `shard_map`s wrap only the routed experts. Each shard sorts its
own (token, choice) assignments by expert (model/dispatch.py), which also groups them by
destination rank, sends the per-(destination, local expert) counts (a tiny all-to-all), then the
rows (Dispatch), runs its local experts as one grouped matmul over rows regrouped by local
expert, sends the results back (Combine) and sums them with the router weights. The shared
experts run between the two shard_maps and the Combine waits for them, so they hide the Dispatch.
Under FarSkip the Combine's result feeds only `x' = y' + R`, which the next layer's attention
does not read: XLA may run the Combine under that attention. Shape legend as in
model/dispatch.py, plus G expert-parallel ranks, L = E / G local experts, R receive rows (ragged
exchange), B rows per source (padded exchange).

The row exchange is `jax.lax.ragged_all_to_all` (only the routed rows move) into a receive buffer
of R rows where the sources' rows lie packed in source order, or, where that does not exist
(XLA:CPU), a plain all_to_all of per-destination buffers of B rows, source s's at [s*B, s*B + its
count). Everything after the exchange reads the receive layout through one regrouping
(`_regroup`), so the rest is shared. The ragged Combine sends each row back to the place its source
sorted it to, so a source receives its own N*K rows, not a receive buffer; Dispatch and Combine are
each other's transpose, and the backward pass runs them as such (`_ragged_move`).

Optimistic dropless: R and B come from `dispatch.moe_buffer` (`model.moe_buffer_factor` x what
balanced routing delivers, not the worst case of every peer sending all of its rows to one rank:
8x that at EP=8). The counts exchange is one all_gather of every rank's per-(destination, local
expert) counts, so every rank of the group knows every rank's load, where its rows land in each
packed receive buffer, and whether any buffer would overflow. On an overflow nothing is exchanged
(the counts are taken as 0, so no rank writes past a buffer) and the shard reports it
(`moe_overflow`); the caller discards that result and runs the worst-case program
(`moe_buffer_factor` 0), so every result it keeps is exactly the dropless one.

Tensor parallelism (inference): the whole forward runs inside one `shard_map` over `tensor`;
attention heads, shared/dense MLP width and experts are split, partial sums meet in psums.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ModelConfig
from farskip_jax.model.dispatch import (
    A2A_COMBINE,
    A2A_COUNTS,
    A2A_DISPATCH,
    MoeBuffer,
    device_family,
    drop_over_capacity,
    fresh_zeros,
    grouped_ffn,
    moe_buffer,
    padded_ffn,
    resolve_matmul,
    routed_experts,
    rows_per_expert,
    sort_by_group,
    take_rows,
    weighted_sum,
)
from farskip_jax.model.moe import RoutedExperts, Routing, SharedFn
from farskip_jax.parallel.mesh import BATCH_AXES, check_tensor_layout, param_specs_tree, replicate_kv_heads


def resolve_exchange(mode: str, mesh: Mesh) -> str:
    """ep_exchange "auto": ragged on GPU meshes (deviceless GPU devices say "gpu" too), padded elsewhere."""
    if mode == "auto":
        return "padded" if device_family(mesh.devices.flat[0]) == "cpu" else "ragged"
    if mode not in ("ragged", "padded"):
        raise ValueError(f"ep_exchange={mode!r}: expected 'auto', 'ragged' or 'padded'")
    return mode


def buffer_config(cfg: ModelConfig, bounded: bool) -> ModelConfig:
    """`cfg` as a parallel strategy sizes its routed-expert buffers: its own `moe_buffer_factor`
    (bounded), or the worst case (the program an overflowed call is re-run with)."""
    return cfg if bounded or cfg.moe_buffer_factor == 0 else dataclasses.replace(cfg, moe_buffer_factor=0.0)


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts split over the mesh's `expert` axis, tokens over (data, expert).

    `bounded`: receive buffers sized by `model.moe_buffer_factor` (may overflow, then the result says
    so); False: the worst case (`worst_case()`), which never overflows."""

    mesh: Mesh
    reduce: None = None
    bounded: bool = True

    def worst_case(self) -> ExpertParallel:
        return dataclasses.replace(self, bounded=False)

    @property
    def batch_shards(self) -> int:
        """Devices the batch axis is split over (the model's `batch_split` chunks each device's part)."""
        return self.mesh.shape["data"] * self.mesh.shape["expert"]

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                  cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
        routed, aux, _ = self.routed_with_shared(x_nd, routing, experts, cfg, None)
        return routed, aux

    def routed_with_shared(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                           shared_fn: SharedFn | None
                           ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
        """(routed [N, D], {dropped_fraction, moe_overflow}, shared_fn(x_nd) or None); the Combine
        waits for the shared experts, so XLA can run them only before it, under the Dispatch.

        Left alone, XLA's scheduler puts every independent op under the Combine: on the 4-layer
        DSV2-Lite H200 step the forward Dispatch had 60 us of compute under a 200 us transfer and
        the Combine 738 us. The wait is a data dependency (`_EPShard.combine`): an optimization
        barrier would not do, XLA:GPU removes barriers before it schedules. Under FarSkip the
        attention, which reads neither, is left to hide the Combine.

        `moe_overflow` is [shards] int32 (1 where the shard's expert group overflowed its bounded
        buffers); the model sums it over layers, and a nonzero sum means the result is void.
        """
        groups = self.mesh.shape["expert"]
        if cfg.n_routed_experts % groups:
            raise ValueError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                             f"mesh.expert={groups}")
        ep = _EPShard(buffer_config(cfg, self.bounded), groups, routing.seq_len,
                      resolve_exchange(cfg.ep_exchange, self.mesh),
                      resolve_matmul(cfg.expert_matmul, self.mesh.devices.flat[0], cfg.dtype))
        tokens, expert_spec = P(BATCH_AXES), P("expert", None, None)
        smap = functools.partial(jax.shard_map, mesh=self.mesh)
        w_gld = (experts.w_gate[...], experts.w_up[...], experts.w_down[...])
        back_rd, srt, dropped, overflow = smap(
            ep.dispatch_experts, in_specs=(tokens, tokens, tokens, expert_spec, expert_spec, expert_spec),
            out_specs=(tokens, tokens, P(), tokens))(x_nd, routing.weights_nk, routing.experts_nk, *w_gld)
        shared = None if shared_fn is None else shared_fn(x_nd)
        routed = smap(ep.combine, in_specs=(tokens, tokens, tokens, tokens), out_specs=tokens)(
            back_rd, srt, routing.weights_nk, x_nd if shared is None else shared)
        return routed, {"dropped_fraction": dropped, "moe_overflow": overflow}, shared


class _Regroup(NamedTuple):
    """Receive layout (source-major) <-> expert-sorted rows, from the exchanged counts only.

    Rows nobody sent point past the end, each to its own index (unique: `place_rows` drops them).
    """

    dst_r: jax.Array  # [R] receive row -> expert-sorted row (R + r: nothing received there)
    src_r: jax.Array  # [R] expert-sorted row -> receive row (R + q: past the received rows)
    starts_l: jax.Array  # [L + 1] local expert boundaries in expert-sorted rows
    expert_r: jax.Array  # [R] local expert of each receive row (L: nothing received)


def _regroup(recv_counts_gl: jax.Array, block_start_g: jax.Array, rows: int) -> _Regroup:
    """Maps the receive layout to local-expert-major rows. Source s's rows lie in
    [block_start_g[s], block_start_g[s] + its count), local experts ascending (senders sort by
    global expert id); the blocks are in source order and do not overlap (packed for the ragged
    exchange, fixed slots of B rows for the padded one)."""
    groups, local = recv_counts_gl.shape
    within_gl = jnp.cumsum(recv_counts_gl, axis=1) - recv_counts_gl  # expert l's offset in source s's block
    start_f = (block_start_g[:, None] + within_gl).reshape(-1)  # (source, expert) groups, in row order
    count_f = recv_counts_gl.reshape(-1)
    starts_l = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(recv_counts_gl.sum(0))]).astype(jnp.int32)
    earlier_gl = jnp.cumsum(recv_counts_gl, axis=0) - recv_counts_gl  # expert l's rows from sources < s
    row_r = jnp.arange(rows, dtype=jnp.int32)
    # The group of each row is the last one starting at or before it (zero-count groups that share a
    # start with the next come before it); whether the row is inside that group decides if it was sent.
    f_r = jnp.clip(jnp.searchsorted(start_f, row_r, side="right", method="scan_unrolled") - 1,
                   0, groups * local - 1).astype(jnp.int32)
    within_r = row_r - start_f[f_r]
    sent_r = (within_r >= 0) & (within_r < count_f[f_r])
    source_r, expert_r = f_r // local, f_r % local
    dst_r = starts_l[expert_r] + earlier_gl[source_r, expert_r] + within_r
    beyond = rows + row_r
    dst_r = jnp.where(sent_r, dst_r, beyond)
    src_r = beyond.at[dst_r].set(row_r, mode="drop", unique_indices=True)
    return _Regroup(dst_r, src_r, starts_l, jnp.where(sent_r, expert_r, local).astype(jnp.int32))


def _expert_ffn_impl(matmul: str, rows_per_group: int, recv_rd: jax.Array, rg: _Regroup, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    if matmul == "padded":  # received rows straight into the [L, C, D] buffer, no sorted copy
        local = w_gate.shape[0]
        expert = jnp.minimum(rg.expert_r, local - 1)
        slot_r = jnp.where(rg.expert_r < local, expert * rows_per_group + rg.dst_r - rg.starts_l[expert],
                           local * rows_per_group + jnp.arange(recv_rd.shape[0], dtype=jnp.int32))
        return padded_ffn(recv_rd, slot_r, w_gate, w_up, w_down, rows_per_group)
    y_rd = grouped_ffn(take_rows(recv_rd, rg.src_r), rg.starts_l, w_gate, w_up, w_down,
                       matmul, rows_per_group)  # type: ignore[arg-type]
    return take_rows(y_rd, rg.dst_r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _expert_ffn(matmul: str, rows_per_group: int, recv_rd: jax.Array, rg: _Regroup, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """This rank's experts over the received rows (regrouped by expert and back): [G*B, D].

    Why a custom VJP: the weight gradients depend on nothing later in the backward pass, and XLA's
    scheduler moved them to the end of the step (under the gradient reduce-scatters), which kept
    every MoE layer's worst-case [L, G*N, D] grouped-GEMM buffers alive at once (DSV2-Lite FCSD,
    4 x 4096 tokens per H200: 8 of them, 4 GiB each, at the peak). Here the input gradient is
    multiplied by a 1 computed from the weight gradients, so they are done before the backward
    pass leaves the layer. The 1 is exact for finite gradients; a non-finite weight gradient
    makes the input gradient non-finite too, and the step is skipped either way.
    """
    return _expert_ffn_impl(matmul, rows_per_group, recv_rd, rg, w_gate, w_up, w_down)


def _expert_ffn_fwd(matmul: str, rows_per_group: int, recv_rd: jax.Array, rg: _Regroup, w_gate: jax.Array,
                    w_up: jax.Array, w_down: jax.Array) -> tuple[jax.Array, Any]:
    return jax.vjp(lambda x, wg, wu, wd: _expert_ffn_impl(matmul, rows_per_group, x, rg, wg, wu, wd),
                   recv_rd, w_gate, w_up, w_down)


def _expert_ffn_bwd(matmul: str, rows_per_group: int, vjp: Any, ct: jax.Array) -> tuple[Any, ...]:
    del matmul, rows_per_group
    d_x, *d_w = vjp(ct)
    # sum over whole gradients: a slice could be folded into the matmul and depend on less of it
    one = jnp.sign(sum(jnp.sum(jnp.abs(g.astype(jnp.float32))) for g in d_w) + 1.0)
    return (d_x * one.astype(d_x.dtype), None, *d_w)


_expert_ffn.defvjp(_expert_ffn_fwd, _expert_ffn_bwd)


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


@jax.custom_vjp
def _ragged_move(x: jax.Array, out: jax.Array, plan: _Plan) -> jax.Array:
    """`plan`'s exchange of the rows of x into the buffer `out` (ragged_all_to_all).

    Rows of `out` that nothing lands in keep their value and get no gradient: callers pass zeros,
    or (the Combine) a buffer whose unwritten rows never reach the result.

    Why a custom VJP: JAX's transpose of ragged_all_to_all learns the peers' offsets with two
    extra all_to_alls per exchange (a sync point each in the backward, in XLA's one collective
    slot) and masks the output cotangent with a cumsum; `plan` already holds both sides' offsets
    (the counts exchange carried them), so the transpose is the transposed plan's exchange.
    """
    return jax.lax.ragged_all_to_all(x, out, plan.in_off, plan.send, plan.out_off, plan.recv,
                                     axis_name="expert")


def _ragged_move_fwd(x: jax.Array, out: jax.Array, plan: _Plan) -> tuple[jax.Array, tuple[_Plan, jax.Array]]:
    # The zero-size slice carries x's row count (a residual must be an array) at no cost.
    return _ragged_move(x, out, plan), (plan, x[:, :0])


def _ragged_move_bwd(res: tuple[_Plan, jax.Array], ct: jax.Array) -> tuple[jax.Array, None, None]:
    plan, x_rows = res
    # Rows of x that were not sent get a zero cotangent: nothing lands there in the transpose.
    return _ragged_move(ct, fresh_zeros(x_rows.shape[0], ct, plan.send), plan.transposed()), None, None


_ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


class _Sorted(NamedTuple):
    """One shard's sorted assignments and the counts exchange, handed between the EP shard_maps.

    Per-shard arrays that are not per token carry a leading axis of 1 (the shard_maps concatenate
    shards along axis 0).
    """

    ids_a: jax.Array  # [A] expert ids after capacity drops (E = dropped)
    order_a: jax.Array  # [A] sorted row -> assignment
    inv_a: jax.Array  # [A] assignment -> sorted row
    starts_e: jax.Array  # [1, E + 1] first sorted row of each global expert
    meta: jax.Array  # [1, G, G, L + 1] every source s's counts for every rank g's local experts and
    # where its rows for g start in s's sorted rows; all 0 on an overflow (nothing moves)
    overflow: jax.Array  # [1] int32: this group's buffers would overflow


@dataclass(frozen=True)
class _EPShard:
    """The per-shard halves of the expert-parallel routed experts (bodies of the shard_maps)."""

    cfg: ModelConfig
    groups: int  # G
    seq_len: int
    exchange: str
    matmul: str

    @property
    def local(self) -> int:  # L
        return self.cfg.n_routed_experts // self.groups

    def buffer(self, n: int) -> MoeBuffer:
        """The receive buffer (`dispatch.moe_buffer`): R rows from all G sources (ragged exchange) or B
        rows per source (padded)."""
        sources = self.groups if self.exchange == "ragged" else 1
        return moe_buffer(self.cfg, n, self.groups, self.seq_len, sources)

    def receive_rows(self, n: int) -> int:
        """Rows of the receive buffer: R, or G * B."""
        rows = self.buffer(n).rows
        return rows if self.exchange == "ragged" else self.groups * rows

    def _sort(self, n: int, weights_nk: jax.Array, experts_nk: jax.Array) -> tuple[_Sorted, jax.Array]:
        """Capacity drops, sort by global expert (= by destination rank, then local expert), counts."""
        e, local, groups = self.cfg.n_routed_experts, self.local, self.groups
        ids_nk, dropped = drop_over_capacity(experts_nk, weights_nk, self.seq_len, self.cfg)
        ids_a = ids_nk.reshape(-1)
        srt = sort_by_group(ids_a, e)
        with jax.named_scope("dispatch"):
            # One tiny all_gather carries every rank's counts per (destination, local expert) and
            # where its rows for each destination start in its sorted rows: from it every rank knows
            # where its rows land in every packed receive buffer, every buffer's load (so all agree
            # on an overflow without another collective), and where the Combine sends each row back.
            # Tagged for remat (model/transformer.py): the backward pass reuses it.
            counts_gl = jnp.diff(srt.starts_g).reshape(groups, local)
            meta_gm = jnp.concatenate([counts_gl, srt.starts_g[:-1:local, None]], axis=1)
            meta = checkpoint_name(jax.lax.all_gather(meta_gm, "expert"), A2A_COUNTS)  # [G src, G dst, L+1]
            limit = self.buffer(n).rows
            counts = meta[..., :local]
            # ragged: every rank's total from all sources; padded: every (source, rank) pair
            load = counts.sum(axis=(0, 2)) if self.exchange == "ragged" else counts.sum(axis=2)
            overflow = jnp.any(load > limit)
            meta = jnp.where(overflow, 0, meta)
        if self.cfg.capacity_factor > 0:  # equal tokens per shard: the mean of means is the global mean
            dropped = jax.lax.pmean(dropped, BATCH_AXES)
        return _Sorted(ids_a, srt.order_a, srt.inv_a, srt.starts_g[None], meta[None],
                       overflow.astype(jnp.int32)[None]), dropped

    def _blocks(self, meta: jax.Array, n: int) -> jax.Array:
        """[G, G]: where source s's block starts in rank g's receive buffer."""
        if self.exchange == "ragged":
            totals_sg = meta[..., :self.local].sum(axis=2)
            return jnp.cumsum(totals_sg, axis=0) - totals_sg  # packed in source order
        b = self.buffer(n).rows
        return jnp.broadcast_to(jnp.arange(self.groups, dtype=jnp.int32)[:, None] * b, (self.groups,) * 2)

    def _plan(self, srt: _Sorted, n: int) -> _Plan:
        """The Dispatch's ragged exchange (the Combine's is its transpose)."""
        meta, local = srt.meta[0], self.local
        me = jax.lax.axis_index("expert")
        blocks = self._blocks(meta, n)
        totals_sg = meta[..., :local].sum(axis=2)
        return _Plan(in_off=srt.starts_e[0, :-1:local], send=totals_sg[me],
                     out_off=blocks[me],  # where my rows land in each rank's buffer
                     recv=totals_sg[:, me],
                     back_in=blocks[:, me],  # where each source's rows lie in my buffer
                     back_out=meta[:, me, local])

    def dispatch_experts(self, x_nd: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
                         ) -> tuple[jax.Array, _Sorted, jax.Array, jax.Array]:
        """Sort, counts, Dispatch, then this rank's experts over the received rows.

        Returns ([R or G*B, D] expert outputs in receive layout, the sorted assignments, dropped
        fraction, [1] overflow flag).
        """
        n, k = experts_nk.shape
        groups, local, rows = self.groups, self.local, self.receive_rows(n)
        srt, dropped = self._sort(n, weights_nk, experts_nk)
        meta = srt.meta[0]
        with jax.named_scope("dispatch"):
            if self.exchange == "ragged":
                recv_rd = _ragged_move(x_nd[srt.order_a // k], fresh_zeros(rows, x_nd, srt.ids_a),
                                       self._plan(srt, n))
            else:  # per-destination buffers: slot q of rank g holds sorted row send_start[g] + q
                b = self.buffer(n).rows
                me = jax.lax.axis_index("expert")
                starts_e = srt.starts_e[0]
                slot_gq = starts_e[:-1:local, None] + jnp.arange(b, dtype=jnp.int32)
                token_gq = srt.order_a[jnp.minimum(slot_gq, n * k - 1)] // k
                sent_g = meta[me, :, :local].sum(axis=1)  # 0 everywhere on an overflow
                filled_gq = jnp.arange(b, dtype=jnp.int32)[None, :] < sent_g[:, None]
                rows_gqd = jnp.where(filled_gq[..., None], x_nd[token_gq], 0)
                recv_rd = jax.lax.all_to_all(rows_gqd, "expert", 0, 0).reshape(rows, -1)
            recv_rd = checkpoint_name(recv_rd, A2A_DISPATCH)
        with jax.named_scope("experts"):
            me = jax.lax.axis_index("expert")
            rg = _regroup(meta[:, me, :local], self._blocks(meta, n)[:, me], rows)
            per_expert = min(groups * rows_per_expert(n, self.seq_len, self.cfg), rows)
            back_rd = _expert_ffn(self.matmul, per_expert, recv_rd, rg, w_gate, w_up, w_down)
            return back_rd, srt, dropped, srt.overflow

    def combine(self, back_rd: jax.Array, srt: _Sorted, weights_nk: jax.Array,
                after_nd: jax.Array) -> jax.Array:
        """Combine the experts' rows back to their sources, then the router-weighted sum: [N, D].

        The ragged Combine starts only once `after_nd` (the shared experts' output) exists: its
        output buffer holds after_nd's first row in its first row. That row is overwritten by the
        first sorted assignment, or, with every assignment dropped, stays there unread (dropped
        rows are selected away in `weighted_sum`), so the result does not depend on it.
        """
        n, k = weights_nk.shape
        groups, local, e = self.groups, self.local, self.cfg.n_routed_experts
        # On an overflow nothing came back: every assignment is selected away (the result is void).
        valid_a = (srt.ids_a < e) & (srt.overflow[0] == 0)
        with jax.named_scope("combine"):
            if self.exchange == "ragged":
                # Rows come back in this rank's sorted order: [N*K, D]; dropped ones stay unwritten.
                out = fresh_zeros(n * k, back_rd, srt.inv_a).at[:1].set(after_nd[:1].astype(back_rd.dtype))
                out_rd = _ragged_move(back_rd, out, self._plan(srt, n).transposed())
                out_rd = checkpoint_name(out_rd, A2A_COMBINE)
                back_a = srt.inv_a
            else:  # the whole [G*B, D] buffer travels; assignment a (sorted row inv[a], to rank g)
                # comes back at g*B + inv[a] - send_start[g]
                b = self.buffer(n).rows
                out_rd = jax.lax.all_to_all(back_rd.reshape(groups, b, -1), "expert", 0, 0)
                out_rd = checkpoint_name(out_rd.reshape(groups * b, -1), A2A_COMBINE)
                rank_a = jnp.minimum(srt.ids_a // local, groups - 1)
                send_start_g = srt.starts_e[0, :-1:local]
                back_a = jnp.where(valid_a, rank_a * b + srt.inv_a - send_start_g[rank_a], 0)
        return weighted_sum(out_rd[back_a].reshape(n, k, -1), valid_a.reshape(n, k), weights_nk)


@dataclass(frozen=True)
class TensorParallel:
    """Inside a shard_map over `tensor`: local heads/experts, psum of partial outputs."""

    axis: str = "tensor"
    device: Any = None  # one of the mesh's devices: picks expert_matmul "auto" (None: jax.devices()[0])
    mode: str = "psum"  # ModelConfig.tp_reduce: psum, or reduce_scatter (+ all-gather)
    bounded: bool = True  # each rank's rows bounded by `moe_buffer` (as ExpertParallel.bounded)

    def worst_case(self) -> TensorParallel:
        return dataclasses.replace(self, bounded=False)

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
                  cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
        """This rank's experts only; the caller's reduce sums the ranks' partial outputs.

        Tokens and routing are replicated over the axis, so every rank drops the same assignments,
        the dropped fraction needs no collective, and every rank can count every rank's rows: the
        overflow flag (any rank's share over its `moe_buffer` bound) is the same on all of them."""
        local = experts.w_gate.shape[0]
        ranks = cfg.n_routed_experts // local
        rank = jax.lax.axis_index(self.axis)
        ids_nk, dropped = drop_over_capacity(routing.experts_nk, routing.weights_nk, routing.seq_len, cfg)
        buffer = moe_buffer(buffer_config(cfg, self.bounded), x_nd.shape[0], ranks, routing.seq_len)
        per_rank = jnp.zeros(ranks + 1, jnp.int32).at[jnp.minimum(ids_nk // local, ranks)].add(1)[:ranks]
        overflow = jnp.any(per_rank > buffer.rows).astype(jnp.int32)
        ids_nk = ids_nk - rank * local
        ids_nk = jnp.where((ids_nk >= 0) & (ids_nk < local), ids_nk, local)  # another rank's: skipped
        with jax.named_scope("experts"):
            routed = routed_experts(x_nd, ids_nk, routing.weights_nk, experts.w_gate[...], experts.w_up[...],
                                    experts.w_down[...],
                                    resolve_matmul(cfg.expert_matmul, self.device or jax.devices()[0],
                                                   cfg.dtype),
                                    rows_per_expert(x_nd.shape[0], routing.seq_len, cfg),
                                    rows=buffer.rows if buffer.bounded else None)
        return routed, {"dropped_fraction": dropped, "moe_overflow": overflow}


# --------------------------------------------------------------------------------------------
# Sharded forward functions over a model's (graphdef, state)


def ep_forward(graphdef: nnx.GraphDef, mesh: Mesh, bounded: bool = True) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> ModelOutput` with expert parallelism
    (`bounded` as in ExpertParallel; the output's aux["moe_overflow"] says whether it is void)."""
    par = ExpertParallel(mesh, bounded=bounded)

    def f(state, input_ids, positions=None, segment_ids=None):
        return nnx.merge(graphdef, state)(input_ids, positions, segment_ids, parallel=par)

    return f


def tp_forward(graphdef: nnx.GraphDef, state_like: Any, mesh: Mesh,
               bounded: bool = True) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> (logits, hidden, overflow)`: the inference TP
    layout (with the model's `tp_reduce`; `tp_microbatches` is read by the model itself); overflow
    as in `ModelOutput.aux["moe_overflow"]` (`bounded` as in TensorParallel)."""
    check_tensor_layout(nnx.merge(graphdef, state_like).cfg, mesh.shape["tensor"])
    specs = param_specs_tree(state_like, "tp")

    def body(state, input_ids, positions, segment_ids):
        model = nnx.merge(graphdef, state)
        par = TensorParallel(device=mesh.devices.flat[0], mode=model.cfg.tp_reduce, bounded=bounded)
        out = model(input_ids, positions, segment_ids, parallel=par)
        return out.logits, out.hidden, out.aux["moe_overflow"]

    def f(state, input_ids, positions=None, segment_ids=None):
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), P(), P()),
                             check_vma=False)(state, input_ids, positions, segment_ids)

    return f


def tp_cached_forward(graphdef: nnx.GraphDef, state_like: Any, mesh: Mesh, prefill: bool,
                      bounded: bool = True) -> Callable[..., Any]:
    """`f(state, input_ids, positions, caches) -> (hidden, caches, overflow)`: `Transformer.cached_forward` in
    the inference TP layout. Heads and experts are split; MLA's latent caches are replicated (one
    latent per token for all heads: every rank writes the same values into them), GQA's key/value
    caches are split with their heads."""
    cfg = nnx.merge(graphdef, state_like).cfg
    check_tensor_layout(cfg, mesh.shape["tensor"])
    specs = param_specs_tree(state_like, "tp")
    caches = P(None, None, "tensor") if cfg.attention_kind == "gqa" else P()

    def body(state, input_ids, positions, caches):
        model = nnx.merge(graphdef, state)
        par = TensorParallel(device=mesh.devices.flat[0], mode=model.cfg.tp_reduce, bounded=bounded)
        return model.cached_forward(input_ids, positions, caches, prefill=prefill, parallel=par)

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), caches), out_specs=(P(), caches, P()),
                         check_vma=False)


def place(state: Any, mesh: Mesh, layout: str) -> Any:
    """Puts every parameter of `state` on `mesh` with its layout's sharding (TP: GQA key/value heads
    copied first where the ranks outnumber them, `replicate_kv_heads`)."""
    if layout == "tp":
        state = replicate_kv_heads(state, mesh.shape["tensor"])
    specs = param_specs_tree(state, layout)
    return jax.tree.map(lambda x, s: put(x, NamedSharding(mesh, s)), state, specs,
                        is_leaf=lambda x: isinstance(x, P))


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` in `sharding`. A value this process holds whole (numpy, or an array on its own devices)
    going onto a mesh that spans processes is sliced here into this process's shards: a multi-process
    run loads every parameter on every process, and backends move no data between hosts in device_put."""
    if sharding.is_fully_addressable or not getattr(x, "is_fully_addressable", True):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
