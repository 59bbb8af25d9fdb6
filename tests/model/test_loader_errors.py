"""The HF loader and config reader fail loudly, naming the tensor, the file and the key."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hf_tiny import build_hf, save_hf, tiny_hf_config
from safetensors.numpy import load_file, save_file

import farskip_jax
from farskip_jax.checkpoint.hf_io import CheckpointError
from farskip_jax.config import ConfigError, load_config

EXPERT_KEY = "model.layers.1.mlp.experts.3.up_proj.weight"
KV_B_KEY = "model.layers.2.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def good_dirs(tmp_path_factory):
    hf = build_hf(tiny_hf_config(), seed=2)
    single = save_hf(hf, tmp_path_factory.mktemp("single"))
    sharded = save_hf(hf, tmp_path_factory.mktemp("sharded"), max_shard_size="20KB")
    return single, sharded


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_expert_tensor(good_dirs, tmp_path):
    d = _copy(good_dirs[0], tmp_path)
    _edit_tensors(d / "model.safetensors", lambda t: t.pop(EXPERT_KEY))
    with pytest.raises(CheckpointError) as e:
        farskip_jax.from_pretrained(d)
    msg = str(e.value)
    assert EXPERT_KEY in msg and str(d) in msg and "missing" in msg
    assert "layers/1/moe/experts/w_up" in msg  # the parameter it was needed for


def test_missing_tensor_in_sharded_index(good_dirs, tmp_path):
    d = _copy(good_dirs[1], tmp_path)
    index_file = d / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"].pop(EXPERT_KEY)
    index_file.write_text(json.dumps(index))
    _edit_tensors(d / shard, lambda t: t.pop(EXPERT_KEY))
    with pytest.raises(CheckpointError, match=EXPERT_KEY.replace(".", r"\.")):
        farskip_jax.from_pretrained(d)


def test_transposed_tensor_names_tensor_and_file(good_dirs, tmp_path):
    d = _copy(good_dirs[0], tmp_path)
    _edit_tensors(d / "model.safetensors",
                  lambda t: t.__setitem__(KV_B_KEY, np.ascontiguousarray(t[KV_B_KEY].T)))
    with pytest.raises(CheckpointError) as e:
        farskip_jax.from_pretrained(d)
    msg = str(e.value)
    assert KV_B_KEY in msg and "model.safetensors" in msg and str(d) in msg
    assert "[16, 64]" in msg and "[64, 16]" in msg  # found vs expected shape


def test_transposed_tensor_in_shard_names_the_shard(good_dirs, tmp_path):
    d = _copy(good_dirs[1], tmp_path)
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][KV_B_KEY]
    _edit_tensors(d / shard, lambda t: t.__setitem__(KV_B_KEY, np.ascontiguousarray(t[KV_B_KEY].T)))
    with pytest.raises(CheckpointError) as e:
        farskip_jax.from_pretrained(d)
    assert KV_B_KEY in str(e.value) and shard in str(e.value)


def test_unknown_routing_method(good_dirs, tmp_path):
    d = _copy(good_dirs[0], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["topk_method"] = "noaux_tc"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        farskip_jax.from_pretrained(d)
    msg = str(e.value)
    assert "topk_method" in msg and "noaux_tc" in msg and "greedy" in msg and "group_limited_greedy" in msg


def test_unknown_override_key(good_dirs):
    with pytest.raises(ConfigError, match=r"model\.farskip\.bogus"):
        farskip_jax.from_pretrained(good_dirs[0], **{"farskip.bogus": True})


def test_unknown_yaml_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("base: tiny\nmodel:\n  num_layerz: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert "model.num_layerz" in str(e.value) and "num_layers" in str(e.value)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises((CheckpointError, ConfigError), match="config.json"):
        farskip_jax.from_pretrained(tmp_path)
