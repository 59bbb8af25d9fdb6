"""DeepSeek-V3 and Instella-MoE: logit parity with HF's DeepseekV3ForCausalLM (fp32, CPU) through our
HF loader, multi-token-prediction layers skipped, FarSkip against a reference wired from HF's own
submodules, connectivity off == regular bitwise, the converter's HF -> Orbax -> HF round trip bitwise,
the router's correction bias kept out of training, Instella-MoE (gated attention, FarSkip keys in
config.json) against a reference from HF's DeepSeek-V3 submodules plus the gate equation, and
generation over the latent cache (cached == uncached logits with the gate and FarSkip, greedy ==
HF generate, TP=2 == one device).

| variant              | layers (dense) | q-LoRA | groups kept | top-k | norm | scale | RoPE             |
| grouped_norm         | 3 (0)          | no     | 2 of 4      | 3     | on   | 2.5   | plain, interleave|
| nonorm_qlora_yarn    | 4 (0, 1)       | 12     | 1 of 2      | 3     | off  | 1.7   | YaRN, rotate-half|

Every model has 16 experts and a random nonzero `e_score_correction_bias` (std 0.3, against
sigmoid scores in (0, 1)), checked to change the logits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_tiny import (
    PROMPTS,
    YARN,
    build_dsv3,
    cached_logits,
    hf_logits,
    jax_logits,
    max_abs_err,
    padded_prompts,
    random_ids,
    record,
    save_hf,
    tiny_dsv3_config,
)
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

import farskip_jax
from farskip_jax import hf_config
from farskip_jax.checkpoint.convert import convert_hf_to_orbax
from farskip_jax.checkpoint.hf_io import TensorSource
from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf
from farskip_jax.config import ExecutionConfig, MeshConfig, TrainConfig
from farskip_jax.generation import Generator
from farskip_jax.model.farskip import REGULAR
from farskip_jax.model.moe import MoE
from farskip_jax.parallel import make_mesh
from farskip_jax.train.optim import make_optimizer

BAR = 1e-4
QUIET = dict(progress=False, log=lambda _line: None)

VARIANTS = {
    "grouped_norm": dict(),
    "nonorm_qlora_yarn": dict(num_hidden_layers=4, first_k_dense_replace=2, q_lora_rank=12, n_group=2,
                              topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.7,
                              rope_interleave=False, rope_parameters=dict(YARN)),
}


_BUILT: dict[str, dict] = {}


def _variant(name: str, tmp_path_factory) -> dict:
    """The HF model of variant `name`, its save_pretrained directory, inputs and logits, and our model
    loaded from that directory; built once per module (the FarSkip tests reuse a variant)."""
    if name not in _BUILT:
        hf = build_dsv3(tiny_dsv3_config(**VARIANTS[name]), seed=len(name))
        directory = save_hf(hf, tmp_path_factory.mktemp(name))
        ids = random_ids(hf.config.vocab_size, batch=2, seq=17, seed=1)
        _BUILT[name] = dict(name=name, hf=hf, dir=directory, ids=ids, ref=hf_logits(hf, ids),
                            model=farskip_jax.from_pretrained(directory))
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    return _variant(request.param, tmp_path_factory)


def test_config_reads_hf(case):
    cfg, hf = case["model"].cfg, case["hf"]
    hf_moe = [i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, DeepseekV3MoE)]
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == hf_moe
    assert (cfg.router_score, cfg.router_bias, cfg.group_score) == ("sigmoid", True, "top2_sum")
    assert cfg.rope_style == ("interleaved" if hf.config.rope_interleave else "half")
    assert hf_config.model_config(hf_config.hf_dict(cfg)) == cfg
    bias = np.asarray(case["model"].layers[hf_moe[0]].moe.router_bias[...])
    np.testing.assert_array_equal(bias, hf.model.layers[hf_moe[0]].mlp.gate.e_score_correction_bias.numpy())


def test_logits_match_hf(case):
    ours, ref = jax_logits(case["model"], case["ids"]), case["ref"]
    assert 0.3 < float(ref.std()) < 5.0, "random init should give logits of order 1"
    err = max_abs_err(ours, ref)
    record("dsv3_hf_parity", case["name"], err)
    assert err <= BAR, f"{case['name']}: max |ours - HF| = {err:.3e} > {BAR}"
    # The correction bias matters here: without it other experts are chosen.
    unbiased = farskip_jax.from_pretrained(case["dir"])
    for layer in unbiased.layers:
        if layer.is_moe:
            layer.moe.router_bias[...] = jnp.zeros_like(layer.moe.router_bias[...])
    assert max_abs_err(jax_logits(unbiased, case["ids"]), ref) > 1e-2


def test_converter_round_trip_bitwise(fs_case, tmp_path):
    """HF -> Orbax -> HF gives back every tensor (the correction bias included) bit for bit, and a
    config.json that reads as the same model (one variant: the Instella test below is another)."""
    case = fs_case
    orbax, back = tmp_path / "orbax", tmp_path / "hf"
    convert_hf_to_orbax(case["dir"], orbax, **QUIET)
    convert_orbax_to_hf(orbax, back, **QUIET)
    _assert_same_tensors(case["dir"], back)
    written = json.loads((back / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert hf_config.model_config(written) == case["model"].cfg
    np.testing.assert_array_equal(jax_logits(farskip_jax.from_pretrained(back), case["ids"]),
                                  jax_logits(case["model"], case["ids"]))


def _assert_same_tensors(a_dir, b_dir) -> None:
    src, out = TensorSource(a_dir), TensorSource(b_dir)
    assert set(src.keys()) == set(out.keys())
    for k in src.keys():
        a, b = src.read(k), out.read(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k


def test_mtp_layer_is_skipped(fs_case, tmp_path, caplog):
    """A checkpoint with one MTP layer's tensors (model.layers.L.*, as DeepSeek-V3 ships them) loads,
    says how many tensors it skipped, and gives the same logits; the converter skips them too."""
    case = fs_case
    mtp = tmp_path / "mtp"
    shutil.copytree(case["dir"], mtp)
    tensors = load_file(mtp / "model.safetensors")
    n, last = case["hf"].config.num_hidden_layers, case["hf"].config.num_hidden_layers - 1
    extra = {k.replace(f"model.layers.{last}.", f"model.layers.{n}."): v.clone()
             for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    d = case["hf"].config.hidden_size
    extra.update({f"model.layers.{n}.eh_proj.weight": torch.zeros(d, 2 * d),
                  f"model.layers.{n}.enorm.weight": torch.ones(d),
                  f"model.layers.{n}.hnorm.weight": torch.ones(d)})
    save_file({**tensors, **extra}, mtp / "model.safetensors", metadata={"format": "pt"})
    hf_cfg = json.loads((mtp / "config.json").read_text())
    assert hf_cfg["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.WARNING):
        model = farskip_jax.from_pretrained(mtp)
    assert f"skipped {len(extra)} tensors" in caplog.text and f"model.layers.{n}" in caplog.text
    np.testing.assert_array_equal(jax_logits(model, case["ids"]), jax_logits(case["model"], case["ids"]))
    lines: list[str] = []
    convert_hf_to_orbax(mtp, tmp_path / "orbax", progress=False, log=lines.append)
    assert any(f"skipped {len(extra)} tensors" in line for line in lines)


def test_router_bias_gets_no_update():
    """The correction bias is a parameter (checkpoints carry it) that training never changes: no
    gradient reaches it, no weight decay, so an AdamW step leaves it bit for bit."""
    # The padded expert matmul compiles fastest on CPU; the router is the same either way.
    cfg = hf_config.model_config(tiny_dsv3_config().to_dict())
    moe = MoE(cfg, nnx.Rngs(0), exe=ExecutionConfig(expert_matmul="padded"))
    moe.router_bias[...] = jnp.linspace(-0.5, 0.5, cfg.n_routed_experts)
    graphdef, params = nnx.split(moe, nnx.Param)
    x = jax.random.normal(jax.random.key(0), (2, 8, cfg.hidden_size))

    def loss(p):
        shared, routed, _ = nnx.merge(graphdef, p)(x)
        return jnp.mean((shared + routed) ** 2)

    tx = make_optimizer(TrainConfig(learning_rate=1e-2, warmup_steps=0), params)

    @jax.jit
    def step(params):
        grads = jax.grad(loss)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        return grads, optax.apply_updates(params, updates)

    grads, new = (nnx.to_pure_dict(t) for t in step(params))
    old = nnx.to_pure_dict(params)
    assert not np.any(np.asarray(grads["router_bias"])) and np.any(np.asarray(grads["router"]))
    np.testing.assert_array_equal(new["router_bias"], old["router_bias"])
    assert not np.array_equal(new["router"], old["router"])


# --------------------------------------------------------------------------------------------
# FarSkip and Instella-MoE: a reference wired from HF's DeepSeek-V3 submodules by FARSKIP.md's
# equations, with Instella's attention gate added by a hook on o_proj's input


@torch.no_grad()
def farskip_reference(hf, ids: np.ndarray, farskip_layers: set[int], mode: str = "both",
                      gates: list[torch.Tensor] | None = None) -> np.ndarray:
    """Logits with FarSkip on `farskip_layers` (mode both / attn_only / mlp_only); `gates[i]` the
    [H*V, D] gate weight of layer i (Instella-MoE: o_proj reads attn * sigmoid(h @ gate^T), h the
    normed attention input), None for ungated attention."""
    m = hf.model
    tokens = torch.as_tensor(ids, dtype=torch.long)
    t = tokens.shape[1]
    x = m.embed_tokens(tokens)
    rope = m.rotary_emb(x, torch.arange(t)[None])
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    y = None
    for i, layer in enumerate(m.layers):
        is_moe = isinstance(layer.mlp, DeepseekV3MoE)

        def attn(h, layer=layer, i=i):
            h = layer.input_layernorm(h)
            hook = None
            if gates is not None:
                gate = torch.sigmoid(h @ gates[i].T)
                hook = layer.self_attn.o_proj.register_forward_pre_hook(lambda _mod, args: (args[0] * gate,))
            try:
                return layer.self_attn(h, position_embeddings=rope, attention_mask=mask)[0]
            finally:
                if hook is not None:
                    hook.remove()

        def ffn(h, layer=layer, is_moe=is_moe):
            """(S, R) for a MoE layer, (None, M) for a dense one."""
            h = layer.post_attention_layernorm(h)
            if not is_moe:
                return None, layer.mlp(h)
            _, weights, experts = layer.mlp.gate(h)
            routed = layer.mlp.experts(h.reshape(-1, h.shape[-1]), experts, weights).reshape(h.shape)
            return layer.mlp.shared_experts(h), routed

        def combine(h, s, r_or_m):
            return h + r_or_m if s is None else h + (r_or_m + s)

        if i not in farskip_layers:  # regular: x' = (x + A) + (R + S)
            h = x + attn(x)
            s, r = ffn(h)
            x, y = combine(h, s, r), None
        elif mode == "both":  # A = Attn(LN1(y)); S, R = MoE(LN2(x)); y' = (x + A) + S
            a = attn(x if y is None else y)
            s, r = ffn(x)
            h = x + a
            x, y = combine(h, s, r), (h + s if is_moe else None)
        elif mode == "attn_only":
            h = x + attn(x if y is None else y)
            s, r = ffn(h)
            x, y = combine(h, s, r), (h + s if is_moe else None)
        elif mode == "mlp_only":
            a = attn(x)
            s, r = ffn(x)
            x, y = combine(x + a, s, r), None
        else:
            raise ValueError(mode)
    return hf.lm_head(m.norm(x)).float().numpy()


FARSKIP_CASES = {
    # name: (our overrides, reference layers, mode); model nonorm_qlora_yarn: dense, dense, MoE, MoE
    "full": ({"farskip.enabled": True}, {0, 1, 2, 3}, "both"),
    "range_1_3": ({"farskip.enabled": True, "farskip.start_idx": 1}, {1, 2, 3}, "both"),
    "attn_only_full": ({"farskip.enabled": True, "farskip.attn_only": True}, {0, 1, 2, 3}, "attn_only"),
    "mlp_only_full": ({"farskip.enabled": True, "farskip.mlp_only": True}, {0, 1, 2, 3}, "mlp_only"),
}


@pytest.fixture(scope="module")
def fs_case(tmp_path_factory):
    return _variant("nonorm_qlora_yarn", tmp_path_factory)


def test_reference_without_farskip_is_hf(fs_case):
    assert max_abs_err(farskip_reference(fs_case["hf"], fs_case["ids"], set()), fs_case["ref"]) <= 1e-5


@pytest.mark.parametrize("name", list(FARSKIP_CASES))
def test_farskip_matches_reference(fs_case, name):
    overrides, layers, mode = FARSKIP_CASES[name]
    model = farskip_jax.from_pretrained(fs_case["dir"], **overrides)
    assert {i for i, c in enumerate(model.connectivity()) if c != REGULAR} == layers
    ref = farskip_reference(fs_case["hf"], fs_case["ids"], layers, mode)
    err = max_abs_err(jax_logits(model, fs_case["ids"]), ref)
    record("dsv3_farskip_reference", name, err)
    assert err <= BAR, f"{name}: max |ours - reference| = {err:.3e} > {BAR}"
    assert max_abs_err(ref, fs_case["ref"]) > 1e-2  # FarSkip is another function here


def test_connectivity_off_is_bitwise_regular(fs_case):
    base = jax_logits(farskip_jax.from_pretrained(fs_case["dir"]), fs_case["ids"])
    empty = farskip_jax.from_pretrained(fs_case["dir"], **{"farskip.enabled": True, "farskip.first_n": 0})
    assert all(c == REGULAR for c in empty.connectivity())
    np.testing.assert_array_equal(jax_logits(empty, fs_case["ids"]), base)
    fs = farskip_jax.from_pretrained(fs_case["dir"], **{"farskip.enabled": True})
    _, state = nnx.split(fs)
    off = dataclasses.replace(fs.cfg, farskip=dataclasses.replace(fs.cfg.farskip, enabled=False))
    graphdef_off, _ = nnx.split(nnx.eval_shape(lambda: farskip_jax.Transformer(off, nnx.Rngs(0))))
    np.testing.assert_array_equal(jax_logits(nnx.merge(graphdef_off, state), fs_case["ids"]), base)


# ---- Instella-MoE ----------------------------------------------------------------------------

INSTELLA_KEYS = {"architectures": ["InstellaMoEForCausalLM"], "gated_attention": True, "qk_layernorm": True,
                 "farskip": True, "farskip_start_idx": 0, "farskip_end_idx": 10000,
                 "attn_only_farskip": False, "mlp_only_farskip": False}


@pytest.fixture(scope="module")
def instella(tmp_path_factory):
    """A tiny Instella-style directory: DeepSeek-V3 tensors (n_group 1, dense layer 0) plus a random
    `self_attn.gate_proj.weight` per layer and Instella's config keys, FarSkip on every layer."""
    hf = build_dsv3(tiny_dsv3_config(n_group=1, topk_group=1, num_experts_per_tok=2, q_lora_rank=12), seed=11)
    directory = save_hf(hf, tmp_path_factory.mktemp("instella"))
    c = hf.config
    g = torch.Generator().manual_seed(5)
    gates = [torch.randn(c.num_attention_heads * c.v_head_dim, c.hidden_size, generator=g) * 0.2
             for _ in range(c.num_hidden_layers)]
    tensors = load_file(directory / "model.safetensors")
    tensors.update({f"model.layers.{i}.self_attn.gate_proj.weight": w for i, w in enumerate(gates)})
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    hf_cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf_cfg, **INSTELLA_KEYS}, indent=2))
    ids = random_ids(c.vocab_size, batch=2, seq=17, seed=2)
    return dict(hf=hf, dir=directory, gates=gates, ids=ids, model=farskip_jax.from_pretrained(directory))


