"""Node-aware expert parallelism: a two-stage Dispatch and Combine when the expert axis spans nodes.

The flat exchange (parallel/expert.py) sends each (token, expert) pair to the rank that owns the
expert. Once the expert axis spans nodes that is the NIC's work: with top-6 of 64 experts over
4 nodes of 8 GPUs, 4.5 of a token's 6 copies leave the node (BENCHMARKS.md K6). Here a token
crosses to each destination node once, and is fanned out to the node's experts over the node's
own links (NVLink / xGMI); coming back, the node's expert outputs are reduced inside the node to
one row per (token, node) before they cross. Under uniform routing that is 3 x (1 - C(48,6) /
C(64,6)) = 2.5 crossings per token instead of 4.5 (an estimate; the real share depends on the
router).

Mesh. The knob is `mesh.expert_per_node` (`ExpertParallel(expert_per_node=...)`; 0, the default,
is the flat exchange). The mesh keeps its (data, expert, tensor) axes, so every sharding, parameter
layout and batch layout stays as it is; the expert axis is read as nodes of `expert_per_node`
consecutive ranks (rank g = node * expert_per_node + local: where `parallel.make_mesh` puts the
devices, process major, one process per node), and each stage is a collective over `expert` within
groups of its indices (`node_groups`): the inter-node stage among the ranks with one local index
(one per node), the in-node stage among a node's ranks. Why groups and not two mesh axes: JAX
takes one mesh per program, and the trainer's step pins its arguments and results to the
(data, expert, tensor) mesh (a shard_map over an (expert -> node, local) view of the same devices
does not lower inside it). XLA prints the groups as replica groups, which is what the inspector's
link model reads to tell NIC from NVLink traffic (xla/links.py). Why a mesh knob and not an
exchange mode: which ranks share a node is a property of the machine the mesh is laid on.

Data flow, per source rank (s, j) (node s, local index j), N tokens, K choices, E experts, Nn
nodes of Lr ranks, El = E / (Nn Lr) experts per rank, En = E / Nn per node:
  0. Capacity drops (as everywhere), then one tiny all_gather over `expert` of every rank's
     rows per destination node, where they start in its sorted rows, and its assignments per
     expert. From it every rank knows both stages' send and receive counts, every buffer's load
     (so all agree on an overflow), and the in-node plans: no count is exchanged between stages.
  1. Dispatch, between nodes (peers (d, j) for every node d): the source sorts its (token, node)
     pairs by destination node and sends each token once to every node that holds one of its
     experts, to the rank with its own local index there, together with the token's node-local
     expert ids and router weights (bit-packed into the row: one exchange, exact in both
     directions).
  2. Dispatch, inside the node (peers (d, r) for every r): that intermediate rank sorts the
     (row, choice) assignments it received by node-local expert and sends each row to the rank owning the
     expert: the flat exchange, over the node's Lr ranks.
  3. The experts: the flat path's grouped FFN over the received rows (the ragged stage 2 lands
     them expert-major, `expert.expert_major_plan`; the padded one is regrouped, `_regroup`).
  4. Combine, inside the node: the transposed stage-2 exchange brings each expert output back to
     the intermediate, which forms every received row's router-weighted partial sum over the
     node's experts (fp32 products and sum, as `weighted_sum`; `_partial_sums`).
  5. Combine, between nodes: the transposed stage-1 exchange sends one partial sum per
     (token, node) back, in the compute dtype (as the flat path sends expert outputs); the source
     adds its nodes' partial sums in fp32.
The sums differ from one device's in order (by node, then over a node's experts) and, in bf16, by
the rounding of each node's partial sum before it crosses (fp32 tests: equal to 1e-5, as the flat
path's).

Buffers (optimistic dropless, `moe_buffer_factor`, `dispatch.bounded_buffer`): the stage-1 receive
buffer (balanced: N q rows, q the expected nodes per token under uniform routing; worst case Nn N,
so at DSV2-Lite's EP32 the bound is the worst case and never overflows), the intermediate's stage-2
send rows (balanced N K, worst every received row's K choices in the node) and the expert rank's
receive buffer (as the flat path's). The counts of step 0 say whether any of them would overflow
anywhere; then every count is taken as 0, nothing moves, every shard reports `moe_overflow`, and the
caller re-runs the worst-case program (factor 0), so every kept result is exactly dropless.

Backward: each ragged exchange is `expert._ragged_move` (custom VJP: the transpose is the
transposed plan's exchange, no offset all_to_alls); the padded exchange (XLA:CPU) is a plain
all_to_all, whose transpose is one too. The packed ids and weights go through `_pack` /
`_unpack`, whose VJPs pack the cotangents the same way, so the router weights' gradient (formed
on the intermediate) travels back bit-exact in the stage-1 Dispatch's transpose. No collective
is added to the backward pass beyond the four transposed exchanges; with `remat="save_a2a"` the
backward pass keeps what it reads of the exchanges (the counts, stage 1's ids and weights, stage 2's
rows both ways) and reruns none of them.

Cost model: each ragged stage declares the rows it moves per device under balanced, uniform
routing (N q for stage 1, N K for stage 2; `expert._Route.balanced_rows`), since neither of its
buffers is exact; the inspector charges those under `--moe-load balanced` (xla/links.py).

Schedule contract (as the flat path's): two shard_maps, the shared experts between them; the
Combine's first exchange (the in-node one) starts only once the shared experts' output exists
(its ragged output buffer is allocated from their output, `schedule.scratch_rows`), so the shared
experts can hide the Dispatch and, under FarSkip, the next layer's attention the Combine. The
counts all_gather depends only on the routing, so XLA may run it under any compute that does not
read the routed output.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.config import ModelConfig
from farskip_jax.execution import ExecutionConfig
from farskip_jax.model import schedule
from farskip_jax.model.dispatch import (
    A2A_COMBINE,
    A2A_COUNTS,
    A2A_DISPATCH,
    MoeBuffer,
    bounded_buffer,
    drop_over_capacity,
    grouped_ffn,
    permute_rows,
    rows_per_expert,
    sort_by_group,
    weighted_sum,
)
from farskip_jax.model.moe import RoutedExperts, Routing, SharedFn
from farskip_jax.parallel.expert import (
    Groups,
    _expert_ffn,
    _Plan,
    _ragged_move,
    _regroup,
    _Route,
    expert_major_plan,
)
from farskip_jax.parallel.mesh import BATCH_AXES

AXIS = "expert"


def node_groups(expert: int, expert_per_node: int) -> tuple[Groups, Groups]:
    """(inter-node groups: the ranks with one local index, one per node; in-node groups: each node's
    ranks), as axis_index_groups of the `expert` axis; rank g is on node g // expert_per_node."""
    if expert_per_node < 1 or expert % expert_per_node:
        raise ValueError(f"mesh.expert_per_node={expert_per_node} does not divide mesh.expert={expert}")
    nodes = expert // expert_per_node
    across = tuple(tuple(d * expert_per_node + j for d in range(nodes)) for j in range(expert_per_node))
    inside = tuple(tuple(d * expert_per_node + j for j in range(expert_per_node)) for d in range(nodes))
    return across, inside


