"""Blockwise (flash-style) causal attention in pure JAX: O(T) memory, every loop of static length.

Both passes fold key blocks into an online softmax (running row max `m`, denominator `denom`,
unnormalised output `acc`, all fp32); the forward keeps only the per-row logsumexp as a residual
and the backward recomputes each block's probabilities from it. No [T, T] array exists; the
largest temporary is one [B, H, block_q, block_kv] score block. Key blocks strictly above the
diagonal are never visited. Blocks cut by packed-document boundaries are computed and masked
rather than skipped with `lax.cond` (on GPU a conditional reads its predicate back to the host).

Every trip count is a Python int, so XLA sees a known cost for every op: a loop whose bounds
depend on another loop's index is one while node of unknown cost to the latency-hiding scheduler.
The same arithmetic runs in two layouts, chosen by what that scheduler does with them (deviceless
H200 compiles of DSV2-Lite widths, 3 layers, `python -m farskip_jax inspect`; numbers for the
commit that made this split, without / with the TP order barriers of model/farskip.py):

- Inference (no gradient: the primal of the custom_vjp). A Python loop over query blocks: each
  folds in the key blocks wholly before it with a static-length `fori_loop` (a scan), then its
  diagonal block(s) with the causal mask. The query blocks are independent short chains, which
  XLA keeps interleaving under layer k's routed psum before layer k+1's router starts. FarSkip TP
  prefill psum time hidden: 60.9% / 63.1%, vs 44.0% / 60.0% for one scan over all pairs (and
  then the first layer's psum is left synchronous).
- Training (custom_vjp fwd/bwd). One `lax.scan` over the static list of lower-triangle block
  pairs, query-major forward, key-major backward. Under EP, XLA fills layer k's Dispatch window
  with the first ready ops until its (low) estimate of the transfer is covered; one node carrying
  the whole core fills it: 97.9% of all-to-all time hidden, vs 76.2% with the query-block chains.

Where it runs: `ExecutionConfig.attention: auto` resolves to tokamax's fused kernels on the GPUs they
were checked for (model/attention_kernels.py: Mosaic GPU on Hopper, Pallas-Triton on MI300X, bf16 /
fp16) and to this module everywhere else: the CPU (always), other GPUs, fp32. It is also the
O(T)-memory fallback (`attention: blockwise`) and, with `reference_attention`, what the kernel
path's tests compare against.

Shape legend: B batch, T tokens, H heads, K q/k head dim, V v head dim (K != V under MLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_NEG = float(jnp.finfo(jnp.float32).min)
Array = jax.Array
State = tuple[Array, Array, Array]  # m [B, H, n], denom [B, H, n], acc [B, H, n, V]


def blockwise_attention(q_bthk: Array, k_bthk: Array, v_bthv: Array, segment_ids_bt: Array,
                        scale: float, block_q: int = 512, block_kv: int = 512) -> Array:
    """Causal attention within packed documents (equal segment ids), returned as [B, T, H, V].

    Blocks larger than T shrink to T; T need not be a multiple of either block.
    """
    t = q_bthk.shape[1]
    return _attention(q_bthk, k_bthk, v_bthv, segment_ids_bt, float(scale), min(block_q, t), min(block_kv, t))


def _at(x: Array, start: int | Array, size: int, axis: int = 1) -> Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _put(x: Array, block: Array, start: int | Array, axis: int = 1) -> Array:
    return lax.dynamic_update_slice_in_dim(x, block, start, axis)


def _scores(q_blk: Array, k_blk: Array, sq_blk: Array, sk_blk: Array, q0: int | Array,
            k0: int | Array, scale: float, causal: bool = True, t: int | None = None
            ) -> tuple[Array, Array]:
    """fp32 scores [B, H, bq, bk] of one block pair and its visibility mask [B, 1, bq, bk].

    `causal=False` for a key block that ends before the query block starts (all of it is in the
    past); `t` masks the padding rows of a query block that runs past the sequence.
    """
    s = jnp.einsum("bqhk,bshk->bhqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    visible = sq_blk[:, :, None] == sk_blk[:, None, :]
    q_pos = q0 + jnp.arange(q_blk.shape[1])
    if causal:
        visible &= (k0 + jnp.arange(k_blk.shape[1]))[None, :] <= q_pos[:, None]
    if t is not None:
        visible &= (q_pos < t)[:, None]
    return s, visible[:, None]


def _fold(state: State, s: Array, visible: Array, v_blk: Array) -> State:
    """The online-softmax update of one query block's state by one key block."""
    m, denom, acc = state
    m_new = jnp.maximum(m, jnp.max(jnp.where(visible, s, _NEG), axis=-1))
    # The where (not just a large negative score) keeps rows with nothing visible yet at 0.
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bhqs,bshv->bhqv", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return m_new, alpha * denom + p.sum(-1), alpha[..., None] * acc + pv


