"""Parameters from any checkpoint, placed into their mesh shardings from the first byte.

`load_params(path, cfg, shardings, dtype)` is the one entry point: an HF directory
(safetensors or pytorch_model*.bin), a converted Orbax directory, or a trainer checkpoint. Every
array is created on its devices directly: HF tensors through `jax.make_array_from_callback`, whose
callback for a device reads only that device's slice from disk (a routed-expert stack [E, ...]
split over 'expert' reads only the experts [e0:e1] the device owns, each an HF tensor of its own),
cast to `dtype` on the host slice; Orbax checkpoints through `orbax_io`'s sharded restore. A
replicated tensor is read once per process and handed to each local device. No whole-model host
tree exists and nothing is staged on one device.

Reads go through `hf_io.TensorSource`: one seek + read of a tensor's byte range in a safetensors
file (safetensors' own `get_slice` cannot return bfloat16 to numpy). A `.bin` file is host-staged:
torch.load (memory-mapped) keeps one whole file at a time.

`from_pretrained` is this loader for one device (or a mesh) plus the model around the parameters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from farskip_jax import hf_config
from farskip_jax.checkpoint import orbax_io
from farskip_jax.checkpoint.common import model_shardings, nest_set
from farskip_jax.checkpoint.hf_io import CheckpointError, TensorSource
from farskip_jax.checkpoint.hf_keys import ParamSpec, hf_key_index, param_specs
from farskip_jax.config import ExecutionConfig, ModelConfig, override
from farskip_jax.model.layers import DTYPES
from farskip_jax.model.transformer import Transformer

log = logging.getLogger(__name__)


def config_from_dir(path: str | Path, **overrides: Any) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json")
    return override(hf_config.model_config(json.loads(cfg_file.read_text())), overrides, "model")


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


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A device's index (slices, possibly open) as explicit [start, stop) slices of every axis."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def hf_array(source: TensorSource, spec: ParamSpec, sharding: jax.sharding.Sharding, dtype: Any) -> jax.Array:
    """One parameter as a jax.Array in `sharding` and `dtype`, each device's slice read on its own.

    Stacked experts: the callback for the expert range [e0:e1] reads exactly those HF tensors.
    Any other parameter is one HF tensor that the layout transform (transpose / head split) turns
    into ours; it is read once per call of this function and sliced per device.
    """
    np_dt = np.dtype(dtype)
    # Host slices already read, by expert range (stacked) or "all": devices holding the same slice
    # (replicas over 'data', or every device for a replicated weight) share one read. They are all
    # held until the array is assembled anyway, so sharing costs no memory.
    cache: dict[Any, np.ndarray] = {}

    def read(index: tuple) -> np.ndarray:
        idx = _bounds(index, spec.shape)
        if len(spec.hf_keys) > 1:
            e = idx[0]
            if (e.start, e.stop) not in cache:
                keys = spec.hf_keys[e.start:e.stop]
                cache[(e.start, e.stop)] = np.stack([spec.to_ours([source.read(k)])[0].astype(np_dt)
                                                     for k in keys])
            return np.ascontiguousarray(cache[(e.start, e.stop)][(slice(None),) + idx[1:]])
        if "all" not in cache:
            arr = spec.to_ours([source.read(spec.hf_keys[0])])
            if arr.shape != spec.shape:
                raise CheckpointError(f"parameter {spec.name}: built shape {arr.shape} != {spec.shape}")
            cache["all"] = np.asarray(arr, dtype=np_dt)
        return np.ascontiguousarray(cache["all"][idx])

    return jax.make_array_from_callback(spec.shape, sharding, read, dtype=np_dt)


def read_hf_params(path: str | Path, cfg: ModelConfig, shardings: Any, dtype: Any) -> dict:
    """Every parameter of `cfg` from the HF directory `path` as a pure dict of sharded jax.Arrays."""
    source = TensorSource(path)
    for msg in (source.skip_mtp_layers(cfg.num_layers), source.skip_vision()):
        if msg is not None:
            log.warning(msg)
    specs = param_specs(cfg)
    check_tensors(source, specs)
    fn = orbax_io.sharding_fn(shardings, cfg)
    out: dict = {}
    for spec in specs:
        nest_set(out, spec.path, hf_array(source, spec, fn(spec.path), dtype))
    return out


def load_params(path: str | Path, cfg: ModelConfig, shardings: Any, dtype: Any) -> dict:
    """The parameters of `cfg` from an HF dir, a converted Orbax dir, or a trainer checkpoint (a step
    directory or a run's checkpoints/ directory: its newest step), as a pure dict of jax.Arrays in
    `shardings` (a pure dict of shardings, a Mesh, or None for the first device) and `dtype`."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; give an HF directory (config.json + "
                              "weights), a convert_torch_ckpt.py output or a training checkpoint")
    if orbax_io.is_orbax_checkpoint(p):
        return orbax_io.restore_params(p, cfg, shardings, dtype)
    if (p / "config.json").exists():
        return read_hf_params(p, cfg, shardings, dtype)
    step_dir = orbax_io.trainer_step_dir(p)
    if step_dir is None:
        raise CheckpointError(f"{p}: neither an HF directory (config.json), a converted Orbax checkpoint "
                              f"({orbax_io.MARKER}) nor a training checkpoint (a 'params' item or step "
                              "directories holding one)")
    fn = orbax_io.sharding_fn(shardings, cfg)
    target: dict = {}
    for spec in param_specs(cfg):
        nest_set(target, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype, sharding=fn(spec.path)))
    return orbax_io.restore_trainer_params(step_dir, target)


def from_pretrained(path: str | Path, *, mesh: jax.sharding.Mesh | None = None,
                    exe: ExecutionConfig = ExecutionConfig(), **overrides: Any) -> Transformer:
    """A `Transformer` from an HF directory (config.json + safetensors or .bin) or a directory written
    by `convert_torch_ckpt.py` (marker `farskip_checkpoint.json`), through `load_params`.

    Without `mesh` every parameter lands on the first device; with `mesh`, routed experts are split
    over its 'expert' axis and the rest replicated, each device reading only its slice.
    Overrides are dotted ModelConfig keys: `from_pretrained(d, **{"farskip.enabled": True})`; how
    the model runs (kernels, remat, buffers...) is `exe`, never stored with the checkpoint.
    """
    if orbax_io.is_orbax_checkpoint(path):
        cfg = orbax_io.load_model_config(path, **overrides)
    else:
        cfg = config_from_dir(path, **overrides)
    shardings = model_shardings(cfg, mesh) if mesh is not None else None
    params = load_params(path, cfg, shardings, DTYPES[cfg.param_dtype])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), exe)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def param_count(model: Transformer) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

