"""The FarSkip layer recurrence: the one place that knows there are several residual streams.

Notation (FARSKIP.md section 1): `x` is the full residual stream, `y` the stream without the
previous layer's routed-expert output (None when the two streams coincide). A/S/R/M are the
attention, shared-expert, routed-expert and dense-MLP outputs.

    regular:            A = Attn(LN1(x));  x' = (x + A) + (R + S)
    FarSkip MoE layer:  A = Attn(LN1(y));  S, R = MoE(LN2(x))
                        y' = (x + A) + S;  x' = (x + A) + (R + S)
    attn_only:          like FarSkip, but the MoE reads LN2(x + A)
    mlp_only:           A = Attn(LN1(x));  the MoE reads LN2(x);  no y stream
    dense layer:        A = Attn(LN1(y)), M = MLP(LN2(x)), x' = (x + A) + M, y' = None

A layer whose input has no y (the first FarSkip layer, or one after a dense or regular layer)
uses y := x and is a "parallel block". Every path calls `residual_step`: the single-device
reference, the expert-parallel training path (R arrives from an all-to-all Combine) and the
tensor-parallel inference path (`reduce` is a psum over the tensor axis; the FarSkip order lets
one psum carry A + S while the routed psum is consumed only by the next layer's MoE input).

Staleness two (`farskip.stale_blocks: 2`, EXPERIMENTAL: no published system has trained it).
In the paper's FarSkip every sub-block (attention, MoE) reads a stream that lacks the output of
the one sub-block before it (the MoE lacks this layer's A; attention lacks the previous layer's
R, while S, which EP computes locally, is already in). With two, every sub-block's input lacks
the outputs of the two sub-blocks before it, a two-step "ladder". The carried stale state is a
`Ladder(w, v)` instead of y; for layer k (input x_k, previous layer's input x_{k-1}):

    stale_blocks=2 MoE layer:  w_k = x_{k-1},  v_k = x_{k-1} + A_{k-1}
                               A_k = Attn(LN1(w_k));  S_k, R_k = MoE(LN2(v_k))
                               x_{k+1} = (x_k + A_k) + (R_k + S_k)
                               w_{k+1} = x_k;  v_{k+1} = x_k + A_k
    dense layer:               A = Attn(LN1(w)), M = MLP(LN2(v)), x' = (x + A) + M, no Ladder

so attention k reads neither layer k-1's MoE output nor its attention output, and the MoE of
layer k reads neither its own A_k nor layer k-1's S and R. A layer without a Ladder (first of the
range, after a dense or regular layer) uses w = v = x: a parallel block, as above. Under tensor
parallelism both psums then have two sub-blocks to hide under: psum(A_k) is first read by the
MoE of k+1 (it runs under the MoE of k and the attention of k+1), psum(S_k + R_k) by the
attention of k+2 (under the attention and MoE of k+1).

Chunks (`residual_step_chunks`) run this same recurrence per chunk: token chunks of a sequence
(the TP option `tp_microbatches`; attention, the one op that mixes tokens, runs over all chunks)
or batch chunks of whole sequences (`batch_split`; attention per chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model import schedule


class Connectivity(NamedTuple):
    attn_stale: bool  # attention reads y: it need not wait for the previous layer's Combine
    mlp_stale: bool  # the FFN reads x: it need not wait for this layer's attention
    stale_blocks: int = 1  # 2: the experimental two-sub-block ladder (module docstring)
    # Under tensor parallelism, order the sub-blocks with optimization barriers so that each psum
    # has the compute it may overlap scheduled under it (`schedule.join`;
    # ExecutionConfig.tp_order_barriers).
    # Why: XLA's latency-hiding scheduler estimates a psum at a fraction of its transfer time (on
    # H200 it puts ~20 us of compute under a 16 MiB psum that the link model puts at 70 us) and
    # keeps one collective in flight, so left alone it starts each psum just before its reader
    # and interleaves the sub-blocks of neighbouring layers. Joining the two values a sub-block
    # reads fixes the order. Both joined outputs are used on purpose: with only one of them
    # used, the same barrier measured worse (the psums still bunch up).
    tp_ordered: bool = False


REGULAR = Connectivity(False, False)


def layer_connectivity(cfg: ModelConfig, exe: ExecutionConfig = ExecutionConfig()) -> list[Connectivity]:
    """Per-layer connectivity from `cfg.farskip` (range, first/last N, attn-/mlp-only, staleness),
    with `exe.tp_order_barriers` on the FarSkip layers."""
    fs = cfg.farskip
    on = Connectivity(attn_stale=not fs.mlp_only, mlp_stale=not fs.attn_only, stale_blocks=fs.stale_blocks,
                      tp_ordered=exe.tp_order_barriers)
    in_range = set(fs.layer_range(cfg.num_layers))
    return [on if i in in_range else REGULAR for i in range(cfg.num_layers)]


class Ladder(NamedTuple):
    """The stale state under stale_blocks=2: the streams the next layer's sub-blocks read."""

    attn_in: jax.Array  # w: the previous layer's input x (no A, S, R of the previous layer)
    ffn_in: jax.Array  # v: w + the previous layer's A


