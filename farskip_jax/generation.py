"""Autoregressive generation: one prefill of the prompts, then one decode step per new token, over
per-layer caches (MLA latents `LatentCache`, GQA keys and values `KVCache`), greedy or sampled
(temperature, top-p).

Prompts are int32 rows right-padded with -1, so prompts of different lengths share a batch: each
row's cache slots and positions are its own, and a row's padding is never attended to. Rows stop
at an EOS id; the batch stops when every row has. FarSkip runs at decode exactly as in training
and prefill (`residual_step`): the y stream goes from layer to layer within each step.

    gen = Generator(model)                       # or Generator(model, mesh=make_mesh(tensor=8))
    out = gen.generate(prompt_ids, max_new_tokens=64, eos_ids=[100001])  # [B, P + 64], -1 padded
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from farskip_jax.config import ModelConfig
from farskip_jax.model.layers import DTYPES
from farskip_jax.model.transformer import AttentionCache, Transformer, empty_cache

PAD = -1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax); otherwise softmax(logits / temperature) restricted to the
    smallest set of tokens whose probability reaches `top_p`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def pick(logits_bv: jax.Array, temperature: float, top_p: float, key: jax.Array) -> jax.Array:
    """The next token of every row [B] int32 from float32 logits [B, V] (see `Sampling`)."""
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled = logits_bv / temperature
    if top_p < 1:
        probs = jax.nn.softmax(scaled, axis=-1)
        order = jnp.argsort(-probs, axis=-1)
        sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the more likely tokens
        keep_sorted = before < top_p  # the most likely token is always kept
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def pad_prompts(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Token-id rows of different lengths as one int32 [B, max length] array, right-padded with PAD."""
    out = np.full((len(rows), max(map(len, rows))), PAD, np.int32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out


def prompt_lengths(prompts: np.ndarray) -> np.ndarray:
    """Tokens per row of a right-padded [B, P] prompt array; raises ValueError on an empty row or a
    token after padding."""
    if prompts.ndim != 2 or prompts.size == 0:
        raise ValueError(f"prompts must be a non-empty [batch, length] array, got {list(prompts.shape)}")
    real = prompts != PAD
    lengths = real.sum(axis=1)
    for b in range(prompts.shape[0]):
        if lengths[b] == 0:
            raise ValueError(f"prompt row {b} is empty (all {PAD})")
        if not real[b, : lengths[b]].all():
            raise ValueError(f"prompt row {b}: a token follows padding ({PAD}); pad rows on the right only")
    return lengths.astype(np.int32)


def tensor_parallel_mesh(cfg: ModelConfig, devices: Sequence[jax.Device]) -> jax.sharding.Mesh | None:
    """A TP mesh over as many of `devices` as split the model evenly (heads, experts, MLP widths):
    the layout that generates from a model too large for one device. None for a single device."""
    from farskip_jax.config import MeshConfig
    from farskip_jax.parallel import make_mesh

    n = max(t for t in range(1, len(devices) + 1) if not cfg.tensor_layout_errors(t))
    return None if n == 1 else make_mesh(MeshConfig(tensor=n), list(devices))


CACHE_BLOCK = 64


class Generator:
    """Compiled prefill and decode for one model (single device, or TP over `mesh`'s tensor axis).

    Under TP each rank's routed-expert rows are bounded (`execution.moe_buffer_factor`); a prefill or
    decode step whose routing overflows a rank's bound is run again by the worst-case program
    (compiled on its first use) on the caches it returned, which overwrites every slot the void
    step wrote, so generation is exactly dropless. `overflows` counts those re-runs.
    """

    def __init__(self, model: Transformer, mesh: jax.sharding.Mesh | None = None):
        self.cfg = model.cfg
        graphdef, state = nnx.split(model)
        self.cache_dtype = DTYPES[self.cfg.dtype]
        if mesh is None:
            def forward(prefill: bool, bounded: bool) -> Callable:
                return lambda s, ids, pos, caches: nnx.merge(graphdef, s).cached_forward(
                    ids, pos, caches, prefill=prefill)
        else:
            from farskip_jax.parallel import tp_cached_forward

            def forward(prefill: bool, bounded: bool) -> Callable:
                return tp_cached_forward(graphdef, state, mesh, prefill, bounded=bounded)
        self.mesh = mesh
        self.load(state)

        def logits(s, hidden_bd):
            return nnx.merge(graphdef, s).logits(hidden_bd)

        # `how` = (temperature, top_p): static, one compile per sampling rule (the seed is data).
        def prefill(bounded, s, ids, lengths, caches, key, how):
            pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
            hidden, caches, overflow = forward(True, bounded)(s, ids, pos, caches)
            last = hidden[jnp.arange(ids.shape[0]), lengths - 1]
            return pick(logits(s, last), *how, key), caches, overflow

        def decode(bounded, s, tokens, positions, caches, key, how):
            hidden, caches, overflow = forward(False, bounded)(s, tokens[:, None], positions[:, None], caches)
            return pick(logits(s, hidden[:, 0]), *how, key), caches, overflow

        self._steps = {(name, bounded): jax.jit(functools.partial(fn, bounded), static_argnums=5,
                                                donate_argnums=3)
                       for name, fn in (("prefill", prefill), ("decode", decode))
                       for bounded in (True, False)}
        self.overflows = 0

    def _run(self, name: str, s: nnx.State, ids: jax.Array, aux: jax.Array, caches: tuple, key: jax.Array,
             how: tuple[float, float]) -> tuple[jax.Array, tuple]:
        """One prefill or decode step (bounded buffers; re-run by the worst-case program on an overflow)."""
        tokens, caches, overflow = self._steps[(name, True)](s, ids, aux, caches, key, how)
        if int(overflow):
            self.overflows += 1
            tokens, caches, _ = self._steps[(name, False)](s, ids, aux, caches, key, how)
        return tokens, caches

    def load(self, state: nnx.State) -> None:
        """Generate with these parameters from now on (same model graph; nothing recompiles). With a
        mesh they are moved into its TP layout, from wherever they are (e.g. a training layout)."""
        if self.mesh is None:
            self.state = state
        else:
            from farskip_jax.parallel import place

            self.state = place(state, self.mesh, "tp")

    def empty_caches(self, batch: int, slots: int) -> tuple[AttentionCache, ...]:
        tensor = 1 if self.mesh is None else self.mesh.shape["tensor"]
        return tuple(empty_cache(self.cfg, batch, slots, self.cache_dtype, tensor)
                     for _ in range(self.cfg.num_layers))

    def generate(self, prompts: np.ndarray, max_new_tokens: int, *, eos_ids: Sequence[int] = (),
                 sampling: Sampling = Sampling(),
                 on_step: Callable[[np.ndarray, np.ndarray], None] | None = None) -> np.ndarray:
        """int32 [B, P + max_new_tokens]: each row its prompt without padding, then its new tokens
        (up to and including its first EOS), right-padded with -1. `on_step(tokens [B], live [B])`
        is called with each step's tokens (live: the row had not stopped before this token)."""
        prompts = np.asarray(prompts)
        if prompts.dtype.kind not in "iu":
            raise ValueError(f"prompts must be integer token ids, got dtype {prompts.dtype}")
        lengths = prompt_lengths(prompts)
        vocab = self.cfg.vocab_size
        if prompts.max() >= vocab or prompts[prompts != PAD].min() < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab}) (or {PAD} for padding)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch, width = prompts.shape
        # Rounded up to whole 64-slot blocks, the MLA decode kernel's (model/mla_decode.py): slots
        # past a row's position are never attended to, and the kernel does not read them.
        caches = self.empty_caches(batch, -(-(width + max_new_tokens) // CACHE_BLOCK) * CACHE_BLOCK)
        key = jax.random.key(sampling.seed)
        how = (float(sampling.temperature), float(sampling.top_p))
        ids = jnp.asarray(np.where(prompts == PAD, 0, prompts), jnp.int32)
        tokens, caches = self._run("prefill", self.state, ids, jnp.asarray(lengths), caches,
                                   jax.random.fold_in(key, 0), how)
        new = np.full((batch, max_new_tokens), PAD, np.int32)
        live = np.ones(batch, bool)
        eos = np.asarray(list(eos_ids), np.int32)
        for step in range(max_new_tokens):
            host = np.asarray(tokens)
            new[live, step] = host[live]
            if on_step is not None:
                on_step(host, live.copy())
            live &= ~np.isin(host, eos)
            if not live.any() or step + 1 == max_new_tokens:
                break
            positions = jnp.asarray(lengths + step, jnp.int32)
            tokens, caches = self._run("decode", self.state, tokens, positions, caches,
                                       jax.random.fold_in(key, step + 1), how)
        out = np.full((batch, width + max_new_tokens), PAD, np.int32)
        for b in range(batch):
            row = np.concatenate([prompts[b, : lengths[b]], new[b][new[b] != PAD]])
            out[b, : row.size] = row
        return out
