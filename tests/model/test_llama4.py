"""Llama-4 text: logit parity with HF's Llama4ForCausalLM (fp32, CPU) through our HF loader, a
Llama4ForConditionalGeneration checkpoint (language_model.* prefix, vision tower skipped) read as
the same model, the published Scout config.json (`attn_temperature_tuning: 4`) accepted, FarSkip
against a reference wired from HF's own submodules, connectivity off == regular bitwise, and the
converter's HF -> Orbax -> HF round trip bitwise (fused expert tensors written back fused; a FarSkip
export's transformers remote code).

| variant          | MoE of 4 (rule)      | NoPE | chunk | q/kv heads | top | qk-norm | temp | RoPE   | tied |
| step2_nope_chunk | 1, 3 (step 2)        | 3    | 4     | 4 / 2      | 1   | yes     | yes  | llama3 | no   |
| list_top2_tied   | 0, 2, 3 (moe_layers) | 0    | none  | 4 / 1      | 2   | no      | no   | plain  | yes  |

17 tokens: the chunks of 4 cut the sequence five times; temperature tuning (floor_scale 4,
attn_scale 0.5) changes q from position 3 on; the llama3 band edges (original 16 positions) put
head_dim 12's six frequencies in all three bands.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import (
    PLAIN_ROPE,
    PROMPTS,
    build_llama4,
    cached_logits,
    hf_logits,
    jax_logits,
    max_abs_err,
    padded_prompts,
    random_ids,
    record,
    save_hf,
    tiny_llama4_config,
)
from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig

import farskip_jax
from farskip_jax import hf_config
from farskip_jax.checkpoint.convert import convert_hf_to_orbax
from farskip_jax.checkpoint.hf_io import TensorSource
from farskip_jax.checkpoint.to_hf import convert_orbax_to_hf
from farskip_jax.config import load_config
from farskip_jax.model.farskip import REGULAR

BAR = 1e-4
QUIET = dict(progress=False, log=lambda _line: None)

VARIANTS = {
    "step2_nope_chunk": dict(),
    "list_top2_tied": dict(moe_layers=[0, 2, 3], no_rope_layers=[0, 1, 1, 1], num_experts_per_tok=2,
                           num_key_value_heads=1, use_qk_norm=False, attention_chunk_size=None,
                           attn_temperature_tuning=False, tie_word_embeddings=True,
                           rope_parameters=dict(PLAIN_ROPE, rope_theta=10000.0)),
    # the published Scout's llama3 scaling (factor 16, low = high frequency factor 1: no blended
    # band) at the tiny model's original context of 16 positions
    "scout_rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                        "original_max_position_embeddings": 16}),
}
MOE_LAYERS = {"step2_nope_chunk": [1, 3], "list_top2_tied": [0, 2, 3], "scout_rope": [1, 3]}
NOPE_LAYERS = {"step2_nope_chunk": (3,), "list_top2_tied": (0,), "scout_rope": (3,)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, tmp_path_factory):
    name = request.param
    hf_cfg = tiny_llama4_config(**VARIANTS[name])
    hf = build_llama4(hf_cfg, seed=len(name))
    directory = save_hf(hf, tmp_path_factory.mktemp(name))
    ids = random_ids(hf_cfg.vocab_size, batch=2, seq=17, seed=1)
    return dict(name=name, hf=hf, dir=directory, ids=ids, ref=hf_logits(hf, ids),
                model=farskip_jax.from_pretrained(directory))


def test_config_and_layer_rule(case):
    """Our config reads HF's rules: MoE layers, NoPE layers, chunked layers, widths, tied head."""
    cfg, hf = case["model"].cfg, case["hf"]
    hf_moe = [i for i, layer in enumerate(hf.model.layers) if layer.is_moe_layer]
    assert hf_moe == MOE_LAYERS[case["name"]]
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == hf_moe
    assert cfg.nope_layers == NOPE_LAYERS[case["name"]]
    hf_nope = [i for i in range(cfg.num_layers) if not hf.model.layers[i].self_attn.use_rope]
    assert hf_nope == list(cfg.nope_layers)
    assert [("chunked_attention" if cfg.chunked_layer(i) else "full_attention")
            for i in range(cfg.num_layers)] == hf.config.layer_types
    assert cfg.intermediate_size == hf.config.intermediate_size_mlp
    assert cfg.moe_intermediate_size == hf.config.intermediate_size and cfg.n_shared_experts == 1
    assert ("lm_head.weight" in TensorSource(case["dir"]).keys()) != cfg.tie_word_embeddings
    assert hf_config.model_config(hf_config.hf_dict(cfg)) == cfg


