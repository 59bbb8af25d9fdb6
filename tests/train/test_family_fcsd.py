"""FCSD per model family (Qwen3-MoE, DeepSeek-V3 with its biased group router, Llama-4 with NoPE
layers, chunked attention and expert-input scaling): the trainer starts
teacher and FarSkip student from a tiny HF `save_pretrained` directory (`train.init_checkpoint`), and
EP=4 trains the same losses as one device. About 45 s per family on 2 CPU cores (cold compile
cache), so kept out of the default suite (`-m slow`); the model-level EP/TP equivalence runs by
default in tests/parallel/test_{qwen3,dsv3,llama4}_parallel.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from farskip_jax.checkpoint.hf_load import config_from_dir
from farskip_jax.config import load_config, to_dict
from farskip_jax.train import trainer as trainer_mod

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hf_tiny import (  # noqa: E402
    build_dsv3,
    build_llama4,
    build_qwen3,
    save_hf,
    tiny_dsv3_config,
    tiny_llama4_config,
    tiny_qwen3_config,
)

pytestmark = pytest.mark.slow


FAMILIES = {
    # Vocabularies cover the tiny tokenizer's 105 ids.
    "qwen3": lambda: build_qwen3(tiny_qwen3_config(vocab_size=105, num_hidden_layers=4, mlp_only_layers=[1]),
                                 seed=1),
    "dsv3": lambda: build_dsv3(tiny_dsv3_config(vocab_size=105, num_hidden_layers=3, first_k_dense_replace=1),
                               seed=1),
    # 4 layers: MoE layers 1 and 3, NoPE layer 3, chunks of 4 positions.
    "llama4": lambda: build_llama4(tiny_llama4_config(vocab_size=105), seed=1),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_dir(request, tmp_path_factory):
    return save_hf(FAMILIES[request.param](), tmp_path_factory.mktemp(f"{request.param}_hf"))


def _losses(hf_dir: Path, tiny_data, overrides, out: Path, expert: int) -> dict[int, float]:
    ov = overrides(tiny_data, out, **{"train.total_steps": 3, "train.eval_every": 100,
                                      "train.warmup_steps": 1, "train.learning_rate": 1e-3,
                                      "train.init_checkpoint": str(hf_dir), "mesh.expert": expert})
    # The model section is the checkpoint's config.json, with FarSkip on for the student.
    for key, value in to_dict(config_from_dir(hf_dir)).items():
        if key != "farskip":
            ov[f"model.{key}"] = value
    ov["model.farskip.enabled"] = True
    summary = trainer_mod.train(load_config("tiny", ov))
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_fcsd_from_hf_ep4_equals_one_device(hf_dir, tiny_data, overrides, tmp_path):
    one = _losses(hf_dir, tiny_data, overrides, tmp_path / "one", 1)
    ep4 = _losses(hf_dir, tiny_data, overrides, tmp_path / "ep4", 4)
    assert one[1] > 0  # the FarSkip student differs from its teacher before any update
    for step in (1, 2, 3):
        assert abs(ep4[step] - one[step]) <= 1e-5 * max(1.0, abs(one[step])), (step, ep4, one)