# What a layer hands the next besides x: y (stale_blocks=1), a Ladder (2), None (one stream).
Stale = jax.Array | Ladder | None


class FFNOut(NamedTuple):
    shared: jax.Array | None  # S (None for a dense layer or without shared experts)
    main: jax.Array  # R for a MoE layer, M for a dense layer
    aux: dict[str, jax.Array]


AttnFn = Callable[[jax.Array], jax.Array]
FFNFn = Callable[[jax.Array], FFNOut]
ReduceFn = Callable[[jax.Array, str], jax.Array]


def _plus(a: jax.Array, b: jax.Array | None) -> jax.Array:
    return a if b is None else a + b


def attention_input(x: jax.Array, y: Stale, conn: Connectivity) -> jax.Array:
    """The stream a layer's attention reads (x when it is not stale or no stale stream came in)."""
    if not conn.attn_stale or y is None:
        return x
    return y.attn_in if isinstance(y, Ladder) else y


def parallel_block_state(x: jax.Array, conn: Connectivity) -> jax.Array | Ladder:
    """A stale state equivalent to None (every sub-block reads x), for loop carries of fixed structure."""
    return Ladder(x, x) if conn.stale_blocks == 2 else x


def residual_step(x: jax.Array, y: Stale, conn: Connectivity, is_moe: bool, attn: AttnFn,
                  ffn: FFNFn, reduce: ReduceFn | None = None
                  ) -> tuple[jax.Array, Stale, dict[str, jax.Array]]:
    """One decoder layer's residual wiring; returns (x', y', aux).

    `attn` and `ffn` take their (already normed) inputs and return full outputs, or per-device
    partial sums when `reduce` is given (tensor parallelism). Summation order follows the
    reference implementations so that regular connectivity reproduces HF's model exactly.
    """
    two_streams = is_moe and conn.attn_stale
    ordered = conn.tp_ordered and reduce is not None
    a = attn(attention_input(x, y, conn))
    if conn.stale_blocks == 2:  # attention and FFN both stale (config validation)
        out = ffn(x if y is None else y.ffn_in)
        if reduce is None:
            h = x + a
            x_new = h + _plus(out.main, out.shared)
            return x_new, (Ladder(x, h) if is_moe else None), out.aux
        # The reductions of a regular layer; only their readers moved (module docstring).
        h = x + reduce(a, "tp_psum_attn")
        f = _plus(out.main, out.shared)
        if ordered:
            # The next layer's attention (it reads x) and MoE (h) after this MoE, so that each
            # psum has the next sub-blocks under it; XLA otherwise runs two layers' MoEs at once
            # and the attention of layer k+2 early, both of which wait for psum(S + R).
            x, h, f = schedule.join(x, h, f)
        return h + reduce(f, "tp_psum_ffn"), (Ladder(x, h) if is_moe else None), out.aux
    if reduce is None:
        h = x + a
        out = ffn(x if conn.mlp_stale else h)
        x_new = h + _plus(out.main, out.shared)
        return x_new, (_plus(h, out.shared) if two_streams else None), out.aux
    if conn.mlp_stale:
        # A and the FFN read the same layer input: their partial sums share reductions.
        if ordered and two_streams and y is not None:
            # x carries the previous layer's routed psum: joined with A, the MoE and the A + S
            # psum follow this attention, which then runs under that psum (a parallel block,
            # y None, has no such psum). The order is [attention || routed psum k-1], then
            # [MoE || A + S psum], then [next attention || routed psum k].
            x, a = schedule.join(x, a)
        out = ffn(x)
        if two_streams:
            y_new = x + reduce(_plus(a, out.shared), "tp_psum_attn_shared")
            return y_new + reduce(out.main, "tp_psum_routed"), y_new, out.aux
        return x + reduce(_plus(_plus(a, out.shared), out.main), "tp_psum_block"), None, out.aux
    h = x + reduce(a, "tp_psum_attn")
    out = ffn(h)
    if two_streams:
        y_new = h if out.shared is None else h + reduce(out.shared, "tp_psum_shared")
        return y_new + reduce(out.main, "tp_psum_routed"), y_new, out.aux
    return h + reduce(_plus(out.main, out.shared), "tp_psum_ffn"), None, out.aux


