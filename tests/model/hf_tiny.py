"""Shared helpers for the HF-parity tests: tiny random DeepSeek-V2/V3, Qwen3-MoE and Llama-4 models in
torch and JAX.

Not a test module. Imported by tests/model/* and tests/test_cli_logits.py. HF models are built
with random weights of a scale that gives logits of order 1 (normal std 0.2 for matrices and
embeddings, U(0.5, 1.5) for norm scales), so that a parity bar of 1e-4 means something.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
from flax import nnx
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Collected by tests/model/conftest.py and printed in the terminal summary.
PARITY_RESULTS: list[tuple[str, str, float]] = []

# YaRN with factor = max_position_embeddings / original_max_position_embeddings (64 / 16).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_hf_config(**kw: Any) -> DeepseekV2Config:
    """A DeepSeek-V2 config small enough to build, save and compile in about a second."""
    base: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters=dict(PLAIN_ROPE))
    base.update(kw)
    if "num_attention_heads" in kw:
        base["num_key_value_heads"] = kw["num_attention_heads"]
    cfg = DeepseekV2Config(**base)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_qwen3_config(**kw: Any) -> Qwen3MoeConfig:
    """A Qwen3-MoE config of the same scale: GQA (4 query, 2 key/value heads), head_dim 12 != 32 / 4."""
    base: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_parameters=dict(PLAIN_ROPE))
    base.update(kw)
    if base["head_dim"] is None:  # unset: HF reads hidden / heads
        del base["head_dim"]
    cfg = Qwen3MoeConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_dsv3_config(**kw: Any) -> DeepseekV3Config:
    """A DeepSeek-V3 config of the same scale: 16 experts in 4 groups of 4 (2 kept), top-3,
    renormalised and scaled by 2.5, one dense layer."""
    base: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_parameters=dict(PLAIN_ROPE))
    base.update(kw)
    base["num_key_value_heads"] = base["num_attention_heads"]
    cfg = DeepseekV3Config(**base)
    cfg._attn_implementation = "eager"
    return cfg


# Llama 3.1 scaling with an original context of 16 positions: the 17-token tests reach past it, and
# head_dim 12 puts rotary frequencies in all three bands.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_llama4_config(**kw: Any) -> Llama4TextConfig:
    """A Llama-4 text config of the same scale: 4 layers, MoE every 2nd (1, 3), NoPE layer 3 (the
    default every 4th), chunks of 4 positions on the RoPE layers, GQA 4 / 2 heads of 12, 4 experts
    top-1 with a shared expert, llama3 RoPE, temperature tuning that changes from position 3 on
    (floor_scale 4, attn_scale 0.5)."""
    base: dict[str, Any] = dict(
        vocab_size=96, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=4, attn_temperature_tuning=True, floor_scale=4,
        attn_scale=0.5, use_qk_norm=True, max_position_embeddings=64, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE))
    base.update(kw)
    cfg = Llama4TextConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def build_llama4(cfg: Llama4TextConfig, seed: int = 0) -> Llama4ForCausalLM:
    torch.manual_seed(seed)
    return randomize_(Llama4ForCausalLM(cfg).eval(), seed)


def build_dsv3(cfg: DeepseekV3Config, seed: int = 0, bias_std: float = 0.3) -> DeepseekV3ForCausalLM:
    """Random weights as `randomize_`, and a random nonzero `e_score_correction_bias` (a buffer, which
    HF initialises to zero) large enough to change which experts the sigmoid scores pick."""
    torch.manual_seed(seed)
    model = randomize_(DeepseekV3ForCausalLM(cfg).eval(), seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * bias_std)
    return model


def build_qwen3(cfg: Qwen3MoeConfig, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return randomize_(Qwen3MoeForCausalLM(cfg).eval(), seed)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """In place: norms ~ U(0.5, 1.5), every other parameter ~ N(0, std^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_hf(cfg: DeepseekV2Config, seed: int = 0) -> DeepseekV2ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(cfg).eval()
    return randomize_(model, seed)


def save_hf(model: torch.nn.Module, directory: Path, max_shard_size: str | None = None) -> Path:
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kw)
    return directory


def random_ids(vocab: int, batch: int = 2, seq: int = 17, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, seq), dtype=np.int32)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    return model(torch.as_tensor(ids, dtype=torch.long), use_cache=False).logits.float().numpy()


@functools.cache
def _jitted_forward(graphdef: Any):
    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    return forward


def jax_logits(model: nnx.Module, ids: np.ndarray) -> np.ndarray:
    """Logits of our model; one compiled forward per graph (config), reused across calls."""
    graphdef, state = nnx.split(model)
    return np.asarray(_jitted_forward(graphdef)(state, ids), dtype=np.float32)


def record(test: str, variant: str, err: float) -> None:
    """Prints one `PARITY ...` line (visible with -s) and keeps it for the terminal summary."""
    PARITY_RESULTS.append((test, variant, err))
    print(f"PARITY test={test} variant={variant} max_abs_err={err:.3e}")


def max_abs_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---- generation checks shared by the family tests ----------------------------------------------

# Right-padded greedy prompts of unequal length (ids below every tiny vocabulary).
PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [12, 7], [33, 2, 90, 14, 8]]


def padded_prompts(prompts: list[list[int]] = PROMPTS) -> np.ndarray:
    """`prompts` right-padded with the generator's PAD into one [B, T] int32 array."""
    from farskip_jax.generation import PAD

    out = np.full((len(prompts), max(map(len, prompts))), PAD, np.int32)
    for b, p in enumerate(prompts):
        out[b, : len(p)] = p
    return out


def cached_logits(model: Any, ids: np.ndarray, prefix: int) -> np.ndarray:
    """Logits [1, T, V] of `ids` [1, T] through the inference cache: one prefill of the first `prefix`
    tokens, then token by token through the decode path."""
    import jax.numpy as jnp

    from farskip_jax.model.transformer import empty_cache

    ids = jnp.asarray(ids, jnp.int32)
    t = ids.shape[1]

    @nnx.jit(static_argnames="prefill")
    def run(model, ids, pos, caches, prefill):
        hidden, caches, _ = model.cached_forward(ids, pos, caches, prefill=prefill)
        return model.logits(hidden), caches

    caches = tuple(empty_cache(model.cfg, 1, t, jnp.float32) for _ in range(model.cfg.num_layers))
    logits, caches = run(model, ids[:, :prefix], jnp.arange(prefix, dtype=jnp.int32)[None], caches, True)
    got = [np.asarray(logits)]
    for i in range(prefix, t):
        logits, caches = run(model, ids[:, i : i + 1], jnp.full((1, 1), i, jnp.int32), caches, False)
        got.append(np.asarray(logits))
    return np.concatenate(got, axis=1)
