"""The one table between HF tensor names (DeepseekV2/V3, Instella-MoE, Qwen3-MoE, Llama-4) and our NNX
parameter paths.

Each `ParamSpec` names one parameter of our model, the HF tensor(s) it comes from, and the
exact layout transforms in both directions. Routed experts are one stacked [E, ...] array
here and E separate tensors in HF files (`mlp.experts.N.gate_proj.weight`). HF stores linear
weights as [out, in]; we store [in, out] and split head dimensions out ([D, H, K]). The two
families share every name but the attention's (`_mla_specs`, `_gqa_specs`, chosen by
`ModelConfig.attention_kind`); Qwen3-MoE has no shared experts and no `lm_head` when tied;
DeepSeek-V3 adds the router's `e_score_correction_bias`, Instella-MoE the attention `gate_proj`.
Llama-4 names its FFN `feed_forward` and stores each MoE layer's experts as two fused tensors
(`_llama4_moe_specs`): our w_gate and w_up are the two halves of one HF tensor (`ParamSpec.fused`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from farskip_jax.config import ModelConfig

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class ParamSpec:
    path: Path  # NNX state path, e.g. ("layers", 3, "moe", "experts", "w_gate")
    shape: tuple[int, ...]  # our shape
    hf_keys: tuple[str, ...]  # one key, or one per expert for stacked routed experts
    hf_shape: tuple[int, ...]  # shape of each HF tensor
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]
    # (part, parts): this parameter is part `part` of `parts` equal slices of the one HF tensor's last
    # axis (Llama-4's fused gate_up_proj: gate, then up). `to_hf` gives the part; writers join the
    # parts in order (`join_fused`).
    fused: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        return "/".join(str(p) for p in self.path)


def _same(shape):
    return dict(to_ours=lambda ts: ts[0], to_hf=lambda a: [a], hf_shape=shape)


def _linear(d_in, d_out):
    """HF [out, in] <-> ours [in, out]."""
    return dict(to_ours=lambda ts: ts[0].T, to_hf=lambda a: [a.T], hf_shape=(d_out, d_in))


def _heads_out(d_in, h, k):
    """HF [H*K, in] <-> ours [in, H, K] (columns are head-major in HF)."""
    return dict(to_ours=lambda ts: ts[0].T.reshape(d_in, h, k), to_hf=lambda a: [a.reshape(d_in, h * k).T],
                hf_shape=(h * k, d_in))


def _heads_in(h, v, d_out):
    """HF o_proj [out, H*V] <-> ours [H, V, out]."""
    return dict(to_ours=lambda ts: ts[0].T.reshape(h, v, d_out), to_hf=lambda a: [a.reshape(h * v, d_out).T],
                hf_shape=(d_out, h * v))


def _reshaped(hf_shape, shape):
    """HF `hf_shape` <-> ours `shape`, same element order (a bias split per head)."""
    return dict(to_ours=lambda ts: ts[0].reshape(shape), to_hf=lambda a: [a.reshape(hf_shape)],
                hf_shape=hf_shape)


def _stacked(d_in, d_out):
    """E HF tensors [out, in] <-> ours [E, in, out]."""
    return dict(to_ours=lambda ts: np.stack([t.T for t in ts]), to_hf=lambda a: [w.T for w in a],
                hf_shape=(d_out, d_in))


def _fused_part(hf_shape, part, parts):
    """Part `part` of `parts` equal slices of the HF tensor's last axis <-> ours (same layout)."""
    width = hf_shape[-1] // parts
    return dict(to_ours=lambda ts: ts[0][..., part * width:(part + 1) * width], to_hf=lambda a: [a],
                hf_shape=hf_shape, fused=(part, parts))


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the model for `cfg`, in a stable order (the parts of a fused HF tensor
    next to each other)."""
    from farskip_jax.hf_config import hf_family

    d, e = cfg.hidden_size, cfg.n_routed_experts
    specs: list[ParamSpec] = []

    def add(path, shape, key, t):
        keys = tuple(key) if isinstance(key, list) else (key,)
        specs.append(ParamSpec(path=path, shape=tuple(shape), hf_keys=keys, **t))

    llama4 = hf_family(cfg) == "llama4_text"

    add(("embed",), (cfg.vocab_size, d), "model.embed_tokens.weight", _same((cfg.vocab_size, d)))
    for i in range(cfg.num_layers):
        p, L = f"model.layers.{i}", ("layers", i)
        add(L + ("input_norm", "scale"), (d,), f"{p}.input_layernorm.weight", _same((d,)))
        add(L + ("post_attn_norm", "scale"), (d,), f"{p}.post_attention_layernorm.weight", _same((d,)))
        a, A = f"{p}.self_attn", L + ("attn",)
        if cfg.attention_kind == "gqa":
            _gqa_specs(cfg, a, A, add)
        else:
            _mla_specs(cfg, a, A, add)
        m = f"{p}.feed_forward" if llama4 else f"{p}.mlp"
        if llama4 and cfg.is_moe_layer(i):
            _llama4_moe_specs(cfg, m, L + ("moe",), add)
        elif cfg.is_moe_layer(i):
            f, M = cfg.moe_intermediate_size, L + ("moe",)
            add(M + ("router",), (d, e), f"{m}.gate.weight", _linear(d, e))
            if cfg.router_bias:
                add(M + ("router_bias",), (e,), f"{m}.gate.e_score_correction_bias", _same((e,)))
            for ours, theirs, (di, do) in (("w_gate", "gate_proj", (d, f)), ("w_up", "up_proj", (d, f)),
                                           ("w_down", "down_proj", (f, d))):
                keys = [f"{m}.experts.{j}.{theirs}.weight" for j in range(e)]
                add(M + ("experts", ours), (e, di, do), keys, _stacked(di, do))
            if cfg.n_shared_experts > 0:
                fs = f * cfg.n_shared_experts
                for ours, (di, do) in (("gate_proj", (d, fs)), ("up_proj", (d, fs)), ("down_proj", (fs, d))):
                    add(M + ("shared", ours), (di, do), f"{m}.shared_experts.{ours}.weight", _linear(di, do))
        else:
            fd = cfg.intermediate_size
            for ours, (di, do) in (("gate_proj", (d, fd)), ("up_proj", (d, fd)), ("down_proj", (fd, d))):
                add(L + ("mlp", ours), (di, do), f"{m}.{ours}.weight", _linear(di, do))
    add(("final_norm", "scale"), (d,), "model.norm.weight", _same((d,)))
    if not cfg.tie_word_embeddings:
        add(("lm_head",), (d, cfg.vocab_size), "lm_head.weight", _linear(d, cfg.vocab_size))
    return specs


def _llama4_moe_specs(cfg: ModelConfig, m: str, M: Path, add: Callable) -> None:
    """Llama-4's MoE block under `m` (`model.layers.N.feed_forward`): `router`, the experts fused on
    disk (`experts.gate_up_proj` [E, D, 2F], gate first; `experts.down_proj` [E, F, D], both already
    [in, out] per expert) and one `shared_expert`."""
    d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    add(M + ("router",), (d, e), f"{m}.router.weight", _linear(d, e))
    for part, ours in enumerate(("w_gate", "w_up")):
        add(M + ("experts", ours), (e, d, f), f"{m}.experts.gate_up_proj",
            _fused_part((e, d, 2 * f), part, 2))
    add(M + ("experts", "w_down"), (e, f, d), f"{m}.experts.down_proj", _same((e, f, d)))
    fs = f * cfg.n_shared_experts
    for ours, (di, do) in (("gate_proj", (d, fs)), ("up_proj", (d, fs)), ("down_proj", (fs, d))):
        add(M + ("shared", ours), (di, do), f"{m}.shared_expert.{ours}.weight", _linear(di, do))


def hf_entries(specs: list[ParamSpec]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF key, HF shape) of every tensor `specs` write, in the order they are complete: a fused
    tensor once, at its last part."""
    return [(k, s.hf_shape) for s in specs if s.fused is None or s.fused[0] == s.fused[1] - 1
            for k in s.hf_keys]


