"""Blockwise (flash-style) attention against the [T, T] einsum reference, and its O(T) memory.

Parity runs in fp32 on causal + packed-document masks, forward and gradients w.r.t. q, k, v, with
MLA's unequal head dims (q/k 12, v 8 here), lengths that are not multiples of the block, and
blocks from 5 to 512 (512 clamps to T). The forward has two layouts (model/flash.py): the
inference one (no gradient) and the training one (under jax.vjp); both are checked. Skipping is
checked by behaviour: a NaN planted in one block reaches exactly the outputs/gradients of the
block pairs that are computed. Every loop must have a static trip count (no `while` in the jaxpr).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_tiny import record

from farskip_jax.config import ConfigError, ExecutionConfig, ModelConfig
from farskip_jax.model.attention import MLAttention, attention_core, reference_attention
from farskip_jax.model.flash import blockwise_attention

BAR = 1e-5
SCALE = 0.3
HEADS, QK_DIM, V_DIM = 3, 12, 8


def _inputs(b: int, t: int, seed: int = 0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, HEADS, QK_DIM)).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, HEADS, QK_DIM)).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, HEADS, V_DIM)).astype(dtype)
    d_out = jax.random.normal(ks[3], (b, t, HEADS, V_DIM)).astype(dtype)
    return q, k, v, d_out


def _packed_segments(t: int, lengths: list[int]) -> np.ndarray:
    """Row 0: documents of `lengths` (the rest one more document); row 1: a single document."""
    row = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(t - sum(lengths), 99)])
    return np.stack([row, np.full(t, 7)]).astype(np.int32)


def _value_and_grads(fn, q, k, v, seg, d_out):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
    return (out, *vjp(d_out))


def _max_err(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


# (T, block_q, block_kv, document lengths): boundaries fall inside blocks, T is odd or a multiple.
CASES = {
    "t32_blocks512": (32, 512, 512, [5, 11]),
    "t45_block8": (45, 8, 8, [10, 20]),
    "t45_q8_kv16": (45, 8, 16, [3, 17, 9]),
    "t45_q16_kv8": (45, 16, 8, [13]),
    "t61_q7_kv5": (61, 7, 5, [1, 30, 2]),
    "t64_block8": (64, 8, 8, [8, 8, 21]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_matches_reference_fp32(name: str) -> None:
    t, bq, bk, lengths = CASES[name]
    q, k, v, d_out = _inputs(2, t, seed=t)
    seg = jnp.asarray(_packed_segments(t, lengths))
    ours = jax.jit(lambda q, k, v, s: blockwise_attention(q, k, v, s, SCALE, bq, bk))
    ref = jax.jit(lambda q, k, v, s: reference_attention(q, k, v, s, SCALE))
    got = _value_and_grads(ours, q, k, v, seg, d_out)  # out: the training forward (under vjp)
    want = _value_and_grads(ref, q, k, v, seg, d_out)
    inference = ours(q, k, v, seg)  # no gradient: the inference forward
    for part, a, b in zip(("out", "dq", "dk", "dv", "out_inference"), (*got, inference), (*want, want[0]),
                          strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = _max_err(a, b)
        record("blockwise_vs_reference", f"{name}_{part}", err)
        assert err <= BAR, (part, err)
    assert float(jnp.abs(want[1]).max()) > 0.1  # gradients are not trivially zero


def test_blockwise_bf16_inputs() -> None:
    """bf16 in, bf16 out; fp32 statistics keep it as close to fp32 math as the reference is."""
    t, seg = 45, jnp.asarray(_packed_segments(45, [10, 20]))
    q, k, v, d_out = _inputs(2, t, seed=3, dtype=jnp.bfloat16)
    got = _value_and_grads(lambda *a: blockwise_attention(*a, SCALE, 8, 8), q, k, v, seg, d_out)
    ref_bf16 = _value_and_grads(lambda *a: reference_attention(*a, SCALE), q, k, v, seg, d_out)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    exact = _value_and_grads(lambda *a: reference_attention(*a, SCALE), *f32[:3], seg, f32[3])
    for a, r, e in zip(got, ref_bf16, exact, strict=True):
        assert a.dtype == jnp.bfloat16
        assert _max_err(a, e) <= 1.5 * _max_err(r, e) + 1e-2


def test_upper_blocks_are_skipped() -> None:
    """NaN in key/value block j: query blocks before j stay finite only if (i < j) pairs never run;
    the same NaN shows up in every later block's output, so the probe would see a computed pair."""
    t, b = 40, 8
    q, k, v, d_out = _inputs(1, t, seed=5)
    seg = jnp.zeros((1, t), jnp.int32)
    fn = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, seg, SCALE, b, b))
    train_out = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[0])
    grads = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](d_out))
    for j in range(t // b):
        nan_kv = slice(j * b, (j + 1) * b)
        for out in (fn(q, k, v.at[:, nan_kv].set(jnp.nan)), train_out(q, k, v.at[:, nan_kv].set(jnp.nan))):
            assert bool(jnp.isfinite(out[:, : j * b]).all()) and bool(jnp.isnan(out[:, j * b:]).all())
        dq, _, _ = grads(q, k.at[:, nan_kv].set(jnp.nan), v)  # dq rows need k blocks <= their own
        assert bool(jnp.isfinite(dq[:, : j * b]).all()) and bool(jnp.isnan(dq[:, j * b:]).all())
        _, dk, dv = grads(q.at[:, nan_kv].set(jnp.nan), k, v)  # dk/dv rows need q blocks >= their own
        later = slice((j + 1) * b, None)
        assert bool(jnp.isfinite(dk[:, later]).all()) and bool(jnp.isfinite(dv[:, later]).all())
        assert bool(jnp.isnan(dk[:, : (j + 1) * b]).all())


def _primitives(jaxpr) -> list[tuple[str, int | None]]:
    """(name, scan length) of every equation, recursing into sub-jaxprs (scan/custom_vjp bodies);
    duck-typed (`.eqns`) because jax.core.Jaxpr moved between JAX versions."""
    found = []
    for eqn in jaxpr.eqns:
        found.append((eqn.primitive.name, eqn.params.get("length")))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _primitives(inner)
    return found


def test_every_loop_has_a_static_trip_count() -> None:
    """A loop whose bounds depend on another loop's index lowers to a `while` of unknown trip count,
    one node of unknown cost to XLA's latency-hiding scheduler; both layouts must be scans.

    T=40, blocks of 8 (5 query blocks): inference has one scan per query block after the first
    (lengths 1..4, over the key blocks wholly before it); training one scan over the 15
    lower-triangle pairs forward and one backward."""
    t, b = 40, 8
    q, k, v, d_out = _inputs(1, t)
    seg = jnp.zeros((1, t), jnp.int32)
    fn = lambda q, k, v: blockwise_attention(q, k, v, seg, SCALE, b, b)  # noqa: E731
    inference = _primitives(jax.make_jaxpr(fn)(q, k, v).jaxpr)
    training = _primitives(jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1](d_out))(q, k, v).jaxpr)
    for prims in (inference, training):
        assert "while" not in [name for name, _ in prims]
    assert sorted(n for name, n in inference if name == "scan") == [1, 2, 3, 4]
    assert sorted(n for name, n in training if name == "scan") == [15, 15]


