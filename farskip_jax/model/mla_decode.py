"""MLA decode attention over the latent cache, reading the cache once: one Pallas-Triton kernel.

Why: with DeepSeek-V2's absorbed projections a decode step attends over the cached latents
directly: scores = q_lat . latent + q_rope . rope, ctx = softmax(scores) . latent. As two XLA
einsums each reads the whole [B, S, C] latent cache from HBM (the scores, then the values), and at
256 sequences x 4096 cached tokens that is 2 x 1 GiB per layer per device: most of an H200 decode
step (BENCHMARKS K5). The kernel streams each block of cached slots through one online softmax, so
each latent row is read once and serves as both key and value; the fp32 scores never reach HBM.

The kernel (per program: one sequence b and 16 query rows, rows = (token, head) pairs, all heads of
a token share the sequence's cache like multi-query attention): loads its queries once, then for
each block of `block_s` slots up to the furthest position among its rows loads latent [block_s, C]
and rope [block_s, R], computes the [16, block_s] scores in fp32, masks slots after each row's
position, folds them into the running max / denominator and accumulates p . latent [16, C] in
fp32. Slots past the furthest position are never read, so a cache allocated for a long generation
costs only what is filled. Lowered by JAX's Pallas Triton backend to XLA's built-in Triton
(`__gpu$xla.gpu.triton`), the same path on H200 (sm_90) and MI300X (gfx942); `interpret=True`
runs the same kernel body on the CPU, which is how the tests check it against `reference`.

Shape legend: B sequences, T new tokens per sequence, H query heads (local under tensor
parallelism), C latent rank (kv_lora_rank), R rope dim, S cache slots, M = T * H query rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_M = 16  # query rows per program: Triton's smallest dot tile
# Slots per loop step: [block_s, C] bf16 of latent in shared memory (64 KiB on gfx942 at C=512,
# block_s=32 with Pallas' single stage on ROCm; H200's 228 KiB takes 64 with two stages).
BLOCK_S = {"cuda": 64, "rocm": 32}
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - m) is 0 without inf - inf


def reference(q_lat_bthc: jax.Array, q_rope_bthr: jax.Array, latent_bsc: jax.Array, rope_bsr: jax.Array,
              positions_bt: jax.Array, scale: float) -> jax.Array:
    """The same attention as two einsums (XLA): ctx [B, T, H, C] in q's dtype; fp32 scores. Row
    (b, t) sees slots <= positions_bt[b, t]. What CPU and other devices run, and the kernel's check."""
    dt = q_lat_bthc.dtype
    latent, rope = latent_bsc.astype(dt), rope_bsr.astype(dt)
    scores = (jnp.einsum("bthc,bsc->bhts", q_lat_bthc, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("bthr,bsr->bhts", q_rope_bthr, rope, preferred_element_type=jnp.float32))
    scores = scores * scale
    slots = jnp.arange(latent.shape[1], dtype=positions_bt.dtype)
    visible = slots[None, None, :] <= positions_bt[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bhts,bsc->bthc", probs, latent)


def _kernel(pos_ref: jax.Array, q_lat_ref: jax.Array, q_rope_ref: jax.Array, latent_ref: jax.Array,
            rope_ref: jax.Array, out_ref: jax.Array, *, block_s: int, scale: float) -> None:
    """One (sequence, 16 query rows) program; refs: pos [16], q_lat [16, C], q_rope [16, R], latent
    [S, C], rope [S, R], out [16, C]."""
    pos_m = pos_ref[...]
    q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]
    rows, width = q_lat.shape
    dims = (((1,), (1,)), ((), ()))  # q [M, C] . block [S, C] -> [M, S]

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
        max_m, denom_m, acc_mc = carry
        slots = pl.ds(j * block_s, block_s)
        latent = latent_ref[slots, :]
        scores = (jax.lax.dot_general(q_lat, latent, dims, preferred_element_type=jnp.float32)
                  + jax.lax.dot_general(q_rope, rope_ref[slots, :], dims, preferred_element_type=jnp.float32))
        slot_s = j * block_s + jnp.arange(block_s, dtype=jnp.int32)
        visible = slot_s[None, :] <= pos_m[:, None]
        scores = jnp.where(visible, scores * scale, _NEG)
        new_max = jnp.maximum(max_m, jnp.max(scores, axis=1))
        p = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        rescale = jnp.exp(max_m - new_max)
        acc_mc = acc_mc * rescale[:, None] + jax.lax.dot_general(
            p.astype(latent.dtype), latent, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return new_max, denom_m * rescale + jnp.sum(p, axis=1), acc_mc

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))
    # Every row sees slot 0 (positions >= 0), so after the first block the denominators are > 0.
    blocks = jnp.max(pos_m) // block_s + 1
    _, denom_m, acc_mc = jax.lax.fori_loop(0, blocks, body, init)
    out_ref[...] = (acc_mc / denom_m[:, None]).astype(out_ref.dtype)


