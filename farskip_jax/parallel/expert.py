"""Expert parallelism (training): the routed experts' Dispatch, grouped GEMM and Combine.

Plugs into the model through the `parallel=` argument (`routed_fn`, `routed_with_shared`); the
layer recurrence (`farskip_jax.model.farskip.residual_step`) decides what waits for what, and the
scheduling hints used here are `farskip_jax.model.schedule`'s (each with its contract and test).

`shard_map`s wrap only the routed experts. Each shard sorts its own (token, choice) assignments by
expert (model/dispatch.py), which also groups them by destination rank, shares the per-(destination,
local expert) counts (a tiny all_gather), then sends the rows (Dispatch), runs its local experts as
one grouped matmul over the rows grouped by local expert, sends the results back (Combine) and sums
them with the router weights. The shared experts run between the two shard_maps and the Combine
waits for them, so they hide the Dispatch. Under FarSkip the Combine's result feeds only
`x' = y' + R`, which the next layer's attention does not read: XLA may run the Combine under that
attention. Shape legend as in model/dispatch.py, plus G expert-parallel ranks, L = E / G local
experts, R receive rows (ragged exchange), B rows per source (padded exchange).

The row exchange is `jax.lax.ragged_all_to_all` (only the routed rows move), one slice per
(destination, local expert), into a receive buffer of R rows laid out by local expert (then
source): the grouped matmul reads it as it is. Where that op does not exist (XLA:CPU) it is a plain
all_to_all of per-destination buffers of B rows, source s's at [s*B, s*B + its count), which one
regrouping (`_regroup`) puts in expert order and back. The ragged Combine sends each row back to
the place its source sorted it to, so a source receives its own N*K rows, not a receive buffer;
Dispatch and Combine are each other's transpose, and the backward pass runs them as such
(`_ragged_move`).

Optimistic dropless: R and B come from `dispatch.moe_buffer` (`execution.moe_buffer_factor` x what
balanced routing delivers, not the worst case of every peer sending all of its rows to one rank:
8x that at EP=8). The counts exchange is one all_gather of every rank's per-(destination, local
expert) counts, so every rank of the group knows every rank's load, where its rows land in each
packed receive buffer, and whether any buffer would overflow. On an overflow nothing is exchanged
(the counts are taken as 0, so no rank writes past a buffer) and the shard reports it
(`moe_overflow`); the caller discards that result and runs the worst-case program
(`execution.moe_buffer_factor` 0), so every result it keeps is exactly the dropless one.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model import schedule
from farskip_jax.model.dispatch import (
    A2A_COMBINE,
    A2A_COUNTS,
    A2A_DISPATCH,
    MoeBuffer,
    buffer_config,
    drop_over_capacity,
    grouped_ffn,
    moe_buffer,
    padded_ffn,
    permute_rows,
    resolve_matmul,
    rows_per_expert,
    sort_by_group,
    weighted_sum,
)
from farskip_jax.model.moe import RoutedExperts, Routing, SharedFn, local_routed
from farskip_jax.model.swiglu_rows import resolve_swiglu
from farskip_jax.parallel.mesh import BATCH_AXES, param_specs_tree
from farskip_jax.platforms import device_family
from farskip_jax.xla.links import BALANCED_ROWS_ATTR


def resolve_exchange(mode: str, mesh: Mesh) -> str:
    """execution.ep_exchange "auto": ragged on GPU meshes (deviceless GPU devices say "gpu" too), padded
    elsewhere."""
    if mode == "auto":
        return "padded" if device_family(mesh.devices.flat[0]) == "cpu" else "ragged"
    if mode not in ("ragged", "padded"):
        raise ValueError(f"ep_exchange={mode!r}: expected 'auto', 'ragged' or 'padded'")
    return mode


def tile_per_node(params: Any, nodes: int) -> Any:
    """`params` with each routed-expert stack (what the EP layout splits over `expert`) repeated
    `nodes` times along its expert axis, the layout of `ExpertParallel.experts_in_node`: split over
    the expert axis as usual, node c's ranks hold copy c. Arrays or ShapeDtypeStructs."""

    def tile(x: Any, spec: P) -> Any:
        if "expert" not in spec or nodes == 1:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((nodes * x.shape[0], *x.shape[1:]), x.dtype)
        return jnp.concatenate([x] * nodes, axis=0)

    return jax.tree.map(tile, params, param_specs_tree(params, "ep"), is_leaf=lambda s: isinstance(s, P))


