"""The device mesh and the one table that maps parameters to mesh axes.

Axes: `data` and `expert` both split the batch in training (expert parallelism moves tokens
between the `expert` shards with all-to-alls); `tensor` is the inference layout of vLLM/SGLang:
activations replicated inside the group, attention heads and experts split over it.

Training (EP) layout: routed experts split over `expert` on their leading axis; every other
parameter replicated (DeepSeek-V2-Lite's non-expert weights are ~1.4B parameters: replicating
them keeps attention free of collectives, which is what lets the all-to-alls hide behind it).
Inference (TP) layout: heads (GQA: query and key/value heads) and expert axes split over `tensor`,
the rest replicated. GQA with fewer key/value heads than ranks copies each head to the ranks whose
query heads read it (`replicate_kv_heads`).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax import distributed
from farskip_jax.config import ConfigError, MeshConfig, ModelConfig

AXES = ("data", "expert", "tensor")
BATCH_AXES = ("data", "expert")

Layout = Literal["ep", "tp"]


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A (data, expert, tensor) mesh over the first `cfg.num_devices` devices, ordered by (process,
    device id) and filled innermost axis first.

    Multi-process (one process per node): `tensor` varies fastest, then `expert`, then `data`, so a
    tensor group, and an expert group of up to a node's devices, stays inside one node and their
    collectives stay on the node's fabric (xGMI / NVLink); only `data` (the gradient all-reduce) and
    an expert axis larger than a node cross the network. The batch axes are process-major as well:
    process p holds a contiguous block of the batch rows, which is what its data loader reads
    (train/batches.py).
    """
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    n = cfg.num_devices
    if n > len(devices):
        raise ValueError(f"mesh data={cfg.data} x expert={cfg.expert} x tensor={cfg.tensor} needs {n} "
                         "devices, "
                         f"{len(devices)} available")
    grid = np.asarray(devices[:n], dtype=object).reshape(cfg.data, cfg.expert, cfg.tensor)
    return Mesh(grid, AXES)


def device_nodes(devices: Sequence[Any]) -> list[Hashable]:
    """The node each of `devices` is on. In a multi-process run, the host name of the device's
    process, so one process per node and one per GPU both find the nodes. In one process, the
    device's `process_index`: 0 for every device of a real single-process run, and the host of a
    deviceless target topology (8 GPUs per host, xla/aot.py)."""
    if jax.process_count() == 1:
        return [d.process_index for d in devices]
    hosts = _process_hosts()
    return [hosts[d.process_index] for d in devices]


@functools.cache
def _process_hosts() -> tuple[str, ...]:
    # A collective (every process gathers every host name); cached, so that only the first call,
    # which every process makes at the same point (train.program.build_program), communicates.
    return tuple(distributed.allgather_json(socket.gethostname()))


def expert_ranks_per_node(mesh: Mesh, nodes: Sequence[Hashable] | None = None) -> int | None:
    """Expert ranks per node for `mesh.expert_per_node: auto`: 0 when each expert group lies on one
    node (the flat exchange stays on NVLink / xGMI); p when every expert group is cut into whole
    blocks of p consecutive ranks, one node per block, as `make_mesh` lays them out (the two-stage
    exchange of parallel/node_aware.py); None when the groups span nodes in any other way (the
    two-stage exchange's node groups would not be nodes). `nodes`: the node of each device of
    `mesh.devices.flat` (default `device_nodes`)."""
    grid = mesh.devices
    keys = np.empty(grid.size, dtype=object)
    keys[:] = device_nodes(list(grid.flat)) if nodes is None else list(nodes)
    keys = keys.reshape(grid.shape)
    axis = mesh.axis_names.index("expert")
    lines = np.moveaxis(keys, axis, -1).reshape(-1, grid.shape[axis])
    expert = lines.shape[1]
    per = next((i for i in range(1, expert) if lines[0, i] != lines[0, 0]), expert)
    if expert % per:
        return None
    for line in lines:
        blocks = line.reshape(-1, per)
        if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
            return None
    return 0 if per == expert else per


# Path suffix -> spec per layout. Paths are NNX state paths joined with "/", e.g.
# "layers/3/moe/experts/w_gate". First match wins; no match means replicated.
_RULES: dict[Layout, list[tuple[str, P]]] = {
    "ep": [
        ("moe/experts/w_gate", P("expert", None, None)),
        ("moe/experts/w_up", P("expert", None, None)),
        ("moe/experts/w_down", P("expert", None, None)),
    ],
    "tp": [
        ("moe/experts/w_gate", P("tensor", None, None)),
        ("moe/experts/w_up", P("tensor", None, None)),
        ("moe/experts/w_down", P("tensor", None, None)),
        ("attn/q_proj", P(None, "tensor", None)),
        # GQA: each rank holds the key/value heads its query heads read (model/gqa_attention.py).
        ("attn/k_proj", P(None, "tensor", None)),
        ("attn/v_proj", P(None, "tensor", None)),
        ("attn/q_b_proj", P(None, "tensor", None)),
        ("attn/kv_b_proj", P(None, "tensor", None)),
        ("attn/o_proj", P("tensor", None, None)),
        ("attn/gate_proj", P(None, "tensor", None)),  # gated attention: per head, like q
        ("shared/gate_proj", P(None, "tensor")),
        ("shared/up_proj", P(None, "tensor")),
        ("shared/down_proj", P("tensor", None)),
        ("mlp/gate_proj", P(None, "tensor")),
        ("mlp/up_proj", P(None, "tensor")),
        ("mlp/down_proj", P("tensor", None)),
    ],
}


