"""HF config.json <-> ModelConfig fields, one reader and one writer per HF family.

`model_config` / `load_hf_config` (reading) and `hf_dict` (writing) are the entry points; this module
imports `farskip_jax.config`, never the reverse. The family
is config.json's `model_type` when reading (`llama4_text` / `llama4`, `qwen3_moe`, `deepseek_v3`,
else DeepSeek-V2) and the architecture fields when writing (`hf_family`). Instella-MoE is a
DeepSeek-V3 (`model_type` deepseek_v3, architecture `InstellaMoEForCausalLM`) with gated attention
(`gated_attention`).
FarSkip settings use Instella-MoE's keys in every family.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from farskip_jax.config import (
    ConfigError,
    FarSkipConfig,
    ModelConfig,
    RopeScaling,
    apply_overrides,
    from_dict,
    to_dict,
)


def model_config(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The validated ModelConfig of an HF DeepseekV2 (both rope generations), DeepseekV3 /
    Instella-MoE (`model_type: deepseek_v3`), Qwen3-MoE (`model_type: qwen3_moe`) or Llama-4
    (`model_type: llama4_text`, or `llama4` through its `text_config`) config.json, with dotted
    `overrides` of its fields applied.

    FarSkip keys (`farskip`, `farskip_start_idx`, `farskip_end_idx`, `attn_only_farskip`,
    `mlp_only_farskip`) are read as Instella-MoE writes them.
    """
    merged = apply_overrides(to_dict(ModelConfig(**model_fields(hf))), overrides, prefix="model")
    return from_dict(ModelConfig, merged, "model")


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Reads `config.json` from an HF checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"{p}: no config.json")
    with open(p) as f:
        return model_config(json.load(f))


def model_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments for an HF config.json (not yet validated)."""
    if hf.get("model_type") in ("llama4", "llama4_text"):
        return _llama4_fields(hf)
    if hf.get("model_type") == "qwen3_moe":
        return _qwen3_moe_fields(hf)
    if hf.get("model_type") == "deepseek_v3":
        return _deepseek_v3_fields(hf)
    return _deepseek_v2_fields(hf)


# Fields whose non-default values only DeepSeek-V3's HF class (or Instella-MoE's) can express.
_V3_FEATURES = {"router_score": "softmax", "router_bias": False, "group_score": "max",
                "scale_normalized_weights": False, "attn_output_gate": False, "rope_style": "interleaved"}


# Fields whose non-default values only Llama-4's HF class can express (GQA families).
_LLAMA4_FEATURES = {"router_score": "softmax", "expert_input_scaling": False, "nope_layers": (),
                    "attention_chunk_size": None, "qk_norm_after_rope": False,
                    "attn_temperature_tuning": False}


def hf_family(cfg: ModelConfig) -> str:
    """The HF model_type that `cfg` is written as: llama4_text for GQA with any of Llama-4's router,
    expert-input or attention fields, else qwen3_moe for GQA; deepseek_v3 when any field says
    DeepSeek-V3's router, RoPE layout or Instella's gate, else deepseek_v2."""
    if cfg.attention_kind == "gqa":
        if any(getattr(cfg, k) != v for k, v in _LLAMA4_FEATURES.items()):
            return "llama4_text"
        return "qwen3_moe"
    return "deepseek_v3" if any(getattr(cfg, k) != v for k, v in _V3_FEATURES.items()) else "deepseek_v2"


def hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json of `cfg`'s family; ConfigError if that family's HF class cannot express it."""
    writers = {"llama4_text": _llama4_hf_dict, "qwen3_moe": _qwen3_moe_hf_dict,
               "deepseek_v3": _deepseek_v3_hf_dict,
               "deepseek_v2": _deepseek_v2_hf_dict}
    return writers[hf_family(cfg)](cfg)