def _empty(b: int, h: int, n: int, vd: int) -> State:
    return (jnp.full((b, h, n), _NEG, jnp.float32), jnp.zeros((b, h, n), jnp.float32),
            jnp.zeros((b, h, n, vd), jnp.float32))


def _finish(state: State, dtype: jnp.dtype) -> tuple[Array, Array]:
    """Output block [B, n, H, V] and logsumexp [B, H, n]; a row that saw no key (padding) gets 0s."""
    m, denom, acc = state
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    out = (acc / safe[..., None]).transpose(0, 2, 1, 3).astype(dtype)
    return out, jnp.where(seen, m + jnp.log(safe), 0.0)


def _forward_inference(q: Array, k: Array, v: Array, seg: Array, scale: float, bq: int, bk: int) -> Array:
    """Output [B, T, H, V]: query blocks as independent chains (module docstring)."""
    b, t, h, _ = q.shape
    outs = []
    for q0 in range(0, t, bq):
        q1 = min(q0 + bq, t)
        q_blk, sq_blk = q[:, q0:q1], seg[:, q0:q1]

        def past_block(j: Array, state: State, q_blk=q_blk, sq_blk=sq_blk, q0=q0) -> State:
            k0 = j * bk
            s, visible = _scores(q_blk, _at(k, k0, bk), sq_blk, _at(seg, k0, bk), q0, k0, scale, causal=False)
            return _fold(state, s, visible, _at(v, k0, bk))

        state = _empty(b, h, q1 - q0, v.shape[-1])
        n_past = q0 // bk  # key blocks that end at or before this block's first row
        if n_past:
            state = lax.fori_loop(0, n_past, past_block, state)  # static bounds: a scan
        for k0 in range(n_past * bk, q1, bk):  # the diagonal, cut after the block's last row
            k1 = min(k0 + bk, q1)
            s, visible = _scores(q_blk, k[:, k0:k1], sq_blk, seg[:, k0:k1], q0, k0, scale)
            state = _fold(state, s, visible, v[:, k0:k1])
        outs.append(_finish(state, v.dtype)[0])
    return jnp.concatenate(outs, axis=1)