def test_logits_match_hf(case):
    ours = jax_logits(case["model"], case["ids"])
    ref = case["ref"]
    assert 0.3 < float(ref.std()) < 5.0, "random init should give logits of order 1"
    err = max_abs_err(ours, ref)
    record("llama4_hf_parity", case["name"], err)
    assert err <= BAR, f"{case['name']}: max |ours - HF| = {err:.3e} > {BAR}"


def test_converter_round_trip_bitwise(case, tmp_path):
    """HF -> Orbax -> HF gives back every tensor bit for bit (the experts fused again), and a config
    HF reads as the same model."""
    orbax, back = tmp_path / "orbax", tmp_path / "hf"
    convert_hf_to_orbax(case["dir"], orbax, **QUIET)
    convert_orbax_to_hf(orbax, back, **QUIET)
    src, out = TensorSource(case["dir"]), TensorSource(back)
    assert set(src.keys()) == set(out.keys())
    assert any(k.endswith("experts.gate_up_proj") for k in out.keys())
    for k in src.keys():
        a, b = src.read(k), out.read(k)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
    written = json.loads((back / "config.json").read_text())
    assert written["model_type"] == "llama4_text" and "auto_map" not in written
    assert hf_config.model_config(written) == case["model"].cfg
    Llama4TextConfig(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    np.testing.assert_array_equal(jax_logits(farskip_jax.from_pretrained(orbax), case["ids"]),
                                  jax_logits(case["model"], case["ids"]))


# --------------------------------------------------------------------------------------------
# Published checkpoint layouts: Llama4ForConditionalGeneration, Scout's config.json


@pytest.fixture(scope="module")
def text_case(tmp_path_factory):
    """The step2_nope_chunk model, also saved as the text half of a Llama4ForConditionalGeneration."""
    hf = build_llama4(tiny_llama4_config(), seed=3)
    ids = random_ids(hf.config.vocab_size, batch=2, seq=17, seed=1)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                  projector_output_dim=16)
    mm = Llama4ForConditionalGeneration(Llama4Config(text_config=hf.config.to_dict(), vision_config=vision))
    mm.language_model.load_state_dict(hf.state_dict())
    return dict(hf=hf, ids=ids, ref=hf_logits(hf, ids), dir=save_hf(hf, tmp_path_factory.mktemp("text")),
                mm_dir=save_hf(mm.eval(), tmp_path_factory.mktemp("mm")))


def test_conditional_generation_checkpoint_is_the_text_model(text_case, tmp_path, caplog):
    """language_model.* tensors load as the text model (same logits bit for bit), the vision tower's
    are skipped with a message naming their count, and the converter writes a text-only
    Llama4ForCausalLM whose tensors are the language model's, bit for bit."""
    mm_keys = TensorSource(text_case["mm_dir"]).keys()
    n_vision = sum(k.startswith(("vision_model.", "multi_modal_projector.")) for k in mm_keys)
    assert n_vision > 0 and any(k.startswith("language_model.model.layers.") for k in mm_keys)
    with caplog.at_level(logging.WARNING):
        model = farskip_jax.from_pretrained(text_case["mm_dir"])
    assert f"skipped {n_vision} tensors of the vision tower and projector" in caplog.text
    text = farskip_jax.from_pretrained(text_case["dir"])
    assert model.cfg == text.cfg
    np.testing.assert_array_equal(jax_logits(model, text_case["ids"]), jax_logits(text, text_case["ids"]))
    lines: list[str] = []
    convert_hf_to_orbax(text_case["mm_dir"], tmp_path / "orbax", progress=False, log=lines.append)
    assert any(f"skipped {n_vision} tensors" in line for line in lines)
    convert_orbax_to_hf(tmp_path / "orbax", tmp_path / "hf", **QUIET)
    src, out = TensorSource(text_case["dir"]), TensorSource(tmp_path / "hf")
    assert set(src.keys()) == set(out.keys())
    for k in src.keys():
        assert src.read(k).tobytes() == out.read(k).tobytes(), k
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]


def test_int_attn_temperature_tuning_is_accepted(text_case, tmp_path):
    """Scout's config.json says `attn_temperature_tuning: 4`; transformers 5.24's config class refuses
    the int, our loader reads it as true (the same model)."""
    hf = json.loads((text_case["dir"] / "config.json").read_text())
    hf["attn_temperature_tuning"] = 4
    with pytest.raises(Exception):  # noqa: B017 - whichever validation error HF raises
        Llama4TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert hf_config.model_config(hf) == farskip_jax.from_pretrained(text_case["dir"]).cfg


