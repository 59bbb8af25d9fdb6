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
                chunk_size: int, token_ndim: int, mesh: Mesh | None = None, grad_dtype: Any = None, *,
                wrt_weights: tuple[int, ...], wrt_tokens: tuple[int, ...]) -> Array:
    """sum over sequence chunks of `body(weights, *chunk_of_each_token_array)`, differentiable with
    respect to `weights[i]` for i in `wrt_weights` and `token_arrays[j]` for j in `wrt_tokens`; the
    others (a frozen teacher, ids, masks) get a zero gradient.

    `chunk_size` positions of every sequence per chunk. Under differentiation each chunk's
    gradient is taken in the forward pass, right after its value (`_sum_and_grads`), and the
    backward pass only scales those by the sum's cotangent: the [rows, chunk, vocab] logits are
    computed once per step, never held for more than one chunk, and never rebuilt. (Recomputing
    them in the backward, as `jax.checkpoint` on the body did, ran the LM-head matmuls of the
    student and of the teacher again, with both softmaxes: est. 19.6 of the 415.7 ms of serial
    compute of an 8-MI300X FCSD step, 10.5 of them matmul; BENCHMARKS K28.) The cost: the
    gradients wait in memory from the loss to the backward pass (the head's and the hidden
    states', 0.5 GiB at DSV2-Lite's shapes). Padded positions must contribute 0 (pass a mask).

    `mesh` (the batch split over its BATCH_AXES; `parallel.grad_sync.batch_mesh`): each device sums
    its own rows, and the gradient of `weights` (the LM heads) adds up over the chunks on each
    device in `grad_dtype` (the hidden states' compute dtype; None: the weights' own) and crosses
    the devices once, in it, instead of once per chunk in fp32 (`farskip_jax.parallel.grad_sync`).
    """

    def local(w: tuple[Array, ...], arrays: tuple[Array, ...]) -> Array:
        summed = _chunk_sum_with_grads(body, (len(w), len(arrays)), wrt_weights, wrt_tokens, chunk_size,
                                       token_ndim)
        return summed(w, arrays)

    return per_batch_shard(local, mesh, weights, token_arrays, sum_outputs=True,
                           grad_dtype=grad_dtype)


def _chunk_sum_with_grads(body: Callable[..., Array], counts: tuple[int, int], wrt_weights: tuple[int, ...],
                          wrt_tokens: tuple[int, ...], chunk_size: int, token_ndim: int
                          ) -> Callable[[tuple[Array, ...], tuple[Array, ...]], Array]:
    """`(weights, token_arrays) -> sum of body over chunks` (`counts`: how many of each), whose
    gradient is computed with the value."""

    def value(w: tuple[Array, ...], arrays: tuple[Array, ...]) -> Array:
        chunked, _ = _chunked_inputs(arrays, chunk_size, token_ndim)
        return jnp.sum(jax.lax.map(lambda xs: body(w, *xs).astype(jnp.float32), chunked))

    def value_and_grads(w: tuple[Array, ...], arrays: tuple[Array, ...]) -> tuple[Array, Any]:
        chunked, chunk = _chunked_inputs(arrays, chunk_size, token_ndim)
        total, w_grads, chunk_grads = _sum_and_grads(body, w, chunked, wrt_weights, wrt_tokens)
        token_shape = arrays[0].shape[:token_ndim]
        token_grads = tuple(unchunk(g, token_shape, chunk) for g in chunk_grads)
        return total, (w_grads, token_grads)

    def scaled(grads: Any, ct: Array) -> tuple[tuple[Array | None, ...], tuple[Array | None, ...]]:
        w_grads, token_grads = grads
        w_out: list[Array | None] = [None] * counts[0]
        t_out: list[Array | None] = [None] * counts[1]
        for i, g in zip(wrt_weights, w_grads, strict=True):
            w_out[i] = (ct * g.astype(jnp.float32)).astype(g.dtype)
        for j, g in zip(wrt_tokens, token_grads, strict=True):
            t_out[j] = (ct * g.astype(jnp.float32)).astype(g.dtype)
        return tuple(w_out), tuple(t_out)

    fn = jax.custom_vjp(value)
    fn.defvjp(value_and_grads, scaled)
    return fn


def _sum_and_grads(body: Callable[..., Array], weights: tuple[Array, ...], chunked: tuple[Array, ...],
                   wrt_weights: tuple[int, ...], wrt_tokens: tuple[int, ...]
                   ) -> tuple[Array, tuple[Array, ...], tuple[Array, ...]]:
    """The sum over chunks of `body`, its gradient with respect to the selected weights (added up
    over the chunks in each weight's dtype) and to the selected token chunks ([n_chunks, ...])."""

    def chunk_vjp(xs: tuple[Array, ...]) -> tuple[Array, tuple[Array, ...], tuple[Array, ...]]:
        def of_selected(w_sel: tuple[Array, ...], x_sel: tuple[Array, ...]) -> Array:
            w, x = list(weights), list(xs)
            for i, v in zip(wrt_weights, w_sel, strict=True):
                w[i] = v
            for j, v in zip(wrt_tokens, x_sel, strict=True):
                x[j] = v
            return body(tuple(w), *x).astype(jnp.float32)

        val, vjp = jax.vjp(of_selected, tuple(weights[i] for i in wrt_weights),
                           tuple(xs[j] for j in wrt_tokens))
        w_grads, x_grads = vjp(jnp.ones_like(val))  # ones_like: varying over the mesh as val is
        return val, w_grads, x_grads

    def step(acc_w: tuple[Array, ...], xs: tuple[Array, ...]
             ) -> tuple[tuple[Array, ...], tuple[Array, tuple[Array, ...]]]:
        val, w_grads, x_grads = chunk_vjp(xs)
        return tuple(a + g for a, g in zip(acc_w, w_grads, strict=True)), (val, x_grads)

    # zeros_like: the accumulators vary over a mesh where the weights do, as the loop's results will.
    start = tuple(jnp.zeros_like(weights[i]) for i in wrt_weights)
    w_acc, (values, x_grads) = jax.lax.scan(step, start, chunked)
    total = jnp.sum(values)
    return total, w_acc, x_grads


def unchunk(y: Array, token_shape: tuple[int, ...], chunk: int) -> Array:
    """[n_chunks, R, chunk, *f] (as `seq_chunks` made it) -> [*token_shape, *f], padding dropped."""
    y = jnp.moveaxis(y, 0, 1)
    y = y.reshape(y.shape[0], y.shape[1] * chunk, *y.shape[3:])[:, :token_shape[-1]]
    return y.reshape(*token_shape, *y.shape[2:])


def chunked_map(body: Callable[..., Any], token_arrays: tuple[Array, ...], chunk_size: int,
                token_ndim: int) -> Any:
    """`body` applied per sequence chunk, outputs reassembled to the token shape (no gradient use).

    Each output leaf of `body` is [R, chunk, *features]; the result leaf is [*token_shape, *features].
    """
    token_shape = token_arrays[0].shape[:token_ndim]
    chunked, chunk = _chunked_inputs(token_arrays, chunk_size, token_ndim)
    out = jax.lax.map(lambda xs: body(*xs), chunked)
    return jax.tree.map(lambda y: unchunk(y, token_shape, chunk), out)
