"""The `execution` section (ExecutionConfig: how to run) apart from `model` (what to compute).

Validation names `execution.<key>`; a moved key written under `model` in user input (`--set`, a
YAML file, overrides) is refused with its new key; a config stored by an earlier version, with
those keys under `model` (tests/stored_configs/: what a training checkpoint of commit c447d9a
stored as its meta "config"), is migrated when a checkpoint is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from farskip_jax import hf_config
from farskip_jax.config import (
    Config,
    ConfigError,
    ExecutionConfig,
    ModelConfig,
    from_dict,
    load_config,
    migrate_stored_config,
    override,
    to_dict,
)

STORED = Path(__file__).parent / "stored_configs" / "dsv2lite_farskip_c447d9a.json"
MOVED = sorted(ModelConfig.MOVED_KEYS)
# execution fields added after the split: never `model.<key>`, so nothing to refuse with a new name
NEW_SINCE_SPLIT = {"remat_hbm_fraction", "remat_budget_gib", "expert_swiglu"}


def test_moved_keys_are_the_execution_fields():
    fields = {f.name for f in dataclasses.fields(ExecutionConfig)}
    assert set(MOVED) | NEW_SINCE_SPLIT == fields and not set(MOVED) & NEW_SINCE_SPLIT
    assert not fields & {f.name for f in dataclasses.fields(ModelConfig)}
    assert all(ModelConfig.MOVED_KEYS[k] == f"execution.{k}" for k in MOVED)


@pytest.mark.parametrize("overrides, message", [
    ({"execution.batch_split": 0}, r"execution\.batch_split must be > 0, got 0"),
    ({"execution.attention_block_kv": -1}, r"execution\.attention_block_kv must be > 0"),
    ({"execution.tp_microbatches": 0}, r"execution\.tp_microbatches must be > 0"),
    ({"execution.moe_buffer_factor": 0.5}, r"execution\.moe_buffer_factor must be 0 .* or >= 1"),
    ({"execution.tp_microbatches": 2, "execution.capacity_factor": 1.0},
     r"execution\.tp_microbatches > 1 needs dropless routing \(execution\.capacity_factor <= 0\)"),
    ({"execution.tp_microbatches": 2, "execution.layer_loop": "scan"},
     r"execution\.tp_microbatches > 1 needs execution\.layer_loop=unrolled"),
    ({"execution.batch_split": 2, "execution.layer_loop": "scan"},
     r"execution\.batch_split=2 needs execution\.layer_loop=unrolled"),
    # `auto` (2 on one node of H200, else 1) was removed when one stream measured fastest everywhere
    ({"execution.batch_split": "auto"}, r"execution\.batch_split='auto' must be an integer"),
    ({"execution.remat": "everything"}, r"execution\.remat='everything' is not allowed.*save_a2a"),
    ({"execution.remat_hbm_fraction": 0}, r"execution\.remat_hbm_fraction must be in \(0, 1\], got 0"),
    ({"execution.remat_hbm_fraction": 1.5}, r"execution\.remat_hbm_fraction must be in \(0, 1\]"),
    ({"execution.remat_budget_gib": -1}, r"execution\.remat_budget_gib must be >= 0"),
    ({"execution.expert_matmul": "dense"}, r"execution\.expert_matmul='dense' is not allowed.*blocked"),
    ({"execution.batch_split": "two"}, r"execution\.batch_split='two' must be an integer"),
    ({"execution.bogus": 1}, r"unknown config key 'execution\.bogus'.*'remat'"),
])
def test_validation_errors_name_the_execution_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_execution_overrides_reach_the_section():
    cfg = load_config("tiny", {"execution.remat": "full", "execution.batch_split": 2})
    assert (cfg.execution.remat, cfg.execution.batch_split) == ("full", 2)
    assert cfg.model == load_config("tiny").model  # how to run changes nothing in the model
    # configs/dsv2lite.yaml's `execution:` section, inherited by its FarSkip variant
    fs = load_config("dsv2lite_farskip")
    assert (fs.execution.remat, fs.execution.batch_split) == ("auto", 1)
    assert fs.execution == load_config("dsv2lite").execution


@pytest.mark.parametrize("key", MOVED)
def test_moved_key_on_the_command_line_is_refused_with_its_new_name(key):
    value = getattr(ExecutionConfig(), key)  # even a valid value: the key itself is gone
    with pytest.raises(ConfigError, match=rf"'model\.{key}' has moved to 'execution\.{key}'.*"
                                          rf"--set execution\.{key}=VALUE"):
        load_config("tiny", {f"model.{key}": value})


def test_moved_key_in_a_yaml_file_or_an_override_is_refused(tmp_path):
    old = tmp_path / "old_layout.yaml"
    old.write_text("base: tiny\nmodel:\n  num_layers: 2\n  remat: full\n")
    with pytest.raises(ConfigError, match=r"'model\.remat' has moved to 'execution\.remat'.*"
                                          r"under `execution:`"):
        load_config(str(old))
    with pytest.raises(ConfigError, match=r"'model\.batch_split' has moved to 'execution\.batch_split'"):
        override(ModelConfig(), {"batch_split": 2}, "model")  # from_pretrained(d, batch_split=2)
    hf = hf_config.hf_dict(load_config("tiny").model)
    with pytest.raises(ConfigError,
                       match=r"'model\.capacity_factor' has moved to 'execution\.capacity_factor'"):
        hf_config.model_config(hf, capacity_factor=1.0)
    from farskip_jax.demo.pipeline import derive

    with pytest.raises(ConfigError, match=r"'model\.expert_matmul' has moved to 'execution\.expert_matmul'"):
        derive(load_config("tiny_demo"), {"model.expert_matmul": "padded"})
    # user input is never migrated: the stored layout itself is refused where a config is given
    with pytest.raises(ConfigError, match="has moved to 'execution."):
        from_dict(Config, json.loads(STORED.read_text()))


def test_stored_config_of_an_earlier_version_is_migrated():
    stored = json.loads(STORED.read_text())
    assert "execution" not in stored and {"remat", "batch_split"} <= set(stored["model"])
    before = json.loads(STORED.read_text())
    migrated = migrate_stored_config(stored)
    assert stored == before  # the input is left alone
    assert migrated["execution"] == {k: stored["model"][k] for k in MOVED}
    assert migrated["model"] == {k: v for k, v in stored["model"].items() if k not in MOVED}
    assert {k: v for k, v in migrated.items() if k not in ("model", "execution")} == \
        {k: v for k, v in stored.items() if k != "model"}
    cfg = from_dict(Config, migrated)
    exe = cfg.execution
    assert (exe.remat, exe.batch_split, exe.moe_buffer_factor) == ("save_a2a", 2, 2.0)
    assert cfg.model.farskip.enabled and cfg.model.num_layers == 27
    # today's layout passes through as it is
    assert migrate_stored_config(to_dict(cfg)) == to_dict(cfg)
    conflict = dict(stored, execution={"remat": "full"})
    with pytest.raises(ConfigError, match="model.remat and execution.remat"):
        migrate_stored_config(conflict)


def test_checkpoints_of_an_earlier_version_still_load_their_config(tmp_path):
    """A training checkpoint's meta "config" (read by --to-hf export and `describe`) and a converted
    checkpoint's model_config.json, both in the layout before the split."""
    from farskip_jax.checkpoint.orbax_io import MODEL_CONFIG, load_model_config
    from farskip_jax.checkpoint.to_hf import trainer_config_dict, trainer_model_config

    stored = json.loads(STORED.read_text())
    want = from_dict(Config, migrate_stored_config(stored))
    step = tmp_path / "step_10"
    (step / "meta").mkdir(parents=True)
    (step / "meta" / "metadata").write_text(json.dumps({"step": 10, "config": stored}))
    assert trainer_model_config(step) == want.model
    assert from_dict(Config, trainer_config_dict(step)) == want
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / MODEL_CONFIG).write_text(json.dumps(stored["model"]))
    assert load_model_config(converted) == want.model
    assert load_model_config(converted, **{"farskip.enabled": False}).farskip.enabled is False