def test_instella_loads_as_farskip_and_matches_reference(instella):
    model, hf = instella["model"], instella["hf"]
    cfg = model.cfg
    assert cfg.attn_output_gate and cfg.farskip.enabled
    assert list(cfg.farskip.layer_range(cfg.num_layers)) == list(range(cfg.num_layers))
    layers = set(range(cfg.num_layers))
    assert {i for i, c in enumerate(model.connectivity()) if c != REGULAR} == layers
    ref = farskip_reference(hf, instella["ids"], layers, "both", gates=instella["gates"])
    err = max_abs_err(jax_logits(model, instella["ids"]), ref)
    record("instella_farskip_reference", "gated_full", err)
    assert err <= BAR
    # The gate and FarSkip both matter: neither reference without one of them is this model.
    assert max_abs_err(ref, farskip_reference(hf, instella["ids"], layers, "both")) > 1e-2
    assert max_abs_err(ref, farskip_reference(hf, instella["ids"], set(), gates=instella["gates"])) > 1e-2
    regular = farskip_jax.from_pretrained(instella["dir"], **{"farskip.enabled": False})
    err = max_abs_err(jax_logits(regular, instella["ids"]),
                      farskip_reference(hf, instella["ids"], set(), gates=instella["gates"]))
    record("instella_gated_regular_reference", "gated_regular", err)
    assert err <= BAR