def _deepseek_v2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of an HF DeepseekV2 config.json (both rope generations)."""
    arch = hf.get("architectures") or []
    if any("Instella" in a for a in arch) or hf.get("gated_attention"):
        raise ConfigError(
            f"config.json architectures={arch} with model_type={hf.get('model_type')!r}: gated-attention "
            "(Instella-MoE) checkpoints are DeepSeek-V3 models (model_type 'deepseek_v3'); loading this "
            "one as DeepSeek-V2 would run the wrong model")
    method = hf.get("topk_method") or "greedy"
    allowed = ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ConfigError(f"config.json topk_method={method!r} is not supported; allowed: {allowed}")
    rope_scaling, rope_theta = _rope_from_hf(hf)
    kw: dict[str, Any] = dict(
        **_mla_fields(hf),
        n_shared_experts=hf.get("n_shared_experts") or 0,
        num_experts_per_tok=hf["num_experts_per_tok"],
        first_k_dense_replace=hf.get("first_k_dense_replace", 0),
        moe_layer_freq=hf.get("moe_layer_freq", 1), routing=method,
        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_alpha=float(hf.get("aux_loss_alpha", 0.001)), seq_aux=bool(hf.get("seq_aux", True)),
        farskip=_farskip_from_hf(hf),
    )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("config.json attention_bias/mlp_bias=true is not supported by DeepSeek-V2")
    return kw


def _deepseek_v2_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF DeepseekV2 config.json (transformers 5 `rope_parameters` and legacy `rope_scaling`)."""
    if cfg.mlp_only_layers or cfg.moe_layer_offset or cfg.router_norm_min_k != 2:
        raise ConfigError("mlp_only_layers, moe_layer_offset and router_norm_min_k != 2 cannot be "
                          "written as a DeepseekV2 config.json")
    _require(cfg, _V3_FEATURES, "DeepseekV2")
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        **_mla_keys(cfg),
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": cfg.moe_layer_freq,
        "topk_method": cfg.routing, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": _rope_to_hf(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "aux_loss_alpha": cfg.aux_loss_alpha,
        "seq_aux": cfg.seq_aux, "bos_token_id": 100000, "eos_token_id": 100001,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        **_farskip_hf_keys(cfg),
    }


def _qwen3_moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of an HF Qwen3-MoE config.json, read as transformers' Qwen3Moe* classes
    read them (MODEL_FAMILIES.md): `head_dim` defaults to hidden / heads, the sliding window is off
    unless `use_sliding_window`, every layer but `mlp_only_layers` with (i + 1) % decoder_sparse_step
    == 0 is MoE, and the router renormalises its top-k weights (even top-1) when `norm_topk_prob`."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("use_sliding_window"):
        raise ConfigError("config.json use_sliding_window=true: sliding-window attention is not supported")
    # Published configs say num_experts; transformers 5 writes its alias num_local_experts.
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    if not experts:
        raise ConfigError("config.json num_experts=0 is a dense model; only MoE models are supported")
    rope_scaling, rope_theta = _rope_from_hf(hf)
    if rope_scaling is not None:
        raise ConfigError("config.json: Qwen3-MoE with RoPE scaling is not supported (rope type must be "
                          "'default')")
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, attention_kind="gqa", num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim"), qk_norm=True, attention_bias=bool(hf.get("attention_bias", False)),
        rope_style="half", n_routed_experts=experts, n_shared_experts=0,
        num_experts_per_tok=hf.get("num_experts_per_tok", 8), first_k_dense_replace=0,
        moe_layer_freq=hf.get("decoder_sparse_step", 1), moe_layer_offset=1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()), routing="greedy", routed_scaling_factor=1.0,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router_norm_min_k=1,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=None,
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_alpha=float(hf.get("router_aux_loss_coef", 0.001)), seq_aux=False,
        farskip=_farskip_from_hf(hf))


