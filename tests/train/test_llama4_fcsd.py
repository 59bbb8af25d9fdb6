"""FCSD on a tiny Llama-4: the trainer starts teacher and FarSkip student from an HF
`save_pretrained` directory (`train.init_checkpoint`), and EP=4 trains the same losses as one
device. Slow on 2 CPU cores (cold compile cache), so kept out of the default suite
(`-m slow`); the model-level EP/TP equivalence runs by default in
tests/parallel/test_llama4_parallel.py."""

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
from hf_tiny import build_llama4, save_hf, tiny_llama4_config  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """The 4-layer tiny Llama-4 (MoE layers 1 and 3, NoPE layer 3, chunks of 4 positions) whose
    vocabulary covers the tiny tokenizer's 105 ids."""
    hf = build_llama4(tiny_llama4_config(vocab_size=105), seed=1)
    return save_hf(hf, tmp_path_factory.mktemp("llama4_hf"))


def _losses(llama4_dir: Path, tiny_data, overrides, out: Path, expert: int) -> dict[int, float]:
    ov = overrides(tiny_data, out, **{"train.total_steps": 3, "train.eval_every": 100,
                                      "train.warmup_steps": 1, "train.learning_rate": 1e-3,
                                      "train.init_checkpoint": str(llama4_dir), "mesh.expert": expert})
    # The model section is the checkpoint's config.json, with FarSkip on for the student.
    for key, value in to_dict(config_from_dir(llama4_dir)).items():
        if key != "farskip":
            ov[f"model.{key}"] = value
    ov["model.farskip.enabled"] = True
    summary = trainer_mod.train(load_config("tiny", ov))
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_fcsd_from_hf_llama4_ep4_equals_one_device(llama4_dir, tiny_data, overrides, tmp_path):
    one = _losses(llama4_dir, tiny_data, overrides, tmp_path / "one", 1)
    ep4 = _losses(llama4_dir, tiny_data, overrides, tmp_path / "ep4", 4)
    assert one[1] > 0  # the FarSkip student differs from its teacher before any update
    for step in (1, 2, 3):
        assert abs(ep4[step] - one[step]) <= 1e-5 * max(1.0, abs(one[step])), (step, ep4, one)
