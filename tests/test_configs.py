"""YAML configs, validation messages, dotted overrides, HF config.json round trips."""

from __future__ import annotations

import dataclasses

import pytest

from farskip_jax import hf_config
from farskip_jax.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    FarSkipConfig,
    ModelConfig,
    RopeScaling,
    load_config,
    parse_overrides,
)

YAMLS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_configs_exist():
    assert {"tiny", "tiny_farskip", "dsv2lite", "dsv2lite_farskip", "qwen3_30b_a3b",
            "qwen3_30b_a3b_farskip", "deepseek_v3", "deepseek_v3_farskip", "instella_moe",
            "llama4_scout", "llama4_scout_farskip"} <= set(YAMLS)


@pytest.mark.parametrize("name", YAMLS)
def test_every_yaml_loads_and_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, Config) and cfg.name == name
    cfg.validate()
    # Every model config round-trips through HF's config.json form.
    again = hf_config.model_config(hf_config.hf_dict(cfg.model))
    assert again.num_layers == cfg.model.num_layers and again.routing == cfg.model.routing


def test_farskip_yaml_inherits_base():
    base, fs = load_config("dsv2lite"), load_config("dsv2lite_farskip")
    assert not base.model.farskip.enabled and fs.model.farskip.enabled
    assert dataclasses.replace(fs.model, farskip=base.model.farskip) == base.model
    assert list(fs.model.farskip.layer_range(fs.model.num_layers)) == list(range(27))


# Qwen3-30B-A3B's published config.json (transformers 4.51 generation: rope_theta + rope_scaling).
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
# ModelConfig fields config.json does not carry (training-side knobs; how to run the model, the
# `execution` section, is not in ModelConfig at all).
NOT_IN_HF = {"param_dtype", "dtype", "device_aux_loss_alpha", "aux_device_groups"}


def test_qwen3_yaml_is_the_published_model():
    """configs/qwen3_30b_a3b.yaml describes the model of the published config.json, and its
    FarSkip variant differs only in connectivity (every layer)."""
    ours, published = load_config("qwen3_30b_a3b").model, hf_config.model_config(QWEN3_30B_A3B_HF)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in NOT_IN_HF:
            assert getattr(ours, f.name) == getattr(published, f.name), f.name
    assert (ours.attention_kind, ours.kv_heads, ours.attn_head_dim) == ("gqa", 4, 128)
    assert ours.rope_style == "half" and ours.qk_norm
    assert all(ours.is_moe_layer(i) for i in range(48)) and ours.n_shared_experts == 0
    fs = load_config("qwen3_30b_a3b_farskip").model
    assert dataclasses.replace(fs, farskip=ours.farskip) == ours
    assert list(fs.farskip.layer_range(fs.num_layers)) == list(range(48))


def test_qwen3_hf_rules_and_round_trip():
    """HF's layer rule (mlp_only_layers, (i + 1) % decoder_sparse_step), head_dim's default,
    num_local_experts (transformers 5's alias), and what Qwen3-MoE cannot express."""
    hf = dict(QWEN3_30B_A3B_HF, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    del hf["head_dim"], hf["num_experts"]
    hf["num_local_experts"] = 16
    cfg = hf_config.model_config(hf)
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [1, 5]
    assert cfg.attn_head_dim == 2048 // 32 and cfg.n_routed_experts == 16 and cfg.router_norm_min_k == 1
    assert hf_config.model_config(hf_config.hf_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="Qwen3-MoE.*n_shared_experts"):
        hf_config.hf_dict(dataclasses.replace(cfg, n_shared_experts=1))
    with pytest.raises(ConfigError, match="sliding"):
        hf_config.model_config(dict(hf, use_sliding_window=True))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config("qwen3_30b_a3b", {"model.num_kv_heads": 5})
    with pytest.raises(ConfigError, match="attention_kind=gqa only"):
        load_config("tiny", {"model.qk_norm": True})


# DeepSeek-V3's published config.json (transformers 4.46 generation), without its auto_map.
DEEPSEEK_V3_HF = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_deepseek_v3_yaml_is_the_published_model():
    """configs/deepseek_v3.yaml describes the published model (its FP8 weights dequantized), its
    FarSkip variant differs only in connectivity, and config.json round-trips through ours."""
    # FP8 is how the published weights are stored (dequantized as they are read): the same model
    dequantized = {k: v for k, v in DEEPSEEK_V3_HF.items() if k != "quantization_config"}
    published = hf_config.model_config(DEEPSEEK_V3_HF)
    assert published == hf_config.model_config(dequantized)
    with pytest.raises(ConfigError, match="only the published FP8"):
        hf_config.model_config({**dequantized, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    ours = load_config("deepseek_v3").model
    for f in dataclasses.fields(ModelConfig):
        if f.name not in NOT_IN_HF:
            assert getattr(ours, f.name) == getattr(published, f.name), f.name
    assert [i for i in range(61) if not ours.is_moe_layer(i)] == [0, 1, 2]
    assert hf_config.model_config(hf_config.hf_dict(ours)) == dataclasses.replace(
        ours, **{k: getattr(ModelConfig(), k) for k in NOT_IN_HF})
    fs = load_config("deepseek_v3_farskip").model
    assert dataclasses.replace(fs, farskip=ours.farskip) == ours
    assert list(fs.farskip.layer_range(fs.num_layers)) == list(range(61))
    with pytest.raises(ConfigError, match="DeepseekV3.*moe_layer_freq"):
        hf_config.hf_dict(dataclasses.replace(ours, moe_layer_freq=2))


def test_instella_yaml_writes_the_released_architecture():
    """configs/instella_moe.yaml is a FarSkip Instella-MoE: its config.json form is the released
    architecture (gated attention, FarSkip keys on every layer, one expert group) and reads back."""
    ours = load_config("instella_moe").model
    hf = hf_config.hf_dict(ours)
    assert hf["architectures"] == ["InstellaMoEForCausalLM"] and hf["model_type"] == "deepseek_v3"
    assert hf["gated_attention"] and hf["farskip"] and hf["n_group"] == 1
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["n_routed_experts"], hf["num_experts_per_tok"],
            hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]) == (27, 2048, 64, 6, 96, 32)
    again = hf_config.model_config(hf)
    assert list(again.farskip.layer_range(27)) == list(range(27)) and again.attn_output_gate


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"model.hiden_size": 8})
    assert "model.hiden_size" in str(e.value) and "hidden_size" in str(e.value)
    with pytest.raises(ConfigError, match=r"model\.farskip\.strat_idx"):
        load_config("tiny", {"model.farskip.strat_idx": 1})


