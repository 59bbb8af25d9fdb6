"""Per-device parameter memory after `place`: routed experts split, everything else replicated.

Read from the placed arrays' `addressable_shards`, i.e. what each device actually holds.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from par_common import split, tiny

from farskip_jax.config import MeshConfig
from farskip_jax.parallel import make_mesh, place
from farskip_jax.parallel.mesh import partition_spec

ROUTED = ("moe/experts/w_gate", "moe/experts/w_up", "moe/experts/w_down")


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def _name(path) -> str:
    return "/".join(str(k) for k in _keys(path) if k != "value")


def _per_device_bytes(placed) -> dict[str, list[int]]:
    """Parameter path -> bytes held by each device."""
    out = {}
    for path, arr in jax.tree_util.tree_flatten_with_path(placed)[0]:
        out[_name(path)] = [s.data.nbytes for s in arr.addressable_shards]
    return out


@pytest.fixture(scope="module")
def state():
    return split(tiny(True))[1]


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(expert=8), MeshConfig(data=2, expert=4)],
                         ids=["ep8", "dp2xep4"])
def test_ep_routed_split_rest_replicated(state, mesh_cfg):
    mesh = make_mesh(mesh_cfg)
    placed = place(state, mesh, "ep")
    full = {_name(p): int(np.asarray(a).nbytes) for p, a in jax.tree_util.tree_flatten_with_path(state)[0]}
    per_dev = _per_device_bytes(placed)
    ep = mesh_cfg.expert
    routed_total = routed_dev = other_dev = 0
    for name, sizes in per_dev.items():
        assert len(sizes) == mesh.size  # one shard on every device
        if name.endswith(ROUTED):
            assert sizes == [full[name] // ep] * mesh.size, name
            routed_total += full[name]
            routed_dev += sizes[0]
        else:
            assert sizes == [full[name]] * mesh.size, name  # replicated: full size everywhere
            other_dev += sizes[0]
    assert routed_total > 0 and routed_dev * ep == routed_total
    total = sum(full.values())
    print(f"PARALLEL_MEM mesh={mesh_cfg.data}x{mesh_cfg.expert} params total={total} B per_device="
          f"{routed_dev + other_dev} B (routed {routed_dev} = {routed_total}/{ep}, replicated {other_dev})")


def test_tp_layout_splits_heads_and_experts(state):
    mesh = make_mesh(MeshConfig(tensor=4))
    placed = place(state, mesh, "tp")
    for path, arr in jax.tree_util.tree_flatten_with_path(placed)[0]:
        split_axes = [i for i, ax in enumerate(partition_spec(_keys(path), "tp")) if ax == "tensor"]
        shard = arr.addressable_shards[0].data
        expected = list(arr.shape)
        for i in split_axes:
            expected[i] //= 4
        assert list(shard.shape) == expected, _name(path)
        assert all(s.data.nbytes == shard.nbytes for s in arr.addressable_shards)
    names = [_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(placed)[0]]
    assert any(n.endswith("attn/o_proj") for n in names)