def _qwen3_moe_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF Qwen3MoeForCausalLM config.json; the inverse of `_qwen3_moe_fields`."""
    fixed = {"qk_norm": True, "rope_style": "half", "n_shared_experts": 0, "first_k_dense_replace": 0,
             "moe_layer_offset": 1, "router_norm_min_k": 1, "routed_scaling_factor": 1.0,
             "routing": "greedy", "rope_scaling": None, "router_score": "softmax", "router_bias": False}
    differ = [f"{k}={getattr(cfg, k)!r} (Qwen3-MoE has {v!r})" for k, v in fixed.items()
              if getattr(cfg, k) != v]
    if differ:
        raise ConfigError("this GQA config cannot be written as a Qwen3-MoE config.json: "
                          + ", ".join(differ))
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        # Unset: HF reads hidden / heads too; omitted so that the config round-trips.
        **({} if cfg.head_dim is None else {"head_dim": cfg.head_dim}),
        "num_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.moe_layer_freq,
        "mlp_only_layers": list(cfg.mlp_only_layers), "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": cfg.attention_bias, "use_sliding_window": False,
        "router_aux_loss_coef": cfg.aux_loss_alpha,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        **_farskip_hf_keys(cfg),
    }


def _deepseek_v3_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of an HF DeepseekV3 config.json, read as transformers' DeepseekV3* classes
    read them (MODEL_FAMILIES.md): sigmoid router with `e_score_correction_bias`, groups scored by
    their top-2 biased scores (n_group 1 = one group), weights renormalised (`norm_topk_prob`, even
    top-1) and then always scaled; every layer from `first_k_dense_replace` on is MoE
    (`moe_layer_freq`, `topk_method`, `scoring_func` are ignored, as HF ignores them); absent keys
    take HF's class defaults. Instella-MoE adds `gated_attention` (its `qk_layernorm` key is not read
    by its own modeling code either). MTP layers (`num_nextn_predict_layers`) are not part of the
    model: the loaders skip their tensors."""
    arch = hf.get("architectures") or []
    if any("Instella" in a for a in arch) and "gated_attention" not in hf:
        raise ConfigError(f"config.json architectures={arch} has no 'gated_attention' key: cannot tell "
                          "whether the attention output is gated")
    if (quant := hf.get("quantization_config")) and quant.get("quant_method") != "fp8":
        # FP8 block quantization (DeepSeek-V3 / R1 as published) is a storage format of the weights,
        # dequantized as they are read (checkpoint/hf_io.py); the model is the same.
        raise ConfigError(f"config.json quantization_config={quant.get('quant_method')!r}: only the "
                          "published FP8 block quantization is read; dequantize other formats to bf16 first")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("config.json attention_bias/mlp_bias=true is not supported by DeepSeek-V3")
    rope_scaling, rope_theta = _rope_from_hf(hf)
    return dict(
        **_mla_fields(hf),
        n_shared_experts=hf.get("n_shared_experts", 1) or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        first_k_dense_replace=hf.get("first_k_dense_replace", 3), moe_layer_freq=1,
        routing="group_limited_greedy", n_group=hf.get("n_group", 8) or 1,
        topk_group=hf.get("topk_group", 4) or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_norm_min_k=1,
        router_score="sigmoid", router_bias=True, group_score="top2_sum", scale_normalized_weights=True,
        attn_output_gate=bool(hf.get("gated_attention", False)),
        rope_style="interleaved" if hf.get("rope_interleave", True) else "half",
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_alpha=float(hf.get("aux_loss_alpha", 0.001)), seq_aux=bool(hf.get("seq_aux", True)),
        farskip=_farskip_from_hf(hf))


_V3_FIXED = {"router_score": "sigmoid", "router_bias": True, "group_score": "top2_sum",
             "scale_normalized_weights": True, "router_norm_min_k": 1, "routing": "group_limited_greedy",
             "moe_layer_freq": 1, "moe_layer_offset": 0, "mlp_only_layers": ()}