def _largest_array(hlo_text: str) -> int:
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in
             re.findall(r"(?:f32|bf16|f16|s32|pred)\[(\d+(?:,\d+)*)\]", hlo_text)]
    return max(sizes)


def test_no_t_by_t_array_in_compiled_hlo() -> None:
    """Forward + backward, and the inference forward alone, at T=1024, blocks of 128: nothing in
    the compiled HLO holds T*T elements (the reference does: its scores are [B, H, T, T])."""
    t, h = 1024, 2
    spec = lambda d: jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)  # noqa: E731
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(impl):
        return jax.jit(jax.grad(lambda q, k, v, s: attention_core(q, k, v, s, SCALE, impl, 128, 128).sum(),
                                argnums=(0, 1, 2)))

    blockwise = loss("blockwise").lower(spec(192), spec(192), spec(128), seg).compile().as_text()
    reference = loss("reference").lower(spec(192), spec(192), spec(128), seg).compile().as_text()
    inference = jax.jit(lambda q, k, v, s: attention_core(q, k, v, s, SCALE, "blockwise", 128, 128))
    inference = inference.lower(spec(192), spec(192), spec(128), seg).compile().as_text()
    assert _largest_array(reference) >= t * t
    for hlo in (blockwise, inference):
        assert _largest_array(hlo) < t * t
        assert _largest_array(hlo) <= t * h * 192  # q/k themselves (and dq/dk) are the largest


TINY = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, moe_intermediate_size=8, num_layers=1,
                   num_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2)
TINY_EXE = ExecutionConfig(attention_block_q=8, attention_block_kv=8)


def test_mlattention_dispatch() -> None:
    """The module honours execution.attention: auto/blockwise equal the reference (auto is blockwise on the
    CPU); cudnn, and tokamax where no fused kernel exists (the CPU), are clear errors."""
    x = jax.random.normal(jax.random.key(1), (2, 21, TINY.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(21), (2, 21))
    seg = jnp.asarray(_packed_segments(21, [9]))
    outs = {}
    for impl in ("auto", "blockwise", "reference"):
        module = MLAttention(TINY, nnx.Rngs(0), exe=dataclasses.replace(TINY_EXE, attention=impl))
        outs[impl] = module(x, pos, seg)
    assert _max_err(outs["auto"], outs["reference"]) <= BAR
    assert _max_err(outs["blockwise"], outs["reference"]) <= BAR
    with pytest.raises(ConfigError, match="execution.attention=cudnn is not supported for MLA.*12 vs 6"):
        MLAttention(TINY, nnx.Rngs(0), exe=dataclasses.replace(TINY_EXE, attention="cudnn"))(x, pos, seg)
    with pytest.raises(ConfigError, match="execution.attention=tokamax: no fused attention kernel"):
        MLAttention(TINY, nnx.Rngs(0), exe=dataclasses.replace(TINY_EXE, attention="tokamax"))(x, pos, seg)
