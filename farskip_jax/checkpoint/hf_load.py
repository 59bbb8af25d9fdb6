"""`from_pretrained`: an HF DeepSeek-V2 directory into our NNX model, validated tensor by tensor."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.checkpoint.hf_io import CheckpointError, TensorSource
from farskip_jax.checkpoint.hf_keys import ParamSpec, hf_key_index, param_specs
from farskip_jax.config import ModelConfig, _apply_overrides, from_dict, to_dict
from farskip_jax.model.layers import DTYPES
from farskip_jax.model.transformer import Transformer


def config_from_dir(path: str | Path, **overrides: Any) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    base = ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    if not overrides:
        return base
    return from_dict(ModelConfig, _apply_overrides(to_dict(base), overrides, "model"), "model")


def check_tensors(source: TensorSource, specs: list[ParamSpec]) -> None:
    """Missing, unexpected and wrongly shaped tensors, each named with its file."""
    index = hf_key_index(specs)
    have = set(source.keys())
    missing = [k for k in index if k not in have]
    if missing:
        raise CheckpointError(f"{source.dir}: missing tensor {missing[0]!r} (needed for parameter "
                              f"{index[missing[0]][0].name}; {len(missing)} missing in all)")
    unexpected = sorted(have - set(index))
    if unexpected:
        k = unexpected[0]
        raise CheckpointError(f"{source.key_to_file[k]}: unexpected tensor {k!r} not used by the config "
                              f"({len(unexpected)} unexpected in all)")
    for key, (spec, _) in index.items():
        shape = source.shape(key)
        if shape != spec.hf_shape:
            raise CheckpointError(f"{source.key_to_file[key]}: tensor {key!r} has shape {list(shape)}, "
                                  f"expected {list(spec.hf_shape)} for the config")


def read_param(source: TensorSource, spec: ParamSpec) -> np.ndarray:
    """Reads and transforms one parameter (a layer's stacked experts at most)."""
    arr = spec.to_ours([source.read(k) for k in spec.hf_keys])
    if arr.shape != spec.shape:
        raise CheckpointError(f"parameter {spec.name}: built shape {arr.shape} != {spec.shape}")
    return arr


def set_path(state: Any, path: tuple, value: Any) -> None:
    node = state
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def from_pretrained(path: str | Path, *, mesh: jax.sharding.Mesh | None = None,
                    **overrides: Any) -> Transformer:
    """Loads `config.json` + safetensors (or .bin) weights into a `Transformer`.

    A directory written by `convert_torch_ckpt.py` (marker `farskip_checkpoint.json`) is restored
    from Orbax instead. With `mesh`, routed experts are split over its 'expert' axis and the rest
    replicated, each parameter placed directly into its sharding.
    Overrides are dotted ModelConfig keys: `from_pretrained(d, **{"farskip.enabled": True})`.
    """
    from farskip_jax.checkpoint import convert

    if convert.is_orbax_checkpoint(path):
        return convert.load_model(path, mesh=mesh, **overrides)
    cfg = config_from_dir(path, **overrides)
    source = TensorSource(path)
    specs = param_specs(cfg)
    check_tensors(source, specs)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    pdtype = DTYPES[cfg.param_dtype]
    shardings = convert.mesh_shardings(cfg, mesh) if mesh is not None else None
    for spec in specs:
        arr = np.asarray(read_param(source, spec)).astype(pdtype)
        value = jax.device_put(arr, convert.nest_get(shardings, spec.path)) if shardings else jnp.asarray(arr)
        set_path(pure, spec.path, value)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def model_config_replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    return dataclasses.replace(cfg, **kw)


def param_count(model: Transformer) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
