"""Helpers shared by the checkpoint readers and writers: nested parameter paths, problem lists."""

from __future__ import annotations

from typing import Any

import numpy as np

from farskip_jax.checkpoint.hf_io import CheckpointError
from farskip_jax.checkpoint.hf_keys import param_specs
from farskip_jax.config import ConfigError, ModelConfig

MAX_LISTED = 20


def nest_set(tree: dict, path: tuple, value: Any) -> None:
    """tree[path[0]][path[1]]... = value, creating the intermediate dicts."""
    node = tree
    for p in path[:-1]:
        node = node.setdefault(p, {})
    node[path[-1]] = value


def nest_get(tree: Any, path: tuple) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def deep_merge(into: dict, other: dict) -> dict:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        else:
            into[k] = v
    return into


def raise_problems(what: str, problems: list[str]) -> None:
    """Raises one CheckpointError listing every problem found in `what` (the first MAX_LISTED)."""
    if problems:
        listed = "\n  - ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"{len(problems)} problem(s) in {what}:\n  - {listed}{more}")


def model_shardings(cfg: ModelConfig, mesh: Any) -> dict:
    """NamedShardings for every parameter of `cfg` as a pure dict, from the project's one table
    (`parallel.mesh`, EP layout): routed experts split on their leading axis over mesh axis
    'expert', everything else replicated."""
    import jax

    from farskip_jax.parallel.mesh import param_shardings

    ep = dict(mesh.shape).get("expert", 1)
    if cfg.n_routed_experts % ep:
        raise ConfigError(f"mesh axis expert={ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    abstract: dict = {}
    for s in param_specs(cfg):
        nest_set(abstract, s.path, jax.ShapeDtypeStruct(s.shape, np.float32))
    return param_shardings(abstract, mesh)
