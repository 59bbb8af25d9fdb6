"""Sequence-axis chunking and the LM-head matmul shared by the losses, evaluation and the teacher top-k.

Everything that turns final hidden states into vocabulary-sized values works on chunks of
`chunk` positions of every sequence at a time, never on chunks of the flattened token axis: the
batch axis is sharded over (data, expert), and a chunk of flattened tokens would span every
device's rows, so XLA would all-gather the activations of the whole batch before each chunk and
every device would compute the LM head for all of them (8x the work under EP=8). A chunk along
the sequence keeps each device's rows where they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from farskip_jax.parallel.grad_sync import per_batch_shard

Array = jax.Array


def lm_logits(hidden: Array, head: Array) -> Array:
    """`hidden @ head` in the hidden states' (compute) dtype with fp32 accumulation, fp32 result.

    The head is cast to the compute dtype, as `Transformer.logits` does: the fp32-master student
    and the bf16 teacher then compute logits the same way (with connectivity off and equal weights
    their KL is exactly 0), and a bf16 model runs its largest matmul on the bf16 tensor-core path.
    fp32 accumulation keeps the softmax over a 100k vocabulary from seeing bf16 summation error.
    """
    return jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)


def rows_by_positions(x: Array, token_ndim: int) -> Array:
    """[*lead, T, *features] -> [R, T, *features] with R = prod(lead) (R = 1 for 1-D token arrays)."""
    tok = x.shape[:token_ndim]
    rows = 1
    for s in tok[:-1]:
        rows *= s
    return x.reshape(rows, tok[-1], *x.shape[token_ndim:])


def seq_chunks(x: Array, chunk: int) -> Array:
    """[R, T, ...] -> [n_chunks, R, chunk, ...], zero-padding T to a multiple of `chunk`."""
    t = x.shape[1]
    pad = (-t) % chunk
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], (t + pad) // chunk, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _chunked_inputs(token_arrays: tuple[Array, ...], chunk_size: int, token_ndim: int
                    ) -> tuple[tuple[Array, ...], int]:
    rows = tuple(rows_by_positions(a, token_ndim) for a in token_arrays)
    chunk = max(1, min(chunk_size, rows[0].shape[1]))
    return tuple(seq_chunks(a, chunk) for a in rows), chunk


def chunked_sum(body: Callable[..., Array], weights: tuple[Array, ...], token_arrays: tuple[Array, ...],
                chunk_size: int, token_ndim: int, mesh: Mesh | None = None, grad_dtype: Any = None) -> Array:
    """sum over sequence chunks of `body(weights, *chunk_of_each_token_array)`, recomputed in the
    backward pass.

    `chunk_size` positions of every sequence per chunk. `jax.checkpoint` on the body means the
    scan saves only the chunk inputs as residuals; the [rows, chunk, vocab] logits are rebuilt chunk
    by chunk when the gradient is taken. Padded positions must contribute 0 (pass a mask).

    `mesh` (the batch split over its BATCH_AXES; `parallel.grad_sync.batch_mesh`): each device sums
    its own rows, and the gradient of `weights` (the LM heads) adds up over the chunks on each
    device in `grad_dtype` (the hidden states' compute dtype; None: the weights' own) and crosses
    the devices once, in it, instead of once per chunk in fp32 (`farskip_jax.parallel.grad_sync`).
    """

    def local(w: tuple[Array, ...], arrays: tuple[Array, ...]) -> Array:
        chunked, _ = _chunked_inputs(arrays, chunk_size, token_ndim)
        part = jax.checkpoint(lambda *xs: body(w, *xs))
        return jnp.sum(jax.lax.map(lambda xs: part(*xs).astype(jnp.float32), chunked))

    return per_batch_shard(local, mesh, weights, token_arrays, sum_outputs=True,
                           grad_dtype=grad_dtype)


def chunked_map(body: Callable[..., Any], token_arrays: tuple[Array, ...], chunk_size: int,
                token_ndim: int) -> Any:
    """`body` applied per sequence chunk, outputs reassembled to the token shape (no gradient use).

    Each output leaf of `body` is [R, chunk, *features]; the result leaf is [*token_shape, *features].
    """
    token_shape = token_arrays[0].shape[:token_ndim]
    chunked, chunk = _chunked_inputs(token_arrays, chunk_size, token_ndim)
    out = jax.lax.map(lambda xs: body(*xs), chunked)

    def unchunk(y: Array) -> Array:  # [n, R, chunk, *f] -> [*token_shape, *f]
        y = jnp.moveaxis(y, 0, 1)
        y = y.reshape(y.shape[0], y.shape[1] * chunk, *y.shape[3:])[:, :token_shape[-1]]
        return y.reshape(*token_shape, *y.shape[2:])

    return jax.tree.map(unchunk, out)