def test_instella_round_trip_and_remote_code(instella, tmp_path, monkeypatch):
    """HF -> Orbax -> HF keeps every tensor bit for bit; the export (FarSkip on) registers
    modeling_farskip_deepseek_v3.py, which transformers runs as the same model as ours."""
    import transformers

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    convert_hf_to_orbax(instella["dir"], tmp_path / "orbax", **QUIET)
    out = tmp_path / "hf"
    convert_orbax_to_hf(tmp_path / "orbax", out, **QUIET)
    _assert_same_tensors(instella["dir"], out)
    written = json.loads((out / "config.json").read_text())
    assert written["gated_attention"] and written["farskip"]
    assert written["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_farskip_deepseek_v3.FarSkipDeepseekV3ForCausalLM"
    assert hf_config.model_config(written) == instella["model"].cfg
    ours = jax_logits(instella["model"], instella["ids"])
    np.testing.assert_array_equal(jax_logits(farskip_jax.from_pretrained(out), instella["ids"]), ours)
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__name__ == "FarSkipDeepseekV3ForCausalLM"
    err = max_abs_err(hf_logits(remote, instella["ids"]), ours)
    record("instella_export_remote_code", "gated_full", err)
    assert err <= BAR


# ---- generation over the MLA latent cache ------------------------------------------------------

NEW = 6


def test_instella_cached_logits_equal_full_forward(instella):
    """Instella-MoE (attention gate, FarSkip on every layer): prefill of a prefix, then token by token
    through the latent-cache decode; every position's logits equal the uncached forward's."""
    model = instella["model"]
    ids = instella["ids"][:1, :12]
    err = max_abs_err(cached_logits(model, ids, prefix=5), jax_logits(model, ids))
    record("dsv3_cached_logits", "instella_farskip", err)
    assert err <= 1e-5


def test_greedy_generation_is_hf_generate_and_tp2(tmp_path_factory, instella):
    """DeepSeek-V3 (biased group router): greedy output of right-padded prompts is token-identical to
    HF generate. Instella-MoE with TP=2 (heads, the gate's rows and the experts over `tensor`)
    generates exactly what one device does."""
    case = _variant("grouped_norm", tmp_path_factory)
    out = Generator(case["model"]).generate(padded_prompts(), NEW)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = case["hf"].generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                      eos_token_id=None, pad_token_id=0).numpy()[0]
        assert np.array_equal(out[b, : len(p) + NEW], ref), (b, out[b], ref)
    one = Generator(instella["model"]).generate(padded_prompts(), NEW)
    tp = Generator(farskip_jax.from_pretrained(instella["dir"]), mesh=make_mesh(MeshConfig(tensor=2)))
    np.testing.assert_array_equal(tp.generate(padded_prompts(), NEW), one)
