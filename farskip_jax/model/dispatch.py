"""Sort-based token dispatch for the routed experts: permutation, grouped GEMM, un-permutation.

Shape legend as in model/moe.py, plus A = N*K assignments (token, choice) in row-major order,
R rows of an expert-sorted buffer, G groups (the experts a grouped GEMM runs), C rows per group
of the padded buffer, S sequences.

One implementation for every path (one device here, expert and tensor parallel in
farskip_jax.parallel.expert and farskip_jax.parallel.tensor). Functions that read how the model runs
(capacity, buffer factor) take the `ExecutionConfig` (`exe`) beside the `ModelConfig` (`cfg`).
  1. `drop_over_capacity`: with execution.capacity_factor > 0, each (sequence, expert) keeps its
     highest-router-weight assignments; dropped ones get the sentinel id E.
  2. `sort_by_group`: stable argsort of the assignments by expert id; group boundaries come from
     the sorted ids (a segment count, no [A, E] one-hot); the inverse permutation is an int scatter.
  3. `grouped_ffn`: SwiGLU over the sorted rows, `jax.lax.ragged_dot` or a padded [G, C, D] buffer.
  4. `weighted_sum`: expert outputs back in (token, choice) order, summed with the router weights.
Ids >= G (dropped, or owned by another tensor-parallel rank) sort after every group and are
counted in none, so the same code skips them everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model import schedule
from farskip_jax.model.grouped_matmul import blocked_matmul, group_of_rows, tokamax_ragged_dot
from farskip_jax.model.swiglu_rows import SwigluKernel, swiglu_ffn, swiglu_rows
from farskip_jax.platforms import device_family

ExpertMatmul = Literal["ragged", "tokamax", "padded", "blocked"]

# checkpoint_name tags of the expert-parallel all-to-all outputs (parallel/expert.py);
# execution.remat="save_a2a" (model/transformer.py) saves exactly these.
A2A_COUNTS, A2A_DISPATCH, A2A_COMBINE = "a2a_counts", "a2a_dispatch", "a2a_combine"
A2A_NAMES = (A2A_COUNTS, A2A_DISPATCH, A2A_COMBINE)


def resolve_matmul(mode: str, device: Any, dtype: str = "bfloat16") -> ExpertMatmul:
    """expert_matmul "auto": ragged on ROCm, tokamax on CUDA (bf16/fp16; its Mosaic kernel takes no
    fp32, which gets ragged), blocked on CPU (BENCHMARKS.md). `dtype`: the compute dtype.

    Each computes only the rows the groups really hold: on ROCm ragged_dot lowers to hipBLASLt's
    grouped GEMM; on CUDA it lowers to a dense masked matmul over every group (8x the FLOPs per
    DSV2-Lite EP=8 layer), so CUDA gets tokamax's Mosaic GPU kernel instead; on XLA:CPU ragged_dot is
    masked-dense too and "blocked" (model/grouped_matmul.py) does only the real rows. GPUs do not
    get "blocked": its while loop is opaque to XLA's latency-hiding scheduler.
    """
    if mode == "auto":
        family = device_family(device)
        if family == "cpu":
            return "blocked"
        return "tokamax" if family == "cuda" and dtype in ("bfloat16", "float16") else "ragged"
    if mode not in ("ragged", "tokamax", "padded", "blocked"):
        raise ValueError(f"expert_matmul={mode!r}: expected 'auto', 'ragged', 'tokamax', 'padded' "
                         "or 'blocked'")
    return mode  # type: ignore[return-value]


class MoeBuffer(NamedTuple):
    """Rows of one rank's routed-expert buffer (`moe_buffer`)."""

    rows: int  # what the buffer holds
    worst: int  # what the worst case needs: `rows` can never overflow when they are equal
    balanced: float  # what balanced routing fills

    @property
    def bounded(self) -> bool:
        return self.rows < self.worst


