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
)

__all__ = ["BATCH_AXES", "ExpertParallel", "TensorParallel", "batch_sharding", "ep_forward", "make_mesh",
           "param_shardings", "param_specs_tree", "partition_spec", "place", "tp_cached_forward",
           "tp_forward"]
