"""Useful FLOPs from the config's shapes (farskip_jax.inspect.flops): hand counts of small configs,
the issue's DeepSeek-V2-Lite reference numbers, and XLA's own cost analysis of dense CPU compiles."""

from __future__ import annotations

import dataclasses

import pytest

from farskip_jax.config import Config, ExecutionConfig, ModelConfig, TrainConfig
from farskip_jax.inspect import flops

# A tiny MLA model, every width distinct so that a wrong product shows: 2 layers (1 dense, 1 MoE).
TINY = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=12,
                   num_layers=2, num_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                   qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, first_k_dense_replace=1)


def test_causal_keys_per_query() -> None:
    # one document of 4: the queries see 1, 2, 3, 4 keys
    assert flops.causal_keys_per_query(4) == pytest.approx(2.5)
    assert flops.causal_keys_per_query(4096) == pytest.approx(2048.5)
    # documents of 3 packed into 7 tokens: 3 + 3 + 1 tokens -> (6 + 6 + 1) / 7
    assert flops.causal_keys_per_query(7, doc_len=3) == pytest.approx(13 / 7)
    # chunks of 2 inside one document of 5: 1+2, 1+2, 1
    assert flops.causal_keys_per_query(5, chunk=2) == pytest.approx(7 / 5)
    assert flops.causal_keys_per_query(5, doc_len=99) == flops.causal_keys_per_query(5)


def test_hand_count_of_a_tiny_mla_model() -> None:
    t = 10  # causal: 5.5 keys per query
    f = flops.forward_flops_per_token(TINY, t)
    # attention, per layer: q 32x(4x12), kv_a 32x(16+4), kv_b 16x(4x(8+6)), o (4x6)x32
    proj = 2 * (32 * 48 + 32 * 20 + 16 * 56 + 24 * 32)
    assert f.attention_proj == 2 * proj
    # core: per key, q.k over 4 heads x 12 and p.v over 4 heads x 6
    assert f.attention_core == pytest.approx(2 * 5.5 * 2 * (4 * 12 + 4 * 6))
    assert f.dense_mlp == 2 * 3 * 32 * 48
    assert f.shared_experts == 2 * 3 * 32 * 12
    assert f.router == 2 * 32 * 8
    assert f.routed_experts == 2 * 2 * 3 * 32 * 12
    assert f.lm_head == 2 * 32 * 100
    assert f.total == pytest.approx(sum(f.as_dict()[k] for k in flops.FIELDS))
    # q-LoRA: q_a 32x16 and q_b 16x(4x12) replace q_proj; the output gate adds 32x(4x6)
    lora = dataclasses.replace(TINY, q_lora_rank=16, attn_output_gate=True)
    g = flops.forward_flops_per_token(lora, t)
    assert g.attention_proj - f.attention_proj == 2 * 2 * (32 * 16 + 16 * 48 - 32 * 48 + 32 * 24)


def test_hand_count_of_gqa_and_chunked_attention() -> None:
    gqa = dataclasses.replace(TINY, attention_kind="gqa", num_kv_heads=2, head_dim=8, num_layers=2,
                              attention_chunk_size=4, nope_layers=(1,))
    f = flops.forward_flops_per_token(gqa, 8)
    # q 32x(4x8), k and v 32x(2x8), o (4x8)x32
    assert f.attention_proj == 2 * 2 * (32 * 32 + 2 * 32 * 16 + 32 * 32)
    # layer 0 (RoPE, chunks of 4): 2.5 keys; layer 1 (NoPE, full causal over 8): 4.5
    assert f.attention_core == pytest.approx((2.5 + 4.5) * 2 * (4 * 8 + 4 * 8))


def test_decode_counts_the_absorbed_latent_attention() -> None:
    s = 64
    f = flops.decode_flops_per_token(TINY, s)
    # W_UK into the query (4 x 8 x 16), W_UV after the softmax (4 x 16 x 6), no kv_b of the token
    proj = 2 * (32 * 48 + 32 * 20 + 4 * 8 * 16 + 4 * 16 * 6 + 24 * 32)
    assert f.attention_proj == 2 * proj
    # per cached key: scores over latent + rope (16 + 4), context over the latent (16), 4 heads
    assert f.attention_core == 2 * s * 2 * 4 * (20 + 16)
    plain = flops.decode_flops_per_token(TINY, s, absorbed=False)
    assert plain.attention_core == 2 * s * 2 * (4 * 12 + 4 * 6)