def _deepseek_v3_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF DeepseekV3 config.json (Instella-MoE's architecture name and `gated_attention` when the
    attention output is gated); the inverse of `_deepseek_v3_fields`."""
    _require(cfg, _V3_FIXED, "DeepseekV3")
    arch = "InstellaMoEForCausalLM" if cfg.attn_output_gate else "DeepseekV3ForCausalLM"
    return {
        "architectures": [arch], "model_type": "deepseek_v3",
        **_mla_keys(cfg),
        "num_experts_per_tok": cfg.num_experts_per_tok, "first_k_dense_replace": cfg.first_k_dense_replace,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "rope_interleave": cfg.rope_style == "interleaved", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_to_hf(cfg), "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
        "aux_loss_alpha": cfg.aux_loss_alpha, "seq_aux": cfg.seq_aux,
        # The export holds no multi-token-prediction layers (they are not loaded).
        "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        **({"gated_attention": True} if cfg.attn_output_gate else {}),
        **_farskip_hf_keys(cfg),
    }


def _llama4_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of an HF Llama-4 config.json: `llama4_text` (Llama4ForCausalLM) or `llama4`
    (Llama4ForConditionalGeneration, whose `text_config` is read; the vision tower is not part of the
    model), read as transformers' Llama4Text* classes read them (MODEL_FAMILIES.md): MoE layers are
    `moe_layers`, else every `interleave_moe_layer_step`-th; an empty or absent `no_rope_layers`
    (1 = uses RoPE) means NoPE on every `no_rope_layer_interval`-th layer; RoPE layers attend in
    chunks of `attention_chunk_size` (null: full); `attn_temperature_tuning` is read as a truth value,
    so the published Scout's 4 (an int, which transformers 5.24's own config class refuses) works."""
    if hf.get("model_type") == "llama4":
        text = dict(hf.get("text_config") or {})
        for key in ("tie_word_embeddings", "farskip", "farskip_start_idx", "farskip_end_idx",
                    "attn_only_farskip", "mlp_only_farskip", "farskip_stale_blocks"):
            if key in hf and key not in text:
                text[key] = hf[key]
        hf = text
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if quant := hf.get("quantization_config"):
        raise ConfigError(f"config.json quantization_config={quant.get('quant_method')!r}: quantized "
                          "checkpoints are not supported; dequantize the weights to bf16 first")
    layers = int(hf.get("num_hidden_layers", 48))
    step = int(hf.get("interleave_moe_layer_step", 1))
    moe_layers = hf.get("moe_layers")
    if moe_layers is None or list(moe_layers) == list(range(step - 1, layers, step)):
        freq, mlp_only = step, ()
    else:  # any other list: every layer MoE but the ones it leaves out
        freq, mlp_only = 1, tuple(i for i in range(layers) if i not in set(moe_layers))
    interval = int(hf.get("no_rope_layer_interval", 4))
    no_rope = list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)])
    nope = tuple(i for i in range(layers) if not no_rope[i])
    chunk = hf.get("attention_chunk_size")
    expected = ["chunked_attention" if rope and chunk is not None else "full_attention"
                for rope in no_rope[:layers]]
    if hf.get("layer_types") is not None and list(hf["layer_types"]) != expected:
        raise ConfigError(f"config.json layer_types={hf['layer_types']}: only chunked attention on the RoPE "
                          f"layers (no_rope_layers) is supported, i.e. {expected}")
    rope_scaling, rope_theta = _rope_from_hf(hf, default_theta=500000.0)
    heads = hf.get("num_attention_heads", 40)
    return dict(
        vocab_size=hf.get("vocab_size", 202048), hidden_size=hf.get("hidden_size", 5120),
        intermediate_size=hf.get("intermediate_size_mlp", 16384),
        moe_intermediate_size=hf.get("intermediate_size", 8192), num_layers=layers, num_heads=heads,
        attention_kind="gqa", num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim"),
        attention_bias=bool(hf.get("attention_bias", False)), rope_style="interleaved",
        n_routed_experts=hf.get("num_local_experts", 16), n_shared_experts=1,
        num_experts_per_tok=hf.get("num_experts_per_tok", 1), first_k_dense_replace=0,
        moe_layer_freq=freq, moe_layer_offset=1, mlp_only_layers=mlp_only, routing="greedy",
        routed_scaling_factor=1.0, norm_topk_prob=False, router_score="sigmoid_topk",
        expert_input_scaling=True, nope_layers=nope, attention_chunk_size=chunk,
        qk_norm_after_rope=bool(hf.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
        floor_scale=float(hf.get("floor_scale", 8192)), attn_scale=float(hf.get("attn_scale", 0.1)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=rope_theta, rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        aux_loss_alpha=float(hf.get("router_aux_loss_coef", 0.001)), seq_aux=False,
        farskip=_farskip_from_hf(hf))


_LLAMA4_FIXED = {"rope_style": "interleaved", "n_shared_experts": 1, "first_k_dense_replace": 0,
                 "moe_layer_offset": 1, "routing": "greedy", "routed_scaling_factor": 1.0,
                 "router_score": "sigmoid_topk", "router_bias": False, "expert_input_scaling": True,
                 "qk_norm": False, "norm_topk_prob": False}


def _llama4_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF Llama4ForCausalLM (`llama4_text`) config.json; the inverse of `_llama4_fields`. The MoE
    layers are written both ways (`interleave_moe_layer_step` and the `moe_layers` it implies, which
    HF reads first)."""
    _require(cfg, _LLAMA4_FIXED, "Llama4Text")
    if cfg.rope_scaling is not None and cfg.rope_scaling.type != "llama3":
        raise ConfigError("this config cannot be written as a Llama4Text config.json: rope_scaling type "
                          f"{cfg.rope_scaling.type!r} (Llama-4 has llama3 or none)")
    chunk = cfg.attention_chunk_size
    return {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.moe_intermediate_size, "intermediate_size_mlp": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.attn_head_dim,
        "num_local_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "interleave_moe_layer_step": cfg.moe_layer_freq,
        "moe_layers": [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)],
        "no_rope_layers": [int(cfg.uses_rope(i)) for i in range(cfg.num_layers)],
        "attention_chunk_size": chunk,
        "layer_types": ["chunked_attention" if cfg.chunked_layer(i) else "full_attention"
                        for i in range(cfg.num_layers)],
        "use_qk_norm": cfg.qk_norm_after_rope, "attn_temperature_tuning": cfg.attn_temperature_tuning,
        "floor_scale": int(cfg.floor_scale) if float(cfg.floor_scale).is_integer() else cfg.floor_scale,
        "attn_scale": cfg.attn_scale, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": _rope_to_hf(cfg), "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": cfg.attention_bias, "router_aux_loss_coef": cfg.aux_loss_alpha,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        **_farskip_hf_keys(cfg),
    }


# ---- shared by all families -----------------------------------------------------------------


def _mla_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The widths and counts every MLA family (DeepSeek-V2, DeepSeek-V3) reads the same way."""
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf["moe_intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], n_routed_experts=hf["n_routed_experts"])


def _mla_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of `_mla_fields` (plus n_shared_experts), in config.json's key order."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts}


def _require(cfg: ModelConfig, fixed: Mapping[str, Any], family: str) -> None:
    """ConfigError naming every field of `cfg` that differs from what `family`'s config.json can say."""
    differ = [f"{k}={getattr(cfg, k)!r} ({family} has {v!r})" for k, v in fixed.items()
              if getattr(cfg, k) != v]
    if differ:
        raise ConfigError(f"this config cannot be written as a {family} config.json: " + ", ".join(differ))


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5 `rope_parameters` of `cfg` (default, YaRN or llama3)."""
    if cfg.rope_scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        return {"rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings}
    return {"rope_theta": cfg.rope_theta, "rope_type": "yarn", "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim}


def _rope_from_hf(hf: Mapping[str, Any], default_theta: float = 10000.0) -> tuple[RopeScaling | None, float]:
    """Reads `rope_scaling` (published DeepSeek-V2, Llama-4) or `rope_parameters` (transformers 5)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None, theta
    if kind == "llama3":
        return RopeScaling(
            type="llama3", factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"])), theta
    if kind != "yarn":
        raise ConfigError(f"config.json rope type {kind!r} is not supported; allowed: 'default', 'yarn', "
                          "'llama3'")
    return RopeScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 1.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
    ), theta


def _farskip_from_hf(hf: Mapping[str, Any]) -> FarSkipConfig:
    """FarSkip settings from Instella-MoE's keys (plus ours, `farskip_stale_blocks`). An end index
    past the last layer means the last layer, as in Instella-MoE's code (its config says 10000)."""
    start, end = hf.get("farskip_start_idx"), hf.get("farskip_end_idx")
    if end is not None:
        end = min(int(end), int(hf["num_hidden_layers"]) - 1)
    return FarSkipConfig(
        enabled=bool(hf.get("farskip", False)), start_idx=None if start is None else int(start),
        end_idx=end, attn_only=bool(hf.get("attn_only_farskip", False)),
        mlp_only=bool(hf.get("mlp_only_farskip", False)), stale_blocks=int(hf.get("farskip_stale_blocks", 1)))


def _farskip_hf_keys(cfg: ModelConfig) -> dict[str, Any]:
    """FarSkip keys as Instella-MoE writes them, for FarSkip-aware serving code."""
    fs = cfg.farskip
    fs_range = fs.layer_range(cfg.num_layers)
    on = fs.enabled and len(fs_range) > 0
    return {
        "farskip": bool(on),
        "farskip_start_idx": fs_range.start if on else None,
        "farskip_end_idx": fs_range.stop - 1 if on else None,
        "attn_only_farskip": fs.attn_only, "mlp_only_farskip": fs.mlp_only,
        # Ours (no Instella key): written only for the experimental stale_blocks=2 model, so
        # that it does not load back as the paper's FarSkip.
        **({"farskip_stale_blocks": fs.stale_blocks} if fs.stale_blocks != 1 else {}),
    }
