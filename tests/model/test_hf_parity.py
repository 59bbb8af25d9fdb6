"""Logit parity with HF transformers' DeepseekV2ForCausalLM (fp32, CPU), through our HF loader.

A small matrix, not a cross product, that covers each feature at least once:

| variant          | q_lora | routing              | scale | dense first | YaRN | batch x seq | saved as  |
| greedy_plain     | null   | greedy               | 1.0   | 1           | off  | 2 x 17      | 1 file    |
| qlora_group_yarn | 12     | group_limited_greedy | 2.5   | 0           | on   | 3 x 20      | 1 file    |
| qlora_dense2     | 12     | greedy               | 0.5   | 2           | on   | 2 x 19      | 4+ shards |

Each variant also checks that our router picks the same experts (and weights) as HF's gate on
the MoE layers' actual inputs.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_tiny import (
    YARN,
    build_hf,
    hf_logits,
    jax_logits,
    max_abs_err,
    random_ids,
    record,
    save_hf,
    tiny_hf_config,
)

import farskip_jax
from farskip_jax.model.moe import route

BAR = 1e-4
route_jit = jax.jit(route, static_argnums=(2, 3))

VARIANTS = {
    "greedy_plain": dict(hf=dict(), batch=2, seq=17, shard=None),
    "qlora_group_yarn": dict(hf=dict(q_lora_rank=12, topk_method="group_limited_greedy", n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=0,
                                     rope_parameters=dict(YARN)), batch=3, seq=20, shard=None),
    "qlora_dense2": dict(hf=dict(q_lora_rank=12, routed_scaling_factor=0.5, first_k_dense_replace=2,
                                 num_hidden_layers=4, rope_parameters=dict(YARN)),
                         batch=2, seq=19, shard="20KB"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    name = request.param
    v = VARIANTS[name]
    cfg = tiny_hf_config(**v["hf"])
    hf = build_hf(cfg, seed=len(name))
    directory = save_hf(hf, tmp_path_factory.mktemp(name), max_shard_size=v["shard"])
    ids = random_ids(cfg.vocab_size, v["batch"], v["seq"], seed=1)
    moe_inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, args, i=i: moe_inputs.__setitem__(i, args[0].detach().clone()))
        for i, layer in enumerate(hf.model.layers) if i >= cfg.first_k_dense_replace]
    ref = hf_logits(hf, ids)
    for h in hooks:
        h.remove()
    return dict(name=name, hf=hf, cfg=cfg, dir=directory, ids=ids, ref=ref, moe_inputs=moe_inputs,
                model=farskip_jax.from_pretrained(directory))


def test_checkpoint_layout(case):
    """The sharded variant really is sharded with an index; the others are one file."""
    files = sorted(p.name for p in case["dir"].glob("*.safetensors"))
    index = case["dir"] / "model.safetensors.index.json"
    if VARIANTS[case["name"]]["shard"]:
        assert len(files) > 1 and index.exists()
        assert set(json.loads(index.read_text())["weight_map"].values()) == set(files)
    else:
        assert files == ["model.safetensors"]


def test_logits_match_hf(case):
    ours = jax_logits(case["model"], case["ids"])
    ref = case["ref"]
    assert 0.3 < float(ref.std()) < 5.0, "random init should give logits of order 1"
    err = max_abs_err(ours, ref)
    record("hf_parity", case["name"], err)
    assert err <= BAR, f"{case['name']}: max |ours - HF| = {err:.3e} > {BAR}"


def test_router_picks_same_experts(case):
    """Same expert set and weights per token as HF's gate, on the MoE inputs HF actually saw."""
    hf, model = case["hf"], case["model"]
    assert case["moe_inputs"], "no MoE layer in this variant"
    for i, h in case["moe_inputs"].items():
        _, w_ref, idx_ref = hf.model.layers[i].mlp.gate(h)
        x_nd = h.reshape(-1, h.shape[-1]).numpy()
        routing = route_jit(x_nd, model.layers[i].moe.router[...], model.cfg, h.shape[1])
        idx_ref, w_ref = idx_ref.numpy(), w_ref.detach().numpy()
        order_ref, order = np.argsort(idx_ref, axis=-1), np.argsort(np.asarray(routing.experts_nk), axis=-1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(routing.experts_nk), order, -1),
                                      np.take_along_axis(idx_ref, order_ref, -1), err_msg=f"layer {i}")
        np.testing.assert_allclose(np.take_along_axis(np.asarray(routing.weights_nk), order, -1),
                                   np.take_along_axis(w_ref, order_ref, -1), atol=1e-6, err_msg=f"layer {i}")


def test_bf16_smoke(case):
    """bf16 params and compute stay close to the fp32 HF logits (logits std ~1.2).

    Measured on greedy_plain: max 0.22, mean 0.015. Rounding the parameters can flip a routing
    decision (qlora_group_yarn: max 0.47 with bf16 params even under fp32 compute), so the max bar
    is loose and the mean bar is the tight one.
    """
    if case["name"] != "greedy_plain":
        pytest.skip("one bf16 variant is enough")
    model = farskip_jax.from_pretrained(case["dir"], param_dtype="bfloat16", dtype="bfloat16")
    assert model.layers[1].moe.experts.w_gate[...].dtype == jnp.bfloat16
    ours = jax_logits(model, case["ids"])
    assert ours.dtype == np.float32 and np.all(np.isfinite(ours))
    err = max_abs_err(ours, case["ref"])
    mean_err = float(np.mean(np.abs(ours - case["ref"])))
    record("bf16_vs_hf_fp32", case["name"], err)
    record("bf16_vs_hf_fp32_mean", case["name"], mean_err)
    assert mean_err <= 0.04, f"bf16 logits drift {mean_err:.3e} (mean) from fp32 HF"
    assert err <= 0.6, f"bf16 logits drift {err:.3e} (max) from fp32 HF"
    assert err > 1e-4, "a bf16 run should not be as close as fp32: is the dtype ignored?"
