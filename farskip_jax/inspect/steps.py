"""The real steps the inspector compiles: the trainer's jitted train step, TP prefill and TP decode.

`build_step(cfg, ...)` returns the `build_step(mesh, mode)` callback that `cli.run_inspect`
wants, where mode is "farskip" or "regular" (the same model and parameters, connectivity on or
off) or, for `--compare four`, one of those at a given batch split. Each mode's run is
`config_for(cfg, mode)`, which changes one section of the config only: `model.farskip` for the
connectivity, `execution.batch_split` for the split, so that a comparison states what it changes.
Arguments are abstract (`jax.ShapeDtypeStruct` with shardings): nothing is allocated, so a
DeepSeek-V2-Lite step compiles for 8 GPUs on a laptop.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from farskip_jax.config import Config, ExecutionConfig, ModelConfig
from farskip_jax.model.transformer import Transformer, with_farskip
from farskip_jax.parallel import param_specs_tree, replicate_kv_heads, tp_forward

_SPLIT_MODE = re.compile(r"^(farskip|regular)_bs([1-9][0-9]*)$")


def config_for(cfg: Config, mode: str) -> Config:
    """The run a mode compiles. 'farskip' / 'regular': `cfg` with FarSkip on / off, which changes
    `model.farskip.enabled` and nothing else (the execution section, its batch split included, is
    the config's own); 'farskip_bsN' / 'regular_bsN' (``--compare four``: regular_bs1 is the paper's
    baseline, one stream and regular connectivity) also set `execution.batch_split` to N, which
    changes nothing in the model."""
    m = _SPLIT_MODE.match(mode)
    if m:
        run = config_for(cfg, m.group(1))
        split = dataclasses.replace(run.execution, batch_split=int(m.group(2)))
        return dataclasses.replace(run, execution=split)
    if mode == "regular":
        return dataclasses.replace(cfg, model=with_farskip(cfg.model, enabled=False))
    if mode == "farskip":
        return cfg if cfg.model.farskip.enabled else dataclasses.replace(cfg, model=with_farskip(cfg.model,
                                                                                               enabled=True))
    raise ValueError(f"mode {mode!r}: expected 'farskip', 'regular', 'farskip_bsN' or 'regular_bsN'")


def four_modes(cfg: Config) -> list[str]:
    """``--compare four``: the paper's baseline (regular, one stream), regular + batch split,
    FarSkip, FarSkip + batch split; the split is the config's own (`execution.batch_split`) when it
    splits, else 2."""
    split = cfg.execution.batch_split
    n = split if split > 1 else 2
    return ["regular_bs1", f"regular_bs{n}", "farskip_bs1", f"farskip_bs{n}"]


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _abstract_model(mcfg: ModelConfig, exe: ExecutionConfig) -> tuple[nnx.GraphDef, nnx.State]:
    model = nnx.eval_shape(lambda: Transformer(mcfg, nnx.Rngs(0), exe))
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, state


def build_train_step(cfg: Config, seqs_per_device: int, seq_len: int
                     ) -> Callable[[Mesh, str], tuple[Any, Sequence[Any]]]:
    """The trainer's step (forward + backward + AdamW update, ZeRO-1, expert parallel) with the `lm`
    loss, student only, so that the report shows the student's own collectives; FCSD adds a teacher
    forward (`build_fcsd_step`). It is the step train.py runs in `lm` mode, with the trainer's
    layouts for every output, so the updated experts and their moments stay split over `expert`.
    """
    lm = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mode="lm"))
    return build_fcsd_step(lm, seqs_per_device, seq_len)


def build_fcsd_step(cfg: Config, seqs_per_device: int, seq_len: int
                    ) -> Callable[[Mesh, str], tuple[Any, Sequence[Any]]]:
    """Exactly the step train.py runs for ``cfg`` (``train.program.abstract_train_step``): FCSD with
    the frozen regular teacher's forward when ``train.mode`` is fcsd (or its top-k cache), the
    optimizer and ZeRO-1 layouts of the trainer, ``train.grad_accum_steps`` micro-batches.

    The mode switches only the student's connectivity ('regular' = the same config with FarSkip
    off; `config_for`); the teacher is regular either way. Its collectives are reported apart when
    the step traces the teacher inside ``jax.named_scope("teacher")``.
    """
    from farskip_jax.train import remat
    from farskip_jax.train.program import abstract_train_step, searches_teacher_layout

    def build(mesh: Mesh, mode: str):
        run = config_for(cfg, mode)
        ep = mesh.shape.get("expert", 1) > 1
        search_teacher = searches_teacher_layout(run, ep)
        if run.execution.remat == "auto" or search_teacher:  # compiled until one fits (cli.run_inspect)
            return remat.Search(remat.candidates(run.execution.remat, ep),
                                lambda c: abstract_train_step(remat.with_remat(run, c), mesh, seqs_per_device,
                                                              seq_len), run.execution, search_teacher)
        return abstract_train_step(run, mesh, seqs_per_device, seq_len)

    return build



def build_prefill_step(cfg: Config, batch: int, seq_len: int
                       ) -> Callable[[Mesh, str], tuple[Any, Sequence[Any]]]:
    """Inference prefill in the TP layout (activations replicated, heads and experts split)."""

    def build(mesh: Mesh, mode: str):
        run = config_for(cfg, mode)
        mcfg = run.model
        graphdef, params = _abstract_model(mcfg, run.execution)
        params = replicate_kv_heads(params, mesh.shape["tensor"])
        specs = param_specs_tree(params, "tp")
        p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        fwd = tp_forward(graphdef, params, mesh)
        replicated = NamedSharding(mesh, P())
        ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=replicated)
        # logits and the overflow flag (what generation reads to decide on a re-run)
        return jax.jit(lambda s, i: fwd(s, i)[::2]), (_abstract(params, p_shard), ids)

    return build


def build_decode_step(cfg: Config, batch: int, cache_len: int
                      ) -> Callable[[Mesh, str], tuple[Any, Sequence[Any]]]:
    """One decode step in the TP layout: `batch` sequences each add one token against a cache of
    `cache_len` tokens (MLA: the absorbed attention over the latent cache, replicated; GQA: the
    key/value cache, split with its heads), then the next token's logits. The caches are donated,
    as the generator does, so they are updated in place."""
    from farskip_jax.model.layers import DTYPES
    from farskip_jax.model.transformer import empty_cache
    from farskip_jax.parallel import tp_cached_forward

    def build(mesh: Mesh, mode: str):
        run = config_for(cfg, mode)
        mcfg = run.model
        graphdef, params = _abstract_model(mcfg, run.execution)
        params = replicate_kv_heads(params, mesh.shape["tensor"])
        specs = param_specs_tree(params, "tp")
        p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
        fwd = tp_cached_forward(graphdef, params, mesh, prefill=False)
        replicated = NamedSharding(mesh, P())
        cache_spec = P(None, None, "tensor") if mcfg.attention_kind == "gqa" else P()
        cache = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, cache_spec)),
            jax.eval_shape(lambda: empty_cache(mcfg, batch, cache_len, DTYPES[mcfg.dtype],
                                               mesh.shape["tensor"])))
        caches = tuple(cache for _ in range(mcfg.num_layers))
        column = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=replicated)

        def step(state, tokens, positions, caches):
            hidden, caches, overflow = fwd(state, tokens, positions, caches)
            return nnx.merge(graphdef, state).logits(hidden[:, 0]), caches, overflow

        return jax.jit(step, donate_argnums=3), (_abstract(params, p_shard), column, column, caches)

    return build

