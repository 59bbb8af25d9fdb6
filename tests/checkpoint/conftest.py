"""Fixtures of the converter's tests: the tiny HF checkpoint, its logits, and its Orbax conversion
(built once per test module that uses them; a few seconds each)."""

from __future__ import annotations

import numpy as np
import pytest
from convert_env import hf_logits_of, random_hf_model

from convert_torch_ckpt import main as cli


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """Tiny random DeepseekV2 written by transformers, sharded into several safetensors files."""
    d = tmp_path_factory.mktemp("hf")
    model = random_hf_model(0)
    model.save_pretrained(d, max_shard_size="40KB")
    assert len(list(d.glob("*.safetensors"))) > 3
    np.save(d.parent / "hf_logits.npy", hf_logits_of(model))
    return d


@pytest.fixture(scope="module")
def hf_logits(hf_dir):
    return np.load(hf_dir.parent / "hf_logits.npy")


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    assert cli(["--input", str(hf_dir), "--output", str(out), "--mesh", "expert=8", "--no-progress"]) == 0
    return out