SCOUT_CONFIG_JSON = {  # meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json, text part
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
    "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1,
        "attn_temperature_tuning": 4,
        "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760, "model_type": "llama4_text", "moe_layers": list(range(48)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)], "num_attention_heads": 40,
        "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "use_qk_norm": True, "vocab_size": 202048},
}


def test_scout_config_json_is_our_yaml():
    """configs/llama4_scout.yaml is the published Scout config.json's text model; the _farskip config
    is the same model with every layer FarSkip."""
    ours = hf_config.model_config(SCOUT_CONFIG_JSON)
    base = load_config("llama4_scout").model
    runtime = ("param_dtype", "dtype")  # the dtypes are ours to choose (how to run: `execution`)
    assert dataclasses.replace(base, **{k: getattr(ours, k) for k in runtime}) == ours
    assert ours.nope_layers == tuple(range(3, 48, 4)) and ours.attn_temperature_tuning
    student = load_config("llama4_scout_farskip").model
    assert student.farskip.enabled and len(student.farskip.layer_range(48)) == 48
    assert dataclasses.replace(student, farskip=base.farskip) == base


# --------------------------------------------------------------------------------------------
# FarSkip: a reference wired from HF's submodules by FARSKIP.md's equations


@torch.no_grad()
def _shared_routed(moe, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, R) of an HF Llama4TextMoe: R = sum over experts of expert(h * sigmoid score), 0 if not chosen."""
    flat = h.reshape(-1, h.shape[-1])
    logits = moe.router(flat)[1]
    top, idx = torch.topk(logits, moe.top_k, dim=-1)
    scores = torch.zeros_like(logits).scatter(1, idx, torch.sigmoid(top))  # [N, E]
    e = scores.shape[1]
    routed = moe.experts((flat[None] * scores.T[..., None]).reshape(e * flat.shape[0], -1))
    return moe.shared_expert(flat).reshape(h.shape), routed.reshape(e, *h.shape).sum(0)


@torch.no_grad()
def farskip_reference(hf, ids: np.ndarray, farskip_layers: set[int], mode: str = "both") -> np.ndarray:
    """Logits with FarSkip on `farskip_layers`; mode both / attn_only / mlp_only. x: full stream;
    y = x + A + S of a FarSkip MoE layer (None: same as x, a parallel block); a dense layer passes one
    stream on. Chunked layers get causal & same-chunk masks, the others causal ones."""
    m = hf.model
    tokens = torch.as_tensor(ids, dtype=torch.long)
    t = tokens.shape[1]
    x = m.embed_tokens(tokens)
    freqs = m.rotary_emb(x, torch.arange(t)[None])
    pos = torch.arange(t)
    neg = torch.finfo(torch.float32).min
    causal = pos[None, :] <= pos[:, None]
    chunk = hf.config.attention_chunk_size or t
    same_chunk = (pos[None, :] // chunk) == (pos[:, None] // chunk)
    masks = {"full_attention": torch.where(causal, 0.0, neg)[None, None],
             "chunked_attention": torch.where(causal & same_chunk, 0.0, neg)[None, None]}
    y = None
    for i, layer in enumerate(m.layers):
        def attn(h, layer=layer, mask=masks[hf.config.layer_types[i]]):
            return layer.self_attn(layer.input_layernorm(h), position_embeddings=freqs,
                                   attention_mask=mask)[0]

        def ffn(h, layer=layer):  # (S, R) of a MoE layer, (0, M) of a dense one
            h = layer.post_attention_layernorm(h)
            if layer.is_moe_layer:
                return _shared_routed(layer.feed_forward, h)
            return 0.0, layer.feed_forward(h)

        if i not in farskip_layers:  # regular: x' = (x + A) + (R + S)
            h = x + attn(x)
            s, r = ffn(h)
            x, y = h + (r + s), None
            continue
        h = x + attn(x if y is None or mode == "mlp_only" else y)
        s, r = ffn(h if mode == "attn_only" else x)
        x, y = h + (r + s), (h + s if layer.is_moe_layer and mode != "mlp_only" else None)
    return hf.lm_head(m.norm(x)).float().numpy()


FARSKIP_CASES = {
    # name: (our overrides, reference layers, mode); step2_nope_chunk: dense, MoE, dense, MoE
    "full": ({"farskip.enabled": True}, {0, 1, 2, 3}, "both"),
    "attn_only_range_1_3": ({"farskip.enabled": True, "farskip.attn_only": True, "farskip.start_idx": 1},
                            {1, 2, 3}, "attn_only"),
    "mlp_only_full": ({"farskip.enabled": True, "farskip.mlp_only": True}, {0, 1, 2, 3}, "mlp_only"),
}


def test_reference_without_farskip_is_hf(text_case):
    err = max_abs_err(farskip_reference(text_case["hf"], text_case["ids"], set()), text_case["ref"])
    assert err <= 1e-5, err


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mlp_only_full" else n
                                  for n in FARSKIP_CASES])  # mlp_only: -m slow (suite time budget)
def test_farskip_matches_reference(text_case, name):
    overrides, layers, mode = FARSKIP_CASES[name]
    model = farskip_jax.from_pretrained(text_case["dir"], **overrides)
    assert {i for i, c in enumerate(model.connectivity()) if c != REGULAR} == layers
    ref = farskip_reference(text_case["hf"], text_case["ids"], layers, mode)
    err = max_abs_err(jax_logits(model, text_case["ids"]), ref)
    record("llama4_farskip_reference", name, err)
    assert err <= BAR, f"{name}: max |ours - reference| = {err:.3e} > {BAR}"
    assert max_abs_err(ref, text_case["ref"]) > 1e-2  # FarSkip is another function here


def test_connectivity_off_is_bitwise_regular(text_case):
    """A FarSkip model's own parameters with connectivity switched off give the regular model's logits
    bit for bit."""
    base = jax_logits(farskip_jax.from_pretrained(text_case["dir"]), text_case["ids"])
    fs = farskip_jax.from_pretrained(text_case["dir"], **{"farskip.enabled": True})
    _, state = nnx.split(fs)
    off = dataclasses.replace(fs.cfg, farskip=dataclasses.replace(fs.cfg.farskip, enabled=False))
    graphdef_off, _ = nnx.split(nnx.eval_shape(lambda: farskip_jax.Transformer(off, nnx.Rngs(0))))
    np.testing.assert_array_equal(jax_logits(nnx.merge(graphdef_off, state), text_case["ids"]), base)


def test_farskip_export_runs_farskip_in_transformers(text_case, tmp_path, monkeypatch):
    """A FarSkip Llama-4 export carries modeling_farskip_llama4.py: transformers with trust_remote_code
    runs the same FarSkip model as ours (and as the reference above)."""
    import transformers

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    convert_hf_to_orbax(text_case["dir"], tmp_path / "orbax", **QUIET)
    out = tmp_path / "hf"
    convert_orbax_to_hf(tmp_path / "orbax", out, overrides={"farskip.enabled": True}, **QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_farskip_llama4.FarSkipLlama4ForCausalLM"
    remote = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    remote.config._attn_implementation = "eager"
    assert type(remote).__name__ == "FarSkipLlama4ForCausalLM"
    theirs = hf_logits(remote, text_case["ids"])
    ours = jax_logits(farskip_jax.from_pretrained(out), text_case["ids"])  # reads the exported FarSkip keys
    err = max_abs_err(theirs, ours)
    record("llama4_farskip_export_remote_code", "full", err)
    assert err <= BAR
    assert max_abs_err(theirs, farskip_reference(text_case["hf"], text_case["ids"], {0, 1, 2, 3})) <= 1e-5
    assert max_abs_err(theirs, text_case["ref"]) > 1e-2


# --------------------------------------------------------------------------------------------
# Generation over the GQA key/value cache: the chunk mask and the temperature in decode too

NEW = 8


@pytest.mark.slow
def test_cached_logits_equal_full_forward(text_case):
    """FarSkip model: prefill of 5 tokens (past the first chunk of 4), then token by token through the
    KV-cache decode across three more chunk boundaries; every position's logits equal the uncached
    forward's."""
    model = farskip_jax.from_pretrained(text_case["dir"], **{"farskip.enabled": True})
    ids = text_case["ids"][:1]
    err = max_abs_err(cached_logits(model, ids, prefix=5), jax_logits(model, ids))
    record("llama4_cached_logits", "farskip_full", err)
    assert err <= 1e-5


@pytest.mark.slow
def test_greedy_generation_is_hf_generate_and_tp2(text_case):
    """Greedy output of right-padded prompts (15 positions: four chunks) is token-identical to HF
    generate, on one device and with TP=2."""
    from farskip_jax.config import MeshConfig
    from farskip_jax.generation import Generator
    from farskip_jax.parallel import make_mesh

    padded = padded_prompts()
    out = Generator(farskip_jax.from_pretrained(text_case["dir"])).generate(padded, NEW)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = text_case["hf"].generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                           eos_token_id=None, pad_token_id=0).numpy()[0]
        assert np.array_equal(out[b, : len(p) + NEW], ref), (b, out[b], ref)
    tp = Generator(farskip_jax.from_pretrained(text_case["dir"]), mesh=make_mesh(MeshConfig(tensor=2)))
    np.testing.assert_array_equal(tp.generate(padded, NEW), out)
