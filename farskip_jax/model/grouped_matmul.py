"""Grouped matmuls x[r] @ w[group of r] over expert-sorted rows, real rows only, beyond XLA's own
`jax.lax.ragged_dot`: blocks of rows in a loop for XLA:CPU (`blocked_matmul`) and tokamax's
Pallas Mosaic GPU kernel for Hopper (`tokamax_ragged_dot`).

Blocked (CPU). Why: on XLA:CPU `jax.lax.ragged_dot` is a masked dense matmul over every group, and
the padded [G, C, D] buffer of model/dispatch.py gives every group C = all rows (dropless), so both
compute G/K times the rows the tokens really send (10.7x for DSV2-Lite top-6 of 64). Here each
group's rows go two ways:
- the head: its first `head` rows (at most; a little over the average group at DSV2-Lite's widths
  on 256 tokens), gathered into a [G, head, D] buffer and multiplied by one batched matmul that
  reads every weight in place;
- the tail: the rest, cut into blocks of `block` rows that each lie inside one group:
  sum_g ceil(tail_g / block) <= R/block + G blocks, a dynamic trip count of one `lax.fori_loop`.
  Each block multiplies its rows by its group's weight slice and writes back only the rows of that
  group (masked), so a block may overhang into the next group's rows without clobbering them.
Why both: a loop block costs a copy of its group's [D, F] weight slice (XLA:CPU materialises a
dynamic slice before a dot) and a dot of few rows; one batched matmul over all groups has neither,
but computes G x head rows whatever the groups hold. With the head near the average group, balanced
routing leaves the loop a few blocks, and under skewed routing the loop computes only the real rows
past the heads (plus at most one block's overhang per group) (BENCHMARKS.md A). The backward pass
(custom VJP) splits the same way: dx and dW of the head as batched matmuls, the tail's blocks in
the loop (dx with the weight slice transposed, dW of each group accumulated block by block onto
the head's).
GPUs do not get it: a while loop is opaque to XLA's latency-hiding scheduler, which would hide
nothing under it.

tokamax (H200). On sm_90 XLA lowers `jax.lax.ragged_dot` to a dense masked dot over every group
(8x the FLOPs at EP8, shared/JAX_012_STACK.md); tokamax's kernel computes the rows of each group
only. Its own VJP cannot be used inside our expert-parallel shard_map: its backward returns
cotangents without the shard_map's varying-axes type ("the manual axis types do not match"), so
`tokamax_ragged_dot` has its own custom VJP made of the same two kernels (dx: a ragged dot with the
weights transposed; dW: a ragged dot whose contraction runs over the ragged rows) and types its
result like its rows and each cotangent like its primal (a Pallas kernel's outputs vary over no
shard_map axis by type). tokamax picks its kernel from JAX's default device, which a deviceless
compile sets to the target's (xla/aot.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Rows per loop block. DSV2-Lite top-6 of 64 experts on 256 tokens averages 24 rows per expert; a
# group's rows past the head are few under balanced routing (one block) and many only when routing
# is skewed, where larger blocks re-read the group's [D, F] weight slice fewer times.
DEFAULT_BLOCK = 32
# Rows of each group in the batched head: DSV2-Lite top-6 of 64 on 256 tokens averages 24 rows per
# expert, and uniform routing keeps ~90% of the groups within 32 (BENCHMARKS.md A). A constant, not
# a share of the buffer's rows: the bounded and the worst-case buffers (model/dispatch.py
# `moe_buffer`) then run every row through the same shapes, so an overflow's re-run gives the
# bounded program's result bit for bit.
DEFAULT_HEAD = 32


def group_of_rows(starts_g: jax.Array, rows: jax.Array) -> jax.Array:
    """Group of each sorted row; rows past the last group get G."""
    return jnp.searchsorted(starts_g[1:], rows, side="right", method="scan_unrolled").astype(jnp.int32)


class _Layout(NamedTuple):
    """Where each group's head rows are: gathered into [G, head] slots, and back into rows."""

    row_gh: jax.Array  # [G, head] row of each slot (0 where the group has fewer rows)
    filled_gh: jax.Array  # [G, head] whether the slot holds a row
    slot_r: jax.Array  # [R] flat slot (g * head + position) of each head row (0 elsewhere)
    in_head_r: jax.Array  # [R] whether the row is in its group's head
    tail_first_g: jax.Array  # [G] first row of each group's tail (its end when it has none)