class FusedJoin:
    """Collects the parts of fused HF tensors as they arrive; `add` returns the HF tensors complete."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray | None]] = {}

    def add(self, spec: ParamSpec, tensors: list[np.ndarray]) -> list[tuple[str, np.ndarray]]:
        if spec.fused is None:
            return list(zip(spec.hf_keys, tensors, strict=True))
        part, parts = spec.fused
        (key,) = spec.hf_keys
        got = self.parts.setdefault(key, [None] * parts)
        got[part] = tensors[0]
        if any(t is None for t in got):
            return []
        del self.parts[key]
        return [(key, np.concatenate(got, axis=-1))]


def _mla_specs(cfg: ModelConfig, a: str, A: Path, add: Callable) -> None:
    """DeepSeek-V2 latent attention: HF keys under `a` (`model.layers.N.self_attn`), paths under `A`."""
    d, h = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        add(A + ("q_proj",), (d, h, qk), f"{a}.q_proj.weight", _heads_out(d, h, qk))
    else:
        r = cfg.q_lora_rank
        add(A + ("q_a_proj",), (d, r), f"{a}.q_a_proj.weight", _linear(d, r))
        add(A + ("q_a_norm", "scale"), (r,), f"{a}.q_a_layernorm.weight", _same((r,)))
        add(A + ("q_b_proj",), (r, h, qk), f"{a}.q_b_proj.weight", _heads_out(r, h, qk))
    c, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    add(A + ("kv_a_proj",), (d, c + rope), f"{a}.kv_a_proj_with_mqa.weight", _linear(d, c + rope))
    add(A + ("kv_a_norm", "scale"), (c,), f"{a}.kv_a_layernorm.weight", _same((c,)))
    nv = cfg.qk_nope_head_dim + cfg.v_head_dim
    add(A + ("kv_b_proj",), (c, h, nv), f"{a}.kv_b_proj.weight", _heads_out(c, h, nv))
    add(A + ("o_proj",), (h, cfg.v_head_dim, d), f"{a}.o_proj.weight", _heads_in(h, cfg.v_head_dim, d))
    if cfg.attn_output_gate:  # Instella-MoE: HF [H*V, D] like q_proj's head-major rows
        v = cfg.v_head_dim
        add(A + ("gate_proj",), (d, h, v), f"{a}.gate_proj.weight", _heads_out(d, h, v))


def _gqa_specs(cfg: ModelConfig, a: str, A: Path, add: Callable) -> None:
    """Qwen3-MoE grouped-query attention: q/k/v/o projections split per head, optional biases
    (HF [H*K] <-> ours [H, K]), per-head q/k norms."""
    d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.attn_head_dim
    for name, heads in (("q_proj", h), ("k_proj", g), ("v_proj", g)):
        add(A + (name,), (d, heads, k), f"{a}.{name}.weight", _heads_out(d, heads, k))
    add(A + ("o_proj",), (h, k, d), f"{a}.o_proj.weight", _heads_in(h, k, d))
    if cfg.attention_bias:
        for name, heads in (("q", h), ("k", g), ("v", g)):
            add(A + (f"{name}_bias",), (heads, k), f"{a}.{name}_proj.bias",
                _reshaped((heads * k,), (heads, k)))
        add(A + ("o_bias",), (d,), f"{a}.o_proj.bias", _same((d,)))
    if cfg.qk_norm:
        add(A + ("q_norm", "scale"), (k,), f"{a}.q_norm.weight", _same((k,)))
        add(A + ("k_norm", "scale"), (k,), f"{a}.k_norm.weight", _same((k,)))


def hf_key_index(specs: list[ParamSpec]) -> dict[str, tuple[ParamSpec, int]]:
    """HF key -> (spec, position among that spec's keys)."""
    return {k: (s, j) for s in specs for j, k in enumerate(s.hf_keys)}
