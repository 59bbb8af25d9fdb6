"""The decoder (DeepSeek-V2/V3, Instella-MoE, Qwen3-MoE, Llama-4): embedding, layer stack wired by
`residual_step`, final norm, LM head. The attention module comes from `ModelConfig.attention_kind`
(`attention_module`).

Every module takes what to compute (`cfg: ModelConfig`) and how to run it (`exe: ExecutionConfig`,
default `ExecutionConfig()`) apart; `exe` changes no parameter, only the program (kernels, remat,
splits, buffers), so two models that differ in `exe` share one parameter tree.

Shape legend: B batch, T tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Generator
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from farskip_jax.config import ExecutionConfig, ModelConfig
from farskip_jax.model import schedule
from farskip_jax.model.attention import LatentCache, MLAttention
from farskip_jax.model.dispatch import A2A_COUNTS, A2A_NAMES
from farskip_jax.model.farskip import (
    Connectivity,
    FFNOut,
    ReduceFn,
    Stale,
    layer_connectivity,
    parallel_block_state,
    residual_step,
    residual_step_chunks,
)
from farskip_jax.model.gqa_attention import GQAttention, KVCache
from farskip_jax.model.layers import DTYPES, MLP, RMSNorm, normal_init
from farskip_jax.model.moe import MoE, RoutedFn, local_routed
from farskip_jax.parallel.grad_sync import batch_mesh, per_batch_shard


class Parallelism(Protocol):
    """What a sharded execution plugs into the model (see farskip_jax.parallel); one that splits the
    batch over devices also says over how many (`batch_shards`, read by `execution.batch_split`)."""

    routed_fn: RoutedFn
    reduce: ReduceFn | None


# One layer's inference cache: MLA's latents or GQA's per-head keys and values.
AttentionCache = LatentCache | KVCache


def attention_module(cfg: ModelConfig) -> type[MLAttention] | type[GQAttention]:
    """The attention class of `cfg.attention_kind` (both share one interface)."""
    return GQAttention if cfg.attention_kind == "gqa" else MLAttention


def empty_cache(cfg: ModelConfig, batch: int, slots: int, dtype: jnp.dtype,
                tensor: int = 1) -> AttentionCache:
    """One layer's empty inference cache for `cfg`'s attention kind, for a TP layout over `tensor`
    ranks (GQA's key/value heads as that layout holds them; MLA's latent cache is replicated)."""
    if cfg.attention_kind == "gqa":
        return KVCache.empty(cfg, batch, slots, dtype, tensor)
    return LatentCache.empty(cfg, batch, slots, dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, idx: int, rngs: nnx.Rngs, exe: ExecutionConfig = ExecutionConfig()):
        pd = DTYPES[cfg.param_dtype]
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.attn = attention_module(cfg)(cfg, rngs, layer=idx, exe=exe)
        self.is_moe = cfg.is_moe_layer(idx)
        self.tp_order_barriers = exe.tp_order_barriers
        self.batch_split_stagger = exe.batch_split_stagger
        if self.is_moe:
            self.moe = MoE(cfg, rngs, exe=exe)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg, rngs)

    def __call__(self, x: jax.Array | list[jax.Array], y: Stale | list[Stale],
                 positions: jax.Array | list[jax.Array], segment_ids: jax.Array | list[jax.Array],
                 conn: Connectivity, routed_fn: RoutedFn, reduce: ReduceFn | None):
        """(x', y', aux); x and y are lists of token chunks under `tp_microbatches`, and x, y, positions
        and segment_ids lists of batch chunks under `batch_split` (farskip.py)."""
        def attention(positions, segment_ids):
            def attn(h):
                with jax.named_scope("attention"):
                    return self.attn(self.input_norm(h), positions, segment_ids)
            return attn

        ffn = functools.partial(self._ffn, routed_fn=routed_fn)
        if isinstance(positions, list):
            attns = [attention(p, s) for p, s in zip(positions, segment_ids, strict=True)]
            return residual_step_chunks(x, y, conn, self.is_moe, attns, ffn, reduce,
                                        staggered=self.batch_split_stagger)
        attn = attention(positions, segment_ids)
        if isinstance(x, list):
            return residual_step_chunks(x, y, conn, self.is_moe, attn, ffn, reduce,
                                        staggered=self.tp_order_barriers and reduce is not None)
        return residual_step(x, y, conn, self.is_moe, attn, ffn, reduce)

    def _ffn(self, h: jax.Array, routed_fn: RoutedFn) -> FFNOut:
        h = self.post_attn_norm(h)
        if self.is_moe:
            shared, routed, aux = self.moe(h, routed_fn)
            return FFNOut(shared, routed, aux)
        with jax.named_scope("mlp"):
            return FFNOut(None, self.mlp(h), {})

    def cached(self, x: jax.Array, y: Stale, positions: jax.Array, cache: AttentionCache, conn: Connectivity,
               routed_fn: RoutedFn, reduce: ReduceFn | None, prefill: bool
               ) -> tuple[jax.Array, Stale, AttentionCache, dict[str, jax.Array]]:
        """(x', y', cache', aux): this layer at inference, reading and extending its cache. Prefill (the
        prompts, one causal segment per row) runs the training attention, decode the cached one
        (MLA: the absorbed form); the residual wiring, FarSkip's included, is `residual_step` as
        everywhere."""
        written: list[AttentionCache] = []

        def attn(h: jax.Array) -> jax.Array:
            with jax.named_scope("attention"):
                h = self.input_norm(h)
                if prefill:
                    out, new = self.attn(h, positions, jnp.ones_like(positions), cache)
                else:
                    out, new = self.attn.decode(h, positions, cache)
            written.append(new)
            return out

        x, y, aux = residual_step(x, y, conn, self.is_moe, attn,
                                  functools.partial(self._ffn, routed_fn=routed_fn), reduce)
        return x, y, written[0], aux


class ModelOutput(NamedTuple):
    logits: jax.Array | None  # [B, T, V] float32 (None when only hidden states were asked for)
    hidden: jax.Array  # final-normed hidden states [B, T, D]
    # summed balance losses, mean dropped fraction, and "moe_overflow" (int32 []: 1 when a bounded
    # routed-expert buffer overflowed in some layer, so everything here is void; dispatch.moe_buffer)
    aux: dict[str, jax.Array]
    layer_outputs: tuple[jax.Array, ...]  # residual stream x after each layer (for hidden-state L2)


def overflow_flag(counts: Any) -> jax.Array:
    """int32 []: 1 when any of the per-layer (per-shard, per-chunk) overflow counts is nonzero."""
    return (jnp.sum(jnp.asarray(counts)) > 0).astype(jnp.int32)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, exe: ExecutionConfig = ExecutionConfig()):
        """The model `cfg` run as `exe` says (the parameters depend on `cfg` only)."""
        cfg.validate()
        exe.validate()
        pd = DTYPES[cfg.param_dtype]
        self.cfg, self.exe = cfg, exe
        self.embed = normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), pd)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs, exe) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal_init(rngs, (cfg.hidden_size, cfg.vocab_size), pd)

    def connectivity(self) -> list[Connectivity]:
        return layer_connectivity(self.cfg, self.exe)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, *, parallel: Parallelism | None = None,
                 compute_logits: bool = True, layer_loop: str | None = None) -> ModelOutput:
        """`layer_loop` (default `exe.layer_loop`) "scan": equal consecutive layers run under one
        `lax.scan` (`_scan_layers`)."""
        return run_streams([self.stream(input_ids, positions, segment_ids, parallel=parallel,
                                        compute_logits=compute_logits, layer_loop=layer_loop)], join=False)[0]

    def stream(self, input_ids: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, parallel: Parallelism | None = None,
               compute_logits: bool = True, layer_loop: str | None = None
               ) -> Generator[Any, Any, ModelOutput]:
        """The forward pass as a generator: after each layer (group) it yields the residual stream
        (x, y) and continues with the value sent back, and returns the ModelOutput (`run_streams`
        drives one or several models)."""
        layer_loop = layer_loop or self.exe.layer_loop
        if layer_loop not in ("unrolled", "scan"):
            raise ValueError(f"layer_loop={layer_loop!r}: expected 'unrolled' or 'scan'")
        cfg, exe = self.cfg, self.exe
        dt = DTYPES[cfg.dtype]
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        routed_fn = parallel.routed_fn if parallel is not None else local_routed
        reduce = parallel.reduce if parallel is not None else None

        # On each device's own tokens: the embedding's gradient (a scatter-add, in fp32: a frequent
        # token's row collects thousands of contributions) is summed over the batch devices once, in
        # `dt`, like every other weight's (parallel/grad_sync.py).
        x = per_batch_shard(lambda w, ids: jnp.take(w[0], ids[0], axis=0).astype(dt), batch_mesh(parallel),
                            (self.embed[...],), (input_ids,), sum_outputs=False, grad_dtype=dt,
                            local_dtype=jnp.float32)
        y = None
        # Tensor-parallel token chunks: the stream is carried as a list of chunks through every layer,
        # so that a chunk's next layer reads only its own psums (farskip.residual_step_chunks).
        chunks = exe.tp_microbatches if reduce is not None else 1
        if chunks > 1:
            if t % chunks:
                raise ValueError(f"execution.tp_microbatches={chunks} does not divide {t} tokens per "
                                 "sequence")
            # Materialised apart (a barrier): XLA would otherwise fuse the slice that starts chunk 1
            # into the residual add after chunk 0's first psum, making chunk 1 wait for that psum.
            x, y = list(schedule.join(*jnp.split(x, chunks, axis=1))), [None] * chunks
            join = _concat
        # Batch chunks (single device, expert parallelism): whole sequences, positions and segments
        # with them; each device's sequences are split, so a chunk stays on its devices.
        elif reduce is None and exe.batch_split > 1:
            chunks = exe.batch_split
            shards = getattr(parallel, "batch_shards", 1)
            if b % (shards * chunks):
                raise ValueError(f"execution.batch_split={chunks} does not divide the {b // shards} "
                                 f"sequences per device ({b} sequences over {shards} devices)")
            x, positions, segment_ids = (_split_batch(v, chunks, shards) for v in (x, positions, segment_ids))
            y = [None] * chunks
            join = functools.partial(_join_batch, shards=shards)
        aux_sum: dict[str, Any] = {}
        outputs = []
        conns = self.connectivity()
        groups = _layer_groups(cfg, conns) if layer_loop == "scan" else [[i] for i in range(cfg.num_layers)]
        for group in groups:
            if len(group) == 1:
                i = group[0]
                with jax.named_scope(f"layer_{i}"):
                    x, y, aux = _maybe_remat(self.layers[i], exe.remat)(x, y, positions, segment_ids,
                                                                        conns[i], routed_fn, reduce)
                xs: list[jax.Array] = [join(x) if chunks > 1 else x]
            else:
                with jax.named_scope(f"layers_{group[0]}_{group[-1]}"):
                    x, y, xs, aux = _scan_layers([self.layers[i] for i in group], conns[group[0]], exe.remat,
                                                 x, y, positions, segment_ids, routed_fn, reduce)
            for k, v in aux.items():
                aux_sum[k] = aux_sum.get(k, 0.0) + v
            outputs.extend(xs)
            x, y = yield x, y
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        if "dropped_fraction" in aux_sum:
            aux_sum["dropped_fraction"] = aux_sum["dropped_fraction"] / max(n_moe, 1)
        aux_sum["moe_overflow"] = overflow_flag(aux_sum.get("moe_overflow", 0))
        if chunks > 1:
            x = join(x)
        hidden = self.final_norm(x)  # the final norm reads x; y is dropped
        logits = self.logits(hidden) if compute_logits else None
        return ModelOutput(logits, hidden, aux_sum, tuple(outputs))

    def cached_forward(self, input_ids: jax.Array, positions: jax.Array, caches: tuple[AttentionCache, ...],
                       *, prefill: bool, parallel: Parallelism | None = None
                       ) -> tuple[jax.Array, tuple[AttentionCache, ...], jax.Array]:
        """Inference over per-layer caches (`empty_cache`): (final-normed hidden [B, T, D], updated caches,
        overflow flag as in `ModelOutput.aux`). `prefill`: `input_ids` [B, T] are the prompts
        (right-padded rows: the padding is written to the cache but never attended to); otherwise
        each row's new tokens at `positions`. After an overflow the caller runs the same call again
        with the worst-case model on the returned caches: that overwrites every slot this call wrote
        (the slots at `positions`), so the caches come out as if the overflow had not happened."""
        cfg = self.cfg
        routed_fn = parallel.routed_fn if parallel is not None else local_routed
        reduce = parallel.reduce if parallel is not None else None
        x = jnp.take(self.embed[...], input_ids, axis=0).astype(DTYPES[cfg.dtype])
        y: Stale = None
        new_caches, overflow = [], []
        for i, conn in enumerate(self.connectivity()):
            with jax.named_scope(f"layer_{i}"):
                x, y, cache, aux = self.layers[i].cached(x, y, positions, caches[i], conn, routed_fn, reduce,
                                                         prefill)
            new_caches.append(cache)
            if "moe_overflow" in aux:
                overflow.append(aux["moe_overflow"])
        return self.final_norm(x), tuple(new_caches), overflow_flag(jnp.stack(overflow) if overflow else 0)

    def head_weights(self) -> jax.Array:
        """The [D, V] output projection (the embedding's transpose when tied)."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        with jax.named_scope("lm_head"):
            w = self.head_weights().astype(hidden_btd.dtype)
            return jnp.dot(hidden_btd, w, preferred_element_type=jnp.float32)


def run_streams(streams: list[Generator[Any, Any, ModelOutput]], join: bool = True,
                scopes: list[str | None] | None = None) -> list[ModelOutput]:
    """Runs the forward passes `streams` (`Transformer.stream`, equal layer counts) side by side.

    With `join`, after every layer the streams' next attention inputs pass one XLA optimization
    barrier together (`_join_attention_inputs`): layer i+1's attention of either model starts only
    once both models have the input it reads, so XLA's scheduler sees the two models' layer i at the
    same time and can run one model's collectives under the other's compute (FCSD: the frozen
    teacher's layer under the student's all-to-alls; two independent forwards are otherwise
    scheduled far apart).
    The values are unchanged. `scopes`: a `jax.named_scope` per stream, entered around each of its
    steps (a scope entered inside a generator would stay open while the other streams run).
    """
    scopes = scopes or [None] * len(streams)

    def step(k: int, value: Any = None, first: bool = False) -> Any:
        with jax.named_scope(scopes[k]) if scopes[k] else contextlib.nullcontext():
            return next(streams[k]) if first else streams[k].send(value)

    outs: list[Any] = [None] * len(streams)
    states = [step(k, first=True) for k in range(len(streams))]
    while True:
        if join and len(states) > 1:
            states = _join_attention_inputs(states)
        moved = []
        for k, st in enumerate(states):
            try:
                moved.append(step(k, st))
            except StopIteration as done:
                outs[k] = done.value
        if not moved:
            return outs
        if len(moved) != len(streams):
            raise ValueError("run_streams: the models have different numbers of layers")
        states = moved


def _join_attention_inputs(states: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The streams' (x, y) states with what each one's next attention reads joined by one barrier:
    the stale stream y (or Ladder) where a stream carries one, else x.

    Why not the whole state: under FarSkip x = y + R carries the layer's routed output, the
    Combine, which FarSkip lets run under the next layer's attention; a barrier on x would make
    that attention wait for the Combine (on the 5-layer EP32 H200 FCSD step, est. 261.7 ms with the
    whole state joined, 257.6 ms with y: BENCHMARKS.md K22). Where a FarSkip range ends, the next
    (regular) layer reads x, so the barrier holds nothing of that one layer's attention."""
    picks = [1 if jax.tree.leaves(y) else 0 for _, y in states]
    joined = schedule.join(*[state[k] for state, k in zip(states, picks, strict=True)])
    return [(v, y) if k == 0 else (x, v) for (x, y), k, v in zip(states, picks, joined, strict=True)]


def _concat(chunks: list[jax.Array]) -> jax.Array:
    """Token chunks (axis 1) back into one array."""
    return jnp.concatenate(chunks, axis=1)


def _split_batch(v: jax.Array, chunks: int, shards: int) -> list[jax.Array]:
    """Batch chunks of v [B, ...] sharded over `shards` devices on axis 0: chunk c holds part c of
    every device's sequences, so splitting and joining (`_join_batch`) move no data between devices."""
    per_shard = v.reshape(shards, chunks, v.shape[0] // (shards * chunks), *v.shape[1:])
    return [per_shard[:, c].reshape(v.shape[0] // chunks, *v.shape[1:]) for c in range(chunks)]


def _join_batch(vs: list[jax.Array], shards: int) -> jax.Array:
    """The inverse of `_split_batch`."""
    stacked = jnp.stack([v.reshape(shards, -1, *v.shape[1:]) for v in vs], axis=1)
    return stacked.reshape(-1, *vs[0].shape[1:])


def _maybe_remat(layer: DecoderLayer, policy: str):
    # "auto" is resolved to one of the others before a train step is built (train/remat.py); any
    # other program runs the model forward only, where every policy is the same program.
    if policy in ("none", "auto"):
        return layer
    kwargs = {}
    if policy == "save_dots":
        kwargs["policy"] = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    elif policy == "save_a2a":
        # Keep only what the all-to-alls received: the recomputed forward then needs no collective
        # (backward all-to-alls = the transposes of Dispatch and Combine only).
        kwargs["policy"] = jax.checkpoint_policies.save_only_these_names(*A2A_NAMES)
    elif policy == "save_a2a_dots":
        # Both of the above: no exchange and no plain matmul (projections, shared experts, dense
        # MLPs) runs again; the grouped expert GEMMs and attention kernels (not dot_general) do.
        kwargs["policy"] = jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.save_only_these_names(*A2A_NAMES),
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    elif policy == "full":
        # Everything is recomputed but the expert-parallel counts exchange ([G, L+1] int32 per MoE
        # layer): the backward's Combine transpose needs its offsets, and rerunning the counts
        # all_to_all first made it wait for that round trip with nothing scheduled under it (DSV2-Lite
        # EP=8 on H200: 24 us of compute under a 200 us transfer in every MoE layer's backward).
        kwargs["policy"] = jax.checkpoint_policies.save_only_these_names(A2A_COUNTS)
    else:
        raise ValueError(f"remat={policy!r}: expected auto, none, full, save_dots, save_a2a or "
                         "save_a2a_dots")
    return _RematCall(layer, kwargs)


class _RematCall:
    """Recomputes one layer in the backward pass (nnx.remat over the layer's state)."""

    def __init__(self, layer: DecoderLayer, kwargs: dict[str, Any]):
        self.layer, self.kwargs = layer, kwargs

    def __call__(self, x, y, positions, segment_ids, conn, routed_fn, reduce):
        def run(layer, x, y, positions, segment_ids):
            return layer(x, y, positions, segment_ids, conn, routed_fn, reduce)

        return nnx.remat(run, **self.kwargs)(self.layer, x, y, positions, segment_ids)


def _layer_groups(cfg: ModelConfig, conns: list[Connectivity]) -> list[list[int]]:
    """Maximal runs of consecutive layers with the same kind (MoE/dense), attention variant (Llama-4's
    RoPE/NoPE, chunked/full) and connectivity: one scan body serves them all."""
    def key(i: int) -> tuple:
        return cfg.is_moe_layer(i), cfg.uses_rope(i), cfg.chunked_layer(i), conns[i]

    groups: list[list[int]] = []
    for i in range(cfg.num_layers):
        if groups and key(groups[-1][-1]) == key(i):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _scan_layers(layers: list[DecoderLayer], conn: Connectivity, remat: str, x: jax.Array,
                 y: Stale, positions: jax.Array, segment_ids: jax.Array, routed_fn: RoutedFn,
                 reduce: ReduceFn | None
                 ) -> tuple[jax.Array, Stale, list[jax.Array], dict[str, jax.Array]]:
    """Runs equal layers as one `lax.scan` over their stacked parameters, carrying (x, y).

    A measurement option (`layer_loop="scan"`), not the production path: the per-layer leaves
    are stacked with `jnp.stack` inside the traced function, which costs one copy of these
    layers' weights per step. It exists to measure compile time and how XLA overlaps
    collectives across a layer boundary when every layer is the same loop body: the carry holds
    both streams, so a layer's pending routed output (Combine) and the next layer's attention,
    which FarSkip lets hide it, live in one body. A missing y (first FarSkip layer: a parallel
    block) enters as y := x (stale_blocks=2: w = v = x), which `residual_step` computes identically;
    after the loop y is None again unless the layers produce two streams.
    """
    graphdef, first = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), first, *[nnx.split(m)[1] for m in layers[1:]])
    two_streams = layers[0].is_moe and conn.attn_stale

    def body(carry, state):
        x, y = carry
        layer = nnx.merge(graphdef, state)
        x_new, y_new, aux = _maybe_remat(layer, remat)(x, y, positions, segment_ids, conn, routed_fn, reduce)
        return (x_new, parallel_block_state(x_new, conn) if y_new is None else y_new), (x_new, aux)

    (x, y), (xs, aux) = jax.lax.scan(body, (x, parallel_block_state(x, conn) if y is None else y), stacked)
    return x, (y if two_streams else None), list(xs), {k: jnp.sum(v, axis=0) for k, v in aux.items()}


def build_model(cfg: ModelConfig, seed: int = 0, exe: ExecutionConfig = ExecutionConfig()) -> Transformer:
    """A randomly initialised model (std 0.02 normal weights, unit norms), run as `exe` says."""
    return Transformer(cfg, nnx.Rngs(params=seed), exe)


def with_farskip(cfg: ModelConfig, **farskip: Any) -> ModelConfig:
    """The same model with other FarSkip settings, e.g. `with_farskip(cfg, enabled=True)`."""
    return dataclasses.replace(cfg, farskip=dataclasses.replace(cfg.farskip, **farskip))