def _layout(starts_g: jax.Array, rows: int, head: int) -> _Layout:
    num_groups = starts_g.shape[0] - 1
    position_h = jnp.arange(head, dtype=jnp.int32)
    filled_gh = position_h < jnp.diff(starts_g)[:, None]
    row_gh = jnp.where(filled_gh, starts_g[:-1, None] + position_h, 0)
    row_r = jnp.arange(rows, dtype=jnp.int32)
    # Rows past the last group get the last group here; `in_head_r` leaves them out.
    group_r = jnp.minimum(group_of_rows(starts_g, row_r), num_groups - 1)
    position_r = row_r - starts_g[group_r]
    in_head_r = (row_r < starts_g[-1]) & (position_r < head)
    slot_r = jnp.where(in_head_r, group_r * head + position_r, 0)
    return _Layout(row_gh, filled_gh, slot_r, in_head_r, jnp.minimum(starts_g[:-1] + head, starts_g[1:]))


def _to_slots(a_rk: jax.Array, lay: _Layout) -> jax.Array:
    """[G, head, K]: each group's head rows of `a_rk`, zero in empty slots."""
    return jnp.where(lay.filled_gh[..., None], a_rk[lay.row_gh], 0)


def _to_rows(a_ghk: jax.Array, lay: _Layout) -> jax.Array:
    """[R, K]: each head row's slot of `a_ghk`, zero for the other rows (the loop writes the tail)."""
    g, h, k = a_ghk.shape
    if h == 0:  # no head: a gather from an empty array is not defined
        return jnp.zeros((lay.slot_r.shape[0], k), a_ghk.dtype)
    return jnp.where(lay.in_head_r[:, None], a_ghk.reshape(g * h, k)[lay.slot_r], 0)


def _for_blocks(body: Callable[[Any, jax.Array, jax.Array, jax.Array], Any], init: Any,
                first_g: jax.Array, end_g: jax.Array, rows: int, block: int) -> Any:
    """fori_loop over the blocks covering rows [first_g[g], end_g[g]) of each group g:
    body(carry, group, window start, [block] mask of the block's rows in that range).

    The window is clamped to end at row R (no padded copy of x); the mask then drops the rows before
    the block's first row as well as those past its group's range.
    """
    num_groups = first_g.shape[0]
    blocks_g = (end_g - first_g + block - 1) // block
    last_g = jnp.cumsum(blocks_g)
    i = jnp.arange(-(-rows // block) + num_groups, dtype=jnp.int32)  # the static bound on blocks
    group_i = jnp.minimum(jnp.searchsorted(last_g, i, side="right"), num_groups - 1).astype(jnp.int32)
    first_i = first_g[group_i] + (i - (last_g - blocks_g)[group_i]) * block

    def step(i: jax.Array, carry: Any) -> Any:
        g, first = group_i[i], first_i[i]
        start = jnp.minimum(first, rows - block)
        row = start + jnp.arange(block, dtype=jnp.int32)
        return body(carry, g, start, (row >= first) & (row < end_g[g]))

    return jax.lax.fori_loop(0, last_g[-1], step, init)


def _typed_alike(a: jax.Array, *like: jax.Array) -> jax.Array:
    """`a` varying over the shard_map axes any of `like` varies over: a loop carry's type must match
    its body's output, which mixes in x, w and the group bounds (expert-parallel shard_map). A select
    with a constant-true predicate takes each operand's axes (and XLA folds it away)."""
    for b in like:
        other = jnp.broadcast_to(b.reshape(-1)[0].astype(a.dtype), a.shape)
        a = jax.lax.select(jnp.ones(a.shape, bool), a, other)
    return a


def _write(out: jax.Array, new: jax.Array, start: jax.Array, mask: jax.Array) -> jax.Array:
    old = jax.lax.dynamic_slice_in_dim(out, start, new.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], new, old), start, 0)


