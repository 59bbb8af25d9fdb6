"""Small building blocks: RMSNorm, rotary embedding (interleaved or rotate-half; YaRN or Llama 3.1
scaling), SwiGLU MLP.

Shape legend: B batch, T tokens (sequence), D model width, F MLP width, R rotary dims.
Weights are stored `[in, out]`; parameters live in `param_dtype`, math runs in `dtype`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ModelConfig, RopeScaling

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


class RMSNorm(nnx.Module):
    """RMSNorm computed in fp32 and cast back, then scaled (HF DeepseekV2RMSNorm order)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). Also the shared experts."""

    def __init__(self, d: int, f: int, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.gate_proj = normal_init(rngs, (d, f), pd)
        self.up_proj = normal_init(rngs, (d, f), pd)
        self.down_proj = normal_init(rngs, (f, d), pd)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = x_btd.dtype
        g = x_btd @ self.gate_proj[...].astype(dt)
        u = x_btd @ self.up_proj[...].astype(dt)
        return (jax.nn.silu(g) * u) @ self.down_proj[...].astype(dt)


# --------------------------------------------------------------------------------------------
# Rotary embedding


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, rs: RopeScaling) -> jnp.ndarray:
    """DeepSeek-V2's YaRN: interpolate low frequencies, keep high ones, ramp in between."""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rs.factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    return interpolation * (1.0 - keep_extrapolated) + extrapolation * keep_extrapolated


def _llama3_inv_freq(inv_freq: jnp.ndarray, rs: RopeScaling) -> jnp.ndarray:
    """Llama 3.1's bands: wavelengths shorter than original / high_freq_factor keep their frequency,
    longer than original / low_freq_factor are divided by `factor`, and the band between blends the
    two linearly in original / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    if rs.high_freq_factor == rs.low_freq_factor:  # no band between
        return scaled
    blend = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - blend) * scaled / rs.factor + blend * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(between, smoothed, scaled)


def rope_tables(cfg: ModelConfig) -> tuple[jnp.ndarray, float]:
    """Inverse frequencies for the rotary dims and the cos/sin magnitude (YaRN's mscale ratio)."""
    dim = cfg.rope_head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling is None:
        return inv, 1.0
    rs = cfg.rope_scaling
    if rs.type == "llama3":
        return _llama3_inv_freq(inv, rs), 1.0
    magnitude = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    if not (rs.mscale and rs.mscale_all_dim):
        magnitude = yarn_mscale(rs.factor)
    return _yarn_inv_freq(dim, cfg.rope_theta, rs), magnitude


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V2)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope(x: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array, magnitude: float,
               style: str = "interleaved") -> jax.Array:
    """Rotates pairs of x [B, T, ..., R] by angle pos * inv_freq[i]: (x[2i], x[2i+1]) when `style` is
    "interleaved" (DeepSeek-V2), (x[i], x[i + R/2]) when "half" (NeoX rotate-half, Qwen3-MoE)."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    extra = x.ndim - 3
    angles = angles.reshape(angles.shape[:2] + (1,) * extra + angles.shape[-1:])
    cos, sin = jnp.cos(angles) * magnitude, jnp.sin(angles) * magnitude
    x32 = x.astype(jnp.float32)
    if style == "half":
        re, im = jnp.split(x32, 2, axis=-1)
        return jnp.concatenate([re * cos - im * sin, im * cos + re * sin], axis=-1).astype(x.dtype)
    if style != "interleaved":
        raise ValueError(f"rope style {style!r}: expected 'interleaved' or 'half'")
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