def slot_block(slots: int, family: str) -> int:
    """Slots per loop step for a cache of `slots`: the largest power of two <= BLOCK_S[family] that
    divides it (a block never runs past the cache), or 0 if that is under 16."""
    block = BLOCK_S.get(family, 32)
    while block >= 16 and slots % block:
        block //= 2
    return block if block >= 16 else 0


def fits(latent_rank: int, rope_dim: int, slots: int, family: str = "cuda") -> bool:
    """Whether the kernel takes these shapes: widths powers of two >= 16 (Triton's block and dot
    rules) and a slot count with a `slot_block` (generation allocates multiples of 64)."""
    widths = all(w >= 16 and w & (w - 1) == 0 for w in (latent_rank, rope_dim))
    return widths and slot_block(slots, family) > 0


def latent_attention(q_lat_bthc: jax.Array, q_rope_bthr: jax.Array, latent_bsc: jax.Array,
                     rope_bsr: jax.Array, positions_bt: jax.Array, scale: float, family: str = "cuda",
                     interpret: bool = False) -> jax.Array:
    """`reference`'s result by the one-read kernel: ctx [B, T, H, C] in q's dtype.

    `family` ("cuda" / "rocm") sizes the slot blocks; `interpret` runs the kernel body as JAX ops
    (any backend: the tests). Per device: inside a tensor-parallel shard_map or on one device."""
    b, t, h, c = q_lat_bthc.shape
    s, r = latent_bsc.shape[1], rope_bsr.shape[-1]
    if not fits(c, r, s, family):
        raise ValueError(f"mla_decode kernel: latent rank {c} and rope dim {r} must be powers of two >= 16 "
                         f"and the cache's {s} slots a multiple of 16")
    dt = q_lat_bthc.dtype
    rows = t * h
    padded = math.ceil(rows / BLOCK_M) * BLOCK_M
    pad = [(0, 0), (0, padded - rows), (0, 0)]
    q_lat = jnp.pad(q_lat_bthc.reshape(b, rows, c), pad)
    q_rope = jnp.pad(q_rope_bthr.reshape(b, rows, r), pad)
    # row t * H + h is token t's; padding rows see slot 0 only (finite, discarded)
    pos = jnp.pad(jnp.repeat(positions_bt.astype(jnp.int32), h, axis=1), [(0, 0), (0, padded - rows)])
    kernel = functools.partial(_kernel, block_s=slot_block(s, family), scale=scale)
    per_seq = lambda i, j: (i, 0, 0)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, padded, c), dt),
        grid=(b, padded // BLOCK_M),
        in_specs=[pl.BlockSpec((None, BLOCK_M), lambda i, j: (i, j)),
                  pl.BlockSpec((None, BLOCK_M, c), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, BLOCK_M, r), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, s, c), per_seq),
                  pl.BlockSpec((None, s, r), per_seq)],
        out_specs=pl.BlockSpec((None, BLOCK_M, c), lambda i, j: (i, j, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2 if family == "cuda" else 1),
        interpret=interpret,
        name="mla_decode",
    )(pos, q_lat, q_rope, latent_bsc.astype(dt), rope_bsr.astype(dt))
    return out[:, :rows].reshape(b, t, h, c)
