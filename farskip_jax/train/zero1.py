"""ZeRO-1 layouts: the optimizer state of replicated weights split over the batch devices.

Under expert parallelism every non-expert weight (DeepSeek-V2-Lite: ~1.4B parameters) is
replicated on all `data x expert` devices, and so would be its fp32 AdamW state (2 x 4 bytes per
parameter, ~11 GB per device). ZeRO-1 keeps the weights replicated (attention needs them whole)
but gives each batch device 1/N of every such weight's optimizer state and of its update: the
gradient's data-parallel sum becomes a reduce-scatter (same bytes as the all-reduce it replaces,
half of its two phases), AdamW runs on the local slice, and the state keeps the new fp32 weights
split the same way; each step all-gathers them at its start (`train.step.make_train_step`: the
forward runs under those all-gathers, and the split master weights save 7/8 of their memory).
Routed-expert weights are already split over `expert` and keep that layout.

The model receives each such weight in the dtype it computes in (`model.dtype`, bf16), except
the few it reads in float32 (`model.moe.FLOAT32_READS`), and the gradient is taken with respect to
that copy. No value changes: every other weight is cast to `model.dtype` before its first use. The
all-gathers move it in that dtype too (half the bytes of the fp32 masters), or as stored with
`train.zero1_gather: param` (cast after the gather; the same training, bit for bit).

The gradients come back the same way, as one bf16 reduce-scatter per weight: XLA sums a weight's
gradient over the batch devices where it is produced, in that dtype. A gradient taken with respect
to a float32 copy instead (each use casting it) was summed over the devices once per use, at each
use's bf16 dot: twice per layer under `execution.batch_split: 2`, each chunk's apart. The LM head
and the embedding, whose gradients are produced in fp32 (the head's once per loss chunk), are
summed per batch shard first and cross the devices once, in bf16 (`farskip_jax.parallel.grad_sync`).
Each device's gradient of a weight used more than once (the split's chunks) is summed in bf16
before it crosses (BENCHMARKS K15).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.model.moe import FLOAT32_READS
from farskip_jax.parallel.mesh import BATCH_AXES, key_name, param_shardings
from farskip_jax.train.step import StepShardings


def batch_devices(mesh: Mesh) -> int:
    """How many devices split the batch (the ZeRO-1 group)."""
    shape = dict(mesh.shape)
    return shape.get("data", 1) * shape.get("expert", 1)


def zero1_spec(spec: P, shape: tuple[int, ...], num_devices: int) -> P:
    """`spec` for a replicated leaf split over BATCH_AXES along its leading-most axis divisible by
    `num_devices`; any other leaf (already sharded, or no divisible axis) keeps `spec`.

    The leading-most axis is preferred because a row-major array's slices along it are contiguous,
    so the reduce-scatter and all-gather move whole blocks without a transpose.
    """
    if num_devices <= 1 or any(axis is not None for axis in spec):
        return spec
    for i, size in enumerate(shape):
        if size >= num_devices and size % num_devices == 0:
            parts: list[Any] = [None] * len(shape)
            parts[i] = BATCH_AXES
            return P(*parts)
    return spec


def grad_shardings(abstract_params: Any, shardings: Any, mesh: Mesh) -> Any:
    """The ZeRO-1 layout of gradients and of the update arithmetic, a tree like `shardings`."""
    n = batch_devices(mesh)
    return jax.tree.map(lambda x, s: NamedSharding(mesh, zero1_spec(s.spec, tuple(x.shape), n)),
                        abstract_params, shardings)


def gather_dtypes(abstract_params: Any, compute: Any, grads: Any, dtype: str | None) -> Any:
    """The dtype each parameter is all-gathered in, a tree like `abstract_params`: `dtype` for a leaf
    that ZeRO-1 splits (its `grads` layout differs from `compute`), is stored wider and is not one of
    `FLOAT32_READS`; its own dtype for every other leaf (or every leaf when `dtype` is None)."""

    def leaf(path: tuple, x: Any, c: NamedSharding, g: NamedSharding) -> Any:
        narrow = dtype is not None and jnp.dtype(dtype).itemsize < jnp.dtype(x.dtype).itemsize
        if narrow and c.spec != g.spec and key_name(path) not in FLOAT32_READS:
            return jnp.dtype(dtype)
        return jnp.dtype(x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, abstract_params, compute, grads)


def step_shardings(abstract_params: Any, tx: optax.GradientTransformation, mesh: Mesh,
                   zero1: bool, gather_dtype: str | None = None, compute_dtype: str | None = None
                   ) -> StepShardings:
    """Every layout of the train step: the EP layout the model computes in, and gradients, stored
    parameters and optimizer state (ZeRO-1 split when `zero1`, else the EP layout), replicated
    scalars; `gather_dtype`: what the split weights are all-gathered in (`gather_dtypes`; None: as
    stored); `compute_dtype`: what the model receives them in, whatever they travelled in (None: as
    stored)."""
    compute = param_shardings(abstract_params, mesh, "ep")
    grads = grad_shardings(abstract_params, compute, mesh) if zero1 else compute
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # Each copy of the parameter tree inside the optimizer state (Adam's mu and nu) takes the
    # gradients' layout; counters and other non-parameter leaves are replicated.
    opt = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, grads,
                                transform_non_params=lambda _: replicated)
    return StepShardings(params=grads, grads=grads, opt_state=opt, scalar=replicated, compute=compute,
                         gather=gather_dtypes(abstract_params, compute, grads, gather_dtype),
                         model=gather_dtypes(abstract_params, compute, grads, compute_dtype))
