"""Qwen3-MoE sharded: EP=4 (training layout), TP=2 (inference layout: query and key/value heads,
dense MLP width and experts over `tensor`) and TP=4 (more ranks than the 2 key/value heads: each
head copied to the two ranks whose query heads read it) equal one device (fp32, dropless): loss,
logits and parameter gradients (a copied head's gradient is the sum over its copies). Key/value
heads that neither split over nor divide the ranks: a clear error.

Model: tiny Qwen3-MoE read from an HF config.json dict, 4 layers (MoE, dense, MoE, MoE via
mlp_only_layers), 4 query / 2 key/value heads of head_dim 12, 8 experts top-2 renormalised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from par_common import TINY_EXE, ids_and_weights, max_abs_err, record, run_fast

from farskip_jax import hf_config
from farskip_jax.config import ConfigError, MeshConfig, ModelConfig
from farskip_jax.model.transformer import build_model, with_farskip
from farskip_jax.parallel import ExpertParallel, batch_sharding, make_mesh, place, tp_forward

TOL = 1e-5
B, T = 4, 16
QWEN3_TINY = {
    "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 12, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 64,
}


def _cfg(farskip: bool) -> ModelConfig:
    return with_farskip(hf_config.model_config(QWEN3_TINY), enabled=farskip)


def _loss_fn(forward):
    def loss(state, ids, w):
        logits = forward(state, ids)
        return jnp.mean(logits * w), logits
    return loss


@pytest.fixture(scope="module", params=[False, True], ids=["regular", "farskip"])
def reference(request):
    cfg = _cfg(request.param)
    graphdef, state = nnx.split(build_model(cfg, seed=3, exe=TINY_EXE), nnx.Param)
    ids, w = ids_and_weights(cfg, B, T)
    loss = _loss_fn(lambda s, ids: nnx.merge(graphdef, s)(ids).logits)
    (value, logits), grads = run_fast(jax.value_and_grad(loss, has_aux=True), state, ids, w)
    return dict(farskip=request.param, graphdef=graphdef, state=state, ids=ids, w=w, loss=value,
                logits=logits, grads=grads)


def _fold_kv_copies(grads, reference):
    """Gradients of the TP=4 layout folded back to the model's shapes: a key/value head copied to
    r ranks gets the sum of its r copies' gradients."""
    def fold(g, ref):
        g = np.asarray(g)
        if g.shape == ref.shape:
            return g
        axis, heads = g.ndim - 2, ref.shape[g.ndim - 2]
        return g.reshape(*g.shape[:axis], heads, g.shape[axis] // heads, *g.shape[axis + 1:]).sum(axis + 1)
    return jax.tree.map(fold, grads, reference)


# `slow` (CI time budget): regular connectivity's EP and TP paths are checked at 8 devices in
# tests/parallel/test_exactness.py; the default suite keeps FarSkip's EP=4 and TP=4 here (the GQA
# head split is the same code for both connectivities).
SLOW_CASES = {"regular-ep4", "regular-tp2", "farskip-tp2", "regular-tp4"}


@pytest.mark.parametrize("mesh_name", ["ep4", "tp2", "tp4"])
def test_sharded_equals_single_device(reference, mesh_name):
    graphdef, state, ids, w = reference["graphdef"], reference["state"], reference["ids"], reference["w"]
    if mesh_name == "ep4":
        mesh = make_mesh(MeshConfig(expert=4))
        par = ExpertParallel(mesh)
        sharded, ids = place(state, mesh, "ep"), jax.device_put(ids, batch_sharding(mesh))
        forward = lambda s, ids: nnx.merge(graphdef, s)(ids, parallel=par).logits  # noqa: E731
    else:
        tensor = int(mesh_name[2:])
        mesh = make_mesh(MeshConfig(tensor=tensor))
        fwd = tp_forward(graphdef, state, mesh)
        sharded = place(state, mesh, "tp")
        k_proj = sharded["layers"][0]["attn"]["k_proj"]
        assert k_proj.sharding.spec[1] == "tensor" and k_proj.shape[1] == max(2, tensor)
        forward = lambda s, ids: fwd(s, ids)[0]  # noqa: E731
    (value, logits), grads = run_fast(jax.value_and_grad(_loss_fn(forward), has_aux=True),
                                      sharded, ids, w)
    grads = _fold_kv_copies(grads, reference["grads"])
    case = f"{'farskip' if reference['farskip'] else 'regular'}/{mesh_name}"
    errs = {"loss": max_abs_err(value, reference["loss"]), "logits": max_abs_err(logits, reference["logits"]),
            "grads": max_abs_err(grads, reference["grads"])}
    for quantity, err in errs.items():
        record("qwen3_sharded", case, quantity, err)
    assert max(errs.values()) <= TOL, errs
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(reference["grads"])) > 1e-4


def test_tensor_split_must_divide_or_copy_kv_heads():
    """With 6 query and 3 key/value heads, TP=2 can neither split nor copy the key/value heads: refused
    before any compile."""
    cfg = dataclasses.replace(_cfg(False), num_heads=6, num_kv_heads=3)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, exe=TINY_EXE)), nnx.Param)
    with pytest.raises(ConfigError, match=r"mesh.tensor=2 does not split the model's key/value heads "
                                          r"\(3: neither a multiple nor a divisor of 2\)"):
        tp_forward(graphdef, state, make_mesh(MeshConfig(tensor=2)))
    biased = dataclasses.replace(_cfg(False), attention_bias=True)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(biased, exe=TINY_EXE)), nnx.Param)
    with pytest.raises(ConfigError, match="attention_bias"):
        tp_forward(graphdef, state, make_mesh(MeshConfig(tensor=2)))
