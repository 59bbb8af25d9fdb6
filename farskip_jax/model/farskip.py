"""The FarSkip layer recurrence: the one place that knows there are two residual streams.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from farskip_jax.config import ModelConfig


class Connectivity(NamedTuple):
    attn_stale: bool  # attention reads y: it need not wait for the previous layer's Combine
    mlp_stale: bool  # the FFN reads x: it need not wait for this layer's attention


REGULAR = Connectivity(False, False)


def layer_connectivity(cfg: ModelConfig) -> list[Connectivity]:
    """Per-layer connectivity from `cfg.farskip` (range, first/last N, attn-/mlp-only)."""
    fs = cfg.farskip
    on = Connectivity(attn_stale=not fs.mlp_only, mlp_stale=not fs.attn_only)
    in_range = set(fs.layer_range(cfg.num_layers))
    return [on if i in in_range else REGULAR for i in range(cfg.num_layers)]


class FFNOut(NamedTuple):
    shared: jax.Array | None  # S (None for a dense layer or without shared experts)
    main: jax.Array  # R for a MoE layer, M for a dense layer
    aux: dict[str, jax.Array]


AttnFn = Callable[[jax.Array], jax.Array]
FFNFn = Callable[[jax.Array], FFNOut]
ReduceFn = Callable[[jax.Array, str], jax.Array]


def _plus(a: jax.Array, b: jax.Array | None) -> jax.Array:
    return a if b is None else a + b


def residual_step(x: jax.Array, y: jax.Array | None, conn: Connectivity, is_moe: bool, attn: AttnFn,
                  ffn: FFNFn, reduce: ReduceFn | None = None
                  ) -> tuple[jax.Array, jax.Array | None, dict[str, jax.Array]]:
    """One decoder layer's residual wiring; returns (x', y', aux).

    `attn` and `ffn` take their (already normed) inputs and return full outputs, or per-device
    partial sums when `reduce` is given (tensor parallelism). Summation order follows the
    reference implementations so that regular connectivity reproduces HF's model exactly.
    """
    two_streams = is_moe and conn.attn_stale
    a = attn(y if conn.attn_stale and y is not None else x)
    if reduce is None:
        h = x + a
        out = ffn(x if conn.mlp_stale else h)
        x_new = h + _plus(out.main, out.shared)
        return x_new, (_plus(h, out.shared) if two_streams else None), out.aux
    if conn.mlp_stale:
        # A and the FFN read the same layer input: their partial sums share reductions.
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
