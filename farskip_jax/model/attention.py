"""Multi-head latent attention (MLA) of DeepSeek-V2/V3, with q-LoRA on or off, and Instella-MoE's
output gate (`attn_output_gate`: the heads' outputs times sigmoid(normed input @ W_gate) before o_proj).

Shape legend: B batch, T query tokens, S key tokens, D model width, H heads (local heads under
tensor parallelism: every head count is read from the weights, never from the config),
K = qk_nope + qk_rope head dim, N qk_nope, R qk_rope, V v head dim, C kv_lora_rank, Q q_lora_rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax import platforms
from farskip_jax.config import ConfigError, ExecutionConfig, ModelConfig
from farskip_jax.model import mla_decode
from farskip_jax.model.attention_kernels import KERNELS, fused_kernel, kernel_attention
from farskip_jax.model.flash import blockwise_attention
from farskip_jax.model.layers import DTYPES, RMSNorm, apply_rope, normal_init, rope_tables, softmax_scale


def reference_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshv: jax.Array, segment_ids_bt: jax.Array,
                        scale: float) -> jax.Array:
    """Causal softmax attention that never crosses packed documents (equal segment ids only).

    Materialises the [B, H, T, S] fp32 scores (1 GiB per sequence per layer at 4096 tokens, 16
    heads): kept as the plain-einsum definition that `blockwise` is tested against.
    """
    t = q_bthk.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk, preferred_element_type=jnp.float32) * scale
    causal = jnp.tril(jnp.ones((t, t), bool))
    same_doc = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    mask = causal[None] & same_doc  # [B, T, S]
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bshv.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, v_bshv)


# Why `cudnn` is refused (deviceless H200 compiles, jax 0.12, B=4, T=4096, 16 heads, bf16): the
# public jax.nn.dot_product_attention rejects MLA's q/k head dim ("The head dim must be <= 128 and a
# multiple of 8, but got 192"; it also wants v's head dim equal to k's), and it takes no segment
# ids: packed documents need a dense [B, 1, T, S] mask, which it turns into a bf16 bias
# (`__cudnn$fmhaScaleBiasSoftmax`, 128 MiB temporary forward, 257 MiB forward + backward for GQA
# head dims), the O(T^2) array this module avoids. `tokamax` masks by per-query document starts
# instead (model/attention_kernels.py).
CUDNN_UNSUPPORTED = (
    "execution.attention=cudnn is not supported for MLA: jax.nn.dot_product_attention needs the value "
    "head dim to equal the query/key head dim (got {k} vs {v}) and cannot take segment ids without "
    "a dense [T, T] mask; use execution.attention=tokamax, blockwise (or auto)")
CUDNN_DENSE_MASK = (
    "execution.attention=cudnn is not supported: jax.nn.dot_product_attention takes no segment ids, so "
    "packed documents would need a dense [T, T] mask; use execution.attention=tokamax, blockwise (or auto)")
MODES = ("auto", "blockwise", "reference", "tokamax", "cudnn")


def resolve_attention(mode: str, device: Any, dtype: Any, head_dims: tuple[int, int] = (0, 0)) -> str:
    """The attention core that ExecutionConfig.attention `mode` means on `device` for `dtype` inputs:
    "blockwise", "reference" or a fused kernel name of model/attention_kernels.py.

    `auto` is the fused kernel where one was compiled and checked for that device and dtype
    (`attention_kernels.fused_kernel`: Mosaic GPU on Hopper, Pallas-Triton on gfx942, bf16 / fp16),
    blockwise elsewhere (CPU always). `tokamax` insists on the fused kernel and is a ConfigError
    where there is none. `head_dims` (q/k, v) only words the cudnn error.
    """
    if mode in ("blockwise", "reference"):
        return mode
    if mode == "cudnn":
        k, v = head_dims
        raise ConfigError(CUDNN_UNSUPPORTED.format(k=k, v=v) if k != v else CUDNN_DENSE_MASK)
    if mode not in MODES:
        raise ConfigError(f"execution.attention must be one of {', '.join(MODES)}, got {mode!r}")
    kernel = fused_kernel(device, dtype)
    if kernel is not None:
        return kernel
    if mode == "tokamax":
        kind = getattr(device, "device_kind", device)
        raise ConfigError(f"execution.attention=tokamax: no fused attention kernel was checked for {kind} "
                          f"with {jnp.dtype(dtype).name} inputs (Mosaic GPU on Hopper, Pallas-Triton on "
                          "MI300X, bf16/fp16 only); use execution.attention=auto or blockwise")
    return "blockwise"


def _target_device() -> Any:
    """platforms.target_device(): the device being traced for. It is JAX's default device (what a
    deviceless compile sets to the target's), read directly where platforms predates the helper."""
    find = getattr(platforms, "target_device", None)
    if find is not None:
        return find()
    from jax.extend import backend

    return backend.get_default_device()


