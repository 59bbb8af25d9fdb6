"""The bundled family configs against the published config.json of the checkpoint each one names.

The published files are not downloadable here; these are public verbatim copies (source below),
checked field by field through the same `hf_config.model_config` that loads a real checkpoint.
The dtypes are ours to choose and left out; how to run the model (remat, batch split, buffers,
kernels) is the `execution` section, not a ModelConfig field. Llama-4 Scout has no verbatim copy
(two hand-edited ones disagree on RoPE); its config.json as published is checked in
tests/model/test_llama4.py. Instella-MoE has none (configs/instella_moe.yaml says which of its
values are DeepSeek-V2-Lite's).
"""

from __future__ import annotations

import dataclasses

import pytest

from farskip_jax import hf_config
from farskip_jax.config import load_config

# Ours to choose: not in config.json.
RUNTIME = ("param_dtype", "dtype")

# kvcache-ai/ktransformers KT-SFT/ktransformers/configs/model_config/config.json
# (commit f1239a1a86fa49e7b122b9b459038e1d5b028042): deepseek-ai/DeepSeek-V2-Lite(-Chat)
DSV2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}

# ai-dynamo/aiconfigurator aic-core/src/aiconfigurator_core/model_configs/deepseek-ai--DeepSeek-V3_config.json
DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# ai-dynamo/aiconfigurator aic-core/src/aiconfigurator_core/model_configs/Qwen--Qwen3-30B-A3B_config.json
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

CASES = {"dsv2lite": DSV2_LITE, "deepseek_v3": DSV3, "qwen3_30b_a3b": QWEN3_30B_A3B}


@pytest.mark.parametrize("name", list(CASES))
def test_bundled_config_is_the_published_one(name: str) -> None:
    published = dict(CASES[name])
    # The FP8 block scales are a storage format of the weights, not the model (issue #27 item 1);
    # the model of the dequantized weights is the one compared.
    published.pop("quantization_config", None)
    theirs = hf_config.model_config(published)
    ours = load_config(name).model
    runtime = {k: getattr(ours, k) for k in RUNTIME}
    differ = {f.name: (getattr(ours, f.name), getattr(theirs, f.name)) for f in dataclasses.fields(ours)
              if f.name not in RUNTIME and getattr(ours, f.name) != getattr(theirs, f.name)}
    assert not differ, f"configs/{name}.yaml vs the published config.json (ours, published): {differ}"
    assert dataclasses.replace(theirs, **runtime) == ours
