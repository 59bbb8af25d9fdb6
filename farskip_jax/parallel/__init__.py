"""Mesh, parameter shardings and the collectives (EP all-to-all, TP psum)."""

from farskip_jax.parallel.collectives import (
    ExpertParallel,
    TensorParallel,
    ep_forward,
    place,
    tp_cached_forward,
    tp_forward,
)
from farskip_jax.parallel.mesh import (
                                       BATCH_AXES,
                                       batch_sharding,
                                       make_mesh,
                                       param_shardings,
                                       param_specs_tree,
                                       partition_spec,
                                       replicate_kv_heads,
)

__all__ = ["BATCH_AXES", "ExpertParallel", "TensorParallel", "batch_sharding", "ep_forward", "make_mesh",
           "param_shardings", "param_specs_tree", "partition_spec", "place", "replicate_kv_heads",
           "tp_cached_forward", "tp_forward"]
