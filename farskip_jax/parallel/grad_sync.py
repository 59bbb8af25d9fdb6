"""Gradients of replicated weights summed over the batch devices once, in the compute dtype.

Under jit, XLA's partitioner sums a replicated weight's gradient over the batch devices at the op
that produces it, in that op's output dtype: for most weights the bf16 dot of each use (with the
model's bf16 copy of the weight, `train.step.StepShardings.to_compute`, the uses add up first).
Two weights were different (BENCHMARKS K15):

- the LM head: its gradient comes from one dot per loss chunk (`train.chunking.chunked_sum`),
  whose output is fp32 (the logits accumulate in fp32), so each step reduce-scattered it once per
  chunk, in fp32: 4 x 4 bytes per parameter where one sum in bf16 moves 2;
- the embedding: its gradient is a scatter-add into fp32, reduce-scattered in fp32.

On the DeepSeek-V3 EP64 slice those two were 17.0 of the step's 18.8 GiB of gradient traffic per
GPU. `per_batch_shard` computes such a function on each device's own tokens (a shard_map over the
batch axes), lets the partial gradients of its weights add up on each device, and sums them over
the devices once, in `grad_dtype`, when the backward pass leaves the shard_map.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.parallel.mesh import BATCH_AXES


def batch_mesh(parallel: Any) -> Mesh | None:
    """The mesh of a parallelism that splits the batch over BATCH_AXES (expert parallel training)
    across more than one device; None for one device or a tensor-parallel (replicated batch) one."""
    mesh = getattr(parallel, "mesh", None)
    if mesh is None or math.prod(mesh.shape[a] for a in BATCH_AXES) == 1:
        return None
    return mesh


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _varying_summed_in(w: jax.Array, local_dtype: Any) -> jax.Array:
    """`w` made per-device and cast to `local_dtype`; the gradient of that cast copy accumulates on
    each device in `local_dtype` and is summed over the devices in `w`'s dtype."""
    return jax.lax.pcast(w, BATCH_AXES, to="varying").astype(local_dtype)


def _fwd(w: jax.Array, local_dtype: Any) -> tuple[jax.Array, Any]:
    return _varying_summed_in(w, local_dtype), jnp.zeros((), w.dtype)


def _bwd(local_dtype: Any, like: jax.Array, ct: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.psum(ct.astype(like.dtype), BATCH_AXES),)


_varying_summed_in.defvjp(_fwd, _bwd)


def per_batch_shard(fn: Callable[..., Any], mesh: Mesh | None, weights: tuple[jax.Array, ...],
                    tokens: tuple[jax.Array, ...], *, sum_outputs: bool, grad_dtype: Any,
                    local_dtype: Any = None) -> Any:
    """`fn(weights, tokens)` with each device computing on its own rows of `tokens` (leading axis
    split over BATCH_AXES) and the whole, replicated `weights`; the weights' gradient is summed over
    the devices once, in `grad_dtype` (None: each weight's own dtype). `sum_outputs`: the outputs
    are per-device sums (of a loss) and come back summed over the devices, replicated; otherwise
    they are per-token and keep the tokens' layout. `mesh` None (one device): `fn` as it is.

    `fn` must read each weight only in `grad_dtype` or wider-then-cast-to-it (as the model reads its
    fp32 masters in the compute dtype): each weight enters the shard_map cast to `grad_dtype`, so
    the sum leaves it in that dtype with nothing between it and the ZeRO-1 slice that keeps the
    device's part (XLA then makes the all-reduce a reduce-scatter; a convert in between kept it an
    all-reduce). Inside, `fn` reads it in `local_dtype` (None: as it entered), the precision in
    which its partial gradients add up on each device: the four chunks of a chunked loss add in
    bf16, as a weight's uses do everywhere else, while a lookup table, whose rows collect one
    contribution per token (thousands for a frequent token), is read in float32. A float32 head
    made each step cast it to bf16 per chunk and add its gradient at full size in float32: est.
    2.3 ms more per 2-layer MI300X step than the per-chunk reduce-scatters did on one node.
    """
    if mesh is None:
        return fn(weights, tokens)
    narrow = tuple(w.astype(grad_dtype)
                   if grad_dtype is not None and jnp.dtype(grad_dtype).itemsize < w.dtype.itemsize else w
                   for w in weights)

    def local(w: tuple[jax.Array, ...], t: tuple[jax.Array, ...]) -> Any:
        out = fn(tuple(_varying_summed_in(x, local_dtype or x.dtype) for x in w), t)
        return jax.tree.map(lambda v: jax.lax.psum(v, BATCH_AXES), out) if sum_outputs else out

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(BATCH_AXES)),
                         out_specs=P() if sum_outputs else P(BATCH_AXES))(narrow, tokens)
