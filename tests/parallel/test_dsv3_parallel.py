"""DeepSeek-V3 / Instella-MoE sharded: EP=4 (training layout) equals one device (fp32, dropless):
loss, logits and parameter gradients, with FarSkip on every layer, the sigmoid group router with a
nonzero correction bias (replicated; it gets no gradient) and Instella's attention gate.

Model: tiny DeepSeek-V3 read from an HF config.json dict, 3 layers (dense, MoE, MoE), 16 experts in
4 groups (2 kept), top-3 renormalised and scaled by 2.5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from par_common import TINY_EXE, ids_and_weights, max_abs_err, record, run_fast

from farskip_jax import hf_config
from farskip_jax.config import MeshConfig
from farskip_jax.model.transformer import build_model, with_farskip
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place

TOL = 1e-5
B, T = 4, 16
DSV3_TINY = {
    "model_type": "deepseek_v3", "architectures": ["InstellaMoEForCausalLM"], "gated_attention": True,
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 16,
    "n_shared_experts": 1, "num_experts_per_tok": 3, "first_k_dense_replace": 1, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 64,
}


def test_ep4_equals_single_device():
    cfg = with_farskip(hf_config.model_config(DSV3_TINY), enabled=True)
    assert cfg.router_bias and cfg.attn_output_gate
    model = build_model(cfg, seed=3, exe=TINY_EXE)
    for i in (1, 2):  # a bias that changes the choice (build_model starts it at zero)
        model.layers[i].moe.router_bias[...] = jax.random.normal(jax.random.key(i), (16,)) * 0.3
    graphdef, state = nnx.split(model, nnx.Param)
    ids, w = ids_and_weights(cfg, B, T)

    def loss_fn(forward):
        def loss(s, ids, w):
            logits = forward(s, ids)
            return jnp.mean(logits * w), logits
        return loss

    single = loss_fn(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)
    (ref_loss, ref_logits), ref_grads = run_fast(jax.value_and_grad(single, has_aux=True), state, ids, w)
    mesh = make_mesh(MeshConfig(expert=4))
    par = ExpertParallel(mesh)
    sharded = place(state, mesh, "ep")
    ep = loss_fn(lambda s, ids: nnx.merge(graphdef, s)(ids, parallel=par).logits)
    (value, logits), grads = run_fast(jax.value_and_grad(ep, has_aux=True), sharded,
                                      jax.device_put(ids, batch_sharding(mesh)), w)
    errs = {"loss": max_abs_err(value, ref_loss), "logits": max_abs_err(logits, ref_logits),
            "grads": max_abs_err(grads, ref_grads)}
    for quantity, err in errs.items():
        record("dsv3_sharded", "instella_farskip/ep4", quantity, err)
    assert max(errs.values()) <= TOL, errs
    assert not np.any(np.asarray(nnx.to_pure_dict(grads)["layers"][1]["moe"]["router_bias"]))
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads)) > 1e-4
