"""Grouped-query attention (GQA) of Qwen3-MoE (per-head q/k RMSNorm before RoPE, optional biases) and
Llama-4 (NoPE layers with temperature tuning, chunked attention and weightless q/k norm after RoPE
on the RoPE layers).

Selected by `ModelConfig.attention_kind == "gqa"` (model/transformer.py `DecoderLayer`); the
interface is MLAttention's, so the layer recurrence, the attention core (`attention_core`: fused
kernel or blockwise, one decision for both kinds) and the parallel paths are shared. Query head h
reads key/value head h // (H / G), the grouping of HF's `repeat_kv`; under tensor parallelism a
rank holds H / tp query heads and the G / tp key/value heads they read, or with tp > G the one head
they read, copied there (parallel/mesh.py `replicate_kv_heads`); both counts come from the weights,
never from the config.

Shape legend: B batch, T query tokens, S key tokens (cache slots), D model width, H query heads,
G key/value heads, K head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ConfigError, ExecutionConfig, ModelConfig
from farskip_jax.model.attention import CUDNN_DENSE_MASK, attention_core
from farskip_jax.model.layers import DTYPES, RMSNorm, apply_rope, normal_init, rope_tables, softmax_scale


class KVCache(NamedTuple):
    """One layer's inference cache: every past token's rotated keys and its values, per key/value
    head (split over `tensor` with the heads under tensor parallelism)."""

    k: jax.Array  # [B, S, G, K]
    v: jax.Array  # [B, S, G, K]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, slots: int, dtype: jnp.dtype, tensor: int = 1) -> KVCache:
        """Zeros for `batch` rows of `slots` tokens; with `tensor` > 1, the heads of the TP layout
        over that many ranks (`ModelConfig.tp_kv_heads`: copied heads are cached once per rank)."""
        shape = (batch, slots, cfg.tp_kv_heads(tensor), cfg.attn_head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, k_btgk: jax.Array, v_btgk: jax.Array, positions_bt: jax.Array) -> KVCache:
        """This cache with token t of row b stored in slot positions_bt[b, t]."""
        rows = jnp.arange(positions_bt.shape[0])[:, None]
        return KVCache(self.k.at[rows, positions_bt].set(k_btgk.astype(self.k.dtype)),
                       self.v.at[rows, positions_bt].set(v_btgk.astype(self.v.dtype)))


def chunk_segments(segment_ids_bt: jax.Array, positions_bt: jax.Array, chunk: int, max_positions: int
                   ) -> jax.Array:
    """Segment ids under which "same segment" means same document AND same attention chunk
    (pos // chunk): with the causal mask, Llama-4's chunked attention. Unique while positions stay
    below `max_positions` (the config's max_position_embeddings)."""
    per_segment = -(-max_positions // chunk)
    return segment_ids_bt * per_segment + positions_bt // chunk


def rms_unit(x: jax.Array, eps: float) -> jax.Array:
    """RMS normalisation without a weight, in fp32 (Llama-4's q/k norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class GQAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0,
                 exe: ExecutionConfig = ExecutionConfig()):
        """`layer`: this layer's index, which decides Llama-4's per-layer features (RoPE or NoPE,
        chunked or full, q/k norm, temperature tuning; `ModelConfig.uses_rope`, `chunked_layer`).
        `exe`: how to run it (the attention core and its blocks)."""
        pd = DTYPES[cfg.param_dtype]
        d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.attn_head_dim
        self.q_proj = normal_init(rngs, (d, h, k), pd)
        self.k_proj = normal_init(rngs, (d, g, k), pd)
        self.v_proj = normal_init(rngs, (d, g, k), pd)
        self.o_proj = normal_init(rngs, (h, k, d), pd)
        if cfg.attention_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, k), pd))
            self.k_bias = nnx.Param(jnp.zeros((g, k), pd))
            self.v_bias = nnx.Param(jnp.zeros((g, k), pd))
            self.o_bias = nnx.Param(jnp.zeros((d,), pd))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(k, cfg.rms_norm_eps, pd)
            self.k_norm = RMSNorm(k, cfg.rms_norm_eps, pd)
        if exe.attention == "cudnn":
            raise ConfigError(CUDNN_DENSE_MASK)
        self.cfg, self.exe = cfg, exe
        self.use_rope = cfg.uses_rope(layer)
        self.chunk = cfg.attention_chunk_size if cfg.chunked_layer(layer) else None
        self.unit_qk_norm = cfg.qk_norm_after_rope and self.use_rope
        self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope

    def _project(self, x_btd: jax.Array, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q [B, T, H, K], k [B, T, G, K], v [B, T, G, K]), q and k normed per head and rotated."""
        cfg, dt = self.cfg, x_btd.dtype

        def proj(w: nnx.Param, bias_name: str) -> jax.Array:
            out = jnp.einsum("btd,dhk->bthk", x_btd, w[...].astype(dt))
            return out + getattr(self, bias_name)[...].astype(dt) if cfg.attention_bias else out

        q, k, v = proj(self.q_proj, "q_bias"), proj(self.k_proj, "k_bias"), proj(self.v_proj, "v_bias")
        if cfg.qk_norm:  # over head_dim, before RoPE (HF Qwen3MoeAttention)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            inv_freq, magnitude = rope_tables(cfg)
            q = apply_rope(q, positions_bt, inv_freq, magnitude, cfg.rope_style)
            k = apply_rope(k, positions_bt, inv_freq, magnitude, cfg.rope_style)
        if self.unit_qk_norm:  # Llama-4: no weight, after RoPE
            q, k = rms_unit(q, cfg.rms_norm_eps), rms_unit(k, cfg.rms_norm_eps)
        if self.temperature_tuning:  # Llama-4's NoPE layers: a longer reach sharpens the softmax
            pos = positions_bt.astype(jnp.float32)
            temp = jnp.log1p(jnp.floor((pos + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
            q = (q.astype(jnp.float32) * temp[:, :, None, None]).astype(q.dtype)
        return q, k, v

    def _out(self, ctx_bthk: jax.Array) -> jax.Array:
        """o_proj of the per-head outputs: [B, T, D] (a partial sum over heads under TP)."""
        out = jnp.einsum("bthk,hkd->btd", ctx_bthk, self.o_proj[...].astype(ctx_bthk.dtype))
        return out + self.o_bias[...].astype(out.dtype) if self.cfg.attention_bias else out

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array,
                 cache: KVCache | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
        """Causal, document-masked attention output [B, T, D]. With `cache` (inference prefill: one
        causal segment per row), also the cache with this call's keys and values written."""
        cfg = self.cfg
        with jax.named_scope("qkv_proj"):
            q, k, v = self._project(x_btd, positions_bt)
        if self.chunk is not None:
            segment_ids_bt = chunk_segments(segment_ids_bt, positions_bt, self.chunk,
                                            cfg.max_position_embeddings)
        with jax.named_scope("core"):
            # The G key/value heads go in as they are: the fused kernels read head h // (H / G) for
            # query head h (HF's repeat_kv order); blockwise and reference repeat them there.
            ctx = attention_core(q, k, v, segment_ids_bt, softmax_scale(cfg), self.exe.attention,
                                 self.exe.attention_block_q, self.exe.attention_block_kv)
        with jax.named_scope("o_proj"):
            out = self._out(ctx)
        return out if cache is None else (out, cache.write(k, v, positions_bt))

    def decode(self, x_btd: jax.Array, positions_bt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """New tokens at `positions_bt` attending over the cache (written first): row b sees slots
        <= its position, so a right-padded prompt's padding in later slots is never read. Returns
        ([B, T, D] output, updated cache)."""
        dt = x_btd.dtype
        with jax.named_scope("qkv_proj"):
            q, k, v = self._project(x_btd, positions_bt)
            cache = cache.write(k, v, positions_bt)
            b, t, h, kd = q.shape
            g = k.shape[2]
            q_bgrtk = q.reshape(b, t, g, h // g, kd).transpose(0, 2, 3, 1, 4)  # query head = g * (H/G) + r
        with jax.named_scope("core"):
            keys, values = cache.k.astype(dt), cache.v.astype(dt)
            scores = jnp.einsum("bgrtk,bsgk->bgrts", q_bgrtk, keys,
                                preferred_element_type=jnp.float32) * softmax_scale(self.cfg)
            slots = jnp.arange(keys.shape[1], dtype=positions_bt.dtype)
            visible = slots[None, None, :] <= positions_bt[:, :, None]  # [B, T, S]
            if self.chunk is not None:  # chunked layer: the query's own chunk only
                visible &= slots[None, None, :] // self.chunk == positions_bt[:, :, None] // self.chunk
            scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
            probs = jax.nn.softmax(scores, axis=-1).astype(dt)
            ctx = jnp.einsum("bgrts,bsgk->btgrk", probs, values).reshape(b, t, h, kd)
        with jax.named_scope("o_proj"):
            return self._out(ctx), cache
