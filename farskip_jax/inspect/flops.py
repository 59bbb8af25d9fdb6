"""Useful FLOPs of a model and of the step the inspector compiles, counted from the config's shapes.

"Useful" means the matrix products the model's math needs, independent of how XLA lowers them: a
padded expert GEMM that computes every worst-case row, a recomputed (rematerialised) forward or a
masked attention block all count in the compiled program's static dot FLOPs (``hlo.static_dot_flops``)
but not here. The ratio of the two is the program's overhead in matmul work.

What is counted, per token of one forward pass (a multiply-add = 2 FLOPs):

- attention projections: MLA (``q_proj``, or ``q_a_proj`` + ``q_b_proj`` with q-LoRA, ``kv_a_proj``,
  ``kv_b_proj``, ``o_proj``, the output gate's ``gate_proj``), GQA (q, k, v, o);
- the attention core: scores (q . k) and values (p . v) over the keys a query sees. Causal: the t-th
  token of a document sees t keys, so a document of n tokens averages (n + 1) / 2 keys per query.
  Packed documents: ``doc_len`` tokens each (the last one shorter), default one document per
  sequence; Llama-4's chunked layers restart the count at every ``attention_chunk_size`` positions;
- dense MLP layers and the shared experts (SwiGLU: three [D, F] matrices), the router ([D, E]), the
  ``num_experts_per_tok`` routed experts each token is sent to, and the LM head ([D, V]).

Norms, RoPE, softmax, SwiGLU's elementwise products and the loss are elementwise work and not
counted (a few per cent of the matmul FLOPs at these widths). A step: training = 3x the student's
forward (the backward pass computes two products per forward product: the input's and the weight's
gradient), FCSD adds the frozen teacher's forward (1x; not with a cached teacher), ``lm`` / ``sft``
train the student alone; prefill = one forward; decode = one new token per sequence attending a
cache of ``cache_len`` tokens (MLA: the absorbed form the model runs over its latent cache).
Per device = total / devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FIELDS = ("attention_proj", "attention_core", "dense_mlp", "shared_experts", "router", "routed_experts",
          "lm_head")


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs by part of the model (any unit: per token, per step, ...)."""

    attention_proj: float = 0.0
    attention_core: float = 0.0
    dense_mlp: float = 0.0
    shared_experts: float = 0.0
    router: float = 0.0
    routed_experts: float = 0.0
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f) for f in FIELDS)

    def scaled(self, factor: float) -> Flops:
        return Flops(**{f: getattr(self, f) * factor for f in FIELDS})

    def __add__(self, other: Flops) -> Flops:
        return Flops(**{f: getattr(self, f) + getattr(other, f) for f in FIELDS})

    def as_dict(self) -> dict[str, float]:
        return {**{f: getattr(self, f) for f in FIELDS}, "total": self.total}


def causal_keys_per_query(seq_len: int, doc_len: int | None = None, chunk: int | None = None) -> float:
    """Average keys a query attends under the causal mask, over a sequence of ``seq_len`` tokens
    packed with documents of ``doc_len`` tokens (None: one document; the last may be shorter), each
    split into attention chunks of ``chunk`` positions (None: no chunking). A span of n tokens
    contributes 1 + 2 + ... + n = n (n + 1) / 2 query-key pairs."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: expected >= 1")
    doc = seq_len if doc_len is None else min(max(1, doc_len), seq_len)

    def pairs(n: int, span: int | None) -> float:
        if span is None or span >= n:
            return n * (n + 1) / 2
        full, rest = divmod(n, span)
        return full * span * (span + 1) / 2 + rest * (rest + 1) / 2

    full, rest = divmod(seq_len, doc)
    return (full * pairs(doc, chunk) + (pairs(rest, chunk) if rest else 0.0)) / seq_len


def _swiglu(d: int, f: int) -> float:
    return 2.0 * 3 * d * f  # gate, up: [D, F]; down: [F, D]


def _attention_proj(cfg: Any) -> float:
    """Per token, one layer: the projections into and out of the heads."""
    d, h = cfg.hidden_size, cfg.num_heads
    if cfg.attention_kind == "gqa":
        k, g = cfg.attn_head_dim, cfg.kv_heads
        return 2.0 * (d * h * k + 2 * d * g * k + h * k * d)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = d * h * qk if cfg.q_lora_rank is None else d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    kv_a = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    kv_b = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = h * cfg.v_head_dim * d
    gate = d * h * cfg.v_head_dim if getattr(cfg, "attn_output_gate", False) else 0
    return 2.0 * (q + kv_a + kv_b + o + gate)


def _core_per_key(cfg: Any) -> float:
    """Per query and attended key, one layer: its score (q . k) and its share of p . v, every head."""
    h = cfg.num_heads
    if cfg.attention_kind == "gqa":
        return 2.0 * h * 2 * cfg.attn_head_dim
    return 2.0 * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


def _ffn(cfg: Any, layer: int) -> Flops:
    """Per token, one layer's feed-forward part: a dense MLP, or router + shared + top-k routed."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return Flops(dense_mlp=_swiglu(d, cfg.intermediate_size))
    return Flops(shared_experts=_swiglu(d, cfg.moe_intermediate_size * cfg.n_shared_experts),
                 router=2.0 * d * cfg.n_routed_experts,
                 routed_experts=cfg.num_experts_per_tok * _swiglu(d, cfg.moe_intermediate_size))


