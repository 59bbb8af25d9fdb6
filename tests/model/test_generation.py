"""Generation over the MLA latent cache: cached logits equal the full forward's, greedy output is
token-identical to HF `generate` (regular model: transformers' DeepseekV2ForCausalLM; FarSkip:
our exported modeling file, itself checked against our logits in tests/checkpoint), EOS handling,
padding of prompts of different lengths, sampling, and tensor parallelism."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_tiny import YARN, build_hf, max_abs_err, record, save_hf, tiny_hf_config

import farskip_jax
from farskip_jax.generation import PAD, Generator, Sampling
from farskip_jax.model.attention import LatentCache

REPO = Path(__file__).resolve().parents[2]
NEW = 10
# Three prompts of different lengths in one right-padded batch.
PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [12, 7], [33, 2, 90, 14, 8]]

VARIANTS = {
    # name: (HF config overrides, our FarSkip overrides)
    "regular_yarn_qlora": (dict(q_lora_rank=12, rope_parameters=dict(YARN)), {}),
    "farskip_all": ({}, {"farskip.enabled": True}),
    "farskip_attn_only_range": ({}, {"farskip.enabled": True, "farskip.start_idx": 1,
                                     "farskip.attn_only": True}),
}


def padded(prompts: list[list[int]]) -> np.ndarray:
    out = np.full((len(prompts), max(map(len, prompts))), PAD, np.int32)
    for b, p in enumerate(prompts):
        out[b, : len(p)] = p
    return out


def _remote_class():
    """FarSkipDeepseekV2ForCausalLM from the modeling file every FarSkip export carries."""
    path = REPO / "farskip_jax" / "checkpoint" / "modeling_farskip_deepseek_v2.py"
    spec = importlib.util.spec_from_file_location("modeling_farskip_deepseek_v2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FarSkipDeepseekV2ForCausalLM


_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory) -> tuple:
    """(name, HF reference model, our model, Generator), built once per variant and module."""
    if name not in _BUILT:
        _BUILT[name] = _build_case(name, tmp_path_factory)
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def farskip_case(tmp_path_factory):
    """One variant for the tests of batching, stopping, sampling and sharding (not per variant)."""
    return _build("farskip_all", tmp_path_factory)


def _build_case(name: str, tmp_path_factory) -> tuple:
    hf_over, ours_over = VARIANTS[name]
    hf = build_hf(tiny_hf_config(**hf_over), seed=3)
    d = save_hf(hf, tmp_path_factory.mktemp(name))
    model = farskip_jax.from_pretrained(d, **ours_over)
    if ours_over:
        fs = model.cfg.farskip
        layers = fs.layer_range(model.cfg.num_layers)
        cfg = tiny_hf_config(**hf_over)
        cfg.farskip, cfg.farskip_start_idx, cfg.farskip_end_idx = True, layers.start, layers.stop - 1
        cfg.attn_only_farskip, cfg.mlp_only_farskip = fs.attn_only, fs.mlp_only
        remote = _remote_class()(cfg).eval()
        remote.load_state_dict(hf.state_dict())
        hf = remote
    return name, hf, model, Generator(model)


def test_cached_logits_equal_full_forward(case):
    """Prefill of a prefix, then the rest token by token (teacher forced) through the absorbed
    decode attention: every position's logits equal the uncached forward's."""
    name, _, model, _ = case
    ids = jnp.asarray([PROMPTS[0] + [1, 2, 3, 4]], jnp.int32)
    full = np.asarray(model(ids).logits)
    k, t = 4, ids.shape[1]

    @nnx.jit(static_argnames="prefill")
    def run(model, ids, pos, caches, prefill):
        hidden, caches, _ = model.cached_forward(ids, pos, caches, prefill=prefill)
        return model.logits(hidden), caches

    caches = tuple(LatentCache.empty(model.cfg, 1, t, jnp.float32) for _ in range(model.cfg.num_layers))
    logits, caches = run(model, ids[:, :k], jnp.arange(k, dtype=jnp.int32)[None], caches, True)
    got = [np.asarray(logits)]
    for i in range(k, t):
        logits, caches = run(model, ids[:, i : i + 1], jnp.full((1, 1), i, jnp.int32), caches, False)
        got.append(np.asarray(logits))
    err = max_abs_err(np.concatenate(got, axis=1), full)
    record("cached_logits", name, err)
    assert err <= 1e-5


def test_greedy_is_token_identical_to_hf_generate(case):
    name, hf, _, gen = case
    out = gen.generate(padded(PROMPTS), NEW)
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0).numpy()[0]
        row = out[b]
        assert np.array_equal(row[: len(p) + NEW], ref), (name, b, row, ref)
        assert (row[len(p) + NEW :] == PAD).all()
    print(f"{name}: {len(PROMPTS)} prompts x {NEW} new tokens identical to HF generate")


def test_eos_ends_a_row_and_pads_it(farskip_case):
    _, _, _, gen = farskip_case
    prompts = padded(PROMPTS)
    free = gen.generate(prompts, NEW)
    eos = int(free[1, len(PROMPTS[1]) + 2])  # row 1's third new token
    out = gen.generate(prompts, NEW, eos_ids=[eos])
    for b, p in enumerate(PROMPTS):
        new = free[b, len(p) : len(p) + NEW]
        hits = np.flatnonzero(new == eos)
        keep = NEW if hits.size == 0 else hits[0] + 1  # up to and including the first EOS
        assert np.array_equal(out[b, : len(p) + keep], free[b, : len(p) + keep])
        assert (out[b, len(p) + keep :] == PAD).all()
    assert out[1, len(PROMPTS[1]) + 2] == eos and (out[1, len(PROMPTS[1]) + 3 :] == PAD).all()


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(farskip_case):
    _, _, _, gen = farskip_case
    prompts = padded(PROMPTS)
    a = gen.generate(prompts, NEW, sampling=Sampling(temperature=1.0, seed=1))
    b = gen.generate(prompts, NEW, sampling=Sampling(temperature=1.0, seed=1))
    c = gen.generate(prompts, NEW, sampling=Sampling(temperature=1.0, seed=2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    nucleus = gen.generate(prompts, NEW, sampling=Sampling(temperature=1.0, top_p=1e-6, seed=3))
    assert np.array_equal(nucleus, gen.generate(prompts, NEW))


def test_bad_prompts_are_named():
    from farskip_jax.generation import prompt_lengths

    with pytest.raises(ValueError, match="row 1 is empty"):
        prompt_lengths(np.array([[1, 2], [PAD, PAD]]))
    with pytest.raises(ValueError, match="row 0: a token follows padding"):
        prompt_lengths(np.array([[1, PAD, 3]]))


def test_tensor_parallel_generation_equals_one_device(farskip_case):
    name, _, model, gen = farskip_case
    from farskip_jax.config import MeshConfig
    from farskip_jax.parallel import make_mesh

    if jax.device_count() < 4:
        pytest.skip("needs 4 host devices (tests/conftest.py sets 8)")
    tp = Generator(model, mesh=make_mesh(MeshConfig(tensor=4)))
    prompts = padded(PROMPTS)
    assert np.array_equal(tp.generate(prompts, NEW), gen.generate(prompts, NEW)), name


def test_tensor_parallel_overflow_fallback_equals_one_device(farskip_case):
    """TP with the tightest bounded buffers (factor 1: each rank's share of balanced routing): the
    prefill and decode steps that overflow are re-run by the worst-case program on the caches they
    returned, and the tokens still equal one device's."""
    name, _, model, gen = farskip_case
    from farskip_jax.config import MeshConfig
    from farskip_jax.model.transformer import build_model
    from farskip_jax.parallel import make_mesh

    if jax.device_count() < 4:
        pytest.skip("needs 4 host devices (tests/conftest.py sets 8)")
    tight = build_model(model.cfg, exe=dataclasses.replace(model.exe, moe_buffer_factor=1.0))
    nnx.update(tight, nnx.state(model))
    tp = Generator(tight, mesh=make_mesh(MeshConfig(tensor=4)))
    prompts = padded(PROMPTS)
    tokens = tp.generate(prompts, NEW)
    print(f"TP generation with factor-1 buffers: {tp.overflows} of {NEW} steps re-run")
    assert tp.overflows > 0, "the factor-1 buffers never overflowed: the test checks nothing"
    assert np.array_equal(tokens, gen.generate(prompts, NEW)), name
