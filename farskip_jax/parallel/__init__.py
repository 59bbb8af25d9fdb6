"""Mesh and parameter shardings (mesh.py), expert parallelism (expert.py: Dispatch, grouped GEMM,
Combine), tensor parallelism (tensor.py: psums) and the sharded forwards built on them (forward.py).
The scheduling hints both use are `farskip_jax.model.schedule`'s."""

from farskip_jax.parallel.expert import ExpertParallel, resolve_exchange, tile_per_node
from farskip_jax.parallel.forward import ep_forward, tp_cached_forward, tp_forward
from farskip_jax.parallel.mesh import (
    BATCH_AXES,
    batch_sharding,
    expert_ranks_per_node,
    make_mesh,
    param_shardings,
    param_specs_tree,
    partition_spec,
    place,
    replicate_kv_heads,
)
from farskip_jax.parallel.tensor import TensorParallel

__all__ = ["BATCH_AXES", "ExpertParallel", "TensorParallel", "batch_sharding", "ep_forward",
           "expert_ranks_per_node", "make_mesh", "param_shardings", "param_specs_tree", "partition_spec",
           "place", "replicate_kv_heads", "resolve_exchange", "tile_per_node", "tp_cached_forward",
           "tp_forward"]
