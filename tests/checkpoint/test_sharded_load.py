"""Checkpoints load straight into their mesh shardings: each device's slice read on its own (a routed
expert stack split over 'expert' reads each expert tensor once, on the device that owns it), cast
on the host, the same values through every path (HF dir, converted Orbax, from_pretrained)."""

from __future__ import annotations

import json
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import farskip_jax
from farskip_jax import hf_config
from farskip_jax.checkpoint.common import model_shardings, nest_get
from farskip_jax.checkpoint.convert import convert_hf_to_orbax
from farskip_jax.checkpoint.hf_io import TensorSource
from farskip_jax.checkpoint.hf_keys import param_specs
from farskip_jax.checkpoint.hf_load import load_params
from farskip_jax.config import load_config
from farskip_jax.model import build_model
from farskip_jax.parallel import make_mesh

E = 8  # tiny config: 8 routed experts


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny config's random model written as an HF directory (fp32, two safetensors shards)."""
    cfg = load_config("tiny").model
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(build_model(cfg, 3), nnx.Param)))
    tensors = {}
    for spec in param_specs(cfg):
        for key, t in zip(spec.hf_keys, spec.to_hf(nest_get(pure, spec.path)), strict=True):
            tensors[key] = np.ascontiguousarray(t)
    d = tmp_path_factory.mktemp("hf")
    keys = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({k: tensors[k] for k in ks}, str(d / name), metadata={"format": "pt"})
    index = {"weight_map": {k: name for name, ks in halves.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps(hf_config.hf_dict(cfg)))
    return d, cfg, pure


def _mesh(data: int, expert: int):
    if jax.device_count() < data * expert:
        pytest.skip("needs 8 (host) devices")
    return make_mesh(load_config("tiny", {"mesh.data": data, "mesh.expert": expert}).mesh)


@pytest.mark.parametrize("data, expert", [(1, 8), (2, 4)])
def test_hf_dir_loads_sharded_reading_each_tensor_once(hf_dir, monkeypatch, data, expert):
    d, cfg, ref = hf_dir
    reads: Counter = Counter()
    orig = TensorSource.read
    monkeypatch.setattr(TensorSource, "read", lambda self, key: reads.update([key]) or orig(self, key))
    mesh = _mesh(data, expert)
    params = load_params(d, cfg, model_shardings(cfg, mesh), jnp.bfloat16)
    n_keys = sum(len(s.hf_keys) for s in param_specs(cfg))
    print(f"mesh data={data} expert={expert}: {sum(reads.values())} tensor reads for {n_keys} HF tensors")
    # Each HF tensor read once: replicas share a read, and no device reads another's experts.
    assert len(reads) == n_keys and set(reads.values()) == {1}
    for spec in param_specs(cfg):
        arr = nest_get(params, spec.path)
        want = np.asarray(nest_get(ref, spec.path)).astype(jnp.bfloat16)
        assert arr.dtype == jnp.bfloat16 and arr.shape == spec.shape
        if len(spec.hf_keys) > 1:  # routed experts: E / expert of them on each device
            for shard in arr.addressable_shards:
                assert shard.data.shape[0] == E // expert
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        else:
            assert arr.sharding.is_fully_replicated
            np.testing.assert_array_equal(np.asarray(arr), want)


def test_converted_orbax_and_from_pretrained_agree(hf_dir, tmp_path):
    d, cfg, ref = hf_dir
    out = tmp_path / "orbax"
    convert_hf_to_orbax(d, out, progress=False, log=lambda *_: None)
    mesh = _mesh(1, 8)
    restored = load_params(out, cfg, model_shardings(cfg, mesh), jnp.float32)
    for spec in param_specs(cfg):
        arr = nest_get(restored, spec.path)
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(nest_get(ref, spec.path)))
        if len(spec.hf_keys) > 1:
            assert arr.addressable_shards[0].data.shape[0] == 1
    # from_pretrained: the same loader on one device, HF dir and converted dir alike.
    for path in (d, out):
        model = farskip_jax.from_pretrained(path)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for spec in param_specs(cfg):
            leaf = nest_get(got, spec.path)
            assert len(leaf.sharding.device_set) == 1
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(nest_get(ref, spec.path)))
