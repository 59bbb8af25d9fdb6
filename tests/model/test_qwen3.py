"""Qwen3-MoE: logit parity with HF's Qwen3MoeForCausalLM (fp32, CPU) through our HF loader, FarSkip
against a reference wired from HF's own submodules, connectivity off == regular bitwise, and the
converter's HF -> Orbax -> HF round trip bitwise (and a FarSkip export's transformers remote code),
and generation over the GQA key/value cache (one device and TP=2) against HF generate.

| variant            | MoE layers of L (rule)      | heads q/kv | head_dim | top-k | norm | tied | bias |
| gqa_hd12_mlponly   | 0, 2, 3 of 4 (step 1, [1])  | 4 / 2      | 12       | 2     | on   | no   | no   |
| step2_mqa_tied     | 3 of 4 (step 2, [1])        | 4 / 1      | 8 (32/4) | 2     | off  | yes  | no   |
| top1_norm_bias_mha | 0, 1 of 2 (step 1, [])      | 4 / 4      | 12       | 1     | on   | no   | yes  |

(rule: decoder_sparse_step, mlp_only_layers)

head_dim 12 differs from hidden / heads = 8 wherever it is set. top1 with norm_topk_prob checks
that the Qwen3 router renormalises even one weight (to 1), which DeepSeek's code does not.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import (
    PROMPTS,
    build_qwen3,
    cached_logits,
    hf_logits,
    jax_logits,
    max_abs_err,
    padded_prompts,
    random_ids,
    record,
    save_hf,
    tiny_qwen3_config,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import farskip_jax
from farskip_jax import hf_config
from farskip_jax.checkpoint.convert import convert_hf_to_orbax
from farskip_jax.checkpoint.hf_io import TensorSource
from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf
from farskip_jax.config import MeshConfig
from farskip_jax.generation import Generator
from farskip_jax.model.farskip import REGULAR
from farskip_jax.parallel import make_mesh

BAR = 1e-4

VARIANTS = {
    "gqa_hd12_mlponly": dict(num_hidden_layers=4, mlp_only_layers=[1]),
    "step2_mqa_tied": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[1],
                           num_key_value_heads=1, head_dim=None, norm_topk_prob=False,
                           tie_word_embeddings=True),
    "top1_norm_bias_mha": dict(num_hidden_layers=2, num_key_value_heads=4, num_experts_per_tok=1,
                               attention_bias=True),
}
MOE_LAYERS = {"gqa_hd12_mlponly": [0, 2, 3], "step2_mqa_tied": [3], "top1_norm_bias_mha": [0, 1]}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    name = request.param
    hf_cfg = tiny_qwen3_config(**VARIANTS[name])
    hf = build_qwen3(hf_cfg, seed=len(name))
    directory = save_hf(hf, tmp_path_factory.mktemp(name))
    ids = random_ids(hf_cfg.vocab_size, batch=2, seq=17, seed=1)
    return dict(name=name, hf=hf, dir=directory, ids=ids, ref=hf_logits(hf, ids),
                model=farskip_jax.from_pretrained(directory))


def test_config_and_layer_rule(case):
    """Our config reads HF's rules: MoE layers, kv heads, head_dim, tied head, no shared expert."""
    cfg, hf = case["model"].cfg, case["hf"]
    hf_moe = [i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    assert hf_moe == MOE_LAYERS[case["name"]]
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == hf_moe
    assert cfg.attention_kind == "gqa" and cfg.n_shared_experts == 0
    assert cfg.kv_heads == hf.config.num_key_value_heads
    assert cfg.attn_head_dim == hf.model.layers[0].self_attn.head_dim
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ("lm_head.weight" in TensorSource(case["dir"]).keys()) != cfg.tie_word_embeddings
    # config.json round trip through ours
    assert hf_config.model_config(hf_config.hf_dict(cfg)) == cfg


def test_logits_match_hf(case):
    ours = jax_logits(case["model"], case["ids"])
    ref = case["ref"]
    assert 0.3 < float(ref.std()) < 5.0, "random init should give logits of order 1"
    err = max_abs_err(ours, ref)
    record("qwen3_hf_parity", case["name"], err)
    assert err <= BAR, f"{case['name']}: max |ours - HF| = {err:.3e} > {BAR}"


def test_converter_round_trip_bitwise(case, tmp_path):
    """HF -> Orbax -> HF gives back every tensor bit for bit, and a config HF reads as the same model."""
    orbax, back = tmp_path / "orbax", tmp_path / "hf"
    quiet = dict(progress=False, log=lambda _line: None)
    convert_hf_to_orbax(case["dir"], orbax, **quiet)
    convert_orbax_to_hf(orbax, back, **quiet)
    src, out = TensorSource(case["dir"]), TensorSource(back)
    assert set(src.keys()) == set(out.keys())
    for k in src.keys():
        a, b = src.read(k), out.read(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
    written = json.loads((back / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe" and "auto_map" not in written
    assert hf_config.model_config(written) == case["model"].cfg
    np.testing.assert_array_equal(jax_logits(farskip_jax.from_pretrained(orbax), case["ids"]),
                                  jax_logits(case["model"], case["ids"]))


# --------------------------------------------------------------------------------------------
# FarSkip: a reference wired from HF's submodules by FARSKIP.md's equations (S = 0: no shared expert)


@torch.no_grad()
def farskip_reference(hf, ids: np.ndarray, farskip_layers: set[int], mode: str = "both") -> np.ndarray:
    """Logits with FarSkip on `farskip_layers`; mode both / attn_only / mlp_only.

    x: full stream; y: x without the previous layer's routed output (None: same as x, so the layer
    is a parallel block). With no shared expert y' = x + A for a MoE layer; a dense layer passes
    one stream on.
    """
    m = hf.model
    tokens = torch.as_tensor(ids, dtype=torch.long)
    t = tokens.shape[1]
    x = m.embed_tokens(tokens)
    rope = m.rotary_emb(x, torch.arange(t)[None])
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    y = None
    for i, layer in enumerate(m.layers):
        is_moe = isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)

        def attn(h, layer=layer):
            return layer.self_attn(layer.input_layernorm(h), position_embeddings=rope, attention_mask=mask)[0]

        def ffn(h, layer=layer):  # R for a MoE layer, M for a dense one
            return layer.mlp(layer.post_attention_layernorm(h))

        if i not in farskip_layers:  # regular: x' = (x + A) + R
            h = x + attn(x)
            x, y = h + ffn(h), None
        elif mode == "both":  # A = Attn(LN1(y)); R = MoE(LN2(x)); y' = x + A
            h = x + attn(x if y is None else y)
            x, y = h + ffn(x), (h if is_moe else None)
        elif mode == "attn_only":  # only attention reads y; the FFN reads x + A
            h = x + attn(x if y is None else y)
            x, y = h + ffn(h), (h if is_moe else None)
        elif mode == "mlp_only":  # only the FFN reads the stale x; no y stream
            h = x + attn(x)
            x, y = h + ffn(x), None
        else:
            raise ValueError(mode)
    return hf.lm_head(m.norm(x)).float().numpy()


FARSKIP_CASES = {
    # name: (our overrides, reference layers, mode); model gqa_hd12_mlponly: MoE, dense, MoE, MoE
    "full": ({"farskip.enabled": True}, {0, 1, 2, 3}, "both"),
    "range_1_3": ({"farskip.enabled": True, "farskip.start_idx": 1}, {1, 2, 3}, "both"),
    "attn_only_full": ({"farskip.enabled": True, "farskip.attn_only": True}, {0, 1, 2, 3}, "attn_only"),
    "mlp_only_full": ({"farskip.enabled": True, "farskip.mlp_only": True}, {0, 1, 2, 3}, "mlp_only"),
}


@pytest.fixture(scope="module")
def fs_case(tmp_path_factory):
    """The gqa_hd12_mlponly model (its dense layer 1 receives a y stream under full FarSkip)."""
    name = "gqa_hd12_mlponly"
    hf = build_qwen3(tiny_qwen3_config(**VARIANTS[name]), seed=len(name))
    ids = random_ids(hf.config.vocab_size, batch=2, seq=17, seed=1)
    return dict(hf=hf, ids=ids, dir=save_hf(hf, tmp_path_factory.mktemp("fs")), ref=hf_logits(hf, ids))


def test_reference_without_farskip_is_hf(fs_case):
    err = max_abs_err(farskip_reference(fs_case["hf"], fs_case["ids"], set()), fs_case["ref"])
    assert err <= 1e-5, err


@pytest.mark.parametrize("name", list(FARSKIP_CASES))
def test_farskip_matches_reference(fs_case, name):
    overrides, layers, mode = FARSKIP_CASES[name]
    model = farskip_jax.from_pretrained(fs_case["dir"], **overrides)
    assert {i for i, c in enumerate(model.connectivity()) if c != REGULAR} == layers
    ref = farskip_reference(fs_case["hf"], fs_case["ids"], layers, mode)
    err = max_abs_err(jax_logits(model, fs_case["ids"]), ref)
    record("qwen3_farskip_reference", name, err)
    assert err <= BAR, f"{name}: max |ours - reference| = {err:.3e} > {BAR}"
    assert max_abs_err(ref, fs_case["ref"]) > 1e-2  # FarSkip is another function here


def test_connectivity_off_is_bitwise_regular(fs_case):
    """An empty FarSkip range, and a FarSkip model's own parameters with connectivity switched off,
    give the regular model's logits bit for bit."""
    base = jax_logits(farskip_jax.from_pretrained(fs_case["dir"]), fs_case["ids"])
    empty = farskip_jax.from_pretrained(fs_case["dir"], **{"farskip.enabled": True, "farskip.first_n": 0})
    assert all(c == REGULAR for c in empty.connectivity())
    np.testing.assert_array_equal(jax_logits(empty, fs_case["ids"]), base)
    fs = farskip_jax.from_pretrained(fs_case["dir"], **{"farskip.enabled": True})
    _, state = nnx.split(fs)
    off = dataclasses.replace(fs.cfg, farskip=dataclasses.replace(fs.cfg.farskip, enabled=False))
    graphdef_off, _ = nnx.split(nnx.eval_shape(lambda: farskip_jax.Transformer(off, nnx.Rngs(0))))
    np.testing.assert_array_equal(jax_logits(nnx.merge(graphdef_off, state), fs_case["ids"]), base)


def test_farskip_export_runs_farskip_in_transformers(fs_case, tmp_path, monkeypatch):
    """A FarSkip Qwen3-MoE export carries modeling_farskip_qwen3_moe.py: transformers with
    trust_remote_code runs the same FarSkip model as ours (and as the reference above)."""
    import transformers

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    quiet = dict(progress=False, log=lambda _line: None)
    convert_hf_to_orbax(fs_case["dir"], tmp_path / "orbax", **quiet)
    out = tmp_path / "hf"
    convert_orbax_to_hf(tmp_path / "orbax", out, overrides={"farskip.enabled": True, "farskip.start_idx": 1},
                        **quiet)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_farskip_qwen3_moe.FarSkipQwen3MoeForCausalLM"
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "FarSkipQwen3MoeForCausalLM"
    theirs = hf_logits(remote, fs_case["ids"])
    ours = jax_logits(farskip_jax.from_pretrained(out), fs_case["ids"])  # reads the exported FarSkip keys
    err = max_abs_err(theirs, ours)
    record("qwen3_farskip_export_remote_code", "range_1_3", err)
    assert err <= BAR
    assert max_abs_err(theirs, farskip_reference(fs_case["hf"], fs_case["ids"], {1, 2, 3})) <= 1e-5
    assert max_abs_err(theirs, fs_case["ref"]) > 1e-2


# --------------------------------------------------------------------------------------------
# Generation over the GQA key/value cache

NEW = 8


def test_cached_logits_equal_full_forward(fs_case):
    """FarSkip model: prefill of a prefix, then token by token through the KV-cache decode; every
    position's logits equal the uncached forward's."""
    model = farskip_jax.from_pretrained(fs_case["dir"], **{"farskip.enabled": True})
    ids = np.asarray([PROMPTS[0] + [1, 2, 3, 4]], np.int32)
    err = max_abs_err(cached_logits(model, ids, prefix=4), jax_logits(model, ids))
    record("qwen3_cached_logits", "farskip_full", err)
    assert err <= 1e-5


def test_greedy_generation_is_hf_generate_and_tp2(fs_case):
    """Greedy output of right-padded prompts is token-identical to HF generate, on one device, with
    TP=2 (query and key/value heads, and the KV caches, split over tensor) and with TP=4 (each of
    the 2 key/value heads and its cache copied to two ranks)."""
    gen = Generator(farskip_jax.from_pretrained(fs_case["dir"]))
    out = gen.generate(padded_prompts(), NEW)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = fs_case["hf"].generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                         eos_token_id=None, pad_token_id=0).numpy()[0]
        assert np.array_equal(out[b, : len(p) + NEW], ref), (b, out[b], ref)
    for tensor in (2, 4):
        tp = Generator(farskip_jax.from_pretrained(fs_case["dir"]), mesh=make_mesh(MeshConfig(tensor=tensor)))
        np.testing.assert_array_equal(tp.generate(padded_prompts(), NEW), out)