def residual_step_chunks(xs: Sequence[jax.Array], ys: Sequence[Stale], conn: Connectivity, is_moe: bool,
                         attn: AttnFn | Sequence[AttnFn], ffn: FFNFn, reduce: ReduceFn | None = None,
                         staggered: bool = False
                         ) -> tuple[list[jax.Array], list[Stale], dict[str, jax.Array]]:
    """`residual_step` on chunks of the residual streams; returns per-chunk (x', y') and the
    chunks' mean aux.

    Token chunks (one `attn`, the TP option `tp_microbatches`): chunks of the same sequences, split
    on axis 1. Attention is the only op that mixes tokens, so it runs once, over the concatenation
    of the chunks of the stream it reads. Batch chunks (one `attn` per chunk, `batch_split`): whole
    sequences, split on axis 0; sequences are independent, so attention runs per chunk too.
    Everything else (norms, router, experts, collectives, residual adds) is per token: each chunk
    runs the recurrence on its own, and XLA may run one chunk's psums or all-to-alls under another
    chunk's compute. The values are those of one chunk (dropless routing for token chunks;
    matmuls over fewer rows may round differently). Aux values are the chunks' means: exact for
    the dropped fraction and sequence-wise balance losses (equal chunks of whole sequences), a
    mean of per-chunk statistics otherwise (token chunks; batch chunks with `seq_aux` off).

    `staggered` chains the chunks, as MaxText's batch-split schedule does: chunk c's FFN starts
    after chunk c-1's FFN output exists (batch chunks: its attention after chunk c-1's attention
    too), and chunk 0 of the next layer after the last chunk of this one, so each chunk's
    collectives run under the next chunk's compute.
    """
    previous: list[jax.Array] = []  # the FFN outputs so far, for the stagger
    attn_done: list[jax.Array] = []  # batch chunks: the attention outputs so far

    def chained_ffn(h: jax.Array) -> FFNOut:
        out = ffn(schedule.after(h, previous[-1]) if staggered and previous else h)
        previous.append(out.main)
        return out

    if callable(attn):
        a = attn(jnp.concatenate([attention_input(x, y, conn) for x, y in zip(xs, ys, strict=True)], axis=1))
        bounds = [sum(x.shape[1] for x in xs[:i]) for i in range(1, len(xs))]
        chunk_attns = [lambda _, a_c=a_c: a_c for a_c in jnp.split(a, bounds, axis=1)]
    else:
        def chained(attn_c: AttnFn) -> AttnFn:
            def run(h: jax.Array) -> jax.Array:
                attn_done.append(attn_c(schedule.after(h, attn_done[-1]) if staggered and attn_done else h))
                return attn_done[-1]
            return run
        chunk_attns = [chained(f) for f in attn]

    results = []
    for c, (x, y, attn_c) in enumerate(zip(xs, ys, chunk_attns, strict=True)):
        with jax.named_scope(f"chunk_{c}"):
            results.append(residual_step(x, y, conn, is_moe, attn_c, chained_ffn, reduce))
    xs_new = [r[0] for r in results]
    if staggered:
        xs_new[0] = schedule.after(xs_new[0], previous[-1])
    # Means, except the overflow flags, which are counted (any chunk's overflow voids the result).
    aux = {k: sum(r[2][k] for r in results) / (1 if k == "moe_overflow" else len(results))
           for k in results[0][2]}
    return xs_new, [r[1] for r in results], aux