def test_bad_value_names_key_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"model.routing": "noaux_tc"})
    msg = str(e.value)
    assert "model.routing" in msg and "greedy" in msg and "group_limited_greedy" in msg
    with pytest.raises(ConfigError, match=r"model\.dtype.*float32.*bfloat16"):
        load_config("tiny", {"model.dtype": "float16"})
    with pytest.raises(ConfigError, match=r"model\.num_layers"):
        load_config("tiny", {"model.num_layers": "four"})
    with pytest.raises(ConfigError, match=r"model\.farskip\.end_idx"):
        load_config("tiny", {"model.farskip.enabled": True, "model.farskip.end_idx": 99})
    with pytest.raises(ConfigError, match="attn_only.*mlp_only"):
        load_config("tiny", {"model.farskip.attn_only": True, "model.farskip.mlp_only": True})
    with pytest.raises(ConfigError,
                       match=r"mesh\.teacher_experts='nodes'.*'auto', 'local', 'node', 'expert'"):
        load_config("tiny", {"mesh.teacher_experts": "nodes"})


def test_parse_overrides_and_apply():
    ov = parse_overrides(["model.num_layers=3", "train.learning_rate=1e-4", "model.farskip.enabled=true",
                          "model.farskip.start_idx=1", "model.q_lora_rank=null", "train.mode=sft"])
    assert ov == {"model.num_layers": 3, "train.learning_rate": 1e-4, "model.farskip.enabled": True,
                  "model.farskip.start_idx": 1, "model.q_lora_rank": None, "train.mode": "sft"}
    cfg = load_config("tiny", ov)
    assert cfg.model.num_layers == 3 and cfg.model.q_lora_rank is None and cfg.train.mode == "sft"
    assert cfg.model.farskip == FarSkipConfig(enabled=True, start_idx=1)
    assert list(cfg.model.farskip.layer_range(3)) == [1, 2]
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["model.num_layers"])


def test_a_derived_config_leaves_its_base_alone():
    """Deriving a stage's config from a base (the demo, reproduce and the ablations derive many from
    one) edits a copy: the base's dict sections (`data`, `demo`) were once shared, so one stage's
    data.batch_size leaked into every later stage."""
    from farskip_jax.config import to_dict
    from farskip_jax.demo.pipeline import derive

    base = load_config("tiny_demo")
    before = to_dict(base)
    child = derive(base, {"data.batch_size": 4, "demo.tasks": ["cpy"], "train.total_steps": 3})
    assert (child.data["batch_size"], child.demo["tasks"], child.train.total_steps) == (4, ["cpy"], 3)
    assert to_dict(base) == before and base.data["batch_size"] == 16 and base.demo["tasks"] == ["rev"]
    tree = to_dict(base)
    tree["data"]["paths"] = ["elsewhere"]
    tree["demo"]["teacher"]["train"]["total_steps"] = 1
    assert to_dict(base) == before


def test_hf_round_trip_preserves_fields():
    cfg = load_config("tiny", {"model.rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64,
                                                      "mscale": 0.707, "mscale_all_dim": 0.707},
                               "model.routed_scaling_factor": 2.0, "model.norm_topk_prob": True,
                               "model.farskip.enabled": True, "model.farskip.start_idx": 1,
                               "model.farskip.end_idx": 2, "model.farskip.attn_only": True}).model
    again = hf_config.model_config(hf_config.hf_dict(cfg))
    # Fields config.json does not carry (training-side knobs) keep their defaults; compare the rest.
    for f in dataclasses.fields(ModelConfig):
        if f.name not in NOT_IN_HF:
            assert getattr(again, f.name) == getattr(cfg, f.name), f.name
    assert again.farskip == FarSkipConfig(enabled=True, start_idx=1, end_idx=2, attn_only=True)


def test_both_rope_generations_parse_the_same():
    common = hf_config.hf_dict(ModelConfig(num_layers=2))
    yarn = {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707}
    legacy = {k: v for k, v in common.items() if k != "rope_parameters"}
    legacy.update(rope_theta=10000.0, rope_scaling={"type": "yarn", **yarn})
    modern = dict(common, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn})
    a, b = hf_config.model_config(legacy), hf_config.model_config(modern)
    assert a.rope_scaling == b.rope_scaling == RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                                           mscale=0.707, mscale_all_dim=0.707)
    assert a.rope_theta == b.rope_theta == 10000.0
    # No scaling in either generation.
    plain_legacy = {k: v for k, v in common.items() if k != "rope_parameters"}
    plain_legacy.update(rope_theta=500.0, rope_scaling=None)
    assert hf_config.model_config(plain_legacy).rope_scaling is None
    assert hf_config.model_config(plain_legacy).rope_theta == 500.0
    with pytest.raises(ConfigError, match="rope type"):
        hf_config.model_config(dict(common, rope_parameters={"rope_type": "linear", "factor": 2.0}))