def attention_core(q_bthk: jax.Array, k_bshk: jax.Array, v_bshv: jax.Array, segment_ids_bt: jax.Array,
                   scale: float, impl: str = "auto", block_q: int = 512, block_kv: int = 512) -> jax.Array:
    """Causal, document-masked attention [B, T, H, V] by `impl` (ExecutionConfig.attention), resolved
    for the device being traced for (`platforms.target_device()`) by `resolve_attention`.

    k/v may carry G key/value heads for H query heads (G divides H; query head h reads key/value
    head h // (H / G), HF's repeat_kv order): the fused kernels read them as they are, the
    blockwise and reference paths repeat them. Segment ids: equal ids attend (causally); the fused
    kernels also need each document to be one contiguous run in its row (attention_kernels.py).
    """
    device = _target_device()
    core = resolve_attention(impl, device, q_bthk.dtype, (q_bthk.shape[-1], v_bshv.shape[-1]))
    if core in KERNELS:
        return kernel_attention(q_bthk, k_bshk, v_bshv, segment_ids_bt, scale, core,  # type: ignore[arg-type]
                                device)
    group = q_bthk.shape[2] // k_bshk.shape[2]
    if group > 1:
        k_bshk, v_bshv = jnp.repeat(k_bshk, group, axis=2), jnp.repeat(v_bshv, group, axis=2)
    if core == "reference":
        return reference_attention(q_bthk, k_bshk, v_bshv, segment_ids_bt, scale)
    return blockwise_attention(q_bthk, k_bshk, v_bshv, segment_ids_bt, scale, block_q, block_kv)


def decode_kernel_family(impl: str, device: Any, dtype: Any) -> str | None:
    """The device family ("cuda" / "rocm") whose one-read MLA decode kernel `impl`
    (ExecutionConfig.attention) means on `device`: where it resolves to a fused attention kernel (H200,
    MI300X; bf16 / fp16), else None (the einsums: CPU, fp32, blockwise / reference)."""
    core = resolve_attention(impl, device, dtype)
    return platforms.device_family(device) if core in ("mosaic_gpu", "pallas_triton") else None


def latent_decode_core(q_lat_bthc: jax.Array, q_rope_bthr: jax.Array, latent_bsc: jax.Array,
                       rope_bsr: jax.Array, positions_bt: jax.Array, scale: float, impl: str = "auto"
                       ) -> jax.Array:
    """MLA decode attention over the latent cache: ctx [B, T, H, C] (`model/mla_decode.py`): the
    one-read kernel where `decode_kernel_family` names one for the device being traced for and the
    shapes fit it (`mla_decode.fits`), else the two einsums."""
    family = decode_kernel_family(impl, _target_device(), q_lat_bthc.dtype)
    if family is not None and mla_decode.fits(latent_bsc.shape[-1], rope_bsr.shape[-1], latent_bsc.shape[1],
                                              family):
        return mla_decode.latent_attention(q_lat_bthc, q_rope_bthr, latent_bsc, rope_bsr, positions_bt,
                                           scale, family)
    return mla_decode.reference(q_lat_bthc, q_rope_bthr, latent_bsc, rope_bsr, positions_bt, scale)


class LatentCache(NamedTuple):
    """One layer's inference cache: what MLA needs of every past token, 576 values per token for
    DeepSeek-V2-Lite (per-head keys and values would be 16 x 320). Per token, not per head, so
    under tensor parallelism every rank holds all of it (the batch axis may be split)."""

    latent: jax.Array  # [B, S, C] the kv latent after kv_a_layernorm
    k_rope: jax.Array  # [B, S, R] the shared rope key, rotated

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, slots: int, dtype: jnp.dtype) -> LatentCache:
        return cls(jnp.zeros((batch, slots, cfg.kv_lora_rank), dtype),
                   jnp.zeros((batch, slots, cfg.qk_rope_head_dim), dtype))

    def write(self, latent_btc: jax.Array, k_rope_btr: jax.Array, positions_bt: jax.Array) -> LatentCache:
        """This cache with token t of row b stored in slot positions_bt[b, t]."""
        rows = jnp.arange(positions_bt.shape[0])[:, None]
        return LatentCache(self.latent.at[rows, positions_bt].set(latent_btc.astype(self.latent.dtype)),
                           self.k_rope.at[rows, positions_bt].set(k_rope_btr.astype(self.k_rope.dtype)))