def moe_buffer(cfg: ModelConfig, exe: ExecutionConfig, tokens: int, ranks: int, seq_len: int,
               sources: int = 1) -> MoeBuffer:
    """The rows a rank's routed-expert buffer needs for `sources` senders of `tokens` tokens each, when
    the `cfg.n_routed_experts` experts are split over `ranks` ranks (the one place that sizes them:
    expert and tensor parallelism, the inspector's cost model).

    Expert parallelism: a rank's receive buffer (`sources` = ranks, each holding `tokens`) or one
    source's slot in it (`sources` = 1, the padded exchange's per-destination buffers). Tensor
    parallelism: every rank sees the same `tokens` (`sources` = 1). Worst case: a token's K experts are
    distinct, so at most min(K, L) of its rows reach one rank, and with a capacity each local expert
    takes at most `rows_per_expert`. Balanced: tokens * K / ranks per source. The bound is
    `exe.moe_buffer_factor` x balanced, rounded up to 8 rows, capped by the worst case (factor 0: the
    worst case).
    """
    k, local = cfg.num_experts_per_tok, cfg.n_routed_experts // ranks
    worst = sources * min(tokens * min(k, local), local * rows_per_expert(tokens, seq_len, cfg, exe))
    return bounded_buffer(exe, sources * tokens * k / ranks, worst)


def bounded_buffer(exe: ExecutionConfig, balanced: float, worst: int) -> MoeBuffer:
    """`exe.moe_buffer_factor` x `balanced` rows, rounded up to 8, at most `worst` (factor 0: `worst`):
    the sizing rule of every bounded routed-expert buffer (`moe_buffer`, and the node-aware
    exchange's stages in parallel/node_aware.py)."""
    if exe.moe_buffer_factor <= 0:
        return MoeBuffer(worst, worst, balanced)
    bound = 8 * math.ceil(math.ceil(exe.moe_buffer_factor * balanced) / 8)
    return MoeBuffer(min(worst, bound), worst, balanced)


def buffer_config(exe: ExecutionConfig, bounded: bool) -> ExecutionConfig:
    """`exe` as a parallel strategy sizes its routed-expert buffers: its own `moe_buffer_factor`
    (bounded), or the worst case (the program an overflowed call is re-run with)."""
    return exe if bounded or exe.moe_buffer_factor == 0 else dataclasses.replace(exe, moe_buffer_factor=0.0)


def balanced_grouped_fill(cfg: ModelConfig, exe: ExecutionConfig, mesh: dict[str, int], expert_parallel: bool,
                          tokens: int, seq_len: int) -> float:
    """The fraction of a grouped GEMM's static rows that hold tokens when routing is balanced.

    ``tokens``: per device under expert parallelism (``expert_parallel``), per TP group otherwise.
    The rows are what `moe_buffer` sizes: EP, a rank's receive buffer from its G sources
    (ragged exchange: the GPU path); TP, a rank's share of the N*K sorted assignments (bounded by
    the same rule; without a bound, all N*K rows are the GEMM's static rows and 1/G of them fill).
    """
    if expert_parallel:
        g = mesh.get("expert", 1)
        buf = moe_buffer(cfg, exe, tokens, g, seq_len, sources=g)
        return min(1.0, buf.balanced / buf.rows)
    g = mesh.get("tensor", 1)
    buf = moe_buffer(cfg, exe, tokens, g, seq_len)
    rows = buf.rows if buf.bounded else tokens * cfg.num_experts_per_tok
    return min(1.0, buf.balanced / rows)


def expert_capacity(seq_len: int, cfg: ModelConfig, exe: ExecutionConfig) -> int:
    """Assignments each expert keeps per sequence: ceil(cf * T * K / E) with cf =
    `exe.capacity_factor`; 0 means dropless."""
    if exe.capacity_factor <= 0:
        return 0
    c = math.ceil(exe.capacity_factor * seq_len * cfg.num_experts_per_tok / cfg.n_routed_experts)
    return max(1, min(c, seq_len))  # an expert sees each token at most once


