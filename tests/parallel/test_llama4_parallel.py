"""Llama-4 sharded: EP=4 (training layout) and TP=2 (inference layout: query and key/value heads,
dense MLP width, shared expert and experts over `tensor`) equal one device (fp32, dropless): loss,
logits and parameter gradients under EP, logits under TP, with FarSkip connectivity (regular
connectivity behind -m slow: the sharded paths are the same, only the wiring differs).

Model: tiny Llama-4 read from an HF config.json dict, 2 layers (dense then MoE by
interleave_moe_layer_step 2), layer 1 NoPE with temperature tuning, chunks of 4 positions on the
RoPE layer (16 tokens: 4 chunks), weightless q/k norm, 4 query / 2 key/value heads of head_dim 12,
8 experts top-2 with expert-input scaling (each token's 2 scaled copies travel as separate rows),
llama3 RoPE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from par_common import TINY_EXE, ids_and_weights, max_abs_err, record, run_fast

from farskip_jax import hf_config
from farskip_jax.config import MeshConfig, ModelConfig
from farskip_jax.model.transformer import build_model, with_farskip
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place, tp_forward

TOL = 1e-5
B, T = 4, 16
LLAMA4_TINY = {
    "model_type": "llama4_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 16,
    "intermediate_size_mlp": 48, "num_hidden_layers": 2, "no_rope_layers": [1, 0], "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12, "num_local_experts": 8, "num_experts_per_tok": 2, "interleave_moe_layer_step": 2,
    "attention_chunk_size": 4, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5,
    "use_qk_norm": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


def _cfg(farskip: bool) -> ModelConfig:
    return with_farskip(hf_config.model_config(LLAMA4_TINY), enabled=farskip)


def _loss_fn(forward):
    def loss(state, ids, w):
        logits = forward(state, ids)
        return jnp.mean(logits * w), logits
    return loss


@pytest.fixture(scope="module", params=[pytest.param(False, marks=pytest.mark.slow), True],
                ids=["regular", "farskip"])
def reference(request):
    cfg = _cfg(request.param)
    assert cfg.nope_layers == (1,) and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    assert cfg.expert_input_scaling and cfg.attention_chunk_size == 4
    graphdef, state = nnx.split(build_model(cfg, seed=3, exe=TINY_EXE), nnx.Param)
    ids, w = ids_and_weights(cfg, B, T)
    loss = _loss_fn(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)
    (value, logits), grads = run_fast(jax.value_and_grad(loss, has_aux=True), state, ids, w)
    return dict(farskip=request.param, graphdef=graphdef, state=state, ids=ids, w=w, loss=value,
                logits=logits, grads=grads)


def _errors(reference: dict, case: str, **got: jax.Array) -> dict[str, float]:
    errs = {name: max_abs_err(v, reference[name]) for name, v in got.items()}
    for quantity, err in errs.items():
        record("llama4_sharded", case, quantity, err)
    return errs


def test_ep4_equals_single_device(reference):
    """Training layout: loss, logits and gradients."""
    graphdef, state, ids, w = reference["graphdef"], reference["state"], reference["ids"], reference["w"]
    mesh = make_mesh(MeshConfig(expert=4))
    par = ExpertParallel(mesh)
    sharded, ids = place(state, mesh, "ep"), jax.device_put(ids, batch_sharding(mesh))
    forward = lambda s, ids: nnx.merge(graphdef, s)(ids, parallel=par).logits  # noqa: E731
    (value, logits), grads = run_fast(jax.value_and_grad(_loss_fn(forward), has_aux=True), sharded, ids, w)
    case = f"{'farskip' if reference['farskip'] else 'regular'}/ep4"
    errs = _errors(reference, case, loss=value, logits=logits, grads=grads)
    assert max(errs.values()) <= TOL, errs
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(reference["grads"])) > 1e-4


def test_tp2_equals_single_device(reference):
    """Inference layout (forward only): logits."""
    graphdef, state, ids = reference["graphdef"], reference["state"], reference["ids"]
    mesh = make_mesh(MeshConfig(tensor=2))
    fwd = tp_forward(graphdef, state, mesh)
    sharded = place(state, mesh, "tp")
    assert sharded["layers"][1]["moe"]["shared"]["gate_proj"].sharding.spec[1] == "tensor"
    logits = run_fast(lambda s, ids: fwd(s, ids)[0], sharded, ids)
    errs = _errors(reference, f"{'farskip' if reference['farskip'] else 'regular'}/tp2", logits=logits)
    assert max(errs.values()) <= TOL, errs