def expected_nodes_per_token(experts: int, nodes: int, k: int) -> float:
    """Nodes a token's k distinct experts land on, on average, when they are drawn uniformly:
    nodes x P(a node holds at least one) = nodes (1 - C(E - E/nodes, k) / C(E, k))."""
    per_node = experts // nodes
    return nodes * (1.0 - math.comb(experts - per_node, k) / math.comb(experts, k))


# ------------------------------------------------------------------ bit-packed side columns -----

def _pack_raw(x_rd: jax.Array, side_rm: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(side_rm.astype(jnp.float32), x_rd.dtype)
    return jnp.concatenate([x_rd, bits.reshape(x_rd.shape[0], -1)], axis=1)


def _unpack_raw(packed: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    per = 4 // packed.dtype.itemsize  # columns of x's dtype per float32
    width = packed.shape[1] - side * per
    bits = packed[:, width:]
    if per > 1:
        bits = bits.reshape(packed.shape[0], side, per)
    return packed[:, :width], jax.lax.bitcast_convert_type(bits, jnp.float32)


@jax.custom_vjp
def _pack(x_rd: jax.Array, side_rm: jax.Array) -> jax.Array:
    """[R, D + M * 4 / itemsize]: x's rows with the float32 columns `side_rm` [R, M] appended bit for
    bit (as pairs of bf16 / fp16 lanes, or as they are for float32 rows), so that one exchange moves
    both. The VJP unpacks the cotangent the same way (bitcasts have no derivative of their own)."""
    return _pack_raw(x_rd, side_rm)


def _pack_fwd(x_rd: jax.Array, side_rm: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _pack_raw(x_rd, side_rm), side_rm[:0]  # the zero-row slice carries M


def _pack_bwd(side0: jax.Array, ct: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _unpack_raw(ct, side0.shape[1])


_pack.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unpack(packed: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """The inverse of `_pack`: (rows [R, D], float32 side columns [R, side])."""
    return _unpack_raw(packed, side)


def _unpack_fwd(packed: jax.Array, side: int) -> tuple[tuple[jax.Array, jax.Array], None]:
    return _unpack_raw(packed, side), None


def _unpack_bwd(side: int, res: None, ct: tuple[jax.Array, jax.Array]) -> tuple[jax.Array]:
    del side, res
    return (_pack_raw(*ct),)


_unpack.defvjp(_unpack_fwd, _unpack_bwd)


# ------------------------------------------------------------------ one exchange over one axis ---

@dataclass(frozen=True)
class _Stage:
    """One exchange over the `expert` axis within `groups` of `peers` ranks (a rank's index in its
    group is `me`): each sender's rows are sorted by
    destination; each receiver holds its senders' blocks in sender order, packed (ragged: `slot`
    rows for all of them) or at fixed offsets (padded: `slot` rows per sender).

    Arguments named `counts_sd` / `starts_sd` [sender, receiver] hold every pair's row count and
    where those rows start in the sender's sorted rows (all 0 on an overflow: nothing moves)."""

    route: _Route  # the axis, the groups, and the rows balanced routing moves per device
    peers: int
    exchange: str
    slot: int

    @property
    def rows(self) -> int:
        """Rows of a receive buffer."""
        return self.slot if self.exchange == "ragged" else self.peers * self.slot

    def blocks(self, counts_sd: jax.Array) -> jax.Array:
        """[sender, receiver]: where the sender's block starts in the receiver's buffer."""
        if self.exchange == "ragged":
            return jnp.cumsum(counts_sd, axis=0) - counts_sd
        return jnp.broadcast_to(jnp.arange(self.peers, dtype=jnp.int32)[:, None] * self.slot,
                                (self.peers, self.peers))

    def received(self, counts_sd: jax.Array, me: jax.Array) -> jax.Array:
        """Bool [rows]: the receive-buffer rows some sender filled."""
        start, count = self.blocks(counts_sd)[:, me], counts_sd[:, me]
        row = jnp.arange(self.rows, dtype=jnp.int32)[:, None]
        return jnp.any((row >= start[None]) & (row < (start + count)[None]), axis=1)

    def plan(self, counts_sd: jax.Array, starts_sd: jax.Array, me: jax.Array) -> _Plan:
        blocks = self.blocks(counts_sd)
        return _Plan(in_off=starts_sd[me], send=counts_sd[me], out_off=blocks[me], recv=counts_sd[:, me],
                     back_in=blocks[:, me], back_out=starts_sd[:, me])

    def dispatch(self, rows_aw: jax.Array, side_am: jax.Array | None, counts_sd: jax.Array,
                 starts_sd: jax.Array, me: jax.Array, dep: jax.Array, plan: _Plan | None = None
                 ) -> tuple[jax.Array, jax.Array | None]:
        """The sender's sorted rows [A, W] (and float32 side columns [A, M], bit-packed into the same
        exchange) into the receivers' buffers: ([rows, W], [rows, M] or None). `plan`: the ragged
        exchange's own layout of the receive buffers (stage 2's `expert_major_plan`) instead of
        the senders' blocks in sender order.

        `dep` (here and in `combine`): an int array, never negative at [0], that varies over the mesh
        like the tokens (not a sort's permutation: argsort drops that type); the ragged exchange's
        result is typed like its output buffer, which `dep` makes mesh-varying. A mesh-invariant
        buffer would make JAX psum its cotangent over the mesh in the backward pass.

        The packing wraps the exchange alone: no arithmetic (a gather's scatter-add transpose, a
        select's zeros) ever sees the packed bits, which bf16 arithmetic would not keep."""
        side = None if side_am is None else side_am.shape[1]
        if self.exchange == "ragged":
            packed = rows_aw if side is None else _pack(rows_aw, side_am)
            out = schedule.scratch_rows(self.rows, packed, dep)
            plan = self.plan(counts_sd, starts_sd, me) if plan is None else plan
            recv = _ragged_move(self.route, packed, out, plan)
        else:
            b = self.slot
            slot_gq = jnp.minimum(starts_sd[me][:, None] + jnp.arange(b, dtype=jnp.int32),
                                  rows_aw.shape[0] - 1)
            filled_gq1 = (jnp.arange(b, dtype=jnp.int32)[None, :] < counts_sd[me][:, None])[..., None]
            buf = jnp.where(filled_gq1, rows_aw[slot_gq], 0)
            if side is not None:
                side_gqm = jnp.where(filled_gq1, side_am[slot_gq], 0.0)
                buf = _pack(buf.reshape(-1, buf.shape[-1]), side_gqm.reshape(-1, side)).reshape(
                    self.peers, b, -1)
            recv = jax.lax.all_to_all(buf, AXIS, 0, 0, axis_index_groups=self.route.groups).reshape(
                self.rows, -1)
        return (recv, None) if side is None else _unpack(recv, side)

    def combine(self, back_rw: jax.Array, counts_sd: jax.Array, starts_sd: jax.Array, me: jax.Array,
                rows: int, dest_a: jax.Array | None, dep: jax.Array, after: jax.Array | None = None,
                plan: _Plan | None = None) -> jax.Array:
        """The transpose of `dispatch`: the receivers' rows back to the sender's first `rows` sorted
        rows [rows, W] (rows that were not sent hold anything). `dest_a` [rows]: each sorted row's
        receiver (the padded exchange's only). `after`: the ragged exchange's output buffer is allocated
        from it, so the exchange waits for it (`schedule.scratch_rows`). `plan`: the Dispatch's, as there."""
        if self.exchange == "ragged":
            # allocated once `after` exists, if given: the exchange waits for it
            out = schedule.scratch_rows(rows, back_rw, dep if after is None else after)
            plan = self.plan(counts_sd, starts_sd, me) if plan is None else plan
            moved = _ragged_move(self.route, back_rw, out, plan.transposed())
        else:
            assert dest_a is not None
            b = self.slot
            buf = jax.lax.all_to_all(back_rw.reshape(self.peers, b, -1), AXIS, 0, 0,
                                     axis_index_groups=self.route.groups)
            row_a = dest_a * b + jnp.arange(rows, dtype=jnp.int32) - starts_sd[me][dest_a]
            moved = buf.reshape(self.rows, -1)[jnp.clip(row_a, 0, self.rows - 1)]
        return moved


# ------------------------------------------------------------------ the shard bodies ------------

class _NodeState(NamedTuple):
    """What the Dispatch shard hands the Combine shard. Per-shard arrays that are not per row carry
    a leading axis of 1 (the shard_maps concatenate shards along axis 0)."""

    present_nd: jax.Array  # [N, Nn] bool: the token has an expert on node d (False on an overflow)
    inv_p: jax.Array  # [N * Nn] (token, node) pair -> its row in the sorted pairs
    order_q: jax.Array  # [S1] sorted pair row -> its (token, node) pair (token * Nn + node)
    lid_rk: jax.Array  # [R1, K] node-local expert ids of the received rows (En: none)
    w_rk: jax.Array  # [R1, K] their router weights (float32; differentiable)
    inv_a: jax.Array  # [R1 * K] received assignment -> its row in the stage-2 sorted rows
    order_a: jax.Array  # [S2] stage-2 sorted row -> received assignment
    counts1: jax.Array  # [1, Nn, Nn] stage-1 rows per (sender node, receiver node) of my node group
    starts1: jax.Array  # [1, Nn, Nn] where they start in the sender's sorted pairs
    counts2: jax.Array  # [1, Lr, Lr, El] stage-2 rows per (sender, receiver, receiver's expert) in my node
    overflow: jax.Array  # [1] int32


@dataclass(frozen=True)
class _NodeShard:
    """The per-shard halves of the node-aware routed experts (bodies of the shard_maps)."""

    cfg: ModelConfig
    exe: ExecutionConfig  # as `buffer_config` sizes the buffers (moe_buffer_factor 0: the worst case)
    nodes: int  # Nn
    per_node: int  # Lr
    seq_len: int
    exchange: str
    matmul: str
    swiglu: str = "xla"  # the activation kernel (model/swiglu_rows.py)

    @property
    def ranks(self) -> int:  # G
        return self.nodes * self.per_node

    @property
    def local(self) -> int:  # El
        return self.cfg.n_routed_experts // self.ranks

    @property
    def node_experts(self) -> int:  # En
        return self.cfg.n_routed_experts // self.nodes

    def pair_rows(self, n: int) -> int:
        """S1: a source's sorted (token, node) pairs that can be valid (a token's K distinct experts
        lie on at most min(K, Nn) nodes): the stage-1 send rows, never exceeded."""
        return n * min(self.cfg.num_experts_per_tok, self.nodes)

    def buffers(self, n: int) -> tuple[MoeBuffer, MoeBuffer, MoeBuffer]:
        """(stage-1 receive buffer: all senders' rows (ragged) or one sender's slot (padded); the
        intermediate's stage-2 send rows; the stage-2 receive buffer, likewise per exchange)."""
        cfg, k, nn, lr, el, en = (self.cfg, self.cfg.num_experts_per_tok, self.nodes, self.per_node,
                                  self.local, self.node_experts)
        rpe = rows_per_expert(n, self.seq_len, cfg, self.exe)
        q = expected_nodes_per_token(cfg.n_routed_experts, nn, k)
        per_sender1 = min(n, en * rpe)  # each token once per node; with a capacity, rpe per expert
        if self.exchange == "ragged":
            b1 = bounded_buffer(self.exe, n * q, nn * per_sender1)
            rows1 = b1.rows
        else:
            b1 = bounded_buffer(self.exe, n * q / nn, per_sender1)
            rows1 = nn * b1.rows
        s2 = bounded_buffer(self.exe, n * k, min(rows1 * min(k, en), en * nn * rpe))
        if self.exchange == "ragged":
            worst2 = min(lr * s2.rows, self.ranks * min(n * min(k, el), el * rpe))
            b2 = bounded_buffer(self.exe, n * k, worst2)
        else:
            b2 = bounded_buffer(self.exe, n * k / lr, min(s2.rows, nn * el * rpe))
        return b1, s2, b2

    def stages(self, n: int) -> tuple[_Stage, _Stage]:
        """The two exchanges. Each declares the rows it moves per device under balanced, uniform
        routing (`_Route.balanced_rows`): stage 1 one row per (token, node), N q; stage 2 one per
        (token, expert), N K."""
        b1, _, b2 = self.buffers(n)
        across, inside = node_groups(self.ranks, self.per_node)
        k = self.cfg.num_experts_per_tok
        q = expected_nodes_per_token(self.cfg.n_routed_experts, self.nodes, k)
        return (_Stage(_Route(AXIS, across, math.ceil(n * q)), self.nodes, self.exchange, b1.rows),
                _Stage(_Route(AXIS, inside, n * k), self.per_node, self.exchange, b2.rows))

    def _where(self) -> tuple[jax.Array, jax.Array]:
        """(my node, my local index): my index in the inter-node and in the in-node group."""
        g = jax.lax.axis_index(AXIS)
        return g // self.per_node, g % self.per_node

    def _counts(self, n: int, ids_nk: jax.Array, pair_starts: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The one counts exchange. Returns (counts1 [Nn, Nn], starts1 [Nn, Nn] of my node group,
        counts2 [Lr, Lr, El] of my node, overflow []); the counts are 0 on an overflow."""
        e, nn, lr, el = self.cfg.n_routed_experts, self.nodes, self.per_node, self.local
        per_expert = jnp.zeros(e + 1, jnp.int32).at[ids_nk.reshape(-1)].add(1)[:e]
        mine = jnp.concatenate([jnp.diff(pair_starts), pair_starts[:-1], per_expert])  # [2 Nn + E]
        # [G sources, 2 Nn + E], source g = node * Lr + local
        every = checkpoint_name(jax.lax.all_gather(mine, AXIS), A2A_COUNTS)
        c1 = every[:, :nn].reshape(nn, lr, nn)  # [src node, src local, dst node]
        st1 = every[:, nn:2 * nn].reshape(nn, lr, nn)
        cnt = every[:, 2 * nn:].reshape(nn, lr, nn, lr, el)  # [src node, src local, dst node, dst local, l]
        b1, s2, b2 = self.buffers(n)
        load1 = c1.sum(axis=0) if self.exchange == "ragged" else c1  # stage-1 receivers (d, j)
        send2 = cnt.sum(axis=(0, 3, 4))  # [j, d]: intermediate (d, j)'s stage-2 rows
        load2 = cnt.sum(axis=(0, 1, 4)) if self.exchange == "ragged" else cnt.sum(axis=(0, 4))
        overflow = jnp.any(load1 > b1.rows) | jnp.any(send2 > s2.rows) | jnp.any(load2 > b2.rows)
        node, loc = self._where()
        counts1 = jnp.where(overflow, 0, c1[:, loc, :])
        counts2 = jnp.where(overflow, 0, cnt[:, :, node].sum(axis=0))  # [j, r, l], summed over src nodes
        return counts1, st1[:, loc, :], counts2, overflow

    @staticmethod
    def _starts2(counts2: jax.Array) -> jax.Array:
        """[Lr, Lr]: where intermediate j's rows for rank r start in its stage-2 sorted rows (sorted by
        node-local expert, so by receiver)."""
        totals = counts2.sum(axis=2)
        return jnp.cumsum(totals, axis=1) - totals

    def _plan2(self, counts2: jax.Array, loc: jax.Array) -> tuple[_Plan | None, jax.Array | None]:
        """The ragged stage-2 exchange, one slice per (receiver, its expert), landing expert-major
        (`expert_major_plan`), and where my experts start in my receive buffer; (None, None) for the
        padded exchange, whose fixed slots are regrouped (`_regroup`)."""
        if self.exchange != "ragged":
            return None, None
        return expert_major_plan(counts2, self._starts2(counts2), loc)

    def dispatch_experts(self, x_nd: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array,
                         w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
                         ) -> tuple[jax.Array, _NodeState, jax.Array, jax.Array]:
        """Capacity drops, counts, both Dispatch stages, this rank's experts.

        Returns ([rows2, D] expert outputs in the stage-2 receive layout, the state for `combine`,
        dropped fraction, [1] overflow flag)."""
        n, k = experts_nk.shape
        nn, en = self.nodes, self.node_experts
        stage1, stage2 = self.stages(n)
        _, s2, _ = self.buffers(n)
        s1 = self.pair_rows(n)
        ids_nk, dropped = drop_over_capacity(experts_nk, weights_nk, self.seq_len, self.cfg, self.exe)
        node, loc = self._where()
        with jax.named_scope("dispatch"):
            node_nk = ids_nk // en  # Nn for a dropped assignment
            present_nd = jnp.any(node_nk[:, :, None] == jnp.arange(nn, dtype=node_nk.dtype), axis=1)
            # (token, node) pairs, token major, sorted by node; pairs without an expert sort last
            key_p = jnp.where(present_nd, jnp.arange(nn, dtype=jnp.int32)[None], nn).reshape(-1)
            pairs = sort_by_group(key_p, nn)
            counts1, starts1, counts2, overflow = self._counts(n, ids_nk, pairs.starts_g)
            token_q, node_q = pairs.order_a[:s1] // nn, pairs.order_a[:s1] % nn
            # what the node needs of the token: its node-local expert ids (En: elsewhere) and weights
            lid_qk = jnp.where(node_nk[token_q] == node_q[:, None], ids_nk[token_q] - node_q[:, None] * en,
                               en)
            side_qm = jnp.concatenate([lid_qk.astype(jnp.float32), weights_nk[token_q].astype(jnp.float32)],
                                      axis=1)
            x_rd, side_rm = stage1.dispatch(x_nd[token_q], side_qm, counts1, starts1, node, key_p)
            # Tagged for remat (model/transformer.py, "save_a2a"): what the backward pass reads of the
            # exchanges, so that it reruns none. Stage 1's rows are not kept: only stage 2's operand
            # reads them, and the backward pass needs neither (the exchanges' VJPs keep only shapes).
            side_rm = checkpoint_name(side_rm, A2A_DISPATCH)
            got_r = stage1.received(counts1, node)
            lid_rk = jnp.where(got_r[:, None], jnp.round(side_rm[:, :k]).astype(jnp.int32), en)
            w_rk = side_rm[:, k:]
            # stage 2: the received (row, choice) assignments by node-local expert = by receiver
            srt = sort_by_group(lid_rk.reshape(-1), en)
            counts2_sd = counts2.sum(axis=2)
            plan2, starts_l = self._plan2(counts2, loc)
            recv2, _ = stage2.dispatch(x_rd[srt.order_a[:s2.rows] // k], None, counts2_sd,
                                       self._starts2(counts2), loc, lid_rk, plan2)
            recv2 = checkpoint_name(recv2, A2A_DISPATCH)
        with jax.named_scope("experts"):
            rows2 = stage2.rows
            per_expert = min(self.ranks * rows_per_expert(n, self.seq_len, self.cfg, self.exe), rows2)
            if plan2 is not None:  # ragged: the receive buffer is expert-major already
                back_rd = grouped_ffn(recv2, starts_l, w_gate, w_up, w_down, self.matmul, per_expert,
                                      self.swiglu)  # type: ignore[arg-type]
            else:
                rg = _regroup(counts2[:, loc], stage2.blocks(counts2_sd)[:, loc], rows2)
                back_rd = _expert_ffn(self.matmul, self.swiglu, per_expert, recv2, rg, w_gate, w_up, w_down)
        if self.exe.capacity_factor > 0:  # equal tokens per shard: the mean of means is the global mean
            dropped = jax.lax.pmean(dropped, BATCH_AXES)
        state = _NodeState(present_nd & ~overflow, pairs.inv_a, pairs.order_a[:s1], lid_rk, w_rk, srt.inv_a,
                           srt.order_a[:s2.rows],
                           counts1[None], starts1[None], counts2[None], overflow.astype(jnp.int32)[None])
        return back_rd, state, dropped, state.overflow

    def combine(self, back_rd: jax.Array, st: _NodeState, after_nd: jax.Array) -> jax.Array:
        """Both Combine stages and the sums: [N, D] (the rows of `after_nd`'s dtype)."""
        n, nn = st.present_nd.shape
        en, el, lr = self.node_experts, self.local, self.per_node
        stage1, stage2 = self.stages(n)
        _, s2, _ = self.buffers(n)
        counts1, starts1, counts2 = st.counts1[0], st.starts1[0], st.counts2[0]
        node, loc = self._where()
        with jax.named_scope("combine"):
            # stage 2 back to the intermediate, in its sorted order: [S2, D]
            dest_a = None
            if self.exchange == "padded":
                dest_a = jnp.minimum(st.lid_rk.reshape(-1)[st.order_a] // el, lr - 1)
            y_ad = stage2.combine(back_rd, counts2.sum(axis=2), self._starts2(counts2), loc, s2.rows, dest_a,
                                  st.lid_rk, after=after_nd, plan=self._plan2(counts2, loc)[0])
            # kept for remat: the partial sums' backward reads it (the stage-1 Combine's result is
            # read by nothing in the backward pass, so it is not kept)
            y_ad = checkpoint_name(y_ad, A2A_COMBINE)
            valid_a = (st.lid_rk.reshape(-1) < en) & (st.inv_a < s2.rows) & (st.overflow[0] == 0)
            partial_rd = _partial_sums(y_ad, st.w_rk, st.inv_a, st.order_a, valid_a)
            # stage 1: one partial sum per (token, node) back to the source, in its sorted pair order
            back_qd = stage1.combine(partial_rd, counts1, starts1, node, st.order_q.shape[0],
                                     st.order_q % nn if self.exchange == "padded" else None, st.lid_rk)
            # absent pairs read past the end (unique slots): no row, and no gradient scattered to one.
            # Present pairs fill the first sorted rows one-to-one, so the gradient is a gather through
            # the inverse (each sorted row's pair, or past the end where that pair is absent).
            s1 = back_qd.shape[0]
            present_p = st.present_nd.reshape(-1)
            slot_p = jnp.where(present_p, st.inv_p, s1 + jnp.arange(n * nn, dtype=jnp.int32))
            inverse_q = jnp.where(present_p[st.order_q], st.order_q, n * nn + jnp.arange(s1, dtype=jnp.int32))
            parts = permute_rows(back_qd, slot_p, inverse_q).reshape(n, nn, -1)
            parts = jnp.where(st.present_nd[..., None], parts, 0).astype(jnp.float32)
            return jnp.sum(parts, axis=1).astype(back_rd.dtype)


@jax.custom_vjp
def _partial_sums(y_ad: jax.Array, w_rk: jax.Array, inv_a: jax.Array, order_a: jax.Array,
                  valid_a: jax.Array) -> jax.Array:
    """[R, D]: each received row's router-weighted sum of its node's expert outputs, in the flat
    path's order (`weighted_sum`: fp32 products and sum); y_ad [S, D] holds the outputs in stage-2
    sorted order, assignment a = (row, choice) at sorted row inv_a[a] (valid_a), order_a its inverse.

    Why a custom VJP: the forward reads R K slots (every choice of every received row, most of them
    on other nodes), and autodiff's transpose scatter-adds R K rows, the invalid ones onto one
    clamped row; the valid assignments are a bijection onto the S sorted rows, so the backward
    gathers S rows instead (cotangents of y and of the weights), no scatter of rows at all."""
    r, k = w_rk.shape
    y_rkd = y_ad[jnp.minimum(inv_a, y_ad.shape[0] - 1)].reshape(r, k, -1)
    return weighted_sum(y_rkd, valid_a.reshape(r, k), w_rk)


def _partial_sums_fwd(y_ad: jax.Array, w_rk: jax.Array, inv_a: jax.Array, order_a: jax.Array,
                      valid_a: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _partial_sums(y_ad, w_rk, inv_a, order_a, valid_a), (y_ad, w_rk, order_a, valid_a)


def _partial_sums_bwd(res: tuple[jax.Array, ...], ct_rd: jax.Array) -> tuple[jax.Array | None, ...]:
    y_ad, w_rk, order_a, valid_a = res
    r, k = w_rk.shape
    ok_a = valid_a[order_a]  # sorted row -> its assignment is a valid one
    ct_ad = ct_rd[order_a // k].astype(jnp.float32)
    w_a = jnp.where(ok_a, w_rk.reshape(-1)[order_a], 0.0)
    d_y = jnp.where(ok_a[:, None], ct_ad * w_a[:, None], 0.0).astype(y_ad.dtype)
    dw_a = jnp.where(ok_a, jnp.sum(ct_ad * y_ad.astype(jnp.float32), axis=1), 0.0)
    d_w = jnp.zeros(r * k, jnp.float32).at[order_a].set(dw_a, mode="drop", unique_indices=True)
    return d_y, d_w.reshape(r, k).astype(w_rk.dtype), None, None, None


_partial_sums.defvjp(_partial_sums_fwd, _partial_sums_bwd)


def node_aware_routed(mesh: Mesh, expert_per_node: int, cfg: ModelConfig, bounded_exe: ExecutionConfig,
                      exchange: str, matmul: str, swiglu: str,
                      x_nd: jax.Array, routing: Routing, experts: RoutedExperts,
                      shared_fn: SharedFn | None
                      ) -> tuple[jax.Array, dict[str, jax.Array], jax.Array | None]:
    """`ExpertParallel.routed_with_shared` with the two-stage exchange (`bounded_exe`: the execution
    config its buffers are sized by, `dispatch.buffer_config`)."""
    ep = _NodeShard(cfg, bounded_exe, mesh.shape[AXIS] // expert_per_node, expert_per_node, routing.seq_len,
                    exchange, matmul, swiglu)
    tokens, expert_spec = P(BATCH_AXES), P(AXIS, None, None)
    smap = functools.partial(jax.shard_map, mesh=mesh)
    w_gld = (experts.w_gate[...], experts.w_up[...], experts.w_down[...])
    back_rd, state, dropped, overflow = smap(
        ep.dispatch_experts, in_specs=(tokens, tokens, tokens, expert_spec, expert_spec, expert_spec),
        out_specs=(tokens, tokens, P(), tokens))(x_nd, routing.weights_nk, routing.experts_nk, *w_gld)
    shared = None if shared_fn is None else shared_fn(x_nd)
    routed = smap(ep.combine, in_specs=(tokens, tokens, tokens), out_specs=tokens)(
        back_rd, state, x_nd if shared is None else shared)
    return routed, {"dropped_fraction": dropped, "moe_overflow": overflow}, shared


def stage_rows(cfg: ModelConfig, exe: ExecutionConfig, tokens: int, expert: int, expert_per_node: int,
               seq_len: int, exchange: str = "ragged") -> dict[str, int]:
    """The node-aware exchange's static rows per rank for `tokens` tokens per source (for reports
    and tests): stage-1 send / receive, stage-2 send / receive."""
    shard = _NodeShard(cfg, exe, expert // expert_per_node, expert_per_node, seq_len, exchange, "ragged")
    b1, s2, b2 = shard.buffers(tokens)
    stage1, stage2 = shard.stages(tokens)
    return {"send1": shard.pair_rows(tokens), "recv1": stage1.rows, "send2": s2.rows, "recv2": stage2.rows,
            "worst_recv1": b1.worst, "worst_send2": s2.worst, "worst_recv2": b2.worst}


__all__ = ["expected_nodes_per_token", "node_aware_routed", "node_groups", "stage_rows"]