def rows_per_expert(num_tokens: int, seq_len: int, cfg: ModelConfig, exe: ExecutionConfig) -> int:
    """Most rows `num_tokens` tokens (whole sequences) can send one expert: the padded buffer's C."""
    cap = expert_capacity(seq_len, cfg, exe)
    return num_tokens if cap == 0 else (num_tokens // seq_len) * cap


def capacity_keep(experts_nk: jax.Array, weights_nk: jax.Array, seq_len: int, capacity: int) -> jax.Array:
    """Bool [N, K]: within each (sequence, expert) the `capacity` highest-weight assignments.

    One stable sort per sequence by (expert, -weight) over its T*K assignments, which arrive in
    (token, choice) order: equal weights keep token order, and since a token picks an expert at
    most once, ties inside a (sequence, expert) are broken by token index. An assignment's rank in
    its group is its sorted position minus the group's first position (a running max of starts).
    The sort runs along one sequence: local to a device as long as no sequence is split.
    """
    n, k = experts_nk.shape
    s, tk = n // seq_len, seq_len * k
    pos_sa = jnp.broadcast_to(jnp.arange(tk, dtype=jnp.int32), (s, tk))
    e_sorted, _, src_sa = jax.lax.sort(
        (experts_nk.reshape(s, tk), -weights_nk.reshape(s, tk).astype(jnp.float32), pos_sa),
        dimension=1, num_keys=2, is_stable=True)
    is_start = jnp.concatenate([jnp.ones((s, 1), bool), e_sorted[:, 1:] != e_sorted[:, :-1]], axis=1)
    group_first = jax.lax.cummax(jnp.where(is_start, pos_sa, 0), axis=1)
    keep_sorted = pos_sa - group_first < capacity
    keep_sa = jnp.zeros((s, tk), bool).at[jnp.arange(s)[:, None], src_sa].set(keep_sorted)
    return keep_sa.reshape(n, k)


def drop_over_capacity(experts_nk: jax.Array, weights_nk: jax.Array, seq_len: int, cfg: ModelConfig,
                       exe: ExecutionConfig) -> tuple[jax.Array, jax.Array]:
    """(expert ids with dropped assignments set to E, this shard's dropped fraction)."""
    cap = expert_capacity(seq_len, cfg, exe)
    if cap == 0:
        return experts_nk, jnp.zeros((), jnp.float32)
    if experts_nk.shape[0] % seq_len:
        raise ValueError(f"{experts_nk.shape[0]} tokens are not whole sequences of {seq_len}: capacity is "
                         "per sequence, so a sequence must not be split across devices")
    keep_nk = capacity_keep(experts_nk, weights_nk, seq_len, cap)
    ids_nk = jnp.where(keep_nk, experts_nk, cfg.n_routed_experts)
    return ids_nk, 1.0 - jnp.mean(keep_nk.astype(jnp.float32))


def group_starts(sorted_ids: jax.Array, num_groups: int) -> jax.Array:
    """[G + 1]: first sorted row of each group; the last entry is the number of rows in groups."""
    bounds = jnp.arange(num_groups + 1, dtype=sorted_ids.dtype)
    # Binary search (unrolled, log2 R steps over G+1 queries): no [R, G] comparison matrix.
    return jnp.searchsorted(sorted_ids, bounds, side="left", method="scan_unrolled").astype(jnp.int32)


class Sorted(NamedTuple):
    order_a: jax.Array  # [A] sorted row -> assignment index
    inv_a: jax.Array  # [A] assignment index -> sorted row
    starts_g: jax.Array  # [G + 1] group boundaries in sorted rows


def sort_by_group(ids_a: jax.Array, num_groups: int) -> Sorted:
    """Stable sort of the assignments by group id: rows of a group keep (token, choice) order."""
    ids_a = jnp.asarray(ids_a)
    order = jnp.argsort(ids_a, stable=True).astype(jnp.int32)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    return Sorted(order, inv, group_starts(ids_a[order], num_groups))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def place_rows(x_rd: jax.Array, slot_r: jax.Array, slots: int) -> jax.Array:
    """[slots, D]: row r of x at slot_r[r], zeros elsewhere; slots >= `slots` are dropped.

    The valid slots must be unique. Transpose of `take_rows` (a custom VJP pair, so that neither
    direction builds a constant zero buffer; see `schedule.fresh_zeros`).
    """
    return schedule.fresh_zeros(slots, x_rd, slot_r).at[slot_r].set(x_rd, mode="drop", unique_indices=True)


def _place_rows_fwd(x_rd: jax.Array, slot_r: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    return place_rows(x_rd, slot_r, slots), slot_r


def _place_rows_bwd(slots: int, slot_r: jax.Array, ct: jax.Array) -> tuple[jax.Array, None]:
    # a dropped row (slot past the end) got no place, so it gets no gradient
    return jnp.where((slot_r < slots)[:, None], take_rows(ct, slot_r), 0), None


place_rows.defvjp(_place_rows_fwd, _place_rows_bwd)


@jax.custom_vjp
def take_rows(y_sd: jax.Array, slot_r: jax.Array) -> jax.Array:
    """[R, D]: row slot_r[r] of y; a slot past the end reads an arbitrary row of y.

    Rows read past the end must not reach the loss (their cotangent is dropped, not added to the
    row they read): callers use them for rows outside every group, whose outputs are unused.
    """
    return y_sd[jnp.minimum(slot_r, y_sd.shape[0] - 1)]


def _take_rows_fwd(y_sd: jax.Array, slot_r: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    # A zero-width array carries y's row count (a residual must be an array) at no cost; made from
    # the shape, so that a rematerialised backward need not recompute y.
    return take_rows(y_sd, slot_r), (slot_r, jnp.zeros((y_sd.shape[0], 0), y_sd.dtype))


def _take_rows_bwd(res: tuple[jax.Array, jax.Array], ct: jax.Array) -> tuple[jax.Array, None]:
    slot_r, y_rows = res
    return place_rows(ct, slot_r, y_rows.shape[0]), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def permute_rows(y_sd: jax.Array, slot_r: jax.Array, inverse_s: jax.Array) -> jax.Array:
    """`take_rows(y_sd, slot_r)` where slot_r is one-to-one and its inverse is known: inverse_s[s]
    is the row r with slot_r[r] == s, or >= R where no row reads slot s. Same values, same
    gradient (bitwise: each row of it is one cotangent row or zero); the gradient is a gather
    through inverse_s where `take_rows` scatters through slot_r. Why: the expert-parallel path
    moves whole buffers of rows through permutations (the Combine's rows back to their
    assignments, the node-aware Combine's pairs back to their tokens, the padded exchange's
    regrouping), and a scatter of such a buffer costs more than the gather of the same rows
    (XLA's fused [196608, 2048] bf16 scatter priced at 456 us on MI300X, the gather at 304 us;
    BENCHMARKS.md K25)."""
    return take_rows(y_sd, slot_r)


def _permute_rows_fwd(y_sd: jax.Array, slot_r: jax.Array, inverse_s: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    return take_rows(y_sd, slot_r), inverse_s


def _permute_rows_bwd(inverse_s: jax.Array, ct: jax.Array) -> tuple[jax.Array, None, None]:
    rows = ct.shape[0]
    return jnp.where((inverse_s < rows)[:, None], ct[jnp.minimum(inverse_s, rows - 1)], 0), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def padded_ffn(x_rd: jax.Array, slot_r: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               rows_per_group: int) -> jax.Array:
    """SwiGLU of rows placed at given slots of a [G, C, D] buffer (C = `rows_per_group`): [R, D].

    Row r goes to flat slot slot_r[r] = group * C + position in group (unique); rows with slots
    >= G*C belong to no group, are not computed and give unspecified outputs. Rows need not be
    sorted: the expert-parallel path places its receive buffer directly.
    """
    dt = x_rd.dtype
    wg, wu, wd = w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt)
    g, c, d = wg.shape[0], rows_per_group, x_rd.shape[-1]
    x_gcd = place_rows(x_rd, slot_r, g * c).reshape(g, c, d)
    h = jax.nn.silu(jnp.einsum("gcd,gdf->gcf", x_gcd, wg)) * jnp.einsum("gcd,gdf->gcf", x_gcd, wu)
    y_gcd = jnp.einsum("gcf,gfd->gcd", h, wd)
    return take_rows(y_gcd.reshape(g * c, d), slot_r)


def grouped_ffn(x_rd: jax.Array, starts_g: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, matmul: ExpertMatmul, rows_per_group: int,
                swiglu: SwigluKernel = "xla") -> jax.Array:
    """SwiGLU silu(x Wg) * (x Wu) Wd of each group's rows with that group's weights: [R, D].

    "ragged" / "tokamax": three jax.lax.ragged_dot / tokamax_ragged_dot over the sorted rows (the groups
    start at row 0: `starts_g[0] == 0`), the activation between them by `swiglu`
    (model/swiglu_rows.py: "pallas_triton" computes only the rows in the groups; with tokamax the
    three GEMMs and the kernels are one op, `swiglu_ffn`). "blocked": three blocked_matmul
    (model/grouped_matmul.py, blocks of real rows in a loop; rows past the last group give 0).
    "padded": each row placed at its (group, position in group) of a [G, C, D] buffer (C =
    `rows_per_group`, the most a group can hold), a batched einsum, and the results gathered back
    (`padded_ffn`). The placement is a scatter of the R rows rather than a gather of G*C slots, so
    that the backward pass gathers R rows instead of scatter-adding G*C (bench/dispatch_bench.py).
    Rows past the last group are unspecified.
    """
    dt = x_rd.dtype
    wg, wu, wd = w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt)
    if matmul in ("ragged", "tokamax"):
        dot = jax.lax.ragged_dot if matmul == "ragged" else tokamax_ragged_dot
        sizes_g = jnp.diff(starts_g)
        if matmul == "tokamax" and swiglu == "pallas_triton":  # no pass over the whole buffer: swiglu_rows
            return swiglu_ffn(x_rd, wg, wu, wd, sizes_g)
        gate, up = dot(x_rd, wg, sizes_g), dot(x_rd, wu, sizes_g)
        return dot(swiglu_rows(gate, up, starts_g[-1], swiglu), wd, sizes_g)
    if matmul == "blocked":
        h = jax.nn.silu(blocked_matmul(x_rd, wg, starts_g)) * blocked_matmul(x_rd, wu, starts_g)
        return blocked_matmul(h, wd, starts_g)
    if matmul != "padded":
        raise ValueError(f"expert_matmul={matmul!r}: expected 'ragged', 'tokamax', 'padded' or 'blocked'")
    r = x_rd.shape[0]
    g, c = w_gate.shape[0], rows_per_group
    rows = jnp.arange(r, dtype=jnp.int32)
    group_r = group_of_rows(starts_g, rows)
    slot_r = rows - starts_g[jnp.minimum(group_r, g - 1)]
    # Rows outside every group go past the buffer (dropped), still unique.
    slot_flat_r = jnp.where((group_r < g) & (slot_r < c), group_r * c + slot_r, g * c + rows)
    return padded_ffn(x_rd, slot_flat_r, w_gate, w_up, w_down, c)


def weighted_sum(y_nkd: jax.Array, valid_nk: jax.Array, weights_nk: jax.Array) -> jax.Array:
    """DeepSeek's order: each expert output times its fp32 router weight, summed over K in fp32.

    Invalid (dropped or foreign) rows are selected away, not multiplied by 0: they may hold
    anything, and a dropped assignment's routed output must be exactly zero.
    """
    y = jnp.where(valid_nk[..., None], y_nkd, 0).astype(jnp.float32)
    w = jnp.where(valid_nk, weights_nk, 0.0).astype(jnp.float32)
    return jnp.sum(y * w[..., None], axis=1).astype(y_nkd.dtype)


def routed_experts(x_nd: jax.Array, ids_nk: jax.Array, weights_nk: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, matmul: ExpertMatmul,
                   rows_per_group: int, rows: int | None = None, swiglu: SwigluKernel = "xla"
                   ) -> jax.Array:
    """Routed output [N, D] of the assignments to experts 0..G-1 of `w_*`; ids >= G are skipped.

    `rows`: compute only the first `rows` expert-sorted rows (the assignments to experts 0..G-1 sort
    first; tensor parallelism bounds each rank's share by `moe_buffer`). Assignments sorted past it
    get no output, so a caller that bounds must check the count itself (`local_rows`) and treat a
    larger one as an overflow."""
    n, k = ids_nk.shape
    num_groups = w_gate.shape[0]
    srt = sort_by_group(ids_nk.reshape(-1), num_groups)
    starts_g, order_a = srt.starts_g, srt.order_a
    if rows is not None and rows < order_a.shape[0]:
        order_a, starts_g = order_a[:rows], jnp.minimum(starts_g, rows)
        rows_per_group = min(rows_per_group, rows)
    y_rd = grouped_ffn(x_nd[order_a // k], starts_g, w_gate, w_up, w_down, matmul, rows_per_group, swiglu)
    r = order_a.shape[0]
    kept = (ids_nk < num_groups) & (srt.inv_a < r).reshape(n, k)  # rows past `rows` are selected away
    # sorted row s holds assignment order_a[s]: the inverse of inv_a over the rows computed
    return weighted_sum(permute_rows(y_rd, srt.inv_a, order_a).reshape(n, k, -1), kept, weights_nk)


def local_rows(ids_nk: jax.Array, num_groups: int) -> jax.Array:
    """int32 []: the assignments to groups 0..`num_groups`-1 (the rows `routed_experts` computes)."""
    return jnp.sum((ids_nk >= 0) & (ids_nk < num_groups)).astype(jnp.int32)