def _forward(x_rd: jax.Array, w_gdf: jax.Array, starts_g: jax.Array, block: int, head: int) -> jax.Array:
    rows = x_rd.shape[0]
    lay = _layout(starts_g, rows, head)
    y_rf = _to_rows(jnp.einsum("ghd,gdf->ghf", _to_slots(x_rd, lay), w_gdf), lay)

    def body(y: jax.Array, g: jax.Array, start: jax.Array, mask: jax.Array) -> jax.Array:
        xb = jax.lax.dynamic_slice_in_dim(x_rd, start, block)
        return _write(y, xb @ jax.lax.dynamic_index_in_dim(w_gdf, g, keepdims=False), start, mask)

    y0 = _typed_alike(y_rf.astype(jnp.result_type(x_rd, w_gdf)), x_rd, w_gdf, starts_g)
    return _for_blocks(body, y0, lay.tail_first_g, starts_g[1:], rows, block)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocked(x_rd: jax.Array, w_gdf: jax.Array, starts_g: jax.Array, block: int, head: int) -> jax.Array:
    return _forward(x_rd, w_gdf, starts_g, block, head)


def _blocked_fwd(x_rd: jax.Array, w_gdf: jax.Array, starts_g: jax.Array, block: int, head: int):
    return _forward(x_rd, w_gdf, starts_g, block, head), (x_rd, w_gdf, starts_g)


