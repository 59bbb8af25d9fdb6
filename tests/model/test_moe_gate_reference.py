"""Our router and MoE block against DeepSeek-V2's original MoE gate, written here in torch.

HF transformers 5 ignores `norm_topk_prob`; DeepSeek's own modeling code does:
softmax -> (group-limited) top-k -> if top_k > 1 and norm_topk_prob: w / (sum w + 1e-20),
else w * routed_scaling_factor. The reference MoE output is sum_k w_k * expert_k(x) + shared(x).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from hf_tiny import record

from farskip_jax.config import ModelConfig
from farskip_jax.model.moe import MoE, route

BASE = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_layers=2,
                   num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                   n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                   routing="group_limited_greedy",
                   n_group=4, topk_group=2, routed_scaling_factor=2.0)


def reference_gate(x_nd: torch.Tensor, w_ed: torch.Tensor, cfg: ModelConfig):
    """DeepSeek-V2's MoEGate forward (inference), from its published description."""
    scores = F.linear(x_nd, w_ed).softmax(dim=-1)
    e = cfg.n_routed_experts
    if cfg.routing == "group_limited_greedy":
        group_scores = scores.view(-1, cfg.n_group, e // cfg.n_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, cfg.n_group, e // cfg.n_group).reshape(-1, e)
        scores = scores.masked_fill(~keep.bool(), 0.0)
    w, idx = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        w = w * cfg.routed_scaling_factor
    return w, idx


def _swiglu(x, gate_df, up_df, down_fd):
    return (F.silu(x @ gate_df) * (x @ up_df)) @ down_fd


@pytest.mark.parametrize("norm,k", [(True, 3), (False, 3), (True, 1)])
def test_gate_and_moe_match_deepseek_reference(norm, k):
    cfg = dataclasses.replace(BASE, norm_topk_prob=norm, num_experts_per_tok=k)
    # Abstract init (no eager random ops), then weights of order 0.3 so routing is far from uniform.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(params=0))))
    rng = np.random.default_rng(4)
    state = jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.3).astype(np.float32), state)
    moe = nnx.merge(graphdef, state)
    x = rng.standard_normal((2, 9, cfg.hidden_size)).astype(np.float32)
    x_nd = x.reshape(-1, cfg.hidden_size)

    w_ref, idx_ref = reference_gate(torch.tensor(x_nd), torch.tensor(np.asarray(moe.router[...]).T), cfg)
    routing = jax.jit(route, static_argnums=(2, 3))(x_nd, moe.router[...], cfg, 9)
    ours_idx, ours_w = np.asarray(routing.experts_nk), np.asarray(routing.weights_nk)
    o, r = np.argsort(ours_idx, -1), np.argsort(idx_ref.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(ours_idx, o, -1),
                                  np.take_along_axis(idx_ref.numpy(), r, -1))
    np.testing.assert_allclose(np.take_along_axis(ours_w, o, -1), np.take_along_axis(w_ref.numpy(), r, -1),
                               atol=1e-6)
    if norm and k > 1:
        np.testing.assert_allclose(ours_w.sum(-1), 1.0, atol=1e-6)  # routed_scaling_factor not applied

    # Whole MoE block: routed (weighted experts) + shared.
    t = {name: torch.tensor(np.asarray(v)) for name, v in
         (("g", moe.experts.w_gate[...]), ("u", moe.experts.w_up[...]), ("d", moe.experts.w_down[...]))}
    xt = torch.tensor(x_nd)
    routed = torch.zeros_like(xt)
    for n in range(xt.shape[0]):
        for j in range(k):
            ex = int(idx_ref[n, j])
            routed[n] += w_ref[n, j] * _swiglu(xt[n], t["g"][ex], t["u"][ex], t["d"][ex])
    sh = moe.shared
    shared = _swiglu(xt, *(torch.tensor(np.asarray(p[...]))
                           for p in (sh.gate_proj, sh.up_proj, sh.down_proj)))
    ours_shared, ours_routed, _ = nnx.jit(lambda m, v: m(v))(moe, x)
    d = cfg.hidden_size
    err = max(float(np.max(np.abs(np.asarray(ours_routed).reshape(-1, d) - routed.numpy()))),
              float(np.max(np.abs(np.asarray(ours_shared).reshape(-1, d) - shared.numpy()))))
    record("moe_gate_reference", f"norm_topk_prob={norm},k={k}", err)
    assert err <= 1e-5