# DeepSeek's code (and HF's port) builds the two latent norms with eps 1e-6 whatever the config says.
LATENT_NORM_EPS = 1e-6


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0,
                 exe: ExecutionConfig = ExecutionConfig()):
        """`layer` is unused: every MLA layer is alike (GQAttention's interface). `exe`: how to run it
        (the attention core and its blocks)."""
        del layer
        pd = DTYPES[cfg.param_dtype]
        d, h = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = normal_init(rngs, (d, h, cfg.qk_head_dim), pd)
        else:
            self.q_a_proj = normal_init(rngs, (d, cfg.q_lora_rank), pd)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, pd)
            self.q_b_proj = normal_init(rngs, (cfg.q_lora_rank, h, cfg.qk_head_dim), pd)
        self.kv_a_proj = normal_init(rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), pd)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, pd)
        self.kv_b_proj = normal_init(rngs, (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim), pd)
        self.o_proj = normal_init(rngs, (h, cfg.v_head_dim, d), pd)
        if cfg.attn_output_gate:
            self.gate_proj = normal_init(rngs, (d, h, cfg.v_head_dim), pd)
        self.cfg, self.exe = cfg, exe

    def _project(self, x_btd: jax.Array, positions_bt: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """(q_nope [B, T, H, N], q_rope [B, T, H, R] rotated, latent [B, T, C] normed, k_rope [B, T, R]
        rotated): everything a token contributes before the heads' keys and values are expanded."""
        cfg, dt = self.cfg, x_btd.dtype
        n, c = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            q = jnp.einsum("btd,dhk->bthk", x_btd, self.q_proj[...].astype(dt))
        else:
            q_lat = self.q_a_norm(x_btd @ self.q_a_proj[...].astype(dt))
            q = jnp.einsum("btq,qhk->bthk", q_lat, self.q_b_proj[...].astype(dt))
        kv_a = x_btd @ self.kv_a_proj[...].astype(dt)
        inv_freq, magnitude = rope_tables(cfg)
        q_rope = apply_rope(q[..., n:], positions_bt, inv_freq, magnitude, cfg.rope_style)
        k_rope = apply_rope(kv_a[..., c:], positions_bt, inv_freq, magnitude, cfg.rope_style)  # one head
        return q[..., :n], q_rope, self.kv_a_norm(kv_a[..., :c]), k_rope

    def __call__(self, x_btd: jax.Array, positions_bt: jax.Array, segment_ids_bt: jax.Array,
                 cache: LatentCache | None = None) -> jax.Array | tuple[jax.Array, LatentCache]:
        """Returns the attention output [B, T, D] (a partial sum over heads under TP).

        With `cache` (inference prefill: the prompt, one causal segment per row), also returns the
        cache with this call's latents written at `positions_bt`."""
        cfg, dt = self.cfg, x_btd.dtype
        n = cfg.qk_nope_head_dim
        with jax.named_scope("qkv_proj"):
            q_nope, q_rope, kv_lat, k_rope = self._project(x_btd, positions_bt)
            kv = jnp.einsum("btc,chk->bthk", kv_lat, self.kv_b_proj[...].astype(dt))
            k_nope, v = kv[..., :n], kv[..., n:]
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            k_heads = jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])
            k = jnp.concatenate([k_nope, k_heads], axis=-1)
        with jax.named_scope("core"):
            out = attention_core(q, k, v, segment_ids_bt, softmax_scale(cfg), self.exe.attention,
                                 self.exe.attention_block_q, self.exe.attention_block_kv)
        with jax.named_scope("o_proj"):
            out = jnp.einsum("bthv,hvd->btd", self._gate(x_btd, out), self.o_proj[...].astype(dt))
        return out if cache is None else (out, cache.write(kv_lat, k_rope, positions_bt))

    def _gate(self, x_btd: jax.Array, out_bthv: jax.Array) -> jax.Array:
        """The heads' outputs times sigmoid(x @ W_gate) under `attn_output_gate` (x: the normed layer
        input), else unchanged. Per head, so tensor parallelism splits W_gate like the heads."""
        if not self.cfg.attn_output_gate:
            return out_bthv
        gate = jnp.einsum("btd,dhv->bthv", x_btd, self.gate_proj[...].astype(x_btd.dtype))
        return out_bthv * jax.nn.sigmoid(gate)

    def decode(self, x_btd: jax.Array, positions_bt: jax.Array, cache: LatentCache
               ) -> tuple[jax.Array, LatentCache]:
        """Attention of new tokens at `positions_bt` over the cache (which they are first written
        into), with the absorbed projections of DeepSeek-V2: the key expansion W_UK is folded into
        the query and the value expansion W_UV applied after the softmax, so the per-head keys and
        values of the cached tokens are never formed. Row b attends to cache slots <= its position:
        anything in later slots (a right-padded prompt's padding) is never read and is overwritten
        as that row grows. Returns ([B, T, D] output, updated cache)."""
        cfg, dt = self.cfg, x_btd.dtype
        n = cfg.qk_nope_head_dim
        w_uk = self.kv_b_proj[..., :n].astype(dt)  # [C, H, N]
        w_uv = self.kv_b_proj[..., n:].astype(dt)  # [C, H, V]
        with jax.named_scope("qkv_proj"):
            q_nope, q_rope, kv_lat, k_rope = self._project(x_btd, positions_bt)
            cache = cache.write(kv_lat, k_rope, positions_bt)
            q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
        with jax.named_scope("core"):
            ctx = latent_decode_core(q_lat, q_rope, cache.latent, cache.k_rope, positions_bt,
                                     softmax_scale(cfg), self.exe.attention)
            out = jnp.einsum("bthc,chv->bthv", ctx, w_uv)
        with jax.named_scope("o_proj"):
            return jnp.einsum("bthv,hvd->btd", self._gate(x_btd, out), self.o_proj[...].astype(dt)), cache