def check_tensor_layout(cfg: ModelConfig, tensor: int) -> None:
    """Raises ConfigError unless the TP layout can split `cfg` over `tensor` ranks evenly."""
    if tensor == 1:
        return
    bad = cfg.tensor_layout_errors(tensor)
    if bad:
        raise ConfigError(f"mesh.tensor={tensor} does not split the model's {', '.join(bad)}: tensor "
                          "parallelism splits each of them over the tensor axis (GQA key/value heads "
                          "may instead divide it: each is then copied to tensor / heads ranks)")
    if cfg.attention_bias:
        raise ConfigError("model.attention_bias with mesh.tensor > 1 is not supported: the o_proj bias "
                          "would be added once per rank to the partial sums")


_KV_PROJECTIONS = ("attn/k_proj", "attn/v_proj", "attn/k_bias", "attn/v_bias")


def replicate_kv_heads(state: Any, tensor: int) -> Any:
    """`state` for the TP layout over `tensor` ranks: GQA key/value projections with fewer heads than
    ranks ([D, G, K], biases [G, K]) get each head repeated tensor / G times, in place, so that rank r
    holds head r // (tensor / G), the one its query heads read (heads r * H/tensor ... are all in
    group r // (tensor / G) of size H / G). Arrays and ShapeDtypeStructs; anything else unchanged."""

    def expand(path: tuple, x: Any) -> Any:
        name = "/".join(str(_key(k)) for k in path if _key(k) != "value")
        if not name.endswith(_KV_PROJECTIONS):
            return x
        axis = x.ndim - 2  # the head axis of [D, G, K] and [G, K]
        heads = x.shape[axis]
        if heads >= tensor:
            return x
        if tensor % heads:
            raise ConfigError(f"{name}: {heads} key/value heads can neither split over nor be copied to "
                              f"mesh.tensor={tensor} ranks")
        if isinstance(x, jax.ShapeDtypeStruct):
            shape = list(x.shape)
            shape[axis] = tensor
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
        repeat = np.repeat if isinstance(x, np.ndarray) else jnp.repeat
        return repeat(x, tensor // heads, axis=axis)

    return jax.tree_util.tree_map_with_path(expand, state)


def partition_spec(path: tuple, layout: Layout) -> P:
    # Drop the trailing attribute of an nnx.Variable leaf (`.value`) so State and pure dicts match.
    name = "/".join(str(p) for p in path if p != "value")
    for suffix, spec in _RULES[layout]:
        if name.endswith(suffix):
            return spec
    return P()


def param_specs_tree(state: Any, layout: Layout) -> Any:
    """A tree of PartitionSpecs matching `state` (an nnx.State or pure dict of arrays)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: partition_spec(tuple(_key(k) for k in path), layout), state)


def param_shardings(state: Any, mesh: Mesh, layout: Layout = "ep") -> Any:
    """NamedShardings for every parameter leaf of `state`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs_tree(state, layout),
                        is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, T]: batch split over data x expert."""
    return NamedSharding(mesh, P(BATCH_AXES))


def _key(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def key_name(path: tuple) -> str:
    """The parameter's own name in a tree path (`.../attn/o_proj` -> "o_proj"; nnx's trailing
    `value` attribute skipped)."""
    names = [str(_key(k)) for k in path if _key(k) != "value"]
    return names[-1] if names else ""


def place(state: Any, mesh: Mesh, layout: str) -> Any:
    """Puts every parameter of `state` on `mesh` with its layout's sharding (TP: GQA key/value heads
    copied first where the ranks outnumber them, `replicate_kv_heads`)."""
    if layout == "tp":
        state = replicate_kv_heads(state, mesh.shape["tensor"])
    specs = param_specs_tree(state, layout)
    return jax.tree.map(lambda x, s: put(x, NamedSharding(mesh, s)), state, specs,
                        is_leaf=lambda x: isinstance(x, P))


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` in `sharding`. A value this process holds whole (numpy, or an array on its own devices)
    going onto a mesh that spans processes is sliced here into this process's shards: a multi-process
    run loads every parameter on every process, and backends move no data between hosts in device_put."""
    if sharding.is_fully_addressable or not getattr(x, "is_fully_addressable", True):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
