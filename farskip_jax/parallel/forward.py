"""Sharded forward functions over a model's (graphdef, state): expert parallel and tensor parallel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from farskip_jax.parallel.expert import ExpertParallel
from farskip_jax.parallel.mesh import check_tensor_layout, param_specs_tree
from farskip_jax.parallel.tensor import TensorParallel


def ep_forward(graphdef: nnx.GraphDef, mesh: Mesh, bounded: bool = True,
               expert_per_node: int = 0) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> ModelOutput` with expert parallelism
    (`bounded` and `expert_per_node` as in ExpertParallel; the output's aux["moe_overflow"] says
    whether it is void)."""
    par = ExpertParallel(mesh, bounded=bounded, expert_per_node=expert_per_node)

    def f(state, input_ids, positions=None, segment_ids=None):
        return nnx.merge(graphdef, state)(input_ids, positions, segment_ids, parallel=par)

    return f


def tp_forward(graphdef: nnx.GraphDef, state_like: Any, mesh: Mesh,
               bounded: bool = True) -> Callable[..., Any]:
    """`f(state, input_ids, positions, segment_ids) -> (logits, hidden, overflow)`: the inference TP
    layout (with the model's `exe.tp_reduce`; `exe.tp_microbatches` is read by the model itself); overflow
    as in `ModelOutput.aux["moe_overflow"]` (`bounded` as in TensorParallel)."""
    check_tensor_layout(nnx.merge(graphdef, state_like).cfg, mesh.shape["tensor"])
    specs = param_specs_tree(state_like, "tp")

    def body(state, input_ids, positions, segment_ids):
        model = nnx.merge(graphdef, state)
        par = TensorParallel(device=mesh.devices.flat[0], mode=model.exe.tp_reduce, bounded=bounded)
        out = model(input_ids, positions, segment_ids, parallel=par)
        return out.logits, out.hidden, out.aux["moe_overflow"]

    def f(state, input_ids, positions=None, segment_ids=None):
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=(P(), P(), P()),
                             check_vma=False)(state, input_ids, positions, segment_ids)

    return f


def tp_cached_forward(graphdef: nnx.GraphDef, state_like: Any, mesh: Mesh, prefill: bool,
                      bounded: bool = True) -> Callable[..., Any]:
    """`f(state, input_ids, positions, caches) -> (hidden, caches, overflow)`: `Transformer.cached_forward` in
    the inference TP layout. Heads and experts are split; MLA's latent caches are replicated (one
    latent per token for all heads: every rank writes the same values into them), GQA's key/value
    caches are split with their heads."""
    cfg = nnx.merge(graphdef, state_like).cfg
    check_tensor_layout(cfg, mesh.shape["tensor"])
    specs = param_specs_tree(state_like, "tp")
    caches = P(None, None, "tensor") if cfg.attention_kind == "gqa" else P()

    def body(state, input_ids, positions, caches):
        model = nnx.merge(graphdef, state)
        par = TensorParallel(device=mesh.devices.flat[0], mode=model.exe.tp_reduce, bounded=bounded)
        return model.cached_forward(input_ids, positions, caches, prefill=prefill, parallel=par)

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), caches), out_specs=(P(), caches, P()),
                         check_vma=False)