def forward_flops_per_token(cfg: Any, seq_len: int, doc_len: int | None = None,
                            logits_fraction: float = 1.0) -> Flops:
    """Useful FLOPs of one token's forward pass through ``cfg`` (a ``ModelConfig``) in sequences of
    ``seq_len`` tokens (``doc_len``: packed documents, see ``causal_keys_per_query``).
    ``logits_fraction``: the share of tokens whose logits are computed (1.0 in training)."""
    total = Flops(lm_head=logits_fraction * 2.0 * cfg.hidden_size * cfg.vocab_size)
    for i in range(cfg.num_layers):
        chunk = cfg.attention_chunk_size if cfg.chunked_layer(i) else None
        keys = causal_keys_per_query(seq_len, doc_len, chunk)
        total = total + Flops(attention_proj=_attention_proj(cfg),
                              attention_core=keys * _core_per_key(cfg)) + _ffn(cfg, i)
    return total


def decode_flops_per_token(cfg: Any, cache_len: int, absorbed: bool = True) -> Flops:
    """Useful FLOPs of one decode step's new token attending ``cache_len`` cached tokens (itself
    included; a chunked layer only its own chunk's). MLA ``absorbed`` (what ``MLAttention.decode``
    runs over the latent cache): the key expansion folded into the query (H x N x C per token), scores
    over the C + R latent and rope widths and the context over C, per key, then the value expansion
    (H x C x V); the cached tokens are never expanded. ``absorbed=False`` counts the per-head form
    over a cache of expanded keys and values (the new token's ``kv_b_proj`` included)."""
    d, h = cfg.hidden_size, cfg.num_heads
    total = Flops(lm_head=2.0 * d * cfg.vocab_size)
    for i in range(cfg.num_layers):
        keys = float(cache_len)
        if cfg.chunked_layer(i):
            keys = float((cache_len - 1) % cfg.attention_chunk_size + 1)
        if cfg.attention_kind == "mla" and absorbed:
            c, n, r, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
            proj = _attention_proj(cfg) - 2.0 * c * h * (n + v)  # no kv_b_proj of the new token ...
            proj += 2.0 * (h * n * c + h * c * v)  # ... but W_UK into the query, W_UV after the softmax
            core = keys * 2.0 * h * ((c + r) + c)
        else:
            proj, core = _attention_proj(cfg), keys * _core_per_key(cfg)
        total = total + Flops(attention_proj=proj, attention_core=core) + _ffn(cfg, i)
    return total


def step_flops(cfg: Any, mode: str, devices: int, seq_len: int, seqs_per_device: int = 1, batch: int = 1,
               doc_len: int | None = None, batch_devices: int | None = None) -> dict[str, Any]:
    """Useful FLOPs of the step ``inspect --mode <mode>`` compiles for ``cfg`` (a ``Config``).

    ``mode``: "train" (the trainer's step with the ``lm`` loss), "fcsd" (the step train.py runs:
    ``cfg.train.mode``, the teacher's forward when that is fcsd without a cached teacher), "prefill"
    (``batch`` sequences of ``seq_len``, all logits, as ``steps.build_prefill_step`` returns them) or
    "decode" (``batch`` sequences, one token each, against ``seq_len`` cached tokens). Train modes:
    ``seqs_per_device`` sequences per batch device (``batch_devices``: data x expert, default every
    device) in each of ``train.grad_accum_steps`` micro-batches. ``devices``: all devices of the mesh.
    """
    mcfg = cfg.model
    notes: list[str] = []
    if mode in ("train", "fcsd"):
        train_mode = "lm" if mode == "train" else getattr(cfg.train, "mode", "fcsd")
        teacher = train_mode == "fcsd" and getattr(cfg.train, "teacher_cache", None) is None
        micro = int(getattr(cfg.train, "grad_accum_steps", 1))
        tokens = (batch_devices or devices) * micro * seqs_per_device * seq_len
        per_token = forward_flops_per_token(mcfg, seq_len, doc_len)
        passes = {"student": 3.0, "teacher": 1.0 if teacher else 0.0}
        notes.append(f"train.mode={train_mode}: student forward + backward = 3x forward"
                     + (", teacher forward 1x" if teacher else ", no teacher in the step"))
    elif mode == "prefill":
        tokens = batch * seq_len
        per_token = forward_flops_per_token(mcfg, seq_len, doc_len)
        passes = {"student": 1.0, "teacher": 0.0}
        notes.append("prefill: one forward, logits of every token")
    elif mode == "decode":
        tokens = batch
        per_token = decode_flops_per_token(mcfg, seq_len)
        passes = {"student": 1.0, "teacher": 0.0}
        notes.append(f"decode: one token per sequence against {seq_len} cached tokens"
                     + (" (MLA absorbed over the latent cache)" if mcfg.attention_kind == "mla" else ""))
    else:
        raise ValueError(f"mode {mode!r}: expected train, fcsd, prefill or decode")
    if mode != "decode":
        keys = causal_keys_per_query(seq_len, doc_len)
        docs = "one document per sequence" if doc_len is None else f"documents of {doc_len} tokens"
        notes.append(f"causal attention, {docs}: {keys:g} keys per query on average")
    total = per_token.scaled(tokens * (passes["student"] + passes["teacher"]))
    return {"per_token_forward": per_token.as_dict(), "tokens": tokens, "passes": passes,
            "total": total.total, "per_device": total.total / devices, "by_part_per_device":
            total.scaled(1.0 / devices).as_dict(), "devices": devices, "seq_len": seq_len,
            "doc_len": doc_len, "assumptions": notes}