@dataclass(frozen=True)
class ExpertParallel:
    """Routed experts split over the mesh's `expert` axis, tokens over (data, expert).

    `bounded`: receive buffers sized by `execution.moe_buffer_factor` (may overflow, then the result says
    so); False: the worst case (`worst_case()`), which never overflows. `expert_per_node`
    (`mesh.expert_per_node`): 0, or at least `expert`, is the flat exchange; a divisor of `expert`
    factors it into nodes of that many ranks and runs the two-stage exchange of
    parallel/node_aware.py (each token crosses to a node once). `teacher_experts`
    (`mesh.teacher_experts` as resolved): the frozen FCSD teacher runs on `for_teacher()`'s layout.
    `experts_in_node`: the expert stacks hold one copy of every expert per node ([nodes x E, ...],
    `tile_per_node`), so each node's ranks split all E among themselves and the exchange runs inside
    each node (over the node's `expert_per_node` ranks: no NIC crossing); with nodes of one rank
    every device holds all E and nothing is exchanged."""

    mesh: Mesh
    reduce: None = None
    bounded: bool = True
    expert_per_node: int = 0
    teacher_experts: Literal["expert", "node", "local"] = "expert"
    experts_in_node: bool = False

    def __post_init__(self) -> None:
        if self.nodes > 1 and self.mesh.shape["expert"] % self.expert_per_node:
            raise ValueError(f"mesh.expert_per_node={self.expert_per_node} does not divide "
                             f"mesh.expert={self.mesh.shape['expert']}")

    @property
    def nodes(self) -> int:
        """Nodes the expert axis spans (1: the flat exchange)."""
        per = self.expert_per_node
        return 1 if per <= 0 or per >= self.mesh.shape["expert"] else self.mesh.shape["expert"] // per

    def worst_case(self) -> ExpertParallel:
        return dataclasses.replace(self, bounded=False)

    def for_teacher(self) -> ExpertParallel:
        """The frozen teacher's parallelism. A frozen model has no gradients or optimizer state to
        keep in step, so its routed experts can be copied for communication's sake at the cost of
        their weights alone. `teacher_experts` "node" (on an expert axis that spans nodes): copied
        on every node and split over that node's ranks (`experts_in_node`; each rank holds
        E / expert_per_node experts instead of E / expert), so its Dispatch and Combine never cross
        a NIC and leave the NICs to the student's exchanges. "local": every rank holds all E (nodes
        of one rank), so the teacher exchanges nothing, holds no receive buffer, and its whole layer
        is compute that XLA can place under the student's exchanges. Otherwise `self`."""
        if self.teacher_experts == "local":
            return dataclasses.replace(self, teacher_experts="expert", experts_in_node=True,
                                       expert_per_node=1)
        if self.teacher_experts == "expert" or self.nodes == 1:
            return self
        return dataclasses.replace(self, teacher_experts="expert", experts_in_node=True)

    @property
    def exchange_ranks(self) -> int:
        """Ranks an expert exchange spans: a node's with `experts_in_node`, else the expert axis."""
        return self.expert_per_node if self.experts_in_node else self.mesh.shape["expert"]

    @property
    def batch_shards(self) -> int:
        """Devices the batch axis is split over (`execution.batch_split` chunks each device's part)."""
        return self.mesh.shape["data"] * self.mesh.shape["expert"]

    def routed_fn(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                  exe: ExecutionConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
        routed, aux, _ = self.routed_with_shared(x_nd, routing, experts, cfg, exe, None)
        return routed, aux

    def routed_with_shared(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                           exe: ExecutionConfig, shared_fn: SharedFn | None
                           ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
        """(routed [N, D], {dropped_fraction, moe_overflow}, shared_fn(x_nd) or None); the Combine
        waits for the shared experts, so XLA can run them only before it, under the Dispatch.

        Left alone, XLA's scheduler puts every independent op under the Combine: on the 4-layer
        DSV2-Lite H200 step the forward Dispatch had 60 us of compute under a 200 us transfer and
        the Combine 738 us. The wait is a data dependency (`_EPShard.combine`,
        `model.schedule.scratch_rows`; tests/parallel/test_dependencies.py checks it). Under
        FarSkip the attention, which reads neither, is left to hide the Combine.

        `moe_overflow` is [shards] int32 (1 where the shard's expert group overflowed its bounded
        buffers); the model sums it over layers, and a nonzero sum means the result is void.
        """
        groups = self.exchange_ranks
        if groups == 1:
            return self._local_routed(x_nd, routing, experts, cfg, exe, shared_fn)
        if cfg.n_routed_experts % groups:
            raise ValueError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by "
                             f"{groups} expert ranks")
        exchange = resolve_exchange(exe.ep_exchange, self.mesh)
        matmul = resolve_matmul(exe.expert_matmul, self.mesh.devices.flat[0], cfg.dtype)
        swiglu = resolve_swiglu(exe.expert_swiglu, self.mesh.devices.flat[0], matmul)
        if self.nodes > 1 and not self.experts_in_node:
            from farskip_jax.parallel.node_aware import node_aware_routed  # it builds on this module

            return node_aware_routed(self.mesh, self.expert_per_node, cfg, buffer_config(exe, self.bounded),
                                     exchange, matmul, swiglu, x_nd, routing, experts, shared_fn)
        ep = _EPShard(cfg, buffer_config(exe, self.bounded), groups, routing.seq_len, exchange, matmul,
                      self.mesh.shape["expert"] if self.experts_in_node else 0, swiglu)
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

    def _local_routed(self, x_nd: jax.Array, routing: Routing, experts: RoutedExperts, cfg: ModelConfig,
                      exe: ExecutionConfig, shared_fn: SharedFn | None
                      ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
        """`routed_with_shared` where every rank holds all E experts (`for_teacher`'s "local"): each
        shard runs the one-device path (`model.moe.local_routed`) on its own tokens. Nothing is
        exchanged, and its rows are exactly its N*K assignments, so nothing can overflow."""
        tokens, stacks = P(BATCH_AXES), P("expert", None, None)

        def shard(x: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array) -> tuple[jax.Array, jax.Array]:
            on_shard = Routing(weights_nk, experts_nk, {}, routing.seq_len)
            routed, aux = local_routed(x, on_shard, _Stacks(w_gate, w_up, w_down), cfg, exe)
            return routed, jax.lax.pmean(aux["dropped_fraction"], BATCH_AXES)

        routed, dropped = jax.shard_map(
            shard, mesh=self.mesh, in_specs=(tokens, tokens, tokens, stacks, stacks, stacks),
            out_specs=(tokens, P()))(x_nd, routing.weights_nk, routing.experts_nk, experts.w_gate[...],
                                     experts.w_up[...], experts.w_down[...])
        shared = None if shared_fn is None else shared_fn(x_nd)
        return routed, {"dropped_fraction": dropped, "moe_overflow": jnp.zeros((), jnp.int32)}, shared


class _Stacks(NamedTuple):
    """One shard's routed-expert weights, as `local_routed` reads a `RoutedExperts`."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array


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
    global expert id); the blocks are in source order and do not overlap: the padded exchange's
    fixed slots of B rows (the ragged exchange lands rows expert-major, `expert_major_plan`)."""
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


def _expert_ffn(matmul: str, swiglu: str, rows_per_group: int, recv_rd: jax.Array, rg: _Regroup,
                w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """This rank's experts over the padded exchange's received rows (regrouped by expert and back):
    [G*B, D].

    JAX's own VJP. (Until K22 the input gradient was gated on the weight gradients, so that XLA
    could not defer them to the end of the step with every layer's worst-case grouped-GEMM buffers
    alive; on jax 0.12 with bounded buffers that gate cost compute and memory instead, BENCHMARKS.md
    K22.)"""
    if matmul == "padded":  # received rows straight into the [L, C, D] buffer, no sorted copy
        local = w_gate.shape[0]
        expert = jnp.minimum(rg.expert_r, local - 1)
        slot_r = jnp.where(rg.expert_r < local, expert * rows_per_group + rg.dst_r - rg.starts_l[expert],
                           local * rows_per_group + jnp.arange(recv_rd.shape[0], dtype=jnp.int32))
        return padded_ffn(recv_rd, slot_r, w_gate, w_up, w_down, rows_per_group)
    # src_r and dst_r are each other's inverse: both regroupings' gradients are gathers
    y_rd = grouped_ffn(permute_rows(recv_rd, rg.src_r, rg.dst_r), rg.starts_l, w_gate, w_up, w_down,
                       matmul, rows_per_group, swiglu)  # type: ignore[arg-type]
    return permute_rows(y_rd, rg.dst_r, rg.src_r)


class _Plan(NamedTuple):
    """One ragged exchange over `expert`, and what its transpose needs; every field is [G * S] int32:
    S slices per peer, peer-major (`jax.lax.ragged_all_to_all`'s layout).

    This rank's slice j for rank g is x[in_off[i] : in_off[i] + send[i]] (i = g*S + j), which lands
    at out_off[i] of g's output; it receives recv[i] rows as source s's slice j (i = s*S + j) at
    back_in[i] of its own output, taken from back_out[i] of s's operand. The Dispatch and the
    Combine are each other's transpose.
    """

    in_off: jax.Array
    send: jax.Array
    out_off: jax.Array
    recv: jax.Array
    back_in: jax.Array
    back_out: jax.Array

    def transposed(self) -> _Plan:
        return _Plan(self.back_in, self.recv, self.back_out, self.send, self.in_off, self.out_off)


def expert_major_plan(counts_sgl: jax.Array, starts_sg: jax.Array, me: jax.Array) -> tuple[_Plan, jax.Array]:
    """A ragged exchange with one slice per (receiver, receiver's local expert), landing expert-major,
    and [L + 1]: where each of rank `me`'s local experts starts in its receive buffer.

    counts_sgl [S, G, L]: sender s's rows for receiver g's local expert l, which lie in s's sorted
    rows from starts_sg [S, G] on, local experts ascending. In g's buffer expert l's rows come from
    every sender in sender order, experts one after another, so the grouped GEMM reads the receive
    buffer as it is, and its output goes back as it is. With one slice per receiver (rows arriving
    sender-major) the buffer had to be regrouped by expert and back: a gather of the whole bounded
    buffer each way, forward and backward (BENCHMARKS.md K26)."""
    total_gl = counts_sgl.sum(axis=0)
    # where (g, l)'s rows from sender s land in g's buffer: expert l's start, then the senders before s
    expert_start_gl = jnp.cumsum(total_gl, axis=1) - total_gl
    land_sgl = expert_start_gl[None] + jnp.cumsum(counts_sgl, axis=0) - counts_sgl
    # where they start in s's sorted rows: its block for g, then the experts before l
    taken_sgl = starts_sg[..., None] + jnp.cumsum(counts_sgl, axis=2) - counts_sgl
    plan = _Plan(in_off=taken_sgl[me].reshape(-1), send=counts_sgl[me].reshape(-1),
                 out_off=land_sgl[me].reshape(-1), recv=counts_sgl[:, me].reshape(-1),
                 back_in=land_sgl[:, me].reshape(-1), back_out=taken_sgl[:, me].reshape(-1))
    starts_l = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(total_gl[me])]).astype(jnp.int32)
    return plan, starts_l


Groups = tuple[tuple[int, ...], ...] | None  # axis_index_groups of a collective (None: the whole axis)


class _Route(NamedTuple):
    """Where a ragged exchange runs (static): mesh axis `axis`, within each of `groups` (lists of
    axis indices; None: the whole axis). `balanced_rows`: the rows it moves per device under
    balanced routing, declared to the inspector's link model (`xla.links.BALANCED_ROWS_ATTR`) where
    neither its send nor its receive buffer is exact (parallel/node_aware.py); None: the send buffer
    holds exactly the rows sent. `unsent_ct_unread`: nothing reads the cotangent of the rows of x
    that the exchange does not send (the Combine's: rows past the experts' groups), so the backward
    exchange lands in `schedule.scratch_rows` instead of zeros."""

    axis: str
    groups: Groups = None
    balanced_rows: int | None = None
    unsent_ct_unread: bool = False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_move(route: _Route, x: jax.Array, out: jax.Array, plan: _Plan) -> jax.Array:
    """`plan`'s exchange (over `route`) of the rows of x into the buffer `out` (ragged_all_to_all);
    plan's arrays have one entry per peer.

    Rows of `out` that nothing lands in keep their value and get no gradient: callers pass zeros
    where those rows are read, else `schedule.scratch_rows` (uninitialised on GPUs): the receive
    buffer's rows past the experts' groups, the Combine's dropped rows.

    Why a custom VJP: JAX's transpose of ragged_all_to_all learns the peers' offsets with two
    extra all_to_alls per exchange (a sync point each in the backward, in XLA's one collective
    slot) and masks the output cotangent with a cumsum; `plan` already holds both sides' offsets
    (the counts exchange carried them), so the transpose is the transposed plan's exchange (which
    moves the same rows, so it declares the same `balanced_rows`).
    """
    declared = ({} if route.balanced_rows is None
                else {BALANCED_ROWS_ATTR: route.balanced_rows})
    with set_xla_metadata(**declared):
        return jax.lax.ragged_all_to_all(x, out, plan.in_off, plan.send, plan.out_off, plan.recv,
                                         axis_name=route.axis, axis_index_groups=route.groups)


def _ragged_move_fwd(route: _Route, x: jax.Array, out: jax.Array, plan: _Plan
                     ) -> tuple[jax.Array, tuple[_Plan, jax.Array]]:
    # A zero-size array carries x's row count (a residual must be an array) at no cost; made from
    # the shape, not sliced from x, so that a rematerialised backward need not recompute x (the
    # node-aware exchange's operands come from another exchange).
    return _ragged_move(route, x, out, plan), (plan, jnp.zeros((x.shape[0], 0), x.dtype))


def _ragged_move_bwd(route: _Route, res: tuple[_Plan, jax.Array], ct: jax.Array
                     ) -> tuple[jax.Array, None, None]:
    plan, x_rows = res
    # Rows of x that were not sent get a zero cotangent (nothing lands there in the transpose), or
    # none at all where nothing reads it.
    fill = schedule.scratch_rows if route.unsent_ct_unread else schedule.fresh_zeros
    out = fill(x_rows.shape[0], ct, plan.send)
    return _ragged_move(route, ct, out, plan.transposed()), None, None


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
    exe: ExecutionConfig  # its moe_buffer_factor sizes the receive buffers (0: the worst case)
    groups: int  # G
    seq_len: int
    exchange: str
    matmul: str
    # > 0: the expert axis has this many ranks and every exchange runs inside each consecutive block
    # of `groups` of them (a node's: `ExpertParallel.experts_in_node`); 0: over the whole axis
    axis_ranks: int = 0
    swiglu: str = "xla"  # the activation kernel (model/swiglu_rows.py)

    @property
    def local(self) -> int:  # L
        return self.cfg.n_routed_experts // self.groups

    @property
    def _blocks_of_axis(self) -> Groups:
        """axis_index_groups of the exchanges (None: the whole axis)."""
        g = self.groups
        if not self.axis_ranks:
            return None
        return tuple(tuple(range(b * g, (b + 1) * g)) for b in range(self.axis_ranks // g))

    def _me(self) -> jax.Array:
        """This shard's rank among the ranks it exchanges with."""
        me = jax.lax.axis_index("expert")
        return me % self.groups if self.axis_ranks else me

    def buffer(self, n: int) -> MoeBuffer:
        """The receive buffer (`dispatch.moe_buffer`): R rows from all G sources (ragged exchange) or B
        rows per source (padded)."""
        sources = self.groups if self.exchange == "ragged" else 1
        return moe_buffer(self.cfg, self.exe, n, self.groups, self.seq_len, sources)

    def receive_rows(self, n: int) -> int:
        """Rows of the receive buffer: R, or G * B."""
        rows = self.buffer(n).rows
        return rows if self.exchange == "ragged" else self.groups * rows

    def _sort(self, n: int, weights_nk: jax.Array, experts_nk: jax.Array) -> tuple[_Sorted, jax.Array]:
        """Capacity drops, sort by global expert (= by destination rank, then local expert), counts."""
        e, local, groups = self.cfg.n_routed_experts, self.local, self.groups
        ids_nk, dropped = drop_over_capacity(experts_nk, weights_nk, self.seq_len, self.cfg, self.exe)
        ids_a = ids_nk.reshape(-1)
        srt = sort_by_group(ids_a, e)
        with jax.named_scope("dispatch"):
            # One tiny all_gather carries every rank's counts per (destination, local expert) and
            # where its rows for each destination start in its sorted rows: from it every rank knows
            # where its rows land in every packed receive buffer, every buffer's load (so all agree
            # on an overflow without another collective), and where the Combine sends each row back.
            # Tagged for execution.remat (model/transformer.py): the backward pass reuses it.
            counts_gl = jnp.diff(srt.starts_g).reshape(groups, local)
            meta_gm = jnp.concatenate([counts_gl, srt.starts_g[:-1:local, None]], axis=1)
            meta = checkpoint_name(jax.lax.all_gather(meta_gm, "expert"), A2A_COUNTS)  # [G src, G dst, L+1]
            if self.axis_ranks:  # the counts of this shard's block of ranks (all_gather has no groups here)
                first = jax.lax.axis_index("expert") // groups * groups
                meta = jax.lax.dynamic_slice_in_dim(meta, first, groups, axis=0)
            limit = self.buffer(n).rows
            counts = meta[..., :local]
            # ragged: every rank's total from all sources; padded: every (source, rank) pair
            load = counts.sum(axis=(0, 2)) if self.exchange == "ragged" else counts.sum(axis=2)
            overflow = jnp.any(load > limit)
            meta = jnp.where(overflow, 0, meta)
        if self.exe.capacity_factor > 0:  # equal tokens per shard: the mean of means is the global mean
            dropped = jax.lax.pmean(dropped, BATCH_AXES)
        return _Sorted(ids_a, srt.order_a, srt.inv_a, srt.starts_g[None], meta[None],
                       overflow.astype(jnp.int32)[None]), dropped

    def _plan(self, srt: _Sorted) -> tuple[_Plan, jax.Array]:
        """The Dispatch's ragged exchange (the Combine's is its transpose) and where this rank's
        local experts start in its receive buffer (`expert_major_plan`)."""
        meta, local = srt.meta[0], self.local
        return expert_major_plan(meta[..., :local], meta[..., local], self._me())

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
        per_expert = min(groups * rows_per_expert(n, self.seq_len, self.cfg, self.exe), rows)
        if self.exchange == "ragged":
            plan, starts_l = self._plan(srt)
            with jax.named_scope("dispatch"):
                recv_rd = _ragged_move(_Route("expert", self._blocks_of_axis), x_nd[srt.order_a // k],
                                       schedule.scratch_rows(rows, x_nd, srt.ids_a), plan)
                recv_rd = checkpoint_name(recv_rd, A2A_DISPATCH)
            with jax.named_scope("experts"):  # the receive buffer is expert-major already
                back_rd = grouped_ffn(recv_rd, starts_l, w_gate, w_up, w_down, self.matmul, per_expert,
                                      self.swiglu)  # type: ignore[arg-type]
            return back_rd, srt, dropped, srt.overflow
        # padded: per-destination buffers, slot q of rank g holds sorted row send_start[g] + q
        b, me = self.buffer(n).rows, self._me()
        with jax.named_scope("dispatch"):
            starts_e = srt.starts_e[0]
            slot_gq = starts_e[:-1:local, None] + jnp.arange(b, dtype=jnp.int32)
            token_gq = srt.order_a[jnp.minimum(slot_gq, n * k - 1)] // k
            sent_g = meta[me, :, :local].sum(axis=1)  # 0 everywhere on an overflow
            filled_gq = jnp.arange(b, dtype=jnp.int32)[None, :] < sent_g[:, None]
            rows_gqd = jnp.where(filled_gq[..., None], x_nd[token_gq], 0)
            recv_rd = jax.lax.all_to_all(rows_gqd, "expert", 0, 0,
                                         axis_index_groups=self._blocks_of_axis).reshape(rows, -1)
            recv_rd = checkpoint_name(recv_rd, A2A_DISPATCH)
        with jax.named_scope("experts"):  # source s's rows lie in its slots [s*B, s*B + count)
            rg = _regroup(meta[:, me, :local], jnp.arange(groups, dtype=jnp.int32) * b, rows)
            back_rd = _expert_ffn(self.matmul, self.swiglu, per_expert, recv_rd, rg, w_gate, w_up, w_down)
        return back_rd, srt, dropped, srt.overflow

    def combine(self, back_rd: jax.Array, srt: _Sorted, weights_nk: jax.Array,
                after_nd: jax.Array) -> jax.Array:
        """Combine the experts' rows back to their sources, then the router-weighted sum: [N, D].

        The ragged Combine starts only once `after_nd` (the shared experts' output) exists: its
        output buffer is allocated from it (`schedule.scratch_rows`). Rows nothing lands in
        (dropped assignments) are selected away in `weighted_sum`.
        """
        n, k = weights_nk.shape
        groups, local, e = self.groups, self.local, self.cfg.n_routed_experts
        # On an overflow nothing came back: every assignment is selected away (the result is void).
        valid_a = (srt.ids_a < e) & (srt.overflow[0] == 0)
        with jax.named_scope("combine"):
            if self.exchange == "ragged":
                # Rows come back in this rank's sorted order: [N*K, D]; dropped ones stay unwritten.
                # allocated once the shared experts' output exists: the Combine waits for them
                out = schedule.scratch_rows(n * k, back_rd, after_nd)
                # back_rd's rows past the experts' groups are not sent; their cotangent is not read
                route = _Route("expert", self._blocks_of_axis, unsent_ct_unread=True)
                out_rd = _ragged_move(route, back_rd, out,
                                      self._plan(srt)[0].transposed())
                out_rd = checkpoint_name(out_rd, A2A_COMBINE)
                # each assignment's row; inv_a and order_a are inverse permutations of [0, N*K)
                rows_a = permute_rows(out_rd, srt.inv_a, srt.order_a)
            else:  # the whole [G*B, D] buffer travels; assignment a (sorted row inv[a], to rank g)
                # comes back at g*B + inv[a] - send_start[g]
                b = self.buffer(n).rows
                out_rd = jax.lax.all_to_all(back_rd.reshape(groups, b, -1), "expert", 0, 0,
                                            axis_index_groups=self._blocks_of_axis)
                out_rd = checkpoint_name(out_rd.reshape(groups * b, -1), A2A_COMBINE)
                rank_a = jnp.minimum(srt.ids_a // local, groups - 1)
                send_start_g = srt.starts_e[0, :-1:local]
                back_a = jnp.where(valid_a, rank_a * b + srt.inv_a - send_start_g[rank_a], 0)
                rows_a = out_rd[back_a]
        return weighted_sum(rows_a.reshape(n, k, -1), valid_a.reshape(n, k), weights_nk)