def _blocked_bwd(block: int, head: int, res: tuple[jax.Array, jax.Array, jax.Array], dy_rf: jax.Array):
    x_rd, w_gdf, starts_g = res
    rows = x_rd.shape[0]
    lay = _layout(starts_g, rows, head)
    dy_ghf = _to_slots(dy_rf, lay)
    dx_head = _to_rows(jnp.einsum("ghf,gdf->ghd", dy_ghf, w_gdf), lay)
    # fp32 accumulation across a group's head and blocks (bf16 weights would otherwise round per block).
    dw_head = jnp.einsum("ghd,ghf->gdf", _to_slots(x_rd, lay), dy_ghf, preferred_element_type=jnp.float32)

    def body(carry: tuple[jax.Array, jax.Array], g: jax.Array, start: jax.Array, mask: jax.Array):
        dx, dw = carry
        w_df = jax.lax.dynamic_index_in_dim(w_gdf, g, keepdims=False)
        # Rows outside the group (other groups, or past the last) must not reach this group's dW.
        dyb = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(dy_rf, start, block), 0)
        xb = jax.lax.dynamic_slice_in_dim(x_rd, start, block)
        dx = _write(dx, jnp.einsum("bf,df->bd", dyb, w_df).astype(dx.dtype), start, mask)
        dw_g = jax.lax.dynamic_index_in_dim(dw, g, keepdims=False)
        dw_g = dw_g + jnp.einsum("bd,bf->df", xb, dyb, preferred_element_type=jnp.float32)
        return dx, jax.lax.dynamic_update_index_in_dim(dw, dw_g, g, 0)

    like = (x_rd, w_gdf, starts_g, dy_rf)
    init = (_typed_alike(dx_head.astype(x_rd.dtype), *like), _typed_alike(dw_head, *like))
    dx, dw = _for_blocks(body, init, lay.tail_first_g, starts_g[1:], rows, block)
    return dx, dw.astype(w_gdf.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_matmul(x_rd: jax.Array, w_gdf: jax.Array, starts_g: jax.Array,
                   block: int = DEFAULT_BLOCK, head: int = DEFAULT_HEAD) -> jax.Array:
    """[R, F]: row r of `x_rd` times w[g] for the group g whose rows [starts_g[g], starts_g[g+1])
    hold r; rows past starts_g[G] are 0 (gradients to x and w flow only from rows inside groups).

    `head`: rows of each group in the batched matmul (0: all in the loop), `block`: rows per loop
    block for the rest. Both set the speed, not the result (each row's products are the same; on
    XLA:CPU the values came out bitwise equal, BENCHMARKS.md A)."""
    block = max(1, min(block, x_rd.shape[0]))
    return _blocked(*vary_alike(x_rd, w_gdf, jnp.asarray(starts_g, jnp.int32)), block, max(0, head))


def vary_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each array cast to vary over every shard_map axis any of them varies over. Inside a shard_map
    the custom VJP must return dW typed like w: expert weights replicated over the data axis would
    otherwise get a data-varying dW. With the cast, JAX's own transpose of it sums dW over data."""
    vma = [_varying_axes(a) for a in arrays]
    axes = frozenset().union(*vma)
    return tuple(jax.lax.pcast(a, tuple(sorted(axes - v)), to="varying") if axes - v else a
                 for a, v in zip(arrays, vma, strict=True))


def _varying_axes(a: jax.Array) -> frozenset[str]:
    """The shard_map axes `a` varies over (jax 0.10: aval.manual_axis_type.varying; else aval.vma)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


# ------------------------------------------------------------------------------------- tokamax


def _dims(contract: tuple[tuple[int, ...], tuple[int, ...]], lhs_ragged: int,
          rhs_group: tuple[int, ...]) -> jax.lax.RaggedDotDimensionNumbers:
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contract, ((), ())),
                                             lhs_ragged_dimensions=[lhs_ragged],
                                             rhs_group_dimensions=list(rhs_group))


# x [M, K] . w [G, K, N] -> [M, N]; dx = dy [M, N] . w^T (contract N); dW = x^T dy per group
# (contract the ragged M: the group axis comes out in front).
RAGGED_FWD = _dims(((1,), (1,)), 0, (0,))
RAGGED_DX = _dims(((1,), (2,)), 0, (0,))
RAGGED_DW = _dims(((0,), (0,)), 0, ())


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tokamax(x_md: jax.Array, w_gkn: jax.Array, sizes_g: jax.Array, implementation: str) -> jax.Array:
    import tokamax  # imported on first use: the CPU paths never load it

    y = tokamax.ragged_dot_general(x_md, w_gkn, sizes_g, RAGGED_FWD, implementation=implementation)
    # A Pallas kernel's result comes back typed as varying over no shard_map axis; it varies like its
    # rows. The cast is inside the custom VJP, so JAX never transposes it (that would psum cotangents).
    return typed_like(y, x_md)


def _tokamax_fwd(x_md: jax.Array, w_gkn: jax.Array, sizes_g: jax.Array, implementation: str):
    return _tokamax(x_md, w_gkn, sizes_g, implementation), (x_md, w_gkn, sizes_g)


def _tokamax_bwd(implementation: str, res: tuple[jax.Array, jax.Array, jax.Array], dy_mn: jax.Array):
    import tokamax

    x_md, w_gkn, sizes_g = res
    dx = tokamax.ragged_dot_general(dy_mn, w_gkn, sizes_g, RAGGED_DX, preferred_element_type=x_md.dtype,
                                    implementation=implementation)
    dw = tokamax.ragged_dot_general(x_md, dy_mn, sizes_g, RAGGED_DW, preferred_element_type=w_gkn.dtype,
                                    implementation=implementation)
    # Rows past the last group carry no assignment: their dx is 0 by definition, whatever the kernel
    # leaves there.
    rows = jnp.arange(x_md.shape[0], dtype=jnp.int32)
    dx = jnp.where((rows < jnp.sum(sizes_g))[:, None], dx, 0)
    return typed_like(dx, x_md), typed_like(dw, w_gkn), np.zeros(sizes_g.shape, jax.dtypes.float0)


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)


def typed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """`ct` varying over exactly the shard_map axes `primal` varies over (a cotangent's type must be
    its primal's). The arguments were cast alike before the call (`vary_alike`), so at most a cast up
    is needed."""
    missing = tuple(sorted(_varying_axes(primal) - _varying_axes(ct)))
    return jax.lax.pcast(ct, missing, to="varying") if missing else ct


def tokamax_ragged_dot(x_md: jax.Array, w_gkn: jax.Array, sizes_g: jax.Array,
                       implementation: str = "mosaic") -> jax.Array:
    """[M, N]: row r of `x_md` times w[g] for the group g whose rows (consecutive, `sizes_g` [G] of them
    from row 0) hold r; rows past sum(sizes_g) are unspecified (callers never read them) and get no
    gradient. `implementation`: tokamax's ("mosaic" on Hopper; "xla" runs anywhere, which is how the
    CPU tests check this function's VJP and types)."""
    x_md, w_gkn, sizes_g = vary_alike(x_md, w_gkn, jnp.asarray(sizes_g, jnp.int32))
    return _tokamax(x_md, w_gkn, sizes_g, implementation)