def test_step_multipliers() -> None:
    cfg = Config(model=TINY, train=TrainConfig(mode="fcsd"))
    per_token = flops.forward_flops_per_token(TINY, 16).total
    fcsd = flops.step_flops(cfg, "fcsd", devices=8, seq_len=16, seqs_per_device=2)
    assert fcsd["tokens"] == 8 * 2 * 16 and fcsd["passes"] == {"student": 3.0, "teacher": 1.0}
    assert fcsd["total"] == pytest.approx(4 * 8 * 2 * 16 * per_token)
    assert fcsd["per_device"] == pytest.approx(fcsd["total"] / 8)
    lm = flops.step_flops(cfg, "train", devices=8, seq_len=16, seqs_per_device=2)  # `lm`: no teacher
    assert lm["total"] == pytest.approx(3 * 8 * 2 * 16 * per_token)
    cached = dataclasses.replace(cfg, train=TrainConfig(mode="fcsd", teacher_cache="/x", grad_accum_steps=2))
    c = flops.step_flops(cached, "fcsd", devices=8, seq_len=16, seqs_per_device=2)
    assert c["total"] == pytest.approx(3 * 2 * 8 * 2 * 16 * per_token)  # 2 micro-batches, no teacher
    pre = flops.step_flops(cfg, "prefill", devices=8, seq_len=16, batch=3)
    assert pre["total"] == pytest.approx(3 * 16 * per_token) and pre["per_device"] == pre["total"] / 8
    dec = flops.step_flops(cfg, "decode", devices=8, seq_len=100, batch=5)
    assert dec["total"] == pytest.approx(5 * flops.decode_flops_per_token(TINY, 100).total)
    with pytest.raises(ValueError):
        flops.step_flops(cfg, "eval", devices=8, seq_len=16)


def test_dsv2_lite_reference_numbers() -> None:
    """Issue #24: 5.47 GFLOP per token forward at T=4096 (causal), 358 TFLOP per device per FCSD step
    (8 GPUs x 4 x 4096 tokens: student 3x, teacher 1x)."""
    from farskip_jax.config import load_config

    cfg = load_config("dsv2lite_farskip")
    f = flops.forward_flops_per_token(cfg.model, 4096)
    assert f.total == pytest.approx(5.47e9, rel=1e-3)
    # 27 layers x (q 2048x3072 + kv_a 2048x576 + kv_b 512x4096 + o 2048x2048), 2 FLOPs per MAC
    assert f.attention_proj == 27 * 2 * (2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048)
    step = flops.step_flops(cfg, "fcsd", devices=8, seq_len=4096, seqs_per_device=4)
    assert step["per_device"] == pytest.approx(358e12, rel=2e-3)


REFERENCE = ExecutionConfig(attention="reference")


def _dense(**kw) -> ModelConfig:
    """A dense (no MoE layer) float32 model, run with the [T, T] reference attention (`REFERENCE`),
    wide enough that the elementwise work XLA also counts stays under 1% of the matmuls."""
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4,
                first_k_dense_replace=2, param_dtype="float32", dtype="float32")
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("kind", ["mla", "mla_lora", "gqa"])
def test_matches_xla_cost_analysis_of_a_dense_cpu_forward(kind: str) -> None:
    """XLA's cost analysis of the model's forward on CPU counts every FLOP of the compiled program,
    elementwise ones too: it must sit just above the useful count (the reference attention computes
    all T x T scores, so the masked half is added back here)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from farskip_jax.model.transformer import Transformer

    kw = {"mla": dict(q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                      v_head_dim=64),
          "mla_lora": dict(q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                           v_head_dim=64),
          "gqa": dict(attention_kind="gqa", num_kv_heads=2, head_dim=64)}[kind]
    cfg = _dense(**kw)
    b, t = 2, 64
    model = Transformer(cfg, nnx.Rngs(0), REFERENCE)
    graphdef, state = nnx.split(model)

    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids).logits

    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        cost = jax.jit(fwd).lower(state, ids).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    f = flops.forward_flops_per_token(cfg, t)
    full_attention = f.attention_core * t / ((t + 1) / 2)  # every key, not the causal (T + 1) / 2
    useful = b * t * (f.total - f.attention_core + full_attention)
    # measured 1.005 for all three; the smallest counted part (the LM head) is ~5% of the total
    assert useful <= cost["flops"] <= 1.02 * useful, (cost["flops"], useful)
