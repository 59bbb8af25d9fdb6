"""Blockwise (flash-style) causal attention in pure JAX: O(T) memory in forward and backward.

The forward pass walks query blocks; for each it folds in key blocks with an online softmax
(running row max `m`, running denominator `denom`, unnormalised output `acc`, all fp32) and keeps only
the per-row logsumexp as a residual. The backward pass walks key blocks and, for each, the query
blocks that can see it, recomputing the probabilities from that logsumexp. No [T, T] array exists
in either pass; the largest temporary is one [B, H, block_q, block_kv] score block.

Causal skipping is exact and costs nothing: the inner loop's trip count depends on the outer
block index, so key blocks strictly above the diagonal are never visited. Blocks that are visible
causally but cut off by packed-document boundaries are computed and masked rather than skipped
with `lax.cond`: on GPU a conditional reads its predicate back to the host, one sync per block.

Shape legend: B batch, T tokens, H heads, K q/k head dim, V v head dim (K != V under MLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_NEG = float(jnp.finfo(jnp.float32).min)


def blockwise_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, segment_ids_bt: jax.Array,
                        scale: float, block_q: int = 512, block_kv: int = 512) -> jax.Array:
    """Causal attention within packed documents (equal segment ids), returned as [B, T, H, V].

    Blocks larger than T shrink to T; a T that is not a multiple of a block is padded up inside
    (padded keys sit after every real query, so causality already hides them).
    """
    t = q_bthk.shape[1]
    return _attention(q_bthk, k_bthk, v_bthv, segment_ids_bt, float(scale), min(block_q, t), min(block_kv, t))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_time(x: jax.Array, length: int, axis: int = 1) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)


def _slice(x: jax.Array, start: jax.Array, size: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(q_blk: jax.Array, k_blk: jax.Array, sq_blk: jax.Array, sk_blk: jax.Array, q0: jax.Array,
            k0: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """fp32 scores [B, H, bq, bk] of one block pair and its visibility mask [B, 1, bq, bk]."""
    s = jnp.einsum("bqhk,bshk->bhqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    q_pos = q0 + jnp.arange(q_blk.shape[1])
    k_pos = k0 + jnp.arange(k_blk.shape[1])
    causal = k_pos[None, :] <= q_pos[:, None]
    same_doc = sq_blk[:, :, None] == sk_blk[:, None, :]
    return s, (causal[None] & same_doc)[:, None]


def _forward(q, k, v, seg, scale: float, bq: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """Output [B, T, H, V] (v's dtype) and per-row logsumexp [B, H, T] (fp32)."""
    b, t, h, _ = q.shape
    vd = v.shape[-1]
    nq, nk = _cdiv(t, bq), _cdiv(t, bk)
    qp, sq = _pad_time(q, nq * bq), _pad_time(seg, nq * bq)
    kp, vp, sk = _pad_time(k, nk * bk), _pad_time(v, nk * bk), _pad_time(seg, nk * bk)

    def q_block(i, carry):
        out, lse = carry
        q0 = i * bq
        q_blk, sq_blk = _slice(qp, q0, bq), _slice(sq, q0, bq)

        def kv_block(j, state):
            m, denom, acc = state
            k0 = j * bk
            s, visible = _scores(q_blk, _slice(kp, k0, bk), sq_blk, _slice(sk, k0, bk), q0, k0, scale)
            m_new = jnp.maximum(m, jnp.max(jnp.where(visible, s, _NEG), axis=-1))
            # The where (not just a large negative score) keeps rows with nothing visible yet at 0.
            p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bhqs,bshv->bhqv", p.astype(v.dtype), _slice(vp, k0, bk),
                            preferred_element_type=jnp.float32)
            return m_new, alpha * denom + p.sum(-1), alpha[..., None] * acc + pv

        last_row = jnp.minimum(q0 + bq, t) - 1  # key blocks past the last real row are all masked
        init = (jnp.full((b, h, bq), _NEG, jnp.float32), jnp.zeros((b, h, bq), jnp.float32),
                jnp.zeros((b, h, bq, vd), jnp.float32))
        m, denom, acc = lax.fori_loop(0, last_row // bk + 1, kv_block, init)
        # Only padded query rows can see nothing (denom == 0); give them output 0 and a finite lse.
        seen = denom > 0
        o_blk = (acc / jnp.where(seen, denom, 1.0)[..., None]).transpose(0, 2, 1, 3).astype(v.dtype)
        lse_blk = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), 0.0)
        return (lax.dynamic_update_slice_in_dim(out, o_blk, q0, 1),
                lax.dynamic_update_slice_in_dim(lse, lse_blk, q0, 2))

    init = (jnp.zeros((b, nq * bq, h, vd), v.dtype), jnp.zeros((b, h, nq * bq), jnp.float32))
    out, lse = lax.fori_loop(0, nq, q_block, init)
    return out[:, :t], lse[:, :, :t]