def _pairs(t: int, bq: int, bk: int, key_major: bool) -> tuple[Array, Array, Array]:
    """Block indices (i, j) of every pair with a causally visible key, and whether each pair is the
    first of its query block (query-major) or key block (key-major), where accumulators restart."""
    nq, nk = -(-t // bq), -(-t // bk)
    pairs = [(i, j) for i in range(nq) for j in range(nk) if j * bk < min((i + 1) * bq, t)]
    if key_major:
        pairs.sort(key=lambda p: (p[1], p[0]))
    qi, kj = (np.array(x, np.int32) for x in zip(*pairs, strict=True))
    lead = kj if key_major else qi
    first = np.concatenate([[True], lead[1:] != lead[:-1]])
    return jnp.asarray(qi), jnp.asarray(kj), jnp.asarray(first)


def _pad(x: Array, block: int, axis: int = 1) -> Array:
    """Pads the time axis to a multiple of `block` so that every dynamic slice stays in bounds."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -x.shape[axis] % block)
    return jnp.pad(x, pad)


def _forward_training(q: Array, k: Array, v: Array, seg: Array, scale: float, bq: int, bk: int
                      ) -> tuple[Array, Array]:
    """Output [B, T, H, V] and logsumexp [B, H, T] (fp32): one scan over the block pairs."""
    b, t, h, _ = q.shape
    qp, sq, kp, vp, sk = _pad(q, bq), _pad(seg, bq), _pad(k, bk), _pad(v, bk), _pad(seg, bk)
    empty = _empty(b, h, bq, v.shape[-1])

    def pair(carry: tuple[Array, Array, State], idx: tuple[Array, Array, Array]):
        out, lse, state = carry
        i, j, first = idx
        q0, k0 = i * bq, j * bk
        state = tuple(jnp.where(first, e, x) for x, e in zip(state, empty, strict=True))
        s, visible = _scores(_at(qp, q0, bq), _at(kp, k0, bk), _at(sq, q0, bq), _at(sk, k0, bk), q0, k0,
                             scale, t=t)
        state = _fold(state, s, visible, _at(vp, k0, bk))
        # Written (in place) after every pair: the query block's last pair writes the final value.
        o_blk, lse_blk = _finish(state, v.dtype)
        return (_put(out, o_blk, q0), _put(lse, lse_blk, q0, axis=2), state), None

    out_lse = (jnp.zeros(qp.shape[:3] + v.shape[3:], v.dtype), jnp.zeros((b, h, qp.shape[1]), jnp.float32))
    init = (*out_lse, empty)
    (out, lse, _), _ = lax.scan(pair, init, _pairs(t, bq, bk, key_major=False))
    return out[:, :t], lse[:, :, :t]


def _backward(q: Array, k: Array, v: Array, seg: Array, out: Array, lse: Array, d_out: Array, scale: float,
              bq: int, bk: int) -> tuple[Array, Array, Array]:
    """Gradients w.r.t. q, k, v: one key-major scan over the block pairs, scores recomputed."""
    t = q.shape[1]
    # delta_i = sum_j P_ij dP_ij = <dO_i, O_i>: the softmax-Jacobian term, one number per row.
    delta = jnp.einsum("bthv,bthv->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qp, sq, dop, lse_p, delta_p = (_pad(x, bq, axis) for x, axis in
                                   ((q, 1), (seg, 1), (d_out, 1), (lse, 2), (delta, 2)))
    kp, vp, sk = _pad(k, bk), _pad(v, bk), _pad(seg, bk)
    f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def pair(carry: tuple[Array, ...], idx: tuple[Array, Array, Array]):
        dq, dk, dv, dk_blk, dv_blk = carry
        i, j, first = idx
        q0, k0 = i * bq, j * bk
        q_blk, do_blk, k_blk, v_blk = _at(qp, q0, bq), _at(dop, q0, bq), _at(kp, k0, bk), _at(vp, k0, bk)
        s, visible = _scores(q_blk, k_blk, _at(sq, q0, bq), _at(sk, k0, bk), q0, k0, scale, t=t)
        p = jnp.where(visible, jnp.exp(s - _at(lse_p, q0, bq, axis=2)[..., None]), 0.0)
        dp = f32("bqhv,bshv->bhqs", do_blk, v_blk)
        ds = (p * (dp - _at(delta_p, q0, bq, axis=2)[..., None]) * scale).astype(q.dtype)
        # dk/dv of key block j accumulate over its query blocks (restarting at the first), dq in place.
        dk_blk = jnp.where(first, 0.0, dk_blk) + f32("bhqs,bqhk->bshk", ds, q_blk)
        dv_blk = jnp.where(first, 0.0, dv_blk) + f32("bhqs,bqhv->bshv", p.astype(v.dtype), do_blk)
        dq = _put(dq, _at(dq, q0, bq) + f32("bhqs,bshk->bqhk", ds, k_blk), q0)
        return (dq, _put(dk, dk_blk, k0), _put(dv, dv_blk, k0), dk_blk, dv_blk), None

    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    block_acc = (zeros(kp[:, :bk].shape), zeros(vp[:, :bk].shape))
    init = (zeros(qp.shape), zeros(kp.shape), zeros(vp.shape), *block_acc)
    (dq, dk, dv, _, _), _ = lax.scan(pair, init, _pairs(t, bq, bk, key_major=True))
    return dq[:, :t].astype(q.dtype), dk[:, :t].astype(k.dtype), dv[:, :t].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q: Array, k: Array, v: Array, seg: Array, scale: float, bq: int, bk: int) -> Array:
    return _forward_inference(q, k, v, seg, scale, bq, bk)


def _attention_fwd(q: Array, k: Array, v: Array, seg: Array, scale: float, bq: int, bk: int):
    out, lse = _forward_training(q, k, v, seg, scale, bq, bk)
    return out, (q, k, v, seg, out, lse)


def _attention_bwd(scale: float, bq: int, bk: int, res: tuple[Array, ...], d_out: Array):
    q, k, v, seg, out, lse = res
    return (*_backward(q, k, v, seg, out, lse, d_out, scale, bq, bk), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