def _backward(q, k, v, seg, out, lse, d_out, scale: float, bq: int, bk: int):
    """Gradients w.r.t. q, k, v from the saved logsumexp; each block pair's scores are recomputed."""
    t = q.shape[1]
    nq, nk = _cdiv(t, bq), _cdiv(t, bk)
    # delta_i = sum_j P_ij dP_ij = <dO_i, O_i>: the softmax-Jacobian term, one number per row.
    delta = jnp.einsum("bthv,bthv->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qp, sq, dop = _pad_time(q, nq * bq), _pad_time(seg, nq * bq), _pad_time(d_out, nq * bq)
    lse_p, delta_p = _pad_time(lse, nq * bq, axis=2), _pad_time(delta, nq * bq, axis=2)
    kp, vp, sk = _pad_time(k, nk * bk), _pad_time(v, nk * bk), _pad_time(seg, nk * bk)

    def kv_block(j, carry):
        dq, dk, dv = carry
        k0 = j * bk
        k_blk, v_blk, sk_blk = _slice(kp, k0, bk), _slice(vp, k0, bk), _slice(sk, k0, bk)

        def q_block(i, state):
            dq, dk_blk, dv_blk = state
            q0 = i * bq
            q_blk, do_blk = _slice(qp, q0, bq), _slice(dop, q0, bq)
            s, visible = _scores(q_blk, k_blk, _slice(sq, q0, bq), sk_blk, q0, k0, scale)
            p = jnp.where(visible, jnp.exp(s - _slice(lse_p, q0, bq, 2)[..., None]), 0.0)
            dv_blk += jnp.einsum("bhqs,bqhv->bshv", p.astype(v.dtype), do_blk,
                                 preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqhv,bshv->bhqs", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - _slice(delta_p, q0, bq, 2)[..., None]) * scale).astype(q.dtype)
            dk_blk += jnp.einsum("bhqs,bqhk->bshk", ds, q_blk, preferred_element_type=jnp.float32)
            dq_blk = _slice(dq, q0, bq) + jnp.einsum("bhqs,bshk->bqhk", ds, k_blk,
                                                     preferred_element_type=jnp.float32)
            return lax.dynamic_update_slice_in_dim(dq, dq_blk, q0, 1), dk_blk, dv_blk

        # Query blocks that end before this key block starts cannot see it: start the loop after them.
        init = (dq, jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))
        dq, dk_blk, dv_blk = lax.fori_loop(k0 // bq, nq, q_block, init)
        return (dq, lax.dynamic_update_slice_in_dim(dk, dk_blk, k0, 1),
                lax.dynamic_update_slice_in_dim(dv, dv_blk, k0, 1))

    dq, dk, dv = lax.fori_loop(0, nk, kv_block, tuple(jnp.zeros(x.shape, jnp.float32) for x in (qp, kp, vp)))
    return dq[:, :t].astype(q.dtype), dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, seg, scale: float, bq: int, bk: int) -> jax.Array:
    return _forward(q, k, v, seg, scale, bq, bk)[0]


def _attention_fwd(q, k, v, seg, scale, bq, bk):
    out, lse = _forward(q, k, v, seg, scale, bq, bk)
    return out, (q, k, v, seg, out, lse)


def _attention_bwd(scale, bq, bk, res, d_out):
    q, k, v, seg, out, lse = res
    return (*_backward(q, k, v, seg, out, lse, d_out, scale, bq, bk), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
